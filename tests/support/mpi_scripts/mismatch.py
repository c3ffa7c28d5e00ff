"""Ranks call allreduce with different layouts; every rank must raise a clear
RuntimeError and the abort handler must end the job.
Usage: mpiexec -n 2 python mismatch.py length|dtype"""
import sys


import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402

comm.install_abort_handler()
world = MPI.COMM_WORLD
rank = world.Get_rank()
what = sys.argv[1] if len(sys.argv) > 1 else "length"
if what == "length":
    buf = np.ones(1000 + rank, np.float32)
else:
    buf = np.ones(1000, np.float32 if rank == 0 else np.float64)
comm.allreduce(buf, world)
print("unreachable: mismatched allreduce returned", flush=True)
