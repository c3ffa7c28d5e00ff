"""benchmarks/sampling.py: --quick runs the three ways (the KV cache, the full window,
transformers' generate) on tiny shapes and writes their rows (no timing is asserted:
the machines are shared); bad flag values are refused before any work."""
import json
import os

import pytest

from tests.support.bench_cli import bench_env, refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "sampling.py")
ROW_KEYS = {"model", "shape", "way", "params", "seconds", "tokens_per_s", "times_s", "same_tokens_as_cached",
            "cached_speedup"}


def _run(*args, timeout=300):
    return run_benchmark(SCRIPT, *args, timeout=timeout, env=bench_env(MKL_NUM_THREADS="1"))


def _rows(out, *args):
    r = _run("--quick", "--threads", "1", "--json", str(out), *args)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "tokens/s" in r.stdout and "BLAS" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "sampling" and data["quick"] and data["threads"] == 1 and data["blas"]
    for row in data["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["tokens_per_s"] > 0 and len(row["times_s"]) == data["rounds"]
    return data["rows"]


def test_quick_without_transformers_has_both_families_cached_and_not(tmp_path):
    rows = _rows(tmp_path / "s.json", "--no-transformers")
    assert [(r["model"], r["way"]) for r in rows] == [("gpt", "cached"), ("gpt", "uncached"),
                                                      ("llama", "cached"), ("llama", "uncached")]
    # greedy decoding: the cache changes the speed, never the tokens
    assert all(r["same_tokens_as_cached"] for r in rows)


@pytest.mark.slow
def test_quick_with_transformers_runs_its_generate_on_the_same_weights(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rows = _rows(tmp_path / "s.json", "--models", "llama")
    assert [r["way"] for r in rows] == ["cached", "uncached", "transformers"]
    assert rows[2]["params"] == rows[0]["params"]


@pytest.mark.parametrize("args, words", [
    (["--models", "bert"], ["--models", "bert"]),
    (["--new", "0"], ["--new"]),
    (["--prompt", "400", "--new", "200", "--window", "512"], ["--window"]),
])
def test_bad_flags_are_refused_before_any_work(tmp_path, args, words):
    refused(_run(*args, "--json", str(tmp_path / "s.json")), *words)
