"""The local Slurm is one per user and shared (issue 34): two shells of one user, or every
root job on a shared login node, meet in the same one. slurm/local/start.sh used to reuse a
running one without a word, and stop.sh to cancel every job in it and stop it under the
others. Now it is reference-counted (slurm/local/holders.sh):

  - start.sh records its caller as a holder and, reusing a running cluster, names the
    other holders;
  - stop.sh lets go of its own caller's hold only; it stops the daemons only when no other
    holder is alive and no job is queued, says what it left running and why, and cancels
    no job unless --force;
  - a holder whose process has ended no longer counts;
  - cluster.sh (the emulated nodes) follows the same rule.

Against stand-ins (no Slurm needed): daemons that are `tail -f` under the daemons' names,
started with the folder's config (what stop.sh checks before it signals a PID), and
sinfo/squeue/scancel scripts that read and log what the test gives them. The last test
does the same against a real single-node Slurm (skipped where Slurm is not installed).
"""
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import free_port_pair
from tests.slurm.local_names import LOCAL, own_prefix, running, script

# Never a user's own cluster: every test names its folder; cluster.sh gets a prefix of this run's own.
ENV = dict(os.environ, RINGPIPE_SLURM_NO_INSTALL="1", RINGPIPE_NETNS_PREFIX=own_prefix("h"))
for _var in ("SLURM_CONF", "RINGPIPE_SLURM_HOLDER_PID"):
    ENV.pop(_var, None)

# The client commands start.sh and stop.sh run. sinfo: the node is idle; squeue: the lines
# of $FAKE_QUEUE ("JOBID STATE"), none once scancel ran; scancel: logged to $FAKE_LOG.
CLIENTS = {
    "sinfo": "#!/bin/sh\necho idle\n",
    "squeue": '#!/bin/sh\ncase " $* " in *" -t "*) exit 0;; esac\ncat "$FAKE_QUEUE" 2>/dev/null\n',
    "scancel": '#!/bin/sh\necho "scancel $*" >>"$FAKE_LOG"\n: >"$FAKE_QUEUE"\n',
    "sbatch": "#!/bin/sh\nexit 0\n", "srun": "#!/bin/sh\nexit 0\n", "scontrol": "#!/bin/sh\nexit 0\n",
}


def stopped(proc):
    """The stand-in daemon PROC ended (reaped here: it is this test's child)."""
    try:
        proc.wait(timeout=10)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture
def fake_slurm(tmp_path):
    """A single-node Slurm's folder whose munged, slurmctld and slurmd run (stand-ins), and the
    environment whose PATH finds the stand-in clients: (env, folder, {daemon: Popen})."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in CLIENTS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    folder = tmp_path / "slurm"
    for sub in ("run", "munge", "log"):
        (folder / sub).mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    conf, sock = folder / "slurm.conf", folder / "munge" / "munge.sock"
    conf.write_text("# a stand-in\n")
    sock.write_text("")
    daemons = {}
    for name, mark in (("munged", sock), ("slurmctld", conf), ("slurmd", conf)):
        shutil.copy(shutil.which("tail"), bin_dir / name)       # `NAME -f MARK` runs until signalled
        daemons[name] = subprocess.Popen([str(bin_dir / name), "-f", str(mark)], stdout=subprocess.DEVNULL)
        (folder / "run" / f"{name}.pid").write_text(f"{daemons[name].pid}\n")
    env = dict(ENV, PATH=f"{bin_dir}:{os.environ['PATH']}", RINGPIPE_SLURM_DIR=str(folder), STOP_WAIT="20",
               FAKE_QUEUE=str(tmp_path / "queue"), FAKE_LOG=str(tmp_path / "calls.log"))
    yield env, folder, daemons
    for proc in daemons.values():
        proc.kill()
        proc.wait()


@pytest.fixture
def other_caller():
    """Another process using the cluster (a second shell): a `sleep` that ends when told."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def cancelled(env):
    log = env["FAKE_LOG"]
    return open(log).read().splitlines() if os.path.exists(log) else []


def test_start_says_it_reuses_a_running_slurm_and_whose_and_stop_leaves_it_to_the_other(fake_slurm, other_caller):
    env, folder, daemons = fake_slurm
    r = script("start.sh", dict(env, RINGPIPE_SLURM_HOLDER_PID=str(other_caller.pid)))
    assert r.returncode == 0, r.stderr
    # This process is the caller: `timeout`, a launcher that ends with the script, is passed over.
    r = script("start.sh", env, wrapper=("timeout", "60"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"export SLURM_CONF={folder}/slurm.conf"       # eval still gets one line
    assert "reusing it" in r.stderr and f"pid {other_caller.pid} (sleep 300" in r.stderr, r.stderr
    assert f"pid {os.getpid()} (" in r.stderr, r.stderr

    r = script("stop.sh", env)
    assert r.returncode == 0, r.stderr
    assert "left running" in r.stderr and f"held by pid {other_caller.pid}" in r.stderr, r.stderr
    assert all(running(p.pid) for p in daemons.values()), "stop.sh stopped a Slurm another caller holds"
    assert cancelled(env) == []


def test_the_last_holder_stops_it_and_a_holder_that_ended_does_not_count(fake_slurm, other_caller):
    env, folder, daemons = fake_slurm
    for holder in (other_caller.pid, os.getpid()):
        assert script("start.sh", dict(env, RINGPIPE_SLURM_HOLDER_PID=str(holder))).returncode == 0
    other_caller.kill()
    other_caller.wait()
    r = script("stop.sh", env)
    assert r.returncode == 0, r.stderr
    assert f"pid {other_caller.pid}, which held" in r.stderr and "has ended" in r.stderr, r.stderr
    assert all(stopped(p) for p in daemons.values()), r.stderr
    assert "stopped Slurm" in r.stderr and not (folder / "holders").exists()


def test_jobs_in_the_queue_keep_it_running_and_only_force_cancels_them(fake_slurm):
    env, folder, daemons = fake_slurm
    with open(env["FAKE_QUEUE"], "w") as fh:
        fh.write("101 RUNNING\n102 PENDING\n103 COMPLETING\n")
    assert script("start.sh", env).returncode == 0
    r = script("stop.sh", env)
    assert r.returncode == 0, r.stderr
    assert "left running" in r.stderr and "jobs 101 102 are in its queue" in r.stderr, r.stderr
    assert cancelled(env) == [] and all(running(p.pid) for p in daemons.values())
    r = script("stop.sh", env, "--force")
    assert r.returncode == 0, r.stderr
    assert cancelled(env) == ["scancel 101 102"], cancelled(env)
    assert all(stopped(p) for p in daemons.values()), r.stderr


def test_stop_refuses_an_unknown_option_and_a_holder_pid_that_is_not_running(fake_slurm):
    env, folder, daemons = fake_slurm
    r = script("stop.sh", env, "--all")
    assert r.returncode == 2 and "unknown option '--all'" in r.stderr, r.stderr
    dead = subprocess.Popen(["true"])
    dead.wait()
    r = script("start.sh", dict(env, RINGPIPE_SLURM_HOLDER_PID=str(dead.pid)))
    assert r.returncode == 2 and "RINGPIPE_SLURM_HOLDER_PID" in r.stderr, r.stderr
    assert all(running(p.pid) for p in daemons.values())


def test_cluster_down_leaves_the_emulated_cluster_up_while_another_caller_holds_it(tmp_path, other_caller):
    folder = tmp_path / "cluster"
    (folder / "run").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    (folder / "slurm.conf").write_text("# a stand-in\n")
    shutil.copy(shutil.which("tail"), tmp_path / "slurmctld")
    ctld = subprocess.Popen([str(tmp_path / "slurmctld"), "-f", str(folder / "slurm.conf")], stdout=subprocess.DEVNULL)
    try:
        (folder / "run" / "slurmctld.pid").write_text(f"{ctld.pid}\n")
        # What `cluster.sh up` records for its caller (it needs namespaces and Slurm to come up).
        hold = subprocess.run(["bash", "-c", f'. "{LOCAL}/holders.sh"; rp_holders_init "$1"; rp_hold "$2"', "hold",
                               str(folder), str(other_caller.pid)], capture_output=True, text=True, timeout=30)
        assert hold.returncode == 0, hold.stderr
        r = script("cluster.sh", dict(ENV, RINGPIPE_CLUSTER_DIR=str(folder)), "down")
        assert r.returncode == 0, r.stderr
        assert "left up" in r.stderr and f"held by pid {other_caller.pid}" in r.stderr, r.stderr
        assert running(ctld.pid) and (folder / "slurm.conf").exists()
    finally:
        ctld.kill()
        ctld.wait()


# ---- the same against a real single-node Slurm ------------------------------------------------------------

def squeue(env):
    r = subprocess.run(["timeout", "10", "squeue", "-h", "-o", "%A"], env=env, capture_output=True, text=True)
    return r.stdout.split()


@pytest.mark.slurm
def test_a_real_slurm_is_stopped_by_its_last_holder_only_and_its_jobs_are_not_cancelled(other_caller):
    if shutil.which("slurmctld") is None and not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("Slurm is not installed: apt-get install -y slurm-wlm munge")
    # Short: the munge socket's path must fit a unix socket's 108 bytes (tmp_path's may not).
    folder = Path(tempfile.mkdtemp(prefix="ringpipe-holders-"))
    env = dict(ENV, RINGPIPE_SLURM_DIR=str(folder), RINGPIPE_SLURM_PORT=str(free_port_pair(16957)),
               PATH=f"{os.environ['PATH']}:/usr/sbin:/sbin")
    try:
        r = script("start.sh", dict(env, RINGPIPE_SLURM_HOLDER_PID=str(other_caller.pid)), timeout=300)
        if r.returncode != 0:
            pytest.skip(f"local Slurm did not start (start.sh exit {r.returncode}): {r.stderr.strip()[-800:]}")
        pids = [int((folder / "run" / f"{n}.pid").read_text()) for n in ("munged", "slurmctld", "slurmd")]
        r = script("start.sh", env, timeout=120)       # waits for no lock a daemon inherited
        assert r.returncode == 0 and f"pid {other_caller.pid} (sleep 300" in r.stderr, r.stderr
        env["SLURM_CONF"] = f"{os.path.realpath(folder)}/slurm.conf"
        job = subprocess.run(["timeout", "30", "sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300"],
                             env=env, capture_output=True, text=True)
        assert job.returncode == 0, job.stderr
        job_id = job.stdout.strip().split(";")[0]

        r = script("stop.sh", env, timeout=120)
        assert "left running" in r.stderr and f"held by pid {other_caller.pid}" in r.stderr, r.stderr
        assert all(running(p) for p in pids) and job_id in squeue(env)
        other_caller.send_signal(signal.SIGKILL)
        other_caller.wait()
        r = script("stop.sh", env, timeout=120)
        assert f"jobs {job_id} are in its queue" in r.stderr, r.stderr
        assert all(running(p) for p in pids) and job_id in squeue(env)
    finally:
        r = script("stop.sh", dict(env, RINGPIPE_SLURM_PURGE="1"), "--force", timeout=120)
    assert f"cancelling jobs: {job_id}" in r.stderr, r.stderr
    deadline = time.time() + 10
    while time.time() < deadline and any(running(p) for p in pids):
        time.sleep(0.2)
    assert not any(running(p) for p in pids) and not folder.exists(), r.stderr
