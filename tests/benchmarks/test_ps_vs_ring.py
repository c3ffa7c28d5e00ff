"""benchmarks/ps_vs_ring.py: a tiny run under 3 ranks on one machine (2 workers, a dedicated
server and the colocated PS next to the ring, the hierarchical all-reduce and the all-to-all control) prints its
table and writes its JSON, every mode's result equal to the exact average; no timing is
asserted (the machines are shared). Bad flags and too few ranks are refused before any work."""
import json
import os
import sys

import pytest

from tests.support.bench_cli import refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "ps_vs_ring.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _run(*args, n=None, timeout=60):
    return run_benchmark(SCRIPT, *args, timeout=timeout, ranks=n)


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")
def test_every_mode_runs_on_one_machine(tmp_path):
    out = tmp_path / "ps.json"
    args = ["--workers", "2", "--servers", "1,0", "--bytes", "256K", "--chunk-bytes", "64K", "--repeats", "2",
            "--warmup", "0", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        args += ["--plot", str(tmp_path / "ps.png")]
    except ImportError:
        pass
    r = _run(*args, n=3)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "shared memory" in r.stdout and "meas/pred" in r.stdout and "0 wrong element(s) OK" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "ps_vs_ring" and data["workers"] == 2 and not data["emulated"]
    assert [row["key"] for row in data["rows"]] == ["ring", "hierarchical", "alltoall", "ps1", "ps0"]
    for row in data["rows"]:
        assert row["wrong"] == 0 and len(row["times_ms"]) == 2 and row["time_ms"] > 0 and row["pred_ms"] > 0, row
    by = {row["key"]: row for row in data["rows"]}
    # the model's bytes on the busiest link: the single master carries n M each way, the ring 2(n-1)/n M
    assert by["ps1"]["link_pred_MiB"] == pytest.approx(2 * 0.25) and by["ring"]["link_pred_MiB"] == pytest.approx(0.25)
    assert by["ring"]["vs_ring"] == pytest.approx(1.0)
    if "--plot" in args:
        assert (tmp_path / "ps.png").stat().st_size > 0


@pytest.mark.parametrize("args, n, words", [
    ([], None, ["mpiexec -n P"]),
    (["--servers", "1,x"], None, ["--servers", "'x'"]),
    (["--servers", "1,1"], None, ["--servers", "twice"]),
    (["--workers", "2", "--servers", "2"], 3, ["--servers 2", "need 4 ranks"]),
])
def test_refusals(args, n, words):
    if n and not os.path.exists(MPIEXEC):
        pytest.skip("no mpiexec next to this python")
    refused(_run(*args, n=n), *words)
