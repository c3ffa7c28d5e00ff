"""Data and models from peers (issue 21): llm.c's shard folders read as they are, a
literal "<|endoftext|>" in a document encoded as text (tiktoken's encode_ordinary,
what llm.c and nanoGPT do), tokenizers told apart by what they do (a tokenizer.json
`transformers` re-saved is the same one), nanoGPT's headerless data starting from a
GPT-2 model once its tokenizer.json is beside it, and data.json written by hand
(docs/data-format.md)."""
import json
import os
import shutil

import numpy as np
import pytest

from ringpipe.engine.data import shards, tokenizer as tk
from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train.run import run

TINY = dict(layers=1, d_model=16, heads=2, context=16, seq_len=16, batch_size=4, steps=3, sample_tokens=0,
            quiet=True, overwrite=True, eval_batches=1)


def train(tmp, data, name="run", **settings):
    from mpi4py import MPI
    out = os.path.join(tmp, name)
    run(Config(**dict(TINY, data=data, out=out, **settings)), world=MPI.COMM_SELF)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return out, [json.loads(line) for line in fh]


def write_llmc_shard(path, tokens, magic=20240520, version=1, dtype="<u2"):
    """A shard as llm.c's dev/data/data_common.py writes one: 256 little-endian int32
    (magic, version, token count, zeros), then the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens)
    with open(path, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(np.asarray(tokens, dtype=dtype).tobytes())


def llmc_folder(folder, with_tokenizer=True):
    """fineweb's layout: val shard 000000, train shards 000001.., and llm.c's HellaSwag
    evaluation file beside them (one split only, another format: not a dataset shard).
    Each train shard holds ids of its own range, so a test can see which were read."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    parts = {"tiny_val_000000.bin": rng.integers(97, 123, 400),
             "tiny_train_000001.bin": rng.integers(97, 110, 700),
             "tiny_train_000002.bin": rng.integers(110, 123, 500)}
    for name, tokens in parts.items():
        write_llmc_shard(os.path.join(folder, name), tokens)
    with open(os.path.join(folder, "hellaswag_val.bin"), "wb") as fh:
        fh.write(np.array([20240522, 1, 0], dtype="<i4").tobytes())
    if with_tokenizer:
        tk.load_tokenizer("bytes").save(folder)
    return str(folder), parts


# ---- llm.c's shard folders ----------------------------------------------------------------------

def test_an_llmc_folder_is_read_as_it_is_every_shard_in_order(tmp_path):
    data, parts = llmc_folder(tmp_path / "d")
    ds = shards.open_dataset(data, 16, 0)
    train = np.concatenate([parts["tiny_train_000001.bin"], parts["tiny_train_000002.bin"]])
    assert [os.path.basename(s.path) for s in ds.splits["train"].shards] == ["tiny_train_000001.bin",
                                                                            "tiny_train_000002.bin"]
    np.testing.assert_array_equal(ds.splits["train"][np.arange(len(train))], train)
    np.testing.assert_array_equal(ds.splits["val"][np.arange(400)], parts["tiny_val_000000.bin"])
    assert ds.vocab_size == 256 and ds.tokenizer.kind == "bytes" and ds.assumed_vocab is None
    said = ds.describe()
    assert "llm.c shards, uint16 tokens" in said and "headerless" not in said and "2 shard(s)" in said
    ds.close()


def test_an_llmc_folder_trains_on_all_its_shards(tmp_path):
    data, _ = llmc_folder(tmp_path / "d")
    out, rows = train(str(tmp_path), data, steps=8, batch_size=16)
    assert len([r for r in rows if "loss" in r]) == 8
    # Both train shards were sampled: the windows of 8 batches of 16 cover ids of each one's range.
    ds = shards.open_dataset(data, 16, Config.seed)
    seen = np.concatenate([ds.batch(step, 16)[0].ravel() for step in range(8)])
    assert (seen < 110).any() and (seen >= 110).any()
    ds.close()


def test_llmc_gpt2_shards_without_a_tokenizer_have_gpt2s_vocabulary_and_a_bad_id_says_so(tmp_path):
    data, _ = llmc_folder(tmp_path / "d", with_tokenizer=False)
    ds = shards.open_dataset(data, 16, 0)
    assert ds.vocab_size == 50257 and ds.tokenizer is None and "GPT-2's" in ds.describe()
    ds.close()
    write_llmc_shard(os.path.join(data, "tiny_train_000002.bin"), [60000] * 500)
    ds = shards.open_dataset(data, 16, 0)
    with pytest.raises(shards.BadTokens, match="which was assumed .*put the tokenizer.json the data was made "
                                               "with in"):
        ds.unigram_entropy()
    ds.close()


def test_renamed_llmc_shards_are_called_llmc_shards_not_headerless(tmp_path):
    write_llmc_shard(tmp_path / "train.bin", np.arange(300) % 256)
    write_llmc_shard(tmp_path / "val.bin", np.arange(100) % 256)
    ds = shards.open_dataset(str(tmp_path), 16, 0)
    assert "llm.c shards" in ds.describe() and "headerless" not in ds.describe()
    assert len(ds.splits["train"]) == 300
    ds.close()


def test_llmc_folders_that_are_not_one_dataset_are_refused_saying_why(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    write_llmc_shard(one / "a_val.bin", [1] * 100)
    with pytest.raises(ValueError, match="one split only"):
        shards.open_dataset(str(one), 16, 0)
    write_llmc_shard(one / "a_train.bin", [1] * 100)
    write_llmc_shard(one / "b_train.bin", [1] * 100)
    write_llmc_shard(one / "b_val.bin", [1] * 100)
    with pytest.raises(ValueError, match=r"2 datasets \(a, b\): put each in a folder of its own"):
        shards.open_dataset(str(one), 16, 0)
    os.remove(one / "b_train.bin")
    os.remove(one / "b_val.bin")
    write_llmc_shard(one / "a_train_000001.bin", [1] * 100, magic=20240801, version=7, dtype="<u4")
    with pytest.raises(ValueError, match="mixes token files of different formats"):
        shards.open_dataset(str(one), 16, 0)


# ---- a literal <|endoftext|> is text ------------------------------------------------------------

def _small_bpe():
    return tk.train_bpe(["the end of a text is not <|endoftext|> written out, it is a token " * 20,
                         "hello world, endoftext and |> and <| are pieces of text " * 20], 320)


def test_a_literal_endoftext_in_a_document_is_encoded_as_text():
    tokenizers = pytest.importorskip("tokenizers")
    tok = _small_bpe()
    doc = "before<|endoftext|>after <|endoftext|>"
    # The same model without the special token: the BPE of the plain text, what tiktoken's
    # encode_ordinary gives for GPT-2.
    plain = json.loads(tok.to_json())
    plain["added_tokens"] = []
    reference = tokenizers.Tokenizer.from_str(json.dumps(plain)).encode(doc, add_special_tokens=False).ids
    ids = tok.encode(doc)
    assert list(ids) == reference and tok.separator[0] not in ids
    assert [list(a) for a in tok.encode_batch([doc])] == [reference]
    assert tok.decode(ids) == doc


def test_prepare_keeps_a_literal_endoftext_as_text(tmp_path):
    from ringpipe.engine.data import prepare as prep
    tok = _small_bpe()
    tok.save(tmp_path / "tok")
    docs = [{"text": f"document {i} quotes <|endoftext|> inside it"} for i in range(20)]
    with open(tmp_path / "in.jsonl", "w") as fh:
        fh.writelines(json.dumps(d) + "\n" for d in docs)
    m = prep.prepare([str(tmp_path / "in.jsonl")], tmp_path / "d", tokenizer=str(tmp_path / "tok/tokenizer.json"),
                     progress=False)
    ds = shards.open_dataset(str(tmp_path / "d"), 8, 0)
    separators = sum(int((ds.splits[s][0:len(ds.splits[s])] == tok.separator[0]).sum()) for s in shards.SPLITS)
    assert separators == sum(m["splits"][s]["documents"] for s in shards.SPLITS) == 20
    ds.close()


# ---- tokenizers told apart by what they do --------------------------------------------------------

def resaved(json_text):
    """What `transformers`' save_pretrained does to a tokenizer.json, simulated: a no-op
    post-processor, merges in the older "a b" form, keys in another order, other indent."""
    doc = json.loads(json_text)
    doc["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    doc["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]]
    doc["model"].pop("ignore_merges", None)
    return json.dumps(dict(reversed(list(doc.items()))), indent=4)


def test_a_resaved_tokenizer_has_the_same_identity_and_a_changed_one_does_not():
    tok = _small_bpe()
    again = tk.from_json(resaved(tok.to_json()))
    assert again.identity == tok.identity and again.sha256 != tok.sha256
    doc = json.loads(tok.to_json())
    doc["model"]["merges"] = doc["model"]["merges"][1:]
    assert tk.from_json(json.dumps(doc)).identity != tok.identity
    doc = json.loads(tok.to_json())
    doc["pre_tokenizer"]["add_prefix_space"] = not doc["pre_tokenizer"]["add_prefix_space"]
    assert tk.from_json(json.dumps(doc)).identity != tok.identity


def test_a_file_in_an_older_form_keeps_its_identity_when_a_newer_library_writes_it():
    """GPT-2's Hub tokenizer.json predates "use_regex", "byte_fallback", "ignore_merges" and
    merges as pairs: what save_pretrained (the library's serialisation) writes out for it."""
    tokenizers = pytest.importorskip("tokenizers")
    doc = json.loads(_small_bpe().to_json())
    doc["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    doc["model"] = {k: v for k, v in doc["model"].items() if k not in ("ignore_merges", "byte_fallback")}
    doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
    older = json.dumps(doc)
    newer = tokenizers.Tokenizer.from_str(older).to_str()
    assert json.loads(newer)["pre_tokenizer"] != doc["pre_tokenizer"]     # the library did write it differently
    assert tk.from_json(newer).identity == tk.from_json(older).identity


def test_metaspaces_older_add_prefix_space_is_its_prepend_scheme():
    old = {"model": {"type": "BPE", "vocab": {}, "merges": []},
           "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "add_prefix_space": True}}
    new = {"model": {"type": "BPE", "vocab": {}, "merges": []},
           "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True}}
    assert tk.tokenizer_identity(old) == tk.tokenizer_identity(new)
    new["pre_tokenizer"]["prepend_scheme"] = "never"
    assert tk.tokenizer_identity(old) != tk.tokenizer_identity(new)


def _random_gpt2(folder, vocab):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = "ring pipe token shard rank layer model data step loss batch".split()
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 9)) + "." for _ in range(300)))
    return str(tmp_path / "corpus.txt")


@pytest.mark.parametrize("how", ["simulated", "transformers"])
def test_init_from_accepts_the_tokenizer_transformers_resaved(tmp_path, how):
    from ringpipe.engine.data import prepare as prep
    prep.prepare([_corpus(tmp_path)], tmp_path / "d", tokenizer="bpe:300", progress=False)
    data = str(tmp_path / "d")
    tok = tk.load_tokenizer(data)
    hf_dir = _random_gpt2(tmp_path / "gpt2", tok.vocab_size)
    if how == "simulated":
        (tmp_path / "gpt2" / "tokenizer.json").write_text(resaved(tok.to_json()))
    else:
        transformers = pytest.importorskip("transformers")
        fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(data, "tokenizer.json"),
                                                    eos_token=tk.END_OF_TEXT)
        fast.save_pretrained(hf_dir)
    assert tk.load_tokenizer(hf_dir).sha256 != tok.sha256           # the file changed ...
    _, rows = train(str(tmp_path), data, init_from="hf:" + hf_dir, layers=None, d_model=None, heads=None,
                    context=None, steps=2)
    assert len([r for r in rows if "loss" in r]) == 2                # ... the tokenizer did not


def test_init_from_refuses_a_tokenizer_that_gives_other_ids(tmp_path):
    from ringpipe.engine.data import prepare as prep
    prep.prepare([_corpus(tmp_path)], tmp_path / "d", tokenizer="bpe:300", progress=False)
    data = str(tmp_path / "d")
    doc = json.loads(tk.load_tokenizer(data).to_json())
    doc["model"]["merges"] = doc["model"]["merges"][::-1]           # the same vocabulary, other merges
    hf_dir = _random_gpt2(tmp_path / "gpt2", 300)
    (tmp_path / "gpt2" / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="another tokenizer than the model of"):
        train(str(tmp_path), data, init_from="hf:" + hf_dir, layers=None, d_model=None, heads=None, context=None)


# ---- nanoGPT's data without an end-of-text token ----------------------------------------------------

def test_nanogpt_data_without_endoftext_starts_from_a_model_once_its_tokenizer_is_beside_it(tmp_path):
    data = tmp_path / "nano"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(97, 123, 3000).astype("<u2").tofile(data / "train.bin")   # ids < 123: no separator in them
    rng.integers(97, 123, 500).astype("<u2").tofile(data / "val.bin")
    hf_dir = _random_gpt2(tmp_path / "gpt2", 256)
    tk.load_tokenizer("bytes").save(hf_dir)
    flags = dict(init_from="hf:" + hf_dir, layers=None, d_model=None, heads=None, context=None, steps=2)
    with pytest.raises(ConfigError) as e:
        train(str(tmp_path), str(data), **flags)
    said = str(e.value)
    assert "has no tokenizer.json" in said and "assumed to be 123" in said and "has 256 tokens" in said
    assert f"cp {os.path.join(hf_dir, 'tokenizer.json')} {data}/" in said
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), data / "tokenizer.json")
    out, rows = train(str(tmp_path), str(data), **flags)
    assert len([r for r in rows if "loss" in r]) == 2


# ---- data.json written by hand -----------------------------------------------------------------------

def hand_written(folder, **tokenizer_entry):
    """The least data.json docs/data-format.md asks for, over llm.c shards and a tokenizer."""
    data, parts = llmc_folder(folder)
    manifest = {"format": "ringpipe-data", "version": 1,
                "tokenizer": {"file": "tokenizer.json", "vocab_size": 256, **tokenizer_entry},
                "splits": {"train": {"shards": ["tiny_train_000001.bin", "tiny_train_000002.bin"]},
                           "val": {"shards": ["tiny_val_000000.bin"]}}}
    with open(os.path.join(data, "data.json"), "w") as fh:
        json.dump(manifest, fh)
    return data


def test_a_hand_written_manifest_without_a_hash_is_read(tmp_path):
    ds = shards.open_dataset(hand_written(tmp_path / "d"), 16, 0)
    assert len(ds.splits["train"]) == 1200 and ds.bytes_per_token("val") is None
    ds.close()


def test_a_hand_written_manifest_may_give_the_files_sha256sum(tmp_path):
    import hashlib
    text = tk.load_tokenizer("bytes").to_json()
    data = hand_written(tmp_path / "d", sha256=hashlib.sha256(text.encode()).hexdigest())
    shards.open_dataset(data, 16, 0).close()


def test_a_wrong_hash_says_what_is_wrong_and_what_to_do(tmp_path):
    data = hand_written(tmp_path / "d", sha256="0" * 64)
    with pytest.raises(ValueError) as e:
        shards.open_dataset(data, 16, 0)
    said = str(e.value)
    assert "tokenizer.json is not the tokenizer the data was prepared with" in said
    assert "leave tokenizer.sha256 out" in said and tk.load_tokenizer("bytes").sha256 in said


def test_a_dataset_prepared_before_identities_is_still_read(tmp_path):
    from ringpipe.engine.data import prepare as prep
    prep.prepare([_corpus(tmp_path)], tmp_path / "d", tokenizer="bpe:300", progress=False)
    path = tmp_path / "d" / "data.json"
    m = json.loads(path.read_text())
    assert m["tokenizer"]["identity"] == tk.load_tokenizer(str(tmp_path / "d")).identity
    del m["tokenizer"]["identity"]                                     # as ringpipe wrote it before
    path.write_text(json.dumps(m))
    shards.open_dataset(str(tmp_path / "d"), 16, 0).close()


def test_resuming_on_nanogpt_data_of_another_assumed_vocabulary_says_what_to_do(tmp_path):
    data = tmp_path / "nano"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(97, 123, 3000).astype("<u2").tofile(data / "train.bin")
    rng.integers(97, 123, 500).astype("<u2").tofile(data / "val.bin")
    train(str(tmp_path), str(data), steps=2)
    np.full(500, 200, dtype="<u2").tofile(data / "val.bin")              # now the largest id says 201
    with pytest.raises(ConfigError, match=r"assumed to be 201 .*but the checkpoint's model has 123 tokens.*put "
                                          "the tokenizer.json the data was made with in it"):
        train(str(tmp_path), str(data), steps=4, resume="auto", overwrite=False)


def test_a_resume_on_data_whose_tokenizer_was_resaved_keeps_the_runs_tokenizer_file(tmp_path):
    from ringpipe.engine.data import prepare as prep
    prep.prepare([_corpus(tmp_path)], tmp_path / "d", tokenizer="bpe:300", progress=False)
    out, _ = train(str(tmp_path), str(tmp_path / "d"), steps=2)
    before = (tmp_path / "run" / "tokenizer.json").read_text()
    shutil.copytree(tmp_path / "d", tmp_path / "again", ignore=shutil.ignore_patterns("prepare.lock"))
    (tmp_path / "again" / "tokenizer.json").write_text(resaved(before))   # data.json's identity still matches
    _, rows = train(str(tmp_path), str(tmp_path / "again"), steps=4, resume="auto", overwrite=False)
    assert [r["step"] for r in rows if "loss" in r][-1] == 4
    assert (tmp_path / "run" / "tokenizer.json").read_text() == before   # what the checkpoints' sha256 names


def test_init_from_notes_that_data_without_a_tokenizer_was_checked_by_size_only(tmp_path):
    from ringpipe.engine.interop import hf
    from ringpipe.engine.model.gpt import GPTConfig
    (tmp_path / "config.json").write_text("{}")
    init = (GPTConfig(vocab=50257), {}, str(tmp_path / "tokenizer.json"))
    notes = hf.check_init_data(str(tmp_path), init, 50257, data_has_tokenizer=False)
    assert any("the data has no tokenizer.json" in n and "Copy that tokenizer.json beside" in n for n in notes)
    with pytest.raises(hf.HFError, match=r"the data's vocabulary \(it has no tokenizer.json\) is 128256 tokens"):
        hf.check_init_data(str(tmp_path), init, 128256, data_has_tokenizer=False)
