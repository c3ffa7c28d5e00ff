"""ringpipe.comm: MPI collectives for data/pipeline parallel training.

MPI only, no model knowledge: comm imports nothing of ringpipe.engine or
ringpipe.kernels. Hot paths use mpi4py's uppercase (buffer) calls on
preallocated memory; each parallel axis gets its own communicator, and our
own traffic runs on private Dup'ed communicators. Device (cupy) buffers work
too: handed to a CUDA-aware MPI directly, else staged through pinned host
memory (comm/device.py).

Settings come from RINGPIPE_* environment variables (comm/settings.py), read
at the first collective, not at import; check_settings() reads them at once.

One module per concern:

    collectives.py  the public allreduce / reduce_scatter / allgather: buffer
                    handling, layout check and validation, algorithm choice
                    (set_crossover); allreduce_on_context, the entry point for
                    callers with their own private context (GradBuckets); the
                    hierarchical all-reduce's three steps (allreduce_hierarchical)
    ring.py         the ring algorithm: chunk_bounds, its schedule and hot loop
                    (set_subchunk_bytes)
    small.py        recursive doubling, the latency-optimal all-reduce
    hierarchical.py the all-reduce by node (reduce-scatter inside, across, all-gather
                    inside: the network carries 2(N-1)/N, not 2(p-1)/p, bytes per byte):
                    the nodes and the communicators it runs on (Hierarchy); the steps
                    run in collectives.py, over those communicators
    layout.py       what the ranks compare before a call: the layout record,
                    its codes and legend, and validation
    fingerprint.py  the layout fingerprints in the message tags
    consistency.py  check_consistent: do all ranks hold the same values?
    context.py      CommContext, our private view of a communicator, and
                    context_for, which keeps one per communicator
    buckets.py      GradBuckets: bucketed all-reduce overlapped with backward
    ps.py           ParameterServerGroup: the parameter server's push, sum (the small
                    path's pairwise tree), global norm and pull; ps_layout, its chunks
    grid.py         ProcessGrid: named parallel axes, one communicator each
    abort.py        the abort handler: one rank's uncaught exception ends the job
    device.py       device (GPU) arrays and MPI: direct or staged
    settings.py     the RINGPIPE_* variables, parsed, checked and agreed on
    launcher.py     what a launch needs settled before MPI_Init (srun's pmi2
                    plugin and the mpich wheel: the OFI netmod)
"""

if __name__ == "comm":
    # Python started in the checkout's root found this folder as the top-level `comm`, the
    # name of Jupyter's package (ipykernel imports it): that one takes the name, and nothing
    # of ringpipe's runs, MPI least of all (ringpipe/_shadowing.py).
    import os
    import runpy

    _shadowing = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), "ringpipe", "_shadowing.py"))
    _shadowing["step_aside"](__name__, __file__)
else:
    # First, before the imports below: the first `from mpi4py import MPI` initializes MPI.
    from . import launcher as _launcher

    _launcher.prepare_mpi_init()
    _launcher.load_mpi()                   # MPIUnavailable (an ImportError) naming what to install

    from .abort import abort_on_error, install_abort_handler
    from .buckets import GradBuckets
    from .collectives import allgather, allreduce, get_crossover, reduce_scatter, set_crossover
    from .consistency import check_consistent
    from .grid import ProcessGrid
    from .ps import ParameterServerGroup, PSLayout, ps_layout, ps_ranks
    from .ring import chunk_bounds
    from .settings import check_settings

    __all__ = [
        "allreduce",
        "reduce_scatter",
        "allgather",
        "chunk_bounds",
        "set_crossover",
        "get_crossover",
        "GradBuckets",
        "ProcessGrid",
        "ParameterServerGroup",
        "PSLayout",
        "ps_layout",
        "ps_ranks",
        "check_consistent",
        "install_abort_handler",
        "abort_on_error",
        "check_settings",
    ]
