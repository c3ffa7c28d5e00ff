"""benchmarks/checkpoint_save.py: --quick saves a tiny GPT at 1 and 2 ranks in the three
variants (whole, sharded, sharded + async) and writes every key the README's table comes
from; no time is asserted. The bytes are: about the same checkpoint in every variant, on
the first rank when whole, split over the ranks when sharded. Bad flags are refused before any run starts."""
import json
import os

import pytest

from tests.support.bench_cli import refused, run_benchmark

SCRIPT = os.path.join("benchmarks", "checkpoint_save.py")


def _run(*args, timeout=120):
    return run_benchmark(SCRIPT, *args, timeout=timeout)


@pytest.mark.slow
def test_quick_run_writes_every_key(tmp_path):
    out = tmp_path / "checkpoint_save.json"
    work = tmp_path / "work"
    work.mkdir()
    r = _run("--quick", "--dir", str(work), "--json", str(out), timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    for words in ("the disk:", "blocking s, first", "goal: async blocking", "sharded save against ranks"):
        assert words in r.stdout, words
    d = json.loads(out.read_text())
    assert d["benchmark"] == "checkpoint_save" and d["quick"] is True
    assert d["ranks"] == [1, 2] and d["variants"] == ["whole", "sharded", "async"] and d["repeats"] == 1
    for key in ("cpu", "cores", "memory", "filesystem", "blas", "load_1min"):
        assert key in d["host"], key

    assert [row["writers"] for row in d["disk"]["rows"]] == [1, 2]
    for row in d["disk"]["rows"]:
        assert row["mb_s"]["median"] > 0 and row["mib"] == d["disk"]["mib"]

    rows = d["summary"]
    assert [(row["ranks"], row["variant"]) for row in rows] == [
        (n, v) for n in (1, 2) for v in ("whole", "sharded", "async")]
    sizes = [row["bytes_total"] for row in rows]
    assert min(sizes) > 0 and max(sizes) < 1.1 * min(sizes)   # the same arrays (the .npz's and manifests' framing differ)
    for row in rows:
        for key in ("blocking_first_s", "blocking_later_s", "blocking_s", "write_s", "clean_step_wall_s",
                    "save_step_wall_s"):
            assert row[key]["median"] >= 0 and row[key]["min"] <= row[key]["max"], key
        assert len(row["bytes_ranks"]) == row["ranks"] and row["peak_rss_max"] > 0
        assert row["vs_whole"] is not None
        if row["variant"] == "whole":
            assert row["bytes_ranks"][1:] == [0] * (row["ranks"] - 1)    # the first rank writes it all
        else:
            assert all(b > 0 for b in row["bytes_ranks"])                 # every rank its share
        if row["variant"] == "async":
            assert row["staging_s"]["median"] >= 0 and row["background_s"]["median"] >= 0
            assert 0 < row["staged_bytes_max"] <= max(row["bytes_ranks"])     # the file adds alignment
        else:
            assert row["staging_s"] is None and row["staged_bytes_max"] is None

    assert len(d["runs"]) == 6 and all(len(run["saves"]) == len(d["save_steps"]) for run in d["runs"])
    goal = d["goals"]["async_over_whole"]
    assert goal["ranks"] == 2 and goal["goal"] == 0.05 and isinstance(goal["blocking_s"]["pass"], bool)
    assert [s["ranks"] for s in d["goals"]["sharded_scaling"]] == [1, 2]
    assert os.listdir(work) == [], "the temp folder was left behind"


@pytest.mark.parametrize("args, words", [
    (["--ranks", "1,16"], ["--ranks", "at most 8"]),
    (["--variants", "whole,fast"], ["--variants", "'fast'"]),
    (["--save-at", "1"], ["--save-at", "at least 2"]),
    (["--zero", "3"], ["--zero 3", "leave 1 out of --ranks"]),
    (["--quick", "--seq-len", "65"], ["--seq-len", "context 64"]),
    (["--repeats", "0"], ["--repeats", ">= 1"]),
])
def test_bad_flags_are_refused_before_any_run(args, words):
    refused(_run(*args), *words)
