"""The simulator's data-parallel communication (ZeRO-0..3, issue 24): bytes, gathers, prefetch, overlap."""

import pytest

from ringpipe.engine.schedules import (
    REDUCE_GRAD, ZeroComm, gpipe, interleaved_1f1b, make_schedule, one_f_one_b, parse_schedule, simulate,
    zero_bytes_formula, zero_bubble_h1,
)
from ringpipe.engine.schedules.__main__ import main

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zbh1", 1), ("interleaved", 2)]


def gathers(result, rank=0):
    return [op for op in result.comm[rank] if op[0][0] == "all-gather" and op[0][1] != "params"]


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("stage,mode", [(0, "auto"), (1, "auto"), (2, "auto"), (3, "use"), (3, "step")])
@pytest.mark.parametrize("dp", [2, 4])
def test_bytes_per_rank_match_the_formulas(name, v, stage, mode, dp):
    p, m, chunk = 3, 5, 1000.0
    schedule = make_schedule(name, p, m, v)
    result = simulate(schedule, zero=ZeroComm(stage, dp, chunk, bandwidth=500.0, units=3, gather=mode))
    assert result.deadlock is None
    expected, _ = zero_bytes_formula(stage, chunk * v, dp, m, result.gather_mode or "step")
    assert result.comm_bytes == pytest.approx([expected] * p, rel=1e-12)


def test_the_formulas_are_the_issues():
    psi, f = 100.0, 3 / 4
    assert zero_bytes_formula(1, psi, 4, 8)[0] == pytest.approx(2 * psi * f)      # reduce-scatter + gather
    assert zero_bytes_formula(2, psi, 4, 8)[0] == pytest.approx(2 * psi * f)
    assert zero_bytes_formula(3, psi, 4, 8, "step")[0] == pytest.approx(2 * psi * f)
    assert zero_bytes_formula(3, psi, 4, 1, "use")[0] == pytest.approx(3 * psi * f)  # the classic 3 Psi
    assert zero_bytes_formula(3, psi, 4, 8, "use")[0] == pytest.approx(17 * psi * f)


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_without_zero_or_with_one_data_rank_the_replay_is_unchanged(name, v):
    schedule = make_schedule(name, 4, 6, v)
    costs = {"F": 1.5, "B": 2.5, "I": 1.25, "W": 1.0}
    base = simulate(schedule, costs, comm_latency=0.25)
    same = simulate(schedule, costs, comm_latency=0.25, zero=ZeroComm(0, 1, 1e9, bandwidth=1.0))
    assert same.timeline == base.timeline
    assert (same.makespan, same.busy, same.bubble) == (base.makespan, base.busy, base.bubble)
    assert same.zero is None and same.comm == [] and same.comm_bytes == []


@pytest.mark.parametrize("name,v", SCHEDULES)
def test_gathering_once_a_step_saves_the_expected_gathers(name, v):
    p, m, units, chunk, dp = 2, 4, 3, 600.0, 2
    schedule = make_schedule(name, p, m, v)
    use = simulate(schedule, zero=ZeroComm(3, dp, chunk, bandwidth=100.0, units=units, gather="use"))
    step = simulate(schedule, zero=ZeroComm(3, dp, chunk, bandwidth=100.0, units=units, gather="step"))
    for rank in range(p):
        # use: before each F and each B/I of every micro-batch (W needs no parameters); step: once
        assert len(gathers(use, rank)) == 2 * m * units * v
        assert len(gathers(step, rank)) == units * v
        saved = (2 * m - 1) * units * v * (chunk / units) * (dp - 1) / dp
        assert use.comm_bytes[rank] - step.comm_bytes[rank] == pytest.approx(saved)
    assert use.makespan > step.makespan > simulate(schedule).makespan


def test_auto_gathers_per_use_without_a_pipeline_and_per_step_with_one():
    zero = ZeroComm(3, 2, 10.0, bandwidth=10.0)
    assert simulate(gpipe(1, 2), zero=zero).gather_mode == "use"
    assert simulate(one_f_one_b(2, 2), zero=zero).gather_mode == "step"


def one_rank(gather_time, mode="use"):
    """p = 1, m = 1, one unit: F=1 then B=2; a gather (and the reduce-scatter) takes gather_time."""
    zero = ZeroComm(3, 2, 2.0 * gather_time, bandwidth=1.0, gather=mode)  # moves half the bytes
    return simulate(gpipe(1, 1), zero=zero)


def test_prefetch_hides_a_gather_shorter_than_the_previous_compute():
    result = one_rank(0.5)
    (f, f_start, f_end), (b, b_start, b_end), (rg, rg_start, rg_end) = result.timeline[0]
    assert (f.kind, f_start, f_end) == ("F", 0.5, 1.5)      # the step's first gather is exposed
    assert (b.kind, b_start, b_end) == ("B", 1.5, 3.5)      # issued as F starts, done at 1.0: hidden
    assert rg.kind == REDUCE_GRAD and rg_start == 4.0      # waits for the reduce-scatter after B
    assert result.makespan == 4.0
    assert result.busy == [3.0]


def test_a_gather_longer_than_the_previous_compute_is_exposed_by_the_difference():
    result = one_rank(1.5)
    (_, f_start, f_end), (_, b_start, _), _ = result.timeline[0]
    assert (f_start, f_end) == (1.5, 2.5)
    assert b_start == 3.0                                  # issued at 1.5, done at 3.0: 0.5 past F
    assert one_rank(1.5, "step").timeline[0][1][1] == 2.5  # kept from F: no second gather


def test_a_stall_inside_an_action_is_not_busy_time():
    # Two units per chunk, each gather 1.0 long behind 0.5 of compute: units wait inside F.
    result = simulate(gpipe(1, 1), zero=ZeroComm(3, 2, 4.0, bandwidth=1.0, units=2))
    assert result.busy == [3.0]
    (_, f_start, f_end) = result.timeline[0][0]
    assert (f_start, f_end) == (1.0, 2.5)                 # unit 1's gather ends at 2.0, not at 1.5
    assert result.bubble[0] == pytest.approx(1 - 3.0 / result.makespan)


def test_gradient_buckets_overlap_the_rest_of_the_backward():
    schedule = one_f_one_b(2, 4)
    result = simulate(schedule, zero=ZeroComm(2, 2, 8.0, bandwidth=4.0, units=4))
    last_b_end = max(end for a, _, end in result.timeline[0] if a.kind == "B")
    reductions = [op for op in result.comm[0] if op[0][0] == "reduce-scatter"]
    assert len(reductions) == 4 and reductions[0][1] < last_b_end
    rg_start = next(start for a, start, _ in result.timeline[0] if a.kind == REDUCE_GRAD)
    assert rg_start == pytest.approx(max(end for _, _, end in reductions))


def test_zero_bubble_reduces_after_the_last_w():
    result = simulate(zero_bubble_h1(2, 4), zero=ZeroComm(0, 2, 8.0, bandwidth=4.0, units=2))
    last_w_start = max(start for a, start, _ in result.timeline[1] if a.kind == "W")
    reductions = [op for op in result.comm[1] if op[0][0] == "all-reduce"]
    assert len(reductions) == 2 and min(start for _, start, _ in reductions) > last_w_start


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_gather_the_parameters_after_every_rank_has_its_gradients(stage):
    schedule = interleaved_1f1b(2, 4, 2)
    result = simulate(schedule, {1: {"B": 3.0}}, zero=ZeroComm(stage, 4, [[3.0, 1.0], [1.0, 1.0]], bandwidth=2.0))
    update = max(row[-1][2] for row in result.timeline)
    for rank, psi in enumerate((4.0, 2.0)):
        label, start, end = result.comm[rank][-1]
        assert label == ("all-gather", "params") and start == pytest.approx(update)
        assert end - start == pytest.approx(psi * 3 / 4 / 2.0)
    assert result.makespan == pytest.approx(update + 4.0 * 3 / 4 / 2.0)


def test_latency_counts_once_per_ring_step():
    zero = ZeroComm(0, 4, 0.0, bandwidth=1.0, latency=0.5)
    assert zero.collective("all-gather", 0.0) == (0.0, 1.5)
    assert zero.collective("all-reduce", 8.0) == (12.0, 3.0 + 12.0)


def test_bad_descriptions_are_refused_clearly():
    for kwargs, words in (({"stage": 4}, "stage"), ({"dp": 0}, "dp"), ({"stage": 2, "dp": 1}, "dp >= 2"),
                          ({"bandwidth": 0.0}, "bandwidth"), ({"units": 0}, "units"), ({"gather": "x"}, "gather"),
                          ({"latency": -1.0}, "latency")):
        args = {"stage": 3, "dp": 2, "chunk_bytes": 1.0, "bandwidth": 1.0, **kwargs}
        with pytest.raises(ValueError, match=words):
            ZeroComm(**args)
    with pytest.raises(ValueError, match="2 ranks x 1 chunks"):
        simulate(one_f_one_b(2, 2), zero=ZeroComm(3, 2, [[1.0]], bandwidth=1.0))


def test_a_deadlock_is_still_reported():
    broken = parse_schedule("rank 0: F0 B0 RG\nrank 1: RF0 F0 RB0 B0 RG")
    result = simulate(broken, zero=ZeroComm(2, 2, 1.0, bandwidth=1.0))
    assert result.deadlock


def test_cli_prints_both_step_times_and_the_formula(capsys):
    argv = ["-s", "zbh1", "-p", "2", "-m", "4", "--costs", "F=10,I=10,W=10", "--dp", "4", "--zero", "3",
            "--param-mb", "8", "--zero-gather", "use"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "without the data-parallel communication" in out
    assert "formula (2m+1)Ψ(N-1)/N = 54.00" in out                 # 9 x 8 MiB x 3/4
    assert "bytes per step per rank (MiB): 54.00 54.00" in out
    assert main(["-p", "2", "-m", "4"]) == 0
    assert "data parallel" not in capsys.readouterr().out


def test_cli_refuses_zero_without_data_ranks(capsys):
    assert main(["-p", "2", "-m", "4", "--zero", "2"]) == 2
    assert "--dp N with N >= 2" in capsys.readouterr().err
    assert main(["-p", "2", "-m", "4", "--dp", "2", "--link-gbps", "0"]) == 2
