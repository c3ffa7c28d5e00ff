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
    "engine.train": [sys.executable, "-m", "engine.train", "--help"],
    "train train-": [sys.executable, "-m", "engine.train", "--help"],   # the train() helper's calls
    "benchmarks/gemm.py": [sys.executable, "benchmarks/gemm.py", "--help"],
    "tests/cuda_sim_check.py": [sys.executable, "tests/cuda_sim_check.py", "--help"],
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
