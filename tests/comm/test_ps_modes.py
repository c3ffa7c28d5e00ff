"""comm/ps.py's steps in flight (end_step, wait_oldest, wait_sent: bounded staleness)
and mode="async" (serve_async).

    mpiexec -n 2 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/comm/test_ps_modes.py   # and -n 4

The last rank serves, the others work. Steps in flight: the servers serve every step as
in sync, and each pull lands in its own buffer, oldest first. Async: each worker's push of
a chunk is applied alone, as it arrives; the worker gets the chunk after its own update
(and those that arrived before), never a sum.
"""

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.comm.ps import ParameterServerGroup

WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
N = 300                     # elements; chunks of 64 float64 (512 bytes): 5 chunks


def agree(problems):
    everyone = WORLD.allgather(problems[:10])
    flat = [f"rank {r}: {x}" for r, lst in enumerate(everyone) for x in lst]
    assert not flat, "\n".join(flat[:40])


def roles():
    if P < 2:
        pytest.skip("a worker and a server: 2 ranks or more")
    return list(range(P - 1)), [P - 1]


@pytest.mark.mpi(min_size=2)
def test_steps_in_flight_land_oldest_first():
    workers, servers = roles()
    steps, problems = 4, []
    with ParameterServerGroup(WORLD, workers, servers, N, np.float64, chunk_bytes=512, op="sum") as g:
        if RANK in workers:
            grads = [np.full(N, float(t + 1) * (RANK + 1)) for t in range(steps)]
            landing = [np.zeros(N) for _ in range(steps)]
            for t in range(steps):
                g.start_pull(landing[t])
                g.push(grads[t], 0, N)
                g.end_step()                     # on without waiting
            assert g.in_flight == steps
            g.wait_sent()
            norms = [g.wait_oldest() for _ in range(steps)]
            total = sum(range(1, len(workers) + 1))
            for t in range(steps):
                # The server's update: the running sum of the summed gradients.
                want = total * sum(range(1, t + 2))
                if not np.array_equal(landing[t], np.full(N, float(want))):
                    problems.append(f"step {t}: pulled {landing[t][:3]}, want {want}")
                if norms[t] != N * float(total * (t + 1)) ** 2:
                    problems.append(f"step {t}: norm {norms[t]}")
        else:
            master = np.zeros(N)

            def update(c, summed, scale):
                lo, hi = g.layout.bounds(c)
                master[lo:hi] += summed
                return master[lo:hi]
            for _ in range(steps):
                g.serve_step(update)
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_async_applies_each_push_alone():
    workers, servers = roles()
    problems = []
    with ParameterServerGroup(WORLD, workers, servers, N, np.float64, chunk_bytes=512, mode="async") as g:
        for step in range(3):
            if RANK in workers:
                params = np.zeros(N)
                g.start_pull(params)
                g.push(np.full(N, 10.0 ** RANK), 0, N)
                if g.wait_pull() is not None:
                    problems.append("async: a norm came back")
                # Each chunk holds 1 + this worker's own push, plus any pushes applied before it:
                # its own digit is there, and no push more than once.
                for c in range(g.layout.n_chunks):
                    lo, hi = g.layout.bounds(c)
                    applied = int(params[lo]) - 1      # (the server starts each step from ones)
                    digits = [applied // 10 ** w % 10 for w in range(len(workers))]
                    if digits[RANK] != 1 or any(d > 1 for d in digits):
                        problems.append(f"step {step} chunk {c}: {params[lo]}")
                    if not np.all(params[lo:hi] == params[lo]):
                        problems.append(f"step {step} chunk {c}: not one value")
            else:
                seen = []
                master = np.ones(N)

                def update(c, w, grad):
                    lo, hi = g.layout.bounds(c)
                    seen.append((c, w))
                    master[lo:hi] += grad
                    return master[lo:hi].copy()
                g.serve_async(update)
                if sorted(seen) != [(c, w) for c in range(g.layout.n_chunks) for w in range(len(workers))]:
                    problems.append(f"step {step}: applied {sorted(seen)}")
            WORLD.Barrier()
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_modes_refuse_the_other_serving():
    workers, servers = roles()
    problems = []
    with ParameterServerGroup(WORLD, workers, servers, N, np.float64, chunk_bytes=512, mode="async") as g:
        if RANK in servers:
            try:
                g.reduce()
                problems.append("reduce() in an async group did not refuse")
            except ValueError as e:
                if "serve_async" not in str(e):
                    problems.append(str(e))
    agree(problems)
