"""SmolLM3 in and out of Hugging Face's format (issue 36): the Llama block with some blocks
whose attention sees no positions (NoPE: LlamaConfig.nope_layers; transformers'
no_rope_layers, 1 where a block rotates q and k, 0 where it does not).

transformers' SmolLM3ForCausalLM is the oracle, in float64 (tests/engine/interop/test_hf_llama.py's
helpers): a saved random model imported by --init-from gives its logits; the export loads as
SmolLM3ForCausalLM with ringpipe's logits and greedy tokens (the KV-cache sampler skips the
rotation in the NoPE blocks too); export -> import -> export is bitwise.
"""
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face tests need torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")
pytest.importorskip("safetensors.numpy", reason="engine/interop/hf.py needs safetensors")

from ringpipe.engine.interop import hf, hf_llama  # noqa: E402
from ringpipe.engine.model.llama import LlamaConfig  # noqa: E402

from tests.engine.interop.test_hf_llama import (EXACT, assert_export_import_export_is_bitwise,  # noqa: E402
                                                assert_greedy_tokens_agree, checkpoint_arrays,
                                                config_only, fine_tune_and_export, hf_logits,
                                                imported_diff, random_tokens, randomize,
                                                ringpipe_logits, ringpipe_model, save)

# An odd shape: 4 blocks, the last without RoPE (SmolLM3's every fourth), 6 heads of 8, 2 KV heads.
SHAPE = dict(vocab_size=97, hidden_size=48, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=37, max_position_embeddings=24, rms_norm_eps=3e-6, rope_theta=77777.0)
OURS = dict(n_layer=4, d_model=48, n_head=6, n_kv_head=2, head_dim=8, d_ff=37, context=24, vocab=97, rms_eps=3e-6,
            rope_theta=77777.0, nope_layers=[3])


def random_smollm3(seed=0, **overrides):
    config = transformers.SmolLM3Config(**{**SHAPE, "tie_word_embeddings": True, "pad_token_id": None,
                                           "use_sliding_window": False, **overrides})
    return randomize(transformers.SmolLM3ForCausalLM(config), seed)


@pytest.mark.parametrize("no_rope_layers, nope", [(None, [3]), ([1, 0, 1, 0], [1, 3]), ([1, 1, 1, 1], None)],
                         ids=["every fourth (the interval's default)", "two NoPE blocks", "none"])
def test_an_imported_smollm3_gives_transformers_logits(tmp_path, no_rope_layers, nope):
    folder = save(random_smollm3(seed=1, no_rope_layers=no_rope_layers), tmp_path / "hf")
    cfg, _, _ = hf.import_hf(folder)
    assert cfg == LlamaConfig(**dict(OURS, nope_layers=nope)).validate()
    assert imported_diff(folder) <= EXACT


def test_a_config_without_the_list_takes_the_interval():
    config = dict(model_type="smollm3", hidden_act="silu", **dict(SHAPE, num_hidden_layers=6),
                  no_rope_layer_interval=2)
    assert hf_llama.config_from_hf(config, "here").nope_layers == [1, 3, 5]


@pytest.mark.parametrize("config, key", [
    (dict(no_rope_layers=[1, 0]), "no_rope_layers"),
    (dict(no_rope_layers=[1, 2, 1, 1]), "no_rope_layers"),
], ids=["a list of another length", "not 0 or 1"])
def test_a_smollm3_config_ringpipe_cannot_represent_is_refused_naming_the_key(tmp_path, config, key):
    folder = config_only(tmp_path, model_type="smollm3", architectures=["SmolLM3ForCausalLM"],
                         **dict(SHAPE, num_hidden_layers=4), **config)
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(folder)
    assert key in str(refused.value) and "config.json" in str(refused.value)


def test_an_exported_smollm3_loads_as_smollm3_with_ringpipes_logits(tmp_path):
    cfg = LlamaConfig(**dict(OURS, nope_layers=[0, 3], tie_embeddings=False)).validate()
    arrays = checkpoint_arrays(cfg, seed=2)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["SmolLM3ForCausalLM"] and config["no_rope_layers"] == [0, 1, 1, 0]
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "SmolLM3ForCausalLM"
    tokens = random_tokens(cfg.vocab)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - ours).max() <= EXACT


def test_smollm3_export_import_export_is_bitwise(tmp_path):
    cfg = LlamaConfig(**OURS).validate()
    assert_export_import_export_is_bitwise(cfg, tmp_path, seed=3)


def test_generate_on_a_smollm3_export_gives_ringpipes_greedy_tokens(tmp_path):
    cfg = LlamaConfig(**dict(OURS, nope_layers=[1, 3])).validate()
    arrays = checkpoint_arrays(cfg, seed=4)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    assert_greedy_tokens_agree(cfg, arrays, out)


def test_a_model_with_two_families_parts_is_refused_by_the_export(tmp_path):
    cfg = LlamaConfig(**dict(OURS, qk_norm="head")).validate()
    with pytest.raises(hf.HFError, match=r"these parts \(qk_norm head, nope True\) has no Hugging Face class"):
        hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), model="llama")


def test_a_smollm3_folder_fine_tunes_with_nope_from_the_command_line(tmp_path):
    """--init-from a SmolLM3 folder: the run's checkpoint records the NoPE blocks and exports back."""
    folder = save(random_smollm3(seed=5, vocab_size=256, max_position_embeddings=32), tmp_path / "hf")
    _, config, cfg, _ = fine_tune_and_export(folder, tmp_path)
    assert cfg.nope_layers == [3] and config["no_rope_layers"] == [1, 1, 1, 0]
