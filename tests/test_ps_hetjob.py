"""slurm/ps_hetjob.sbatch (parameter servers on nodes of their own, as a heterogeneous
Slurm job) against stand-in srun and python, as tests/test_scripts.py tries
slurm/train.sbatch: the srun line it leads train.sbatch to run (component 0 = the
workers, component 1 = the servers, --ps-servers = component 1's task count), the
completion check over all ranks, and what it refuses. No Slurm needed."""
import os
import subprocess

import pytest

from tests.support import ROOT

FAKE_PY = """#!/bin/bash
# Stand-in python: an MPICH library for train.sbatch's check; swallows the manifest; logs the rest.
[ "${1:-}" = - ] && { cat > /dev/null; exit 0; }
if [ "${2:-} ${3:-}" = "ringpipe finished" ]; then echo "$*" >> "$FAKE_DIR/finished.log"; exit 0; fi
echo "MPICH Version:      5.0.2"
"""
FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$FAKE_DIR/srun.log"
"""
HETJOB = {"SLURM_HET_SIZE": "2", "SLURM_JOB_ID": "", "SLURM_NTASKS": "4",
          "SLURM_NTASKS_HET_GROUP_0": "4", "SLURM_NTASKS_HET_GROUP_1": "2",
          "SLURM_CPUS_PER_TASK": "8", "SLURM_CPUS_PER_TASK_HET_GROUP_0": "8",
          "SLURM_CPUS_PER_TASK_HET_GROUP_1": "4"}


def _run(tmp_path, args=("--steps", "1"), **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PY), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RINGPIPE_", "SRUN_"))}
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path),
             RINGPIPE_PYTHON=str(bin_dir / "python"), RINGPIPE_RUN_DIR=str(tmp_path / "run"), **env)
    e = {k: v for k, v in e.items() if v != ""}
    r = subprocess.run(["bash", "slurm/ps_hetjob.sbatch", *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    logs = {n: (tmp_path / f"{n}.log").read_text() if (tmp_path / f"{n}.log").exists() else None
            for n in ("srun", "finished")}
    return r, logs


def test_one_mpi_job_over_both_components_servers_last(tmp_path):
    r, logs = _run(tmp_path, **HETJOB)
    assert r.returncode == 0, r.stdout + r.stderr
    srun = logs["srun"]
    assert srun is not None, r.stdout + r.stderr
    workers, servers = srun.split(" : ")
    # Component 0 (the workers, ranks 0..3) with its CPUs; component 1 (the servers, ranks 4, 5)
    # with its own CPUs and thread counts, then the one program both run.
    assert workers.startswith("--kill-on-bad-exit=1 --mpi=pmi2 -n 4 -c 8"), workers
    assert servers.startswith("-n 2 -c 4 --export=ALL,OMP_NUM_THREADS=4,"), servers
    assert "-m ringpipe.train --resume auto --out" in servers, servers
    assert servers.rstrip().endswith("--sync ps --ps-servers 2 --steps 1"), servers
    assert "ranks 4..5" in r.stdout, r.stdout
    # The completion check counts every rank, servers included.
    assert logs["finished"] is not None and logs["finished"].rstrip().endswith("--ranks 6"), logs


def test_the_mpi_plugin_asked_for_goes_to_both_components(tmp_path):
    r, logs = _run(tmp_path, RINGPIPE_SRUN_MPI="pmix", **HETJOB)
    assert r.returncode == 0, r.stdout + r.stderr
    workers, servers = logs["srun"].split(" : ")
    assert "--mpi=pmix" in workers and "--mpi=pmix" in servers, logs["srun"]


def test_refuses_a_job_that_is_not_heterogeneous(tmp_path):
    r, logs = _run(tmp_path, SLURM_NTASKS="6")
    assert r.returncode == 2 and logs["srun"] is None
    assert "not a two-component heterogeneous job" in r.stderr and "#SBATCH hetjob" in r.stderr, r.stderr


@pytest.mark.parametrize("arg", ["--ps-servers", "--ps-servers=3", "--sync"])
def test_refuses_a_server_count_of_its_own(tmp_path, arg):
    r, logs = _run(tmp_path, args=("--steps", "1", arg, "3"), **HETJOB)
    assert r.returncode == 2 and logs["srun"] is None
    assert "sets --sync ps --ps-servers 2 itself" in r.stderr, r.stderr
