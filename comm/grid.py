"""The process grid: the world's ranks laid out along named parallel axes,
with one communicator per axis.

    grid = ProcessGrid(world, [("pipe", pp), ("data", dp)])   # outermost axis first

World rank = the row-major index of the rank's coordinates, the outermost
axis varying slowest: here pipe_index * dp + data_index, so the data-parallel
ranks of one pipeline stage are contiguous (on a cluster they tend to share a
node, and the data-parallel all-reduce is the heavy traffic). A tensor axis
goes innermost, [("pipe", pp), ("data", dp), ("tensor", tp)], which keeps
its even heavier traffic closest together.

The grid is a plain object the program creates and passes on: nothing here
keeps a global one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

__all__ = ["ProcessGrid", "local_rank_from_env", "local_rank_by_split"]

# Set by the launcher: MPICH/Hydra, Open MPI, Slurm.
_LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def local_rank_from_env(environ=None) -> int | None:
    environ = os.environ if environ is None else environ
    for var in _LOCAL_RANK_VARS:
        val = environ.get(var)
        if val is not None and val.strip().lstrip("-").isdigit():
            return int(val)
    return None


def local_rank_by_split(world) -> int:
    """Rank among the processes sharing this node's memory (collective)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank()
    finally:
        node.Free()


def _axis_sizes(axes, world_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(names, sizes) of `axes`, with a size of None filled in; else a
    ValueError. Depends only on the arguments and the world size, which every
    rank has alike, so every rank raises the same error."""
    try:
        pairs = [tuple(axis) for axis in axes]
    except TypeError:
        pairs = None
    if not pairs or any(len(axis) != 2 for axis in pairs):
        raise ValueError(f"ProcessGrid: axes must be a non-empty list of (name, size) pairs, got {axes!r}")
    names = tuple(name for name, _ in pairs)
    if any(not isinstance(name, str) or not name for name in names) or len(set(names)) != len(names):
        raise ValueError(f"ProcessGrid: axis names must be distinct non-empty strings, got {list(names)}")
    # numpy integers are ints here too (a grid computed with numpy, say).
    sizes = [int(size) if isinstance(size, np.integer) else size for _, size in pairs]
    for name, size in zip(names, sizes):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"ProcessGrid: {name} must be a positive int (or None: whatever divides the "
                             f"world), got {size!r}")
    unknown = [name for name, size in zip(names, sizes) if size is None]
    if len(unknown) > 1:
        raise ValueError(f"ProcessGrid: at most one axis size may be None (whatever divides the world), "
                         f"got None for {', '.join(unknown)}")
    if unknown:
        known = math.prod(size for size in sizes if size is not None)
        sizes[names.index(unknown[0])] = world_size // known
    product = " * ".join(f"{name}={size}" for name, size in zip(names, sizes))
    if math.prod(sizes) != world_size:
        raise ValueError(f"ProcessGrid: the axis sizes must multiply to the world size: {product} "
                         f"= {math.prod(sizes)} != {world_size} ranks")
    return names, tuple(sizes)


class ProcessGrid:
    """The ranks of `world` on a grid of named axes, outermost first, each
    given as (name, size); at most one size may be None: whatever divides the
    world. Collective over `world` (one Split per axis). Bad axes raise the
    same ValueError on every rank, before any communication.

        grid.axes, grid.shape       axis names and sizes, outermost first
        grid.size(axis)             ranks along the axis
        grid.index(axis)            this rank's coordinate along it
        grid.comm(axis)             the ranks that differ from this one only along
                                    the axis; its rank there is grid.index(axis)
        grid.world, grid.rank, grid.world_size
        grid.local_rank             rank among the processes on this node
    """

    def __init__(self, world, axes: "Sequence[tuple[str, int | None]]"):
        world_size, rank = world.Get_size(), world.Get_rank()
        self.axes, self.shape = _axis_sizes(axes, world_size)
        self.world, self.rank, self.world_size = world, rank, world_size
        self._index = {}
        self._comm = {}
        stride = world_size
        for name, size in zip(self.axes, self.shape):
            stride //= size                   # world ranks between neighbours along this axis
            index = rank // stride % size
            self._index[name] = index
            # The ranks whose coordinates agree on every other axis share a
            # color: this rank's with its coordinate along `name` taken out.
            self._comm[name] = world.Split(color=rank - index * stride, key=index)
        env = local_rank_from_env()
        # Launchers set the variable for every rank or for none, so the
        # collective split below is entered by all ranks or by none.
        self.local_rank = env if env is not None else local_rank_by_split(world)

    def _axis(self, axis: str) -> str:
        if axis not in self._index:
            raise ValueError(f"ProcessGrid has no axis {axis!r}; its axes are {', '.join(self.axes)}")
        return axis

    def size(self, axis: str) -> int:
        return self.shape[self.axes.index(self._axis(axis))]

    def index(self, axis: str) -> int:
        return self._index[self._axis(axis)]

    def comm(self, axis: str):
        return self._comm[self._axis(axis)]

    def free(self) -> None:
        """Free the axis communicators (collective over the world, like creation)."""
        for c in self._comm.values():
            if c != MPI.COMM_NULL and not MPI.Is_finalized():
                c.Free()

    def __repr__(self) -> str:
        coords = ", ".join(f"{name}={self._index[name]}/{size}" for name, size in zip(self.axes, self.shape))
        return f"ProcessGrid(rank={self.rank}/{self.world_size}, {coords}, local_rank={self.local_rank})"
