"""Faults during a sharded save, written at once or in the background (--checkpoint-async), to
real 2-rank jobs: SIGKILL of a rank while the ranks write their files; SIGKILL of rank 0 inside
the commit, after the rank files' folder is renamed into place and before the manifest is;
SIGTERM while the ranks write; a disk that fills up during the save. Each time the checkpoint
before it is intact and is the one `--resume auto` picks (SIGTERM: the save is finished and is
the stop's checkpoint, or, in the background, committed before the stop's), no half-written
checkpoint is ever picked, what the fault left (`ckpt_S.shards.tmp`, a `ckpt_S.shards` no
manifest names, the manifest's temp file) is removed by the next run, which ends bit-identical
to an uninterrupted run, and the exit code tells the truth (the launcher's for SIGKILL, 85
naming the checkpoint for SIGTERM, 1 saying the previous checkpoints are intact for a full
disk). benchmarks/fault_matrix.py's sharded-* and async-* scenarios do the same with random
timing and victims."""
import os
import signal
import subprocess

import pytest

from benchmarks import fault_matrix
from ringpipe.engine.job import checkpoint, sharded
from ringpipe.engine.job.lifecycle import REQUEUE_EXIT_CODE
from tests.support.hostile import tmpfs

pytestmark = pytest.mark.skipif(not os.path.exists(fault_matrix.MPIEXEC), reason="no mpiexec next to this python")

# A checkpoint of ~155 MB (a 77 MB file a rank): one save takes ~0.3-0.6 s on 2 cores, ~1 s in
# the background, so a signal sent when the first rank file appears lands inside it.
STEPS, EVERY = 8, 2
FIRST, SECOND = EVERY, 2 * EVERY             # the fault meets the second save; the first must survive it
assert fault_matrix.SAVE_MODEL[-2] == "--decay-steps"
MODEL = [*fault_matrix.SAVE_MODEL[:-1], str(STEPS)]       # the matrix's model, on this run's schedule
LONG = 10**6                                 # a run the fault stops (same schedule: --decay-steps)


def flags(how):
    return ["--checkpoint-every", str(EVERY), "--keep", "0"] + (["--checkpoint-async"] if how == "async" else [])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its final parameters and the size of one checkpoint (its last)."""
    out = str(tmp_path_factory.mktemp("reference") / "run")
    rc, output = fault_matrix.run_to_end(out, steps=STEPS, model=MODEL, deadline=120)
    assert rc == 0, output[-3000:]
    last = manifest(out, STEPS)
    size = os.path.getsize(last) + sum(os.path.getsize(os.path.join(last[:-5] + ".shards", name))
                                       for name in os.listdir(last[:-5] + ".shards"))
    return {"params": fault_matrix.params(out), "ckpt_bytes": size}


def ckpt_of(out):
    return os.path.join(out, "checkpoints")


def manifest(out, step):
    return checkpoint.manifest_path(ckpt_of(out), step)


def assert_only_whole_checkpoints(out, *steps):
    """The checkpoints are exactly `steps`, each valid; no manifest names a half-written one."""
    valid, invalid = checkpoint.scan(ckpt_of(out))
    assert not invalid, invalid
    assert valid == [manifest(out, s) for s in steps], valid
    assert checkpoint.find_latest(ckpt_of(out)) == manifest(out, steps[-1])


def resume_is_bit_identical(out, how, reference, at, left):
    """The next run removes what the fault left (`left`), resumes from step `at` and ends as the
    uninterrupted run did."""
    rc, output = fault_matrix.run_to_end(out, "--resume", "auto", *flags(how), steps=STEPS, model=MODEL,
                                         deadline=120)
    assert rc == 0, output[-3000:]
    assert f"resumed from {manifest(out, at)} at step {at}" in output, output[-3000:]
    if left:
        assert f"removed {len(left)} temp file(s) left by an interrupted checkpoint write: {', '.join(left)}" \
            in output, output[-3000:]
    assert not fault_matrix.leftovers(ckpt_of(out))
    assert fault_matrix.same_as(reference["params"], out)


def signal_during_second_save(out, how, sig, victim, deadline=60):
    """Start a long run, send `sig` to rank `victim` as soon as the second save's first rank file
    exists. Returns (exit code, output)."""
    proc = fault_matrix.launch(out, *flags(how), steps=LONG, model=MODEL)
    try:
        assert fault_matrix.wait_for_save(ckpt_of(out), FIRST, proc), "the first save was not seen"
        pids = fault_matrix.rank_pids_by_rank(proc.pid)
        assert fault_matrix.wait_for_save(ckpt_of(out), SECOND, proc), "the second save was not seen"
        os.kill(pids[victim], sig)
        # The signal was sent while the save was under way: its temp folder was still there after it.
        assert os.path.isdir(os.path.join(ckpt_of(out), sharded.temp_folder_name(SECOND)))
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    rc, output, _, ended = fault_matrix.finish(proc, deadline)
    assert ended, f"the job was still running {deadline} s after the {sig.name}"
    return rc, output


@pytest.mark.parametrize("how,victim", [("sharded", 1), ("async", 0)])
def test_sigkill_while_the_ranks_write_keeps_the_previous_checkpoint_newest(tmp_path, reference, how, victim):
    out = str(tmp_path / "run")
    rc, output = signal_during_second_save(out, how, signal.SIGKILL, victim)
    # Once in ~160 kills (the fault matrix's first run) the other rank's MPI_Abort came before
    # MPICH's report of the kill: the job still failed, claimed no checkpoint and lost nothing.
    assert rc not in (0, REQUEUE_EXIT_CODE, 130), (rc, output[-2000:])
    assert "signal 9" in output.lower() or "abort" in output.lower(), (rc, output[-2000:])
    assert "exiting with code" not in output            # no rank claims a checkpoint
    assert_only_whole_checkpoints(out, FIRST)
    left = fault_matrix.leftovers(ckpt_of(out))
    assert left == [sharded.temp_folder_name(SECOND)], left
    resume_is_bit_identical(out, how, reference, FIRST, left)


@pytest.mark.parametrize("how", ["sharded", "async"])
def test_sigkill_inside_the_commit_leaves_a_folder_no_manifest_names_and_it_is_never_picked(tmp_path, reference,
                                                                                           how):
    """Rank 0 dies (an LD_PRELOAD shim's SIGKILL) when it renames the manifest into place: the
    rank files' folder is already ckpt_S.shards, the manifest is still its temp file."""
    shim = fault_matrix.kill_at_rename_shim(str(tmp_path))
    if shim is None:
        pytest.skip("no C compiler to build the LD_PRELOAD shim")
    out = str(tmp_path / "run")
    proc = fault_matrix.launch_killed_at_rename(out, shim, manifest(out, SECOND), *flags(how), steps=LONG, model=MODEL)
    rc, output, _, ended = fault_matrix.finish(proc, 120)
    assert ended
    assert rc not in (0, REQUEUE_EXIT_CODE, 130) and "signal 9" in output.lower(), (rc, output[-2000:])
    folder = os.path.join(ckpt_of(out), sharded.folder_name(SECOND))
    assert os.path.isdir(folder) and len(os.listdir(folder)) == 2      # every rank file, in place
    assert_only_whole_checkpoints(out, FIRST)                            # but nothing names them
    left = fault_matrix.leftovers(ckpt_of(out))
    assert len(left) == 2 and left[1] == sharded.folder_name(SECOND), left
    assert left[0].startswith(os.path.basename(manifest(out, SECOND)) + ".tmp."), left
    resume_is_bit_identical(out, how, reference, FIRST, left)


@pytest.mark.parametrize("how,victim", [("sharded", 0), ("async", 1)])
def test_sigterm_while_the_ranks_write_finishes_the_save_and_exits_85_naming_it(tmp_path, reference, how, victim):
    out = str(tmp_path / "run")
    rc, output = signal_during_second_save(out, how, signal.SIGTERM, victim)
    stopped = int(os.path.basename(checkpoint.find_latest(ckpt_of(out)))[5:13])
    assert rc == REQUEUE_EXIT_CODE, (rc, output[-2000:])
    assert f"SIGTERM received: checkpoint at step {stopped} written; exiting with code 85" in output
    assert f"SIGTERM to rank {victim}" in output
    if how == "sharded":
        assert stopped == SECOND                     # the save it met is finished and is the stop's
        assert_only_whole_checkpoints(out, FIRST, SECOND)
    else:
        # The save in the background is committed first, then the stop's at the next step boundary.
        assert SECOND <= stopped < STEPS, stopped
        assert_only_whole_checkpoints(out, FIRST, SECOND, *([stopped] if stopped != SECOND else []))
    assert not fault_matrix.leftovers(ckpt_of(out))
    resume_is_bit_identical(out, how, reference, stopped, [])


@pytest.mark.parametrize("how", ["sharded", "async"])
def test_disk_full_during_a_save_exits_1_saying_the_previous_checkpoints_are_intact(tmp_path, reference, how):
    """--out on a disk of 1.5 checkpoints: the first save fits, the second runs out of space."""
    disk = tmpfs(tmp_path / "disk", str(int(reference["ckpt_bytes"] * 1.5)))
    try:
        out = str(disk / "run")
        rc, output = fault_matrix.run_to_end(out, *flags(how), steps=STEPS, model=MODEL, deadline=120)
        assert rc == 1, (rc, output[-2000:])
        assert f"disk full at {ckpt_of(out)} (" in output, output[-2000:]
        assert f"the checkpoint for step {SECOND} was not written; the previous checkpoints are intact" in output
        assert "Traceback" not in output and "[Errno" not in output, output[-2000:]
        assert_only_whole_checkpoints(out, FIRST)
        assert not fault_matrix.leftovers(ckpt_of(out))     # the failed save's files are gone: the disk has room
        subprocess.run(["mount", "-o", "remount,size=2g", str(disk)], check=True)
        resume_is_bit_identical(out, how, reference, FIRST, [])
    finally:
        subprocess.run(["umount", "-l", str(disk)])
