"""The record of one Hugging Face class (families/__init__.py says what each field means)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    defaults: dict
    parts: dict = field(default_factory=dict)
    windows: str = "none"
    window_switch: str | None = None
    read: Callable | None = None
    rope: Callable | None = None
    check: Callable | None = None
    window_layers: Callable | None = None
    drop: tuple = ()
    write: Callable | None = None


# The LlamaConfig fields a class may fix, with the value of a plain Llama: a model's parts are
# these fields' values (nope_layers as "has NoPE blocks").
PART_DEFAULTS = {"qkv_bias": False, "qk_norm": "none", "norm_place": "pre", "rms_offset": 0.0, "mlp_act": "silu",
                 "embed_scale": False, "nope": False}


def parts_of(cfg) -> dict:
    """A LlamaConfig's parts, as PART_DEFAULTS names them."""
    return {**{name: getattr(cfg, name) for name in PART_DEFAULTS if name != "nope"}, "nope": bool(cfg.nope_layers)}


def signature(family: Family) -> dict:
    return {**PART_DEFAULTS, **family.parts}


