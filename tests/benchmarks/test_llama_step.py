"""benchmarks/llama_step.py: --quick runs every framework on transformers' tiny shape and
writes the rows docs quote (no timing is asserted: the machines are shared); the rows of one
shape count the same parameters; bad flag values are refused before any child starts."""
import json
import math
import os

import pytest

from tests.support.bench_cli import bench_env, refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "llama_step.py")
ROW_KEYS = {"framework", "dtype", "step_s", "fwd_bwd_s", "update_s", "tokens_per_s", "model_gflops", "peak_rss_gib",
            "import_rss_gib", "state_gib", "loss_first", "loss_last", "loss_expected", "loss_ok", "params",
            "step_times_s", "losses", "threads", "versions", "round", "rounds_step_s", "shape"}


def _run(*args, timeout=120):
    return run_benchmark(SCRIPT, *args, timeout=timeout, env=bench_env(MKL_NUM_THREADS="1"))


@pytest.mark.slow
def test_quick_writes_a_row_per_framework(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "llama_step.json"
    r = _run("--quick", "--threads", "1", "--frameworks", "ringpipe,torch,torch-bf16", "--json", str(out),
             timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "ringpipe / torch: tokens/s" in r.stdout and "ringpipe / torch-bf16: tokens/s" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "llama_step" and data["quick"]
    [shape] = data["shapes"]
    assert shape["shape"] == "hf-tiny" and shape["config"]["n_kv_head"] == 2 and shape["config"]["d_ff"] == 37
    assert shape["padded_vocab"] == 128 and shape["tokens_per_step"] == data["batch"] * data["seq"]
    rows = shape["rows"]
    assert [row["framework"] for row in rows] == ["ringpipe", "torch", "torch-bf16"]
    assert [row["dtype"] for row in rows] == ["float32", "float32", "bf16 autocast"]
    for row in rows:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert len(row["step_times_s"]) == data["steps"]
        assert len(row["losses"]) == data["steps"] + data["warmup"]
        assert row["loss_ok"] and all(math.isfinite(v) for v in row["losses"])
        assert row["peak_rss_gib"] > 0 and row["state_gib"] > 0
    # The same shape: the same parameter count (embedding padded alike, tied once).
    assert rows[0]["params"] == rows[1]["params"] == rows[2]["params"]
    assert rows[0]["memory_floor_gib"] > 0 and rows[1]["memory_floor_gib"] is None
    assert rows[0]["threads"]["OPENBLAS_NUM_THREADS"] == "1" and rows[1]["threads"]["torch"] == 1
    for other in ("torch", "torch-bf16"):
        ratio = shape["ratio_ringpipe_over"][other]["tokens_per_s"]
        assert ratio["min"] <= ratio["median"] <= ratio["max"] and len(ratio["rounds"]) == 1


def test_ringpipe_alone_two_rounds_has_no_ratio(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--quick", "--threads", "1", "--frameworks", "ringpipe,ringpipe", "--steps", "1", "--warmup", "0",
             "--rounds", "2", "--json", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    [shape] = json.loads(out.read_text())["shapes"]
    assert [row["framework"] for row in shape["rows"]] == ["ringpipe"]          # named twice, runs once
    assert [x["round"] for x in shape["all_rounds"]] == [1, 2]
    row = shape["rows"][0]
    assert sorted(row["rounds_step_s"]) == sorted(x["step_s"] for x in shape["all_rounds"])
    assert shape["ratio_ringpipe_over"] == {}


@pytest.mark.parametrize("args, words", [
    (["--batch", "0"], ["--batch", ">= 1"]),
    (["--seq", "x"], ["--seq", "invalid integer"]),
    (["--quick", "--seq", "513"], ["--seq", "context 512", "hf-tiny"]),
    (["--shapes", "small,gpt2"], ["--shapes", "'gpt2'"]),
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--warmup", "-1"], ["--warmup", ">= 0"]),
    (["--threads", "0"], ["--threads", ">= 1"]),
    (["--frameworks", "ringpipe,jax"], ["--frameworks", "'jax'"]),
    (["--rounds", "0"], ["--rounds", ">= 1"]),
])
def test_refuses_bad_flags(args, words):
    refused(_run(*args), *words)


def test_refuses_unwritable_json(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _run("--quick", "--json", str(blocker / "out.json"))
    assert r.returncode == 2 and r.stdout == "" and "--json" in r.stderr and "cannot write" in r.stderr
