"""The hierarchical all-reduce (comm/hierarchical.py) against MPI's own, on nodes
emulated with RINGPIPE_NODES (a node name per rank), at 2 and 4 ranks:

    mpiexec -n 4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/comm/test_hierarchical.py

Every layout of ranks on nodes that fits: even (2 x 2), one rank per node, one node,
and uneven (3 nodes of 2/1/1). The ranks agree before asserting, so a failure shows
on every rank.
"""
import os
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe import comm
from ringpipe.comm.collectives import choose_algorithm
from ringpipe.comm.context import context_for
from ringpipe.comm.costmodel import CostModel, Level, fit
from ringpipe.comm.hierarchical import ENV_NODES, NodeMap

WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
LAYOUTS = {2: ["a,b", "a,a"], 4: ["a,a,b,b", "a,b,a,b", "a,b,c,d", "a,a,a,a", "a,a,b,c"]}
MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def test_node_map_describes_even_and_uneven_nodes():
    assert NodeMap([0, 0, 1, 1]).even and NodeMap([0, 0, 1, 1]).describe() == "2 node(s), 2 rank(s) each"
    uneven = NodeMap([0, 0, 1, 2])
    assert not uneven.even and uneven.sizes == [2, 1, 1] and "2/1/1" in uneven.describe()


class emulated_nodes:
    """A fresh communicator whose ranks sit on the nodes `names` (comma list)."""

    def __init__(self, names):
        self.names = names

    def __enter__(self):
        self.before = os.environ.get(ENV_NODES)
        os.environ[ENV_NODES] = self.names
        self.comm = WORLD.Dup()
        context_for(self.comm)              # the node map is read when the context is made
        return self.comm

    def __exit__(self, *exc):
        self.comm.Free()
        if self.before is None:
            os.environ.pop(ENV_NODES, None)
        else:
            os.environ[ENV_NODES] = self.before


def _agree(problems):
    everyone = WORLD.allgather(problems)
    assert not any(everyone), everyone


def _data(n, dtype, rank):
    rng = np.random.default_rng([n, rank])
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("names_index", range(5))
def test_hierarchical_equals_mpi_allreduce_and_is_bit_identical(names_index):
    layouts = LAYOUTS.get(P, [])
    if names_index >= len(layouts):
        pytest.skip(f"{P} ranks have {len(layouts)} node layouts")
    problems = []
    with emulated_nodes(layouts[names_index]) as c:
        for dtype in (np.float64, np.float32, np.int64):
            for op in ("sum", "avg", "max", "min"):
                if op == "avg" and dtype == np.int64:
                    continue
                for n in (1, 2, 3, 7, 1001, 65_537):
                    x = _data(n, dtype, RANK)
                    expected = np.empty_like(x)
                    c.Allreduce(x, expected, op=MPI_OP[op])
                    if op == "avg":
                        expected /= P
                    comm.allreduce(x, c, op=op, algorithm="hierarchical")
                    tol = 0 if dtype == np.int64 else (1e-12 if dtype == np.float64 else 1e-5)
                    if not np.allclose(x, expected, rtol=tol, atol=tol):
                        problems.append(f"{layouts[names_index]} {dtype.__name__} {op} n={n}: differs from MPI")
                    crcs = c.allgather(zlib.crc32(x.tobytes()))
                    if len(set(crcs)) != 1:
                        problems.append(f"{layouts[names_index]} {dtype.__name__} {op} n={n}: ranks differ")
    _agree(problems)


def test_the_cost_model_prefers_the_hierarchy_only_when_the_link_is_the_bottleneck():
    fast, slow = Level(2e-6, 0.05e-9), Level(20e-6, 8e-9)            # shared memory; 1 Gbit/s
    across = CostModel(intra=fast, inter=slow, nodes=2, per_node=2)
    assert across.best(4 << 20) == "hierarchical"
    # the flat ring sends 1.5 n over the link, the hierarchy n (+ the node's cheap steps)
    assert across.ring(4 << 20) / across.hierarchical(4 << 20) == pytest.approx(1.5, rel=0.05)
    same = CostModel(intra=slow, inter=slow, nodes=2, per_node=2)     # no faster level inside the node
    assert same.best(4 << 20) == "ring"
    fitted = fit([8, 1 << 20, 4 << 20], [20e-6 + 8 * 8e-9, 20e-6 + (1 << 20) * 8e-9, 20e-6 + (4 << 20) * 8e-9])
    assert fitted.alpha == pytest.approx(20e-6, rel=1e-3) and fitted.beta == pytest.approx(8e-9, rel=1e-3)


@pytest.mark.mpi(min_size=4)
def test_auto_follows_the_measured_cost_model_where_the_hierarchy_is_a_candidate():
    if P != 4:
        pytest.skip("4 ranks")
    big = 1 << 20
    for names in LAYOUTS[4]:
        with emulated_nodes(names) as c:
            ctx = context_for(c)
            small, large = choose_algorithm("auto", 64, ctx), choose_algorithm("auto", big, ctx)
            assert small == "small"
            if names in ("a,a,b,b", "a,b,a,b"):                     # several nodes of several ranks
                assert ctx.cost is not None and large == ctx.cost.best(big)
                assert len(set(c.allgather((large, ctx.cost)))) == 1     # the same on every rank
            else:                                                    # one node, one rank per node, uneven
                assert ctx.cost is None and large == "ring"


@pytest.mark.mpi(min_size=4)
def test_gradient_buckets_run_it_and_equal_the_flat_ring():
    if P != 4:
        pytest.skip("4 ranks")
    n = 300_000
    grads = _data(n, np.float64, RANK)
    ranges = [(0, 100_000), (100_000, 250_000), (250_000, n)]
    results = {}
    for names in ("a,a,b,b", "a,a,a,a"):
        with emulated_nodes(names) as c:
            g = grads.copy()
            buckets = comm.GradBuckets(g, ranges, c, bucket_bytes=1 << 20, overlap=False,
                                       algorithm="hierarchical" if names == "a,a,b,b" else "auto")
            try:
                for k in range(len(ranges)):
                    buckets.mark_ready(k)
                buckets.wait()
                results[names] = (g, buckets._algos)
            finally:
                buckets.close()
    assert set(results["a,a,b,b"][1]) == {"hierarchical"} and set(results["a,a,a,a"][1]) == {"ring"}
    np.testing.assert_allclose(results["a,a,b,b"][0], results["a,a,a,a"][0], rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_a_bad_node_list_is_refused_on_every_rank():
    before = os.environ.get(ENV_NODES)
    os.environ[ENV_NODES] = "a" if RANK == 0 else ",".join(["a"] * P)   # wrong length on rank 0 only
    c = WORLD.Dup()
    try:
        with pytest.raises(ValueError, match="one node name per rank"):
            context_for(c)
    finally:
        c.Free()
        if before is None:
            os.environ.pop(ENV_NODES, None)
        else:
            os.environ[ENV_NODES] = before
