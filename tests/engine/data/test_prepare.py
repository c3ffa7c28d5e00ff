"""`ringpipe prepare` and the token shards it writes (engine/data/prepare.py, engine/data/shards.py,
engine/data/tokenizer.py): what goes in comes back out token for token, in llm.c's format,
the same for 1 and N ranks; the dataset reads only the windows it samples; every
bad input is refused with a message that names it, on every rank, without a hang."""
import importlib.util
import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from ringpipe.engine.data import prepare as prep
from ringpipe.engine.data import shards
from ringpipe.engine.data import tokenizer as tk
from ringpipe.engine.data.datasets import TokenDataset
from tests.support import MPIEXEC, ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RAYON_NUM_THREADS="1",
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="needs the Hugging Face tokenizers library")
needs_pyarrow = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")
needs_mpiexec = pytest.mark.skipif(not os.path.exists(MPIEXEC), reason="no mpiexec next to this python")

# Text with ASCII, multi-byte UTF-8, emoji, a NUL, an empty document.
TEXTS = ["hello world\n", "naïve café, 東京 and a 🐍 emoji\n", "", "null \0 byte", "tabs\tand\r\nnewlines\n\n"]


def documents(n, salt=""):
    return [f"{TEXTS[i % len(TEXTS)]} document {salt}{i} " * (1 + i % 4) for i in range(n)]


def write_corpus(root):
    """A folder of every input kind. Returns [(key, text)] in the order prepare reads them."""
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)
    docs = []
    with open(os.path.join(root, "a.txt"), "w", encoding="utf-8") as fh:
        fh.write("a whole file is one document: ünïcödé 🎉\nsecond line\n")
    docs.append(("a.txt", open(os.path.join(root, "a.txt"), encoding="utf-8").read()))
    lines = documents(40, "j")
    with open(os.path.join(root, "c.jsonl"), "w", encoding="utf-8") as fh:
        for text in lines:
            fh.write(json.dumps({"id": 1, "text": text}) + "\n")
        fh.write("\n")                                        # a blank last line holds no document
    docs += [("c.jsonl", t) for t in lines]
    if importlib.util.find_spec("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        rows = documents(30, "p")
        pq.write_table(pa.table({"text": rows, "n": list(range(30))}), os.path.join(root, "d.parquet"))
        docs += [("d.parquet", t) for t in rows]
    with open(os.path.join(root, "notes.md"), "w") as fh:
        fh.write("not an input kind: skipped\n")
    with open(os.path.join(root, "sub", "b.txt"), "w", encoding="utf-8") as fh:
        fh.write("in a sub-folder\n")
    docs.append(("sub/b.txt", "in a sub-folder\n"))
    return docs


def expected_splits(docs, tok, val_every):
    """What the shards must hold: each document's encoding and the separator, in
    order, the documents split by the crc32 rule (written out here, not prep's)."""
    out = {"train": [], "val": []}
    index = {}
    for key, text in docs:
        i = index[key] = index.get(key, -1) + 1
        split = "val" if zlib.crc32(f"{key}:{i}".encode()) % val_every == 0 else "train"
        out[split] += [tok.encode(text), np.asarray(tok.separator, dtype=tok.dtype)]
    return {s: np.concatenate(parts) for s, parts in out.items()}


def read_split(data_dir, split):
    m = json.load(open(os.path.join(data_dir, "data.json")))
    return np.concatenate([shards.read_shard(os.path.join(data_dir, f)) for f in m["splits"][split]["shards"]])


def run_cli(*args, cwd, n=None, timeout=120):
    cmd = [sys.executable, "-m", "ringpipe.engine.data.prepare", *args]
    if n is not None:
        cmd = [MPIEXEC, "-n", str(n)] + cmd
    try:
        return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{' '.join(cmd)}` still ran after {timeout} s: a hang")


def small_bpe(tmp_path):
    folder = tmp_path / "tok"
    tok = tk.train_bpe(documents(60, "t"), 320)
    tok.save(folder)
    return str(folder / "tokenizer.json")


# ---- what goes in comes out ---------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("bpe:300", marks=needs_tokenizers),
                                       pytest.param("file", marks=needs_tokenizers)])
def test_shards_hold_each_document_then_the_separator_in_order(tmp_path, monkeypatch, tokenizer):
    monkeypatch.chdir(tmp_path)
    docs = write_corpus("corpus")
    spec = small_bpe(tmp_path) if tokenizer == "file" else tokenizer
    m = prep.prepare(["corpus"], "data", tokenizer=spec, val_every=3, progress=False)
    assert [s["path"] for s in m["sources"]] == [os.path.join("corpus", k) for k in dict.fromkeys(k for k, _ in docs)]
    assert m["skipped"] == {"files": 1, "examples": [os.path.join("corpus", "notes.md")]}
    assert m["split"]["method"] == "documents"
    tok = tk.load_tokenizer("data")                  # the tokenizer.json written beside the shards
    assert tok.sha256 == m["tokenizer"]["sha256"]
    assert tok.kind == ("bytes" if tokenizer == "bytes" else "hf")
    expected = expected_splits(docs, tok, 3)
    for split in ("train", "val"):
        np.testing.assert_array_equal(read_split("data", split), expected[split])
        assert m["splits"][split]["tokens"] == len(expected[split])
    assert sum(s["documents"] for s in m["sources"]) == len(docs)
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == len(docs)


def test_few_documents_fall_back_to_the_last_tenth_of_the_tokens(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("one big document, " * 100)
    m = prep.prepare([str(path)], tmp_path / "data", progress=False)
    assert m["split"]["method"] == "tail" and "less than 1%" in m["split"]["why"]
    whole = np.concatenate([read_split(tmp_path / "data", s) for s in ("train", "val")])
    np.testing.assert_array_equal(whole, np.frombuffer(path.read_bytes() + b"\n", np.uint8))
    assert m["splits"]["val"]["tokens"] == len(whole) // 10
    # Bytes stay exact for the bytes tokenizer, even for the document the cut falls into.
    for s in ("train", "val"):
        assert m["splits"][s]["bytes"] == m["splits"][s]["tokens"]


# ---- the shard format ---------------------------------------------------------------------------

def test_shards_are_llmc_bin_files(tmp_path):
    """Read as llm.c's dataloader does: 256 int32 header, magic, version, count, then uint16."""
    (tmp_path / "x.txt").write_text("llm.c " * 50)
    prep.prepare([str(tmp_path / "x.txt")], tmp_path / "d", progress=False)
    for split in ("train", "val"):
        path = tmp_path / "d" / f"{split}_000000.bin"
        with open(path, "rb") as fh:
            header = np.frombuffer(fh.read(256 * 4), dtype="<i4")
            tokens = np.frombuffer(fh.read(), dtype="<u2")
        assert (header[0], header[1]) == (20240520, 1) and not header[3:].any()
        assert header[2] == len(tokens)
        np.testing.assert_array_equal(tokens, shards.read_shard(str(path)))


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    tokens = np.array([0, 65535, 65536, 69999], dtype=np.int64)
    path = shards.write_shard(str(tmp_path / "big.bin"), tokens, vocab_size=70000)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert (header[0], header[1], header[2]) == (20240801, 7, 4)
    assert os.path.getsize(path) == 1024 + 4 * 4
    back = shards.read_shard(path)
    assert back.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(back, tokens)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        shards.write_shard(str(tmp_path / "bad.bin"), [70000], vocab_size=70000)


@needs_tokenizers
def test_prepare_with_a_big_vocabulary_tokenizer_writes_uint32_shards(tmp_path):
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"] = 70000
    doc = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
           "decoder": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
           "added_tokens": [{"id": 70001, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}],
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    (tmp_path / "in.txt").write_text("w1 w69999 w65536 nope " * 30)
    m = prep.prepare([str(tmp_path / "in.txt")], tmp_path / "d", tokenizer=str(tmp_path / "tokenizer.json"),
                     progress=False)
    assert m["tokenizer"]["vocab_size"] == 70002 and m["separator"] == [70001] and m["dtype"] == "uint32"
    whole = np.concatenate([read_split(tmp_path / "d", s) for s in ("train", "val")])
    assert whole.dtype == np.dtype("<u4")
    np.testing.assert_array_equal(whole, [1, 69999, 65536, 70000] * 30 + [70001])


def test_a_truncated_shard_is_refused(tmp_path):
    path = shards.write_shard(str(tmp_path / "train_000000.bin"), np.arange(100), vocab_size=256)
    with open(path, "r+b") as fh:
        fh.truncate(1024 + 2 * 60)
    with pytest.raises(ValueError, match=r"train_000000.bin is truncated: header says 100 tokens, the file holds 60"):
        shards.read_shard(path)
    (tmp_path / "junk.bin").write_bytes(b"\x01\x02\x03\x04" * 300)
    with pytest.raises(ValueError, match="junk.bin is not a token shard"):
        shards.read_shard(str(tmp_path / "junk.bin"))


def test_a_damaged_dataset_is_refused_naming_what_is_wrong(tmp_path):
    (tmp_path / "in.txt").write_text("some text " * 100)
    data = tmp_path / "d"
    prep.prepare([str(tmp_path / "in.txt")], data, progress=False)
    manifest = json.loads((data / "data.json").read_text())

    def refused(match, edit):
        (data / "data.json").write_text(json.dumps(edit(json.loads(json.dumps(manifest)))))
        with pytest.raises(ValueError, match=match):
            shards.open_dataset(str(data), 8, 0)

    held = manifest["splits"]["train"]["tokens"]
    refused(f"the train shards hold {held} tokens, the manifest says {held + 1}", lambda m: {**m, "splits": {
        **m["splits"], "train": {**m["splits"]["train"], "tokens": held + 1}}})
    refused("not 'ringpipe-data'", lambda m: {**m, "format": "other"})
    refused("tokenizer.vocab_size", lambda m: {**m, "tokenizer": {**m["tokenizer"], "vocab_size": "256"}})
    refused("is not a list of file names", lambda m: {**m, "splits": {
        **m["splits"], "val": {**m["splits"]["val"], "shards": ["../x.bin"]}}})
    refused("val_000001.bin does not exist", lambda m: {**m, "splits": {
        **m["splits"], "val": {**m["splits"]["val"], "shards": ["val_000000.bin", "val_000001.bin"]}}})
    (data / "data.json").write_text("{not json")
    with pytest.raises(ValueError, match="data.json is not valid JSON"):
        shards.open_dataset(str(data), 8, 0)
    (data / "data.json").write_text(json.dumps(manifest))
    shards.open_dataset(str(data), 8, 0)                      # intact again
    (data / "tokenizer.json").write_text(tk.bytes_tokenizer().to_json().replace('"use_regex": false', '"use_regex": true'))
    with pytest.raises(ValueError, match="is not the tokenizer the data was prepared with"):
        shards.open_dataset(str(data), 8, 0)


def test_a_nanogpt_folder_is_read(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, 5000).astype(np.uint16).tofile(tmp_path / "train.bin")
    val = rng.integers(0, 1000, 600).astype(np.uint16)
    val[7] = 50300
    val.tofile(tmp_path / "val.bin")
    ds = shards.open_dataset(str(tmp_path), 16, 3)
    assert ds.vocab_size == 50301 and ds.tokenizer is None and ds.bytes_per_token("val") is None
    assert "nanoGPT" in ds.describe() and "largest token id" in ds.describe()
    np.testing.assert_array_equal(ds.splits["val"][np.arange(600)], val)
    x, y = ds.batch(0, 4)
    assert x.shape == (4, 16) and x.dtype == np.int64
    with open(tmp_path / "val.bin", "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(ValueError, match="odd"):
        shards.open_dataset(str(tmp_path), 16, 3)


# ---- 1 rank = N ranks ---------------------------------------------------------------------------

def _dataset_files(folder):
    files = {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder)) if f != "data.json"}
    manifest = json.loads((folder / "data.json").read_text())
    return files, {k: v for k, v in manifest.items() if k not in ("created", "command")}


@needs_mpiexec
@pytest.mark.parametrize("tokenizer", ["bytes", pytest.param("bpe:300", marks=needs_tokenizers)])
def test_one_rank_and_three_ranks_write_the_same_bytes(tmp_path, tokenizer):
    write_corpus(tmp_path / "corpus")
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in documents(25, "m")))
    results = {}
    for n in (1, 3):
        r = run_cli("corpus", "more.jsonl", "--out", f"d{n}", "--tokenizer", tokenizer, "--field", "text",
                    "--tokens-per-shard", "500", "--quiet", cwd=tmp_path, n=n)
        assert r.returncode == 2 and "more.jsonl, line 1 has no 'text' field" in r.stderr   # --field: one name
        r = run_cli("corpus", "--out", f"d{n}", "--tokenizer", tokenizer, "--tokens-per-shard", "500",
                    cwd=tmp_path, n=n)
        assert r.returncode == 0, r.stderr
        assert f"ringpipe train --data d{n}" in r.stdout
        results[n] = _dataset_files(tmp_path / f"d{n}")
        assert not any(f.startswith(".prepare") for f in os.listdir(tmp_path / f"d{n}"))
    assert results[1] == results[3]
    assert len(results[1][1]["splits"]["train"]["shards"]) > 2          # several shards, rolled over at 500


# ---- tokenizers ---------------------------------------------------------------------------------

@needs_tokenizers
def test_bpe_training_is_deterministic():
    texts = documents(80, "d")
    a, b = tk.train_bpe(texts, 400), tk.train_bpe(iter(texts), 400)
    assert a.sha256 == b.sha256 and a.to_json() == b.to_json()
    # As many tokens as asked, or fewer when the text runs out of pairs to merge.
    assert 257 < a.vocab_size <= 400 and a.separator == (a._hf.token_to_id("<|endoftext|>"),)
    text = "naïve 🐍 document 7"
    assert a.decode(a.encode(text)) == text and a.encode(text).dtype == np.uint16


@needs_tokenizers
def test_the_bytes_tokenizer_json_encodes_like_the_bytes_tokenizer(tmp_path):
    import tokenizers
    ours = tk.load_tokenizer("bytes")
    theirs = tokenizers.Tokenizer.from_file(ours.save(tmp_path))
    for text in ["plain ASCII", "naïve café 東京", "emoji 🐍🎉 and ZWJ 👩‍💻", "\0 nul and \x7f del", "\n\t\r", ""]:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False).ids == list(ids) == list(text.encode("utf-8"))
        assert theirs.decode(list(ids)) == ours.decode(ids) == text
    assert tk.load_tokenizer(str(tmp_path)).kind == "bytes"          # its own file comes back as the fast one
    assert ours.decode([0xE6, 0x9D]) == "\ufffd"                     # a cut character: replaced, no error


def test_tokenizer_errors_say_what_to_do(tmp_path):
    for spec, match in [("bpe:abc", "'abc' is not a whole number"), ("bpe:10", "needs more than 257 tokens"),
                        ("bpe:5000000000", "more than 2\\^32")]:
        with pytest.raises(ValueError, match=match):
            tk.parse_vocab_spec(spec)
    (tmp_path / "bad.json").write_text("{ nope")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        tk.load_tokenizer(str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        tk.load_tokenizer(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="more than 2\\^32"):
        tk.Tokenizer("hf", 2**32 + 1, (0,), 0, "{}")


# ---- the dataset --------------------------------------------------------------------------------

@pytest.fixture
def many_shards(tmp_path):
    """A bytes dataset cut into 97-token shards: most windows cross a shard boundary."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(120)))
    prep.prepare([str(tmp_path / "in.jsonl")], tmp_path / "d", tokens_per_shard=97, progress=False)
    return str(tmp_path / "d")


def test_a_batch_is_a_pure_function_of_seed_step_and_split(many_shards):
    a, b = shards.open_dataset(many_shards, 32, seed=5), shards.open_dataset(many_shards, 32, seed=5)
    for split in ("train", "val"):
        for step in (0, 1, 17):
            xa, ya = a.batch(step, 8, split=split)
            xb, yb = b.batch(step, 8, split=split)
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ya, yb)
            np.testing.assert_array_equal(xa[:, 1:], ya[:, :-1])        # targets: the inputs shifted by one
            for lo, hi in ((0, 3), (3, 8), (5, 6)):                        # any rank's rows of the same batch
                x, y = a.batch(step, 8, lo, hi, split=split)
                np.testing.assert_array_equal(x, xa[lo:hi])
                np.testing.assert_array_equal(y, ya[lo:hi])
    assert not np.array_equal(a.batch(0, 8)[0], a.batch(1, 8)[0])
    assert not np.array_equal(a.batch(0, 8)[0], shards.open_dataset(many_shards, 32, seed=6).batch(0, 8)[0])


def test_windows_across_shard_boundaries_read_both_shards(many_shards):
    """The split is one concatenation of its shards: the batches equal TokenDataset's over
    the concatenated array (the same sampler), though nearly every window crosses a boundary."""
    ds = shards.open_dataset(many_shards, 50, seed=1)
    assert len(ds.splits["train"].shards) > 20
    whole = {s: read_split(many_shards, s) for s in ("train", "val")}
    reference = TokenDataset(whole["train"], whole["val"], 50, 1, "reference")
    for split in ("train", "val"):
        for step in range(5):
            for ours, theirs in zip(ds.batch(step, 16, split=split), reference.batch(step, 16, split=split)):
                np.testing.assert_array_equal(ours, theirs)
        tokens = ds.splits[split]
        np.testing.assert_array_equal(tokens[90:300], whole[split][90:300])
        assert tokens[96] == whole[split][96] and tokens[97] == whole[split][97]


def test_the_prefetcher_gives_the_same_batches(many_shards):
    ds = shards.open_dataset(many_shards, 16, seed=2)
    with shards.Prefetcher(ds, 8, 2, 6) as batches:
        for step in (0, 1, 2, 5, 6, 3):                             # in order, a jump, and back
            for ours, direct in zip(batches.get(step), ds.batch(step, 8, 2, 6)):
                np.testing.assert_array_equal(ours, direct)
    assert batches._thread is None

    class Failing:
        def batch(self, step, *args, **kwargs):
            if step == 1:
                raise ValueError("shard vanished")
            return step

    failing = shards.Prefetcher(Failing(), 4)
    assert failing.get(0) == 0
    with pytest.raises(ValueError, match="shard vanished"):
        failing.get(1)                                              # the background error, raised here
    assert failing.get(2) == 2
    failing.close()


def test_unigram_entropy_and_bytes_per_token_are_sane(tmp_path, many_shards):
    ds = shards.open_dataset(many_shards, 16, seed=0)
    assert ds.bytes_per_token("val") == 1.0 and ds.bytes_per_token("train") == 1.0
    assert 0 < ds.unigram_entropy() < np.log(256)
    assert "read by window" in ds.describe() and "tokenizer bytes" in ds.describe()
    # Uniform random tokens over 1000 ids: the best context-free model costs log(1000) nats.
    rng = np.random.default_rng(0)
    split_shards = {}
    for split, n in (("train", 400_000), ("val", 100_000)):
        path = shards.write_shard(str(tmp_path / f"{split}.shard"), rng.integers(0, 1000, n), vocab_size=1000)
        split_shards[split] = [shards.inspect_shard(path)]
    uniform = shards.ShardDataset(split_shards, 16, 0, vocab_size=1000, tokenizer=None, name="uniform",
                                  description="uniform", text_bytes={"train": 1_200_000, "val": 300_000})
    assert abs(uniform.unigram_entropy() - np.log(1000)) < 0.01
    assert uniform.bytes_per_token("val") == 3.0
    narrow = shards.ShardDataset(split_shards, 16, 0, vocab_size=500, tokenizer=None, name="too narrow",
                                 description="")
    with pytest.raises(ValueError, match="holds token id 999 at token position .*, outside the tokenizer's vocabulary 0..499"):
        narrow.unigram_entropy()


def write_manifest(data, tokens, bytes_per_token=1):
    """A manifest for shards written by hand (train_000000.bin, val_000000.bin)."""
    tok = tk.bytes_tokenizer()
    tok.save(data)
    shards.write_manifest(str(data), {
        "format": "ringpipe-data", "version": 1,
        "tokenizer": {"kind": "bytes", "file": "tokenizer.json", "sha256": tok.sha256, "vocab_size": 256},
        "separator": [10], "dtype": "uint16", "tokens_per_shard": 2**31 - 1,
        "splits": {s: {"shards": [f"{s}_000000.bin"], "tokens": n, "bytes": bytes_per_token * n, "documents": 1}
                   for s, n in tokens.items()},
        "split": {"method": "by hand"}, "sources": [], "skipped": {"files": 0, "examples": []},
        "created": "now", "command": "test"})


def _rss_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_big_dataset_is_batched_without_reading_it(tmp_path):
    """200 MB of tokens: opening, describing and batching it grows the process by far less
    than 10% of that (only the sampled windows are read)."""
    n = 100_000_000
    rng = np.random.default_rng(0)
    with shards.ShardWriter(str(tmp_path / "train_000000.bin"), vocab_size=256) as writer:
        for _ in range(10):
            writer.write(rng.integers(0, 256, n // 10, dtype=np.uint16))
    shards.write_shard(str(tmp_path / "val_000000.bin"), rng.integers(0, 256, 100_000), vocab_size=256)
    write_manifest(tmp_path, {"train": n, "val": 100_000})
    # In the page cache, as a dataset is right after prepare: a memory map of a cached file
    # counted whole folios of it per fault (92% of a corpus, measured); pread counts nothing.
    before = _rss_bytes()
    ds = shards.open_dataset(str(tmp_path), 1024, seed=0)
    ds.describe()
    with shards.Prefetcher(ds, 16) as batches:
        for step in range(20):
            x, y = batches.get(step)
            ds.batch(step, 16, split="val")
    grown = _rss_bytes() - before
    assert x.shape == (16, 1024)
    assert grown < 0.1 * 2 * n, f"RSS grew by {grown / 1e6:.1f} MB for a {2 * n / 1e6:.0f} MB shard"


# ---- the command and its errors -------------------------------------------------------------------

def test_help_explains_and_main_returns_an_exit_code(capsys):
    assert prep.main(["--help"]) == 0
    text = capsys.readouterr().out
    for word in ("--tokenizer", "bpe:VOCAB", "--field", "--val-every", "--tokens-per-shard", ".parquet", "mpiexec"):
        assert word in text
    assert prep.main(["x.txt"]) == 2                                  # no --out: argparse's usage error


def test_overwrite_replaces_a_dataset_and_leaves_no_stale_shards(tmp_path):
    (tmp_path / "in.txt").write_text("x" * 1000)
    prep.prepare([str(tmp_path / "in.txt")], tmp_path / "d", tokens_per_shard=100, progress=False)
    assert len(os.listdir(tmp_path / "d")) == 2 + 10 + 1 + 1              # + prepare.lock, which stays
    with pytest.raises(ValueError, match="already holds a dataset"):
        prep.prepare([str(tmp_path / "in.txt")], tmp_path / "d", progress=False)
    m = prep.prepare([str(tmp_path / "in.txt")], tmp_path / "d", overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path / "d")) == ["data.json", "prepare.lock", "tokenizer.json", "train_000000.bin",
                                                  "val_000000.bin"]
    assert m["splits"]["train"]["shards"] == ["train_000000.bin"]


def _bad_inputs(tmp_path):
    """(name, CLI arguments, the message's part) for every input prepare must refuse."""
    t = tmp_path
    (t / "ok.txt").write_text("fine text\n" * 20)
    (t / "empty.txt").write_text("")
    (t / "binary.txt").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0" * 50)
    (t / "latin1.txt").write_bytes(b"caf\xe9 " * 10)
    (t / "notjson.jsonl").write_text('{"text": "a"}\n{"text": broken}\n')
    (t / "nofield.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    (t / "number.jsonl").write_text('{"text": 42}\n')
    (t / "table.csv").write_text("a,b\n1,2\n")
    (t / "bad_tokenizer.json").write_text("{ not json")
    prep.prepare([str(t / "ok.txt")], t / "existing", progress=False)
    cases = [
        ("missing", ["nothere.txt", "--out", "o"], "input nothere.txt does not exist"),
        ("empty", ["empty.txt", "--out", "o"], "input empty.txt is empty"),
        ("binary", ["binary.txt", "--out", "o"], "input binary.txt is not text: NUL bytes or invalid UTF-8"),
        ("not utf-8", ["latin1.txt", "--out", "o"], "input latin1.txt is not text"),
        ("not json", ["notjson.jsonl", "--out", "o"], "input notjson.jsonl, line 2 is not JSON"),
        ("no field", ["nofield.jsonl", "--out", "o"], "input nofield.jsonl, line 3 has no 'text' field (its "
                                                      "fields: body); pass --field"),
        ("not a string", ["number.jsonl", "--out", "o"], "input number.jsonl, line 1: 'text' is a JSON int, not a "
                                                         "string"),
        ("extension", ["table.csv", "--out", "o"], "input table.csv: unsupported file type .csv"),
        ("tokenizer", ["ok.txt", "--out", "o", "--tokenizer", "bad_tokenizer.json"],
         "bad_tokenizer.json is not valid JSON"),
        ("tokenizer missing", ["ok.txt", "--out", "o", "--tokenizer", "nope/tokenizer.json"],
         "nope/tokenizer.json does not exist"),
        ("bpe:abc", ["ok.txt", "--out", "o", "--tokenizer", "bpe:abc"], "'abc' is not a whole number"),
        ("bpe:10", ["ok.txt", "--out", "o", "--tokenizer", "bpe:10"], "needs more than 257 tokens"),
        ("vocab over uint32", ["ok.txt", "--out", "o", "--tokenizer", "bpe:4294967297"], "more than 2^32"),
        ("existing dataset", ["ok.txt", "--out", "existing"], "--out existing already holds a dataset"),
        ("val-every", ["ok.txt", "--out", "o", "--val-every", "1"], "--val-every 1: must be a whole number from 2 to 100"),
        ("twice", ["ok.txt", "ok.txt", "--out", "o"], "is given twice"),
    ]
    if importlib.util.find_spec("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"content": ["x"]}), t / "nocolumn.parquet")
        cases.append(("parquet column", ["nocolumn.parquet", "--out", "o"],
                      "input nocolumn.parquet has no column 'text' (its columns: content)"))
    return cases


def test_every_bad_input_is_refused_with_a_clear_message(tmp_path):
    for name, args, message in _bad_inputs(tmp_path):
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert message in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr, (name, r.stderr)
        assert not os.path.exists(tmp_path / "o"), name             # nothing written, no empty folder left
    assert os.path.exists(tmp_path / "existing" / "train_000000.bin")  # the refused --out is untouched


@needs_mpiexec
@pytest.mark.parametrize("bad", ["not json", "binary"])
def test_a_bad_file_on_one_rank_stops_every_rank(tmp_path, bad):
    """File 1 of 2 belongs to rank 1: its error must reach rank 0 (which prints it), and both exit."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "0.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in documents(50)))
    if bad == "not json":
        (tmp_path / "in" / "1.jsonl").write_text('{"text": "fine"}\n' * 500 + "oops\n")
        message = "1.jsonl, line 501 is not JSON"
    else:
        (tmp_path / "in" / "1.jsonl").write_bytes(b"\0\1\2" * 100)
        message = "1.jsonl is not text"
    r = run_cli("in", "--out", "o", cwd=tmp_path, n=2, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "failed on rank(s) [1] only" in r.stderr and message in r.stderr
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "o")


@needs_mpiexec
def test_the_library_prepares_on_a_communicator_of_the_callers(tmp_path, monkeypatch):
    """prepare(world=...) on a Dup of COMM_WORLD under 2 ranks: every rank returns the
    manifest, and the data equals that of prepare() in one process."""
    monkeypatch.chdir(tmp_path)
    write_corpus("corpus")
    script = os.path.join(ROOT, "tests", "support", "mpi_scripts", "prepare_parallel.py")
    try:
        r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script, "two", "bytes", "corpus"], env=ENV,
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("prepare on 2 ranks still ran after 120 s: a hang")
    assert r.returncode == 0, r.stderr
    parallel = json.loads(r.stdout)
    serial = prep.prepare(["corpus"], "one", progress=False, tokens_per_shard=300)
    assert {k: v for k, v in parallel.items() if k not in ("created", "command")} == \
        {k: v for k, v in serial.items() if k not in ("created", "command")}
    assert _dataset_files(tmp_path / "two") == _dataset_files(tmp_path / "one")
