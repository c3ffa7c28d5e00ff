"""--ps-mode ssp:S and async (engine/parallel/ps_modes.py): the parameter server's modes
that change the math, on dedicated servers.

- ssp:0 is sync, bit for bit;
- ssp:S is deterministic: the same bits with 1 or 2 servers, another trajectory than
  sync's, and a resume from its checkpoint ends bit-identical to the uninterrupted run;
- async trains (finite losses that fall), labels itself, and its checkpoint continues in
  a sync run;
- both are labelled in metrics.jsonl's records and monitor.json's header;
- bad modes are refused before work (serial).

Run with `mpiexec -n 4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_ps_modes.py` (tests/run_mpi.sh's 4-rank pass): 2 workers + 1 server
on the first 3 ranks (the fourth waits), 2 + 2 on all 4.
"""
import json
import os
import re

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.parallel import ps as ps_model
from ringpipe.engine.parallel.ps_modes import AsynchronousPS, BoundedStalenessPS
from ringpipe.engine.train.config import Config, check
from ringpipe.engine.train.run import run

from tests.support.parity import assert_continues, final_arrays, job, losses, metrics

world = MPI.COMM_WORLD
# A clip above this model's early norms and below its later ones would make the modes'
# norms matter; 0.05 clips every step (the servers' clipping acts in every mode).
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=6, dtype="float64",
            sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1, grad_clip=0.05,
            monitor_every=0, tensorboard=False, optimizer="adamw", microbatches=2)


def needs_4_ranks():
    if world.size != 4:
        pytest.skip("2 workers + 1 or 2 servers: 3 and 4 ranks")


def train(out, ranks, servers, **settings):
    """A PS run on the first `ranks` ranks; every rank of the world waits for it."""
    comm = job(ranks)
    result = None
    if comm is not None:
        result = run(Config(**dict(BASE, **settings), sync="ps", ps_servers=servers, out=out), world=comm)
        assert result.exit_code == 0
        comm.Free()
    world.Barrier()
    return result


def same_bits(a, b, what):
    assert losses(a) == losses(b), what
    got, want = final_arrays(a), final_arrays(b)
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(got[k], want[k]), f"{what}: {k}"


@pytest.mark.mpi(min_size=2)
def test_ssp0_is_sync(shared_dir, monkeypatch):
    needs_4_ranks()
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    sync, ssp0 = os.path.join(shared_dir, "sync"), os.path.join(shared_dir, "ssp0")
    train(sync, 3, 1)
    train(ssp0, 3, 1, ps_mode="ssp:0")
    same_bits(ssp0, sync, "ssp:0 against sync")
    assert "ps_mode" not in metrics(ssp0)[-1]


@pytest.mark.mpi(min_size=2)
def test_ssp_is_deterministic_and_not_sync(shared_dir, monkeypatch):
    """ssp:2's trajectory is the bound's, whatever the servers' count (1 or 2) and timing."""
    needs_4_ranks()
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    one, two, sync = (os.path.join(shared_dir, name) for name in ("k1", "k2", "sync"))
    result = train(one, 3, 1, ps_mode="ssp:2")
    if world.rank < 2:
        assert isinstance(result.model, BoundedStalenessPS)
    train(two, 4, 2, ps_mode="ssp:2")
    train(sync, 3, 1)
    same_bits(one, two, "ssp:2 with 1 and 2 servers")
    # Step 0 computes on the first parameters in both; steps 1 and 2 still do under ssp:2.
    assert losses(one)[0] == losses(sync)[0] and losses(one)[1] != losses(sync)[1]
    assert len(set(losses(one)[:3])) == 3            # (other batches, the same parameters)
    records = metrics(one)
    assert all(m["ps_mode"] == "ssp:2" and np.isfinite(m["loss"]) for m in records)
    with open(os.path.join(one, "monitor.json")) as fh:
        header = json.load(fh)
    assert header.get("exact") is False or header.get("header", {}).get("exact") is False


@pytest.mark.mpi(min_size=2)
def test_ssp_resume_is_bit_identical(shared_dir, monkeypatch):
    needs_4_ranks()
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    whole, tail = os.path.join(shared_dir, "whole"), os.path.join(shared_dir, "tail")
    settings = dict(ps_mode="ssp:2", steps=8, eval_every=8, checkpoint_every=4)
    train(whole, 3, 1, **settings)
    train(tail, 3, 1, **dict(settings, resume=os.path.join(whole, "checkpoints", "ckpt_00000004.json")))
    assert_continues(tail, whole, 4, 8, 0.0, "ssp:2 resumed at step 4")


@pytest.mark.mpi(min_size=2)
def test_async_trains_and_continues_in_sync(shared_dir, monkeypatch):
    needs_4_ranks()
    monkeypatch.setattr(ps_model, "CHUNK_BYTES", 1000)
    first, then = os.path.join(shared_dir, "async"), os.path.join(shared_dir, "then-sync")
    result = train(first, 3, 1, ps_mode="async", steps=8, eval_every=4, grad_clip=1.0)
    if world.rank < 2:
        assert isinstance(result.model, AsynchronousPS)
    records = metrics(first)
    assert all(m["ps_mode"] == "async" and np.isfinite(m["loss"]) for m in records)
    assert records[-1]["loss"] < records[0]["loss"]
    train(then, 3, 1, steps=10, eval_every=10,
          resume=os.path.join(first, "checkpoints", "ckpt_00000008.json"))
    after = metrics(then)
    assert [m["step"] for m in after] == [9, 10] and "ps_mode" not in after[-1]
    assert all(np.isfinite(m["loss"]) for m in after)


# ---- refusals (serial: the configuration's checks) --------------------------------------------

@pytest.mark.parametrize("settings,says", [
    (dict(sync="ps", ps_servers=1, ps_mode="ssp"), "ssp needs its bound: ssp:S"),
    (dict(sync="ps", ps_servers=1, ps_mode="ssp:two"), "takes a whole number of updates >= 0 as S, got 'two'"),
    (dict(sync="ps", ps_servers=1, ps_mode="ssp:-1"), "got '-1'"),
    (dict(sync="ps", ps_servers=1, ps_mode="hogwild"), "is sync, ssp:S (bounded staleness) or async, got 'hogwild'"),
    (dict(sync="ps", ps_mode="ssp:2"), "needs dedicated servers (ps_servers 1 or more)"),
    (dict(sync="ps", ps_mode="async"), "needs dedicated servers"),
    (dict(ps_mode="async"), "add sync ps ps_servers K"),
    (dict(sync="ps", ps_servers=1, ps_mode="async", reduce_order="canonical"), "changes the math"),
])
def test_refusals(settings, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        check(Config(data="synthetic", batch_size=12, **settings), 4)


def test_validation_as_often_as_the_bound_is_noted():
    """Every validation drains ssp's pulls: as often as the bound, the bound is never reached."""
    notes = check(Config(data="synthetic", batch_size=12, steps=6, sync="ps", ps_servers=1, ps_mode="ssp:2"), 4)
    assert any("at most 0 update(s) behind" in n and "sync's math" in n for n in notes)
    assert check(Config(data="synthetic", batch_size=12, steps=30, sync="ps", ps_servers=1, ps_mode="ssp:2"), 4) == []


def test_labels():
    assert Config(sync="ps", ps_servers=1, ps_mode="ssp:3").inexact_mode == "ssp:3"
    assert Config(sync="ps", ps_servers=1, ps_mode="async").inexact_mode == "async"
    assert Config(sync="ps", ps_servers=1, ps_mode="ssp:0").inexact_mode is None
    assert Config().inexact_mode is None
    assert check(Config(data="synthetic", batch_size=12, sync="ps", ps_servers=1, ps_mode="ssp:0"), 4) == []
