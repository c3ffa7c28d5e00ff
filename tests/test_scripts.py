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
