"""The shell scripts users and GPU sessions run: they parse, and the GPU check
passes only flags its Python targets accept.

benchmarks/gpu_check.sh runs for real only on a lent GPU machine, with minutes
of budget: a typo found there costs the whole run, so it is caught here."""
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(
    glob.glob(os.path.join(ROOT, "benchmarks", "*.sh"))
    + glob.glob(os.path.join(ROOT, "slurm", "*.sh"))
    + glob.glob(os.path.join(ROOT, "slurm", "*.sbatch"))
    + glob.glob(os.path.join(ROOT, "slurm", "local", "*.sh"))
    + glob.glob(os.path.join(ROOT, "tests", "*.sh"))
    + [os.path.join(ROOT, ".ci", "run")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: os.path.relpath(p, ROOT))
def test_shell_script_parses(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# Lines of gpu_check.sh that call each Python target (matched by these words),
# and the command that prints that target's --help.
GPU_CHECK_TARGETS = {
    "ringpipe.train": [sys.executable, "-m", "ringpipe.train", "--help"],
    "train train-": [sys.executable, "-m", "ringpipe.train", "--help"],   # the train() helper's calls
    "benchmarks/gemm.py": [sys.executable, "benchmarks/gemm.py", "--help"],
    "tests/support/cuda_sim_check.py": [sys.executable, "tests/support/cuda_sim_check.py", "--help"],
}


def test_gpu_check_passes_only_flags_its_targets_accept():
    text = open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read()
    code_lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    checked = 0
    for marker, help_cmd in GPU_CHECK_TARGETS.items():
        flags = set()
        for ln in code_lines:
            if marker in ln:
                flags |= set(re.findall(r"(?<![\w])(--[a-z][a-z0-9-]*)", ln.split(marker, 1)[1]))
        assert flags, f"no call of {marker} found in gpu_check.sh: update this test"
        r = subprocess.run(help_cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        unknown = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", r.stdout))
        assert not unknown, f"gpu_check.sh passes {unknown} to {marker}, whose --help lacks them"
        checked += len(flags)
    assert checked >= 8


# ---- slurm/submit_scaling.sh against stand-in Slurm commands ----------------------------

FAKE_SBATCH = """#!/bin/bash
# Stand-in sbatch: prints the next job id; runs a --wrap command at once, as the job.
n=$(cat "$FAKE_DIR/next" 2>/dev/null || echo 100); echo $((n + 1)) > "$FAKE_DIR/next"
echo "$*" >> "$FAKE_DIR/sbatch.log"
out=/dev/null
while [ $# -gt 0 ]; do
    case "$1" in
        -o) out=${2//%j/$n} ;;
        --wrap) SLURM_JOB_ID=$n sh -c "$2" > "$out" 2>&1 ;;
    esac
    shift
done
echo "$n"
"""
FORGOTTEN = """#!/bin/bash
echo "slurm_load_jobs error: Invalid job id specified" >&2
exit 1
"""


def _fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("squeue", FORGOTTEN), ("scontrol", FORGOTTEN),
                       ("sacct", FORGOTTEN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path))


@pytest.mark.parametrize("merge_ok", [True, False])
def test_submit_scaling_wait_after_slurm_forgot_the_jobs(tmp_path, merge_ok):
    """Slurm forgets finished jobs (MinJobAge, 300 s by default), and squeue then
    fails: --wait must still tell a good sweep from a failed merge, not die on
    squeue's exit code."""
    env = _fake_slurm(tmp_path)
    env["RINGPIPE_PYTHON"] = "true" if merge_ok else "false"     # the merge job's python: succeed or fail
    results = tmp_path / "results"
    r = subprocess.run(["bash", "slurm/submit_scaling.sh", "--ranks", "1 2", "--results", str(results), "--wait"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if merge_ok:
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == str(results)
        assert "warning" not in r.stderr, r.stderr
    else:
        assert r.returncode == 1, r
        assert "the merge job ended ?" in r.stderr


def test_submit_scaling_refuses_training_args_for_an_allreduce_sweep(tmp_path):
    env = _fake_slurm(tmp_path)
    r = subprocess.run(["bash", "slurm/submit_scaling.sh", "--kind", "allreduce", "--results", str(tmp_path / "r"),
                        "--", "--max-bytes", "64M"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--allreduce-args \"--max-bytes 64M\"" in r.stderr
    assert not (tmp_path / "sbatch.log").exists(), "refused before submitting anything"


# ---- slurm/train.sbatch's choice of srun --mpi, against a stand-in srun and python ------

FAKE_PY = """#!/bin/bash
# Stand-in python: prints $FAKE_MPI_LIB for the script's MPI library check; swallows the manifest.
[ "${1:-}" = - ] && { cat > /dev/null; exit 0; }
if [ "${2:-} ${3:-}" = "ringpipe finished" ]; then
    [ -n "${FAKE_UNFINISHED:-}" ] && { echo "run: 1 of 4 rank(s) never finished (no marker: 3)" >&2; exit 1; }
    exit 0
fi
echo "$FAKE_MPI_LIB"
"""
FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$FAKE_DIR/srun.log"
"""
OMPI_LIB = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH_LIB = "MPICH Version:      5.0.2"


def _train_sbatch(tmp_path, lib, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_PY), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RINGPIPE_"))}
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path), FAKE_MPI_LIB=lib,
             RINGPIPE_PYTHON=str(bin_dir / "python"), RINGPIPE_RUN_DIR=str(tmp_path / "run"), **env)
    r = subprocess.run(["bash", "slurm/train.sbatch", "--steps", "1"], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=60)
    log = tmp_path / "srun.log"
    return r, (log.read_text() if log.exists() else None)


@pytest.mark.parametrize("lib,env,plugin", [
    (MPICH_LIB, {}, "pmi2"),
    (OMPI_LIB, {}, "pmix"),
    (OMPI_LIB, {"RINGPIPE_SRUN_MPI": "pmix"}, "pmix"),
    (MPICH_LIB, {"RINGPIPE_SRUN_MPI": "none"}, "none"),     # the trainer's own check refuses that one
], ids=["mpich", "openmpi", "openmpi-pmix", "mpich-none"])
def test_train_sbatch_picks_the_srun_mpi_plugin(tmp_path, lib, env, plugin):
    r, srun = _train_sbatch(tmp_path, lib, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert srun is not None and srun.startswith(f"--kill-on-bad-exit=1 --mpi={plugin} "), srun
    assert f"{lib} | srun --mpi={plugin}" in r.stdout, r.stdout


@pytest.mark.parametrize("env", [{"RINGPIPE_SRUN_MPI": "pmi2"}, {"RINGPIPE_SRUN_ARGS": "-v --mpi=pmi2"},
                                 {"RINGPIPE_SRUN_ARGS": "--mpi pmi2"}], ids=["env", "args=", "args"])
def test_train_sbatch_refuses_open_mpi_under_pmi2(tmp_path, env):
    """Open MPI under srun --mpi=pmi2 silently runs every task as a 1-rank world."""
    r, srun = _train_sbatch(tmp_path, OMPI_LIB, **env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert srun is None, f"srun ran: {srun}"
    assert "uses Open MPI (Open MPI v5.0.11" in r.stderr and "srun --mpi=pmi2" in r.stderr, r.stderr
    assert "Use srun --mpi=pmix for Open MPI" in r.stderr and "1-rank MPI world" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "run_manifests.jsonl").exists(), "refused before the manifest"


def test_train_sbatch_fails_a_job_whose_ranks_did_not_all_finish(tmp_path):
    """srun exits 0, but a rank left no completion marker: the job must fail, not say done."""
    r, srun = _train_sbatch(tmp_path, MPICH_LIB, FAKE_UNFINISHED="1", SLURM_NTASKS="4")
    assert srun is not None
    assert r.returncode == 1, r.stdout + r.stderr
    assert "never finished" in r.stderr and "not every rank finished: failing the job" in r.stdout + r.stderr
