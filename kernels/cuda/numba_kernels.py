"""
Numba CUDA kernels for the ops of the table in kernels/ops.py (all but linear_forward),
plus a tiled GEMM and a column sum: the "numba_cuda" backend.

It is registered from the same op table as the production "cuda" backend (CUDA C,
kernels/cuda/cupy_kernels.py) but only ever runs when asked for, with
backend="numba_cuda" or kernels.set_backend("numba_cuda"); ops it leaves out run on
"cuda". kernels/cuda/__init__.py says why it is kept. Its jobs:
  - a readable GPU implementation that runs (slowly, but exactly) under Numba's CUDA
    simulator (NUMBA_ENABLE_CUDASIM=1), so every kernel is checked against
    kernels/reference.py on machines with no GPU (tests/support/cuda_sim_check.py):
    the teaching ladder's first rungs next to the tuned CUDA C;
  - the "numba tiled" row of benchmarks/gemm.py and the backend="numba_cuda"
    comparison on real GPUs. Nothing here uses warp shuffles, because the simulator
    has none.

Design:
  - kernels are built by factories keyed on dtype (and GEMM tile shape / transposes),
    so tile sizes, transposes and the dtype are compile-time constants (closure
    variables are frozen into the kernel by numba) and the shared/local arrays can be
    sized statically;
  - row-wise ops (layernorm, softmax, cross-entropy) use one block per row and a
    power-of-two block with a shared-memory tree reduction; row statistics are summed
    in float64 like the reference (these ops are memory-bound, FP64 adds cost nowhere
    that matters on a data-center GPU);
  - cross-row sums (layernorm dweight/dbias, column_sum) go through fixed-size row
    chunks and a float64 partial array, so the result does not depend on launch
    configuration (bitwise reproducible) and there are no atomics;
  - values read from float32 arrays are cast with F64(...) wherever float64 math is
    meant. Compiled numba would promote anyway, but the simulator runs plain Python
    on numpy scalars, where (NEP 50) python_float * float32 stays float32: without
    the casts the simulator would check different arithmetic than the GPU runs.

Host wrappers are named after the ops and take the table's arguments, plus launch
knobs with defaults (block=, tiles=, rows_per_chunk=) that the simulator checks use
to cross tile edges with tiny shapes. They accept:
  - numpy arrays: copied to the device, computed, copied back (results are numpy,
    outputs passed in are written in place) -- this is what runs in the simulator;
  - device arrays (numba device arrays, or anything with __cuda_array_interface__,
    e.g. cupy): no copies; new outputs are cupy arrays if the inputs are cupy.
Inputs are assumed validated by kernels/__init__.py (C-contiguous, dtypes, shapes).

This module imports numba.cuda at import time: import it lazily (kernels.cuda does).
It deliberately imports nothing relative, so tests can exec a mutated copy of its
source (the planted-bug checks in tests/support/cuda_sim_check.py).
"""

import math
from functools import lru_cache

import numpy as np
from numba import cuda

from ringpipe.kernels import reference as _ref
from ringpipe.kernels.arrays import is_gpu_array

GELU_SCALE = _ref.GELU_SCALE
GELU_CUBE = _ref.GELU_CUBE

# GEMM tiles: (BM, BN, BK, TM, TN). Each block computes a BM x BN tile of C with
# (BM/TM) x (BN/TN) threads, each thread a TM x TN register tile; K advances BK per
# shared-memory stage. 64x64x8 with 4x4 per thread = 256 threads, 4 KiB of shared
# memory per operand in float32: the "2D block tiling" rung of the SGEMM ladder.
# Not tuned beyond that (no vector loads, no double buffering, no warp tiling).
GEMM_TILES = (64, 64, 8, 4, 4)
# Threads per block for row-wise kernels (power of two, <= _MAX_BLOCK).
ROW_BLOCK = 128
_MAX_BLOCK = 1024
# Threads per block for elementwise kernels.
ELT_BLOCK = 256
# Rows per partial sum in column reductions: fixed, so results are reproducible.
ROWS_PER_CHUNK = 64


def _ceil_div(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------
# GEMM


@lru_cache(maxsize=None)
def gemm_kernel(dtype, trans_a, trans_b, tiles=GEMM_TILES):
    """C[z] (+)= op(A[z]) @ op(B[z]) on 3D arrays: a (Ba, M, K) or (Ba, K, M) if
    trans_a; b (Bb, K, N) or (Bb, N, K) if trans_b; c (Bz, M, N). Ba or Bb may be 1
    (broadcast). Launch: grid (ceil(N/BN), ceil(M/BM), Bz), block (BN/TN, BM/TM)."""
    BM, BN, BK, TM, TN = tiles
    TX, TY = BN // TN, BM // TM
    NT = TX * TY
    DT = np.dtype(dtype).type
    ZERO = DT(0)
    TA, TB = bool(trans_a), bool(trans_b)

    @cuda.jit
    def gemm(a, b, c, accumulate):
        M = c.shape[1]
        N = c.shape[2]
        K = a.shape[1] if TA else a.shape[2]
        z = cuda.blockIdx.z
        za = z if a.shape[0] > 1 else 0
        zb = z if b.shape[0] > 1 else 0
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * TX + tx
        m0 = cuda.blockIdx.y * BM
        n0 = cuda.blockIdx.x * BN

        # As holds op(A)'s tile k-major (As[k, m]) whatever A's layout, so the inner
        # loop reads a row of As and a row of Bs: threads with consecutive tx read
        # consecutive addresses (no bank conflicts).
        As = cuda.shared.array((BK, BM), DT)
        Bs = cuda.shared.array((BK, BN), DT)
        acc = cuda.local.array((TM, TN), DT)
        ra = cuda.local.array(TM, DT)
        rb = cuda.local.array(TN, DT)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = ZERO

        n_ktiles = (K + BK - 1) // BK
        for t in range(n_ktiles):
            k0 = t * BK
            # Global -> shared. The flat index walks the operand's contiguous dim
            # fastest, so a warp's loads coalesce for every transpose variant.
            # Outside the matrix we store zeros: they add nothing to the dot products.
            for i in range(tid, BM * BK, NT):
                if TA:
                    kk = i // BM
                    mm = i % BM
                    m = m0 + mm
                    k = k0 + kk
                    v = a[za, k, m] if (m < M and k < K) else ZERO
                else:
                    mm = i // BK
                    kk = i % BK
                    m = m0 + mm
                    k = k0 + kk
                    v = a[za, m, k] if (m < M and k < K) else ZERO
                As[kk, mm] = v
            for i in range(tid, BN * BK, NT):
                if TB:
                    nn = i // BK
                    kk = i % BK
                    n = n0 + nn
                    k = k0 + kk
                    v = b[zb, n, k] if (n < N and k < K) else ZERO
                else:
                    kk = i // BN
                    nn = i % BN
                    n = n0 + nn
                    k = k0 + kk
                    v = b[zb, k, n] if (n < N and k < K) else ZERO
                Bs[kk, nn] = v
            cuda.syncthreads()
            for kk in range(BK):
                # Thread (tx, ty) owns rows ty + i*TY and columns tx + j*TX of the
                # tile (interleaved, not a contiguous TMxTN patch): a warp then reads
                # and stores consecutive columns.
                for i in range(TM):
                    ra[i] = As[kk, ty + i * TY]
                for j in range(TN):
                    rb[j] = Bs[kk, tx + j * TX]
                for i in range(TM):
                    for j in range(TN):
                        acc[i, j] += ra[i] * rb[j]
            cuda.syncthreads()  # before the next stage overwrites As/Bs

        for i in range(TM):
            m = m0 + ty + i * TY
            if m < M:
                for j in range(TN):
                    n = n0 + tx + j * TX
                    if n < N:
                        if accumulate:
                            c[z, m, n] += acc[i, j]
                        else:
                            c[z, m, n] = acc[i, j]

    return gemm


# ---------------------------------------------------------------------------
# block reductions (shared-memory trees; no warp shuffles: the simulator has none)


@cuda.jit(device=True)
def _block_sum(sh, v):
    # every thread gets the sum of v over the block; blockDim.x must be a power of two
    tid = cuda.threadIdx.x
    sh[tid] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            sh[tid] += sh[tid + s]
        cuda.syncthreads()
        s //= 2
    r = sh[0]
    cuda.syncthreads()  # nobody may overwrite sh[0] for a next reduction before all read it
    return r


@cuda.jit(device=True)
def _block_max(sh, v):
    tid = cuda.threadIdx.x
    sh[tid] = v
    cuda.syncthreads()
    s = cuda.blockDim.x // 2
    while s > 0:
        if tid < s:
            if sh[tid + s] > sh[tid]:
                sh[tid] = sh[tid + s]
        cuda.syncthreads()
        s //= 2
    r = sh[0]
    cuda.syncthreads()
    return r


# ---------------------------------------------------------------------------
# row-wise and elementwise kernels, one set per dtype


@lru_cache(maxsize=None)
def row_kernels(dtype):
    """dict name -> kernel for one float dtype: the row-wise and elementwise ops, made by
    one factory per family below (each a closure over the dtype's constants)."""
    DT = np.dtype(dtype).type
    return {**_layernorm_kernels(DT), **_column_sum_kernels(DT), **_gelu_kernels(DT), **_softmax_kernels(DT),
            **_optimizer_kernels(DT)}


def _layernorm_kernels(DT):
    """LayerNorm forward and backward (its weight's and bias's gradients as column partials)."""
    F64 = np.float64

    @cuda.jit
    def layernorm_forward(x, w, b, eps, out, mean, rstd):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        C = x.shape[1]
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        s = 0.0
        for c in range(tid, C, nt):
            s += F64(x[row, c])
        mu = _block_sum(sh, s) / C
        s = 0.0
        for c in range(tid, C, nt):  # two-pass variance: no cancellation
            d = F64(x[row, c]) - mu
            s += d * d
        var = _block_sum(sh, s) / C
        # rounded to the dtype before use, as the reference does, so that out is
        # consistent with the mean/rstd handed to the backward pass
        mu_t = DT(mu)
        rs_t = DT(1.0 / math.sqrt(var + eps))
        if tid == 0:
            mean[row] = mu_t
            rstd[row] = rs_t
        for c in range(tid, C, nt):
            out[row, c] = (x[row, c] - mu_t) * rs_t * w[c] + b[c]

    @cuda.jit
    def layernorm_backward_dx(dout, x, w, mean, rstd, dx):
        # dx = rstd * (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm)), dnorm = dout*w
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        C = x.shape[1]
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        mu = mean[row]
        rs = rstd[row]
        s1 = 0.0
        s2 = 0.0
        for c in range(tid, C, nt):
            dn = dout[row, c] * w[c]  # in the dtype, like the reference's dnorm
            s1 += F64(dn)
            s2 += F64(dn) * ((x[row, c] - mu) * rs)
        a1 = _block_sum(sh, s1) / C
        a2 = _block_sum(sh, s2) / C
        # each thread writes only the columns it read: dx may alias dout
        for c in range(tid, C, nt):
            dn = dout[row, c] * w[c]
            nrm = (x[row, c] - mu) * rs
            dx[row, c] = DT((dn - a1 - nrm * a2) * rs)

    @cuda.jit
    def layernorm_backward_params_partial(dout, x, mean, rstd, pw, pb, rows_per_chunk):
        # pw/pb (chunks, C) float64: this chunk's sums of norm*dout and dout per column
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        chunk = cuda.blockIdx.y
        N = x.shape[0]
        C = x.shape[1]
        if c < C:
            r0 = chunk * rows_per_chunk
            r1 = r0 + rows_per_chunk
            if r1 > N:  # not min(): numba 0.68 types it via a device overload that PTX-only builds cannot compile
                r1 = N
            sw = 0.0
            sb = 0.0
            for r in range(r0, r1):
                d = F64(dout[r, c])
                sw += ((x[r, c] - mean[r]) * rstd[r]) * d
                sb += d
            pw[chunk, c] = sw
            pb[chunk, c] = sb

    return {
        "layernorm_forward": layernorm_forward,
        "layernorm_backward_dx": layernorm_backward_dx,
        "layernorm_backward_params_partial": layernorm_backward_params_partial,
    }


def _column_sum_kernels(DT):
    """The column sum (a bias's gradient) in fixed row chunks: bitwise the same for any launch."""
    F64 = np.float64

    @cuda.jit
    def column_sum_partial(x, p, rows_per_chunk):
        # p (chunks, C) float64 = per-chunk column sums of x (N, C); threads walk
        # columns, so a warp reads consecutive addresses of each row
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        chunk = cuda.blockIdx.y
        N = x.shape[0]
        C = x.shape[1]
        if c < C:
            r0 = chunk * rows_per_chunk
            r1 = r0 + rows_per_chunk
            if r1 > N:  # not min(): numba 0.68 types it via a device overload that PTX-only builds cannot compile
                r1 = N
            s = 0.0
            for r in range(r0, r1):
                s += F64(x[r, c])
            p[chunk, c] = s

    @cuda.jit
    def column_sum_finish(p, out, accumulate):
        # out[c] (+)= sum over chunks of p[:, c], chunks in a fixed order
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c < out.shape[0]:
            s = 0.0
            for k in range(p.shape[0]):
                s += p[k, c]
            if accumulate:
                out[c] = DT(out[c] + s)
            else:
                out[c] = DT(s)

    return {
        "column_sum_partial": column_sum_partial,
        "column_sum_finish": column_sum_finish,
    }


def _gelu_kernels(DT):
    """GELU (tanh approximation), forward and backward, elementwise."""
    ONE = DT(1)
    S = DT(GELU_SCALE)
    CUBE = DT(GELU_CUBE)
    HALF = DT(0.5)
    THREE_CUBE = DT(3.0 * GELU_CUBE)

    @cuda.jit
    def gelu_forward(x, out):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < x.shape[0]:
            v = x[i]
            out[i] = HALF * v * (ONE + math.tanh(S * (v + CUBE * v * v * v)))
            i += stride

    @cuda.jit
    def gelu_backward(dout, x, dx):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < x.shape[0]:
            v = x[i]
            t = math.tanh(S * (v + CUBE * v * v * v))
            # 1 - t^2 rather than sech^2: cannot overflow
            g = HALF * (ONE + t) + HALF * v * (ONE - t * t) * S * (ONE + THREE_CUBE * v * v)
            dx[i] = g * dout[i]
            i += stride

    return {
        "gelu_forward": gelu_forward,
        "gelu_backward": gelu_backward,
    }


def _softmax_kernels(DT):
    """The causal softmax, forward and backward, and the cross-entropy: one block per row."""
    ZERO = DT(0)
    F64 = np.float64

    @cuda.jit
    def softmax_causal_forward(s, scale, out, window):
        # s, out (R, T) with R = batch * T rows; row r is query t = r % T, which sees
        # keys lo <= j <= t (lo = t - window + 1 under a sliding window, else 0). Each
        # thread touches only its own j in every pass, so out may alias s.
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        T = s.shape[1]
        t = row % T
        lo = t - window + 1 if window > 0 and t - window + 1 > 0 else 0
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        mx = -math.inf
        for j in range(lo + tid, t + 1, nt):
            z = F64(s[row, j]) * scale
            if z > mx:
                mx = z
        mx = _block_max(sh, mx)  # finite: the diagonal is always kept
        tot = 0.0
        for j in range(lo + tid, t + 1, nt):
            tot += math.exp(F64(s[row, j]) * scale - mx)
        tot = _block_sum(sh, tot)
        for j in range(tid, T, nt):
            if lo <= j <= t:
                out[row, j] = DT(math.exp(F64(s[row, j]) * scale - mx) / tot)
            else:
                out[row, j] = ZERO

    @cuda.jit
    def softmax_causal_backward(dp, p, scale, out):
        # dscores = scale * p * (dp - sum_{j<=t} dp*p); 0 above the diagonal, whatever dp holds there
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        T = p.shape[1]
        t = row % T
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        dot = 0.0
        for j in range(tid, t + 1, nt):
            dot += F64(dp[row, j]) * p[row, j]
        dot = _block_sum(sh, dot)
        for j in range(tid, T, nt):
            if j <= t:
                out[row, j] = DT(scale * F64(p[row, j]) * (F64(dp[row, j]) - dot))
            else:
                out[row, j] = ZERO

    @cuda.jit
    def cross_entropy(logits, targets, losses, dlogits, grad_scale, want_grad):
        # one block per row: max, sum of exp (float64), loss = lse - logit[target];
        # then dlogits = (softmax - onehot) * grad_scale, which may alias logits
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        V = logits.shape[1]
        tgt = targets[row]
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        # read before the reductions' barriers: afterwards another thread may have
        # overwritten logits[row, tgt] with its gradient (dlogits aliasing logits)
        lt = logits[row, tgt] if tid == 0 else ZERO
        mx = -math.inf
        for j in range(tid, V, nt):
            if logits[row, j] > mx:
                mx = logits[row, j]
        mx = _block_max(sh, mx)
        tot = 0.0
        for j in range(tid, V, nt):
            tot += math.exp(F64(logits[row, j]) - mx)
        tot = _block_sum(sh, tot)
        lse = mx + math.log(tot)
        if tid == 0:
            losses[row] = DT(lse - lt)
        if want_grad:
            lse_t = DT(lse)  # the reference subtracts lse rounded to the dtype
            for j in range(tid, V, nt):
                g = math.exp(F64(logits[row, j] - lse_t))
                if j == tgt:
                    g -= 1.0
                dlogits[row, j] = DT(g * grad_scale)

    return {
        "softmax_causal_forward": softmax_causal_forward,
        "softmax_causal_backward": softmax_causal_backward,
        "cross_entropy": cross_entropy,
    }


def _optimizer_kernels(DT):
    """AdamW, SGD with momentum, and the partial sums of squares of the gradient norm."""
    F64 = np.float64

    @cuda.jit
    def adamw(p, g, m, v, lr, beta1, beta2, eps, wd, bc1, bc2, mask, has_mask):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < p.shape[0]:
            gi = F64(g[i])
            mi = DT(beta1 * F64(m[i]) + (1.0 - beta1) * gi)
            vi = DT(beta2 * F64(v[i]) + (1.0 - beta2) * gi * gi)
            m[i] = mi
            v[i] = vi
            decay = wd * F64(mask[i]) if has_mask else wd
            pi = F64(p[i])
            # decoupled weight decay: on the parameter, not folded into the gradient
            p[i] = DT(pi - lr * ((F64(mi) / bc1) / (math.sqrt(F64(vi) / bc2) + eps) + decay * pi))
            i += stride

    @cuda.jit
    def sgd_momentum(p, g, buf, lr, momentum, wd, mask, has_mask):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < p.shape[0]:
            decay = wd * F64(mask[i]) if has_mask else wd
            pi = F64(p[i])
            b = DT(momentum * F64(buf[i]) + (F64(g[i]) + decay * pi))
            buf[i] = b
            p[i] = DT(pi - lr * b)
            i += stride

    @cuda.jit
    def sum_of_squares_partial(x, partial):
        # partial[block] = sum of x^2 over the block's grid-stride share, in float64
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        s = 0.0
        while i < x.shape[0]:
            xi = F64(x[i])
            s += xi * xi
            i += stride
        s = _block_sum(sh, s)
        if cuda.threadIdx.x == 0:
            partial[cuda.blockIdx.x] = s

    return {
        "adamw": adamw,
        "sgd_momentum": sgd_momentum,
        "sum_of_squares_partial": sum_of_squares_partial,
    }


@lru_cache(maxsize=None)
def llama_kernels(dtype):
    """dict name -> kernel for one float dtype: RMSNorm, RoPE, SwiGLU (the Llama family)."""
    DT = np.dtype(dtype).type
    return {**_rmsnorm_kernels(DT), **_rope_swiglu_kernels(DT)}


def _rmsnorm_kernels(DT):
    """RMSNorm forward and backward (its weight's gradient as column partials)."""
    F64 = np.float64

    @cuda.jit
    def rmsnorm_forward(x, w, eps, y, rstd):
        # one block per row of x (N, C): y = (x * rstd) * w, rstd = 1/sqrt(mean(x^2) + eps)
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        C = x.shape[1]
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        s = 0.0
        for c in range(tid, C, nt):
            v = F64(x[row, c])
            s += v * v
        # rounded to the dtype before use, as the reference: y agrees with the saved rstd
        r = DT(1.0 / math.sqrt(_block_sum(sh, s) / C + eps))
        if tid == 0:
            rstd[row] = r
        for c in range(tid, C, nt):
            y[row, c] = (x[row, c] * r) * w[c]

    @cuda.jit
    def rmsnorm_backward_dx(dy, x, w, rstd, dx):
        # dx = rstd * (g - xhat * mean_c(g * xhat)), g = dy * w, xhat = x * rstd
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        C = x.shape[1]
        sh = cuda.shared.array(_MAX_BLOCK, F64)
        r = rstd[row]
        s = 0.0
        for c in range(tid, C, nt):
            s += F64(dy[row, c] * w[c]) * F64(x[row, c] * r)
        m = DT(_block_sum(sh, s) / C)
        for c in range(tid, C, nt):
            dx[row, c] = (dy[row, c] * w[c] - (x[row, c] * r) * m) * r

    @cuda.jit
    def rmsnorm_backward_dw_partial(dy, x, rstd, pw, rows_per_chunk):
        # pw (chunks, C) float64: this chunk's column sums of dy * xhat
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        chunk = cuda.blockIdx.y
        N = x.shape[0]
        C = x.shape[1]
        if c < C:
            r0 = chunk * rows_per_chunk
            r1 = r0 + rows_per_chunk
            if r1 > N:  # not min(): see layernorm_backward_params_partial
                r1 = N
            s = 0.0
            for r in range(r0, r1):
                s += F64(dy[r, c]) * F64(x[r, c] * rstd[r])
            pw[chunk, c] = s

    return {
        "rmsnorm_forward": rmsnorm_forward,
        "rmsnorm_backward_dx": rmsnorm_backward_dx,
        "rmsnorm_backward_dw_partial": rmsnorm_backward_dw_partial,
    }


def _rope_swiglu_kernels(DT):
    """RoPE's rotation (forward, or its transpose for backward) and SwiGLU, elementwise."""
    ONE = DT(1)

    @cuda.jit
    def rope(x, cos, sin, y, sign):
        # x, y (B*T, H, hd), cos/sin (T, hd); one thread per (row, head, i < hd/2) pair.
        # sign > 0: y1 = x1*cos1 - x2*sin1, y2 = x2*cos2 + x1*sin2; sign < 0 the transpose
        H = x.shape[1]
        h = x.shape[2] // 2
        T = cos.shape[0]
        pairs = x.shape[0] * H * h
        p = cuda.grid(1)
        stride = cuda.gridsize(1)
        while p < pairs:
            i = p % h
            head = (p // h) % H
            row = p // (h * H)
            t = row % T
            a = x[row, head, i]
            b = x[row, head, i + h]
            if sign > 0:
                y[row, head, i] = a * cos[t, i] - b * sin[t, i]
                y[row, head, i + h] = b * cos[t, i + h] + a * sin[t, i + h]
            else:
                y[row, head, i] = a * cos[t, i] + b * sin[t, i + h]
                y[row, head, i + h] = b * cos[t, i + h] - a * sin[t, i]
            p += stride

    @cuda.jit
    def swiglu_forward(gate, up, out):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < gate.shape[0]:
            g = gate[i]
            out[i] = g / (ONE + math.exp(-g)) * up[i]  # exp overflow for g << 0: -0, no NaN
            i += stride

    @cuda.jit
    def swiglu_backward(dh, gate, up, dgate, dup):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < gate.shape[0]:
            g = gate[i]
            d = dh[i]
            sig = ONE / (ONE + math.exp(-g))
            dgate[i] = d * up[i] * sig * (ONE + g * (ONE - sig))
            dup[i] = d * g * sig
            i += stride

    return {
        "rope": rope,
        "swiglu_forward": swiglu_forward,
        "swiglu_backward": swiglu_backward,
    }


# ---------------------------------------------------------------------------
# host side: numpy in -> device -> numpy out, or device arrays straight through


class _Launch:
    """Moves one call's arrays to the device and the written ones back.

    All-numpy calls: every array is copied to the device (an output that aliases an
    input, e.g. out=scores, maps to the same device buffer) and outputs are copied
    back into the caller's numpy arrays. Otherwise arrays are used as they are and
    new outputs are allocated next to them (cupy if the inputs are cupy)."""

    def __init__(self, *arrays):
        present = [a for a in arrays if a is not None]
        # host: a call on numpy arrays only (the simulator's case). Anything else is
        # already on the device: cupy arrays, or numba device arrays (which are not
        # GPU arrays to kernels' dispatch, but these wrappers take them too)
        self.host = all(isinstance(a, np.ndarray) for a in present)
        self.cupy = any(is_gpu_array(a) for a in present)
        self._dev = {}
        self._back = []

    def dev(self, a):
        if a is None or not isinstance(a, np.ndarray):
            return a
        key = id(a)
        if key not in self._dev:
            self._dev[key] = cuda.to_device(np.ascontiguousarray(a))
        return self._dev[key]

    def out(self, a, shape, dtype):
        """Device buffer for an output: the caller's (copied back at the end if it is
        numpy) or a new one."""
        if a is not None:
            d = self.dev(a)
            if isinstance(a, np.ndarray):
                self._back.append((d, a))
            return d
        if self.cupy:
            import cupy

            return cupy.empty(shape, dtype=dtype)
        return cuda.device_array(shape, dtype=dtype)

    def result(self, d, target=None):
        """What to return for device output d: numpy on the host path (target, the
        caller's array, when there was one), else the device array itself."""
        if not self.host:
            return d
        if target is not None:
            return target
        return d.copy_to_host()

    def finish(self):
        for d, a in self._back:
            d.copy_to_host(a)


def _c_contiguous(a):
    if hasattr(a, "is_c_contiguous"):  # numba device arrays (and the simulator's)
        return a.is_c_contiguous()
    return a.flags.c_contiguous  # numpy, cupy


def _row_block(n, block=None):
    # power of two (the tree reductions need it), no more threads than useful
    if block is not None:
        return int(block)
    b = 32
    while b < n and b < ROW_BLOCK:
        b *= 2
    return b


def _elt_grid(n, block):
    return max(1, min(_ceil_div(n, block), 4096))


def _reshape(a, shape):
    return a.reshape(shape)


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32",
           tiles=GEMM_TILES):
    """out = op(a) @ op(b) (or out += with accumulate), leading dims broadcast like
    xp.matmul (a general broadcast is materialized; a plain 2D operand is not).
    precision="bf16": the float32 GEMM on bf16-rounded inputs (no tensor cores here;
    numpy or cupy inputs)."""
    if precision == "bf16":
        a, b = _ref.round_to_bf16(a), _ref.round_to_bf16(b)
    if out is not None and not _c_contiguous(out):
        # a strided out (a slice): compute into a temporary, then write through
        tmp = out.copy() if accumulate else None
        res = matmul(a, b, tmp, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, tiles=tiles)
        out[...] = res
        return out
    L = _Launch(a, b, out)
    sa, sb = tuple(a.shape), tuple(b.shape)  # tuple(): the simulator's shapes reject negative indices
    M, K = (sa[-1], sa[-2]) if trans_a else (sa[-2], sa[-1])
    N = sb[-2] if trans_b else sb[-1]
    batch_a, batch_b = sa[:-2], sb[:-2]
    batch = tuple(np.broadcast_shapes(batch_a, batch_b))
    nb = int(np.prod(batch, dtype=np.int64)) if batch else 1

    def as3d(x, xbatch):
        mat = tuple(x.shape)[-2:]
        nx = int(np.prod(xbatch, dtype=np.int64))
        if xbatch != batch and nx != 1:
            # a partial broadcast (e.g. (2,1,..) with (1,3,..)): materialize it
            if is_gpu_array(x):
                import cupy

                x = cupy.ascontiguousarray(cupy.broadcast_to(x, batch + mat))
            elif isinstance(x, np.ndarray):
                x = np.ascontiguousarray(np.broadcast_to(x, batch + mat))
            else:
                raise NotImplementedError("numba_kernels.matmul: partial batch broadcast of numba device arrays")
            nx = nb
        # batch 1 (a plain 2D operand) is broadcast by the kernel: no copy
        return x.reshape((nx,) + mat)

    a3, b3 = as3d(a, batch_a), as3d(b, batch_b)
    dt = a.dtype
    d_out = L.out(out, batch + (M, N), dt)
    c3 = _reshape(d_out, (nb, M, N))
    BM, BN, BK, TM, TN = tiles
    if M and N and nb:
        # K == 0 needs no special case: no k-tiles, the kernel stores (or adds) zeros
        kern = gemm_kernel(np.dtype(dt).name, bool(trans_a), bool(trans_b), tuple(tiles))
        grid = (_ceil_div(N, BN), _ceil_div(M, BM), nb)
        kern[grid, (BN // TN, BM // TM)](L.dev(a3), L.dev(b3), c3, bool(accumulate))
    L.finish()
    return L.result(d_out, out)


def layernorm_forward(x, weight, bias, eps=1e-5, out=None, *, block=None):
    L = _Launch(x, weight, bias, out)
    N, C = x.shape
    d_out = L.out(out, (N, C), x.dtype)
    d_mean = L.out(None, (N,), x.dtype)
    d_rstd = L.out(None, (N,), x.dtype)
    if N:
        row_kernels(x.dtype.name)["layernorm_forward"][N, _row_block(C, block)](
            L.dev(x), L.dev(weight), L.dev(bias), float(eps), d_out, d_mean, d_rstd)
    L.finish()
    return L.result(d_out, out), L.result(d_mean), L.result(d_rstd)


def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None, *, block=None,
                       rows_per_chunk=ROWS_PER_CHUNK):
    L = _Launch(dout, x, weight, mean, rstd, dx, dweight, dbias)
    N, C = x.shape
    k = row_kernels(x.dtype.name)
    d_dx = L.out(dx, (N, C), x.dtype)
    d_dout, d_x, d_mean, d_rstd = L.dev(dout), L.dev(x), L.dev(mean), L.dev(rstd)
    if N:
        k["layernorm_backward_dx"][N, _row_block(C, block)](d_dout, d_x, L.dev(weight), d_mean, d_rstd, d_dx)
    if (dweight is not None or dbias is not None) and N and C:
        chunks = _ceil_div(N, rows_per_chunk)
        pw = L.out(None, (chunks, C), np.float64)
        pb = L.out(None, (chunks, C), np.float64)
        cb = 64
        k["layernorm_backward_params_partial"][(_ceil_div(C, cb), chunks), cb](
            d_dout, d_x, d_mean, d_rstd, pw, pb, rows_per_chunk)
        for p, target in ((pw, dweight), (pb, dbias)):
            if target is not None:
                k["column_sum_finish"][_ceil_div(C, cb), cb](p, L.out(target, (C,), x.dtype), True)
    L.finish()
    return L.result(d_dx, dx)


def column_sum(x, out=None, *, accumulate=False, rows_per_chunk=ROWS_PER_CHUNK):
    """out (C,) (+)= x (N, C).sum(axis=0), summed in float64 (the bias gradient)."""
    if accumulate and out is None:
        raise ValueError("column_sum: accumulate=True needs out")
    L = _Launch(x, out)
    N, C = x.shape
    k = row_kernels(x.dtype.name)
    d_out = L.out(out, (C,), x.dtype)
    if C:
        chunks = max(1, _ceil_div(N, rows_per_chunk))
        p = L.out(None, (chunks, C), np.float64)
        cb = 64
        k["column_sum_partial"][(_ceil_div(C, cb), chunks), cb](L.dev(x), p, rows_per_chunk)
        if N == 0:  # no rows: the partial kernel wrote nothing
            k["column_sum_partial"][(_ceil_div(C, cb), 1), cb](L.dev(x), p, 1)
        k["column_sum_finish"][_ceil_div(C, cb), cb](p, d_out, bool(accumulate))
    L.finish()
    return L.result(d_out, out)


def gelu_forward(x, out=None, *, block=ELT_BLOCK):
    L = _Launch(x, out)
    d_out = L.out(out, x.shape, x.dtype)
    n = x.size
    if n:
        row_kernels(x.dtype.name)["gelu_forward"][_elt_grid(n, block), block](
            _reshape(L.dev(x), (n,)), _reshape(d_out, (n,)))
    L.finish()
    return L.result(d_out, out)


def gelu_backward(dout, x, dx=None, *, block=ELT_BLOCK):
    L = _Launch(dout, x, dx)
    d_dx = L.out(dx, x.shape, x.dtype)
    n = x.size
    if n:
        row_kernels(x.dtype.name)["gelu_backward"][_elt_grid(n, block), block](
            _reshape(L.dev(dout), (n,)), _reshape(L.dev(x), (n,)), _reshape(d_dx, (n,)))
    L.finish()
    return L.result(d_dx, dx)


def _rows(a, T):
    return _reshape(a, (a.size // T, T))


def softmax_causal_forward(scores, scale, out=None, *, bf16_out=None, window=0, block=None):
    L = _Launch(scores, out)
    d_out = L.out(out, scores.shape, scores.dtype)
    T = tuple(scores.shape)[-1]
    if scores.size:
        R = scores.size // T
        row_kernels(scores.dtype.name)["softmax_causal_forward"][R, _row_block(T, block)](
            _rows(L.dev(scores), T), float(scale), _rows(d_out, T), int(window))
    L.finish()
    probs = L.result(d_out, out)
    if bf16_out is not None:    # rounded afterwards (the GPU's GEMMs round float32 operands themselves)
        _ref.write_bf16_bits(probs, bf16_out)
    return probs


def softmax_causal_backward(dprobs, probs, scale, out=None, *, bf16_out=None, block=None):
    if bf16_out is not None:
        return _ref.write_bf16_bits(softmax_causal_backward(dprobs, probs, scale, block=block), bf16_out)
    L = _Launch(dprobs, probs, out)
    d_out = L.out(out, probs.shape, probs.dtype)
    T = tuple(probs.shape)[-1]
    if probs.size:
        R = probs.size // T
        row_kernels(probs.dtype.name)["softmax_causal_backward"][R, _row_block(T, block)](
            _rows(L.dev(dprobs), T), _rows(L.dev(probs), T), float(scale), _rows(d_out, T))
    L.finish()
    return L.result(d_out, out)


def cross_entropy_forward_backward(logits, targets, dlogits=None, grad_scale=1.0, *, block=None):
    L = _Launch(logits, targets, dlogits)
    N, V = logits.shape
    if isinstance(targets, np.ndarray):
        targets = targets.astype(np.int64, copy=False)
    d_losses = L.out(None, (N,), logits.dtype)
    want = dlogits is not None
    # a 1x1 stand-in keeps one compiled specialization for both cases
    d_dl = L.out(dlogits, (N, V), logits.dtype) if want else L.out(None, (1, 1), logits.dtype)
    if N:
        row_kernels(logits.dtype.name)["cross_entropy"][N, _row_block(V, block)](
            L.dev(logits), L.dev(targets), d_losses, d_dl, float(grad_scale), want)
    L.finish()
    return L.result(d_losses), (L.result(d_dl, dlogits) if want else None)


def _mask_arg(L, wd_mask):
    # bool masks are read as uint8 (a view); None becomes a 1-element stand-in
    if wd_mask is None:
        return L.dev(np.ones(1, dtype=np.uint8)) if L.host else L.out(None, (1,), np.uint8), False
    if str(wd_mask.dtype) == "bool":
        wd_mask = wd_mask.view(np.uint8)
    return L.dev(wd_mask), True


def adamw_update(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None,
                 block=ELT_BLOCK):
    L = _Launch(param, grad, m, v, wd_mask)
    n = param.shape[0]
    d_p = L.out(param, (n,), param.dtype)
    d_m = L.out(m, (n,), param.dtype)
    d_v = L.out(v, (n,), param.dtype)
    mask, has_mask = _mask_arg(L, wd_mask)
    if n:
        row_kernels(param.dtype.name)["adamw"][_elt_grid(n, block), block](
            d_p, L.dev(grad), d_m, d_v, float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), 1.0 - beta1**step, 1.0 - beta2**step, mask, has_mask)
    L.finish()


def sgd_momentum_update(param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None, block=ELT_BLOCK):
    L = _Launch(param, grad, buf, wd_mask)
    n = param.shape[0]
    d_p = L.out(param, (n,), param.dtype)
    d_b = L.out(buf, (n,), param.dtype)
    mask, has_mask = _mask_arg(L, wd_mask)
    if n:
        row_kernels(param.dtype.name)["sgd_momentum"][_elt_grid(n, block), block](
            d_p, L.dev(grad), d_b, float(lr), float(momentum), float(weight_decay), mask, has_mask)
    L.finish()


def sum_of_squares(x, *, block=ELT_BLOCK):
    L = _Launch(x)
    n = x.size
    if n == 0:
        return 0.0
    grid = min(_elt_grid(n, block), 1024)
    partial = L.out(None, (grid,), np.float64)
    row_kernels(x.dtype.name)["sum_of_squares_partial"][grid, block](_reshape(L.dev(x), (n,)), partial)
    host = partial.get() if is_gpu_array(partial) else partial.copy_to_host()
    return float(np.sum(host))


# ---------------------------------------------------------------------------
# Llama-family ops


def _as_rows(a):
    # (..., C) -> (N, C)
    C = tuple(a.shape)[-1]
    return _reshape(a, (a.size // C if C else 0, C))


def rmsnorm_forward(x, w, eps=1e-5, *, block=None):
    L = _Launch(x, w)
    shape = tuple(x.shape)
    d_y = L.out(None, shape, x.dtype)
    d_rstd = L.out(None, (int(np.prod(shape[:-1], dtype=np.int64)),), x.dtype)
    N, C = d_rstd.shape[0], shape[-1]
    if N and C:
        llama_kernels(x.dtype.name)["rmsnorm_forward"][N, _row_block(C, block)](
            _as_rows(L.dev(x)), L.dev(w), float(eps), _as_rows(d_y), d_rstd)
    L.finish()
    return L.result(d_y), L.result(_reshape(d_rstd, shape[:-1]))


def rmsnorm_backward(dy, x, w, rstd, *, block=None, rows_per_chunk=ROWS_PER_CHUNK):
    L = _Launch(dy, x, w, rstd)
    shape = tuple(x.shape)
    C = shape[-1]
    N = x.size // C if C else 0
    d_dx = L.out(None, shape, x.dtype)
    d_dw = L.out(None, (C,), x.dtype)
    if C:
        k = llama_kernels(x.dtype.name)
        d_dy, d_x, d_rstd = _as_rows(L.dev(dy)), _as_rows(L.dev(x)), _reshape(L.dev(rstd), (N,))
        if N:
            k["rmsnorm_backward_dx"][N, _row_block(C, block)](d_dy, d_x, L.dev(w), d_rstd, _as_rows(d_dx))
        # at least one chunk, so that dw is written (zeros) when there are no rows
        chunks = max(1, _ceil_div(N, rows_per_chunk))
        pw = L.out(None, (chunks, C), np.float64)
        cb = 64
        k["rmsnorm_backward_dw_partial"][(_ceil_div(C, cb), chunks), cb](d_dy, d_x, d_rstd, pw, rows_per_chunk)
        row_kernels(x.dtype.name)["column_sum_finish"][_ceil_div(C, cb), cb](pw, d_dw, False)
    L.finish()
    return L.result(d_dx), L.result(d_dw)


def _rope(a, cos, sin, sign, block):
    L = _Launch(a, cos, sin)
    B, T, H, hd = tuple(a.shape)
    d_out = L.out(None, (B, T, H, hd), a.dtype)
    pairs = a.size // 2
    if pairs:
        llama_kernels(a.dtype.name)["rope"][_elt_grid(pairs, block), block](
            _reshape(L.dev(a), (B * T, H, hd)), L.dev(cos), L.dev(sin), _reshape(d_out, (B * T, H, hd)), sign)
    L.finish()
    return L.result(d_out)


def rope_forward(x, cos, sin, *, block=ELT_BLOCK):
    return _rope(x, cos, sin, 1, block)


def rope_backward(dy, cos, sin, *, block=ELT_BLOCK):
    return _rope(dy, cos, sin, -1, block)


def swiglu_forward(gate, up, *, block=ELT_BLOCK):
    L = _Launch(gate, up)
    d_h = L.out(None, tuple(gate.shape), gate.dtype)
    n = gate.size
    if n:
        llama_kernels(gate.dtype.name)["swiglu_forward"][_elt_grid(n, block), block](
            _reshape(L.dev(gate), (n,)), _reshape(L.dev(up), (n,)), _reshape(d_h, (n,)))
    L.finish()
    return L.result(d_h)


def swiglu_backward(dh, gate, up, *, block=ELT_BLOCK):
    L = _Launch(dh, gate, up)
    shape = tuple(gate.shape)
    d_dg, d_du = L.out(None, shape, gate.dtype), L.out(None, shape, gate.dtype)
    n = gate.size
    if n:
        llama_kernels(gate.dtype.name)["swiglu_backward"][_elt_grid(n, block), block](
            _reshape(L.dev(dh), (n,)), _reshape(L.dev(gate), (n,)), _reshape(L.dev(up), (n,)),
            _reshape(d_dg, (n,)), _reshape(d_du, (n,)))
    L.finish()
    return L.result(d_dg), L.result(d_du)
