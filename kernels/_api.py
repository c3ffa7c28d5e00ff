"""The public ops of ringpipe.kernels: validation at the boundary, then dispatch.

kernels/__init__.py says what the ops are and how to add one, and re-exports every public name
defined here; this is a module of its own so that the package's __init__.py runs none of it when
Python finds kernels/ as a top-level `kernels` (ringpipe/_shadowing.py).
"""

import numpy as np

from .backend import _dispatch, get_array_module, is_gpu_array, resolve_matmul_precision
from .reference import round_to_bf16

_FLOAT_KINDS = ("float32", "float64")


class KernelDtypeError(TypeError, ValueError):
    """Wrong dtype for a kernel operand. Both a TypeError (what it is) and a ValueError
    (so callers validating configs with `except ValueError` catch it too)."""

# ---------------------------------------------------------------------------
# validation helpers: cheap metadata checks only (no reductions, no device syncs),
# so they run the same for numpy and cupy


def _array(op, name, a):
    if not (hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "ndim")):
        raise TypeError(f"kernels.{op}: {name} must be a numpy or cupy array, got {type(a).__name__} "
                        "(convert it with np.asarray)")


def _float_dtype(op, name, a):
    _array(op, name, a)
    if str(a.dtype) not in _FLOAT_KINDS:
        raise KernelDtypeError(f"kernels.{op}: {name} must be float32 or float64, got {a.dtype}")
    return a.dtype


def _same_dtype(op, dtype, **arrays):
    for name, a in arrays.items():
        if a is not None and a.dtype != dtype:
            raise KernelDtypeError(
                f"kernels.{op}: {name} has dtype {a.dtype}, expected {dtype} (all operands share one dtype)"
            )


def _shape(op, name, a, shape):
    if a is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"kernels.{op}: {name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


def _ndim(op, name, a, ndim):
    _array(op, name, a)
    if a.ndim != ndim:
        raise ValueError(f"kernels.{op}: {name} must be {ndim}D, got shape {tuple(a.shape)}")


def _out_ok(op, name, a):
    if a is not None and not a.flags.c_contiguous:
        raise ValueError(f"kernels.{op}: output {name} must be C-contiguous")
    if a is not None and not getattr(a.flags, "writeable", True):    # cupy arrays have no such flag
        raise ValueError(f"kernels.{op}: output {name} is read-only")


def _precision(op, precision, dtype):
    # the precision this GEMM runs at: the per-call one, else the module default
    p = resolve_matmul_precision(precision)
    if p == "bf16" and dtype != np.float32:
        where = "precision='bf16'" if precision is not None else "kernels.set_matmul_precision('bf16')"
        raise KernelDtypeError(
            f"kernels.{op}: bf16 precision needs float32 operands (float32 master weights, bf16 GEMM "
            f"inputs), got {dtype} (from {where})"
        )
    return p


def _is_bf16(a):
    # an operand already in bf16: uint16 bit patterns (to_bf16) or ml_dtypes.bfloat16
    return hasattr(a, "dtype") and (str(a.dtype) in ("uint16", "bfloat16"))


def _gemm_operands(op, precision, operands, **others):
    # One resolution for every GEMM (matmul, linear_forward): -> (its two operands, ready
    # for the backend, and the precision it runs at). operands: {name: array} of the two
    # GEMM inputs; others: the call's other arrays (out, bias), of the operands' dtype.
    (first, a), (second, b) = operands.items()
    if _is_bf16(a) or _is_bf16(b):
        _bf16_operands(op, operands, **others)
        a, b = _bf16_off_cpu(a, b, *others.values())
        return a, b, "bf16"
    dt = _float_dtype(op, first, a)
    _same_dtype(op, dt, **{second: b}, **others)
    return a, b, _precision(op, precision, dt)


def _bf16_operands(op, operands, **float32_ones):
    # GEMM operands of which one at least is already bf16: the others float32 or bf16,
    # the output (and bias) float32; the GEMM is a bf16 one whatever the precision says
    for name, a in operands.items():
        if not _is_bf16(a) and str(a.dtype) != "float32":
            raise KernelDtypeError(f"kernels.{op}: {name} has dtype {a.dtype}; beside a bf16 operand, "
                                   "operands are float32 (rounded to bf16) or bf16")
    _same_dtype(op, np.dtype(np.float32), **float32_ones)


def _bf16_off_cpu(a, b, *others):
    # the GPU backends take float32 operands: bf16 ones are widened (exactly) there
    if get_array_module(a, b, *others) is np:
        return a, b
    widen = lambda x: (x.view("uint16").astype("uint32") << 16).view("float32") if _is_bf16(x) else x  # noqa: E731
    return widen(a), widen(b)


def _c(a):
    # contiguous inputs pass through untouched
    if a is None or a.flags.c_contiguous:
        return a
    return get_array_module(a).ascontiguousarray(a)


# ---------------------------------------------------------------------------
# bf16 operands


def to_bf16(x, out=None):
    """float32 array -> a new C-contiguous uint16 array of its bfloat16 bit patterns
    (round to nearest, ties to even, as round_to_bf16). The GEMMs take it as an operand
    with no rounding pass: cast a weight once, use it in many GEMMs. out: a C-contiguous
    uint16 array of x's shape to write them into instead (e.g. rows of a larger one)."""
    _array("to_bf16", "x", x)
    if str(x.dtype) != "float32":
        raise KernelDtypeError(f"kernels.to_bf16: x must be float32, got {x.dtype}")
    if out is not None:
        _array("to_bf16", "out", out)
        if str(out.dtype) != "uint16" or tuple(out.shape) != tuple(x.shape) or not out.flags.c_contiguous:
            raise KernelDtypeError(f"kernels.to_bf16: out must be a C-contiguous uint16 array of shape "
                                   f"{tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    if is_gpu_array(x):
        bits = (round_to_bf16(x).view("uint32") >> 16).astype("uint16")
        if out is None:
            return bits
        out[...] = bits
        return out
    from . import bf16  # numba: loaded on first use

    return bf16.to_bf16(x, out)


def from_bf16(x):
    """bf16 bit patterns (uint16, or ml_dtypes.bfloat16) -> float32 of the same values."""
    _array("from_bf16", "x", x)
    if not _is_bf16(x):
        raise KernelDtypeError(f"kernels.from_bf16: x must hold bf16 (uint16 bit patterns), got {x.dtype}")
    return (x.view("uint16").astype("uint32") << 16).view("float32")


def bf16_gemm():
    """One line: which GEMM runs precision='bf16' on the CPU in this process, and why."""
    from . import bf16

    return bf16.describe()


def float32_gemm():
    """One line: which library runs float32 GEMMs on the CPU in this process (numpy's BLAS or
    oneDNN's sgemm, kernels/sgemm.py), and why; the choice is made on the first call."""
    from . import sgemm

    return sgemm.describe()


def float32_gemm_choice():
    """"blas" or "onednn": the library of this process's float32 CPU GEMMs (chosen on the first call)."""
    from . import sgemm

    return sgemm.choice()[0]


def use_float32_gemm(name, why="chosen by the caller"):
    """Run float32 CPU GEMMs with NAME ("blas" or "onednn") from now on: a job's ranks take one
    choice (the trainer gives each rank rank 0's), whatever each would have measured."""
    from . import sgemm

    sgemm.use(name, why)


# ---------------------------------------------------------------------------
# matmul


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision=None, backend=None):
    """C = op(a) @ op(b), op = transpose of the last two dims if trans_*.

    a (..., M, K) or (..., K, M) if trans_a; b (..., K, N) or (..., N, K) if trans_b;
    leading dims broadcast like xp.matmul. out (..., M, N) is overwritten, or added
    into if accumulate=True (then out is required). Strided inputs are fine here:
    BLAS takes transposed views without copies. precision: "float32" or "bf16"
    (float32 operands only), None for kernels.get_matmul_precision().
    """
    op = "matmul"
    _array(op, "a", a)
    _array(op, "b", b)
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"kernels.{op}: a and b must be at least 2D, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b, precision = _gemm_operands(op, precision, dict(a=a, b=b), out=out)
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    K2, N = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if K != K2:
        raise ValueError(
            f"kernels.{op}: inner dims differ: op(a) is (..., {M}, {K}), op(b) is (..., {K2}, {N}) "
            f"(trans_a={trans_a}, trans_b={trans_b})"
        )
    if accumulate and out is None:
        raise ValueError(f"kernels.{op}: accumulate=True needs out")
    try:
        batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        raise ValueError(
            f"kernels.{op}: batch dims of {tuple(a.shape)} and {tuple(b.shape)} do not broadcast"
        ) from None
    # checked here because `out += r` would silently broadcast a smaller result
    _shape(op, "out", out, batch + (M, N))
    impl = _dispatch(op, (a, b, out), backend)
    return impl(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, precision=precision)


def matmul_nt(a, b, out=None, **kw):
    """a @ b.T (e.g. x @ W.T with W stored (out_features, in_features))."""
    return matmul(a, b, out, trans_b=True, **kw)


def matmul_tn(a, b, out=None, **kw):
    """a.T @ b (e.g. dW = dy.T @ x)."""
    return matmul(a, b, out, trans_a=True, **kw)


# ---------------------------------------------------------------------------
# Linear layer pieces


def linear_forward(x, w, bias=None, *, gelu=False, precision=None, backend=None):
    """A Linear layer's forward, w stored (out_features, in_features):

    x (N, C_in), w (C_out, C_in), bias (C_out,) or None -> (y (N, C_out), pre)
    y = x @ w.T (+ bias), then GELU (tanh approximation) if gelu; pre is the
    pre-activation (what gelu_backward needs) if gelu, else None. Both are new arrays.
    On the GPU (float32) bias and GELU are fused into the GEMM's epilogue.
    precision as for matmul.
    """
    op = "linear_forward"
    _ndim(op, "x", x, 2)
    _ndim(op, "w", w, 2)
    N, C_in = x.shape
    C_out = w.shape[0]
    x, w, precision = _gemm_operands(op, precision, dict(x=x, w=w), bias=bias)
    if w.shape[1] != C_in:
        raise ValueError(f"kernels.{op}: w has shape {tuple(w.shape)}, expected ({C_out}, {C_in}): "
                         f"stored (out_features, in_features), in_features = x.shape[1]")
    _shape(op, "bias", bias, (C_out,))
    impl = _dispatch(op, (x, w, bias), backend)
    # x and w may be strided, as for matmul; the bias is read by the fused epilogue
    return impl(x, w, _c(bias), gelu=gelu, precision=precision)


def column_sum(x, out=None, *, accumulate=False, backend=None):
    """x (N, C) -> (C,) column sums (a bias gradient). out is overwritten, or added into
    if accumulate=True (then out is required); a new array if out is None."""
    op = "column_sum"
    _ndim(op, "x", x, 2)
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, out=out)
    _shape(op, "out", out, (x.shape[1],))
    _out_ok(op, "out", out)
    if accumulate and out is None:
        raise ValueError(f"kernels.{op}: accumulate=True needs out")
    impl = _dispatch(op, (x, out), backend)
    return impl(_c(x), out, accumulate=accumulate)


# ---------------------------------------------------------------------------
# layernorm


def layernorm_forward(x, weight, bias, eps=1e-5, out=None, *, backend=None):
    """x (N, C), weight/bias (C,) -> (out (N, C), mean (N,), rstd (N,)), all in x's dtype."""
    op = "layernorm_forward"
    _ndim(op, "x", x, 2)
    N, C = x.shape
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, weight=weight, bias=bias, out=out)
    _shape(op, "weight", weight, (C,))
    _shape(op, "bias", bias, (C,))
    _shape(op, "out", out, (N, C))
    _out_ok(op, "out", out)
    impl = _dispatch(op, (x, weight, bias, out), backend)
    return impl(_c(x), _c(weight), _c(bias), eps, out)


def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None, *, backend=None):
    """dx (N, C) is overwritten (allocated if None) and returned; dweight, dbias (C,) are
    accumulated into (+=) if given, skipped if None."""
    op = "layernorm_backward"
    _ndim(op, "x", x, 2)
    N, C = x.shape
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, dout=dout, weight=weight, mean=mean, rstd=rstd, dx=dx, dweight=dweight, dbias=dbias)
    for name, a in (("dout", dout), ("dx", dx)):
        _shape(op, name, a, (N, C))
    for name, a in (("weight", weight), ("dweight", dweight), ("dbias", dbias)):
        _shape(op, name, a, (C,))
    for name, a in (("mean", mean), ("rstd", rstd)):
        _shape(op, name, a, (N,))
    for name, a in (("dx", dx), ("dweight", dweight), ("dbias", dbias)):
        _out_ok(op, name, a)
    impl = _dispatch(op, (dout, x, weight, mean, rstd, dx, dweight, dbias), backend)
    return impl(_c(dout), _c(x), _c(weight), _c(mean), _c(rstd), dx, dweight, dbias)


# ---------------------------------------------------------------------------
# gelu


def gelu_forward(x, out=None, *, backend=None):
    """GELU, tanh approximation, elementwise on any shape."""
    op = "gelu_forward"
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, out=out)
    _shape(op, "out", out, x.shape)
    _out_ok(op, "out", out)
    impl = _dispatch(op, (x, out), backend)
    return impl(_c(x), out)


def gelu_backward(dout, x, dx=None, *, backend=None):
    """dx = gelu'(x) * dout, any shape; dx overwritten (may alias dout)."""
    op = "gelu_backward"
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, dout=dout, dx=dx)
    _shape(op, "dout", dout, x.shape)
    _shape(op, "dx", dx, x.shape)
    _out_ok(op, "dx", dx)
    impl = _dispatch(op, (dout, x, dx), backend)
    return impl(_c(dout), _c(x), dx)


# ---------------------------------------------------------------------------
# causal softmax


def _check_square(op, name, a):
    _array(op, name, a)
    if a.ndim < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"kernels.{op}: {name} must be (..., T, T), got shape {tuple(a.shape)}")


def _check_bf16_out(op, bf16_out, dtype, shape):
    # a float32 result's bf16 bits: a C-contiguous uint16 array of its shape
    if bf16_out is None:
        return
    _array(op, "bf16_out", bf16_out)
    if (str(dtype) != "float32" or str(bf16_out.dtype) != "uint16" or tuple(bf16_out.shape) != tuple(shape)
            or not bf16_out.flags.c_contiguous):
        raise KernelDtypeError(f"kernels.{op}: bf16_out takes the bf16 bits of a float32 result: a C-contiguous "
                               f"uint16 array of shape {tuple(shape)}, got {bf16_out.dtype} "
                               f"{tuple(bf16_out.shape)} for {dtype} inputs")


def softmax_causal_forward(scores, scale, out=None, *, bf16_out=None, window=0, backend=None):
    """scores (..., T, T) -> probs, softmax over j <= t of scale*scores, exactly 0 for j > t.
    window > 0 (a sliding window, as Mistral's and Gemma 3's local layers): over t - window < j
    <= t only, exactly 0 before. out may be scores itself (in place). bf16_out (float32 only):
    a uint16 array of scores' shape that also gets the probabilities' bf16 bits (as to_bf16), for
    a bf16 GEMM (att @ v); the Numba kernel writes them in the same pass, the other backends
    round afterwards. The backward needs no window: the probabilities it reads are 0 outside."""
    op = "softmax_causal_forward"
    if type(window) is not int or window < 0:
        raise ValueError(f"kernels.{op}: window must be a whole number >= 0 (0: no window), got {window!r}")
    _check_square(op, "scores", scores)
    dt = _float_dtype(op, "scores", scores)
    _same_dtype(op, dt, out=out)
    _shape(op, "out", out, scores.shape)
    _out_ok(op, "out", out)
    _check_bf16_out(op, bf16_out, dt, scores.shape)
    impl = _dispatch(op, (scores, out, bf16_out), backend)
    return impl(_c(scores), scale, out, bf16_out=bf16_out, window=window)


def softmax_causal_backward(dprobs, probs, scale, out=None, *, bf16_out=None, backend=None):
    """dscores = scale * probs * (dprobs - sum_j dprobs*probs), 0 above the diagonal.
    out may be dprobs itself (in place). bf16_out (float32 only, out None): a uint16 array
    of probs' shape that gets dscores' bf16 bits (as to_bf16) instead, for the bf16 GEMMs
    of dq and dk, and is returned; the Numba kernel never stores the float32 values."""
    op = "softmax_causal_backward"
    _check_square(op, "probs", probs)
    dt = _float_dtype(op, "probs", probs)
    _same_dtype(op, dt, dprobs=dprobs, out=out)
    _shape(op, "dprobs", dprobs, probs.shape)
    _shape(op, "out", out, probs.shape)
    _out_ok(op, "out", out)
    _check_bf16_out(op, bf16_out, dt, probs.shape)
    if bf16_out is not None and out is not None:
        raise ValueError(f"kernels.{op}: give out (float32 dscores) or bf16_out (their bf16 bits), not both")
    impl = _dispatch(op, (dprobs, probs, out, bf16_out), backend)
    return impl(_c(dprobs), _c(probs), scale, out, bf16_out=bf16_out)


# ---------------------------------------------------------------------------
# cross-entropy


def cross_entropy_forward_backward(logits, targets, dlogits=None, grad_scale=1.0, *, backend=None):
    """logits (N, V), targets (N,) ints in [0, V) -> (losses (N,), dlogits or None).

    losses[n] = -log softmax(logits[n])[targets[n]], in logits' dtype. If dlogits is
    given (it may be logits itself), it is overwritten with
    (softmax(logits) - onehot(targets)) * grad_scale.
    """
    op = "cross_entropy_forward_backward"
    _ndim(op, "logits", logits, 2)
    N, V = logits.shape
    dt = _float_dtype(op, "logits", logits)
    _same_dtype(op, dt, dlogits=dlogits)
    _array(op, "targets", targets)
    _shape(op, "targets", targets, (N,))
    _shape(op, "dlogits", dlogits, (N, V))
    _out_ok(op, "dlogits", dlogits)
    if targets.dtype.kind not in "iu":
        raise KernelDtypeError(f"kernels.{op}: targets must be an integer array, got {targets.dtype}")
    if N and not is_gpu_array(targets):
        # numba does no bounds checking: an out-of-range target would read arbitrary
        # memory. On the host min/max is cheap; the GPU path checks on its own terms.
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise ValueError(f"kernels.{op}: target {bad} out of range [0, {V}) for logits of shape {(N, V)}")
    impl = _dispatch(op, (logits, targets, dlogits), backend)
    return impl(_c(logits), _c(targets), dlogits, grad_scale)


# ---------------------------------------------------------------------------
# optimizers and norms


def _check_flat(op, param, grad, **state):
    """param and the optimizer state are updated in place (outputs); grad is an
    input, which the caller passes on through _c."""
    _ndim(op, "param", param, 1)
    _array(op, "grad", grad)
    dt = _float_dtype(op, "param", param)
    _same_dtype(op, dt, grad=grad, **state)
    for name, a in dict(grad=grad, **state).items():
        _shape(op, name, a, param.shape)
    _out_ok(op, "param", param)
    for name, a in state.items():
        _out_ok(op, name, a)


def _check_mask(op, param, wd_mask):
    if wd_mask is None:
        return
    _shape(op, "wd_mask", wd_mask, param.shape)
    if str(wd_mask.dtype) not in ("bool", "uint8", "float32", "float64"):
        raise KernelDtypeError(f"kernels.{op}: wd_mask must be bool, uint8, float32 or float64, got {wd_mask.dtype}")
    if not wd_mask.flags.c_contiguous:
        raise ValueError(f"kernels.{op}: wd_mask must be C-contiguous (it is read along the flat param)")


def adamw_update(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None, backend=None):
    """AdamW step in place on flat 1D arrays; step is 1-based (bias correction).

    m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g^2
    p -= lr * (m/(1-b1^step) / (sqrt(v/(1-b2^step)) + eps) + weight_decay*mask*p)
    """
    op = "adamw_update"
    _check_flat(op, param, grad, m=m, v=v)
    _check_mask(op, param, wd_mask)
    if step < 1:
        raise ValueError(f"kernels.{op}: step is 1-based, got {step}")
    impl = _dispatch(op, (param, grad, m, v, wd_mask), backend)
    impl(param, _c(grad), m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
         weight_decay=weight_decay, step=step, wd_mask=wd_mask)


def sgd_momentum_update(param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None, backend=None):
    """SGD with momentum in place (PyTorch convention, no dampening; buf starts at zero):
    g' = g + wd*mask*p ; buf = momentum*buf + g' ; p -= lr*buf"""
    op = "sgd_momentum_update"
    _check_flat(op, param, grad, buf=buf)
    _check_mask(op, param, wd_mask)
    impl = _dispatch(op, (param, grad, buf, wd_mask), backend)
    impl(param, _c(grad), buf, lr=lr, momentum=momentum, weight_decay=weight_decay, wd_mask=wd_mask)


def sum_of_squares(x, *, backend=None):
    """sum(x**2) as a python float, accumulated in float64 (global-norm clipping)."""
    op = "sum_of_squares"
    _float_dtype(op, "x", x)
    impl = _dispatch(op, (x,), backend)
    return impl(_c(x))


# ---------------------------------------------------------------------------
# Llama-family ops: RMSNorm, rotary position embedding (RoPE), SwiGLU


def _last_dim(op, name, a):
    _array(op, name, a)
    if a.ndim < 1:
        raise ValueError(f"kernels.{op}: {name} must have at least 1 dim (..., C), got a scalar")
    return a.shape[-1]


def rmsnorm_forward(x, w, eps=1e-5, *, backend=None):
    """RMSNorm over the last dim: x (..., C), w (C,) -> (y (..., C), rstd (...,)),
    y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps), as transformers' LlamaRMSNorm.
    Both new arrays in x's dtype; rstd is what rmsnorm_backward needs."""
    op = "rmsnorm_forward"
    C = _last_dim(op, "x", x)
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, w=w)
    _shape(op, "w", w, (C,))
    impl = _dispatch(op, (x, w), backend)
    return impl(_c(x), _c(w), float(eps))


def rmsnorm_backward(dy, x, w, rstd, *, backend=None):
    """-> (dx (..., C), dw (C,)), both new; dw is summed over every row of x."""
    op = "rmsnorm_backward"
    C = _last_dim(op, "x", x)
    dt = _float_dtype(op, "x", x)
    _same_dtype(op, dt, dy=dy, w=w, rstd=rstd)
    _shape(op, "dy", dy, x.shape)
    _shape(op, "w", w, (C,))
    _shape(op, "rstd", rstd, x.shape[:-1])
    impl = _dispatch(op, (dy, x, w, rstd), backend)
    return impl(_c(dy), _c(x), _c(w), _c(rstd))


def _check_rope(op, name, a, cos, sin):
    _ndim(op, name, a, 4)
    B, T, H, hd = a.shape
    if hd % 2:
        raise ValueError(f"kernels.{op}: the head size (last dim of {name}, shape {tuple(a.shape)}) must be even: "
                         "RoPE rotates its two halves against each other")
    dt = _float_dtype(op, name, a)
    _same_dtype(op, dt, cos=cos, sin=sin)
    for tname, tab in (("cos", cos), ("sin", sin)):
        _array(op, tname, tab)
        if tuple(tab.shape) != (T, hd):
            raise ValueError(f"kernels.{op}: {tname} has shape {tuple(tab.shape)}, expected ({T}, {hd}) = "
                             f"(positions, head size) of {name} {tuple(a.shape)}; slice the table built by "
                             "kernels.rope_tables to the positions in use")


def rope_forward(x, cos, sin, *, backend=None):
    """Rotary position embedding in transformers' half-split layout: x (B, T, H, hd),
    cos/sin (T, hd) (kernels.rope_tables) -> y = x * cos + rotate_half(x) * sin, new,
    with rotate_half(x) = cat(-x[..., hd/2:], x[..., :hd/2]) within each head."""
    op = "rope_forward"
    _check_rope(op, "x", x, cos, sin)
    impl = _dispatch(op, (x, cos, sin), backend)
    return impl(_c(x), _c(cos), _c(sin))


def rope_backward(dy, cos, sin, *, backend=None):
    """dx of rope_forward (it is linear in x: the transpose), dy (B, T, H, hd) -> new dx."""
    op = "rope_backward"
    _check_rope(op, "dy", dy, cos, sin)
    impl = _dispatch(op, (dy, cos, sin), backend)
    return impl(_c(dy), _c(cos), _c(sin))


def swiglu_forward(gate, up, *, backend=None):
    """h = silu(gate) * up (silu(g) = g * sigmoid(g)), elementwise on any shape, new."""
    op = "swiglu_forward"
    dt = _float_dtype(op, "gate", gate)
    _same_dtype(op, dt, up=up)
    _shape(op, "up", up, gate.shape)
    impl = _dispatch(op, (gate, up), backend)
    return impl(_c(gate), _c(up))


def swiglu_backward(dh, gate, up, *, backend=None):
    """-> (dgate, dup) of h = silu(gate) * up, both new."""
    op = "swiglu_backward"
    dt = _float_dtype(op, "gate", gate)
    _same_dtype(op, dt, dh=dh, up=up)
    _shape(op, "up", up, gate.shape)
    _shape(op, "dh", dh, gate.shape)
    impl = _dispatch(op, (dh, gate, up), backend)
    return impl(_c(dh), _c(gate), _c(up))
