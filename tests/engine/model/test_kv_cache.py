"""Sampling with a KV cache (LayerChain.decode, gpt.generate's CachedDecoder): the same
logits as the full forward at every step, hence the same tokens, for both text families,
in float64, before and past the context (where the window slides and the cache is rebuilt)."""
import numpy as np
import pytest

from ringpipe.engine.model.gpt import GPTConfig, build_gpt, generate
from ringpipe.engine.model.layers import KVCache
from ringpipe.engine.model.llama import LlamaConfig, build_llama

CONTEXT = 12


def _loud(model, seed=1):
    # Random init gives nearly uniform logits; larger weights make greedy and sampled
    # choices depend on every position, so a wrong key or position changes the tokens.
    rng = np.random.default_rng(seed)
    model.params.data[:] = rng.normal(0.0, 0.3, model.params.data.shape)
    return model


MODELS = {
    "gpt": lambda: build_gpt(GPTConfig(n_layer=2, d_model=32, n_head=4, context=CONTEXT), dtype=np.float64),
    # grouped-query (2 query heads per key/value head), odd d_ff, untied, Llama 3 frequency scaling
    "llama-gqa": lambda: build_llama(LlamaConfig(
        n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=37, context=CONTEXT, vocab=99, tie_embeddings=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 4}), dtype=np.float64),
    "llama-mqa": lambda: build_llama(LlamaConfig(
        n_layer=2, d_model=32, n_head=4, n_kv_head=1, d_ff=40, context=CONTEXT, vocab=99), dtype=np.float64),
    "llama-mha": lambda: build_llama(LlamaConfig(
        n_layer=1, d_model=24, n_head=3, context=CONTEXT, vocab=99, qkv_bias=True), dtype=np.float64),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("prompt", [[5, 7, 11], list(range(1, 2 * CONTEXT))])    # short; longer than the context
def test_cached_and_uncached_sample_the_same_tokens(name, temperature, prompt):
    model = _loud(MODELS[name]())
    assert model.decodes
    n_new = 2 * CONTEXT + 3                  # well past the context: the window slides
    cached = generate(model, prompt, n_new, CONTEXT, temperature=temperature, seed=4)
    uncached = generate(model, prompt, n_new, CONTEXT, temperature=temperature, seed=4, cache=False)
    assert cached == uncached
    assert len(set(cached)) > 1              # not a constant sequence


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_logits_equal_forward_logits_at_every_position(name):
    model = _loud(MODELS[name]())
    tokens = np.random.default_rng(2).integers(0, 99, size=(2, CONTEXT))
    full, _ = model.forward(tokens, targets=None, need_grad=False)        # (B, T, V)
    cache = model.new_cache(CONTEXT)
    first = model.decode(tokens[:, :4], cache, 0)                          # a prompt of 4 at once
    assert np.max(np.abs(first - full[:, 3])) < 1e-12
    for t in range(4, CONTEXT):                                            # then one token per step
        step = model.decode(tokens[:, t:t + 1], cache, t)
        assert np.max(np.abs(step - full[:, t])) < 1e-12, t


def test_a_short_generate_context_uses_a_short_window():
    # run.py samples with context = min(seq_len, model context): the window is that long.
    model = _loud(MODELS["gpt"]())
    assert generate(model, [1, 2], 20, 5, seed=1) == generate(model, [1, 2], 20, 5, seed=1, cache=False)


def test_grouped_query_cache_holds_key_value_heads_once():
    model = _loud(MODELS["llama-gqa"]())
    cache = model.new_cache(CONTEXT)
    model.decode(np.array([[1, 2, 3]]), cache, 0)
    block_cache = cache[1]                                                 # the first block's
    assert block_cache.k.shape == (1, 2, CONTEXT, 8)                       # 2 key/value heads, not 4


def test_decoding_past_the_cache_or_the_context_is_refused():
    cache = KVCache(3)
    k = np.zeros((1, 2, 2, 4))
    cache.append(k, k, 0)
    with pytest.raises(ValueError, match="capacity 3"):
        cache.append(k, k, 2)
    for name in ("gpt", "llama-mqa"):
        model = MODELS[name]()
        with pytest.raises(ValueError, match="context"):
            model.decode(np.array([[1, 2]]), model.new_cache(CONTEXT + 2), CONTEXT)
