"""Issues 20 and 34, `ringpipe export`, `--init-from hf:DIR` and `ringpipe sample` given hostile
or mistaken input: each test failed before its fix (a deleted run, a 0600 weights file, minutes
and gigabytes spent on a declared size, a traceback, a silent fallback, a hang, a NaN weight
blamed on the learning rate, an errno line naming a temp file).

No torch or transformers: checkpoints are written with checkpoint.save and Hugging Face
folders with export_hf and safetensors, so these run in seconds.
"""
import contextlib
import json
import os
import stat
import struct
import subprocess

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="engine/interop/hf.py needs safetensors")

from ringpipe.engine.job import checkpoint
from ringpipe.engine.model import gpt
from ringpipe.engine.interop import hf, hf_folder, sample  # noqa: E402
from ringpipe.engine.model.gpt import GPTConfig, build_gpt  # noqa: E402
from tests.support.hostile import deadline, tmpfs  # noqa: E402
from tests.support import checkpoints  # noqa: E402

CONFIG = dict(n_layer=2, d_model=32, n_head=2, context=16, vocab=256)
BIG = 64        # no model in these tests has more layers: building one that does is the bug


# ---- helpers -------------------------------------------------------------------------------

def params_of(config):
    model = build_gpt(GPTConfig(**config), seed=1)
    return {f"param/{name}": array.copy() for name, array in model.params.state_dict(model.params.data).items()}


def make_run(folder, config=CONFIG, steps=(3,), tokenizer=None):
    """A GPT run directory with checkpoints at `steps`, written directly (no training);
    tokenizer: a engine.data.tokenizer Tokenizer saved as the run's (default: bytes)."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    tokenizer = tokenizer or load_tokenizer("bytes")
    folder.mkdir(parents=True)
    tokenizer.save(str(folder))
    meta = {"model": "gpt", "model_config": dict(config), "optimizer": "adamw", "opt_step_count": 3, "loss": 1.0,
            "dtype": "float32", "precision": "float32", "layout": {"chunks": 1, "dp": 1, "pp": 1, "tp": 1},
            "args": {"heads": config["n_head"]},
            "tokenizer": {"file": "tokenizer.json", "kind": tokenizer.kind, "sha256": tokenizer.sha256,
                          "vocab_size": tokenizer.vocab_size}}
    for step in steps:
        checkpoint.save(str(folder / "checkpoints"), step, params_of(config), meta, keep=0)
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "run.lock").write_text("")
    return folder


def edit_manifest(run, **model_config):
    """Change the newest manifest's model_config and recompute its checksum, as someone
    editing it on purpose would (the checksum catches accidents, not intent)."""
    path = checkpoint.resolve(str(run))
    manifest = json.load(open(path))
    manifest["model_config"].update(model_config)
    manifest["checksum"] = checkpoint._checksum(manifest)
    with open(path, "w") as fh:
        json.dump(manifest, fh)
    return path


def make_hf_folder(folder, config=CONFIG):
    hf.export_hf(params_of(config), dict(config), str(folder))
    return folder


def edit_config_json(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def rewrite_tensors(folder, change):
    path = str(folder / "model.safetensors")
    tensors = safetensors_numpy.load_file(path)
    change(tensors)
    safetensors_numpy.save_file(tensors, path, metadata={"format": "pt"})


@contextlib.contextmanager
def bounded_memory(extra=2 << 30):
    """Turn reading a device forever (/dev/zero) into a MemoryError, not a machine out of memory."""
    import resource
    with open("/proc/self/status") as fh:
        size = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


@pytest.fixture
def no_big_models(monkeypatch):
    """Building a GPT of more than BIG layers fails the test: a declared size must be
    checked against the tensors before anything is built from it."""
    real_layers, real_build = gpt.gpt_layers, gpt.build_gpt

    def guard(cfg):
        if cfg.n_layer > BIG or cfg.d_model > 4096 or cfg.context > 4096:
            raise AssertionError(f"a model of {cfg} was built before its size was checked against the tensors")

    monkeypatch.setattr(hf, "gpt_layers", lambda cfg, *a, **k: (guard(cfg), real_layers(cfg, *a, **k))[1])
    monkeypatch.setattr(gpt, "build_gpt", lambda cfg, *a, **k: (guard(cfg), real_build(cfg, *a, **k))[1])


def tree(folder):
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names)


# ---- 1. --overwrite replaces only a model folder ------------------------------------------------

@pytest.mark.parametrize("target", ["parent", "run", "checkpoints", "dataset", "home", "inside-run"])
def test_overwrite_never_replaces_anything_but_a_model_folder(tmp_path, capsys, target):
    base = tmp_path / "runs"
    run = make_run(base / "gpt")
    out = {"parent": base, "run": run, "checkpoints": run / "checkpoints", "dataset": tmp_path / "data",
           "home": tmp_path / "home", "inside-run": run / "logs"}[target]
    if target == "dataset":
        out.mkdir()
        (out / "data.json").write_text("{}")
        (out / "train_000000.bin").write_bytes(b"\0" * 16)
    if target == "home":
        (out / ".ssh").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
    if target == "inside-run":
        out.mkdir()
        (out / "config.json").write_text("{}")          # looks like a model folder, but lies in the run
    before = {folder: tree(folder) for folder in (tmp_path,)}
    for overwrite in ([], ["--overwrite"]):
        assert hf.main([str(run), "--out", str(out), *overwrite]) == 2
        err = capsys.readouterr().err
        assert str(out) in err and "Traceback" not in err
        assert "--overwrite" not in err.replace(f"--out {out}", "")     # it would not help: never suggested
    assert {folder: tree(folder) for folder in (tmp_path,)} == before


def test_overwrite_replaces_a_model_folder_whole(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    out = tmp_path / "hf"
    assert hf.main([str(run), "--out", str(out)]) == 0
    (out / "model-00001-of-00002.safetensors").write_bytes(b"an old shard")
    assert hf.main([str(run), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err                  # here it helps, so it is suggested
    assert hf.main([str(run), "--out", str(out), "--overwrite"]) == 0
    assert "model-00001-of-00002.safetensors" not in os.listdir(out)    # replaced, not merged
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"]               # nothing left aside


# ---- 2. the exported files get the user's umask ----------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_have_the_users_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        out = make_hf_folder(tmp_path / "hf")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o666 & ~umask, name


# ---- 3. declared sizes are checked against the tensors before anything is built --------------------

@pytest.mark.parametrize("change, says", [
    ({"n_layer": 2**14}, "n_layer 16384, but the weights hold 2 layers"),     # the most config.json may declare
    ({"n_layer": 10**6}, "set n_layer to a whole number from 1 to 16,384"),
    ({"n_embd": 2**14, "n_head": 2}, "wte.weight has shape"),
    ({"n_positions": 10**6}, "wpe.weight has shape"),
])
def test_import_checks_config_sizes_against_the_tensors_first(tmp_path, no_big_models, change, says):
    folder = make_hf_folder(tmp_path / "hf")
    edit_config_json(folder, **change)
    with deadline(20), pytest.raises(ValueError, match=says):
        hf.import_hf(str(folder))


@pytest.mark.parametrize("change, says", [
    ({"n_layer": 10**6}, "n_layer 1000000, but the weights hold 2 layers"),
    ({"d_model": 2**14, "n_head": 2}, "param/wte has shape"),
    ({"context": 10**6}, "param/wpe has shape"),
])
def test_sample_and_export_check_the_manifest_against_the_npz_first(tmp_path, capsys, no_big_models, change, says):
    run = make_run(tmp_path / "run")
    edit_manifest(run, **change)
    with deadline(20):
        assert sample.main([str(run), "--tokens", "2"]) == 2
        assert says in capsys.readouterr().err
        assert hf.main([str(run), "--out", str(tmp_path / "hf")]) == 2
        assert says in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "hf")


def test_export_hf_checks_the_declared_depth_before_building(no_big_models, tmp_path):
    # 2^14: the most layers a model may have (engine/model/limits.py refuses more before this check)
    with deadline(20), pytest.raises(ValueError, match="n_layer 16384, but the parameters hold 2 layers"):
        hf.export_hf(params_of(CONFIG), dict(CONFIG, n_layer=2**14), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def test_a_model_larger_than_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    run = make_run(tmp_path / "run")
    folder = make_hf_folder(tmp_path / "hf")
    monkeypatch.setattr(hf_folder, "_available_memory", lambda: 1 << 16)
    monkeypatch.setattr(gpt, "build_gpt", lambda *a, **k: pytest.fail("built before the memory check"))
    assert sample.main([str(run), "--tokens", "2"]) == 2
    assert "GiB are available" in capsys.readouterr().err
    with pytest.raises(ValueError, match="GiB are available"):
        hf.import_hf(str(folder))


# ---- 4. only float tensors are imported ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint8])
def test_non_float_tensors_are_refused_by_name(tmp_path, dtype):
    folder = make_hf_folder(tmp_path / "hf")

    def to_ints(tensors):
        tensors["transformer.h.1.ln_1.bias"] = tensors["transformer.h.1.ln_1.bias"].astype(dtype)

    rewrite_tensors(folder, to_ints)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.ln_1\.bias is [A-Z0-9]+, not a float type"):
        hf.import_hf(str(folder))


def test_the_npz_parameters_must_be_floats(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    arrays = params_of(CONFIG)
    arrays["param/ln_f.b"] = arrays["param/ln_f.b"].astype(np.int64)
    manifest = json.load(open(checkpoint.resolve(str(run))))
    meta = {k: v for k, v in manifest.items() if k not in checkpoint.WRITTEN_KEYS}
    checkpoint.save(str(run / "checkpoints"), 4, arrays, meta, keep=0)
    assert sample.main([str(run), "--tokens", "2"]) == 2
    assert "param/ln_f.b has dtype int64, not a float type" in capsys.readouterr().err


# ---- 5. an edited n_head or vocab is refused, naming what disagrees -------------------------------

@pytest.mark.parametrize("change, says", [
    ({"n_head": 3}, "n_head 3, which does not divide d_model 32"),
    ({"n_head": 4}, "n_head 4, but the run was started with --heads 2"),
    ({"vocab": 300}, "param/wte has shape (256, 32), but"),
    ({"vocab": 250}, "vocab 250, but the run's tokenizer has 256"),
])
def test_export_of_an_edited_manifest_is_refused_clearly(tmp_path, capsys, change, says):
    run = make_run(tmp_path / "run")
    edit_manifest(run, **change)
    assert hf.main([str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err
    assert not os.path.exists(tmp_path / "hf")


# ---- 6. sample's prompt and seed ---------------------------------------------------------------

def test_a_prompt_of_raw_bytes_is_encoded_by_the_byte_tokenizer(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    prompt = os.fsdecode(b"ab\xff")                   # what Python makes of argv bytes that are not UTF-8
    assert sample.main([str(run), "--prompt", prompt, "--tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("ab\ufffd")
    assert sample.prompt_ids(prompt, sample.run_tokenizer(checkpoint.resolve(str(run)),
                                                           checkpoint.read_manifest(str(run))))[0] == [97, 98, 255]


def test_a_prompt_of_raw_bytes_is_refused_by_a_bpe_tokenizer(tmp_path, capsys):
    from ringpipe.engine.data.tokenizer import train_bpe
    bpe = train_bpe(["the ring all-reduce moves every byte once. " * 30], 280)
    run = make_run(tmp_path / "run", config=dict(CONFIG, vocab=bpe.vocab_size), tokenizer=bpe)
    assert sample.main([str(run), "--prompt", os.fsdecode(b"ring \xff"), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err and "0xff at position 5" in err and "Traceback" not in err
    assert sample.main([str(run), "--prompt", "ring", "--tokens", "2"]) == 0


def test_a_negative_seed_is_refused(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_:
        sample.main([str(run), "--seed", "-1"])
    assert exit_.value.code == 2 and "--seed must be a whole number" in capsys.readouterr().err


# ---- 7. falling back to an older checkpoint is said --------------------------------------------

def test_sample_says_when_it_falls_back_to_an_older_checkpoint(tmp_path, capsys):
    run = make_run(tmp_path / "run", steps=(3, 6))
    checkpoints.truncate(run / "checkpoints" / "ckpt_00000006.json")          # the newest is truncated
    assert sample.main([str(run), "--tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "ckpt_00000003.json" in err and "ckpt_00000006.json" in err and "truncated" in err
    assert err.count("note: ") == 1
    assert hf.main([str(run), "--out", str(tmp_path / "hf")]) == 0        # export says it too
    assert "ckpt_00000006.json" in capsys.readouterr().err
    # No note when the newest is used.
    good = make_run(tmp_path / "good", steps=(3, 6))
    assert sample.main([str(good), "--tokens", "2"]) == 0
    assert "note" not in capsys.readouterr().err


# ---- 8. --init-from hf:DIR without a tokenizer.json -----------------------------------------------

def test_init_data_check_refuses_a_larger_vocabulary_and_notes_an_unverified_tokenizer(tmp_path):
    folder = make_hf_folder(tmp_path / "hf")           # no tokenizer given: the folder has none
    init = hf.import_hf(str(folder))
    assert init[2] is None
    with pytest.raises(ValueError, match="300 tokens, more than the 256"):
        hf.check_init_data(str(folder), init, 300)
    notes = hf.check_init_data(str(folder), init, 256)
    assert len(notes) == 1 and "cannot be verified" in notes[0] and "256 tokens" in notes[0]
    with_tokenizer = tmp_path / "hf-tok"
    from ringpipe.engine.data.tokenizer import load_tokenizer
    hf.export_hf(params_of(CONFIG), dict(CONFIG), str(with_tokenizer), tokenizer_json=load_tokenizer("bytes").to_json())
    assert hf.check_init_data(str(with_tokenizer), hf.import_hf(str(with_tokenizer)), 256) == []


# ---- 9. FIFOs, devices and deep JSON where a file is read ----------------------------------------

def deep_json(depth=100_000):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "deep"])
def test_model_folder_files_that_are_not_files_are_refused(tmp_path, name, kind):
    from ringpipe.engine.data.tokenizer import load_tokenizer
    folder = tmp_path / "hf"
    hf.export_hf(params_of(CONFIG), dict(CONFIG), str(folder), tokenizer_json=load_tokenizer("bytes").to_json())
    path = folder / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    else:
        path.write_text(deep_json() if name != "model.safetensors" else "")
        if name == "model.safetensors":     # a header of deep JSON
            text = deep_json().encode()
            path.write_bytes(len(text).to_bytes(8, "little") + text)
    with deadline(20), bounded_memory(), pytest.raises(ValueError, match=name.replace(".", r"\.")):
        hf.import_hf(str(folder))


def test_a_deep_or_fifo_index_file_is_refused(tmp_path):
    folder = make_hf_folder(tmp_path / "hf")
    os.remove(folder / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(deep_json())
    with deadline(20), pytest.raises(ValueError, match="index.json is not valid JSON: it is nested too deeply"):
        hf.import_hf(str(folder))
    os.remove(folder / "model.safetensors.index.json")
    os.mkfifo(folder / "model.safetensors.index.json")
    with deadline(20), pytest.raises(ValueError, match="index.json is a named pipe"):
        hf.import_hf(str(folder))


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_the_runs_tokenizer_that_is_not_a_file_is_refused(tmp_path, capsys, kind):
    run = make_run(tmp_path / "run")
    os.remove(run / "tokenizer.json")
    if kind == "fifo":
        os.mkfifo(run / "tokenizer.json")
    else:
        (run / "tokenizer.json").write_text(deep_json())
    with deadline(20):
        assert sample.main([str(run), "--tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert "tokenizer.json" in err and ("named pipe" in err or "nested too deeply" in err)
        assert hf.main([str(run), "--out", str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "tokenizer.json" in err and ("named pipe" in err or "nested too deeply" in err)


def test_init_from_a_folder_without_a_tokenizer_says_the_tokenizer_is_unverified(tmp_path, capsys):
    """Through the trainer: the note reaches the user, and data of a larger vocabulary is refused."""
    from ringpipe.engine.train.cli import run_flags
    from ringpipe.engine.data.prepare import prepare
    folder = make_hf_folder(tmp_path / "hf")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    prepare([str(corpus)], str(tmp_path / "bytes"), progress=False)
    flags = ["--init-from", f"hf:{folder}", "--steps", "1", "--sample-tokens", "0", "--batch-size", "2"]
    run_flags(flags + ["--data", str(tmp_path / "bytes"), "--out", str(tmp_path / "run")])
    assert "has no tokenizer.json, so the data's tokenizer cannot be verified" in capsys.readouterr().out
    prepare([str(corpus)], str(tmp_path / "bpe"), tokenizer="bpe:300", progress=False)
    with pytest.raises(SystemExit, match="the data's tokenizer has 289 tokens, but the model .* has a vocabulary "
                                         "of 256"):
        run_flags(flags + ["--data", str(tmp_path / "bpe"), "--out", str(tmp_path / "run2")])


# ---- 10. issue 34: hostile weights, tokenizers and destinations ------------------------------------

def init_from(folder, out, quiet=True):
    """Train from `folder` as `ringpipe train --init-from` does, in this process: a refusal is the
    ConfigError the command turns into exit code 2 (on every rank: the import runs under agree)."""
    from ringpipe.engine.train.cli import config_from_args, parse_args
    from ringpipe.engine.train.run import run
    flags = ["--init-from", f"hf:{folder}", "--data", "synthetic", "--steps", "1", "--batch-size", "2",
             "--sample-tokens", "0", "--out", str(out)]
    return run(config_from_args(parse_args(flags + (["--quiet"] if quiet else []))))


def save_bf16(path, tensors):
    """A safetensors file of BF16 tensors, written by hand: numpy has no bfloat16 (its values
    are the top 16 bits of float32's)."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, array in tensors.items():
        raw = (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


POISONED = "transformer.h.1.mlp.c_fc.weight"


@pytest.mark.parametrize("dtype, value, says", [
    (np.float32, np.nan, "holds 1 NaN or infinite values (of 4,096)"),
    (np.float32, -np.inf, "holds 1 NaN or infinite values"),
    (np.float16, np.inf, "holds 1 NaN or infinite values"),
    ("bf16", np.nan, "holds 1 NaN or infinite values"),
    (np.float64, 1e39, "holds 1 of its 4,096 values beyond float32's range"),     # finite in the file, not in float32
])
def test_weights_that_are_not_finite_in_float32_are_refused_naming_the_tensor(tmp_path, dtype, value, says):
    folder = make_hf_folder(tmp_path / "hf")
    tensors = safetensors_numpy.load_file(str(folder / "model.safetensors"))
    tensors = {name: array.astype(np.float32 if dtype == "bf16" else dtype) for name, array in tensors.items()}
    tensors[POISONED][3, 4] = value
    if dtype == "bf16":
        save_bf16(folder / "model.safetensors", tensors)
    else:
        safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(str(folder))
    message = str(refused.value)
    assert f"model.safetensors: the tensor {POISONED} {says}" in message, message
    assert "use an undamaged copy of the model" in message


def test_init_from_a_folder_with_a_nan_weight_stops_before_training_naming_it(tmp_path):
    """Before: the run trained, and stopped with "training diverged... lower --lr"."""
    from ringpipe.engine.job.errors import ConfigError
    folder = make_hf_folder(tmp_path / "hf")
    rewrite_tensors(folder, lambda tensors: tensors[POISONED].__setitem__((0, 0), np.nan))
    with pytest.raises(ConfigError, match=f"the tensor {POISONED} holds 1 NaN or infinite values"):
        init_from(folder, tmp_path / "run")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


NOT_TOKENIZERS = {
    "model a number": {"model": 5},
    "model null": {"model": None},
    "a list": [1, 2],
    "vocabulary ids not numbers": {"model": {"type": "BPE", "vocab": {"a": "zero"}, "merges": []}},
    "unigram pieces not pairs": {"model": {"type": "Unigram", "vocab": [5, 6]}},
    "added tokens not objects": {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [5]},
    "an added token without an id": {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                                     "added_tokens": [{"content": "<s>"}]},
    "a model type the library does not know": {"model": {"type": "Nonsense", "vocab": {"a": 0}}},
}


@pytest.mark.parametrize("document", NOT_TOKENIZERS.values(), ids=NOT_TOKENIZERS.keys())
def test_a_models_tokenizer_json_that_is_not_a_tokenizer_is_refused_at_import_naming_it(tmp_path, document):
    if NOT_TOKENIZERS["a model type the library does not know"] is document:
        pytest.importorskip("tokenizers", reason="only the tokenizers library tells this one apart")
    folder = make_hf_folder(tmp_path / "hf")
    (folder / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(hf.HFError) as refused:
        hf.import_hf(str(folder))
    message = str(refused.value)
    assert str(folder / "tokenizer.json") in message, message
    assert "replace it with the tokenizer.json the model was published with" in message, message


def test_init_from_a_folder_whose_tokenizer_is_not_one_stops_before_training(tmp_path):
    """Before: a traceback in engine/data/tokenizer.py once the data was compared with it (or,
    with data of no tokenizer, a run that went on)."""
    from ringpipe.engine.job.errors import ConfigError
    folder = make_hf_folder(tmp_path / "hf")
    (folder / "tokenizer.json").write_text('{"model": 5}')
    with pytest.raises(ConfigError, match="tokenizer.json is not a tokenizer.json of the tokenizers library"):
        init_from(folder, tmp_path / "run")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_a_config_json_refusal_comes_before_the_fine_tuning_lines(tmp_path, capsys):
    """The lines about fine-tuning defaults do not apply to a model that cannot be fine-tuned:
    the refusal is said first, and says what to do."""
    from ringpipe.engine.job.errors import ConfigError
    folder = make_hf_folder(tmp_path / "hf")
    edit_config_json(folder, activation_function="relu")
    with pytest.raises(ConfigError, match="ringpipe cannot fine-tune this model: activation_function is 'relu'.*"
                                          "Fine-tune it with transformers instead"):
        init_from(folder, tmp_path / "run", quiet=False)
    assert "fine-tuning" not in capsys.readouterr().out


@pytest.mark.parametrize("destination, says", [
    ("/proc/self/x", "choose --out in a folder you can write to"),      # was: [Errno 2] ... /proc/self/.x.tmp-...
    ("/proc/x", "choose --out in a folder you can write to"),
    ("FILE/x", "FILE is not a folder, so no folder can be made in it"),   # was: [Errno 17] File exists
    ("/dev/null/x", "/dev/null is not a folder, so no folder can be made in it"),
    ("/dev/null", "exists and is not a folder; choose the path of a new folder"),
    ("READ-ONLY/x", "READ-ONLY is not writable by this user; choose --out in a folder you can write to"),
])
def test_export_to_where_no_folder_can_be_made_is_refused_naming_the_destination(tmp_path, capsys, destination,
                                                                                  says):
    run = make_run(tmp_path / "run")
    (tmp_path / "FILE").write_text("a file")
    (tmp_path / "READ-ONLY").mkdir(mode=0o555)
    if destination.startswith("READ-ONLY") and os.access(tmp_path / "READ-ONLY", os.W_OK):
        pytest.skip("this user (root) may write to a read-only folder")
    out = destination if destination.startswith("/") else str(tmp_path / destination)
    with deadline(20):
        assert hf.main([str(run), "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and says.replace("FILE", str(tmp_path / "FILE")).replace(
        "READ-ONLY", str(tmp_path / "READ-ONLY")) in err, err
    assert ".tmp-" not in err and "Errno" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["FILE", "READ-ONLY", "run"]


def test_export_onto_a_full_disk_is_refused_naming_the_destination(tmp_path, capsys):
    """Before: a traceback from safetensors' Rust code (SafetensorError: ... os error 28), exit 1."""
    run = make_run(tmp_path / "run")
    disk = tmpfs(tmp_path / "disk", "64k")         # model.safetensors is 137 KB
    try:
        assert hf.main([str(run), "--out", str(disk / "hf")]) == 2
        err = capsys.readouterr().err
        assert f"--out {disk / 'hf'}: writing the model failed (No space left on device)" in err, err
        assert os.listdir(disk) == []               # the temp folder is gone too
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_export_makes_the_missing_folders_of_its_destination(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert hf.main([str(run), "--out", str(tmp_path / "new" / "deeper" / "hf")]) == 0
    assert os.path.exists(tmp_path / "new" / "deeper" / "hf" / "model.safetensors")
