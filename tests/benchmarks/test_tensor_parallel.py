"""benchmarks/tensor_parallel.py: a small run under 2 ranks whose own accounting (parameters,
activations, bytes through the tensor axis) equals the formulas it prints; no timing is
asserted (the machines are shared). Bad flags are refused before any work."""
import json
import os
import sys

import pytest

from tests.support.bench_cli import refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "tensor_parallel.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _run(*args, n=None, timeout=120):
    return run_benchmark(SCRIPT, *args, timeout=timeout, ranks=n)


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")
def test_accounting_equals_the_formulas(tmp_path):
    out = tmp_path / "tp.json"
    r = _run("--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16", "--batch", "8", "--steps", "1", "--rounds", "1",
             "--json", str(out), n=2)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    data = json.loads(out.read_text())
    for row in data["memory"]:
        assert row["params"] == row["params_formula"], row
        assert abs(row["act_MiB"] - row["act_formula_MiB"]) < 1e-9, row
    kinds = {(c["layout"], c["kind"]): c for c in data["comm"]}
    assert kinds[("tp2", "all-reduce")]["formula_MiB"] > 0
    for c in data["comm"]:
        # all that is not in the formula: the cross-entropy's 3 numbers a token, the LayerNorms' gradients
        assert 0 <= c["small"] < 0.02 * max(c["formula_MiB"], 1), c
    layouts = {row["layout"] for row in data["rows"]}
    assert {"dp2", "pp2", "tp2", "tp2 (overlap off)", "tp2+sp"} <= layouts
    assert "## throughput" in r.stdout and "vs dp2" in r.stdout


@pytest.mark.parametrize("args, words", [
    ([], ["mpiexec -n 2 or -n 4"]),
    (["--heads", "6"], ["--heads 6"]),
    (["--steps", "0"], ["--steps"]),
])
def test_bad_flags_are_refused(args, words):
    refused(_run(*args), *words)
