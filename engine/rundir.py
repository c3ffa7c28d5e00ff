"""The run directory (`--out`): one run owns it for its whole life.

What a run keeps there:

    OUT/run.lock            who owns the directory now (host, pid, start time)
    OUT/metrics.jsonl       one JSON object per step, whole lines only
    OUT/checkpoints/        ckpt_XXXXXXXX.{npz,json} (engine/checkpoint.py)
    OUT/logs/rank<R>.log    per-rank logs
    OUT/heartbeat/          watchdog heartbeats
    OUT/tokenizer.json      the tokenizer the run's data was prepared with (travels to exports)
    OUT/previous/           the run that was there before a fresh start (--overwrite)

Only world rank 0 takes the lock and touches the shared files, the trainer
shares the outcome with the other ranks. The lock is an flock(2) on
run.lock held until the run ends: the kernel drops it when the process dies,
however it dies, so a lock file left by a killed run is recognised as stale
(the lock can be taken; the file still names the dead run) and taken over.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time

LOCK_NAME = "run.lock"
METRICS_NAME = "metrics.jsonl"
PREVIOUS_NAME = "previous"
# What a run writes into OUT: a fresh start moves exactly these aside, so
# unrelated files a user keeps in the folder are never touched.
DONE_NAME = "finished"             # OUT/finished/rank{R}.json: that rank ran to the end
RUN_ENTRIES = ("checkpoints", METRICS_NAME, "logs", "heartbeat", "tokenizer.json", DONE_NAME)

# flock() is not offered by every cluster filesystem (Lustre mounted without
# -o flock, some FUSE mounts): these errors mean "no locking here".
_NO_LOCKING = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def metrics_path(out_dir: str) -> str:
    return os.path.join(out_dir, METRICS_NAME)


class RunDirError(RuntimeError):
    """The run directory cannot be used (another live run owns it, a full disk, ...)."""


def free_mb(path: str) -> float:
    """Free space of the filesystem holding `path`, in MB (NaN if unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return float("nan")
    return st.f_bavail * st.f_frsize / 1e6


def describe_write_error(e: OSError, folder: str, what: str, intact: str = "") -> str:
    """Why `what` could not be written to `folder`, and what to do (for a full
    disk, how much space is left). `intact` is appended to "was not written"."""
    not_written = f"{what} was not written{intact}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_mb(folder)
        free = "free space unknown" if free != free else f"{free:.0f} MB free"
        return (f"disk full at {folder} ({free}): {not_written}. "
                "Free space or point --out elsewhere, then --resume auto")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "read-only filesystem" if e.errno == errno.EROFS else "permission denied"
        return (f"cannot write to {folder} ({why}): {not_written}. "
                "Make it writable or point --out elsewhere, then --resume auto")
    return f"cannot write to {folder} ({e.strerror or e}): {not_written}"


class RunDir:
    """Rank 0's handle on `--out`."""

    def __init__(self, path: str):
        self.path = path
        self.lock_path = os.path.join(path, LOCK_NAME)
        self._lock_fd: int | None = None

    # ---- ownership -----------------------------------------------------------------
    def lock(self) -> list[str]:
        """Take the run's lock, or raise RunDirError naming the run that holds it.
        Returns notes for the user (a stale lock taken over, no locking here)."""
        notes = []
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunDirError(
                f"--out {self.path} is in use by another run ({_describe_owner(owner)}); two runs in one "
                "directory would mix their checkpoints and metrics. Wait for it to end or stop it, "
                "or pass another --out") from None
        except OSError as e:
            if e.errno not in _NO_LOCKING:
                os.close(fd)
                raise
            notes.append(f"note: the filesystem of {self.path} does not support file locks ({e.strerror}): "
                         "a second run started on the same --out would not be detected")
        previous = _read_owner(fd)
        if previous:
            notes.append(f"note: took over a stale lock of a run that did not end cleanly "
                         f"({_describe_owner(previous)})")
        owner = {"host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self._lock_fd = fd
        return notes

    def unlock(self) -> None:
        """Release the lock; an emptied lock file means "ended cleanly"."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)                 # closing drops the flock

    # ---- a clean start ---------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """The run entries (checkpoints, metrics, logs, ...) an earlier run left in OUT."""
        return [name for name in RUN_ENTRIES if os.path.lexists(os.path.join(self.path, name))]

    def move_previous_aside(self) -> str | None:
        """Move the earlier run's entries into OUT/previous/ (replacing the run kept
        there before), so the new run starts in a clean directory while nothing of
        the last run is lost. Returns a note, or None when there was nothing."""
        found = self.leftovers()
        if not found:
            return None
        previous = os.path.join(self.path, PREVIOUS_NAME)
        replaced = os.path.lexists(previous)
        if replaced:
            shutil.rmtree(previous) if os.path.isdir(previous) and not os.path.islink(previous) \
                else os.remove(previous)
        os.mkdir(previous)
        for name in found:
            os.rename(os.path.join(self.path, name), os.path.join(previous, name))
        return (f"the earlier run's {', '.join(found)} moved to {previous}"
                f"{' (replacing the run kept there before)' if replaced else ''}; "
                f"resume it with --resume {previous} if that was a mistake")


def _read_owner(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw.decode()) if raw.strip() else None
    except (OSError, ValueError, UnicodeDecodeError):
        return {"unreadable": True}


def _describe_owner(owner: dict | None) -> str:
    if not owner or "host" not in owner:
        return "owner unknown"
    alive = ""
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        alive = ", running" if _pid_alive(owner["pid"]) else ", no longer running"
    return (f"host {owner['host']} pid {owner.get('pid')}{alive}, started {owner.get('started', '?')}: "
            f"{owner.get('command', '?')}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MetricsLog:
    """OUT/metrics.jsonl, written by rank 0: every record is one whole line.

    A line is written with a single write(2) on an O_APPEND descriptor; if the
    write fails part-way (a full disk), the file is cut back to where the line
    began, so it never holds half a record. A torn last line left by a process
    that was killed mid-write is cut off when a resumed run opens the file."""

    def __init__(self, path: str, append: bool):
        self.path = path
        self.notes: list[str] = []
        if append:
            self._repair_torn_tail()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self._fd = os.open(path, flags, 0o644)

    def _repair_torn_tail(self) -> None:
        try:
            with open(self.path, "rb+") as fh:
                size = fh.seek(0, os.SEEK_END)
                if size == 0:
                    return
                # Find the last newline, reading backwards a block at a time.
                end, block = size, 1 << 16
                while end > 0:
                    start = max(0, end - block)
                    fh.seek(start)
                    chunk = fh.read(end - start)
                    cut = chunk.rfind(b"\n")
                    if cut >= 0:
                        keep = start + cut + 1
                        break
                    end = start
                else:
                    keep = 0
                if keep < size:
                    fh.truncate(keep)
                    self.notes.append(f"note: {self.path} ended in a torn line ({size - keep} bytes, from an "
                                      "interrupted write); it was cut off")
        except FileNotFoundError:
            pass

    def write(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        start = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)      # never leave half a record behind
            except OSError:
                pass
            raise RunDirError(describe_write_error(e, os.path.dirname(self.path) or ".",
                                                   f"the metrics of step {record.get('step')}")) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# ---- completion markers: success is what every rank says, not what a launcher says ----------
#
# mpirun was seen to exit 0 after a node was killed (shared/notes/multinode-emulation.md): a
# batch script or a sweep that trusts the launcher's exit code reports a run as done that
# is not. Every rank writes its own marker as the last thing it does; finished() counts them.

def clear_finished(out_dir: str) -> None:
    """Rank 0, at start: markers of an earlier run must not count for this one."""
    shutil.rmtree(os.path.join(out_dir, DONE_NAME), ignore_errors=True)


def mark_finished(out_dir: str, rank: int, size: int, step: int) -> None:
    folder = os.path.join(out_dir, DONE_NAME)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"rank": rank, "ranks": size, "step": step, "host": socket.gethostname(), "pid": os.getpid(),
                   "time": time.time()}, fh)
    os.replace(tmp, path)


def finished(out_dir: str, ranks: int | None = None) -> tuple[bool, str]:
    """(every rank finished?, what to say). ranks: how many there were (default: as
    the markers say)."""
    folder = os.path.join(out_dir, DONE_NAME)
    markers = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as fh:
                    rec = json.load(fh)
                markers[int(rec["rank"])] = rec
            except (OSError, ValueError, KeyError, TypeError):
                continue
    if ranks is None:
        ranks = max((m.get("ranks", 0) for m in markers.values()), default=0)
    if not ranks:
        return False, f"{out_dir}: no rank wrote a completion marker ({folder}): the run did not finish"
    missing = [r for r in range(ranks) if r not in markers]
    steps = sorted({m.get("step") for m in markers.values()})
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        return False, (f"{out_dir}: {len(missing)} of {ranks} rank(s) never finished (no marker: {shown}); "
                       "whatever the launcher's exit code said, the run did not complete")
    return True, f"{out_dir}: all {ranks} rank(s) finished (step {', '.join(map(str, steps))})"


def main(argv=None, prog="ringpipe finished") -> int:
    import argparse
    p = argparse.ArgumentParser(prog=prog, description="Did every rank of a run finish? Exit 0 if so, 1 if "
                                "not (naming the ranks): check this, not the launcher's exit code, in batch "
                                "scripts (mpirun has exited 0 after a node died).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--ranks", type=int, default=None, help="how many ranks the run had (default: as the "
                   "markers say; give it, e.g. $SLURM_NTASKS, so that a rank that never started counts)")
    args = p.parse_args(argv)
    ok, message = finished(args.run_dir, args.ranks)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
