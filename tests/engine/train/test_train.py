"""Single-process training: it learns, it is deterministic, resume is exact, bad input is refused clearly."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint
from ringpipe.engine.data.datasets import FASHION_MNIST_DIR, load_stdlib_corpus
from ringpipe.engine.train.cli import run_flags

from tests.support import ROOT
from tests.support import checkpoints
TINY = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
        "--batch-size", "4", "--sample-tokens", "0", "--quiet"]


def run(tmp_path, *extra, name="run"):
    out = str(tmp_path / name)
    run_flags(TINY + ["--out", out] + list(extra))
    return out


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


def final_params(out):
    arrays, _ = checkpoint.load(out + "/checkpoints")
    return {k: v for k, v in arrays.items() if k.startswith("param/")}


@pytest.mark.slow
def test_gpt_learns_the_stdlib_corpus(tmp_path):
    """A short run must beat the unigram baseline (the best model that ignores context)
    by a wide margin. Python source has strong local structure: after ~150 steps a
    2-layer model reaches ~2.3 nats/byte against a unigram ~3.3. Requiring 0.5 nats
    below the baseline leaves room for noise yet fails any model that only learned
    byte frequencies (which stalls right at the baseline)."""
    out = str(tmp_path / "learn")
    run_flags(["--layers", "2", "--d-model", "64", "--heads", "4", "--context", "64",
                      "--batch-size", "16", "--steps", "150", "--lr", "3e-3", "--eval-batches", "4",
                      "--sample-tokens", "0", "--quiet", "--out", out])
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    val = records[-1]["val_loss"]
    baseline = load_stdlib_corpus(64, 1337).unigram_entropy()
    assert val < baseline - 0.5, (val, baseline)


def test_same_seed_is_bit_identical(tmp_path):
    a = run(tmp_path, "--steps", "5", name="a")
    b = run(tmp_path, "--steps", "5", name="b")
    assert losses(a) == losses(b)
    pa, pb = final_params(a), final_params(b)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_different_seed_differs(tmp_path):
    assert losses(run(tmp_path, "--steps", "3", name="a")) != \
        losses(run(tmp_path, "--steps", "3", "--seed", "7", name="b"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_gives_the_uninterrupted_trajectory(tmp_path, optimizer):
    full = run(tmp_path, "--steps", "6", "--optimizer", optimizer, name="full")
    part = run(tmp_path, "--steps", "6", "--optimizer", optimizer, "--checkpoint-every", "3", name="part")
    # throw away the end of the second run and redo it from its step-3 checkpoint
    checkpoints.remove(os.path.join(part, "checkpoints", "ckpt_00000006.json"))
    run_flags(TINY + ["--out", part, "--steps", "6", "--optimizer", optimizer, "--resume", "auto"])
    assert losses(part)[-3:] == losses(full)[-3:]
    pf, pp = final_params(full), final_params(part)
    assert all(np.array_equal(pf[k], pp[k]) for k in pf)


def test_bf16_precision_reaches_every_layer_and_is_restored(tmp_path):
    """--precision bf16 is the kernels' module default for the run (the layers never
    pass a precision): the losses move a little, stay close, and the default is back
    to float32 afterwards."""
    from ringpipe import kernels

    f32 = losses(run(tmp_path, "--steps", "4", name="f32"))
    bf16 = losses(run(tmp_path, "--steps", "4", "--precision", "bf16", name="bf16"))
    assert kernels.get_matmul_precision() == "float32"
    assert bf16 != f32
    np.testing.assert_allclose(bf16, f32, rtol=1e-3)
    _, manifest = checkpoint.load(str(tmp_path / "bf16" / "checkpoints"))
    assert manifest["precision"] == "bf16"
    arrays = final_params(str(tmp_path / "bf16"))
    assert all(a.dtype == np.float32 for a in arrays.values())      # float32 master weights


def test_bf16_start_up_line_names_the_gemm(tmp_path, capsys):
    """--precision bf16 says which GEMM runs it here (kernels.bf16_gemm()) and that the weights
    are rounded once per step; float32 runs say nothing of bf16."""
    from ringpipe import kernels

    loud = [a for a in TINY if a != "--quiet"]           # the bf16 line is a start-up fact
    run_flags(loud + ["--out", str(tmp_path / "f32"), "--steps", "1"])
    assert "bf16 GEMM" not in capsys.readouterr().out
    run_flags(loud + ["--out", str(tmp_path / "bf16"), "--steps", "1", "--precision", "bf16"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("bf16 GEMM: "))
    assert line.startswith(kernels.bf16_gemm()) and "once per step" in line


def test_bf16_precision_needs_float32(tmp_path):
    with pytest.raises(SystemExit, match="--precision bf16 needs --dtype float32"):
        run(tmp_path, "--precision", "bf16", "--dtype", "float64")


def test_mlp_learns_synthetic(tmp_path):
    out = str(tmp_path / "mlp")
    run_flags(["--model", "mlp", "--data", "synthetic", "--steps", "40", "--batch-size", "32",
                      "--lr", "3e-3", "--quiet", "--out", out])
    ls = losses(out)
    assert ls[-1] < 0.5 * ls[0]


@pytest.mark.skipif(not os.path.exists(FASHION_MNIST_DIR),
                    reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it)")
def test_mlp_on_fashion_mnist(tmp_path):
    out = str(tmp_path / "fm")
    run_flags(["--model", "mlp", "--steps", "60", "--batch-size", "64", "--lr", "2e-3",
                      "--quiet", "--out", out])
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        val = [json.loads(line) for line in fh][-1]["val_loss"]
    assert val < 1.0          # chance is ln(10) = 2.30


# ---- bad input: a clear error before work is lost -------------------------------------

def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "ringpipe.train", *args], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=300)


def test_help_explains():
    r = cli("--help")
    assert r.returncode == 0 and "--dp" in r.stdout and "Examples" in r.stdout


def test_unknown_flag_and_value():
    r = cli("--stepz", "3")
    assert r.returncode == 2 and "unrecognized arguments: --stepz" in r.stderr
    r = cli("--dtype", "float16")
    assert r.returncode == 2 and "invalid choice: 'float16'" in r.stderr


def test_sample_bytes_is_the_old_name_of_sample_tokens(capsys):
    """--sample-tokens was --sample-bytes (it counts tokens): the old name still sets it, and says so."""
    from ringpipe.engine.train.cli import config_from_args, parse_args
    assert config_from_args(parse_args(["--sample-tokens", "7"])).sample_tokens == 7
    assert capsys.readouterr().err == ""
    assert config_from_args(parse_args(["--sample-bytes", "9"])).sample_tokens == 9
    assert "--sample-bytes is now --sample-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, says", [
    ("--lr", "nan", "--lr must be a finite number, got nan"),
    ("--watchdog", "inf", "--watchdog must be a finite number, got inf"),
    ("--lr", "-1", "--lr must be > 0, got -1.0"),
    ("--warmup", "-5", "--warmup must be >= 0, got -5"),
    ("--min-lr-ratio", "-3", "--min-lr-ratio .* must be between 0 and 1, got -3.0"),
    ("--weight-decay", "-1", "--weight-decay must be >= 0, got -1.0"),
    ("--grad-clip", "-1", r"--grad-clip must be >= 0, got -1.0 \(0 disables clipping\)"),
    ("--layers", "0", "--layers must be >= 1, got 0"),
    ("--heads", "-2", "--heads must be >= 1, got -2"),
])
def test_nonsense_values_are_refused_before_any_work(tmp_path, flag, value, says):
    with pytest.raises(SystemExit, match=says):
        run(tmp_path, flag, value)
    assert not os.path.exists(tmp_path / "run"), "refused before the run directory was made"


@pytest.mark.parametrize("flag", ["--out", "--trace"])
def test_output_folder_that_cannot_be_made_is_refused_before_the_data_loads(tmp_path, flag):
    (tmp_path / "afile").write_text("not a folder")
    where = ["--out", str(tmp_path / "run")] if flag == "--trace" else []
    with pytest.raises(SystemExit, match=rf"cannot create the folder {flag} .*afile/x.*pass {flag} a folder"):
        run_flags(TINY + where + [flag, str(tmp_path / "afile" / "x")])


def test_cuda_aware_setting_is_checked_on_the_cpu_too(tmp_path, monkeypatch):
    from ringpipe.comm import device
    monkeypatch.setenv(device.ENV_CUDA_AWARE, "maybe")
    device._reset_decision()
    try:
        with pytest.raises(SystemExit, match="RINGPIPE_CUDA_AWARE_MPI='maybe': use 1"):
            run(tmp_path)
    finally:
        device._reset_decision()


def test_seq_len_over_context(tmp_path):
    with pytest.raises(SystemExit, match="--seq-len 32 exceeds the model's context 16"):
        run(tmp_path, "--seq-len", "32")


def test_heads_must_divide_width(tmp_path):
    with pytest.raises(SystemExit, match="divisible by --heads"):
        run(tmp_path, "--heads", "3")


def test_missing_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        run(tmp_path, "--resume", str(tmp_path / "nope.json"))


def test_corrupt_checkpoint_is_refused_and_previous_still_loads(tmp_path):
    out = run(tmp_path, "--steps", "4", "--checkpoint-every", "2")
    newest = os.path.join(out, "checkpoints", "ckpt_00000004.json")
    checkpoints.flip_middle(newest)
    with pytest.raises(SystemExit, match="corrupt"):
        run(tmp_path, "--steps", "4", "--resume", newest)
    assert checkpoint.find_latest(os.path.join(out, "checkpoints")).endswith("ckpt_00000002.json")
    checkpoints.truncate(newest)
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load(newest)
    arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
    assert manifest["step"] == 2 and "param/wte" in arrays


def test_checkpoint_never_unpickles(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, x=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        dict(np.load(path, allow_pickle=False))


def test_resume_with_changed_trajectory_flags_says_so(tmp_path, capsys):
    out = run(tmp_path, "--steps", "2")
    capsys.readouterr()
    loud = [a for a in TINY if a != "--quiet"]           # "resumed from" is a start-up fact
    run_flags(loud + ["--out", out, "--steps", "3", "--resume", "auto", "--seed", "7", "--dp", "1"])
    said = capsys.readouterr().out
    assert "note: resuming with --seed 7 where the checkpoint's run had 1337" in said
    assert "--dp" not in said.split("resumed from")[1], "a layout change is not a trajectory change"
    # settings left at their defaults compare as the run resolved them, as the checkpoint recorded them
    assert "--seq-len" not in said and "resuming with --data" not in said, said


def test_existing_run_is_not_overwritten(tmp_path):
    run(tmp_path, "--steps", "2")
    with pytest.raises(SystemExit, match="already holds checkpoints"):
        run(tmp_path, "--steps", "2")


def test_absent_dataset_names_the_package(tmp_path):
    with pytest.raises(SystemExit, match="apt-get install dataset-fashion-mnist"):
        run_flags(["--model", "mlp", "--data", "fashion-mnist", "--data-path", str(tmp_path),
                          "--out", str(tmp_path / "x"), "--quiet"])


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(tmp_path):
    out = run(tmp_path, "--steps", "3", "--checkpoint-every", "1", "--optimizer", "sgd", "--lr", "1e-3")
    # continue the same run with an absurd learning rate (the largest --lr takes, no weight
    # decay: lr x weight_decay must stay below 1): it must blow up, name the step, and
    # leave the step-3 checkpoint as the newest valid one
    with pytest.raises(SystemExit, match=r"(loss|gradient norm) is (nan|inf) at step \d+.*ckpt_00000003"):
        run_flags(TINY + ["--out", out, "--steps", "40", "--optimizer", "sgd", "--lr", "1e6", "--weight-decay", "0",
                          "--grad-clip", "0", "--warmup", "1", "--resume", "auto"])
    assert checkpoint.find_latest(os.path.join(out, "checkpoints")).endswith("ckpt_00000003.json")


def test_cuda_without_cupy_or_gpu_names_what_is_missing(tmp_path):
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False
    if has_cupy:
        pytest.skip("CuPy is installed; the no-CuPy message cannot be shown here")
    with pytest.raises(SystemExit, match="--device cuda needs CuPy"):
        run(tmp_path, "--device", "cuda")


@pytest.mark.parametrize("launcher", ["python", "mpiexec -n 1"])
def test_cli_runs_plain_and_under_mpiexec(tmp_path, launcher):
    """Progress lines, validation, the final sample: what a user sees."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if launcher != "python" and not os.path.exists(mpiexec):
        pytest.skip("no mpiexec next to this python (install the mpi extra)")
    prefix = [] if launcher == "python" else [mpiexec, "-n", "1"]
    args = [a for a in TINY if a != "--quiet"]
    args[args.index("--sample-tokens") + 1] = "16"
    r = subprocess.run(prefix + [sys.executable, "-m", "ringpipe.train", *args, "--steps", "2",
                                 "--out", str(tmp_path / "cli")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step 2/2 | loss" in r.stdout and "tok/s" in r.stdout and "ETA" in r.stdout
    assert "val " in r.stdout and "---- sample ----" in r.stdout
    assert os.path.exists(tmp_path / "cli" / "metrics.jsonl")


def test_resume_accepts_a_run_directory(tmp_path):
    out = run(tmp_path, "--steps", "2")
    run_flags(TINY + ["--out", str(tmp_path / "next"), "--steps", "3", "--resume", out])
    assert len(losses(str(tmp_path / "next"))) == 1        # only step 3 was left to do


@pytest.mark.parametrize("flag,value", [("--bucket-mb", "0"), ("--checkpoint-every", "-1"), ("--eval-batches", "0"),
                                        ("--keep", "-1"), ("--seq-len", "0"), ("--eval-every", "-2")])
def test_out_of_range_values_are_refused(tmp_path, flag, value):
    with pytest.raises(SystemExit, match=f"{flag} must be"):
        run(tmp_path, flag, value)


def test_text_folder_reads_txt_and_md(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(12):
        (folder / f"note{i}.md").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    out = str(tmp_path / "t")
    run_flags(TINY[2:] + ["--data", "text", "--data-path", str(folder), "--steps", "2", "--out", out])
    assert len(losses(out)) == 2


def test_every_rank_leaves_a_completion_marker_that_ringpipe_finished_checks(tmp_path):
    from ringpipe.engine.job import rundir
    out = run(tmp_path, "--steps", "2")
    assert rundir.main([out]) == 0
    assert rundir.main([out, "--ranks", "2"]) == 1                # rank 1 never finished
    ok, message = rundir.finished(out, 2)
    assert not ok and "1 of 2 rank(s) never finished (no marker: 1)" in message
    os.remove(os.path.join(out, "finished", "rank0.json"))
    assert rundir.main([out]) == 1
    run_flags(TINY + ["--out", out, "--steps", "3", "--resume", "auto"])   # a finished run marks again
    assert rundir.finished(out, 1)[0]
    run_flags(TINY + ["--out", out, "--steps", "3", "--overwrite"])
    assert rundir.finished(out, 1)[0]
    assert not os.path.exists(os.path.join(out, "previous", "finished", "rank1.json"))


def test_a_reader_that_stops_reading_does_not_end_the_run(tmp_path):
    """`ringpipe train | head -2`: the pipe closes after two lines. The run goes on to its last
    checkpoint and exits 0 (it died with a BrokenPipeError traceback and MPI_Abort before)."""
    out = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-m", "ringpipe.train", "--steps", "20", "--layers", "1",
                              "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
                              "--log-every", "1", "--max-data-mb", "1", "--sample-tokens", "0", "--out", out],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.readline()
    child.stdout.close()                       # the reader goes away while the run still prints
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err.decode()[-2000:]
    assert b"BrokenPipeError" not in err
    assert checkpoint.find_latest(os.path.join(out, "checkpoints")).endswith("ckpt_00000020.json")
