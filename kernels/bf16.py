"""
The bf16 x bf16 -> float32 GEMM on the CPU: real bfloat16 dot products where the CPU
has them (AVX512_BF16 or AMX-BF16), today's emulation where it does not.

What runs (kernels/cpu.py's matmul sends every bf16 GEMM here):
  native    oneDNN's C API, dnnl_gemm_bf16bf16f32, through ctypes: bf16 operands,
            float32 accumulation and result, row-major, transpose flags and leading
            dimensions (so transposed views cost no copy). From PyPI's onednn-cpu-gomp
            (the `bf16` extra; its library needs only libgomp and libstdc++), loaded
            by kernels/onednn.py.
  emulated  reference.matmul's numbers bit for bit: float32 operands rounded to bf16
            values held in float32 (one Numba pass each), then the float32 BLAS GEMM.
            The same numbers as native up to the accumulation order, a little slower
            than float32 (the rounding passes, and no bf16 units).
Chosen once per process by RINGPIPE_BF16_GEMM:
  auto      (default) native where the CPU has the instructions and the library is
            installed, else emulated, with one note on stderr (launcher rank 0) saying why
  native    native, or Bf16Unavailable saying what is missing
  emulate   emulated, silently (the yardstick, or a CPU whose native path misbehaves)

Measured on a 2-core AMD EPYC Zen 5 (AVX512_BF16, no AMX): see docs/library.md and
benchmarks/bf16_gemm.py.

Candidates measured and dropped: OpenBLAS's sbgemm (the scipy-openblas32/64 wheels
are built without BFLOAT16: no sbgemm symbol; numpy's bundled OpenBLAS neither), and a
Numba kernel of our own (a library made for this is the better default: oneDNN blocks
for the caches and packs the operands, which a hand kernel would have to redo).

Operands may already be bf16: uint16 arrays holding bf16 bit patterns (to_bf16 makes
them) or ml_dtypes.bfloat16 arrays (viewed as uint16; ml_dtypes is not needed here).
Then no rounding pass runs: the training step can keep weights in bf16 and cast them
once per update. Float32 operands are rounded to nearest, ties to even, as
reference.round_to_bf16 (the same bits; NaNs stay NaN).

Threads: oneDNN's OpenMP (libgomp) reads OMP_NUM_THREADS when it loads, which importing
ringpipe sets per rank (ringpipe/threads.py); kernels.set_num_threads changes it afterwards
(kernels/onednn.py).
"""

import os
import sys

import numpy as np
from numba import njit, prange

from ringpipe import threads

from . import onednn, reference

ENV = "RINGPIPE_BF16_GEMM"
MODES = ("auto", "native", "emulate")
# The CPU flags (Linux /proc/cpuinfo names) of bf16 dot-product instructions.
CPU_FLAGS = ("avx512_bf16", "amx_bf16")


class Bf16Unavailable(RuntimeError):
    """RINGPIPE_BF16_GEMM=native on a machine that cannot run the native bf16 GEMM."""


# ---------------------------------------------------------------------------
# bf16 conversion (what reference.round_to_bf16 computes, as bits, in one pass)


@njit(parallel=True, cache=True)
def _to_bf16_rows(u, out):
    # u: (rows, cols) uint32 view of float32, any strides; out: (rows, cols) uint16.
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the top
    # half. NaNs keep sign and top payload bits with the quiet bit set (a low payload
    # would otherwise carry into inf). In int64, so nothing wraps.
    for i in prange(u.shape[0]):
        for j in range(u.shape[1]):
            x = np.int64(u[i, j])
            r = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
            q = (x >> 16) | 0x40
            out[i, j] = np.uint16((q if (x & 0x7FFFFFFF) > 0x7F800000 else r) & 0xFFFF)


@njit(parallel=True, cache=True)
def _round_rows(u, out):
    # as _to_bf16_rows, but the bf16 kept in the top half of a float32 (out: uint32 view)
    for i in prange(u.shape[0]):
        for j in range(u.shape[1]):
            x = np.int64(u[i, j])
            r = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
            q = (x >> 16) | 0x40
            out[i, j] = np.uint32(((q if (x & 0x7FFFFFFF) > 0x7F800000 else r) & 0xFFFF) << 16)


def is_bf16(x):
    """True for an operand already in bf16: uint16 bit patterns or ml_dtypes.bfloat16."""
    return x is not None and hasattr(x, "dtype") and (x.dtype == np.uint16 or x.dtype.name == "bfloat16")


def bits(x):
    """A bf16 operand as its uint16 bit patterns (a view, no copy)."""
    return x if x.dtype == np.uint16 else x.view(np.uint16)


def _convert(x, dtype, kernel, out=None):
    x = np.asarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype) if out is None else out    # (out: C-contiguous, x's shape)
    if x.size == 0:
        return out
    if x.ndim == 0 or x.strides[-1] != 4:
        x = np.ascontiguousarray(x)
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)   # a copy only if it must
    kernel(rows.view(np.uint32), out.reshape(rows.shape).view(np.uint16 if dtype == np.uint16 else np.uint32))
    return out


def to_bf16(x, out=None):
    """float32 array, any shape or strides -> new C-contiguous uint16 array of its
    bfloat16 bit patterns (round to nearest, ties to even); or into out (C-contiguous
    uint16 of x's shape)."""
    return _convert(x, np.uint16, _to_bf16_rows, out)


def round_values(x):
    """reference.round_to_bf16 in one parallel pass: float32 -> new C-contiguous float32
    array holding the nearest bf16 values (the same bits)."""
    return _convert(x, np.float32, _round_rows)


def from_bf16(b):
    """bf16 bit patterns (uint16 or ml_dtypes.bfloat16, numpy or cupy) -> float32, exact."""
    return (bits(b).astype("uint32") << 16).view("float32")


# ---------------------------------------------------------------------------
# the native library and the choice


def cpu_bf16_flags(path="/proc/cpuinfo"):
    """The bf16 dot-product flags of this CPU (a subset of CPU_FLAGS); () where the file
    is missing (not Linux): then no native path."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in CPU_FLAGS if flag in have)
    except OSError:
        pass
    return ()


_state = {"choice": None, "noted": False}


def mode():
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: valid values are {', '.join(MODES)}")
    return value


def _choose():
    # (onednn.Library or None, why not native or None)
    m = mode()
    if m == "emulate":
        return None, f"{ENV}=emulate"
    flags = cpu_bf16_flags()
    if not flags:
        why = "this CPU has no bf16 dot-product instructions (AVX512_BF16 or AMX-BF16)"
    else:
        lib, why = onednn.library()
        if lib is not None:
            return lib, None
    if m == "native":
        raise Bf16Unavailable(f"{ENV}=native, but {why}; unset {ENV} (or set it to emulate) to round the "
                              "operands to bf16 and run the float32 GEMM instead")
    return None, why


def native():
    """The native GEMM (onednn.Library), or None when bf16 GEMMs are emulated; chosen on the
    first call. In auto mode, the first emulated call says why, once."""
    if _state["choice"] is None:
        _state["choice"] = _choose()
    lib, why = _state["choice"]
    if lib is None and not _state["noted"] and mode() == "auto":
        _state["noted"] = True
        if threads.launcher_rank() == 0:
            print(f"note: bf16 GEMMs are emulated (operands rounded to bf16, float32 GEMM): {why}",
                  file=sys.stderr, flush=True)
    return lib


def reset():
    """Forget the choice (tests change the environment or the detection)."""
    _state["choice"], _state["noted"] = None, False


def describe():
    """One line: which bf16 GEMM this process runs, and why (it says what the first
    emulated call's note would: that note is not printed again)."""
    _state["noted"] = True
    try:
        lib = native()
    except Bf16Unavailable as exc:
        return f"bf16 GEMM: unavailable ({exc})"
    if lib is not None:
        return f"bf16 GEMM: native, {lib.describe()} dnnl_gemm_bf16bf16f32, on {'/'.join(cpu_bf16_flags())}"
    return f"bf16 GEMM: emulated (float32 operands rounded to bf16, float32 BLAS): {_state['choice'][1]}"


# ---------------------------------------------------------------------------
# the GEMM


def _operand(x, trans):
    """(bf16 bits whose matrices have unit column stride, trans): float32 is rounded
    (a transposed view is rounded as its base, flag flipped, so no transposing copy);
    a bf16 operand passes as it is where the library can read it."""
    if x.dtype == np.float32:
        if x.strides[-1] != 4 and x.strides[-2] == 4 and x.shape[-1] > 1:
            x, trans = x.swapaxes(-1, -2), not trans
        return to_bf16(x), trans
    x = bits(x)
    rows, cols = x.shape[-2:]
    if x.strides[-1] != 2 and cols > 1 and x.strides[-2] == 2:
        x, trans = x.swapaxes(-1, -2), not trans
        rows, cols = cols, rows
    row_ok = rows <= 1 or (x.strides[-2] % 2 == 0 and x.strides[-2] >= 2 * cols)
    if (x.strides[-1] != 2 and cols > 1) or not row_ok:
        x = np.ascontiguousarray(x)
    return x, trans


def emulated_matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False):
    """The fallback: the reference's numbers bit for bit (bf16 operands widened exactly,
    float32 ones rounded to bf16 values into C-contiguous copies, the float32 GEMM), the
    rounding in one Numba pass instead of numpy's several."""
    a, b = (from_bf16(x) if is_bf16(x) else round_values(x) for x in (a, b))
    return reference.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False):
    """C = op(a) @ op(b) with bf16 operands and float32 accumulation, as kernels.matmul:
    a, b float32 (rounded here) or bf16 bits, batch dims broadcast, out float32."""
    lib = native()
    if lib is None:
        return emulated_matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    a, ta = _operand(a, trans_a)
    b, tb = _operand(b, trans_b)
    return onednn.gemm(lib, lib.gemm, "dnnl_gemm_bf16bf16f32", a, ta, b, tb, out, accumulate,
                       f"set {ENV}=emulate to run the emulated GEMM")
