"""
Numba CPU kernels: one kernel per op, where the reference makes several full-array
passes; each row's passes run back to back while the row is in cache.

Conventions:
  - every kernel is @njit(cache=True): the test suite and MPI runs start many
    processes, and each would otherwise pay the compile again
  - parallel=True + prange over independent rows (or fixed-size chunks of a flat
    array), so no two threads ever write the same element: no races, no atomics
  - cross-row reductions (layernorm dweight/dbias, sum_of_squares) go through
    per-chunk partial sums with a chunk size fixed by the data, not the thread
    count, so results are bitwise reproducible however many threads run
  - row statistics are accumulated in float64 (`acc = 0.0`) even for float32
    inputs; elementwise math stays in the input dtype where that is cheaper
  - fastmath stays off, so LLVM never vectorizes a float reduction on its own: the
    row helpers below sum in a few explicit chains, and elementwise loops are kept
    free of reductions (and of libm calls, see _expf) so that they do vectorize
  - the python wrappers at the bottom implement every op of the table in
    kernels/ops.py (the "numba" backend): they allocate outputs and mirror reference.py;
    inputs arrive validated (C-contiguous, matching dtypes and shapes) from
    kernels/__init__.py, which matters: numba does no bounds checking

Compilation is lazy (first call per dtype), then cached on disk next to this file.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import bf16, reference, sgemm

GELU_SCALE = reference.GELU_SCALE
GELU_CUBE = reference.GELU_CUBE

# Rows per partial-sum chunk in layernorm backward: small enough for many chunks to
# spread over threads, large enough that the (chunks, C) float64 partials stay small.
_LN_ROWS_PER_CHUNK = 32
# Elements per partial sum in flat reductions.
_FLAT_BLOCK = 1 << 14

# ---------------------------------------------------------------------------
# exp that vectorizes
#
# numba lowers math.exp to one scalar libm call per element, which also stops LLVM
# from vectorizing the loop: ~15x slower than numpy's SIMD exp on float32 (measured
# on this repo's CPU box). _expf is plain float/int arithmetic, so loops calling it
# compile to AVX. float64 keeps libm: it is the checking dtype, not the fast one.


@intrinsic
def _float32_from_bits(typingctx, bits):
    # reinterpret an int32 bit pattern as float32 (free; numba has no scalar bitcast)
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bits_from_float32(typingctx, x):
    # reinterpret a float32 as its int32 bit pattern (free)
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always")
def _bf16_bits(x):
    # float32 -> its bf16 bit pattern, the bits kernels.to_bf16 writes (bf16._to_bf16_rows:
    # nearest, ties to even; NaNs quiet), so a kernel can write a bf16 GEMM's operand itself
    u = np.int64(_bits_from_float32(x)) & 0xFFFFFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    q = (u >> 16) | 0x40
    return np.uint16((q if (u & 0x7FFFFFFF) > 0x7F800000 else r) & 0xFFFF)


# module-level numpy scalars are frozen into the kernels as float32 constants
_F32_EXP_LO = np.float32(-87.33)  # just above log(FLT_MIN): 2^k stays a normal number
_F32_EXP_HI = np.float32(88.72)  # k = 128 from here on: the 2^k bits become inf
_F32_LOG2E = np.float32(1.44269504088896341)
_F32_LN2_HI = np.float32(0.693359375)  # ln2 split in two so k*ln2 is exact in the high part
_F32_LN2_LO = np.float32(-2.12194440e-4)
_F32_HALF = np.float32(0.5)
_F32_ONE = np.float32(1.0)
_F32_EXP_POLY = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
                 np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


@njit(inline="always")
def _expf(x):
    # Cephes expf: exp(x) = 2^k exp(r), k = round(x / ln2), |r| <= ln2/2, exp(r) by a
    # polynomial. Max relative error ~1e-7 (1-2 ulp; the tests check it against
    # float64). NaN stays NaN; x < -87.33 flushes to 0; x > 88.38 gives inf (a hair
    # before true float32 overflow at 88.72, irrelevant for the max-shifted softmax
    # arguments and the tanh-via-exp here).
    xc = x
    if xc < _F32_EXP_LO:  # comparisons are False for NaN, so NaN passes through
        xc = _F32_EXP_LO
    if xc > _F32_EXP_HI:
        xc = _F32_EXP_HI
    k = np.floor(xc * _F32_LOG2E + _F32_HALF)
    r = xc - k * _F32_LN2_HI - k * _F32_LN2_LO
    c0, c1, c2, c3, c4, c5 = _F32_EXP_POLY
    p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    p = p * r * r + r + _F32_ONE
    y = p * _float32_from_bits(np.int32((np.int32(k) + 127) << 23))  # 2^k via the exponent bits
    if x < _F32_EXP_LO:
        y = np.float32(0.0)
    return y


def _exp(x):
    """exp for use inside kernels: _expf for float32, libm for float64 (chosen at compile time)."""
    return math.exp(x)


@overload(_exp)
def _exp_overload(x):
    if x == types.float32:
        return lambda x: _expf(x)
    return lambda x: math.exp(x)


@njit(inline="always")
def _row_max(a, n):
    mx = a[0]
    for j in range(1, n):
        if a[j] > mx:
            mx = a[j]
    return mx


@njit(inline="always")
def _row_sum64(a, n):
    # float64 sum of a[:n] in four chains: without fastmath a single chain is bound
    # by add latency. The order is fixed by n alone, so results are reproducible.
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += a[i]
        s1 += a[i + 1]
        s2 += a[i + 2]
        s3 += a[i + 3]
        i += 4
    while i < n:
        s0 += a[i]
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(inline="always")
def _row_sqdev64(a, n, m):
    # float64 sum of (a[:n] - m)^2, four chains as in _row_sum64
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        d0 = a[i] - m
        d1 = a[i + 1] - m
        d2 = a[i + 2] - m
        d3 = a[i + 3] - m
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
        i += 4
    while i < n:
        d = a[i] - m
        s0 += d * d
        i += 1
    return (s0 + s1) + (s2 + s3)


@njit(inline="always")
def _row_dot64(a, b, n):
    # float64 sum of a[:n] * b[:n], four chains as in _row_sum64
    s0 = 0.0
    s1 = 0.0
    s2 = 0.0
    s3 = 0.0
    i = 0
    while i + 4 <= n:
        s0 += a[i] * np.float64(b[i])
        s1 += a[i + 1] * np.float64(b[i + 1])
        s2 += a[i + 2] * np.float64(b[i + 2])
        s3 += a[i + 3] * np.float64(b[i + 3])
        i += 4
    while i < n:
        s0 += a[i] * np.float64(b[i])
        i += 1
    return (s0 + s1) + (s2 + s3)


# ---------------------------------------------------------------------------
# layernorm


@njit(cache=True, fastmath=False, parallel=True)
def _layernorm_forward(x, w, b, eps, out, mean, rstd):
    # x (N, C), w/b (C,), out (N, C), mean/rstd (N,)
    N, C = x.shape
    for n in prange(N):
        xr = x[n]
        o = out[n]
        m = _row_sum64(xr, C) / C
        # two-pass variance: E[x^2] - m^2 cancels badly for rows far from zero
        s = 1.0 / math.sqrt(_row_sqdev64(xr, C, m) / C + eps)
        for c in range(C):
            o[c] = (xr[c] - m) * s * w[c] + b[c]
        mean[n] = m
        rstd[n] = s


@njit(cache=True, fastmath=False, parallel=True)
def _layernorm_backward(dout, x, w, mean, rstd, dx, dw_part, db_part, rows_per_chunk, want_param_grads):
    # dout, x, dx (N, C); w (C,); mean, rstd (N,); dw_part, db_part (chunks, C) float64
    N, C = x.shape
    nchunks = (N + rows_per_chunk - 1) // rows_per_chunk
    for k in prange(nchunks):
        for n in range(k * rows_per_chunk, min(N, (k + 1) * rows_per_chunk)):
            xr = x[n]
            dy = dout[n]
            d = dx[n]
            m = mean[n]
            s = rstd[n]
            # two independent chains, so the reduction is not add-latency bound
            dnorm_mean = 0.0
            dnorm_norm_mean = 0.0
            for c in range(C):
                dnorm = w[c] * dy[c]
                dnorm_mean += dnorm
                dnorm_norm_mean += dnorm * ((xr[c] - m) * s)
            dnorm_mean /= C
            dnorm_norm_mean /= C
            # the loops below have no reduction and vectorize
            for c in range(C):
                norm = (xr[c] - m) * s
                d[c] = (w[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s
            if want_param_grads:
                # chunk k owns row k of the partials: race-free
                dwp = dw_part[k]
                dbp = db_part[k]
                for c in range(C):
                    dbp[c] += dy[c]
                    dwp[c] += (xr[c] - m) * s * dy[c]


# ---------------------------------------------------------------------------
# gelu, on flat views


@njit(cache=True, fastmath=False, parallel=True)
def _gelu_forward(x, out):
    # numba float literals are float64; constants typed like x keep float32 math in float32
    f = x.dtype.type
    half, one, two = f(0.5), f(1.0), f(2.0)
    s, c = f(GELU_SCALE), f(GELU_CUBE)
    for i in prange(x.shape[0]):
        xi = x[i]
        u = s * (xi + c * xi * xi * xi)
        # tanh through exp: libm tanh is scalar and ~10x slower. The absolute error
        # is ~ulp(1), which is all gelu needs since it adds tanh to 1. exp overflow
        # to inf gives t = 1 exactly, no NaN.
        t = one - two / (_exp(two * u) + one)
        out[i] = half * xi * (one + t)


@njit(cache=True, fastmath=False, parallel=True)
def _gelu_backward(dout, x, dx):
    f = x.dtype.type
    half, one, two, three = f(0.5), f(1.0), f(2.0), f(3.0)
    s, c = f(GELU_SCALE), f(GELU_CUBE)
    for i in prange(x.shape[0]):
        xi = x[i]
        u = s * (xi + c * xi * xi * xi)
        t = one - two / (_exp(two * u) + one)
        # d tanh(u) = (1 - t^2) du; 1 - t^2 rather than 1/cosh^2 cannot overflow
        local_grad = half * (one + t) + half * xi * (one - t * t) * s * (one + three * c * xi * xi)
        # read before write: dx may alias dout
        dx[i] = local_grad * dout[i]


# ---------------------------------------------------------------------------
# causal softmax; scores viewed as (R, T, T), one (r, t) query row per iteration


@njit(cache=True, fastmath=False, parallel=True)
def _softmax_causal_forward(scores, scale, out, bits, want_bits, window):
    # scale arrives in the scores dtype so float32 rows stay in float32. want_bits: also
    # the probabilities' bf16 bits into bits (R, T, T) uint16, from the row still in cache.
    # window > 0: query t sees keys lo..t only, lo = t - window + 1 (a sliding window)
    R, T, _ = scores.shape
    for rt in prange(R * T):
        r = rt // T
        t = rt - r * T
        lo = t - window + 1 if window > 0 and t - window + 1 > 0 else 0
        s = scores[r, t]  # (T,) row views; only lo <= j <= t is ever read
        o = out[r, t]
        mx = scale * s[lo]
        for j in range(lo + 1, t + 1):
            z = scale * s[j]
            if z > mx:
                mx = z
        # separate loops on purpose: the exp and scale loops touch only `o`, so they
        # vectorize even when out aliases scores (in place)
        for j in range(lo, t + 1):
            o[j] = scale * s[j] - mx
        for j in range(lo):
            o[j] = 0.0
        for j in range(lo, t + 1):
            o[j] = _exp(o[j])
        inv = 1.0 / _row_sum64(o, t + 1)      # (the zeros before lo add nothing)
        for j in range(lo, t + 1):
            o[j] *= inv
        for j in range(t + 1, T):
            o[j] = 0.0
        if want_bits:
            b = bits[r, t]
            for j in range(t + 1):
                b[j] = _bf16_bits(o[j])
            for j in range(t + 1, T):
                b[j] = 0


@njit(cache=True, fastmath=False, parallel=True)
def _softmax_causal_backward(dprobs, probs, scale, out):
    R, T, _ = probs.shape
    for rt in prange(R * T):
        r = rt // T
        t = rt - r * T
        dp = dprobs[r, t]
        p = probs[r, t]
        o = out[r, t]
        dot = _row_dot64(dp, p, t + 1)
        # read-then-write per element: out may alias dprobs
        for j in range(t + 1):
            o[j] = scale * p[j] * (dp[j] - dot)
        for j in range(t + 1, T):
            o[j] = 0.0


@njit(cache=True, fastmath=False, parallel=True)
def _softmax_causal_backward_bits(dprobs, probs, scale, bits):
    # as _softmax_causal_backward, but only the bf16 bits of dscores, into bits (R, T, T)
    # uint16: the float32 values are rounded as they are made, never stored
    R, T, _ = probs.shape
    for rt in prange(R * T):
        r = rt // T
        t = rt - r * T
        dp = dprobs[r, t]
        p = probs[r, t]
        b = bits[r, t]
        dot = _row_dot64(dp, p, t + 1)
        for j in range(t + 1):
            b[j] = _bf16_bits(np.float32(scale * p[j] * (dp[j] - dot)))
        for j in range(t + 1, T):
            b[j] = 0


# ---------------------------------------------------------------------------
# fused cross-entropy: one row of logits at a time, never a probs array


@njit(cache=True, fastmath=False, parallel=True)
def _cross_entropy(logits, targets, losses, dlogits, grad_scale, want_grad):
    # logits, dlogits (N, V); targets (N,) int64; losses (N,)
    N, V = logits.shape
    for n in prange(N):
        x = logits[n]
        mx = _row_max(x, V)
        t = targets[n]
        zt = x[t] - mx  # read first: dlogits may be logits itself
        if want_grad:
            # the softmax is built in the output row (V elements, cache-resident): one
            # exp per element and no separate probs array. Split loops as in softmax
            # so the exp/scale loops vectorize even in place.
            d = dlogits[n]
            for j in range(V):
                d[j] = x[j] - mx
            for j in range(V):
                d[j] = _exp(d[j])
            total = _row_sum64(d, V)
            c = grad_scale / total
            for j in range(V):
                d[j] *= c
            d[t] -= grad_scale
        else:
            total = 0.0
            for j in range(V):
                total += _exp(x[j] - mx)
        losses[n] = math.log(total) - zt


# ---------------------------------------------------------------------------
# optimizers: elementwise over flat arrays; prange hands each thread a contiguous range


@njit(cache=True, fastmath=False, parallel=True)
def _adamw(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bc1, bc2, mask, has_mask):
    for i in prange(p.shape[0]):
        gi = g[i]
        mi = beta1 * m[i] + (1.0 - beta1) * gi
        vi = beta2 * v[i] + (1.0 - beta2) * gi * gi
        m[i] = mi
        v[i] = vi
        wd = weight_decay * mask[i] if has_mask else weight_decay
        p[i] -= lr * ((mi / bc1) / (math.sqrt(vi / bc2) + eps) + wd * p[i])


@njit(cache=True, fastmath=False, parallel=True)
def _sgd_momentum(p, g, buf, lr, momentum, weight_decay, mask, has_mask):
    for i in prange(p.shape[0]):
        wd = weight_decay * mask[i] if has_mask else weight_decay
        b = momentum * buf[i] + (g[i] + wd * p[i])
        buf[i] = b
        p[i] -= lr * b


@njit(cache=True, fastmath=False, parallel=True)
def _sum_of_squares(x, block):
    n = x.shape[0]
    nblocks = (n + block - 1) // block
    part = np.zeros(nblocks, dtype=np.float64)
    for k in prange(nblocks):
        lo = k * block
        part[k] = _row_sqdev64(x[lo:], min(block, n - lo), 0.0)
    # blocks are fixed by n, not by the thread count: reproducible for any threads
    total = 0.0
    for k in range(nblocks):
        total += part[k]
    return total


# ---------------------------------------------------------------------------
# Llama-family ops: RMSNorm over rows, RoPE over (position, head) rows, SwiGLU flat


@njit(cache=True, fastmath=False, parallel=True)
def _rmsnorm_forward(x, w, eps, y, rstd):
    # x, y (N, C); w (C,); rstd (N,)
    N, C = x.shape
    for n in prange(N):
        xr = x[n]
        yr = y[n]
        # rounded to the dtype before use, as the reference: y agrees with the saved rstd
        r = x.dtype.type(1.0 / math.sqrt(_row_dot64(xr, xr, C) / C + eps))
        for c in range(C):
            yr[c] = (xr[c] * r) * w[c]
        rstd[n] = r


@njit(cache=True, fastmath=False, parallel=True)
def _rmsnorm_backward(dy, x, w, rstd, dx, dw_part, rows_per_chunk):
    # dy, x, dx (N, C); w (C,); rstd (N,); dw_part (chunks, C) float64, chunk k owns row k
    N, C = x.shape
    f = x.dtype.type
    nchunks = (N + rows_per_chunk - 1) // rows_per_chunk
    for k in prange(nchunks):
        dwp = dw_part[k]
        for n in range(k * rows_per_chunk, min(N, (k + 1) * rows_per_chunk)):
            xr = x[n]
            g = dy[n]
            d = dx[n]
            r = rstd[n]
            dot = 0.0
            for c in range(C):
                dot += (w[c] * g[c]) * np.float64(xr[c] * r)
            m = f(dot / C)
            # no reduction below: these loops vectorize
            for c in range(C):
                d[c] = (w[c] * g[c] - (xr[c] * r) * m) * r
            for c in range(C):
                dwp[c] += g[c] * (xr[c] * r)


@njit(cache=True, fastmath=False, parallel=True)
def _rope(x, cos, sin, y, T, sign):
    # x, y (B*T, H, hd) rows of one position; cos/sin (T, hd). sign +1: forward,
    #   y1 = x1*cos1 - x2*sin1,  y2 = x2*cos2 + x1*sin2;
    # sign -1: the transpose (backward), dx1 = dy1*cos1 + dy2*sin2, dx2 = dy2*cos2 - dy1*sin1
    R, H, hd = x.shape
    h = hd // 2
    for rt in prange(R):
        t = rt % T
        c = cos[t]
        s = sin[t]
        for head in range(H):
            xr = x[rt, head]
            yr = y[rt, head]
            for i in range(h):
                a = xr[i]
                b = xr[i + h]
                if sign > 0:
                    yr[i] = a * c[i] - b * s[i]
                    yr[i + h] = b * c[i + h] + a * s[i + h]
                else:
                    yr[i] = a * c[i] + b * s[i + h]
                    yr[i + h] = b * c[i + h] - a * s[i]


@njit(cache=True, fastmath=False, parallel=True)
def _swiglu_forward(gate, up, h):
    one = gate.dtype.type(1.0)
    for i in prange(gate.shape[0]):
        g = gate[i]
        h[i] = g / (one + _exp(-g)) * up[i]


@njit(cache=True, fastmath=False, parallel=True)
def _swiglu_backward(dh, gate, up, dgate, dup):
    one = gate.dtype.type(1.0)
    for i in prange(gate.shape[0]):
        g = gate[i]
        sig = one / (one + _exp(-g))
        d = dh[i]
        dgate[i] = d * up[i] * sig * (one + g * (one - sig))
        dup[i] = d * g * sig


# ---------------------------------------------------------------------------
# python wrappers: the "numba" backend's implementations of the op table
# (kernels/ops.py), same arguments as reference.py

# BLAS already is the fast CPU float32 GEMM; numba would only lose to it. The same goes
# for numpy's column sums (and keeping them keeps bias gradients bit-identical to before).
column_sum = reference.column_sum


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32"):
    # bf16 (asked for, or operands already bf16): the CPU's bf16 GEMM where it has one,
    # else the reference's emulation (kernels/bf16.py chooses, once)
    if precision == "bf16" or bf16.is_bf16(a) or bf16.is_bf16(b):
        return bf16.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    # float32: oneDNN's sgemm where it beats the BLAS on this host (kernels/sgemm.py chooses, once)
    if sgemm.wants(a, b, out, trans_a, trans_b):
        return sgemm.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    return reference.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)


def linear_forward(x, w, bias=None, *, gelu=False, precision="float32"):
    # as the reference, but with the numba GELU (what a separate GELU layer would run)
    return reference.bias_gelu(matmul(x, w, trans_b=True, precision=precision), bias, gelu, gelu_forward)


def layernorm_forward(x, weight, bias, eps=1e-5, out=None):
    N = x.shape[0]
    if out is None:
        out = np.empty_like(x)
    mean = np.empty(N, dtype=x.dtype)
    rstd = np.empty(N, dtype=x.dtype)
    _layernorm_forward(x, weight, bias, float(eps), out, mean, rstd)
    return out, mean, rstd


def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None):
    N, C = x.shape
    if dx is None:
        dx = np.empty_like(x)
    want = dweight is not None or dbias is not None
    nchunks = (N + _LN_ROWS_PER_CHUNK - 1) // _LN_ROWS_PER_CHUNK
    shape = (nchunks, C) if want else (0, 0)
    dw_part = np.zeros(shape, dtype=np.float64)
    db_part = np.zeros(shape, dtype=np.float64)
    _layernorm_backward(dout, x, weight, mean, rstd, dx, dw_part, db_part, _LN_ROWS_PER_CHUNK, want)
    if dweight is not None:
        dweight += dw_part.sum(axis=0).astype(dweight.dtype)
    if dbias is not None:
        dbias += db_part.sum(axis=0).astype(dbias.dtype)
    return dx


def gelu_forward(x, out=None):
    if out is None:
        out = np.empty_like(x)
    _gelu_forward(x.reshape(-1), out.reshape(-1))
    return out


def gelu_backward(dout, x, dx=None):
    if dx is None:
        dx = np.empty_like(x)
    _gelu_backward(dout.reshape(-1), x.reshape(-1), dx.reshape(-1))
    return dx


def _as_rtt(a):
    # (..., T, T) -> (R, T, T) view (inputs are C-contiguous, so no copy)
    T = a.shape[-1]
    return a.reshape(-1, T, T)


_NO_BITS = np.empty((0, 0, 0), np.uint16)


def softmax_causal_forward(scores, scale, out=None, *, bf16_out=None, window=0):
    # bf16_out (kernels.softmax_causal_forward): the bf16 bits too, in the same pass
    if out is None:
        out = np.empty_like(scores)
    if scores.size:
        bits = _NO_BITS if bf16_out is None else _as_rtt(bf16_out)
        _softmax_causal_forward(_as_rtt(scores), scores.dtype.type(scale), _as_rtt(out), bits,
                                bf16_out is not None, int(window))
    return out


def softmax_causal_backward(dprobs, probs, scale, out=None, *, bf16_out=None):
    # bf16_out (kernels.softmax_causal_backward): only the bf16 bits, no float32 out
    if bf16_out is not None:
        if probs.size:
            _softmax_causal_backward_bits(_as_rtt(dprobs), _as_rtt(probs), probs.dtype.type(scale),
                                          _as_rtt(bf16_out))
        return bf16_out
    if out is None:
        out = np.empty_like(probs)
    if probs.size:
        _softmax_causal_backward(_as_rtt(dprobs), _as_rtt(probs), probs.dtype.type(scale), _as_rtt(out))
    return out



def cross_entropy_forward_backward(logits, targets, dlogits=None, grad_scale=1.0):
    losses = np.empty(logits.shape[0], dtype=logits.dtype)
    want = dlogits is not None
    # a 1-element stand-in keeps one compiled specialization for both cases
    dl = dlogits if want else np.empty((1, 1), dtype=logits.dtype)
    _cross_entropy(logits, targets.astype(np.int64, copy=False), losses, dl, float(grad_scale), want)
    return losses, dlogits


def _mask_arg(wd_mask):
    # bool masks are read as uint8 (a view); None becomes an empty uint8 stand-in so it
    # shares the compiled specialization of the common uint8 mask
    if wd_mask is None:
        return np.empty(0, dtype=np.uint8), False
    if wd_mask.dtype == np.bool_:
        return wd_mask.view(np.uint8), True
    return wd_mask, True


def adamw_update(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None):
    mask, has_mask = _mask_arg(wd_mask)
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    _adamw(param, grad, m, v, float(lr), float(beta1), float(beta2), float(eps),
           float(weight_decay), bc1, bc2, mask, has_mask)


def sgd_momentum_update(param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None):
    mask, has_mask = _mask_arg(wd_mask)
    _sgd_momentum(param, grad, buf, float(lr), float(momentum), float(weight_decay), mask, has_mask)


def sum_of_squares(x):
    return float(_sum_of_squares(x.reshape(-1), _FLAT_BLOCK))


def _rows(a):
    # (..., C) -> (N, C) view (inputs are C-contiguous, so no copy)
    return a.reshape(-1, a.shape[-1])


def rmsnorm_forward(x, w, eps=1e-5):
    y = np.empty_like(x)
    rstd = np.empty(x.shape[:-1], dtype=x.dtype)
    _rmsnorm_forward(_rows(x), w, float(eps), _rows(y), rstd.reshape(-1))
    return y, rstd


def rmsnorm_backward(dy, x, w, rstd):
    x2 = _rows(x)
    N, C = x2.shape
    dx = np.empty_like(x)
    dw_part = np.zeros(((N + _LN_ROWS_PER_CHUNK - 1) // _LN_ROWS_PER_CHUNK, C), dtype=np.float64)
    _rmsnorm_backward(_rows(dy), x2, w, rstd.reshape(-1), _rows(dx), dw_part, _LN_ROWS_PER_CHUNK)
    # chunks fixed by N, summed in order: reproducible for any thread count
    return dx, dw_part.sum(axis=0).astype(x.dtype)


def _rope_call(a, cos, sin, sign):
    B, T, H, hd = a.shape
    out = np.empty_like(a)
    _rope(a.reshape(B * T, H, hd), cos, sin, out.reshape(B * T, H, hd), T, sign)
    return out


def rope_forward(x, cos, sin):
    return _rope_call(x, cos, sin, 1)


def rope_backward(dy, cos, sin):
    return _rope_call(dy, cos, sin, -1)


def swiglu_forward(gate, up):
    h = np.empty_like(gate)
    _swiglu_forward(gate.reshape(-1), up.reshape(-1), h.reshape(-1))
    return h


def swiglu_backward(dh, gate, up):
    dgate, dup = np.empty_like(gate), np.empty_like(gate)
    _swiglu_backward(dh.reshape(-1), gate.reshape(-1), up.reshape(-1), dgate.reshape(-1), dup.reshape(-1))
    return dgate, dup
