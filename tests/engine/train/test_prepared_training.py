"""Training from prepared token shards (`ringpipe prepare` -> `ringpipe train --data DIR`).

The serial tests: resume is bit-identical, validation reports bits per byte, the
tokenizer travels with the run and a different one is refused, `--init-from hf:`
starts from exactly a Hugging Face model's weights. Under MPI (`-m mpi --with-mpi`,
2 or 4 ranks): every DP x PP layout on the shards equals one process, and a run
resumed at DP 2 is bit-identical to an uninterrupted one.
"""
import json
import os

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint
from ringpipe.engine.data import prepare as prep, shards
from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train.run import run
from tests.support import checkpoints

WORDS = ("ring all reduce pipeline stage token shard gradient bucket rank layer tensor model data "
         "train step loss weight batch micro schedule optimizer").split()
TINY = dict(layers=2, d_model=16, heads=2, context=16, batch_size=8, steps=4, sample_tokens=0, quiet=True,
            overwrite=True, eval_batches=1)


def write_corpus(folder, seed=0, files=4, docs=30):
    """Text files of sentences of WORDS, different per seed."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    for f in range(files):
        with open(os.path.join(folder, f"part{f}.txt"), "w") as fh:
            for _ in range(docs):
                fh.write(" ".join(rng.choice(WORDS, size=rng.integers(5, 15))) + ".\n")
    return folder


def prepared(tmp, name="data", tokenizer="bpe:300", seed=0, world=None):
    corpus = write_corpus(os.path.join(tmp, f"corpus-{name}"), seed=seed)
    out = os.path.join(tmp, name)
    prep.prepare([corpus], out, tokenizer=tokenizer, progress=False, world=world)
    return out


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def losses(out):
    return [m["loss"] for m in metrics(out) if "loss" in m]        # a fine-tune's step 0 has validation only


def weights(out):
    arrays, _ = checkpoint.load(os.path.join(out, "checkpoints"))
    return arrays


def single(tmp, data, name, world=None, **settings):
    from mpi4py import MPI
    out = os.path.join(tmp, name)
    run(Config(**dict(TINY, data=data, out=out, **settings)), world=world or MPI.COMM_SELF)
    return out


def drop_last_checkpoint(out, step):
    checkpoints.remove(os.path.join(out, "checkpoints", f"ckpt_{step:08d}.json"))


# ---- one process -------------------------------------------------------------------------------

def test_resume_on_shards_is_bit_identical(tmp_path):
    data = prepared(str(tmp_path))
    full = single(str(tmp_path), data, "full", steps=6)
    part = single(str(tmp_path), data, "part", steps=6, checkpoint_every=3)
    drop_last_checkpoint(part, 6)
    single(str(tmp_path), data, "part", steps=6, resume="auto", overwrite=False)
    assert losses(part)[-3:] == losses(full)[-3:]
    a, b = weights(full), weights(part)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_vocabulary_comes_from_the_data_and_validation_reports_bits_per_byte(tmp_path):
    data = prepared(str(tmp_path))
    out = single(str(tmp_path), data, "run")
    _, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
    tokenizer = shards.read_manifest(data)["tokenizer"]
    assert manifest["model_config"]["vocab"] == tokenizer["vocab_size"] == 300
    assert manifest["tokenizer"]["sha256"] == tokenizer["sha256"]
    with open(os.path.join(out, "tokenizer.json")) as fh, open(os.path.join(data, tokenizer["file"])) as gh:
        assert fh.read() == gh.read()                  # the run keeps the tokenizer it was trained with
    last = metrics(out)[-1]
    per_token = shards.open_dataset(data, 16, 0).bytes_per_token("val")
    assert per_token > 1.5                             # BPE merges: more than a byte a token
    assert last["val_bpb"] == pytest.approx(last["val_loss"] / np.log(2) / per_token)


def test_resuming_on_data_of_another_tokenizer_is_refused(tmp_path):
    first = prepared(str(tmp_path), "first", seed=0)
    other = prepared(str(tmp_path), "other", seed=1)   # another corpus: another BPE, same vocabulary size
    single(str(tmp_path), first, "run", steps=2)
    with pytest.raises(ConfigError, match="another tokenizer"):
        single(str(tmp_path), other, "run", steps=4, resume="auto", overwrite=False)


def test_bytes_data_cannot_resume_a_bpe_run(tmp_path):
    out = single(str(tmp_path), prepared(str(tmp_path)), "run", steps=2)
    with pytest.raises(ConfigError, match="tokenizer|vocabulary"):
        single(str(tmp_path), prepared(str(tmp_path), "bytes", tokenizer="bytes"), "run", steps=4, resume=out,
               overwrite=False)


# ---- --init-from hf: ---------------------------------------------------------------------------

def _random_gpt2(folder, vocab):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


def test_init_from_a_transformers_model_trains_from_its_weights(tmp_path):
    """The first step's loss (before any update) is the transformers model's loss on that batch."""
    import torch
    data = prepared(str(tmp_path), tokenizer="bytes")
    hf_dir = str(tmp_path / "gpt2")
    model = _random_gpt2(hf_dir, vocab=256)
    out = single(str(tmp_path), data, "run", init_from="hf:" + hf_dir, steps=1, layers=None, d_model=None,
                 heads=None, context=None, seq_len=16, batch_size=4, dtype="float32")
    x, y = shards.open_dataset(data, 16, Config.seed).batch(0, 4)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).logits
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.from_numpy(y).reshape(-1))
    assert losses(out)[0] == pytest.approx(float(expected), abs=1e-5)
    _, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
    assert manifest["model_config"] == {"n_layer": 2, "d_model": 32, "n_head": 2, "context": 32, "vocab": 256}


def test_init_from_refuses_a_shape_setting_that_disagrees(tmp_path):
    data = prepared(str(tmp_path), tokenizer="bytes")
    hf_dir = str(tmp_path / "gpt2")
    _random_gpt2(hf_dir, vocab=256)
    with pytest.raises(ConfigError, match="has n_layer 2, but n_layer 3 was given"):
        single(str(tmp_path), data, "run", init_from="hf:" + hf_dir, layers=3, d_model=None, heads=None,
               context=None)


def test_init_from_refuses_data_of_another_vocabulary(tmp_path):
    data = prepared(str(tmp_path))                         # BPE, 300 tokens
    hf_dir = str(tmp_path / "gpt2")
    _random_gpt2(hf_dir, vocab=256)
    with pytest.raises(ConfigError, match="300 tokens"):
        single(str(tmp_path), data, "run", init_from="hf:" + hf_dir, layers=None, d_model=None, heads=None,
               context=None, seq_len=16)


@pytest.mark.parametrize("value, says", [("gpt2", "give hf:HF_DIR"), ("hf:/no/such/folder", "does not exist")])
def test_init_from_bad_values(tmp_path, value, says):
    with pytest.raises(ConfigError, match=says):
        single(str(tmp_path), prepared(str(tmp_path)), "run", init_from=value)


def test_init_from_with_a_preset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="preset> would be ignored|preset would be ignored"):
        single(str(tmp_path), prepared(str(tmp_path)), "run", init_from="hf:" + str(tmp_path), preset="gpt2-124m")


# ---- every layout equals one process (MPI) -----------------------------------------------------

LAYOUTS = {"dp2": dict(), "pp2": dict(pp=2, microbatches=2), "dp2-pp2": dict(pp=2, microbatches=2)}
RANKS = {"dp2": 2, "pp2": 2, "dp2-pp2": 4}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_on_shards_equals_one_process(shared_dir, layout):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.size != RANKS[layout]:
        pytest.skip(f"{layout} runs on {RANKS[layout]} ranks")
    data = prepared(shared_dir, world=world)           # prepared by every rank together
    from tests.support.parity import assert_same_run, reference, train
    settings = dict(TINY, data=data, dtype="float64", steps=4)
    ref = reference(Config(**settings, out=os.path.join(shared_dir, f"ref{world.rank}")))
    par = train(Config(**settings, **LAYOUTS[layout], out=os.path.join(shared_dir, "parallel")), world)
    world.Barrier()
    assert_same_run(par, ref, 1e-10)        # losses, validation, gradients, weights, checkpoint


@pytest.mark.mpi(min_size=2)
def test_resume_on_shards_at_dp2_is_bit_identical(shared_dir):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    if world.size != 2:
        pytest.skip("runs on 2 ranks")
    data = prepared(shared_dir, world=world)
    full = single(shared_dir, data, "full", world=world, steps=6)
    part = single(shared_dir, data, "part", world=world, steps=6, checkpoint_every=3)
    world.Barrier()
    if world.rank == 0:
        drop_last_checkpoint(part, 6)
    world.Barrier()
    single(shared_dir, data, "part", world=world, steps=6, resume="auto", overwrite=False)
    world.Barrier()
    assert losses(part)[-3:] == losses(full)[-3:]
    a, b = weights(full), weights(part)
    assert all(np.array_equal(a[k], b[k]) for k in a)


# ---- the stdlib corpus is a prepared dataset in a cache -----------------------------------------

def test_the_stdlib_corpus_is_prepared_once_and_batches_as_in_memory(tmp_path, monkeypatch):
    from ringpipe.engine.data import datasets as data
    from ringpipe.engine.data.prepare import prepare_stdlib
    monkeypatch.setenv("RINGPIPE_CACHE", str(tmp_path / "cache"))
    folder = prepare_stdlib(2 << 20)
    assert os.path.dirname(folder) == str(tmp_path / "cache")
    first = os.stat(os.path.join(folder, "train_000000.bin")).st_mtime_ns
    assert prepare_stdlib(2 << 20) == folder                                 # reused, not written again
    assert os.stat(os.path.join(folder, "train_000000.bin")).st_mtime_ns == first
    assert prepare_stdlib(1 << 20) != folder                                 # another limit, another corpus
    shards_ds, memory = shards.open_dataset(folder, 32, 5), data.load_stdlib_corpus(32, 5, max_bytes=2 << 20)
    for step in range(3):
        for split in ("train", "val"):
            a, b = shards_ds.batch(step, 4, 1, 3, split=split), memory.batch(step, 4, 1, 3, split=split)
            assert all(np.array_equal(p, q) for p, q in zip(a, b))
    os.truncate(os.path.join(folder, "val_000000.bin"), 2000)                # damaged: prepared again
    assert prepare_stdlib(2 << 20) == folder
    shards.read_manifest(folder)


def test_an_unwritable_cache_names_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("RINGPIPE_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ConfigError, match="set RINGPIPE_CACHE to a writable folder"):
        single(str(tmp_path), "stdlib", "run", max_data_mb=1)


def test_a_preset_that_disagrees_with_the_checkpoint_is_refused(tmp_path):
    data = prepared(str(tmp_path), tokenizer="bytes")
    single(str(tmp_path), data, "run", steps=1)
    with pytest.raises(ConfigError, match="other than <preset> gpt2-124m's|other than preset gpt2-124m's"):
        single(str(tmp_path), data, "run", steps=2, resume="auto", overwrite=False, preset="gpt2-124m",
               layers=None, d_model=None, heads=None, context=None)
