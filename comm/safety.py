"""Failure containment for MPI jobs: cross-rank consistency checks, private
communicators, and an abort handler that turns one rank's exception into a
job-wide exit instead of a silent hang."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import stat
import sys
import termios
import threading
import time
import traceback
import zlib

import numpy as np
from mpi4py import MPI

from . import fingerprint, settings
from .device import empty_for_mpi

__all__ = [
    "check_consistent",
    "install_abort_handler",
    "abort_job",
    "remove_own_shm_segments",
    "abort_on_error",
    "context_for",
    "CommContext",
    "DTYPE_CODES",
    "OP_CODES",
    "ALGO_CODES",
    "LAYOUT_LEGEND",
]

# Small stable integer codes so a layout fits in the fixed int64 record that
# check_consistent exchanges. 0 means "not supported": it still travels, so the
# ranks first agree on what they were given and then all raise the same error.
DTYPE_CODES = {
    np.dtype(np.float16): 1,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
}
OP_CODES = {"none": 0, "sum": 1, "avg": 2, "max": 3, "min": 4}
ALGO_CODES = {"none": 0, "ring": 1, "small": 2}
LAYOUT_LEGEND = (
    "dtype " + ", ".join(f"{c}={d}" for d, c in DTYPE_CODES.items()) + "; op "
    + ", ".join(f"{c}={o}" for o, c in OP_CODES.items() if c) + "; algorithm "
    + ", ".join(f"{c}={a}" for a, c in ALGO_CODES.items() if c)
    + "; ok 1=contiguous and writeable, -2=not an array; 0 or -1 = unsupported"
    + "; shape/order = a hash of the array's shape and memory order")

# One fixed-size record per rank: a length slot plus up to _SLOTS-1 values.
# Fixed size matters: if ranks passed tuples of different lengths and we sized
# the Allgather by the tuple, the collective itself would be mismatched.
_SLOTS = 9


def _as_int(v) -> int:
    if isinstance(v, (bool, int, np.integer)):
        return int(v)
    # Anything else (a float, a string) is compared by its repr: 1.4 must not pass for 1.
    return zlib.crc32(repr(v).encode())


def _record(values) -> np.ndarray:
    vals = [_as_int(v) for v in values]
    rec = np.zeros(_SLOTS, dtype=np.int64)
    if len(vals) > _SLOTS - 1:
        # Fold the overflow into one slot; a collision only weakens the check.
        tail = np.asarray(vals[_SLOTS - 2 :], dtype=np.int64).tobytes()
        vals = vals[: _SLOTS - 2] + [zlib.crc32(tail)]
        rec[0] = -len(values)  # negative length flags "tail hashed"
    else:
        rec[0] = len(vals)
    rec[1 : 1 + len(vals)] = vals
    return rec


def check_consistent(comm, what: str, values, legend: str = "") -> None:
    """Raise the same RuntimeError on every rank unless all ranks passed equal
    `values` (a small tuple of ints; other values are compared by a CRC32 of
    their repr, and shown as that). One uppercase Allgather; collective.
    `legend`, if given, is appended to the message to decode the values."""
    comm = MPI.COMM_WORLD if comm is None else comm
    mine = _record(values)
    if comm.Get_size() == 1:
        return
    table = np.empty((comm.Get_size(), _SLOTS), dtype=np.int64)
    comm.Allgather(mine, table)
    if (table == table[0]).all():
        return
    lines = []
    for r, rec in enumerate(table):
        k = abs(int(rec[0]))
        shown = tuple(int(v) for v in rec[1 : 1 + min(k, _SLOTS - 1)])
        lines.append(f"  rank {r}: {shown}{'  (tail hashed)' if rec[0] < 0 else ''}")
    raise RuntimeError(
        f"ringpipe: inconsistent {what} across the {comm.Get_size()} ranks of the "
        f"communicator (every rank must pass the same values):\n" + "\n".join(lines)
        + (f"\n  ({legend})" if legend else "")
    )


class CommContext:
    """Our private view of a user communicator.

    A Dup gives our point-to-point traffic its own context, so our messages
    can never match one the caller (say, a pipeline stage) has in flight on
    the same communicator. It also owns the receive scratch, the MPI.Status
    the receives reuse and the layouts already checked, so those are reused
    call after call. A context must be driven by one thread at a time, which
    MPI requires for collectives on one communicator anyway.

    Creating one is collective: the Dup, then one small allgather in which the
    ranks compare their comm settings (comm/settings.py: check mode, crossover,
    ring sub-chunk size, tag range). Settings that differ would make the ranks
    send different messages (one rank skipping a layout check the others make
    hangs them all), so instead every rank raises the same error here.

    RINGPIPE_COMM_CHECK decides when the ranks compare a layout (length,
    dtype, op, algorithm, shape and memory order) with one small Allgather:
      first   (default) on its first use on this communicator;
      always  on every call (one small extra Allgather each; for debugging a
              program whose ranks may diverge: names the call and each rank's
              layout);
      off     never.
    In every mode each message carries a fingerprint of its sender's layout in
    its tag (comm/fingerprint.py), which costs nothing: ranks passing
    different layouts they have each used before (or, with "off", at all) get
    an error instead of wrong bytes. A difference in what decides the message
    sizes (length, dtype size, algorithm) raises on the ranks that receive the
    odd message, and may leave the others waiting: under comm.abort_on_error()
    the job ends. Any other difference (dtype, op, shape) raises the same
    error on every rank. A rank that skips a call or makes an extra one can
    still hang the others (with "first", in the layout check it alone makes).
    """

    def __init__(self, comm, dup: bool = True):
        self.parent = comm
        self._scratch: dict = {}
        self.comm = comm.Dup() if dup else comm
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.tag_bits = fingerprint.tag_bits(self.comm)
        try:
            # Shared with every context of this process: set_crossover() and
            # set_subchunk_bytes() act on all of them.
            self.settings = settings.agree(self.comm, self.tag_bits)
        except BaseException:
            self.free()      # every rank raises alike, so every rank frees its Dup
            raise
        self.always_check = self.settings.check == "always"
        self.checked: set = set()   # layouts all ranks agreed on
        self.valid: dict = {}       # layouts agreed on and validated -> semantics hash (fast path)
        self.status = MPI.Status()  # for the receives of one call at a time
        self.broken: str | None = None   # why our messages no longer line up, if they do not
        self._abandoned: list = []

    def ensure_checked(self, what: str, values: tuple, legend: str = "") -> None:
        mode = self.settings.check
        if mode == "off":
            return
        key = (what,) + tuple(values)
        if mode == "first" and key in self.checked:
            return
        check_consistent(self.comm, what, values, legend)
        self.checked.add(key)

    def ensure_usable(self) -> None:
        """Refuse to send anything once a collective broke off half-way."""
        if self.broken is not None:
            raise RuntimeError(
                "ringpipe: collectives on this communicator no longer work: an earlier call broke off "
                f"half-way, leaving messages in flight that would be mistaken for the next call's. "
                f"It failed with: {self.broken}")

    def abandon(self, receives, sends, why: str) -> None:
        """A collective broke off half-way (`why`). Cancel its receives still
        pending, so MPI writes no late message into the caller's buffer, and
        keep every request alive: mpi4py would free an active request with
        its Python object, while MPI may still touch the memory."""
        for req in receives:
            if req:                      # not yet completed
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass
        self._abandoned.append((list(receives), sends))
        self.broken = why

    def scratch(self, dtype: np.dtype, n: int, xp=np) -> np.ndarray:
        """n-element receive scratch of `dtype` in xp's memory (host, or the
        device for cupy); grow-only, one per (module, dtype)."""
        key = (xp.__name__, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            # Grow geometrically so a slowly growing workload does not
            # reallocate on every call.
            size = max(n, 1024, 0 if buf is None else buf.size + buf.size // 2)
            buf = empty_for_mpi(xp, size, dtype)
            self._scratch[key] = buf
        return buf[:n]

    def free(self) -> None:
        if self.comm is not self.parent and self.comm != MPI.COMM_NULL:
            if not MPI.Is_finalized():
                self.comm.Free()
        self._scratch.clear()


# The private context lives on the user's communicator as an MPI attribute:
# each communicator object has its own (a freed and recycled handle starts
# without one, on every rank alike), and MPI calls _free_context when the user
# frees the communicator, so our Dup goes with it instead of leaking.
_keyval = None
_contexts_lock = threading.Lock()


def _free_context(comm, keyval, ctx) -> None:
    ctx.free()


def context_for(comm) -> CommContext:
    """The private context of `comm` (Dup'ed collectively on first use, freed
    when `comm` is freed)."""
    global _keyval
    with _contexts_lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_free_context)
        ctx = comm.Get_attr(_keyval)
        if ctx is None:
            ctx = CommContext(comm)
            comm.Set_attr(_keyval, ctx)
    return ctx


# --------------------------------------------------------------------------
# Abort handler: an uncaught exception on one rank must end the whole job.
# Without it the other ranks block forever in their next collective.

_installed = False
_abort_lock = threading.Lock()


def _where() -> str:
    try:
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except Exception:  # MPI unusable (finalized): still say something useful
        rank, size = "?", "?"
    return f"[ringpipe rank {rank}/{size} on {socket.gethostname()}]"


def wait_until_output_is_read(timeout: float = 2.0, fds=(1, 2)) -> None:
    """Give the launcher time to forward what this rank just wrote.

    Under mpiexec (hydra) and srun, a rank's stdout/stderr are pipes read by a
    proxy process. MPI_Abort makes the launcher kill that proxy, and bytes
    still sitting in the pipe are lost: the job died, but without the message
    saying why (seen in about 1 run in 15 on a loaded 2-core machine). So wait,
    at most `timeout` seconds, until the reader has drained both pipes.
    FIONREAD on a pipe counts the unread bytes from either end. Files and
    terminals need no wait and are skipped."""
    pipes = []
    for fd in fds:
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                pipes.append(fd)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    buf = bytearray(4)
    while pipes and time.monotonic() < deadline:
        try:
            pipes = [fd for fd in pipes if fcntl.ioctl(fd, termios.FIONREAD, buf) == 0
                     and int.from_bytes(buf, sys.byteorder) > 0]
        except OSError:
            return
        if pipes:
            time.sleep(0.01)
    # The proxy has read the bytes; let it pass them on before it is killed.
    time.sleep(0.05)


def _shield_from_signals() -> None:
    """Nothing may interrupt the way to MPI_Abort: a second Ctrl-C used to land
    in the sleep of wait_until_output_is_read as a KeyboardInterrupt, the rank
    then went into MPI_Finalize instead, and the other ranks waited forever.
    Signals that Python turns into exceptions or handler calls are ignored from
    here on; SIGTERM gets its default action back, which ends the rank (the
    launcher then ends the job) should the abort itself ever stall. Handlers
    can only be changed on the main thread; on another thread Python runs none
    of them anyway."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGTERM"):
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                signal.signal(sig, signal.SIG_DFL if name == "SIGTERM" else signal.SIG_IGN)
            except (ValueError, OSError):
                pass


def remove_own_shm_segments() -> list[str]:
    """Unlink the shared-memory files MPICH mapped for this job (/dev/shm/mpich_shm_*).

    MPICH removes them in MPI_Finalize; after an MPI_Abort (or any abnormal
    end) they stay behind, 4 MB or more per job, until someone deletes them.
    The aborting rank knows its own segments: they are the ones mapped into
    its address space. Unlinking them is safe while the other ranks still use
    them (the memory lives until the last mapping goes) and the job is being
    ended anyway. Returns the paths removed (Linux only; elsewhere nothing)."""
    removed = []
    try:
        with open("/proc/self/maps") as fh:
            maps = fh.read().splitlines()
    except OSError:
        return removed
    for line in maps:
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)") and path not in removed:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def abort_job(code: int = 1, comm=None) -> None:
    """End the whole MPI job from this rank (MPI_Abort of `comm`, default
    COMM_WORLD): let the launcher read what was written, remove our
    shared-memory segments, abort, and exit for sure."""
    try:
        wait_until_output_is_read()
        remove_own_shm_segments()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            (MPI.COMM_WORLD if comm is None else comm).Abort(code)
    finally:
        os._exit(code)


def _report_and_abort(exc_type, exc, tb, thread_name: str | None = None,
                      with_traceback: bool = True, code: int = 1) -> None:
    _shield_from_signals()
    try:
        # Serialize: two failing threads on one rank must not interleave output.
        with _abort_lock:
            head = _where()
            if thread_name is not None:
                head += f" (thread {thread_name})"
            try:
                msg = "".join(traceback.format_exception(exc_type, exc, tb)) if with_traceback else ""
                sys.stderr.write(f"{head} {exc_type.__name__}: {exc}\n{msg}")
                sys.stderr.flush()
            except Exception:
                pass
            try:
                sys.stdout.flush()
            except Exception:
                pass
            abort_job(code)
    finally:
        os._exit(code)        # whatever happened above, this rank does not live on


def _excepthook(exc_type, exc, tb):
    _report_and_abort(exc_type, exc, tb)


def _thread_excepthook(args):
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback, name)


def install_abort_handler() -> None:
    """Make any uncaught exception (main or other threads) print
    '[ringpipe rank R/SIZE on HOST] Type: msg' plus the traceback and
    MPI_Abort the whole job. Idempotent."""
    global _installed
    if _installed:
        return
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    _installed = True


@contextlib.contextmanager
def abort_on_error():
    """`with abort_on_error(): main()` (or as a decorator): any exception
    escaping the block aborts the job the same way; a clean sys.exit() is let
    through."""
    install_abort_handler()
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        # A deliberate exit with a message: no traceback, but still take the
        # job down, since the other ranks may be waiting on this one.
        _report_and_abort(type(e), e, e.__traceback__, with_traceback=False,
                          code=e.code if isinstance(e.code, int) else 1)
    except BaseException as e:
        _report_and_abort(type(e), e, e.__traceback__)
