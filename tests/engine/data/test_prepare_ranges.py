"""Every numeric setting of `ringpipe prepare` has a range that says what makes sense (issue 34):
a value outside it is refused before any work, naming the flag, its range and what to pass.
Before, --val-every 10^20 and --tokens-per-shard 1 (a shard file per token: millions of
files at scale) were accepted."""
import os
import subprocess
import sys

import pytest

from ringpipe.engine.data import parts
from ringpipe.engine.data import prepare as prep
from tests.support import ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RAYON_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

# (settings of prepare(), what the refusal must say). Each was accepted before the ranges.
OUT_OF_RANGE = [
    (dict(val_every=10**20), "--val-every 100000000000000000000: must be a whole number from 2 to 100"),
    (dict(val_every=101), "--val-every 101: must be a whole number from 2 to 100"),
    (dict(tokens_per_shard=1), "--tokens-per-shard 1: must be a whole number from 64 to 2^31-1"),
    (dict(tokens_per_shard=63), "--tokens-per-shard 63: must be a whole number from 64"),
    (dict(tokenizer="bpe:1000000000"), "--tokenizer bpe:1000000000: a BPE trained here holds at most 1,048,576"),
    (dict(tokenizer="bpe:300", bpe_train_mb=1e9), "--bpe-train-mb 1000000000.0: must be a number of MB from 0.01 "
                                                  "to 100,000"),
    (dict(tokenizer="bpe:300", bpe_train_mb=1e-9), "--bpe-train-mb 1e-09: must be a number of MB from 0.01"),
    (dict(tokenizer="bpe:300", bpe_train_mb=True), "--bpe-train-mb True: must be a number of MB"),
]


@pytest.mark.parametrize("settings,message", OUT_OF_RANGE, ids=[m.split(":")[0] for _, m in OUT_OF_RANGE])
def test_a_setting_out_of_its_range_is_refused_before_any_work(tmp_path, settings, message):
    (tmp_path / "in.txt").write_text("some text " * 50)
    with pytest.raises(ValueError) as e:                          # on every rank alike (job.agreement)
        prep.prepare([str(tmp_path / "in.txt")], tmp_path / "out", progress=False, **settings)
    assert message in str(e.value), str(e.value)
    assert "pass e.g." in str(e.value) or "use e.g." in str(e.value), str(e.value)    # and what to do
    assert not os.path.exists(tmp_path / "out")


def test_the_edges_of_the_ranges_are_accepted(tmp_path):
    (tmp_path / "in.txt").write_text("some text " * 50)
    m = prep.prepare([str(tmp_path / "in.txt")], tmp_path / "out", progress=False, val_every=100,
                     tokens_per_shard=64)
    assert m["tokens_per_shard"] == 64 and len(m["splits"]["train"]["shards"]) == -(-m["splits"]["train"]["tokens"] // 64)


def test_a_split_of_more_shard_files_than_training_can_open_is_refused_before_any_is_written(tmp_path, monkeypatch):
    """The count of files is known once the text is tokenized: refused then, saying the size that fits."""
    monkeypatch.setattr(parts, "MAX_SHARDS_PER_SPLIT", 5)
    (tmp_path / "in.txt").write_text("x" * 1000)               # 1,001 tokens: 901 train, 100 val (the tail)
    with pytest.raises(ValueError) as e:                          # on every rank alike (job.agreement)
        prep.prepare([str(tmp_path / "in.txt")], tmp_path / "out", progress=False, tokens_per_shard=100)
    assert ("--tokens-per-shard 100: the train split's 901 tokens would be 10 shard files, more than the 5 a split "
            "may have") in str(e.value) and "pass --tokens-per-shard 181 or more" in str(e.value), str(e.value)
    assert not os.path.exists(tmp_path / "out")                  # nothing written (the folder it made is gone)
    m = prep.prepare([str(tmp_path / "in.txt")], tmp_path / "out", progress=False, tokens_per_shard=181)
    assert len(m["splits"]["train"]["shards"]) == 5


def test_the_command_exits_2_naming_the_flag(tmp_path):
    (tmp_path / "in.txt").write_text("some text " * 50)
    r = subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", "in.txt", "--out", "o",
                        "--tokens-per-shard", "1"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--tokens-per-shard 1: must be a whole number from 64" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(tmp_path / "o")
