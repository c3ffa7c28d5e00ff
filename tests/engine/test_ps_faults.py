"""Whole-job behaviour of dedicated parameter servers (`--sync ps --ps-servers 1`) under
faults: a 3-rank mpiexec job (workers 0 and 1, server 2) of a tiny GPT, once it trains,
loses the server or a worker to SIGKILL, or the server raises; each time the whole job
must end within seconds, with a non-zero exit code, its output naming the rank."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.fault_matrix import rank_pids

from tests.support import MPI_SCRIPTS, MPIEXEC, ROOT
from tests.engine.test_faults import ENV, TINY, ends_within, wait_for_steps

PS = ["--sync", "ps", "--ps-servers", "1", "--steps", "100000"]    # stopped by the fault, long before the end
BOUND_S = 60                     # from the fault to the end of the job, as test_faults.py bounds its own
SERVER, WORKER = 2, 1

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")


def pids_by_rank(proc) -> dict[int, int]:
    """{rank: pid} of a job's python ranks, from the PMI_RANK hydra gives each (rank_pids'
    order is the pids', not the ranks')."""
    ranks = {}
    for pid in rank_pids(proc.pid):
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
        ranks[int(env[b"PMI_RANK"])] = pid
    return ranks


def killed_job(tmp_path_factory, rank: int) -> dict:
    """Train with a dedicated server, SIGKILL `rank` once two steps are logged: how the job ended."""
    out = str(tmp_path_factory.mktemp(f"killed{rank}"))
    p = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, "-m", "ringpipe.train", *TINY, *PS, "--out", out],
                         cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 2, p)
    pids = pids_by_rank(p)
    assert sorted(pids) == [0, 1, 2], pids
    t0 = time.time()
    os.kill(pids[rank], signal.SIGKILL)
    stdout, stderr = ends_within(p, BOUND_S, f"rank {rank} was killed")
    return dict(seconds=time.time() - t0, code=p.returncode, output=stdout + stderr, pid=pids[rank])


@pytest.fixture(scope="module", params=[SERVER, WORKER], ids=["server", "worker"])
def killed(request, tmp_path_factory):
    """One job per killed rank, shared by the test of its end and the test of its message."""
    return dict(killed_job(tmp_path_factory, request.param), rank=request.param)


def test_a_killed_server_or_worker_ends_the_job_quickly(killed):
    assert killed["seconds"] < BOUND_S
    assert killed["code"] != 0, killed
    assert "signal 9" in killed["output"], killed["output"][-2000:]


@pytest.mark.xfail(strict=True, reason=(
    "nothing names the killed rank: MPICH's mpiexec prints 'Killed (signal 9)' and the PID of whichever rank "
    "its cleanup saw end first (seen: rank 1's PID when rank 2, the server, was killed), no rank number; the "
    "other ranks are killed by that cleanup within ~0.1 s, before any ringpipe code could notice the silent "
    "peer and say so (the server's OUT/logs/rankR.log says what it served, not that it died)"))
def test_a_killed_server_or_worker_is_named(killed):
    # "rank R" as a word of its own (the start-up lines say "on dedicated rank 2" and "on rank 0").
    assert re.search(rf"(?<!dedicated )\brank {killed['rank']}\b(?!/)", killed["output"]), killed["output"][-2000:]


def test_an_exception_in_the_server_aborts_the_job_naming_the_server(tmp_path):
    out, trigger = str(tmp_path / "run"), str(tmp_path / "fail-now")
    p = subprocess.Popen([MPIEXEC, "-n", "3", sys.executable, os.path.join(MPI_SCRIPTS, "ps_server_fails.py"),
                          trigger, *TINY, *PS, "--out", out],
                         cwd=ROOT, env=dict(ENV, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    wait_for_steps(out, 2, p)
    t0 = time.time()
    open(trigger, "w").close()               # the server raises at its next step
    stdout, stderr = ends_within(p, BOUND_S, "the server raised")
    assert time.time() - t0 < BOUND_S
    assert p.returncode != 0, (p.returncode, stderr[-2000:])
    output = stdout + stderr
    assert "[ringpipe rank 2/3 on " in output, output[-2000:]           # the abort handler's line
    assert "error: parameter server rank 2 failed after serving " in output, output[-2000:]    # serve()'s
    assert "RuntimeError: deliberate failure of the parameter server" in output, output[-2000:]
