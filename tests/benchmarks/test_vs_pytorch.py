"""benchmarks/vs_pytorch.py and benchmarks/step_breakdown.py (issue 35): --quick runs every
framework and writes the rows the README quotes, with the host's GEMM rates; bad flag values
are refused before any child starts. No timing is asserted: the machines are shared."""
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.bench_cli import bench_env, refused


def _run(script, *args, timeout=120):
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), *args], cwd=ROOT,
                          env=bench_env(MKL_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [(["--cells", "huge"], ["--cells", "huge"]),
                                         (["--loads", "storm"], ["--loads", "storm"]),
                                         (["--threads", "-1"], ["--threads"]),
                                         (["--rounds", "0"], ["--rounds"])])
def test_vs_pytorch_refuses_bad_flags(args, words):
    refused(_run("vs_pytorch.py", *args), *words)


@pytest.mark.parametrize("args, words", [(["--threads", "-2"], ["--threads"]), (["--vocab", "0"], ["--vocab"]),
                                         (["--precision", "fp8"], ["--precision"])])
def test_step_breakdown_refuses_bad_flags(args, words):
    refused(_run("step_breakdown.py", *args), *words)


def test_busy_rows_are_shares_of_their_quiet_twins_and_default_threads_are_set_against_one():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import vs_pytorch
    finally:
        sys.path.pop(0)
    cell = vs_pytorch.QUICK_CELLS["small256"]

    def rounds(*rates):
        return [{"tokens_per_s": t, "peak_rss_bytes": 100, "gemm": "g"} for t in rates]
    quiet = vs_pytorch.summarize("small256", cell, 1, {"ringpipe": rounds(100, 110), "torch": rounds(50, 50)}, "quiet")
    busy = vs_pytorch.summarize("small256", cell, 1, {"ringpipe": rounds(40, 60), "torch": rounds(20, 20)}, "busy2")
    busy += vs_pytorch.summarize("small256", cell, 0, {"ringpipe": rounds(45), "torch": rounds(10),
                                                      "ringpipe@1": rounds(50)}, "busy2")
    assert quiet[0]["ratio"] == pytest.approx(2.1) and quiet[0]["ratio_range"] == "2.00-2.20"
    kept = vs_pytorch.kept_shares(quiet + busy)
    assert len(kept) == 1 and abs(kept[0]["ringpipe_kept"] - 50 / 105) < 1e-12 and kept[0]["torch_kept"] == pytest.approx(0.4)
    default = [r for r in busy if r["threads"] == "default vs 1"]
    assert len(default) == 1 and default[0]["ratio"] == pytest.approx(0.9)


@pytest.mark.slow
def test_quick_comparison_has_every_pair_and_the_hosts_gemm_rates(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "vs.json"
    r = _run("vs_pytorch.py", "--quick", "--cells", "small256", "--threads", "1", "--json", str(out), timeout=900)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "# host GEMM rates, 1 thread(s)" in r.stdout and "numpy BLAS float32" in r.stdout
    data = json.loads(out.read_text())
    assert {row["precision"] for row in data["rows"]} == ({"float32", "bf16"} if data["bf16"] else {"float32"})
    assert all(row["ratio"] > 0 and row["ringpipe_tokens_per_s"] > 0 for row in data["rows"])
    assert "numpy BLAS float32" in data["host_gemm_gflops"]["1"]["rates"]["2048^3"]


@pytest.mark.slow
def test_quick_breakdown_splits_the_step(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "breakdown.json"
    r = _run("step_breakdown.py", "--quick", "--json", str(out), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "ringpipe / torch: the rest of fwd+bwd" in r.stdout
    rows = {row["framework"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ringpipe", "torch"}
    assert all(0 < row["gemm_ms"] <= row["fwd_bwd_ms"] * 1.5 for row in rows.values())
