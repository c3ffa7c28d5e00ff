"""The hierarchical all-reduce: ranks grouped by node, the network crossed once.

Across nodes the network, not memory, is the bottleneck. A flat ring over p
ranks on N nodes of L ranks sends 2(p-1)/p·n bytes out of each node's link
(1.5n for 2 x 2). The hierarchical all-reduce sends 2(N-1)/N·n (n for 2 x 2):

  1. reduce-scatter inside the node (the ring on the node's ranks): local rank
     j holds the node's sum of chunk j (chunk_bounds(n, L)[j]);
  2. all-reduce of chunk j across the nodes, among the ranks of local rank j
     (one such group per local rank, all L groups at once: the link carries
     n/L per group); the ring, or the small-message path when the chunk is small;
  3. all-gather inside the node.

Every rank ends with bit-identical bytes: each chunk's node sum is computed by
one rank, the cross-node ring gives its group identical bytes, the gathers copy.
The chunks line up across nodes only when every node has the same number of
ranks; otherwise (uneven nodes) the node's ranks all-reduce among themselves,
local rank 0 of each node all-reduces across the nodes, and broadcasts back
(correct and bit-identical, but each leader's link carries all n bytes).

Nodes are the ranks of one host (MPI's processor name, which is what
Split_type(COMM_TYPE_SHARED) groups by on MPICH and Open MPI), exchanged with
the settings when a communicator's private context is created (comm/context.py:
no extra collective). On one
machine, RINGPIPE_NODES (a node name per COMM_WORLD rank, e.g. "a,a,b,b")
groups the ranks into nodes instead, to test and study the algorithm.

This module knows the nodes and makes the hierarchy's communicators; the three steps run
in comm/collectives.py (allreduce_hierarchical), as the public collectives on those
communicators: they dispatch to this algorithm, so it does not import them.
"""

from __future__ import annotations

import os

from mpi4py import MPI

ENV_NODES = "RINGPIPE_NODES"

__all__ = ["ENV_NODES", "NodeMap", "node_key", "node_map", "Hierarchy"]


class NodeMap:
    """Which node each rank of a communicator is on: node[r] is a node index
    (nodes numbered by their lowest rank), the same list on every rank."""

    def __init__(self, node: list[int]):
        self.node = list(node)
        self.n_nodes = len(set(node))
        self.sizes = [self.node.count(i) for i in range(self.n_nodes)]
        self.even = len(set(self.sizes)) == 1

    def describe(self) -> str:
        sizes = self.sizes
        per_node = f"{sizes[0]} rank(s) each" if self.even else "ranks per node " + "/".join(map(str, sizes))
        return f"{self.n_nodes} node(s), {per_node}"


def _emulated_names(world_size: int) -> list[str] | None:
    raw = os.environ.get(ENV_NODES, "").strip()
    if not raw:
        return None
    names = [n.strip() for n in raw.split(",")]
    if len(names) != world_size or not all(names):
        raise ValueError(f"{ENV_NODES}={raw!r}: give one node name per rank of COMM_WORLD ({world_size}), "
                         "comma-separated (e.g. a,a,b,b), or unset it to group ranks by shared memory")
    return names


def node_key(comm):
    """This rank's node, as (key, error) to exchange with the other ranks: its
    processor name (the host, as MPI names it), or its RINGPIPE_NODES entry.
    No communication: comm/context.py sends it along with the settings."""
    try:
        names = _emulated_names(MPI.COMM_WORLD.Get_size())
    except ValueError as e:
        return None, str(e)
    if names is None:
        return ("host", MPI.Get_processor_name()), None
    world_rank = comm.Get_group().Translate_ranks([comm.Get_rank()], MPI.COMM_WORLD.Get_group())[0]
    return ("named", names[world_rank]), None


def node_map(table: list) -> NodeMap:
    """Every rank's node_key() -> the NodeMap, or the same ValueError on every rank."""
    errors = [e for _, e in table if e]
    if errors:
        raise ValueError(errors[0])
    keys = [k for k, _ in table]
    if len({k[0] for k in keys}) > 1:
        raise ValueError(f"{ENV_NODES} is set on some ranks only: set it for every rank alike, or for none")
    first_rank: dict = {}
    for r, k in enumerate(keys):
        first_rank.setdefault(k, r)
    order = sorted(first_rank.values())
    index = {k: order.index(r) for k, r in first_rank.items()}
    return NodeMap([index[k] for k in keys])


class Hierarchy:
    """The communicators of the hierarchical all-reduce over one communicator:
    `node` (this node's ranks) and `cross` (this local rank's peers on the
    other nodes; for uneven nodes, the nodes' local ranks 0 only, else None).
    Created collectively on the first hierarchical call."""

    def __init__(self, comm, nodes: NodeMap):
        rank = comm.Get_rank()
        mine = nodes.node[rank]
        self.nodes, self.p = nodes, comm.Get_size()
        self.node = comm.Split(mine, key=rank)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        if nodes.even:
            self.cross = comm.Split(self.local_rank, key=mine)
        else:
            color = 0 if self.local_rank == 0 else MPI.UNDEFINED
            self.cross = comm.Split(color, key=mine)
            if self.cross == MPI.COMM_NULL:
                self.cross = None

    def free(self) -> None:
        if MPI.Is_finalized():
            return
        for c in (self.node, self.cross):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
