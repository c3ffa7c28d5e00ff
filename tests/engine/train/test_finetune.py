"""Fine-tuning from --init-from hf:DIR shows what it does (issue 21): validation at step 0
(the model as given), the epochs the run covers, --keep-best's OUT/best/ (exported and
sampled like a run, kept across a resume), the fine-tuning defaults, and why a run
without a tokenizer samples nothing at the end.

The Hugging Face folder is a `ringpipe export` of a small run (no torch needed). Under
MPI (`-m mpi --with-mpi`, 2 ranks): --keep-best at dp 2, pp 2 and tp 2 keeps the step and the
weights one process keeps.
"""
import json
import os

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint, rundir
from ringpipe.engine.interop import hf
from ringpipe.engine.data import shards
from ringpipe.engine.train.config import Config, check, resume_differences
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.interop.sample import load_run
from tests.engine.train.test_prepared_training import drop_last_checkpoint, metrics, prepared, single, weights

pytest.importorskip("safetensors.numpy", reason="--init-from hf: and export need safetensors")


BASE_STEPS = 300         # near what the tiny model can learn of the data: a fine-tune can make it worse


def exported(tmp, data, name="base", steps=BASE_STEPS, world=None):
    """A Hugging Face folder: the export of a small run trained on `data`."""
    base = single(tmp, data, name, world=world, steps=steps)
    folder = os.path.join(tmp, f"hf-{name}")
    if world is None or world.rank == 0:
        assert hf.main([base, "--out", folder]) == 0
    if world is not None:
        world.Barrier()
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(bytes data, a run trained on it, its export)."""
    tmp = str(tmp_path_factory.mktemp("finetune"))
    data = prepared(tmp, tokenizer="bytes")
    return data, os.path.join(tmp, "base"), exported(tmp, data)


def fine_tune(tmp, model, name, **settings):
    data, _, folder = model
    return single(str(tmp), data, name, init_from="hf:" + folder, **settings)


def validation(out):
    return {m["step"]: m["val_loss"] for m in metrics(out) if "val_loss" in m}


# ---- 1. validation at step 0 --------------------------------------------------------------------

def test_a_fine_tune_validates_the_model_as_given_before_the_first_step(tmp_path, model):
    out = fine_tune(tmp_path, model, "ft")
    first = metrics(out)[0]
    assert sorted(first) == ["epoch", "step", "val_bpb", "val_loss"] and first["step"] == 0 and first["epoch"] == 0
    # The exported model is the base run's last checkpoint: the same validation batches give its loss.
    assert first["val_loss"] == pytest.approx(validation(model[1])[BASE_STEPS], rel=1e-6)
    assert first["val_bpb"] == pytest.approx(first["val_loss"] / np.log(2))          # bytes: a token is a byte
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3, 4]


def test_step_0_is_said_and_only_a_run_from_weights_has_it(tmp_path, model, capsys):
    fine_tune(tmp_path, model, "ft", quiet=False)
    assert "step 0/4 | before the first update | val " in capsys.readouterr().out
    scratch = single(str(tmp_path), model[0], "scratch")
    assert metrics(scratch)[0]["step"] == 1


def test_a_resumed_fine_tune_does_not_validate_step_0_again(tmp_path, model):
    out = fine_tune(tmp_path, model, "ft", steps=4, checkpoint_every=2)
    drop_last_checkpoint(out, 4)
    fine_tune(tmp_path, model, "ft", steps=4, resume="auto", overwrite=False)
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3, 4, 3, 4]


# ---- 2. epochs ----------------------------------------------------------------------------------

def test_every_record_says_its_epoch_and_the_start_says_the_runs(tmp_path, model, capsys):
    out = fine_tune(tmp_path, model, "ft", steps=6, quiet=False)
    train_tokens = len(shards.open_dataset(model[0], 16, 0).splits["train"])
    per_step = TINY_TOKENS_PER_STEP
    for m in metrics(out)[1:]:
        assert m["epoch"] == pytest.approx(m["step"] * per_step / train_tokens)
    said = capsys.readouterr().out
    assert (f"epochs: steps 6 x {per_step} tokens = {6 * per_step / train_tokens:.2f} epoch(s) of the training "
            f"split ({train_tokens:,} tokens") in said
    assert "times over" not in said                                        # well under 3 epochs: no note


TINY_TOKENS_PER_STEP = 8 * 16          # test_prepared_training's TINY: batch 8 x context 16


def test_a_fine_tune_of_many_epochs_is_told_validation_may_get_worse(tmp_path, model, capsys):
    train_tokens = len(shards.open_dataset(model[0], 16, 0).splits["train"])
    steps = 3 * train_tokens // TINY_TOKENS_PER_STEP + 2                    # just over 3 epochs
    fine_tune(tmp_path, model, "ft", steps=steps, eval_every=steps, log_every=steps)
    said = capsys.readouterr().out
    assert "validation gets worse than at step 0" in said
    assert f"pass steps {int(3 * train_tokens / TINY_TOKENS_PER_STEP)}" in said


def test_a_run_from_scratch_is_told_only_past_10_epochs(tmp_path, model, capsys):
    train_tokens = len(shards.open_dataset(model[0], 16, 0).splits["train"])
    single(str(tmp_path), model[0], "scratch", steps=4 * train_tokens // TINY_TOKENS_PER_STEP)
    assert "times over" not in capsys.readouterr().out


# ---- 3. --keep-best -----------------------------------------------------------------------------

def best_checkpoints(out):
    return checkpoint.list_checkpoints(rundir.best_path(out))


def test_keep_best_keeps_the_step_of_the_lowest_validation_loss(tmp_path, model, capsys):
    out = fine_tune(tmp_path, model, "ft", steps=8, eval_every=2, quiet=False)
    val = validation(out)
    step = min(val, key=val.get)
    [path] = best_checkpoints(out)
    assert path == checkpoint.manifest_path(rundir.best_path(out), step)
    manifest = checkpoint.read_manifest(path)
    assert manifest["best"] == {"step": step, "val_loss": val[step]}
    assert checkpoint.read_manifest(os.path.join(out, "checkpoints"))["best"] == manifest["best"]
    assert f"best validation: step {step}, val {val[step]:.4f}" in capsys.readouterr().out


def test_the_best_is_exported_and_sampled_like_a_run(tmp_path, model):
    out = fine_tune(tmp_path, model, "ft", steps=4, eval_every=2)
    best = rundir.best_path(out)
    assert hf.main([best, "--out", str(tmp_path / "hf")]) == 0
    cfg, arrays, tokenizer = hf.import_hf(str(tmp_path / "hf"))
    assert tokenizer is not None                    # found in the run directory, not in OUT/best/
    saved, _ = checkpoint.load(best)
    assert np.array_equal(arrays["wpe"], saved["param/wpe"])
    _, tokenizer, path = load_run(best)
    assert path == best_checkpoints(out)[0] and tokenizer.kind == "bytes"


def test_when_fine_tuning_only_hurts_the_best_is_the_model_as_given(tmp_path, model, capsys):
    out = fine_tune(tmp_path, model, "ft", steps=4, eval_every=1, lr=0.05, warmup=0, quiet=False)
    val = validation(out)
    assert min(val, key=val.get) == 0, val          # a learning rate 25x the scratch default: every step worse
    [path] = best_checkpoints(out)
    assert path.endswith("ckpt_00000000.json") and checkpoint.read_manifest(path)["loss"] is None
    cfg, given, _ = hf.import_hf(model[2])
    kept, _ = checkpoint.load(path)
    assert np.array_equal(kept["param/h.0.attn.qkv.w"], given["h.0.attn.qkv.w"])
    assert "best validation: step 0, val" in capsys.readouterr().out


def test_keep_best_resumes_bit_identical_with_the_same_best(tmp_path, model):
    settings = dict(steps=8, eval_every=2, lr=0.02)       # validation rises and falls: the best is not the last
    full = fine_tune(tmp_path, model, "full", **settings)
    part = fine_tune(tmp_path, model, "part", checkpoint_every=3, **settings)
    drop_last_checkpoint(part, 8)
    drop_last_checkpoint(part, 6)
    fine_tune(tmp_path, model, "part", resume="auto", overwrite=False, **settings)
    assert [m.get("loss") for m in metrics(part)][-5:] == [m.get("loss") for m in metrics(full)][-5:]
    a, b = weights(full), weights(part)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    full_best, part_best = best_checkpoints(full), best_checkpoints(part)
    assert [os.path.basename(p) for p in part_best] == [os.path.basename(p) for p in full_best]
    assert checkpoint.read_manifest(part_best[0])["best"] == checkpoint.read_manifest(full_best[0])["best"]
    a, b = checkpoint.load(full_best[0])[0], checkpoint.load(part_best[0])[0]
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_resume_that_leaves_the_best_trajectory_does_not_claim_its_checkpoint(tmp_path, model, capsys):
    out = fine_tune(tmp_path, model, "ft", steps=4, eval_every=1, checkpoint_every=2, lr=0.05)
    assert min(validation(out), key=validation(out).get) == 0         # every step worse: the best is step 0
    drop_last_checkpoint(out, 4)
    # As a run stopped after a better step 3 than this run will reach would have left OUT/best.
    arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints", "ckpt_00000002.json"))
    meta = {k: v for k, v in manifest.items() if k not in checkpoint.WRITTEN_KEYS}
    checkpoint.save(rundir.best_path(out), 3, arrays, meta, alone=True)
    capsys.readouterr()
    fine_tune(tmp_path, model, "ft", steps=4, eval_every=1, checkpoint_every=2, lr=0.05, resume="auto",
              overwrite=False, quiet=False)
    said = capsys.readouterr().out
    assert "best validation: step 0, val" in said
    assert "its checkpoint is not kept" in said and "ckpt_00000003.json, written before this run resumed" in said


def test_best_holds_one_checkpoint_and_a_fresh_start_moves_it_aside(tmp_path, model):
    out = fine_tune(tmp_path, model, "ft", steps=6, eval_every=1)
    assert len(best_checkpoints(out)) == 1
    fine_tune(tmp_path, model, "ft", steps=2, keep_best=False)                  # overwrite=True: a fresh start
    assert not os.path.exists(rundir.best_path(out))
    assert len(best_checkpoints(os.path.join(out, rundir.PREVIOUS_NAME))) == 1


def test_keep_best_is_off_from_scratch_unless_asked(tmp_path, model):
    out = single(str(tmp_path), model[0], "scratch")
    assert not os.path.exists(rundir.best_path(out)) and "best" not in checkpoint.read_manifest(out)
    out = single(str(tmp_path), model[0], "asked", keep_best=True, eval_every=2)
    val = validation(out)
    assert checkpoint.read_manifest(rundir.best_path(out))["best"]["step"] == min(val, key=val.get)


@pytest.mark.parametrize("best, says", [({"step": -1, "val_loss": 1.0}, "best.step"),
                                        ({"step": 1, "val_loss": float("nan")}, "best"),
                                        ({"step": 1}, "exactly the keys step, val_loss")])
def test_a_manifest_with_a_bad_best_is_refused(tmp_path, best, says):
    meta = {"model": "gpt", "model_config": {"context": 1, "d_model": 1, "n_head": 1, "n_layer": 1, "vocab": 1},
            "optimizer": "adamw", "opt_step_count": 1, "loss": 1.0, "dtype": "float32", "precision": "float32",
            "layout": {"dp": 1, "pp": 1, "tp": 1, "chunks": 1}, "args": {}, "best": best}
    with pytest.raises(checkpoint.CheckpointError, match=says):
        checkpoint.save(str(tmp_path), 1, {"param/w": np.zeros(2, np.float32)}, meta)


# ---- 4. fine-tuning defaults --------------------------------------------------------------------

def test_fine_tuning_defaults_apply_only_where_not_given(tmp_path):
    tuned = Config(init_from="hf:" + str(tmp_path), steps=200)
    scratch = Config(steps=200)
    assert (tuned.peak_lr, tuned.warmup_steps, tuned.eval_period, tuned.best_kept) == (2e-4, 2, 20, True)
    assert (scratch.peak_lr, scratch.warmup_steps, scratch.eval_period, scratch.best_kept) == (2e-3, 10, 40, False)
    given = Config(init_from="hf:" + str(tmp_path), steps=200, lr=1e-3, warmup=7, eval_every=3, keep_best=False)
    assert (given.peak_lr, given.warmup_steps, given.eval_period, given.best_kept) == (1e-3, 7, 3, False)
    assert Config(init_from="hf:x", optimizer="sgd").peak_lr == pytest.approx(0.005)


def test_the_defaults_applied_are_said_and_those_given_are_not(tmp_path):
    notes = check(Config(init_from="hf:" + str(tmp_path), steps=200, lr=1e-3), world_size=1)
    said = [n for n in notes if "fine-tuning defaults" in n]
    assert len(said) == 1 and "<warmup> 2" in said[0] and "<eval_every> 20" in said[0]
    assert "<keep_best> on" in said[0] and "<lr>" not in said[0]
    assert any("step 0 shows the model as given" in n for n in notes)
    assert not [n for n in check(Config(steps=200), world_size=1) if "fine-tun" in n]


def test_a_fine_tune_resumes_with_its_init_from_and_is_told_when_it_was_dropped(tmp_path, model):
    out = fine_tune(tmp_path, model, "ft", steps=4, checkpoint_every=2)
    drop_last_checkpoint(out, 4)
    # The same command line continues it (the weights of --init-from are not used on resume).
    fine_tune(tmp_path, model, "ft", steps=4, resume="auto", overwrite=False)
    saved = checkpoint.read_manifest(os.path.join(out, "checkpoints"))["args"]
    notes = [n for n in resume_differences(saved, Config(steps=4)) if "<init_from>" in n]
    assert len(notes) == 1 and "default as for training from scratch" in notes[0] and "pass <init_from>" in notes[0]
    assert not [n for n in resume_differences(saved, Config(init_from=saved["init_from"])) if "<init_from>" in n]


def test_resuming_another_model_than_init_from_is_refused(tmp_path, model):
    out = single(str(tmp_path), model[0], "other", layers=1)
    with pytest.raises(ConfigError, match="holds another model"):
        fine_tune(tmp_path, model, "other", layers=None, resume="auto", overwrite=False, steps=6)
    assert os.path.isdir(out)


# ---- 6. no tokenizer, no sample: said ---------------------------------------------------------

def test_a_run_on_data_without_a_tokenizer_says_why_it_samples_nothing(tmp_path, capsys):
    folder = tmp_path / "nano"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        rng.integers(0, 300, n).astype(np.uint16).tofile(folder / f"{split}.bin")
    single(str(tmp_path), str(folder), "run", steps=2, sample_tokens=20, quiet=False)
    said = capsys.readouterr().out
    assert "no sample at the end: the data has no tokenizer" in said


def test_the_keep_best_flag():
    from ringpipe.engine.train.cli import parse_args
    assert [parse_args(flags).keep_best for flags in ([], ["--keep-best"], ["--no-keep-best"])] == [None, True, False]


# ---- MPI: --keep-best at every layout keeps what one process keeps ----------------------------

LAYOUTS = {"dp2": dict(), "pp2": dict(pp=2, microbatches=2), "tp2": dict(tp=2)}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_keep_best_at_every_layout_equals_one_process(shared_dir, layout):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.size != 2:
        pytest.skip("runs on 2 ranks")
    tmp = os.path.join(shared_dir, layout)
    if world.rank == 0:
        os.makedirs(tmp, exist_ok=True)
    world.Barrier()
    data = prepared(tmp, tokenizer="bytes", world=world)
    folder = exported(tmp, data, world=world)
    settings = dict(dtype="float64", steps=6, eval_every=2, lr=0.02, init_from="hf:" + folder)
    ref = single(tmp, data, f"ref{world.rank}", **settings)
    par = single(tmp, data, "parallel", world=world, **settings, **LAYOUTS[layout])
    world.Barrier()
    [ref_best], [par_best] = best_checkpoints(ref), best_checkpoints(par)
    assert os.path.basename(par_best) == os.path.basename(ref_best)
    a, b = checkpoint.read_manifest(ref_best)["best"], checkpoint.read_manifest(par_best)["best"]
    assert a["step"] == b["step"] and b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-10)
    a, b = checkpoint.load(ref_best)[0], checkpoint.load(par_best)[0]
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-10, atol=1e-10, err_msg=k)
    assert json.loads(json.dumps(metrics(par)[0]))["step"] == 0
