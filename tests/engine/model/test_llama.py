"""The Llama family (engine/model/llama.py): finite-difference checks of every new layer
and of whole models (float64), exactness against transformers' LlamaForCausalLM on the
same weights (logits and first-step gradients), its shape checks, and training through
the library entry point (learning, resume, refusals)."""
import json
import os

import numpy as np
import pytest

from ringpipe import kernels as K
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model import llama as M
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.train.cli import run_flags
from ringpipe.kernels.rope import rope_inv_freq
from tests.engine.model.test_gradients import TOL, check_layer, check_model, numeric_grad, rel_err
from tests.support import checkpoints

rng = np.random.default_rng(0)


def tiny(**shape):
    base = dict(n_layer=1, d_model=8, n_head=4, n_kv_head=2, d_ff=5, context=8, vocab=11)
    return M.LlamaConfig(**{**base, **shape}).validate()


# ---- finite differences ------------------------------------------------------------

def test_rmsnorm():
    check_layer(M.RMSNorm("norm", 7), rng.normal(size=(2, 3, 7)))


@pytest.mark.parametrize("scaling", [None, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])
def test_rope(scaling):
    x = rng.normal(size=(2, 5, 3, 8))                          # (B, T, H, hd)
    cos, sin = M.Rotary(8, 10000.0, scaling).tables(5, x)
    R = rng.normal(size=x.shape)
    dx = K.rope_backward(R, cos, sin)
    assert rel_err(dx, numeric_grad(lambda: float((K.rope_forward(x, cos, sin) * R).sum()), x)) < TOL


@pytest.mark.parametrize("d_ff", [5, 37])
def test_swiglu_mlp(d_ff):
    check_layer(M.SwiGLU("mlp", tiny(d_model=6, n_head=1, n_kv_head=1, d_ff=d_ff)), rng.normal(size=(2, 3, 6)))


@pytest.mark.parametrize("kv_heads,bias,qk_norm", [(4, False, "none"), (2, False, "none"), (1, False, "none"),
                                                   (2, True, "none"), (2, False, "head"), (1, False, "head")],
                         ids=["mha", "gqa", "mqa", "gqa-bias", "gqa-qk-norm", "mqa-qk-norm"])
def test_grouped_query_attention(kv_heads, bias, qk_norm):
    cfg = tiny(n_kv_head=kv_heads, qkv_bias=bias, qk_norm=qk_norm, head_dim=6)
    layer = M.GroupedQueryAttention("attn", cfg, M.Rotary(cfg.head_dim, 100.0))
    check_layer(layer, rng.normal(size=(2, 5, 8)))


def test_width_rmsnorm():
    """OLMo 2's q/k norm: one RMS over all of a position's (heads, hd) channels."""
    check_layer(M.WidthRMSNorm("norm", 12, 1e-5), rng.normal(size=(2, 3, 4, 3)))


def test_post_norm_block():
    cfg = tiny(qk_norm="all", norm_place="post")
    check_layer(M.LlamaBlock("h.0", cfg, M.Rotary(cfg.head_dim, 100.0)), rng.normal(size=(2, 5, 8)))   # post norms


def test_llama_block():
    cfg = tiny()
    check_layer(M.LlamaBlock("h.0", cfg, M.Rotary(cfg.head_dim, 100.0)), rng.normal(size=(2, 5, 8)))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_whole_llama_all_parameters(tied):
    cfg = tiny(n_layer=2, tie_embeddings=tied, rope_theta=100.0)
    stage = LayerChain(M.llama_layers(cfg), dtype=np.float64)
    check_model(stage, rng.integers(0, 11, size=(2, 5)), rng.integers(0, 11, size=(2, 5)), check_input=False)


def test_llama_blocks_and_head_input_gradient():
    stage = LayerChain(M.llama_layers(tiny(n_layer=2))[1:], dtype=np.float64)
    check_model(stage, rng.normal(size=(2, 5, 8)), rng.integers(0, 11, size=(2, 5)), check_input=True)


# ---- the shape -------------------------------------------------------------------

def test_defaults_are_filled_in_and_recorded():
    cfg = M.LlamaConfig(d_model=96, n_head=6).validate()
    assert (cfg.n_kv_head, cfg.head_dim, cfg.d_ff) == (6, 16, 256)
    assert cfg.to_dict()["n_kv_head"] == 6 and cfg.padded_vocab == 256


@pytest.mark.parametrize("shape,says", [
    (dict(d_model=96, n_head=6, n_kv_head=4), "kv_heads 4 does not divide heads 6 .* use kv_heads 1, 2, 3, 6"),
    (dict(d_model=30, n_head=4), "divisible by heads 4"),
    (dict(d_model=12, n_head=4), "head size 3 must be even"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn' is not supported"),
    (dict(rope_scaling={"factor": 2.0}), "missing high_freq_factor"),
    (dict(rope_theta=0.0), "must be > 0"),
    (dict(qk_norm="some"), "qk_norm must be one of none, head, all"),
    (dict(norm_place="middle"), "norm_place must be one of pre, post"),
    (dict(n_layer=1, nope_layers=[1]), "nope_layers must be distinct block indices from 0 to layers - 1 = 0"),
    (dict(nope_layers="1,x"), "nope_layers must be block indices separated by commas"),
])
def test_bad_shapes_are_refused_saying_what_works(shape, says):
    with pytest.raises(ConfigError, match=says):
        M.LlamaConfig(**shape).validate()


def test_presets_are_the_real_shapes():
    smol = M.LlamaConfig(**M.PRESETS["smollm2-135m"]).validate()
    assert abs(M.parameter_count(smol) - 134_515_008) < 0.01 * 134_515_008      # SmolLM2-135M, as HF counts it
    one_b = M.LlamaConfig(**M.PRESETS["llama3.2-1b"]).validate()
    assert abs(M.parameter_count(one_b) - 1_235_814_400) < 0.01 * 1_235_814_400  # Llama 3.2 1B
    assert M.flops_per_token(smol, 2048) > 6 * M.parameter_count(smol) * 0.5
    # Qwen3-0.6B and 1.7B as Hugging Face counts them (tied embeddings, q/k norms of 128 each).
    assert M.parameter_count(M.LlamaConfig(**M.PRESETS["qwen3-0.6b"]).validate()) == 596_049_920
    assert M.parameter_count(M.LlamaConfig(**M.PRESETS["qwen3-1.7b"]).validate()) == 1_720_574_976
    assert M.parameter_count(M.LlamaConfig(**M.PRESETS["olmo2-1b"]).validate()) == 1_484_916_736   # OLMo 2 1B
    smol3 = M.LlamaConfig(**M.PRESETS["smollm3-3b"]).validate()                  # SmolLM3-3B, as HF counts it
    assert M.parameter_count(smol3) == 3_075_098_624 and smol3.nope_layers == list(range(3, 36, 4))


# ---- exactness against transformers ------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
HF_TINY = M.PRESETS["hf-tiny"]
SHAPES = {
    "hf-tiny": dict(HF_TINY),
    "hf-tiny-untied": dict(HF_TINY, tie_embeddings=False),
    "mha": dict(HF_TINY, n_kv_head=4, d_ff=40),
    "mqa-untied": dict(HF_TINY, n_kv_head=1, tie_embeddings=False),
    "llama3-rope": dict(HF_TINY, rope_scaling=LLAMA3, rope_theta=500000.0),
    "qwen2-qkv-bias": dict(HF_TINY, qkv_bias=True, rms_eps=1e-6),     # compared with Qwen2ForCausalLM
    # Qwen3ForCausalLM: the per-head q/k norm; the odd shape (head_dim 16, not 48 / 6).
    "qwen3-qk-norm": dict(HF_TINY, qk_norm="head", rms_eps=1e-6),
    "qwen3-odd": dict(n_layer=2, d_model=48, n_head=6, n_kv_head=2, d_ff=37, head_dim=16, context=32, vocab=97,
                      qk_norm="head", rms_eps=3e-6, rope_theta=77777.0, tie_embeddings=False),
    # Olmo2ForCausalLM: norms after attention and the MLP, the q/k norm over all heads; odd widths
    "olmo2": dict(n_layer=2, d_model=48, n_head=6, n_kv_head=2, d_ff=37, context=32, vocab=97, qk_norm="all",
                  norm_place="post", rms_eps=2e-6, rope_theta=500000.0, tie_embeddings=False),
    # MistralForCausalLM: a sliding window of 5 on every block (the sequences are 13 long)
    "mistral-window": dict(HF_TINY, sliding_window=5, rms_eps=1e-6),
    # Qwen3ForCausalLM with a window of 4 on block 1 only (layer_types)
    "qwen3-window-layers": dict(HF_TINY, qk_norm="head", sliding_window=4, window_layers=[1], rms_eps=1e-6),
    # SmolLM3ForCausalLM: block 1 of 3 without rotary positions (NoPE)
    "smollm3-nope": dict(HF_TINY, n_layer=3, nope_layers=[1], rms_eps=1e-6, rope_theta=2000000.0),
}


def _float64_rmsnorm(self, h):
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_model(cfg: M.LlamaConfig, monkeypatch):
    """A random LlamaForCausalLM (Qwen2ForCausalLM with qkv_bias) of cfg's shape in float64.
    transformers computes RMSNorm and the RoPE tables in float32 even in a float64 model (for half-precision training);
    the test lifts those two to float64 so that the comparison sees the math, not float32
    rounding. Its llama3 frequencies are checked against ours at float32 precision first."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_type": "llama3", "rope_theta": cfg.rope_theta}
    qwen = cfg.qkv_bias          # Qwen2: Llama's block with q/k/v biases (Llama's attention_bias adds o's too)
    family = (transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if qwen else \
        (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    extra = dict(use_sliding_window=False) if qwen else dict(attention_bias=False, mlp_bias=False)
    sliding = [i for i in range(cfg.n_layer) if M.window_of(cfg, i)]
    windows = dict(use_sliding_window=bool(sliding), sliding_window=cfg.sliding_window,
                   layer_types=["sliding_attention" if i in sliding else "full_attention" for i in range(cfg.n_layer)])
    if cfg.sliding_window and not (qwen or cfg.qk_norm != "none" or cfg.nope_layers):
        # Mistral: Llama's block with a window on every layer
        family, extra = (transformers.MistralConfig, transformers.MistralForCausalLM), dict(
            sliding_window=cfg.sliding_window)
    if cfg.qk_norm == "head":    # Qwen3: Llama's block with q_norm and k_norm over each head
        family, extra = (transformers.Qwen3Config, transformers.Qwen3ForCausalLM), dict(attention_bias=False,
                                                                                        **windows)
    if cfg.norm_place == "post":  # OLMo 2: the norms after attention and the MLP, q/k norms over all heads
        family, extra = (transformers.Olmo2Config, transformers.Olmo2ForCausalLM), dict(attention_bias=False,
                                                                                        pad_token_id=None)
    if cfg.nope_layers:          # SmolLM3: Llama's block, some blocks without RoPE (no_rope_layers 0)
        family = (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM)
        extra = dict(use_sliding_window=False, attention_bias=False, mlp_bias=False, pad_token_id=None,
                     no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layer)])
    hf_cfg = family[0](
        vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context, rms_norm_eps=cfg.rms_eps, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings, **extra)
    torch.manual_seed(0)
    model = family[1](hf_cfg).to(torch.float64).eval()
    model.config._attn_implementation = "sdpa"            # eager's softmax is float32 too
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    ours = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rotary = model.model.rotary_emb
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), ours, rtol=1e-6)
    inv_freq = torch.from_numpy(ours)

    def float64_rope(x, position_ids):
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    monkeypatch.setattr(rotary, "forward", float64_rope)
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _float64_rmsnorm)
    monkeypatch.setattr(transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm, "forward", _float64_rmsnorm)
    monkeypatch.setattr(transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm, "forward", _float64_rmsnorm)
    monkeypatch.setattr(transformers.models.smollm3.modeling_smollm3.SmolLM3RMSNorm, "forward", _float64_rmsnorm)
    monkeypatch.setattr(transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm, "forward", _float64_rmsnorm)
    monkeypatch.setattr(transformers.models.mistral.modeling_mistral.MistralRMSNorm, "forward", _float64_rmsnorm)
    return model


def hf_names(cfg: M.LlamaConfig) -> dict:
    """ringpipe's name of each Hugging Face parameter (the interface's names; the copy needs no permutation)."""
    names = {"model.embed_tokens.weight": "wte", "model.norm.weight": "norm_f.w"}
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.", f"h.{i}."
        if cfg.norm_place == "post":       # OLMo 2: after attention, after the MLP
            names[hf + "post_attention_layernorm.weight"] = ours + "norm1.w"
            names[hf + "post_feedforward_layernorm.weight"] = ours + "norm2.w"
        elif cfg.norm_place == "sandwich":  # Gemma 3: before and after each
            names.update({hf + "input_layernorm.weight": ours + "norm1.w",
                          hf + "post_attention_layernorm.weight": ours + "post_attn_norm.w",
                          hf + "pre_feedforward_layernorm.weight": ours + "norm2.w",
                          hf + "post_feedforward_layernorm.weight": ours + "post_mlp_norm.w"})
        else:
            names[hf + "input_layernorm.weight"] = ours + "norm1.w"
            names[hf + "post_attention_layernorm.weight"] = ours + "norm2.w"
        for p in "qkvo":
            names[hf + f"self_attn.{p}_proj.weight"] = ours + f"attn.{p}.w"
            if cfg.qkv_bias and p != "o":
                names[hf + f"self_attn.{p}_proj.bias"] = ours + f"attn.{p}.b"
        if cfg.qk_norm != "none":
            for p in "qk":
                names[hf + f"self_attn.{p}_norm.weight"] = ours + f"attn.{p}_norm.w"
        for p in ("gate", "up", "down"):
            names[hf + f"mlp.{p}_proj.weight"] = ours + f"mlp.{p}.w"
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.w"
    return names


def ours_from(hf, cfg: M.LlamaConfig, permute=None) -> LayerChain:
    model = M.build_llama(cfg, np.float64)
    hf_params = dict(hf.named_parameters())
    for hf_name, name in hf_names(cfg).items():
        weight = hf_params[hf_name].detach().numpy()
        if permute is not None:
            weight = permute(name, weight)
        model.params.view(name)[:weight.shape[0]] = weight      # wte: the padding rows stay as they are
    return model


def compare(cfg, hf, model, tokens, targets):
    """(max |Δ logits|, the largest of |Δ loss| and each parameter's relative gradient difference)."""
    logits_hf = hf(torch.from_numpy(tokens)).logits
    loss = torch.nn.functional.cross_entropy(logits_hf.reshape(-1, cfg.vocab), torch.from_numpy(targets).reshape(-1))
    loss.backward()
    ours, _ = model.forward(tokens, need_grad=False)
    delta = np.abs(ours[..., :cfg.vocab] - logits_hf.detach().numpy()).max()
    model.params.zero_grad()
    ours_loss = model.loss_and_grad(tokens, targets, grad_scale=1.0 / targets.size) / targets.size
    worst = abs(ours_loss - loss.item())
    hf_params = dict(hf.named_parameters())
    for hf_name, name in hf_names(cfg).items():
        expected = hf_params[hf_name].grad.numpy()
        got = model.params.grad_view(name)[:expected.shape[0]]
        worst = max(worst, np.abs(got - expected).max() / np.abs(expected).max())
    return delta, worst


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_and_gradients_equal_transformers(shape, monkeypatch):
    cfg = M.LlamaConfig(**SHAPES[shape]).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens, targets = rng.integers(0, cfg.vocab, size=(2, 13)), rng.integers(0, cfg.vocab, size=(2, 13))
    delta, worst = compare(cfg, hf, ours_from(hf, cfg), tokens, targets)
    assert delta <= 1e-10 and worst <= 1e-10, (delta, worst)


def _interleaved(cfg):
    """Reorder q and k rows within each head to the interleaved RoPE layout (Meta's
    original checkpoints): a model that is right up to this permutation must fail."""
    def permute(name, w):
        if name.endswith(("attn.q.w", "attn.k.w")):
            heads = w.shape[0] // cfg.head_dim
            return w.reshape(heads, 2, cfg.head_dim // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
        return w
    return permute


def _q_heads_swapped(cfg):
    def permute(name, w):
        if name.endswith("attn.q.w"):
            hd = cfg.head_dim
            return np.concatenate([w[hd:2 * hd], w[:hd], w[2 * hd:]])
        return w
    return permute


@pytest.mark.parametrize("wrong", [_interleaved, _q_heads_swapped], ids=["interleaved-rope", "q-heads-swapped"])
def test_a_wrong_layout_fails_the_exactness_test(wrong, monkeypatch):
    """The negative control: the tolerance above is tight enough to see a permutation."""
    cfg = M.LlamaConfig(**HF_TINY).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13))
    delta, worst = compare(cfg, hf, ours_from(hf, cfg, permute=wrong(cfg)), tokens, tokens)
    assert delta > 1e-6 and worst > 1e-6, (delta, worst)


def test_a_qk_norm_over_the_whole_width_fails_the_exactness_test(monkeypatch):
    """The negative control of Qwen3's norm: one RMSNorm over all of a position's q (or k)
    channels, the weights repeated per head (OLMo 2's placement), is another model."""
    cfg = M.LlamaConfig(**SHAPES["qwen3-odd"]).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13))
    right = ours_from(hf, cfg)
    expected = hf(torch.from_numpy(tokens)).logits.detach().numpy()
    assert np.abs(right.forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max() <= 1e-10

    def over_the_width(self, norm, x):
        if norm is None:
            return x, None
        B, T, heads, hd = x.shape
        y, _ = K.rmsnorm_forward(x.reshape(B * T, heads * hd), np.tile(norm.w, heads), norm.eps)
        return y.reshape(x.shape), None
    monkeypatch.setattr(M.GroupedQueryAttention, "_normed", over_the_width)
    delta = np.abs(ours_from(hf, cfg).forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
    assert delta > 1e-6, delta


def test_olmo2_norms_in_the_wrong_place_or_per_head_fail_the_exactness_test(monkeypatch):
    """The negative controls of OLMo 2: the same weights with the norms before attention and the
    MLP (Llama's place), or the q/k norm per head, give another model."""
    cfg = M.LlamaConfig(**SHAPES["olmo2"]).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13))
    expected = hf(torch.from_numpy(tokens)).logits.detach().numpy()
    assert np.abs(ours_from(hf, cfg).forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max() <= 1e-10
    pre = ours_from(hf, cfg)
    for block in pre.layers[1:-1]:              # the same norms, moved to Llama's slots (before)
        block.ln1, block.ln2, block.post1, block.post2 = block.post1, block.post2, None, None
    delta = np.abs(pre.forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
    assert delta > 1e-6, delta

    def per_head(self, x):
        B, T, heads, hd = x.shape
        y, _ = K.rmsnorm_forward(x.reshape(-1, hd), np.ones(hd), self.eps)
        return (y.reshape(B * T, heads * hd) * self.w).reshape(x.shape), None
    monkeypatch.setattr(M.WidthRMSNorm, "forward", per_head)
    delta = np.abs(ours_from(hf, cfg).forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
    assert delta > 1e-6, delta


@pytest.mark.parametrize("shape", ["mistral-window", "qwen3-window-layers"])
def test_a_window_dropped_or_on_other_blocks_fails_the_exactness_test(shape, monkeypatch):
    """The negative control of sliding windows: the same weights without the window, or with it
    on the other blocks, give another model (the window binds: 13 positions, a window of 4-5)."""
    cfg = M.LlamaConfig(**SHAPES[shape]).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13))
    expected = hf(torch.from_numpy(tokens)).logits.detach().numpy()
    wrongs = [dict(sliding_window=None, window_layers=None), dict(sliding_window=cfg.sliding_window + 1)]
    if cfg.window_layers:
        wrongs.append(dict(window_layers=[0]))
    for wrong in wrongs:
        other = M.LlamaConfig(**{**SHAPES[shape], **wrong}).validate()
        delta = np.abs(ours_from(hf, other).forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
        assert delta > 1e-6, (wrong, delta)


def test_a_nope_block_that_rotates_fails_the_exactness_test(monkeypatch):
    """The negative control of SmolLM3's NoPE blocks: the same weights with every block
    rotating (or the NoPE block moved) give another model."""
    cfg = M.LlamaConfig(**SHAPES["smollm3-nope"]).validate()
    hf = hf_model(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 13))
    expected = hf(torch.from_numpy(tokens)).logits.detach().numpy()
    for wrong in (None, [2]):
        other = M.LlamaConfig(**dict(SHAPES["smollm3-nope"], nope_layers=wrong)).validate()
        model = ours_from(hf, other)
        delta = np.abs(model.forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
        assert delta > 1e-6, (wrong, delta)


# ---- training through the library ----------------------------------------------------

TINY = ["--model", "llama", "--preset", "llama-tiny", "--batch-size", "4", "--seq-len", "32",
        "--sample-tokens", "0", "--quiet", "--max-data-mb", "1"]


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_llama_learns_the_stdlib_bytes(tmp_path):
    out = str(tmp_path / "run")
    run_flags(TINY + ["--steps", "30", "--lr", "3e-3", "--out", out])
    losses = [r["loss"] for r in _records(out)]
    assert losses[-1] < losses[0] - 1.0, losses          # from ~ln 256 = 5.5 towards the byte statistics


def test_llama_resume_is_bit_identical(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_flags(TINY + ["--steps", "4", "--out", full])
    run_flags(TINY + ["--steps", "4", "--checkpoint-every", "2", "--out", part])
    checkpoints.remove(os.path.join(part, "checkpoints", "ckpt_00000004.json"))
    run_flags(TINY + ["--steps", "4", "--out", part, "--resume", "auto"])
    assert [r["loss"] for r in _records(part)][-2:] == [r["loss"] for r in _records(full)][-2:]
    from tests.engine.train.test_train import final_params
    a, b = final_params(full), final_params(part)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


GPT_TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--sample-tokens", "0", "--quiet", "--max-data-mb", "1"]


@pytest.mark.parametrize("written,resumed", [(TINY, GPT_TINY), (GPT_TINY, TINY)], ids=["llama-as-gpt", "gpt-as-llama"])
def test_the_other_family_s_checkpoint_is_refused(tmp_path, written, resumed):
    out = str(tmp_path / "run")
    run_flags(written + ["--steps", "1", "--out", out])
    kind = "llama" if written is TINY else "gpt"
    other = "gpt" if kind == "llama" else "llama"
    with pytest.raises(SystemExit, match=f"{kind} model, not --model {other}: pass --model {kind} to continue it"):
        run_flags(["--model", other] + resumed + ["--steps", "2", "--out", out, "--resume", "auto"])


def test_a_preset_without_model_names_its_family():
    from ringpipe.engine.train.cli import config_from_args, parse_args
    assert config_from_args(parse_args(["--preset", "llama-tiny"])).model == "llama"
    assert config_from_args(parse_args(["--preset", "gpt2-124m"])).model == "gpt"
    assert config_from_args(parse_args(["--model", "gpt", "--preset", "llama-tiny"])).model == "gpt"


def test_resume_without_model_continues_the_checkpoint_s_family(tmp_path):
    """The user never typed --model gpt: `--resume auto --out RUN` continues a Llama run as one."""
    out = str(tmp_path / "run")
    run_flags(TINY + ["--steps", "1", "--out", out])
    result = run_flags(["--steps", "2", "--out", out, "--resume", "auto", "--sample-tokens", "0", "--quiet"])
    assert result.steps_done == 2 and _records(out)[-1]["step"] == 2


@pytest.mark.parametrize("flags,says", [
    (["--model", "llama", "--kv-heads", "3"], "--kv-heads 3 does not divide --heads 4 .* use --kv-heads 1, 2, 4"),
    (["--kv-heads", "2"], "--kv-heads applies to --model llama only"),
    (["--model", "llama", "--preset", "hf-tiny"], "the data's tokenizer has 256 tokens, but --preset hf-tiny has "
                                                  "a vocabulary of 99"),
    (["--model", "gpt", "--preset", "llama-tiny"], "unknown --preset 'llama-tiny' for --model gpt .*add --model llama"),
    # the advice names what fixes the context, not a --context the next run would refuse
    (["--preset", "llama-tiny", "--no-tie-embeddings"], "has --tie-embeddings on, but --tie-embeddings off was given"),
    (["--preset", "llama-tiny", "--rope-theta", "5e5"], "has --rope-theta 10000.0, but --rope-theta 500000.0 was given"),
    (["--preset", "llama-tiny", "--seq-len", "128"], r"lower --seq-len \(the context is --preset llama-tiny's\)$"),
])
def test_bad_llama_flags_are_refused(tmp_path, flags, says):
    shape = ["--layers", "1", "--d-model", "16", "--heads", "4", "--batch-size", "4", "--sample-tokens", "0",
             "--quiet", "--max-data-mb", "1"]
    if "--preset" in flags:
        shape = shape[6:]
    with pytest.raises(SystemExit, match=says):
        run_flags(shape + ["--steps", "1", "--out", str(tmp_path / "run")] + flags)


@pytest.mark.parametrize("setting,value,ok", [
    ("rope_theta", 500000.0, True), ("rope_scaling", dict(LLAMA3, rope_type="llama3"), True),
    ("tie_embeddings", False, True), ("rope_theta", [1], False), ("rope_scaling", {"factor": {"x": 1}}, False),
    ("rms_eps", float("inf"), False),
])
def test_a_llama_checkpoint_s_settings_are_checked(tmp_path, setting, value, ok):
    """model_config holds numbers, switches and the rope_scaling object besides counts:
    the checkpoint format takes those and refuses anything else, naming the key."""
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.job.checkpoint import CheckpointError
    from tests.engine.job.test_checkpoint import edit_manifest, save
    path = save(tmp_path, 3)
    shape = M.LlamaConfig(**SHAPES["hf-tiny"]).validate().to_dict()
    edit_manifest(path, model="llama", model_config={**shape, setting: value})
    if ok:
        assert checkpoint.load(path)[1]["model_config"][setting] == value
    else:
        with pytest.raises(CheckpointError, match=f"'model_config.{setting}' holds .*expected a finite number"):
            checkpoint.load(path)
