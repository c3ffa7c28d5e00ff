"""Issue 20, the reading side of `ringpipe prepare` (engine/data/prepare.py's readers,
engine/data/tokenizer.py): inputs that are huge, hostile or damaged end in a refusal that
names the file (a ValueError: exit code 2), never in a traceback, a hang, or memory
that grows with the size of one document."""
import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ringpipe.engine.data import prepare as prep
from ringpipe.engine.data import prepare_job, readers
from ringpipe.engine.data import tokenizer as tk
from tests.support import ROOT
from tests.support.hostile import deadline

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1", RAYON_NUM_THREADS="1",
           RUST_BACKTRACE="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="needs the Hugging Face tokenizers library")
needs_pyarrow = pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow")

# Words of every kind a pre-tokenizer treats apart: letters, digits, punctuation,
# multi-byte letters, emoji, contractions; joined by single and repeated spaces,
# tabs and line breaks, so that safe and unsafe places to cut both occur often.
WORDS = ["the", "quick", "Brown", "fox", "12345", "7", "naïve", "café", "東京", "🐍", "it's", "DON'T", "x",
         "...", "--", "a1b2", "(paren)", "Ünïcödé", "ok.", "end,", "_under_", "ß", "Ωmega"]
GLUE = [" "] * 12 + ["  ", "\n", "\n\n", "\t", " \n", "\r\n", "\n "]


def varied_text(n_chars, seed=0):
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(WORDS) + rng.choice(GLUE)
        out.append(w)
        size += len(w)
    return "".join(out)


def train(texts, vocab_size=400):
    return tk.train_bpe(texts, vocab_size)


def llama3_style_tokenizer(texts):
    """A BPE behind Llama 3's pre-tokenizer regex (a Split, then ByteLevel without its own regex)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers, Regex
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=[tk.END_OF_TEXT],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk.from_json(hf.to_str(), source="llama3-style")


def streamed_ids(tok, text):
    cut = readers.cutter(tok)
    pieces = list(readers._pieces([text], cut, "t.txt", ""))
    assert [last for _, last in pieces] == [False] * (len(pieces) - 1) + [True]
    assert "".join(p for p, _ in pieces) == text
    return np.concatenate(tok.encode_batch([p for p, _ in pieces])), pieces


# ---- 1. a long document is read and encoded in pieces, to the same tokens --------------------

@pytest.mark.parametrize("kind", ["bytes", "bpe", "llama3"])
def test_a_document_encoded_in_pieces_gives_the_ids_of_the_whole(kind, monkeypatch):
    if kind != "bytes" and importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the Hugging Face tokenizers library")
    text = varied_text(120_000, seed=1)
    tok = {"bytes": tk.bytes_tokenizer, "bpe": lambda: train([varied_text(20_000, seed=2)]),
           "llama3": lambda: llama3_style_tokenizer([varied_text(20_000, seed=3)])}[kind]()
    monkeypatch.setattr(readers, "PIECE_CHARS", 997)
    ids, pieces = streamed_ids(tok, text)
    assert len(pieces) > 100
    assert np.array_equal(ids, tok.encode(text))
    if kind != "bytes":          # cut at boundaries, not at the window's end
        assert all(len(p) < 997 for p, last in pieces if not last)


@needs_tokenizers
def test_a_long_run_without_a_boundary_is_cut_hard_and_still_one_document(tmp_path, monkeypatch):
    tok = train([varied_text(20_000, seed=4)])
    text = "x" * 5000 + " tail words here"
    monkeypatch.setattr(readers, "PIECE_CHARS", 1000)
    ids, pieces = streamed_ids(tok, text)
    assert [len(p) for p, _ in pieces[:5]] == [1000] * 5          # the documented hard cut: the window's end
    assert tok.decode(ids) == text
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "long.txt").write_text(text)
    tok.save(str(tmp_path / "tok"))
    m = prep.prepare([str(tmp_path / "in")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tok"), progress=False)
    assert m["sources"][0]["documents"] == 1


@needs_tokenizers
def test_a_tokenizer_that_encodes_pieces_differently_reads_documents_whole_up_to_a_limit(tmp_path, monkeypatch):
    """A normalizer that prepends to every text (Llama 2's "▁") fails the probe: its
    documents are encoded whole, and one past MAX_WHOLE_DOCUMENT is refused, saying why."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    hf = Tokenizer(models.WordLevel({"<unk>": 0, tk.END_OF_TEXT: 1, "▁a": 2}, unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok = tk.from_json(hf.to_str(), source="prepend.json")
    assert readers.cutter(tok) is None
    monkeypatch.setattr(readers, "PIECE_CHARS", 100)
    monkeypatch.setattr(readers, "MAX_WHOLE_DOCUMENT", 1000)
    assert list(readers._pieces(["a b " * 200], None, "f.txt", "")) == [("a b " * 200, True)]
    with pytest.raises(prep.PrepareError, match=r"f.txt, line 3: a document over 1,000 characters.*split the docu"):
        list(readers._pieces(["a b " * 300], None, "f.txt", ", line 3"))


@needs_tokenizers
def test_prepare_in_pieces_writes_the_bytes_of_a_whole_prepare(tmp_path, monkeypatch):
    """The part files' interface: a document in pieces is one document (its counts
    summed, one split), so the shards and manifest are those of encoding it whole."""
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.txt").write_text(varied_text(30_000, seed=5), encoding="utf-8")
    with open(inp / "b.jsonl", "w", encoding="utf-8") as fh:
        for i in range(30):
            fh.write(json.dumps({"text": varied_text(50 + 400 * (i % 7), seed=10 + i)}) + "\n")
    train([varied_text(20_000, seed=6)]).save(str(tmp_path / "tok"))

    def dataset(out, tokenizer, piece_chars):
        monkeypatch.setattr(readers, "PIECE_CHARS", piece_chars)
        m = prep.prepare([str(inp)], str(out), tokenizer=tokenizer, progress=False, val_every=3)
        files = sorted(n for n in os.listdir(out) if n.endswith(".bin"))
        return {n: (out / n).read_bytes() for n in files}, m["splits"], m["sources"]

    for tokenizer in ("bytes", str(tmp_path / "tok")):
        whole = dataset(tmp_path / "whole", tokenizer, 1 << 20)
        pieces = dataset(tmp_path / "pieces", tokenizer, 333)
        assert whole == pieces
        assert whole[2][0]["documents"] == 1 and whole[2][1]["documents"] == 30
        import shutil
        shutil.rmtree(tmp_path / "whole")
        shutil.rmtree(tmp_path / "pieces")


def _peak_rss_mb(path, tmp_path, tokenizer="bytes", limit_gb=2):
    """Peak RSS (MB, the child's own high-water mark) of a prepare of `path`, run in a child under a
    2 GB address-space limit."""
    script = textwrap.dedent(f"""
        import resource, shutil
        resource.setrlimit(resource.RLIMIT_AS, ({limit_gb} << 30, {limit_gb} << 30))
        from ringpipe.engine.data import prepare as prep
        prep.prepare([{str(path)!r}], {str(tmp_path / "out")!r}, tokenizer={tokenizer!r}, progress=False,
                     overwrite=True)
        shutil.rmtree({str(tmp_path / "out")!r})
        # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over exec from the forked
        # parent, so it would start at the test process's own size (seen: 451 MB in the full suite).
        with open("/proc/self/status") as fh:
            print(next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) // 1024)
    """)
    r = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.split()[-1])


def _one_line_file(path, n_bytes):
    block = varied_text(1 << 20, seed=7).replace("\n", " ").replace("\r", " ").encode("utf-8")
    with open(path, "wb") as fh:
        left = n_bytes
        while left > 0:
            fh.write(block[:left])
            left -= len(block)


@pytest.mark.slow
def test_memory_of_a_one_line_txt_does_not_grow_with_its_size(tmp_path):
    """Issue 20: a 1 GiB one-line .txt peaked at 5.3 GB with the bytes tokenizer (the
    file, its str, its bytes and its ids, each whole). 50 MB and 200 MB must now peak
    alike (before the fix: 394 MB and 1,473 MB; after: 108 MB and 110 MB)."""
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    _one_line_file(small, 50_000_000)
    _one_line_file(large, 200_000_000)
    peak_small = _peak_rss_mb(small, tmp_path)
    large_peak = _peak_rss_mb(large, tmp_path)
    print(f"peak RSS: 50 MB -> {peak_small} MB, 200 MB -> {large_peak} MB")
    assert large_peak < peak_small + 60, (peak_small, large_peak)
    assert large_peak < 400


# ---- 2. BPE training reads a bounded sample, in pieces ----------------------------------------

def test_bpe_training_reads_at_most_its_budget_from_every_file(tmp_path):
    paths = []
    for name, n in (("a.txt", 30_000), ("b.txt", 10_000)):
        (tmp_path / name).write_text(varied_text(n, seed=len(name) + n).replace("\n", " "), encoding="utf-8")
        paths.append(tmp_path / name)
    sources = [prep.Source(str(p), p.name, p.stat().st_size) for p in paths]

    class Bar:
        def advance(self, n, tokens=0):
            pass

    used = [0]
    texts = list(prepare_job._texts_for_bpe(sources, "text", Bar(), 8_000, used))
    assert used[0] == sum(len(t.encode("utf-8")) for t in texts) <= 8_000
    assert used[0] > 7_000
    assert texts[0].startswith(paths[0].read_text(encoding="utf-8")[:50])
    assert any(t.startswith(paths[1].read_text(encoding="utf-8")[:50]) for t in texts)   # every file is sampled
    again = [0]
    assert list(prepare_job._texts_for_bpe(sources, "text", Bar(), 8_000, again)) == texts        # deterministic


@needs_tokenizers
def test_bpe_trains_on_pieces_and_the_manifest_says_how_much(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.txt").write_text(varied_text(60_000, seed=8), encoding="utf-8")
    longest, real_train = [], tk.train_bpe

    def spy(texts, vocab_size):
        def seen():
            for t in texts:
                longest.append(len(t))
                yield t
        return real_train(seen(), vocab_size)

    monkeypatch.setattr(tk, "train_bpe", spy)
    monkeypatch.setattr(readers, "PIECE_CHARS", 4096)
    m = prep.prepare([str(tmp_path / "in")], str(tmp_path / "out"), tokenizer="bpe:300", progress=False,
                     bpe_train_mb=0.02)
    assert max(longest) <= 4096 and sum(longest) <= 20_000
    training = m["tokenizer"]["training"]
    assert training["bpe_train_mb"] == 0.02 and 19_000 < training["trained_on_bytes"] <= 20_000
    assert json.loads((tmp_path / "out" / "data.json").read_text())["tokenizer"]["training"] == training


def test_the_bpe_budget_is_a_flag(tmp_path):
    args = prep.build_parser().parse_args(["x.txt", "--out", "o", "--bpe-train-mb", "5"])
    assert args.bpe_train_mb == 5
    assert prep.build_parser().parse_args(["x.txt", "--out", "o"]).bpe_train_mb == prep.DEFAULT_BPE_TRAIN_MB
    with pytest.raises(ValueError, match="--bpe-train-mb 0"):
        prep.prepare([str(tmp_path)], str(tmp_path / "o"), tokenizer="bpe:300", progress=False, bpe_train_mb=0)


# ---- 3. the tokenizers library's own exceptions become refusals naming the file ----------------

def _refused(tmp_path, inputs, tokenizer, match):
    with pytest.raises(ValueError, match=match) as e:
        prep.prepare(inputs, str(tmp_path / "out"), tokenizer=tokenizer, progress=False)
    assert type(e.value).__name__ != "RecursionError"
    return str(e.value)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_lone_surrogate_in_jsonl_is_refused_naming_the_line(tmp_path, tokenizer):
    if tokenizer == "bpe" and importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the Hugging Face tokenizers library")
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "bad \\ud800 half"}\n')
    if tokenizer == "bpe":
        train([varied_text(5000)]).save(str(tmp_path / "tok"))
        tokenizer = str(tmp_path / "tok")
    _refused(tmp_path, [str(path)], tokenizer, r"s.jsonl, line 2: 'text' holds a lone surrogate \(\\ud800")


@needs_tokenizers
def test_a_lone_surrogate_given_to_a_tokenizer_directly_is_a_value_error():
    tok = train([varied_text(5000)])
    for call in (lambda: tok.encode("a\ud800"), lambda: tok.encode_batch(["ok", "a\ud800"]),
                 lambda: tk.bytes_tokenizer().encode("a\udfff")):
        with pytest.raises(ValueError, match="lone surrogate U\\+D[8-9A-F]"):
            call()


def _tokenizer_json(model, pre_tokenizer=None):
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": pre_tokenizer, "post_processor": None, "decoder": None, "model": model})


@needs_tokenizers
def test_a_pathological_regex_that_panics_the_library_is_refused_naming_the_tokenizer(tmp_path):
    """The Rust library panics (pyo3's PanicException, a BaseException) on a regex
    that backtracks past its limit: a ValueError naming the tokenizer file instead."""
    tok_path = tmp_path / "regex.json"
    tok_path.write_text(_tokenizer_json(
        {"type": "WordLevel", "vocab": {"<unk>": 0, tk.END_OF_TEXT: 1, "a": 2}, "unk_token": "<unk>"},
        {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}))
    (tmp_path / "t.txt").write_text("a" * 60 + "\n")
    msg = _refused(tmp_path, [str(tmp_path / "t.txt")], str(tok_path), "failed while encoding text")
    assert str(tok_path) in msg and "t.txt" in msg and "PanicException" in msg


@needs_tokenizers
def test_a_word_level_model_without_its_unknown_token_is_refused_at_load(tmp_path):
    tok_path = tmp_path / "wl.json"
    tok_path.write_text(_tokenizer_json({"type": "WordLevel", "vocab": {"a": 0, tk.END_OF_TEXT: 1},
                                         "unk_token": "<unk>"}, {"type": "Whitespace"}))
    with pytest.raises(ValueError, match=f"{tok_path}.*failed while loading.*UNK"):
        tk.load_tokenizer(str(tok_path))
    (tmp_path / "t.txt").write_text("a b\n")
    _refused(tmp_path, [str(tmp_path / "t.txt")], str(tok_path), str(tok_path))


def test_a_deeply_nested_tokenizer_json_is_refused_naming_it(tmp_path):
    tok_path = tmp_path / "deep.json"
    tok_path.write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=f"{tok_path} is not valid JSON: it is nested too deeply"):
        tk.load_tokenizer(str(tok_path))


def test_a_fifo_as_the_tokenizer_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "tokenizer.json")
    with deadline(10):
        with pytest.raises(ValueError, match="named pipe"):
            tk.load_tokenizer(str(tmp_path))


# ---- 4. deeply nested JSON in a .jsonl line -------------------------------------------------

def test_a_deeply_nested_jsonl_line_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    _refused(tmp_path, [str(path)], "bytes", r"deep.jsonl, line 2 is JSON nested too deeply")


def test_a_jsonl_line_over_the_limit_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "' + "x" * 5000 + '"}\n')
    monkeypatch.setattr(readers, "MAX_JSONL_LINE", 1000)
    _refused(tmp_path, [str(path)], "bytes", r"long.jsonl, line 2 is longer than 1,000 bytes.*\.txt file")
    monkeypatch.setattr(readers, "MAX_JSONL_LINE", 5012)            # the line and its newline: just fits
    prep.prepare([str(path)], str(tmp_path / "out"), progress=False)


# ---- 5. a damaged parquet file ----------------------------------------------------------------

def _parquet(path, n=5000):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [f"document {i} " * 40 for i in range(n)]
    pq.write_table(pa.table({"text": rows}), str(path), row_group_size=500, compression="none")


@needs_pyarrow
def test_a_parquet_damaged_past_its_footer_is_refused_naming_it(tmp_path):
    """The footer (the schema, the row groups) reads; the data pages in the middle are
    garbage: the failure comes from iter_batches, mid-read, and names the file."""
    path = tmp_path / "bad.parquet"
    _parquet(path)
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 20_000] = b"\xab" * 20_000
    path.write_bytes(bytes(raw))
    prep.check_source(prep.Source(str(path), "bad.parquet", len(raw)), "text")       # the cheap check passes
    msg = _refused(tmp_path, [str(path)], "bytes", r"bad.parquet: reading it failed at row \d+ .*damaged")
    assert "Traceback" not in msg


@needs_pyarrow
def test_a_truncated_parquet_is_refused_naming_it(tmp_path):
    path = tmp_path / "cut.parquet"
    _parquet(path)
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    _refused(tmp_path, [str(path)], "bytes", r"cut.parquet is not a readable parquet file")


# ---- 6. FIFOs and devices where a file is expected ---------------------------------------------

@pytest.mark.parametrize("kind", [".txt", ".jsonl", ".parquet"])
def test_readers_refuse_a_fifo_or_a_device_without_blocking(tmp_path, kind):
    if kind == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        pytest.skip("needs pyarrow")
    fifo = tmp_path / f"pipe{kind}"
    os.mkfifo(fifo)
    zero = tmp_path / f"zero{kind}"
    zero.symlink_to("/dev/zero")
    for path, what in ((fifo, "named pipe"), (zero, "character device")):
        source = prep.Source(str(path), path.name, 0)
        with deadline(10):
            with pytest.raises(prep.PrepareError, match=f"{path.name} is a {what}.*not a regular file"):
                prep.check_source(source, "text")
            with pytest.raises(prep.PrepareError, match=f"{path.name} is a {what}.*not a regular file"):
                list(prep.read_pieces(source, "text", None))
            with pytest.raises(prep.PrepareError, match=f"{path.name} is a {what}.*not a regular file"):
                list(prep.read_documents(source, "text"))
