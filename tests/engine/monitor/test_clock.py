"""engine/monitor/clock.py StepClock (a rank's step time split from its timed spans) and
engine/monitor/ranks.py Stragglers (which rank stands out against its peers), on made-up
spans and rows: no MPI, no training."""
import threading

import pytest

from ringpipe.engine.monitor.clock import StepClock, span
from ringpipe.engine.monitor.ranks import Stragglers

MiB = 1 << 20


# ---- StepClock -----------------------------------------------------------------------------

def test_each_category_goes_to_its_part_and_other_is_the_rest():
    clock = StepClock()
    clock.begin_step()
    clock.append(("next batch", "data", 0.0, 0.01))
    clock.append(("F+B 0", "compute", 0.01, 0.51))
    clock.append(("wait F0", "recv", 0.51, 0.61))
    clock.append(("send B0", "send", 0.61, 0.63))
    clock.append(("all-reduce wait", "allreduce", 0.63, 0.73))
    clock.append(("loss all-reduce", "comm", 0.73, 0.74))
    clock.append(("a marker", "instant", 0.74, 0.75))        # no part of the split: ignored
    split = clock.end_step(0.80)
    assert split == pytest.approx({"compute": 0.50, "comm": 0.13, "bubble": 0.10, "data": 0.01, "other": 0.06})
    assert sum(split.values()) == pytest.approx(0.80)


def test_a_collective_inside_a_compute_span_is_taken_out_of_it():
    """A tensor-parallel all-reduce inside a layer's forward: appended before the layer's
    span ends, it counts as communication and the layer's compute is what is left."""
    clock = StepClock()
    clock.begin_step()
    clock.append(("tp all-reduce", "comm", 0.20, 0.30))      # inside the layer's span below
    clock.append(("block 0", "compute", 0.10, 0.50))
    clock.append(("wait", "allreduce", 0.55, 0.60))          # after it: not inside, nothing subtracted
    clock.append(("update", "compute", 0.60, 0.70))
    split = clock.end_step(0.70)
    assert split["compute"] == pytest.approx(0.30 + 0.10)
    assert split["comm"] == pytest.approx(0.10 + 0.05)
    assert split["other"] == pytest.approx(0.70 - 0.55)


def test_spans_of_another_thread_are_ignored():
    """A collective on a communication thread overlaps compute: only the main thread's wait costs the step."""
    trace = []
    clock = StepClock(trace=trace)
    clock.begin_step()
    worker = threading.Thread(target=clock.append, args=(("bucket all-reduce", "allreduce", 0.0, 0.4),))
    worker.start()
    worker.join()
    clock.append(("F+B 0", "compute", 0.0, 0.5))
    split = clock.end_step(0.5)
    assert split["comm"] == 0.0 and split["compute"] == pytest.approx(0.5) and split["other"] == pytest.approx(0.0)
    assert [e[0] for e in trace] == ["F+B 0"]


def test_other_is_the_step_less_the_parts_and_never_negative():
    clock = StepClock()
    clock.begin_step()
    clock.append(("F+B 0", "compute", 0.0, 0.3))
    clock.append(("next batch", "data", 0.3, 0.4))
    assert clock.end_step(1.0)["other"] == pytest.approx(0.6)
    assert clock.end_step(0.35)["other"] == 0.0             # spans longer than the step measured: clamped
    clock.begin_step()                                       # a new step starts from nothing
    assert clock.end_step(0.2) == {"compute": 0.0, "comm": 0.0, "bubble": 0.0, "data": 0.0, "other": 0.2}


def test_the_trace_receives_every_event_of_the_main_thread():
    trace = []
    clock = StepClock(trace=trace)
    clock.begin_step()
    events = [("next batch", "data", 0.0, 0.1), ("F+B 0", "compute", 0.1, 0.2), ("a marker", "instant", 0.2, 0.2)]
    for event in events:
        clock.append(event)
    with span(clock, "update", "compute"):
        pass
    assert trace[:3] == events and trace[3][:2] == ("update", "compute") and trace[3][3] >= trace[3][2]
    assert StepClock().trace is None                         # no --trace: nothing kept


# ---- Stragglers ----------------------------------------------------------------------------

def rows(compute=(10.0, 10.0, 10.0, 10.0), data=None, rss=None, step_ms=100.0):
    """One interval's per-rank rows as RankMonitor gathers them."""
    n = len(compute)
    data = data or [1.0] * n
    rss = rss or [1000 * MiB] * n
    return [{"rank": r, "node": f"n{r // 2}", "step_ms": step_ms, "compute_ms": compute[r], "data_ms": data[r],
             "rss_bytes": rss[r]} for r in range(n)]


def test_a_rank_at_twice_the_compute_is_named_at_the_third_interval_exactly():
    watch = Stragglers(ratio=1.5, intervals=3, peers=[[0, 1, 2, 3]])
    slow = rows(compute=(10.0, 10.0, 10.0, 20.0))
    assert watch.update(slow) == ([], [], [])
    assert watch.update(slow) == ([], [], [])
    named, new, gone = watch.update(slow)
    expected = {"rank": 3, "node": "n1", "what": "compute", "ratio": 2.0, "intervals": 3}
    assert named == new == [expected] and gone == []
    named, new, gone = watch.update(slow)                    # still slow: named, but not new
    assert named == [dict(expected, intervals=4)] and new == [] and gone == []
    named, new, gone = watch.update(rows())                  # back in line: no longer named
    assert named == [] and new == [] and gone == [(3, "compute")]


def test_a_streak_broken_by_one_interval_starts_over():
    watch = Stragglers(ratio=1.5, intervals=3, peers=[[0, 1, 2, 3]])
    slow = rows(compute=(10.0, 10.0, 10.0, 20.0))
    for interval in (slow, slow, rows(), slow, slow):
        assert watch.update(interval)[0] == []
    assert [e["rank"] for e in watch.update(slow)[1]] == [3]


def test_a_data_wait_at_twice_the_others_but_under_5_percent_of_the_step_is_not_named():
    watch = Stragglers(ratio=1.5, intervals=1, peers=[[0, 1, 2, 3]])
    assert watch.update(rows(data=[2.0, 2.0, 2.0, 4.0], step_ms=100.0))[0] == []      # 4% of the step
    named = watch.update(rows(data=[4.0, 4.0, 4.0, 8.0], step_ms=100.0))[0]          # 8%: named
    assert [(e["rank"], e["what"], e["ratio"]) for e in named] == [(3, "data", 2.0)]


def test_memory_at_1_6x_but_only_200_mib_more_is_not_named():
    watch = Stragglers(ratio=1.5, intervals=1, peers=[[0, 1, 2, 3]])
    assert watch.update(rows(rss=[333 * MiB] * 3 + [533 * MiB]))[0] == []
    named = watch.update(rows(rss=[2000 * MiB] * 3 + [3200 * MiB]))[0]               # 1.6x and 1.2 GiB more
    assert [(e["rank"], e["what"], e["ratio"]) for e in named] == [(3, "memory", 1.6)]


def test_with_two_peers_the_median_is_the_other_one():
    watch = Stragglers(ratio=1.5, intervals=1, peers=[[0, 1]])
    named = watch.update(rows(compute=(10.0, 16.0)))[0]
    assert [(e["rank"], e["ratio"]) for e in named] == [(1, 1.6)]
    assert watch.update(rows(compute=(10.0, 14.0)))[0] == []                        # 1.4x: within the ratio


def test_pipeline_stages_are_peer_groups():
    """Stage 1 (the head) has twice stage 0's work: nobody is named while each stage's
    ranks agree; a rank slow against its own stage is."""
    watch = Stragglers(ratio=1.5, intervals=1, peers=[[0, 1], [2, 3]])
    assert watch.update(rows(compute=(10.0, 10.0, 20.0, 20.0)))[0] == []
    named = watch.update(rows(compute=(10.0, 10.0, 20.0, 40.0)))[0]
    assert [(e["rank"], e["what"], e["ratio"]) for e in named] == [(3, "compute", 2.0)]
    # A stage of one rank has no peers to be compared with.
    alone = Stragglers(ratio=1.5, intervals=1, peers=[[0], [1]])
    assert alone.update(rows(compute=(10.0, 40.0)))[0] == []
