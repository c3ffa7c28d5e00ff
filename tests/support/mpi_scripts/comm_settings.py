"""Each rank makes one collective and prints one JSON line: {"rank": R,
"error": null or "Type: message"}; exits 1 if its call raised. Launched MPMD
with different RINGPIPE_* variables per block (tests/comm/test_comm_fingerprint.py),
where every rank must raise the same error instead of hanging.
Usage: mpiexec ... python comm_settings.py [allreduce|swap|buckets]
  allreduce  one all-reduce
  swap       ranks pass float32 / int32 layouts of the same size, never used
             before (with RINGPIPE_COMM_CHECK=off only the fingerprints see it)
  buckets    construct a GradBuckets"""
import json
import sys


import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402

world = MPI.COMM_WORLD
rank = world.Get_rank()
what = sys.argv[1] if len(sys.argv) > 1 else "allreduce"
try:
    if what == "allreduce":
        comm.allreduce(np.ones(10), world)
    elif what == "swap":
        comm.allreduce(np.ones(5000, np.float32 if rank == 0 else np.int32), world, algorithm="ring")
    elif what == "buckets":
        comm.GradBuckets(np.zeros(100, np.float32), [(0, 50), (50, 100)], world).close()
    else:
        raise SystemExit(f"unknown {what!r}")
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
# One write per line: the launcher merges the ranks' output.
sys.stdout.write(json.dumps({"rank": rank, "error": error}) + "\n")
sys.stdout.flush()
sys.exit(1 if error else 0)
