"""Tests for comm/ps.py (the parameter server's communication) and its cost
model (comm/costmodel.py).

    python -m pytest tests/comm/test_ps.py                                          # serial part
    mpiexec -n 2 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/comm/test_ps.py   # and -n 4

The determinism contract: the gradient a server sums equals, bitwise, what
comm.allreduce(..., algorithm="small") gives on the workers; the global norm
equals, bitwise, the per-chunk sums of squares of that gradient added in
chunk order on one process; every worker pulls exactly what the owner's
update returned, step after step. MPI tests collect each rank's problems and
agree before asserting, so a failure shows on every rank.
"""

import math
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe import comm
from ringpipe.comm import costmodel
from ringpipe.comm.ps import (CHUNK_BYTES, ParameterServerGroup, ordered_sum, ps_layout, ps_ranks,
                              server_norm_sq, tree_sum)

WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def agree(problems):
    everyone = WORLD.allgather(problems[:10])
    flat = [f"rank {r}: {x}" for r, lst in enumerate(everyone) for x in lst]
    assert not flat, "\n".join(flat[:40])


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---- the layout (serial) ---------------------------------------------------------------


def test_layout_interleaves_chunks_round_robin():
    lay = ps_layout(1000, 4, workers=[3, 1, 2, 0], servers=[5, 4], chunk_bytes=256)
    assert lay.chunk_elements == 64 and lay.n_chunks == 16
    assert lay.workers == (0, 1, 2, 3) and lay.servers == (4, 5) and not lay.colocated
    assert [lay.owner(c) for c in range(4)] == [4, 5, 4, 5]
    assert list(lay.owned_by(5)) == list(range(1, 16, 2)) and list(lay.owned_by(0)) == []
    assert lay.bounds(15) == (960, 1000)                 # the last chunk is shorter
    assert list(lay.chunks_in(60, 130)) == [0, 1, 2] and list(lay.chunks_in(64, 128)) == [1]
    assert list(lay.chunks_in(5, 5)) == []
    covered = sorted(i for s in lay.servers for c in lay.owned_by(s) for i in range(*lay.bounds(c)))
    assert covered == list(range(1000))


def test_layout_colocated_and_chunk_size():
    lay = ps_layout(10, 8, [0, 1], [1, 0], chunk_bytes=20)    # 20 bytes hold 2 float64
    assert lay.colocated and lay.chunk_elements == 2 and lay.n_chunks == 5
    assert ps_layout(10, 4, [0], [0]).chunk_elements == CHUNK_BYTES // 4 == 1 << 20


@pytest.mark.parametrize("kwargs, says", [
    (dict(workers=[0, 1], servers=[]), "no servers"),
    (dict(workers=[], servers=[0]), "no workers"),
    (dict(workers=[0, 1], servers=[2, 2]), "more than once"),
    (dict(workers=[0, 0], servers=[2]), "more than once"),
    (dict(workers=[0, -1], servers=[2]), "integers >= 0"),
    (dict(workers=[0], servers=[1], chunk_bytes=2), "chunk_bytes >= 4"),
    (dict(workers=[0], servers=[1], n_elements=0), "n_elements >= 1"),
])
def test_layout_refuses_bad_input(kwargs, says):
    args = dict(n_elements=100, itemsize=4, chunk_bytes=64) | kwargs
    with pytest.raises(ValueError, match=says):
        ps_layout(**args)


def test_ps_ranks():
    assert ps_ranks(4, 0) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert ps_ranks(4, 1) == ([0, 1, 2], [3])
    assert ps_ranks(6, 2) == ([0, 1, 2, 3], [4, 5])
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="--ps-servers"):
            ps_ranks(4, bad)


# ---- the sums (serial) -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_tree_sum_is_recursive_doublings_order(n):
    rng = np.random.default_rng(n)
    # Magnitudes that differ per element: another order gives other bits (checked for n >= 4).
    x = [(rng.standard_normal(257) * 10.0 ** rng.integers(-4, 5, size=257)).astype(np.float32) for _ in range(n)]
    expected = {
        1: x[0] if n == 1 else None,
        2: x[0] + x[1] if n > 1 else None,
        3: (x[0] + x[1]) + x[2] if n > 2 else None,
        4: (x[0] + x[1]) + (x[2] + x[3]) if n > 3 else None,
        5: ((x[0] + x[1]) + x[2]) + (x[3] + x[4]) if n > 4 else None,
        6: ((x[0] + x[1]) + (x[2] + x[3])) + (x[4] + x[5]) if n > 5 else None,
        7: ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + x[6]) if n > 6 else None,
        8: ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])) if n > 7 else None,
    }[n]
    assert same_bits(tree_sum(np.stack(x)), expected)
    if n >= 4:
        in_a_row = x[0]
        for v in x[1:]:
            in_a_row = in_a_row + v
        assert not same_bits(in_a_row, expected)


def test_norm_parts_and_ordered_sum():
    chunks = [np.array([3.0, 4.0], np.float32), np.array([1e8], np.float32), np.array([1.0], np.float32)]
    assert list(server_norm_sq(chunks)) == [25.0, 1e16, 1.0]
    # One by one: 1e16 + 1 loses the 1 in float64; fsum would keep it.
    assert ordered_sum([1e16, 1.0, 1.0]) == 1e16 and math.fsum([1e16, 1.0, 1.0]) != 1e16


# ---- one rank: worker and server at once (serial, on COMM_SELF) ----------------------------


def _one_rank_group(n=100, chunk_bytes=32, op="avg"):
    return ParameterServerGroup(MPI.COMM_SELF, [0], [0], n, np.float32, chunk_bytes=chunk_bytes, op=op)


def test_one_rank_steps_round_trip():
    n = 100
    g = _one_rank_group(n)
    master = np.arange(n, dtype=np.float32)
    params = np.zeros(n, np.float32)
    for step in range(3):
        grad = np.full(n, step + 1.0, np.float32)
        g.start_pull(params)                       # may be posted before the pushes
        for lo, hi in [(70, 100), (3, 70), (0, 3)]:   # buckets from the end, not on chunk bounds
            g.push(grad, lo, hi)

        def update(c, summed, scale):
            lo, hi = g.layout.bounds(c)
            master[lo:hi] -= np.float32(scale) * summed
            return master[lo:hi]
        norm_sq = g.serve_step(update, clip_scale=lambda nsq: 0.5)
        assert norm_sq == n * (step + 1.0) ** 2
        assert g.wait_pull() == norm_sq
        assert same_bits(params, master)
    g.free()


def test_one_rank_reduce_then_send_params():
    """serve_step's two halves, with the caller's own code between them: the summed chunks
    written into the pushed gradient buffer itself once wait_pushes() returns (the colocated PS)."""
    n = 100
    g = _one_rank_group(n)
    master = np.arange(n, dtype=np.float32)
    with pytest.raises(ValueError, match="reduce\\(\\) first"):
        g.send_params([])
    for step in range(2):
        grad = np.full(n, step + 2.0, np.float32)
        g.push(grad, 0, n)
        norm_sq = g.reduce()
        assert norm_sq == n * (step + 2.0) ** 2
        with pytest.raises(ValueError, match="reduced already"):
            g.reduce()
        g.wait_pushes()
        for c, summed in zip(g.layout.owned_by(0), g.summed):
            lo, hi = g.layout.bounds(c)
            grad[lo:hi] = summed * np.float32(0.5)
            master[lo:hi] -= grad[lo:hi]
        params = np.zeros(n, np.float32)
        g.start_pull(params)
        g.send_params([master[lo:hi].copy() for lo, hi in map(g.layout.bounds, g.layout.owned_by(0))])
        assert g.wait_pull() == norm_sq
        assert same_bits(params, master)
    g.free()


def test_one_rank_refuses_misuse():
    n = 100
    g = _one_rank_group(n)
    grad = np.ones(n, np.float32)
    with pytest.raises(ValueError, match="1-D float32"):
        g.push(np.ones(n, np.float64), 0, n)
    with pytest.raises(ValueError, match="not inside"):
        g.push(grad, 0, n + 1)
    g.push(grad, 0, 50)
    with pytest.raises(ValueError, match="overlaps"):
        g.push(grad, 40, 60)
    with pytest.raises(ValueError, match="same gradient buffer"):
        g.push(grad.copy(), 50, 60)
    with pytest.raises(ValueError, match="waits for itself"):
        g.serve_step(lambda c, s, k: s)
    with pytest.raises(ValueError, match="shares memory"):
        g.start_pull(grad)
    params = np.zeros(n, np.float32)
    g.start_pull(params)
    with pytest.raises(ValueError, match="50 of 100 elements were not pushed"):
        g.wait_pull()
    g.push(grad, 50, n)
    # An update that returns the wrong thing breaks the group: later calls refuse.
    with pytest.raises(ValueError, match="contiguous float32"):
        g.serve_step(lambda c, s, k: s.astype(np.float64))
    with pytest.raises(RuntimeError, match="no longer works"):
        g.wait_pull()
    g.free()


def test_group_refuses_bad_arguments():
    with pytest.raises(ValueError, match="not in the 1-rank communicator"):
        ParameterServerGroup(MPI.COMM_SELF, [0], [1], 10, np.float32)
    with pytest.raises(ValueError, match="not float16"):
        ParameterServerGroup(MPI.COMM_SELF, [0], [0], 10, np.int32)
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        ParameterServerGroup(MPI.COMM_SELF, [0], [0], 10, np.float32, op="max")
    with pytest.raises(ValueError, match="no servers"):
        ParameterServerGroup(MPI.COMM_SELF, [0], [], 10, np.float32)


# ---- the cost model (serial) ----------------------------------------------------------------


def test_link_bytes_match_the_issue():
    M, n = 1000.0, 8
    assert costmodel.ring_link_bytes(M, n) == 2 * (n - 1) / n * M
    assert costmodel.ps_link_bytes(M, n, 1) == n * M                       # single master: n M each way
    assert costmodel.ps_link_bytes(M, n, n) == M                           # K = n: M each way
    assert costmodel.ps_link_bytes(M, n, 2) == n * M / 2                   # the servers' links are busiest
    assert costmodel.ps_link_bytes(M, n, 16) == M                          # the workers' links are
    assert costmodel.ps_link_bytes(M, n, 0) == costmodel.ring_link_bytes(M, n)   # colocated = the ring
    assert costmodel.hierarchical_link_bytes(M, 2) == M
    # "about n/2x worse" and "up to 2x better" than the ring
    ring = costmodel.ring_link_bytes(M, n)
    assert costmodel.ps_link_bytes(M, n, 1) / ring == pytest.approx(n / 2 * n / (n - 1))
    assert ring / costmodel.ps_link_bytes(M, n, n) == pytest.approx(2 * (n - 1) / n)


def test_ps_time_formulas():
    lvl = costmodel.Level(alpha=1e-5, beta=1e-9)
    M, n, C = 64 << 20, 4, 4 << 20
    c = 16
    assert costmodel.ps_time(lvl, M, n, 2, C) == pytest.approx(
        2 * max(c * lvl.alpha + M * lvl.beta, n * c / 2 * lvl.alpha + n * M / 2 * lvl.beta))
    assert costmodel.ps_time(lvl, M, n, n, C, overlap=True) == pytest.approx(c * lvl.alpha + M * lvl.beta)
    assert costmodel.ps_time(lvl, M, n, 0, C) == pytest.approx(
        2 * (0.75 * c * lvl.alpha + 0.75 * M * lvl.beta))
    assert costmodel.ring_time(lvl, M, n) == pytest.approx(2 * 3 * lvl.alpha + 1.5 * M * lvl.beta)
    # The ring's method on one node is ring_time on the inside level.
    model = costmodel.CostModel(lvl, lvl, 1, n)
    assert model.ring(M) == pytest.approx(costmodel.ring_time(lvl, M, n))
    # Bandwidth-bound: K = n with overlap beats the ring, a single master loses to it.
    assert costmodel.ps_time(lvl, M, n, n, C, overlap=True) < costmodel.ring_time(lvl, M, n)
    assert costmodel.ps_time(lvl, M, n, 1, C) > costmodel.ring_time(lvl, M, n)


# ---- MPI: the determinism contract -----------------------------------------------------------


def _configs(p):
    """(name, workers, servers) that fit p ranks."""
    out = [("colocated", list(range(p)), list(range(p)))]
    if p >= 2:
        out.append(("1 worker + 1 server", [0], [1]))
    if p >= 3:
        out.append(("2 workers + 1 server", [0, 1], [p - 1]))
    if p >= 4:
        out += [("2 workers + 2 servers", [0, 1], [2, 3]),
                ("3 workers + 1 server", [0, 1, 2], [3]),
                ("4 workers, 2 of them servers", [0, 1, 2, 3], [1, 3])]
    return out


def _buckets(n):
    """Bucket ranges from the end of the buffer, not on chunk boundaries (as GradBuckets makes them)."""
    cuts = [c for c in (0, 7, 37, 300, 301, 777) if c < n] + [n]
    return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 2, -1, -1)]


def _run_and_check(workers, servers, op, dtype=np.float32, n=1000, steps=3, chunk_bytes=64):
    problems = []
    g = ParameterServerGroup(WORLD, workers, servers, n, dtype, chunk_bytes=chunk_bytes, op=op)
    lay = g.layout
    wcomm = WORLD.Split(0 if g.is_worker else MPI.UNDEFINED, RANK)
    master = np.random.default_rng(7).standard_normal(n).astype(dtype)     # the servers' chunks of it
    params = np.empty(n, dtype)
    for step in range(steps):
        ref = norm_pulled = None
        if g.is_worker:
            rng = np.random.default_rng(1000 * step + RANK)     # magnitudes vary: the order shows in the bits
            grad = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(dtype)
            ref = grad.copy()
            comm.allreduce(ref, wcomm, op=op, algorithm="small")
            for lo, hi in _buckets(n):
                g.push(grad, lo, hi)
        if RANK == lay.servers[-1] and step == 1:
            time.sleep(0.05)           # one server late: the workers' next pushes queue up meanwhile
        summed, sent, norm_served = {}, {}, None
        if g.is_server:
            def update(c, s, scale):
                lo, hi = lay.bounds(c)
                summed[c] = s.copy()
                master[lo:hi] -= (np.asarray(scale, dtype) * s).astype(dtype)
                sent[c] = master[lo:hi].copy()
                return master[lo:hi]
            norm_served = g.serve_step(update, clip_scale=lambda nsq: 0.25)
        if g.is_worker:
            norm_pulled = g.pull(params)
            pulled = params.copy()
        else:
            pulled = None
        everyone = WORLD.allgather((g.is_worker, g.is_server, ref, pulled, summed, sent, norm_served,
                                    norm_pulled))
        # The reference: the first worker's all-reduce (every worker's is the same bits).
        reference = next(e[2] for e in everyone if e[0])
        owner_summed = {c: s for e in everyone if e[1] for c, s in e[4].items()}
        owner_sent = {c: s for e in everyone if e[1] for c, s in e[5].items()}
        if sorted(owner_summed) != list(range(lay.n_chunks)):
            problems.append(f"step {step}: servers updated chunks {sorted(owner_summed)}")
            break
        for c in range(lay.n_chunks):
            lo, hi = lay.bounds(c)
            if not same_bits(owner_summed[c], reference[lo:hi]):
                problems.append(f"step {step}: chunk {c}'s sum differs from allreduce(algorithm='small')")
        expected_norm = ordered_sum(server_norm_sq([reference[slice(*lay.bounds(c))]
                                                    for c in range(lay.n_chunks)]))
        expected_params = np.concatenate([owner_sent[c] for c in range(lay.n_chunks)])
        for r, (is_w, is_s, _, got, _, _, ns, npull) in enumerate(everyone):
            if is_s and ns != expected_norm:
                problems.append(f"step {step}: server {r}'s norm {ns!r} != {expected_norm!r}")
            if is_w and npull != expected_norm:
                problems.append(f"step {step}: worker {r} pulled norm {npull!r} != {expected_norm!r}")
            if is_w and not same_bits(got, expected_params):
                problems.append(f"step {step}: worker {r}'s pulled parameters differ from the updates")
    g.free()
    if wcomm != MPI.COMM_NULL:
        wcomm.Free()
    return problems


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("config", range(6))
def test_ps_sums_like_small_allreduce(config, op):
    configs = _configs(P)
    if config >= len(configs):
        pytest.skip(f"configuration {config} needs more than {P} ranks")
    name, workers, servers = configs[config]
    problems = _run_and_check(workers, servers, op)
    agree([f"{name}, op={op}: {p}" for p in problems])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_ps_other_dtypes_colocated(dtype):
    agree(_run_and_check(list(range(P)), list(range(P)), "avg", dtype=dtype, n=500, steps=2, chunk_bytes=48))


@pytest.mark.mpi(min_size=2)
def test_ps_one_chunk_per_step_and_large_chunks():
    # Default-sized chunks: the whole buffer is one chunk, owned by the first server.
    agree(_run_and_check(list(range(P)), list(range(P)), "avg", n=1000, steps=2, chunk_bytes=CHUNK_BYTES))


@pytest.mark.mpi(min_size=2)
def test_ps_mismatched_arguments_raise_on_every_rank():
    with pytest.raises(RuntimeError, match="ParameterServerGroup"):
        ParameterServerGroup(WORLD, list(range(P)), list(range(P)), 100 + (RANK == 1), np.float32)


# ---- MPI: the streamed step (no clipping) -----------------------------------------------------


def _streamed_vs_blocking(workers, servers, op="avg", n=1000, steps=3, chunk_bytes=64):
    """Two groups, the same pushes: one served by reduce()+send_params() with scale 1,
    the other by serve_streamed(); the workers must pull the same bits and norms."""
    problems = []
    groups = {how: ParameterServerGroup(WORLD, workers, servers, n, np.float32, chunk_bytes=chunk_bytes, op=op)
              for how in ("blocking", "streamed")}
    lay = groups["blocking"].layout
    masters = {how: np.random.default_rng(7).standard_normal(n).astype(np.float32) for how in groups}
    pulled = {how: np.empty(n, np.float32) for how in groups}
    for step in range(steps):
        norms = {}
        for how, g in groups.items():
            master = masters[how]

            def update(c, s, scale):
                lo, hi = lay.bounds(c)
                master[lo:hi] -= np.float32(0.01 * scale) * s
                return master[lo:hi]
            grad = None
            if g.is_worker:
                rng = np.random.default_rng(1000 * step + RANK)
                grad = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, size=n)).astype(np.float32)
            if how == "blocking":
                if g.is_worker:
                    for lo, hi in _buckets(n):
                        g.push(grad, lo, hi)
                if g.is_server:
                    g.reduce()
                    g.send_params([update(c, s, 1.0) for c, s in zip(lay.owned_by(RANK), g.summed)])
                if g.is_worker:
                    norms[how] = g.pull(pulled[how])
            else:
                if g.is_worker:
                    g.push_and_pull(grad, pulled[how], _buckets(n))
                if RANK == lay.servers[-1] and step == 1:
                    time.sleep(0.05)       # one server late: the next pushes queue up meanwhile
                norm_served = g.serve_streamed(update) if g.is_server else None
                if g.is_worker:
                    norms[how] = g.wait_pull()
                if norm_served is not None and g.is_worker and norm_served != norms[how]:
                    problems.append(f"step {step}: serve_streamed returned {norm_served!r}, pulled {norms[how]!r}")
        if groups["blocking"].is_worker:
            if not same_bits(pulled["blocking"], pulled["streamed"]):
                problems.append(f"step {step}: streamed parameters differ from reduce()+send_params()")
            if norms["blocking"] != norms["streamed"]:
                problems.append(f"step {step}: streamed norm {norms['streamed']!r} != {norms['blocking']!r}")
    for g in groups.values():
        g.free()
    return problems


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("config", ["colocated", "dedicated", "mixed"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_ps_streamed_same_bits_as_reduce_then_send(config, op):
    if config == "colocated":
        workers, servers = list(range(P)), list(range(P))
    elif config == "dedicated":
        workers, servers = list(range(P // 2)), list(range(P // 2, P))
    else:
        if P < 4:
            pytest.skip("workers that are partly servers need 4 ranks")
        workers, servers = list(range(P)), [1, 3]
    agree([f"{config}, op={op}: {p}" for p in _streamed_vs_blocking(workers, servers, op)])


@pytest.mark.mpi(min_size=2)
def test_ps_streamed_steps_do_not_mix():
    # Many short steps, one server slow on every other step: a worker's next push
    # meets the previous step's returns in flight; each step must pull its own values.
    workers, servers = (list(range(P)), list(range(P))) if P == 2 else (list(range(P // 2)), list(range(P // 2, P)))
    problems = []
    n = 300
    g = ParameterServerGroup(WORLD, workers, servers, n, np.float64, chunk_bytes=40, op="sum")
    lay = g.layout
    params = np.empty(n)
    for step in range(8):
        if g.is_worker:
            grad = np.full(n, float(step + 1))
            g.push_and_pull(grad, params)
        if g.is_server:
            if RANK == lay.servers[0] and step % 2:
                time.sleep(0.02)
            g.serve_streamed(lambda c, s, scale: s)         # the params: the summed gradient itself
        if g.is_worker:
            norm = g.wait_pull()
            want = float(len(workers) * (step + 1))
            if not np.all(params == want):
                problems.append(f"step {step}: pulled {sorted(set(params.tolist()))[:3]}, want {want}")
            if norm != n * want * want:
                problems.append(f"step {step}: norm {norm} != {n * want * want}")
    g.free()
    agree(problems)


def test_one_rank_streamed_refuses_misuse():
    g = _one_rank_group()
    grad = np.ones(100, np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        g.push_and_pull(grad, grad)
    params = np.zeros(100, np.float32)
    g.start_pull(params)
    g.push(grad, 0, 50)
    with pytest.raises(ValueError, match="has not pushed every element"):
        g.serve_streamed(lambda c, s, scale: s)
    g.push(grad, 50, 100)                  # the refusal left the step usable: finish it
    assert g.serve_streamed(lambda c, s, scale: s * np.float32(2)) == 100.0
    assert g.wait_pull() == 100.0 and np.all(params == 2)
    g.free()
