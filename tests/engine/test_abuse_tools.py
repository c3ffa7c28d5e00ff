"""Issue 20, the tools' side: what `ringpipe finished`, the run directory and the collective
tools do with files and signals they should not trust.

  - `ringpipe finished` reads its markers bounded and checked: a huge "ranks" does not
    spin, a marker linked to /dev/zero is not read, bad values are exit 2 naming the file
  - OUT/run.lock and OUT/metrics.jsonl are never written through a symbolic link
  - Ctrl-C (or an error) on one rank of a collective tool ends the whole job in seconds
"""
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from ringpipe.engine.job import rundir
from ringpipe.engine.data.prepare import OneProcess        # a one-rank world without MPI
from tests.support import MPIEXEC, ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def _limit_memory():
    # A reader that reads /dev/zero whole (the bug) dies here at 2 GB instead of taking the machine.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def finished_cli(*args, timeout=30):
    """`ringpipe finished ARGS` in a process of its own, memory-capped, with a deadline:
    the bugs this file pins down spun forever or ate the machine's memory."""
    try:
        return subprocess.run([sys.executable, "-m", "ringpipe", "finished", *map(str, args)], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=timeout, preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`ringpipe finished {' '.join(map(str, args))}` was still running after {timeout} s")


def marker(out, which, **fields):
    """OUT/finished/rank{which}.json as a 2-rank run writes it, but for `fields`."""
    folder = out / "finished"
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"rank": which, "ranks": 2, "step": 5, "host": "h", "pid": 1, "time": 0.0}
    rec.update(fields)
    (folder / f"rank{which}.json").write_text(json.dumps(rec))
    return folder / f"rank{which}.json"


# ---- ringpipe finished ---------------------------------------------------------------------------

def test_sound_markers_still_say_finished_or_not(tmp_path):
    marker(tmp_path, 0)
    assert rundir.main([str(tmp_path)]) == 1                 # rank 1 has none
    marker(tmp_path, 1)
    assert rundir.main([str(tmp_path)]) == 0
    assert rundir.main([str(tmp_path), "--ranks", "2"]) == 0
    ok, message = rundir.finished(str(tmp_path), 3)
    assert not ok and "1 of 3 rank(s) never finished (no marker: 2)" in message
    assert "the markers say the run had 2 rank(s)" in message


def test_a_huge_rank_count_in_a_marker_does_not_spin(tmp_path):
    marker(tmp_path, 0, ranks=10 ** 12)            # used to loop over range(10**12)
    r = finished_cli(tmp_path, timeout=20)
    assert r.returncode == 2, r
    assert "rank0.json" in r.stderr and '"ranks"' in r.stderr and "Traceback" not in r.stderr


def test_a_marker_linked_to_dev_zero_is_not_read(tmp_path):
    (tmp_path / "finished").mkdir()
    os.symlink("/dev/zero", tmp_path / "finished" / "rank0.json")     # was read until OOM-killed (23.8 GB)
    r = finished_cli(tmp_path, "--ranks", 1, timeout=20)
    assert r.returncode == 2, r
    assert "rank0.json" in r.stderr and "not a regular file" in r.stderr


def test_an_oversized_marker_is_refused(tmp_path):
    path = marker(tmp_path, 0, ranks=1)
    path.write_text(json.dumps({"rank": 0, "ranks": 1, "step": 1, "pad": "x" * (64 << 10)}))
    r = finished_cli(tmp_path)
    assert r.returncode == 2 and "rank0.json" in r.stderr and "more than" in r.stderr, r


@pytest.mark.parametrize("fields, why", [
    ({"ranks": "2"}, '"ranks" is "2"'),
    ({"ranks": 2.0}, '"ranks" is 2.0'),
    ({"ranks": 1e12}, '"ranks" is 1000000000000.0'),
    ({"ranks": 0}, '"ranks" is 0'),
    ({"ranks": True}, '"ranks" is true'),
    ({"rank": "0"}, '"rank" is "0"'),
    ({"rank": 5}, '"rank" is 5'),                  # outside 0..ranks-1
    ({"step": -1}, '"step" is -1'),
    ({"step": "10"}, '"step" is "10"'),
    ({"step": None}, '"step" is null'),
])
def test_bad_marker_fields_are_exit_2_naming_the_file(tmp_path, fields, why):
    marker(tmp_path, 0, **fields)
    marker(tmp_path, 1)
    r = finished_cli(tmp_path)
    assert r.returncode == 2, r
    assert why in r.stderr and "rank0.json" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("content, why", [("[1, 2]", "not a JSON object"), ("{", "not valid JSON"),
                                          ('{"rank": 1, "ranks": 2, "step": 0}', "its name says rank 0")])
def test_marker_that_is_not_one_is_exit_2(tmp_path, content, why):
    marker(tmp_path, 0).write_text(content)
    r = finished_cli(tmp_path)
    assert r.returncode == 2 and why in r.stderr and "rank0.json" in r.stderr, r


def test_markers_of_different_runs_are_exit_2(tmp_path):
    marker(tmp_path, 0, ranks=2)
    marker(tmp_path, 1, ranks=3)
    r = finished_cli(tmp_path)
    assert r.returncode == 2 and "disagree" in r.stderr, r


def test_a_marker_beyond_the_ranks_given_is_exit_2(tmp_path):
    marker(tmp_path, 0)
    marker(tmp_path, 1)
    r = finished_cli(tmp_path, "--ranks", 1)
    assert r.returncode == 2 and "rank1.json" in r.stderr, r


@pytest.mark.parametrize("ranks", ["-1", "0", str((1 << 20) + 1)])
def test_bad_ranks_flag_is_exit_2(tmp_path, ranks):
    marker(tmp_path, 0)
    r = finished_cli(tmp_path, "--ranks", ranks)
    assert r.returncode == 2 and f"--ranks {ranks}: must be a whole number" in r.stderr, r


@pytest.mark.parametrize("ranks", [None, "-1", "2"])
def test_a_missing_run_folder_is_exit_2_not_success(tmp_path, ranks):
    # `--ranks -1` on a missing folder used to say "all -1 rank(s) finished" and exit 0.
    args = [tmp_path / "nowhere"] + ([] if ranks is None else ["--ranks", ranks])
    r = finished_cli(*args)
    assert r.returncode == 2, r
    assert ("nowhere" in r.stderr and "does not exist" in r.stderr) or "--ranks -1: must be" in r.stderr, r


def test_the_markers_folder_as_a_file_is_exit_2(tmp_path):
    (tmp_path / "finished").write_text("x")
    r = finished_cli(tmp_path)
    assert r.returncode == 2 and "is not a folder" in r.stderr, r


def test_temp_files_of_a_killed_write_are_not_markers(tmp_path):
    marker(tmp_path, 0, ranks=1)
    (tmp_path / "finished" / "rank0.json.tmp99").write_text("{")
    assert rundir.main([str(tmp_path)]) == 0


# ---- the run directory's own files -----------------------------------------------------------------

def test_run_lock_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("my notes\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(target, out / "run.lock")
    with pytest.raises(rundir.RunDirError, match="symbolic link"):
        rundir.RunDir(str(out)).lock()
    assert target.read_text() == "my notes\n"


def test_training_refuses_a_linked_run_lock_with_exit_2(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("my notes\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(target, out / "run.lock")
    r = subprocess.run([sys.executable, "-m", "ringpipe", "train", "--data", "synthetic", "--layers", "1",
                        "--d-model", "8", "--heads", "2", "--context", "8", "--batch-size", "2", "--steps", "1",
                        "--sample-tokens", "0", "--quiet", "--out", str(out)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r
    assert "run.lock" in r.stderr and "symbolic link" in r.stderr, r.stderr
    assert target.read_text() == "my notes\n"                 # was truncated and overwritten with the owner


def test_run_lock_as_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "run.lock")
    with pytest.raises(rundir.RunDirError, match="named pipe"):
        rundir.RunDir(str(tmp_path)).lock()


@pytest.mark.parametrize("content", ["7", '"text"', '{"host": 5}', '{"host": "HOST", "pid": 1e300}',
                                     '{"host": "HOST", "pid": 100000000000000000000000}',
                                     '{"host": "HOST", "pid": true, "command": "\\u001b[2J"}'])
def test_a_stale_lock_saying_anything_is_taken_over(tmp_path, content):
    (tmp_path / "run.lock").write_text(content.replace("HOST", socket.gethostname()))
    d = rundir.RunDir(str(tmp_path))
    notes = d.lock()                                            # used to raise TypeError/OverflowError
    d.unlock()
    assert notes and "stale lock" in notes[0] and "\x1b" not in notes[0]


def test_metrics_log_as_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("my notes")                                 # no newline: a resume would cut it
    os.symlink(target, tmp_path / "metrics.jsonl")
    for append in (False, True):
        with pytest.raises(rundir.RunDirError, match="symbolic link"):
            rundir.MetricsLog(str(tmp_path / "metrics.jsonl"), append=append)
    assert target.read_text() == "my notes"


def test_metrics_log_without_line_breaks_is_refused_not_read_backwards_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with open(path, "wb") as fh:
        fh.truncate(3 << 20)             # sparse: zeros, no newline
    with pytest.raises(rundir.RunDirError, match="no line break"):
        rundir.MetricsLog(str(path), append=True)
    assert path.stat().st_size == 3 << 20


def test_metrics_torn_tail_is_still_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"st')
    log = rundir.MetricsLog(str(path), append=True)
    log.write({"step": 3})
    log.close()
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert log.notes and "torn line (4 bytes" in log.notes[0]


# ---- a signal to one rank of a collective tool ends the job ------------------------------------------

def _corpus(folder, files=8, words_per_file=150_000):
    """Text that `prepare --tokenizer bpe:4000` takes several seconds over (rank 0 trains the
    tokenizer on all of it while the other ranks wait), made once per test."""
    import random
    rng = random.Random(1)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    folder.mkdir()
    for i in range(files):
        (folder / f"f{i}.txt").write_text(" ".join(rng.choice(vocab) for _ in range(words_per_file)))
    return folder


def _rank_pids(mpiexec_pid):
    from benchmarks.fault_matrix import rank_pids
    return rank_pids(mpiexec_pid, b"prepare")


def _when_working(proc, out, ranks, timeout=120):
    """The ranks' pids once prepare has made its parts folder (past start-up: the signal
    handling is in place, and the tokenizer is being trained)."""
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            pytest.fail(f"prepare ended before the signal: {proc.communicate()}")
        parts = out.is_dir() and any(n.startswith(".prepare-parts-") for n in os.listdir(out))
        pids = _rank_pids(proc.pid) if ranks > 1 else [proc.pid]
        if parts and len(pids) == ranks:
            time.sleep(0.3)
            return pids
        time.sleep(0.05)
    pytest.fail("prepare did not start working")


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")
@pytest.mark.parametrize("victim, sig", [(1, signal.SIGINT), (0, signal.SIGTERM)])
def test_a_signal_to_one_rank_of_prepare_ends_the_whole_job(tmp_path, victim, sig):
    # Rank 1 waits while rank 0 trains the tokenizer; SIGINT to rank 1 alone used to end
    # rank 1 only, and rank 0 then waited for it forever in the next collective.
    corpus, out = _corpus(tmp_path / "corpus"), tmp_path / "out"
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "ringpipe", "prepare", str(corpus),
                             "--out", str(out), "--tokenizer", "bpe:4000", "--quiet"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = _when_working(proc, out, 2)
        t0 = time.time()
        os.kill(pids[victim], sig)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job was still running 15 s after {sig.name} to rank {victim}")
        assert time.time() - t0 < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert f"ringpipe prepare: rank {victim} interrupted by {sig.name}; ending the job" in err, err
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert not (out / "data.json").exists()          # no dataset claimed; the parts folder the next run removes


def test_a_signal_to_a_one_rank_prepare_runs_its_cleanup(tmp_path):
    # One rank: KeyboardInterrupt (ToolInterrupted), so prepare removes its parts folder;
    # SIGTERM used to kill it outright and leave the folder behind.
    corpus, out = _corpus(tmp_path / "corpus"), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ringpipe", "prepare", str(corpus), "--out", str(out),
                             "--tokenizer", "bpe:4000", "--quiet"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _when_working(proc, out, 1)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode > 0, (proc.returncode, err)          # a return, not death by the signal
    assert "interrupted by SIGTERM" in err, err
    assert not out.exists() or not [n for n in os.listdir(out) if n.startswith(".prepare-parts-")]


def test_end_job_on_signal_one_rank_raises_keyboard_interrupt_with_the_exit_code():
    from ringpipe.engine.job import lifecycle

    restore = lifecycle.end_job_on_signal(OneProcess(), "ringpipe test")
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)                              # the handler raises in here
        assert isinstance(caught.value, lifecycle.ToolInterrupted) and caught.value.exit_code == 143
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None) or callable(signal.getsignal(signal.SIGTERM))


def test_a_signal_during_start_up_is_held_then_acted_on():
    # Before MPI is up a KeyboardInterrupt would end this rank alone (in an import, or in
    # MPI_Init), and the job hung in MPI_Finalize; held, it is acted on once the tool can end the job.
    from ringpipe.engine.job import lifecycle

    saved = {s: signal.getsignal(s) for s in lifecycle.TOOL_SIGNALS}
    try:
        lifecycle.hold_signals()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)                               # nothing is raised: the signal is only noted
        with pytest.raises(lifecycle.ToolInterrupted) as caught:
            lifecycle.end_job_on_signal(OneProcess(), "ringpipe test")
        assert caught.value.exit_code == 130
    finally:
        for s, old in saved.items():
            signal.signal(s, old)


@pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")
def test_a_signal_to_one_rank_while_prepare_starts_ends_the_job(tmp_path):
    # SIGINT 220 ms into `mpiexec -n 2 ringpipe prepare` reached rank 0 while it imported
    # ringpipe.comm (MPI_Init done, no handler yet): it left, and the job hung. Signal soon
    # after the ranks appear, a few times, so that some land in start-up. (Not in the first
    # ~20 ms of the interpreter, before any ringpipe code runs: Python itself aborts there,
    # "Fatal Python error: init_import_site", and MPICH's proxy was seen not to report that
    # rank's end, leaving the other in MPI_Init; the README says so.)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("start-up " * 2000)
    for attempt, delay in enumerate((0.05, 0.1, 0.2)):
        out = tmp_path / f"out{attempt}"
        proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "ringpipe", "prepare", str(corpus),
                                 "--out", str(out), "--quiet"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            end = time.time() + 30
            while len(_rank_pids(proc.pid)) < 2 and time.time() < end and proc.poll() is None:
                time.sleep(0.002)
            time.sleep(delay)
            pids = _rank_pids(proc.pid)
            if pids:
                os.kill(pids[0], signal.SIGINT)
            try:
                output, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job was still running 20 s after SIGINT to rank 0 ({delay} s after it appeared)")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        if pids and proc.returncode:                   # not finished before the signal: it says why it ended
            assert "interrupted by SIGINT" in output or "KeyboardInterrupt" in output, output[-2000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    r = subprocess.run([sys.executable, "-m", "ringpipe", "train", "--data", "synthetic", "--layers", "1",
                        "--d-model", "8", "--heads", "2", "--context", "8", "--batch-size", "2", "--steps", "1",
                        "--sample-tokens", "0", "--quiet", "--out", str(out)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r
    return out


@pytest.mark.parametrize("module", ["ringpipe.engine.interop.sample", "ringpipe.engine.interop.hf"])
def test_sample_and_export_run_no_collectives(trained, tmp_path, module):
    # `mpiexec -n 2 ringpipe sample|export` is N independent processes: no MPI, so no rank
    # can wait in a collective for another that failed (end_job_on_signal is not needed;
    # hydra lets the others run to their own end).
    args = [str(trained), "--tokens", "2"] if module.endswith("sample") else [str(trained), "--out",
                                                                               str(tmp_path / "hf")]
    code = (f"import sys, {module} as m\n"
            f"rc = m.main({args!r})\n"
            "print(rc, 'mpi4py' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.stdout.strip().splitlines()[-1] in ("0 False", "None False"), r
