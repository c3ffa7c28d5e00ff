"""benchmarks/ps_staleness.py: a tiny run (2 workers + 1 server, 8 steps, one seed) prints its
table and writes its JSON, every mode labelled in its metrics, ssp's loss off sync's from the
second step on; no timing is asserted (the machines are shared). Bad flags are refused."""
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.bench_cli import bench_env, refused

SCRIPT = os.path.join("benchmarks", "ps_staleness.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")
def test_a_tiny_run_measures_the_gap(tmp_path):
    out = tmp_path / "staleness.json"
    r = subprocess.run([sys.executable, SCRIPT, "--workers", "2", "--steps", "8", "--seeds", "1",
                        "--modes", "ssp:1,async", "--json", str(out)], cwd=ROOT, env=bench_env(),
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "gap vs sync" in r.stdout
    data = json.loads(out.read_text())
    rows = {row["mode"]: row for row in data["rows"]}
    assert list(rows) == ["sync", "ssp:1", "async"]
    assert all(row["labelled"] for row in rows.values())
    assert rows["sync"]["gap"] == 0.0
    runs = {run["mode"]: run for run in data["runs"]}
    assert runs["ssp:1"]["losses"][0] == runs["sync"]["losses"][0]      # step 0: the same parameters
    assert runs["ssp:1"]["losses"][1:] != runs["sync"]["losses"][1:]


@pytest.mark.parametrize("args", [["--steps", "0"], ["--seeds", "x"], ["--workers", "-1"]])
def test_bad_flags_are_refused(args):
    r = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=bench_env(), capture_output=True, text=True,
                       timeout=60)
    refused(r, args[0])
