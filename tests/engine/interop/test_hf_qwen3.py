"""Qwen3 (dense) in and out of Hugging Face's format (issue 36): a Llama block with the
per-head q/k norm (LlamaConfig.qk_norm "head"), head_dim apart from hidden / heads.

transformers' Qwen3ForCausalLM is the oracle, in float64 (its RMSNorms and RoPE tables
lifted to float64, as tests/engine/interop/test_hf_llama.py does): a saved random model
imported by --init-from gives its logits; ringpipe's export loads as Qwen3ForCausalLM with
ringpipe's logits and greedy tokens; export -> import -> export is bitwise; the config keys a
Qwen3 folder may set that ringpipe's model would compute differently are refused by name.
"""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face tests need torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")
pytest.importorskip("safetensors.numpy", reason="engine/interop/hf.py needs safetensors")

from ringpipe.engine.interop import hf, hf_llama  # noqa: E402
from ringpipe.engine.model.chain import LayerChain  # noqa: E402
from ringpipe.engine.model.llama import PRESETS, LlamaConfig, llama_layers  # noqa: E402

from tests.engine.interop.test_hf_llama import (EXACT, assert_export_and_sample_agree,  # noqa: E402
                                                assert_export_import_export_is_bitwise,
                                                assert_greedy_tokens_agree, checkpoint_arrays,
                                                config_only, fine_tune_and_export, hf_logits,
                                                imported_diff, random_tokens, randomize,
                                                ringpipe_logits, ringpipe_model, save)

# The odd shape: hidden 48, 6 heads of 16 (not 48 / 6), 2 key/value heads,
# intermediate 37, eps and theta off their defaults.
ODD = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
           head_dim=16, intermediate_size=37, max_position_embeddings=24, rms_norm_eps=3e-6, rope_theta=77777.0)
# The same as a ringpipe shape.
ODD_OURS = dict(n_layer=2, d_model=48, n_head=6, n_kv_head=2, head_dim=16, d_ff=37, context=24, vocab=97,
                rms_eps=3e-6, rope_theta=77777.0, qk_norm="head")


def random_qwen3(seed=0, **overrides):
    config = transformers.Qwen3Config(**{**ODD, "tie_word_embeddings": True, "use_sliding_window": False, **overrides})
    return randomize(transformers.Qwen3ForCausalLM(config), seed)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_imported_qwen3_gives_transformers_logits(tmp_path, tied):
    folder = save(random_qwen3(seed=1, tie_word_embeddings=tied), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    assert cfg == LlamaConfig(**dict(ODD_OURS, tie_embeddings=tied)).validate()
    assert arrays["h.1.attn.q_norm.w"].shape == arrays["h.1.attn.k_norm.w"].shape == (16,)
    assert arrays["h.1.attn.k_norm.w"].any()
    assert imported_diff(folder) <= EXACT


def test_a_qwen3_default_config_reads_head_dim_128(tmp_path):
    """Qwen3's head_dim defaults to 128 whatever hidden / heads is (transformers' Qwen3Config)."""
    config = dict(model_type="qwen3", hidden_act="silu", vocab_size=99, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=37, max_position_embeddings=24)
    cfg = hf_llama.config_from_hf(config, "here")
    assert (cfg.head_dim, cfg.n_kv_head, cfg.qk_norm, cfg.qkv_bias, cfg.rms_eps) == (128, 1, "head", False, 1e-6)


@pytest.mark.parametrize("config, key", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(num_experts=8), "num_experts"),
], ids=["o_proj bias", "experts"])
def test_a_qwen3_config_ringpipe_cannot_represent_is_refused_naming_the_key(tmp_path, config, key):
    folder = config_only(tmp_path, model_type="qwen3", architectures=["Qwen3ForCausalLM"], **config)
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(folder)
    assert key in str(refused.value) and "config.json" in str(refused.value)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_exported_qwen3_loads_as_qwen3_with_ringpipes_logits(tmp_path, tied):
    cfg = LlamaConfig(**dict(ODD_OURS, tie_embeddings=tied)).validate()
    arrays = checkpoint_arrays(cfg, seed=2)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["head_dim"], config["rms_norm_eps"], config["attention_bias"]) == (16, 3e-6, False)
    assert config["use_sliding_window"] is False and config["layer_types"] == ["full_attention"] * 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    tokens = random_tokens(cfg.vocab)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - ours).max() <= EXACT


def test_a_qwen3_with_a_window_on_some_layers_is_exact_both_ways(tmp_path):
    """use_sliding_window with layer_types: the window on the layers named, read and written back."""
    folder = save(random_qwen3(seed=6, use_sliding_window=True, sliding_window=5,
                               layer_types=["full_attention", "sliding_attention"]), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    assert (cfg.sliding_window, cfg.window_layers) == (5, [1])
    assert imported_diff(folder) <= EXACT
    out = hf.export_hf({f"param/{k}": v for k, v in arrays.items()}, cfg.to_dict(), str(tmp_path / "out"),
                       model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["layer_types"] == ["full_attention", "sliding_attention"] and config["use_sliding_window"]
    tokens = random_tokens(cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - hf_logits(folder, tokens)).max() <= EXACT


def test_qwen3_export_import_export_is_bitwise(tmp_path):
    cfg = LlamaConfig(**dict(ODD_OURS, tie_embeddings=False)).validate()
    assert_export_import_export_is_bitwise(cfg, tmp_path, seed=3)


def test_generate_on_a_qwen3_export_gives_ringpipes_greedy_tokens(tmp_path):
    """transformers' greedy generate on the export = ringpipe's sampler (KV cache, q/k norm
    at every decoded position), float64, 20 tokens."""
    cfg = LlamaConfig(**ODD_OURS).validate()
    arrays = checkpoint_arrays(cfg, seed=4)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    assert_greedy_tokens_agree(cfg, arrays, out)


def test_a_model_with_biases_and_a_qk_norm_is_refused_by_the_export(tmp_path):
    cfg = LlamaConfig(**dict(ODD_OURS, qkv_bias=True)).validate()
    with pytest.raises(hf.HFError, match="no Hugging Face class"):
        hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    assert not os.path.exists(tmp_path / "hf")


def test_the_qwen3_name_table_is_the_models_parameters():
    cfg = LlamaConfig(**ODD_OURS).validate()
    model = LayerChain(llama_layers(cfg))
    ours = {name: model.params.view(name).shape for name in model.params.names()}
    assert ours == {name: hf_llama.shape_of(cfg, name, cfg.padded_vocab) for name, _ in hf_llama.name_map(cfg)}
    assert ("h.0.attn.q_norm.w", "model.layers.0.self_attn.q_norm.weight") in hf_llama.name_map(cfg)


def test_a_llama_checkpoint_written_before_qk_norm_still_exports(tmp_path):
    """model_config without qk_norm (every Llama checkpoint before Qwen3): no q/k norm."""
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24)).validate()
    old = {k: v for k, v in cfg.to_dict().items() if k != "qk_norm"}
    out = hf.export_hf(checkpoint_arrays(cfg), old, str(tmp_path / "hf"), model="llama")
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "llama"


def test_a_qwen3_folder_fine_tunes_exports_and_samples(tmp_path, capsys):
    """save_pretrained -> --init-from (the family from config.json) -> two steps -> ringpipe
    export (Qwen3ForCausalLM) -> transformers gives the checkpoint's logits; ringpipe sample."""
    folder = save(random_qwen3(seed=5, vocab_size=256, max_position_embeddings=32), tmp_path / "hf")
    run, config, cfg, params = fine_tune_and_export(folder, tmp_path)
    assert config["model_type"] == "qwen3" and config["head_dim"] == 16 and cfg.qk_norm == "head"
    assert_export_and_sample_agree(run, cfg, params, tmp_path / "out", capsys)
