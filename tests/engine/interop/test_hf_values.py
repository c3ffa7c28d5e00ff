"""Issue 34: every value ringpipe reads from a Hugging Face config.json is checked, type and
range, before anything is read or built, and the refusal names the key and says what to do
first. Before, a NaN RoPE factor, a low_freq_factor of 0 or an original_max_position_embeddings
of 0 passed the import and failed in kernels/rope.py at model build (a traceback and
MPI_Abort); a layer_types shorter than the layers, attention_dropout "0.1" or NaN, a float
original_max_position_embeddings and rope_theta Infinity were accepted.

The checks are called directly on a config dict (no weights, no torch): JSON's NaN,
Infinity, huge integers, true for 1 and 8.0 for 8 are what json.loads gives for them.
"""
import json
import math

import pytest

from ringpipe.engine.interop import hf, hf_llama, hf_values
from ringpipe.engine.model.llama import PRESETS, LlamaConfig

WHERE = "m/config.json"
NAN, INF = math.nan, math.inf
LLAMA = dict(model_type="llama", vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=37, max_position_embeddings=24, hidden_act="silu",
             rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
GPT2 = dict(model_type="gpt2", vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2)


def llama(**changes):
    return hf_llama.config_from_hf(dict(LLAMA, **changes), "m")


def scaled(key="rope_scaling", **changes):
    return {key: dict(LLAMA3, **changes)}


def refusal(check, config):
    with pytest.raises(hf.HFError) as refused:
        check(config)
    return str(refused.value)


def llama_refusal(**changes):
    return refusal(lambda config: hf_llama.config_from_hf(config, "m"), dict(LLAMA, **changes))


def gpt2_refusal(**changes):
    return refusal(lambda config: hf._config_from_hf(config, "m"), dict(GPT2, **changes))


# ---- values out of type or range: "set KEY to ..." first -------------------------------------

LLAMA_INVALID = {
    # the issue's: a RoPE that failed in kernels/rope.py at model build
    "low_freq_factor 0": (scaled(low_freq_factor=0.0), "rope_scaling.low_freq_factor"),
    "low_freq_factor negative": (scaled(low_freq_factor=-1.0), "rope_scaling.low_freq_factor"),
    "original context 0": (scaled(original_max_position_embeddings=0),
                           "rope_scaling.original_max_position_embeddings"),
    "factor NaN": (scaled(factor=NAN), "rope_scaling.factor"),
    "factor NaN, transformers 5": (scaled("rope_parameters", factor=NAN, rope_theta=1e4), "rope_parameters.factor"),
    "factor Infinity": (scaled(factor=INF), "rope_scaling.factor"),
    "factor below 1": (scaled(factor=0.5), "rope_scaling.factor"),
    "factor a string": (scaled(factor="8"), "rope_scaling.factor"),
    "high not above low": (scaled(high_freq_factor=1.0), "rope_scaling.high_freq_factor"),
    "a field missing": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
                        "rope_scaling.low_freq_factor"),
    "a float original context": (scaled(original_max_position_embeddings=8.0),
                                 "rope_scaling.original_max_position_embeddings"),
    "original contexts disagree": (dict(scaled(), original_max_position_embeddings=16),
                                   "original_max_position_embeddings"),
    # at the top level beside the default RoPE, which does not read it: checked all the same
    "top-level original context 0": (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
    "top-level float original context": (dict(original_max_position_embeddings=1.5),
                                         "original_max_position_embeddings"),
    "rope_scaling a string": (dict(rope_scaling="llama3"), "rope_scaling"),
    "rope_type a number": (scaled(rope_type=3), "rope_scaling.rope_type"),
    "rope_theta Infinity": (dict(rope_theta=INF), "rope_theta"),
    "rope_theta NaN": (dict(rope_theta=NAN), "rope_theta"),
    "rope_theta 0": (dict(rope_theta=0), "rope_theta"),
    "rope_theta a string": (dict(rope_theta="10000"), "rope_theta"),
    "rope_theta true": (dict(rope_theta=True), "rope_theta"),
    "rope_theta huge": (dict(rope_theta=1e300), "rope_theta"),
    "rope_parameters' theta Infinity": (dict(rope_parameters={"rope_type": "default", "rope_theta": INF}),
                                        "rope_parameters.rope_theta"),
    "partial_rotary_factor NaN": (dict(partial_rotary_factor=NAN), "partial_rotary_factor"),
    # the absurd values
    "layer_types shorter": (dict(layer_types=["full_attention"]), "layer_types"),
    "layer_types a string": (dict(layer_types="full_attention"), "layer_types"),
    "attention_dropout a string": (dict(attention_dropout="0.1"), "attention_dropout"),
    "attention_dropout NaN": (dict(attention_dropout=NAN), "attention_dropout"),
    "attention_dropout above 1": (dict(attention_dropout=1.5), "attention_dropout"),
    # sizes: bool is not an int, 32.0 is not 32, and each has a sane maximum
    "hidden_size true": (dict(hidden_size=True), "hidden_size"),
    "hidden_size a float": (dict(hidden_size=32.0), "hidden_size"),
    "hidden_size huge": (dict(hidden_size=10**30), "hidden_size"),
    "hidden_size of 5000 digits": (dict(hidden_size=10**4000), "hidden_size"),
    "vocab_size past uint32": (dict(vocab_size=2**40), "vocab_size"),
    "layers 0": (dict(num_hidden_layers=0), "num_hidden_layers"),
    "layers huge": (dict(num_hidden_layers=10**9), "num_hidden_layers"),
    "context a float": (dict(max_position_embeddings=24.0), "max_position_embeddings"),
    "context huge": (dict(max_position_embeddings=2**40), "max_position_embeddings"),
    "kv heads 0": (dict(num_key_value_heads=0), "num_key_value_heads"),
    "kv heads true": (dict(num_key_value_heads=True), "num_key_value_heads"),
    "kv heads not dividing": (dict(num_key_value_heads=3), "num_key_value_heads"),
    "heads not dividing": (dict(num_attention_heads=5, num_key_value_heads=1), "num_attention_heads"),
    "an odd head size": (dict(hidden_size=36), "num_attention_heads"),
    "an odd head_dim": (dict(head_dim=15), "head_dim"),
    "head_dim 0": (dict(head_dim=0), "head_dim"),
    # the math's settings
    "rms_norm_eps NaN": (dict(rms_norm_eps=NAN), "rms_norm_eps"),
    "rms_norm_eps a string": (dict(rms_norm_eps="1e-5"), "rms_norm_eps"),
    "tie a string": (dict(tie_word_embeddings="true"), "tie_word_embeddings"),
    "tie 1": (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    "hidden_act a number": (dict(hidden_act=5), "hidden_act"),
    "attention_bias a string": (dict(attention_bias="false"), "attention_bias"),
    "mistral window 0": (dict(model_type="mistral", sliding_window=0), "sliding_window"),
    "mistral window a string": (dict(model_type="mistral", sliding_window="4096"), "sliding_window"),
    "qwen2 switch a string": (dict(model_type="qwen2", use_sliding_window="yes"), "use_sliding_window"),
    "qwen2 window layers a float": (dict(model_type="qwen2", use_sliding_window=True, sliding_window=24,
                                         max_window_layers=2.5), "max_window_layers"),
}


@pytest.mark.parametrize("changes, key", LLAMA_INVALID.values(), ids=LLAMA_INVALID.keys())
def test_a_llama_value_out_of_type_or_range_is_refused_saying_what_to_set(changes, key):
    message = llama_refusal(**changes)
    assert message.startswith(f"{WHERE}: set {key} to "), message
    assert "restore the value" in message, message


GPT2_INVALID = {
    "n_embd true": (dict(n_embd=True), "n_embd"),
    "n_embd a float": (dict(n_embd=32.0), "n_embd"),
    "n_head 0": (dict(n_head=0), "n_head"),
    "n_head not dividing": (dict(n_head=5), "n_head"),
    "n_positions huge": (dict(n_positions=10**12), "n_positions"),
    "vocab_size past uint32": (dict(vocab_size=2**33), "vocab_size"),
    "n_inner a float": (dict(n_inner=128.5), "n_inner"),
    "epsilon NaN": (dict(layer_norm_epsilon=NAN), "layer_norm_epsilon"),
    "epsilon a string": (dict(layer_norm_epsilon="1e-5"), "layer_norm_epsilon"),
    "tie a string": (dict(tie_word_embeddings="false"), "tie_word_embeddings"),
    "dropout NaN": (dict(resid_pdrop=NAN), "resid_pdrop"),
    "dropout a string": (dict(attn_pdrop="0.1"), "attn_pdrop"),
    "dropout 2": (dict(embd_pdrop=2), "embd_pdrop"),
    "scale a string": (dict(scale_attn_weights="true"), "scale_attn_weights"),
    "reorder a string": (dict(reorder_and_upcast_attn="no"), "reorder_and_upcast_attn"),
}


@pytest.mark.parametrize("changes, key", GPT2_INVALID.values(), ids=GPT2_INVALID.keys())
def test_a_gpt2_value_out_of_type_or_range_is_refused_saying_what_to_set(changes, key):
    message = gpt2_refusal(**changes)
    assert message.startswith(f"{WHERE}: set {key} to "), message


def test_json_spellings_are_shown_as_json_writes_them():
    """NaN, Infinity, true and null, as the user sees them in config.json; a huge integer by its size."""
    for value, shown in ((NAN, "NaN"), (INF, "Infinity"), (-INF, "-Infinity"), (True, "true"), (None, "null"),
                         (10**4000, "a whole number of 4001 digits")):
        assert f"(it is {shown})" in llama_refusal(rope_theta=value), value
    assert json.loads('{"a": NaN, "b": Infinity}')["b"] == INF       # what json.loads gives: the cases above


# ---- valid settings ringpipe computes differently: "cannot fine-tune", and what to use ----------

UNSUPPORTED = {
    "another activation": (dict(hidden_act="gelu"), "hidden_act"),
    "a bias on o_proj": (dict(attention_bias=True), "attention_bias"),
    "experts": (dict(num_local_experts=8), "num_local_experts"),
    "quantized": (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    "partial rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "chunked layers": (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    "a rope type": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    "RoPE per layer type": (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "rope_parameters"),
}


@pytest.mark.parametrize("changes, key", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_a_model_ringpipe_computes_differently_is_refused_saying_what_to_use(changes, key):
    message = llama_refusal(**changes)
    assert message.startswith(f"{WHERE}: ringpipe cannot fine-tune this model: {key} is "), message
    assert "Fine-tune it with transformers instead, or choose a model whose config.json has" in message, message


def test_gpt2_refusals_say_what_to_use_too():
    message = gpt2_refusal(activation_function="relu")
    assert message.startswith(f"{WHERE}: ringpipe cannot fine-tune this model: activation_function is 'relu'")
    assert "choose a model whose config.json has activation_function gelu_new" in message
    message = gpt2_refusal(model_type="bert")
    assert "ringpipe cannot import this model: model_type is 'bert'" in message and "gpt2" in message


# ---- what published models and ringpipe's own exports hold is accepted --------------------------

def test_every_config_ringpipe_exports_reads_back_as_the_same_model():
    """The rules refuse nothing ringpipe writes: every preset, llama3 scaling, Qwen2's, Qwen3's and
    SmolLM3's keys (Qwen3 and SmolLM3 presets without biases: they have none, and no class has both)."""
    for name, preset in PRESETS.items():
        own_parts = preset.get("qk_norm", "none") != "none" or preset.get("nope_layers")
        for qkv_bias in ((False,) if own_parts else (False, True)):
            cfg = LlamaConfig(**dict(preset, qkv_bias=qkv_bias)).validate()
            assert hf_llama.config_from_hf(hf_llama.hf_config(cfg, 0, 0), "m") == cfg, name


def test_published_settings_are_accepted():
    """Llama 3.2's rope (transformers 4's keys), Qwen2.5's window longer than its context and
    max_window_layers past its depth, an unswitched window, a window as long as the context."""
    cfg = llama(rope_theta=500000.0, rope_scaling=dict(LLAMA3, factor=32, original_max_position_embeddings=8192))
    assert cfg.rope_scaling["factor"] == 32 and cfg.rope_theta == 500000.0
    assert llama(**scaled(original_max_position_embeddings=8), original_max_position_embeddings=8).n_layer == 2
    assert llama(model_type="qwen2", use_sliding_window=False, sliding_window=131072, max_window_layers=70)
    assert llama(model_type="mistral", sliding_window=24, attention_dropout=0)
    assert llama(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_theta == 1e6
    assert hf._config_from_hf(dict(GPT2, resid_pdrop=0.1, n_inner=None), "m").d_model == 32


def test_every_rule_says_what_it_asks_for():
    assert hf_values.RULES["hidden_size"].expected() == "a whole number from 1 to 1,048,576"
    assert hf_values.RULES["rms_norm_eps"].expected() == "a finite number greater than 0 and less than 1"
    assert hf_values.RULES["head_dim"].expected() == "a whole number from 2 to 1,048,576 (or null)"
    assert hf_values.RULES["tie_word_embeddings"].expected() == "true or false"
    for rule in hf_values.RULES.values():
        assert not rule.holds(NAN) and not rule.holds(INF) and rule.holds(None) == rule.null
        assert rule.holds(True) == (rule.kind == "bool")
