#!/usr/bin/env bash
# The whole test suite: serial tests, then the MPI tests under 2 and 4 ranks
# (tests/run_mpi.sh).
# Called by `make test` (which puts the project's .venv first on PATH) and so by .ci/run.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
# 4 ranks share 2 cores here: one BLAS/Numba thread per rank keeps them from thrashing.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
status=0

run() {  # pytest exit 5 = "no tests collected": not a failure for a selection that may be empty
    "$@"; rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
}

echo "== lint (ruff: undefined names, unused imports, syntax errors; config in ruff.toml) =="
run "$PY" -m ruff check --quiet .

echo "== serial tests (about 5 minutes on 2 cores; a line per test file) =="
if [ "${RINGPIPE_SLURM_NO_INSTALL:-0}" = 0 ] && ! command -v slurmctld >/dev/null 2>&1; then
    echo "note: tests/slurm/test_slurm.py installs slurm-wlm and munge with apt-get for its real-Slurm jobs" \
         "(root only; RINGPIPE_SLURM_NO_INSTALL=1 skips those tests instead)"
fi
run "$PY" -m pytest -m "not mpi" tests "$@"
# 2 and 4 ranks with the mpiexec on PATH (`make test-openmpi` runs the same under Open MPI).
run bash tests/run_mpi.sh "$@"
exit $status
