"""Gemma 3 (text) as the Llama block's parts (issue 36): RMSNorms scaling by (1 + w), four a
block (before and after attention and the MLP), GeGLU with GELU's tanh form, the embedding
times sqrt(d_model), the per-head q/k norm, scores by query_pre_attn_scalar^-1/2, and the
5:1 pattern of windowed (local, their own RoPE base) and global blocks.

transformers' Gemma3ForCausalLM is the oracle in float64, its RMSNorms and RoPE tables lifted
to float64 (it computes both in float32); its embedding scale is a float32 buffer, which
ringpipe uses as it is. Negative controls: the norm as w (not 1 + w), the global RoPE base on
the local blocks, and no window each fail the comparison."""
import numpy as np
import pytest

from ringpipe.engine.model import llama as M
from ringpipe.kernels.rope import rope_inv_freq
from tests.engine.model.test_gradients import check_layer
from tests.engine.model.test_llama import compare, ours_from

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

rng = np.random.default_rng(0)
TINY = dict(M.PRESETS["gemma3-tiny"], vocab=97, context=32)


def test_sandwich_block_and_geglu_finite_differences():
    cfg = M.LlamaConfig(**dict(TINY, n_layer=1, window_layers=[0])).validate()
    block = M.LlamaBlock("h.0", cfg, M.Rotary(cfg.head_dim, 100.0), window=3)      # the sandwich wiring
    check_layer(block, rng.normal(size=(2, 5, 48)))


def test_the_presets_are_the_real_shapes():
    assert M.parameter_count(M.LlamaConfig(**M.PRESETS["gemma3-270m"]).validate()) == 268_098_176
    assert M.parameter_count(M.LlamaConfig(**M.PRESETS["gemma3-1b"]).validate()) == 999_885_952
    one_b = M.LlamaConfig(**M.PRESETS["gemma3-1b"]).validate()
    assert [M.window_of(one_b, i) for i in range(6)] == [512, 512, 512, 512, 512, 0]


def _float64_gemma_rmsnorm(self, x):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + self.weight)


def hf_gemma(cfg: M.LlamaConfig, monkeypatch):
    window_layers = set(range(cfg.n_layer) if cfg.window_layers is None else cfg.window_layers)
    hf_cfg = transformers.Gemma3TextConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context, rms_norm_eps=cfg.rms_eps, query_pre_attn_scalar=int(cfg.attn_scalar),
        sliding_window=cfg.sliding_window, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=None,
        layer_types=["sliding_attention" if i in window_layers else "full_attention" for i in range(cfg.n_layer)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}},
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=cfg.logit_softcap, attn_logit_softcapping=None)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(hf_cfg).to(torch.float64).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    monkeypatch.setattr(transformers.models.gemma3.modeling_gemma3.Gemma3RMSNorm, "forward", _float64_gemma_rmsnorm)
    rotary = model.model.rotary_emb
    tables = {kind: torch.from_numpy(rope_inv_freq(cfg.head_dim, theta))
              for kind, theta in (("full_attention", cfg.rope_theta), ("sliding_attention", cfg.rope_local_theta))}

    def float64_rope(x, position_ids, layer_type):
        angles = position_ids[..., None].double() * tables[layer_type]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    monkeypatch.setattr(rotary, "forward", float64_rope)
    return model


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "final-logit soft-capping"])
def test_gemma3_logits_and_gradients_equal_transformers(monkeypatch, softcap):
    """softcap: logits = cap tanh(logits / cap) (final_logit_softcapping: null in Gemma 3's configs,
    Gemma 2's 30), at a cap small enough to bend these logits."""
    cfg = M.LlamaConfig(**TINY, logit_softcap=softcap).validate()
    hf = hf_gemma(cfg, monkeypatch)
    tokens, targets = rng.integers(0, cfg.vocab, size=(2, 21)), rng.integers(0, cfg.vocab, size=(2, 21))
    delta, worst = compare(cfg, hf, ours_from(hf, cfg), tokens, targets)
    assert delta <= 1e-10 and worst <= 1e-10, (delta, worst)


@pytest.mark.parametrize("wrong", [dict(rms_offset=0.0), dict(rope_local_theta=None), dict(sliding_window=None,
                                                                                             window_layers=None),
                                   dict(embed_scale=False), dict(mlp_act="silu"), dict(attn_scalar=None),
                                   dict(logit_softcap=None)],
                         ids=["norm as w", "global base on local blocks", "no window", "no embedding scale",
                              "silu gate", "head_dim scale", "no soft-capping"])
def test_each_gemma3_part_left_out_fails_the_exactness_test(monkeypatch, wrong):
    cfg = M.LlamaConfig(**TINY, logit_softcap=2.0).validate()
    hf = hf_gemma(cfg, monkeypatch)
    tokens = rng.integers(0, cfg.vocab, size=(2, 21))
    expected = hf(torch.from_numpy(tokens)).logits.detach().numpy()
    other = M.LlamaConfig(**{**TINY, "logit_softcap": 2.0, **wrong}).validate()
    delta = np.abs(ours_from(hf, other).forward(tokens, need_grad=False)[0][..., :cfg.vocab] - expected).max()
    assert delta > 1e-6, delta


def test_soft_capping_under_bf16_matmuls_follows_float32():
    """The bf16 head (loss_and_bf16_grad: the logits a block of rows at a time) caps them too:
    its loss is float32's at bf16's tolerance, and another than without the cap (weights large
    enough for the logits to bend)."""
    from ringpipe import kernels as K
    shape = dict(TINY, n_layer=1, window_layers=[0])
    weights = np.random.default_rng(5).normal(0.0, 0.5, size=M.build_llama(M.LlamaConfig(**shape).validate()).params.size)

    def loss(softcap, precision):
        model = M.build_llama(M.LlamaConfig(**shape, logit_softcap=softcap).validate(), np.float32)
        model.params.data[:] = weights
        try:
            K.set_matmul_precision(precision)
            return model.loss_and_grad(tokens, targets, grad_scale=1.0)
        finally:
            K.set_matmul_precision("float32")
    tokens, targets = rng.integers(0, 97, size=(2, 16)), rng.integers(0, 97, size=(2, 16))
    float32 = loss(1.0, "float32")
    assert loss(1.0, "bf16") == pytest.approx(float32, rel=2e-2)
    assert abs(loss(None, "float32") - float32) > 0.05 * abs(float32)
