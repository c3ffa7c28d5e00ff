"""benchmarks/gpt2_step.py: --quick runs both frameworks and writes the rows the README
quotes (no timing is asserted: the machines are shared), and bad flag values are refused
before any child starts."""
import json
import math
import os

import pytest

from tests.support.bench_cli import bench_env, refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "gpt2_step.py")
ROW_KEYS = {"framework", "step_s", "fwd_bwd_s", "update_s", "tokens_per_s", "model_tflops", "gemm_gflops",
            "fraction_of_gemm", "peak_rss_gib",
            "import_rss_gib", "state_gib", "loss_first", "loss_last", "loss_expected", "loss_ok", "params",
            "first_step_s", "step_times_s", "losses", "threads", "versions", "round", "rounds_step_s",
            "wall_s", "cpu_s", "involuntary_switches", "load_before", "load_after"}


def _env():
    return bench_env(MKL_NUM_THREADS="1")


def _run(*args, timeout=120):
    return run_benchmark(SCRIPT, *args, timeout=timeout, env=_env())


@pytest.mark.slow
def test_quick_writes_both_rows(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2_step.json"
    r = _run("--quick", "--threads", "1", "--json", str(out), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "ringpipe / torch: tokens/s" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "gpt2_step" and data["preset"] == "quick"
    assert data["padded_vocab"] == 50304 and data["config"]["vocab"] == 50257
    assert data["tokens_per_step"] == data["batch"] * data["seq"]
    rows = data["rows"]
    assert [row["framework"] for row in rows] == ["ringpipe", "torch"]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert len(row["step_times_s"]) == data["steps"]
        assert len(row["losses"]) == data["steps"] + data["warmup"]
        assert row["loss_ok"] and all(math.isfinite(v) for v in row["losses"])
        assert abs(row["loss_first"] - math.log(50257)) < 1.0
        assert row["peak_rss_gib"] > 0 and row["state_gib"] > 0
    # The same shapes: the same parameter count (wte padded alike, tied once).
    assert rows[0]["params"] == rows[1]["params"]
    assert rows[0]["memory_floor_gib"] > 0 and rows[1]["memory_floor_gib"] is None
    assert rows[0]["threads"]["OPENBLAS_NUM_THREADS"] == "1" and rows[1]["threads"]["torch"] == 1
    assert set(data["ratio_ringpipe_over_torch"]) >= {"tokens_per_s", "peak_rss"}


def test_quick_one_framework_two_rounds_has_no_ratio(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--quick", "--threads", "1", "--frameworks", "ringpipe,ringpipe", "--steps", "1", "--warmup", "0",
             "--rounds", "2", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [row["framework"] for row in data["rows"]] == ["ringpipe"]          # a framework named twice runs once
    assert [x["round"] for x in data["all_rounds"]] == [1, 2]
    assert data["rows"][0]["step_s"] == min(data["rows"][0]["rounds_step_s"])
    assert data["ratio_ringpipe_over_torch"] is None


@pytest.mark.parametrize("args, words", [
    (["--batch", "0"], ["--batch", ">= 1"]),
    (["--seq", "x"], ["--seq", "invalid integer"]),
    (["--seq", "2048"], ["--seq", "exceeds the model's context 1024"]),
    (["--quick", "--seq", "65"], ["--seq", "context 64"]),
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--threads", "-1"], ["--threads", ">= 0"]),      # 0: each framework's own default
    (["--vocab", "0"], ["--vocab", ">= 1"]),
    (["--frameworks", "ringpipe,jax"], ["--frameworks", "'jax'", "ringpipe,torch"]),
    (["--rounds", "0"], ["--rounds", ">= 1"]),
    (["--torch-attn", "flash"], ["--torch-attn", "invalid choice"]),
])
def test_refuses_bad_flags(args, words):
    refused(_run(*args), *words)


def test_refuses_unwritable_json(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _run("--quick", "--json", str(blocker / "out.json"))
    assert r.returncode == 2 and r.stdout == "" and "--json" in r.stderr and "cannot write" in r.stderr


@pytest.mark.slow
def test_quick_bf16_rows_and_ratios(tmp_path):
    """ringpipe-bf16 (bf16 matmuls) next to ringpipe float32 and torch's bf16 autocast: the rows
    say their dtype and which bf16 GEMM ran, and the bf16 ratios are written."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "gpt2_step_bf16.json"
    r = _run("--quick", "--threads", "1", "--frameworks", "ringpipe-bf16,ringpipe,torch-bf16", "--json", str(out),
             timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "ringpipe-bf16 / torch-bf16: tokens/s" in r.stdout and "ringpipe-bf16 / ringpipe: tokens/s" in r.stdout
    data = json.loads(out.read_text())
    rows = {row["framework"]: row for row in data["rows"]}
    assert rows["ringpipe-bf16"]["dtype"] == "bf16 matmuls" and rows["ringpipe"]["dtype"] == "float32"
    assert rows["torch-bf16"]["dtype"] == "bf16 autocast"
    assert rows["ringpipe-bf16"]["bf16_gemm"].startswith("bf16 GEMM: ")
    assert all(row["loss_ok"] for row in rows.values())
    assert set(data["bf16_ratios"]) == {"ringpipe-bf16/torch-bf16", "ringpipe-bf16/ringpipe"}
