"""Checkpoints hold a GPT's wte at one padding for every layout (GPTConfig.padded_vocab);
files written before that, at a tensor-parallel size that does not divide 128, hold more
padding rows and still load everywhere (resume, sampling, export), read without them."""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.checkpoint import CheckpointError
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

SHAPE = dict(layers=2, d_model=12, heads=3, context=8, batch_size=3, steps=4, dtype="float64")
COMMON = dict(data="synthetic", sample_tokens=0, quiet=True, eval_every=4, eval_batches=4, **SHAPE)
WRITTEN = checkpoint.WRITTEN_KEYS


def test_the_checkpoint_knows_the_models_padding_multiple():
    from ringpipe.engine.model.gpt import VOCAB_PAD_MULTIPLE
    assert checkpoint._GPT_VOCAB_PAD == VOCAB_PAD_MULTIPLE


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A run (vocab 256: wte 256 rows), its step-2 checkpoint rewritten as a tp-3 run
    wrote it before: wte and its optimizer state at 384 rows (lcm(128, 3) = 384), the
    padding rows not zero (initialised, then decayed), layout tp 3."""
    root = tmp_path_factory.mktemp("vocab")
    ref = root / "ref"
    run(Config(out=str(ref), checkpoint_every=2, **COMMON), world=MPI.COMM_SELF)
    step2 = str(ref / "checkpoints" / "ckpt_00000002.json")
    arrays, manifest = checkpoint.load(step2)
    rng = np.random.default_rng(0)
    old_arrays = {k: np.concatenate([v, rng.normal(size=(128, 12))]) if k.endswith("/wte") else v
                  for k, v in arrays.items()}
    meta = {k: v for k, v in manifest.items() if k not in WRITTEN}
    meta["layout"] = dict(meta["layout"], tp=3)
    old = root / "old"
    checkpoint.save(str(old / "checkpoints"), 2, old_arrays, meta)
    if "tokenizer" in meta:           # the run's tokenizer, beside the checkpoints as a run keeps it
        (old / meta["tokenizer"]["file"]).write_bytes((ref / meta["tokenizer"]["file"]).read_bytes())
    return ref, step2, old, arrays


def test_an_old_checkpoint_padded_for_tp3_is_read_without_its_extra_rows(written):
    _, _, old, arrays = written
    _, declared = checkpoint.declared_arrays(str(old))
    assert declared["param/wte"][0] == declared["opt/m/wte"][0] == (256, 12)
    loaded, manifest = checkpoint.load(str(old), expected={"param/wte": (256, 12), "opt/v/wte": (256, 12)})
    assert manifest["layout"]["tp"] == 3
    np.testing.assert_array_equal(loaded["param/wte"], arrays["param/wte"])
    np.testing.assert_array_equal(loaded["opt/v/wte"], arrays["opt/v/wte"])
    assert loaded["param/wte"].flags.c_contiguous


def test_an_old_checkpoint_continues_as_the_run_that_wrote_it(written):
    ref, _, old, _ = written
    resumed = old.parent / "resumed"
    run(Config(out=str(resumed), resume=str(old / "checkpoints" / "ckpt_00000002.json"), **COMMON),
        world=MPI.COMM_SELF)
    final, _ = checkpoint.load(str(resumed / "checkpoints"))
    ref_final, _ = checkpoint.load(str(ref / "checkpoints"))
    assert final.keys() == ref_final.keys()
    for k in ref_final:
        np.testing.assert_allclose(final[k], ref_final[k], rtol=1e-12, atol=1e-12, err_msg=k)


def test_an_old_checkpoint_samples_and_exports(written, tmp_path):
    from ringpipe.engine.interop import hf
    from ringpipe.engine.interop.sample import load_run
    _, step2, old, _ = written
    model, _, _ = load_run(str(old))
    same, _, _ = load_run(step2)
    np.testing.assert_array_equal(model.params.data, same.params.data)
    pytest.importorskip("safetensors")
    assert hf.main([str(old / "checkpoints"), "--out", str(tmp_path / "hf")]) == 0
    assert os.path.exists(tmp_path / "hf" / "model.safetensors")


def test_a_wte_of_neither_padding_is_refused(written, tmp_path):
    """Only the exact row count an old layout wrote is read without its extra rows."""
    _, step2, _, _ = written
    arrays, manifest = checkpoint.load(step2)
    arrays["param/wte"] = np.concatenate([arrays["param/wte"], np.zeros((64, 12))])
    meta = dict({k: v for k, v in manifest.items() if k not in WRITTEN}, layout=dict(manifest["layout"], tp=3))
    checkpoint.save(str(tmp_path / "checkpoints"), 2, arrays, meta)
    with pytest.raises(CheckpointError, match=r"param/wte has shape \(320, 12\), the model expects \(256, 12\)"):
        checkpoint.load(str(tmp_path), expected={"param/wte": (256, 12)})
