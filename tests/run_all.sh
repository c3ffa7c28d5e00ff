#!/usr/bin/env bash
# The whole test suite: lint, serial tests, then the MPI tests under 2, 4 and 8 ranks
# (tests/run_mpi.sh), ending with one summary of the phases: result, measured time,
# and for a failed one the command that reruns just it (tests/support/phases.sh).
# Called by `make test` (which puts the project's .venv first on PATH) and so by .ci/run.
#
#   bash tests/run_all.sh --plan   # only say what a run will do and install, before anything does
set -u
cd "$(dirname "$0")/.."

# The real-Slurm tests (tests/slurm/) apt-get install slurm-wlm and munge as root
# (slurm/local/start.sh): a user is told before anything installs, and how to say no.
# The monitor tools' tests need chromium (the HTML report opened in a real browser) and tmux
# (`ringpipe top` in a real terminal): installed the same way, before the serial tests.
plan() {
    echo "make test: lint, the serial tests, then the MPI tests on 2, 4 and 8 ranks;" \
         "a summary with each part's time closes the run"
    tools_plan
    if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then
        return
    fi
    if [ "${RINGPIPE_SLURM_NO_INSTALL:-0}" = 1 ]; then
        echo "note: Slurm is not installed and RINGPIPE_SLURM_NO_INSTALL=1: the real-Slurm tests" \
             "(tests/slurm/) will be skipped, each with its reason in pytest's closing lines"
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "note: the real-Slurm tests (tests/slurm/) will install slurm-wlm and munge with apt-get," \
             "as root (once, about 15-30 s). To skip those tests instead: RINGPIPE_SLURM_NO_INSTALL=1 make test"
    else
        echo "note: Slurm is not installed and cannot be here (needs root and apt-get): the real-Slurm" \
             "tests (tests/slurm/) will be skipped, each with its reason in pytest's closing lines"
    fi
}

# What of chromium and tmux is missing (by package name).
missing_tools() {
    command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || echo chromium
    command -v tmux >/dev/null 2>&1 || echo tmux
}

tools_plan() {
    local missing
    missing=$(missing_tools | tr '\n' ' ')
    [ -n "$missing" ] || return 0
    if [ "${RINGPIPE_TOOLS_NO_INSTALL:-0}" = 1 ]; then
        echo "note: ${missing}not installed and RINGPIPE_TOOLS_NO_INSTALL=1: the monitor tools' tests that need" \
             "them (tests/engine/monitor/) will be skipped, each with its reason"
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "note: the monitor tools' tests will install ${missing}with apt-get, as root, before the serial" \
             "tests. To skip those tests instead: RINGPIPE_TOOLS_NO_INSTALL=1 make test"
    else
        echo "note: ${missing}not installed and cannot be here (needs root and apt-get): the monitor tools'" \
             "tests that need them (tests/engine/monitor/) will be skipped, each with its reason"
    fi
}

install_tools() {
    local missing
    missing=$(missing_tools | tr '\n' ' ')
    if [ -z "$missing" ] || [ "${RINGPIPE_TOOLS_NO_INSTALL:-0}" = 1 ] || [ "$(id -u)" != 0 ] \
            || ! command -v apt-get >/dev/null 2>&1; then
        return 0
    fi
    echo "installing ${missing}with apt-get (the monitor tools' tests)"
    # shellcheck disable=SC2086  # the package names, one word each
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null 2>&1 \
        || echo "warning: apt-get could not install ${missing}(its package lists may need \`apt-get update\`);" \
                "the tests that need them will skip"
}

if [ "${1:-}" = --plan ]; then
    plan
    exit 0
fi

. tests/support/phases.sh
PY=${PYTHON:-python}
# 4 ranks share 2 cores here: one BLAS/Numba thread per rank keeps them from thrashing.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
PYPATH=$(command -v "$PY" || echo "$PY")
EXTRA=$(printf ' %q' "$@")
[ $# -gt 0 ] || EXTRA=
phases_begin

echo "== lint (ruff: undefined names, unused imports, syntax errors; config in ruff.toml) =="
phase "lint (ruff)" "$PYPATH -m ruff check ." "$PY" -m ruff check --quiet .

echo "== serial tests (a line per test file) =="
plan | grep '^note:'
install_tools
phase "serial tests" "OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 $PYPATH -m pytest -m 'not mpi' tests$EXTRA  # --lf: only the tests that failed" \
    "$PY" -m pytest -m "not mpi" tests "$@"

# 2, 4 and 8 ranks with the mpiexec on PATH (`make test-openmpi` runs the same under Open MPI);
# run_mpi.sh adds its passes to this run's summary.
bash tests/run_mpi.sh "$@"
phases_end
