"""
CuPy host side of the CUDA C kernels in kernels/cuda/*.cu.

  sgemm.cu      float32 GEMM (NN/NT/TN/TT, batched, any shape; fused bias / GELU
                epilogues, beta=1 accumulate)
  wmma_gemm.cu  bf16/fp16 tensor-core GEMM (WMMA) with float32 accumulation, and
                float32 <-> bf16 conversions
  fused.cu      layernorm fwd/bwd, GELU fwd/bwd, causal softmax fwd/bwd, softmax
                cross-entropy fwd+bwd, AdamW, SGD, column sums, sum of squares; RMSNorm,
                RoPE, SwiGLU fwd/bwd (the Llama family)

This module is the "cuda" backend, the production GPU path: it implements every op of
the table in kernels/ops.py, each as a function of the op's name taking the table's
arguments; kernels.cuda.register() registers it. The other public functions (sgemm,
gemm_bf16, gemm_tc, to_bf16, from_bf16) are the GEMM building blocks, for the tests
and benchmarks/gemm.py.
Inputs arrive validated (dtypes, shapes, contiguity) except matmul's and
linear_forward's x and w, which may be strided views (kernels.matmul promises that).
precision="bf16" (float32 operands) runs the GEMM on tensor cores (gemm_bf16).

Importing this module imports cupy. Sources are compiled on first use with
cupy.RawModule (NVRTC, `-std=c++17`), falling back to CuPy's nvcc backend if NVRTC
fails (e.g. cannot find <mma.h>), and cached per process (and by CuPy on disk).

Kernel arguments are always passed as explicit numpy scalars of the C parameter's
width (np.int32 for int, np.int64 for long long, np.float32 / np.float64) and null
pointers as np.uint64(0): CuPy would turn a bare Python int into a 64-bit value, which
silently shifts every later argument of a kernel that takes `int`.

float64 GEMMs go to cuBLAS (cupy.matmul): the hand-written GEMMs are float32 and
16-bit only. The fused kernels have float32 and float64 versions.
"""

import glob
import math
import os
import sys
from functools import lru_cache

import cupy
import numpy as np

from ringpipe.kernels import reference as _ref

_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("sgemm.cu", "fused.cu", "wmma_gemm.cu")
# a kernel per source, looked up right after loading so compile errors surface at load
_PROBE = {"sgemm.cu": "sgemm_nn", "fused.cu": "gelu_forward_f32", "wmma_gemm.cu": "f32_to_bf16"}

_NULL = np.uint64(0)
SGEMM_TILE = 128  # BM = BN in sgemm.cu
WMMA_TILE = 128  # BM = BN in wmma_gemm.cu
GEMM_THREADS = 256
ROW_BLOCK_MAX = 256  # threads per row for layernorm / softmax (not tuned)
CE_BLOCK_MAX = 512  # cross-entropy rows are long (vocabulary)
ELT_BLOCK = 256
ELT_GRID_MAX = 8192  # grid-stride elementwise kernels
COL_BLOCK = 128
ROWS_PER_CHUNK = 64  # rows per partial sum in column reductions (fixed: reproducible)
_GRID_YZ_MAX = 65535


# ---------------------------------------------------------------------------
# loading


def _include_dirs():
    """Directories holding the CUDA headers the sources include (<mma.h>, <cuda_bf16.h>).
    NVRTC ships some headers built in, but not all on every version; CuPy adds the
    toolkit's include dir only when it finds a toolkit. Pip-installed CUDA (the
    nvidia-* wheels) keeps headers under site-packages/nvidia/.../include."""
    cands = []
    try:
        p = cupy.cuda.get_cuda_path()
        if p:
            cands.append(os.path.join(p, "include"))
    except Exception:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "include"))
    cands.append("/usr/local/cuda/include")
    for sp in sys.path:
        if sp.endswith("site-packages"):
            cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "include")))
    out = []
    for d in cands:
        if d not in out and os.path.isfile(os.path.join(d, "mma.h")):
            out.append(d)
    return out[:1]  # one toolkit's headers, not a mix of versions


@lru_cache(maxsize=None)
def module(name):
    """cupy.RawModule of kernels/cuda/<name>, compiled (NVRTC, else nvcc)."""
    with open(os.path.join(_DIR, name)) as f:
        code = f.read()
    opts = ("-std=c++17",) + tuple(f"-I{d}" for d in _include_dirs())
    errors = []
    for backend in ("nvrtc", "nvcc"):
        try:
            mod = cupy.RawModule(code=code, options=opts, backend=backend)
            mod.get_function(_PROBE[name])  # forces the compile
            return mod
        except Exception as exc:  # CompileException, or nvcc missing
            errors.append(f"--- {backend}: {type(exc).__name__}: {exc}")
    raise RuntimeError(f"kernels/cuda/{name} failed to compile with options {opts}:\n" + "\n".join(errors))


@lru_cache(maxsize=None)
def _fn(source, name):
    return module(source).get_function(name)


def _suffix(dtype):
    dt = np.dtype(dtype)
    if dt == np.float32:
        return "f32"
    if dt == np.float64:
        return "f64"
    raise TypeError(f"kernels/cuda: no kernel for dtype {dt}")


def _fused(name, dtype):
    return _fn("fused.cu", f"{name}_{_suffix(dtype)}")


def _ceil_div(a, b):
    return -(-a // b)


def _pow2_block(n, cap):
    b = 32
    while b < n and b < cap:
        b *= 2
    return b


def _elt_grid(n):
    return max(1, min(_ceil_div(n, ELT_BLOCK), ELT_GRID_MAX))


# ---------------------------------------------------------------------------
# GEMM


def _gemm_operand(x, trans):
    """(array whose last two dims are C-contiguous, trans flag): a transposed view
    (e.g. W.T) is handed over as its contiguous base with the flag flipped, no copy."""
    if x.flags.c_contiguous:
        return x, trans
    xt = x.swapaxes(-1, -2)
    if xt.flags.c_contiguous:
        return xt, not trans
    return cupy.ascontiguousarray(x), trans


def _batch_operand(x, xbatch, batch, nb):
    """(x as (nbx, r, c), element stride between batch entries): batch 1 broadcasts
    with stride 0, a partial broadcast is materialized."""
    mat = tuple(x.shape[-2:])
    nx = int(np.prod(xbatch, dtype=np.int64)) if xbatch else 1
    if nx == 1:
        return x.reshape((1,) + mat), 0
    if tuple(xbatch) != tuple(batch):
        x = cupy.ascontiguousarray(cupy.broadcast_to(x, tuple(batch) + mat))
    return x.reshape((nb,) + mat), mat[0] * mat[1]


def _aligned(x, elems):
    # 16-byte vector access is safe when the base pointer is 16-byte aligned and every
    # row starts a multiple of the vector width further on
    return x.data.ptr % 16 == 0 and elems % (16 // x.itemsize) == 0


def _check_grid(op, gy, gz):
    if gy > _GRID_YZ_MAX or gz > _GRID_YZ_MAX:
        raise ValueError(f"kernels/cuda.{op}: grid ({gy} row tiles, {gz} batches) exceeds {_GRID_YZ_MAX}")


def _gemm_geometry(label, a, b, trans_a, trans_b, accumulate, out):
    """Shapes of op(a) @ op(b) batched like matmul: (M, N, K, nb, a3, s_a, b3, s_b, shape),
    a3/b3 the operands as (nb, rows, cols) with their batch strides. `label`
    prefixes the error messages."""
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    Kb, N = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if K != Kb:
        raise ValueError(f"{label}: inner dims differ ({K} vs {Kb})")
    batch = tuple(np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
    nb = int(np.prod(batch, dtype=np.int64)) if batch else 1
    a3, s_a = _batch_operand(a, a.shape[:-2], batch, nb)
    b3, s_b = _batch_operand(b, b.shape[:-2], batch, nb)
    if accumulate and out is None:
        raise ValueError(f"{label}: accumulate=True needs out")
    return M, N, K, nb, a3, s_a, b3, s_b, batch + (M, N)


def sgemm(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, bias=None, gelu=False, pre=None,
          alpha=1.0):
    """float32 out (+)= alpha * op(a) @ op(b) [+ bias] [-> pre] [-> gelu], batched over
    leading dims (broadcast like matmul). bias (N,) is added per column; pre, if
    given, receives the pre-activation (same shape as out, C-contiguous)."""
    a, trans_a = _gemm_operand(a, trans_a)
    b, trans_b = _gemm_operand(b, trans_b)
    for name, x in (("a", a), ("b", b), ("out", out), ("bias", bias), ("pre", pre)):
        if x is not None and x.dtype != np.float32:
            raise TypeError(f"kernels/cuda.sgemm: {name} must be float32, got {x.dtype}")
    M, N, K, nb, a3, s_a, b3, s_b, shape = _gemm_geometry("kernels/cuda.sgemm", a, b, trans_a, trans_b,
                                                          accumulate, out)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"kernels/cuda.sgemm: out has shape {tuple(out.shape)}, expected {shape}")
    if out is not None and not out.flags.c_contiguous:
        # a strided out (e.g. a slice): compute into a temporary, then write through
        tmp = cupy.empty(shape, dtype=np.float32)
        if accumulate:
            tmp[...] = out
        sgemm(a, b, tmp, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, bias=bias, gelu=gelu, pre=pre,
              alpha=alpha)
        out[...] = tmp
        return out
    if out is None:
        out = cupy.empty(shape, dtype=np.float32)
    if pre is not None and (tuple(pre.shape) != shape or not pre.flags.c_contiguous):
        raise ValueError(f"kernels/cuda.sgemm: pre must be C-contiguous with shape {shape}")
    if bias is not None and (tuple(bias.shape) != (N,) or not bias.flags.c_contiguous):
        raise ValueError(f"kernels/cuda.sgemm: bias must be C-contiguous with shape ({N},)")
    if M == 0 or N == 0 or nb == 0:
        return out
    epi = (1 if bias is not None else 0) | (2 if gelu else 0)
    vec_a = _aligned(a3, M if trans_a else K)
    vec_b = _aligned(b3, K if trans_b else N)
    vec_c = _aligned(out, N) and (pre is None or _aligned(pre, N))
    grid = (_ceil_div(N, SGEMM_TILE), _ceil_div(M, SGEMM_TILE), nb)
    _check_grid("sgemm", grid[1], grid[2])
    kern = _fn("sgemm.cu", "sgemm_" + ("t" if trans_a else "n") + ("t" if trans_b else "n"))
    kern(grid, (GEMM_THREADS,), (
        a3, b3, out, np.int32(M), np.int32(N), np.int32(K),
        np.int64(s_a), np.int64(s_b), np.int64(M * N),
        np.float32(alpha), np.float32(1.0 if accumulate else 0.0),
        bias if bias is not None else _NULL, pre if pre is not None else _NULL,
        np.int32(epi), np.int32(vec_a), np.int32(vec_b), np.int32(vec_c)))
    return out


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32"):
    """kernels.matmul for cupy arrays: float32 through sgemm.cu, float64 through cuBLAS,
    precision="bf16" (float32 operands) through the tensor-core GEMM."""
    if precision == "bf16":
        return gemm_bf16(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    if a.dtype == np.float32:
        return sgemm(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    return _ref.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)


def linear_forward(x, w, bias=None, *, gelu=False, precision="float32"):
    """kernels.linear_forward for cupy arrays: x (N, C_in), w (C_out, C_in) ->
    (y, pre) with y = x @ w.T (+ bias) (then GELU, pre the pre-activation). float32
    runs the bias and GELU in sgemm's epilogue; float64 (cuBLAS) and bf16 (the
    tensor-core GEMM has no epilogues) run them as separate kernels."""
    if x.dtype == np.float32 and precision == "float32":
        pre = cupy.empty((x.shape[0], w.shape[0]), dtype=np.float32) if gelu else None
        return sgemm(x, w, trans_b=True, bias=bias, gelu=gelu, pre=pre), pre
    y = matmul(x, w, trans_b=True, precision=precision)
    return _ref.bias_gelu(y, bias, gelu, gelu_forward)


# ---------------------------------------------------------------------------
# tensor-core GEMM (bf16 / fp16 in, float32 out)


def to_bf16(x):
    """float32 cupy array -> uint16 array of bfloat16 bits (round to nearest even)."""
    x = cupy.ascontiguousarray(x, dtype=np.float32)
    y = cupy.empty(x.shape, dtype=np.uint16)
    if x.size:
        _fn("wmma_gemm.cu", "f32_to_bf16")((_elt_grid(x.size),), (ELT_BLOCK,), (x, y, np.int64(x.size)))
    return y


def from_bf16(x):
    """uint16 bfloat16 bits -> float32."""
    x = cupy.ascontiguousarray(x)
    if x.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bfloat16 bits, got {x.dtype}")
    y = cupy.empty(x.shape, dtype=np.float32)
    if x.size:
        _fn("wmma_gemm.cu", "bf16_to_f32")((_elt_grid(x.size),), (ELT_BLOCK,), (x, y, np.int64(x.size)))
    return y


def gemm_bf16(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False):
    """float32 out (+)= op(a) @ op(b) for float32 a, b rounded to bf16 (nearest even):
    tensor cores, float32 accumulation. What kernels.matmul(precision="bf16") runs."""
    for name, x in (("a", a), ("b", b), ("out", out)):
        if x is not None and x.dtype != np.float32:
            raise TypeError(f"kernels/cuda.gemm_bf16: {name} must be float32, got {x.dtype}")
    # convert the contiguous base of a transposed view (W.T), not a transposed copy
    a, trans_a = _gemm_operand(a, trans_a)
    b, trans_b = _gemm_operand(b, trans_b)
    if out is not None and not out.flags.c_contiguous:
        # gemm_tc writes only contiguous outputs: go through a temporary, as sgemm does
        tmp = cupy.empty(out.shape, dtype=np.float32)
        if accumulate:
            tmp[...] = out
        gemm_bf16(a, b, tmp, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
        out[...] = tmp
        return out
    return gemm_tc(to_bf16(a), to_bf16(b), out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, kind="bf16")


def gemm_tc(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, kind=None):
    """float32 out (+)= op(a) @ op(b) on tensor cores. a, b: bf16 bits (uint16, from
    to_bf16) or float16 arrays; kind "bf16"/"f16" (default from the dtype). 2D or
    batched like sgemm. TT is not provided (transpose one operand first)."""
    if kind is None:
        kind = "f16" if a.dtype == np.float16 else "bf16"
    want = np.float16 if kind == "f16" else np.uint16
    if a.dtype != want or b.dtype != want:
        raise TypeError(f"gemm_tc({kind}): a and b must be {np.dtype(want)}, got {a.dtype} and {b.dtype}")
    a, trans_a = _gemm_operand(a, trans_a)
    b, trans_b = _gemm_operand(b, trans_b)
    if trans_a and trans_b:
        b, trans_b = cupy.ascontiguousarray(b.swapaxes(-1, -2)), False
    M, N, K, nb, a3, s_a, b3, s_b, shape = _gemm_geometry("gemm_tc", a, b, trans_a, trans_b, accumulate, out)
    if out is None:
        out = cupy.empty(shape, dtype=np.float32)
    if out.dtype != np.float32 or tuple(out.shape) != shape or not out.flags.c_contiguous:
        raise ValueError(f"gemm_tc: out must be C-contiguous float32 of shape {shape}")
    if M == 0 or N == 0 or nb == 0:
        return out
    grid = (_ceil_div(N, WMMA_TILE), _ceil_div(M, WMMA_TILE), nb)
    _check_grid("gemm_tc", grid[1], grid[2])
    kern = _fn("wmma_gemm.cu", f"wmma_gemm_{kind}_" + ("t" if trans_a else "n") + ("t" if trans_b else "n"))
    kern(grid, (GEMM_THREADS,), (
        a3, b3, out, np.int32(M), np.int32(N), np.int32(K),
        np.int64(s_a), np.int64(s_b), np.int64(M * N),
        np.float32(1.0), np.float32(1.0 if accumulate else 0.0),
        np.int32(_aligned(a3, M if trans_a else K)), np.int32(_aligned(b3, K if trans_b else N))))
    return out


# ---------------------------------------------------------------------------
# layernorm


def layernorm_forward(x, weight, bias, eps=1e-5, out=None):
    N, C = x.shape
    if out is None:
        out = cupy.empty_like(x)
    mean = cupy.empty((N,), dtype=x.dtype)
    rstd = cupy.empty((N,), dtype=x.dtype)
    if N and C:
        _fused("layernorm_forward", x.dtype)((N,), (_pow2_block(C, ROW_BLOCK_MAX),), (
            x, weight, bias, out, mean, rstd, np.int32(C), np.float64(eps)))
    return out, mean, rstd


def _chunked_column_sums(N, C, dtype, partial_kernel, args, targets):
    """Launch a (C-tiles x row-chunks) partial kernel writing len(targets) float64
    (chunks, C) partials, then fold each into its target (C,) with +=."""
    chunks = max(1, _ceil_div(N, ROWS_PER_CHUNK))
    partials = [cupy.zeros((chunks, C), dtype=np.float64) for _ in targets]
    grid = (_ceil_div(C, COL_BLOCK), chunks)
    _check_grid("column sums", chunks, 1)
    partial_kernel(grid, (COL_BLOCK,), tuple(args) + tuple(partials) + (np.int32(N), np.int32(C),
                                                                          np.int32(ROWS_PER_CHUNK)))
    fin = _fused("column_sum_finish", dtype)
    for p, (target, acc) in zip(partials, targets):
        fin((_ceil_div(C, COL_BLOCK),), (COL_BLOCK,), (p, np.int32(chunks), np.int32(C), target, np.int32(acc)))


def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None):
    N, C = x.shape
    if dx is None:
        dx = cupy.empty_like(x)
    if N and C:
        _fused("layernorm_backward_dx", x.dtype)((N,), (_pow2_block(C, ROW_BLOCK_MAX),), (
            dout, x, weight, mean, rstd, dx, np.int32(C)))
    if C and (dweight is not None or dbias is not None):
        # partials for both always (one pass over dout and x); fold only the wanted ones
        pw_target = dweight if dweight is not None else cupy.zeros((C,), dtype=x.dtype)
        pb_target = dbias if dbias is not None else cupy.zeros((C,), dtype=x.dtype)
        if N:
            _chunked_column_sums(N, C, x.dtype, _fused("layernorm_backward_params_partial", x.dtype),
                                 (dout, x, mean, rstd), [(pw_target, 1), (pb_target, 1)])
    return dx


def column_sum(x, out=None, *, accumulate=False):
    """out (C,) (+)= x (N, C).sum(axis=0), summed in float64: the bias gradient."""
    N, C = x.shape
    if accumulate and out is None:
        raise ValueError("column_sum: accumulate=True needs out")
    if out is None:
        out = cupy.empty((C,), dtype=x.dtype)
    if C:
        if N == 0:
            if not accumulate:
                out.fill(0)
            return out
        _chunked_column_sums(N, C, x.dtype, _fused("column_sum_partial", x.dtype), (cupy.ascontiguousarray(x),),
                             [(out, int(bool(accumulate)))])
    return out


# ---------------------------------------------------------------------------
# gelu


def gelu_forward(x, out=None):
    if out is None:
        out = cupy.empty_like(x)
    n = x.size
    if n:
        _fused("gelu_forward", x.dtype)((_elt_grid(n),), (ELT_BLOCK,), (x, out, np.int64(n)))
    return out


def gelu_backward(dout, x, dx=None):
    if dx is None:
        dx = cupy.empty_like(x)
    n = x.size
    if n:
        _fused("gelu_backward", x.dtype)((_elt_grid(n),), (ELT_BLOCK,), (dout, x, dx, np.int64(n)))
    return dx


# ---------------------------------------------------------------------------
# causal softmax


def softmax_causal_forward(scores, scale, out=None, *, bf16_out=None, window=0):
    # bf16_out: rounded afterwards (the GPU's GEMMs round float32 operands themselves)
    if out is None:
        out = cupy.empty_like(scores)
    T = scores.shape[-1]
    if scores.size:
        R = scores.size // T
        _fused("softmax_causal_forward", scores.dtype)((R,), (_pow2_block(T, ROW_BLOCK_MAX),), (
            scores, out, np.int32(T), np.float64(scale), np.int32(window)))
    if bf16_out is not None:
        _ref.write_bf16_bits(out, bf16_out)
    return out


def softmax_causal_backward(dprobs, probs, scale, out=None, *, bf16_out=None):
    if bf16_out is not None:
        return _ref.write_bf16_bits(softmax_causal_backward(dprobs, probs, scale), bf16_out)
    if out is None:
        out = cupy.empty_like(probs)
    T = probs.shape[-1]
    if probs.size:
        R = probs.size // T
        _fused("softmax_causal_backward", probs.dtype)((R,), (_pow2_block(T, ROW_BLOCK_MAX),), (
            dprobs, probs, out, np.int32(T), np.float64(scale)))
    return out


# ---------------------------------------------------------------------------
# cross-entropy


def cross_entropy_forward_backward(logits, targets, dlogits=None, grad_scale=1.0):
    """Out-of-range targets are not checked on the host (that would cost a device
    sync per step): the kernel writes NaN as their loss instead."""
    N, V = logits.shape
    losses = cupy.empty((N,), dtype=logits.dtype)
    t = cupy.ascontiguousarray(targets, dtype=np.int64)
    if N:
        _fused("cross_entropy", logits.dtype)((N,), (_pow2_block(V, CE_BLOCK_MAX),), (
            logits, t, losses, dlogits if dlogits is not None else _NULL, np.int32(V), np.float64(grad_scale)))
    return losses, dlogits


# ---------------------------------------------------------------------------
# optimizers and norms


_MASK_SUFFIX = {"uint8": "u8", "bool": "u8", "float32": "f32", "float64": "f64"}


def _mask(wd_mask):
    if wd_mask is None:
        return _NULL, "u8"
    if wd_mask.dtype == np.bool_:
        wd_mask = wd_mask.view(np.uint8)
    return wd_mask, _MASK_SUFFIX[str(wd_mask.dtype)]


def adamw_update(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None):
    mask, msuf = _mask(wd_mask)
    n = param.size
    if n:
        kern = _fn("fused.cu", f"adamw_{_suffix(param.dtype)}_{msuf}")
        kern((_elt_grid(n),), (ELT_BLOCK,), (
            param, grad, m, v, mask, np.int64(n), np.float64(lr), np.float64(beta1), np.float64(beta2),
            np.float64(eps), np.float64(weight_decay), np.float64(1.0 - beta1**step), np.float64(1.0 - beta2**step)))


def sgd_momentum_update(param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None):
    mask, msuf = _mask(wd_mask)
    n = param.size
    if n:
        kern = _fn("fused.cu", f"sgd_momentum_{_suffix(param.dtype)}_{msuf}")
        kern((_elt_grid(n),), (ELT_BLOCK,), (
            param, grad, buf, mask, np.int64(n), np.float64(lr), np.float64(momentum), np.float64(weight_decay)))


def sum_of_squares(x):
    """Python float (one device sync, like the reference's float())."""
    n = x.size
    if n == 0:
        return 0.0
    grid = min(_elt_grid(n), 1024)
    partial = cupy.empty((grid,), dtype=np.float64)
    _fused("sum_of_squares_partial", x.dtype)((grid,), (ELT_BLOCK,), (x, np.int64(n), partial))
    return float(math.fsum(cupy.asnumpy(partial).tolist()))


# ---------------------------------------------------------------------------
# Llama-family ops: RMSNorm, RoPE, SwiGLU


def rmsnorm_forward(x, w, eps=1e-5):
    C = x.shape[-1]
    N = x.size // C if C else 0
    y = cupy.empty_like(x)
    rstd = cupy.empty(x.shape[:-1], dtype=x.dtype)
    if N and C:
        _fused("rmsnorm_forward", x.dtype)((N,), (_pow2_block(C, ROW_BLOCK_MAX),), (
            x, w, y, rstd, np.int32(C), np.float64(eps)))
    return y, rstd


def rmsnorm_backward(dy, x, w, rstd):
    C = x.shape[-1]
    N = x.size // C if C else 0
    dx = cupy.empty_like(x)
    dw = cupy.zeros((C,), dtype=x.dtype)
    if N and C:
        _fused("rmsnorm_backward_dx", x.dtype)((N,), (_pow2_block(C, ROW_BLOCK_MAX),), (
            dy, x, w, rstd, dx, np.int32(C)))
        _chunked_column_sums(N, C, x.dtype, _fused("rmsnorm_backward_dw_partial", x.dtype), (dy, x, rstd),
                             [(dw, 0)])
    return dx, dw


def _rope(a, cos, sin, sign):
    B, T, H, hd = a.shape
    out = cupy.empty_like(a)
    pairs = a.size // 2
    if pairs:
        _fused("rope", a.dtype)((_elt_grid(pairs),), (ELT_BLOCK,), (
            a, cos, sin, out, np.int64(pairs), np.int32(T), np.int32(H), np.int32(hd), np.int32(sign)))
    return out


def rope_forward(x, cos, sin):
    return _rope(x, cos, sin, 1)


def rope_backward(dy, cos, sin):
    return _rope(dy, cos, sin, -1)


def swiglu_forward(gate, up):
    h = cupy.empty_like(gate)
    n = gate.size
    if n:
        _fused("swiglu_forward", gate.dtype)((_elt_grid(n),), (ELT_BLOCK,), (gate, up, h, np.int64(n)))
    return h


def swiglu_backward(dh, gate, up):
    dgate, dup = cupy.empty_like(gate), cupy.empty_like(gate)
    n = gate.size
    if n:
        _fused("swiglu_backward", gate.dtype)((_elt_grid(n),), (ELT_BLOCK,), (dh, gate, up, dgate, dup, np.int64(n)))
    return dgate, dup
