"""What must be settled before MPI_Init: the launcher and the MPI library are
fixed once MPI starts, so this runs when `ringpipe.comm` is first imported,
before any `from mpi4py import MPI` (which initializes MPI).

One case today: the `mpich` wheel from PyPI started by `srun --mpi=pmi2`.

Slurm's pmi2 plugin also serves the PMI-1 wire protocol, which is what that
wheel's built-in PMI client speaks (it has no PMI-2 client: MPIR_CVAR_PMI_VERSION=2
fails in MPI_Init). The plugin reads each PMI-1 request with a single read() of
at most 1024 bytes (src/plugins/mpi/pmi2/pmi1.c, "TODO: read until newline"),
and MPICH sends requests of up to about 1,090 bytes: with the UCX netmod,
MPI_Init all-gathers a 4,096-byte business card per rank through PMI, in
segments of 511 bytes written as up to 1,022 hex digits plus the command. The
card is mostly uninitialised heap bytes, so how far the run-length encoding
shrinks a segment changes with the environment, the paths and the memory
layout. When one request is longer than 1024 bytes the plugin answers success
but loses the value ("mpi/pmi2: value not properly terminated in client
request"), the peers decode a damaged address ("UCX ERROR failed to unpack
address"), and some ranks exit with code 15 while the others wait in the PMI
barrier until srun kills them (with --kill-on-bad-exit) or forever (without).

The OFI netmod, also in the wheel, exchanges a fixed-length address of a few
dozen bytes: one short request per rank. So under exactly that launch (srun's
pmi2 plugin, the mpich wheel, and no netmod chosen by the user) we choose it
with MPIR_CVAR_CH4_NETMOD=ofi. Any other MPI or launcher is left alone:
hydra's `mpiexec` reads whole lines, a site MPICH built against Slurm's libpmi2
speaks PMI-2, and Open MPI uses pmix.
"""

from __future__ import annotations

import os
import sys

__all__ = ["NETMOD_VARIABLES", "MPIUnavailable", "load_mpi", "netmod_choice", "prepare_mpi_init", "prepared"]


class MPIUnavailable(ImportError):
    """mpi4py is installed but loads no MPI library: a plain `pip install ringpipe`
    without the `mpi` extra on a machine with no MPI. Its `name` is "mpi4py.MPI", so
    a command line can tell it from other import errors without importing comm."""


def load_mpi():
    """`from mpi4py import MPI` (which initializes MPI), or MPIUnavailable saying what to
    install instead of mpi4py's dozen lines of library paths it tried."""
    try:
        from mpi4py import MPI
    except RuntimeError as e:            # mpi4py's "cannot load MPI library" and the paths it tried
        first = (str(e).splitlines() or ["no MPI library found"])[0]
        raise MPIUnavailable(
            f"ringpipe needs an MPI library and mpi4py could not load one ({first}). Install MPICH from "
            "PyPI with `pip install 'ringpipe[mpi]'` (or `pip install mpich`); on a cluster, build mpi4py "
            "against the site's MPI instead (README: \"Using your cluster's MPI\")", name="mpi4py.MPI") from None
    return MPI

# MPICH reads a control variable under either name; a user who set one has chosen.
NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD")

# What prepare_mpi_init() set in this process, for the run's start-up lines ('' if nothing).
prepared = ""


def _mpich_wheel_installed() -> bool:
    """Is the `mpich` wheel from PyPI installed in this Python (the library mpi4py loads
    from the environment's lib/ unless MPI4PY_LIBMPI points elsewhere)?"""
    from importlib import metadata
    try:
        metadata.version("mpich")
    except metadata.PackageNotFoundError:
        return False
    return True


def netmod_choice(environ, mpich_wheel: bool) -> str | None:
    """The MPICH netmod to choose before MPI_Init ('ofi'), or None to leave MPI alone.
    A pure function of the environment, for tests."""
    under_srun_pmi2 = environ.get("SLURM_MPI_TYPE") == "pmi2" and "PMI_FD" in environ
    chosen = any(environ.get(v) for v in NETMOD_VARIABLES)
    other_library = bool(environ.get("MPI4PY_LIBMPI"))
    if under_srun_pmi2 and mpich_wheel and not chosen and not other_library:
        return "ofi"
    return None


def prepare_mpi_init(environ=None) -> str:
    """Set what this launch needs before MPI_Init (see the module docstring).
    Returns what was set ('' if nothing). Does nothing once mpi4py.MPI is
    imported: MPI may already be running, and its netmod cannot change."""
    global prepared
    env = os.environ if environ is None else environ
    if "mpi4py.MPI" in sys.modules:
        return ""
    # The wheel lookup reads package metadata: only worth it under srun's pmi2 plugin.
    if env.get("SLURM_MPI_TYPE") != "pmi2":
        return ""
    netmod = netmod_choice(env, _mpich_wheel_installed())
    if netmod is None:
        return ""
    env["MPIR_CVAR_CH4_NETMOD"] = netmod
    prepared = (f"MPIR_CVAR_CH4_NETMOD={netmod}: the mpich wheel's UCX start-up messages can exceed the "
                "1024 bytes srun's pmi2 plugin reads at once; set MPIR_CVAR_CH4_NETMOD=ucx to keep UCX")
    return prepared
