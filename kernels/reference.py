"""
Plain array-module reference implementations of every op in the table (kernels/ops.py).

These are the ground truth the fast kernels are tested against, and what runs for
backend="numpy". They favour obviousness over speed, but stay vectorized so the
reference path is still usable for training. Written against `xp`, so they run on
numpy and cupy alike. Inputs are assumed validated by kernels/__init__.py.

Row statistics (means, variances, softmax normalizers) are summed in float64 so
that the float32 reference is at least as accurate as the kernels it checks.
"""

import math

import numpy as np

from .arrays import get_array_module

# ---------------------------------------------------------------------------
# matmul


def _op(x, trans):
    # transpose of the last two dims as a view: BLAS takes the transpose flag, no copy
    return x.swapaxes(-1, -2) if trans else x


def round_to_bf16(x):
    """float32 -> float32 holding the nearest bfloat16 (round half to even), any shape.

    bfloat16 is the top 16 bits of a float32. Adding 0x7FFF plus the lowest kept bit
    and truncating rounds to nearest, ties to even; a carry out of the mantissa bumps
    the exponent, which is the right answer (up to inf). A NaN whose payload sits in
    the low bits would carry into inf, so NaNs keep sign and top bits, quiet bit set.
    """
    xp = get_array_module(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (u | 0x00400000) & 0xFFFF0000, rounded).view(xp.float32)


def _is_bf16(x):
    return x.dtype == np.uint16 or x.dtype.name == "bfloat16"


def _from_bf16(x):
    # bf16 bit patterns -> the float32 of the same value (bf16 is float32's top half)
    return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32"):
    xp = get_array_module(a, b, out)
    if _is_bf16(a) or _is_bf16(b):
        # operands already bf16 (uint16 bit patterns, or ml_dtypes.bfloat16): widened
        # exactly to float32; a float32 partner is still rounded
        a, b = (_from_bf16(x) if _is_bf16(x) else x for x in (a, b))
        precision = "bf16"
    if precision == "bf16":
        # bf16 inputs, float32 products and sums: a product of two 8-bit significands
        # is exact in float32, so only the accumulation rounds, as on tensor cores
        a, b = round_to_bf16(a), round_to_bf16(b)
    a, b = _op(a, trans_a), _op(b, trans_b)
    if accumulate:
        # BLAS could do beta=1 for us, but xp.matmul has no beta; one temporary is fine
        out += xp.matmul(a, b)
        return out
    if out is None:
        return xp.matmul(a, b)
    return xp.matmul(a, b, out=out)


def linear_forward(x, w, bias=None, *, gelu=False, precision="float32"):
    # x (N, C_in), w (C_out, C_in), bias (C_out,) -> y (N, C_out), pre (N, C_out) or None
    return bias_gelu(matmul(x, w, trans_b=True, precision=precision), bias, gelu, gelu_forward)


def bias_gelu(y, bias, gelu, gelu_forward):
    """The unfused tail of linear_forward on the GEMM output y (N, C_out), in place:
    (y (+ bias) [-> gelu_forward], pre or None). Each backend passes its own GELU."""
    if bias is not None:
        y += bias
    if not gelu:
        return y, None
    return gelu_forward(y), y


def column_sum(x, out=None, *, accumulate=False):
    # x (N, C) -> out (C,). Summed in x's dtype, the way the engine always summed its
    # bias gradients, so CPU training stays bit-identical to before this op existed
    s = x.sum(axis=0)
    if out is None:
        return s
    if accumulate:
        out += s
    else:
        out[...] = s
    return out


# ---------------------------------------------------------------------------
# layernorm


def layernorm_forward(x, weight, bias, eps=1e-5, out=None):
    # x (N, C), weight/bias (C,) -> out (N, C), mean/rstd (N,)
    xp = get_array_module(x)
    mean = x.mean(axis=1, dtype=xp.float64)
    var = ((x - mean[:, None]) ** 2).mean(axis=1, dtype=xp.float64)  # two-pass: no cancellation
    rstd = 1.0 / xp.sqrt(var + eps)
    mean, rstd = mean.astype(x.dtype), rstd.astype(x.dtype)
    norm = (x - mean[:, None]) * rstd[:, None]
    if out is None:
        out = xp.empty_like(x)
    out[...] = norm * weight + bias
    return out, mean, rstd


def layernorm_backward(dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None):
    # dout, x (N, C); weight (C,); mean, rstd (N,)
    # y = norm * w + b with norm = (x - mean) * rstd. Differentiating through mean and rstd:
    #   dx = rstd * (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm)),  dnorm = dout * w
    xp = get_array_module(x)
    norm = (x - mean[:, None]) * rstd[:, None]
    dnorm = dout * weight
    dnorm_mean = dnorm.mean(axis=1, keepdims=True, dtype=xp.float64)
    dnorm_norm_mean = (dnorm * norm).mean(axis=1, keepdims=True, dtype=xp.float64)
    if dx is None:
        dx = xp.empty_like(x)
    dx[...] = (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[:, None]
    if dbias is not None:
        dbias += dout.sum(axis=0, dtype=xp.float64).astype(dbias.dtype)
    if dweight is not None:
        dweight += (norm * dout).sum(axis=0, dtype=xp.float64).astype(dweight.dtype)
    return dx


# ---------------------------------------------------------------------------
# gelu (tanh approximation, as in GPT-2)

GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBE = 0.044715


def gelu_forward(x, out=None):
    xp = get_array_module(x)
    # x * x * x, not x**3: numpy's float32 power is ~60x slower than two multiplies
    y = 0.5 * x * (1.0 + xp.tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x)))
    if out is None:
        return y.astype(x.dtype, copy=False)
    out[...] = y
    return out


def gelu_backward(dout, x, dx=None):
    xp = get_array_module(x)
    t = xp.tanh(GELU_SCALE * (x + GELU_CUBE * x * x * x))
    # d/dx tanh(u) = (1 - tanh^2 u) u'; 1 - t^2 instead of 1/cosh^2 cannot overflow
    local_grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x)
    if dx is None:
        dx = xp.empty_like(x)
    dx[...] = local_grad * dout
    return dx


# ---------------------------------------------------------------------------
# causal softmax over attention scores (..., T, T)


def _causal_mask(xp, T):
    # (T, T) True where key j may be attended from query t, i.e. j <= t
    return xp.tril(xp.ones((T, T), dtype=bool))


def write_bf16_bits(x, bf16_out):
    """bf16_out (uint16, x's shape) = the bf16 bits of float32 x (as kernels.to_bf16); returns it.
    What a backend without a fused kernel does with a softmax's bf16_out."""
    xp = get_array_module(x)
    bf16_out[...] = (round_to_bf16(x).view(xp.uint32) >> 16).astype(xp.uint16)
    return bf16_out


def softmax_causal_forward(scores, scale, out=None, *, bf16_out=None, window=0):
    xp = get_array_module(scores)
    T = scores.shape[-1]
    mask = _causal_mask(xp, T)
    if window:                 # a sliding window: key j is seen by query t when j > t - window
        mask = mask & (xp.arange(T)[None, :] > xp.arange(T)[:, None] - window)
    z = xp.where(mask, scores * scale, -xp.inf)
    z = z - z.max(axis=-1, keepdims=True)  # the diagonal is always unmasked, so max is finite
    e = xp.exp(z)  # exp(-inf) = 0 above the diagonal
    probs = e / e.sum(axis=-1, keepdims=True, dtype=xp.float64)
    if out is None:
        out = probs.astype(scores.dtype)
    else:
        out[...] = probs  # safe when out is scores: everything above was a temporary
    if bf16_out is not None:
        write_bf16_bits(out, bf16_out)
    return out


def softmax_causal_backward(dprobs, probs, scale, out=None, *, bf16_out=None):
    # softmax Jacobian-vector product: dz_j = p_j (dp_j - sum_k dp_k p_k), then chain through scale
    xp = get_array_module(probs)
    T = probs.shape[-1]
    mask = _causal_mask(xp, T)
    # where, not a multiply by the mask: dprobs above the diagonal may hold anything
    dot = xp.where(mask, dprobs * probs, 0.0).sum(axis=-1, keepdims=True, dtype=xp.float64)
    dscores = xp.where(mask, scale * probs * (dprobs - dot), 0.0)
    if bf16_out is not None:
        return write_bf16_bits(dscores.astype(probs.dtype), bf16_out)
    if out is None:
        return dscores.astype(probs.dtype)
    out[...] = dscores
    return out


# ---------------------------------------------------------------------------
# fused cross-entropy


def cross_entropy_forward_backward(logits, targets, dlogits=None, grad_scale=1.0):
    # logits (N, V), targets (N,) -> losses (N,), dlogits (N, V) or None
    xp = get_array_module(logits)
    N = logits.shape[0]
    rows = xp.arange(N)
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + xp.log(xp.exp(logits - m).sum(axis=1, dtype=xp.float64))
    losses = (lse - logits[rows, targets]).astype(logits.dtype)
    if dlogits is None:
        return losses, None
    # losses are final before dlogits is written, so dlogits may be logits itself;
    # softmax is formed directly in dlogits, no separate probs array
    xp.subtract(logits, lse[:, None].astype(logits.dtype), out=dlogits)
    xp.exp(dlogits, out=dlogits)
    dlogits[rows, targets] -= 1.0
    dlogits *= grad_scale
    return losses, dlogits


# ---------------------------------------------------------------------------
# optimizers (in place on flat 1D arrays)


def _mask(p, wd_mask):
    return 1.0 if wd_mask is None else wd_mask.astype(p.dtype)


def adamw_update(param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None):
    xp = get_array_module(param)
    m *= beta1
    m += (1.0 - beta1) * grad
    v *= beta2
    v += (1.0 - beta2) * grad * grad
    mhat = m / (1.0 - beta1**step)
    vhat = v / (1.0 - beta2**step)
    # decoupled weight decay: applied to the parameter, not folded into the gradient
    param -= lr * (mhat / (xp.sqrt(vhat) + eps) + weight_decay * _mask(param, wd_mask) * param)


def sgd_momentum_update(param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None):
    # PyTorch convention: L2 decay folded into the gradient, no dampening
    g = grad + weight_decay * _mask(param, wd_mask) * param
    buf *= momentum
    buf += g
    param -= lr * buf


def sum_of_squares(x):
    xp = get_array_module(x)
    return float(xp.sum(xp.square(x, dtype=xp.float64)))


# ---------------------------------------------------------------------------
# Llama-family ops: RMSNorm, rotary position embedding, SwiGLU


def rmsnorm_forward(x, w, eps=1e-5):
    # x (..., C), w (C,) -> y (..., C), rstd (...,). Order as transformers' LlamaRMSNorm:
    # (x * rstd) * w, so float64 agrees with it to the last bits
    xp = get_array_module(x)
    ms = (x * x).mean(axis=-1, dtype=xp.float64)
    rstd = xp.asarray(1.0 / xp.sqrt(ms + eps), dtype=x.dtype)  # an array even for 1D x (shape ())
    return (x * rstd[..., None]) * w, rstd


def rmsnorm_backward(dy, x, w, rstd):
    # y = w * xhat with xhat = x * rstd, rstd = (mean_c(x^2) + eps)^-1/2. Through rstd:
    #   dx = rstd * (g - xhat * mean_c(g * xhat)),  g = dy * w;   dw = sum_rows dy * xhat
    xp = get_array_module(x)
    C = x.shape[-1]
    xhat = x * rstd[..., None]
    g = dy * w
    dot = (g * xhat).mean(axis=-1, keepdims=True, dtype=xp.float64)
    dx = ((g - xhat * dot) * rstd[..., None]).astype(x.dtype)
    dw = (dy * xhat).reshape(-1, C).sum(axis=0, dtype=xp.float64).astype(x.dtype)
    return dx, dw


def _rotate_half(xp, x):
    # transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim
    h = x.shape[-1] // 2
    return xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope_forward(x, cos, sin):
    # x (B, T, H, hd), cos/sin (T, hd): y = x * cos + rotate_half(x) * sin, per head
    xp = get_array_module(x)
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return x * c + _rotate_half(xp, x) * s


def rope_backward(dy, cos, sin):
    # the transpose of y = x*cos + R x*sin, R = rotate_half (R^T = -R):
    #   dx = dy * cos - R(dy * sin)
    xp = get_array_module(dy)
    c, s = cos[:, None, :], sin[:, None, :]
    return dy * c - _rotate_half(xp, dy * s)


def _sigmoid(gate):
    # 1 / (1 + exp(-g)): exp overflows to inf for g << 0 and gives exactly 0, the right
    # limit; numpy would warn about that overflow on every such call (cupy does not)
    xp = get_array_module(gate)
    if xp is np:
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + np.exp(-gate))
    return 1.0 / (1.0 + xp.exp(-gate))


def swiglu_forward(gate, up):
    # h = silu(gate) * up, silu(g) = g * sigmoid(g)
    return gate * _sigmoid(gate) * up


def swiglu_backward(dh, gate, up):
    # dgate = dh * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dh * silu(g)
    sig = _sigmoid(gate)
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dh * gate * sig
    return dgate.astype(gate.dtype, copy=False), dup.astype(gate.dtype, copy=False)
