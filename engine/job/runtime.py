"""Process-level settings that must happen before heavy work starts."""
from __future__ import annotations

import ctypes
import ctypes.util
import difflib
import os
import signal

from ringpipe import threads

# Stop signals that arrived before the trainer's StopFlag existed (see
# catch_stop_signals_early); the StopFlag takes them over.
pending_stop_signals: list[int] = []
_EARLY_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def _note_early_signal(signum, frame):
    # A second SIGTERM/SIGINT before training started: nothing to save yet, stop now.
    if signum != signal.SIGUSR1 and signum in pending_stop_signals:
        os._exit(128 + signum)
    pending_stop_signals.append(signum)


def catch_stop_signals_early() -> None:
    """From the first lines of the trainer on, a SIGUSR1/SIGTERM/SIGINT is kept
    for the StopFlag instead of killing the process (or being swallowed by
    MPICH's own SIGUSR1 handler): a job told to stop while it starts up stops
    at its first step boundary, with a checkpoint. Stdlib only, so it runs
    before numpy is imported."""
    for s in _EARLY_SIGNALS:
        signal.signal(s, _note_early_signal)


def local_rank_count() -> int:
    """How many ranks share this node, as the launcher says; 1 when not launched by one."""
    return threads.local_rank_count()


def set_thread_defaults() -> None:
    """The BLAS/Numba thread defaults (ringpipe/threads.py: the cores this process may use,
    split among the node's ranks; passive OpenMP waiting; the user's settings win). Importing
    ringpipe set them already, before numpy could load; calling this says so where it matters
    and costs nothing."""
    threads.apply_defaults()


def thread_report() -> list[str]:
    """The start-up report's lines on threads: how many per rank and why, and the
    oversubscription warning unless this process already printed it."""
    return threads.report_lines()


def reuse_freed_memory():
    """Keep large freed blocks in the heap instead of returning them to the OS.

    glibc serves allocations above 128 KiB with mmap and unmaps them on free, so
    every activation array of every step is fresh memory and pays a page fault
    per 4 KiB on first touch (measured here: 3x fewer minor faults and ~8% less
    CPU per GPT step with this). No effect where glibc's mallopt is absent."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)
        return bool(ok)
    except (OSError, AttributeError):
        return False


# Every RINGPIPE_* variable something in this repository reads: the trainer and
# comm, the Slurm batch scripts, the local Slurm, the tests. (A test checks the
# list against the repository.) Any other name is most likely a typo.
KNOWN_VARIABLES = (
    "RINGPIPE_ALLREDUCE_CROSSOVER", "RINGPIPE_CACHE", "RINGPIPE_CALIBRATION", "RINGPIPE_CLUSTER_DIR",
    "RINGPIPE_COMM_CHECK", "RINGPIPE_NODES", "RINGPIPE_NODES_DIR", "RINGPIPE_CUDA_AWARE_MPI", "RINGPIPE_RING_SUBCHUNK",
    "RINGPIPE_SKIP_LAUNCHER_CHECK", "RINGPIPE_BF16_GEMM", "RINGPIPE_SGEMM",
    "RINGPIPE_MAX_RESTARTS", "RINGPIPE_PYTHON", "RINGPIPE_ROOT", "RINGPIPE_RUN_DIR", "RINGPIPE_SRUN_ARGS",
    "RINGPIPE_SRUN_MPI", "RINGPIPE_THREAD_DEFAULTS", "RINGPIPE_NODE_LOAD",
    "RINGPIPE_SLURM_CPUS", "RINGPIPE_SLURM_DIR", "RINGPIPE_SLURM_FIRST_JOB_ID", "RINGPIPE_SLURM_HOLDER_PID",
    "RINGPIPE_SLURM_NO_INSTALL",
    "RINGPIPE_SLURM_PORT", "RINGPIPE_SLURM_PURGE", "RINGPIPE_SLURM_TIMEOUT", "RINGPIPE_NETNS_PREFIX",
    "RINGPIPE_CUDA_EMU", "RINGPIPE_KEEP_SLURM", "RINGPIPE_REQUIRE_SLURM", "RINGPIPE_TEST_SLURM_DIR",
    "RINGPIPE_TOOLS_NO_INSTALL",
)


def unknown_variables(environ=None) -> list[str]:
    """A note for each RINGPIPE_* variable in the environment that nothing reads,
    naming the known one it most resembles (a typo would otherwise do nothing)."""
    environ = os.environ if environ is None else environ
    notes = []
    for name in sorted(n for n in environ if n.startswith("RINGPIPE_") and n not in KNOWN_VARIABLES):
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1)
        notes.append(f"note: {name} is set but ringpipe reads no such variable"
                     + (f"; did you mean {close[0]}?" if close else ""))
    return notes
