"""engine/interop/hf_llama.py: the Llama family in and out of Hugging Face's format (issue 23).

transformers (on torch) is the oracle, in float64: a LlamaForCausalLM saved with
save_pretrained must give its logits in ringpipe after --init-from's import (max |diff|
<= 1e-10), and ringpipe's export must give ringpipe's logits in LlamaForCausalLM. A
deliberately wrong RoPE layout must fail the same comparison (a loose tolerance can hide
a wrong permutation). Skipped where torch, transformers or safetensors are missing.
"""
import json
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face tests need torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")
pytest.importorskip("safetensors.numpy", reason="engine/interop/hf.py needs safetensors")

from ringpipe.engine.interop import hf, hf_folder, hf_llama  # noqa: E402
from ringpipe.engine.model.chain import LayerChain  # noqa: E402
from ringpipe.engine.model.llama import PRESETS, LlamaConfig, llama_layers  # noqa: E402

EXACT = 1e-10          # float64, the same weights: only summation order differs
torch.set_num_threads(1)

# transformers' own test shape (LlamaModelTester), as the preset hf-tiny; a context of 24
# keeps the tests quick.
HF_TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=37, max_position_embeddings=24)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8}


# ---- helpers -------------------------------------------------------------------------------

def randomize(model, seed):
    """Every parameter random; the norms' weights near 1 (all 1 would hide a mix-up of the two)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.2)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p += 1.0
    return model.eval()


def random_hf_model(seed=0, kind="llama", **overrides):
    settings = dict(HF_TINY, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    settings.update(overrides)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    rope_scaling = settings.pop("rope_scaling", None)
    config = config_class(**settings)
    if rope_scaling is not None:
        config.rope_parameters = dict(rope_scaling, rope_theta=settings["rope_theta"])
    return randomize(model_class(config), seed)


def save(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return str(folder)


def hf_logits(folder, tokens):
    """transformers' logits of the folder's model, in float64 throughout (see lift_to_float64)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                              dtype=torch.float64).eval()
    lift_to_float64(model)
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def lift_to_float64(model):
    """transformers computes RMSNorm and the RoPE tables in float32 even in a float64 model
    (eager attention's softmax too, hence sdpa): lifted to float64, as tests/engine/model/
    test_llama.py does, so the comparison sees the math, not float32 rounding. The tables
    are ringpipe's (the model's Rotary), checked first against transformers' own to float32
    precision."""
    from ringpipe.engine.model.llama import Rotary
    rope = model.config.rope_parameters
    scaling = None
    if rope["rope_type"] == "llama3":
        scaling = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")}
    rotary = model.model.rotary_emb
    head_dim = rotary.inv_freq.numel() * 2
    positions = torch.arange(model.config.max_position_embeddings)[None]
    theirs = rotary(torch.zeros(1, dtype=torch.float64), positions)
    ours = Rotary(head_dim, rope["rope_theta"], scaling).tables(positions.shape[1], np.zeros(1))
    for table, their_table in zip(ours, theirs):
        np.testing.assert_allclose(their_table[0].numpy(), table, atol=1e-5)
    cos, sin = (torch.from_numpy(np.asarray(table, dtype=np.float64)) for table in ours)

    def float64_rope(x, position_ids):
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    def float64_rmsnorm(norm, h):
        return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    rotary.forward = float64_rope
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(float64_rmsnorm, module)


def ringpipe_model(cfg, arrays):
    model = LayerChain(llama_layers(cfg), dtype=np.float64)
    model.params.load_flat(model.params.data, arrays)
    return model


def ringpipe_logits(model, tokens, vocab):
    logits, _ = model.forward(tokens, targets=None, need_grad=False)
    return np.asarray(logits)[:, :, :vocab]


def random_tokens(vocab, batch=2, length=24, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=(batch, length))


def imported_diff(folder):
    """max |ringpipe's logits - transformers'| for the folder's model, through import_hf."""
    cfg, arrays, _ = hf.import_hf(folder)
    tokens = random_tokens(cfg.vocab, length=min(24, cfg.context))
    return np.abs(ringpipe_logits(ringpipe_model(cfg, arrays), tokens, cfg.vocab) - hf_logits(folder, tokens)).max()


def checkpoint_arrays(cfg, seed=0):
    """A ringpipe Llama's parameters as a checkpoint holds them ({"param/<name>": array}),
    every one random and exactly a float32 (the export's dtype), norms near 1."""
    model = LayerChain(llama_layers(cfg), dtype=np.float64)
    rng = np.random.default_rng(seed)
    arrays = {}
    for name in model.params.names():
        shape = model.params.view(name).shape
        values = rng.normal(0.0, 0.2, size=shape) + (1.0 if name.endswith(("norm1.w", "norm2.w", "norm_f.w")) else 0)
        arrays[f"param/{name}"] = values.astype(np.float32).astype(np.float64)
    return arrays


def folder_bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def assert_greedy_tokens_agree(cfg, arrays, folder, tokens=20, lift=None):
    """transformers' greedy generate on the exported `folder` (float64, lifted by `lift`, default
    lift_to_float64) equals ringpipe's sampler on the checkpoint's `arrays` ({"param/<name>": ...}),
    `tokens` tokens after a three-token prompt: the KV cache, windows and NoPE blocks included."""
    from ringpipe.engine.model.registry import RECIPES
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa",
                                                              dtype=torch.float64).eval()
    (lift or lift_to_float64)(model)
    prompt = [5, 17, 42]
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ours = ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()})
    assert generated[0, len(prompt):].tolist() == list(RECIPES["llama"].generate(ours, prompt, tokens, cfg.context,
                                                                                 temperature=0))


def assert_export_import_export_is_bitwise(cfg, folder, seed=3):
    """A checkpoint of cfg exported, imported and exported again: the same config, the same bytes."""
    first = hf.export_hf(checkpoint_arrays(cfg, seed=seed), cfg.to_dict(), str(folder / "1"), model="llama")
    cfg2, arrays, _ = hf.import_hf(first)
    assert cfg2 == cfg
    second = hf.export_hf(arrays, cfg2.to_dict(), str(folder / "2"), model="llama")
    assert folder_bytes(first) == folder_bytes(second)


def fine_tune_and_export(folder, tmp_path, *flags):
    """A save_pretrained folder (the byte tokenizer put beside it) -> --init-from (its family from
    config.json, or `flags`' --model) -> two steps -> ringpipe export to tmp_path/out. Returns (run
    dir, exported config.json, the checkpoint's LlamaConfig, its params as float32 {name: array})."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.train.cli import run_flags
    with open(os.path.join(folder, "tokenizer.json"), "w") as fh:
        fh.write(load_tokenizer("bytes").to_json())
    run = tmp_path / "run"
    run_flags([*flags, "--init-from", f"hf:{folder}", "--data", "synthetic", "--steps", "2", "--batch-size", "4",
               "--seq-len", "32", "--quiet", "--out", str(run)])
    assert hf.main([str(run), "--out", str(tmp_path / "out")]) == 0
    arrays, manifest = checkpoint.load(str(run))
    params = {k[len("param/"):]: v.astype(np.float32) for k, v in arrays.items() if k.startswith("param/")}
    return run, json.load(open(tmp_path / "out" / "config.json")), LlamaConfig(**manifest["model_config"]), params


def assert_export_and_sample_agree(run, cfg, params, out, capsys, logits_of=None):
    """The exported folder `out` gives the checkpoint's logits in transformers (float64; logits_of,
    default hf_logits), and ringpipe sample reads the run and continues the prompt."""
    from ringpipe.engine.interop import sample
    tokens = random_tokens(256, length=32)
    ours = ringpipe_logits(ringpipe_model(cfg, params), tokens, 256)
    assert np.abs((logits_of or hf_logits)(str(out), tokens) - ours).max() <= EXACT
    capsys.readouterr()
    assert sample.main([str(run), "--prompt", "def ", "--tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(changes)
    for key in [k for k, v in changes.items() if v is _DELETE]:
        del config[key]
    json.dump(config, open(path, "w"))


_DELETE = object()


def config_only(tmp_path, **config):
    """A folder holding only config.json: a refusal from it happened before any weight was looked for."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                **HF_TINY)
    base.update(config)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v is not _DELETE}))
    return str(folder)


# ---- import: transformers -> ringpipe ----------------------------------------------------------

SHAPES = {
    "hf-tiny, tied": dict(),
    "hf-tiny, untied": dict(tie_word_embeddings=False),
    "multi-query": dict(num_key_value_heads=1),
    "multi-head": dict(num_key_value_heads=4),
    "theta and eps": dict(rope_theta=500000.0, rms_norm_eps=1e-6),
    "head_dim set": dict(head_dim=16),
    "llama3 scaling": dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
}


@pytest.mark.parametrize("overrides", SHAPES.values(), ids=SHAPES.keys())
def test_an_imported_llama_gives_transformers_logits(tmp_path, overrides):
    folder = save(random_hf_model(**overrides), tmp_path / "hf")
    diff = imported_diff(folder)
    assert diff <= EXACT, diff


def test_import_reads_the_shape_from_config_json(tmp_path):
    folder = save(random_hf_model(tie_word_embeddings=False, rope_theta=500000.0), tmp_path / "hf")
    cfg, arrays, tokenizer = hf.import_hf(folder)
    assert isinstance(cfg, LlamaConfig) and tokenizer is None
    assert cfg == LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, rope_theta=500000.0, tie_embeddings=False,
                                     rms_eps=1e-5)).validate()
    assert arrays["wte"].shape == arrays["lm_head.w"].shape == (cfg.padded_vocab, 32) == (128, 32)
    assert not arrays["wte"][99:].any() and not arrays["lm_head.w"][99:].any()      # the padding rows
    assert all(a.dtype == np.float32 for a in arrays.values())


def test_qwen2_and_mistral_folders_that_fit_are_imported_exactly(tmp_path):
    qwen = save(random_hf_model(kind="qwen2", seed=3), tmp_path / "qwen2")
    cfg, arrays, _ = hf.import_hf(qwen)
    assert cfg.qkv_bias and arrays["h.1.attn.k.b"].any()
    assert imported_diff(qwen) <= EXACT
    # Mistral with its window switched off, or no shorter than the context.
    for window in (None, 24):
        mistral = save(random_hf_model(kind="mistral", seed=4, sliding_window=window), tmp_path / f"mistral-{window}")
        assert imported_diff(mistral) <= EXACT


def test_import_reads_sharded_and_bf16_folders(tmp_path):
    model = random_hf_model(seed=5, tie_word_embeddings=False)
    sharded = save(model, tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert imported_diff(sharded) <= EXACT
    bf16 = save(model.to(torch.bfloat16), tmp_path / "bf16")
    assert imported_diff(bf16) <= EXACT


def test_a_download_with_transformers_4_config_keys_is_read_as_transformers_reads_it(tmp_path):
    """Llama 3.2's and SmolLM2's config.json on the Hub predate rope_parameters: theta in
    rope_theta, Llama 3's scaling in rope_scaling, bf16 weights, eos a list."""
    folder = save(random_hf_model(seed=15).to(torch.bfloat16), tmp_path / "hf")
    config = json.load(open(os.path.join(folder, "config.json")))
    del config["rope_parameters"]
    config.update(rope_theta=500000.0, torch_dtype="bfloat16", eos_token_id=[1, 2],
                  rope_scaling=dict(LLAMA3_SCALING, original_max_position_embeddings=16))
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    cfg, _, _ = hf.import_hf(folder)
    assert (cfg.rope_theta, cfg.rope_scaling["original_max_position_embeddings"]) == (500000.0, 16)
    assert imported_diff(folder) <= EXACT


def test_a_swapped_rope_layout_or_head_order_fails_the_comparison(tmp_path):
    """The negative control: q/k rows in Meta's interleaved RoPE layout (or heads out of
    order) give another model, and the comparison that passes at 1e-10 says so."""
    folder = save(random_hf_model(seed=6), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    hd = cfg.head_dim
    # Meta's order: the rotary pair (i, i + hd/2) of the half-split layout at rows (2i, 2i + 1).
    interleaved = np.stack([np.arange(hd // 2), np.arange(hd // 2) + hd // 2], axis=1).reshape(-1)
    tokens = random_tokens(cfg.vocab)
    theirs = hf_logits(folder, tokens)
    for swap in ("rope layout", "head order"):
        wrong = dict(arrays)
        for name in ("h.0.attn.q.w", "h.0.attn.k.w"):
            heads = arrays[name].reshape(-1, hd, cfg.d_model)
            heads = heads[:, interleaved] if swap == "rope layout" else heads[::-1]
            wrong[name] = heads.reshape(-1, cfg.d_model)
        diff = np.abs(ringpipe_logits(ringpipe_model(cfg, wrong), tokens, cfg.vocab) - theirs).max()
        assert diff > 1e-3, (swap, diff)


def test_import_notes_name_the_llamas_dropout_not_gpt2s(tmp_path):
    folder = save(random_hf_model(), tmp_path / "hf")
    assert hf.import_notes(folder) == []                # no GPT-2 dropout defaults for a Llama
    edit_config(folder, attention_dropout=0.1)
    assert "attention_dropout 0.1" in hf.import_notes(folder)[0]


# ---- refusals: before any work, naming the key ---------------------------------------------

REFUSED = {
    "a mixture of experts": (dict(model_type="mixtral"), "model_type"),
    "experts in a llama config": (dict(num_local_experts=8), "num_local_experts"),
    "another activation": (dict(hidden_act="gelu"), "hidden_act"),
    "a bias on o_proj": (dict(attention_bias=True), "attention_bias"),
    "MLP biases": (dict(mlp_bias=True), "mlp_bias"),
    "an unknown layer type": (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
    "a rope type": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    "a rope type, transformers 5": (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
                                    "rope_parameters"),
    "llama3 without its numbers": (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    "partial rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "quantized": (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    "kv heads not dividing": (dict(num_key_value_heads=3), "num_key_value_heads"),
    "a size missing": (dict(intermediate_size=_DELETE), "intermediate_size"),
}


@pytest.mark.parametrize("config, key", REFUSED.values(), ids=REFUSED.keys())
def test_a_config_ringpipe_cannot_represent_is_refused_before_any_work_naming_the_key(tmp_path, config, key):
    folder = config_only(tmp_path, **config)      # no weights: a refusal here read none
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(folder)
    message = str(refused.value)
    assert key in message and "config.json" in message, message
    assert "safetensors" not in message, message


def test_sliding_windows_are_read_as_transformers_builds_them(tmp_path):
    """Mistral's window on every layer, Qwen2's when switched on: from max_window_layers on, or
    on the layers layer_types names; and each imported folder gives transformers' logits."""
    def read(**config):
        return hf_llama.config_from_hf(dict(HF_TINY, hidden_act="silu", **config), "here")
    mistral = read(model_type="mistral", sliding_window=16)
    assert (mistral.sliding_window, mistral.window_layers) == (16, None)
    assert read(model_type="mistral", max_position_embeddings=8192).sliding_window == 4096   # its default
    qwen = read(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert (qwen.sliding_window, qwen.window_layers) == (16, [1])
    typed = read(model_type="qwen2", use_sliding_window=True, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention"])
    assert (typed.sliding_window, typed.window_layers) == (8, [0])
    for kind, extra in (("mistral", dict(sliding_window=5)),
                        ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1))):
        folder = save(random_hf_model(kind=kind, seed=21, **extra), tmp_path / kind)
        assert imported_diff(folder) <= EXACT, kind


def test_a_windowed_llama_exports_as_mistral_and_reads_back(tmp_path):
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, sliding_window=5)).validate()
    arrays = checkpoint_arrays(cfg, seed=22)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["architectures"], config["sliding_window"]) == (["MistralForCausalLM"], 5)
    tokens = random_tokens(cfg.vocab)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - ours).max() <= EXACT
    assert hf.import_hf(out)[0] == cfg
    partial = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, sliding_window=5, window_layers=[1])).validate()
    with pytest.raises(hf.HFError, match="sliding window on some of the blocks of a model with LlamaForCausalLM, MistralForCausalLM.s parts has no Hugging Face class"):
        hf.export_hf(checkpoint_arrays(partial), partial.to_dict(), str(tmp_path / "partial"), model="llama")


def test_generate_on_a_windowed_export_gives_ringpipes_greedy_tokens(tmp_path):
    """The KV-cache sampler honours the window: 20 greedy tokens past a window of 4, against
    transformers' generate on the Mistral export (float64)."""
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, sliding_window=4)).validate()
    arrays = checkpoint_arrays(cfg, seed=23)
    assert_greedy_tokens_agree(cfg, arrays, hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama"))


def test_a_window_as_long_as_the_context_and_unswitched_windows_are_fine(tmp_path):
    for config in (dict(model_type="mistral", sliding_window=24), dict(model_type="mistral", sliding_window=None),
                   dict(model_type="qwen2", use_sliding_window=False, sliding_window=4),
                   dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)):
        cfg = hf_llama.config_from_hf(dict(HF_TINY, hidden_act="silu", **config), "here")
        assert cfg.n_layer == 2


def test_tensors_the_config_does_not_have_are_refused_by_name(tmp_path):
    folder = save(random_hf_model(seed=7, attention_bias=True), tmp_path / "hf")
    edit_config(folder, attention_bias=False)         # the config hides the biases; the tensors do not
    with pytest.raises(hf.HFError, match="o_proj.bias"):
        hf.import_hf(folder)
    folder = save(random_hf_model(seed=7), tmp_path / "short")
    edit_config(folder, num_hidden_layers=3)
    with pytest.raises(hf.HFError, match="num_hidden_layers 3.*2 layers"):
        hf.import_hf(folder)
    edit_config(folder, num_hidden_layers=2, intermediate_size=38)
    with pytest.raises(hf.HFError, match="mlp.gate_proj.weight has shape"):
        hf.import_hf(folder)


def test_a_tied_config_with_a_different_head_is_refused(tmp_path):
    folder = save(random_hf_model(seed=8, tie_word_embeddings=False), tmp_path / "hf")
    edit_config(folder, tie_word_embeddings=True)
    with pytest.raises(hf.HFError, match="lm_head.weight differs"):
        hf.import_hf(folder)


# ---- export: ringpipe -> transformers ----------------------------------------------------------

EXPORTED = {
    "hf-tiny": dict(PRESETS["hf-tiny"], context=24),
    "untied, odd vocab": dict(PRESETS["hf-tiny"], context=24, vocab=300, tie_embeddings=False),
    "multi-query": dict(PRESETS["hf-tiny"], context=24, n_kv_head=1),
    "llama3 scaling": dict(PRESETS["hf-tiny"], context=24, rope_theta=500000.0, rms_eps=1e-6,
                           rope_scaling={k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}),
    "q/k/v biases (qwen2)": dict(PRESETS["hf-tiny"], context=24, qkv_bias=True),
}


@pytest.mark.parametrize("shape", EXPORTED.values(), ids=EXPORTED.keys())
def test_an_exported_llama_gives_ringpipes_logits_in_transformers(tmp_path, shape):
    cfg = LlamaConfig(**shape).validate()
    arrays = checkpoint_arrays(cfg)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    tokens = random_tokens(cfg.vocab)
    ours = ringpipe_logits(ringpipe_model(cfg, {k[len("param/"):]: v for k, v in arrays.items()}), tokens, cfg.vocab)
    diff = np.abs(hf_logits(out, tokens) - ours).max()
    assert diff <= EXACT, diff


def test_export_writes_every_config_key_and_hugging_faces_names(tmp_path):
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, tie_embeddings=False)).validate()
    out = hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size")} \
        == dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=24, vocab_size=99)
    # Written, not left to transformers' defaults (rms_norm_eps 1e-6, tied false in 5.x).
    assert (config["hidden_act"], config["rms_norm_eps"], config["tie_word_embeddings"]) == ("silu", 1e-5, False)
    assert (config["attention_bias"], config["mlp_bias"], config["rope_scaling"]) == (False, False, None)
    assert config["rope_theta"] == 10000.0
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config["dtype"] == config["torch_dtype"] == "float32"
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.rms_norm_eps, loaded.tie_word_embeddings, loaded.num_key_value_heads) == (1e-5, False, 2)
    names = set(hf_folder.__dict__["_safetensors"]("numpy").load_file(os.path.join(out, "model.safetensors")))
    assert names == {theirs for _, theirs in hf_llama.name_map(cfg)}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= names


def test_export_import_export_is_bitwise(tmp_path):
    shape = dict(PRESETS["hf-tiny"], context=24, vocab=300, tie_embeddings=False, rope_theta=500000.0,
                 rope_scaling={k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"})
    for name, extra in (("untied llama3", {}), ("qwen2", dict(qkv_bias=True, tie_embeddings=True))):
        cfg = LlamaConfig(**dict(shape, **extra)).validate()
        first = hf.export_hf(checkpoint_arrays(cfg, seed=9), cfg.to_dict(), str(tmp_path / name / "1"),
                             model="llama")
        cfg2, arrays, _ = hf.import_hf(first)
        assert cfg2 == cfg, name
        second = hf.export_hf(arrays, cfg2.to_dict(), str(tmp_path / name / "2"), model="llama")
        assert folder_bytes(first) == folder_bytes(second), name


def test_an_imported_folder_exports_to_the_same_model(tmp_path):
    """A user's folder (save_pretrained) -> ringpipe -> export: transformers gives the same logits."""
    folder = save(random_hf_model(seed=10, tie_word_embeddings=False, num_key_value_heads=1), tmp_path / "hf")
    cfg, arrays, _ = hf.import_hf(folder)
    out = hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "out"), model="llama")
    tokens = random_tokens(cfg.vocab)
    assert np.abs(hf_logits(out, tokens) - hf_logits(folder, tokens)).max() <= EXACT


def test_generate_on_an_export_gives_ringpipes_greedy_tokens(tmp_path):
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, n_kv_head=1)).validate()
    arrays = checkpoint_arrays(cfg, seed=13)
    assert_greedy_tokens_agree(cfg, arrays, hf.export_hf(arrays, cfg.to_dict(), str(tmp_path / "hf"), model="llama"),
                               tokens=8)


def test_export_takes_bos_and_eos_from_the_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer test needs the tokenizers library")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=280, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["ringpipe trains llamas by hand. " * 50], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24, vocab=tok.get_vocab_size())).validate()
    out = hf.export_hf(checkpoint_arrays(cfg), cfg.to_dict(), str(tmp_path / "hf"), tokenizer_json=str(tmp_path /
                       "tokenizer.json"), model="llama")
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert (loaded.bos_token, loaded.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert hf.import_hf(out)[2] == os.path.join(out, "tokenizer.json")


def test_a_huge_declared_depth_is_refused_before_anything_is_built(tmp_path):
    folder = save(random_hf_model(seed=14, kind="qwen2"), tmp_path / "hf")
    edit_config(folder, num_hidden_layers=2**14, use_sliding_window=True, sliding_window=4096,
                max_window_layers=2**14, layer_types=_DELETE)     # the most layers config.json may declare
    with pytest.raises(hf.HFError, match="num_hidden_layers 16384, but the weights hold 2 layers"):
        hf.import_hf(folder)


def test_export_refuses_parameters_of_another_shape_or_without_a_mapping(tmp_path):
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24)).validate()
    arrays = checkpoint_arrays(cfg)
    with pytest.raises(hf.HFError, match="no Hugging Face mapping"):
        hf.export_hf(dict(arrays, **{"param/h.0.attn.o.b": np.zeros(32)}), cfg.to_dict(), str(tmp_path / "a"),
                     model="llama")
    with pytest.raises(hf.HFError, match="h.1.mlp.up.w"):
        hf.export_hf(dict(arrays, **{"param/h.1.mlp.up.w": np.zeros((38, 32))}), cfg.to_dict(),
                     str(tmp_path / "b"), model="llama")
    with pytest.raises(hf.HFError, match="model_config has the keys"):
        hf.export_hf(arrays, dict(cfg.to_dict(), n_embd=3), str(tmp_path / "c"), model="llama")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_the_name_table_is_the_models_parameters():
    """Every parameter the model has is mapped, and only those (the export checks it too)."""
    for extra in ({}, dict(tie_embeddings=False), dict(qkv_bias=True)):
        cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], **extra)).validate()
        model = LayerChain(llama_layers(cfg))
        ours = {name: model.params.view(name).shape for name in model.params.names()}
        assert ours == {name: hf_llama.shape_of(cfg, name, cfg.padded_vocab) for name, _ in hf_llama.name_map(cfg)}


# ---- the command lines: --init-from hf:DIR, ringpipe export, ringpipe sample ---------------------

def test_a_llama_folder_fine_tunes_exports_and_samples(tmp_path, capsys):
    """A user's folder (save_pretrained, with the byte tokenizer) -> --init-from -> two steps ->
    ringpipe export -> transformers gives the checkpoint's logits; ringpipe sample reads the run."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    folder = save(random_hf_model(seed=11, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=32),
                  tmp_path / "hf")
    run, config, cfg, params = fine_tune_and_export(folder, tmp_path, "--model", "llama")
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert open(tmp_path / "out" / "tokenizer.json").read() == load_tokenizer("bytes").to_json()
    assert_export_and_sample_agree(run, cfg, params, tmp_path / "out", capsys)


def test_init_from_a_llama_folder_with_another_model_is_refused_naming_the_family(tmp_path):
    from ringpipe.engine.train.cli import run_flags
    folder = save(random_hf_model(seed=12, vocab_size=256, max_position_embeddings=32), tmp_path / "hf")
    with pytest.raises(SystemExit, match="holds a model of the llama family, not gpt: pass --model llama"):
        run_flags(["--model", "gpt", "--init-from", f"hf:{folder}", "--data", "synthetic", "--steps", "1", "--batch-size", "4",
                   "--seq-len", "32", "--quiet", "--out", str(tmp_path / "run")])
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_export_refuses_an_edited_llama_checkpoint_before_reading_it(tmp_path, capsys):
    from ringpipe.engine.job import checkpoint
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=24)).validate()
    meta = {"model": "llama", "model_config": dict(cfg.to_dict(), d_ff=38), "args": {}, "optimizer": "adamw",
            "opt_step_count": 0, "loss": None, "dtype": "float32", "precision": "float32", "layout": {"dp": 1, "pp": 1, "tp": 1, "chunks": 1}}
    checkpoint.save(str(tmp_path / "run" / "checkpoints"), 1, checkpoint_arrays(cfg), meta)
    assert hf.main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert "param/h.0.mlp.gate.w" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_init_from_without_model_takes_the_family_from_the_folder(tmp_path):
    """--init-from hf:DIR alone: the folder's config.json names the family (issue 23: it takes
    the family and shape from config.json, as it does for GPT-2)."""
    from ringpipe.engine.interop.hf import family_of
    from ringpipe.engine.train.cli import config_from_args, parse_args
    llama, gpt2, other = tmp_path / "llama", tmp_path / "gpt2", tmp_path / "other"
    for folder, model_type in ((llama, "llama"), (gpt2, "gpt2"), (other, "bert")):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert family_of(str(llama)) == "llama" and family_of(str(gpt2)) == "gpt" and family_of(str(other)) is None
    assert family_of(str(tmp_path / "missing")) is None
    assert config_from_args(parse_args(["--init-from", f"hf:{llama}"])).model == "llama"
    assert config_from_args(parse_args(["--init-from", f"hf:{gpt2}"])).model == "gpt"
    assert config_from_args(parse_args(["--init-from", f"hf:{other}"])).model == "gpt"     # the import says why
    assert config_from_args(parse_args([])).model == "gpt"
    assert config_from_args(parse_args(["--model", "gpt", "--init-from", f"hf:{llama}"])).model == "gpt"
