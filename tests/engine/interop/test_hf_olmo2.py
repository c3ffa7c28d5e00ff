"""OLMo 2 in and out of Hugging Face's format (issue 36): the Llama block's parts wired with
the norms after attention and the MLP (LlamaConfig.norm_place "post": its
post_attention_layernorm and post_feedforward_layernorm) and the q/k norm over a position's
whole projection (qk_norm "all": q_norm of H hd weights, k_norm of Hkv hd).

transformers' Olmo2ForCausalLM is the oracle, in float64 (tests/engine/interop/test_hf_llama.py's
helpers): import, export (as Olmo2ForCausalLM), export -> import -> export bitwise, greedy
generate against ringpipe's sampler, and a fine-tune from the command line.
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
from ringpipe.engine.model.llama import LlamaConfig, llama_layers  # noqa: E402

from tests.engine.interop.test_hf_llama import (EXACT, assert_export_import_export_is_bitwise,  # noqa: E402
                                                assert_greedy_tokens_agree, checkpoint_arrays,
                                                config_only, fine_tune_and_export, hf_logits,
                                                imported_diff, random_tokens, randomize,
                                                ringpipe_logits, ringpipe_model, save)

SHAPE = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=37, max_position_embeddings=24, rms_norm_eps=2e-6, rope_theta=500000.0)
OURS = dict(n_layer=2, d_model=48, n_head=6, n_kv_head=2, head_dim=8, d_ff=37, context=24, vocab=97, rms_eps=2e-6,
            rope_theta=500000.0, qk_norm="all", norm_place="post", tie_embeddings=False)


def random_olmo2(seed=0, **overrides):
    config = transformers.Olmo2Config(**{**SHAPE, "pad_token_id": None, "eos_token_id": None, **overrides})
    return randomize(transformers.Olmo2ForCausalLM(config), seed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied (OLMo 2's)", "tied"])
def test_an_imported_olmo2_gives_transformers_logits(tmp_path, tied):
    folder = save(random_olmo2(seed=1, tie_word_embeddings=tied), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    assert cfg == LlamaConfig(**dict(OURS, tie_embeddings=tied)).validate()
    assert arrays["h.0.attn.q_norm.w"].shape == (48,) and arrays["h.0.attn.k_norm.w"].shape == (16,)
    assert imported_diff(folder) <= EXACT


def test_olmo2_names_map_its_post_norms_to_ringpipes_block_norms():
    cfg = LlamaConfig(**OURS).validate()
    names = dict(hf_llama.name_map(cfg))
    assert names["h.1.norm1.w"] == "model.layers.1.post_attention_layernorm.weight"
    assert names["h.1.norm2.w"] == "model.layers.1.post_feedforward_layernorm.weight"
    model = LayerChain(llama_layers(cfg))
    ours = {name: model.params.view(name).shape for name in model.params.names()}
    assert ours == {name: hf_llama.shape_of(cfg, name, cfg.padded_vocab) for name in names}


def test_an_olmo2_config_with_biases_is_refused_naming_the_key(tmp_path):
    folder = config_only(tmp_path, model_type="olmo2", architectures=["Olmo2ForCausalLM"], attention_bias=True)
    with pytest.raises(hf.HFError, match="attention_bias"):
        hf.import_hf(folder)


def test_an_exported_olmo2_loads_as_olmo2_with_ringpipes_logits(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    arrays = checkpoint_arrays(cfg, seed=2)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["Olmo2ForCausalLM"] and config["model_type"] == "olmo2"
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "Olmo2ForCausalLM"
    tokens = random_tokens(cfg.vocab)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - ours).max() <= EXACT


def test_olmo2_export_import_export_is_bitwise(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    assert_export_import_export_is_bitwise(cfg, tmp_path, seed=3)


def test_generate_on_an_olmo2_export_gives_ringpipes_greedy_tokens(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    arrays = checkpoint_arrays(cfg, seed=4)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    assert_greedy_tokens_agree(cfg, arrays, out)


@pytest.mark.parametrize("parts", [dict(qk_norm="all"), dict(norm_place="post")], ids=["q/k norm alone",
                                                                                      "post norms alone"])
def test_half_of_olmo2s_parts_has_no_class_to_export_to(tmp_path, parts):
    cfg = LlamaConfig(**{**OURS, "qk_norm": "none", "norm_place": "pre", **parts}).validate()
    with pytest.raises(hf.HFError, match="no Hugging Face class"):
        hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), model="llama")


def test_an_olmo2_folder_fine_tunes_from_the_command_line(tmp_path):
    folder = save(random_olmo2(seed=5, vocab_size=256, max_position_embeddings=32), tmp_path / "hf")
    _, config, cfg, _ = fine_tune_and_export(folder, tmp_path)
    assert (cfg.qk_norm, cfg.norm_place, config["model_type"]) == ("all", "post", "olmo2")
