"""engine.job.lifecycle: stop flag, launcher check, watchdog, per-rank logging.

Serial:   python -m pytest tests/engine/job/test_lifecycle.py -m "not mpi"
MPI:      mpiexec -n 2 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/job/test_lifecycle.py
          (also under -n 4: the stuck / signalled rank is always the last one)
"""
import io
import logging
import os
import signal
import tempfile
import threading
import time

import pytest

from ringpipe.engine.job import lifecycle
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.job.lifecycle import LauncherError, REQUEUE_EXIT_CODE, StopFlag, Watchdog, check_launcher


class FakeComm:
    def __init__(self, size=1, rank=0):
        self._size, self._rank = size, rank

    def Get_size(self):
        return self._size

    def Get_rank(self):
        return self._rank


MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\n"
OMPI = "Open MPI v5.0.3, package: Open MPI ..., Apr 08, 2024\n"


# ---------------------------------------------------------------------------- StopFlag

def test_requeue_exit_code():
    assert REQUEUE_EXIT_CODE == 85


def test_stopflag_signal_sets_flag_only():
    from mpi4py import MPI
    before = signal.getsignal(signal.SIGUSR1)
    with StopFlag() as stop:
        assert not stop.requested and stop.signal_name is None
        assert stop.should_stop(MPI.COMM_SELF) is False
        os.kill(os.getpid(), signal.SIGUSR1)     # would kill the process without the handler
        time.sleep(0.01)
        assert stop.requested and stop.signal_name == "SIGUSR1"
        assert stop.should_stop(MPI.COMM_SELF) is True
        assert stop.should_stop(MPI.COMM_SELF) is True   # stays set
    assert signal.getsignal(signal.SIGUSR1) == before     # handlers restored


def test_stopflag_sigterm_and_trigger():
    from mpi4py import MPI
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.should_stop(MPI.COMM_SELF) and stop.signal_name == "SIGTERM"
    s = StopFlag(install=False)
    s.trigger()
    assert s.should_stop(FakeComm(1)) and s.signal_name == "SIGUSR1"


def test_stopflag_handler_does_no_io(monkeypatch):
    """The handler must not print, log or call MPI: only store the number."""
    import builtins
    calls = []
    monkeypatch.setattr(builtins, "print", lambda *a, **k: calls.append(a))
    stop = StopFlag(install=False)
    stop._handler(signal.SIGUSR1, None)
    assert stop._received == signal.SIGUSR1 and not calls
    assert stop._handler.__code__.co_names == ("_received",)


@pytest.mark.mpi(min_size=2)
def test_stopflag_agreement_when_one_rank_signalled():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    with StopFlag() as stop:
        assert stop.should_stop(world) is False          # nobody signalled
        if rank == size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.01)
        world.Barrier()
        assert stop.requested == (rank == size - 1)
        assert stop.should_stop(world) is True           # every rank agrees, same call
        assert stop.signal_name == "SIGUSR1"


@pytest.mark.mpi(min_size=2)
def test_stopflag_signal_during_collective_is_seen_next_boundary():
    """A signal that lands while the main thread waits in MPI is kept for the
    next should_stop (no rank may miss it, none may see it a step earlier)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    with StopFlag() as stop:
        if rank == 0:
            t = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
            t.start()
        if rank == size - 1:
            time.sleep(0.5)          # rank 0 is blocked in the Barrier when its signal arrives
        world.Barrier()
        if rank == 0:
            t.join()
        results = [stop.should_stop(world) for _ in range(2)]
        assert results == [True, True]


# ---------------------------------------------------------------------------- check_launcher

STEP_ENV = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
            "SLURM_PROCID": "2", "SLURM_MPI_TYPE": "none"}


def test_check_launcher_refuses_singleton_under_srun_mpich():
    with pytest.raises(LauncherError) as e:
        check_launcher(FakeComm(1), environ=STEP_ENV, library_version=MPICH)
    msg = str(e.value)
    assert "srun --mpi=pmi2" in msg and "MPICH Version:      4.2.0" in msg
    assert "rank 0 of 1" in msg and "4 tasks" in msg and "none" in msg
    assert "Release date" not in msg                       # first line of the version only
    assert isinstance(e.value, ConfigError) and str(e.value) == msg   # every task prints it, exits 2


def test_check_launcher_refuses_singleton_under_srun_openmpi():
    env = dict(STEP_ENV, SLURM_MPI_TYPE="pmi2")
    with pytest.raises(LauncherError) as e:
        check_launcher(FakeComm(1), environ=env, library_version=OMPI)
    assert "srun --mpi=pmix" in str(e.value) and "Open MPI v5.0.3" in str(e.value)


@pytest.mark.parametrize("env", [
    {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "3"},            # older Slurm: no SLURM_STEP_NUM_TASKS
    {"SLURM_STEP_ID": "0", "SLURM_NPROCS": "2"},
])
def test_check_launcher_ntasks_fallbacks(env):
    with pytest.raises(LauncherError):
        check_launcher(FakeComm(1), environ=env, library_version=MPICH)


@pytest.mark.parametrize("env,size", [
    (STEP_ENV, 4),                                               # right plugin: world matches
    ({}, 1),                                                     # not under Slurm
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 1),   # the batch script itself
    (dict(STEP_ENV, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"), 1),       # srun -n 1
    (dict(STEP_ENV, RINGPIPE_SKIP_LAUNCHER_CHECK="1"), 1),      # explicit opt-out
])
def test_check_launcher_accepts(env, size):
    check_launcher(FakeComm(size), environ=env, library_version=MPICH)


def test_check_launcher_real_library_version():
    from mpi4py import MPI
    with pytest.raises(LauncherError) as e:
        check_launcher(MPI.COMM_SELF, environ=STEP_ENV)
    assert MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip() in str(e.value)
    assert "\0" not in str(e.value)


# ---------------------------------------------------------------------------- Watchdog

def test_watchdog_off_by_default(tmp_path):
    dog = Watchdog(FakeComm(1), 0, run_dir=str(tmp_path))
    assert not dog.enabled and dog._thread is None
    dog.beat(1)
    dog.stop()
    assert not (tmp_path / "heartbeat").exists()


def test_watchdog_reports_stuck_step(tmp_path):
    out = io.StringIO()
    with Watchdog(FakeComm(1), 0.3, run_dir=str(tmp_path), interval=0.05, stream=out) as dog:
        for step in range(1, 4):
            dog.beat(step)
            time.sleep(0.05)
        assert not dog.tripped
        time.sleep(0.8)                      # "hang" after step 3
        assert dog.tripped
    text = out.getvalue()
    assert "[rank 0] watchdog: no progress" in text and "stuck after step 3" in text
    assert text.count("no progress") == 1    # one report per stall, not one per poll
    assert "test_lifecycle.py" in text       # where the main thread is
    import json
    hb = json.loads((tmp_path / "heartbeat" / "rank0").read_text())
    assert hb["step"] == 3 and hb["rank"] == 0


def test_watchdog_quiet_while_beating():
    out = io.StringIO()
    with Watchdog(FakeComm(1), 0.3, interval=0.05, stream=out) as dog:
        for step in range(12):
            dog.beat(step)
            time.sleep(0.05)
    assert not dog.tripped and out.getvalue() == ""


def _hb(step, where="ring.py:10 in allreduce `comm.Sendrecv(a, b)`", in_comm=True, age=0.0):
    now = time.time()
    return {"step": step, "last_beat": now - 5, "written": now - age, "where": where,
            "in_comm": in_comm, "pid": 1, "host": "h"}


def test_watchdog_describe_ranks():
    dog = Watchdog(FakeComm(4), 0, interval=0.1)
    dog.hb_dir, dog.size = "/nonexistent", 4
    # a rank at an earlier step
    text = dog.describe_ranks({0: _hb(5), 1: _hb(5), 2: _hb(4), 3: _hb(5)})
    assert "ranks behind: 2 (rank 2 at an earlier step" in text
    # same step: the rank not in a collective
    text = dog.describe_ranks({0: _hb(5), 1: _hb(5), 2: _hb(5, "train.py:9 in step `time.sleep(9)`", False),
                               3: _hb(5)})
    assert "ranks behind: 2 (rank 2 not in a collective" in text
    # a dead rank (stale file) and a missing one
    text = dog.describe_ranks({0: _hb(5), 1: _hb(5, age=60), 2: _hb(5), 3: None})
    assert "ranks behind: 1, 3" in text and "dead or frozen" in text and "never wrote" in text
    # nobody stands out
    assert "no rank stands out" in dog.describe_ranks({r: _hb(5) for r in range(4)})


@pytest.mark.mpi(min_size=2)
def test_watchdog_names_the_rank_that_never_reached_the_collective():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    run_dir = world.bcast(tempfile.mkdtemp(prefix="ringpipe-wd-") if rank == 0 else None, root=0)
    out = io.StringIO()
    dog = Watchdog(world, 1.0, run_dir=run_dir, interval=0.1, stream=out)
    try:
        world.Barrier()
        dog.beat(1)
        if rank == size - 1:
            time.sleep(2.5)                  # never reaches the next collective in time
        world.Barrier()                      # the others wait here, main thread inside MPI
        dog.beat(2)
    finally:
        dog.stop()
    text = out.getvalue()
    if rank == 0:
        assert "stuck after step 1" in text, text
        assert f"ranks behind: {size - 1} (rank {size - 1} not in a collective" in text, text
    world.Barrier()
    if rank == 0:
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- logging

def test_setup_rank_logging(tmp_path, capfd):
    log = lifecycle.setup_rank_logging(str(tmp_path), rank=3, size=4)
    log.info("hello file")
    log.warning("careful")
    log = lifecycle.setup_rank_logging(str(tmp_path), rank=3, size=4)   # idempotent
    log.error("bad")
    for h in log.handlers:
        h.flush()
    text = (tmp_path / "logs" / "rank3.log").read_text()
    assert "hello file" in text and "[rank 3/4] WARNING" in text and text.count("bad") == 1
    err = capfd.readouterr().err
    assert "[rank 3] WARNING: careful" in err and "[rank 3] ERROR: bad" in err
    assert "hello file" not in err and err.count("bad") == 1
    # Its own two handlers, once (pytest may attach capture handlers of its own).
    assert len([h for h in log.handlers if getattr(h, "_ringpipe_rank_handler", False)]) == 2
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    logging.getLogger("ringpipe").handlers.clear()
