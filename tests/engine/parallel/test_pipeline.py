"""Pipeline (and DP x PP) training equals one process: losses, gradients, weights (float64 ~1e-10).

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_pipeline.py`.
Every rank first trains the single-process reference on COMM_SELF, then the grid, both
through the library entry point run(Config(...), world): the parity harness,
tests/support/parity.py.
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train.run import run

from tests.support.parity import assert_same_arrays, assert_same_run, final_arrays, layouts, losses, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10


def base(layers, batch, **more):
    return Config(**{**dict(data="synthetic", layers=layers, d_model=8, heads=2, context=8, batch_size=batch,
                            steps=3, dtype="float64", sample_tokens=0, quiet=True, overwrite=True, eval_every=3,
                            eval_batches=1), **more})


CASES = [(sched, pp, dp, m) for dp, pp, _ in layouts(world.size, pp=(2, 4), dp=(1, 2))
         for sched in ("gpipe", "1f1b", "interleaved", "zbh1") for m in sorted({1, pp, 2 * pp + 1})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule,pp,dp,m", CASES or [(None, None, None, None)])
def test_pipeline_equals_single_process(shared_dir, schedule, pp, dp, m):
    if schedule is None:
        pytest.skip("no pp in {2,4} with dp in {1,2} fits this many ranks")
    chunks = 2 if schedule == "interleaved" else 1
    layers = max(2, pp * chunks)
    tag = f"{schedule}-{pp}-{dp}-{m}"
    ref = reference(base(layers, dp * m * 2, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    try:
        grid = train(base(layers, dp * m * 2, pp=pp, dp=dp, schedule=schedule, microbatches=m, chunks=chunks,
                          out=os.path.join(shared_dir, f"grid-{tag}")), world)
    except ConfigError as e:      # a schedule that cannot support this m must say so clearly
        assert schedule == "interleaved" and "micro" in str(e), e
        return
    world.Barrier()
    # losses, validation, the gradients (of the last step, after clipping) and weights of every
    # parameter this rank holds, and the gathered checkpoint: the whole model, equal to the reference's
    assert_same_run(grid, ref, TOL)
    # activation memory, from the executor's own accounting
    s, peak = world.rank // dp, grid.model.inner.executor.peak_in_flight
    if schedule == "gpipe":
        assert peak == m
    elif schedule == "1f1b":
        assert peak <= min(pp - s, m)


@pytest.mark.mpi(min_size=2)
def test_more_stages_than_layers_is_refused(shared_dir):
    with pytest.raises(ConfigError, match="only 1 layers"):
        run(base(1, 4, pp=world.size, out=os.path.join(shared_dir, "bad1")), world=world)


@pytest.mark.mpi(min_size=2)
def test_grid_that_does_not_match_ranks_is_refused(shared_dir):
    with pytest.raises(ConfigError, match=f"dp 2 x pp {world.size} = {2 * world.size} does not match"):
        run(base(4, 4, pp=world.size, dp=2, out=os.path.join(shared_dir, "bad2")), world=world)


@pytest.mark.mpi(min_size=2)
def test_microbatches_that_do_not_divide_the_batch_are_refused(shared_dir):
    with pytest.raises(ConfigError, match="does not split into microbatches 3"):
        run(base(4, 4, pp=world.size, microbatches=3, out=os.path.join(shared_dir, "bad3")), world=world)


@pytest.mark.mpi(min_size=2)
def test_trace_and_balanced_partition(shared_dir):
    out = os.path.join(shared_dir, "traced")
    ref = reference(base(world.size, 4, out=os.path.join(shared_dir, f"traced-ref{world.rank}")))
    train(base(world.size, 4, pp=world.size, microbatches=4, partition="balanced", trace=os.path.join(out, "trace"),
               out=out), world)
    world.Barrier()
    # balanced partition changes where layers run, never the math
    np.testing.assert_allclose(losses(out), losses(ref.out), rtol=TOL)
    with open(os.path.join(out, "trace", "trace.json")) as fh:
        events = json.load(fh)["traceEvents"]
    ranks = {e["tid"] for e in events if e.get("ph") == "X"}
    assert ranks == set(range(world.size))
    cats = {e["cat"] for e in events if e.get("ph") == "X"}
    assert {"compute", "send"} <= cats
    names = {e["name"] for e in events if e.get("ph") == "X" and e["tid"] == 0}
    assert "F0" in names and "B0" in names


@pytest.mark.mpi(min_size=4)
def test_checkpoint_from_one_layout_resumes_in_another(shared_dir):
    """Written by (dp 2, pp 2), continued by (dp 4, pp 1), (dp 1, pp 4) and one process:
    all reach the uninterrupted single-process trajectory."""
    if world.size != 4:
        pytest.skip("written for 4 ranks")
    ref = reference(base(4, 8, steps=6, out=os.path.join(shared_dir, f"relayout-ref{world.rank}")))
    first = os.path.join(shared_dir, "relayout-22")
    run(base(4, 8, steps=6, pp=2, dp=2, microbatches=2, checkpoint_every=3, out=first), world=world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000003.json")
    for name, layout, comm_ in (("41", dict(dp=4), world), ("14", dict(pp=4, microbatches=4), world),
                                (f"11-{world.rank}", {}, MPI.COMM_SELF)):
        out = os.path.join(shared_dir, f"relayout-{name}")
        train(base(4, 8, steps=6, resume=ckpt, out=out, **layout), comm_)
        world.Barrier()
        arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
        assert manifest["step"] == 6
        assert_same_arrays(arrays, final_arrays(ref.out), TOL, name)
