"""bf16 operands kept where they are reused (engine/model/layers.py BF16): the same numbers as
rounding in every GEMM, and a weight cache that is never stale.

Under bf16 precision every GEMM rounds its float32 operands to bf16; the layers now round a
weight once per step and an activation or gradient once for the GEMMs that read it, and pass
the bits. The GEMMs get the same bits, so training is the same bits as the per-call rounding
(the path as it was, forced here by switching BF16 off). The MPI layouts (ZeRO-3 among them)
are in tests/engine/parallel/test_dp.py test_bf16_matmuls_under_parallelism_equal_single_process.
"""
import numpy as np
import pytest

from ringpipe import kernels as K
from ringpipe.engine.model import layers
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.model.llama import LlamaConfig, llama_layers
from ringpipe.engine.model.optim import make_optimizer
from ringpipe.engine.parallel.local import LocalModel

FAMILIES = {
    "gpt": lambda: gpt_layers(GPTConfig(n_layer=2, d_model=48, n_head=2, context=16, vocab=64)),
    "llama": lambda: llama_layers(LlamaConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, context=16,
                                              vocab=64, qkv_bias=True)),
}


@pytest.fixture
def bf16():
    before = K.get_matmul_precision()
    K.set_matmul_precision("bf16")
    yield
    K.set_matmul_precision(before)


def _batch(step, B=4, T=12, vocab=64):
    rng = np.random.default_rng(step)
    return rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))


def _train(family, steps=3, microbatches=2, recompute="none"):
    """AdamW steps on a fresh model through LocalModel (the trainer's inner model, which opens
    the step's weight cache). Returns (losses, last gradients, weights)."""
    model = LocalModel(FAMILIES[family](), np.dtype(np.float32), seed=0, microbatches=microbatches)
    model.chain.set_recompute(recompute)
    params = model.params
    opt = make_optimizer("adamw", params.size, params.dtype, np, params.decay_mask(), 0.1)
    losses = []
    for step in range(steps):
        params.zero_grad()
        x, y = _batch(step)
        losses.append(model.forward_backward(x, y, 1.0 / y.size))
        grad = params.grad.copy()
        opt.step(params.data, params.grad, 1e-2)       # the weights change: a stale bf16 copy would show
    return losses, grad, params.data.copy()


def _per_call(monkeypatch):
    # the path as it was: the layers pass float32 and each GEMM rounds its operands
    monkeypatch.setattr(layers.Bf16Operands, "applies", staticmethod(lambda a: False))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("head_rows", [None, 5], ids=["head-whole", "head-5-rows"])
def test_bf16_operands_train_as_the_per_call_rounding(bf16, monkeypatch, family, recompute, head_rows):
    if head_rows:       # the head's logits in blocks of 5 rows (LMHead.loss_and_bf16_grad), the last one short
        monkeypatch.setattr(layers.LMHead, "BF16_BLOCK_BYTES", head_rows * 4 * 128)
    kept = _train(family, recompute=recompute)
    _per_call(monkeypatch)
    per_call = _train(family, recompute=recompute)
    assert kept[0] == per_call[0]
    np.testing.assert_array_equal(kept[1], per_call[1])
    np.testing.assert_array_equal(kept[2], per_call[2])


def test_weight_copies_live_for_one_step_and_follow_the_update(bf16, monkeypatch):
    """Each step rounds the weights as they are after the last update: a cache kept from
    the step before (stale) would train differently from rounding per call."""
    rounded = []
    real = K.to_bf16
    monkeypatch.setattr(K, "to_bf16", lambda a, out=None: rounded.append(a.shape) or real(a, out))
    model = LocalModel(FAMILIES["gpt"](), np.dtype(np.float32), seed=0, microbatches=2)
    x, y = _batch(0)
    model.forward_backward(x, y, 1.0 / y.size)
    wte, fc = model.params.view("wte").shape, model.params.view("h.0.mlp.fc.w").shape
    # two micro-batches, each weight read by forward and backward: rounded once (fc: one per block)
    assert rounded.count(wte) == 1 and rounded.count(fc) == 2
    assert layers.BF16.copies is None             # dropped when the step ends, before any update
    model.params.data += 1.0                      # an update (restore, --init-from...) between steps
    rounded.clear()
    model.forward_backward(x, y, 1.0 / y.size)
    assert rounded.count(wte) == 1 and rounded.count(fc) == 2      # rounded again from the new weights


def test_weight_copies_need_a_caching_step(bf16):
    w = np.ones((4, 3), np.float32)
    assert layers.BF16.weight(w) is w             # outside a step: the GEMM rounds it
    with layers.BF16.step(cache=False):           # ZeRO-3: never cached
        assert layers.BF16.weight(w) is w
    with layers.BF16.step():
        copy = layers.BF16.weight(w)
        assert copy.dtype == np.uint16 and layers.BF16.weight(w) is copy
        assert layers.BF16.weight(w[:2]) is not copy      # another view, another key
    assert layers.BF16.copies is None


def test_float32_precision_passes_every_operand_through():
    assert K.get_matmul_precision() == "float32"
    x = np.ones((2, 3), np.float32)
    with layers.BF16.step():
        assert layers.BF16.weight(x) is x and layers.BF16.of(x) is x
    with _precision("bf16"):                      # float64 (and GPU arrays) are never rounded here
        assert layers.BF16.of(x.astype(np.float64)).dtype == np.float64


class _precision:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.before = K.get_matmul_precision()
        K.set_matmul_precision(self.name)

    def __exit__(self, *exc):
        K.set_matmul_precision(self.before)


def test_kept_activations_are_bf16(bf16):
    """What a block keeps for its backward's weight gradients is bf16: half the bytes."""
    chain = LayerChain(FAMILIES["gpt"](), dtype=np.float32)
    chain.params.init(0)
    x, y = _batch(0)
    _, ctxs = chain.forward(x, y, grad_scale=1.0 / y.size)
    block = ctxs[1]                                 # (ln1, attn, ln2, mlp)
    fc_x, _ = block[3][0]
    assert fc_x.dtype == np.uint16
    assert block[1][1].dtype == np.uint16           # q


def test_zero3_chains_round_per_gemm(bf16):
    """Under ZeRO-3 (a chain whose parameters an outer axis gathers per layer) no copies are
    kept: they would hold half the whole model on every rank for the step."""
    chain = LayerChain(FAMILIES["gpt"](), dtype=np.float32)
    with layers.bf16_step([chain]):
        assert layers.BF16.copies == {}
    chain.residency = object()
    with layers.bf16_step([chain]):
        assert layers.BF16.copies is None
