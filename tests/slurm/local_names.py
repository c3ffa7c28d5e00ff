"""The names slurm/local/*.sh derive per user (folders, port, network namespaces), read
from slurm/local/names.sh itself: the scripts and the tests share one rule. Also how the
tests run those scripts (script) and see whether a daemon they started still runs (running)."""
import os
import subprocess

from tests.support import ROOT

LOCAL = os.path.join(ROOT, "slurm", "local")
NAMES_SH = os.path.join(LOCAL, "names.sh")


def local_names(env=None) -> dict:
    """{"RINGPIPE_SLURM_DIR": ..., "RINGPIPE_NETNS_PREFIX": ..., ...} as the scripts would use
    them under env (default: this process's environment)."""
    r = subprocess.run(["bash", NAMES_SH], env=env, capture_output=True, text=True, timeout=30, check=True)
    return dict(line.split("=", 1) for line in r.stdout.splitlines())


def own_prefix(kind: str) -> str:
    """A namespace prefix of this test process's own (`rp` + kind + pid, at most 12 characters):
    emulated nodes a test brings up never meet a user's (rpUID-*) nor another test run's."""
    return f"rp{kind}{os.getpid()}"[:12]


def script(name, env, *args, timeout=120, wrapper=()):
    """Run slurm/local/<name> under env (`wrapper`: a launcher before bash, e.g. timeout)."""
    return subprocess.run([*wrapper, "bash", os.path.join(LOCAL, name), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def running(pid) -> bool:
    """Is process `pid` alive (not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
