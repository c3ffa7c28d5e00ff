"""Run engine.job.lifecycle.check_launcher() on every task and report: under
`srun --mpi=none` each task is MPI rank 0 of 1 and must be refused.

Task 0 prints the refusal; with --every-task every task does (then the first
task to exit has printed it, whichever srun's --kill-on-bad-exit=1 lets live)."""
import os
import sys


from mpi4py import MPI  # noqa: E402

from ringpipe.engine.job.lifecycle import LauncherError, check_launcher  # noqa: E402

try:
    check_launcher(MPI.COMM_WORLD)
except LauncherError as e:
    if os.environ.get("SLURM_PROCID", "0") == "0" or "--every-task" in sys.argv[1:]:
        print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
print(f"LAUNCH_OK rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()}", flush=True)
