"""A Llama-family language model (Llama 3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, SmolLM3,
OLMo 2 and Gemma 3 shapes), in one readable file.

    tokens (B, T) -> TokenEmbedding -> n_layer x LlamaBlock -> LlamaHead (RMSNorm, logits, loss)
    LlamaBlock:  x + attn(norm1(x)), then + mlp(norm2(x))
                 (norm_place "post", OLMo 2's: x + norm1(attn(x)), then + norm2(mlp(x));
                 "sandwich", Gemma 3's: a norm before and after each)
    attn:        grouped-query causal attention, rotary positions on q and k (none in the
                 nope_layers: SmolLM3's NoPE blocks)
                 (qk_norm "head", Qwen3's: each head's q and k RMS-normalised over its hd
                 channels, before the rotation; "all", OLMo 2's: over all heads' channels)
    mlp:         down(silu(gate(x)) * up(x))   (SwiGLU; mlp_act gelu_tanh: GeGLU, Gemma's)

The families differ by parts the shape names (LlamaConfig): q/k/v biases (Qwen2), the q/k
norm (Qwen3 and Gemma 3 per head, OLMo 2 over the whole projection), where the block's norms
sit (OLMo 2: after attention and MLP; Gemma 3: before and after), blocks without rotary
positions (SmolLM3's NoPE layers), sliding windows and their own RoPE base (Mistral, Qwen,
Gemma 3), Gemma's (1 + w) norms, scaled embedding, score scale and final-logit soft-capping,
head_dim apart from d_model / n_head, the RoPE's base and scaling.

Parameters are laid out as Hugging Face's LlamaForCausalLM lays them out, so its weights
copy by name with no permutation: every Linear weight is (out, in); q and k rows are
heads in order, and within a head the rotary pairs are (i, i + hd/2) (`rotate_half`,
the "half-split" layout), not neighbours. Names:

    wte (V, C) · h.{i}.norm1.w · h.{i}.attn.{q,k,v,o}.w (+ q/k/v .b when qkv_bias) ·
    h.{i}.attn.{q,k}_norm.w ((hd,) when qk_norm is "head", (H hd,) and (Hkv hd,) when "all") ·
    h.{i}.post_attn_norm.w, h.{i}.post_mlp_norm.w when norm_place is "sandwich" ·
    h.{i}.norm2.w · h.{i}.mlp.{gate,up,down}.w · norm_f.w · lm_head.w (V, C) when untied

Shapes: B batch, T time, C d_model, H query heads, Hkv key/value heads, G = H/Hkv query
heads per key/value head, hd head_dim, F d_ff, V padded vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ringpipe import kernels as K
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model import limits
from ringpipe.engine.model.gpt import VOCAB_PAD_MULTIPLE, VOCAB_SIZE, _divisor_near, divisors, generate
from ringpipe.engine.model.layers import (BF16, WHOLE, Block, Layer, LMHead, attend_cached, causal_attention,
                                          causal_attention_backward, scatter_add_rows)
from ringpipe.engine.model.params import ParamSpec
from ringpipe.engine.model.recipe import ModelRecipe

# The q/k norm: none (Llama, Qwen2), "head": an RMSNorm of hd weights applied to each head's q
# and k before RoPE (Qwen3: q_norm and k_norm, shared by the heads), or "all": one RMSNorm over
# a position's whole q projection (H hd weights) and one over its k (Hkv hd) (OLMo 2).
QK_NORMS = ("none", "head", "all")
# The MLP's gate activation: silu (SwiGLU: Llama, Qwen, ...) or GELU's tanh form (GeGLU: Gemma).
MLP_ACTS = ("silu", "gelu_tanh")
# Where a block's two RMSNorms sit: before attention and the MLP (Llama), or after each, before
# the residual add (OLMo 2: post_attention_layernorm, post_feedforward_layernorm).
NORM_PLACES = ("pre", "post", "sandwich")     # sandwich: Gemma 3's four, before and after each

# Llama 3's frequency scaling (Hugging Face's rope_scaling with rope_type "llama3").
ROPE_SCALING_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")


@dataclass
class LlamaConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    n_kv_head: int | None = None     # None: n_head (multi-head attention); 1: multi-query
    d_ff: int | None = None          # None: 8/3 d_model rounded up to a multiple of 32 (Llama's rule of thumb)
    context: int = 128
    vocab: int = VOCAB_SIZE
    head_dim: int | None = None      # None: d_model // n_head
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # Llama 3: the ROPE_SCALING_KEYS (and rope_type "llama3")
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: str = "none"            # QK_NORMS: "head" normalises each head's q and k over hd (Qwen3),
                                     # "all" over all heads' channels (OLMo 2)
    norm_place: str = "pre"          # NORM_PLACES: "post" normalises attention's and the MLP's outputs (OLMo 2)
    nope_layers: list | None = None  # blocks (0-based) whose attention has no rotary positions (SmolLM3's NoPE)
    sliding_window: int | None = None    # a query sees this many positions, itself included (Mistral's window)
    window_layers: list | None = None    # the blocks with the window (None: every block, when there is one)
    # Gemma 3's parts:
    rms_offset: float = 0.0          # every RMSNorm scales by (offset + w): Gemma's 1, its weights start at 0
    mlp_act: str = "silu"            # MLP_ACTS: the gate's activation, silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: bool = False        # the embedding's rows times sqrt(d_model), rounded to float32 (Gemma)
    attn_scalar: float | None = None   # attention scores times attn_scalar^-1/2 (None: head_dim^-1/2)
    rope_local_theta: float | None = None   # the RoPE base of the windowed blocks (None: rope_theta)
    logit_softcap: float | None = None   # logits = cap tanh(logits / cap) (final_logit_softcapping; None: none)

    def validate(self):
        """Check every value, type and range (limits.py: a checkpoint's manifest or a notebook
        may hold anything), then the shape; fill in the sizes left to their rule (n_kv_head,
        d_ff, head_dim), so a checkpoint records them explicitly. Returns self."""
        _check_values(self)
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        self.d_ff = -(-8 * self.d_model // 3 // 32) * 32 if self.d_ff is None else self.d_ff
        if self.head_dim is None:
            if self.d_model % self.n_head:
                raise ConfigError(f"<d_model> {self.d_model} must be divisible by <heads> {self.n_head} "
                                  f"(try <heads> {_divisor_near(self.d_model, self.n_head)})")
            self.head_dim = self.d_model // self.n_head
        if self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"the head size {self.head_dim} must be even (rotary embedding turns pairs of "
                              "channels): change <d_model> or <heads>")
        if self.n_head % self.n_kv_head:
            works = divisors(self.n_head)         # in pairs up to sqrt: no loop of <heads> steps
            raise ConfigError(f"<kv_heads> {self.n_kv_head} does not divide <heads> {self.n_head} (each key/value "
                              f"head serves an equal group of query heads): use <kv_heads> "
                              f"{', '.join(map(str, works))}")
        _check_rope_scaling(self.rope_scaling)
        self.nope_layers = _block_list("nope_layers", self.nope_layers, self.n_layer, empty=None)
        limits.check_whole("Llama <sliding_window>", self.sliding_window, 1, limits.MAX_CONTEXT, none="no window")
        self.window_layers = _block_list("window_layers", self.window_layers, self.n_layer)
        if self.window_layers is not None and not self.sliding_window:
            raise ConfigError("<window_layers> names the blocks with a sliding window, but <sliding_window> is not "
                              "set: give the window's length too, or drop <window_layers>")
        return self

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding (and logits): the same rule as GPTConfig's."""
        return -(-self.vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def to_dict(self):
        return asdict(self)


def _check_values(cfg: LlamaConfig) -> None:
    """Every value's type and range, before any arithmetic on them: a rope_theta of 1e300 or
    "abc", an rms_eps of 5 or a qkv_bias of "yes" would otherwise reach the kernels."""
    for name, high in (("n_layer", limits.MAX_LAYERS), ("d_model", limits.MAX_WIDTH), ("n_head", limits.MAX_HEADS),
                       ("context", limits.MAX_CONTEXT), ("vocab", limits.MAX_VOCAB)):
        limits.check_whole(f"Llama <{name}>", getattr(cfg, name), 1, high)
    limits.check_whole("Llama <n_kv_head>", cfg.n_kv_head, 1, limits.MAX_HEADS, none="as many as <heads>")
    limits.check_whole("Llama <d_ff>", cfg.d_ff, 1, limits.MAX_FFN, none="8/3 <d_model>, rounded up to 32")
    limits.check_whole("Llama <head_dim>", cfg.head_dim, 2, limits.MAX_WIDTH, none="<d_model> / <heads>")
    # The RoPE base and the norm's eps by what the math needs (> 0); the flags and
    # config.json ask for more (engine/train/ranges.py, engine/interop/hf_values.py).
    limits.check_number("Llama <rope_theta>", cfg.rope_theta, 0, limits.MAX_ROPE_THETA)
    limits.check_number("Llama <rms_eps>", cfg.rms_eps, 0, 1, open_high=True)
    for name in ("tie_embeddings", "qkv_bias"):
        limits.check_switch(f"Llama <{name}>", getattr(cfg, name))
    if not isinstance(cfg.qk_norm, str) or cfg.qk_norm not in QK_NORMS:
        raise ConfigError(f"Llama <qk_norm> must be one of {', '.join(QK_NORMS)} (head: Qwen3's per-head norm of q "
                          f"and k; all: OLMo 2's over all heads), got {cfg.qk_norm!r}")
    if not isinstance(cfg.norm_place, str) or cfg.norm_place not in NORM_PLACES:
        raise ConfigError(f"Llama <norm_place> must be one of {', '.join(NORM_PLACES)} (post: OLMo 2's norms after "
                          f"attention and the MLP; sandwich: Gemma 3's before and after each), got {cfg.norm_place!r}")
    if not isinstance(cfg.mlp_act, str) or cfg.mlp_act not in MLP_ACTS:
        raise ConfigError(f"Llama <mlp_act> must be one of {', '.join(MLP_ACTS)}, got {cfg.mlp_act!r}")
    limits.check_number("Llama <rms_offset>", cfg.rms_offset, -1e6, 1e6, open_low=False)
    limits.check_switch("Llama <embed_scale>", cfg.embed_scale)
    if cfg.attn_scalar is not None:
        limits.check_number("Llama <attn_scalar>", cfg.attn_scalar, 0, limits.MAX_WIDTH)
    if cfg.rope_local_theta is not None:
        limits.check_number("Llama <rope_local_theta>", cfg.rope_local_theta, 0, limits.MAX_ROPE_THETA)
    if cfg.logit_softcap is not None:
        limits.check_number("Llama <logit_softcap>", cfg.logit_softcap, 0, 1e9)


def _block_list(name, value, n_layer, empty=()):
    """A list of distinct block indices below n_layer, sorted; None stays None, and an empty
    list becomes `empty`; given as a list, or as the comma-separated text of a flag ("3,7,11")."""
    if value is None:
        return None
    if value == "" or value == []:
        return None if empty is None else list(empty)
    if isinstance(value, str):
        try:
            value = [int(part) for part in value.split(",")]
        except ValueError:
            raise ConfigError(f"<{name}> must be block indices separated by commas (e.g. 3,7,11), got "
                              f"{value!r}") from None
    if (not isinstance(value, (list, tuple)) or len(value) > limits.MAX_LAYERS
            or not all(type(i) is int and 0 <= i < n_layer for i in value) or len(set(value)) != len(value)):
        raise ConfigError(f"<{name}> must be distinct block indices from 0 to <layers> - 1 = {n_layer - 1}, got "
                          f"{value!r}")
    return sorted(value)


def _check_rope_scaling(scaling) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be an object of {', '.join(ROPE_SCALING_KEYS)}, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind != "llama3":
        raise ConfigError(f"rope_scaling of rope_type {kind!r} is not supported: ringpipe implements Llama 3's "
                          "frequency scaling (rope_type llama3) only, or none")
    missing = [k for k in ROPE_SCALING_KEYS if k not in scaling]
    unknown = [k for k in scaling if k not in ROPE_SCALING_KEYS + ("rope_type", "type")]
    if missing or unknown:
        raise ConfigError(f"rope_scaling (llama3) takes exactly {', '.join(ROPE_SCALING_KEYS)}"
                          + (f"; missing {', '.join(missing)}" if missing else "")
                          + (f"; unknown {', '.join(unknown)}" if unknown else ""))
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        limits.check_number(f"Llama rope_scaling's {name}", scaling[name], 0, limits.MAX_ROPE_FACTOR)
    limits.check_whole("Llama rope_scaling's original_max_position_embeddings",
                       scaling["original_max_position_embeddings"], 1, limits.MAX_CONTEXT)
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"rope_scaling needs high_freq_factor > low_freq_factor, got {scaling}")


# Standard shapes, by name (<preset>). The real models' presets hold their vocabulary
# too: they train on data prepared with that model's tokenizer.
PRESETS = {
    # Every preset fixes the rope and the tying too: a --rope-theta or --no-tie-embeddings given with one
    # is refused as any other disagreeing shape flag, not silently trained.
    "llama-tiny": dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, context=64,
                       tie_embeddings=True, rope_theta=10000.0),
    # transformers' own test shape (LlamaModelTester)
    "hf-tiny": dict(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=37, context=512, vocab=99,
                    tie_embeddings=True, rope_theta=10000.0),
    "smollm2-135m": dict(n_layer=30, d_model=576, n_head=9, n_kv_head=3, d_ff=1536, context=8192, vocab=49152,
                         tie_embeddings=True, rope_theta=100000.0),
    # Qwen3 (dense): head_dim 128 apart from d_model / n_head, the per-head q/k norm, rms_eps 1e-6.
    "qwen3-0.6b": dict(n_layer=28, d_model=1024, n_head=16, n_kv_head=8, d_ff=3072, head_dim=128, context=40960,
                       vocab=151936, tie_embeddings=True, rope_theta=1000000.0, rms_eps=1e-6, qk_norm="head"),
    "qwen3-1.7b": dict(n_layer=28, d_model=2048, n_head=16, n_kv_head=8, d_ff=6144, head_dim=128, context=40960,
                       vocab=151936, tie_embeddings=True, rope_theta=1000000.0, rms_eps=1e-6, qk_norm="head"),
    # SmolLM3-3B: every fourth block without rotary positions (NoPE: blocks 3, 7, ..., 35).
    "smollm3-3b": dict(n_layer=36, d_model=2048, n_head=16, n_kv_head=4, d_ff=11008, context=65536, vocab=128256,
                       tie_embeddings=True, rope_theta=5000000.0, rms_eps=1e-6, nope_layers=list(range(3, 36, 4))),
    # OLMo 2 1B (0425): norms after attention and the MLP, the q/k norm over all heads, untied.
    "olmo2-1b": dict(n_layer=16, d_model=2048, n_head=16, n_kv_head=16, d_ff=8192, context=4096, vocab=100352,
                     tie_embeddings=False, rope_theta=500000.0, rms_eps=1e-6, qk_norm="all", norm_place="post"),
    # Gemma 3 (text): 5 windowed (local, RoPE base 10^4) blocks to 1 global (10^6), GeGLU, four
    # norms a block scaling by (1 + w), the per-head q/k norm, scores by 256^-1/2, sqrt(d) embeddings.
    "gemma3-270m": dict(n_layer=18, d_model=640, n_head=4, n_kv_head=1, d_ff=2048, head_dim=256, context=32768,
                        vocab=262144, tie_embeddings=True, rope_theta=1000000.0, rms_eps=1e-6, qk_norm="head",
                        norm_place="sandwich", sliding_window=512, window_layers=[i for i in range(18) if (i + 1) % 6],
                        rms_offset=1.0, mlp_act="gelu_tanh", embed_scale=True, attn_scalar=256.0,
                        rope_local_theta=10000.0),
    "gemma3-1b": dict(n_layer=26, d_model=1152, n_head=4, n_kv_head=1, d_ff=6912, head_dim=256, context=32768,
                      vocab=262144, tie_embeddings=True, rope_theta=1000000.0, rms_eps=1e-6, qk_norm="head",
                      norm_place="sandwich", sliding_window=512, window_layers=[i for i in range(26) if (i + 1) % 6],
                      rms_offset=1.0, mlp_act="gelu_tanh", embed_scale=True, attn_scalar=256.0,
                      rope_local_theta=10000.0),
    # Gemma 3's parts on a tiny shape (tests, examples): 6 blocks, the last global.
    "gemma3-tiny": dict(n_layer=6, d_model=48, n_head=4, n_kv_head=2, d_ff=37, head_dim=16, context=64,
                        tie_embeddings=True, rope_theta=1000000.0, rms_eps=1e-6, qk_norm="head", norm_place="sandwich",
                        sliding_window=8, window_layers=[0, 1, 2, 3, 4], rms_offset=1.0, mlp_act="gelu_tanh",
                        embed_scale=True, attn_scalar=24.0, rope_local_theta=10000.0),
    "llama3.2-1b": dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192, context=131072,
                        vocab=128256, tie_embeddings=True, rope_theta=500000.0,
                        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192}),
}


# ---- rotary position tables --------------------------------------------------------

class Rotary:
    """The cos/sin tables (T, hd) of positions 0..T-1 (kernels.rope_tables: computed in
    float64, rounded once), shared by every attention layer of a model and kept for the
    last (T, dtype, array module) asked."""

    def __init__(self, head_dim, theta, scaling=None):
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._key, self._tables = None, None

    def tables(self, T, like):
        xp = K.get_array_module(like)
        key = (T, like.dtype.str, xp.__name__)
        if key != self._key:
            tables = K.rope_tables(T, self.head_dim, self.theta, self.scaling, dtype=like.dtype)
            self._tables = tuple(xp.asarray(t) for t in tables)
            self._key = key
        return self._tables


# ---- layers ------------------------------------------------------------------------

class RMSNorm(Layer):
    """y = x / rms(x) * w (no mean subtracted, no bias); x (..., C).
    partial=True: under sequence parallelism this rank normalises only its positions,
    so its weight gradient is its part of the sum (ParamSpec.partial), as LayerNorm's.
    offset (Gemma's 1.0): y = x / rms(x) * (offset + w), the weights stored as offsets (from 0);
    the gradient of w is the gradient of the scale."""

    def __init__(self, name, c, eps=1e-5, partial=False, offset=0.0):
        self.name, self.c, self.eps, self.partial, self.offset = name, c, eps, partial, offset

    def specs(self):
        return [ParamSpec(f"{self.name}.w", (self.c,), init="zeros" if self.offset == 1 else "ones", decay=False,
                          partial=self.partial)]

    def _scale(self):
        return self.w + self.offset if self.offset else self.w

    def bind(self, params):
        self.w, self.dw = params.view(f"{self.name}.w"), params.grad_view(f"{self.name}.w")

    def forward(self, x):
        x2 = x.reshape(-1, self.c)
        y, rstd = K.rmsnorm_forward(x2, self._scale(), self.eps)
        return y.reshape(x.shape), (x2, rstd)

    def backward_input(self, dy, ctx):
        x2, rstd = ctx
        dx, dw = K.rmsnorm_backward(dy.reshape(-1, self.c), x2, self._scale(), rstd)
        self.dw += dw                    # cheap: accumulated here, as LayerNorm's are
        return dx.reshape(dy.shape), None


class WidthRMSNorm(Layer):
    """RMSNorm over a width a tensor group may split (OLMo 2's q and k norms: all of a position's
    heads): each rank holds the weights of its heads' channels (a contiguous slice, as the
    column-parallel q or k rows), and the sums over the width (of x^2 in forward, of dy*w*x in
    backward) are all-reduced over the group, so every rank normalises by the whole width's
    RMS. Computing them per rank would normalise each rank's heads by their own RMS: another
    model (tests/engine/parallel/test_llama_tensor.py shows it differs).
    x (..., width / group size) -> the same shape."""

    def __init__(self, name, width, eps, maker=WHOLE):
        if width % maker.size:
            raise ConfigError(f"<tp> {maker.size} does not divide the q/k norm's width {width}")
        self.name, self.width, self.eps = name, width, eps
        self.local = width // maker.size
        self.tensor = maker if maker.size > 1 else None
        self.split = maker.split(0) if self.tensor is not None else None

    def specs(self):
        return [ParamSpec(f"{self.name}.w", (self.local,), init="ones", decay=False, split=self.split)]

    def bind(self, params):
        self.w, self.dw = params.view(f"{self.name}.w"), params.grad_view(f"{self.name}.w")

    def _summed(self, rows):
        """Row sums over the whole width: this rank's, plus the group's."""
        return rows if self.tensor is None else self.tensor.allreduce(rows)

    def forward(self, x):
        xp = K.get_array_module(x)
        x2 = x.reshape(-1, self.local)                                   # (N, local)
        rstd = 1.0 / xp.sqrt(self._summed((x2 * x2).sum(axis=1)) / self.width + self.eps)    # (N,)
        return (x2 * rstd[:, None] * self.w).reshape(x.shape), (x2, rstd)

    def backward_input(self, dy, ctx):
        x2, rstd = ctx
        dy2 = dy.reshape(-1, self.local)
        self.dw += (dy2 * x2 * rstd[:, None]).sum(axis=0)               # this rank's channels only
        g = dy2 * self.w
        dot = self._summed((g * x2).sum(axis=1))                        # (N,): over the whole width
        dx = rstd[:, None] * g - x2 * (rstd ** 3 * dot / self.width)[:, None]
        return dx.reshape(dy.shape), None


def _residual_std(n_layer):
    return 0.02 / math.sqrt(2 * n_layer)     # as GPT-2's: the residual stream stays O(1)


class SharedInput(Layer):
    """Linears reading one input (q, k and v; gate and up), run one after another; the input
    gradient is the sum of theirs. Under tensor parallelism the group's SharedInputColumns
    (engine/parallel/tensor.py) takes its place: the input gathered once and its gradient
    reduced once for them all, not once per linear.
    forward(x) -> ([y of each], ctx); backward_input([dy of each], ctx) -> (dx, wctx)."""

    def __init__(self, linears):
        self.linears = linears

    def specs(self):
        return [s for lin in self.linears for s in lin.specs()]

    def bind(self, params):
        for lin in self.linears:
            lin.bind(params)

    def forward(self, x):
        x = BF16.of(x)          # under bf16 rounded once for them all, and kept once (BF16)
        outs, ctxs = zip(*(lin.forward(x) for lin in self.linears))
        return list(outs), ctxs

    def backward_input(self, dys, ctxs):
        parts = [lin.backward_input(dy, ctx) for lin, dy, ctx in zip(self.linears, dys, ctxs)]
        dx = parts[0][0]
        for more, _ in parts[1:]:
            dx += more
        return dx, [w for _, w in parts]

    def backward_weight(self, wctx):
        for lin, w in zip(self.linears, wctx):
            lin.backward_weight(w)


def _shared_input(maker, linears):
    return maker.shared_input(linears) if maker.size > 1 else SharedInput(linears)


class GroupedQueryAttention(Layer):
    """Causal self-attention with H query heads sharing Hkv key/value heads: query head h
    reads key/value head h // G (transformers' repeat_kv). Rotary positions on q and k.
    Split by a maker over `maker.size` ranks (tensor parallelism): rank r holds query heads
    r*H/size ... and key/value heads r*Hkv/size ..., which are exactly the ones its query
    heads read (H/size = G * Hkv/size), so attention needs no communication; o is row-parallel.
    keep_probs False (selective recomputation, Block.set_recompute): the probabilities
    (B, H, T, T) are not kept; the backward computes them again from q and k.
    qk_norm "head" (Qwen3): q_norm and k_norm, RMSNorms of hd weights, normalise each head's
    q and k before the rotation. Every tensor-parallel rank holds them whole and applies them
    to its own heads, so its weight gradient is its heads' part (ParamSpec.partial: summed
    over the group). qk_norm "all" (OLMo 2): WidthRMSNorms over all heads' channels of a
    position, their weights split with the heads."""

    keep_probs = True

    def __init__(self, name, cfg: LlamaConfig, rotary: Rotary, maker=WHOLE, window=0):
        C, hd = cfg.d_model, cfg.head_dim
        self.window = window          # > 0: a sliding window of that many positions (Mistral's, Qwen's)
        # the scores' scale: head_dim^-1/2, or Gemma 3's query_pre_attn_scalar^-1/2
        self.scale = 1.0 / math.sqrt(cfg.attn_scalar if cfg.attn_scalar is not None else hd)
        if cfg.n_kv_head % maker.size:
            raise ConfigError(f"<tp> {maker.size} does not divide the model's {cfg.n_kv_head} key/value heads")
        # the heads on this rank
        self.h, self.h_kv, self.hd, self.rotary = cfg.n_head // maker.size, cfg.n_kv_head // maker.size, hd, rotary
        self.q = maker.column(f"{name}.q", C, cfg.n_head * hd, bias=cfg.qkv_bias)
        self.k = maker.column(f"{name}.k", C, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.v = maker.column(f"{name}.v", C, cfg.n_kv_head * hd, bias=cfg.qkv_bias)
        self.o = maker.row(f"{name}.o", cfg.n_head * hd, C, std=_residual_std(cfg.n_layer), bias=False)
        self.qkv = _shared_input(maker, [self.q, self.k, self.v])        # q, k and v read the same x
        self.parts = [self.qkv, self.o]
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(f"{name}.q_norm", hd, cfg.rms_eps, partial=maker.size > 1, offset=cfg.rms_offset)
            self.k_norm = RMSNorm(f"{name}.k_norm", hd, cfg.rms_eps, partial=maker.size > 1, offset=cfg.rms_offset)
        if cfg.qk_norm == "all":          # over (B, T, heads, hd) as over (B, T, heads * hd): a row is a position
            self.q_norm = WidthRMSNorm(f"{name}.q_norm", cfg.n_head * hd, cfg.rms_eps, maker=maker)
            self.k_norm = WidthRMSNorm(f"{name}.k_norm", cfg.n_kv_head * hd, cfg.rms_eps, maker=maker)
        # The norms' gradients are added in their backward_input (RMSNorm's), so they are
        # not among the parts a backward_weight walks.
        self.norms = [n for n in (self.q_norm, self.k_norm) if n is not None]

    def specs(self):
        return [s for part in self.parts + self.norms for s in part.specs()]

    def bind(self, params):
        for part in self.parts + self.norms:
            part.bind(params)

    def _rotated(self, q, k, start, T, like, table_length=None):
        """q, k (B, T, heads, hd) at positions start..start+T-1, rotated; as they are in a
        NoPE layer (rotary None: SmolLM3's every fourth), whose attention sees no positions.
        table_length: the tables' positions (decoding asks for the cache's capacity once)."""
        if self.rotary is None:
            return q, k
        cos, sin = self.rotary.tables(table_length or start + T, like)
        cos, sin = cos[start:start + T], sin[start:start + T]                 # (T, hd): these positions
        return K.rope_forward(q, cos, sin), K.rope_forward(k, cos, sin)

    def _normed(self, norm, x):
        """x (B, T, heads, hd) -> (norm(x) over hd, its ctx); x itself without a q/k norm."""
        return (x, None) if norm is None else norm.forward(x)

    def forward(self, x):
        xp = K.get_array_module(x)
        H, Hkv, hd, G = self.h, self.h_kv, self.hd, self.h // self.h_kv
        (q, k, v), qkv_ctx = self.qkv.forward(x)                           # (B, T, H*hd), k and v (B, T, Hkv*hd)
        B, T, _ = q.shape          # the whole sequence, also when x is a sequence-parallel part
        q, qn_ctx = self._normed(self.q_norm, q.reshape(B, T, H, hd))                  # (B, T, H, hd)
        k, kn_ctx = self._normed(self.k_norm, k.reshape(B, T, Hkv, hd))                # (B, T, Hkv, hd)
        q, k = self._rotated(q, k, 0, T, x)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)                        # (B, H|Hkv, T, hd)
        # q, k and v are each read by two GEMMs and kept: rounded once under bf16 (BF16)
        q = BF16.of(xp.ascontiguousarray(q))
        k = xp.repeat(BF16.of(k), G, axis=1)                               # (B, H, T, hd): head h reads h // G
        v = xp.repeat(BF16.of(v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)), G, axis=1)
        scale = self.scale
        y, att = causal_attention(q, k, v, scale, window=self.window)      # (B, T, H*hd)
        out, o_ctx = self.o.forward(y)
        return out, (qkv_ctx, o_ctx, q, k, v, att if self.keep_probs else None, scale, qn_ctx, kn_ctx)

    def decode(self, x, cache, start):
        """x (B, T, C) of positions start..start+T-1 -> (B, T, C) (sampling, LayerChain.decode):
        rotary at those positions, their keys and values appended to `cache` once per
        key/value head (not repeated per query head), attention to every position so far."""
        xp = K.get_array_module(x)
        B, T, _ = x.shape
        H, Hkv, hd = self.h, self.h_kv, self.hd
        q = self._normed(self.q_norm, self.q.forward(x)[0].reshape(B, T, H, hd))[0]     # (B, T, H, hd)
        k = self._normed(self.k_norm, self.k.forward(x)[0].reshape(B, T, Hkv, hd))[0]   # (B, T, Hkv, hd)
        q, k = self._rotated(q, k, start, T, x, table_length=cache.capacity)
        v = self.v.forward(x)[0].reshape(B, T, Hkv, hd)
        k, v = cache.append(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), start)   # (B, Hkv, start+T, hd)
        y = attend_cached(xp.ascontiguousarray(q.transpose(0, 2, 1, 3)), k, v, start, self.scale,
                          window=self.window)
        y = xp.ascontiguousarray(y.transpose(0, 2, 1, 3)).reshape(B, T, H * hd)    # (B, T, H*hd)
        return self.o.forward(y)[0]

    def backward_input(self, dout, ctx):
        qkv_ctx, o_ctx, q, k, v, att, scale, qn_ctx, kn_ctx = ctx
        xp = K.get_array_module(dout)
        B, H, T, hd = q.shape
        Hkv, G = self.h_kv, self.h // self.h_kv
        dy, o_w = self.o.backward_input(dout, o_ctx)                       # (B, T, H*hd)
        dq, dk, dv = causal_attention_backward(dy, q, k, v, att, scale, window=self.window)   # (B, H, T, hd)
        # A key/value head's gradient is the sum over the G query heads that read it.
        dk, dv = (d.reshape(B, Hkv, G, T, hd).sum(axis=2).transpose(0, 2, 1, 3) for d in (dk, dv))   # (B, T, Hkv, hd)
        dq = dq.transpose(0, 2, 1, 3)                                             # (B, T, H, hd)
        if self.rotary is not None:
            cos, sin = self.rotary.tables(T, dout)
            dq, dk = K.rope_backward(dq, cos, sin), K.rope_backward(dk, cos, sin)  # (B, T, H|Hkv, hd)
        if self.q_norm is not None:              # (their weight gradients are added here)
            dq = self.q_norm.backward_input(dq, qn_ctx)[0]
            dk = self.k_norm.backward_input(dk, kn_ctx)[0]
        dq, dk = dq.reshape(B, T, H * hd), dk.reshape(B, T, Hkv * hd)
        dx, qkv_w = self.qkv.backward_input([dq, dk, xp.ascontiguousarray(dv).reshape(B, T, Hkv * hd)], qkv_ctx)
        return dx, (qkv_w, o_w)

    def backward_weight(self, wctx):
        for part, w in zip(self.parts, wctx):
            part.backward_weight(w)


class SwiGLU(Layer):
    """down(silu(gate(x)) * up(x)): x (B, T, C) -> (B, T, F) -> (B, T, C). mlp_act gelu_tanh:
    GeGLU, down(gelu(gate(x)) * up(x)) with GELU's tanh form (Gemma's gelu_pytorch_tanh)."""

    def __init__(self, name, cfg: LlamaConfig, maker=WHOLE):
        C, F = cfg.d_model, cfg.d_ff
        self.act = cfg.mlp_act
        self.gate = maker.column(f"{name}.gate", C, F, bias=False)
        self.up = maker.column(f"{name}.up", C, F, bias=False)
        self.down = maker.row(f"{name}.down", F, C, std=_residual_std(cfg.n_layer), bias=False)
        self.gate_up = _shared_input(maker, [self.gate, self.up])     # gate and up read the same x
        self.parts = [self.gate_up, self.down]

    def specs(self):
        return [s for part in self.parts for s in part.specs()]

    def bind(self, params):
        for part in self.parts:
            part.bind(params)

    def forward(self, x):
        (g, u), gate_up_ctx = self.gate_up.forward(x)     # (B, T, F) each
        h = K.swiglu_forward(g, u) if self.act == "silu" else K.gelu_forward(g) * u
        y, down_ctx = self.down.forward(h)
        return y, (gate_up_ctx, down_ctx, g, u)

    def backward_input(self, dy, ctx):
        gate_up_ctx, down_ctx, g, u = ctx
        dh, down_w = self.down.backward_input(dy, down_ctx)
        if self.act == "silu":
            dg, du = K.swiglu_backward(dh, g, u)
        else:                                             # GeGLU: h = gelu(g) u
            dg, du = K.gelu_backward(dh * u, g), dh * K.gelu_forward(g)
        dx, gate_up_w = self.gate_up.backward_input([dg, du], gate_up_ctx)
        return dx, (gate_up_w, down_w)

    def backward_weight(self, wctx):
        for part, w in zip(self.parts, wctx):
            part.backward_weight(w)


class LlamaBlock(Block):
    """Block's residual wiring (engine/model/layers.py), with Llama's parts: RMSNorms,
    grouped-query attention, SwiGLU. Where the norms sit is the family's (norm_place):
      pre (Llama, Qwen, ...)  x1 = x + attn(norm1(x)), then x1 + mlp(norm2(x1))
      post (OLMo 2)           x1 = x + norm1(attn(x)), then x1 + norm2(mlp(x1)): its
                              post_attention_layernorm and post_feedforward_layernorm
      sandwich (Gemma 3)      x1 = x + post_attn_norm(attn(norm1(x))), then
                              x1 + post_mlp_norm(mlp(norm2(x1))): its four
    Under sequence parallelism every norm acts on this rank's positions."""

    def __init__(self, name, cfg: LlamaConfig, rotary: Rotary, maker=WHOLE, window=0):
        self.name = name

        def norm(part):
            return RMSNorm(f"{name}.{part}", cfg.d_model, cfg.rms_eps, partial=maker.sequence_parallel,
                           offset=cfg.rms_offset)
        self.attn = GroupedQueryAttention(f"{name}.attn", cfg, rotary, maker=maker, window=window)
        self.mlp = SwiGLU(f"{name}.mlp", cfg, maker=maker)
        # (parts in the order the parameters are laid out: norm1, attention, norm2, MLP, as ever)
        if cfg.norm_place == "post":
            self.ln1 = self.ln2 = None
            self.post1, self.post2 = norm("norm1"), norm("norm2")
            self.parts = [self.post1, self.attn, self.post2, self.mlp]
        else:
            self.ln1, self.ln2 = norm("norm1"), norm("norm2")
            self.parts = [self.ln1, self.attn, self.ln2, self.mlp]
            if cfg.norm_place == "sandwich":
                self.post1, self.post2 = norm("post_attn_norm"), norm("post_mlp_norm")
                self.parts = [self.ln1, self.attn, self.post1, self.ln2, self.mlp, self.post2]


class ScaledEmbedding(Layer):
    """An embedding whose rows are multiplied by `scale` (Gemma's sqrt(d_model), rounded to
    float32 as transformers' buffer is): the same parameters (wte), forward and backward
    scaled. Wraps the whole table (TokenEmbedding) or a tensor group's rows of it."""

    def __init__(self, inner, scale):
        self.inner, self.scale = inner, scale

    def specs(self):
        return self.inner.specs()

    def bind(self, params):
        self.inner.bind(params)

    def forward(self, tokens):
        y, ctx = self.inner.forward(tokens)
        return y * y.dtype.type(self.scale), ctx

    def decode(self, tokens, cache, start):
        y = self.inner.decode(tokens, cache, start)
        return y * y.dtype.type(self.scale)

    def backward_input(self, dout, ctx):
        return self.inner.backward_input(dout * dout.dtype.type(self.scale), ctx)

    def __getattr__(self, name):          # the rest (wte, context, ...) is the inner embedding's
        return getattr(self.inner, name)


class TokenEmbedding(Layer):
    """tokens (B, T) int -> wte[tokens] (B, T, C): no position table (rotary positions are in attention)."""

    def __init__(self, vocab, c, context):
        self.vocab, self.c, self.context = vocab, c, context

    def specs(self):
        return [ParamSpec("wte", (self.vocab, self.c))]

    def bind(self, params):
        self.wte, self.dwte = params.view("wte"), params.grad_view("wte")

    def forward(self, tokens):
        if tokens.shape[1] > self.context:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's context {self.context}")
        return self.wte[tokens], tokens

    def decode(self, tokens, cache, start):
        # tokens (B, T) at positions start..start+T-1 -> (B, T, C)
        if start + tokens.shape[1] > self.context:
            raise ValueError(f"position {start + tokens.shape[1] - 1} is past the model's context {self.context}")
        return self.wte[tokens]

    def backward_input(self, dout, ctx):
        tokens = ctx
        scatter_add_rows(self.dwte, tokens.reshape(-1), dout.reshape(-1, self.c))
        return None, None


class LlamaHead(LMHead):
    """LMHead (logits, padding rows masked, fused cross-entropy) with a final RMSNorm
    (norm_f, in LMHead's ln_f slot), against wte when tied, else its own lm_head.w."""

    def __init__(self, cfg: LlamaConfig):
        weight = "wte" if cfg.tie_embeddings else "lm_head.w"
        super().__init__(cfg.padded_vocab, cfg.d_model, wte=weight, used=cfg.vocab)
        self.ln_f = RMSNorm("norm_f", cfg.d_model, cfg.rms_eps, offset=cfg.rms_offset)
        self.softcap = cfg.logit_softcap


def llama_layers(cfg: LlamaConfig, tensor=None):
    """The model's layers; with a tensor group (engine/parallel/tensor.py), this rank's
    parts of them: the group is then the layer maker (Megatron's split: q, k, v, gate and
    up column-parallel, o and down row-parallel, the vocabulary-parallel embedding and
    head; the RMSNorms replicated, on this rank's positions under sequence parallelism)."""
    cfg.validate()
    rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    # Gemma 3's windowed (local) blocks rotate with a base of their own, without scaling.
    local = Rotary(cfg.head_dim, cfg.rope_local_theta) if cfg.rope_local_theta is not None else rotary
    maker = WHOLE if tensor is None else tensor
    nope = set(cfg.nope_layers or ())
    windows = [window_of(cfg, i) for i in range(cfg.n_layer)]
    rotaries = [None if i in nope else local if windows[i] else rotary for i in range(cfg.n_layer)]
    blocks = [LlamaBlock(f"h.{i}", cfg, rotaries[i], maker=maker, window=windows[i]) for i in range(cfg.n_layer)]
    if tensor is None:
        embedding = _scaled(cfg, TokenEmbedding(cfg.padded_vocab, cfg.d_model, cfg.context))
        return [embedding, *blocks, LlamaHead(cfg)]
    embedding = _scaled(cfg, tensor.embedding(cfg.padded_vocab, cfg.context, cfg.d_model, wpe=None))
    head = tensor.head(cfg.padded_vocab, cfg.d_model, wte="wte" if cfg.tie_embeddings else "lm_head.w",
                       used=cfg.vocab)
    head.ln_f = RMSNorm("norm_f", cfg.d_model, cfg.rms_eps, partial=tensor.sequence_parallel, offset=cfg.rms_offset)
    head.softcap = cfg.logit_softcap
    return [embedding, *blocks, head]


def _scaled(cfg: LlamaConfig, embedding):
    """Gemma's embedding times sqrt(d_model) (float32, as transformers' buffer), or as it is."""
    return ScaledEmbedding(embedding, float(np.float32(math.sqrt(cfg.d_model)))) if cfg.embed_scale else embedding


def window_of(cfg: LlamaConfig, i: int) -> int:
    """Block i's sliding window: sliding_window where window_layers lists the block (or lists
    none: every block, as Mistral), else 0 (the whole causal past)."""
    if not cfg.sliding_window or (cfg.window_layers is not None and i not in cfg.window_layers):
        return 0
    return cfg.sliding_window


def build_llama(cfg: LlamaConfig, dtype=np.float32, xp=np, seed=0):
    model = LayerChain(llama_layers(cfg), dtype=dtype, xp=xp)
    model.params.init(seed)
    return model


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (3x forward), matmuls only. Per layer forward: q and o
    2*2*C*H*hd, k and v 2*2*C*Hkv*hd, SwiGLU 3*2*C*F, scores and weighted sum 2*2*T*H*hd
    (the full T x T product); the head 2*C*V."""
    cfg.validate()
    C, L, V, T, F = cfg.d_model, cfg.n_layer, cfg.padded_vocab, seq_len, cfg.d_ff
    attn_width = cfg.n_head * cfg.head_dim
    per_layer = 4 * C * attn_width + 4 * C * cfg.n_kv_head * cfg.head_dim + 6 * C * F + 4 * T * attn_width
    return 3.0 * (L * per_layer + 2 * C * V)


def parameter_count(cfg: LlamaConfig) -> int:
    cfg.validate()
    C, hd = cfg.d_model, cfg.head_dim
    attn = 2 * C * cfg.n_head * hd + 2 * C * cfg.n_kv_head * hd
    bias = (cfg.n_head + 2 * cfg.n_kv_head) * hd if cfg.qkv_bias else 0
    qk_norm = {"none": 0, "head": 2 * hd, "all": (cfg.n_head + cfg.n_kv_head) * hd}[cfg.qk_norm]
    norms = 4 * C if cfg.norm_place == "sandwich" else 2 * C
    per_layer = attn + bias + qk_norm + 3 * C * cfg.d_ff + norms
    return cfg.padded_vocab * C * (1 if cfg.tie_embeddings else 2) + cfg.n_layer * per_layer + C


def memory(cfg: LlamaConfig, rows: int, microbatches: int, seq_len: int | None, pp: int) -> tuple[int, int]:
    """(parameters, activation elements of one micro-batch on one pipeline rank): the
    lower bound engine/train/config.py memory_floor refuses a run by."""
    T = seq_len or cfg.context
    micro = rows // microbatches
    # Per token and block at least the residual, two norms, q, k, v (repeated to H heads),
    # the attention output and the SwiGLU's gate, up and product (about 8 C + 3 F), and the
    # attention probabilities (heads x T); plus the logits of the head.
    per_block = 8 * cfg.d_model + 3 * cfg.d_ff + cfg.n_head * T
    return parameter_count(cfg), micro * T * (max(1, cfg.n_layer // pp) * per_block + cfg.padded_vocab)


LLAMA_RECIPE = ModelRecipe(
    name="llama", shape=LlamaConfig,
    fields={"layers": "n_layer", "d_model": "d_model", "heads": "n_head", "context": "context",
            "kv_heads": "n_kv_head", "d_ff": "d_ff", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_embeddings", "qk_norm": "qk_norm", "nope_layers": "nope_layers",
            "norm_place": "norm_place", "sliding_window": "sliding_window", "window_layers": "window_layers"},
    layers=llama_layers, flops_per_item=flops_per_token, memory=memory,
    data="tokens", default_data="stdlib", data_path_data="text", unit="tokens", rate_unit="tok",
    axes=("data", "pipe", "tensor"), presets=PRESETS, generate=generate, blocks=True,
    hf_format=True)       # engine/interop/hf_llama.py: LlamaForCausalLM folders both ways
