"""--sync ps (colocated, --ps-servers 0) with a pipeline and a tensor axis never changes the
math: one parameter-server group per (stage, tensor rank), the tied embedding summed between
the stages before its push, the norm counted once over stages and tensor ranks. PP 2 x DP 2
and TP 2 x DP 2 train as one process does (float64 1e-10, clipping active), and a PS PP 2 x
DP 2 checkpoint continues in an all-reduce PP 2 x DP 2 run and back on the same trajectory.

Run with `mpiexec -n 4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_ps_grid.py`; the configuration checks run serially. The parity
harness: tests/support/parity.py. (PP 2 x TP 2 x DP 2 needs 8 ranks: not here; run by hand
it gives the same, with and without sequence parallelism.)
"""
import os

import pytest
from mpi4py import MPI

from ringpipe.engine.parallel import ps as ps_model
from ringpipe.engine.parallel.pipeline.stage import PipelineModel
from ringpipe.engine.parallel.tensor import TensorParallel
from ringpipe.engine.train.config import Config, check

from tests.support.parity import assert_continues, assert_same_run, metrics, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10
CLIP = 0.05          # below this model's gradient norms: every step is clipped
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=3, dtype="float64",
            microbatches=2, sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1,
            grad_clip=CLIP, monitor_every=0, tensorboard=False)
# 1000 bytes cut this model into ~100 chunks across parameter boundaries (the tied wte over
# several owners); None: the 4 MiB default, the whole stage in one chunk on one owner.
SMALL_CHUNKS = 1000


def ps_equals_one_process(shared_dir, monkeypatch, tag, chunk_bytes, model=None, **layout):
    """model: settings of both runs (layers, micro-batches) that differ from BASE."""
    if world.size != 4:
        pytest.skip("written for 4 ranks (a model-parallel axis of 2 x dp 2)")
    if chunk_bytes is not None:
        monkeypatch.setattr(ps_model, "CHUNK_BYTES", chunk_bytes)
    cfg = dict(BASE, **(model or {}))
    ref = reference(Config(**cfg, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    par = train(Config(**cfg, **layout, dp=2, sync="ps", out=os.path.join(shared_dir, tag)), world)
    world.Barrier()
    assert isinstance(par.model, ps_model.ParameterServerData)
    # Losses, validation, grad norms (every parameter counted once: they set the clipping),
    # this rank's summed chunks, every weight it holds, and the whole checkpoint.
    assert_same_run(par, ref, TOL, grad_norm=True)
    assert all(m["grad_norm"] > CLIP for m in metrics(par.out)), "clipping must act in this test"
    return par


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,chunk_bytes,more", [
    ("1f1b", None, {}),
    ("1f1b", SMALL_CHUNKS, {}),
    ("zbh1", SMALL_CHUNKS, {}),
    ("1f1b", SMALL_CHUNKS, dict(no_overlap=True)),
    # Two model chunks a rank: the tied wte between virtual stages 0 and 3, ranks 0 and 1.
    ("interleaved", SMALL_CHUNKS, dict(chunks=2, model=dict(layers=4, microbatches=4))),
], ids=["1f1b-one-chunk", "1f1b-small-chunks", "zbh1-small-chunks", "1f1b-small-chunks-no-overlap",
        "interleaved-small-chunks"])
def test_ps_with_a_pipeline_equals_one_process(shared_dir, monkeypatch, schedule, chunk_bytes, more):
    par = ps_equals_one_process(shared_dir, monkeypatch, f"pp-{schedule}-{chunk_bytes}-{len(more)}", chunk_bytes,
                                pp=2, schedule=schedule, **more)
    stage = par.model.inner
    assert isinstance(stage, PipelineModel)
    # Both ends of the tied embedding hold it, the last one leaves it out of the norm.
    assert stage._tied and par.model.norm_excluded == (stage._tied if stage.grid.index("pipe") == 1 else [])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_ps_with_a_tensor_axis_equals_one_process(shared_dir, monkeypatch, sequence_parallel):
    par = ps_equals_one_process(shared_dir, monkeypatch, f"tp-{sequence_parallel}", SMALL_CHUNKS, tp=2,
                                sequence_parallel=sequence_parallel)
    tensor = par.model.inner
    assert isinstance(tensor, TensorParallel)
    # The replicated parameters (LayerNorms, biases of the row-parallel linears, wpe) count on tensor rank 0.
    assert bool(par.model.norm_excluded) == (tensor.tensor.index == 1)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("first,then", [("ps", "allreduce"), ("allreduce", "ps")])
def test_a_pipeline_checkpoint_continues_between_ps_and_allreduce(shared_dir, monkeypatch, first, then):
    """PP 2 x DP 2 checkpointed at step 3 by one sync, continued to step 6 by the other, ends
    where an uninterrupted all-reduce PP 2 x DP 2 run does."""
    if world.size != 4:
        pytest.skip("written for 4 ranks (pp 2 x dp 2)")
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", SMALL_CHUNKS)
    steps = dict(BASE, steps=6, eval_every=6, pp=2, dp=2)
    whole = os.path.join(shared_dir, "whole")
    train(Config(**steps, out=whole), world)
    world.Barrier()
    head = os.path.join(shared_dir, f"head-{first}")
    train(Config(**steps, sync=first, checkpoint_every=3, out=head), world)
    world.Barrier()
    tail = os.path.join(shared_dir, f"tail-{then}")
    train(Config(**steps, sync=then, resume=os.path.join(head, "checkpoints", "ckpt_00000003.json"), out=tail),
          world)
    world.Barrier()
    assert_continues(tail, whole, 3, 6, TOL, f"{first} then {then}")


# ---- the configuration (serial) ----------------------------------------------------------------

@pytest.mark.parametrize("settings,world_size", [
    (dict(pp=2, microbatches=2), 4),
    (dict(pp=2, chunks=2, schedule="interleaved", layers=4, microbatches=4), 4),
    (dict(tp=2), 4),
    (dict(tp=2, pp=2, microbatches=2), 8),
])
def test_colocated_servers_take_any_layout(settings, world_size):
    assert check(Config(data="synthetic", batch_size=8, sync="ps", **settings), world_size) == []


@pytest.mark.parametrize("settings,world_size,servers", [
    (dict(pp=2, microbatches=2), 5, 1),
    (dict(tp=2), 6, 2),
    (dict(tp=2, pp=2, microbatches=2), 9, 1),
])
def test_dedicated_servers_take_any_layout(settings, world_size, servers):
    """One server group per (stage, tensor rank) on the dedicated servers too (their parity:
    test_ps_servers.py's 8-rank tests)."""
    assert check(Config(data="synthetic", batch_size=8, sync="ps", ps_servers=servers, **settings), world_size) == []
