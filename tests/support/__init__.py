"""What the tests share: where things are, and helpers that are not tests.

    mpi_pytest.py      pytest on every MPI rank (tests/run_all.sh runs it under mpiexec)
    mpi_scripts/       small MPI programs the tests launch as jobs
    slurm_jobs/        batch scripts and programs for the real-Slurm tests
    fake_cupy.py       a CPU emulation of CuPy that runs our CUDA C kernels (with cuda_emu.h)
    cuda_sim_check.py  the Numba CUDA kernels under NUMBA_ENABLE_CUDASIM
    emulated.py        the emulated-node tests' run losses and act-once-training thread
    bench_cli.py       a benchmark's clean environment, and "refused before any work"
    hostile.py         the hostile-input tests' deadline (a hang becomes a failure) and a small disk to fill
"""
import os
import socket
import sys

SUPPORT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(SUPPORT))          # the repository
MPI_SCRIPTS = os.path.join(SUPPORT, "mpi_scripts")
SLURM_JOBS = os.path.join(SUPPORT, "slurm_jobs")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def free_port_pair(fallback: int) -> int:
    """A port p with p and p+1 free (a local slurmctld and slurmd), so parallel runs do not
    collide; `fallback` when none is found in 50 tries."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 60000:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", p))
                b.bind(("", p + 1))
            return p
        except OSError:
            continue
    return fallback
