"""comm/launcher.py: the netmod chosen before MPI_Init for the mpich wheel under
`srun --mpi=pmi2` (whose UCX start-up requests overflow the plugin's 1024-byte
read), and nothing chosen for any other launch; no MPI library at all is a one-line
refusal naming the extra to install. The launch itself is in tests/slurm/test_cluster.py."""
import os
import subprocess
import sys

import pytest

from ringpipe.comm import launcher

SRUN_PMI2 = {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "PMI_RANK": "0", "PMI_SIZE": "4"}


@pytest.mark.parametrize("environ, wheel, expected", [
    (SRUN_PMI2, True, "ofi"),
    (SRUN_PMI2, False, None),                                             # a site MPICH (its own PMI client)
    ({**SRUN_PMI2, "MPIR_CVAR_CH4_NETMOD": "ucx"}, True, None),           # the user chose
    ({**SRUN_PMI2, "MPICH_CH4_NETMOD": "ucx"}, True, None),               # the same, MPICH's other name
    ({**SRUN_PMI2, "MPI4PY_LIBMPI": "/opt/mpi/lib/libmpi.so"}, True, None),  # mpi4py loads another library
    ({**SRUN_PMI2, "SLURM_MPI_TYPE": "pmix"}, True, None),               # pmix: no PMI-1 wire
    ({"SLURM_MPI_TYPE": "pmi2"}, True, None),                             # the batch shell, not a task
    ({"PMI_FD": "5", "PMI_RANK": "0"}, True, None),                        # hydra's mpiexec reads whole lines
    ({}, True, None),
])
def test_netmod_choice(environ, wheel, expected):
    assert launcher.netmod_choice(environ, wheel) == expected


def test_prepare_sets_the_variable_before_mpi_starts_and_never_after(monkeypatch):
    monkeypatch.setattr(launcher, "prepared", "")
    monkeypatch.setattr(launcher, "_mpich_wheel_installed", lambda: True)
    env = dict(SRUN_PMI2)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", object())         # MPI already imported: too late
    assert launcher.prepare_mpi_init(env) == "" and "MPIR_CVAR_CH4_NETMOD" not in env
    monkeypatch.delitem(sys.modules, "mpi4py.MPI")                    # before MPI_Init: chosen
    said = launcher.prepare_mpi_init(env)
    assert env["MPIR_CVAR_CH4_NETMOD"] == "ofi" and said == launcher.prepared
    assert "MPIR_CVAR_CH4_NETMOD=ofi" in said and "MPIR_CVAR_CH4_NETMOD=ucx" in said   # what, and how to undo it


def test_the_mpich_wheel_is_found_in_the_project_environment():
    """make venv installs MPICH from PyPI (the `mpi` extra): the case this module is for."""
    from mpi4py import MPI
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("this environment's MPI is not MPICH (the Open MPI venv)")
    assert launcher._mpich_wheel_installed()


@pytest.mark.parametrize("command", [["ringpipe", "train", "--steps", "1"], ["ringpipe", "prepare", "x.txt"],
                                     ["ringpipe.train", "--steps", "1"]])
def test_no_mpi_library_is_a_refusal_naming_the_extra(tmp_path, command):
    # A plain `pip install ringpipe` on a machine with no MPI: mpi4py finds no library. It was a
    # 37-line traceback of every path mpi4py tried; now one line saying what to install.
    (tmp_path / "x.txt").write_text("text\n")
    env = dict(os.environ, MPI4PY_LIBMPI=str(tmp_path / "no" / "libmpi.so"))
    env.pop("PMI_FD", None)
    r = subprocess.run([sys.executable, "-m", *command, "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pip install 'ringpipe[mpi]'" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
