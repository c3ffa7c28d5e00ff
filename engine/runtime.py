"""Process-level settings that must happen before heavy work starts."""
from __future__ import annotations

import ctypes
import ctypes.util
import os


def set_thread_defaults():
    """Several ranks on one node must not each start one BLAS/Numba thread per
    core: split the cores among local ranks unless the user already chose. Call
    before numpy is imported, since BLAS reads these once at load time."""
    local = next((os.environ[k] for k in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                          "SLURM_NTASKS_PER_NODE") if os.environ.get(k)), None)
    try:
        local = int(local.split("(")[0]) if local else 1
    except ValueError:
        local = 1
    per_rank = str(max(1, (os.cpu_count() or 1) // max(1, local)))
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, per_rank)
    # Numba's OpenMP threads spin after each parallel kernel and starve BLAS's
    # threads on the same cores: measured 10x slower GPT steps on 2 cores. Passive
    # waiting costs a few microseconds per kernel launch instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
