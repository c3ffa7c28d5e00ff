"""A 4-rank job in which rank 2 raises after MPI init, while the others wait in
an Allreduce that would never complete. comm.install_abort_handler() turns the
exception into MPI_Abort; with `srun --kill-on-bad-exit=1` the whole step ends
at once. Prints CRASH_AT <epoch seconds> just before raising."""
import os
import time


import numpy as np  # noqa: E402

from ringpipe import comm  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm.install_abort_handler()
world = MPI.COMM_WORLD
CRASH_RANK = int(os.environ.get("CRASH_RANK", "2"))
world.Barrier()
buf = np.zeros(1)
for step in range(3):
    world.Allreduce(MPI.IN_PLACE, buf)
if world.Get_rank() == CRASH_RANK:
    print(f"CRASH_AT {time.time():.3f}", flush=True)
    raise RuntimeError(f"injected failure on rank {CRASH_RANK}")
while True:                       # the others: the next collective never completes
    world.Allreduce(MPI.IN_PLACE, buf)
