"""A stop signal to a dedicated parameter server (--sync ps --ps-servers 1) is the job's, as
one to a worker is, in every PS mode (sync, ssp, async, streamed): every rank stops at a step
boundary with a checkpoint and the same exit code (85, SIGINT 130), rank 0's log names the
rank that got it, and the checkpoint resumes (bit-identical where the mode repeats bit for bit).

The signal is the StopFlag's, set before the run starts (`trigger`, as its handler would), on
one rank of 2 workers + 1 server on the first 3 ranks (the fourth waits): a real signal's
delivery is tests/engine/test_ps_faults.py's, and benchmarks/fault_matrix.py's ps-signal trials.
Run with `mpiexec -n 4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_ps_signals.py` (tests/run_mpi.sh's 4-rank pass).
"""
import os
import signal

import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint, lifecycle
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

from tests.support.parity import assert_continues, job

world = MPI.COMM_WORLD
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=4, dtype="float64",
            sample_tokens=0, quiet=True, eval_every=4, eval_batches=1, grad_clip=0.05, monitor_every=0,
            tensorboard=False, sync="ps", ps_servers=1)
MODES = {"sync": {}, "ssp": dict(ps_mode="ssp:1"), "async": dict(ps_mode="async"), "streamed": dict(grad_clip=0.0)}
SERVER = 2


def train(out, signalled=None, signum=0, **settings):
    """The run on the first 3 ranks, with `signum` received by rank `signalled` before it starts;
    every rank of the world waits for it. The rank's RunResult and StopFlag (None on the fourth)."""
    comm = job(3)
    result = stop = None
    if comm is not None:
        stop = lifecycle.StopFlag(install=False)
        if comm.rank == signalled:
            stop.trigger(signum)
        result = run(Config(**dict(BASE, **settings), out=out), world=comm, stop=stop)
        comm.Free()
    world.Barrier()
    return result, stop


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode,signalled,signum", [
    ("sync", SERVER, signal.SIGTERM), ("ssp", SERVER, signal.SIGUSR1), ("async", SERVER, signal.SIGINT),
    ("streamed", SERVER, signal.SIGTERM), ("async", 1, signal.SIGUSR1), ("ssp", 0, signal.SIGINT)],
    ids=["sync-server-TERM", "ssp-server-USR1", "async-server-INT", "streamed-server-TERM", "async-worker-USR1",
         "ssp-worker-INT"])
def test_a_signal_to_a_server_or_a_worker_stops_every_rank(shared_dir, mode, signalled, signum):
    if world.size != 4:
        pytest.skip("2 workers + 1 server on 3 of 4 ranks")
    tag = f"{mode}-{signalled}-{int(signum)}"
    cut, tail, whole = (os.path.join(shared_dir, f"{part}-{tag}") for part in ("cut", "tail", "whole"))
    # Every run first, the checks after: a rank that fails a check never leaves the others waiting.
    result, stop = train(cut, signalled, signum, **MODES[mode])
    stopped_at = world.bcast(result.steps_done if world.rank == 0 else None)
    resumed, _ = train(tail, resume=checkpoint.manifest_path(os.path.join(cut, "checkpoints"), stopped_at),
                    **MODES[mode])
    exact = mode in ("sync", "streamed")           # (ssp and async: another trajectory, by design)
    if exact:
        train(whole, **MODES[mode])
    if result is None:
        return
    # Every rank, the server too, ends alike: at a step before the last, with the signal's code.
    code = lifecycle.INTERRUPT_EXIT_CODE if signum == signal.SIGINT else lifecycle.REQUEUE_EXIT_CODE
    assert (result.exit_code, result.stopped_by) == (code, signal.Signals(signum).name), result
    assert 1 <= result.steps_done < BASE["steps"], result
    # A second signal from then on (lifecycle.StopFlag's escape) exits with that code, the server's too.
    assert stop.forced_exit_code == code
    assert checkpoint.read_manifest(checkpoint.find_latest(os.path.join(cut, "checkpoints")))["step"] == stopped_at
    # The stop checkpoint resumes: to the end; where the mode repeats bit for bit, as a run never stopped.
    assert (resumed.exit_code, resumed.steps_done) == (0, BASE["steps"])
    if world.rank == 0:
        with open(os.path.join(cut, "logs", "rank0.log")) as fh:
            said = fh.read()
        who = f"{signal.Signals(signum).name} to rank {signalled}" + (
            " (a parameter server)" if signalled == SERVER else "")
        assert who in said, said[-2000:]
        if exact:
            assert_continues(tail, whole, stopped_at, BASE["steps"], 0.0, f"{mode} resumed at step {stopped_at}")
