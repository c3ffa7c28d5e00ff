"""Job lifecycle on a cluster: stop-and-requeue on a signal, launcher sanity
check, a hang watchdog, and per-rank logs.

The pieces, as the trainer uses them:

    from ringpipe.engine.job import lifecycle
    lifecycle.check_launcher(world)          # before any work: wrong `srun --mpi`?
    log = lifecycle.setup_rank_logging(out_dir, rank, size)
    stop = lifecycle.StopFlag()              # SIGUSR1/SIGTERM/SIGINT only set a flag
    dog = lifecycle.Watchdog(world, timeout_s, run_dir=out_dir)   # 0 = off
    for step in ...:
        ...one optimizer step...
        dog.beat(step + 1)
        if stop.should_stop(world):          # collective: every rank agrees
            save(step + 1); world.Barrier()
            sys.exit(lifecycle.REQUEUE_EXIT_CODE)
    dog.stop()

REQUEUE_EXIT_CODE (85) is the contract with slurm/train.sbatch: "I stopped on
request at a step boundary and a checkpoint of that step is on disk; start me
again with --resume auto". The batch script answers it with
`scontrol requeue $SLURM_JOB_ID`. 85 is outside the codes Python (1, 2), the
shell (126, 127, 128+N for signals) and MPI launchers commonly use, and is
not one Slurm gives a meaning to.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

from ringpipe.engine.job.errors import ConfigError

__all__ = [
    "REQUEUE_EXIT_CODE",
    "INTERRUPT_EXIT_CODE",
    "StopFlag",
    "StopError",
    "LauncherError",
    "check_launcher",
    "Watchdog",
    "setup_rank_logging",
    "TOOL_SIGNALS",
    "ToolInterrupted",
    "end_job_on_signal",
]

#: Exit code meaning "checkpointed on request; requeue me" (see module docstring).
REQUEUE_EXIT_CODE = 85
#: Exit code after Ctrl-C (SIGINT): stopped and checkpointed, by the user's wish
#: (128 + SIGINT, the shell's code for an interrupted command; not requeued).
INTERRUPT_EXIT_CODE = 130


# ---------------------------------------------------------------------------
# Stop on a signal, at a step boundary every rank agrees on.

class StopFlag:
    """Turn SIGUSR1/SIGTERM/SIGINT into a request to stop at the next step boundary.

    The handlers only store the signal number (no I/O, no MPI, no allocation
    beyond Python's own), so a signal can arrive at any moment, including
    while the main thread is inside an MPI call. `should_stop(comm)` is the
    only place the flag is read: one tiny uppercase Allreduce (MAX of two
    int64) per call, so if any rank got a signal, every rank returns True at
    the same step, and they all checkpoint and exit together. Call it at the
    same point of every step on every rank of `comm` (it is a collective).

    Slurm's `--signal=USR1@T` (time limit ahead), `scancel --signal=USR1`,
    the SIGTERM that precedes SIGKILL on preemption or cancel, and Ctrl-C
    (SIGINT, which mpiexec forwards to the ranks) all end up here. A second
    SIGTERM or SIGINT means "stop now": the process exits at once, even from
    inside a blocking MPI call, with `forced_exit_code` (see there).

    The same flag also carries a failure of one rank that the others must
    hear of at the next boundary (`fail(message)`, e.g. rank 0 could not
    write metrics.jsonl): should_stop() then raises StopError on every rank.

    Create it as early as possible (the trainer does so before MPI starts,
    since MPICH installs a SIGUSR1 handler of its own during MPI_Init that
    would swallow the signal) and call `install()` again once MPI is up.
    Handlers can only be installed from the main thread.
    """

    DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    # A second one of these ends the process at once ("stop now").
    FORCE_SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, signals=DEFAULT_SIGNALS, install: bool = True):
        self.signals = tuple(signals)
        self._received = 0       # written by the handler only
        self._heard = 0          # a signal another process got and told this rank of (heard())
        self._agreed = 0         # the MAX over ranks from the last should_stop
        self._failure: str | None = None
        self._buf = None         # preallocated for the Allreduce (numpy imported lazily)
        self._previous: dict = {}
        self._wakeup = None
        # What a forced exit (second SIGTERM/SIGINT) returns. None: 128 + the
        # signal, the shell's convention for "killed by it". The trainer sets
        # it once the exit is already decided and covered by a checkpoint
        # (REQUEUE_EXIT_CODE after a stop checkpoint, 0 after the final one),
        # so the code tells the truth however the process ends.
        self.forced_exit_code: int | None = None
        self.forced_note = ""
        # A stop signal that came before this flag existed (runtime.catch_stop_signals_early).
        from ringpipe.engine.job import runtime
        if runtime.pending_stop_signals:
            self._received = runtime.pending_stop_signals[-1]
            runtime.pending_stop_signals.clear()
        if install:
            self.install()

    def _handler(self, signum, frame):  # async-signal-safe: one store, nothing else
        self._received = signum

    def install(self) -> "StopFlag":
        """Install the handlers (again: after MPI_Init, to take SIGUSR1 back from MPICH)."""
        for s in self.signals:
            old = signal.signal(s, self._handler)
            self._previous.setdefault(s, old)
        self._start_escape()
        return self

    def ignore_from_now_on(self) -> None:
        """Ignore these signals for the rest of the process: for its last moments,
        once the exit code is decided. (Python resets the handlers it installed
        to the default, "terminate", while it shuts down; ignored ones it keeps.)"""
        for s in self.signals:
            signal.signal(s, signal.SIG_IGN)

    def uninstall(self) -> None:
        """Restore the handlers that were there before install()."""
        for s, old in self._previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._wakeup:
            signal.set_wakeup_fd(-1)
            os.close(self._wakeup[1])
            self._wakeup = None

    def _start_escape(self):
        """A second SIGTERM or SIGINT ends the process at once, even while the
        main thread is blocked inside MPI (where Python-level handlers cannot
        run): the C signal handler writes the signal number to a wakeup pipe,
        and a thread watching it exits the process. The first one still means
        "checkpoint at the next step"; a hang would otherwise only yield to
        SIGKILL. The exit skips cleanup on purpose: the launcher sees the rank
        end and ends the job."""
        force = [s for s in self.FORCE_SIGNALS if s in self.signals]
        if self._wakeup or not force:
            return
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):        # not the main thread, or no pipes: no escape hatch
            return
        self._wakeup = (r, w)
        force_numbers = {int(s) for s in force}

        def watch():
            seen = 0
            while True:
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data:
                    return
                for number in data:          # one byte per signal that arrived
                    if number in force_numbers:
                        seen += 1
                        if seen >= 2:
                            self._exit_now(signal.Signals(number))

        threading.Thread(target=watch, name="ringpipe-signal-escape", daemon=True).start()

    def _exit_now(self, sig) -> None:
        code = self.forced_exit_code if self.forced_exit_code is not None else 128 + int(sig)
        note = self.forced_note or "no checkpoint of the current step was written"
        try:
            os.write(2, f"[ringpipe pid {os.getpid()}] second {sig.name}: stopping now ({note}); "
                        f"exit code {code}\n".encode())
        except OSError:
            pass
        os._exit(code)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()
        return False

    def trigger(self, signum: int = signal.SIGUSR1) -> None:
        """Request a stop without a signal (tests, programmatic stops)."""
        self._received = int(signum)

    def heard(self, signum: int) -> None:
        """A stop signal that another process of the job got and told this rank of (a
        dedicated parameter server, which takes no part in should_stop: engine/parallel/ps.py).
        The next should_stop() counts it as if it had come here; `requested` and `received`
        stay this rank's own."""
        self._heard = max(self._heard, int(signum))

    def decided(self, code: int, checkpoint_step: int | None = None) -> None:
        """The exit code is decided and covered by a checkpoint (the stop checkpoint of
        `checkpoint_step`, or the final one): a second signal from now on exits with it."""
        self.forced_exit_code = code
        self.forced_note = (f"the checkpoint of step {checkpoint_step} is written" if checkpoint_step is not None
                            else "the run is complete and its final checkpoint written")

    def fail(self, message: str) -> None:
        """Report a failure of this rank that every rank must stop for at the
        next should_stop() (which then raises StopError with the message)."""
        self._failure = message

    @property
    def requested(self) -> bool:
        """This rank got a signal (local; no communication)."""
        return bool(self._received)

    @property
    def received(self) -> int:
        """The signal number this rank got itself (0: none; local, no communication)."""
        return int(self._received)

    def should_stop(self, comm=None) -> bool:
        """Collective over `comm` (default COMM_WORLD): True on every rank iff
        any rank has received a stop signal (or heard() of one); StopError on every rank iff any
        rank called fail(). One 16-byte Allreduce."""
        if self._buf is None:
            import numpy as np
            self._buf = np.zeros(2, dtype=np.int64)
        self._buf[0] = max(self._received, self._heard)
        self._buf[1] = self._failure is not None
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            from mpi4py import MPI
            comm.Allreduce(MPI.IN_PLACE, self._buf, op=MPI.MAX)
        if self._buf[1]:
            failures = comm.allgather(self._failure) if comm.Get_size() > 1 else [self._failure]
            rank, message = next((r, m) for r, m in enumerate(failures) if m is not None)
            raise StopError(message if comm.Get_size() == 1 else f"{message} (on rank {rank})")
        if self._buf[0]:
            self._agreed = int(self._buf[0])
        return bool(self._buf[0])

    @property
    def signum(self) -> int:
        """The agreed signal number (largest over ranks) or the local one; 0 if none."""
        return self._agreed or self._received

    @property
    def signal_name(self) -> str | None:
        """'SIGUSR1', 'SIGTERM', ... for messages; None if no stop was requested."""
        return signal_name(self.signum) if self.signum else None


def signal_name(signum: int) -> str:
    """'SIGTERM' for 15, 'signal 99' for a number no signal has."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopError(RuntimeError):
    """A rank reported a failure (StopFlag.fail); every rank stops with it."""


# ---------------------------------------------------------------------------
# The tools around training (prepare, ...): a signal on one rank ends the job.

#: What ends a tool run: Ctrl-C (which reaches only the ranks it is sent to: a
#: `kill -INT` of one rank, or one rank's terminal), Slurm's and kill's SIGTERM, a
#: closed terminal's SIGHUP.
TOOL_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ToolInterrupted(KeyboardInterrupt):
    """A signal ended a one-rank tool run. A KeyboardInterrupt, so the tool's own
    `except KeyboardInterrupt` and `finally` cleanup run as for Ctrl-C; `exit_code` is
    the truthful code, 128 + the signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""

    def __init__(self, signum: int, tool: str):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"{tool}: interrupted by {signal.Signals(signum).name}")


class HeldSignals:
    """A signal handler that only notes the signals it gets, for a tool's start-up: until
    MPI is up and end_job_on_signal is installed, Python's default would raise a
    KeyboardInterrupt wherever the rank happens to be (an import, MPI_Init), and a rank that
    leaves then waits in MPI_Finalize for ranks that wait for it in their first collective
    (seen: `mpiexec -n 2 ringpipe prepare` hung when SIGINT reached rank 0 220 ms in).
    end_job_on_signal acts on what was held, as if it had just arrived."""

    def __init__(self):
        self.pending: list[int] = []

    def __call__(self, signum, frame):
        self.pending.append(int(signum))


def hold_signals(signals=TOOL_SIGNALS) -> None:
    """From now until end_job_on_signal, note SIGINT/SIGTERM/SIGHUP instead of acting on them.
    Call it first thing in a collective tool's entry point (main thread only)."""
    if not any(isinstance(signal.getsignal(s), HeldSignals) for s in signals):
        held = HeldSignals()
        for s in signals:
            signal.signal(s, held)


def end_job_on_signal(world, tool: str, signals=TOOL_SIGNALS):
    """Make SIGINT/SIGTERM/SIGHUP on this rank end the whole job, for a tool whose ranks
    meet in collectives (`ringpipe prepare`). Call it on every rank, at start, from the
    main thread, once MPI is up. Returns a function that puts the old handlers back.

    Why: a signal reaches only the rank it is sent to. Python turns SIGINT into a
    KeyboardInterrupt on that rank alone: it cleans up and leaves, and the other ranks
    wait forever in their next collective for a rank that is gone (seen: 292 s and
    counting). Sharing "I was interrupted" in an agreement step would need every rank to
    reach it, and a rank busy for minutes (training a BPE tokenizer) would not; so the
    rank that got the signal ends the job itself:

      - more than one rank: print "TOOL: rank R interrupted by SIGINT; ending the job"
        and MPI_Abort with 128 + the signal (130 SIGINT, 143 SIGTERM), which the launcher
        passes on. The other ranks are killed by the launcher, so their cleanup (a
        `finally`, temp folders) does not run: a tool must keep its work in a place its
        next run finds and removes (prepare: OUT/.prepare-parts-*, reported and removed by
        the next `prepare --overwrite`), never half-written where a reader would take it.
      - one rank: raise ToolInterrupted (a KeyboardInterrupt) in the main thread, so the
        tool's own cleanup runs as for Ctrl-C.

    The Python handler only runs when the main thread is back in Python; a rank blocked
    in a collective (the very rank the others wait on) may not get there. So the signal
    is also written to a wakeup pipe (signal.set_wakeup_fd) that a thread watches, and
    the thread aborts the job: MPI is initialised for threads (mpi4py's default,
    MPI_THREAD_MULTIPLE), as the Watchdog's abort already relies on. With one rank, a
    second signal ends the process at once (cleanup that hangs must not need SIGKILL)."""
    rank, size = world.Get_rank(), world.Get_size()
    ending = threading.Lock()            # the first of the handler and the thread to get it aborts
    numbers = {int(s) for s in signals}
    seen = [0]

    def say(text: str) -> None:
        try:
            os.write(2, (text + "\n").encode())     # no buffered stream: a handler may interrupt one
        except OSError:
            pass

    def end_job(signum: int) -> None:
        if not ending.acquire(blocking=False):
            return                                   # the other path is ending it already
        name = signal.Signals(signum).name
        say(f"{tool}: rank {rank} interrupted by {name}; ending the job")
        from ringpipe.comm.abort import abort_job
        abort_job(128 + signum, world)               # does not return

    def handler(signum, frame):
        if size == 1:
            seen[0] += 1
            if seen[0] == 1:                         # a second one: the watcher thread exits at once
                say(f"{tool}: interrupted by {signal.Signals(signum).name}; cleaning up")
                raise ToolInterrupted(signum, tool)
            if wakeup is None:                       # no watcher thread to do it
                os._exit(128 + signum)
            return
        end_job(signum)
        while True:                                  # the watcher thread got there first: it ends
            time.sleep(1)                            # the process; do no more work meanwhile

    previous = {s: signal.signal(s, handler) for s in signals}

    # The watcher: a signal arrives while the main thread is inside MPI (or any long C call).
    wakeup = None                        # bound first: the handler reads it while the pipe is made
    wakeup = _own_wakeup_pipe()

    def watched(number: int, count: int) -> None:
        if size > 1:
            end_job(number)
        elif count >= 2:
            say(f"{tool}: second {signal.Signals(number).name}: stopping now, without cleanup")
            os._exit(128 + number)

    if wakeup is not None:
        _start_watcher(wakeup[0], numbers, watched)

    def restore() -> None:
        for s, old in previous.items():
            held_only = old is None or isinstance(old, HeldSignals)
            signal.signal(s, signal.default_int_handler if held_only and s == signal.SIGINT
                          else signal.SIG_DFL if held_only else old)
        if wakeup is not None:
            signal.set_wakeup_fd(-1)
            os.close(wakeup[1])          # the watcher's read sees the end and it returns

    # A signal that came during start-up (hold_signals) is acted on now, as if it had just
    # arrived: the job ends (several ranks), or ToolInterrupted is raised here (one rank).
    held = [n for old in previous.values() if isinstance(old, HeldSignals) for n in old.pending]
    if held:
        handler(held[0], None)
    return restore


def _own_wakeup_pipe():
    """(read end, write end) of a pipe made this process's signal wakeup fd, or None: another
    watcher has one already (a StopFlag: theirs is left as it is), or there can be none (not
    the main thread, no pipes), and the handler acts alone."""
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old_fd != -1:                 # someone else watches already (a StopFlag): leave theirs
            signal.set_wakeup_fd(old_fd)
            os.close(r)
            os.close(w)
            return None
        return r, w
    except (ValueError, OSError):        # not the main thread, or no pipes: the handler alone
        return None


def _start_watcher(read_fd: int, numbers: set, on_signal) -> None:
    """A daemon thread that reads the wakeup pipe (one byte per signal that arrived) and calls
    on_signal(number, count) for each signal of `numbers`, count being how many came so far.
    It ends when the pipe's write end is closed."""
    def watch():
        count = 0
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number not in numbers:
                    continue
                count += 1
                on_signal(number, count)

    threading.Thread(target=watch, name="ringpipe-end-job-on-signal", daemon=True).start()


def missing_mpi(error: ImportError) -> str | None:
    """What to tell the user when importing ringpipe.comm failed for want of MPI: no
    mpi4py at all, or mpi4py without an MPI library (comm.launcher.MPIUnavailable, whose
    message says what to install); None for any other import error (a bug: raise it)."""
    if error.name == "mpi4py.MPI":
        return str(error)
    if error.name == "mpi4py":
        return ("ringpipe needs mpi4py and an MPI library: `pip install 'ringpipe[mpi]'` installs both (MPICH "
                "from PyPI); on a cluster, build mpi4py against the site's MPI (README: \"Using your cluster's "
                "MPI\")")
    return None


# ---------------------------------------------------------------------------
# Launcher check: `srun --mpi=<wrong plugin>` silently gives N singletons.

class LauncherError(ConfigError):
    """The launcher and the MPI library do not match (or a launcher setting is
    bad). Every task prints it: each is alone in its own world, and srun may
    kill task 0 before it gets to print."""


def _slurm_tasks(env) -> tuple[int, str] | None:
    """(task count, variable) of the Slurm step this process is a task of, or
    None when not inside an srun step. The batch script itself (and a plain
    `python` run in it or in salloc) has SLURM_NTASKS of the whole job but is
    one process by design: no SLURM_STEP_ID there, so it is not checked."""
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env and "SLURM_STEP_NUM_TASKS" not in env:
        return None
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"):
        v = env.get(var, "").strip()
        if v.isdigit():
            return int(v), var
    return None


def check_launcher(world=None, environ=None, library_version: str | None = None) -> None:
    """Raise LauncherError, before any work, if Slurm started several tasks but
    MPI put each in a world of its own (every rank is "rank 0 of 1"): the
    symptom of `srun --mpi=none` with MPICH, or pmi2 with Open MPI. Cheap, no
    communication; call it right after MPI init on every rank.

    `environ` and `library_version` default to os.environ and
    MPI.Get_library_version() (tests pass fakes). RINGPIPE_SKIP_LAUNCHER_CHECK=1
    disables the check.
    """
    env = os.environ if environ is None else environ
    skip = env.get("RINGPIPE_SKIP_LAUNCHER_CHECK", "")
    if skip not in ("", "0", "1"):
        raise LauncherError(f"RINGPIPE_SKIP_LAUNCHER_CHECK={skip!r}: use 1 to skip the launcher check, "
                            "or 0 (or unset) to keep it")
    if skip == "1":
        return
    if world is None:
        from mpi4py import MPI
        world = MPI.COMM_WORLD
    size = world.Get_size()
    found = _slurm_tasks(env)
    if found is None or size != 1 or found[0] <= 1:
        return
    ntasks, var = found
    if library_version is None:
        from mpi4py import MPI
        library_version = MPI.Get_library_version()
    # (Open MPI's string ends in a NUL byte.)
    lib = (library_version.replace("\0", "").strip().splitlines() or ["unknown MPI library"])[0].strip()
    is_ompi = "open mpi" in lib.lower()
    plugin_now = env.get("SLURM_MPI_TYPE", "")
    good, other = ("pmix", "pmi2") if is_ompi else ("pmi2", "pmix")
    task = env.get("SLURM_PROCID", "?")
    raise LauncherError(
        f"MPI launcher mismatch: Slurm started {ntasks} tasks ({var}={ntasks}), but this "
        f"process (Slurm task {task}) is MPI rank 0 of 1: every task thinks it is alone and would "
        f"train its own copy of the model.\n"
        f"  MPI library: {lib}\n"
        f"  srun --mpi plugin used: "
        f"{plugin_now or 'none (SLURM_MPI_TYPE is not set: srun --mpi=none, or the cluster default MpiDefault=none)'}\n"
        f"  fix: launch with `srun --mpi={good}` ({'Open MPI' if is_ompi else 'MPICH, Intel MPI, MVAPICH'}); "
        f"use `srun --mpi={other}` for {'MPICH-family libraries' if is_ompi else 'Open MPI'}. "
        f"`srun --mpi=list` shows the plugins this cluster has; slurm/train.sbatch takes "
        f"RINGPIPE_SRUN_MPI={good}. Or launch with the library's own mpiexec.")


# ---------------------------------------------------------------------------
# Watchdog: say which step (and which ranks) a hung job is stuck at.

# An innermost source line like `comm.Allreduce(...)` or `req.Wait()`: the
# thread is (most likely) blocked in communication.
_COMM_CALL = re.compile(
    r"\.(I?[Aa]llreduce|I?[Rr]educe\w*|I?[Aa]llgather\w*|I?[Gg]ather\w*|I?[Ss]catter\w*|I?[Aa]lltoall\w*"
    r"|I?[Bb]cast|I?[Bb]arrier|[Ss]endrecv\w*|I?[Rr]ecv|I?S?[Ss]end|I?[Pp]robe|Wait\w*|wait|Test\w*)\s*\(")


def _main_thread_location(depth: int = 3) -> tuple[str, bool]:
    """('file:line in func `code` <- ...', in_comm) for the main thread's
    innermost frames. Works while the main thread is blocked in a C call that
    released the GIL (mpi4py releases it around MPI calls). in_comm: the
    innermost line looks like a communication call."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident)
    if frame is None:
        return "?", False
    stack = traceback.extract_stack(frame)[-depth:]
    parts = []
    for fs in reversed(stack):
        parts.append(f"{os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}"
                     + (f" `{fs.line.strip()[:60]}`" if fs.line else ""))
    in_comm = bool(stack and stack[-1].line and _COMM_CALL.search(stack[-1].line))
    return " <- ".join(parts), in_comm


class Watchdog:
    """Report (and optionally abort) when this rank makes no progress for
    `timeout_s` seconds. Off (no thread, beat() is a no-op) when timeout_s <= 0.

    The trainer calls `beat(step)` after each finished step. A daemon thread
    wakes every `interval` seconds and, when `run_dir` is given, rewrites
    RUN_DIR/heartbeat/rank{R} (JSON: last step, time of the last beat, where
    the main thread is now). It keeps doing so while the main thread sits in
    an MPI call, so when the job hangs, rank 0's watchdog reads every rank's
    file and names the ranks that are behind: a lower step, a stale file
    (process dead or frozen with the GIL held), or, when all are at the same
    step, the ranks whose main thread is somewhere other than where most
    ranks wait (typically the one that never reached the collective).

    Messages go to `stream` (stderr). With abort=True the job is ended with
    comm.Abort(1) after the report (rank 0 first; other ranks wait a little so
    rank 0's report gets out). No MPI call is made by the thread otherwise.
    """

    def __init__(self, comm=None, timeout_s: float = 0.0, run_dir: str | None = None,
                 abort: bool = False, interval: float | None = None, stream=None):
        self.timeout_s = float(timeout_s or 0.0)
        self.enabled = self.timeout_s > 0
        self.comm = comm
        if comm is not None:
            self.rank, self.size = comm.Get_rank(), comm.Get_size()
        else:
            self.rank, self.size = 0, 1
        self.abort = abort
        self.stream = stream
        self.interval = interval if interval is not None else min(max(self.timeout_s / 4, 0.05), 5.0)
        self.hb_dir = os.path.join(run_dir, "heartbeat") if run_dir else None
        self.step: int | None = None            # last finished step (None: none yet)
        self.last_beat = time.time()
        self.tripped = False                    # a stall has been reported
        self.last_report: str | None = None
        self._reported_for = object()           # the beat a report was made for
        self._stop = threading.Event()
        self._thread = None
        self.pulse = None
        if not self.enabled:
            return
        if comm is not None and self.size > 1 and hasattr(comm, "allgather"):
            # A heartbeat over the network (engine/job/pulse.py): names the ranks a
            # stall cannot reach. Collective: every rank makes its watchdog here.
            from ringpipe.engine.job.pulse import Pulse
            self.pulse = Pulse(comm)
        if self.hb_dir:
            os.makedirs(self.hb_dir, exist_ok=True)
            self._write_heartbeat()
        self._thread = threading.Thread(target=self._run, name=f"ringpipe-watchdog-{self.rank}", daemon=True)
        self._thread.start()

    # -- main thread side -----------------------------------------------------
    def beat(self, step: int) -> None:
        """Mark `step` as finished on this rank (two stores; no I/O)."""
        self.step = int(step)
        self.last_beat = time.time()

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, 2 * self.interval))
        self._thread = None
        pulse, self.pulse = self.pulse, None
        if pulse is not None:
            pulse.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    # -- thread side ------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(self.hb_dir, f"rank{rank}")

    def _write_heartbeat(self) -> None:
        where, in_comm = _main_thread_location()
        rec = {"rank": self.rank, "step": self.step, "last_beat": self.last_beat, "written": time.time(),
               "where": where, "in_comm": in_comm, "pid": os.getpid(), "host": socket.gethostname()}
        path = self._path(self.rank)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, path)
        except OSError:
            pass

    def _read_heartbeats(self) -> dict:
        out = {}
        for r in range(self.size):
            try:
                with open(self._path(r)) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                out[r] = None
        return out

    def _say(self, text: str) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(text if text.endswith("\n") else text + "\n")
            stream.flush()
        except Exception:
            pass

    @property
    def quiet_after(self) -> float:
        """Seconds without a datagram from a rank before it counts as unheard."""
        return max(3 * self.interval, 1.0)

    def _unheard(self) -> str | None:
        pulse = self.pulse
        return pulse.describe_silent(self.quiet_after) if pulse is not None else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            pulse = self.pulse
            if pulse is not None:
                pulse.tick()
            if self.hb_dir:
                self._write_heartbeat()
            beat_id = (self.step, self.last_beat)
            idle = time.time() - self.last_beat
            if idle < self.timeout_s or beat_id == self._reported_for:
                continue
            self._reported_for = beat_id
            self.tripped = True
            where = "before its first step" if self.step is None else f"after step {self.step}"
            msg = (f"[rank {self.rank}] watchdog: no progress for {idle:.0f} s "
                   f"(timeout {self.timeout_s:g} s): this rank is stuck {where}; "
                   f"main thread at {_main_thread_location()[0]}")
            unheard = self._unheard()
            if unheard:
                msg += (f"\n[rank {self.rank}] watchdog: not heard over the network for over "
                        f"{self.quiet_after:.0f} s: {unheard}")
            if self.rank == 0 and self.hb_dir and self.size > 1:
                self._write_heartbeat()
                msg += "\n" + self.describe_ranks()
            self.last_report = msg
            self._say(msg)
            if self.abort:
                self._abort()

    def describe_ranks(self, heartbeats: dict | None = None) -> str:
        """The report rank 0 adds: which ranks are behind, from the heartbeat files."""
        hbs = self._read_heartbeats() if heartbeats is None else heartbeats
        now = time.time()
        stale_after = max(3 * self.interval + 1.0, 2.0)
        missing = [r for r, h in hbs.items() if h is None]
        stale = [r for r, h in hbs.items() if h is not None and now - h["written"] > stale_after]
        live = {r: h for r, h in hbs.items() if h is not None and r not in stale}
        steps = {r: (-1 if h["step"] is None else h["step"]) for r, h in live.items()}
        behind: list[int] = []
        reason = ""
        if steps and len(set(steps.values())) > 1:
            top = max(steps.values())
            behind = sorted(r for r, s in steps.items() if s < top)
            reason = f"at an earlier step than step {top}"
        elif len(live) > 1 and any(h.get("in_comm") for h in live.values()) \
                and not all(h.get("in_comm") for h in live.values()):
            # Same step; some ranks wait in communication, the others never got there.
            behind = sorted(r for r, h in live.items() if not h.get("in_comm"))
            reason = "not in a collective while the others wait in one"
        elif len(live) > 1:
            # Same step, no clear signal: the odd ones out are where most ranks are not.
            counts: dict = {}
            for h in live.values():
                counts[h["where"]] = counts.get(h["where"], 0) + 1
            common = max(counts.values())
            if common > 1 and sum(1 for c in counts.values() if c == common) == 1:
                majority = next(w for w, c in counts.items() if c == common)
                behind = sorted(r for r, h in live.items() if h["where"] != majority)
                reason = "not where the other ranks wait (have not reached the collective?)"
        lines = [f"[rank 0] watchdog: heartbeats of the {self.size} ranks ({self.hb_dir}):"]
        for r in sorted(hbs):
            h = hbs[r]
            if h is None:
                lines.append(f"  rank {r}: no heartbeat file")
                continue
            step = "none yet" if h["step"] is None else h["step"]
            lines.append(f"  rank {r} ({h.get('host', '?')} pid {h.get('pid', '?')}): last step {step}, "
                         f"{now - h['last_beat']:.0f} s since, file {now - h['written']:.0f} s old; "
                         f"at {h.get('where', '?')}")
        unheard = self.pulse.silent(self.quiet_after) if heartbeats is None and self.pulse is not None else []
        culprits = sorted(set(behind) | set(stale) | set(missing) | set(unheard))
        if culprits:
            why = []
            if unheard:
                why.append(f"{_ranks(unheard)} not heard over the network by rank 0 (unreachable)")
            if behind:
                why.append(f"{_ranks(behind)} {reason}")
            if stale:
                why.append(f"{_ranks(stale)} stopped writing heartbeats (dead or frozen)")
            if missing:
                why.append(f"{_ranks(missing)} never wrote a heartbeat")
            lines.append(f"[rank 0] watchdog: ranks behind: {', '.join(map(str, culprits))} ({'; '.join(why)})")
        else:
            lines.append("[rank 0] watchdog: no rank stands out (all at the same step and place)")
        return "\n".join(lines)

    def _abort(self) -> None:
        if self.rank != 0:
            time.sleep(2 * self.interval + 1.0)   # let rank 0's report out first
        self._say(f"[rank {self.rank}] watchdog: aborting the job")
        from ringpipe.comm.abort import abort_job
        abort_job(1, self.comm)


def _ranks(rs) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


# ---------------------------------------------------------------------------
# Per-rank logging.

def setup_rank_logging(out_dir: str | None, rank: int, size: int, level=logging.INFO,
                       name: str = "ringpipe", stderr_level=logging.WARNING) -> logging.Logger:
    """Logger `name` writing everything at `level` to OUT/logs/rank{R}.log and
    warnings and errors to stderr as '[rank R] WARNING: ...'. Idempotent:
    calling it again replaces the handlers it added. out_dir None: stderr only."""
    logger = logging.getLogger(name)
    logger.setLevel(min(level, stderr_level))
    logger.propagate = False
    for h in list(logger.handlers):
        if getattr(h, "_ringpipe_rank_handler", False):
            logger.removeHandler(h)
            h.close()
    width = len(str(max(size - 1, 0)))
    if out_dir:
        log_dir = os.path.join(out_dir, "logs")
        os.makedirs(log_dir, exist_ok=True)
        fh = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"), mode="a")
        fh.setLevel(level)
        fh.setFormatter(logging.Formatter(
            f"%(asctime)s [rank {rank:>{width}}/{size}] %(levelname)s %(name)s: %(message)s"))
        fh._ringpipe_rank_handler = True
        logger.addHandler(fh)
    sh = logging.StreamHandler(sys.stderr)
    sh.setLevel(stderr_level)
    sh.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s: %(message)s"))
    sh._ringpipe_rank_handler = True
    logger.addHandler(sh)
    return logger
