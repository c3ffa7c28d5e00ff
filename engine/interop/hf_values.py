"""config.json's values: one rule per key ringpipe reads (its type and its range), and the
wording of a refusal, for GPT-2 (hf.py) and the Llama family (hf_llama.py).

JSON holds what Python's json module reads: NaN, Infinity, integers of any size, 8.0 where
8 is meant, true where 1 is. Every value read from a config.json is checked here before
anything is built or any tensor read, so a damaged or hand-edited file is refused naming
its key, rather than failing later in a kernel (a NaN RoPE factor), costing minutes and
gigabytes (a huge size), or being read as something else (true taken as 1, "0.1" ignored).

Two kinds of refusal, worded so that what to do comes first:
    invalid(where, key, value, expected)   a value no model is saved with: set it
    unsupported(where, key, value, ...)    a valid model ringpipe computes differently: say
                                           that ringpipe cannot fine-tune it, and what to use
"""
from __future__ import annotations

import dataclasses
import math

# The sane maxima are the model's own (engine/model/limits.py): far beyond any published
# model, far below a size that would cost memory or time before the tensors are found to
# disagree with it. MAX_CONTEXT bounds a sliding window's tokens too.
from ringpipe.engine.model.limits import (MAX_CONTEXT, MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_ROPE_FACTOR,
                                          MAX_ROPE_THETA, MAX_VOCAB, MAX_WIDTH)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What a config.json value may be.

    kind: "int" (a JSON whole number: not true, not 8.0), "number" (an int or a float,
    finite), "bool" (true or false), "str". low, high: the range, inclusive unless
    open_low / open_high. null: JSON null is allowed (transformers' "not set")."""
    kind: str
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    null: bool = False

    def holds(self, value) -> bool:
        if value is None:
            return self.null
        if self.kind in ("bool", "str"):
            return type(value) is (bool if self.kind == "bool" else str)
        if type(value) is not int and (self.kind == "int" or type(value) is not float or not math.isfinite(value)):
            return False                         # bool is not an int: type(True) is bool
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or (value < self.high if self.open_high else value <= self.high)

    def expected(self) -> str:
        """What the rule asks for, in words: "a whole number from 1 to 1,048,576"."""
        words = {"bool": "true or false", "str": "a string"}.get(self.kind)
        if words is None:
            words = "a whole number" if self.kind == "int" else "a finite number"
            if self.low is not None and self.high is not None and not (self.open_low or self.open_high):
                words += f" from {_number(self.low)} to {_number(self.high)}"
            else:
                if self.low is not None:
                    words += f" {'greater than' if self.open_low else 'at least'} {_number(self.low)}"
                if self.high is not None:
                    words += (" and" if self.low is not None else "") + \
                             f" {'less than' if self.open_high else 'at most'} {_number(self.high)}"
        return words + (" (or null)" if self.null else "")


def _number(x) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        x = int(x)
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


# A key config.json leaves out, where it has no default (shown as "missing").
MISSING = object()


def shown(value) -> str:
    """A value as config.json writes it (null, true, NaN), cut short if it is long."""
    if value is MISSING:
        return "missing"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, int) and abs(value) >= 10**30:
        return f"a whole number of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def invalid(where: str, key: str, value, expected: str) -> str:
    """The message for a value no model is saved with: set it (first), and to what."""
    return (f"{where}: set {key} to {expected} (it is {shown(value)}); restore the value of the config.json "
            "the model was published or saved with")


def unsupported(where: str, key: str, value, why: str, instead: str) -> str:
    """The message for a valid setting ringpipe's model computes differently: it cannot be
    fine-tuned here (first), why, and what to use instead."""
    return (f"{where}: ringpipe cannot fine-tune this model: {key} is {shown(value)}, and {why}. Fine-tune it "
            f"with transformers instead, or choose a model whose config.json has {instead}")


# The rule of every key hf.py and hf_llama.py read from a config.json (a key may mean the
# same in both families: vocab_size, tie_word_embeddings). A RoPE object's fields are
# checked with the rule of their name too (rope_scaling.factor as "factor").
RULES = {
    # sizes
    "vocab_size": Rule("int", 1, MAX_VOCAB),
    "hidden_size": Rule("int", 1, MAX_WIDTH), "n_embd": Rule("int", 1, MAX_WIDTH),
    "intermediate_size": Rule("int", 1, MAX_FFN), "n_inner": Rule("int", 1, MAX_FFN, null=True),
    "num_hidden_layers": Rule("int", 1, MAX_LAYERS), "n_layer": Rule("int", 1, MAX_LAYERS),
    "num_attention_heads": Rule("int", 1, MAX_HEADS), "n_head": Rule("int", 1, MAX_HEADS),
    "num_key_value_heads": Rule("int", 1, MAX_HEADS, null=True),
    "head_dim": Rule("int", 2, MAX_WIDTH, null=True),
    "max_position_embeddings": Rule("int", 1, MAX_CONTEXT), "n_positions": Rule("int", 1, MAX_CONTEXT),
    # the math
    "hidden_act": Rule("str"), "activation_function": Rule("str"),
    "rms_norm_eps": Rule("number", 0, 1, open_low=True, open_high=True),
    "layer_norm_epsilon": Rule("number", 0, 1, open_low=True, open_high=True),
    "tie_word_embeddings": Rule("bool"),
    "attention_bias": Rule("bool"), "mlp_bias": Rule("bool"),
    "scale_attn_weights": Rule("bool"), "scale_attn_by_inverse_layer_idx": Rule("bool"),
    "reorder_and_upcast_attn": Rule("bool"), "add_cross_attention": Rule("bool"),
    "partial_rotary_factor": Rule("number", 0, 1, open_low=True),
    # dropout: a probability (ringpipe trains without; import_notes says so)
    "attention_dropout": Rule("number", 0, 1), "resid_pdrop": Rule("number", 0, 1),
    "embd_pdrop": Rule("number", 0, 1), "attn_pdrop": Rule("number", 0, 1),
    # Gemma 3
    "hidden_activation": Rule("str"), "query_pre_attn_scalar": Rule("number", 0, MAX_WIDTH, open_low=True),
    "rope_local_base_freq": Rule("number", 1, MAX_ROPE_THETA, open_low=True),
    "final_logit_softcapping": Rule("number", 0, 1e9, open_low=True, null=True),
    "attn_logit_softcapping": Rule("number", 0, 1e9, open_low=True, null=True),
    "use_bidirectional_attention": Rule("bool", null=True),
    # sliding windows (Mistral, Qwen2)
    "sliding_window": Rule("int", 1, MAX_CONTEXT, null=True), "use_sliding_window": Rule("bool"),
    "max_window_layers": Rule("int", 0, MAX_LAYERS, null=True),
    # RoPE: at the top level, and in rope_scaling / rope_parameters
    "rope_theta": Rule("number", 1, MAX_ROPE_THETA, open_low=True),
    "rope_type": Rule("str"), "type": Rule("str"),
    "factor": Rule("number", 1, MAX_ROPE_FACTOR),
    "low_freq_factor": Rule("number", 0, MAX_ROPE_FACTOR, open_low=True),
    "high_freq_factor": Rule("number", 0, MAX_ROPE_FACTOR, open_low=True),
    "original_max_position_embeddings": Rule("int", 1, MAX_CONTEXT),
}
