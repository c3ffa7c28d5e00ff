"""`ringpipe prepare`'s tokens: each input file encoded into a part file of its own (the
tokens, and a table of its documents: their tokens, bytes and split), then the parts
joined in file order into the train and val shards, and the manifest (data.json) that
names them. The format is engine/data/shards.py's.

A document goes to validation when crc32("KEY:INDEX") % val_every == 0, KEY being its
file's path inside the folder given (or the file's name) and INDEX its place in the
file: the split is the same wherever the data lives and however many ranks prepare it.
When that leaves validation under 1% of the tokens (or over half), the last
TAIL_VAL_FRACTION of the tokens are validation instead.
"""
from __future__ import annotations

import array
import datetime
import os
import zlib

import numpy as np

from ringpipe.engine.data import shards
from ringpipe.engine.data.errors import PrepareError
from ringpipe.engine.data.readers import Source, cutter, read_pieces

TAIL_VAL_FRACTION = 0.1                       # when the per-document split does not work
# Training opens every shard of a dataset and memory-maps it (engine/data/shards.py), and Linux
# allows 65,530 maps a process by default: a split of more files than this is refused before
# any shard is written (at the default 100M tokens a shard, a trillion tokens fit).
MAX_SHARDS_PER_SPLIT = 10_000


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

def part_paths(parts_dir: str, index: int) -> tuple[str, str]:
    return (os.path.join(parts_dir, f"{index:08d}.tokens"), os.path.join(parts_dir, f"{index:08d}.docs.npy"))


# A part's documents: their tokens (separator included), text bytes, and split.
_DOC_DTYPE = np.dtype([("tokens", "<i8"), ("bytes", "<i8"), ("val", "?")])


def tokenize_source(source: Source, index: int, tok, field: str, val_every: int, parts_dir: str, bar=None):
    """Encode the documents of `source`, each followed by the separator, into the
    part files of `index`: the tokens in document order, and a table of the
    documents (their token and byte counts, and which split each goes to). A long
    document comes in pieces (read_pieces): its pieces' tokens follow one another and
    the table holds it once, with their sums, as if it had been encoded whole."""
    tokens_path, docs_path = part_paths(parts_dir, index)
    separator = np.asarray(tok.separator, dtype=tok.dtype)
    n_tokens, n_bytes, splits = array.array("q"), array.array("q"), array.array("b")
    doc_tokens = doc_bytes = 0     # of the document whose pieces are being written
    shown = 0                      # bytes of the file the progress bar has been told about
    with open(tokens_path, "wb") as out:
        # A Hugging Face tokenizer holds ~100 bytes per character while it encodes (offsets,
        # token strings): 1 MB groups keep that near 150 MB (4 MB groups peaked over 600 MB).
        group_bytes_max = 4 << 20 if tok.kind == "bytes" else 1 << 20
        for group in _batches(read_pieces(source, field, cutter(tok)), max_bytes=group_bytes_max):
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
    tables = [np.load(part_paths(parts_dir, i)[1], allow_pickle=False) for i in range(len(sources))]
    total = sum(int(t["tokens"].sum()) for t in tables)
    if total < 2:
        raise PrepareError("the inputs hold too little text to split into train and val; add text")
    split = _choose_split(tables, val_every)
    _check_shard_count(tables, split, total, tokens_per_shard)
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


def _check_shard_count(tables, split, total, tokens_per_shard):
    """Refuse a split that would be cut into more than MAX_SHARDS_PER_SPLIT files (known
    once the files are tokenized, before any shard is written), saying the size that fits."""
    if split["method"] == "documents":
        val = sum(int(t["tokens"][t["val"]].sum()) for t in tables)
    else:
        val = max(1, int(total * TAIL_VAL_FRACTION))
    for name, tokens in (("train", total - val), ("val", val)):
        files = -(-tokens // tokens_per_shard)
        if files > MAX_SHARDS_PER_SPLIT:
            raise PrepareError(f"--tokens-per-shard {tokens_per_shard}: the {name} split's {tokens:,} tokens would "
                               f"be {files:,} shard files, more than the {MAX_SHARDS_PER_SPLIT:,} a split may have "
                               "(training opens and maps every shard); pass --tokens-per-shard "
                               f"{-(-tokens // MAX_SHARDS_PER_SPLIT)} or more (the default: 100000000)")


def _write_by_document(tables, parts_dir, dtype, writers):
    """Each run of documents to the split the crc32 rule gave it."""
    counts = {s: {"bytes": 0, "documents": 0} for s in shards.SPLITS}
    for i, table in enumerate(tables):
        with open(part_paths(parts_dir, i)[0], "rb") as fh:
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
        with open(part_paths(parts_dir, i)[0], "rb") as fh:
            for chunk in _read_tokens(fh, dtype, int(table["tokens"].sum())):
                in_train = min(len(chunk), max(0, cut - position))
                writers["train"].write(chunk[:in_train])
                writers["val"].write(chunk[in_train:])
                position += len(chunk)
    return counts


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
