"""Device (GPU) arrays and MPI: pass the device buffer, or stage it through pinned host memory.

A CUDA-aware MPI reads and writes GPU memory itself, so it gets the device
array (mpi4py takes anything with __cuda_array_interface__). Any other MPI
gets a copy in pinned (page-locked) host memory: the copy engine DMAs from it
directly, where pageable memory would take an extra bounce.

Either way the stream is synchronized before MPI touches the buffer: MPI
knows nothing of kernels still queued to write it (or, for fresh memory from
CuPy's pool, still using it).

Which path: RINGPIPE_CUDA_AWARE_MPI=1 (direct) or 0 (staged) decides;
unset or "auto" asks the MPI library (MPIX_Query_cuda_support, exported by
MPICH and Open MPI builds with CUDA), and also takes the variables with which
Cray MPICH (MPICH_GPU_SUPPORT_ENABLED=1) and MVAPICH2-GDR (MV2_USE_CUDA=1)
users switch GPU support on, since those libraries may not answer the query.
Ranks may even differ: MPI moves the same bytes from either kind of memory,
so the results do not change.

Host (numpy) arrays pass through untouched; nothing here imports cupy
unless a device array shows up.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .settings import ENV_CUDA_AWARE, cuda_aware_choice

__all__ = ["ENV_CUDA_AWARE", "GPU_SUPPORT_VARIABLES", "stats", "is_device_array", "query_library",
           "enabled_by_environment", "cuda_aware", "synchronize",
           "record_event", "use_own_stream", "empty_for_mpi", "array_ops", "to_pinned", "copy_back", "Transport"]

# The MPI libraries' own switches for GPU memory (Cray MPICH, MVAPICH2-GDR).
GPU_SUPPORT_VARIABLES = ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA")

# Bytes copied between device and host for MPI, for the run summary and the tests.
stats = {"staged_bytes": 0}

_decided: bool | None = None


def is_device_array(a) -> bool:
    """Is `a` in GPU memory? What mpi4py goes by too. comm's one test for it."""
    return hasattr(a, "__cuda_array_interface__")


def query_library() -> bool:
    """Does the loaded MPI library say it is CUDA-aware? False when it cannot tell."""
    from mpi4py import MPI

    try:
        # dlsym through mpi4py's extension module also searches the libmpi it links.
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    fn.restype = ctypes.c_int
    return bool(fn())


def enabled_by_environment() -> str | None:
    """'VAR=1' when one of GPU_SUPPORT_VARIABLES switches the MPI's GPU support on, else None."""
    for var in GPU_SUPPORT_VARIABLES:
        if os.environ.get(var, "").strip() == "1":
            return f"{var}=1"
    return None


def cuda_aware() -> bool:
    """Pass device buffers straight to MPI? Decided once per process (see module doc)."""
    global _decided
    if _decided is None:
        # Parsed where comm's other variables are (comm/settings.py), with the same refusal.
        choice = cuda_aware_choice(os.environ.get(ENV_CUDA_AWARE, "auto"))
        if choice is None:
            choice = query_library() or enabled_by_environment() is not None
        _decided = choice
    return _decided


def _reset_decision() -> None:
    """Forget the cached decision (tests change the environment)."""
    global _decided
    _decided = None


def synchronize(a=None) -> None:
    """Wait for the kernels queued on this thread's current stream (before MPI
    reads or writes a device buffer those kernels touch). Work queued by another
    thread is that thread's to hand over: GradBuckets records an event."""
    if a is None or is_device_array(a):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def record_event():
    """A CUDA event marking the work queued so far on this thread's stream, for
    another thread to wait on (event.synchronize())."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record()
    return event


def use_own_stream():
    """Give the calling thread its own non-blocking stream (returned: keep it alive),
    so its kernels neither wait for nor hold up the main thread's."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    return stream


def empty_for_mpi(xp, shape, dtype):
    """Memory MPI may write into. On the device, CuPy's pool hands out a block as
    soon as Python drops it, possibly while queued kernels still use it; they are
    ordered after each other on the stream, but MPI is not, so wait for them."""
    buf = xp.empty(shape, dtype=dtype)
    if is_device_array(buf):
        synchronize(buf)
    return buf


def array_ops(flat, ufunc=None):
    """(array module, ufunc, sync) for reducing into `flat` with the numpy ufunc
    `ufunc` (or None): on the host (numpy, ufunc, None); for a device array cupy
    and its ufunc of the same name, which run on the GPU, and synchronize, to
    call after a reduction and before MPI sends its result."""
    if not is_device_array(flat):
        return np, ufunc, None
    import cupy

    return cupy, (getattr(cupy, ufunc.__name__) if ufunc is not None else None), synchronize


def _pinned_empty(shape, dtype):
    import cupyx

    return cupyx.empty_pinned(shape, dtype=dtype)


def to_pinned(a):
    """A copy of device array `a` in pinned host memory, complete on return."""
    synchronize(a)                  # get() only waits by itself on the legacy default stream
    host = _pinned_empty(a.shape, a.dtype)
    a.get(out=host)
    stats["staged_bytes"] += a.nbytes
    return host


def copy_back(a, host) -> None:
    """Device array `a` = the staged host copy `host` (after MPI changed it),
    complete on return, so `host` may be freed or reused."""
    a.set(host.reshape(a.shape))
    synchronize(a)
    stats["staged_bytes"] += host.nbytes


class Transport:
    """How this process hands arrays of one array module to MPI.

    xp is numpy (host arrays go as they are) or cupy (device arrays go
    directly when cuda_aware(), else through pinned host copies).
    """

    def __init__(self, xp):
        self.xp = xp
        self.device = xp is not np
        # Asked on the CPU too: a bad RINGPIPE_CUDA_AWARE_MPI is refused wherever it is set.
        self.direct = cuda_aware() and self.device

    def describe(self) -> str:
        if not self.device:
            return "host memory"
        if self.direct and not query_library():
            switch = enabled_by_environment()
            if switch:
                return f"device buffers straight to MPI ({switch} switches its GPU support on)"
            return (f"device buffers straight to MPI, as {ENV_CUDA_AWARE}=1 says, although the MPI library "
                    f"does not report CUDA support (MPIX_Query_cuda_support): if it cannot read GPU memory, "
                    f"set {ENV_CUDA_AWARE}=0")
        if self.direct:
            return "device buffers straight to MPI (CUDA-aware MPI)"
        return (f"staged through pinned host memory (MPI is not CUDA-aware; "
                f"set {ENV_CUDA_AWARE}=1 if yours is)")

    def send_buffer(self, a):
        """A contiguous buffer holding a's values that MPI may read until the send completes."""
        a = self.xp.ascontiguousarray(a)
        if not self.device:
            return a
        if self.direct:
            synchronize(a)
            return a
        return to_pinned(a)

    def recv_buffer(self, shape, dtype):
        """Memory for MPI to receive into; pass it to received() once the receive completed."""
        if self.direct:
            return empty_for_mpi(self.xp, shape, dtype)
        return _pinned_empty(shape, dtype) if self.device else np.empty(shape, dtype)

    def received(self, buf):
        """The array of this module holding a completed receive."""
        if not self.device or self.direct:
            return buf
        dev = self.xp.empty(buf.shape, buf.dtype)
        copy_back(dev, buf)         # straight from pinned memory (asarray would copy it once more)
        return dev

    def in_place(self, a, mpi_call) -> None:
        """Run mpi_call(buf) on a buffer MPI may use in place of `a`, then make `a` hold the result."""
        if not self.device:
            mpi_call(a)
        elif self.direct:
            synchronize(a)
            mpi_call(a)
        else:
            host = to_pinned(a)
            mpi_call(host)
            copy_back(a, host)
