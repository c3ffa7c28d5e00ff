"""Issue 20, round two, the data side: nothing lost, no hang.

- a token id outside the vocabulary anywhere in a split (past the start-up check) stops
  every rank, at every layout, with the same message and exit code 2, before a step
  runs on it (train and validation batches);
- a dataset opened by a run keeps reading the files it was opened with when the folder
  is replaced; DATA_DIR/prepare.lock is held shared while it is open;
- data.json is read safely (FIFO, /dev/zero, deep nesting, a huge file), and a shard
  listed twice (in both splits, or twice in one) is refused;
- a resume on prepared data says nothing of a changed <data> when it is the same folder.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ringpipe.engine.data import shards
from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.data.tokenizer import load_tokenizer
from tests.support.hostile import deadline

SEQ, BATCH = 8, 4
TINY = dict(layers=2, d_model=8, heads=2, context=SEQ, seq_len=SEQ, batch_size=BATCH, steps=4, sample_tokens=0,
            quiet=True, overwrite=True, eval_batches=1, eval_every=100, dtype="float64")
TRAIN_TOKENS, VAL_TOKENS = 3000, 600


def make_data(folder, train=None, val=None, shards_per_split=2, vocab=256):
    """A prepared data folder written by hand (engine/data/prepare.py's layout): the bytes
    tokenizer, `shards_per_split` shards per split, data.json. Shards are written with a
    vocab_size of 65536 (still uint16, what a vocabulary of 256 is stored as), so a test
    can put ids the tokenizer does not have into them."""
    os.makedirs(folder, exist_ok=True)
    tok = load_tokenizer("bytes")
    tok.save(folder)
    rng = np.random.default_rng(0)
    train = rng.integers(97, 123, size=TRAIN_TOKENS) if train is None else np.asarray(train)
    val = rng.integers(97, 123, size=VAL_TOKENS) if val is None else np.asarray(val)
    splits = {}
    for name, tokens in (("train", train), ("val", val)):
        files = []
        for k, part in enumerate(np.array_split(tokens, shards_per_split)):
            file = f"{name}_{k:06d}.bin"
            shards.write_shard(os.path.join(folder, file), part, vocab_size=65536)
            files.append(file)
        splits[name] = {"shards": files, "tokens": int(len(tokens)), "bytes": int(len(tokens)), "documents": 1}
    manifest = {"format": shards.MANIFEST_FORMAT, "version": shards.MANIFEST_VERSION,
                "tokenizer": {"kind": "bytes", "file": "tokenizer.json", "sha256": tok.sha256, "vocab_size": vocab},
                "separator": list(tok.separator), "tokens_per_shard": max(TRAIN_TOKENS, VAL_TOKENS),
                "splits": splits, "sources": [], "split": {}, "skipped": {}, "created": "now", "command": "test"}
    shards.write_manifest(folder, manifest)
    return folder


def starts_of(step, split="train", seed=1337, n=TRAIN_TOKENS):
    """The window starts of global batch `step` (as ShardDataset.batch draws them)."""
    rng = np.random.default_rng([seed, step, shards._SPLIT_IDS[split]])
    return rng.integers(0, n - SEQ - 1, size=BATCH)


def late_bad_position(step=2, row=BATCH - 1, seed=1337):
    """A train position in row `row` of batch `step` and in no window of an earlier batch:
    the start-up check (patched to read little) and steps 0..step-1 never see it. Row
    BATCH - 1 is the second data-parallel replica's under --dp 2."""
    seen = set()
    for s in range(step):
        for a in starts_of(s, seed=seed):
            seen.update(range(int(a), int(a) + SEQ + 1))
    start = int(starts_of(step, seed=seed)[row])
    for pos in range(start + SEQ, start - 1, -1):
        if pos not in seen and pos > 64:
            return pos
    pytest.skip("no position only batch 2 reads (another seed would find one)")


def bad_train(position, token=300):
    tokens = np.random.default_rng(0).integers(97, 123, size=TRAIN_TOKENS)
    tokens[position] = token
    return tokens


# ---- out-of-vocabulary ids: the dataset ---------------------------------------------------

def test_a_batch_holding_an_id_outside_the_vocabulary_is_refused_with_where_it_is(tmp_path):
    pos = late_bad_position()
    data = make_data(str(tmp_path / "d"), train=bad_train(pos, 70000 % 65536))
    ds = shards.open_dataset(data, SEQ, 1337)
    ds.batch(0, BATCH)                                    # batch 0 does not reach it
    with pytest.raises(shards.BadTokens) as e:
        ds.batch(2, BATCH)
    assert e.value.position == pos
    assert f"token id {70000 % 65536} at token position {pos:,}" in str(e.value)
    assert "train_000000.bin" in str(e.value) or "train_000001.bin" in str(e.value)
    assert "vocabulary 0..255" in str(e.value) and "prepare the data again" in str(e.value)
    # Only the rows that hold it: rows 0..2 of batch 2 are fine.
    ds.batch(2, BATCH, 0, BATCH - 1)


def test_the_start_up_check_says_where_the_id_is(tmp_path):
    data = make_data(str(tmp_path / "d"), train=bad_train(100, 256))
    ds = shards.open_dataset(data, SEQ, 1337)
    # In the words of the step loop's check (the same error, found earlier).
    with pytest.raises(shards.BadTokens, match=r"the train split holds token id 256 at token position 100 \(token "
                                               r"100 of shard train_000000.bin\), outside the tokenizer's "
                                               r"vocabulary 0..255"):
        ds.unigram_entropy()


# ---- out-of-vocabulary ids: a run, every layout -------------------------------------------------

RUNNER = ("import sys; from ringpipe.engine.data import shards; shards.ShardDataset.UNIGRAM_LIMIT_BYTES = 64; "
          "from ringpipe.engine.train.cli import main; sys.argv[0] = 'ringpipe train'; main()")


def cli_run(data, out, ranks=1, extra=(), timeout=240):
    """`ringpipe train` in a subprocess (under mpiexec when ranks > 1), with the start-up
    histogram cut to the first 32 tokens so a late bad id is found only by the step loop."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k not in ("quiet", "overwrite")]
    cmd = [sys.executable, "-c", RUNNER, "--data", data, *flags, "--out", out, *extra]
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        if not os.path.exists(mpiexec):
            pytest.skip("no mpiexec next to this python")
        cmd = [mpiexec, "-n", str(ranks), *cmd]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def error_line(r):
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, f"rc {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    return lines[0]


@pytest.fixture(scope="module")
def late_bad(tmp_path_factory):
    folder = tmp_path_factory.mktemp("late-bad")
    pos = late_bad_position()
    data = make_data(str(folder / "data"), train=bad_train(pos))
    return str(folder), data, pos


@pytest.fixture(scope="module")
def one_rank(late_bad):
    folder, data, pos = late_bad
    return cli_run(data, os.path.join(folder, "one"))


def test_a_late_bad_id_stops_one_rank_with_exit_2_before_the_step_that_would_use_it(one_rank, late_bad):
    folder, data, pos = late_bad
    assert one_rank.returncode == 2, one_rank.stderr[-3000:]
    line = error_line(one_rank)
    assert f"the train split holds token id 300 at token position {pos:,}" in line
    assert "stopped after step 2" in line and "Traceback" not in one_rank.stderr
    # Nothing lost: the two good steps are in a checkpoint and in the metrics.
    assert os.path.exists(os.path.join(folder, "one", "checkpoints", "ckpt_00000002.json"))
    with open(os.path.join(folder, "one", "metrics.jsonl")) as fh:
        assert [json.loads(line)["step"] for line in fh] == [1, 2]


@pytest.mark.parametrize("layout", [["--dp", "2"], ["--pp", "2", "--microbatches", "2"], ["--tp", "2"]],
                         ids=["dp2", "pp2", "tp2"])
def test_a_late_bad_id_stops_every_layout_with_the_same_message(one_rank, late_bad, layout):
    folder, data, pos = late_bad
    r = cli_run(data, os.path.join(folder, "-".join(layout)), ranks=2, extra=layout)
    assert r.returncode == 2, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert error_line(r) == error_line(one_rank)


def test_a_bad_id_in_the_first_batch_stops_before_any_step(tmp_path):
    pos = int(starts_of(0)[BATCH - 1]) + 3
    data = make_data(str(tmp_path / "d"), train=bad_train(pos))
    r = cli_run(data, str(tmp_path / "out"), ranks=2, extra=["--dp", "2"])
    assert r.returncode == 2, r.stderr[-3000:]
    line = error_line(r)
    assert f"token id 300 at token position {pos:,}" in line and "stopped after" not in line
    assert not os.path.exists(os.path.join(tmp_path, "out", "checkpoints", "ckpt_00000001.json"))


def test_a_bad_id_in_a_validation_batch_stops_before_it_is_used(tmp_path, monkeypatch):
    from mpi4py import MPI
    monkeypatch.setattr(shards.ShardDataset, "UNIGRAM_LIMIT_BYTES", 64)     # past the start-up check

    from ringpipe.engine.train.run import run
    val = np.random.default_rng(1).integers(97, 123, size=VAL_TOKENS)
    val[int(starts_of(0, "val", n=VAL_TOKENS)[0]) + 2] = 999
    data = make_data(str(tmp_path / "d"), val=val)
    out = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"the val split holds token id 999 .*stopped after step 2"):
        run(Config(**dict(TINY, data=data, out=out, eval_every=2)), world=MPI.COMM_SELF)
    assert os.path.exists(os.path.join(out, "checkpoints", "ckpt_00000002.json"))


# ---- a dataset does not change under a run ------------------------------------------------------

def test_a_dataset_replaced_while_open_keeps_reading_the_files_it_opened(tmp_path):
    data = make_data(str(tmp_path / "d"))
    before = shards.open_dataset(data, SEQ, 1337)
    expected = [shards.open_dataset(data, SEQ, 1337).batch(s, BATCH) for s in range(3)]
    # prepare --overwrite swaps a new dataset in by rename: the old inodes stay open.
    make_data(data, train=np.full(TRAIN_TOKENS, 65), val=np.full(VAL_TOKENS, 66))
    for s in range(3):
        x, y = before.batch(s, BATCH)
        assert np.array_equal(x, expected[s][0]) and np.array_equal(y, expected[s][1])
    assert (shards.open_dataset(data, SEQ, 1337).batch(0, BATCH)[0] == 65).all()


def test_a_dataset_holds_prepare_lock_shared_while_it_is_open(tmp_path):
    import fcntl
    data = make_data(str(tmp_path / "d"))
    lock = os.path.join(data, shards.LOCK_NAME)
    open(lock, "w").close()
    ds = shards.open_dataset(data, SEQ, 1337)
    other = os.open(lock, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)       # what a prepare would take
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)           # another run may read too
        fcntl.flock(other, fcntl.LOCK_UN)
        ds.close()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)           # let go with the dataset
        # Held exclusively (a prepare writing): the dataset still opens, saying nothing.
        again = shards.open_dataset(data, SEQ, 1337)
        assert again._lock_fd is None
    finally:
        os.close(other)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_lock_that_is_not_a_regular_file_is_ignored_without_blocking(tmp_path, kind):
    data = make_data(str(tmp_path / "d"))
    lock = os.path.join(data, shards.LOCK_NAME)
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "symlink":
        open(os.path.join(data, "elsewhere"), "w").close()
        os.symlink("elsewhere", lock)
    else:
        os.mkdir(lock)
    with deadline(10):
        assert shards.hold_dataset(data) is None
        shards.open_dataset(data, SEQ, 1337).batch(0, BATCH)


# ---- data.json read safely ----------------------------------------------------------------------




@pytest.mark.parametrize("kind,words", [
    ("fifo", "named pipe"), ("dev-zero", "character device"), ("deep", "nested too deeply"),
    ("huge", "bytes, more than"), ("not-utf8", "not UTF-8")])
def test_a_manifest_that_is_not_one_is_refused_naming_it(tmp_path, kind, words):
    data = make_data(str(tmp_path / "d"))
    path = os.path.join(data, shards.MANIFEST_NAME)
    os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "deep":
        with open(path, "w") as fh:
            fh.write("[" * 200000 + "]" * 200000)
    elif kind == "huge":
        with open(path, "wb") as fh:
            fh.truncate(shards.MANIFEST_LIMIT_BYTES + 1)
    else:
        with open(path, "wb") as fh:
            fh.write(b'{"format": "\xff"}')
    with deadline(20), pytest.raises(ValueError) as e:
        shards.open_dataset(data, SEQ, 1337)
    assert path in str(e.value) and words in str(e.value) and "prepare the data again" in str(e.value)


# ---- a shard listed twice ----------------------------------------------------------------------

def _edit_manifest(data, edit):
    path = os.path.join(data, shards.MANIFEST_NAME)
    with open(path) as fh:
        m = json.load(fh)
    edit(m)
    shards.write_manifest(data, m)


def _both_splits(m):
    m["splits"]["val"]["shards"][0] = m["splits"]["train"]["shards"][1]
    m["splits"]["val"]["tokens"] = 1500 + 300


def _twice_in_train(m):
    m["splits"]["train"]["shards"] = [m["splits"]["train"]["shards"][0]] * 2
    m["splits"]["train"]["tokens"] = 3000


@pytest.mark.parametrize("edit,words", [(_both_splits, "listed in splits.val and already in splits.train"),
                                        (_twice_in_train, "listed in splits.train and already in splits.train")])
def test_a_shard_listed_twice_is_refused(tmp_path, edit, words):
    data = make_data(str(tmp_path / "d"))
    _edit_manifest(data, edit)
    with pytest.raises(ValueError, match=words):
        shards.read_manifest(data)


def test_one_file_under_two_names_is_refused(tmp_path):
    data = make_data(str(tmp_path / "d"), shards_per_split=2)
    os.remove(os.path.join(data, "val_000001.bin"))
    os.link(os.path.join(data, "train_000000.bin"), os.path.join(data, "val_000001.bin"))
    _edit_manifest(data, lambda m: m["splits"]["val"].update(tokens=300 + 1500))
    with pytest.raises(ValueError, match="val_000001.bin is listed in splits.val and already in splits.train "
                                         r"\(as train_000000.bin\)"):
        shards.read_manifest(data)


# ---- a resume on prepared data ------------------------------------------------------------------

def test_a_resume_on_the_same_prepared_folder_notes_no_change_of_data(tmp_path, capsys):
    from mpi4py import MPI

    from ringpipe.engine.train.run import run
    data = make_data(str(tmp_path / "d"))
    out = str(tmp_path / "out")
    settings = dict(TINY, quiet=False, out=out, checkpoint_every=2)
    run(Config(**dict(settings, data=data, steps=2)), world=MPI.COMM_SELF)
    capsys.readouterr()
    link = str(tmp_path / "link")
    os.symlink(data, link)                      # the same folder by another name: still the same data
    run(Config(**dict(settings, data=link, steps=4, resume="auto", overwrite=False)), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    assert "resumed from" in said and "no longer as that run would have" not in said
    # Another folder is noted, naming both.
    other = make_data(str(tmp_path / "other"))
    run(Config(**dict(settings, data=other, steps=6, resume="auto", overwrite=False)), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    assert f"resuming with data {other} where the checkpoint's run had {os.path.realpath(data)}" in said


def test_a_bad_id_in_the_batch_balanced_partitioning_measures_on_rank_0_stops_every_rank(tmp_path):
    """--partition balanced times the layers on pipeline rank 0 alone, on rows of batch 0.
    A bad id there crashed rank 0 with an IndexError traceback (exit 1); refused by the
    batch check on rank 0 alone, rank 1 would wait in the broadcast of the costs forever."""
    pos = max(int(starts_of(0)[0]) + 3, 70)
    if not int(starts_of(0)[0]) <= pos <= int(starts_of(0)[0]) + SEQ:
        pytest.skip("batch 0's first row starts before the start-up check's end")
    data = make_data(str(tmp_path / "d"), train=bad_train(pos))
    r = cli_run(data, str(tmp_path / "out"), ranks=2,
                extra=["--pp", "2", "--microbatches", "2", "--partition", "balanced"], timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"token id 300 at token position {pos:,}" in error_line(r)


@pytest.fixture(scope="module")
def val_bad(tmp_path_factory):
    """A bad id in validation batch 0's last row (the second replica's under --dp 2), past
    the start-up check; evaluation after step 2 reads it."""
    folder = tmp_path_factory.mktemp("val-bad")
    val = np.random.default_rng(1).integers(97, 123, size=VAL_TOKENS)
    pos = int(starts_of(0, "val", n=VAL_TOKENS)[BATCH - 1]) + SEQ
    if pos < 64:
        pytest.skip("validation batch 0's last row is inside the start-up check")
    val[pos] = 4000
    return str(folder), make_data(str(folder / "data"), val=val), pos


@pytest.mark.parametrize("layout", [[], ["--dp", "2"], ["--pp", "2", "--microbatches", "2"]], ids=["one", "dp2", "pp2"])
def test_a_bad_id_in_a_validation_batch_stops_every_layout_alike(val_bad, layout):
    folder, data, pos = val_bad
    r = cli_run(data, os.path.join(folder, "-".join(layout) or "one"), ranks=2 if layout else 1,
                extra=["--eval-every", "2", *layout])
    assert r.returncode == 2, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    line = error_line(r)
    assert f"the val split holds token id 4000 at token position {pos:,}" in line and "after step 2" in line
    expected = os.path.join(folder, "expected-line")
    if not layout:
        with open(expected, "w") as fh:
            fh.write(line)
    elif os.path.exists(expected):
        with open(expected) as fh:
            assert line == fh.read()


def test_a_run_lets_go_of_the_data_folder_when_it_ends(tmp_path, monkeypatch):
    """Also when it ends in an error whose traceback (held by the caller) keeps the
    run's objects alive: the lock is let go by the run, not by the garbage collector."""
    import fcntl

    from mpi4py import MPI

    from ringpipe.engine.train.run import run
    monkeypatch.setattr(shards.ShardDataset, "UNIGRAM_LIMIT_BYTES", 64)
    data = make_data(str(tmp_path / "d"), train=bad_train(late_bad_position()))
    lock = os.path.join(data, shards.LOCK_NAME)
    open(lock, "w").close()
    with pytest.raises(ConfigError, match="token id 300") as failed:
        run(Config(**dict(TINY, data=data, out=str(tmp_path / "out"))), world=MPI.COMM_SELF)
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)        # a prepare may replace it now
    finally:
        os.close(fd)
    assert failed.value is not None
