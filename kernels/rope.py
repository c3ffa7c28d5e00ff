"""
The cos/sin tables of rotary position embedding (kernels.rope_forward / rope_backward),
in transformers' half-split layout: row t is cat(t * inv_freq, t * inv_freq) through
cos and sin, inv_freq[i] = theta^(-2i/hd), so the two halves of a head share one
frequency each.

Llama 3's frequency scaling ("rope_type": "llama3" in a Hugging Face config) is applied
to inv_freq exactly as transformers' `_compute_llama3_parameters`: long wavelengths
(beyond original_max_position_embeddings / low_freq_factor) are divided by `factor`,
short ones (below .../high_freq_factor) kept, and those between interpolated smoothly.

Precision. transformers computes inv_freq, the phases t * inv_freq and their cos/sin
in float32 whatever the model's dtype (and so did Meta's reference code the weights
were trained with); a float32 phase at position 4096 is off by ~1e-4. phase_dtype=
"float64" (the default) gives the exact tables. phase_dtype="float32" follows
transformers' float32 steps (float32 inv_freq and phase; cos/sin of that phase
rounded to float32), which lands within one float32 ulp of its tables: numpy's and
torch's float32 pow/cos differ in the last bit on a few percent of entries, so
nothing outside torch reproduces them bit for bit.

Host-side numpy only: a GPU run copies the (small) tables over once.
"""

import math

import numpy as np

LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
PHASE_DTYPES = {"float64": np.float64, "float32": np.float32}


def llama3_inv_freq(inv_freq, scaling):
    """inv_freq (hd/2,) scaled as Llama 3 does (transformers' _compute_llama3_parameters),
    computed in inv_freq's dtype. scaling: a dict with LLAMA3_SCALING_KEYS."""
    missing = [k for k in LLAMA3_SCALING_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope scaling {dict(scaling)!r} lacks {', '.join(missing)}: Llama 3 scaling needs "
                         f"{', '.join(LLAMA3_SCALING_KEYS)}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    if not (factor > 0 and 0 < low < high and old_context > 0):
        raise ValueError(f"rope scaling {dict(scaling)!r}: needs factor > 0, 0 < low_freq_factor < high_freq_factor "
                         "and original_max_position_embeddings > 0")
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(inv_freq.dtype, copy=False)


def rope_inv_freq(hd, theta, scaling=None, phase_dtype="float64"):
    """(hd/2,) inverse frequencies theta^(-2i/hd), Llama-3-scaled if scaling is given."""
    if not isinstance(hd, int) or hd < 2 or hd % 2:
        raise ValueError(f"rope: head size must be an even int >= 2, got {hd!r}")
    if not theta > 0:
        raise ValueError(f"rope: theta must be > 0, got {theta!r}")
    if phase_dtype not in PHASE_DTYPES:
        raise ValueError(f"rope: phase_dtype must be one of {', '.join(PHASE_DTYPES)}, got {phase_dtype!r}")
    f = PHASE_DTYPES[phase_dtype]
    exponents = np.arange(0, hd, 2).astype(f) / f(hd)
    inv_freq = (f(1.0) / (f(theta) ** exponents)).astype(f)
    if scaling is None:
        return inv_freq
    if not isinstance(scaling, dict):
        raise ValueError(f"rope scaling must be None or a dict of {', '.join(LLAMA3_SCALING_KEYS)}, got {scaling!r}")
    return llama3_inv_freq(inv_freq, scaling)


def rope_tables(T, hd, theta, scaling=None, dtype=np.float64, *, phase_dtype="float64"):
    """(cos, sin), each (T, hd) in dtype, for positions 0..T-1 in the half-split layout.

    theta: the RoPE base (rope_theta). scaling: None, or Llama 3's rope_scaling dict
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    phase_dtype: "float64" (exact), or "float32" to follow transformers' float32 steps
    (see the module docstring)."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"rope_tables: T (positions) must be an int >= 1, got {T!r}")
    inv_freq = rope_inv_freq(hd, theta, scaling, phase_dtype)
    f = inv_freq.dtype.type
    phase = np.arange(T).astype(f)[:, None] * inv_freq[None, :]
    phase = np.concatenate([phase, phase], axis=1)
    # cos/sin of the float32 phase taken in float64 and rounded: correctly rounded,
    # which is the closest numpy gets to torch's float32 cos
    cos = np.cos(phase.astype(np.float64)).astype(f)
    sin = np.sin(phase.astype(np.float64)).astype(f)
    return np.ascontiguousarray(cos, dtype=dtype), np.ascontiguousarray(sin, dtype=dtype)
