"""benchmarks/memory.py: --quick trains a tiny GPT at 2 ranks under ZeRO 0 and 1 and writes
the rows docs/memory.md quotes (measured peak RSS next to the prediction, tokens/s, bytes
sent per step against the formula); no time is asserted. Bad flags are refused before any
run starts."""
import json
import os

import pytest

from tests.support.bench_cli import refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "memory.py")


def _run(*args, timeout=120):
    return run_benchmark(SCRIPT, *args, timeout=timeout)


@pytest.mark.slow
def test_quick_measures_against_the_prediction(tmp_path):
    out = tmp_path / "memory.json"
    r = _run("--quick", "--json", str(out), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "measured/pred" in r.stdout and "largest |measured/predicted - 1|" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "memory" and data["mode"] == "sweep"
    rows = data["rows"]
    assert [(row["ranks"], row["zero"], row["recompute"]) for row in rows] == [(2, 0, "none"), (2, 1, "none")]
    for row in rows:
        assert row["peak_gib"] > 0 and row["predicted_gib"] > 0
        assert 0.5 < row["ratio"] < 2           # a tiny model: mostly the fixed overhead
        # ZeRO 0 and 1 send 2 x 4 Psi (N-1)/N bytes a step: a reduce-scatter and an all-gather.
        assert row["sent_over_formula"] == pytest.approx(1.0, rel=0.01)
        assert row["tokens_per_s"] > 0 and len(row["losses"]) == data["steps"]
    assert rows[1]["vs_zero1"] == 1.0


@pytest.mark.parametrize("args, words", [
    (["--zero", "0,4"], ["--zero", "'4'"]),
    (["--recompute", "some"], ["--recompute", "'some'"]),
    (["--steps", "2"], ["--steps", "at least 3"]),
    (["--quick", "--seq", "65"], ["--seq", "context 64"]),
    (["--ranks", "16"], ["--ranks", "at most 8"]),
    (["--quick", "--largest"], ["--largest", "not allowed with"]),
])
def test_bad_flags_are_refused_before_any_run(args, words):
    refused(_run(*args), *words)
