"""`ringpipe prepare --out`, held by rank 0 for the whole run: OUT/prepare.lock flock'd
exclusively (refused while another prepare, or a training run holding it shared, uses
the folder), what the folder holds checked (a dataset replaced only under --overwrite,
shards no data.json names never), the temporary parts folder, and at the end the new
dataset swapped in (engine/data/swap.py). The parts folder is removed and the lock
released however the run ends (the lock file stays, emptied: training runs lock it too).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time

from ringpipe.engine.job import files
from ringpipe.engine.data import shards, swap
from ringpipe.engine.data.errors import PrepareError

PARTS_PREFIX = ".prepare-parts-"
# flock() is not offered by every cluster filesystem (Lustre without -o flock, some FUSE mounts).
LOCK_NAME = shards.LOCK_NAME        # OUT/prepare.lock: flock'd by the prepare writing OUT, shared by training runs
STAGING_NAME = "dataset"           # PARTS/dataset/: the new dataset, complete, before it is swapped in


def write_error(e: OSError, out: str, path: str | None = None) -> PrepareError:
    """A failed write as a refusal naming the file and what to do; the old dataset is untouched
    (the new one is built in the parts folder, and only renames touch OUT's dataset)."""
    path = path or e.filename or out
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        from ringpipe.engine.job.rundir import free_mb
        free = free_mb(out)
        free = "free space unknown" if free != free else f"{free:.0f} MB free"
        why = f"disk full writing {path} ({free})"
        todo = ("free space (prepare needs room for the new dataset beside the old one, and about as much again "
                "for its temporary parts) or choose another --out")
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"cannot write {path} ({'read-only filesystem' if e.errno == errno.EROFS else 'permission denied'})"
        todo = "make --out writable or choose another --out"
    else:
        why = f"cannot write {path} ({e.strerror or e})"
        todo = "fix the cause or choose another --out"
    return PrepareError(f"{why}: {todo}, then prepare again; the dataset already in {out} (if any) is unchanged")


class OutFolder:
    """Rank 0's hold on --out for the whole run: the lock, the parts folder, and the
    swap of the new dataset for the old one.

    Only the files a manifest names are the dataset (data.json, its tokenizer, its
    shards): prepare replaces those and never deletes any other file in OUT. The new
    dataset is written whole into PARTS/dataset/ first; the swap (`install`) then only
    renames, so at every instant OUT or OUT/previous/ holds a complete dataset."""

    def __init__(self, out: str, overwrite: bool):
        self.out, self.overwrite = out, overwrite
        self.made = False                    # OUT did not exist: a refusal removes it again
        self.parts_dir = None
        self.old: list[str] = []             # the old dataset's files, data.json last
        self._lock_fd = None
        self._lock_tries = 0

    @property
    def staging(self) -> str:
        return os.path.join(self.parts_dir, STAGING_NAME)

    # ---- taking the folder ----------------------------------------------------------
    def open(self) -> list[str]:
        """Lock OUT, check what it holds, make the parts folder. Returns notes for the user."""
        out = self.out
        if os.path.lexists(out) and not os.path.isdir(out):
            raise PrepareError(f"--out {out} exists and is not a folder; choose another --out")
        self.made = not os.path.exists(out)
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise PrepareError(f"--out {out} cannot be made ({e.strerror or e}); choose another --out") from None
        try:
            notes = self._lock()
            notes += self._check_contents()
            self.parts_dir = tempfile.mkdtemp(prefix=PARTS_PREFIX, dir=out)
            os.mkdir(self.staging)
        except OSError as e:
            self.close()
            raise PrepareError(f"--out {out} cannot be written ({e.strerror or e}); choose another --out") from None
        except BaseException:
            self.close()
            raise
        return notes

    def _lock(self) -> list[str]:
        """OUT/prepare.lock, flock'd exclusively until close(): one prepare writes OUT at a
        time, and none while a training run holds it shared (it reads the shards). The
        kernel drops a flock when its process dies, so a lock left by a killed prepare is
        taken over; the file stays (training locks it too) and names its last owner."""
        path = os.path.join(self.out, LOCK_NAME)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if os.path.islink(path):
                raise PrepareError(f"{path} is a symbolic link, not prepare's lock file; remove it") from None
            raise PrepareError(f"--out {self.out}: cannot open its lock file {path} ({e.strerror or e}); "
                               "make the folder writable or choose another --out") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise PrepareError(f"{path} is {files.file_kind(mode)}, not prepare's lock file; remove it")
        notes = []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = files.read_lock_owner(fd, LOCK_NAME)
            os.close(fd)
            raise PrepareError(f"--out {self.out} is in use ({_describe_lock_owner(owner)}); a prepare writing "
                               "it now would mix two datasets or pull the shards from under a training run. Wait "
                               "for it to end or stop it, or choose another --out") from None
        except OSError as e:
            if e.errno not in files.NO_LOCKING:
                os.close(fd)
                raise
            notes.append(f"the filesystem of {self.out} does not support file locks ({e.strerror}): a second "
                         "prepare, or a training run, on the same folder would not be detected")
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if not same:
            # A prepare that made OUT and was refused removes it again, lock file and all;
            # a lock taken on the removed file guards nothing: take the one there now.
            os.close(fd)
            if self._lock_tries >= 3:
                raise PrepareError(f"--out {self.out}: its lock file {path} keeps being removed; is another "
                                   "program clearing the folder? choose another --out")
            self._lock_tries += 1
            return self._lock()
        owner = files.read_lock_owner(fd, LOCK_NAME)
        if owner:
            notes.append(f"took over the lock of a prepare that did not end cleanly ({_describe_lock_owner(owner)})")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._lock_fd = fd
        return notes

    def _check_contents(self) -> list[str]:
        """Refuse what this run may not replace; find the old dataset's files; clear what a
        killed prepare left (safe: we hold the lock, so no live prepare uses it)."""
        out, notes = self.out, []
        manifest = os.path.join(out, shards.MANIFEST_NAME)
        previous = os.path.join(out, swap.PREVIOUS_NAME)
        has_manifest = os.path.lexists(manifest)
        restored = ""
        if os.path.lexists(os.path.join(previous, shards.MANIFEST_NAME)) and not has_manifest:
            restored = swap.restore_previous(out, previous)
            notes.append(restored)
            has_manifest = True
        if has_manifest and not self.overwrite:
            raise PrepareError(f"{restored + '; ' if restored else ''}--out {out} already holds a dataset ({manifest}); "
                               "pass --overwrite to replace it, or choose another --out")
        for name in shards.NANOGPT_NAMES:
            if os.path.exists(os.path.join(out, name)) and not self.overwrite:
                raise PrepareError(f"--out {out} already holds nanoGPT data ({name}); pass --overwrite to write "
                                   "beside it (it is left as it is), or choose another --out")
        if has_manifest:
            self.old = swap.dataset_files(out)
        if has_manifest and os.path.lexists(previous):
            notes += swap.clear_previous(out, previous, self.old)
        foreign = sorted(name for name in os.listdir(out)
                         if (shards.SHARD_NAME.match(name) or name == "tokenizer.json") and name not in self.old)
        if foreign:
            shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
            raise PrepareError(
                f"--out {out} holds {shown}, which no data.json there names (llm.c's shards, or a dataset whose "
                "data.json was lost); prepare writes files of these names and never replaces files it did not "
                f"write{', not even under --overwrite' if self.overwrite else ''}: move them away, or choose "
                "another --out")
        for name in sorted(os.listdir(out)):
            if name.startswith(PARTS_PREFIX):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
                notes.append(f"removed {os.path.join(out, name)}, left by a prepare that did not finish")
        return notes

    # ---- the swap (engine/data/swap.py) ---------------------------------------------
    def install(self, manifest: dict, tok) -> None:
        """The new dataset (shards already in the staging folder) into OUT, the old one
        aside: staging gets tokenizer.json and data.json; the old dataset's files are
        hard-linked into OUT/previous/ (data.json last: it is complete there before OUT's
        goes), OUT/data.json removed, the new files renamed in (data.json last), the old
        shards the new manifest does not name removed, OUT/previous/ removed. If a rename
        fails or Ctrl-C's KeyboardInterrupt comes, the old dataset is put back; if the
        process is killed (SIGKILL, or an MPI abort from another rank's signal), previous/
        holds the old dataset whole and the next prepare says how to restore it. (Blocking
        signals would not help: Python runs its handlers in the main thread whatever the
        thread mask, and engine/job/lifecycle.py's watcher thread aborts the job.)"""
        tok.save(self.staging)
        shards.write_manifest(self.staging, manifest)
        shards.read_manifest(self.staging)               # the new dataset checks out before anything is replaced
        new = manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"] + ["tokenizer.json"]
        swap.swap_in(self.out, self.staging, self.old, new)

    # ---- letting go -----------------------------------------------------------------
    def close(self) -> None:
        """The parts folder removed, the lock released (the lock file stays: training runs
        lock it too; emptied, it means "ended cleanly"); OUT removed again if this run made
        it and wrote nothing into it."""
        try:
            if self.parts_dir is not None:
                parts, self.parts_dir = self.parts_dir, None
                shutil.rmtree(parts, ignore_errors=True)
            if self.made and self._lock_fd is not None:
                # Refused before anything was written: no empty folder left behind. Only while
                # holding the lock (a prepare refused because OUT is in use removes nothing),
                # and the lock file first, so no other prepare can take a lock on it meanwhile.
                self.made = False
                if os.listdir(self.out) == [LOCK_NAME]:
                    os.remove(os.path.join(self.out, LOCK_NAME))
                    os.rmdir(self.out)
        except OSError:
            pass
        finally:                                         # a second Ctrl-C midway must not keep the lock
            self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)                          # emptied: "ended cleanly", for the next one's message
        except OSError:
            pass
        finally:
            os.close(fd)                                 # closing drops the flock


def _describe_lock_owner(owner: dict | None) -> str:
    if not owner:
        # prepare empties the file when it ends; a training run (hold_dataset) writes nothing in it
        return "a training run reads the dataset (ringpipe train --data), or a prepare is starting"
    # A prepare that is gone left its name in the file, while the lock is held: by a training run.
    described = files.describe_lock_owner(owner).replace(
        ", no longer running,", ", no longer running: a training run reads the dataset now,")
    return f"by prepare on {described}"
