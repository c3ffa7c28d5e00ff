"""ringpipe.comm: MPI collectives for data/pipeline parallel training.

MPI only, no model knowledge. Hot paths use mpi4py's uppercase (buffer)
calls on preallocated memory; each parallel axis gets its own communicator,
and our own traffic runs on private Dup'ed communicators. Device (cupy)
buffers work too: handed to a CUDA-aware MPI directly, else staged through
pinned host memory (comm/device.py).

Settings come from RINGPIPE_* environment variables (comm/settings.py), read
at the first collective, not at import; check_settings() reads them at once.
"""

from .buckets import GradBuckets
from .ring import (
    allgather,
    allreduce,
    chunk_bounds,
    get_crossover,
    reduce_scatter,
    set_crossover,
)
from .safety import abort_on_error, check_consistent, install_abort_handler
from .settings import check_settings
from .topology import Topology

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "chunk_bounds",
    "set_crossover",
    "get_crossover",
    "GradBuckets",
    "Topology",
    "check_consistent",
    "install_abort_handler",
    "abort_on_error",
    "check_settings",
]
