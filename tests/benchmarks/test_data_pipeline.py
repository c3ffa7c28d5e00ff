"""benchmarks/data_pipeline.py: a tiny run writes every row and key the README's table
comes from (timings are never asserted), and bad flag values are refused before any work."""
import json
import os

import pytest

from tests.support.bench_cli import bench_env, refused, run_benchmark


def _env():
    return bench_env(RAYON_NUM_THREADS="1")


def _run(*args, timeout=120):
    return run_benchmark(os.path.join("benchmarks", "data_pipeline.py"), *args, timeout=timeout, env=_env())


@pytest.mark.slow
def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "data_pipeline.json"
    work = tmp_path / "work"
    work.mkdir()
    r = _run("--quick", "--tmp-dir", str(work), "--json", str(out), timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    d = json.loads(out.read_text())

    rows = d["prepare"]["rows"]
    assert {(row["tokenizer"].split(":")[0], row["ranks"]) for row in rows} == {
        ("bytes", 1), ("bytes", 2), ("bpe", 1), ("bpe", 2)}
    for row in rows:
        for key in ("files", "text_bytes", "tokens", "wall_s", "tokens_per_s", "own_tokens_per_s", "speedup",
                    "own_speedup", "runs_wall_s"):
            assert key in row, key
        assert row["tokens"] > 0 and row["files"] == d["prepare"]["files"]
        if row["ranks"] == 1:
            assert row["speedup"] == 1.0
    bytes_rows = [row for row in rows if row["tokenizer"] == "bytes"]
    assert bytes_rows[0]["tokens"] == bytes_rows[1]["tokens"]      # 1 rank and 2 ranks prepare the same data
    assert d["prepare"]["bpe"]["vocab_size"] > 257

    m = d["memory"]
    assert m["corpus_tokens"] == 2 << 20 and m["shards"] >= 3 and m["batches"] == 20
    assert m["corpus_bytes"] >= 2 * m["corpus_tokens"]
    assert [row["cache"] for row in m["rows"]] == ["warm", "cold"]
    for row in m["rows"]:
        for key in ("rss_before", "rss_peak", "growth_bytes", "hwm_growth_bytes", "file_growth_bytes",
                    "anon_growth_bytes", "growth_frac"):
            assert isinstance(row[key], (int, float)), key
        assert isinstance(row["pass"], bool) and len(row["batch_s"]) == 20
    assert m["goal_frac"] == 0.10 and m["pass"] == (m["worst_growth_frac"] < 0.10)

    f = d["fetch"]
    assert [row["what"].split(",")[0].split(" ")[0] for row in f["rows"]] == [
        "dataset.batch", "dataset.batch", "Prefetcher.get"]
    for row in f["rows"]:
        assert row["median_s"] >= 0 and row["frac_of_step"] >= 0 and isinstance(row["pass"], bool)
    assert f["step_s"] > 0 and len(f["model"]["steps_s"]) == 2 and f["goal_frac"] == 0.02

    for words in ("ringpipe prepare", "resident memory", "batch fetch vs one training step"):
        assert words in r.stdout
    assert os.listdir(work) == [], "the temp folder was left behind"


@pytest.mark.parametrize("args, words", [
    (["--corpus-tokens", "0"], ["--corpus-tokens", "at least 1 token"]),
    (["--corpus-tokens", "4Q"], ["--corpus-tokens", "invalid size"]),
    (["--corpus-tokens", "1000"], ["--corpus-tokens", "too few"]),
    (["--tokens-per-shard", "3G"], ["--tokens-per-shard", "2^31 - 1"]),
    (["--ranks", "2,4"], ["--ranks", "include 1"]),
    (["--ranks", "0,1"], ["--ranks", ">= 1"]),
    (["--tokenizers", "bytes,wordpiece"], ["--tokenizers", "'wordpiece'"]),
    (["--bpe-vocab", "257"], ["--bpe-vocab", "> 257"]),
    (["--prepare-mb", "-1"], ["--prepare-mb"]),
    (["--prepare-mb", "nan"], ["--prepare-mb"]),
    (["--batches", "0"], ["--batches", ">= 1"]),
    (["--steps", "x"], ["--steps", "invalid integer"]),
    (["--d-model", "100", "--heads", "3"], ["--d-model 100", "--heads 3"]),
    (["--tmp-dir", "/nonexistent/folder"], ["--tmp-dir", "not a folder"]),
    (["--quick", "--repeats", "0"], ["--repeats", ">= 1"]),
])
def test_refuses_bad_flags(args, words):
    refused(_run(*args), *words)


def test_refuses_unwritable_json(tmp_path):
    blocker = tmp_path / "a-file"          # a path below a regular file cannot be created, even by root
    blocker.write_text("")
    r = _run("--quick", "--json", str(blocker / "out.json"))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert "--json" in r.stderr and "cannot write" in r.stderr
