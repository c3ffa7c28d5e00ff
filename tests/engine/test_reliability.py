"""Nothing lost, no hang: the run directory, checkpoints, signals and input under abuse.

One test per way work was lost or a job hung (each failed before its fix):
a run owns its --out (lock, clean fresh starts), only valid checkpoints count,
a poisoned update is never saved, Ctrl-C checkpoints, signals at start-up and
shutdown are kept, exit codes tell the truth, a full disk is reported, and
input that would be ignored is refused or said. The randomised fault matrix is
tests/benchmarks/test_fault_injection.py.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint, rundir
from ringpipe.engine.train.cli import run_flags
from tests.engine.test_faults import MPIEXEC, ROOT, TINY as TINY_MPI, ends_within, rank_pids, wait_for_steps
from tests.support.hostile import tmpfs
from tests.support import checkpoints

TINY = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
        "--batch-size", "4", "--sample-tokens", "0", "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
           PYTHONUNBUFFERED="1")


def run(out, *extra):
    run_flags(TINY + ["--out", str(out)] + list(extra))
    return str(out)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def ckpt_steps(out):
    return [int(os.path.basename(p)[5:13]) for p in checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))]


def params_of(out):
    arrays, _ = checkpoint.load(os.path.join(out, "checkpoints"))
    return {k: v for k, v in arrays.items() if k.startswith("param/")}


def same_params(a, b):
    pa, pb = params_of(a), params_of(b)
    return pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ringpipe.train", *TINY, *args], cwd=ROOT, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def start(*args, mpi=0):
    cmd = ([MPIEXEC, "-n", str(mpi)] if mpi else []) + [sys.executable, "-m", "ringpipe.train",
                                                       *(TINY_MPI if mpi else TINY), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ---- the run directory --------------------------------------------------------------------

def test_overwrite_moves_the_old_run_aside_so_resume_and_pruning_see_only_the_new_one(tmp_path):
    out = tmp_path / "run"
    run(out, "--layers", "2", "--steps", "8", "--checkpoint-every", "2")       # the old run: 2 layers
    run(out, "--steps", "4", "--checkpoint-every", "1", "--keep", "2", "--overwrite")
    assert ckpt_steps(str(out)) == [3, 4]                       # pruning kept the new run's, not old 6 and 8
    assert ckpt_steps(str(out / "previous")) == [4, 6, 8]       # nothing of the old run is lost
    assert [r["step"] for r in records(str(out))] == [1, 2, 3, 4]
    run(out, "--steps", "6", "--resume", "auto")                 # continues the NEW run
    assert [r["step"] for r in records(str(out))][-2:] == [5, 6]
    _, manifest = checkpoint.load(str(out / "checkpoints"))
    assert manifest["model_config"]["n_layer"] == 1


def test_overwrite_again_replaces_the_kept_previous_run(tmp_path, capsys):
    out = tmp_path / "run"
    for _ in range(3):
        run(out, "--steps", "2", "--overwrite")
    assert ckpt_steps(str(out / "previous")) == [2]
    assert not os.path.exists(out / "previous" / "previous")
    assert "replacing the run kept there before" in capsys.readouterr().out


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tmp_path):
    out = str(tmp_path / "run")
    first = start("--out", out, "--steps", "100000")
    try:
        wait_for_steps(out, 1, first)
        t0 = time.time()
        second = cli("--out", out, "--steps", "3", "--resume", "auto")
        assert second.returncode == 2, second
        assert time.time() - t0 < 60
        assert f"--out {out} is in use by another run" in second.stderr
        assert f"pid {first.pid}" in second.stderr and "running" in second.stderr
        assert first.poll() is None                              # the first run is untouched
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    lines = open(os.path.join(out, "metrics.jsonl")).read().splitlines()
    assert all(json.loads(line) for line in lines)               # every line whole


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / rundir.LOCK_NAME).write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 7,
                                                    "started": "yesterday", "command": "ringpipe-train"}))
    run(out, "--steps", "2")
    said = capsys.readouterr().out
    assert "took over a stale lock" in said and "no longer running" in said
    assert (out / rundir.LOCK_NAME).read_text() == ""            # ended cleanly: lock file emptied


def test_fresh_start_moves_metrics_of_a_run_that_saved_nothing_aside(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    run(out, "--steps", "2")
    assert (out / "previous" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert [r["step"] for r in records(str(out))] == [1, 2]


def test_torn_metrics_line_is_repaired_on_resume(tmp_path, capsys):
    out = run(tmp_path / "run", "--steps", "4", "--checkpoint-every", "2")
    os.remove(os.path.join(out, "checkpoints", "ckpt_00000004.json"))
    with open(os.path.join(out, "metrics.jsonl"), "a") as fh:
        fh.write('{"step": 5, "lo')                             # killed mid-write
    run(out, "--steps", "4", "--resume", "auto")
    assert "ended in a torn line" in capsys.readouterr().out
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4, 3, 4]


def test_stale_checkpoint_temp_files_are_removed_at_start(tmp_path):
    out = run(tmp_path / "run", "--steps", "2")
    junk = os.path.join(out, "checkpoints", "ckpt_00000003.npz.tmp.99999")
    with open(junk, "wb") as fh:
        fh.write(b"\0" * 1000)
    run(out, "--steps", "3", "--resume", "auto")
    assert not os.path.exists(junk)


# ---- checkpoints: only valid ones count -------------------------------------------------

def test_resume_auto_with_only_invalid_checkpoints_is_an_error_not_a_fresh_start(tmp_path):
    out = run(tmp_path / "run", "--steps", "2", "--checkpoint-every", "1")
    for p in checkpoint.list_checkpoints(os.path.join(out, "checkpoints")):
        checkpoints.truncate(p, 50)
    with pytest.raises(SystemExit, match="found no valid checkpoint .* only invalid ones: ckpt_00000001.json"):
        run(out, "--steps", "4", "--resume", "auto")


def test_resume_auto_skips_a_checkpoint_whose_manifest_was_edited(tmp_path, capsys):
    out = run(tmp_path / "run", "--steps", "4", "--checkpoint-every", "2")
    path = os.path.join(out, "checkpoints", "ckpt_00000004.json")
    manifest = json.load(open(path))
    manifest["step"] = 3
    json.dump(manifest, open(path, "w"))
    run_flags([a for a in TINY if a != "--quiet"] + ["--out", out, "--steps", "4", "--resume", "auto"])   # says where
    said = capsys.readouterr().out
    assert "skipping invalid checkpoint(s) newer than ckpt_00000002.json: ckpt_00000004.json" in said
    assert "resumed from" in said and "at step 2" in said


@pytest.mark.parametrize("edit, says", [
    (lambda m: None, "manifest"),                                   # JSON null
    (lambda m: [1, 2], "manifest"),
    (lambda m: {k: v for k, v in m.items() if k != "opt_step_count"}, "opt_step_count"),
    (lambda m: dict(m, step="12"), "step"),
    (lambda m: dict(m, npz="/etc/passwd"), "npz|checksum"),
])
def test_hostile_manifest_is_refused_with_a_message(tmp_path, edit, says):
    out = run(tmp_path / "run", "--steps", "2")
    path = os.path.join(out, "checkpoints", "ckpt_00000002.json")
    json.dump(edit(json.load(open(path))), open(path, "w"))
    r = cli("--out", out, "--steps", "3", "--resume", path)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and re.search(says, r.stderr), r.stderr


def test_a_fifo_named_like_a_manifest_does_not_block_resume(tmp_path):
    out = run(tmp_path / "run", "--steps", "2")
    os.mkfifo(os.path.join(out, "checkpoints", "ckpt_00000009.json"))
    r = cli("--out", out, "--steps", "3", "--resume", "auto", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "not a regular file" in r.stdout and "newer than ckpt_00000002.json" in r.stdout


# ---- divergence: never apply, save or recommend a poisoned update ---------------------------

def test_nan_gradient_norm_stops_before_the_update_and_nothing_poisoned_is_saved(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:    # the default GPT: its gradient norm goes NaN while the loss is finite
        run_flags(["--data", "synthetic", "--sample-tokens", "0", "--quiet", "--out", str(out),
                          "--lr", "1e6", "--weight-decay", "0", "--steps", "30", "--checkpoint-every", "1"])
    message = str(e.value.code)
    assert "training diverged" in message
    for path in checkpoint.list_checkpoints(str(out / "checkpoints")):
        arrays, _ = checkpoint.load(path)
        assert all(np.isfinite(v).all() for v in arrays.values()), path
    recommended = checkpoint.find_latest(str(out / "checkpoints"))
    if recommended:
        assert recommended in message


def test_gradient_norm_is_checked_before_the_update(monkeypatch, tmp_path):
    """A finite loss with a NaN gradient (the --lr 1e6 case) stops before opt.step."""
    from ringpipe import kernels
    calls = {"n": 0}
    real = kernels.sum_of_squares

    def poisoned(a, *args, **kw):
        calls["n"] += 1
        return float("nan") if calls["n"] == 3 else real(a, *args, **kw)
    monkeypatch.setattr(kernels, "sum_of_squares", poisoned)
    with pytest.raises(SystemExit, match="the gradient norm is nan at step 3: training diverged. Nothing was "
                                         r"saved after the last good checkpoint \(.*ckpt_00000002.json\)"):
        run(tmp_path / "run", "--steps", "5", "--checkpoint-every", "1")
    assert ckpt_steps(str(tmp_path / "run")) == [1, 2]


# ---- signals --------------------------------------------------------------------------------

def test_ctrl_c_checkpoints_and_resume_is_bit_identical(tmp_path):
    whole = run(tmp_path / "whole", "--steps", "400")
    cut = str(tmp_path / "cut")
    # Runs on (same LR schedule) until interrupted, however fast its steps are.
    p = start("--out", cut, "--steps", "100000", "--decay-steps", "400", "--log-every", "1")
    wait_for_steps(cut, 3, p)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out, err)
    assert "SIGINT received: checkpoint at step" in out and "KeyboardInterrupt" not in err
    assert checkpoint.read_manifest(checkpoint.find_latest(os.path.join(cut, "checkpoints")))["step"] < 400
    cli("--out", cut, "--steps", "400", "--resume", "auto")
    assert same_params(whole, cut)


def test_second_ctrl_c_stops_at_once(tmp_path):
    out = str(tmp_path / "run")
    p = start("--out", out, "--steps", "100000", "--d-model", "64", "--context", "64", "--batch-size", "16")
    wait_for_steps(out, 1, p)
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode in (130, 0), err
    assert "Traceback" not in err


def test_two_sigints_50ms_apart_to_one_rank_end_the_job(tmp_path):
    """The second one used to land in the abort handler's sleep: MPI_Abort never ran, the job hung."""
    out = str(tmp_path / "run")
    p = start("--out", out, "--steps", "100000", mpi=2)
    wait_for_steps(out, 2, p)
    pid = rank_pids(p.pid)[-1]
    os.kill(pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(pid, signal.SIGINT)
    ends_within(p, 60, "two SIGINTs to one rank")
    assert p.returncode != 0


def test_double_sigterm_exit_code_tells_the_truth(tmp_path):
    out = str(tmp_path / "run")
    p = start("--out", out, "--steps", "100000", "--log-every", "1")
    wait_for_steps(out, 2, p)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, err = p.communicate(timeout=60)
    if "exiting with code 85" in stdout or "checkpoint of step" in err:
        assert p.returncode == 85, (p.returncode, stdout, err)
        assert checkpoint.find_latest(os.path.join(out, "checkpoints"))
    else:
        assert p.returncode == 128 + signal.SIGTERM, (p.returncode, stdout, err)


@pytest.mark.parametrize("delay", [0.1, 0.3, 0.6])
def test_sigusr1_at_start_up_is_not_lost(tmp_path, delay):
    """Sent while the ranks import, start MPI (where MPICH installs a SIGUSR1
    handler of its own) and set up: the run must stop with a checkpoint at its
    first step boundary, never train on as if nothing had come. (Before the
    first line of Python runs, the default action ends the rank instead: the
    job fails, and slurm/train.sbatch requeues since it forwarded the signal.)"""
    out = str(tmp_path / "run")
    p = start("--out", out, "--steps", "100000", mpi=2)
    deadline = time.time() + 60
    while time.time() < deadline and len(rank_pids(p.pid)) < 2:
        time.sleep(0.002)
    time.sleep(delay)
    for pid in rank_pids(p.pid):
        os.kill(pid, signal.SIGUSR1)
    stdout, err = ends_within(p, 120, "a SIGUSR1 at start-up (was it lost?)")
    assert p.returncode == 85, (p.returncode, stdout, err)
    assert "SIGUSR1 received: checkpoint at step" in stdout


def test_signal_during_the_final_checkpoint_does_not_kill_the_rank(tmp_path):
    out = str(tmp_path / "run")
    # A model big enough that writing its final checkpoint takes a moment.
    p = start("--out", out, "--steps", "2", "--d-model", "512", "--layers", "4", "--heads", "4",
              "--batch-size", "2", "--context", "16")
    ckpt = os.path.join(out, "checkpoints")
    deadline, sent = time.time() + 120, False
    while time.time() < deadline and p.poll() is None and not sent:
        if os.path.isdir(ckpt) and any(".tmp" in f for f in os.listdir(ckpt)):      # a file or a shards folder
            p.send_signal(signal.SIGTERM)
            sent = True
        time.sleep(0.002)
    stdout, err = p.communicate(timeout=120)
    assert sent, "never saw the final checkpoint being written"
    assert p.returncode == 0, (stdout, err)
    assert checkpoint.find_latest(ckpt).endswith("ckpt_00000002.json")


# ---- a full disk --------------------------------------------------------------------------

def test_disk_full_during_a_checkpoint_is_reported_and_nothing_valid_is_lost(tmp_path):
    disk = tmpfs(tmp_path / "disk", "600k")
    try:
        out = str(disk / "run")
        # Each checkpoint of this model is ~170 KB: the third or fourth fills the disk.
        r = cli("--out", out, "--steps", "20", "--checkpoint-every", "1", "--keep", "0", "--d-model", "48",
                "--heads", "2")
        assert r.returncode == 1, r
        assert "disk full at" in r.stderr and "MB free" in r.stderr and "Traceback" not in r.stderr, r.stderr
        ckpt = os.path.join(out, "checkpoints")
        assert not [f for f in os.listdir(ckpt) if ".tmp" in f]           # no temp file or folder keeps the disk full
        valid, invalid = checkpoint.scan(ckpt)
        assert valid and not invalid
        lines = open(os.path.join(out, "metrics.jsonl")).read()
        assert lines.endswith("\n") and all(json.loads(x) for x in lines.splitlines())
        subprocess.run(["mount", "-o", "remount,size=20m", str(disk)], check=True)
        r = cli("--out", out, "--steps", "8", "--checkpoint-every", "1", "--keep", "0", "--d-model", "48",
                "--heads", "2", "--resume", "auto")
        assert r.returncode == 0, r.stderr
        whole = cli("--out", str(tmp_path / "whole"), "--steps", "8", "--d-model", "48", "--heads", "2")
        assert whole.returncode == 0
        assert same_params(out, str(tmp_path / "whole"))
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# ---- input that would be ignored is refused or said ----------------------------------------

def test_data_path_alone_means_text_and_with_synthetic_is_refused(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world, this is text. " * 200)
    run(tmp_path / "a", "--data-path", str(text), "--steps", "1", "--data", "text")
    args = [a for a in TINY if a not in ("--data", "synthetic", "--quiet")]      # the data line is a start-up fact
    run_flags(args + ["--out", str(tmp_path / "b"), "--data-path", str(text), "--steps", "1"])
    said = capsys.readouterr().out
    assert "reading it as --data text" in said and "1 file, 5.3 KiB, memory-mapped" in said
    with pytest.raises(SystemExit, match="--data-path is read only with --data text"):
        run(tmp_path / "c", "--data-path", str(text))


def test_text_folder_says_what_it_read_skips_binaries_and_the_cap(tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(30):
        (folder / f"notes{i:02d}.log").write_text(f"entry {i}: " + "some words of text " * 100)
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    (folder / "__init__.py").write_text("")
    args = [a for a in TINY if a not in ("--data", "synthetic", "--quiet")]      # the data line is a start-up fact
    run_flags(args + ["--out", str(tmp_path / "r"), "--data", "text", "--data-path", str(folder),
                             "--steps", "1", "--max-data-mb", "0.02"])
    said = capsys.readouterr().out
    assert "binary or special file(s) skipped (e.g. image.png)" in said
    assert "stopped at the 0.02 MiB limit" in said and "--max-data-mb raises it" in said


def test_small_folder_whose_validation_file_is_empty_still_trains(tmp_path):
    """The per-file split sends __init__.py (crc32 % 10 == 0) to validation and every
    other file here to training: an empty validation split, once a refusal."""
    import zlib
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    names = [f"mod{i}.py" for i in range(40) if zlib.crc32(f"mod{i}.py".encode()) % 10][:12]
    assert zlib.crc32(b"__init__.py") % 10 == 0 and len(names) == 12
    for i, name in enumerate(names):
        (folder / name).write_text(f"def f{i}(x):\n    return x + {i}\n" * 400)
    args = [a for a in TINY if a not in ("--data", "synthetic")]
    run_flags(args + ["--out", str(tmp_path / "r"), "--data", "text", "--data-path", str(folder),
                             "--steps", "1"])


@pytest.mark.parametrize("path, says", [("/dev/zero", "is a character device"), ("fifo", "is a FIFO")])
def test_special_files_as_data_path_are_named_not_reported_missing(tmp_path, path, says):
    if path == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    with pytest.raises(SystemExit, match=says):
        run(tmp_path / "r", "--data", "text", "--data-path", path)


def test_a_huge_single_file_is_memory_mapped_not_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.write(b"a line of text\n" * 1000)
        fh.truncate(40 * 2**30)                     # sparse: 40 GiB, no disk used
    t0 = time.time()
    run(tmp_path / "r", "--data", "text", "--data-path", str(big), "--steps", "1")
    assert time.time() - t0 < 60


@pytest.mark.parametrize("flags, says", [
    (["--schedule", "gpipe"], "--schedule gpipe has no effect without pipeline stages"),
    (["--pp", "1", "--chunks", "1", "--schedule", "interleaved"], "no effect without pipeline stages"),
    (["--chunks", "2", "--schedule", "1f1b"], "--chunks 2 needs --schedule interleaved"),
    (["--bucket-mb", "1e300"], "--bucket-mb must be <= 1,048,576, got 1e\\+300"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--watchdog-abort"], "--watchdog-abort needs --watchdog"),
])
def test_flags_without_effect_or_out_of_range_are_refused(tmp_path, flags, says):
    with pytest.raises(SystemExit, match=says):
        run(tmp_path / "r", *flags)


def test_interleaved_without_chunks_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--schedule interleaved needs --chunks >= 2"):
        run(tmp_path / "r", "--schedule", "interleaved", "--pp", "2", "--layers", "2")


# Inside the flags' ranges (engine/train/ranges.py refuses larger ones by the range alone), past any memory.
@pytest.mark.parametrize("flags", [["--batch-size", "10000000"], ["--d-model", "999999"]])
def test_runs_that_cannot_fit_in_memory_are_refused_at_once(tmp_path, flags):
    t0 = time.time()
    with pytest.raises(SystemExit, match="this run needs at least .* per rank"):
        run(tmp_path / "r", *flags, *(["--heads", "3"] if "--d-model" in flags else []))
    assert time.time() - t0 < 5


def test_continuing_to_more_steps_says_the_schedule_changes_and_decay_steps_keeps_it(tmp_path, capsys):
    out = run(tmp_path / "run", "--steps", "6")
    capsys.readouterr()
    run(out, "--steps", "9", "--resume", "auto")
    said = capsys.readouterr().out
    assert "the LR schedule now spans 9 steps where the checkpoint's run had 6" in said
    assert "pass --decay-steps 6" in said
    kept = run(tmp_path / "kept", "--steps", "6")
    run(kept, "--steps", "9", "--resume", "auto", "--decay-steps", "6")
    assert "LR schedule" not in capsys.readouterr().out
    assert [r["lr"] for r in records(kept)][-3:] == [pytest.approx(2e-3 * 0.1)] * 3   # stays at the minimum


def test_auto_buckets_give_several_buckets_for_the_default_model():
    from ringpipe.comm.buckets import _make_buckets
    from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
    from ringpipe.engine.model.params import ParamBuffer
    from ringpipe.engine.parallel.data import bucket_sizes
    specs = [s for layer in gpt_layers(GPTConfig()) for s in layer.specs()]
    params = ParamBuffer(specs)
    size, first = bucket_sizes(None, params.grad.nbytes)
    assert 3 * 2**20 < params.grad.nbytes < 25 * 2**20            # the default bucket was bigger than it all
    assert len(_make_buckets(params.ranges(), 4, size)) >= 4 and first <= 2**20
    assert bucket_sizes(2.0, 10**9) == (2 * 2**20, None)


def test_bad_ringpipe_variables_are_refused_before_any_work(tmp_path):
    for name, value in [("RINGPIPE_ALLREDUCE_CROSSOVER", "abc"), ("RINGPIPE_RING_SUBCHUNK", "abc"),
                        ("RINGPIPE_COMM_CHECK", "sometimes")]:
        r = cli("--out", str(tmp_path / "r"), "--steps", "1", env=dict(ENV, **{name: value}))
        assert r.returncode == 2 and name in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)


# ---- the abort path ---------------------------------------------------------------------

def _script(name, *args, n=2, timeout=60):
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, os.path.join(ROOT, "tests", "support", "mpi_scripts", name),
                           *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_the_abort_path_survives_any_number_of_signals():
    t0 = time.time()
    try:
        r = _script("abort_under_signals.py")
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung: signals during the abort kept MPI_Abort from running")
    # The report names the first exception: the RuntimeError, or a KeyboardInterrupt that came first.
    assert r.returncode != 0 and re.search("boom while being interrupted|KeyboardInterrupt", r.stderr), r
    assert "unreachable" not in r.stdout and time.time() - t0 < 60


def _mpich_segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("mpich_shm_")} if os.path.isdir("/dev/shm") else set()


def _mapped_segments():
    """The segments some running process maps: another job's, alive (the machine is shared)."""
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                mapped |= {line.rsplit("/", 1)[-1].strip() for line in fh if "/dev/shm/mpich_shm_" in line}
        except OSError:
            continue
    return mapped


def test_an_aborted_job_leaves_no_shared_memory_segment_behind():
    before = _mpich_segments()
    r = _script("crash.py", "main", n=2)
    assert r.returncode != 0
    # New segments that no live process maps: the aborted job's (other jobs' are mapped while they run).
    left = _mpich_segments() - before - _mapped_segments()
    assert not left, f"MPICH's /dev/shm segment of the aborted job was left behind: {left}"


def test_every_ringpipe_variable_the_repository_reads_is_known_and_typos_are_named():
    import re as _re
    from ringpipe.engine.job import runtime
    found = set()
    for folder, _, files in os.walk(ROOT):
        if any(part in folder for part in (".venv", ".git", "__pycache__")):
            continue
        for f in files:
            if f.endswith((".py", ".sh", ".sbatch")) or f in ("Makefile", "run"):
                with open(os.path.join(folder, f), errors="replace") as fh:
                    found |= set(_re.findall(r"RINGPIPE_[A-Z0-9_]*[A-Z0-9]", fh.read()))
    found -= {"RINGPIPE_COM_CHECK"}                     # the typo below
    assert found <= set(runtime.KNOWN_VARIABLES), found - set(runtime.KNOWN_VARIABLES)
    notes = runtime.unknown_variables({"RINGPIPE_COM_CHECK": "off", "RINGPIPE_COMM_CHECK": "first"})
    assert notes == ["note: RINGPIPE_COM_CHECK is set but ringpipe reads no such variable; "
                     "did you mean RINGPIPE_COMM_CHECK?"]


def test_bad_skip_launcher_check_value_is_refused():
    from ringpipe.engine.job.lifecycle import LauncherError, check_launcher
    with pytest.raises(LauncherError, match="RINGPIPE_SKIP_LAUNCHER_CHECK='yes': use 1"):
        check_launcher(environ={"RINGPIPE_SKIP_LAUNCHER_CHECK": "yes"})
