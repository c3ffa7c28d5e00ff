"""Run pytest on every MPI rank; show rank 0's report, and another rank's only if it failed.

Each rank writes its report to a temp file; rank 0 prints its own, then any
failing rank's, so a failure on rank 3 is never hidden behind rank 0's pass.
"""
import os
import sys
import tempfile

import pytest
from mpi4py import MPI

world = MPI.COMM_WORLD
rank = world.Get_rank()
log = os.path.join(tempfile.gettempdir(), f"ringpipe-pytest-{os.getpid()}-rank{rank}.log")
saved = os.dup(1), os.dup(2)
if rank != 0:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
rc = int(pytest.main(sys.argv[1:] + ["-p", "no:cacheprovider"]))
sys.stdout.flush()
sys.stderr.flush()
os.dup2(saved[0], 1)
os.dup2(saved[1], 2)
codes = world.gather((rc, log), root=0)
if rank == 0:
    for r, (code, path) in enumerate(codes):
        if r and code not in (0, 5):
            print(f"\n==== rank {r} of {world.Get_size()} failed (pytest exit {code}); its report: ====")
            print(open(path).read())
worst = max((c for c, _ in codes), key=lambda c: (c not in (0, 5), c)) if rank == 0 else 0
worst = world.bcast(worst, root=0)        # also: rank 0 has read every report before any is removed
try:
    os.remove(log)
except OSError:
    pass
sys.exit(worst)
