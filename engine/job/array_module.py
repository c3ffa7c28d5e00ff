"""Choosing the array module: numpy on the CPU, cupy on a CUDA GPU.

The GPU path is the same engine with `xp = cupy` and the CUDA kernels from
kernels/cuda registered for cupy arrays. Each rank takes GPU
local_rank % n_gpus. Asking for CUDA without CuPy or without a GPU is refused
with a message naming what is missing.
"""
from __future__ import annotations

import numpy as np

from ringpipe.engine.job.errors import ConfigError
from ringpipe.kernels import is_gpu_array


def select(device: str, local_rank: int = 0):
    """Return the array module for `device` ("cpu" or "cuda"), binding this rank's GPU."""
    if device == "cpu":
        return np
    if device != "cuda":
        raise ConfigError(f"unknown <device> {device!r}: use cpu or cuda")
    try:
        import cupy
    except ImportError:
        raise ConfigError("<device> cuda needs CuPy, which is not installed: pip install the wheel for "
                          "your driver's CUDA major (the 'CUDA Version' nvidia-smi shows): cupy-cuda12x or "
                          "cupy-cuda13x (pip install -e '.[gpu]' installs cupy-cuda12x); or use <device> cpu") from None
    try:
        n_gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:        # CUDARuntimeError when no driver / no device
        raise ConfigError(f"<device> cuda: CuPy is installed but sees no CUDA GPU ({e}); "
                          "check nvidia-smi and CUDA_VISIBLE_DEVICES, or use <device> cpu") from None
    if n_gpus < 1:
        raise ConfigError("<device> cuda: no CUDA GPU visible (check CUDA_VISIBLE_DEVICES), "
                          "or use <device> cpu")
    cupy.cuda.Device(local_rank % n_gpus).use()
    from ringpipe.kernels import cuda as kernels_cuda
    kernels_cuda.register()
    return cupy


def describe(xp) -> str:
    """Where this rank computes: 'CPU', or e.g. 'GPU 0 of 4 (NVIDIA H200)'."""
    if xp is np:
        return "CPU"
    dev = xp.cuda.Device().id
    try:
        name = xp.cuda.runtime.getDeviceProperties(dev)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"GPU {dev} of {xp.cuda.runtime.getDeviceCount()} ({name})"
    except Exception:             # only a name for the log: never fail a run over it
        return f"GPU {dev}"


def to_host(a):
    """A numpy array of `a` (a copy off the GPU for cupy arrays)."""
    return a.get() if is_gpu_array(a) else a

