"""The abort handler: an uncaught exception on one rank ends the whole MPI job.

Without it the other ranks block forever in their next collective. With it
(install_abort_handler(), or `with abort_on_error():`) the failing rank
prints '[ringpipe rank R/SIZE on HOST] Type: message' and its traceback,
waits until the launcher has read that, and calls MPI_Abort (abort_job).
"""

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

from mpi4py import MPI

__all__ = ["install_abort_handler", "abort_on_error", "abort_job", "wait_until_output_is_read",
           "remove_own_shm_segments"]

_installed = False                  # install_abort_handler() is idempotent
_abort_lock = threading.Lock()      # two failing threads of one rank report one at a time


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
