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

from ringpipe.engine import rundir
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
                        "--sample-bytes", "0", "--quiet", "--out", str(out)],
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
