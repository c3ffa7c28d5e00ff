"""
The backend registry and dispatch for kernels/ (the array module of the inputs: arrays.py).

Two independent choices decide which code runs for a kernel call:
  - the array module of the inputs (numpy, or cupy for GPU arrays), and
  - the backend name (per call `backend=`, else the module default, set_backend).

A backend is a module whose top-level functions, named after the ops of the table in
kernels/ops.py, implement them. Registered here on import:
  "numpy"  kernels/reference.py, the plain reference implementations; written against
           `xp`, so they run on numpy and cupy arrays alike
  "numba"  kernels/cpu.py, the fast CPU kernels: the default, and the one host backend
and by kernels.cuda.register(), for cupy arrays (see kernels/cuda/__init__.py):
  "cuda"        the CUDA C kernels: the production GPU path, what cupy arrays run on
  "cublas"      cuBLAS GEMMs, the rest as "cuda" (a yardstick)
  "numba_cuda"  the Numba CUDA kernels, opt-in only

Rule: "numpy" always means the reference. Any other name means "the fast path for the
device the arrays live on": "numba" for numpy arrays; for cupy arrays the named backend
if it is a GPU one, else "cuda" (GPU_DEFAULT). So set_backend("cuda") on a GPU run still
leaves stray host-side calls on numba, and no name but "numpy" moves cupy arrays off
the GPU kernels.

A backend implements every op in the table, or names a fallback backend that runs the
ones it leaves out ("cublas" and "numba_cuda" fall back to "cuda"). register_backend
checks the op names against the table when it is called; the module is imported on the
first call dispatched to it (numba and cupy are slow to import), and then every op it
claims must be there, taking the table's arguments (RegistrationError otherwise).
tests/kernels check both for every backend without a GPU.

This module never imports cupy unless an input already is a cupy array.
"""

import importlib
from typing import NamedTuple

import numpy as np

from .arrays import get_array_module, is_gpu_array  # noqa: F401 (get_array_module: callers ask here too)
from .ops import BY_NAME, OP_NAMES, signature_problem

DTYPES = {"float32": np.float32, "float64": np.float64}


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


# ---------------------------------------------------------------------------
# the backend registry


class RegistrationError(Exception):
    """A backend claims an op the table does not have, leaves one out with no fallback,
    or its module does not define an op it claims with the table's arguments."""


class Backend(NamedTuple):
    name: str
    module: str  # import path; its functions named after ops implement them
    device: str  # "cpu" (numpy arrays), "gpu" (cupy arrays) or "any" (the xp-generic reference)
    ops: frozenset  # the op names it implements
    fallback: str | None  # the backend that runs the ops it leaves out; None: it has them all


DEVICES = ("any", "cpu", "gpu")
# The backend a non-"numpy" name resolves to when it does not fit the arrays' device.
CPU_DEFAULT = "numba"
# The production GPU path, named here only: the CUDA C kernels (kernels/cuda/cupy_kernels.py)
# register under this name, the other GPU backends fall back to it, and cupy arrays run
# on it unless a GPU backend is asked for by name (tests/kernels/gpu_op_table.py checks
# every GPU backend against the reference, op by op).
GPU_DEFAULT = "cuda"

_BACKENDS = {}  # name -> Backend
_LOADED = {}  # name -> {op name: function}, filled on the first call dispatched to it
_default_backend = CPU_DEFAULT


def register_backend(name, module, *, device, ops=None, fallback=None):
    """Declare backend `name`: the functions of `module` (an import path, imported on the
    first call dispatched to it) named after ops implement them.

    ops: the op names it implements, None for the whole table. A backend that leaves
    ops out names a fallback: a registered backend with every op, for the same device
    (or "any"). Registering a name again replaces it."""
    if device not in DEVICES:
        raise RegistrationError(f"kernel backend {name!r}: device must be one of {', '.join(DEVICES)}, "
                                f"got {device!r}")
    claimed = OP_NAMES if ops is None else tuple(ops)
    unknown = [op for op in claimed if op not in BY_NAME]
    if unknown:
        raise RegistrationError(f"kernel backend {name!r}: {', '.join(unknown)} not in the op table "
                                "(kernels/ops.py)")
    left_out = [op for op in OP_NAMES if op not in claimed]
    if fallback is None and left_out:
        raise RegistrationError(f"kernel backend {name!r} leaves out {', '.join(left_out)} and names no "
                                "fallback backend to run them")
    if fallback is not None:
        fb = _BACKENDS.get(fallback)
        if fb is None or fb.fallback is not None or fb.device not in (device, "any"):
            raise RegistrationError(f"kernel backend {name!r}: fallback {fallback!r} must be a registered "
                                    f"backend with every op, for {device} arrays")
    _BACKENDS[name] = Backend(name, module, device, frozenset(claimed), fallback)
    _LOADED.pop(name, None)


def load_backend(name):
    """Import backend `name`'s module and return {op name: its function}, checking that
    every op it claims is defined there with the table's arguments. _dispatch calls this
    on first use; tests call it to check a backend without running anything."""
    b = _BACKENDS[name]
    module = importlib.import_module(b.module)
    impls, problems = {}, []
    for op in OP_NAMES:
        if op not in b.ops:
            continue
        fn = getattr(module, op, None)
        if not callable(fn):
            problems.append(f"{op} is not defined there")
            continue
        problem = signature_problem(BY_NAME[op], fn)
        if problem:
            problems.append(problem)
        impls[op] = fn
    if problems:
        raise RegistrationError(f"kernel backend {name!r} (module {b.module}): " + "; ".join(problems))
    _LOADED[name] = impls
    return impls


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


def gpu_backend_for(name, backend):
    """The backend that runs op `name` on cupy arrays when `backend` (a registered name,
    not "numpy") is asked for: a GPU backend itself, any other name GPU_DEFAULT; then
    that backend's fallback if it leaves the op out."""
    b = _BACKENDS[backend]
    if b.device != "gpu":
        b = _BACKENDS.get(GPU_DEFAULT)
        if b is None:
            raise NotImplementedError(
                f"kernels.{name}: no GPU backend registered for cupy arrays yet "
                f"(kernels.cuda.register() registers them); "
                f"pass backend='numpy' to run the reference implementation on cupy"
            )
    return b.name if name in b.ops else b.fallback


def _impl(backend, name):
    impls = _LOADED.get(backend)
    if impls is None:
        impls = load_backend(backend)
    return impls[name]


def _dispatch(name, arrays, backend=None):
    """Return the implementation of op `name` for these input arrays and backend."""
    backend = _default_backend if backend is None else _check_backend_name(backend)
    if backend == "numpy":
        return _impl("numpy", name)
    for x in arrays:
        if x is not None and is_gpu_array(x):
            return _impl(gpu_backend_for(name, backend), name)
    return _impl(CPU_DEFAULT, name)


# the two backends every process has; kernels.cuda.register() adds the GPU ones
register_backend("numpy", f"{__package__}.reference", device="any")
register_backend("numba", f"{__package__}.cpu", device="cpu")


# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# numba threads


def set_num_threads(n):
    """Threads for the numba CPU kernels (and oneDNN's GEMMs, bf16 and float32, for calls
    from this thread) in this process. Under MPI give each rank
    cores_per_node // ranks_per_node: the default (all cores, in every rank)
    oversubscribes the node and OpenMP's spin-waiting makes that very slow."""
    import numba

    numba.set_num_threads(int(n))
    from . import onednn   # oneDNN's GEMMs run on OpenMP threads of their own

    onednn.set_num_threads(int(n))


def get_num_threads():
    import numba

    return numba.get_num_threads()
