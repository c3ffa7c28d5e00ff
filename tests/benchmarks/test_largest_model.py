"""benchmarks/largest_model.py --quick: a small Qwen3-shaped folder fine-tuned under ZeRO-3 on
4 ranks, resumed at --tp 2 and --pp 2, exported; every run's memory moments parsed into the
JSON (no memory ratio is asserted: the machine is shared)."""
import json
import os

import pytest

from tests.support.bench_cli import run_benchmark


@pytest.mark.slow
def test_quick_run_collects_every_runs_moments(tmp_path):
    out = tmp_path / "largest.json"
    r = run_benchmark(os.path.join("benchmarks", "largest_model.py"), "--quick", "--json", str(out), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    d = json.loads(out.read_text())
    assert [run["run"] for run in d["runs"]] == ["fine-tune", "resume tp2", "resume pp2"]
    for run in d["runs"]:
        names = [row["moment"].split(" (")[0] for row in run["moments"]]
        assert {"start-up", "steps 1-2", "save"} <= set(names), names
        assert ("import" if run["run"] == "fine-tune" else "resume") in names
        assert all(row["measured_mib"] > 0 for row in run["moments"])
    assert d["export"]["ok"]
