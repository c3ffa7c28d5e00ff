"""benchmarks/bf16_gemm.py: --quick writes a row per GEMM with its error against float64 (no
timing is asserted: the machines are shared); bad flag values are refused before any child."""
import json
import os

from tests.support.bench_cli import refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "bf16_gemm.py")


def _run(*args, timeout=180):
    return run_benchmark(SCRIPT, *args, timeout=timeout)


def test_quick_writes_every_row_and_its_error(tmp_path):
    out = tmp_path / "bf16_gemm.json"
    r = _run("--quick", "--threads", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    impls = {row["impl"] for row in data["rows"]}
    assert {"ringpipe bf16 emulated", "ringpipe bf16 before", "ringpipe float32", "numpy float32"} <= impls
    assert data["children"][0]["bf16_gemm"].startswith("bf16 GEMM: ")
    if "native" in data["children"][0]["bf16_gemm"].split(",")[0]:
        assert {"ringpipe bf16 native", "ringpipe bf16 operands"} <= impls
    for row in data["rows"]:
        assert row["gflops"] > 0 and row["threads"] == 1
        # bf16 inputs in bf16 rows, float32 accumulation: tiny against a float64 product of the same inputs
        assert row["max_rel_err"] < (1e-2 if row["impl"] == "torch bf16" else 1e-5), row   # torch: bf16 output
    assert "load average" in r.stdout and "OPENBLAS_CORETYPE" in r.stdout


def test_bad_flags_are_refused():
    refused(_run("--threads", "0"), "--threads")
    refused(_run("--rounds", "0"), "--rounds")
