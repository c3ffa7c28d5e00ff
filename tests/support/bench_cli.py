"""What the benchmark tests share: a clean environment for a benchmark's process, running
one, and the check that a bad flag is refused before any work."""
import os
import subprocess
import sys

from tests.support import ROOT

# An outer launcher's variables would make a child mpiexec try to join that job.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_CVAR_")


def bench_env(**extra) -> dict:
    """os.environ without an outer launcher's variables; one thread per library, as in the
    benchmarks (`extra`: more variables, e.g. a library's own thread count)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", **extra)
    return env


def run_benchmark(script, *args, timeout=120, ranks=None, env=None):
    """`script` (benchmarks/NAME.py) with `args`, from the checkout's root, in `env` (default bench_env()),
    under `mpiexec -n ranks` (the venv's) when given; the finished process, output captured."""
    launch = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] if ranks else []
    return subprocess.run([*launch, sys.executable, script, *args], cwd=ROOT,
                          env=bench_env() if env is None else env, capture_output=True, text=True, timeout=timeout)


def refused(r, *words) -> str:
    """`r` (a finished subprocess) was refused by argparse before any work: exit 2, no
    output, no traceback, and its last stderr line names every one of `words`."""
    assert r.returncode == 2, f"exit {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", f"refused after starting work:\n{r.stdout[-2000:]}"
    last = r.stderr.strip().splitlines()[-1]
    assert "error:" in last, r.stderr
    for w in words:
        assert w in last, f"{w!r} not in {last!r}"
    return last
