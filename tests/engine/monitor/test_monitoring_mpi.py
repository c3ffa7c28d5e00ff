"""Per-rank monitoring under MPI (engine/monitor/ranks.py, clock.py, through the trainer):
every rank's numbers reach metrics.jsonl and are plausible under DP, PP and TP, and a rank
slowed on purpose is named the straggler.

Run by tests/run_mpi.sh under 2 and 4 ranks (`mpiexec -n 2|4 python tests/support/mpi_pytest.py
-m mpi --with-mpi tests/engine/monitor/test_monitoring_mpi.py`); each layout is sized to the
world: dp = world, pp 2 x dp world/2, tp 2 x dp world/2.
"""
import json
import os
import socket
import statistics

import pytest
from mpi4py import MPI

from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

world = MPI.COMM_WORLD
SPLIT = ("compute", "comm", "bubble", "data", "other")
# The tiny GPT: a few seconds a run at 4 ranks on 2 cores.
TINY = dict(data="synthetic", layers=2, d_model=32, heads=2, context=32, seq_len=32, batch_size=8,
            sample_tokens=0, quiet=True, overwrite=True, tensorboard=False)
LAYOUTS = {"dp": lambda n: dict(dp=n),
           "pp": lambda n: dict(pp=2, dp=n // 2, microbatches=2),
           "tp": lambda n: dict(tp=2, dp=n // 2)}


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def nodes_by_rank():
    return world.allgather(socket.gethostname())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_rank_reports_a_plausible_time_split(shared_dir, layout):
    """Steps 4, 8, 12 (monitor_every 4) hold one entry per rank whose time split adds up to
    its step time by definition, and whose spans cover the step: what no span timed
    ("other") stays under 5% of it, the issue's "adds up within 5%"."""
    if world.size % 2:
        pytest.skip("the layouts need an even world")
    out = os.path.join(shared_dir, layout)
    extra = LAYOUTS[layout](world.size)
    run(Config(**TINY, **extra, steps=12, monitor_every=4, out=out), world=world)
    nodes = nodes_by_rank()
    world.Barrier()
    if world.rank != 0:
        return
    all_records = records(out)
    by_step = {r["step"]: r for r in all_records}
    assert [r["step"] for r in all_records if "ranks" in r] == [4, 8, 12]
    dp = extra["dp"]
    items_per_step = TINY["batch_size"] * TINY["seq_len"]
    for step in (4, 8, 12):
        record = by_step[step]
        rows = record["ranks"]
        assert record["interval_steps"] == 4
        assert [row["rank"] for row in rows] == list(range(world.size))
        assert [row["node"] for row in rows] == nodes
        for row in rows:
            where = f"{layout} step {step} rank {row['rank']}: {row}"
            parts = sum(row[f"{part}_ms"] for part in SPLIT)
            assert parts == pytest.approx(row["step_ms"], rel=1e-6), where
            assert all(row[f"{part}_ms"] >= 0 for part in SPLIT), where
            # One interval of a tiny model's steps (~15 ms) can lose a millisecond to the scheduler
            # between two spans on a loaded machine; the 5% is judged over the run below.
            assert row["other_ms"] <= 0.2 * row["step_ms"], f"untimed share over 20%: {where}"
            assert row["rss_bytes"] > 0 and row["peak_bytes"] >= 0.9 * row["rss_bytes"], where
            assert row["cpu_percent"] > 0, where
            expected = items_per_step / dp / (row["step_ms"] / 1e3)
            assert row["items_per_s"] == pytest.approx(expected, rel=0.1), where
        # Each rank's mean over the interval against the interval's global step times (rank 0's clock).
        global_mean = statistics.mean(by_step[s]["step_ms"] for s in range(step - 3, step + 1))
        # (Ranks enter a step at different moments: rank 0 writes the records between steps.) The
        # time from a step's last collective to its end (the update) is each rank's own: with more
        # ranks than cores (4 on the 2-core CI machine) a rank taken off its core there for a
        # scheduler slice or two (3 ms each) lengthens its own step only. These steps take 3-6 ms,
        # so that is allowed for as time (12 ms over the interval's 4 steps), not as a ratio: a
        # unit or interval mistake (x1000, x4) still fails.
        oversubscribed = world.size > len(os.sched_getaffinity(0))
        close = 0.4 if oversubscribed else 0.2
        slack_ms = 12.0 / 4 if oversubscribed else 0.0
        for row in rows:
            assert row["step_ms"] == pytest.approx(global_mean, rel=close, abs=slack_ms), (layout, step, row["rank"])
    sections = [row for step in (4, 8, 12) for row in by_step[step]["ranks"]]
    # The "the time split adds up to the step time within 5%": what no span timed,
    # over every rank and interval of the run. With more ranks than cores (4 on the 2-core CI
    # machine) each rank is off its core half the time, and the scheduler's cuts between two
    # spans of a tiny model's ~15 ms step add up to a few percent more: 10% there.
    untimed = sum(row["other_ms"] for row in sections) / sum(row["step_ms"] for row in sections)
    bound = 0.05 if world.size <= len(os.sched_getaffinity(0)) else 0.10
    assert untimed <= bound, f"{layout}: {untimed:.1%} of the step time is in no timed span (bound {bound:.0%})"
    if layout == "pp":
        assert any(row["bubble_ms"] > 0 for row in sections), "no pipeline bubble on any rank"
    if layout == "tp":
        assert all(row["comm_ms"] > 0 for row in sections), "a tensor-parallel rank with no communication"


@pytest.mark.mpi(min_size=2)
def test_a_slowed_rank_is_named_the_straggler(shared_dir, monkeypatch, capsys):
    """The last rank sleeps 50 ms inside each micro-batch's forward+backward (inside its
    compute span): it is named for compute, nobody else is, and the others' wait for it
    shows as communication, not compute."""
    from ringpipe.engine.model.chain import LayerChain
    slow = world.size - 1
    if world.rank == slow:
        import time
        original = LayerChain.loss_and_grad

        def slowed(self, *args, **kwargs):
            time.sleep(0.05)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(LayerChain, "loss_and_grad", slowed)
    out = os.path.join(shared_dir, "straggler")
    run(Config(**dict(TINY, quiet=False), dp=world.size, steps=20, monitor_every=2, straggler_intervals=3, out=out),
        world=world)
    world.Barrier()
    if world.rank != 0:
        return
    printed = capsys.readouterr().out
    last = records(out)[-1]
    assert last["step"] == 20
    compute_named = [s for s in last["stragglers"] if s["what"] == "compute"]
    assert [s["rank"] for s in compute_named] == [slow], last["stragglers"]
    (named,) = compute_named
    assert named["ratio"] >= 1.5 and named["node"] == socket.gethostname()
    assert f"straggler: rank {slow} on node {named['node']}" in printed
    rows = last["ranks"]
    for row in rows:
        if row["rank"] != slow:
            # The others waited for the slow rank in the gradient all-reduce: communication.
            assert row["compute_ms"] < 0.5 * rows[slow]["compute_ms"], rows
            assert row["comm_ms"] > 0.5 * (rows[slow]["compute_ms"] - row["compute_ms"]), rows
