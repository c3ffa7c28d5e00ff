"""Issue 34: with --init-from hf:DIR and data that has a tokenizer of its own, the two
tokenizers are compared (engine/train/assemble.py check_tokenizer). Where the model's
tokenizer.json cannot be read for that, because the `tokenizers` library is not installed or
the file is damaged, the run is refused with a ConfigError (exit 2) that says what to do;
before, load_tokenizer's plain ValueError ended the run with a traceback.

check_tokenizer is called directly on the parts of a run it reads: no training, no data."""
import json
import sys
import types

import pytest

from ringpipe.engine.data.tokenizer import load_tokenizer
from ringpipe.engine.interop import hf
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.gpt import GPTConfig
from ringpipe.engine.train import assemble

# A tokenizer.json in shape (a "model" with a type and a vocabulary), which only the
# `tokenizers` library itself can load or refuse.
WORD_LEVEL = {"version": "1.0", "added_tokens": [],
              "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}}
DAMAGED = {"added_tokens": [], "model": {"type": "NoSuchModel", "vocab": {"a": 0}}}


def parts_of_a_run(tmp_path, model_tokenizer: dict, monkeypatch):
    """What check_tokenizer reads of a run that starts from a model folder holding
    `model_tokenizer`, on data whose own tokenizer is the byte tokenizer."""
    path = tmp_path / "hf" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps(model_tokenizer))
    monkeypatch.setattr(hf, "check_init_data", lambda *args, **kwargs: [])     # the folder's notes: not tested here
    tokenizer = load_tokenizer("bytes")
    return types.SimpleNamespace(
        tokenizer=tokenizer, manifest={}, init=(GPTConfig(vocab=256), {}, str(path)),
        cfg=types.SimpleNamespace(hf_dir=str(path.parent), init_from=f"hf:{path.parent}", out_dir=str(tmp_path)),
        dataset=types.SimpleNamespace(vocab_size=tokenizer.vocab_size), report=None), str(path)


def test_a_missing_tokenizers_library_is_a_refusal_that_says_to_install_it(tmp_path, monkeypatch):
    training, path = parts_of_a_run(tmp_path, WORD_LEVEL, monkeypatch)
    monkeypatch.setitem(sys.modules, "tokenizers", None)        # import tokenizers: ImportError, as when missing
    with pytest.raises(ConfigError) as refused:
        assemble.check_tokenizer(training)
    said = str(refused.value)
    assert said.startswith("install the Hugging Face tokenizers library (pip install 'tokenizers>=0.19'"), said
    assert path in said and "init_from" in said


def test_a_damaged_model_tokenizer_is_a_refusal_that_says_to_replace_it(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    training, path = parts_of_a_run(tmp_path, DAMAGED, monkeypatch)
    with pytest.raises(ConfigError) as refused:
        assemble.check_tokenizer(training)
    said = str(refused.value)
    assert path in said and said.endswith("replace it with the tokenizer.json the model was published with"), said
    assert "bpe:VOCAB" not in said          # the advice for --tokenizer is not this file's


def test_a_readable_model_tokenizer_that_differs_is_still_refused_as_before(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    training, _ = parts_of_a_run(tmp_path, WORD_LEVEL, monkeypatch)
    with pytest.raises(ConfigError, match="the data was prepared with another tokenizer than the model"):
        assemble.check_tokenizer(training)
