"""
Array-module detection and backend dispatch for kernels/.

Two independent choices decide which code runs for a kernel call:
  - the array module of the inputs (numpy, or cupy for GPU arrays), and
  - the backend name (per call `backend=`, else the module default):
      "numpy"  the plain reference implementations (kernels/reference.py); they are
               written against `xp`, so they also run on cupy arrays
      "numba"  the fast CPU kernels (kernels/cpu.py); the default
      other    names registered by kernels/cuda (e.g. "cuda"): fast GPU kernels

Rule: "numpy" always means the reference. Any other name means "the fast path for
the device the arrays live on": numba for numpy arrays, _GPU_IMPL for cupy arrays.
So set_backend("cuda") on a GPU run still leaves stray host-side calls on numba.

This module never imports cupy unless an input already is a cupy array.
"""

import numpy as np

DTYPES = {"float32": np.float32, "float64": np.float64}

# Backend names accepted by set_backend / backend=. kernels/cuda adds its own via
# register_gpu_impl(..., backend_name="cuda").
_BACKENDS = {"numba", "numpy"}
_default_backend = "numba"

# The GPU dispatch point: kernel name (e.g. "layernorm_forward") -> callable with the
# same positional/keyword signature as the public function in kernels/__init__.py,
# minus `backend`. Inputs are already validated (shapes, dtypes, contiguity).
# kernels/cuda fills this in; until a name is present, cupy inputs raise.
_GPU_IMPL = {}
# Per-backend overrides for cupy inputs: (backend_name, kernel_name) -> callable, tried
# before _GPU_IMPL (e.g. backend="cublas" swaps only matmul). Filled by
# register_gpu_impl(..., default=False).
_GPU_IMPL_BY_BACKEND = {}


def is_gpu_array(x):
    # by module name, so we never import cupy just to ask
    return type(x).__module__.startswith("cupy")


def get_array_module(*arrays):
    """cupy if any argument is a cupy array, else numpy. None arguments are ignored."""
    for x in arrays:
        if x is not None and is_gpu_array(x):
            import cupy  # only reachable when a cupy array already exists

            return cupy
    return np


def resolve_dtype(name):
    """'float32' / 'float64' (or the numpy dtype itself) -> numpy scalar type."""
    if isinstance(name, str):
        if name in DTYPES:
            return DTYPES[name]
    else:
        for t in DTYPES.values():
            try:
                if np.dtype(name) == np.dtype(t):
                    return t
            except TypeError:
                break
    raise ValueError(f"unknown dtype {name!r}; valid names: {', '.join(sorted(DTYPES))}")


def _check_backend_name(name):
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; valid names: {', '.join(sorted(_BACKENDS))}")
    return name


def set_backend(name):
    """Set the module-wide default backend ("numba" or "numpy", plus GPU names once registered)."""
    global _default_backend
    _default_backend = _check_backend_name(name)


def get_backend():
    return _default_backend


# GEMM precision for float32 operands (per call `precision=`, else this default), like
# torch.set_float32_matmul_precision: "bf16" rounds both inputs to bfloat16 and
# accumulates in float32 (tensor cores on the GPU); float32 master weights stay as they are.
MATMUL_PRECISIONS = ("float32", "bf16")
_default_precision = "float32"


def resolve_matmul_precision(name=None):
    """None -> the module default; a valid name -> itself; anything else -> ValueError."""
    if name is None:
        return _default_precision
    if not isinstance(name, str) or name not in MATMUL_PRECISIONS:
        raise ValueError(f"unknown matmul precision {name!r}; valid names: {', '.join(MATMUL_PRECISIONS)}")
    return name


def set_matmul_precision(name):
    """Set the module-wide default precision of matmul / matmul_nt / matmul_tn / linear_forward."""
    global _default_precision
    _default_precision = resolve_matmul_precision(name)


def get_matmul_precision():
    return _default_precision


def register_gpu_impl(kernel_name, fn, backend_name="cuda", default=True):
    """Called by kernels/cuda: route cupy inputs of `kernel_name` to `fn`. default=False
    registers `fn` only for backend=backend_name (other GPU names keep _GPU_IMPL)."""
    if default:
        _GPU_IMPL[kernel_name] = fn
    else:
        _GPU_IMPL_BY_BACKEND[(backend_name, kernel_name)] = fn
    _BACKENDS.add(backend_name)


def set_num_threads(n):
    """Threads for the numba CPU kernels in this process. Under MPI give each rank
    cores_per_node // ranks_per_node: the default (all cores, in every rank)
    oversubscribes the node and OpenMP's spin-waiting makes that very slow."""
    import numba

    numba.set_num_threads(int(n))


def get_num_threads():
    import numba

    return numba.get_num_threads()


_cpu_module = None


def _cpu():
    # numba import + cache load is the slow part of `import kernels`; defer it to first use
    global _cpu_module
    if _cpu_module is None:
        from . import cpu

        _cpu_module = cpu
    return _cpu_module


def _dispatch(name, arrays, backend=None):
    """Return the implementation of kernel `name` for these input arrays and backend."""
    backend = _default_backend if backend is None else _check_backend_name(backend)
    if backend == "numpy":
        from . import reference

        return getattr(reference, name)
    if any(x is not None and is_gpu_array(x) for x in arrays):
        fn = _GPU_IMPL_BY_BACKEND.get((backend, name)) or _GPU_IMPL.get(name)
        if fn is None:
            raise NotImplementedError(
                f"kernels.{name}: no GPU implementation registered for cupy arrays yet "
                f"(kernels/cuda registers them in kernels.backend._GPU_IMPL); "
                f"pass backend='numpy' to run the reference implementation on cupy"
            )
        return fn
    return getattr(_cpu(), name)
