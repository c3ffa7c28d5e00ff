"""comm collectives on device arrays equal the same collectives on host arrays.

Run under mpiexec with a cupy on the path (the real one, or tests/support/fake_cupy.py)
and RINGPIPE_CUDA_AWARE_MPI=1 (device buffers straight to MPI, reductions on the
GPU) or 0 (staged through pinned host memory). Prints one JSON line on rank 0:
{"ok": bool, "problems": [...], "direct": bool, "staged_bytes": int}.
"""
import json


import cupy  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from ringpipe import comm  # noqa: E402
from ringpipe.comm import device  # noqa: E402
from ringpipe.comm.ring import set_subchunk_bytes  # noqa: E402

world = MPI.COMM_WORLD
p, rank = world.Get_size(), world.Get_rank()
problems = []


def data(n, dtype, salt):
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.standard_normal(n).astype(dtype)


def check(label, got, want):
    got = cupy.asnumpy(got)
    if got.shape != want.shape or got.tobytes() != want.tobytes():
        problems.append(f"rank {rank}: {label}: device result differs from host result")


set_subchunk_bytes(4096)              # several sub-chunks per ring chunk even at these sizes
for salt, (n, dtype) in enumerate([(1, np.float32), (37, np.float64), (5000, np.float32),
                                   (100_003, np.float32), (20_000, np.float16)]):
    for op in ("sum", "avg", "max"):
        for algo in ("ring", "small"):
            host = data(n, dtype, salt)
            dev = cupy.asarray(host)
            comm.allreduce(host, world, op=op, algorithm=algo)
            comm.allreduce(dev, world, op=op, algorithm=algo)
            check(f"allreduce n={n} {np.dtype(dtype)} {op} {algo}", dev, host)
    host = data(n, dtype, salt)
    dev = cupy.asarray(host)
    lo, hi = comm.chunk_bounds(n, p)[rank]
    check(f"reduce_scatter n={n}", comm.reduce_scatter(dev, world), comm.reduce_scatter(host, world))
    host, dev = host.copy(), cupy.asarray(host)
    comm.allgather(host, world)
    comm.allgather(dev, world)
    check(f"allgather n={n}", dev, host)

# A strided device buffer is refused the same way on every rank, whichever the path.
try:
    comm.allreduce(cupy.zeros(10, np.float32)[::2], world)
    problems.append(f"rank {rank}: a strided device buffer was accepted")
except ValueError as e:
    if "contiguous" not in str(e):
        problems.append(f"rank {rank}: strided device buffer: unexpected error {e}")

# Gradient buckets, with and without the progress thread.
ranges = [(0, 1000), (1000, 1300), (1300, 50_000), (50_000, 50_007)]
for overlap in (False, True):
    host = data(50_007, np.float32, 99)
    dev = cupy.asarray(host)
    for grad in (host, dev):
        with comm.GradBuckets(grad, ranges, comm=world, bucket_bytes=40_000, overlap=overlap) as gb:
            for i in reversed(range(len(ranges))):
                gb.mark_ready(i)
            gb.wait()
    check(f"GradBuckets overlap={overlap}", dev, host)

problems = [x for lst in world.allgather(problems) for x in lst]
if rank == 0:
    print(json.dumps({"ok": not problems, "problems": problems, "direct": device.cuda_aware(),
                      "staged_bytes": device.stats["staged_bytes"]}), flush=True)
