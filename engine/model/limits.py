"""The largest model ringpipe builds, as one set of bounds, and the checks of a model
config's values (type and range) its validate() makes.

A model's shape arrives from places that cannot be trusted to hold sane numbers: a
checkpoint's manifest (a JSON file anyone can edit), a Hugging Face config.json, a Config
made in a notebook. A NaN, a string or a size of 10^12 that reaches the kernels fails
there with a traceback, runs for hours, or computes garbage. So every value is checked
before a model is built, against these bounds: far past every real model, far below a
size that costs minutes or gigabytes before anything else notices. What fits in memory
is check_memory's to say (engine/train/config.py), once the shape is known.

The bounds are shared: the model configs' validate() (gpt.py, llama.py, mlp.py), the
run's settings (engine/train/ranges.py) and a Hugging Face config.json
(engine/interop/hf_values.py) all take them from here, so a shape one accepts the others
accept. This module imports nothing of ringpipe's but the error it raises.
"""
from __future__ import annotations

import math
import numbers

from ringpipe.engine.job.errors import ConfigError

MAX_LAYERS = 2**14          # blocks: the deepest published transformers have a few hundred
MAX_WIDTH = 2**20           # d_model, head_dim: the widest real models are 16k-25k (Llama 3 405B: 16,384)
MAX_HEADS = 2**16           # attention heads: real models have up to 128
MAX_FFN = 2**22             # d_ff: real models up to 73,728 (PaLM)
MAX_CONTEXT = 2**24         # positions: Llama 4 Scout's context is 10M
MAX_VOCAB = 2**32           # token ids are stored as uint32 at most (engine/data/tokenizer.py)
MAX_ROPE_THETA = 1e12       # the rotary base: Llama 3 500,000; Qwen2 1,000,000
MAX_ROPE_FACTOR = 2.0**16   # Llama 3's scaling: factor 8 to 32, low_freq_factor 1, high_freq_factor 4


def check_whole(what: str, value, low: int, high: int, none: str = "") -> None:
    """Refuse `value` unless it is a whole number (not a bool, not 8.0) from low to high;
    what: the value's name in the refusal ("Llama <n_layer>"); none: what None means, where
    None is allowed (the rule then says so)."""
    if value is None and none:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not low <= value <= high:
        rule = f"a whole number from {low:,} to {high:,}" + (f" (or None: {none})" if none else "")
        raise ConfigError(f"{what} must be {rule}, got {shown(value)}")


def check_number(what: str, value, low: float, high: float, open_low=True, open_high=False) -> None:
    """Refuse `value` unless it is a finite number (an int or a float, not a bool) in the
    range from low to high, each end open (excluded) or not."""
    fits = (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and (isinstance(value, numbers.Integral) or math.isfinite(value))     # a huge int has no float
            and (low < value if open_low else low <= value) and (value < high if open_high else value <= high))
    if not fits:
        rule = f"{'>' if open_low else '>='} {low:g} and {'<' if open_high else '<='} {high:g}"
        raise ConfigError(f"{what} must be {rule} (a finite number), got {shown(value)}")


def check_switch(what: str, value) -> None:
    """Refuse `value` unless it is True or False (a 5 or "yes" would be taken as on)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{what} must be true or false, got {shown(value)}")


def shown(value) -> str:
    """A value as a refusal shows it: cut short when long, a huge whole number by its digits
    (printing one of 5,000 digits is itself refused by Python)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a whole number of {int(math.log10(abs(value))) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
