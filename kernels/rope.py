"""
The cos/sin tables of rotary position embedding (kernels.rope_forward / rope_backward),
in transformers' half-split layout: row t is cat(t * inv_freq, t * inv_freq) through
cos and sin, inv_freq[i] = theta^(-2i/hd), so the two halves of a head share one
frequency each.

Llama 3's frequency scaling ("rope_type": "llama3" in a Hugging Face config) is applied
to inv_freq exactly as transformers' `_compute_llama3_parameters`: long wavelengths
(beyond original_max_position_embeddings / low_freq_factor) are divided by `factor`,
short ones (below .../high_freq_factor) kept, and those between interpolated smoothly.

Precision: the tables are computed in float64 and rounded to `dtype` once. transformers
computes inv_freq, the phases t * inv_freq and their cos/sin in float32 whatever the
model's dtype (a float32 phase at position 4096 is off by ~1e-4), and numpy's float32
pow/cos differ from torch's in the last bit, so no numpy code reproduces those tables
bit for bit; tests/kernels/test_llama_kernels.py compares against transformers' own
code run in float64 instead.

Host-side numpy only: a GPU run copies the (small) tables over once.
"""

import math

import numpy as np

LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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


def rope_inv_freq(hd, theta, scaling=None):
    """(hd/2,) inverse frequencies theta^(-2i/hd), Llama-3-scaled if scaling is given."""
    if not isinstance(hd, int) or hd < 2 or hd % 2:
        raise ValueError(f"rope: head size must be an even int >= 2, got {hd!r}")
    if not theta > 0:
        raise ValueError(f"rope: theta must be > 0, got {theta!r}")
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if scaling is None:
        return inv_freq
    if not isinstance(scaling, dict):
        raise ValueError(f"rope scaling must be None or a dict of {', '.join(LLAMA3_SCALING_KEYS)}, got {scaling!r}")
    return llama3_inv_freq(inv_freq, scaling)


def rope_tables(T, hd, theta, scaling=None, dtype=np.float64):
    """(cos, sin), each (T, hd) in dtype, for positions 0..T-1 in the half-split layout.

    theta: the RoPE base (rope_theta). scaling: None, or Llama 3's rope_scaling dict
    (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings);
    other keys (rope_type) are ignored."""
    if not isinstance(T, int) or T < 1:
        raise ValueError(f"rope_tables: T (positions) must be an int >= 1, got {T!r}")
    inv_freq = rope_inv_freq(hd, theta, scaling)
    phase = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    phase = np.concatenate([phase, phase], axis=1)  # both halves of a head share a frequency
    return np.ascontiguousarray(np.cos(phase), dtype=dtype), np.ascontiguousarray(np.sin(phase), dtype=dtype)
