"""--sync ps --ps-servers K (dedicated parameter-server ranks, engine/parallel/ps.py) never
changes the math: the workers train as one process does (float64 1e-10), with clipping active
and with micro-batches, whatever the servers' count; a checkpoint of a K = 1 run continues in
an all-reduce run and back on the same trajectory; bad layouts are refused before any work.

Run with `mpiexec -n 4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_ps_servers.py` (tests/run_mpi.sh's 4-rank pass). The layouts are
2 workers + 2 servers and 3 + 1 on the 4 ranks, and 2 + 1 on the first 3 of them (the fourth
waits). The server ranks hold no model: the parity is checked on the workers, the servers
check that they ended as the workers did. The refusals run serially.
"""
import os
import re

import pytest
from mpi4py import MPI

from ringpipe.engine.job import rundir
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.parallel import ps as ps_model
from ringpipe.engine.train.config import Config, check
from ringpipe.engine.train.run import run

from tests.support.parity import Trained, assert_continues, assert_same_run, job, metrics, reference

world = MPI.COMM_WORLD
TOL = 1e-10
CLIP = 0.05          # below this model's gradient norms: every step is clipped
# A global batch of 12 divides among 2 and 3 workers, and then into 2 micro-batches.
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=12, steps=3, dtype="float64",
            sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1, grad_clip=CLIP,
            monitor_every=0, tensorboard=False)
# (ranks of the job, dedicated servers): the workers are the first ranks - servers.
LAYOUTS = {"2+1": (3, 1), "2+2": (4, 2), "3+1": (4, 1)}
# 4 MiB: this model in one chunk (one server owns it, a second none); 1000 bytes: ~100 chunks
# across parameter boundaries, interleaved over the servers.
CHUNKS = {"one-chunk": None, "small-chunks": 1000}


def needs_4_ranks():
    if world.size != 4:
        pytest.skip("the layouts are 2+1, 2+2 and 3+1 of 4 ranks (at 2 ranks, 1 worker + 1 server is dp 1: refused)")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("chunks,micro", [("one-chunk", dict()), ("small-chunks", dict(microbatches=2)),
                                          ("small-chunks", dict(microbatches=2, no_overlap=True))],
                         ids=["one-chunk-m1", "small-chunks-m2", "small-chunks-m2-no-overlap"])
def test_servers_equal_one_process(shared_dir, monkeypatch, layout, optimizer, chunks, micro):
    needs_4_ranks()
    ranks, servers = LAYOUTS[layout]
    if CHUNKS[chunks] is not None:
        monkeypatch.setattr(ps_model, "CHUNK_BYTES", CHUNKS[chunks])
    cfg = dict(BASE, optimizer=optimizer, **micro)
    tag = f"{layout}-{optimizer}-{chunks}-{len(micro)}"
    ref = reference(Config(**cfg, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    comm = job(ranks)
    if comm is not None:
        result = run(Config(**cfg, sync="ps", ps_servers=servers, out=os.path.join(shared_dir, tag)), world=comm)
        assert result.steps_done == 3 and result.exit_code == 0
        if comm.rank < ranks - servers:
            assert isinstance(result.model, ps_model.ParameterServerData) and not result.model.owned
            # Losses, validation, grad norms, every weight, and the whole checkpoint (the
            # optimizer state asked from the servers).
            assert_same_run(Trained(result.model, os.path.join(shared_dir, tag)), ref, TOL, grad_norm=True)
            assert all(m["grad_norm"] > CLIP for m in metrics(os.path.join(shared_dir, tag))), \
                "clipping must act in this test"
            if CHUNKS[chunks] is not None:
                assert result.model.layout.n_chunks >= 4 * servers
        else:
            assert result.model is None          # a server holds no model
        comm.Free()
    world.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["2+1", "2+2"])
def test_streamed_servers_equal_one_process(shared_dir, monkeypatch, layout):
    """Without clipping the servers stream (each chunk updated and sent back as soon as every
    worker pushed it, the workers' pull posted before backward): the same math."""
    needs_4_ranks()
    ranks, servers = LAYOUTS[layout]
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    cfg = dict(BASE, optimizer="adamw", microbatches=2, grad_clip=0.0)
    ref = reference(Config(**cfg, out=os.path.join(shared_dir, f"ref-streamed-{world.rank}")))
    comm = job(ranks)
    if comm is not None:
        out = os.path.join(shared_dir, f"streamed-{layout}")
        result = run(Config(**cfg, sync="ps", ps_servers=servers, out=out), world=comm)
        assert result.steps_done == 3 and result.exit_code == 0
        if comm.rank < ranks - servers:
            assert result.model.streamed
            assert_same_run(Trained(result.model, out), ref, TOL, grad_norm=True)
        comm.Free()
    world.Barrier()
    if world.rank == 0:        # every rank of the job, servers included, marked the run finished
        done, why = rundir.finished(os.path.join(shared_dir, f"streamed-{layout}"), ranks)
        assert done, why


# Pipeline and tensor axes with dedicated servers: one group per (stage, tensor rank), every
# server in each; the tied embedding summed between the stages before its push; the global
# norm the coordinates' added; and DP 4 alone. (ranks, servers, layout): the first 5 or 6 of 8 ranks.
GRID_LAYOUTS = {"pp2-dp2+1": (5, 1, dict(pp=2, microbatches=2)), "pp2-dp2+2": (6, 2, dict(pp=2, microbatches=2)),
                "tp2-dp2+1": (5, 1, dict(tp=2)), "dp4+1": (5, 1, dict()), "dp4+2": (6, 2, dict(microbatches=2)),
                "pp2-dp2+2-streamed": (6, 2, dict(pp=2, microbatches=2, grad_clip=0.0))}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", list(GRID_LAYOUTS))
def test_servers_with_pipeline_and_tensor_axes(shared_dir, monkeypatch, layout):
    """PP 2 x DP 2 with 1 and 2 servers, TP 2 x DP 2 with 1, DP 4 with 1 and 2, as one process (float64
    1e-10, clipping on every step): tests/run_mpi.sh's 8-rank pass selects it."""
    if world.size != 8:
        pytest.skip("5 and 6 of 8 ranks")
    ranks, servers, axes = GRID_LAYOUTS[layout]
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    cfg = dict(dict(BASE, batch_size=8, optimizer="adamw"), **axes)
    cfg["microbatches"] = axes.get("microbatches", 1)
    ref = reference(Config(**dict(cfg, pp=1, tp=1), out=os.path.join(shared_dir, f"ref-{layout}-{world.rank}")))
    comm = job(ranks)
    if comm is not None:
        out = os.path.join(shared_dir, layout)
        result = run(Config(**cfg, sync="ps", ps_servers=servers, out=out), world=comm)
        assert result.steps_done == 3 and result.exit_code == 0
        if comm.rank < ranks - servers:
            assert_same_run(Trained(result.model, out), ref, TOL, grad_norm=True, holdings=False)
            if cfg["grad_clip"]:
                assert all(m["grad_norm"] > CLIP for m in metrics(out)), "clipping must act in this test"
        comm.Free()
    world.Barrier()


@pytest.mark.mpi(min_size=8)
def test_pipeline_servers_checkpoint_continues_in_allreduce(shared_dir, monkeypatch):
    """PP 2 x DP 2 + 1 server checkpointed at step 3, continued by an all-reduce PP 2 x DP 2 run
    to step 6, ends where an uninterrupted all-reduce run does (8-rank pass)."""
    if world.size != 8:
        pytest.skip("5 of 8 ranks, then 4")
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    steps = dict(BASE, batch_size=8, steps=6, eval_every=6, microbatches=2, optimizer="adamw", pp=2)
    whole, head, tail = (os.path.join(shared_dir, name) for name in ("whole", "head", "tail"))
    for out, ranks, more in ((whole, 4, {}), (head, 5, dict(sync="ps", ps_servers=1, checkpoint_every=3)),
                             (tail, 4, dict(resume=os.path.join(head, "checkpoints", "ckpt_00000003.json")))):
        comm = job(ranks)
        if comm is not None:
            run(Config(**steps, out=out, **more), world=comm)
            comm.Free()
        world.Barrier()
    assert_continues(tail, whole, 3, 6, TOL, "pp 2 x dp 2 + 1 server, then all-reduce")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first,then", [("ps", "allreduce"), ("allreduce", "ps")])
def test_checkpoints_continue_between_servers_and_allreduce(shared_dir, monkeypatch, first, then):
    """A run checkpointed at step 3 by 2 workers + 1 server (3 ranks), continued to step 6 by an
    all-reduce run on 4 ranks (or the other way round), ends where an uninterrupted all-reduce
    run does: the checkpoint holds the servers' optimizer state whole."""
    needs_4_ranks()
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    steps = dict(BASE, batch_size=8, steps=6, eval_every=6, microbatches=2, optimizer="adamw")
    whole = os.path.join(shared_dir, "whole")
    run(Config(**steps, out=whole), world=world)
    world.Barrier()

    def part(sync, out, **more):
        if sync == "allreduce":
            run(Config(**steps, out=out, **more), world=world)
        else:
            comm = job(3)
            if comm is not None:
                run(Config(**steps, sync="ps", ps_servers=1, out=out, **more), world=comm)
                comm.Free()
        world.Barrier()

    head = os.path.join(shared_dir, f"head-{first}")
    part(first, head, checkpoint_every=3)
    tail = os.path.join(shared_dir, f"tail-{then}")
    part(then, tail, resume=os.path.join(head, "checkpoints", "ckpt_00000003.json"))
    assert_continues(tail, whole, 3, 6, TOL, f"{first} then {then}")


@pytest.mark.mpi(min_size=2)
def test_servers_stop_with_the_workers(shared_dir, monkeypatch):
    """A run the workers end early (a refusal after the split, before any model is built)
    leaves no server waiting: every rank raises the same error."""
    needs_4_ranks()
    cfg = Config(**dict(BASE, steps=3), sync="ps", ps_servers=1, resume=os.path.join(shared_dir, "missing.json"),
                 out=os.path.join(shared_dir, "stops"))
    with pytest.raises(ConfigError):
        run(cfg, world=world)
    world.Barrier()


# ---- refusals (serial: the configuration's checks) --------------------------------------------

@pytest.mark.parametrize("settings,world_size,says", [
    (dict(sync="ps", ps_servers=1), 2, "the workers' layout has 1: launch at least 3 ranks for ps_servers 1"),
    (dict(sync="ps", ps_servers=2), 3, "the workers' layout has 1: launch at least 4 ranks for ps_servers 2"),
    (dict(sync="ps", ps_servers=4), 4, "leaves no rank to compute gradients"),
    (dict(sync="ps", ps_servers=1), 1, "leaves no rank to compute gradients"),
    (dict(sync="ps", ps_servers=1, dp=2), 4, "does not match the 3 workers of this job (4 ranks less ps_servers 1)"),
    (dict(sync="ps", ps_servers=1, zero=1), 4, "shards the optimizer state over its servers already"),
    (dict(sync="ps", ps_servers=1, device="cuda"), 3, "host (numpy) buffers only"),
    (dict(ps_servers=1), 4, "add sync ps"),
])
def test_refusals(settings, world_size, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check(Config(data="synthetic", batch_size=12, **settings), world_size)


def test_workers_make_the_data_axis():
    assert Config(sync="ps", ps_servers=2).data_parallel(6) == 4
    assert Config(sync="ps", ps_servers=0).data_parallel(4) == 4
    assert check(Config(data="synthetic", batch_size=12, sync="ps", ps_servers=1, microbatches=2), 4) == []
    assert check(Config(data="synthetic", batch_size=12, sync="ps", ps_servers=2), 4) == []
