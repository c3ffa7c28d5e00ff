"""
kernels: the compute ops of ringpipe. Pure compute, no MPI, no model knowledge.

The ops are listed once, in the op table of kernels/ops.py (name, what it computes, the
arguments its implementations take). Each public function (kernels/_api.py, imported
below) validates its inputs at the boundary (cheap metadata checks, the same for numpy
and cupy), then dispatches through the table (kernels/backend.py) on the array module
of its inputs and on the backend (`backend=` per call, else kernels.set_backend's default):
  "numba"   fast CPU kernels (kernels/cpu.py), the default for numpy arrays
  "numpy"   the plain reference implementations (kernels/reference.py), any device
  "cuda"    the CUDA C kernels (kernels/cuda/cupy_kernels.py + *.cu): the one
            production GPU path, the default for cupy arrays
  "cublas", "numba_cuda"  opt-in GPU alternatives for comparison and teaching
The GPU backends exist once kernels.cuda.register() has run (the engine calls it for
--device cuda); kernels/cuda/__init__.py says why the Numba CUDA kernels stay as an
opt-in backend rather than a second production path.

GEMMs (matmul, matmul_nt, matmul_tn, linear_forward) also take `precision=` (per
call, else kernels.set_matmul_precision's default): "float32", or "bf16" for float32
operands rounded to bfloat16 with float32 accumulation (tensor cores on the GPU; on
the CPU oneDNN's bf16 GEMM where the CPU has bf16 dot products, else an exact
emulation: kernels/bf16.py, RINGPIPE_BF16_GEMM). Operands already in bf16 (uint16 bit
patterns from to_bf16, or ml_dtypes.bfloat16) run the bf16 GEMM with no rounding
pass. The layers never pass precision: the default decides.
matmul_nt and matmul_tn are matmul with a transpose flag, not ops of their own.

Conventions shared by all ops:
  - arrays are C-contiguous (inputs that are not get a contiguous copy; outputs
    that are not are rejected, since writes into a copy would be lost)
  - float32 or float64, one dtype per call
  - "accumulate" outputs are parameter gradients and are added into (+=);
    activation gradients (dx, dlogits, ...) are overwritten

How to add a kernel op:
  1. Add an Op to OPS in kernels/ops.py: its name, what it computes, and the
     arguments the implementations take (the public ones minus `backend=`, with
     `precision` already resolved).
  2. Implement it, as a top-level function of that name taking exactly those
     arguments, in every backend that claims the whole table: kernels/reference.py
     (the ground truth, written against `xp`), kernels/cpu.py (Numba, or an alias of
     the reference where numpy/BLAS is already the fast path) and
     kernels/cuda/cupy_kernels.py (CUDA C). The Numba CUDA backend
     (kernels/cuda/numba_kernels.py) claims every op but those in
     kernels.cuda.NUMBA_CUDA_LEAVES_OUT: implement it there too, or add it to that
     tuple (it then runs on "cuda"). kernels/cuda/cublas.py has only the GEMMs.
  3. Add the public function in kernels/_api.py: validate with its helpers, then
     `impl = _dispatch(op, arrays, backend)` and call impl; import it below and list
     it in __all__.
  4. Tests: tests/kernels/test_kernels.py iterates the table (a public function for
     every op, reference and Numba implementations with the table's arguments) and
     needs a numba-vs-reference test of the numbers; tests/kernels/test_cuda_kernels.py
     checks the GPU backends define what they claim (no GPU needed) and needs a
     test_gpu_* test, which the CPU emulation of the CUDA C runs here too.

float32 GEMMs on the CPU run numpy's BLAS or oneDNN's sgemm, whichever a short calibration
found faster on this host (cached per host; RINGPIPE_SGEMM=blas|onednn forces one;
float32_gemm() says which and why): kernels/sgemm.py.

Importing this package does not import numba or cupy; numba loads on the first
"numba" call and compiles (or loads from its on-disk cache) per dtype.

Threads: importing ringpipe splits the cores this process may use (affinity, cgroup
quota) among the node's ranks for BLAS and Numba, with passive OpenMP waiting, unless
the user set OMP_NUM_THREADS, NUMBA_NUM_THREADS, ... or numba.set_num_threads first
(ringpipe/threads.py). set_num_threads changes the Numba count afterwards.
"""

if __name__ == "kernels":
    # Python started in the checkout's root found this folder as the top-level `kernels`, the
    # name of Hugging Face's package (transformers imports it): that one takes the name, and
    # nothing of ringpipe's runs (ringpipe/_shadowing.py).
    import os
    import runpy

    _shadowing = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), "ringpipe", "_shadowing.py"))
    _shadowing["step_aside"](__name__, __file__)
else:
    from ringpipe import threads

    from ._api import (
        KernelDtypeError,
        adamw_update,
        bf16_gemm,
        column_sum,
        cross_entropy_forward_backward,
        float32_gemm,
        float32_gemm_choice,
        from_bf16,
        gelu_backward,
        gelu_forward,
        layernorm_backward,
        layernorm_forward,
        linear_forward,
        matmul,
        matmul_nt,
        matmul_tn,
        rmsnorm_backward,
        rmsnorm_forward,
        rope_backward,
        rope_forward,
        sgd_momentum_update,
        softmax_causal_backward,
        softmax_causal_forward,
        sum_of_squares,
        swiglu_backward,
        swiglu_forward,
        to_bf16,
        use_float32_gemm,
    )
    from .backend import (  # noqa: F401 (_dispatch and resolve_matmul_precision: as before the ops moved)
        DTYPES,
        MATMUL_PRECISIONS,
        _dispatch,
        get_array_module,
        get_backend,
        get_matmul_precision,
        get_num_threads,
        is_gpu_array,
        resolve_dtype,
        resolve_matmul_precision,
        set_backend,
        set_matmul_precision,
        set_num_threads,
    )
    from .reference import round_to_bf16
    from .rope import rope_tables

    # Importing ringpipe set the thread defaults before numpy loaded (ringpipe/threads.py). A
    # user's own code hears once, on rank 0, when its ranks and threads outnumber the cores;
    # the trainer says it in its start-up report instead.
    threads.warn_once()

    __all__ = [
        "DTYPES", "KernelDtypeError", "get_array_module", "get_backend", "is_gpu_array", "resolve_dtype",
        "set_backend", "set_num_threads", "get_num_threads",
        "MATMUL_PRECISIONS", "set_matmul_precision", "get_matmul_precision", "round_to_bf16",
        "to_bf16", "from_bf16", "bf16_gemm", "float32_gemm", "float32_gemm_choice", "use_float32_gemm",
        "matmul", "matmul_nt", "matmul_tn", "linear_forward", "column_sum",
        "layernorm_forward", "layernorm_backward",
        "gelu_forward", "gelu_backward",
        "softmax_causal_forward", "softmax_causal_backward",
        "cross_entropy_forward_backward",
        "adamw_update", "sgd_momentum_update", "sum_of_squares",
        "rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "rope_tables",
        "swiglu_forward", "swiglu_backward",
    ]
