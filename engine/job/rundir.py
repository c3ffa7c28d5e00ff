"""The run directory (`--out`): one run owns it for its whole life.

What a run keeps there:

    OUT/run.lock            who owns the directory now (host, pid, start time)
    OUT/metrics.jsonl       one JSON object per step, whole lines only
    OUT/checkpoints/        ckpt_XXXXXXXX.{npz,json} (engine/job/checkpoint.py)
    OUT/best/               with --keep-best: the one checkpoint of the best validation loss so far
    OUT/logs/rank<R>.log    per-rank logs
    OUT/heartbeat/          watchdog heartbeats
    OUT/tokenizer.json      the tokenizer the run's data was prepared with (travels to exports)
    OUT/monitor.json        the run's ranks, nodes and layout, for `ringpipe top` and `report` (engine/monitor)
    OUT/tensorboard/        TensorBoard event files
    OUT/job_summary.*       per node CPU, memory and time split at the end of a run (and Slurm's sacct)
    OUT/val_confusion.json  a classifier's newest confusion matrix (engine/monitor/confusion.py)
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
import re
import socket
import stat
import sys
import time

from ringpipe.engine.job.files import (NO_LOCKING, UnreadableFile, describe_lock_owner, file_kind, read_json, read_lock_owner)

LOCK_NAME = "run.lock"
METRICS_NAME = "metrics.jsonl"
PREVIOUS_NAME = "previous"
# What a run writes into OUT: a fresh start moves exactly these aside, so
# unrelated files a user keeps in the folder are never touched.
DONE_NAME = "finished"             # OUT/finished/rank{R}.json: that rank ran to the end
BEST_NAME = "best"                 # OUT/best/: --keep-best's checkpoint (`ringpipe export OUT/best`)
# The monitor's files (engine/monitor: its header, TensorBoard's event files, the job summary).
MONITOR_ENTRIES = ("monitor.json", "tensorboard", "job_summary.json", "job_summary.txt", "sacct.txt",
                   "val_confusion.json")
RUN_ENTRIES = ("checkpoints", BEST_NAME, METRICS_NAME, "logs", "heartbeat", "tokenizer.json", DONE_NAME) + MONITOR_ENTRIES


def metrics_path(out_dir: str) -> str:
    return os.path.join(out_dir, METRICS_NAME)


def best_path(out_dir: str) -> str:
    """The folder of the best checkpoint (a checkpoints folder holding one)."""
    return os.path.join(out_dir, BEST_NAME)


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
        fd = _open_own_file(self.lock_path, os.O_RDWR | os.O_CREAT, "the run's lock file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = read_lock_owner(fd, LOCK_NAME)
            os.close(fd)
            raise RunDirError(
                f"--out {self.path} is in use by another run ({describe_lock_owner(owner)}); two runs in one "
                "directory would mix their checkpoints and metrics. Wait for it to end or stop it, "
                "or pass another --out") from None
        except OSError as e:
            if e.errno not in NO_LOCKING:
                os.close(fd)
                raise
            notes.append(f"note: the filesystem of {self.path} does not support file locks ({e.strerror}): "
                         "a second run started on the same --out would not be detected")
        previous = read_lock_owner(fd, LOCK_NAME)
        if previous:
            notes.append(f"note: took over a stale lock of a run that did not end cleanly "
                         f"({describe_lock_owner(previous)})")
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


def _open_own_file(path: str, flags: int, what: str) -> int:
    """os.open(path, flags) for a file of the run that ringpipe writes (the lock, the
    metrics): never through a symbolic link (O_NOFOLLOW: OUT/run.lock -> ~/notes.txt
    would have been truncated and overwritten), never a FIFO or device (O_NONBLOCK so
    opening a FIFO does not wait; fstat afterwards, so what is checked is what is
    written). RunDirError naming the file otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise RunDirError(f"{what} {path} is a symbolic link (to {os.readlink(path)!r}); ringpipe writes "
                              "this file and would overwrite what the link points to. Remove the link "
                              "(rm " + path + "), or pass another --out") from None
        raise RunDirError(describe_write_error(e, os.path.dirname(path) or ".", what)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RunDirError(f"{what} {path} is {file_kind(mode)}, not a regular file; ringpipe writes this file "
                          "itself. Remove it, or pass another --out")
    os.set_blocking(fd, True)
    return fd


class MetricsLog:
    """OUT/metrics.jsonl, written by rank 0: every record is one whole line.

    A line is written with a single write(2) on an O_APPEND descriptor; if the
    write fails part-way (a full disk), the file is cut back to where the line
    began, so it never holds half a record. A torn last line left by a process
    that was killed mid-write is cut off when a resumed run opens the file."""

    def __init__(self, path: str, append: bool):
        self.path = path
        self.notes: list[str] = []
        self._fd = None
        # Opened once, never through a link, and only a regular file (_open_own_file):
        # a metrics.jsonl linked to another file would have had that file truncated.
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        fd = _open_own_file(path, flags, "the metrics log")
        try:
            if append:
                self._repair_torn_tail(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    # A record is well under 4 KiB: a "torn line" longer than this is not one,
    # and searching further back for a line break would read the whole file.
    TORN_LIMIT = 1 << 20

    def _repair_torn_tail(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        # Find the last newline, reading backwards a block at a time, at most TORN_LIMIT bytes.
        end, block, keep = size, 1 << 16, None
        while end > 0 and size - end < self.TORN_LIMIT:
            start = max(0, end - block)
            chunk = os.pread(fd, end - start, start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        if keep is None:
            if end > 0:
                raise RunDirError(f"the metrics log {self.path} has no line break in its last {self.TORN_LIMIT:,} "
                                  "bytes: it is not a metrics log ringpipe wrote (one JSON record per line). Move "
                                  "it aside, then --resume again")
            keep = 0
        if keep < size:
            os.ftruncate(fd, keep)
            self.notes.append(f"note: {self.path} ended in a torn line ({size - keep} bytes, from an "
                              "interrupted write); it was cut off")

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
    folder = os.path.join(out_dir, DONE_NAME)
    if os.path.islink(folder) or (os.path.lexists(folder) and not os.path.isdir(folder)):
        os.remove(folder)          # rmtree refuses a link: the markers would go where it points
    shutil.rmtree(folder, ignore_errors=True)


def mark_finished(out_dir: str, rank: int, size: int, step: int) -> None:
    folder = os.path.join(out_dir, DONE_NAME)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.json")
    tmp = f"{path}.tmp{os.getpid()}"
    if os.path.lexists(tmp):
        os.remove(tmp)             # a leftover of a killed process with our pid
    # O_EXCL | O_NOFOLLOW: the temp file is ours, never a link planted at its name; then
    # one rename, so a reader sees the whole marker or none (read_marker checks every field).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        json.dump({"rank": rank, "ranks": size, "step": step, "host": socket.gethostname(), "pid": os.getpid(),
                   "time": time.time()}, fh)
    os.replace(tmp, path)


# A marker is a ~150-byte JSON object; a larger file is not one (and is not read).
MARKER_LIMIT = 64 << 10
# More ranks than any machine has: a count beyond this (from a marker or --ranks) is a
# damaged or hand-made value, not a run, and is never looped over.
MAX_RANKS = 1 << 20
_MARKER_NAME = re.compile(r"rank(0|[1-9][0-9]{0,6})\.json")


class FinishedError(ValueError):
    """`ringpipe finished` cannot tell: no run folder there, a bad --ranks, or a marker that
    is not one ringpipe wrote (the message names the file and what to do). Exit code 2."""


def _whole_number(value, what: str, where: str, low: int, high: int) -> int:
    # bool is an int to Python, 1e12 and "3" are not whole numbers to us: all refused.
    if type(value) is not int or not low <= value <= high:
        raise FinishedError(f"{where}: {what} is {json.dumps(value)[:60]}, not a whole number in {low}..{high}; "
                            "the marker is damaged or was not written by ringpipe: remove it and check the run's "
                            "logs, or run again")
    return value


def read_marker(path: str, rank: int) -> dict:
    """The completion marker of `rank` at `path`, every field checked (FinishedError otherwise)."""
    try:
        rec = read_json(path, "completion marker", MARKER_LIMIT)
    except UnreadableFile as e:
        raise FinishedError(f"{e}; remove it and check the run's logs, or run again") from None
    if not isinstance(rec, dict):
        raise FinishedError(f"completion marker {path} holds {type(rec).__name__}, not a JSON object; "
                            "remove it and check the run's logs, or run again")
    ranks = _whole_number(rec.get("ranks"), '"ranks"', f"completion marker {path}", 1, MAX_RANKS)
    _whole_number(rec.get("rank"), '"rank"', f"completion marker {path}", 0, ranks - 1)
    if rec["rank"] != rank:
        raise FinishedError(f"completion marker {path} says rank {rec['rank']}, but its name says rank {rank}; "
                            "remove it and check the run's logs, or run again")
    _whole_number(rec.get("step"), '"step"', f"completion marker {path}", 0, 1 << 62)
    return rec


def finished(out_dir: str, ranks: int | None = None) -> tuple[bool, str]:
    """(every rank finished?, what to say). ranks: how many there were (default: as
    the markers say). Raises FinishedError when it cannot tell (see there).

    Everything read is bounded: markers are size-limited regular files (engine/job/files.py:
    a marker linked to /dev/zero is refused, not read), their fields checked, and the
    counts looped over are at most MAX_RANKS, so it ends quickly whatever the folder holds
    (slurm/train.sbatch runs it after srun: it must never hang)."""
    if ranks is not None:
        if type(ranks) is not int or not 1 <= ranks <= MAX_RANKS:
            raise FinishedError(f"--ranks {ranks}: must be a whole number in 1..{MAX_RANKS} (how many ranks the "
                                "run had, e.g. $SLURM_NTASKS)")
    if not os.path.isdir(out_dir):
        what = "does not exist" if not os.path.lexists(out_dir) else "is not a folder"
        raise FinishedError(f"run folder {out_dir} {what}: give the --out of the run to check")
    folder = os.path.join(out_dir, DONE_NAME)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise FinishedError(f"{folder} is not a folder (ringpipe keeps the completion markers there): remove it "
                            "and check the run's logs, or run again")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    found = {}
    for name in names:
        m = _MARKER_NAME.fullmatch(name)
        if m:                                  # rank3.json.tmp123: a write a killed rank left; not a marker
            found[int(m.group(1))] = os.path.join(folder, name)
    limit = ranks if ranks is not None else MAX_RANKS
    beyond = sorted(r for r in found if r >= limit)
    if beyond:
        raise FinishedError(f"{found[beyond[0]]}: a marker of rank {beyond[0]}, but the run had "
                            f"{limit if ranks is not None else f'at most {MAX_RANKS:,}'} rank(s) "
                            f"(ranks 0..{limit - 1}); remove the markers that are not this run's, or give the "
                            "right --ranks")
    markers = {r: read_marker(path, r) for r, path in sorted(found.items())}
    counts = sorted({m["ranks"] for m in markers.values()})
    if len(counts) > 1:
        raise FinishedError(f"{folder}: the markers disagree on how many ranks the run had ({counts}): they are "
                            "from different runs; remove the folder and run again")
    # The markers' own count differing from --ranks: the ranks were not one world of that
    # size (e.g. srun with the wrong --mpi plugin: N singletons, each "rank 0 of 1").
    # Not finished, as expected: exit 1 with both counts, not 2 (the markers are sound).
    other = (f" (the markers say the run had {counts[0]} rank(s): the ranks were not one MPI job of {ranks})"
             if ranks is not None and counts and counts[0] != ranks else "")
    if ranks is None:
        ranks = counts[0] if counts else 0
    if not ranks:
        return False, f"{out_dir}: no rank wrote a completion marker ({folder}): the run did not finish"
    missing = ranks - len(markers)
    if other and not missing:
        return False, f"{out_dir}: every one of the {ranks} rank(s) left a marker, but{other}"
    steps = sorted({m["step"] for m in markers.values()})
    if missing:
        first = []
        for r in range(ranks):               # ranks <= MAX_RANKS; stops at the 21st gap
            if r not in markers:
                first.append(r)
                if len(first) > 20:
                    break
        shown = ", ".join(map(str, first[:20])) + (" ..." if missing > 20 else "")
        return False, (f"{out_dir}: {missing} of {ranks} rank(s) never finished (no marker: {shown}){other}; "
                       "whatever the launcher's exit code said, the run did not complete")
    return True, f"{out_dir}: all {ranks} rank(s) finished (step {', '.join(map(str, steps))})"


def main(argv=None, prog="ringpipe finished") -> int:
    import argparse
    p = argparse.ArgumentParser(prog=prog, description="Did every rank of a run finish? Exit 0 if so, 1 if "
                                "not (naming the ranks), 2 if it cannot tell (no such run folder, a bad --ranks, "
                                "a damaged marker: the message names the file). Check this, not the launcher's "
                                "exit code, in batch scripts (mpirun has exited 0 after a node died).")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--ranks", type=int, default=None, help="how many ranks the run had (default: as the "
                   "markers say; give it, e.g. $SLURM_NTASKS, so that a rank that never started counts)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:                # --help (0) or a usage error (2, argparse printed it)
        return int(e.code or 0)
    try:
        ok, message = finished(args.run_dir, args.ranks)
    except FinishedError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                   # the folder cannot be listed (permissions, I/O error)
        print(f"{prog}: error: cannot read {e.filename or args.run_dir} ({e.strerror or e}); check the path "
              "and its permissions", file=sys.stderr)
        return 2
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
