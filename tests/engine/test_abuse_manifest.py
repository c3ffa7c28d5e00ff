"""Issue 34: a checkpoint manifest edited to hold an absurd model value (a RoPE factor of 1e300,
a rope_theta that is a string, an rms_eps of 5, a qkv_bias of "yes") is refused by `ringpipe
export`, `ringpipe sample` and `--resume`, naming the key and the file, before anything is
built. Before, the checkpoint's schema let them through (only NaN and Infinity were refused):
export and sample wrote or printed garbage with exit 0, or failed with a TypeError traceback,
or in kernels/rope.py; a resume trained on.

The checkpoints are written directly (checkpoint.save), so these run in seconds.
"""
import json
import os

import pytest

from ringpipe.engine.data.tokenizer import load_tokenizer
from ringpipe.engine.interop import hf, sample
from ringpipe.engine.job import checkpoint
from ringpipe.engine.model.llama import LlamaConfig, build_llama
from ringpipe.engine.train.cli import run_flags
from tests.support.hostile import deadline

LLAMA3 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8}


def make_llama_run(folder):
    """A Llama run directory with one checkpoint (step 3, AdamW) and the byte tokenizer, written directly."""
    cfg = LlamaConfig(n_layer=1, d_model=16, n_head=2, n_kv_head=1, d_ff=32, context=16, vocab=256,
                      rope_scaling=dict(LLAMA3)).validate()
    model = build_llama(cfg, seed=1)
    params = {f"param/{name}": a.copy() for name, a in model.params.state_dict(model.params.data).items()}
    # AdamW's state, so that a resume has all it needs: the manifest's values alone decide.
    params.update({f"opt/{state}/{name[6:]}": 0 * a for name, a in list(params.items()) for state in ("m", "v")})
    tokenizer = load_tokenizer("bytes")
    folder.mkdir(parents=True)
    tokenizer.save(str(folder))
    meta = {"model": "llama", "model_config": cfg.to_dict(), "optimizer": "adamw", "opt_step_count": 3, "loss": 1.0,
            "dtype": "float32", "precision": "float32", "layout": {"chunks": 1, "dp": 1, "pp": 1, "tp": 1},
            "args": {"heads": cfg.n_head},
            "tokenizer": {"file": "tokenizer.json", "kind": tokenizer.kind, "sha256": tokenizer.sha256,
                          "vocab_size": tokenizer.vocab_size}}
    checkpoint.save(str(folder / "checkpoints"), 3, params, meta, keep=0)
    return folder


def edit_manifest(run, key, value):
    """Set model_config's `key` (rope_scaling.factor: inside rope_scaling) and recompute the
    checksum, as someone editing the manifest on purpose would. Returns its path."""
    path = checkpoint.resolve(str(run))
    manifest = json.load(open(path))
    outer, _, inner = key.partition(".")
    if inner:
        manifest["model_config"][outer][inner] = value
    else:
        manifest["model_config"][outer] = value
    manifest["checksum"] = checkpoint._checksum(manifest)
    with open(path, "w") as fh:
        json.dump(manifest, fh)
    return path


EDITS = [
    ("rope_scaling.factor", 1e300, "rope_scaling's factor must be > 0 and <= 65536"),
    ("rope_scaling.factor", "x", "rope_scaling's factor must be > 0"),
    ("rope_scaling.low_freq_factor", -1.0, "rope_scaling's low_freq_factor must be > 0"),
    ("rope_scaling.original_max_position_embeddings", 0.5, "original_max_position_embeddings must be a whole number"),
    ("rope_scaling.original_max_position_embeddings", 0, "original_max_position_embeddings must be a whole number"),
    ("rope_theta", 1e300, "rope_theta must be > 0 and <= 1e+12"),
    ("rope_theta", "abc", "rope_theta must be > 0"),
    ("rms_eps", 5.0, "rms_eps must be > 0 and < 1"),
    ("rms_eps", True, "rms_eps must be > 0 and < 1"),
    ("tie_embeddings", 5, "tie_embeddings must be true or false"),
    ("qkv_bias", "yes", "qkv_bias must be true or false"),
    ("n_head", 2**31 - 1, "n_head must be a whole number from 1 to 65,536"),
]


@pytest.mark.parametrize("key, value, says", EDITS, ids=[f"{k}={v}" for k, v, _ in EDITS])
def test_export_and_sample_refuse_an_absurd_manifest_value(tmp_path, capsys, key, value, says):
    run = make_llama_run(tmp_path / "run")
    path = edit_manifest(run, key, value)
    with deadline(30):
        assert hf.main([str(run), "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert says in err and path in err and "the manifest was edited" in err, err
        assert sample.main([str(run), "--tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert says in err and path in err, err
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("key, value, says", [EDITS[0], EDITS[7], EDITS[9]], ids=["factor", "rms_eps", "tie"])
def test_resume_refuses_an_absurd_manifest_value_naming_the_file(tmp_path, key, value, says):
    run = make_llama_run(tmp_path / "run")
    path = edit_manifest(run, key, value)
    with deadline(60), pytest.raises(SystemExit) as refused:
        run_flags(["--resume", str(run), "--out", str(tmp_path / "next"), "--data", "synthetic", "--steps", "5",
                   "--batch-size", "2", "--seq-len", "8", "--quiet"])
    said = str(refused.value)
    assert says in said and path in said and "resume from the checkpoint as it was written" in said, said
    assert not os.path.exists(tmp_path / "next" / "checkpoints")
