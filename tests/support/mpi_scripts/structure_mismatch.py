"""After both layouts were used once on every rank, ranks pass layouts whose
messages differ in size or number. The ranks that receive an odd message must
raise a clear RuntimeError, and the abort handler must end the job.
Usage: mpiexec -n P python structure_mismatch.py CASE   (CASE: see CASES)"""
import sys


import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402
from ringpipe.comm.ring import set_subchunk_bytes  # noqa: E402

comm.install_abort_handler()
world = MPI.COMM_WORLD
rank, p = world.Get_rank(), world.Get_size()
odd = rank == 1              # the rank whose layout differs


def allreduce(algorithm):
    return lambda buf: comm.allreduce(buf, world, algorithm=algorithm)


# CASE: (run one call, this rank's buffer as (length, dtype), the other layout it used before)
CASES = {
    "ring-dtype-size": (allreduce("ring"), (5000, np.float32), (5000, np.float64)),
    "ring-length": (allreduce("ring"), (5000, np.float32), (5001, np.float32)),
    "small-dtype-size": (allreduce("small"), (10, np.float32), (10, np.float64)),
    "small-length": (allreduce("small"), (10, np.float32), (11, np.float32)),
    "reduce_scatter-length": (lambda b: comm.reduce_scatter(b, world), (5000, np.float32), (4000, np.float32)),
    "allgather-dtype-size": (lambda b: comm.allgather(b, world), (5000, np.float32), (5000, np.int64)),
    # fewer elements than ranks: a dtype of the same size counts as structure there
    "reduce_scatter-few-elements": (lambda b: comm.reduce_scatter(b, world), (1, np.float32), (1, np.int32)),
    "allgather-few-elements": (lambda b: comm.allgather(b, world), (1, np.float32), (1, np.int32)),
}

case = sys.argv[1]
if case in CASES:
    run, usual, other = CASES[case]
    for n, dtype in (usual, other):       # every rank uses both layouts once
        run(np.ones(n, dtype))
    n, dtype = other if odd else usual
    run(np.ones(n, dtype))
elif case == "subchunk":
    buf = np.ones(100_000, np.float32)
    comm.allreduce(buf, world, algorithm="ring")
    set_subchunk_bytes(64 * 1024 if odd else 1 << 20)    # one rank retunes alone
    comm.allreduce(buf, world, algorithm="ring")
elif case == "crossover":
    buf = np.ones(5000, np.float32)                      # 20000 bytes
    comm.allreduce(buf, world, algorithm="ring")
    comm.allreduce(buf, world, algorithm="small")
    comm.set_crossover(1000 if odd else 1 << 20)         # "auto": ring on one rank, small elsewhere
    comm.allreduce(buf, world)
elif case == "rs-vs-ag":
    buf = np.ones(5000, np.float32)
    comm.reduce_scatter(buf, world)
    comm.allgather(buf, world)
    (comm.allgather if odd else comm.reduce_scatter)(buf, world)
else:
    raise SystemExit(f"unknown case {case!r}; use one of {sorted(CASES) + ['subchunk', 'crossover', 'rs-vs-ag']}")
print("unreachable: mismatched collective returned", flush=True)
