"""--reduce-order canonical: the same global batch and micro-batches give bit-identical float32
weights whatever the number of data-parallel replicas (issue 27's deterministic summation).

The global batch is cut into M micro-batches; dp replicas each compute M/dp of them. Under
canonical order every micro-batch's gradient is computed alone and the M are summed in one
pairwise tree, ((g0 + g1) + (g2 + g3)), inside a replica (LocalModel) and across the replicas
(recursive doubling, comm/small.py): dp 1 with M micro-batches, dp 2 with M/2 and dp M with one
are then the same sums in the same order, bit for bit. Under the default (fast) order they are
not: the check that the bits would differ otherwise is part of the test.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_canonical.py`.
"""
import os
import re

import numpy as np
import pytest

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.parallel.local import LocalModel
from ringpipe.engine.train.config import Config, check

from tests.support.parity import reference, train

BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=20, sample_tokens=0,
            quiet=True, overwrite=True, dtype="float32", monitor_every=0, tensorboard=False, eval_every=20)


def _weights(trained):
    return np.asarray(trained.model.params.data).copy()


def _split(world, groups):
    """The world cut into `groups` consecutive groups (each a data-parallel job of its own)."""
    size = world.Get_size() // groups
    return world.Split(world.Get_rank() // size, world.Get_rank())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("order", ["canonical", "fast"])
def test_dp_1_2_4_give_the_same_bits_under_canonical_order(shared_dir, order):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    n = world.Get_size()
    if n & (n - 1) or 8 % n:
        pytest.skip("a power of two of ranks dividing the global batch of 8")
    # M = n global micro-batches: dp 1 runs n, dp n runs one each, dp n/2 two each.
    one = reference(Config(**BASE, reduce_order=order, microbatches=n, out=os.path.join(shared_dir, f"one{world.rank}")))
    layouts = {1: _weights(one)}
    every = train(Config(**BASE, reduce_order=order, microbatches=1, out=os.path.join(shared_dir, "all")), world)
    layouts[n] = _weights(every)
    if n >= 4:
        half = _split(world, 2)
        try:
            group = world.Get_rank() // (n // 2)
            pair = train(Config(**BASE, reduce_order=order, microbatches=2,
                                out=os.path.join(shared_dir, f"half{group}")), half)
            layouts[n // 2] = _weights(pair)
        finally:
            half.Free()
    world.Barrier()
    if order == "canonical":
        for dp, weights in layouts.items():
            assert np.array_equal(weights, layouts[1]), \
                f"dp {dp}: {np.count_nonzero(weights != layouts[1])} of {weights.size} weights differ from dp 1's bits"
    else:
        # The point of the option: in the fast order the sums differ in their last bits.
        assert not np.array_equal(layouts[n], layouts[1]), "the fast order gave dp 1's bits too: nothing is shown"
        np.testing.assert_allclose(layouts[n], layouts[1], rtol=1e-4, atol=1e-5)


def test_a_replicas_micro_batches_are_summed_in_a_pairwise_tree():
    """LocalModel's canonical sum of 4 micro-batches is ((g0 + g1) + (g2 + g3)) of the gradients
    each computed alone, to the bit."""
    from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
    shape = GPTConfig(vocab=32, context=8, n_layer=1, d_model=8, n_head=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, size=(8, 8))
    y = rng.integers(0, 32, size=(8, 8))
    canonical = LocalModel(gpt_layers(shape), np.float32, 1, microbatches=4, canonical=True)
    alone = LocalModel(gpt_layers(shape), np.float32, 1, microbatches=1)
    canonical.params.zero_grad()
    canonical.forward_backward(x, y, 1.0 / 64)
    grads = []
    for i in range(4):
        alone.params.zero_grad()
        alone.forward_backward(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2], 1.0 / 64)
        grads.append(alone.params.grad.copy())
    tree = (grads[0] + grads[1]) + (grads[2] + grads[3])
    assert np.array_equal(canonical.params.grad, tree)


@pytest.mark.parametrize("settings,world_size,says", [
    (dict(pp=2, microbatches=2), 2, "not with a pipeline"),
    (dict(zero=1), 2, "without ZeRO"),
    (dict(microbatches=3, batch_size=6), 1, "microbatches to be a power of two"),
    (dict(batch_size=6), 3, "dp to be a power of two"),
])
def test_what_canonical_order_cannot_do_is_refused(settings, world_size, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check(Config(**{**BASE, **settings}, reduce_order="canonical"), world_size)
