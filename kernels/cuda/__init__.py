"""
kernels.cuda: GPU implementations of the ops in the kernels/ op table, for cupy arrays.

  register()   register the GPU backends with kernels.backend (call once, e.g. when a
               run starts with --device cuda). Cheap: it imports neither cupy nor
               numba; each backend's module is imported on the first call sent to it.
  available()  (ok, reason): is there a cupy that sees a GPU?

Backends registered (kernels.set_backend / backend=), for cupy inputs:
  "cuda"        the CUDA C kernels in this folder (cupy_kernels.py + sgemm.cu,
                wmma_gemm.cu, fused.cu): float32 SGEMM, bf16 tensor-core GEMM, fused
                layernorm / softmax / cross-entropy / GELU / AdamW; float64 GEMMs go
                to cuBLAS. Every op of the table. THE production GPU path: the default
                for cupy arrays, what ringpipe train --device cuda runs
                (kernels.backend.GPU_DEFAULT names it, the one place that does).
  "cublas"      cublas.py: matmul through cupy.matmul (cuBLAS), linear_forward as
                cuBLAS + bias + our GELU kernel, every other op as "cuda": the
                yardstick for the hand-written GEMM in a training run
  "numba_cuda"  numba_kernels.py: the Numba CUDA kernels, every op but linear_forward
                (which falls back to "cuda"). Opt-in only.
numpy inputs keep running on the CPU kernels whatever the name (kernels/backend.py).

Why the Numba CUDA twin stays, and stays opt-in. It duplicates the CUDA C kernels op
for op, which is a cost: two GPU implementations to keep in step. It earns its place
because it is the only GPU code that runs, and is checked against the reference,
with no GPU at all (Numba's CUDA simulator, tests/support/cuda_sim_check.py, with
planted-bug checks), and it is the readable first rung of the kernel ladder
(benchmarks/gemm.py's "numba tiled" row sits under the tuned SGEMM and cuBLAS). A
separate ladder folder outside the installed package (as llm.c keeps dev/cuda) would
need setup.py to leave it out and the tests to find it elsewhere; registering it from
the same op table instead means it cannot drift from the op names and arguments the
production kernels implement (tests/kernels check both registrations without a GPU).
It is never a second production path: nothing selects it by default, so a training
run on cupy arrays always runs "cuda" unless asked otherwise, and the tests say so.
"""

def available():
    """(True, description) if cupy imports and sees a CUDA device, else (False, why)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return False, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"cupy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    if n < 1:
        return False, "cupy sees no CUDA device"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return True, f"{n} device(s), current: {name} (cc {props['major']}.{props['minor']})"
    except Exception:
        return True, f"{n} device(s)"


# The ops the Numba CUDA backend leaves to "cuda": a Linear layer's forward is the
# "cuda" one (its fused GEMM epilogues). A new op in the table is claimed by
# numba_cuda unless listed here, so the twin cannot silently fall behind.
NUMBA_CUDA_LEAVES_OUT = ("linear_forward",)
# cublas swaps only the GEMMs
CUBLAS_OPS = ("matmul", "linear_forward")


def register():
    """Register the GPU backends with kernels.backend (idempotent). The op names each
    claims are checked against the table now; the modules load on first use."""
    from .. import backend as kb
    from ..ops import OP_NAMES

    production = kb.GPU_DEFAULT         # "cuda": the CUDA C kernels
    kb.register_backend(production, f"{__name__}.cupy_kernels", device="gpu")
    kb.register_backend("cublas", f"{__name__}.cublas", device="gpu", ops=CUBLAS_OPS, fallback=production)
    kb.register_backend("numba_cuda", f"{__name__}.numba_kernels", device="gpu",
                        ops=[op for op in OP_NAMES if op not in NUMBA_CUDA_LEAVES_OUT], fallback=production)
