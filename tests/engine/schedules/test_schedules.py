"""Pipeline schedules: generators, validator, simulator, text format, CLI."""

import sys

import pytest

from ringpipe.engine.schedules import (
    B, F, I, RECV_F, SEND_F, W, Action, ScheduleError, ascii_timeline, bubble_formula, forward_only, gpipe,
    interleaved_1f1b, make_schedule, one_f_one_b, parse_actions, parse_schedule, plot_timeline, simulate,
    theoretical_bubble, validate, zero_bubble_h1,
)
from ringpipe.engine.schedules.__main__ import main

PS = (1, 2, 3, 4, 5, 8)


def micro_batch_counts(p):
    return sorted({m for m in (1, 2, 3, p - 1, p, p + 1, 2 * p + 1, 4 * p, 8 * p) if m >= 1})


GRID = [(p, m) for p in PS for m in micro_batch_counts(p)]
ONE_CHUNK = {"gpipe": gpipe, "1f1b": one_f_one_b, "zbh1": zero_bubble_h1}


def close(a, b):
    return a == pytest.approx(b, abs=1e-12)


# ---------------------------------------------------------------------------
# Every generator on the grid: valid, deadlock-free, complete.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ONE_CHUNK))
@pytest.mark.parametrize("p", PS)
def test_single_chunk_generators_are_valid(name, p):
    for m in micro_batch_counts(p):
        schedule = ONE_CHUNK[name](p, m)
        assert (schedule.p, schedule.m, schedule.v) == (p, m, 1)
        validate(schedule)
        result = simulate(schedule)
        assert result.deadlock is None
        computes = [a for r in range(p) for a in schedule.compute_order(r)]
        assert len(computes) == p * m * (3 if name == "zbh1" else 2)


@pytest.mark.parametrize("ragged", ["pad", "merge"])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("p", PS)
def test_interleaved_is_valid_for_any_m(p, v, ragged):
    for m in micro_batch_counts(p):
        schedule = interleaved_1f1b(p, m, v, ragged=ragged)
        validate(schedule)
        assert simulate(schedule).deadlock is None
        for rank in range(p):
            assert len(schedule.compute_order(rank)) == 2 * m * v


def test_every_rank_ends_with_reduce_grad():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("zbh1", 1)):
        for actions in make_schedule(name, 4, 6, v).ranks:
            assert actions[-1].kind == "REDUCE_GRAD" and all(a.kind != "REDUCE_GRAD" for a in actions[:-1])


def test_single_rank_passes_data_locally():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 3), ("zbh1", 1)):
        schedule = make_schedule(name, 1, 5, v)
        assert not any(a.is_send or a.is_recv for a in schedule.ranks[0])
        validate(schedule)


def test_receives_are_posted_ahead_of_their_compute():
    schedule = one_f_one_b(4, 8)
    # Rank 1 posts its first two receives per direction before any compute.
    assert str(schedule).splitlines()[1].startswith("rank 1: RF0 RF1 RB0 RB1 F0 SF0 RF2 F1")
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if action.is_send:
                producer = actions[index - 1]
                assert producer.is_compute and (producer.mb, producer.chunk) == (action.mb, action.chunk)


def test_interleaved_with_one_chunk_is_1f1b():
    for p, m in GRID:
        assert interleaved_1f1b(p, m, 1).ranks == one_f_one_b(p, m).ranks


def test_bad_sizes_and_names_are_rejected_clearly():
    for call in (lambda: gpipe(0, 4), lambda: one_f_one_b(4, 0), lambda: interleaved_1f1b(4, 8, 0),
                 lambda: zero_bubble_h1(2.5, 4), lambda: make_schedule("1f1b", 4, -1)):
        with pytest.raises(ScheduleError, match="must be an integer >= 1"):
            call()
    with pytest.raises(ScheduleError, match="valid names: gpipe, 1f1b, interleaved, zbh1"):
        make_schedule("chimera", 4, 8)
    with pytest.raises(ScheduleError, match="Use 'interleaved' for v > 1"):
        make_schedule("1f1b", 4, 8, v=2)
    with pytest.raises(ScheduleError, match="ragged must be one of"):
        interleaved_1f1b(4, 6, 2, ragged="squeeze")


def test_make_schedule_names():
    assert make_schedule("1F1B", 2, 2).name == "1f1b"
    assert make_schedule("zb-h1", 2, 2).name == "zbh1"
    assert make_schedule("interleaved", 2, 4, 2).v == 2


# ---------------------------------------------------------------------------
# Bubbles.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact(name):
    for p, m in GRID:
        expected = (p - 1) / (m + p - 1)
        assert close(theoretical_bubble(name, p, m), expected)
        for costs in (None, {"F": 1, "B": 1}, {"F": 2, "B": 3}):
            result = simulate(make_schedule(name, p, m), costs)
            assert all(close(b, expected) for b in result.bubble), (p, m, costs)
        assert simulate(make_schedule(name, p, m)).makespan == 3 * (m + p - 1)


def test_interleaved_bubble_matches_theory_and_beats_1f1b():
    for p, m in GRID:
        one_f_one_b_bubble = simulate(one_f_one_b(p, m)).mean_bubble
        for v in (2, 3):
            expected, _, exact = bubble_formula("interleaved", p, m, v)
            padded = simulate(interleaved_1f1b(p, m, v)).mean_bubble
            merged = simulate(interleaved_1f1b(p, m, v, ragged="merge")).mean_bubble
            assert close(merged, expected), (p, m, v)
            if exact:
                assert close(padded, expected), (p, m, v)
            else:
                assert m > p and m % p and padded > expected
            if m >= p and p > 1:
                assert padded < one_f_one_b_bubble and merged < one_f_one_b_bubble, (p, m, v)
    assert close(theoretical_bubble("interleaved", 4, 8, 2), 3 / 19)


def test_zbh1_bubble_matches_theory_and_beats_1f1b():
    for p, m in GRID:
        result = simulate(zero_bubble_h1(p, m))  # default costs: F=I=W=1, B=2
        expected = ((p - 1) + max(0, p - m)) / (3 * m + (p - 1) + max(0, p - m))
        assert close(result.mean_bubble, expected) and close(theoretical_bubble("zbh1", p, m), expected)
        if m >= p:
            assert close(expected, (p - 1) / (3 * m + p - 1))
        if p > 1:  # same work per micro-batch as 1F1B (B = I + W), less idle
            assert result.mean_bubble < simulate(one_f_one_b(p, m)).mean_bubble


# ---------------------------------------------------------------------------
# Memory: micro-batches in flight.
# ---------------------------------------------------------------------------

def test_in_flight_bounds():
    for p, m in GRID:
        flush, ofob, zb = gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)
        for stage in range(p):
            assert flush.micro_batches_in_flight(stage) == m
            assert ofob.micro_batches_in_flight(stage) == min(p - stage, m)
            assert zb.micro_batches_in_flight(stage) == min(p - stage, m)
            # Counting activations until W: every rank stays within 1F1B's peak.
            assert zb.micro_batches_in_flight(stage, until_weight_grad=True) <= min(p, m)
        assert simulate(ofob).peak_in_flight == [min(p - s, m) for s in range(p)]
        for v in (2, 3):
            schedule = interleaved_1f1b(p, m, v)
            for rank in range(p):
                megatron_bound = 2 * (p - rank - 1) + (v - 1) * p + 1
                assert schedule.micro_batches_in_flight(rank) <= min(megatron_bound, m * v)


def test_in_flight_counts_each_chunk_separately():
    schedule = parse_schedule("F0.0 F0.1 B0.1 B0.0 RG", v=2)
    assert schedule.micro_batches_in_flight(0) == 2


# ---------------------------------------------------------------------------
# Validator: hand-written broken schedules.
# ---------------------------------------------------------------------------

GOOD_P2_M2 = """
rank 0: RB0 RB1 F0 SF0 F1 SF1 B0 B1 RG
rank 1: RF0 RF1 F0 B0 SB0 F1 B1 SB1 RG
"""


def broken(text):
    with pytest.raises(ScheduleError) as caught:
        validate(parse_schedule(text))
    return caught.value


def test_hand_written_schedule_is_valid():
    validate(parse_schedule(GOOD_P2_M2))


def test_missing_recv_is_caught():
    error = broken(GOOD_P2_M2.replace("RF1 F0", "F0"))
    assert (error.rule, error.rank, error.action) == ("recv-before-compute", 1, Action(F, 1))
    assert "needs the activation from rank 0 but no RF1 is posted before it" in str(error)
    assert str(error).startswith("rank 1, action #")


def test_recv_posted_too_late_is_caught():
    error = broken(GOOD_P2_M2.replace("rank 1: RF0 RF1 F0 B0 SB0 F1", "rank 1: RF0 F0 B0 SB0 F1 RF1"))
    assert error.rule == "recv-before-compute" and "only posted later" in str(error)


def test_backward_before_forward_is_caught():
    error = broken(GOOD_P2_M2.replace("F0 B0 SB0", "B0 SB0 F0"))
    assert (error.rule, error.rank, error.action) == ("order", 1, Action(B, 0))
    assert "backward runs before F0" in str(error)


def test_cyclic_wait_is_reported_as_deadlock():
    # Rank 1 insists on micro-batch 1 first, which rank 0 only forwards after
    # B0, which needs rank 1's gradient of micro-batch 0.
    error = broken("""
        rank 0: RB0 F0 SF0 B0 RB1 F1 SF1 B1 RG
        rank 1: RF1 F1 B1 SB1 RF0 F0 B0 SB0 RG
    """)
    assert error.rule == "deadlock" and set(error.stuck) == {0, 1}
    text = str(error)
    assert text.startswith("[deadlock] rank 0 is stuck")
    assert "rank 0 is stuck at #3 B0: waits for the output gradient of mb 0 chunk 0 from rank 1" in text
    assert "rank 1 is stuck at #1 F1: waits for the activation of mb 1 chunk 0 from rank 0" in text


def test_other_rules():
    cases = {
        "send-recv-match": GOOD_P2_M2.replace(" SB1 RG", " RG"),          # RB1 never matched
        "send-after-compute": GOOD_P2_M2.replace("F0 SF0", "SF0 F0"),
        "compute-count": GOOD_P2_M2.replace("B1 RG\nrank 1", "RG\nrank 1"),
        "reduce-grad": GOOD_P2_M2.replace("B0 B1 RG", "B0 RG B1"),
        "no-peer": GOOD_P2_M2.replace("RB0 RB1 F0", "RF0 RB0 RB1 F0"),
    }
    for rule, text in cases.items():
        assert broken(text).rule == rule, rule


def test_split_backward_rules():
    validate(parse_schedule("F0 I0 W0 RG"))
    assert broken("F0 W0 I0 RG").rule == "order"
    assert broken("F0 I0 RG").rule == "compute-count"
    assert broken("F0 B0 W0 RG").rule == "compute-count"


def test_single_rank_rules():
    assert broken("F0 SF0 B0 RG").rule == "local-stages"
    assert broken("F0.1 F0.0 B0.1 B0.0 RG").rule == "local-dependency"
    assert broken("F0.0 F0.1 B0.0 B0.1 RG").rule == "local-dependency"


def test_simulate_reports_deadlock_without_raising():
    result = simulate(parse_schedule("rank 0: RB0 B0 F0 SF0 RG\nrank 1: RF0 F0 B0 SB0 RG"))
    assert result.deadlock.startswith("deadlock: ") and set(result.stuck) == {0, 1}
    assert "needs its own F0" in result.stuck[0]
    assert "SF0 not executed yet; rank 0 is stuck at #1 B0" in result.stuck[1]


def test_unreceived_send_hangs_the_step():
    result = simulate(parse_schedule("rank 0: RB0 F0 SF0 SF0 B0 RG\nrank 1: RF0 F0 B0 SB0 RG"))
    assert result.deadlock is None  # a duplicate send is a validator matter
    # SF1 feeds no compute on rank 1: both lists run out, the Isend never completes.
    result = simulate(parse_schedule("rank 0: RB0 F0 SF0 SF1 B0 RG\nrank 1: RF0 F0 B0 SB0 RG"))
    assert list(result.stuck) == [0] and "SF1 is never received (rank 1 posts no RF1)" in result.stuck[0]


# ---------------------------------------------------------------------------
# Simulator semantics.
# ---------------------------------------------------------------------------

def test_latency_and_per_rank_costs():
    schedule = one_f_one_b(2, 1)  # rank 0: F0 SF0 . B0 ; rank 1: F0 B0 SB0
    result = simulate(schedule, comm_latency=0.5)
    assert result.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    slow = simulate(schedule, {"F": 1, "B": 2, 1: {"F": 3}})
    assert slow.makespan == 1 + 3 + 2 + 2
    assert slow.busy == [3, 5]


def test_transfer_starts_when_the_receive_is_posted():
    # Rank 1 posts RF1 only after F0, so the second transfer's latency is exposed.
    late = parse_schedule("""
        rank 0: RB0 RB1 F0 SF0 F1 SF1 B0 B1 RG
        rank 1: RF0 F0 RF1 F1 B0 SB0 B1 SB1 RG
    """)
    early = parse_schedule(str(late).replace("RF0 F0 RF1", "RF0 RF1 F0"))

    def start_of_f1_on_rank_1(result):
        return next(start for action, start, _ in result.timeline[1] if action == Action(F, 1))

    assert start_of_f1_on_rank_1(simulate(late, comm_latency=1)) == 4   # F0 ends 3, RF1 posted 3, +1
    assert start_of_f1_on_rank_1(simulate(early, comm_latency=1)) == 3  # sent at 2, +1


def test_costs_reject_unknown_kinds():
    with pytest.raises(ValueError, match="unknown action kind"):
        simulate(one_f_one_b(2, 2), {"X": 1})


# ---------------------------------------------------------------------------
# Text format.
# ---------------------------------------------------------------------------

def test_str_parse_round_trip():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbh1", 1)):
        for p, m in ((1, 3), (4, 8), (3, 7)):
            schedule = make_schedule(name, p, m, v)
            again = parse_schedule(str(schedule), name=name)
            assert (again.p, again.m, again.v, again.ranks) == (p, m, v, schedule.ranks)


def test_compact_action_format():
    assert parse_actions("F3 B3 I3 W3 SF3 RF3 SB3 RB3 RG F3.1, SB0.2") == [
        Action(F, 3), Action(B, 3), Action(I, 3), Action(W, 3), Action(SEND_F, 3), Action(RECV_F, 3),
        Action("SEND_B", 3), Action("RECV_B", 3), Action("REDUCE_GRAD"),
        Action(F, 3, 1), Action("SEND_B", 0, 2)]
    assert str(Action(F, 3)) == "F3" and str(Action(F, 3, 1)) == "F3.1"
    assert Action(F, 3).compact(show_chunk=True) == "F3.0"
    with pytest.raises(ScheduleError, match="cannot parse 'X3'"):
        parse_actions("F0 X3")
    with pytest.raises(ValueError):
        Action("F")
    with pytest.raises(ValueError):
        Action("REDUCE_GRAD", 1)


def test_schedule_str_is_one_line_per_rank():
    lines = str(one_f_one_b(2, 1)).splitlines()
    assert lines == ["rank 0: RB0 F0 SF0 B0 RG", "rank 1: RF0 F0 B0 SB0 RG"]


def test_peer_and_message_key_wrap_around_chunks():
    schedule = interleaved_1f1b(4, 4, 2)
    send = Action(SEND_F, 2, 0)  # rank 3, chunk 0 = stage 3 -> stage 4 = rank 0, chunk 1
    assert schedule.peer(3, send) == (0, 1)
    assert schedule.message_key(3, send) == schedule.message_key(0, Action(RECV_F, 2, 1)) == ("F", 2, 4)


# ---------------------------------------------------------------------------
# Pictures and CLI.
# ---------------------------------------------------------------------------

def test_ascii_timeline():
    result = simulate(one_f_one_b(2, 2))
    # Rank 0 idles while micro-batch 0 goes down and its gradient comes back.
    assert ascii_timeline(result).splitlines()[1:] == ["rank 0 FF..BB.BB", "rank 1 .FBBFBB.."]
    assert ascii_timeline(result, style="mb").splitlines()[1:] == ["rank 0 01..00.11", "rank 1 .000111.."]
    squeezed = ascii_timeline(simulate(one_f_one_b(4, 32)), width=40)
    assert all(len(line) <= 7 + 40 for line in squeezed.splitlines()[1:-1])
    assert "one character =" in squeezed


def test_plot_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zbh1.png"
    plot_timeline(simulate(interleaved_1f1b(2, 4, 2)), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_timeline_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install ringpipe\[plot\]"):
        plot_timeline(simulate(one_f_one_b(2, 2)), str(tmp_path / "x.png"))


def test_cli(capsys):
    assert main(["--schedule", "zbh1", "-p", "4", "-m", "8", "--costs", "F=1,I=1,W=1"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: RF0 RF1 F0 RF2 I0 SB0 F1 RF3 I1" in out
    assert "validate: OK" in out and "theory: (p-1)/(3m+p-1) = 0.1111" in out
    assert main(["--schedule", "interleaved", "-p", "4", "-m", "6", "-v", "2", "--no-comm"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "SF" not in out
    assert main(["--schedule", "1f1b", "-p", "4", "-m", "0"]) == 2
    assert "m (micro-batches) must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("p,m,v", [(1, 3, 1), (2, 3, 1), (4, 2, 1), (2, 4, 2), (1, 2, 3), (3, 5, 2)])
def test_forward_only_schedule_for_evaluation(p, m, v):
    """What evaluation runs through the executor: one F per (micro-batch, chunk), its
    messages, no backward and no REDUCE_GRAD; valid and deadlock-free."""
    s = forward_only(p, m, v)
    validate(s)
    assert not s.training
    for rank, actions in enumerate(s.ranks):
        assert {a.kind for a in actions} <= {"F", "SEND_F", "RECV_F"}
        assert sorted((a.mb, a.chunk) for a in actions if a.kind == "F") == [(mb, c) for mb in range(m)
                                                                              for c in range(v)]
    assert not simulate(s).deadlock


def test_forward_only_rules():
    s = forward_only(2, 2)
    s.ranks[0].append(Action("REDUCE_GRAD"))
    with pytest.raises(ScheduleError) as e:
        validate(s)
    assert e.value.rule == "reduce-grad"
    s = forward_only(1, 1)
    s.ranks[0].append(Action("B", 0))
    with pytest.raises(ScheduleError) as e:
        validate(s)
    assert e.value.rule == "compute-count"
