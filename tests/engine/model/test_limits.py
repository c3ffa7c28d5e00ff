"""Issue 34: every model config's validate() checks each value's type and range (engine/model/
limits.py), whoever made it: a checkpoint's manifest, a notebook's Config. Before, only "< 1"
was checked: a float layer count, a vocabulary of 10^12, a NaN or string rope_theta, an
rms_eps of 5, a qkv_bias of "yes" or a RoPE factor of 1e300 passed (or failed with a
TypeError), and reached the kernels. The bounds are one set, shared with the flags' ranges
and a Hugging Face config.json's rules."""
import math
import re

import pytest

from ringpipe.engine.interop import hf_values
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model import limits
from ringpipe.engine.model.gpt import GPTConfig
from ringpipe.engine.model.llama import LlamaConfig
from ringpipe.engine.model.mlp import MLPConfig
from ringpipe.engine.train import ranges

LLAMA = dict(n_layer=1, d_model=16, n_head=2, n_kv_head=1, d_ff=32, context=16, vocab=256)
LLAMA3 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("change, says", [
    (dict(n_layer=2.0), "GPT n_layer must be a whole number from 1 to 16,384, got 2.0"),
    (dict(n_layer=True), "GPT n_layer must be a whole number"),
    (dict(n_layer=2**14 + 1), "GPT n_layer must be a whole number from 1 to 16,384, got 16385"),
    (dict(d_model=2**20 + 64), "GPT d_model must be a whole number from 1 to 1,048,576"),
    (dict(n_head="2"), "GPT n_head must be a whole number"),
    (dict(context=float("nan")), "GPT context must be a whole number"),
    (dict(vocab=10**40), "GPT vocab must be a whole number from 1 to 4,294,967,296, got a whole number of 41 digits"),
    (dict(n_layer=0), "GPT n_layer must be a whole number from 1"),
])
def test_gpt_values_are_checked(change, says):
    with pytest.raises(ConfigError, match=_exactly(says)):
        GPTConfig(**dict(dict(n_layer=1, d_model=16, n_head=2, context=16, vocab=256), **change)).validate()


@pytest.mark.parametrize("change, says", [
    (dict(n_layer=1.5), "Llama n_layer must be a whole number"),
    (dict(n_kv_head=1.0), "Llama n_kv_head must be a whole number from 1 to 65,536 (or None: as many as heads)"),
    (dict(d_ff=2**22 + 1), "Llama d_ff must be a whole number from 1 to 4,194,304"),
    (dict(head_dim=0), "Llama head_dim must be a whole number from 2"),
    (dict(context=2**24 + 1), "Llama context must be a whole number from 1 to 16,777,216"),
    (dict(rope_theta=float("nan")), "Llama rope_theta must be > 0 and <= 1e+12 (a finite number), got nan"),
    (dict(rope_theta=float("inf")), "Llama rope_theta must be > 0 and <= 1e+12"),
    (dict(rope_theta=1e300), "Llama rope_theta must be > 0 and <= 1e+12"),
    (dict(rope_theta="10000"), "Llama rope_theta must be > 0"),
    (dict(rope_theta=None), "Llama rope_theta must be > 0"),
    (dict(rms_eps=5.0), "Llama rms_eps must be > 0 and < 1"),
    (dict(rms_eps=True), "Llama rms_eps must be > 0 and < 1"),
    (dict(rms_eps=-1e-5), "Llama rms_eps must be > 0"),
    (dict(tie_embeddings=1), "Llama tie_embeddings must be true or false, got 1"),
    (dict(qkv_bias="yes"), "Llama qkv_bias must be true or false, got 'yes'"),
    (dict(rope_scaling=dict(LLAMA3, factor=float("nan"))), "Llama rope_scaling's factor must be > 0 and <= 65536"),
    (dict(rope_scaling=dict(LLAMA3, factor=1e300)), "Llama rope_scaling's factor must be > 0 and <= 65536"),
    (dict(rope_scaling=dict(LLAMA3, factor="8")), "Llama rope_scaling's factor must be > 0"),
    (dict(rope_scaling=dict(LLAMA3, low_freq_factor=0.0)), "Llama rope_scaling's low_freq_factor must be > 0"),
    (dict(rope_scaling=dict(LLAMA3, high_freq_factor=float("inf"))), "rope_scaling's high_freq_factor must be > 0"),
    (dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=8.0)),
     "Llama rope_scaling's original_max_position_embeddings must be a whole number from 1 to 16,777,216"),
    (dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=0)),
     "Llama rope_scaling's original_max_position_embeddings must be a whole number from 1"),
])
def test_llama_values_are_checked(change, says):
    with pytest.raises(ConfigError, match=_exactly(says)):
        LlamaConfig(**dict(LLAMA, **change)).validate()


@pytest.mark.parametrize("change, says", [
    (dict(hidden=64.0), "MLP hidden must be a whole number from 1 to 1,048,576, got 64.0"),
    (dict(n_layer=10**6), "MLP n_layer must be a whole number from 1 to 16,384"),
    (dict(n_in=None), "MLP n_in must be a whole number"),
    (dict(n_classes=2**32 + 1), "MLP n_classes must be a whole number from 1 to 4,294,967,296"),
])
def test_mlp_values_are_checked(change, says):
    with pytest.raises(ConfigError, match=_exactly(says)):
        MLPConfig(**change).validate()


def test_real_shapes_and_their_limits_pass():
    """The bounds refuse nothing real: the presets, numpy's integers, the largest shape allowed."""
    import numpy as np
    from ringpipe.engine.model.llama import PRESETS
    for preset in PRESETS.values():
        LlamaConfig(**preset).validate()
    LlamaConfig(**dict(LLAMA, rope_theta=10000, rope_scaling=dict(LLAMA3))).validate()      # JSON's 10000: an int
    GPTConfig(n_layer=np.int64(2), d_model=16, n_head=2, context=16, vocab=256).validate()
    GPTConfig(n_layer=limits.MAX_LAYERS, d_model=limits.MAX_WIDTH, n_head=2, context=limits.MAX_CONTEXT,
              vocab=limits.MAX_VOCAB).validate()
    MLPConfig(n_in=784, hidden=256, n_layer=2, n_classes=10).validate()


def test_the_bounds_are_one_set():
    """The flags' ranges and config.json's rules take the model's bounds: a shape one of them
    accepts, the model accepts (no third copy of the numbers)."""
    assert ranges.RANGES["layers"].high == hf_values.RULES["num_hidden_layers"].high == limits.MAX_LAYERS
    assert ranges.RANGES["d_model"].high == hf_values.RULES["hidden_size"].high == limits.MAX_WIDTH
    assert ranges.RANGES["heads"].high == hf_values.RULES["num_attention_heads"].high == limits.MAX_HEADS
    assert ranges.RANGES["d_ff"].high == hf_values.RULES["intermediate_size"].high == limits.MAX_FFN
    assert ranges.RANGES["context"].high == hf_values.RULES["max_position_embeddings"].high == limits.MAX_CONTEXT
    assert ranges.RANGES["rope_theta"].high == hf_values.RULES["rope_theta"].high == limits.MAX_ROPE_THETA
    assert hf_values.RULES["vocab_size"].high == limits.MAX_VOCAB
    assert hf_values.RULES["factor"].high == limits.MAX_ROPE_FACTOR
    assert math.isfinite(limits.MAX_ROPE_THETA)


def _exactly(text):
    """The refusal as str() shows it (a <field> by its name: engine/job/errors.py), matched literally."""
    return re.escape(text)
