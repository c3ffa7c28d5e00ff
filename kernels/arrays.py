"""Which array module an array belongs to: numpy, or cupy for a GPU array.

A leaf of kernels/: the backends (reference.py, written against `xp`) and the dispatch
that chooses between them (backend.py) both ask it, so a backend never imports the
module that dispatches to it. This module never imports cupy unless an input already is
a cupy array.
"""

import numpy as np


def is_gpu_array(x):
    """True for a cupy array: the one test of "GPU array" in kernels/, what dispatch
    sends to the GPU backends. By module name, so cupy is never imported just to ask.
    (Numba device arrays are not GPU arrays here: kernels never dispatch on them.)"""
    return type(x).__module__.startswith("cupy")


def get_array_module(*arrays):
    """cupy if any argument is a cupy array, else numpy. None arguments are ignored."""
    for x in arrays:
        if x is not None and is_gpu_array(x):
            import cupy  # only reachable when a cupy array already exists

            return cupy
    return np
