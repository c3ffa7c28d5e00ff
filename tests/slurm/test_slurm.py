"""End to end under a real single-node Slurm (slurm/local/start.sh): training
jobs, stop-and-requeue, a crashing rank, a wrong `srun --mpi` plugin, and a
scaling sweep. About 1.5-2 minutes here (plus 15-30 s for `apt-get install
slurm-wlm munge` the first time). Skipped, with the reason, when Slurm cannot
be installed or started. The cluster lives in a temp folder, on free ports,
held by this test process (slurm/local/holders.sh), and is always stopped at the end.

    python -m pytest tests/slurm/test_slurm.py -v          # or -m slurm / -m "not slurm"
    RINGPIPE_KEEP_SLURM=1 ...                        # keep the folder (logs) afterwards
    RINGPIPE_REQUIRE_SLURM=1 ...                     # fail instead of skip if Slurm cannot be set up
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slurm

from ringpipe.engine.job import checkpoint
from tests.support import free_port_pair, ROOT
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
PY = VENV_PY if os.path.exists(VENV_PY) else sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
TINY = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
        "--batch-size", "8", "--steps", "6", "--dtype", "float64", "--sample-tokens", "0"]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}
THREADS = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}


def _free_port_pair():
    return free_port_pair(16817)



def _unavailable(reason):
    """Skip, or fail when RINGPIPE_REQUIRE_SLURM=1 (CI that installed Slurm on purpose)."""
    if os.environ.get("RINGPIPE_REQUIRE_SLURM", "0") not in ("", "0"):
        pytest.fail(f"RINGPIPE_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    """Start a private Slurm; yield the environment for its clients; always stop it."""
    if shutil.which("slurmctld") is None and not os.path.exists("/usr/sbin/slurmctld"):
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            _unavailable("Slurm is not installed and cannot be installed here (needs root and apt-get): "
                         "apt-get install -y slurm-wlm munge")
    d = tempfile.mkdtemp(prefix="ringpipe-slurm-test-")
    # A cluster of its own (its folder, its port), held by this process: never a user's, which
    # start.sh would share and stop.sh leave to its other holders.
    env = dict(os.environ, RINGPIPE_SLURM_DIR=d, RINGPIPE_SLURM_PORT=str(_free_port_pair()),
               RINGPIPE_PYTHON=PY, RINGPIPE_SLURM_HOLDER_PID=str(os.getpid()), **THREADS)
    env.pop("SLURM_CONF", None)
    try:
        try:
            r = subprocess.run(["timeout", "420", os.path.join(ROOT, "slurm/local/start.sh")], env=env,
                               capture_output=True, text=True)
        except OSError as e:
            _unavailable(f"cannot run slurm/local/start.sh: {e}")
        if r.returncode != 0:
            _unavailable(f"local Slurm did not start (slurm/local/start.sh exit {r.returncode}): "
                         f"{r.stderr.strip()[-1500:]}")
        m = re.search(r"export SLURM_CONF=(\S+)", r.stdout)
        assert m, r.stdout
        env["SLURM_CONF"] = m.group(1)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        env["RINGPIPE_TEST_SLURM_DIR"] = d
        yield env
    finally:
        stop_env = dict(env)
        if os.environ.get("RINGPIPE_KEEP_SLURM", "0") in ("", "0"):
            stop_env["RINGPIPE_SLURM_PURGE"] = "1"
        # --force: every job in this folder's cluster is one these tests submitted (a test that
        # failed midway may have left one queued), and no one else holds it.
        subprocess.run(["timeout", "120", os.path.join(ROOT, "slurm/local/stop.sh"), "--force"], env=stop_env,
                       capture_output=True, text=True)


# ------------------------------------------------------------------------------ helpers

def sbatch_wait(env, args, timeout=180, extra_env=None):
    """Like `timeout T sbatch --wait ARGS` from the repo root, but polling the job
    every 0.1 s (sbatch --wait backs off to sleeps of several seconds, which
    costs more than these jobs run): (exit code, job id, scontrol info)."""
    jid = sbatch(env, args, extra_env)
    info = wait_state(env, jid, lambda i: i.get("JobState") in FINAL, timeout, "end")
    code, sig = (int(x) for x in info.get("ExitCode", "0:0").split(":"))
    return (code or (128 + sig if sig else 0)), jid, info


def sbatch(env, args, extra_env=None):
    e = dict(env, **(extra_env or {}))
    r = subprocess.run(["timeout", "30", "sbatch", "--parsable"] + args, cwd=ROOT, env=e,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip().split(";")[0]


def job_info(env, jid):
    r = subprocess.run(["timeout", "10", "scontrol", "show", "job", "-o", str(jid)], env=env,
                       capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def wait_state(env, jid, pred, timeout, what):
    deadline = time.time() + timeout
    info = {}
    while time.time() < deadline:
        info = job_info(env, jid)
        if pred(info):
            return info
        time.sleep(0.1)
    pytest.fail(f"job {jid}: no {what} within {timeout}s; last: {info}")


def _stepds_of(jid):
    """PIDs of this machine's `slurmstepd: [JID.*]` processes (our cluster runs here)."""
    pids = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(d, "cmdline"), "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(f"slurmstepd: [{jid}.".encode()):
            pids.append(int(os.path.basename(d)))
    return pids


def losses(run_dir):
    """step -> loss, the last record of each step winning (a resumed run appends)."""
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
    return out


def final_arrays(run_dir):
    latest = checkpoint.find_latest(os.path.join(run_dir, "checkpoints"))
    assert latest, f"no checkpoint in {run_dir}"
    return os.path.basename(latest), checkpoint.load(latest)[0]


def mpiexec_reference(out_dir, args):
    """The same run under `mpiexec -n 4` (no Slurm), started in the background."""
    return subprocess.Popen(["timeout", "300", MPIEXEC, "-n", "4", PY, "-m", "ringpipe.train", "--out", out_dir]
                            + args, cwd=ROOT, env=dict(os.environ, **THREADS),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc):
    out, _ = proc.communicate()
    assert proc.returncode == 0, out
    return out


# ------------------------------------------------------------------------------ tests

def test_train_job_matches_mpiexec(slurm, tmp_path):
    ref = mpiexec_reference(str(tmp_path / "ref"), TINY)
    run = tmp_path / "run"
    rc, jid, out = sbatch_wait(slurm, ["-N", "1", "-n", "4", "--ntasks-per-node=4", "-c", "1", "--time=10",
                                       "-o", str(tmp_path / "job.out"), "slurm/train.sbatch"] + TINY,
                               extra_env={"RINGPIPE_RUN_DIR": str(run)})
    log = (tmp_path / "job.out").read_text()
    assert rc == 0, f"{out}\n{log}"
    finish(ref)
    got, want = losses(run), losses(tmp_path / "ref")
    assert sorted(got) == list(range(1, 7))
    assert got == want, f"losses differ from mpiexec -n 4:\n{got}\n{want}"
    assert "srun --mpi=pmi2" in log and "4 ranks: dp 4" in log

    man = json.loads((run / "run_manifest.json").read_text())
    assert man["job_id"] == jid and man["restart_count"] == 0 and man["ntasks"] == "4"
    assert man["node_list"] and man["run_dir"] == str(run.resolve())
    assert man["trainer_args"] == TINY and man["srun_mpi"] == "pmi2" and "MPICH" in man["mpi_library"]
    assert "git_revision" in man and man["env"]["OMP_NUM_THREADS"] == "1"
    assert man["env"]["SRUN_CPUS_PER_TASK"] == "1"
    events = [json.loads(x) for x in (run / "run_manifests.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "end"] and events[-1]["action"] == "done"


def test_usr1_checkpoints_requeues_and_matches_uninterrupted(slurm, tmp_path):
    steps = 300                       # a few seconds: the signal must land before the end
    # Not --quiet: the job's log must say "resumed from" (a fact, which quiet leaves out).
    args = TINY[:-6] + ["--steps", str(steps), "--dtype", "float64", "--sample-tokens", "0"]
    ref = mpiexec_reference(str(tmp_path / "ref"), args)
    finish(ref)                       # first, so the two runs do not share the 2 cores
    run = tmp_path / "run"
    jid = sbatch(slurm, ["-N", "1", "-n", "4", "--ntasks-per-node=4", "-c", "1", "--time=10",
                         "-o", str(tmp_path / "job.out"), "slurm/train.sbatch"] + args,
                 extra_env={"RINGPIPE_RUN_DIR": str(run)})
    # Signal the batch shell (as --signal=B:USR1@T does) once a few steps are done.
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            break
        assert job_info(slurm, jid).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            (tmp_path / "job.out").read_text()
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", "--batch", jid], env=slurm, check=True)
    # Requeued: back to PENDING with Restarts=1; skip the requeue delay.
    wait_state(slurm, jid, lambda i: i.get("Restarts") == "1" and i.get("JobState") in ("PENDING", "REQUEUED")
               or i.get("JobState") in FINAL, 60, "requeue")
    info = job_info(slurm, jid)
    assert info.get("Restarts") == "1", f"not requeued: {info}\n{(tmp_path / 'job.out').read_text()}"
    # Skipping Slurm's requeue delay is only safe once the first run's step
    # daemons are gone: the new run reuses the step id <job>.0, and a lingering
    # slurmstepd of the old step (slow to finish on a loaded machine) breaks
    # the new step's PMI2 exchange ("failed to send temp kvs"). On a real
    # cluster the ~2 min requeue delay covers this.
    wait_state(slurm, jid, lambda i: i.get("JobState") == "PENDING" and not _stepds_of(jid), 60,
               "requeued job pending with its old step daemons gone")
    for _ in range(50):               # then it accepts a start time
        r = subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], env=slurm,
                           capture_output=True, text=True)
        if r.returncode == 0:
            break
        time.sleep(0.2)
    info = wait_state(slurm, jid, lambda i: i.get("JobState") in FINAL, 120, "end after the requeue")
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    assert "got SIGUSR1" in log and "requeueing job" in log and "exited with 85" in log, log
    m = re.search(r"resumed from \S+ at step (\d+)", log)
    assert m and 1 <= int(m.group(1)) < steps, log

    got, want = losses(run), losses(tmp_path / "ref")
    assert got == want, "losses of the requeued run differ from the uninterrupted one"
    name_a, a = final_arrays(run)
    name_b, b = final_arrays(tmp_path / "ref")
    assert name_a == name_b and a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{k} differs after requeue"
    events = [json.loads(x) for x in (run / "run_manifests.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart_count"]) for e in events] == [("start", 0), ("end", 0), ("start", 1),
                                                                  ("end", 1)]
    assert events[1]["action"] == "requeue" and events[1]["exit_code"] == 85 and events[3]["action"] == "done"


def test_crashing_rank_ends_job_fast_and_is_named(slurm, tmp_path):
    out_file = tmp_path / "job.out"
    rc, jid, out = sbatch_wait(slurm, ["-n", "4", "-c", "1", "-o", str(out_file), "tests/support/slurm_jobs/step.sbatch",
                                       "tests/support/slurm_jobs/crash_rank.py"], timeout=120)
    log = out_file.read_text()
    assert rc != 0, log
    assert "[ringpipe rank 2/4 on" in log and "injected failure on rank 2" in log, log
    crash = float(re.search(r"CRASH_AT (\S+)", log).group(1))
    end = re.search(r"STEP_END (\S+) (\d+)", log)
    assert end and int(end.group(2)) != 0, log
    assert float(end.group(1)) - crash < 15, f"the step took {float(end.group(1)) - crash:.1f}s to end:\n{log}"
    assert job_info(slurm, jid)["JobState"] == "FAILED"


def test_wrong_mpi_plugin_is_refused(slurm, tmp_path):
    out_file = tmp_path / "job.out"
    # Every task prints the refusal, as the trainer's does (engine/train/cli.py): a task that
    # exits first makes srun (--kill-on-bad-exit) end the others, task 0 too, on a loaded
    # machine before it printed (seen: tasks 1-2 exited 2, 0 and 3 were terminated, no message).
    rc, jid, out = sbatch_wait(slurm, ["-n", "4", "-c", "1", "-o", str(out_file), "tests/support/slurm_jobs/step.sbatch",
                                       "tests/support/slurm_jobs/launcher_check.py", "--every-task"], timeout=120,
                               extra_env={"RINGPIPE_SRUN_MPI": "none"})
    log = out_file.read_text()
    assert rc != 0 and "LAUNCH_OK" not in log, log
    assert "rank 0 of 1" in log and "Slurm started 4 tasks" in log and "`srun --mpi=pmi2`" in log, log
    assert "MPICH" in log and "srun --mpi plugin used: none (SLURM_MPI_TYPE is not set" in log, log
    assert 1 <= log.count("error: MPI launcher mismatch") <= 4, log     # at least the first task to end said it
    # and the right plugin passes
    rc, jid, out = sbatch_wait(slurm, ["-n", "4", "-c", "1", "-o", str(tmp_path / "ok.out"),
                                       "tests/support/slurm_jobs/step.sbatch", "tests/support/slurm_jobs/launcher_check.py"],
                               timeout=120, extra_env={"RINGPIPE_SRUN_MPI": "pmi2"})
    assert rc == 0 and (tmp_path / "ok.out").read_text().count("LAUNCH_OK") == 4


OMPI_PY = os.path.join(ROOT, ".venv-openmpi", "bin", "python")


def test_open_mpi_under_pmi2_is_refused(slurm, tmp_path):
    """Open MPI under `srun --mpi=pmi2` does not fail by itself: each task is a 1-rank world
    (no error from MPI). The trainer's launcher check catches it, and train.sbatch
    refuses the pair before it starts srun."""
    if not os.path.exists(OMPI_PY):
        pytest.skip(".venv-openmpi is missing: `make venv-openmpi` builds it (.ci/run does, before `make test`)")
    out_file = tmp_path / "job.out"
    # Every task prints the refusal: Open MPI's singletons start at different speeds, and
    # --kill-on-bad-exit may end task 0 before it prints.
    rc, jid, out = sbatch_wait(slurm, ["-n", "4", "-c", "1", "-o", str(out_file), "tests/support/slurm_jobs/step.sbatch",
                                       "tests/support/slurm_jobs/launcher_check.py", "--every-task"], timeout=120,
                               extra_env={"RINGPIPE_PYTHON": OMPI_PY, "RINGPIPE_SRUN_MPI": "pmi2"})
    log = out_file.read_text()
    assert rc != 0 and "LAUNCH_OK" not in log, log
    assert "rank 0 of 1" in log and "Slurm started 4 tasks" in log and "`srun --mpi=pmix` (Open MPI)" in log, log
    assert "MPI library: Open MPI" in log and "srun --mpi plugin used: pmi2" in log, log
    # train.sbatch: refused up front, no step started
    run = tmp_path / "run"
    rc, jid, out = sbatch_wait(slurm, ["-N", "1", "-n", "4", "-c", "1", "--time=10", "-o", str(tmp_path / "t.out"),
                                       "slurm/train.sbatch"] + TINY,
                               extra_env={"RINGPIPE_RUN_DIR": str(run), "RINGPIPE_PYTHON": OMPI_PY,
                                          "RINGPIPE_SRUN_MPI": "pmi2"})
    log = (tmp_path / "t.out").read_text()
    assert rc == 2, log
    assert "uses Open MPI" in log and "Use srun --mpi=pmix for Open MPI" in log, log
    assert "training step exited" not in log and not (run / "run_manifests.jsonl").exists(), log
    assert "null byte" not in log, log


def test_train_sbatch_with_wrong_plugin_refused_before_work(slurm, tmp_path):
    run = tmp_path / "run"
    rc, jid, out = sbatch_wait(slurm, ["-N", "1", "-n", "4", "-c", "1", "--time=10", "-o", str(tmp_path / "job.out"),
                                       "slurm/train.sbatch"] + TINY,
                               extra_env={"RINGPIPE_RUN_DIR": str(run), "RINGPIPE_SRUN_MPI": "none"})
    log = (tmp_path / "job.out").read_text()
    assert rc != 0, log
    assert "`srun --mpi=pmi2`" in log and "rank 0 of 1" in log, log
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip(), log
    assert "requeueing" not in log


def test_scaling_sweep_table_and_plot(slurm, tmp_path):
    res = tmp_path / "scaling"
    r = subprocess.run(["timeout", "240", "slurm/submit_scaling.sh", "--kind", "both", "--ranks", "1 2",
                        "--steps", "8", "--warmup", "3", "--batch", "8", "--results", str(res),
                        "--allreduce-args", "--quick --algorithms ring,mpi", "--wait", "--"]
                       + TINY[:TINY.index("--batch-size")] + ["--dtype", "float64"],
                       cwd=ROOT, env=slurm, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr + "".join(
        p.read_text() for p in (res / "logs").glob("*.out"))
    md = (res / "scaling.md").read_text()
    assert re.search(r"\| strong \| 1 \| 1 \| 8 \| [\d.]+ \| [\d.]+ \| 1\.00 \| [\d.]+ \| 100% \|", md), md
    assert re.search(r"\| strong \| 2 \| 1 \| 8 \|", md), md
    data = json.loads((res / "scaling.json").read_text())
    assert [p["ranks"] for p in data["rows"]] == [1, 2] and all(p["throughput"] > 0 for p in data["rows"])
    for png in ("scaling.png", "allreduce.png"):
        assert (res / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ar = (res / "allreduce.md").read_text()
    assert "busbw GB/s, 2 ranks" in ar and "| 1M | ring |" in ar, ar
    assert "| strong | 1 |" in r.stdout            # --wait printed the table


def test_a_sweep_beyond_the_cluster_submits_nothing(slurm, tmp_path):
    # One node of 4 CPUs: 8 ranks are 2 nodes. The smaller points used to be queued anyway.
    name = f"sweep-test-{os.getpid()}"
    r = subprocess.run(["timeout", "120", "slurm/submit_scaling.sh", "--ranks", "1 2 8", "--mode", "both",
                        "--job-name", name, "--results", str(tmp_path / "res"), "--"] + TINY,
                       cwd=ROOT, env=slurm, capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refuses train strong, 8 ranks on 2 node(s)" in r.stderr and "nothing was submitted" in r.stderr
    queued = subprocess.run(["timeout", "10", "squeue", "-h", "-t", "all", "-n", name, "-o", "%i"], env=slurm,
                            capture_output=True, text=True)
    assert queued.returncode == 0 and queued.stdout.strip() == "", queued
    assert not (tmp_path / "res").exists()
