"""Gemma 3 (text) in and out of Hugging Face's format (issue 36): Gemma3ForCausalLM folders
(model_type gemma3_text) through --init-from and back through ringpipe export, against
transformers in float64 (its RMSNorms and per-layer-type RoPE tables lifted to float64, as
tests/engine/model/test_gemma3.py does)."""
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
from ringpipe.kernels.rope import rope_inv_freq  # noqa: E402

from tests.engine.interop.test_hf_llama import (EXACT, assert_export_and_sample_agree,  # noqa: E402
                                                assert_export_import_export_is_bitwise,
                                                assert_greedy_tokens_agree, checkpoint_arrays,
                                                config_only, fine_tune_and_export, random_tokens,
                                                randomize, ringpipe_logits, ringpipe_model, save)

SHAPE = dict(vocab_size=97, hidden_size=48, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=37, max_position_embeddings=32, rms_norm_eps=1e-6,
             query_pre_attn_scalar=24, sliding_window=8, pad_token_id=None,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
OURS = dict(PRESETS["gemma3-tiny"], vocab=97, context=32)


def random_gemma3(seed=0, **overrides):
    config = transformers.Gemma3TextConfig(**{**SHAPE, **overrides})
    return randomize(transformers.Gemma3ForCausalLM(config), seed)


def lift_gemma3_to_float64(model):
    """transformers computes Gemma's RMSNorm and RoPE tables in float32: in float64 here. Its
    embedding scale, sqrt(d_model), is a float32 buffer in a model made in float32 (as a
    training run's), but exact when from_pretrained makes the model in float64: set to the
    float32 value, which ringpipe uses at every precision."""
    embed = model.model.embed_tokens
    embed.embed_scale.fill_(float(np.float32(embed.scalar_embed_scale)))
    head_dim = model.config.head_dim
    tables = {kind: torch.from_numpy(rope_inv_freq(head_dim, params["rope_theta"]))
              for kind, params in model.config.rope_parameters.items()}

    def rope(x, position_ids, layer_type):
        angles = position_ids[..., None].double() * tables[layer_type]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def rmsnorm(norm, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)) * (1.0 + norm.weight)
    model.model.rotary_emb.forward = rope
    for module in model.modules():
        if type(module).__name__ == "Gemma3RMSNorm":
            module.forward = rmsnorm.__get__(module)
    return model


def hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                              dtype=torch.float64).eval()
    lift_gemma3_to_float64(model)
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def imported_diff(folder):
    cfg, arrays, _ = hf.import_hf(folder)
    tokens = random_tokens(cfg.vocab, length=24)
    return np.abs(ringpipe_logits(ringpipe_model(cfg, arrays), tokens, cfg.vocab) - hf_logits(folder, tokens)).max()


def test_an_imported_gemma3_gives_transformers_logits(tmp_path):
    folder = save(random_gemma3(seed=1), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    assert cfg == LlamaConfig(**OURS).validate()
    assert arrays["h.0.post_mlp_norm.w"].shape == (48,) and arrays["h.0.attn.q_norm.w"].shape == (16,)
    assert imported_diff(folder) <= EXACT


def test_final_logit_soft_capping_is_read_and_written_back(tmp_path):
    """final_logit_softcapping (Gemma 2's 30; null in Gemma 3's): the logits capped as transformers'."""
    folder = save(random_gemma3(seed=6, final_logit_softcapping=2.0), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    assert cfg.logit_softcap == 2.0
    assert imported_diff(folder) <= EXACT
    out = hf.export_hf({f"param/{k}": v for k, v in arrays.items()}, cfg.to_dict(), str(tmp_path / "out"),
                       model="llama")
    assert json.load(open(os.path.join(out, "config.json")))["final_logit_softcapping"] == 2.0


def test_the_gemma3_name_table_is_the_models_parameters():
    cfg = LlamaConfig(**OURS).validate()
    names = dict(hf_llama.name_map(cfg))
    assert names["h.2.norm2.w"] == "model.layers.2.pre_feedforward_layernorm.weight"
    assert names["h.2.post_attn_norm.w"] == "model.layers.2.post_attention_layernorm.weight"
    model = LayerChain(llama_layers(cfg))
    ours = {name: model.params.view(name).shape for name in model.params.names()}
    assert ours == {name: hf_llama.shape_of(cfg, name, cfg.padded_vocab) for name in names}


@pytest.mark.parametrize("config, key", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_type"),
], ids=["attention soft-capping", "another activation", "linear RoPE scaling"])
def test_a_gemma3_config_ringpipe_cannot_represent_is_refused_naming_the_key(tmp_path, config, key):
    folder = config_only(tmp_path, **{**{k: v for k, v in SHAPE.items() if k != "pad_token_id"},
                                      "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **config})
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(folder)
    assert key in str(refused.value) and "config.json" in str(refused.value)


def test_an_exported_gemma3_loads_as_gemma3_with_ringpipes_logits(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    arrays = checkpoint_arrays(cfg, seed=2)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (config["query_pre_attn_scalar"], config["rope_local_base_freq"]) == (24, 10000.0)
    tokens = random_tokens(cfg.vocab, length=24)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - ours).max() <= EXACT


def test_gemma3_export_import_export_is_bitwise(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    assert_export_import_export_is_bitwise(cfg, tmp_path, seed=3)


def test_generate_on_a_gemma3_export_gives_ringpipes_greedy_tokens(tmp_path):
    """Past the window of 8 on the local blocks, with the global block seeing everything."""
    cfg = LlamaConfig(**OURS).validate()
    arrays = checkpoint_arrays(cfg, seed=4)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    assert_greedy_tokens_agree(cfg, arrays, out, lift=lift_gemma3_to_float64)


def test_a_model_with_some_of_gemma3s_parts_has_no_class_to_export_to(tmp_path):
    cfg = LlamaConfig(**dict(OURS, mlp_act="silu")).validate()
    with pytest.raises(hf.HFError, match=r"these parts \(qk_norm head, norm_place sandwich, rms_offset 1.0, embed_scale True\) has no Hugging Face class"):
        hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), model="llama")


def test_a_gemma3_folder_fine_tunes_exports_and_samples_from_the_command_line(tmp_path, capsys):
    """save_pretrained -> --init-from (the family from config.json) -> two steps -> ringpipe export
    (Gemma3ForCausalLM) -> transformers gives the checkpoint's logits; ringpipe sample reads the run."""
    folder = save(random_gemma3(seed=5, vocab_size=256), tmp_path / "hf")
    run, config, cfg, params = fine_tune_and_export(folder, tmp_path)
    assert config["model_type"] == "gemma3_text"
    assert (cfg.norm_place, cfg.mlp_act, cfg.sliding_window) == ("sandwich", "gelu_tanh", 8)
    assert_export_and_sample_agree(run, cfg, params, tmp_path / "out", capsys, logits_of=hf_logits)
