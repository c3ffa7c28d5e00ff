"""Tests for comm/: collectives against MPI's own, GradBuckets, ProcessGrid,
consistency checks and the abort handler.

    python -m pytest tests/comm/test_comm.py                                   # serial part
    mpiexec -n 2 python -m pytest --with-mpi tests/comm/test_comm.py           # and -n 4

MPI tests never let one rank fail alone: each collects its problems and the
ranks agree (allreduce) before asserting, so a failure is reported on every
rank instead of desynchronizing the next test.
"""

import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe import comm
from ringpipe.comm.grid import local_rank_by_split, local_rank_from_env
from ringpipe.comm.ring import set_subchunk_bytes
from ringpipe.comm.settings import DEFAULT_SUBCHUNK

from tests.support import ROOT
SCRIPTS = os.path.join(ROOT, "tests", "support", "mpi_scripts")
WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()

FLOATS = [np.float16, np.float32, np.float64]
INTS = [np.int32, np.int64]
MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
EPS = {np.float16: 2.0**-10, np.float32: 2.0**-23, np.float64: 2.0**-52}
serial_only = pytest.mark.skipif(P > 1, reason="launches its own mpiexec; run serially")


def lengths(p):
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 1000, 1_000_003})


def ops_for(dtype):
    return ["sum", "avg", "max", "min"] if dtype in FLOATS else ["sum", "max", "min"]


def data(n, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype in INTS:
        return rng.integers(-1000, 1000, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def agree(problems, comm_=WORLD):
    """Gather every rank's problem list; assert (on all ranks) that none failed."""
    everyone = comm_.allgather(problems[:10])
    flat = [f"rank {r}: {x}" for r, lst in enumerate(everyone) for x in lst]
    assert not flat, "\n".join(flat[:40])


def same_bytes_everywhere(arr, comm_=WORLD):
    # Hash, not the bytes: 4 MB pickled per call would dominate the runtime.
    digest = zlib.crc32(arr.view(np.uint8)) ^ (zlib.adler32(arr.view(np.uint8)) << 32)
    return len(set(comm_.allgather(digest))) == 1


def mpi_reference(x, op, comm_=WORLD):
    ref = np.empty_like(x)
    comm_.Allreduce(x, ref, op=MPI_OP[op])
    if op == "avg":
        ref = (ref / comm_.Get_size()).astype(x.dtype)
    return ref


def close(a, b, dtype, p):
    if dtype in INTS:
        return np.array_equal(a, b)
    # Summation order differs from MPI's: allow a few roundings per addend
    # (values are N(0,1), so |partial sums| stay around sqrt(p)).
    tol = 4 * p * EPS[dtype]
    return np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol * p)


# ---------------------------------------------------------------------------
# Serial: pure functions and single-rank behaviour


def _clean_env():
    # Strip whatever an outer launcher left in the environment, or a child
    # process would try to join that job instead of starting its own.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_CVAR_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


def test_chunk_bounds_properties():
    for n in [0, 1, 2, 3, 7, 10, 1000, 1_000_003]:
        for p in [1, 2, 3, 4, 5, 8, 13]:
            b = comm.chunk_bounds(n, p)
            assert len(b) == p
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(p - 1))  # contiguous
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # longer chunks first
            ref = [len(a) for a in np.array_split(np.arange(n), p)]
            assert sizes == ref
    with pytest.raises(ValueError):
        comm.chunk_bounds(5, 0)


def test_single_rank_is_identity_and_validates():
    x = np.arange(10, dtype=np.float32)
    assert comm.allreduce(x, MPI.COMM_SELF) is x
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    comm.allreduce(x, MPI.COMM_SELF, op="avg")  # sum / 1
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    v = comm.reduce_scatter(x, MPI.COMM_SELF)
    assert v.size == 10 and np.shares_memory(v, x)
    comm.allgather(x, MPI.COMM_SELF)
    with pytest.raises(TypeError, match="dtype"):
        comm.allreduce(np.zeros(3, np.int8), MPI.COMM_SELF)
    with pytest.raises(TypeError, match="avg"):
        comm.allreduce(np.zeros(3, np.int32), MPI.COMM_SELF, op="avg")
    with pytest.raises(ValueError, match="op"):
        comm.allreduce(np.zeros(3, np.float32), MPI.COMM_SELF, op="prod")
    with pytest.raises(ValueError, match="contiguous"):
        comm.allreduce(np.zeros(10, np.float32)[::2], MPI.COMM_SELF)
    with pytest.raises(ValueError, match="algorithm"):
        comm.allreduce(np.zeros(3, np.float32), MPI.COMM_SELF, algorithm="tree")
    with pytest.raises(ValueError, match="algorithm"):
        comm.allreduce(np.zeros(3, np.float32), MPI.COMM_SELF, algorithm="none")


def test_crossover_setting():
    old = comm.get_crossover()
    try:
        comm.set_crossover(123)
        assert comm.get_crossover() == 123
    finally:
        comm.set_crossover(old)
    env = dict(_clean_env(), RINGPIPE_ALLREDUCE_CROSSOVER="4096")
    out = subprocess.run([sys.executable, "-c", "from ringpipe import comm; print(comm.get_crossover())"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "4096", out.stderr


def test_local_rank_from_env():
    assert local_rank_from_env({"MPI_LOCALRANKID": "3"}) == 3
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert local_rank_from_env({"SLURM_LOCALID": "2"}) == 2
    assert local_rank_from_env({}) is None


def test_grad_buckets_layout_serial():
    g = np.zeros(100, np.float32)
    ranges = [(0, 10), (10, 40), (40, 45), (45, 100)]
    gb = comm.GradBuckets(g, ranges, MPI.COMM_SELF, bucket_bytes=35 * 4)
    # Reverse order, greedy up to 140 bytes; the 55-element param exceeds it alone.
    assert [(b[0], b[1]) for b in gb.buckets] == [(45, 100), (10, 45), (0, 10)]
    for i in [2, 0, 3, 1]:
        gb.mark_ready(i)
    gb.wait()
    gb.mark_ready(1)
    with pytest.raises(ValueError, match="already marked"):
        gb.mark_ready(1)
    with pytest.raises(IndexError):
        gb.mark_ready(4)
    for i in [0, 2, 3]:
        gb.mark_ready(i)
    gb.wait()
    assert gb.stats()["steps"] == 2
    gb.mark_ready(0)
    with pytest.raises(RuntimeError, match=r"never marked ready.*\[1, 2, 3\]"):
        gb.wait()
    gb.close()
    with pytest.raises(ValueError, match="param_ranges"):
        comm.GradBuckets(g, [(0, 50), (40, 100)], MPI.COMM_SELF)


def test_grad_buckets_breaks_begin_a_bucket():
    g = np.zeros(100, np.float32)
    ranges = [(0, 10), (10, 40), (40, 45), (45, 100)]
    # Without breaks (10, 45) is one bucket; a break at parameter 2 cuts it.
    gb = comm.GradBuckets(g, ranges, MPI.COMM_SELF, bucket_bytes=35 * 4, breaks={2}, overlap=False)
    assert [(b[0], b[1]) for b in gb.buckets] == [(45, 100), (40, 45), (10, 40), (0, 10)]
    gb.close()
    with pytest.raises(ValueError, match="collective"):
        comm.GradBuckets(g, ranges, MPI.COMM_SELF, collective="broadcast")


# ---------------------------------------------------------------------------
# MPI: collectives against MPI's own


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["ring", "small", "auto"])
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=lambda d: np.dtype(d).name)
def test_allreduce_matches_mpi(dtype, algorithm):
    problems = []
    for n in lengths(P):
        x = data(n, dtype, seed=1000 * RANK + n)
        for op in ops_for(dtype):
            ref = mpi_reference(x, op)
            y = x.copy()
            out = comm.allreduce(y, WORLD, op=op, algorithm=algorithm)
            if out is not y:
                problems.append(f"{op} n={n}: did not return the buffer")
            exact = op in ("max", "min") or dtype in INTS
            ok = np.array_equal(y, ref) if exact else close(y, ref, dtype, P)
            if not ok:
                err = np.max(np.abs(y.astype(np.float64) - ref)) if n else 0
                problems.append(f"{op} n={n}: differs from MPI.Allreduce (max err {err})")
            if not same_bytes_everywhere(y):
                problems.append(f"{op} n={n}: ranks hold different bytes")
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_allreduce_multidim_and_subchunking():
    # A 2D buffer is reduced as flat memory; tiny sub-chunks force many
    # pipelined messages per ring step (the default would send one).
    problems = []
    try:
        set_subchunk_bytes(256)
        for shape in [(37, 29), (3, 1000)]:
            x = data(int(np.prod(shape)), np.float32, seed=RANK).reshape(shape)
            ref = mpi_reference(x.reshape(-1), "sum").reshape(shape)
            comm.allreduce(x, WORLD, algorithm="ring")
            if not close(x, ref, np.float32, P) or not same_bytes_everywhere(x):
                problems.append(f"shape {shape}")
    finally:
        set_subchunk_bytes(DEFAULT_SUBCHUNK)
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_auto_follows_crossover():
    old = comm.get_crossover()
    problems = []
    try:
        for cross in (0, 1 << 30):  # all ring, all small
            comm.set_crossover(cross)
            x = data(5000, np.float64, seed=RANK)
            ref = mpi_reference(x, "sum")
            comm.allreduce(x, WORLD)
            if not close(x, ref, np.float64, P):
                problems.append(f"crossover {cross}")
    finally:
        comm.set_crossover(old)
    agree(problems)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=lambda d: np.dtype(d).name)
def test_reduce_scatter_matches_mpi(dtype):
    problems = []
    for n in lengths(P):
        x = data(n, dtype, seed=7 * RANK + n)
        bounds = comm.chunk_bounds(n, P)
        counts = [hi - lo for lo, hi in bounds]
        lo, hi = bounds[RANK]
        for op in ops_for(dtype):
            ref = np.empty(counts[RANK], dtype)
            WORLD.Reduce_scatter(x, ref, recvcounts=counts, op=MPI_OP[op])
            if op == "avg":
                ref = (ref / P).astype(dtype)
            y = x.copy()
            view = comm.reduce_scatter(y, WORLD, op=op)
            if view.size != hi - lo or (view.size and not (
                    np.shares_memory(view, y) and view.__array_interface__["data"][0]
                    == y[lo:].__array_interface__["data"][0])):
                problems.append(f"{op} n={n}: returned view is not y[{lo}:{hi}]")
            exact = op in ("max", "min") or dtype in INTS
            ok = np.array_equal(view, ref) if exact else close(view, ref, dtype, P)
            if not ok:
                problems.append(f"{op} n={n}: differs from MPI.Reduce_scatter")
    agree(problems)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64], ids=lambda d: np.dtype(d).name)
def test_allgather_matches_mpi(dtype):
    problems = []
    for n in lengths(P):
        bounds = comm.chunk_bounds(n, P)
        counts = [hi - lo for lo, hi in bounds]
        displs = [lo for lo, _ in bounds]
        lo, hi = bounds[RANK]
        mine = data(hi - lo, dtype, seed=RANK + 3 * n)
        ref = np.empty(n, dtype)
        WORLD.Allgatherv(mine, [ref, counts, displs, MPI._typedict[np.dtype(dtype).char]])
        y = np.full(n, 99, dtype)  # garbage outside our chunk must be overwritten
        y[lo:hi] = mine
        comm.allgather(y, WORLD)
        if not np.array_equal(y, ref):
            problems.append(f"n={n}: differs from MPI.Allgatherv")
    agree(problems)


@pytest.mark.mpi
def test_reduce_scatter_then_allgather_is_allreduce():
    x = data(1001, np.float64, seed=RANK)
    ref = mpi_reference(x, "avg")
    comm.reduce_scatter(x, WORLD, op="avg")
    comm.allgather(x, WORLD)
    agree([] if close(x, ref, np.float64, P) else ["rs+ag != allreduce avg"])


@pytest.mark.mpi(min_size=2)
def test_subcommunicator_and_tag_isolation():
    # Our traffic runs on a private Dup: a message the caller has in flight on
    # the same communicator (same tags as ours) must not be swallowed.
    sub = WORLD.Split(color=RANK % 2, key=RANK)
    try:
        right, left = (sub.rank + 1) % sub.size, (sub.rank - 1) % sub.size
        token = np.full(4, RANK, np.int64)
        got = np.empty(4, np.int64)
        reqs = [sub.Irecv(got, left, 0), sub.Isend(token, right, 0)]
        x = data(10_000, np.float32, seed=RANK)
        ref = mpi_reference(x, "sum", sub)
        comm.allreduce(x, sub, algorithm="ring")
        y = data(10, np.float32, seed=RANK)
        ref_small = mpi_reference(y, "max", sub)
        comm.allreduce(y, sub, op="max", algorithm="small")
        MPI.Request.Waitall(reqs)
        problems = []
        if not close(x, ref, np.float32, sub.size):
            problems.append("ring on subcomm")
        if not np.array_equal(y, ref_small):
            problems.append("small on subcomm")
        if sub.size > 1 and got[0] != sub.Get_group().Translate_ranks([left], WORLD.Get_group())[0]:
            problems.append(f"caller's message corrupted: {got}")
    finally:
        sub.Free()
    agree(problems)


# ---------------------------------------------------------------------------
# MPI: GradBuckets


def _model(seed_sizes=(1000, 50_000, 3, 200_000, 0, 7, 120_000, 100, 64_000)):
    ranges, lo = [], 0
    for s in seed_sizes:
        ranges.append((lo, lo + s))
        lo += s
    return ranges, lo


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("bucket_bytes", [1, 64 * 1024, 600_000, 25 * 2**20])
def test_grad_buckets_equal_plain_allreduce(bucket_bytes, overlap):
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    problems = []
    a = np.random.default_rng(RANK).standard_normal((96, 96))
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=bucket_bytes, overlap=overlap) as gb:
        for step in range(3):
            g[:] = data(n, np.float32, seed=100 * step + RANK)
            ref = mpi_reference(g, "avg")
            # A different arbitrary order on every rank and step, with numpy
            # work (GIL-releasing BLAS and GIL-holding small ops) in between.
            order = np.random.default_rng(step * 31 + RANK).permutation(len(ranges))
            for i in order:
                a = np.tanh(a @ a.T / 96)
                gb.mark_ready(int(i))
            gb.wait()
            if not close(g, ref, np.float32, P):
                problems.append(f"step {step}: differs from Allreduce avg")
            if not same_bytes_everywhere(g):
                problems.append(f"step {step}: ranks hold different bytes")
        st = gb.stats()
        if st["steps"] != 3 or not (0.0 <= st["hidden"] <= 1.0) or st["overlap"] != overlap:
            problems.append(f"stats {st}")
    agree(problems)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_grad_buckets_reduce_scatter_keeps_each_ranks_chunk(overlap):
    """collective="reduce_scatter" (ZeRO-2/3): each rank's chunk of every bucket holds the
    average, and on_reduced is told of every bucket once, in bucket order."""
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    told, problems = [], []
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=64 * 1024, overlap=overlap,
                          collective="reduce_scatter", on_reduced=told.append) as gb:
        g[:] = data(n, np.float32, seed=7 + RANK)
        ref = mpi_reference(g, "avg")
        for i in np.random.default_rng(RANK).permutation(len(ranges)):
            gb.mark_ready(int(i))
        gb.wait()
        for lo, hi, _, _ in gb.buckets:
            a, b = comm.chunk_bounds(hi - lo, P)[RANK]
            if not close(g[lo + a:lo + b], ref[lo + a:lo + b], np.float32, P):
                problems.append(f"bucket ({lo}, {hi}): this rank's chunk differs from Allreduce avg")
        if told != list(range(len(gb.buckets))):
            problems.append(f"on_reduced saw {told}")
    agree(problems)


@pytest.mark.mpi
def test_grad_buckets_with_main_thread_mpi_traffic():
    # The main thread keeps doing its own MPI (pipeline-style point-to-point
    # with the same tags our ring uses, and collectives on the same
    # communicator) while buckets reduce in the background.
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    problems = []
    right, left = (RANK + 1) % P, (RANK - 1) % P
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=64 * 1024) as gb:
        for step in range(3):
            g[:] = data(n, np.float32, seed=10 * step + RANK)
            ref = mpi_reference(g, "avg")
            for i in reversed(range(len(ranges))):
                gb.mark_ready(i)
                token = np.array([RANK, i, step], np.int64)
                got = np.empty(3, np.int64)
                WORLD.Sendrecv(token, right, 0, got, left, 0)
                if list(got) != [left, i, step]:
                    problems.append(f"p2p token {got}")
                x = np.full(3, float(RANK))
                comm.allreduce(x, WORLD, algorithm="small" if i % 2 else "ring")
                if not np.all(x == P * (P - 1) / 2):
                    problems.append(f"main-thread allreduce {x}")
            gb.wait()
            if not close(g, ref, np.float32, P):
                problems.append(f"step {step}: buckets differ from Allreduce avg")
    agree(problems)


@pytest.mark.mpi
def test_grad_buckets_sum_float64_reverse_order():
    ranges, n = _model()
    g = data(n, np.float64, seed=RANK)
    ref = mpi_reference(g, "sum")
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=100_000, op="sum") as gb:
        for i in reversed(range(len(ranges))):  # as backward really goes
            gb.mark_ready(i)
        gb.wait()
    agree([] if close(g, ref, np.float64, P) else ["sum float64 differs"])


@pytest.mark.mpi(min_size=2)
def test_grad_buckets_missing_param_raises_everywhere_then_recovers():
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=64 * 1024) as gb:
        for i in range(len(ranges)):
            if i != 3:
                gb.mark_ready(i)
        t = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"never marked ready.*\[3\]"):
            gb.wait()
        assert time.perf_counter() - t < 10
        # The step was abandoned the same way on every rank; the next one works.
        g[:] = data(n, np.float32, seed=RANK)
        ref = mpi_reference(g, "avg")
        for i in range(len(ranges)):
            gb.mark_ready(i)
        gb.wait()
        agree([] if close(g, ref, np.float32, P) else ["step after the failed one"])


@pytest.mark.mpi(min_size=2)
def test_grad_buckets_mismatched_layout_raises_everywhere():
    ranges, n = _model()
    if RANK == 1:
        ranges = ranges[:-1] + [(ranges[-1][0], ranges[-1][1] - 1)]
    g = np.zeros(n, np.float32)
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="inconsistent GradBuckets layout"):
        comm.GradBuckets(g, ranges, WORLD)
    assert time.perf_counter() - t < 10


# ---------------------------------------------------------------------------
# MPI: consistency checks


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["length", "dtype", "op", "algorithm"])
def test_mismatch_raises_on_every_rank(case):
    # A fresh communicator: no layout is cached on it, on any rank.
    c = WORLD.Dup()
    try:
        n, dtype, op, algo = 777, np.float32, "sum", "ring"
        if case == "length":
            n += RANK
        elif case == "dtype":
            dtype = np.float32 if RANK == 0 else np.float64
        elif case == "op":
            op = "sum" if RANK == 0 else "max"
        else:
            algo = "ring" if RANK == 0 else "small"
        t = time.perf_counter()
        with pytest.raises(RuntimeError) as info:
            comm.allreduce(np.ones(n, dtype), c, op=op, algorithm=algo)
        assert time.perf_counter() - t < 10
        msg = str(info.value)
        assert "inconsistent allreduce layout" in msg
        assert all(f"rank {r}:" in msg for r in range(P))
        # The failed call left no traffic behind: the communicator still works.
        x = np.full(5, RANK + 1.0)
        comm.allreduce(x, c)
        assert np.all(x == P * (P + 1) / 2)
    finally:
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_invalid_input_raises_same_error_everywhere():
    c = WORLD.Dup()
    try:
        with pytest.raises(TypeError, match="int8"):
            comm.allreduce(np.zeros(4, np.int8), c)
        with pytest.raises(RuntimeError, match="inconsistent"):  # one rank's buffer is strided
            comm.allreduce(np.zeros(8, np.float32)[:: (2 if RANK == 0 else 1)][:4], c)
    finally:
        c.Free()


@pytest.mark.mpi(min_size=2)
def test_check_consistent():
    comm.check_consistent(WORLD, "same", (1, 2, 3))
    with pytest.raises(RuntimeError, match=r"(?s)inconsistent my thing.*rank 0: \(1, 0\)"):
        comm.check_consistent(WORLD, "my thing", (1, RANK))
    with pytest.raises(RuntimeError, match="inconsistent"):  # different tuple lengths
        comm.check_consistent(WORLD, "lengths", tuple(range(RANK + 1)))


# ---------------------------------------------------------------------------
# MPI: ProcessGrid


def factorizations(size, k):
    """Every k-tuple of positive ints whose product is `size`."""
    if k == 1:
        return [(size,)]
    return [(d,) + rest for d in range(1, size + 1) if size % d == 0 for rest in factorizations(size // d, k - 1)]


def grid_problems(axes):
    """What is wrong with ProcessGrid(WORLD, axes) on this rank (sizes given, none None)."""
    names, shape = tuple(n for n, _ in axes), tuple(s for _, s in axes)
    label = "x".join(f"{n}={s}" for n, s in axes)
    strides = [int(np.prod(shape[k + 1:])) for k in range(len(shape))]
    coords = tuple(RANK // stride % size for stride, size in zip(strides, shape))
    grid = comm.ProcessGrid(WORLD, axes)
    problems = []
    try:
        if (grid.axes, grid.shape, grid.rank, grid.world_size) != (names, shape, RANK, P):
            problems.append(f"{label}: attributes {grid}")
        if tuple(grid.index(n) for n in names) != coords or tuple(grid.size(n) for n in names) != shape:
            problems.append(f"{label}: index/size {grid}, expected coordinates {coords}")
        for k, name in enumerate(names):
            c = grid.comm(name)
            # the ranks that differ from this one only along `name`, in the order of that coordinate
            expected = [RANK + (i - coords[k]) * strides[k] for i in range(shape[k])]
            members = c.allgather(RANK)
            if members != expected:
                problems.append(f"{label}: comm({name!r}) members {members} != {expected}")
            if c.Get_rank() != grid.index(name):
                problems.append(f"{label}: rank in comm({name!r}) {c.Get_rank()} != index {grid.index(name)}")
            x = np.ones(10)
            comm.allreduce(x, c)        # what the collectives run on
            if not np.all(x == shape[k]):
                problems.append(f"{label}: allreduce over comm({name!r})")
        if len(set(WORLD.allgather(coords))) != P:
            problems.append(f"{label}: two ranks share coordinates")
    finally:
        grid.free()
    return problems


@pytest.mark.mpi
def test_grid_factorizations():
    problems = []
    for pp, dp in factorizations(P, 2):
        problems += grid_problems([("pipe", pp), ("data", dp)])
        # today's layout: the data-parallel ranks of one stage are contiguous
        grid = comm.ProcessGrid(WORLD, [("pipe", pp), ("data", dp)])
        if (grid.index("pipe"), grid.index("data")) != divmod(RANK, dp):
            problems.append(f"pipe={pp}xdata={dp}: rank {RANK} at {grid}")
        grid.free()
    for axes, shape in [([("pipe", 1), ("data", None)], (1, P)), ([("data", None)], (P,)),
                        ([("pipe", P), ("data", None)], (P, 1)), ([("pipe", None), ("data", 1)], (P, 1))]:
        grid = comm.ProcessGrid(WORLD, axes)  # None: whatever divides the world
        if grid.shape != shape:
            problems.append(f"{axes}: shape {grid.shape} != {shape}")
        grid.free()
    grid = comm.ProcessGrid(WORLD, [("data", P)])
    split = local_rank_by_split(WORLD)      # collective: every rank, exactly once
    # One node: the local ranks are 0..P-1, one each. Hydra numbers them in world-rank
    # order, like the split; Open MPI (PRRTE) in its mapping order, which with 4 ranks
    # oversubscribing 2 cores is 0, 2, 1, 3 (round-robin over the cores).
    local_ranks = WORLD.allgather(grid.local_rank)
    if sorted(local_ranks) != list(range(P)):
        problems.append(f"local ranks {local_ranks} are not 0..{P - 1}, one each")
    if "OMPI_COMM_WORLD_LOCAL_RANK" not in os.environ and grid.local_rank != split:
        problems.append(f"local_rank {grid.local_rank} vs split {split}")
    grid.free()
    agree(problems)


@pytest.mark.mpi
def test_grid_with_a_tensor_axis():
    # The tensor axis goes innermost; under -n 4 this covers (1, 2, 2) and (2, 1, 2).
    problems = []
    for pp, dp, tp in factorizations(P, 3):
        problems += grid_problems([("pipe", pp), ("data", dp), ("tensor", tp)])
    agree(problems)


@pytest.mark.mpi
def test_grid_bad_shape_raises_everywhere():
    for axes, text in [([("pipe", 1), ("data", P + 1)], "multiply to the world size"),
                       ([("pipe", P + 1), ("data", None)], "multiply to the world size"),
                       ([("pipe", 2), ("data", P)], "multiply to the world size"),
                       ([("pipe", 0), ("data", None)], "pipe must be a positive int"),
                       ([("pipe", 1), ("data", 1.0 * P)], "data must be a positive int"),
                       ([("pipe", None), ("data", None)], "at most one axis size may be None"),
                       ([("data", 1), ("data", P)], "distinct"),
                       ([], "non-empty list"),
                       ([("pipe", 1, 2)], "non-empty list")]:
        with pytest.raises(ValueError, match=f"ProcessGrid: .*{text}"):
            comm.ProcessGrid(WORLD, axes)
    WORLD.Barrier()  # nobody got stuck in a Split


def test_grid_names_its_axes():
    grid = comm.ProcessGrid(MPI.COMM_SELF, [("pipe", 1), ("data", None), ("tensor", 1)])
    assert grid.axes == ("pipe", "data", "tensor") and grid.shape == (1, 1, 1)
    assert [grid.index(a) for a in grid.axes] == [0, 0, 0]
    with pytest.raises(ValueError, match="no axis 'expert'; its axes are pipe, data, tensor"):
        grid.size("expert")
    assert "pipe=0/1" in repr(grid)
    grid.free()
    with pytest.raises(ValueError, match=r"ProcessGrid: the axis sizes must multiply to the world size: "
                                         r"pipe=2 \* data=1 = 2 != 1 ranks"):
        comm.ProcessGrid(MPI.COMM_SELF, [("pipe", 2), ("data", 1)])


# ---------------------------------------------------------------------------
# Whole jobs: crashes and mismatches must end the job within seconds.


def _mpiexec(n, *args, timeout=60):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = _clean_env()
    t = time.perf_counter()
    out = subprocess.run([mpiexec, "-n", str(n), sys.executable, *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.perf_counter() - t


@serial_only
def test_abort_waits_until_the_launcher_has_read_the_report():
    # The launcher's proxy reads a rank's stderr through a pipe and is killed
    # on MPI_Abort: the abort must wait until the pipe is drained, or the
    # message saying why the job died can be lost.
    import threading
    from ringpipe.comm.abort import wait_until_output_is_read
    r, w = os.pipe()
    try:
        os.write(w, b"[ringpipe rank 1/2] ValueError: boom\n")
        reading = threading.Event()

        def slow_reader():
            time.sleep(0.3)
            reading.set()   # before the read: the pipe cannot drain earlier
            os.read(r, 4096)

        t = threading.Thread(target=slow_reader)
        t.start()
        wait_until_output_is_read(timeout=30, fds=(w,))
        assert reading.is_set()
        t.join()
        # Nothing unread: returns at once; a non-pipe fd is ignored.
        wait_until_output_is_read(timeout=30, fds=(w,))
        with open(os.devnull, "w") as f:
            wait_until_output_is_read(timeout=30, fds=(f.fileno(),))
    finally:
        os.close(r)
        os.close(w)


@serial_only
@pytest.mark.parametrize("mode", ["main", "thread", "context"])
def test_uncaught_exception_aborts_job(mode):
    out, dt = _mpiexec(2, os.path.join(SCRIPTS, "crash.py"), mode)
    assert out.returncode != 0
    assert dt < 20, f"job took {dt:.1f}s to die"
    assert "[ringpipe rank 1/2 on " in out.stderr, out.stderr[-2000:]
    assert "ValueError: boom from rank 1" in out.stderr
    assert "Traceback" in out.stderr
    if mode == "thread":
        assert "(thread worker)" in out.stderr


@serial_only
def test_deliberate_exit_on_one_rank_ends_job():
    out, dt = _mpiexec(2, os.path.join(SCRIPTS, "crash.py"), "exit")
    assert out.returncode != 0
    assert dt < 20, f"job took {dt:.1f}s to die"
    assert "[ringpipe rank 1/2 on " in out.stderr, out.stderr[-2000:]
    assert "SystemExit: error: deliberate exit on rank 1" in out.stderr
    assert "Traceback" not in out.stderr


@serial_only
@pytest.mark.parametrize("what", ["length", "dtype"])
def test_mismatch_job_fails_fast(what):
    out, dt = _mpiexec(2, os.path.join(SCRIPTS, "mismatch.py"), what)
    assert out.returncode != 0
    assert dt < 20, f"job took {dt:.1f}s to die"
    assert "RuntimeError: ringpipe: inconsistent allreduce layout" in out.stderr, out.stderr[-2000:]
    assert "rank 0: (1000," in out.stderr and "rank 1: (" in out.stderr
    assert "unreachable" not in out.stdout


@serial_only
def test_benchmark_quick_runs_clean(tmp_path):
    path = tmp_path / "ar.json"
    out, dt = _mpiexec(2, os.path.join(ROOT, "benchmarks", "allreduce.py"), "--quick",
                       "--json", str(path), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "# Avg bus bandwidth" in out.stdout
    import json
    res = json.loads(path.read_text())
    assert {r["algo"] for r in res["rows"]} == {"ring", "small", "hierarchical", "mpi", "naive"}
    assert all(r["wrong"] == 0 for r in res["rows"])
    assert res["ring_fit"]["alpha_us"] is not None


# ---- comm as a library: what a user's own mpi4py program may pass ----------------------

def _raises_everywhere(fn, cls, text):
    with pytest.raises(cls, match=text):
        fn()


@pytest.mark.mpi(min_size=2)
def test_private_communicators_go_with_the_users_communicator():
    # Each use on a new communicator Dups it once; freeing the user's
    # communicator must free ours, or MPICH runs out of context ids (~2000).
    x = np.ones(4)
    for i in range(2500):
        sub = WORLD.Split(0, RANK if i % 2 else -RANK)
        comm.allreduce(x, comm=sub, op="max")
        sub.Free()
    # A recycled handle on some ranks only must not split the ranks between
    # "reuse the old Dup" and "Dup anew" (that hung).
    a = WORLD.Dup()
    comm.allreduce(np.ones(4), comm=a)
    a.Free()
    extra = MPI.COMM_SELF.Dup() if RANK == 1 else None
    b = WORLD.Dup()
    y = np.ones(4)
    comm.allreduce(y, comm=b)
    assert (y == P).all()
    b.Free()
    if extra is not None:
        extra.Free()


@pytest.mark.mpi(min_size=2)
def test_library_inputs_are_refused_alike_on_every_rank():
    # Lengths no other test uses: with the default RINGPIPE_COMM_CHECK=first a
    # layout is compared across ranks on its first use only, so a rank that
    # used its side of a mismatch before would skip that check (the message
    # fingerprints would still catch it, with another error: see
    # tests/comm/test_comm_fingerprint.py).
    _raises_everywhere(lambda: comm.allreduce([1.0, 2.0]), TypeError, "must be a numpy or cupy array")
    _raises_everywhere(lambda: comm.GradBuckets([0.0] * 10, [(0, 10)]), TypeError, "numpy or cupy array")
    # MPI's own ops by name; one rank alone passing an op we lack is a mismatch, not a hang
    x = np.full(5, float(RANK))
    comm.allreduce(x, op=MPI.MAX)
    assert (x == P - 1).all()
    _raises_everywhere(lambda: comm.allreduce(np.ones(37), op=MPI.PROD if RANK == 0 else "sum"),
                       RuntimeError, "inconsistent allreduce layout")
    _raises_everywhere(lambda: comm.allreduce(np.ones(37), op=MPI.PROD), ValueError, "unknown op")
    # the same elements laid out differently (order, shape) would be mixed up silently
    a = np.arange(77.0).reshape(7, 11)
    _raises_everywhere(lambda: comm.allreduce(a if RANK == 0 else np.asfortranarray(a)),
                       RuntimeError, "inconsistent allreduce layout")
    _raises_everywhere(lambda: comm.allreduce(np.zeros((7, 11)) if RANK == 0 else np.zeros((11, 7))),
                       RuntimeError, "inconsistent allreduce layout")
    # values are compared exactly, not truncated to int
    _raises_everywhere(lambda: comm.check_consistent(WORLD, "value", (1.0 + 0.4 * RANK,)),
                       RuntimeError, "inconsistent value")
    comm.check_consistent(WORLD, "value", (1.5, "x"))
    grid = comm.ProcessGrid(WORLD, [("pipe", np.int64(1)), ("data", np.int64(P))])
    assert grid.shape == (1, P) and isinstance(grid.size("data"), int)
    grid.free()
