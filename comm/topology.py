"""Process grid: one communicator per parallel axis (data x pipeline).

World rank = stage * dp + dp_rank, so the ranks of one pipeline stage are
contiguous (on a cluster they tend to share a node, and the data-parallel
all-reduce is the heavy traffic).
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

__all__ = ["Topology", "local_rank_from_env"]

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


class Topology:
    """dp x pp grid over `world` (default MPI.COMM_WORLD).

    dp_comm: ranks of the same stage (the data-parallel all-reduce group).
    pp_comm: ranks with the same dp_rank, ordered by stage (the pipeline);
    prev_stage_rank / next_stage_rank are ranks in pp_comm, None at the ends.
    """

    def __init__(self, world=None, dp: int | None = None, pp: int = 1):
        world = MPI.COMM_WORLD if world is None else world
        size, rank = world.Get_size(), world.Get_rank()
        # All validation before any communication: every rank sees the same
        # size and arguments, so every rank raises the same error.
        # numpy integers are ints here too (a grid computed with numpy, say).
        pp = int(pp) if isinstance(pp, np.integer) else pp
        dp = int(dp) if isinstance(dp, np.integer) else dp
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"Topology: pp must be a positive int, got {pp!r}")
        if dp is None:
            dp = size // pp
        if not isinstance(dp, int) or dp < 1 or dp * pp != size:
            raise ValueError(
                f"Topology: dp * pp must equal the world size: dp={dp} * pp={pp} "
                f"= {dp * pp if isinstance(dp, int) else '?'} != {size} ranks")

        self.world = world
        self.rank, self.size = rank, size
        self.dp, self.pp = dp, pp
        self.stage, self.dp_rank = divmod(rank, dp)
        self.dp_comm = world.Split(color=self.stage, key=self.dp_rank)
        self.pp_comm = world.Split(color=self.dp_rank, key=self.stage)
        self.prev_stage_rank = self.stage - 1 if self.stage > 0 else None
        self.next_stage_rank = self.stage + 1 if self.stage < pp - 1 else None
        self.is_first_stage = self.stage == 0
        self.is_last_stage = self.stage == pp - 1
        env = local_rank_from_env()
        # Launchers set the variable for every rank or for none, so the
        # collective split below is entered by all ranks or by none.
        self.local_rank = env if env is not None else local_rank_by_split(world)

    def free(self) -> None:
        for c in (self.dp_comm, self.pp_comm):
            if c != MPI.COMM_NULL and not MPI.Is_finalized():
                c.Free()

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}/{self.size}, dp={self.dp}, pp={self.pp}, "
                f"stage={self.stage}, dp_rank={self.dp_rank}, local_rank={self.local_rank})")
