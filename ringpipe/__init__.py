"""ringpipe: a lean MPI training engine, one import namespace.

    ringpipe.kernels   compute on numpy/cupy arrays (no MPI, no model)
    ringpipe.comm      MPI collectives and failure containment (no model)
    ringpipe.engine    layers, models, optimizers, data, checkpoints, the trainer

The repository keeps one folder per package at its top (kernels/, comm/,
engine/); setup.py installs them under this name, so nothing else on a user's
machine (Jupyter's `comm`, Hugging Face's `kernels`) is shadowed. Python started in the
checkout's root finds the folders themselves under those names: they step aside there
(ringpipe/_shadowing.py).
"""
__version__ = "0.1.0"

# The package is what setup.py installs (pip install -e . for a checkout), nothing more: a
# checkout that cannot be installed gets the same package from benchmarks/package_view.py.

# Before anything of ringpipe loads numpy, BLAS or Numba (they read their thread counts
# once, at load): every entry point gets the same thread defaults, a user's settings win
# (ringpipe/threads.py says which and why).
from ringpipe import threads as _threads

_threads.apply_defaults()
