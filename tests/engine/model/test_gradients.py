"""Finite-difference gradient checks (float64) for every layer and for whole models.

Each check compares the analytic gradient of L = sum(out * R) (R random) with a
central difference for EVERY parameter element and every input element:
relative error ||analytic - numeric|| / (||analytic|| + ||numeric||) < 1e-6.
"""
import numpy as np
import pytest

from ringpipe.engine.model import layers as L
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.model.mlp import MLPConfig, mlp_layers
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.params import ParamBuffer

EPS = 1e-5
TOL = 1e-6


def rel_err(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    denom = np.linalg.norm(a) + np.linalg.norm(b)
    return 0.0 if denom == 0 else np.linalg.norm(a - b) / denom


def numeric_grad(f, x):
    """Central differences of scalar f() with respect to every element of x (in place)."""
    g = np.zeros(x.size)
    flat = x.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        fp = f()
        flat[i] = old - EPS
        fm = f()
        flat[i] = old
        g[i] = (fp - fm) / (2 * EPS)
    return g.reshape(x.shape)


def bind(layer, seed=0):
    params = ParamBuffer(layer.specs(), np.float64)
    params.init(seed)
    # Perturb away from the special init values (ones/zeros) so every path is exercised.
    params.data += np.random.default_rng(seed + 1).normal(0, 0.1, params.size)
    layer.bind(params)
    return params


def check_layer(layer, x):
    params = bind(layer)
    y, ctx = layer.forward(x)
    R = np.random.default_rng(3).normal(size=y.shape)
    loss = lambda: float((layer.forward(x)[0] * R).sum())
    params.zero_grad()
    dx = layer.backward(R.copy(), ctx)
    for name in params.names():
        num = numeric_grad(loss, params.view(name))
        assert rel_err(params.grad_view(name), num) < TOL, name
    if dx is not None:
        assert rel_err(dx, numeric_grad(loss, x)) < TOL, "input"


rng = np.random.default_rng(0)


def test_linear():
    check_layer(L.Linear("fc", 5, 7), rng.normal(size=(3, 4, 5)))


def test_linear_no_bias():
    check_layer(L.Linear("fc", 5, 3, bias=False), rng.normal(size=(6, 5)))


def test_linear_with_fused_gelu():
    check_layer(L.Linear("fc", 5, 7, gelu=True), rng.normal(size=(3, 4, 5)))


def test_layernorm():
    check_layer(L.LayerNorm("ln", 7), rng.normal(size=(2, 3, 7)))


def test_gelu():
    check_layer(L.GELU(), rng.normal(size=(4, 9)) * 2)


def test_attention():
    check_layer(L.CausalSelfAttention("attn", 8, 2, 1), rng.normal(size=(2, 5, 8)))


def test_mlp_block():
    check_layer(L.MLP("mlp", 6, 1), rng.normal(size=(2, 3, 6)))


def test_transformer_block():
    check_layer(L.Block("h.0", 8, 2, 2), rng.normal(size=(2, 5, 8)))


def test_dense_gelu():
    check_layer(L.DenseGELU("fc", 5, 6), rng.normal(size=(4, 5)))


def test_embedding():
    layer = L.Embedding(vocab=7, context=6, c=4)
    params = bind(layer)
    tokens = np.array([[1, 3, 3, 0, 6], [2, 2, 2, 5, 1]])      # repeats: gradients must add up
    y, ctx = layer.forward(tokens)
    R = rng.normal(size=y.shape)
    loss = lambda: float((layer.forward(tokens)[0] * R).sum())
    params.zero_grad()
    layer.backward(R, ctx)
    for name in params.names():
        assert rel_err(params.grad_view(name), numeric_grad(loss, params.view(name))) < TOL, name


@pytest.mark.parametrize("head", ["lm", "classifier"])
def test_heads_with_cross_entropy(head):
    if head == "lm":
        layer, x, targets = L.LMHead(vocab=9, c=6), rng.normal(size=(2, 3, 6)), rng.integers(0, 9, size=(2, 3))
    else:
        layer, x, targets = L.ClassifierHead("head", 6, 5), rng.normal(size=(7, 6)), rng.integers(0, 5, size=7)
    params = bind(layer)
    scale = 1.0 / targets.size
    loss = lambda: layer.forward(x, targets, grad_scale=scale, need_grad=False)[0] * scale
    params.zero_grad()
    _, ctx = layer.forward(x, targets, grad_scale=scale)
    dx = layer.backward(None, ctx)
    for name in params.names():
        assert rel_err(params.grad_view(name), numeric_grad(loss, params.view(name))) < TOL, name
    assert rel_err(dx, numeric_grad(loss, x)) < TOL


def check_model(stage, x, targets, check_input):
    stage.params.init(0)
    stage.params.data += np.random.default_rng(5).normal(0, 0.05, stage.params.size)
    scale = 1.0 / targets.size
    loss = lambda: stage.loss(x, targets) * scale
    stage.params.zero_grad()
    loss_sum, ctxs = stage.forward(x, targets, grad_scale=scale)
    dx = stage.backward(None, ctxs)
    for name in stage.params.names():
        num = numeric_grad(loss, stage.params.view(name))
        assert rel_err(stage.params.grad_view(name), num) < TOL, name
    if check_input:
        assert rel_err(dx, numeric_grad(loss, x)) < TOL, "input"


def test_whole_gpt_all_parameters():
    # Small vocab so that every element of every parameter (tied wte included) is checked quickly.
    cfg = GPTConfig(n_layer=2, d_model=8, n_head=2, context=6, vocab=11)
    stage = LayerChain(gpt_layers(cfg), dtype=np.float64)
    tokens = rng.integers(0, 11, size=(2, 5))
    targets = rng.integers(0, 11, size=(2, 5))
    check_model(stage, tokens, targets, check_input=False)


def test_gpt_blocks_and_head_input_gradient():
    # Tokens are discrete; the input gradient that matters is the one into the first block.
    cfg = GPTConfig(n_layer=2, d_model=8, n_head=2, context=6, vocab=11)
    stage = LayerChain(gpt_layers(cfg)[1:], dtype=np.float64)
    x = rng.normal(size=(2, 5, 8))
    check_model(stage, x, rng.integers(0, 11, size=(2, 5)), check_input=True)


def test_whole_mlp_parameters_and_inputs():
    stage = LayerChain(mlp_layers(MLPConfig(n_in=6, hidden=7, n_layer=2, n_classes=4)), dtype=np.float64)
    check_model(stage, rng.normal(size=(5, 6)), rng.integers(0, 4, size=5), check_input=True)


def test_zero_bubble_split_equals_full_backward():
    cfg = GPTConfig(n_layer=2, d_model=8, n_head=2, context=6, vocab=11)
    tokens, targets = rng.integers(0, 11, size=(2, 5)), rng.integers(0, 11, size=(2, 5))
    grads = []
    for split in (False, True):
        stage = LayerChain(gpt_layers(cfg), dtype=np.float64)
        stage.params.init(0)
        _, ctxs = stage.forward(tokens, targets, grad_scale=0.1)
        if split:
            _, wctxs = stage.backward_input(None, ctxs)
            stage.backward_weight(wctxs)
        else:
            stage.backward(None, ctxs)
        grads.append(stage.params.grad.copy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12, atol=1e-15)


def test_ready_callbacks_cover_every_parameter_once():
    cfg = GPTConfig(n_layer=2, d_model=8, n_head=2, context=6, vocab=11)
    stage = LayerChain(gpt_layers(cfg), dtype=np.float64)
    stage.params.init(0)
    seen = []
    stage.loss_and_grad(rng.integers(0, 11, size=(1, 4)), rng.integers(0, 11, size=(1, 4)), 1.0,
                        on_ready=seen.append)
    assert sorted(seen) == list(range(len(stage.params.names())))
    # the tied embedding is reported last: the embedding's backward is the final contribution
    assert seen[-1] in (stage.params.index_of("wte"), stage.params.index_of("wpe"))
    assert stage.params.index_of("wte") in seen[-2:]
