#!/usr/bin/env bash
# One-shot GPU check for ringpipe's kernels, for a freshly lent GPU machine.
#
#   OUT=/path/to/results bash benchmarks/gpu_check.sh
#
# Runs, each step under its own time limit and all of them under one overall
# budget (GPU_CHECK_BUDGET_S, default 450 s; later steps are skipped rather than
# overrun it), logging every step's exit code and continuing past failures:
#   1. environment: nvidia-smi, nvcc, python, packages
#   2. MPI: use the machine's mpi4py and mpiexec if they work; else install the MPICH
#      and mpi4py wheels carried in ./.whl (fetched beforehand, where an index is
#      reachable, by benchmarks/gpu_wheels.sh) into a temporary prefix.
#      cupy: use it if it imports and sees the GPU; else try to install the wheel for
#      the machine's CUDA major (cupy-cuda13x / cupy-cuda12x / cupy-cuda11x), first
#      from ./.whl if present, then from the package index
#   3. the GPU tests: pytest tests/kernels/test_cuda_kernels.py -k test_gpu_
#   4. benchmarks/gemm.py --quick --json
#   5. short GPU training runs: python -m ringpipe.train --device cuda --steps 30, in
#      float32 and with --precision bf16 (tokens/s and model FLOP/s of each), and the Llama family
#      (with Qwen3's per-head q/k norm and a sliding window)
#   6. device buffers and MPI on the GPU: tests/support/mpi_scripts/device_comm_check.py under
#      mpiexec -n 2, staged through pinned memory and (if the MPI says it is
#      CUDA-aware) direct
#   7. the Numba CUDA kernels on the device: tests/support/cuda_sim_check.py --gpu
#   8. nvcc compile checks with the ptxas register/spill report
#   9. a tensor-parallel run, --tp 2 --sequence-parallel, two ranks on the GPU (its
#      overlap thread on, as --tp-overlap auto is for cuda; tokens/s in check.log)
#  10. a ZeRO-3 run with --recompute full, two ranks on the GPU (tokens/s in check.log)
#      The float32 run and this one gather per-rank numbers every 5 steps (--monitor-every 5):
#      NVML's GPU utilisation and memory in train_metrics.jsonl's "ranks", the job summary
#      (per node CPU, memory, time split, GPU) in check.log
# Results go to ${OUT:-gpu_results}, at most 8 files (what a device run brings back):
#   check.log (everything, in order), steps.tsv (step, exit code, seconds), env.txt,
#   pytest_gpu.xml, gemm.json, train_metrics.jsonl, train_bf16_metrics.jsonl, train_llama_metrics.jsonl
# Knobs: PYTHON (default python3), GPU_CHECK_BUDGET_S, GEMM_BENCH_ARGS (default --quick),
# TRAIN_ARGS (extra ringpipe train arguments).
# Exit code: 0 if every step that ran passed, 1 otherwise.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
START=$(date +%s)
LOG="$OUT/check.log"
STEPS="$OUT/steps.tsv"
TMPD=$(mktemp -d /tmp/ringpipe_gpu_check.XXXXXX)
# The checkout itself, not an installed ringpipe: the GPU machine has none, and maybe no pip.
# package_view.py makes the checkout again of links, its ringpipe/ the package setup.py would
# install (engine/, kernels/, comm/ under it); every step runs from there (docs/gpu.md).
VIEW=$("$PY" benchmarks/package_view.py "$TMPD/view") && cd "$VIEW" || { echo "gpu_check.sh: no package view" >&2; exit 1; }
export PYTHONPATH=$VIEW${PYTHONPATH:+:$PYTHONPATH}
: >"$LOG"
printf 'step\texit\tseconds\n' >"$STEPS"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
status=0

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT_S COMMAND...: run under min(LIMIT_S, time left), log, record
step() {
    local name=$1 limit=$2
    shift 2
    local now left rc t0 t1
    now=$(date +%s)
    left=$((BUDGET - (now - START) - 5))
    if [ "$left" -lt 15 ]; then
        say "=== [$name] SKIPPED: overall budget of ${BUDGET}s used up"
        printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "=== [$name] (limit ${limit}s) $*"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$TMPD/step.log" 2>&1
    rc=$?
    t1=$(date +%s)
    cat "$TMPD/step.log" >>"$LOG"
    tail -n 25 "$TMPD/step.log"
    [ "$rc" -eq 124 ] && say "--- [$name] TIMED OUT after ${limit}s"
    say "--- [$name] exit $rc in $((t1 - t0))s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((t1 - t0))" >>"$STEPS"
    [ "$rc" -ne 0 ] && status=1
    return 0
}

# ---------------------------------------------------------------------------
# 1. environment
{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(hostname)"
    echo "--- nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi failed"
    echo "--- nvcc"; nvcc --version 2>&1 || echo "nvcc not found"
    echo "--- python: $(command -v "$PY") $("$PY" --version 2>&1)"
    echo "--- packages"
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(cupy|numba|numpy|torch|mpi4py|pytest|cuda|nvidia-cuda)' || true
    echo "--- env: CUDA_HOME=${CUDA_HOME:-} CUDA_PATH=${CUDA_PATH:-} CUPY_TF32=${CUPY_TF32:-}"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >>"$LOG"
head -n 20 "$OUT/env.txt"

# ---------------------------------------------------------------------------
# 2. MPI, then cupy
# Commands on a lent GPU machine run as root: let Open MPI's mpiexec accept that.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIEXEC=$(dirname "$(command -v "$PY")")/mpiexec
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
have_mpi() {
    command -v "$MPIEXEC" >/dev/null 2>&1 &&
        timeout 60 "$MPIEXEC" -n 2 "$PY" -c "from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2" >/dev/null 2>&1
}
if have_mpi; then
    say "=== [mpi] machine's own: $MPIEXEC, $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>&1)"
    printf 'mpi\t0\t0\n' >>"$STEPS"
elif ls .whl/mpich-*.whl .whl/mpi4py-*.whl >/dev/null 2>&1; then
    SITE=$TMPD/site
    step "pip-local-mpi" 120 "$PY" -m pip install --no-index --no-deps --no-compile --ignore-installed \
        --prefix "$SITE" .whl/mpich-*.whl .whl/mpi4py-*.whl
    # Found, not assumed: some Pythons (Debian's) install a --prefix under PREFIX/local.
    MPIEXEC=$(find "$SITE" -path '*/bin/mpiexec' | head -n 1)
    pkgs=$(dirname "$(find "$SITE" -name __init__.py -path '*/mpi4py/__init__.py' | head -n 1)")
    PYTHONPATH=$(dirname "$pkgs")${PYTHONPATH:+:$PYTHONPATH}
    PATH=$(dirname "$MPIEXEC"):$PATH
    MPI4PY_LIBMPI=$(find "$SITE" -name libmpi.so.12 | head -n 1)
    export PYTHONPATH PATH MPI4PY_LIBMPI
    if have_mpi; then say "=== [mpi] carried MPICH ready: $MPIEXEC"; else say "=== [mpi] STILL NOT USABLE: MPI steps will fail"; status=1; fi
else
    say "=== [mpi] NOT USABLE and no wheels in ./.whl (run benchmarks/gpu_wheels.sh where an index is reachable): MPI steps will fail"
    status=1
fi

have_cupy() { "$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" >/dev/null 2>&1; }
if have_cupy; then
    say "=== [cupy] already installed: $("$PY" -c 'import cupy; print(cupy.__version__)' 2>&1)"
    printf 'cupy\t0\t0\n' >>"$STEPS"
else
    major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
    [ -z "$major" ] && major=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p' | head -n 1)
    case "${major:-}" in
        11) wheels="cupy-cuda11x" ;;
        12) wheels="cupy-cuda12x" ;;
        13) wheels="cupy-cuda13x cupy-cuda12x" ;;  # 12x runs on a 13 driver if 13x is unavailable
        *) wheels="cupy-cuda12x cupy-cuda13x" ;;
    esac
    say "=== [cupy] not usable; CUDA major '${major:-?}', trying: $wheels"
    for w in $wheels; do
        if [ -d .whl ]; then
            step "pip-local-$w" 120 "$PY" -m pip install --no-index --find-links .whl "$w"
            have_cupy && break
        fi
        step "pip-$w" 150 "$PY" -m pip install --retries 1 --timeout 20 "$w"
        have_cupy && break
    done
    if have_cupy; then say "=== [cupy] ready"; else say "=== [cupy] STILL NOT USABLE: GPU steps will fail/skip"; status=1; fi
fi
"$PY" -c "import pytest" >/dev/null 2>&1 || step "pip-pytest" 60 "$PY" -m pip install --retries 1 --timeout 20 pytest
# NVML's binding: the monitor's GPU utilisation and memory (skipped where no index is reachable)
"$PY" -c "import pynvml" >/dev/null 2>&1 || step "pip-nvml" 60 "$PY" -m pip install --retries 1 --timeout 20 nvidia-ml-py
"$PY" -c "from ringpipe.kernels.cuda import available; print('ringpipe.kernels.cuda.available():', available())" 2>&1 | tee -a "$LOG"

# ---------------------------------------------------------------------------
# 3-7
step "pytest-gpu" 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cuda_kernels.py -k test_gpu_ \
    --junitxml "$OUT/pytest_gpu.xml"
# shellcheck disable=SC2086  # GEMM_BENCH_ARGS / TRAIN_ARGS are word lists on purpose
step "gemm-bench" 200 "$PY" benchmarks/gemm.py ${GEMM_BENCH_ARGS:---quick} --json "$OUT/gemm.json"
# train NAME RESULT_FILE EXTRA_ARGS...: a 30-step GPU run, its metrics.jsonl kept
train() {
    local name=$1 result=$2
    shift 2
    rm -rf "${TMPD:?}/$name"
    # shellcheck disable=SC2086
    step "$name" 120 "$PY" -m ringpipe.train --device cuda --steps 30 --out "$TMPD/$name" --overwrite "$@" ${TRAIN_ARGS:-}
    [ -f "$TMPD/$name/metrics.jsonl" ] && cp "$TMPD/$name/metrics.jsonl" "$OUT/$result"
}
train train-cuda train_metrics.jsonl --monitor-every 5
train train-cuda-bf16 train_bf16_metrics.jsonl --precision bf16
train train-cuda-llama train_llama_metrics.jsonl --model llama --preset llama-tiny --qk-norm head --sliding-window 16   # Qwen3's q/k norm, a window
RINGPIPE_CUDA_AWARE_MPI=0 step "mpi-device-staged" 90 "$MPIEXEC" -n 2 "$PY" tests/support/mpi_scripts/device_comm_check.py
if "$PY" -c "from ringpipe.comm.device import query_library as q; raise SystemExit(0 if q() else 1)" 2>/dev/null; then
    RINGPIPE_CUDA_AWARE_MPI=1 step "mpi-device-direct" 90 "$MPIEXEC" -n 2 "$PY" tests/support/mpi_scripts/device_comm_check.py
else
    say "=== [mpi-device-direct] SKIPPED: this MPI does not report CUDA support (MPIX_Query_cuda_support)"
fi
step "numba-gpu" 120 "$PY" tests/support/cuda_sim_check.py --gpu
step "nvcc-ptxas" 90 "$PY" -m pytest -q -s -p no:cacheprovider tests/kernels/test_cuda_kernels.py -k "nvcc or nvrtc"
# Last: the budget skips it before the checks above.
# shellcheck disable=SC2086
RINGPIPE_CUDA_AWARE_MPI=0 step "train-cuda-tp2" 120 "$MPIEXEC" -n 2 "$PY" -m ringpipe.train --device cuda --tp 2 \
    --sequence-parallel --steps 30 --out "$TMPD/train-cuda-tp2" --overwrite ${TRAIN_ARGS:-}
# ZeRO-3 (parameters gathered per layer on the gather thread) with full recomputation on the GPU.
# shellcheck disable=SC2086
RINGPIPE_CUDA_AWARE_MPI=0 step "train-cuda-zero3" 120 "$MPIEXEC" -n 2 "$PY" -m ringpipe.train --device cuda --zero 3 \
    --recompute full --steps 30 --monitor-every 5 --out "$TMPD/train-cuda-zero3" --overwrite ${TRAIN_ARGS:-}
[ -f "$TMPD/train-cuda-zero3/job_summary.txt" ] && cat "$TMPD/train-cuda-zero3/job_summary.txt" >> "$LOG"

# ---------------------------------------------------------------------------
say "=== summary ($(($(date +%s) - START))s of ${BUDGET}s budget)"
if command -v column >/dev/null 2>&1; then column -t "$STEPS"; else cat "$STEPS"; fi | tee -a "$LOG"
say "results in $OUT: $(cd "$OUT" && echo *)"
rm -rf "$TMPD"
exit $status
