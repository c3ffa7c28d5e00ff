"""`ringpipe prepare` under abuse (issue 20): two prepares into one folder, a prepare
stopped (SIGKILL, Ctrl-C, a failed write) while it replaces a dataset, foreign shards
in --out, symbolic links out of the input folders, a folder that cannot be read, a
full disk. Each test fails on the prepare before these fixes."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from ringpipe.engine.data import outfolder, prepare_job, shards
from ringpipe.engine.data import prepare as prep
from ringpipe.engine.data import tokenizer as tokenizers
from tests.support import ROOT
from tests.support.hostile import tmpfs

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RAYON_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def make(tmp_path, name, text, out="d", **kw):
    """A dataset of `text` (one .txt file called `name`) in tmp_path/out."""
    src = tmp_path / name
    src.write_text(text)
    return prep.prepare([str(src)], tmp_path / out, progress=False, **kw)


def which(folder):
    """The input file names of the valid dataset in `folder`, or None (none, or not valid)."""
    try:
        m = shards.read_manifest(str(folder))
    except ValueError:
        return None
    return sorted(os.path.basename(s["path"]) for s in m["sources"])


def lock_is_free(folder):
    fd = os.open(os.path.join(folder, "prepare.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def no_parts_left(folder):
    return not [n for n in os.listdir(folder) if n.startswith(prep.PARTS_PREFIX)]


# ---- 1. one prepare owns --out ------------------------------------------------------------------

@pytest.mark.parametrize("holder", ["prepare", "training", "a lock naming pid 10^20"])
def test_a_prepare_is_refused_while_another_prepare_or_a_training_run_holds_the_folder(tmp_path, holder):
    make(tmp_path, "old.txt", "old text " * 300)
    fd = os.open(tmp_path / "d" / "prepare.lock", os.O_RDWR)
    try:
        if holder == "prepare":          # another prepare: LOCK_EX, its name in the file
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now",
                                      "command": "ringpipe prepare other"}).encode(), 0)
            said = f"pid {os.getpid()}, running"
        elif holder != "training":       # what the file says is not trusted (os.kill would overflow)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": 10**20}).encode(), 0)
            said = "no longer running"
        else:                            # a training run reading the data: LOCK_SH (shards.hold_dataset)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            said = "a training run reads the dataset"
        with pytest.raises(ValueError, match="is in use") as e:
            make(tmp_path, "new.txt", "new text " * 300, overwrite=True)
        assert said in str(e.value) and "choose another --out" in str(e.value)
    finally:
        os.close(fd)
    assert which(tmp_path / "d") == ["old.txt"] and no_parts_left(tmp_path / "d")
    make(tmp_path, "new.txt", "new text " * 300, overwrite=True)              # free again: it goes ahead
    assert which(tmp_path / "d") == ["new.txt"]


def test_the_lock_of_a_killed_prepare_is_taken_over_and_the_lock_file_stays(tmp_path):
    os.makedirs(tmp_path / "d")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "d" / "prepare.lock").write_text(json.dumps({"host": socket.gethostname(),
                                                             "pid": int(dead.stdout), "started": "then"}))
    make(tmp_path, "a.txt", "text " * 300)
    assert which(tmp_path / "d") == ["a.txt"]
    assert (tmp_path / "d" / "prepare.lock").read_text() == "" and lock_is_free(tmp_path / "d")


def test_two_prepares_at_once_into_one_folder_one_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(40):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 3000)
    cmd = [sys.executable, "-m", "ringpipe.engine.data.prepare", "in", "--out", "d", "--quiet",
           "--tokens-per-shard", "20000"]
    runs = [subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in runs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results                  # the second waits for no one: it is refused, or finds the first's
    assert any("is in use" in err or "already holds a dataset" in err for _, err in results), results
    assert which(tmp_path / "d") is not None
    m = shards.read_manifest(str(tmp_path / "d"))
    named = set(m["splits"]["train"]["shards"] + m["splits"]["val"]["shards"])
    assert {n for n in os.listdir(tmp_path / "d") if shards.SHARD_NAME.match(n)} == named   # no shard of the other


# ---- 2. a stopped --overwrite leaves a whole dataset ------------------------------------------------

_FS_CALLS = ("replace", "rename", "link", "remove", "mkdir", "rmdir", "fsync", "write")


def _fail_at(set_attr, k, fail):
    """Make the k-th filesystem call (of _FS_CALLS, counted together) call fail(). set_attr:
    monkeypatch.setattr, or plain setattr in a forked child that never returns."""
    count = [0]
    for name in _FS_CALLS:
        real = getattr(os, name)

        def wrapper(*a, _real=real, **kw):
            count[0] += 1
            if count[0] == k:
                fail()
            return _real(*a, **kw)
        set_attr(os, name, wrapper)
    return count


@pytest.mark.parametrize("how", ["error", "ctrl-c"])
def test_a_failure_at_any_step_of_an_overwrite_leaves_the_old_dataset(tmp_path, monkeypatch, how):
    """Fail the 1st, 2nd, ... filesystem call of `prepare --overwrite` (an I/O error, or
    Ctrl-C's KeyboardInterrupt) until one run gets through: after each, OUT holds the old
    dataset whole, the lock is free, no parts folder is left."""
    (tmp_path / "new.txt").write_text("new text " * 2000)
    d = tmp_path / "d"

    def fail():
        if how == "error":
            raise OSError(errno.EIO, "Input/output error")
        raise KeyboardInterrupt
    for k in range(1, 400):
        make(tmp_path, "old.txt", "old text " * 3000, tokens_per_shard=5000, overwrite=True)
        with monkeypatch.context() as m:
            count = _fail_at(m.setattr, k, fail)
            try:
                prep.prepare([str(tmp_path / "new.txt")], d, overwrite=True, progress=False, tokens_per_shard=5000)
                failed = False
            except (ValueError, KeyboardInterrupt):
                failed = True
        if failed and how == "ctrl-c" and which(d) == ["new.txt"]:
            assert not os.path.exists(d / "previous"), k          # interrupted once the swap was done: the new one
        elif failed:
            assert which(d) == ["old.txt"] or which(d / "previous") == ["old.txt"], k
        else:                        # got through, or the failure hit the best-effort cleanup after the swap
            assert which(d) == ["new.txt"], k
        # (a parts folder may stay when the failure hit its removal: the next run clears it)
        assert not os.path.exists(d / "prepare.lock") or lock_is_free(d), k
        if count[0] < k:
            assert not os.path.exists(d / "previous") and no_parts_left(d)
            assert sorted(n for n in os.listdir(d) if n.endswith(".bin")) == [
                "train_000000.bin", "train_000001.bin", "train_000002.bin", "train_000003.bin", "val_000000.bin"]
            break
    else:
        pytest.fail("prepare never got through")
    assert k > 5                                                    # the failures did hit the writes and the swap


@pytest.mark.parametrize("links", [True, False])
def test_a_kill_at_any_step_of_the_swap_leaves_a_whole_dataset_findable(tmp_path, links):
    """SIGKILL (no cleanup runs) at each filesystem call of the swap, in a forked child.
    With hard links, OUT or OUT/previous/ holds a whole dataset at every instant. Without
    (some FUSE mounts: the old files are moved aside instead, data.json first), not at every
    instant; either way the next prepare undoes the killed swap from its journal
    (previous/swap.json), giving back the old dataset whole (or keeps the new one, if the
    kill came once it was in place), and leaves no file of either behind."""
    (tmp_path / "new.txt").write_text("new text " * 2000)
    for k in range(1, 60):
        d = tmp_path / f"d{k}"
        make(tmp_path, "old.txt", "old text " * 3000, out=d.name, tokens_per_shard=5000)
        pid = os.fork()
        if pid == 0:                                                # the child: dies at call k of the swap
            try:
                real_install = outfolder.OutFolder.install

                def install(self, manifest, tok):
                    if not links:
                        def no_link(*a, **kw):
                            raise OSError(errno.EPERM, "Operation not permitted")
                        os.link = no_link
                    _fail_at(setattr, k, lambda: os.kill(os.getpid(), signal.SIGKILL))
                    return real_install(self, manifest, tok)
                outfolder.OutFolder.install = install
                prep.prepare([str(tmp_path / "new.txt")], d, overwrite=True, progress=False, tokens_per_shard=5000)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        if links:
            assert (which(d) or which(d / "previous")) in (["old.txt"], ["new.txt"]), (k, os.listdir(d))
        if os.WIFEXITED(status):                                    # the swap got through before call k
            assert which(d) == ["new.txt"] and not os.path.exists(d / "previous")
            break
        # The next prepare finishes or undoes what the killed one left: without --overwrite
        # it is refused, and OUT then holds the old dataset or (killed once it was in) the new.
        with pytest.raises(ValueError, match="already holds a dataset"):
            prep.prepare([str(tmp_path / "new.txt")], d, progress=False)
        assert which(d) in (["old.txt"], ["new.txt"]), (k, os.listdir(d))      # previous/ may wait for --overwrite
        prep.prepare([str(tmp_path / "new.txt")], d, overwrite=True, progress=False, tokens_per_shard=5000)
        assert which(d) == ["new.txt"] and not os.path.exists(d / "previous")
        assert sorted(n for n in os.listdir(d) if n.endswith(".bin")) == [
            "train_000000.bin", "train_000001.bin", "train_000002.bin", "train_000003.bin", "val_000000.bin"], k
    else:
        pytest.fail("the swap never got through")


def test_sigkill_at_random_moments_of_the_command_leaves_a_whole_dataset(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(30):
        (tmp_path / "in" / f"{i}.txt").write_text(f"new document {i} " * 2000)
    rng = random.Random(20)
    for attempt in range(4):
        d = tmp_path / f"d{attempt}"
        make(tmp_path, "old.txt", "old text " * 3000, out=d.name, tokens_per_shard=5000)
        p = subprocess.Popen([sys.executable, "-m", "ringpipe.engine.data.prepare", "in", "--out", d.name, "--quiet",
                              "--overwrite", "--tokens-per-shard", "5000"], cwd=tmp_path, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 2.5))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        assert which(d) is not None or which(d / "previous") == ["old.txt"], os.listdir(d)


# ---- 3. files prepare did not write are never deleted --------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True])
def test_shards_no_manifest_names_are_refused_not_deleted(tmp_path, overwrite):
    os.makedirs(tmp_path / "d")
    shards.write_shard(str(tmp_path / "d" / "train_000000.bin"), list(range(100)), 256)   # llm.c's, or a lost manifest
    (tmp_path / "d" / "notes.txt").write_text("mine")
    before = (tmp_path / "d" / "train_000000.bin").read_bytes()
    with pytest.raises(ValueError, match="train_000000.bin, which no data.json there names"):
        make(tmp_path, "a.txt", "text " * 300, overwrite=overwrite)
    assert (tmp_path / "d" / "train_000000.bin").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "d")) == ["notes.txt", "prepare.lock", "train_000000.bin"]


def test_overwrite_replaces_only_the_files_the_manifest_names(tmp_path):
    make(tmp_path, "old.txt", "old text " * 3000, tokens_per_shard=5000)
    (tmp_path / "d" / "notes.txt").write_text("mine")
    (tmp_path / "d" / "train.bin").write_bytes(b"\0" * 64)          # nanoGPT's, beside it
    make(tmp_path, "new.txt", "new", overwrite=True)
    assert sorted(os.listdir(tmp_path / "d")) == ["data.json", "notes.txt", "prepare.lock", "tokenizer.json",
                                                  "train.bin", "train_000000.bin", "val_000000.bin"]
    assert which(tmp_path / "d") == ["new.txt"]


# ---- 4. symbolic links out of an input folder ------------------------------------------------------

def _linked_inputs(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "outside" / "dir").mkdir(parents=True)
    (tmp_path / "in" / "ok.txt").write_text("fine text " * 100)
    (tmp_path / "outside" / "secret.txt").write_text("a secret " * 100)
    (tmp_path / "outside" / "dir" / "x.txt").write_text("more secret " * 100)
    os.symlink(tmp_path / "outside" / "secret.txt", tmp_path / "in" / "secret.txt")
    os.symlink(tmp_path / "outside" / "dir", tmp_path / "in" / "linked")
    os.symlink(tmp_path / "in", tmp_path / "in" / "loop")                       # back up: never walked twice
    return str(tmp_path / "in")


def test_symlinks_out_of_an_input_folder_are_skipped_and_said(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _linked_inputs(tmp_path)
    m = prep.prepare(["in"], "d", progress=False)
    assert [s["path"] for s in m["sources"]] == [os.path.join("in", "ok.txt")]
    assert m["skipped"]["links"] == 2
    text = prep.summary(m, "d", 1.0)
    assert "2 symbolic link(s) out of the input folders skipped" in text and "--follow-symlinks" in text
    m = prep.prepare(["in"], "d2", progress=False, follow_symlinks=True)
    assert sorted(s["path"] for s in m["sources"]) == [os.path.join("in", "linked", "x.txt"),
                                                       os.path.join("in", "ok.txt"), os.path.join("in", "secret.txt")]
    m = prep.prepare([os.path.join("in", "secret.txt")], "d3", progress=False)     # named: the user's choice
    assert [s["path"] for s in m["sources"]] == [os.path.join("in", "secret.txt")]
    m = prep.prepare([os.path.join("in", "linked")], "d4", progress=False)        # a linked folder, named: read
    assert [s["path"] for s in m["sources"]] == [os.path.join("in", "linked", "x.txt")]
    assert "--follow-symlinks" in subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", "--help"],
                                                 env=ENV, capture_output=True, text=True).stdout


# ---- 5. a folder that cannot be read ----------------------------------------------------------------

def test_an_unreadable_subfolder_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "in" / "locked").mkdir(parents=True)
    (tmp_path / "in" / "ok.txt").write_text("fine text " * 100)
    (tmp_path / "in" / "locked" / "a.txt").write_text("hidden text " * 100)
    real = os.scandir

    def scandir(path="."):          # chmod 000 does not stop root: what os.walk sees when it is not root
        if isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith("locked"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(ValueError, match=r"input folder .*locked cannot be read \(Permission denied\)"):
        prep.prepare([str(tmp_path / "in")], tmp_path / "d", progress=False)
    assert not os.path.exists(tmp_path / "d")


# ---- 6. a full disk ---------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["shard", "tokenizer"])
def test_a_full_disk_names_the_file_and_leaves_the_old_dataset(tmp_path, monkeypatch, where):
    make(tmp_path, "old.txt", "old text " * 3000, tokens_per_shard=5000)

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    if where == "shard":
        monkeypatch.setattr(shards.ShardWriter, "write", full)
    else:
        monkeypatch.setattr(tokenizers.Tokenizer, "save", full)
    with pytest.raises(ValueError) as e:
        make(tmp_path, "new.txt", "new text " * 300, overwrite=True)
    message = str(e.value)
    assert message.startswith("disk full writing ") and "MB free" in message, message
    assert ("train_000000.bin" in message) if where == "shard" else True, message
    assert "free space" in message and "unchanged" in message, message
    assert which(tmp_path / "d") == ["old.txt"] and no_parts_left(tmp_path / "d") and lock_is_free(tmp_path / "d")


# ---- 7. Ctrl-C ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["tokenizing", "writing shards"])
def test_ctrl_c_releases_the_lock_removes_the_parts_and_keeps_the_old_dataset(tmp_path, monkeypatch, when):
    make(tmp_path, "old.txt", "old text " * 3000, tokens_per_shard=5000)

    def interrupt(*a, **kw):
        raise KeyboardInterrupt
    if when == "tokenizing":
        monkeypatch.setattr(prepare_job, "tokenize_source", interrupt)
    else:
        monkeypatch.setattr(shards.ShardWriter, "write", interrupt)
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path, "new.txt", "new text " * 300, overwrite=True)
    assert which(tmp_path / "d") == ["old.txt"] and no_parts_left(tmp_path / "d") and lock_is_free(tmp_path / "d")


@pytest.mark.parametrize("new_bytes", [150_000, 400_000])      # fills the disk writing the shards / the parts
def test_a_really_full_disk_is_refused_naming_the_file_and_the_old_dataset_stays(tmp_path, new_bytes):
    disk = tmpfs(tmp_path / "disk", "600k")
    try:
        (tmp_path / "old.txt").write_text("old text " * 5000)          # 45 KB: 90 KB of uint16 shards
        (tmp_path / "new.txt").write_text("n" * new_bytes)
        out = str(disk / "d")
        prep.prepare([str(tmp_path / "old.txt")], out, progress=False)
        r = subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", str(tmp_path / "new.txt"), "--out", out,
                            "--overwrite", "--quiet"], env=ENV, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"error: disk full writing {out}/" in r.stderr and "MB free" in r.stderr, r.stderr
        assert "free space" in r.stderr and "unchanged" in r.stderr, r.stderr
        assert which(out) == ["old.txt"] and no_parts_left(out) and lock_is_free(out)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---- 7. Ctrl-C on one rank of two -------------------------------------------------------------------

def _rank_pid(launcher_pid, rank, timeout=30):
    """The pid of MPI rank `rank` among the launcher's descendants (PMI_RANK in its environment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        for pid in parents:
            up = pid
            while up in parents and up != launcher_pid:
                up = parents[up]
            if up != launcher_pid or pid == launcher_pid:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    if f"PMI_RANK={rank}".encode() in fh.read().split(b"\0") and \
                            b"ringpipe.engine.data.prepare" in open(f"/proc/{pid}/cmdline", "rb").read():
                        return pid
            except OSError:
                pass
        time.sleep(0.2)
    pytest.fail(f"no rank {rank} under the launcher {launcher_pid}")


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
                    reason="no mpiexec next to this python")
def test_ctrl_c_on_one_rank_of_two_ends_the_job_and_the_old_dataset_stays(tmp_path):
    make(tmp_path, "old.txt", "old text " * 3000)
    (tmp_path / "in").mkdir()
    for i in range(30):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 20000)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    p = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "ringpipe.engine.data.prepare", "in", "--out", "d",
                          "--overwrite", "--quiet", "--tokenizer", "bpe:300", "--tokens-per-shard", "100000"],
                         cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while no_parts_left(tmp_path / "d") and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)                                          # rank 0 holds the folder: the work began
        time.sleep(1.0)
        assert p.poll() is None, "prepare ended before it could be interrupted: give it more to do"
        os.kill(_rank_pid(p.pid, 1), signal.SIGINT)
        code = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("a Ctrl-C on rank 1 left the job running (the other rank waits forever)")
    assert code != 0, p.stderr.read()
    assert which(tmp_path / "d") == ["old.txt"] and not os.path.exists(tmp_path / "d" / "previous")
    # What the killed ranks left (the parts folder, the lock file naming rank 0) the next prepare clears.
    r = subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", str(tmp_path / "old.txt"), "--out", "d",
                        "--overwrite"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert no_parts_left(tmp_path / "d") and lock_is_free(tmp_path / "d")


def test_ctrl_c_on_the_command_says_which_dataset_out_holds(tmp_path):
    make(tmp_path, "old.txt", "old text " * 3000)
    (tmp_path / "in").mkdir()
    for i in range(30):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 20000)
    p = subprocess.Popen([sys.executable, "-m", "ringpipe.engine.data.prepare", "in", "--out", "d", "--overwrite",
                          "--quiet", "--tokenizer", "bpe:300"], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while no_parts_left(tmp_path / "d") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert p.poll() is None, "prepare ended before it could be interrupted: give it more to do"
    p.send_signal(signal.SIGINT)
    code, err = p.wait(timeout=60), p.stderr.read()
    assert code == 130 and "holds the dataset it held before" in err and "Traceback" not in err, err
    assert which(tmp_path / "d") == ["old.txt"] and no_parts_left(tmp_path / "d") and lock_is_free(tmp_path / "d")


def test_the_summary_says_a_dataset_was_replaced_and_help_says_how(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text " * 300)
    args = [str(tmp_path / "a.txt"), "--out", str(tmp_path / "d")]
    r = subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", *args], env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "replaced the dataset" not in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "ringpipe.engine.data.prepare", *args, "--overwrite"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "replaced the dataset that was in" in r.stdout and "previous" in r.stdout, r.stdout
    assert prep.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--follow-symlinks", "DATA_DIR/previous/", "prepare.lock", "only the files its data.json names"):
        assert words in text, words


def test_overwrite_is_refused_while_a_training_run_has_the_dataset_open(tmp_path):
    make(tmp_path, "old.txt", "old text " * 3000)
    dataset = shards.open_dataset(str(tmp_path / "d"), seq_len=16, seed=0)     # holds prepare.lock shared
    try:
        with pytest.raises(ValueError, match="is in use .*a training run reads the dataset"):
            make(tmp_path, "new.txt", "new text " * 300, overwrite=True)
    finally:
        dataset.close()
    make(tmp_path, "new.txt", "new text " * 300, overwrite=True)
    assert which(tmp_path / "d") == ["new.txt"]


def test_a_link_to_another_file_of_the_folder_is_named_as_such(tmp_path):
    # Not "given twice ... from the inputs you passed": only the folder was passed.
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("the same text\n" * 50)
    os.symlink("a.txt", folder / "b.txt")
    with pytest.raises(ValueError, match=r"b.txt is the same file as .*a.txt.*remove the link"):
        prep.prepare([str(folder)], tmp_path / "out", progress=False)


def test_settings_without_effect_are_refused_or_said(tmp_path, capsys):
    # --bpe-train-mb with a tokenizer that trains nothing was silently ignored: refused.
    (tmp_path / "a.txt").write_text("some text\n" * 300)
    with pytest.raises(ValueError, match="--bpe-train-mb applies only to --tokenizer bpe:VOCAB"):
        prep.prepare([str(tmp_path / "a.txt")], tmp_path / "d1", bpe_train_mb=5, progress=False)
    assert not (tmp_path / "d1").exists()
    # --follow-symlinks with no folder among the inputs has nothing to follow: said, not silent.
    prep.prepare([str(tmp_path / "a.txt")], tmp_path / "d2", follow_symlinks=True)
    assert "--follow-symlinks has no effect here" in capsys.readouterr().err
