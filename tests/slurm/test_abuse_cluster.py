"""Issue 20, the local Slurm's side: its state folders have fixed names under /tmp and
the scripts run as root, so

  - a state folder that exists already is used only if it is ours alone (owned by us,
    mode 0700, not a link): another user's folder could hold their munge key, config or
    PID files (start.sh, stop.sh, cluster.sh, nodes.sh refuse it with exit 2);
  - a PID file is believed only for the daemon it names, started with this folder's
    config: `cluster.sh down` used to SIGKILL whatever PID was written there;
  - start.sh makes a fresh munge key on every start instead of reusing one it finds.

The decoy tests need no Slurm; the key test starts a real single-node Slurm (skipped when
it cannot be installed or started, as tests/slurm/test_slurm.py).
"""
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.support import free_port_pair
from tests.slurm.local_names import LOCAL, own_prefix, running, script

# cluster.sh down takes down every namespace of its prefix: one of this test run's own.
PREFIX = own_prefix("a")
NS = f"/run/netns/{PREFIX}"
ENV = dict(os.environ, RINGPIPE_SLURM_NO_INSTALL="1", RINGPIPE_NETNS_PREFIX=PREFIX)
ENV.pop("SLURM_CONF", None)
IS_ROOT = os.geteuid() == 0


@pytest.fixture
def decoys(tmp_path):
    """Two innocent processes: `sleep 1000`, and a sleep whose name is `slurmctld` (what a
    name-only check would take for the daemon). Killed at the end."""
    named = tmp_path / "bin" / "slurmctld"
    named.parent.mkdir()
    shutil.copy("/bin/sleep", named)
    procs = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen([str(named), "1000"])]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def private_folder():
    return tempfile.mkdtemp(prefix="ringpipe-abuse-")        # mode 0700, ours: a folder the scripts accept


def plant_pids(folder, pid, names):
    os.makedirs(os.path.join(folder, "run"), exist_ok=True)
    for name in names:
        with open(os.path.join(folder, "run", f"{name}.pid"), "w") as fh:
            fh.write(f"{pid}\n")


# ---- private folders ---------------------------------------------------------------------------------------

def private_dir(path, check=False):
    return subprocess.run(["bash", "-c", f'. "{LOCAL}/private.sh"; private_dir "test folder" "$1" {"check" if check else ""}',
                           "private_dir", str(path)], capture_output=True, text=True, timeout=30)


def test_a_new_state_folder_is_made_private(tmp_path):
    r = private_dir(tmp_path / "a" / "state")
    assert r.returncode == 0, r.stderr
    assert oct((tmp_path / "a" / "state").stat().st_mode & 0o777) == "0o700"
    assert private_dir(tmp_path / "a" / "state").returncode == 0          # ours: accepted again
    assert private_dir(tmp_path / "missing", check=True).returncode == 0
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("kind", ["mode755", "other-owner", "symlink", "file"])
def test_a_state_folder_not_ours_alone_is_refused(tmp_path, kind):
    path = tmp_path / "state"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        os.symlink(tmp_path / "elsewhere", path)
    elif kind == "file":
        path.write_text("x")
    else:
        path.mkdir(mode=0o700)
        if kind == "mode755":
            path.chmod(0o755)
        else:
            if not IS_ROOT:
                pytest.skip("needs root to give the folder to another user")
            os.chown(path, 65534, 65534)
    for check in (False, True):
        r = private_dir(path, check)
        assert r.returncode == 2, r
        assert str(path) in r.stderr and "another user's" in r.stderr


@pytest.mark.parametrize("kind", ["mode755", "other-owner"])
def test_start_refuses_a_state_folder_not_ours_and_leaves_its_key(tmp_path, kind):
    state = tmp_path / "slurm"
    (state / "munge").mkdir(parents=True, mode=0o700)
    key = state / "munge" / "munge.key"
    key.write_bytes(b"their key" * 128)
    state.chmod(0o755 if kind == "mode755" else 0o700)
    if kind == "other-owner":
        if not IS_ROOT:
            pytest.skip("needs root to give the folder to another user")
        os.chown(state, 65534, 65534)
    env = dict(ENV, RINGPIPE_SLURM_DIR=str(state), RINGPIPE_SLURM_PORT=str(_free_port_pair()))
    try:
        r = script("start.sh", env, timeout=120)
        assert r.returncode == 2, r
        assert str(state) in r.stderr and "RINGPIPE_SLURM_DIR" in r.stderr
        assert key.read_bytes() == b"their key" * 128
        assert not (state / "run").exists()                       # nothing was started
    finally:
        if (state / "run").exists():                               # the bug: a Slurm started there; stop it
            os.chown(state, os.geteuid(), os.getegid())
            state.chmod(0o700)
            script("stop.sh", env)


# ---- PID files name any process ------------------------------------------------------------------------------

@pytest.fixture
def no_emulated_nodes():
    # cluster.sh down also takes the emulated nodes (PREFIX-* namespaces) down: not while others use them.
    if os.path.exists(f"{NS}-sw"):
        pytest.skip("emulated nodes are up (slurm/local/nodes.sh status): not touching them")


def test_cluster_down_signals_no_process_a_pid_file_names_unless_it_is_our_daemon(decoys, no_emulated_nodes):
    folder = private_folder()
    try:
        for pid in decoys:
            plant_pids(folder, pid, ["slurmctld", "slurmd-n1", "munged"])
            env = dict(ENV, RINGPIPE_CLUSTER_DIR=folder)
            r = script("cluster.sh", env, "down", timeout=60)
            assert r.returncode == 0, r
            time.sleep(0.2)
            assert running(pid), f"cluster.sh down killed pid {pid}, a process that is not its daemon: {r.stderr}"
            assert f"not signalling pid {pid}" in r.stderr, r.stderr
            assert not os.path.exists(folder)                      # the rest of `down` still happened
            os.mkdir(folder, 0o700)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_cluster_down_refuses_a_folder_not_ours_and_touches_nothing(decoys, no_emulated_nodes, tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    plant_pids(str(folder), decoys[0], ["slurmctld", "munged"])
    r = script("cluster.sh", dict(ENV, RINGPIPE_CLUSTER_DIR=str(folder)), "down", timeout=60)
    assert r.returncode == 2, r
    assert str(folder) in r.stderr and "RINGPIPE_CLUSTER_DIR" in r.stderr
    time.sleep(0.2)
    assert running(decoys[0]) and (folder / "run" / "slurmctld.pid").exists()


def test_cluster_up_refuses_a_folder_not_ours_before_any_work(no_emulated_nodes, tmp_path):
    folder = tmp_path / "cluster"
    folder.mkdir()
    folder.chmod(0o755)
    env = dict(ENV, RINGPIPE_CLUSTER_DIR=str(folder))
    try:
        r = script("cluster.sh", env, "up", "--nodes", "1", timeout=300)
        assert r.returncode == 2, r
        assert str(folder) in r.stderr and not os.path.exists(f"{NS}-sw")
    finally:
        if os.path.exists(f"{NS}-sw"):                     # the bug: it came up; take it down
            folder.chmod(0o700)
            script("cluster.sh", env, "down", timeout=120)


def test_stop_signals_no_process_a_pid_file_names_unless_it_is_our_daemon(decoys):
    folder = private_folder()
    try:
        for pid in decoys:                                         # the second is named slurmctld
            plant_pids(folder, pid, ["slurmctld", "slurmd", "munged"])
            r = script("stop.sh", dict(ENV, RINGPIPE_SLURM_DIR=folder, STOP_WAIT="5"), timeout=60)
            assert r.returncode == 0, r
            time.sleep(0.2)
            assert running(pid), f"stop.sh signalled pid {pid}, a process that is not its daemon: {r.stderr}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the munge key -------------------------------------------------------------------------------------------

def _free_port_pair():
    return free_port_pair(16917)


@pytest.mark.slurm
def test_start_makes_a_fresh_munge_key_and_stop_still_stops_its_daemons():
    if shutil.which("slurmctld") is None and not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("Slurm is not installed: apt-get install -y slurm-wlm munge")
    folder = private_folder()
    os.makedirs(os.path.join(folder, "munge"), mode=0o700)
    key = os.path.join(folder, "munge", "munge.key")
    with open(key, "wb") as fh:
        fh.write(b"a key someone left" * 60)
    os.chmod(key, 0o400)
    env = dict(ENV, RINGPIPE_SLURM_DIR=folder, RINGPIPE_SLURM_PORT=str(_free_port_pair()))
    pids = []
    try:
        r = script("start.sh", env, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"local Slurm did not start (start.sh exit {r.returncode}): {r.stderr.strip()[-800:]}")
        assert r.stdout.strip() == f"export SLURM_CONF={os.path.realpath(folder)}/slurm.conf"
        with open(key, "rb") as fh:
            assert fh.read() != b"a key someone left" * 60, "start.sh reused the munge key it found"
        for name in ("munged", "slurmctld", "slurmd"):
            with open(os.path.join(folder, "run", f"{name}.pid")) as fh:
                pids.append(int(fh.read().strip()))
        r = script("start.sh", env, timeout=120)                   # idempotent: its daemons are recognised
        assert r.returncode == 0 and "already running" in r.stderr, r
    finally:
        script("stop.sh", dict(env, RINGPIPE_SLURM_PURGE="1"), timeout=120)
    assert pids and not any(running(p) for p in pids), "stop.sh left a daemon running"
    assert not os.path.exists(folder)
