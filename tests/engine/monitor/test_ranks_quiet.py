"""Issue 34: --quiet prints warnings and notes only (Reporter.note), not facts (Reporter.say).
A straggler named during a run is a warning: printed under quiet too; the monitoring's
start-up fact (the interval it chose) is not. Before, both went through one print function
(RankMonitor's say, Reporter.say), so quiet silenced the stragglers.

RankMonitor is driven directly, as rank 0 of a two-rank world whose other rank computes ten
times slower: no MPI, no training."""
from ringpipe.engine.monitor.ranks import VALUES, RankMonitor
from ringpipe.engine.train.reporting import Reporter

SPLIT = {"compute": 0.01, "comm": 0.001, "bubble": 0.0, "data": 0.0, "other": 0.0}


class RankZeroOfTwo:
    """What RankMonitor asks of MPI, answered for rank 0 of two ranks; rank 1's numbers are
    rank 0's with its compute time `slower` times longer."""

    def __init__(self, slower: float):
        self.slower = slower

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def gather(self, mine, root=0):
        return [mine, ("node-b", 2, mine[2])]

    def Gather(self, vector, table, root=0):
        table[0] = vector
        table[1] = vector
        table[1][VALUES.index("compute_ms")] = vector[VALUES.index("compute_ms")] * self.slower


def run_monitor(tmp_path, capsys, quiet: bool) -> str:
    """Four steps, auto interval, one rank ten times slower (named after one interval): what was printed."""
    report = Reporter(is_main=True, quiet=quiet, steps=4, log_every=None)
    monitor = RankMonitor(RankZeroOfTwo(slower=10.0), out_dir=str(tmp_path), interval="auto", ratio=1.5,
                          intervals=1, coords={"dp": 0, "pp": 0, "tp": 0}, header={"steps": 4, "start_step": 0},
                          say=report.say, note=report.note)
    monitor.step_done(1, 0.011, SPLIT, 4, {})
    monitor.step_done(2, 0.011, SPLIT, 4, {})            # the auto interval is agreed here (the fact), then a gather
    record = {}
    for done in (3, 4):
        monitor.step_done(done, 0.011, SPLIT, 4, record)
    assert [entry["rank"] for entry in record["stragglers"]] == [1]
    return capsys.readouterr().out


def test_a_straggler_is_printed_under_quiet_and_the_start_up_fact_is_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("ringpipe.comm.allreduce", lambda array, world, op: array)     # one process: its own max
    out = run_monitor(tmp_path, capsys, quiet=True)
    assert "straggler: rank 1 on node node-b, compute 10.0x the median of its peers" in out, out
    assert "monitoring:" not in out, out


def test_without_quiet_both_are_printed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("ringpipe.comm.allreduce", lambda array, world, op: array)
    out = run_monitor(tmp_path, capsys, quiet=False)
    assert "monitoring: per-rank numbers every" in out and "straggler: rank 1" in out, out

