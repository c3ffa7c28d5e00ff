"""Data parallelism never changes the math: DP=N equals one process on the same global batch.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_dp.py`.
Every rank first trains the single-process reference on COMM_SELF, then all ranks
train together, both through the library entry point run(Config(...), world);
losses, gradients and final weights must agree (float64 ~1e-10, float32 ~1e-5): the
parity harness, tests/support/parity.py.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train.run import run

from tests.support.parity import assert_same_run, losses, reference, train

world = MPI.COMM_WORLD
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=4, sample_tokens=0,
            quiet=True, overwrite=True)


def run_pair(shared_dir, extra, dtype, layout=None):
    """One process with `extra`, then every rank with `extra` + `layout`: (parallel, reference)."""
    settings = dict(BASE, dtype=dtype, **extra)
    ref = reference(Config(**settings, out=os.path.join(shared_dir, f"ref{world.rank}")))
    par = train(Config(**settings, **(layout or {}), out=os.path.join(shared_dir, "dp")), world)
    world.Barrier()
    return par, ref


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 1e-5)])
@pytest.mark.parametrize("extra", [dict(bucket_mb=25), dict(), dict(bucket_mb=0.001),
                                   dict(bucket_mb=0.001, no_overlap=True), dict(zero=1),
                                   dict(optimizer="sgd", zero=1)],
                         ids=["one-bucket", "auto-buckets", "many-buckets", "no-overlap", "zero1", "sgd-zero1"])
def test_dp_equals_single_process(shared_dir, extra, dtype, tol):
    if 8 % world.size:
        pytest.skip("global batch 8 must divide among the ranks")
    assert_same_run(*run_pair(shared_dir, extra, dtype), tol)     # parameters and optimizer state too


@pytest.mark.mpi(min_size=2)
# With tp, SGD: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by
# all keys), so it holds only rounding noise, which bf16 makes larger and AdamW (m / sqrt(v)) scales up
# to lr-sized steps in any layout that sums in another order. SGD keeps that noise at its own size.
# zero=2/3: the bf16 weight copies (engine/model/layers.py BF16) are made after each update's gather
# (ZeRO-2) or not at all (ZeRO-3, parameters gathered per layer); tp without sequence parallelism
# keeps the column layers' inputs in bf16.
@pytest.mark.parametrize("layout,optimizer", [({}, "adamw"), (dict(pp=2, microbatches=2), "adamw"),
                                              (dict(tp=2, sequence_parallel=True), "sgd"), (dict(tp=2), "sgd"),
                                              (dict(zero=2), "adamw"), (dict(zero=3, microbatches=2), "adamw")],
                         ids=["dp", "dp-x-pp", "dp-x-tp", "dp-x-tp-no-sp", "zero2", "zero3"])
def test_bf16_matmuls_under_parallelism_equal_single_process(shared_dir, layout, optimizer):
    # bf16 rounding is deterministic, so mixed precision keeps invariant 1 at float32 tolerance.
    if 8 % world.size:
        pytest.skip("global batch 8 must divide among the ranks")
    par, ref = run_pair(shared_dir, dict(precision="bf16", optimizer=optimizer), "float32", layout)
    assert_same_run(par, ref, 1e-5, holdings=False)


@pytest.mark.mpi(min_size=2)
def test_mlp_dp_equals_single_process(shared_dir):
    settings = dict(model="mlp", data="synthetic", batch_size=8, steps=3, dtype="float64", quiet=True,
                    overwrite=True)
    ref = reference(Config(**settings, out=os.path.join(shared_dir, f"ref{world.rank}")))
    par = train(Config(**settings, out=os.path.join(shared_dir, "dp")), world)
    world.Barrier()
    np.testing.assert_allclose(losses(par.out), losses(ref.out), rtol=1e-10)


@pytest.mark.mpi(min_size=2)
def test_batch_that_does_not_divide_is_refused_on_every_rank(shared_dir):
    bad = world.size + 1
    with pytest.raises(ConfigError, match=f"batch_size {bad} does not divide among {world.size}"):
        run(Config(**dict(BASE, batch_size=bad), out=os.path.join(shared_dir, "bad")), world=world)


@pytest.mark.mpi(min_size=2)
def test_dp_that_does_not_match_ranks_is_refused(shared_dir):
    with pytest.raises(ConfigError, match=f"dp {world.size + 1} x pp 1 = {world.size + 1} does not match"):
        run(Config(**BASE, dp=world.size + 1, out=os.path.join(shared_dir, "bad")), world=world)
