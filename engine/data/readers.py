"""`ringpipe prepare`'s inputs: which files (folders walked in sorted order, links that
lead out of a folder skipped), the checks that cost little before any work, and the
documents of .txt, .jsonl and .parquet files read in pieces of bounded size.

A .txt file is one document, a .jsonl line one (its --field value), a .parquet row one
(its --field column). Every reader refuses with a PrepareError naming the file, and the
line or row, for anything that is not UTF-8 text or lacks the field.
"""
from __future__ import annotations

import codecs
import json
import os
import re

import numpy as np

from ringpipe.engine.job import files
from ringpipe.engine.data.datasets import looks_like_text      # the trainer's own test of "is this text?"
from ringpipe.engine.data.errors import PrepareError

SUPPORTED = (".txt", ".jsonl", ".parquet")
_HEAD_BYTES = 8192                            # how much of a file the text check reads


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
# cut (cut_at):
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
_SAFE_CUT = re.compile(r"(?<=[^\W_])(?= [^\W_])|(?<=[^\W_]\n)(?=[^\W_])")
# Text with every kind of boundary _SAFE_CUT finds, and the neighbours that could join across one.
_CUT_PROBE = ("The quick brown fox, 3 jumped over 1234567 lazy dogs.\nNew line here\n\n  Indented  text\twith tabs"
              " naïve café 東京 and 🐍 emoji; it's don't WE'LL x\nyes\r\nno - dash -- and... dots 12 34 56 a1b2 c3"
              " Ünïcödé words\nend a\nb\n c d\n\ne f  g")


def cut_at(text: str, start: int, end: int, safe=_SAFE_CUT) -> int:
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


def cutter(tok):
    """How documents are cut for `tok` (see above): a function (text, start, end) -> at, or
    None: not at all."""
    if tok.kind == "bytes":
        return lambda text, start, end: end
    if _cuts_alike(tok):
        return cut_at
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
