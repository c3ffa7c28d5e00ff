"""
kernels.cuda: GPU implementations of the kernels/ ops, for cupy arrays.

  register()   fill kernels.backend's GPU dispatch table (call once, e.g. when a run
               starts with --device cuda). Cheap: it imports neither cupy nor numba;
               each entry imports its implementation on first call.
  available()  (ok, reason): is there a cupy that sees a GPU?

Backend names registered (kernels.set_backend / backend=), for cupy inputs:
  "cuda"        the CUDA C kernels in this folder (kernels/cuda/cupy_kernels.py):
                float32 SGEMM, fused layernorm / softmax / cross-entropy / GELU / AdamW;
                float64 GEMMs go to cuBLAS. The default for cupy arrays.
  "cublas"      matmul through cupy.matmul (cuBLAS), linear_forward as cuBLAS + bias
                + our GELU kernel, everything else as "cuda": the yardstick for the
                hand-written GEMM in a training run
  "numba_cuda"  the Numba CUDA kernels (kernels/cuda/numba_kernels.py) for every op
                they cover (unimplemented ones, e.g. linear_forward, fall back to "cuda")
numpy inputs keep running on the CPU kernels whatever the name (kernels/backend.py).
"""

from importlib import import_module

_registered = False


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


def _lazy(module, name):
    """A dispatch entry that imports kernels.cuda.<module> (and so cupy / numba.cuda)
    on first call, then forwards."""
    target = {}

    def call(*args, **kwargs):
        fn = target.get("fn")
        if fn is None:
            fn = target["fn"] = getattr(import_module(f"{__name__}.{module}"), name)
        return fn(*args, **kwargs)

    call.__name__ = f"{module}.{name}"
    call.__qualname__ = call.__name__
    return call


def _cublas_matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32"):
    # xp.matmul on cupy arrays = cuBLAS; bf16 = cuBLAS's float32 GEMM on bf16-rounded inputs
    from .. import reference

    return reference.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate,
                            precision=precision)


def _cublas_linear_forward(x, w, bias=None, *, gelu=False, precision="float32"):
    # unfused: the cuBLAS GEMM, then bias and our GELU kernel
    from .. import reference
    from .cupy_kernels import gelu_forward

    return reference.bias_gelu(_cublas_matmul(x, w, trans_b=True, precision=precision), bias, gelu, gelu_forward)


# the ops of each kernel set (kept here so register() imports neither module); a
# Linear layer's forward under numba_cuda is the "cuda" one (its GEMM epilogues)
_CUPY_OPS = (
    "matmul", "linear_forward", "column_sum", "layernorm_forward", "layernorm_backward", "gelu_forward",
    "gelu_backward", "softmax_causal_forward", "softmax_causal_backward", "cross_entropy_forward_backward",
    "adamw_update", "sgd_momentum_update", "sum_of_squares",
)
_NUMBA_OPS = tuple(op for op in _CUPY_OPS if op != "linear_forward")


def register():
    """Install the GPU implementations in kernels.backend (idempotent)."""
    global _registered
    from .. import backend as kb

    for op in _CUPY_OPS:
        kb.register_gpu_impl(op, _lazy("cupy_kernels", op), backend_name="cuda")
    kb.register_gpu_impl("matmul", _cublas_matmul, backend_name="cublas", default=False)
    kb.register_gpu_impl("linear_forward", _cublas_linear_forward, backend_name="cublas", default=False)
    for op in _NUMBA_OPS:
        kb.register_gpu_impl(op, _lazy("numba_kernels", op), backend_name="numba_cuda", default=False)
    _registered = True


def is_registered():
    return _registered
