"""Whole-job behaviour under mpiexec: a signal checkpoints and exits for requeue, resume is
bit-identical; a rank killed with SIGKILL ends the job quickly instead of hanging."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.fault_matrix import rank_pids
from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.lifecycle import REQUEUE_EXIT_CODE

from tests.support import ROOT
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
TINY = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
        "--batch-size", "8", "--sample-tokens", "0", "--dtype", "float64", "--lr", "1e-3"]  # no --quiet: "resumed from" is read
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")

pytestmark = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")


def launch(out, *extra, n=2):
    return subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, "-m", "ringpipe.train", *TINY,
                             "--out", out, *extra], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ends_within(proc, seconds, what):
    """(stdout, stderr) of a job that must end within `seconds`; fails the test (and kills it) if not."""
    try:
        return proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the job was still running {seconds} s after {what}")


def wait_for_steps(out, n, proc, timeout=120):
    path = os.path.join(out, "metrics.jsonl")
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(path):
            with open(path) as fh:
                if sum(1 for _ in fh) >= n:
                    return
        if proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("job made no progress")


def final_arrays(out):
    arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
    return arrays, manifest


def test_signal_checkpoints_requeues_and_resume_is_bit_identical(tmp_path):
    steps = "60"
    whole = str(tmp_path / "whole")
    p = launch(whole, "--steps", steps)
    assert p.wait(timeout=300) == 0, p.communicate()

    cut = str(tmp_path / "cut")
    p = launch(cut, "--steps", steps)
    wait_for_steps(cut, 3, p)
    pids = rank_pids(p.pid)
    assert len(pids) == 2, pids
    os.kill(pids[-1], signal.SIGUSR1)          # one rank only: the ranks must agree anyway
    out, err = p.communicate(timeout=120)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, out, err)
    assert "SIGUSR1 received: checkpoint at step" in out
    _, manifest = final_arrays(cut)
    stopped_at = manifest["step"]
    assert 3 <= stopped_at < int(steps)

    p = launch(cut, "--steps", steps, "--resume", "auto")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "resumed from" in out and f"at step {stopped_at}" in out
    a, _ = final_arrays(whole)
    b, _ = final_arrays(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    with open(os.path.join(whole, "metrics.jsonl")) as fh:
        la = [json.loads(line)["loss"] for line in fh]
    with open(os.path.join(cut, "metrics.jsonl")) as fh:
        lb = [json.loads(line)["loss"] for line in fh]
    assert la == lb


def test_sigkill_of_one_rank_ends_the_job_quickly(tmp_path):
    out = str(tmp_path / "killed")
    p = launch(out, "--steps", "100000", n=2)
    wait_for_steps(out, 2, p)
    pids = rank_pids(p.pid)
    t0 = time.time()
    os.kill(pids[-1], signal.SIGKILL)
    ends_within(p, 30, "one rank was killed")
    assert p.returncode != 0
    assert time.time() - t0 < 30


def test_ranks_launched_with_different_flags_get_a_clear_error_not_a_hang(tmp_path):
    """MPMD launch where half the ranks get --zero 1: without a check the two halves
    would take different collective paths and deadlock."""
    args = [sys.executable, "-m", "ringpipe.train", *TINY, "--steps", "3", "--out", str(tmp_path / "m")]
    t0 = time.time()
    r = subprocess.run([MPIEXEC, "-n", "1", *args, ":", "-n", "1", *args, "--zero", "1"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert "rank 1 has --zero 1 where rank 0 has 0" in r.stderr
    assert time.time() - t0 < 60


def test_ranks_that_see_different_checkpoints_are_refused_not_hung(tmp_path):
    """--out on node-local disk: half the ranks find a checkpoint, half do not."""
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    a.mkdir()
    b.mkdir()
    args = [sys.executable, "-m", "ringpipe.train", *TINY, "--steps", "2", "--out", "run"]
    r = subprocess.run([MPIEXEC, "-n", "1", *args], cwd=str(a), env=dict(ENV, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([MPIEXEC, "-n", "1", "-wdir", str(a), *args, "--resume", "auto", ":",
                        "-n", "1", "-wdir", str(b), *args, "--resume", "auto"],
                       cwd=ROOT, env=dict(ENV, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert "ranks found different checkpoint to resume froms" not in r.stderr
    assert "rank 0: run/checkpoints/ckpt_00000002.json, rank 1: None" in r.stderr


def test_command_line_refused_on_one_rank_only_stops_every_rank(tmp_path):
    """MPMD launch where one rank's command line does not parse: that rank must not
    exit alone and leave the other waiting in its first collective."""
    args = [sys.executable, "-m", "ringpipe.train", *TINY, "--out", str(tmp_path / "m")]
    t0 = time.time()
    r = subprocess.run([MPIEXEC, "-n", "1", *args, "--steps", "2", ":", "-n", "1", *args, "--steps", "x"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert ("error: the command line failed on rank(s) [1] only (were the ranks launched with different "
            "arguments?): rank 1: ringpipe train: error: argument --steps: invalid int value: 'x'") in r.stderr
    assert time.time() - t0 < 60


def test_node_without_cupy_stops_every_rank_naming_it(tmp_path):
    """--device cuda where only rank 0 has CuPy (here the CPU emulation of it)."""
    from tests.kernels.test_cuda_kernels import _emu_env, _need_gxx
    _need_gxx()
    emu = _emu_env(str(tmp_path / "emu"), sanitize=False)
    args = [sys.executable, "-m", "ringpipe.train", *TINY, "--steps", "2", "--device", "cuda",
            "--out", str(tmp_path / "m")]
    env_args = [a for k, v in emu.items() for a in ("-env", k, v)]
    t0 = time.time()
    r = subprocess.run([MPIEXEC, "-n", "1", *env_args, *args, ":", "-n", "1", "-env", "PYTHONPATH", ROOT, *args],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert ("error: the device setup failed on rank(s) [1] only (does every node have CuPy and a visible GPU?): "
            "rank 1: --device cuda needs CuPy") in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 60
