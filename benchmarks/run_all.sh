#!/usr/bin/env bash
# Every CPU benchmark in one go, each writing its table to stdout and JSON to $OUT.
#   bash benchmarks/run_all.sh [OUT_DIR]      (default bench_results/<date>)
# Run on a quiet machine; the README's tables come from this script.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
OUT=${1:-bench_results/$(date +%Y-%m-%d)}
mkdir -p "$OUT"
one() {  # name, command...
    local name=$1; shift
    echo "== $name: $*" | tee "$OUT/$name.txt"
    "$@" 2>&1 | tee -a "$OUT/$name.txt"
    echo "exit ${PIPESTATUS[0]}" >> "$OUT/$name.txt"
}
{ uname -a; nproc; lscpu | grep -E "Model name|Thread|Core|Socket" ; "$PY" -c "import numpy; numpy.show_config()" 2>/dev/null | grep -A3 -i "blas" | head -8; } > "$OUT/machine.txt" 2>&1
one train_throughput "$PY" benchmarks/train_throughput.py --json "$OUT/train_throughput.json"
one kernels_cpu "$PY" benchmarks/kernels_cpu.py --json "$OUT/kernels_cpu.json"
one bf16_gemm "$PY" benchmarks/bf16_gemm.py --json "$OUT/bf16_gemm.json"
one llama_kernels "$PY" benchmarks/llama_kernels.py --json "$OUT/llama_kernels.json"
one allreduce_2 env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$MPIEXEC" -n 2 "$PY" benchmarks/allreduce.py --json "$OUT/allreduce_2.json"
one allreduce_4 env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$MPIEXEC" -n 4 "$PY" benchmarks/allreduce.py --max-bytes 64M --json "$OUT/allreduce_4.json"
one overlap_matmul env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$MPIEXEC" -n 2 "$PY" benchmarks/allreduce.py --overlap --work matmul --json "$OUT/overlap_matmul.json"
one overlap_sleep env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$MPIEXEC" -n 2 "$PY" benchmarks/allreduce.py --overlap --work sleep --json "$OUT/overlap_sleep.json"
one pipeline_2 "$MPIEXEC" -n 2 "$PY" benchmarks/pipeline.py --json "$OUT/pipeline_2.json"
one pipeline_4 "$MPIEXEC" -n 4 "$PY" benchmarks/pipeline.py --json "$OUT/pipeline_4.json"
one tensor_parallel_2 "$MPIEXEC" -n 2 "$PY" benchmarks/tensor_parallel.py --json "$OUT/tensor_parallel_2.json"
one tensor_parallel_4 "$MPIEXEC" -n 4 "$PY" benchmarks/tensor_parallel.py --json "$OUT/tensor_parallel_4.json"
one scaling "$PY" benchmarks/scaling.py --json "$OUT/scaling.json"
one gpt2_step "$PY" benchmarks/gpt2_step.py --json "$OUT/gpt2_step.json"
one llama_step "$PY" benchmarks/llama_step.py --json "$OUT/llama_step.json"
one data_pipeline "$PY" benchmarks/data_pipeline.py --json "$OUT/data_pipeline.json"
one memory "$PY" benchmarks/memory.py --json "$OUT/memory.json"
echo "results in $OUT"
