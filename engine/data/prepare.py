"""`ringpipe prepare`: text in, token shards and a manifest out (the format is engine/data/shards.py's).

    ringpipe prepare corpus/ --out data/mine --tokenizer bpe:8192
    mpiexec -n 8 ringpipe prepare web/*.parquet --out data/web --tokenizer path/to/tokenizer.json
    ringpipe train --data data/mine

Inputs: .txt files (a file is one document), .jsonl (a document per line: the
--field value), .parquet (a document per row of the --field column), or folders
of them. Each document is encoded and followed by the tokenizer's separator; a
document goes to validation when crc32("KEY:INDEX") % val_every == 0, KEY being
its file's path inside the folder given (or the file's name) and INDEX its place
in the file: the split is the same wherever the data lives and however many
ranks prepare it.

The steps, each ending with every rank agreeing on its outcome (so a bad file on
one rank stops all ranks with the same message, never leaves them waiting):

  1. rank 0 lists the input files, folders walked in sorted order
  2. every rank checks its share (file i belongs to rank i % ranks): not empty, text, has the field
  3. rank 0 takes the out folder: flock(LOCK_EX) on OUT/prepare.lock for the whole run
     (refused while another prepare, or a training run holding it shared, uses the
     folder), checks what the folder holds, makes a temporary parts folder inside it
  4. the tokenizer: bytes, a tokenizer.json, or bpe:VOCAB trained by rank 0 on the text
     (at most --bpe-train-mb MB of it, sampled from every file)
  5. every rank tokenizes its share, a part file per input file
  6. rank 0 joins the parts in file order into the new dataset's shards, tokenizer.json and
     data.json in PARTS/dataset/, then swaps it in (renames only): a journal of the names
     (OUT/previous/swap.json), the old dataset's files hard-linked into OUT/previous/, the new
     ones renamed in (data.json last), the old shards the new data.json does not name removed,
     OUT/previous/ removed. At every instant OUT or OUT/previous/ holds a whole dataset (on a
     filesystem without hard links the old files are moved there instead: whole again once
     moved). A failure or Ctrl-C during the swap puts the old dataset back; after a kill the
     next prepare does (from the journal), and says so. The parts folder is removed and the
     lock released however the run ends (the lock file stays, emptied: training runs lock it too).

What prepare deletes: only its own parts folder, and under --overwrite the files the
old data.json names. Shards no data.json names (llm.c's, or a dataset whose manifest
was lost) are refused, never replaced. Symbolic links inside input folders that lead
out of them are skipped and listed (--follow-symlinks reads them); a folder that cannot
be read is refused, naming it. Write errors (a full disk) name the file, exit 2, and
leave the old dataset as it was.

The shards and manifest are the same bytes for 1 rank and N ranks (but for the
manifest's "created" and "command").
"""
from __future__ import annotations

import argparse
import array
import codecs
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import time
import zlib

import numpy as np

from ringpipe.engine.job import files
from ringpipe.engine.data import shards
from ringpipe.engine.data import tokenizer as tokenizers_
from ringpipe.engine.data.datasets import looks_like_text      # the trainer's own test of "is this text?"

SUPPORTED = (".txt", ".jsonl", ".parquet")
DEFAULT_TOKENS_PER_SHARD = 100_000_000        # llm.c's fineweb shards
DEFAULT_VAL_EVERY = 10
TAIL_VAL_FRACTION = 0.1                       # when the per-document split does not work
PARTS_PREFIX = ".prepare-parts-"
_HEAD_BYTES = 8192                            # how much of a file the text check reads


class PrepareError(ValueError):
    """Bad input or settings: the message names the file and says what to do."""


# ---- one process or MPI -------------------------------------------------------------------

class OneProcess:
    """The few communicator calls prepare() makes, for a run without MPI."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]

    def bcast(self, obj, root=0):
        return obj


def _wait_for_all(world):
    """A barrier that sleeps while it waits: ranks with nothing left to do would
    otherwise spin in MPI and take the cores from the ranks still working."""
    if world.Get_size() == 1:
        return
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.02)


def _then_wait(world, fn):
    def run():
        try:
            return fn()
        finally:
            _wait_for_all(world)     # reached on success and failure alike, so no rank waits forever
    return run


def _on_every_rank(world, fn, what):
    """fn() on every rank; a refusal anywhere becomes the same error everywhere."""
    from ringpipe.engine.job.agreement import agree
    return agree(world, _then_wait(world, fn), what, hint="each rank reads its own share of the files")


def _on_rank0(world, fn, what):
    """fn() on rank 0 only; every rank gets its result or its error."""
    from ringpipe.engine.job.agreement import agree_on_rank0
    if world.Get_rank() == 0:
        return agree_on_rank0(world, _then_wait(world, fn), what)
    _wait_for_all(world)
    return agree_on_rank0(world, fn, what)


# ---- step 1: the input files --------------------------------------------------------------

class Source:
    """One input file. `path`: as the user wrote it (the folder given + the path inside
    it); `key`: what the split hashes (the path inside the folder, or the file's name)."""

    def __init__(self, path: str, key: str, size: int):
        self.path, self.key, self.size = path, key, size
        self.kind = os.path.splitext(path)[1].lower()

    def __repr__(self):
        return f"Source({self.path!r})"


def _shown(path: str) -> str:
    """A path relative to the working directory when it lies under it, else as it is."""
    path = os.path.normpath(path)
    if os.path.isabs(path):
        rel = os.path.relpath(path, os.getcwd())
        if not rel.startswith(".."):
            return rel
    return path


def list_sources(inputs: list[str], follow_symlinks: bool = False) -> tuple[list[Source], list[str], list[str]]:
    """The input files in order (each folder walked in sorted order, hidden entries
    left out), the other files found in folders (skipped), and the symbolic links
    inside folders that lead out of the folder given (skipped unless follow_symlinks:
    `in/secret.txt -> /etc/passwd` must not end up in the shards because a folder was
    prepared). An INPUT that is itself a link is the user's explicit choice and is read."""
    if not inputs:
        raise PrepareError("no input given; pass .txt, .jsonl or .parquet files, or folders of them")
    found, skipped, links, seen = [], [], [], {}
    for given in inputs:
        if not os.path.exists(given):
            raise PrepareError(f"input {given} does not exist; check the path")
        if os.path.isdir(given):
            found += _walk_folder(given, follow_symlinks, skipped, links)
        else:
            if not os.path.isfile(given):
                raise PrepareError(f"input {given} is not a regular file or folder (a FIFO or device?); "
                                   "pass text files or folders")
            if not given.lower().endswith(SUPPORTED):
                ext = os.path.splitext(given)[1] or "(none)"
                raise PrepareError(f"input {given}: unsupported file type {ext}; ringpipe prepare reads .txt (a "
                                   "document per file), .jsonl (a document per line) and .parquet (a document per "
                                   "row); convert it, or pass its folder (where other files are skipped)")
            found.append((given, os.path.basename(given), given))
    sources = []
    for path, key, given in found:
        real = os.path.realpath(path)
        if real in seen:
            # Often a symbolic link inside a folder to another file of it, not a repeated argument.
            how = "is the same file as" if os.path.islink(path) or os.path.islink(seen[real]) else "is given twice: also as"
            raise PrepareError(f"input {_shown(path)} {how} {seen[real]} (from the inputs you passed); read each "
                               "file once (remove the link, or the repeated input), or its text would be in the "
                               "data twice")
        seen[real] = _shown(path)
        sources.append(Source(_shown(path), key, os.path.getsize(path)))
    if not sources:
        raise PrepareError(f"no .txt, .jsonl or .parquet file in {', '.join(inputs)}"
                           + (f" ({len(skipped)} other file(s) skipped, e.g. {skipped[0]})" if skipped else "")
                           + (f" ({len(links)} symbolic link(s) out of the folder skipped, e.g. {links[0]}; pass "
                              "--follow-symlinks to read them)" if links else ""))
    return sources, skipped, links


def _walk_folder(given: str, follow_symlinks: bool, skipped: list, links: list) -> list:
    """(path, key, given) of the supported files under the folder `given`, in sorted order."""
    root = os.path.realpath(given)

    def inside(real):
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    def unreadable(e: OSError):
        # os.walk would skip a folder it cannot list without a word, and its files would be
        # silently missing from the data: refuse instead, naming it.
        where = _shown(e.filename) if e.filename else given
        raise PrepareError(f"input folder {where} cannot be read ({e.strerror or e}); make it readable (chmod) "
                           "or move it out of the input folder")

    found = []
    walked = set()                 # the real folders walked: a followed link back up is not walked twice
    for dirpath, dirs, names in os.walk(given, onerror=unreadable, followlinks=follow_symlinks):
        walked.add(os.path.realpath(dirpath))
        keep = []
        for name in sorted(dirs):
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                if inside(real) and not follow_symlinks:
                    continue       # a link to a folder of the input itself: its files are read where they are
                if not follow_symlinks:
                    links.append(f"{_shown(path)} -> {real}")
                    continue
                if real in walked or any(real == w or w.startswith(real + os.sep) for w in walked):
                    continue       # a loop (a link to a folder above it, or one walked already)
            keep.append(name)
        dirs[:] = keep
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and not follow_symlinks and not inside(os.path.realpath(path)):
                links.append(f"{_shown(path)} -> {os.path.realpath(path)}")
                continue
            if not name.lower().endswith(SUPPORTED) or not os.path.isfile(path):
                skipped.append(_shown(path))
                continue
            key = os.path.relpath(path, given).replace(os.sep, "/")
            found.append((path, key, given))
    return found


# ---- step 2: checks before any work -------------------------------------------------------

def check_source(source: Source, field: str) -> None:
    """The checks that cost little, so a bad file is found before hours of tokenizing.
    The file is opened without blocking and must be a regular file (files.open_regular):
    a FIFO would otherwise wait forever for a writer, and /dev/zero be read forever."""
    path = source.path
    if not os.path.lexists(path):
        raise PrepareError(f"input {path} does not exist (any more) on this rank; is the folder on a filesystem "
                           "every rank sees?")
    with os.fdopen(_open_input(path), "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise PrepareError(f"input {path} is empty (0 bytes); remove it, or fill it")
        if source.kind == ".parquet":
            _parquet_column(path, field, fh)
            return
        head = fh.read(_HEAD_BYTES)
    if not looks_like_text(head):
        raise PrepareError(f"input {path} is not text: NUL bytes or invalid UTF-8 in its first 8 KiB; remove it "
                           "from the inputs (or convert it to UTF-8 text)")


def _open_input(path: str) -> int:
    """A descriptor of the input file `path`; PrepareError if it is not a regular file
    (a FIFO, a device, a socket), checked on the descriptor that is then read."""
    try:
        return files.open_regular(path, "input")
    except files.UnreadableFile as e:
        raise PrepareError(f"{e}; leave it out of the inputs") from None


def _parquet_column(path: str, field: str, fh):
    """The parquet file open on `fh`, after checking that it has a string column `field`."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"input {path}: reading .parquet needs pyarrow: pip install 'pyarrow>=14' "
                           "(or pip install -e '.[data]')") from None
    try:
        pf = pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as e:
        raise PrepareError(f"input {path} is not a readable parquet file ({e}); check the file") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise PrepareError(f"input {path} has no column {field!r} (its columns: {', '.join(names[:20])}); "
                           "pass --field NAME to read another one")
    column_type = pf.schema_arrow.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or getattr(pa.types, "is_string_view", lambda t: False)(column_type)):
        raise PrepareError(f"input {path}: column {field!r} holds {column_type}, not strings; pass --field with "
                           "a text column")
    if pf.metadata.num_rows == 0:
        raise PrepareError(f"input {path} holds no rows; remove it from the inputs")
    return pf


# ---- reading documents --------------------------------------------------------------------
#
# Memory must not grow with the size of a document (a 1 GiB one-line .txt peaked at
# 5.3 GB, a 100 MB document under bpe:1000 at 16.4 GB): a document is read and encoded
# in pieces of at most PIECE_CHARS characters, each a document of its own to the
# tokenizer, and counted as ONE document in the part's table (its tokens and bytes
# summed, one split), so the shards are those of encoding it whole. Where a piece is
# cut (_cut_at):
#   - bytes tokenizer: anywhere between two characters (its ids are the UTF-8 bytes);
#   - a Hugging Face tokenizer: at the last _SAFE_CUT boundary in the piece: before a
#     space between two word characters ("foo| bar"), or after a line break between
#     two ("foo\n|bar"). GPT-2's, Llama 3's and our own BPE's pre-tokenizers end a
#     pre-token there and start the next alike with or without the text before it, and
#     BPE never merges across pre-tokens. _cuts_alike checks this on the tokenizer at
#     hand (a normalizer that prepends "▁" to every text fails it): one that fails
#     encodes each document whole, refusing one over MAX_WHOLE_DOCUMENT characters.
#   - the hard-cut rule: when no boundary lies within the PIECE_CHARS window (a
#     megabyte without a space or a line break), the piece is cut at the window's end,
#     between two characters; only the tokens at that cut may differ from encoding the
#     text whole (one pre-token becomes two).
# A document of at most PIECE_CHARS characters is never cut: it is encoded whole, as ever.

PIECE_CHARS = 1 << 20
MAX_JSONL_LINE = 64 << 20          # a .jsonl line is JSON, parsed whole: a longer one is refused (see _jsonl_documents)
MAX_WHOLE_DOCUMENT = 16 << 20      # characters, for a tokenizer that pieces cannot be given to (see above)
DEFAULT_BPE_TRAIN_MB = 1024        # how much text bpe:VOCAB trains on at most (--bpe-train-mb)
_SAFE_CUT = re.compile(r"(?<=[^\W_])(?= [^\W_])|(?<=[^\W_]\n)(?=[^\W_])")
# Text with every kind of boundary _SAFE_CUT finds, and the neighbours that could join across one.
_CUT_PROBE = ("The quick brown fox, 3 jumped over 1234567 lazy dogs.\nNew line here\n\n  Indented  text\twith tabs"
              " naïve café 東京 and 🐍 emoji; it's don't WE'LL x\nyes\r\nno - dash -- and... dots 12 34 56 a1b2 c3"
              " Ünïcödé words\nend a\nb\n c d\n\ne f  g")


def _cut_at(text: str, start: int, end: int, safe=_SAFE_CUT) -> int:
    """Where the piece text[start:...] ends: start < at <= end; the last `safe` boundary
    before `end` (searched in growing windows from the end), else `end` (a hard cut).
    safe=None: anywhere (the bytes tokenizer)."""
    if safe is None:
        return end
    for back in (1 << 12, 1 << 16, end - start):
        lo = max(start + 1, end - back)
        last = None
        for m in safe.finditer(text, lo, end):
            last = m.start()
        if last is not None:
            return last
        if lo == start + 1:
            break
    return end


_ALIKE: dict = {}      # tokenizer sha256 -> whether _cuts_alike


def _cuts_alike(tok) -> bool:
    """Whether `tok` encodes text cut at _SAFE_CUT boundaries, piece by piece, to the
    ids of the whole text (checked on _CUT_PROBE, cut at every boundary)."""
    if tok.sha256 not in _ALIKE:
        cuts = [0] + [m.start() for m in _SAFE_CUT.finditer(_CUT_PROBE)] + [len(_CUT_PROBE)]
        pieces = [_CUT_PROBE[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
        whole = tok.encode(_CUT_PROBE)
        joined = np.concatenate(tok.encode_batch(pieces))
        _ALIKE[tok.sha256] = len(whole) == len(joined) and bool((whole == joined).all())
    return _ALIKE[tok.sha256]


def _cutter(tok):
    """How documents are cut for `tok` (see above): a function (text, start, end) -> at, or
    None: not at all."""
    if tok.kind == "bytes":
        return lambda text, start, end: end
    if _cuts_alike(tok):
        return _cut_at
    return None


def _pieces(chunks, cut, path: str, where: str):
    """One document, given as str chunks, as (piece, last) pairs: one piece when it holds
    at most PIECE_CHARS characters, else pieces of at most that many, ended where `cut`
    says. cut=None: the document whole, refused past MAX_WHOLE_DOCUMENT characters."""
    buf, pos = "", 0
    for chunk in chunks:
        if chunk:
            buf = buf[pos:] + chunk
            pos = 0
        if cut is None:
            if len(buf) > MAX_WHOLE_DOCUMENT:
                raise PrepareError(
                    f"input {path}{where}: a document over {MAX_WHOLE_DOCUMENT:,} characters, and this tokenizer "
                    "encodes a document cut in pieces differently from the whole (its normalizer or pre-tokenizer "
                    "joins text across spaces), so it would have to be held and encoded whole: split the document, "
                    "or use 'bytes' or bpe:VOCAB")
            continue
        while len(buf) - pos > PIECE_CHARS:
            at = cut(buf, pos, pos + PIECE_CHARS)
            yield buf[pos:at], False
            pos = at
    yield buf[pos:], True


def read_pieces(source: Source, field: str, cut):
    """The documents of a file, in order, as (piece, last) pairs (see _pieces); a .txt
    file is read PIECE_CHARS bytes at a time, so memory stays bounded however long its line."""
    if source.kind == ".txt":
        yield from _pieces(_txt_chunks(source.path), cut, source.path, "")
        return
    documents = _jsonl_documents(source.path, field) if source.kind == ".jsonl" else \
        _parquet_documents(source.path, field)
    for text, where in documents:
        yield from _pieces((text,), cut, source.path, where)


def read_documents(source: Source, field: str):
    """The documents of a file, in order, as whole str; PrepareError naming the file (and
    the line or row) for anything that is not UTF-8 text or lacks the field. (Holds a
    document whole: prepare itself reads read_pieces.)"""
    if source.kind == ".txt":
        yield "".join(_txt_chunks(source.path))
    elif source.kind == ".jsonl":
        yield from (text for text, _ in _jsonl_documents(source.path, field))
    else:
        yield from (text for text, _ in _parquet_documents(source.path, field))


def _txt_chunks(path: str):
    """A .txt file's text, decoded PIECE_CHARS bytes at a time (a character cut by a
    read is completed by the next: the incremental decoder keeps its first bytes)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0                                           # bytes read before this read
    with os.fdopen(_open_input(path), "rb") as fh:
        while True:
            raw = fh.read(PIECE_CHARS)
            pending = len(decoder.getstate()[0])         # bytes of a character the last read cut
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise PrepareError(f"input {path}: invalid UTF-8 at byte {offset - pending + e.start}; ringpipe "
                                   "prepare reads UTF-8 text: convert the file (e.g. iconv -f latin1 -t utf-8) "
                                   "or leave it out") from None
            offset += len(raw)
            if text:
                yield text
            if not raw:
                return


def _decode(raw: bytes, path: str, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PrepareError(f"input {path}{where}: invalid UTF-8 at byte {e.start}; ringpipe prepare reads UTF-8 "
                           "text: convert the file (e.g. iconv -f latin1 -t utf-8) or leave it out") from None


def _jsonl_documents(path: str, field: str):
    """(text, where) of each line's document."""
    n_documents = 0
    with os.fdopen(_open_input(path), "rb") as fh:
        line_no = 0
        while True:
            # A line is read whole (JSON is parsed whole), so its length is bounded before
            # it is read: a 20 GB line without a newline would otherwise fill the memory.
            raw = fh.readline(MAX_JSONL_LINE + 1)
            if not raw:
                break
            line_no += 1
            where = f", line {line_no}"
            if len(raw) > MAX_JSONL_LINE and not raw.endswith(b"\n"):
                raise PrepareError(f"input {path}{where} is longer than {MAX_JSONL_LINE:,} bytes, the most a .jsonl "
                                   "line may hold (it is parsed whole): put so long a document in a .txt file of "
                                   "its own (read in pieces), or split it")
            line = _decode(raw, path, where)
            if not line.strip():
                continue                                 # a blank line (often the last) holds no document
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"input {path}{where} is not JSON ({e.msg} at column {e.colno}); every line of "
                                   "a .jsonl file must be one JSON object") from None
            except RecursionError:
                raise PrepareError(f"input {path}{where} is JSON nested too deeply to read; every line of a .jsonl "
                                   f"file must be one JSON object with a {field!r} string") from None
            if not isinstance(record, dict):
                raise PrepareError(f"input {path}{where} is a JSON {type(record).__name__}, not an object with a "
                                   f"{field!r} field")
            if field not in record:
                keys = ", ".join(list(record)[:10]) or "none"
                raise PrepareError(f"input {path}{where} has no {field!r} field (its fields: {keys}); pass --field "
                                   "NAME to read another one")
            text = record[field]
            if not isinstance(text, str):
                raise PrepareError(f"input {path}{where}: {field!r} is a JSON {type(text).__name__}, not a string; "
                                   "pass --field with a text field")
            if "\\u" in line:                            # only an escape can make a lone surrogate
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    code = ord(text[e.start])
                    raise PrepareError(f"input {path}{where}: {field!r} holds a lone surrogate (\\u{code:04x} at "
                                       f"character {e.start}: half of a UTF-16 pair, which JSON allows but "
                                       "text cannot hold); fix the line, or leave it out") from None
            n_documents += 1
            yield text, where
    if n_documents == 0:
        raise PrepareError(f"input {path} holds no documents (only blank lines); remove it from the inputs")


def _parquet_documents(path: str, field: str):
    """(text, where) of each row's document. A file damaged past its footer (truncated,
    overwritten) fails in the middle of reading: a PrepareError naming it, too."""
    with os.fdopen(_open_input(path), "rb") as fh:
        pf = _parquet_column(path, field, fh)
        import pyarrow as pa
        batches = pf.iter_batches(batch_size=1024, columns=[field])
        row = 0
        while True:
            try:
                batch = next(batches, None)
                texts = None if batch is None else batch.column(0).to_pylist()
            except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
                raise PrepareError(f"input {path}: reading it failed at row {row} ({type(e).__name__}: {e}); the "
                                   "file is damaged (truncated, or partly overwritten): write it again, or leave "
                                   "it out") from None
            if texts is None:
                break
            for text in texts:
                if text is None:
                    raise PrepareError(f"input {path}, row {row}: {field!r} is null; fill or drop the rows without "
                                       "text")
                yield text, f", row {row}"
                row += 1


def _batches(pieces, max_docs=256, max_bytes=4 << 20):
    """(piece, last) pairs in groups (a few MB each), for encode_batch's threads."""
    group, size = [], 0
    for item in pieces:
        group.append(item)
        size += len(item[0])
        if len(group) >= max_docs or size >= max_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def _is_val(key: str, index: int, val_every: int) -> bool:
    return zlib.crc32(f"{key}:{index}".encode("utf-8")) % val_every == 0


# ---- step 5: a file's tokens into a part ------------------------------------------------

def _part_paths(parts_dir: str, index: int) -> tuple[str, str]:
    return (os.path.join(parts_dir, f"{index:08d}.tokens"), os.path.join(parts_dir, f"{index:08d}.docs.npy"))


# A part's documents: their tokens (separator included), text bytes, and split.
_DOC_DTYPE = np.dtype([("tokens", "<i8"), ("bytes", "<i8"), ("val", "?")])


def tokenize_source(source: Source, index: int, tok, field: str, val_every: int, parts_dir: str, bar=None):
    """Encode the documents of `source`, each followed by the separator, into the
    part files of `index`: the tokens in document order, and a table of the
    documents (their token and byte counts, and which split each goes to). A long
    document comes in pieces (read_pieces): its pieces' tokens follow one another and
    the table holds it once, with their sums, as if it had been encoded whole."""
    tokens_path, docs_path = _part_paths(parts_dir, index)
    separator = np.asarray(tok.separator, dtype=tok.dtype)
    n_tokens, n_bytes, splits = array.array("q"), array.array("q"), array.array("b")
    doc_tokens = doc_bytes = 0     # of the document whose pieces are being written
    shown = 0                      # bytes of the file the progress bar has been told about
    with open(tokens_path, "wb") as out:
        # A Hugging Face tokenizer holds ~100 bytes per character while it encodes (offsets,
        # token strings): 1 MB groups keep that near 150 MB (4 MB groups peaked over 600 MB).
        group_bytes_max = 4 << 20 if tok.kind == "bytes" else 1 << 20
        for group in _batches(read_pieces(source, field, _cutter(tok)), max_bytes=group_bytes_max):
            try:
                encoded = tok.encode_batch([text for text, _ in group])
            except ValueError as e:                      # the tokenizer's refusal, worded in engine/data/tokenizer.py
                raise PrepareError(f"input {source.path}: {e}") from None
            group_tokens = group_bytes = 0
            for (text, last), ids in zip(group, encoded):
                out.write(ids.data)
                # The bytes tokenizer's ids are the text's UTF-8 bytes: no second encode to count them.
                size = len(ids) if tok.kind == "bytes" else len(text.encode("utf-8"))
                doc_tokens += len(ids)
                doc_bytes += size
                group_tokens += len(ids)
                group_bytes += size
                if last:
                    out.write(separator.data)
                    n_tokens.append(doc_tokens + len(separator))
                    n_bytes.append(doc_bytes + tok.separator_bytes)
                    splits.append(_is_val(source.key, len(splits), val_every))
                    group_tokens += len(separator)
                    group_bytes += tok.separator_bytes
                    doc_tokens = doc_bytes = 0
            if bar is not None:
                step = min(group_bytes, source.size - shown)
                bar.advance(step, group_tokens)
                shown += step
    if bar is not None:
        bar.advance(source.size - shown)
    docs = np.zeros(len(n_tokens), dtype=_DOC_DTYPE)
    docs["tokens"], docs["bytes"], docs["val"] = n_tokens, n_bytes, splits
    np.save(docs_path, docs, allow_pickle=False)


# ---- step 6: the parts into shards ----------------------------------------------------------

class SplitWriter:
    """The shards of one split: tokens go into NAME_000000.bin until it holds
    tokens_per_shard, then NAME_000001.bin, and so on."""

    def __init__(self, folder: str, split: str, tokens_per_shard: int, vocab_size: int):
        self.folder, self.split, self.per_shard, self.vocab_size = folder, split, tokens_per_shard, vocab_size
        self.files: list[str] = []
        self.tokens = 0
        self._current = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._current is None:
                name = f"{self.split}_{len(self.files):06d}.bin"
                with _naming(os.path.join(self.folder, name)):
                    self._current = shards.ShardWriter(os.path.join(self.folder, name), self.vocab_size)
                self.files.append(name)
            room = self.per_shard - self._current.count
            with _naming(self._current.path):
                self._current.write(tokens[:room])
            self.tokens += min(room, len(tokens))
            tokens = tokens[room:]
            if self._current.count == self.per_shard:
                self.close()

    def close(self) -> None:
        if self._current is not None:
            current, self._current = self._current, None
            with _naming(current.path):
                current.close()                  # on failure it removed its temp file itself

    def abort(self) -> None:
        if self._current is not None:
            self._current.abort()
            self._current = None


class _naming:
    """A write's OSError carries no file name (a full disk fails in write(2) or fsync):
    give it the shard's, so the message can say which file could not be written."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if isinstance(value, OSError) and not value.filename:
            raise OSError(value.errno, value.strerror or str(value), self.path) from None
        return False


def _read_tokens(fh, dtype, count, block=16 << 20):
    """`count` tokens from the file's position on, in blocks (memory stays small)."""
    while count > 0:
        n = min(block, count)
        chunk = np.fromfile(fh, dtype=dtype, count=n)
        if len(chunk) != n:
            raise PrepareError(f"{fh.name} ended early: a temporary part changed while it was read; prepare again")
        count -= n
        yield chunk


def _choose_split(docs_tables, val_every):
    """How to split: by document (the crc32 rule) unless that leaves validation with
    less than 1% of the tokens (or more than half): then the last tenth of all tokens."""
    total = sum(int(d["tokens"].sum()) for d in docs_tables)
    val = sum(int(d["tokens"][d["val"]].sum()) for d in docs_tables)
    n_docs = sum(len(d) for d in docs_tables)
    rule = (f"a document goes to val when crc32('KEY:INDEX') % {val_every} == 0, KEY being its file's path "
            "inside the folder given (or the file's name), INDEX its place in the file from 0")
    if total and 0.01 * total <= val <= 0.5 * total:
        return {"method": "documents", "val_every": val_every, "rule": rule}
    return {"method": "tail", "val_fraction": TAIL_VAL_FRACTION,
            "why": (f"split by document ({rule}), validation would hold {val} of {total} tokens "
                    f"({n_docs} documents), {'less than 1%' if val < 0.01 * total else 'more than half'}: "
                    f"the last {TAIL_VAL_FRACTION:.0%} of the tokens, in document order, are validation instead")}


def _runs(table):
    """The file's documents as runs of consecutive documents of the same split:
    (is_val, tokens, bytes, documents) each, in order."""
    if len(table) == 0:
        return []
    change = (np.flatnonzero(np.diff(table["val"].astype(np.int8))) + 1).tolist()
    bounds = [0] + change + [len(table)]
    return [(bool(table["val"][a]), int(table["tokens"][a:b].sum()), int(table["bytes"][a:b].sum()), b - a)
            for a, b in zip(bounds[:-1], bounds[1:])]


def join_parts(sources, parts_dir, out, tok, tokens_per_shard, val_every):
    """Rank 0: the parts, in file order, into the train and val shards. Returns the
    manifest's split, splits and sources entries."""
    tables = [np.load(_part_paths(parts_dir, i)[1], allow_pickle=False) for i in range(len(sources))]
    total = sum(int(t["tokens"].sum()) for t in tables)
    if total < 2:
        raise PrepareError("the inputs hold too little text to split into train and val; add text")
    split = _choose_split(tables, val_every)
    writers = {s: SplitWriter(out, s, tokens_per_shard, tok.vocab_size) for s in shards.SPLITS}
    try:
        if split["method"] == "documents":
            counts = _write_by_document(tables, parts_dir, tok.dtype, writers)
        else:
            counts = _write_tail(tables, parts_dir, tok.dtype, writers, cut=total - max(1, int(total * TAIL_VAL_FRACTION)))
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    splits = {s: {"shards": writers[s].files, "tokens": writers[s].tokens, **counts[s]} for s in shards.SPLITS}
    records = [{"path": src.path, "size": src.size, "documents": len(t), "tokens": int(t["tokens"].sum())}
               for src, t in zip(sources, tables)]
    return split, splits, records


def _write_by_document(tables, parts_dir, dtype, writers):
    """Each run of documents to the split the crc32 rule gave it."""
    counts = {s: {"bytes": 0, "documents": 0} for s in shards.SPLITS}
    for i, table in enumerate(tables):
        with open(_part_paths(parts_dir, i)[0], "rb") as fh:
            for is_val, n_tokens, n_bytes, n_docs in _runs(table):
                name = "val" if is_val else "train"
                for chunk in _read_tokens(fh, dtype, n_tokens):
                    writers[name].write(chunk)
                counts[name]["bytes"] += n_bytes
                counts[name]["documents"] += n_docs
    return counts


def _write_tail(tables, parts_dir, dtype, writers, cut):
    """All tokens in document order: those before position `cut` to train, the rest
    to val. The document the cut falls into counts in both, its bytes shared
    between them by its tokens (exact for the bytes tokenizer)."""
    tokens = np.concatenate([t["tokens"] for t in tables])
    n_bytes = np.concatenate([t["bytes"] for t in tables])
    ends = np.cumsum(tokens)
    starts = ends - tokens
    train_bytes = int(n_bytes[ends <= cut].sum())
    cut_doc = np.flatnonzero((starts < cut) & (ends > cut))
    if len(cut_doc):
        k = int(cut_doc[0])
        train_bytes += round(int(n_bytes[k]) * (cut - int(starts[k])) / int(tokens[k]))
    counts = {"train": {"bytes": train_bytes, "documents": int((starts < cut).sum())},
              "val": {"bytes": int(n_bytes.sum()) - train_bytes, "documents": int((ends > cut).sum())}}
    position = 0
    for i, table in enumerate(tables):
        with open(_part_paths(parts_dir, i)[0], "rb") as fh:
            for chunk in _read_tokens(fh, dtype, int(table["tokens"].sum())):
                in_train = min(len(chunk), max(0, cut - position))
                writers["train"].write(chunk[:in_train])
                writers["val"].write(chunk[in_train:])
                position += len(chunk)
    return counts


# ---- the out folder -------------------------------------------------------------------------

LOCK_NAME = shards.LOCK_NAME        # OUT/prepare.lock: flock'd by the prepare writing OUT, shared by training runs
PREVIOUS_NAME = "previous"         # OUT/previous/: the old dataset while --overwrite swaps the new one in
STAGING_NAME = "dataset"           # PARTS/dataset/: the new dataset, complete, before it is swapped in
SWAP_JOURNAL = "swap.json"         # OUT/previous/swap.json: the files a swap renames, to undo a killed one
# flock() is not offered by every cluster filesystem (Lustre without -o flock, some FUSE mounts).


def _fsync_dir(path: str) -> None:
    """Make the renames in a folder durable (a crash after it must not undo them)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass                       # not every filesystem can fsync a folder; the renames still happened
    finally:
        os.close(fd)


def _write_error(e: OSError, out: str, path: str | None = None) -> PrepareError:
    """A failed write as a refusal naming the file and what to do; the old dataset is untouched
    (the new one is built in the parts folder, and only renames touch OUT's dataset)."""
    path = path or e.filename or out
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        from ringpipe.engine.job.rundir import free_mb
        free = free_mb(out)
        free = "free space unknown" if free != free else f"{free:.0f} MB free"
        why = f"disk full writing {path} ({free})"
        todo = ("free space (prepare needs room for the new dataset beside the old one, and about as much again "
                "for its temporary parts) or choose another --out")
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = f"cannot write {path} ({'read-only filesystem' if e.errno == errno.EROFS else 'permission denied'})"
        todo = "make --out writable or choose another --out"
    else:
        why = f"cannot write {path} ({e.strerror or e})"
        todo = "fix the cause or choose another --out"
    return PrepareError(f"{why}: {todo}, then prepare again; the dataset already in {out} (if any) is unchanged")


class _OutFolder:
    """Rank 0's hold on --out for the whole run: the lock, the parts folder, and the
    swap of the new dataset for the old one.

    Only the files a manifest names are the dataset (data.json, its tokenizer, its
    shards): prepare replaces those and never deletes any other file in OUT. The new
    dataset is written whole into PARTS/dataset/ first; the swap (`install`) then only
    renames, so at every instant OUT or OUT/previous/ holds a complete dataset."""

    def __init__(self, out: str, overwrite: bool):
        self.out, self.overwrite = out, overwrite
        self.made = False                    # OUT did not exist: a refusal removes it again
        self.parts_dir = None
        self.old: list[str] = []             # the old dataset's files, data.json last
        self._lock_fd = None
        self._lock_tries = 0

    @property
    def staging(self) -> str:
        return os.path.join(self.parts_dir, STAGING_NAME)

    # ---- taking the folder ----------------------------------------------------------
    def open(self) -> list[str]:
        """Lock OUT, check what it holds, make the parts folder. Returns notes for the user."""
        out = self.out
        if os.path.lexists(out) and not os.path.isdir(out):
            raise PrepareError(f"--out {out} exists and is not a folder; choose another --out")
        self.made = not os.path.exists(out)
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise PrepareError(f"--out {out} cannot be made ({e.strerror or e}); choose another --out") from None
        try:
            notes = self._lock()
            notes += self._check_contents()
            self.parts_dir = tempfile.mkdtemp(prefix=PARTS_PREFIX, dir=out)
            os.mkdir(self.staging)
        except OSError as e:
            self.close()
            raise PrepareError(f"--out {out} cannot be written ({e.strerror or e}); choose another --out") from None
        except BaseException:
            self.close()
            raise
        return notes

    def _lock(self) -> list[str]:
        """OUT/prepare.lock, flock'd exclusively until close(): one prepare writes OUT at a
        time, and none while a training run holds it shared (it reads the shards). The
        kernel drops a flock when its process dies, so a lock left by a killed prepare is
        taken over; the file stays (training locks it too) and names its last owner."""
        path = os.path.join(self.out, LOCK_NAME)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if os.path.islink(path):
                raise PrepareError(f"{path} is a symbolic link, not prepare's lock file; remove it") from None
            raise PrepareError(f"--out {self.out}: cannot open its lock file {path} ({e.strerror or e}); "
                               "make the folder writable or choose another --out") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise PrepareError(f"{path} is {files.file_kind(mode)}, not prepare's lock file; remove it")
        notes = []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = files.read_lock_owner(fd, LOCK_NAME)
            os.close(fd)
            raise PrepareError(f"--out {self.out} is in use ({_describe_lock_owner(owner)}); a prepare writing "
                               "it now would mix two datasets or pull the shards from under a training run. Wait "
                               "for it to end or stop it, or choose another --out") from None
        except OSError as e:
            if e.errno not in files.NO_LOCKING:
                os.close(fd)
                raise
            notes.append(f"the filesystem of {self.out} does not support file locks ({e.strerror}): a second "
                         "prepare, or a training run, on the same folder would not be detected")
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            same = False
        if not same:
            # A prepare that made OUT and was refused removes it again, lock file and all;
            # a lock taken on the removed file guards nothing: take the one there now.
            os.close(fd)
            if self._lock_tries >= 3:
                raise PrepareError(f"--out {self.out}: its lock file {path} keeps being removed; is another "
                                   "program clearing the folder? choose another --out")
            self._lock_tries += 1
            return self._lock()
        owner = files.read_lock_owner(fd, LOCK_NAME)
        if owner:
            notes.append(f"took over the lock of a prepare that did not end cleanly ({_describe_lock_owner(owner)})")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._lock_fd = fd
        return notes

    def _check_contents(self) -> list[str]:
        """Refuse what this run may not replace; find the old dataset's files; clear what a
        killed prepare left (safe: we hold the lock, so no live prepare uses it)."""
        out, notes = self.out, []
        manifest = os.path.join(out, shards.MANIFEST_NAME)
        previous = os.path.join(out, PREVIOUS_NAME)
        has_manifest = os.path.lexists(manifest)
        restored = ""
        if os.path.lexists(os.path.join(previous, shards.MANIFEST_NAME)) and not has_manifest:
            restored = self._restore_previous(previous)
            notes.append(restored)
            has_manifest = True
        if has_manifest and not self.overwrite:
            raise PrepareError(f"{restored + '; ' if restored else ''}--out {out} already holds a dataset ({manifest}); "
                               "pass --overwrite to replace it, or choose another --out")
        for name in shards.NANOGPT_NAMES:
            if os.path.exists(os.path.join(out, name)) and not self.overwrite:
                raise PrepareError(f"--out {out} already holds nanoGPT data ({name}); pass --overwrite to write "
                                   "beside it (it is left as it is), or choose another --out")
        if has_manifest:
            self.old = _dataset_files(out)
        if has_manifest and os.path.lexists(previous):
            notes += self._clear_previous(previous)
        foreign = sorted(name for name in os.listdir(out)
                         if (shards.SHARD_NAME.match(name) or name == "tokenizer.json") and name not in self.old)
        if foreign:
            shown = ", ".join(foreign[:10]) + (f" and {len(foreign) - 10} more" if len(foreign) > 10 else "")
            raise PrepareError(
                f"--out {out} holds {shown}, which no data.json there names (llm.c's shards, or a dataset whose "
                "data.json was lost); prepare writes files of these names and never replaces files it did not "
                f"write{', not even under --overwrite' if self.overwrite else ''}: move them away, or choose "
                "another --out")
        for name in sorted(os.listdir(out)):
            if name.startswith(PARTS_PREFIX):
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
                notes.append(f"removed {os.path.join(out, name)}, left by a prepare that did not finish")
        return notes

    def _restore_previous(self, previous: str) -> str:
        """OUT holds no data.json and OUT/previous/ a dataset: a prepare --overwrite was
        killed while it swapped. Its journal (previous/swap.json, written before it touched
        anything) names the files it was renaming in: those go, the old dataset's files come
        back (data.json last). Without a journal nothing is guessed: refuse, saying how."""
        out, q = self.out, shlex.quote
        try:
            journal = files.read_json(os.path.join(previous, SWAP_JOURNAL), "the swap's journal")
            new, old = journal["new"], journal["old"]
            if not all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in new + old):
                raise ValueError("it names files outside the folder")
        except (ValueError, KeyError, TypeError) as e:
            raise PrepareError(
                f"--out {out} holds no dataset, but {previous} holds one: a prepare --overwrite was stopped while "
                f"it swapped the new dataset in, and what it left cannot be undone safely ({e}). Train on the old one "
                f"where it is (--data {q(previous)}), or move its files back by hand: `cd {q(out)} && for f in "
                "previous/*; do rm -f \"${f#previous/}\"; mv \"$f\" .; done && rmdir previous`") from None

        _move_back(out, previous, new, old)
        return (f"restored the dataset in {out} from {previous}, where a prepare --overwrite that was stopped while "
                "it swapped datasets had set it aside")

    def _clear_previous(self, previous: str) -> list[str]:
        """OUT/previous/ beside a complete dataset in OUT (under --overwrite) is in the way of
        the swap. Cleared if it is what a stopped prepare left: the dataset it had replaced
        (named by its own data.json) or hard links of OUT's files; the old shards left in OUT
        that are the same files and that OUT's data.json does not name go too. Anything
        else in it is the user's: refuse, deleting nothing."""
        if not os.path.isdir(previous) or os.path.islink(previous):
            raise PrepareError(f"{previous} is not a folder prepare made; prepare keeps the old dataset there while "
                               "it swaps the new one in: move it away")

        def same(name):
            there, here = os.path.join(previous, name), os.path.join(self.out, name)
            return os.path.lexists(there) and os.path.lexists(here) and os.path.samefile(there, here)
        held = os.listdir(previous)
        ours = set(_dataset_files(previous)) if shards.MANIFEST_NAME in held else set()
        ours |= {n for n in held if same(n) or n == SWAP_JOURNAL or n.startswith(SWAP_JOURNAL + ".tmp-")}
        others = sorted(set(held) - ours)
        if others:
            raise PrepareError(f"{previous} holds {', '.join(others[:10])}: not a dataset prepare set aside; "
                               "prepare keeps the old dataset there while it swaps the new one in: move the folder "
                               "away")
        for name in sorted(ours, key=lambda n: n == shards.MANIFEST_NAME):     # its data.json last
            if name not in self.old and same(name):
                os.remove(os.path.join(self.out, name))   # an old shard the new dataset does not name
            if os.path.lexists(os.path.join(previous, name)):
                os.remove(os.path.join(previous, name))
        os.rmdir(previous)
        return [f"removed {previous}, the old dataset a stopped prepare --overwrite had set aside ({self.out} "
                "holds a complete one)"]

    # ---- the swap -------------------------------------------------------------------
    def install(self, manifest: dict, tok) -> None:
        """The new dataset (shards already in the staging folder) into OUT, the old one
        aside: staging gets tokenizer.json and data.json; the old dataset's files are
        hard-linked into OUT/previous/ (data.json last: it is complete there before OUT's
        goes), OUT/data.json removed, the new files renamed in (data.json last), the old
        shards the new manifest does not name removed, OUT/previous/ removed. If a rename
        fails or Ctrl-C's KeyboardInterrupt comes, the old dataset is put back; if the
        process is killed (SIGKILL, or an MPI abort from another rank's signal), previous/
        holds the old dataset whole and the next prepare says how to restore it. (Blocking
        signals would not help: Python runs its handlers in the main thread whatever the
        thread mask, and engine/job/lifecycle.py's watcher thread aborts the job.)"""
        tok.save(self.staging)
        shards.write_manifest(self.staging, manifest)
        shards.read_manifest(self.staging)               # the new dataset checks out before anything is replaced
        new = manifest["splits"]["train"]["shards"] + manifest["splits"]["val"]["shards"] + ["tokenizer.json"]
        self._swap(new)

    def _swap(self, new: list[str]) -> None:
        out, previous = self.out, os.path.join(self.out, PREVIOUS_NAME)
        data_json = shards.MANIFEST_NAME
        aside = linked = False
        try:
            if self.old:
                os.mkdir(previous)
                aside = True
                # The journal first: a prepare killed from here on is undone by the next one
                # (_restore_previous), which then knows which files in OUT were this run's.
                shards.write_json_atomic(os.path.join(previous, SWAP_JOURNAL), {"new": new, "old": self.old})
                try:
                    for name in self.old:                # data.json last
                        os.link(os.path.join(out, name), os.path.join(previous, name))
                    linked = True
                except OSError:
                    # No hard links here (some FUSE and object-store mounts): move the files
                    # instead, data.json first, so OUT never holds a manifest naming moved shards.
                    for name in [data_json] + [n for n in self.old if n != data_json]:
                        src = os.path.join(out, name)
                        if os.path.lexists(src):
                            os.replace(src, os.path.join(previous, name))
                _fsync_dir(previous)
                if linked:
                    os.remove(os.path.join(out, data_json))
            for name in new:
                os.replace(os.path.join(self.staging, name), os.path.join(out, name))
            _fsync_dir(out)
            os.replace(os.path.join(self.staging, data_json), os.path.join(out, data_json))
            _fsync_dir(out)
        except BaseException:
            if aside:
                self._put_back(previous, new)
            raise
        # The new dataset is in place: what remains of the old one goes, its shards in OUT the
        # new manifest does not name, then previous/ (its data.json last). Best effort: the run
        # succeeded; whatever a failure or a kill leaves here is still named by previous/data.json
        # (or is a hard link of it), and the next prepare clears it (_clear_previous).
        try:
            for name in self.old:
                if name not in new and name != data_json and os.path.lexists(os.path.join(out, name)):
                    os.remove(os.path.join(out, name))
            if aside:
                for name in sorted(os.listdir(previous), key=lambda n: n == data_json):
                    os.remove(os.path.join(previous, name))
                os.rmdir(previous)
        except (OSError, KeyboardInterrupt):
            pass                   # the new dataset is in place: a Ctrl-C now has nothing left to stop

    def _put_back(self, previous: str, new: list[str]) -> None:
        """After a failed swap: the old dataset back into OUT (data.json last), the new
        files that were renamed in removed. If this fails too, OUT/previous/ stays with
        its journal, and the next prepare finishes the job (_restore_previous)."""
        try:
            _move_back(self.out, previous, new, self.old)
        except OSError:
            pass

    # ---- letting go -----------------------------------------------------------------
    def close(self) -> None:
        """The parts folder removed, the lock released (the lock file stays: training runs
        lock it too; emptied, it means "ended cleanly"); OUT removed again if this run made
        it and wrote nothing into it."""
        try:
            if self.parts_dir is not None:
                parts, self.parts_dir = self.parts_dir, None
                shutil.rmtree(parts, ignore_errors=True)
            if self.made and self._lock_fd is not None:
                # Refused before anything was written: no empty folder left behind. Only while
                # holding the lock (a prepare refused because OUT is in use removes nothing),
                # and the lock file first, so no other prepare can take a lock on it meanwhile.
                self.made = False
                if os.listdir(self.out) == [LOCK_NAME]:
                    os.remove(os.path.join(self.out, LOCK_NAME))
                    os.rmdir(self.out)
        except OSError:
            pass
        finally:                                         # a second Ctrl-C midway must not keep the lock
            self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)                          # emptied: "ended cleanly", for the next one's message
        except OSError:
            pass
        finally:
            os.close(fd)                                 # closing drops the flock


def _move_back(out: str, previous: str, new: list[str], old: list[str]) -> None:
    """Undo a swap: the files it renamed into OUT that the old dataset does not have go,
    the old dataset's files come back from previous/ (data.json last), previous/ goes.
    A file of previous/ that is a hard link of OUT's (the old file never left) is just
    dropped: rename(2) between two links of one file does nothing."""
    for name in new:
        if name not in old and os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in old:                                      # data.json last
        there, here = os.path.join(previous, name), os.path.join(out, name)
        if not os.path.lexists(there):
            continue
        if os.path.lexists(here) and os.path.samefile(there, here):
            os.remove(there)
        else:
            os.replace(there, here)
    for name in os.listdir(previous):
        if name == SWAP_JOURNAL or name.startswith(SWAP_JOURNAL + ".tmp-"):
            os.remove(os.path.join(previous, name))
    os.rmdir(previous)
    _fsync_dir(out)


def _dataset_files(folder: str) -> list[str]:
    """The files of the dataset in `folder` its data.json names: tokenizer, shards, then
    data.json itself. Refused if the manifest cannot be read (prepare cannot tell then
    which files are the dataset, and deletes nothing it cannot name)."""
    path = os.path.join(folder, shards.MANIFEST_NAME)
    try:
        m = files.read_json(path, "the dataset's manifest")
        names = [m["tokenizer"]["file"]] + [f for s in shards.SPLITS for f in m["splits"][s]["shards"]]
        if not all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in names):
            raise ValueError("it names files outside its folder")
    except (ValueError, KeyError, TypeError) as e:
        raise PrepareError(f"{path} cannot be read ({e}), so prepare cannot tell which files in {folder} are its "
                           "dataset and replaces none: remove the old dataset's files (data.json, tokenizer.json, "
                           "the .bin shards) by hand, or choose another --out") from None
    return [n for n in dict.fromkeys(names) if n != shards.MANIFEST_NAME] + [shards.MANIFEST_NAME]


def _describe_lock_owner(owner: dict | None) -> str:
    if not owner:
        # prepare empties the file when it ends; a training run (hold_dataset) writes nothing in it
        return "a training run reads the dataset (ringpipe train --data), or a prepare is starting"
    # A prepare that is gone left its name in the file, while the lock is held: by a training run.
    described = files.describe_lock_owner(owner).replace(
        ", no longer running,", ", no longer running: a training run reads the dataset now,")
    return f"by prepare on {described}"


# ---- progress -------------------------------------------------------------------------------

class _Progress:
    """A tqdm bar over input bytes (for the ETA) with tokens/s beside it, on stderr."""

    def __init__(self, total_bytes: int, what: str, enabled: bool):
        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:          # progress is a nicety: prepare works without it
                return
            tty = sys.stderr.isatty()
            self.bar = tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, file=sys.stderr,
                            mininterval=0.5 if tty else 10.0, dynamic_ncols=tty)

    def advance(self, n_bytes: int, n_tokens: int = 0) -> None:
        self.tokens += n_tokens
        if self.bar is not None:
            self.bar.update(n_bytes)
            if n_tokens:
                rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
                self.bar.set_postfix_str(f"{rate / 1e6:.2f}M tokens/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _texts_for_bpe(sources, field, bar, budget_bytes: int, used: list):
    """The text bpe:VOCAB trains on, at most `budget_bytes` of it (of UTF-8 text): all of
    every file when they hold less; else the head of each file, its share of the budget
    in proportion to its size on disk, so that every file is sampled and the same inputs
    give the same sample. Long documents come in pieces cut at _SAFE_CUT boundaries,
    where the trainer's ByteLevel pre-tokenizer splits anyway: the words it counts are
    those of the whole text. used[0]: the bytes given so far (for the manifest)."""
    total = sum(s.size for s in sources)
    for source in sources:
        share = source.size if total <= budget_bytes else budget_bytes * source.size // total
        taken = 0
        for text, _ in read_pieces(source, field, _cut_at):
            if taken >= share:
                break
            raw = text.encode("utf-8")
            if taken + len(raw) > share:                 # the share ends inside this piece: its head
                raw = raw[:share - taken]
                text = raw.decode("utf-8", errors="ignore")
            taken += len(raw)
            used[0] += len(raw)
            bar.advance(len(raw))
            yield text


# ---- the whole job --------------------------------------------------------------------------

def prepare(inputs, out, tokenizer="bytes", field="text", overwrite=False, world=None, progress=True,
            val_every=DEFAULT_VAL_EVERY, tokens_per_shard=DEFAULT_TOKENS_PER_SHARD, command=None,
            bpe_train_mb=None, follow_symlinks=False) -> dict:
    """Tokenize `inputs` (files or folders) into token shards in `out`; returns the
    manifest (also written to out/data.json). `tokenizer`: "bytes", "bpe:VOCAB"
    (trained on the inputs) or a tokenizer.json (or a folder holding one). `world`:
    an MPI communicator whose ranks share the work (None: this process alone).
    Raises ValueError (on every rank alike) for bad input, before any shard is written,
    for an `out` another prepare or a training run holds (OUT/prepare.lock), and for a
    failed write (the dataset in `out` unchanged). `overwrite`: replace the dataset in
    `out` (only the files its data.json names). `follow_symlinks`: read links inside input
    folders that lead out of them (skipped by default). `bpe_train_mb`: how much text
    bpe:VOCAB trains on at most (None: DEFAULT_BPE_TRAIN_MB); refused with another tokenizer."""
    world = OneProcess() if world is None else world
    rank, size = world.Get_rank(), world.Get_size()
    inputs = [os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)]
    out, tokenizer = os.fspath(out), os.fspath(tokenizer)
    command = command if command is not None else shlex.join(sys.argv)
    bpe_budget_given = bpe_train_mb is not None
    bpe_train_mb = DEFAULT_BPE_TRAIN_MB if bpe_train_mb is None else bpe_train_mb

    def check_settings():
        if not isinstance(val_every, int) or val_every < 2:
            raise PrepareError(f"--val-every {val_every}: must be a whole number >= 2 (1 in N documents goes to "
                               "validation)")
        if not isinstance(tokens_per_shard, int) or not 1 <= tokens_per_shard <= shards.MAX_SHARD_TOKENS:
            raise PrepareError(f"--tokens-per-shard {tokens_per_shard}: must be a whole number in 1..2^31-1")
        if bpe_budget_given and not tokenizer.startswith("bpe:"):
            # A setting without effect is refused, never silently ignored.
            raise PrepareError(f"--bpe-train-mb applies only to --tokenizer bpe:VOCAB (which trains a tokenizer); "
                               f"with --tokenizer {tokenizer} nothing is trained: drop --bpe-train-mb")
        if tokenizer.startswith("bpe:"):
            tokenizers_.parse_vocab_spec(tokenizer)
            if not isinstance(bpe_train_mb, (int, float)) or not 0 < bpe_train_mb < float("inf"):
                raise PrepareError(f"--bpe-train-mb {bpe_train_mb}: must be a number of MB > 0 (how much of "
                                   "the text bpe:VOCAB trains on at most)")
        elif tokenizer != "bytes":
            tokenizers_.load_tokenizer(tokenizer)       # parse it now: a bad file is refused before any work

    _on_every_rank(world, check_settings, "settings")
    if rank == 0 and progress and follow_symlinks and not any(os.path.isdir(i) for i in inputs):
        print("note: --follow-symlinks has no effect here: it reads links inside input folders, and no INPUT "
              "is a folder (a link given as an INPUT is always read)", file=sys.stderr, flush=True)
    sources, skipped, links = _on_rank0(world, lambda: list_sources(inputs, follow_symlinks), "input listing")
    if rank == 0 and progress and links:
        print(f"note: {len(links)} symbolic link(s) leading out of the input folders skipped (e.g. {links[0]}); pass "
              "--follow-symlinks to read them", file=sys.stderr, flush=True)
    mine = list(range(rank, len(sources), size))          # this rank's share, round-robin
    _on_every_rank(world, lambda: [check_source(sources[i], field) for i in mine], "input check")
    # Rank 0 owns --out from here to the end (its lock, the parts folder, the swap);
    # held in `folder` on rank 0 only, so the finally below releases it however this ends
    # (a refusal, a full disk, Ctrl-C's KeyboardInterrupt).
    folder = _OutFolder(out, overwrite) if rank == 0 else None
    try:
        notes = _on_rank0(world, folder.open if folder else None, "out folder")
        parts_dir = _on_rank0(world, lambda: folder.parts_dir, "parts folder")
        if rank == 0 and progress:
            for note in notes:
                print(f"note: {note}", file=sys.stderr, flush=True)
        tok = _make_tokenizer(world, tokenizer, sources, field, parts_dir, progress, bpe_train_mb)

        def tokenize_mine():
            bar = _Progress(sum(sources[i].size for i in mine),
                            "tokenizing" if size == 1 else f"tokenizing (rank 0's {len(mine)} of {len(sources)} "
                            "files)", progress and rank == 0)
            try:
                for i in mine:
                    try:
                        tokenize_source(sources[i], i, tok, field, val_every, parts_dir, bar)
                    except OSError as e:
                        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                            raise
                        raise _write_error(e, out, e.filename or _part_paths(parts_dir, i)[0]) from None
            finally:
                bar.close()

        _on_every_rank(world, tokenize_mine, "tokenization")

        def write_dataset():
            try:
                split, splits, records = join_parts(sources, parts_dir, folder.staging, tok, tokens_per_shard,
                                                    val_every)
                manifest = build_manifest(tok, split, splits, records, skipped, tokens_per_shard, command, links)
                folder.install(manifest, tok)
            except OSError as e:
                raise _write_error(e, out) from None
            return manifest

        manifest = _on_rank0(world, write_dataset, "writing the shards")
    finally:
        if folder is not None:
            folder.close()
    return manifest


def build_manifest(tok, split, splits, records, skipped, tokens_per_shard, command, links=()) -> dict:
    """DATA_DIR/data.json: what engine/data/shards.py's read_manifest checks and open_dataset reads."""
    return {
        "format": shards.MANIFEST_FORMAT, "version": shards.MANIFEST_VERSION,
        # identity: what decides the ids (read first); sha256: the file's JSON, what ringpipe before
        # identities checks (a dataset prepared now stays readable by it).
        "tokenizer": {"kind": tok.kind, "file": "tokenizer.json", "identity": tok.identity, "sha256": tok.sha256,
                      "vocab_size": tok.vocab_size,
                      **({"training": tok.training} if getattr(tok, "training", None) else {})},  # bpe:VOCAB's sample
        "separator": list(tok.separator),           # the ids after every document
        "dtype": tok.dtype.name,                    # of the shards' tokens: uint16, or uint32 over 65536 ids
        "tokens_per_shard": tokens_per_shard,
        "splits": splits,                           # train/val: shards (in order), tokens, bytes (of text), documents
        "split": split,                             # how documents were assigned to train and val
        "sources": records,                         # every input file: path, size, documents, tokens
        "skipped": {"files": len(skipped), "examples": skipped[:10],
                    # symbolic links out of the input folders: named only when there were some
                    **({"links": len(links), "link_examples": list(links[:10])} if links else {})},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def _make_tokenizer(world, spec, sources, field, parts_dir, progress, bpe_train_mb=DEFAULT_BPE_TRAIN_MB):
    """Every rank's tokenizer: "bytes", a file every rank loads, or a BPE rank 0 trains
    on the inputs (at most bpe_train_mb MB of their text) and saves in the parts folder
    for the others to load. A trained one carries `training`, what data.json records of it."""
    if spec == "bytes":
        return tokenizers_.bytes_tokenizer()
    training = None
    if spec.startswith("bpe:"):
        vocab_size = tokenizers_.parse_vocab_spec(spec)
        budget = int(bpe_train_mb * 1_000_000)

        def train():
            total = sum(s.size for s in sources)
            bar = _Progress(min(total, budget), f"training BPE ({vocab_size} tokens) on at most {bpe_train_mb:g} MB "
                            "of the text (--bpe-train-mb)", progress)
            used = [0]
            try:
                trained = tokenizers_.train_bpe(_texts_for_bpe(sources, field, bar, budget, used), vocab_size)
            finally:
                bar.close()
            record = {"bpe_train_mb": bpe_train_mb, "trained_on_bytes": used[0],
                      "sample": "all of the text" if total <= budget else
                      "the head of each file, its share of --bpe-train-mb in proportion to its size"}
            return trained.save(parts_dir), record

        spec, training = _on_rank0(world, train, "BPE training")
    tok = _on_every_rank(world, lambda: tokenizers_.load_tokenizer(spec), "tokenizer")
    hashes = world.allgather(tok.sha256)
    if len(set(hashes)) > 1:
        raise PrepareError(f"the ranks loaded different tokenizers from {spec} (sha256 {', '.join(h[:12] for h in hashes)}"
                           "); put it on a filesystem every rank sees, with the same file")
    if training is not None:
        tok.training = training
    return tok


# ---- the stdlib corpus, prepared once into a cache --------------------------------------------

STDLIB_CACHE_VERSION = 1          # raise when what the cached folder holds changes


def cache_root() -> str:
    """$RINGPIPE_CACHE, else $XDG_CACHE_HOME/ringpipe, else ~/.cache/ringpipe."""
    if os.environ.get("RINGPIPE_CACHE"):
        return os.environ["RINGPIPE_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringpipe")


def _stdlib_key(max_bytes: int) -> tuple[str, str]:
    """The interpreter's stdlib folder and a key of what the corpus would hold (its
    files' names and sizes, the byte limit): a changed library is prepared again."""
    from ringpipe.engine.data.datasets import stdlib_files
    root, files = stdlib_files()
    listing = [(os.path.relpath(f, root), os.path.getsize(f)) for f in files]
    text = json.dumps([STDLIB_CACHE_VERSION, root, max_bytes, listing])
    return root, hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_stdlib(max_bytes: int, cache: str | None = None) -> str:
    """The stdlib corpus (engine/data/datasets.py's load_stdlib_corpus: the same bytes, the same
    split) as a prepared dataset of the bytes tokenizer in CACHE/stdlib-KEY; written on
    first use (into a temp folder renamed into place, so concurrent jobs never see half
    a dataset), then reused. Returns the folder. The batches are those of the in-memory
    corpus (ShardDataset draws as TokenDataset does), so trajectories do not change."""
    from ringpipe.engine.data.datasets import load_stdlib_corpus
    root, key = _stdlib_key(max_bytes)
    cache = cache or cache_root()
    folder = os.path.join(cache, f"stdlib-{key}")
    if os.path.exists(os.path.join(folder, shards.MANIFEST_NAME)):
        try:
            shards.read_manifest(folder)
            return folder
        except ValueError:
            shutil.rmtree(folder, ignore_errors=True)          # damaged: prepare it again
    try:
        os.makedirs(cache, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".stdlib-", dir=cache)
    except OSError as e:
        raise PrepareError(f"the stdlib corpus is prepared into {cache}, which cannot be written ({e.strerror or e}); "
                           "set RINGPIPE_CACHE to a writable folder every node sees") from None
    try:
        corpus = load_stdlib_corpus(0, 0, max_bytes=max_bytes)
        tok = tokenizers_.bytes_tokenizer()
        splits = {}
        for split in shards.SPLITS:
            tokens = corpus.splits[split]
            name = f"{split}_000000.bin"
            shards.write_shard(os.path.join(tmp, name), tokens, tok.vocab_size)
            splits[split] = {"shards": [name], "tokens": len(tokens), "bytes": len(tokens), "documents": 0}
        rule = {"rule": "per file: crc32(path inside the stdlib) % 10 == 0 goes to validation (engine/data/datasets.py)"}
        manifest = build_manifest(tok, rule, splits, [{"path": root, "description": corpus.description}], [],
                                  max(len(corpus.splits["train"]), 1), "ringpipe train --data stdlib")
        tok.save(tmp)
        shards.write_manifest(tmp, manifest)
        if os.path.isdir(folder) and not os.path.exists(os.path.join(folder, shards.MANIFEST_NAME)):
            shutil.rmtree(folder, ignore_errors=True)          # a damaged copy, removed above or left by hand
        try:
            os.rename(tmp, folder)
        except OSError:
            if not os.path.exists(os.path.join(folder, shards.MANIFEST_NAME)):
                raise
            # another job prepared it first: use theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ---- the command ----------------------------------------------------------------------------

class _Given(argparse.Action):
    """Store the value and note that the flag was given (DEST_given), so a setting without
    effect in this combination can be refused rather than silently ignored."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def build_parser(prog="ringpipe prepare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text into token shards (llm.c's .bin format) and a manifest (data.json) that "
                    "`ringpipe train --data DATA_DIR` reads window by window. Inputs: .txt files (one document each), "
                    ".jsonl (one document per line, the --field value), .parquet (one document per row of the "
                    "--field column), or folders of them (walked in sorted order; other files are skipped). Every "
                    "document is followed by the tokenizer's separator (<|endoftext|>, or a newline for bytes). "
                    "Under `mpiexec -n N` the ranks share the files; the output is the same as one process's.",
        epilog="Examples:\n"
               "  ringpipe prepare notes/ --out data/notes                        # byte-level, vocab 256\n"
               "  ringpipe prepare corpus.jsonl --out data/c --tokenizer bpe:8192  # train a BPE on the input\n"
               "  mpiexec -n 8 ringpipe prepare web/ --out data/web --tokenizer gpt2/tokenizer.json\n"
               "  ringpipe train --data data/notes                                # then train on it",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl or .parquet files, or folders of them")
    p.add_argument("--out", required=True, metavar="DATA_DIR",
                   help="folder to write (the shards, tokenizer.json, data.json); refused if it holds a dataset, "
                        "unless --overwrite, or shards no data.json names (never deleted), or while another "
                        "prepare or a training run uses it (DATA_DIR/prepare.lock)")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (default: UTF-8 bytes, vocab 256), bpe:VOCAB (a byte-level BPE of VOCAB tokens "
                        "trained on the input, e.g. bpe:8192), or a Hugging Face tokenizer.json (or its folder)")
    p.add_argument("--field", default="text", help="the JSON field / parquet column holding the text (default text)")
    p.add_argument("--val-every", type=int, default=DEFAULT_VAL_EVERY, metavar="N",
                   help="a document goes to validation when crc32(its file and index) %% N == 0 (default 10: about "
                        "1 in 10); if that leaves validation under 1%% of the tokens (few documents), the last 10%% "
                        "of the tokens are validation instead")
    p.add_argument("--tokens-per-shard", type=int, default=DEFAULT_TOKENS_PER_SHARD, metavar="N",
                   help="tokens per shard file (default 100000000, llm.c's)")
    p.add_argument("--bpe-train-mb", type=float, default=DEFAULT_BPE_TRAIN_MB, metavar="MB", action=_Given,
                   help=f"bpe:VOCAB trains on at most this many MB of the text (default {DEFAULT_BPE_TRAIN_MB}): "
                        "the head of each file, its share in proportion to its size; data.json records how much")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the dataset in --out: only the files its data.json names; the new dataset is "
                        "built aside and swapped in at the end (the old one kept in DATA_DIR/previous/ during the "
                        "swap, removed after it), so a stopped or failed prepare leaves the old dataset whole (a "
                        "killed one: the next prepare puts it back)")
    p.add_argument("--follow-symlinks", action="store_true",
                   help="read symbolic links inside input folders that lead out of them (skipped by default, and "
                        "listed; a link given as an INPUT is always read)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no summary (errors are still printed)")
    return p


def summary(manifest: dict, out: str, seconds: float, replaced: bool = False) -> str:
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    t = manifest["tokenizer"]
    total = train["tokens"] + val["tokens"]
    n_docs = sum(s["documents"] for s in manifest["sources"])
    split = manifest["split"]
    how = (f"1 in about {split['val_every']} documents" if split["method"] == "documents"
           else f"the last {split['val_fraction']:.0%} of the tokens (too few documents to split by document)")
    links = manifest["skipped"].get("links", 0)
    lines = [f"prepared {out}: {len(manifest['sources'])} file(s), {n_docs:,} document(s)"
             + (f"; {manifest['skipped']['files']} other file(s) skipped (e.g. {manifest['skipped']['examples'][0]})"
                if manifest["skipped"]["files"] else "")
             + (f"; {links} symbolic link(s) out of the input folders skipped (e.g. "
                f"{manifest['skipped']['link_examples'][0]}; --follow-symlinks reads them)" if links else ""),
             f"  train {train['tokens']:,} tokens in {len(train['shards'])} shard(s), val {val['tokens']:,} tokens in "
             f"{len(val['shards'])} shard(s) (validation: {how})",
             f"  tokenizer {t['kind']} (vocab {t['vocab_size']:,}), "
             f"{(train['bytes'] + val['bytes']) / max(total, 1):.2f} bytes/token; "
             f"{total / max(seconds, 1e-9) / 1e6:.2f}M tokens/s over {seconds:.1f} s"]
    if replaced:
        lines.append(f"  replaced the dataset that was in {out} (only the files its data.json named; set aside in "
                     f"{os.path.join(out, PREVIOUS_NAME)}/ during the swap, removed once the new one was in place)")
    lines.append(f"next: ringpipe train --data {shlex.quote(out)}")
    return "\n".join(lines)


def _manifest_identity(out: str):
    """Which data.json OUT holds (inode, mtime), to tell after an interrupt whether it changed."""
    try:
        st = os.stat(os.path.join(out, shards.MANIFEST_NAME))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def main(argv=None, prog="ringpipe prepare") -> int:
    """The command line; returns the exit code: 0 done, 2 refused (bad input or settings)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from ringpipe.engine.job import lifecycle
    lifecycle.hold_signals()               # until MPI is up: then end_job_on_signal acts on them
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:                # --help (0) or a usage error (2, argparse printed it)
        return int(e.code or 0)
    # Hugging Face tokenizers start a thread per core in each rank: importing ringpipe set
    # RAYON_NUM_THREADS to this rank's share of the cores (ringpipe/threads.py).
    try:
        from ringpipe import comm          # MPI_Init happens here
    except ImportError as e:
        if lifecycle.missing_mpi(e) is None:
            raise
        print(f"{prog}: error: {lifecycle.missing_mpi(e)}", file=sys.stderr)
        return 2
    from mpi4py import MPI
    comm.install_abort_handler()           # a bug on one rank ends the job instead of leaving the others waiting
    world = MPI.COMM_WORLD
    before = None
    try:
        lifecycle.end_job_on_signal(world, prog)   # and so does Ctrl-C/SIGTERM on one rank (the others would wait)
        before = _manifest_identity(args.out) if world.Get_rank() == 0 else None
        lifecycle.check_launcher()
        t0 = time.perf_counter()
        manifest = prepare(args.inputs, args.out, tokenizer=args.tokenizer, field=args.field,
                           overwrite=args.overwrite, world=world, progress=not args.quiet,
                           follow_symlinks=args.follow_symlinks,
                           val_every=args.val_every, tokens_per_shard=args.tokens_per_shard,
                           bpe_train_mb=args.bpe_train_mb if getattr(args, "bpe_train_mb_given", False) else None,
                           command=shlex.join([prog] + argv))
    except lifecycle.LauncherError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)      # every task is alone: each says so
        return 2
    except ValueError as e:                # refused alike on every rank: rank 0 says why
        if world.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:
        if world.Get_rank() == 0:
            # prepare() released the lock and removed the parts folder on its way out, and put
            # the old dataset back if the interrupt came during the swap: OUT holds one whole
            # dataset, the old one, or the new one if the interrupt came once it was in place
            after = _manifest_identity(args.out)
            print(f"interrupted: {args.out} holds the new dataset (it was in place already)" if after != before
                  and after is not None else f"interrupted: {args.out} holds the dataset it held before (if any); "
                  "prepare again", file=sys.stderr)
        return getattr(e, "exit_code", 130)        # lifecycle.ToolInterrupted: 128 + the signal (SIGTERM: 143)
    if world.Get_rank() == 0 and not args.quiet:
        print(summary(manifest, args.out, time.perf_counter() - t0, replaced=before is not None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
