"""Per-user names of the local Slurm and the emulated nodes (issue 21): with fixed ones
(/tmp/ringpipe-slurm, port 16817, namespaces rp-*) two users of one machine collided.
slurm/local/names.sh derives them from the user (root's stay the same from run to run:
CI runs as root), each can be set, and a port in use is not taken. No Slurm, no root
needed: `id` is stood in for to be another user.
"""
import os
import shutil
import socket
import subprocess

import pytest

from tests.support import ROOT
from tests.slurm.local_names import NAMES_SH, local_names

LOCAL = os.path.join(ROOT, "slurm", "local")
OVERRIDES = ("RINGPIPE_SLURM_DIR", "RINGPIPE_SLURM_PORT", "RINGPIPE_CLUSTER_DIR", "RINGPIPE_NODES_DIR",
             "RINGPIPE_NETNS_PREFIX")
CLEAN = {k: v for k, v in os.environ.items() if k not in OVERRIDES}


def as_user(tmp_path, uid, name):
    """An environment in which `id -u` says uid and `id -un` says name."""
    bin_dir = tmp_path / f"id-{uid}"
    bin_dir.mkdir()
    (bin_dir / "id").write_text(f'#!/bin/sh\ncase "$1" in -u) echo {uid};; -un) echo "{name}";; esac\n')
    (bin_dir / "id").chmod(0o755)
    return dict(CLEAN, PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_root_gets_the_same_names_every_time(tmp_path):
    assert local_names(as_user(tmp_path, 0, "root")) == {
        "RINGPIPE_SLURM_DIR": "/tmp/ringpipe-slurm-root", "RINGPIPE_SLURM_PORT": "17000",
        "RINGPIPE_CLUSTER_DIR": "/tmp/ringpipe-cluster-root", "RINGPIPE_NODES_DIR": "/tmp/ringpipe-nodes-root",
        "RINGPIPE_NETNS_PREFIX": "rp0"}


def test_two_users_get_different_folders_port_and_namespaces(tmp_path):
    alice, bob = local_names(as_user(tmp_path, 1000, "alice")), local_names(as_user(tmp_path, 1001, "b o/b"))
    assert alice["RINGPIPE_SLURM_DIR"] == "/tmp/ringpipe-slurm-alice" and alice["RINGPIPE_NETNS_PREFIX"] == "rp1000"
    assert bob["RINGPIPE_SLURM_DIR"] == "/tmp/ringpipe-slurm-b_o_b"          # no odd characters in a path
    assert (alice["RINGPIPE_SLURM_PORT"], bob["RINGPIPE_SLURM_PORT"]) == ("19000", "19002")   # a pair each
    assert all(alice[k] != bob[k] for k in alice)
    assert local_names(CLEAN)["RINGPIPE_NETNS_PREFIX"] == f"rp{os.geteuid()}"                 # ours


def test_each_name_can_be_set(tmp_path):
    chosen = {"RINGPIPE_SLURM_DIR": str(tmp_path / "s"), "RINGPIPE_SLURM_PORT": "23456",
              "RINGPIPE_CLUSTER_DIR": str(tmp_path / "c"), "RINGPIPE_NODES_DIR": str(tmp_path / "n"),
              "RINGPIPE_NETNS_PREFIX": "mine2"}
    assert local_names(dict(CLEAN, **chosen)) == chosen


@pytest.mark.parametrize("script", ["nodes.sh", "cluster.sh"])
def test_a_namespace_prefix_that_is_not_a_short_plain_word_is_refused(script):
    for bad in ("a/b", "x" * 13, "-n"):
        r = subprocess.run(["bash", os.path.join(LOCAL, script), "status"], env=dict(CLEAN, RINGPIPE_NETNS_PREFIX=bad),
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "RINGPIPE_NETNS_PREFIX" in r.stderr and "1 to 12" in r.stderr, (bad, r)


def _listening_in_range():
    """A socket listening on a port of names.sh's range (17000..24999), the 3 after it free."""
    for port in range(24001, 24999, 7):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            for other in (port + 1, port + 2, port + 3):
                with socket.socket() as a:
                    a.bind(("127.0.0.1", other))
            return s, port
        except OSError:
            s.close()
    pytest.skip("no free port in 24001..24999 to listen on")


def test_a_port_in_use_is_passed_over_for_the_next_free_pair():
    sock, port = _listening_in_range()
    with sock:
        r = subprocess.run(["bash", "-c", f'. "{NAMES_SH}"; rp_free_port_pair {port}; rp_free_port_pair {port - 1}'],
                           capture_output=True, text=True, timeout=30)
    # From port: (port, port+1) is taken, the next pair tried is (port+2, port+3);
    # from port-1: (port-1, port) is taken too, then (port+1, port+2).
    assert r.returncode == 0 and r.stdout.split() == [str(port + 2), str(port + 1)], r


def test_start_refuses_a_chosen_port_in_use_before_starting_anything(tmp_path):
    if shutil.which("slurmctld") is None and not os.path.exists("/usr/sbin/slurmctld"):
        pytest.skip("Slurm is not installed (start.sh checks for it before the port)")
    sock, port = _listening_in_range()
    state = tmp_path / "slurm"
    with sock:
        r = subprocess.run(["bash", os.path.join(LOCAL, "start.sh")], capture_output=True, text=True, timeout=60,
                           env=dict(CLEAN, RINGPIPE_SLURM_DIR=str(state), RINGPIPE_SLURM_PORT=str(port),
                                    RINGPIPE_SLURM_NO_INSTALL="1"))
    assert r.returncode == 2 and f"port {port}" in r.stderr and "RINGPIPE_SLURM_PORT" in r.stderr, r
    assert not (state / "run").exists() and not (state / "slurm.conf").exists()
