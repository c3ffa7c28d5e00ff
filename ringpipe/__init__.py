"""ringpipe: a lean MPI training engine, one import namespace.

    ringpipe.kernels   compute on numpy/cupy arrays (no MPI, no model)
    ringpipe.comm      MPI collectives and failure containment (no model)
    ringpipe.engine    layers, models, optimizers, data, checkpoints, the trainer

The repository keeps one folder per package at its top (kernels/, comm/,
engine/); setup.py installs them under this name, so nothing else on a user's
machine (Jupyter's `comm`, Hugging Face's `kernels`) is shadowed.
"""
import os as _os

__version__ = "0.1.0"

# Run from a checkout that was never installed (a GPU machine with no pip, say:
# benchmarks/gpu_check.sh), ringpipe.engine must still be <checkout>/engine, as
# setup.py's package_dir maps it: the subpackages sit beside this folder. An
# install (editable or not) maps them itself; this only adds the checkout.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "setup.py")) and _os.path.isdir(_os.path.join(_checkout, "engine")):
    __path__.append(_checkout)

# Before anything of ringpipe loads numpy, BLAS or Numba (they read their thread counts
# once, at load): every entry point gets the same thread defaults, a user's settings win
# (ringpipe/threads.py says which and why).
from ringpipe import threads as _threads  # noqa: E402

_threads.apply_defaults()
