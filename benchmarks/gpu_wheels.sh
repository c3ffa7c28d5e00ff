#!/usr/bin/env bash
# Fetch, on a machine that can reach a package index, the wheels that
# benchmarks/gpu_check.sh installs on a GPU machine that cannot:
#
#   bash benchmarks/gpu_wheels.sh [DIR]        (default .whl, git-ignored)
#
# GPU machines often come with CuPy and Numba but no MPI library for mpi4py
# (ringpipe train and the device-buffer MPI checks need one). This fetches the
# MPICH wheel and a matching mpi4py (about 15 MB together), so the GPU machine
# needs no network. gpu_check.sh uses them only when the machine's own
# mpi4py/mpiexec do not work.
# Knobs: GPU_PY_VERSION (the GPU machine's Python, default 3.12),
#        EXTRA_WHEELS (more NAME==VERSION to fetch, e.g. a cupy-cuda12x).
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${GPU_PY_VERSION:-3.12}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$DIR"
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms="$platforms --platform $p"
done
# shellcheck disable=SC2086  # word lists on purpose
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    $platforms -d "$DIR" mpich==5.0.2 mpi4py==4.1.2 ${EXTRA_WHEELS:-}
ls -l "$DIR"
echo "Carry '$DIR' to the GPU machine (device tool: carry=[\"$DIR\"]) and run: OUT=... bash benchmarks/gpu_check.sh"
