"""--sync ps (the colocated sharded parameter server, engine/parallel/ps.py) never changes the
math: dp = world size trains as one process does (float64 1e-10), with clipping active, and
its checkpoints continue in an all-reduce run and back on the same trajectory; what it does
not do yet, the configuration refuses.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_ps.py`;
the refusals run serially. The parity harness: tests/support/parity.py.
"""
import os
import re

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.parallel import ps as ps_model
from ringpipe.engine.train.config import Config, check
from ringpipe.engine.train.run import run

from tests.support.parity import assert_continues, assert_same_run, metrics, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10
CLIP = 0.05          # below this model's gradient norms: every step is clipped
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=3, dtype="float64",
            sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1, grad_clip=CLIP,
            monitor_every=0, tensorboard=False)
# 4 MiB holds this model in one chunk (owned by rank 0: the others serve nothing); 1000 bytes
# cuts it in ~100 chunks across parameter boundaries, every rank the owner of many.
CHUNKS = {"one-chunk": None, "small-chunks": 1000}


def pair(shared_dir, tag, **settings):
    """(--sync ps on every rank, one process) of the same global batch and micro-batch split."""
    cfg = dict(BASE, **settings)
    ref = reference(Config(**cfg, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    par = train(Config(**cfg, sync="ps", out=os.path.join(shared_dir, tag)), world)
    world.Barrier()
    return par, ref


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunks", list(CHUNKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("micro", [dict(), dict(microbatches=2), dict(microbatches=2, no_overlap=True)],
                         ids=["m1", "m2", "m2-no-overlap"])
def test_ps_equals_one_process(shared_dir, monkeypatch, chunks, optimizer, micro):
    if 8 % world.size:
        pytest.skip("global batch 8 must divide among the ranks")
    if CHUNKS[chunks] is not None:
        monkeypatch.setattr(ps_model, "CHUNK_BYTES", CHUNKS[chunks])
    par, ref = pair(shared_dir, f"{chunks}-{optimizer}-{len(micro)}", optimizer=optimizer, **micro)
    assert isinstance(par.model, ps_model.ParameterServerData)
    # Losses, validation, grad norms, this rank's summed chunks, every weight, and the whole
    # checkpoint (the optimizer state gathered from its owners).
    assert_same_run(par, ref, TOL, grad_norm=True)
    assert all(m["grad_norm"] > CLIP for m in metrics(par.out)), "clipping must act in this test"
    if CHUNKS[chunks] is not None:
        assert par.model.layout.n_chunks >= 4 * world.size and par.model.owned


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first,then", [("ps", "allreduce"), ("allreduce", "ps")])
def test_checkpoints_continue_between_ps_and_allreduce(shared_dir, monkeypatch, first, then):
    """A run checkpointed at step 3 by one sync, continued to step 6 by the other, ends where
    an uninterrupted all-reduce run does."""
    if 8 % world.size:
        pytest.skip("global batch 8 must divide among the ranks")
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    steps = dict(BASE, steps=6, eval_every=6, microbatches=2)
    whole = os.path.join(shared_dir, "whole")
    run(Config(**steps, out=whole), world=world)
    world.Barrier()
    head = os.path.join(shared_dir, f"head-{first}")
    run(Config(**steps, sync=first, checkpoint_every=3, out=head), world=world)
    world.Barrier()
    tail = os.path.join(shared_dir, f"tail-{then}")
    run(Config(**steps, sync=then, resume=os.path.join(head, "checkpoints", "ckpt_00000003.json"), out=tail),
        world=world)
    world.Barrier()
    assert_continues(tail, whole, 3, 6, TOL, f"{first} then {then}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunks", list(CHUNKS))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_ps_float32_bits_equal_canonical_allreduce(shared_dir, monkeypatch, chunks, optimizer):
    """The PS sums in recursive doubling's tree and its norm is chunk-ordered; --reduce-order
    canonical all-reduces in that tree and (without a tensor axis) takes the norm over the same
    chunks: float32 weights, losses and clipped norms equal to the bit."""
    if world.size & (world.size - 1) or 8 % world.size:
        pytest.skip("a power of two of ranks dividing the global batch of 8")
    if CHUNKS[chunks] is not None:
        monkeypatch.setattr(ps_model, "CHUNK_BYTES", CHUNKS[chunks])
    cfg = dict(BASE, dtype="float32", steps=6, eval_every=6, microbatches=2, reduce_order="canonical",
               optimizer=optimizer)
    ring = train(Config(**cfg, out=os.path.join(shared_dir, f"canonical-{chunks}-{optimizer}")), world)
    server = train(Config(**cfg, sync="ps", out=os.path.join(shared_dir, f"ps32-{chunks}-{optimizer}")), world)
    world.Barrier()
    assert np.array_equal(np.asarray(server.model.params.data), np.asarray(ring.model.params.data))
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in metrics(server.out)] == [m[key] for m in metrics(ring.out)], key
    assert all(m["grad_norm"] > CLIP for m in metrics(server.out)), "clipping must act in this test"


# ---- refusals (serial: the configuration's checks) --------------------------------------------

@pytest.mark.parametrize("settings,world_size,says", [
    (dict(sync="ps"), 1, "needs dp >= 2"),
    (dict(sync="ps", dp=1, tp=2), 2, "needs dp >= 2"),
    (dict(sync="ps", ps_servers=4), 4, "leaves no rank to compute gradients"),
    (dict(sync="ps", ps_servers=-1), 4, "ps_servers must be >= 0, got -1 (dedicated server ranks"),
    (dict(sync="ps", zero=1), 2, "shards the optimizer state over its servers already"),
    (dict(sync="ps", device="cuda"), 2, "host (numpy) buffers only"),
    (dict(ps_servers=1), 4, "add sync ps"),
    (dict(sync="gossip"), 2, "allreduce or ps"),
])
def test_refusals(settings, world_size, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check(Config(data="synthetic", batch_size=8, **settings), world_size)


def test_accepted_and_noted():
    assert check(Config(data="synthetic", batch_size=8, sync="ps"), 2) == []
    assert check(Config(data="synthetic", batch_size=8, sync="ps", ps_servers=0, microbatches=2,
                        reduce_order="canonical"), 4) == []
    notes = check(Config(data="synthetic", batch_size=8, sync="ps", bucket_mb=1), 2)
    assert any("has no effect with <sync> ps" in n for n in notes)
