"""A GPT-style byte-level language model, in one readable file.

    tokens (B, T) -> Embedding (token + position) -> n_layer x Block -> LMHead (tied wte) -> loss

`gpt_layers(cfg)` returns the list of layers; `engine.model.chain.LayerChain` runs any
contiguous slice of it, so the same list serves one process and a pipeline.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model import limits
from ringpipe.engine.model.layers import WHOLE, Block
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.recipe import ModelRecipe

VOCAB_SIZE = 256   # bytes
# The embedding and the LM head are padded to a multiple of this many rows, for
# GEMM shapes that tile well (llm.c pads GPT-2's 50257 to 50304); the padded
# rows' logits are masked, so they never receive probability, and exports trim them.
VOCAB_PAD_MULTIPLE = 128


@dataclass
class GPTConfig:
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    context: int = 128
    vocab: int = VOCAB_SIZE

    def validate(self):
        """Check every value, type and range (limits.py: a manifest or a notebook may hold
        anything), then the shape. Returns self."""
        for name, high in (("n_layer", limits.MAX_LAYERS), ("d_model", limits.MAX_WIDTH), ("n_head", limits.MAX_HEADS),
                           ("context", limits.MAX_CONTEXT), ("vocab", limits.MAX_VOCAB)):
            limits.check_whole(f"GPT <{name}>", getattr(self, name), 1, high)
        if self.d_model % self.n_head:
            raise ConfigError(f"<d_model> {self.d_model} must be divisible by <n_head> {self.n_head} "
                              f"(try <n_head> {_divisor_near(self.d_model, self.n_head)})")
        return self

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding (and logits), for every layout: checkpoints hold wte with
        this many rows whatever the tensor-parallel size (the tensor axis pads further
        in memory where it must: engine/parallel/tensor.py)."""
        return -(-self.vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def to_dict(self):
        return asdict(self)


# Standard shapes, by name (--preset): (n_layer, d_model, n_head, context).
PRESETS = {
    "gpt2-124m": (12, 768, 12, 1024),
    "gpt2-350m": (24, 1024, 16, 1024),
    "gpt2-774m": (36, 1280, 20, 1024),
    "gpt2-1558m": (48, 1600, 25, 1024),
}


# divisors() tries at most this many candidates (the pairs i, n // i up to sqrt(n)): all of
# them for any n below 2^40, far past any width or head count (Config bounds them lower).
DIVISOR_SEARCH = 1 << 20


def divisors(n):
    """The divisors of n in increasing order, found in pairs (i, n // i) up to sqrt(n): a
    few thousand steps for any real width. Past n = 2^40 only the pairs of the first
    DIVISOR_SEARCH candidates (an error message's suggestion must not hang)."""
    small = [i for i in range(1, min(math.isqrt(n), DIVISOR_SEARCH) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def _divisor_near(n, k):
    """The divisor of n closest to k (the lower one on a tie), whatever the size of k:
    chosen from divisors(n), never by stepping from k (a k of 10^20 would take 10^20 steps)."""
    return min(divisors(n), key=lambda d: (abs(d - k), d))


def gpt_layers(cfg: GPTConfig, tensor=None):
    """The model's layers; with a tensor group (engine/parallel/tensor.py), this
    rank's parts of them: the group is then the layer maker."""
    cfg.validate()
    maker = WHOLE if tensor is None else tensor
    V = cfg.padded_vocab
    layers = [maker.embedding(V, cfg.context, cfg.d_model)]
    layers += [Block(f"h.{i}", cfg.d_model, cfg.n_head, cfg.n_layer, maker=maker) for i in range(cfg.n_layer)]
    layers.append(maker.head(V, cfg.d_model, used=cfg.vocab))
    return layers


def build_gpt(cfg: GPTConfig, dtype=np.float32, xp=np, seed=0):
    model = LayerChain(gpt_layers(cfg), dtype=dtype, xp=xp)
    model.params.init(seed)
    return model


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting matmuls only.

    Per layer forward: qkv 2*3C^2, proj 2C^2, mlp 2*8C^2 (= 24 C^2), attention
    scores and weighted sum 2*2*T*C (causal: we compute the full T x T product).
    Head: 2*C*V (V padded: the GEMM computes every row). The embedding lookup is free.
    """
    C, L, V, T = cfg.d_model, cfg.n_layer, cfg.padded_vocab, seq_len
    forward = L * (24 * C * C + 4 * T * C) + 2 * C * V
    return 3.0 * forward


# The most tokens one call of generate may be asked for (<sample_tokens>, `ringpipe sample
# --tokens`): a million tokens is a few megabytes of text and hours on a CPU; more is a typo.
MAX_NEW_TOKENS = 1_000_000


def generate(model: LayerChain, prompt: list, n_new: int, context: int, temperature=1.0, seed=0,
             cache=True, stop=None, on_token=None) -> list:
    """Sample n_new token ids after the `prompt` ids, each from the logits of the last
    `context` tokens. The padding rows' logits are masked by the head.
    cache=True (where the model decodes: LayerChain.decodes) keeps every layer's keys and
    values, so a step runs the model on the one new token; cache=False runs it on the
    whole window each step. Both give the same logits up to rounding, hence the same
    tokens for a seed and temperature (a draw could differ only where rounding moves a
    probability across the uniform number drawn).
    on_token(id): called with each new id as it is drawn (a caller that streams the text).
    stop(): asked before each token; True ends the sampling early (a stop signal), and the
    ids drawn so far are returned."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in prompt] or [10]
    decoder = CachedDecoder(model, context) if cache and model.decodes else None
    for _ in range(n_new):
        if stop is not None and stop():
            break
        logits = decoder.last_logits(tokens) if decoder else _window_logits(model, tokens, context)
        last = np.asarray(to_host(logits), dtype=np.float64)
        if temperature <= 0:
            nxt = int(last.argmax())
        else:
            p = np.exp((last - last.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        tokens.append(nxt)
        if on_token is not None:
            on_token(nxt)
    return tokens[len(prompt):]


def _window_logits(model: LayerChain, tokens: list, context: int):
    """(V,) logits after `tokens`: the full model on the last `context` of them."""
    window = model.params.xp.asarray(np.array(tokens[-context:], dtype=np.int64)[None, :])
    logits, _ = model.forward(window, targets=None, need_grad=False)
    return logits[0, -1]


class CachedDecoder:
    """The logits after a growing token list, from a KV cache (LayerChain.decode) of the
    window tokens[-context:] at positions 0... While the text fits the context the window
    only grows: a step feeds the tokens not yet cached (the whole prompt first, then one).
    Once it is full, the window slides by one each step and every kept token moves to
    another position: the cache of the kept window is recomputed from scratch (correctness
    over speed: the logits stay those of the uncached path)."""

    def __init__(self, model: LayerChain, context: int):
        self.model, self.context = model, context
        self.cache, self.length = None, 0           # window positions 0..length-1 are cached

    def last_logits(self, tokens: list):
        window = tokens[-self.context:]
        if self.cache is None or len(tokens) > self.context:
            self.cache, self.length = self.model.new_cache(self.context), 0
        new = np.array(window[self.length:], dtype=np.int64)[None, :]     # (1, T) not yet cached
        logits = self.model.decode(self.model.params.xp.asarray(new), self.cache, self.length)   # (1, V)
        self.length = len(window)
        return logits[0]


def memory(cfg: GPTConfig, rows: int, microbatches: int, seq_len: int | None, pp: int) -> tuple[int, int]:
    """(parameters, activation elements of one micro-batch on one pipeline rank): the
    lower bound engine/train/config.py memory_floor refuses a run by."""
    C, L = cfg.d_model, cfg.n_layer
    V = cfg.padded_vocab                 # the embedding's rows and the logits' columns
    n_params = V * C + cfg.context * C + L * 12 * C * C
    micro = rows // microbatches
    T = seq_len or cfg.context
    # Per token and block at least the residual, LayerNorm, qkv, attention output and MLP
    # activations (about 16 C) and the saved attention probabilities (heads x T); plus the
    # logits of the head.
    return n_params, micro * T * (max(1, L // pp) * (16 * C + cfg.n_head * T) + V)


GPT_RECIPE = ModelRecipe(
    name="gpt", shape=GPTConfig,
    fields={"layers": "n_layer", "d_model": "d_model", "heads": "n_head", "context": "context"},
    layers=gpt_layers, flops_per_item=flops_per_token, memory=memory,
    data="tokens", default_data="stdlib", data_path_data="text", unit="tokens", rate_unit="tok",
    axes=("data", "pipe", "tensor"),
    presets={name: dict(zip(("n_layer", "d_model", "n_head", "context"), shape)) for name, shape in PRESETS.items()},
    hf_format=True, generate=generate, blocks=True)
