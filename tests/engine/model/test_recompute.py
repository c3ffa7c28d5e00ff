"""Activation recomputation (LayerChain.set_recompute): full and selective train exactly as none.

One process, float32: the recomputed ops are the same ops on the same inputs, so the
losses, gradients and weights after a few steps are the same bits (array_equal), with the
whole backward and with the zero-bubble split (backward_input now, backward_weight later).
The MPI layouts are in tests/engine/parallel/test_recompute_parity.py.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.chain import BlockInput, LayerChain
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.model.llama import LlamaConfig, llama_layers
from ringpipe.engine.train import config as config_checks, memory
from ringpipe.engine.train.config import Config

from tests.support.parity import assert_same_arrays, final_arrays, losses, train

MODES = ("none", "full", "selective")
FAMILIES = {
    "gpt": lambda: gpt_layers(GPTConfig(n_layer=2, d_model=16, n_head=2, context=8, vocab=50)),
    "llama": lambda: llama_layers(LlamaConfig(n_layer=2, d_model=16, n_head=4, n_kv_head=2, d_ff=24, context=8,
                                              vocab=50)),
}


def _batch(step, B=3, T=6, vocab=50):      # T not the head size: only the probabilities are T x T
    rng = np.random.default_rng(step)
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


def _train(family, mode, split, steps=3, lr=0.05):
    """steps of plain SGD on a fresh model (seed 0). Returns (losses, last gradients, weights)."""
    chain = LayerChain(FAMILIES[family](), dtype=np.float32)
    chain.params.init(0)
    chain.set_recompute(mode)
    losses = []
    for step in range(steps):
        chain.params.zero_grad()
        x, y = _batch(step)
        loss, ctxs = chain.forward(x, y, grad_scale=1.0 / y.size)
        _check_kept(chain, ctxs, mode)
        if split:        # zero-bubble: activation gradients first, the weight gradients later
            _, wctxs = chain.backward_input(None, ctxs)
            chain.backward_weight(wctxs)
        else:
            chain.backward(None, ctxs)
        losses.append(loss)
        grad = chain.params.grad.copy()
        chain.params.data -= np.float32(lr) * chain.params.grad
    return losses, grad, chain.params.data.copy()


def _check_kept(chain, ctxs, mode):
    """What forward kept: a block's input alone (full), or its ctx without the attention
    probabilities (selective)."""
    blocks = [i for i, layer in enumerate(chain.layers) if hasattr(layer, "set_recompute")]
    assert blocks
    for i in blocks:
        assert isinstance(ctxs[i], BlockInput) == (mode == "full")
        if mode != "full":
            attn_ctx = ctxs[i][1]
            probs = [a for a in attn_ctx if getattr(a, "ndim", 0) == 4 and a.shape[-1] == a.shape[-2]]
            assert bool(probs) == (mode == "none"), [getattr(a, "shape", a) for a in attn_ctx]


@pytest.mark.parametrize("split", [False, True], ids=["backward", "zero-bubble-split"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_recomputation_trains_bit_identically_to_none_in_float32(family, split):
    ref_losses, ref_grad, ref_weights = _train(family, "none", split)
    for mode in ("full", "selective"):
        losses, grad, weights = _train(family, mode, split)
        assert losses == ref_losses, mode
        np.testing.assert_array_equal(grad, ref_grad, err_msg=mode)
        np.testing.assert_array_equal(weights, ref_weights, err_msg=mode)


def test_the_recomputing_forward_runs_inside_the_layers_acquire_window():
    """ZeRO-3 holds a layer's parameters only between acquire and release: the forward run
    again in backward must read them there."""
    chain = LayerChain(FAMILIES["gpt"](), dtype=np.float32)
    chain.params.init(0)
    chain.set_recompute("full")
    held, reads = set(), []

    class Residency:
        def acquire(self, c, i, *direction):      # (direction: which layer comes next)
            held.add(i)

        def release(self, c, i):
            held.discard(i)

    chain.residency = Residency()
    for i, layer in enumerate(chain.layers):
        forward = layer.forward

        def watched(*args, _i=i, _forward=forward, **kwargs):
            reads.append((_i, _i in held))
            return _forward(*args, **kwargs)
        layer.forward = watched
    x, y = _batch(0)
    _, ctxs = chain.forward(x, y)
    _, wctxs = chain.backward_input(None, ctxs)
    chain.backward_weight(wctxs)
    blocks = [i for i, layer in enumerate(chain.layers) if hasattr(layer, "set_recompute")]
    assert [i for i, _ in reads] == list(range(len(chain.layers))) + blocks[::-1]   # each block twice
    assert all(inside for _, inside in reads)


def test_a_chain_without_blocks_takes_every_mode_and_keeps_its_ctx():
    """A pipeline chunk of the embedding alone: nothing to recompute, nothing refused."""
    chain = LayerChain(FAMILIES["gpt"]()[:1], dtype=np.float32, has_head=False)
    chain.set_recompute("full")
    assert chain.blocks == 0 and chain.recompute == "full"
    _, ctxs = chain.forward(_batch(0)[0])
    assert not isinstance(ctxs[0], BlockInput)
    with pytest.raises(ValueError, match="none, full, selective"):
        chain.set_recompute("some")


def test_recomputation_of_a_model_without_blocks_is_refused_naming_what_works():
    with pytest.raises(ConfigError, match=r"recompute full .* model mlp has none: it works for model gpt "
                                          r"or llama; leave recompute none"):
        config_checks.check(Config(model="mlp", recompute="full"), 1)
    with pytest.raises(ConfigError, match="recompute must be auto, none, full, selective"):
        config_checks.check(Config(recompute="partial"), 1)
    for mode in MODES + ("auto",):
        config_checks.check(Config(model="llama", recompute=mode), 1)
    config_checks.check(Config(model="mlp"), 1)         # auto, the default: nothing to recompute, no refusal


def test_auto_recomputes_where_the_attention_probabilities_outweigh_the_rest():
    """auto: selective where H T^2 is a third or more of what a block keeps (GPT-2 124M at
    T 1024: a half), none for short sequences (the small GPT at T 128: a fifth) and for a
    model without blocks; a mode given is kept."""
    gpt2 = GPTConfig(n_layer=12, d_model=768, n_head=12, context=1024, vocab=50257)
    small = GPTConfig(n_layer=4, d_model=256, n_head=8, context=128, vocab=256)
    assert memory.probabilities_share(gpt2, 1024) == pytest.approx(0.5, abs=0.01)
    assert memory.probabilities_share(small, 128) == pytest.approx(0.2, abs=0.01)
    assert memory.recompute_of(Config(), gpt2, 1024) == "selective"
    assert memory.recompute_of(Config(), gpt2, 128) == "none"       # the same model on short sequences
    assert memory.recompute_of(Config(), small, 128) == "none"
    assert memory.recompute_of(Config(model="mlp"), gpt2, 1024) == "none"
    for mode in MODES:
        assert memory.recompute_of(Config(recompute=mode), gpt2, 1024) == mode


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_a_run_with_recomputation_equals_one_without(tmp_path, model):
    """Through the library entry point (Config.recompute reaches the rank model's chain):
    the same losses and checkpoint, bit for bit, and the start-up description says so."""
    def trained(mode):
        cfg = Config(model=model, data="synthetic", layers=2, d_model=16, heads=2, context=8, batch_size=4,
                     microbatches=2, steps=2, sample_tokens=0, quiet=True, eval_every=2, eval_batches=1,
                     recompute=mode, out=os.path.join(tmp_path, mode))
        return train(cfg, MPI.COMM_SELF)
    ref = trained("none")
    assert "recompute" not in ref.model.describe()
    for mode in ("full", "selective"):
        par = trained(mode)
        assert losses(par.out) == losses(ref.out)
        assert_same_arrays(final_arrays(par.out), final_arrays(ref.out), 0.0, mode)
        assert f"recompute {mode}" in par.model.describe()


def test_auto_through_the_library_recomputes_long_sequences_and_says_so(tmp_path, capsys):
    """Heads 4 at T 64, C 16: the probabilities are half of a block's activations, so auto (the
    default) runs selective: the same bits as none, the start-up lines say it and why, and the
    caller's Config still says auto."""
    def config(mode, **more):
        return Config(data="synthetic", layers=2, d_model=16, heads=4, context=64, batch_size=2, steps=2,
                      sample_tokens=0, eval_every=2, eval_batches=1, out=os.path.join(tmp_path, mode), **more)
    auto = config("auto", quiet=False)
    par = train(auto, MPI.COMM_SELF)
    assert auto.recompute == "auto"
    assert "recompute selective" in par.model.describe()
    said = capsys.readouterr().out
    assert "recompute selective (auto): the attention probabilities would be 50% of what a block keeps at T 64" in said
    ref = train(config("none", recompute="none", quiet=True), MPI.COMM_SELF)
    assert "recompute" not in ref.model.describe()
    assert losses(par.out) == losses(ref.out)
    assert_same_arrays(final_arrays(par.out), final_arrays(ref.out), 0.0, "auto")
