"""Token shards on disk and the dataset that reads them window by window (pread).

A prepared data folder (written by `ringpipe prepare`, engine/data/prepare.py):

    DATA_DIR/data.json          the manifest, written last: no manifest, no dataset
    DATA_DIR/tokenizer.json     the tokenizer the tokens came from (Hugging Face format)
    DATA_DIR/train_000000.bin   token shards in llm.c's format, in order
    DATA_DIR/val_000000.bin

A shard is llm.c's `.bin` file: a header of 256 little-endian int32 (header[0]
the magic number, header[1] the version, header[2] the token count, the rest 0),
then the tokens, little-endian:

    magic 20240520, version 1: uint16 tokens (llm.c's "gpt-2"; a vocabulary of at most 65536)
    magic 20240801, version 7: uint32 tokens (llm.c's "llama-3"; anything larger)

so llm.c reads our shards and we read its. A folder without data.json is read
as a peer's, as it is (open_dataset): nanoGPT's headerless uint16 `train.bin` /
`val.bin` (or those names holding llm.c shards), or llm.c's shard folders,
PREFIX_train_NNNNNN.bin / PREFIX_val_NNNNNN.bin or PREFIX_train.bin /
PREFIX_val.bin, every shard of a split in sorted order. docs/data-format.md
is the manual of data.json and of these folders.

Training never reads a whole shard: np.memmap maps the files, and a batch reads
only the windows it samples. A split's shards are one virtual concatenation
(ConcatenatedShards): a window may cross from one shard into the next.

A dataset does not change under a training run. Every shard's file is opened
when the dataset is opened (ConcatenatedShards), and every read goes through
those descriptors: a folder that `ringpipe prepare` replaces while a run reads
it (by renaming a new one into place) leaves the run reading the old files,
whose inodes stay readable while they are open. When DATA_DIR/prepare.lock
exists (a regular file), open_dataset also takes a shared flock on it for the
dataset's lifetime (hold_dataset): a prepare that takes it exclusively can see
that a run is reading. Not having it is not an error: a prepare holding it,
or no lock file, is said nothing of.

Every token id that reaches the model is checked against the tokenizer's
vocabulary, window by window as a batch is read (ShardDataset.batch: one max()
of the window; BadTokens otherwise); the start-up histogram sees only the first
256 MiB of a split.
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import stat
import threading

import numpy as np

from ringpipe.engine.job import files

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_UINT16, VERSION_UINT16 = 20240520, 1     # llm.c "gpt-2"
MAGIC_UINT32, VERSION_UINT32 = 20240801, 7     # llm.c "llama-3"
_VERSION_OF_MAGIC = {MAGIC_UINT16: VERSION_UINT16, MAGIC_UINT32: VERSION_UINT32}
_DTYPE_OF_MAGIC = {MAGIC_UINT16: np.dtype("<u2"), MAGIC_UINT32: np.dtype("<u4")}
NANOGPT_NAMES = ("train.bin", "val.bin")
# llm.c's dev/data scripts name a split's shards PREFIX_train_000001.bin ... (fineweb)
# or PREFIX_train.bin (tinyshakespeare): one prefix per dataset.
LLMC_NAME = re.compile(r"^(.+)_(train|val)(_[0-9]+)?\.bin$")
# The vocabulary an llm.c shard's magic implies when no tokenizer.json says: its dev/data
# scripts write GPT-2 tokens as uint16 (version 1) and Llama 3's as uint32 (version 7).
LLMC_VOCAB = {np.dtype("<u2"): (50257, "GPT-2's"), np.dtype("<u4"): (128256, "Llama 3's")}
MAX_SHARD_TOKENS = 2**31 - 1                   # header[2] is an int32

MANIFEST_NAME = "data.json"
MANIFEST_FORMAT, MANIFEST_VERSION = "ringpipe-data", 1
SPLITS = ("train", "val")
_SPLIT_IDS = {"train": 0, "val": 1}             # as engine/data/datasets.py's: the same batches for the same tokens
SHARD_NAME = re.compile(r"^(train|val)_[0-9]{6}\.bin$")
LOCK_NAME = "prepare.lock"
# A real manifest is kilobytes (a line per shard and per source); this is far above
# any prepared corpus and far below what would hurt to read.
MANIFEST_LIMIT_BYTES = 64 * files.MiB


class BadTokens(ValueError):
    """A token id outside the tokenizer's vocabulary in a batch about to be used.
    `position`: where the first such token is in its split (the same at every layout)."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (llm.c's gpt-2 shards), else uint32 (its llama-3 shards)."""
    if vocab_size > 2**32:
        raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit in uint32 token ids; use a tokenizer "
                         "with at most 2^32 tokens")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def _header(dtype: np.dtype, count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    magic = MAGIC_UINT16 if dtype.itemsize == 2 else MAGIC_UINT32
    header[0], header[1], header[2] = magic, _VERSION_OF_MAGIC[magic], count
    return header.tobytes()


# ---- writing ----------------------------------------------------------------------------

class ShardWriter:
    """One shard, written as the tokens come: they go to a temp file beside `path`;
    close() writes the header with the final count, fsyncs and renames the file
    into place, so `path` is always either absent or complete.

        with ShardWriter("train_000000.bin", vocab_size=50257) as w:
            w.write(ids); w.write(more_ids)
    """

    def __init__(self, path: str, vocab_size: int):
        self.path, self.vocab_size = path, vocab_size
        self.dtype = shard_dtype(vocab_size)
        self.count = 0
        self._tmp = f"{path}.tmp-{os.getpid()}"
        self._fh = open(self._tmp, "wb")
        self._fh.write(_header(self.dtype, 0))       # rewritten with the count at close()

    def write(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if tokens.size == 0:
            return
        if tokens.dtype.kind not in "iu":
            raise ValueError(f"{self.path}: token ids must be integers, got {tokens.dtype}")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{self.path}: token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}; "
                             "the tokens and the vocab_size given do not belong together")
        if self.count + tokens.size > MAX_SHARD_TOKENS:
            raise ValueError(f"{self.path}: a shard holds at most 2^31 - 1 tokens (its header counts them in an "
                             "int32); write fewer tokens per shard")
        self._fh.write(np.ascontiguousarray(tokens, dtype=self.dtype).data)
        self.count += tokens.size

    def close(self) -> int:
        """Finish the shard: header, fsync, rename. Returns its token count."""
        try:
            self._fh.seek(0)
            self._fh.write(_header(self.dtype, self.count))
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.count

    def abort(self) -> None:
        """Drop the shard: nothing is left at `path` or in the temp file."""
        self._fh.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.close()
        else:
            self.abort()


def write_shard(path: str, tokens, vocab_size: int) -> str:
    """Write `tokens` as one llm.c shard at `path` (atomically); uint32 over 65536 ids."""
    with ShardWriter(path, vocab_size) as writer:
        writer.write(tokens)
    return path


def write_json_atomic(path: str, obj) -> None:
    """A JSON file written whole or not at all (temp file, fsync, rename)."""
    files.write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ---- reading ----------------------------------------------------------------------------

class Shard:
    """Where a shard's tokens are in its file (what read_shard found in the header).
    `identity`: (st_dev, st_ino) of the file, so one file listed twice is seen."""

    def __init__(self, path: str, dtype: np.dtype, offset: int, count: int, headerless: bool = False,
                 identity: tuple | None = None):
        self.path, self.dtype, self.offset, self.count, self.headerless = path, dtype, offset, count, headerless
        self.identity = identity

    @property
    def size(self) -> int:
        """The file's size in bytes, as the header says."""
        return self.offset + self.count * self.dtype.itemsize

    def open(self) -> int:
        """A read-only descriptor of the file, checked to still be the file inspect_shard
        read (a regular file of the size its header gives): every later read goes
        through it, so a shard renamed away or replaced keeps reading as it was."""
        fd = files.open_regular(self.path, "shard")
        st = os.fstat(fd)
        if st.st_size != self.size:
            os.close(fd)
            raise ValueError(f"shard {self.path} is {st.st_size} bytes, its header said {self.size}: it changed "
                             "while the dataset was opened (is `ringpipe prepare` writing it?); prepare again")
        return fd

    def memmap(self, fd: int | None = None) -> np.ndarray:
        """The tokens as a read-only array over a memory map of the file (of `fd` when
        given). The map is advised MADV_RANDOM: a batch reads a few KB at random places,
        and the kernel's read-around of each page fault (8 MB on some systems) would
        otherwise read a 200 MB shard whole for a few hundred windows (measured)."""
        if self.count == 0:
            return np.zeros(0, dtype=self.dtype)      # a zero-length file cannot be mapped
        if fd is None:
            fd = self.open()
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        else:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            mapped.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(mapped, dtype=self.dtype, count=self.count, offset=self.offset)

    def blocks(self, limit: int | None = None, block: int = 1 << 20, fd: int | None = None):
        """The tokens in blocks of `block`, at most `limit` of them, read with plain
        file reads (pread of `fd` when given): the page cache holds them, not this
        process's memory (a pass over a memmap would leave the whole file resident in it)."""
        remaining = self.count if limit is None else min(self.count, limit)
        own = fd is None
        if own:
            fd = self.open()
        try:
            pos = self.offset
            while remaining > 0:
                n = min(block, remaining)
                chunk = np.empty(n, dtype=self.dtype)
                got = os.preadv(fd, [memoryview(chunk).cast("B")], pos)
                if got != chunk.nbytes:
                    raise ValueError(f"{self.path} ended early: it changed while it was read; prepare again")
                remaining -= n
                pos += chunk.nbytes
                yield chunk
        finally:
            if own:
                os.close(fd)


def inspect_shard(path: str) -> Shard:
    """Read and check a shard's header (not its tokens): llm.c's magic and version,
    and that the token count matches the file's size; or nanoGPT's headerless
    uint16 train.bin / val.bin. ValueError naming the file otherwise."""
    # Opened without blocking and checked after opening: a FIFO or device in a data
    # folder is refused at once instead of waiting for a writer or reading forever.
    try:
        fd = files.open_regular(path, "shard")
    except files.UnreadableFile as e:
        raise files.UnreadableFile(f"{e}; prepare the data again") from None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    identity = (st.st_dev, st.st_ino)
    magic = int.from_bytes(head[:4], "little", signed=True) if len(head) >= 4 else None
    if magic in _DTYPE_OF_MAGIC:
        if len(head) < HEADER_BYTES:
            raise ValueError(f"shard {path} is truncated: {len(head)} bytes, shorter than its {HEADER_BYTES}-byte "
                             "header; it was not written completely: prepare again")
        header = np.frombuffer(head, dtype="<i4")
        version, count = int(header[1]), int(header[2])
        if version != _VERSION_OF_MAGIC[magic]:
            raise ValueError(f"shard {path} has llm.c's magic {magic} but version {version}, not "
                             f"{_VERSION_OF_MAGIC[magic]}: a format this reader does not know; prepare it again")
        if count < 0:
            raise ValueError(f"shard {path}: its header says {count} tokens; the file is damaged: prepare again")
        dtype = _DTYPE_OF_MAGIC[magic]
        held = (st.st_size - HEADER_BYTES) // dtype.itemsize
        if held < count:
            raise ValueError(f"shard {path} is truncated: header says {count} tokens, the file holds {held}: it "
                             "was not written completely; prepare again")
        if st.st_size != HEADER_BYTES + count * dtype.itemsize:
            raise ValueError(f"shard {path}: header says {count} tokens but the file holds {held} "
                             f"({st.st_size} bytes): it is damaged or was written by another program; prepare again")
        return Shard(path, dtype, HEADER_BYTES, count, identity=identity)
    if os.path.basename(path) in NANOGPT_NAMES:
        if st.st_size % 2:
            raise ValueError(f"{path}: a nanoGPT token file holds uint16 tokens, but its size ({st.st_size} bytes) "
                             "is odd: it is truncated or not a token file")
        return Shard(path, np.dtype("<u2"), 0, st.st_size // 2, headerless=True, identity=identity)
    raise ValueError(f"{path} is not a token shard: it starts with {magic}, not llm.c's magic {MAGIC_UINT16} "
                     f"(uint16 tokens) or {MAGIC_UINT32} (uint32); nanoGPT's headerless files must be named "
                     "train.bin / val.bin")


def read_shard(path: str) -> np.ndarray:
    """The tokens of a shard, memory-mapped (read only when indexed); checked as inspect_shard does."""
    return inspect_shard(path).memmap()


def _room_for_descriptors(n: int) -> None:
    """Raise this process's soft limit on open files (towards the hard one) when a
    dataset's shards need more descriptors than it leaves: they are all held open."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return
    want = n + 256                              # what the rest of the process (MPI, logs) may use
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
        except (OSError, ValueError):
            pass


def _open_shard(shard: Shard, n_shards: int) -> int:
    try:
        return shard.open()
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise ValueError(f"the dataset has {n_shards} shards, more files than this process may hold open "
                             f"(opening {shard.path}: {e.strerror}); raise `ulimit -n`, or prepare the data "
                             "with larger shards (`ringpipe prepare --tokens-per-shard`)") from None
        raise ValueError(f"shard {shard.path} cannot be opened ({e.strerror or e}); prepare the data again") from None


class ConcatenatedShards:
    """A split's shards as one read-only 1-D token array: len(a), a[i], a[lo:hi] and
    a[index_array] read only the tokens asked for, from whichever shards hold them
    (a window may start in one shard and end in the next).

    Every shard's file is opened here, once, and read only through that descriptor
    (windows, blocks, the memory maps): a dataset replaced on disk while a run reads
    it keeps reading the files it was opened with, consistently."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        self._fds: list[int | None] = []
        _room_for_descriptors(len(shards))
        try:
            for shard in shards:
                self._fds.append(_open_shard(shard, len(shards)))
        except BaseException:
            self.close()
            raise
        self._arrays = None                    # memory maps, made from the descriptors on first use
        # starts[k]: the position of shard k's first token in the concatenation; starts[-1]: the total.
        self.starts = np.cumsum([0] + [s.count for s in shards], dtype=np.int64)
        self.dtype = shards[0].dtype if shards else np.dtype("<u2")
        self.nbytes = int(sum(s.count * s.dtype.itemsize for s in shards))

    @property
    def arrays(self) -> list[np.ndarray]:
        """Each shard's tokens as a memory map of its open descriptor (made on first use:
        training reads by window, and a map costs a descriptor of its own)."""
        if self._arrays is None:
            self._arrays = [s.memmap(self._fd(k)) for k, s in enumerate(self.shards)]
        return self._arrays

    def _fd(self, k: int) -> int:
        fd = self._fds[k] if k < len(self._fds) else None
        if fd is None:
            raise ValueError(f"the dataset's shard {self.shards[k].path} was closed; open the dataset again")
        return fd

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step != 1:
                raise IndexError("ConcatenatedShards slices take no step")
            return self._range(lo, max(lo, hi))
        positions = np.asarray(index)
        if positions.dtype.kind not in "iu":
            raise IndexError(f"token positions must be integers, got {positions.dtype}")
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"token position out of range 0..{len(self) - 1}")
        # Sort the positions, cut the sorted list where each shard starts, and read each
        # shard's part with one fancy index (in file order, which also suits the disk).
        flat = positions.reshape(-1)
        order = np.argsort(flat, kind="stable")
        in_order = flat[order]
        cuts = np.searchsorted(in_order, self.starts)      # shard k: in_order[cuts[k]:cuts[k + 1]]
        out = np.empty(flat.shape, dtype=self.dtype)
        for k in np.flatnonzero(np.diff(cuts)):
            a, b = cuts[k], cuts[k + 1]
            out[order[a:b]] = self.arrays[k][in_order[a:b] - self.starts[k]]
        out = out.reshape(positions.shape)
        return out[()] if out.ndim == 0 else out             # a single position gives a scalar, as numpy does

    def windows(self, starts, length: int) -> np.ndarray:
        """(len(starts), length): `length` consecutive tokens from each start, read with
        pread into the result. Not through the memory map: a map of a file that sits in
        the page cache (as it does after `ringpipe prepare`, or after an epoch) counts
        every page it touches as this process's resident memory, which grew to 92% of a
        1 GiB corpus in 200 batches (measured); pread copies only the tokens asked for.
        Safe from several threads at once (pread takes its own offset)."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        out = np.empty((len(starts), length), dtype=self.dtype)
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"a window of {length} tokens from {starts.min()}..{starts.max()} leaves 0..{len(self)}")
        item = self.dtype.itemsize
        for row, start in enumerate(starts.tolist()):
            pos, end = start, start + length
            while pos < end:
                k = int(np.searchsorted(self.starts, pos, side="right")) - 1
                take = min(end, int(self.starts[k + 1])) - pos
                shard = self.shards[k]
                target = out[row, pos - start:pos - start + take]
                got = os.preadv(self._fd(k), [memoryview(target).cast("B")],
                                shard.offset + (pos - int(self.starts[k])) * item)
                if got != take * item:
                    raise ValueError(f"{shard.path} ended early: it changed while it was read; prepare again")
                pos += take
        return out

    def close(self) -> None:
        self._arrays = None                    # the maps hold their own descriptors until collected
        for k, fd in enumerate(self._fds):
            if fd is not None:
                os.close(fd)
                self._fds[k] = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _range(self, lo: int, hi: int) -> np.ndarray:
        parts = []
        for k, array in enumerate(self.arrays):
            a, b = max(lo, self.starts[k]), min(hi, self.starts[k + 1])
            if a < b:
                parts.append(array[a - self.starts[k]:b - self.starts[k]])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def blocks(self, limit: int | None = None, block: int = 1 << 20):
        """The first `limit` tokens (all: None) in blocks, by plain file reads (see Shard.blocks)."""
        remaining = len(self) if limit is None else min(len(self), limit)
        for k, shard in enumerate(self.shards):
            if remaining <= 0:
                break
            for chunk in shard.blocks(limit=remaining, block=block, fd=self._fd(k)):
                remaining -= len(chunk)
                yield chunk


# ---- the manifest -----------------------------------------------------------------------

def write_manifest(data_dir: str, manifest: dict) -> str:
    path = os.path.join(data_dir, MANIFEST_NAME)
    write_json_atomic(path, manifest)
    return path


def _expect(ok: bool, path: str, what: str):
    if not ok:
        raise ValueError(f"{path}: {what}; the manifest is damaged or from another program: prepare the data again "
                         "(or, written by hand, correct it: docs/data-format.md gives every field)")


def _is_int(value, low=0, high=None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _plain_name(name) -> bool:
    """A file name inside the data folder (no folders, nothing that climbs out of it)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def read_manifest(data_dir: str) -> dict:
    """DATA_DIR/data.json, checked: its types, that every shard exists with a valid
    header, and that the shards' token counts sum to the manifest's. ValueError
    saying what is wrong otherwise. Reads shard headers only, never tokens.
    Required: format, version, tokenizer.file, tokenizer.vocab_size, splits.*.shards;
    the rest is checked when present (docs/data-format.md: a hand-written manifest)."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    if not os.path.lexists(path):
        raise ValueError(f"{path} does not exist: {data_dir} is not a prepared data folder; write one with "
                         f"`ringpipe prepare INPUT... --out {data_dir}`")
    # A FIFO, a device, a huge file or JSON nested past the parser's recursion is
    # refused naming the file (engine/job/files.py), never a hang or a traceback.
    try:
        m = files.read_json(path, "the data manifest", limit=MANIFEST_LIMIT_BYTES)
    except files.UnreadableFile as e:
        raise files.UnreadableFile(f"{e}: {data_dir} is not a usable prepared data folder; prepare the data "
                                   "again") from None
    _expect(isinstance(m, dict), path, "it is not a JSON object")
    _expect(m.get("format") == MANIFEST_FORMAT, path,
            f"its format is {m.get('format')!r}, not {MANIFEST_FORMAT!r}")
    if _is_int(m.get("version")) and m["version"] > MANIFEST_VERSION:
        raise ValueError(f"{path}: manifest version {m['version']} was written by a newer ringpipe (this one reads "
                         f"version {MANIFEST_VERSION}); upgrade ringpipe or prepare the data again")
    _expect(m.get("version") == MANIFEST_VERSION, path, f"its version is {m.get('version')!r}")
    t = _check_manifest_tokenizer(m, path)
    _check_manifest_shards(m, path, data_dir, shard_dtype(t["vocab_size"]))
    _check_manifest_records(m, path)
    return m


def _check_manifest_tokenizer(m: dict, path: str) -> dict:
    t = m.get("tokenizer")
    _expect(isinstance(t, dict), path, "\"tokenizer\" is not an object")
    _expect(t.get("kind", "hf") in ("bytes", "hf"), path, f"tokenizer.kind is {t.get('kind')!r}, not 'bytes' or 'hf'")
    _expect(_plain_name(t.get("file")), path, f"tokenizer.file {t.get('file')!r} is not a file name")
    for key in ("sha256", "identity"):          # optional: without them the file is taken as it is
        _expect(key not in t or (isinstance(t[key], str) and re.fullmatch(r"[0-9a-f]{64}", t[key]) is not None),
                path, f"tokenizer.{key} is not 64 hex digits (leave it out to take {t.get('file')} as it is)")
    _expect(_is_int(t.get("vocab_size"), 1, 2**32), path, "tokenizer.vocab_size is not a whole number in 1..2^32")
    separator = m.get("separator", [0])
    _expect(isinstance(separator, list) and separator and all(_is_int(i, 0, t["vocab_size"] - 1) for i in separator),
            path, "\"separator\" is not a list of token ids")
    _expect(_is_int(m.get("tokens_per_shard", 1), 1, MAX_SHARD_TOKENS), path, "tokens_per_shard is not a positive int")
    return t


def _check_manifest_shards(m: dict, path: str, data_dir: str, dtype: np.dtype) -> None:
    splits = m.get("splits")
    _expect(isinstance(splits, dict) and set(splits) == set(SPLITS), path, "\"splits\" must hold train and val")
    # A shard in both splits would train on the validation tokens (and validate on
    # training ones); twice in one split, it would count double. Either is refused,
    # by name and by file (a hard or symbolic link is the same file).
    listed: dict = {}
    for name in SPLITS:
        s = splits[name]
        _expect(isinstance(s, dict), path, f"splits.{name} is not an object")
        _expect(isinstance(s.get("shards"), list) and all(_plain_name(f) for f in s["shards"]), path,
                f"splits.{name}.shards is not a list of file names")
        for key in ("tokens", "bytes", "documents"):
            _expect(key not in s or _is_int(s[key]), path, f"splits.{name}.{key} is not a whole number >= 0")
        held = 0
        for file in s["shards"]:
            shard = inspect_shard(os.path.join(data_dir, file))
            for key in (("name", file), ("file", shard.identity)):
                if key in listed:
                    where = listed[key]
                    raise ValueError(f"{path}: shard {file} is listed in splits.{name} and already in splits."
                                     f"{where[0]} (as {where[1]}): a shard belongs to one split, once; the "
                                     "manifest was edited or the folder's files linked together: prepare the "
                                     "data again")
                listed[key] = (name, file)
            if shard.headerless or shard.dtype != dtype:
                raise ValueError(f"{shard.path} holds {'headerless ' if shard.headerless else ''}"
                                 f"{shard.dtype.name} tokens, but the shards of a vocabulary of "
                                 f"{m['tokenizer']['vocab_size']} are llm.c shards of {dtype.name} tokens: it does "
                                 f"not belong to {path}; prepare the data again")
            held += shard.count
        if "tokens" in s and held != s["tokens"]:
            raise ValueError(f"{path}: the {name} shards hold {held} tokens, the manifest says {s['tokens']}: a "
                             "shard was replaced or the manifest edited; prepare the data again (or, for a "
                             f"manifest written by hand, correct splits.{name}.tokens or leave it out)")


def _check_manifest_records(m: dict, path: str) -> None:
    """What `ringpipe prepare` records of how the data was made: optional, typed when present."""
    sources = m.get("sources", [])
    _expect(isinstance(sources, list) and all(isinstance(x, dict) for x in sources), path,
            "\"sources\" is not a list of objects")
    for key in ("split", "skipped"):
        _expect(isinstance(m.get(key, {}), dict), path, f"\"{key}\" is not an object")
    for key in ("created", "command"):
        _expect(isinstance(m.get(key, ""), str), path, f"\"{key}\" is not a string")


# ---- the dataset ------------------------------------------------------------------------

def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 else f"{n_bytes / 1e3:.1f} kB"


class ShardDataset:
    """Token shards as a dataset, with the surface of engine/data/datasets.py's TokenDataset.

    A training example is a window of seq_len + 1 tokens (inputs and the targets
    shifted by one) anywhere in the split's concatenated shards. batch(step, ...)
    is rows lo:hi of the global batch number `step`, a pure function of (seed,
    step, split), drawn exactly as TokenDataset draws it: the same tokens give
    the same batches, and 1 rank or N ranks see the same examples.
    """

    kind = "tokens"
    UNIGRAM_LIMIT_BYTES = 256 << 20

    def __init__(self, splits: dict[str, list[Shard]], seq_len: int, seed: int, vocab_size: int, tokenizer,
                 name: str, description: str, text_bytes: dict | None = None):
        self.splits = {split: ConcatenatedShards(splits[split]) for split in SPLITS}
        for split, tokens in self.splits.items():
            if len(tokens) < seq_len + 2:
                raise ValueError(f"{name}: the {split} split has {len(tokens)} tokens, fewer than --seq-len "
                                 f"{seq_len} + 2; use a shorter --seq-len or prepare more data")
        self.seq_len, self.seed, self.name = seq_len, seed, name
        self.vocab_size, self.tokenizer = vocab_size, tokenizer
        self.description = description
        self._text_bytes = text_bytes or {}
        self._lock_fd = None                      # hold_dataset's shared flock, held while the dataset is open
        # How the vocabulary was had without a tokenizer (a peer's folder), or None: from the tokenizer.
        self.assumed_vocab: str | None = None

    def describe(self) -> str:
        """What was read, for the run's start-up lines."""
        parts = []
        for split, tokens in self.splits.items():
            parts.append(f"{split} {len(tokens):,} tokens in {len(tokens.shards)} shard(s), {_size(tokens.nbytes)}")
        return f"{self.description} | {'; '.join(parts)} | read by window, not loaded"

    def batch(self, step, batch_size, lo=0, hi=None, split="train"):
        hi = batch_size if hi is None else hi
        tokens = self.splits[split]
        T = self.seq_len
        rng = np.random.default_rng([self.seed, step, _SPLIT_IDS[split]])
        starts = rng.integers(0, len(tokens) - T - 1, size=batch_size)[lo:hi]
        window = tokens.windows(starts, T + 1)               # (b, T+1), read from the shards that hold it
        # Every id that reaches the model is checked here, as it is read: one max() of the
        # window, 2 us for 64 rows of 1025 uint16 tokens against 190 us for their preads
        # (measured, page cache warm), in the prefetch thread. Past the start-up histogram
        # (a split's first 256 MiB) an id outside the vocabulary would otherwise index
        # past the embedding (an IndexError at --tp 1), be masked to a zero vector by the
        # vocabulary-parallel layers (--tp 2: trains on nothing, says nothing) or hit a
        # padding row (a loss of 1e8).
        if window.size and int(window.max()) >= self.vocab_size:
            bad = np.argwhere(window >= self.vocab_size)
            positions = starts[bad[:, 0]] + bad[:, 1]
            first = int(np.argmin(positions))
            raise self.bad_tokens(split, int(positions[first]), int(window[tuple(bad[first])]))
        window = window.astype(np.int64)
        return window[:, :-1], window[:, 1:]

    def bad_tokens(self, split: str, position: int, token: int) -> BadTokens:
        """The error for token id `token` at `position` of `split`: what it is, where
        (the split's position and the shard's), and what to do. Layout-independent:
        the same id at the same place gives the same words at any number of ranks."""
        tokens = self.splits[split]
        k = int(np.searchsorted(tokens.starts, position, side="right")) - 1
        shard = os.path.basename(tokens.shards[k].path)
        where = (f"{self.name}: the {split} split holds token id {token} at token position {position:,} "
                 f"(token {position - int(tokens.starts[k]):,} of shard {shard}), outside ")
        if self.assumed_vocab is not None:
            return BadTokens(f"{where}the vocabulary 0..{self.vocab_size - 1}, which was assumed ({self.assumed_vocab})"
                             ": the data has no tokenizer.json to say its own; put the tokenizer.json the data was "
                             f"made with in {self.name}", position)
        return BadTokens(f"{where}the tokenizer's vocabulary 0..{self.vocab_size - 1}; the data and its tokenizer "
                         "do not belong together (a shard was damaged, replaced or written with another tokenizer): "
                         "prepare the data again", position)

    def close(self) -> None:
        """Close the shards' files and let go of the dataset's lock."""
        for tokens in self.splits.values():
            tokens.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)              # closing the descriptor releases the flock
            self._lock_fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def bytes_per_token(self, split="val"):
        """Bytes of text per token in `split` (for bits per byte), or None when unknown."""
        n_bytes = self._text_bytes.get(split)
        tokens = len(self.splits[split])
        return n_bytes / tokens if n_bytes and tokens else None

    def _counts(self, split) -> np.ndarray:
        """Token histogram of the split's first 256 MiB, block by block (np.bincount of a
        whole memmap would first copy it into an int64 array, 4-8x its size)."""
        tokens = self.splits[split]
        counts = np.zeros(self.vocab_size, dtype=np.float64)
        at = 0
        for block in tokens.blocks(limit=self.UNIGRAM_LIMIT_BYTES // tokens.dtype.itemsize):
            hist = np.bincount(block, minlength=self.vocab_size)
            if len(hist) > self.vocab_size:
                # The largest id, and where it first is (the step loop's check names the first bad id).
                where = int(np.argmax(block == len(hist) - 1))
                raise self.bad_tokens(split, at + where, len(hist) - 1)     # the words of the step loop's check
            counts += hist
            at += len(block)
        return counts

    def unigram_entropy(self):
        """Cross-entropy (nats/token) of the best context-free model on the validation
        split, fit on the training split (add-one smoothing): the bar a language model
        must clear to have learned anything. From the first 256 MiB of each split."""
        counts = self._counts("train") + 1.0
        logp = np.log(counts / counts.sum())
        val = self._counts("val")
        return float(-(val * logp).sum() / val.sum())


def hold_dataset(data_dir: str) -> int | None:
    """A shared flock on DATA_DIR/prepare.lock, when that is a regular file: the
    descriptor holding it (closing it lets go), or None. Opened read-only with
    O_NOFOLLOW|O_NONBLOCK (a link or FIFO put there neither redirects nor blocks),
    locked with LOCK_NB: training never waits for a prepare. No lock file, or a
    lock that cannot be had, is not an error and is said nothing of: the shard
    descriptors the dataset holds keep its reads consistent either way."""
    path = os.path.join(data_dir, LOCK_NAME)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def open_dataset(data_dir: str, seq_len: int, seed: int) -> ShardDataset:
    """A prepared data folder (data.json, written by `ringpipe prepare`), or a nanoGPT
    folder (train.bin + val.bin: headerless uint16 tokens). Every shard is opened now
    and DATA_DIR/prepare.lock held shared (hold_dataset) for the dataset's lifetime."""
    if not os.path.isdir(data_dir):
        what = "does not exist" if not os.path.exists(data_dir) else "is not a folder"
        raise ValueError(f"--data {data_dir} {what}; write a data folder with `ringpipe prepare INPUT... "
                         f"--out {data_dir}`")
    lock = hold_dataset(data_dir)
    try:
        dataset = _open_folder(data_dir, seq_len, seed)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    dataset._lock_fd = lock
    return dataset


def _open_folder(data_dir, seq_len, seed):
    if os.path.lexists(os.path.join(data_dir, MANIFEST_NAME)):
        return _open_prepared(data_dir, seq_len, seed)
    found = peer_shards(data_dir)
    if found is None:
        raise ValueError(f"--data {data_dir} holds neither {MANIFEST_NAME} (a folder written by `ringpipe prepare`) "
                         "nor train.bin + val.bin (nanoGPT's) nor PREFIX_train*.bin + PREFIX_val*.bin (llm.c's "
                         f"shards); write one with `ringpipe prepare INPUT... --out {data_dir}`, or see "
                         "docs/data-format.md")
    return _open_peer(data_dir, found, seq_len, seed)


def _open_prepared(data_dir, seq_len, seed):
    from ringpipe.engine.data.tokenizer import load_tokenizer
    m = read_manifest(data_dir)
    t = m["tokenizer"]
    tokenizer_path = os.path.join(data_dir, t["file"])
    tokenizer = load_tokenizer(tokenizer_path)
    check_manifest_tokenizer(tokenizer, t, tokenizer_path)
    separator = m.get("separator", list(tokenizer.separator))
    if tokenizer.vocab_size != t["vocab_size"] or list(tokenizer.separator) != separator:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens and separator "
                         f"{list(tokenizer.separator)}, the manifest says {t['vocab_size']} and {separator}; "
                         "prepare the data again (or, for a manifest written by hand, write the tokenizer's in "
                         "tokenizer.vocab_size and separator)")
    splits = {s: [inspect_shard(os.path.join(data_dir, f)) for f in m["splits"][s]["shards"]] for s in SPLITS}
    description = f"{data_dir}: tokenizer {tokenizer.kind} (vocab {tokenizer.vocab_size:,})"
    text_bytes = {s: m["splits"][s].get("bytes") for s in SPLITS}
    return ShardDataset(splits, seq_len, seed, tokenizer.vocab_size, tokenizer, name=data_dir,
                        description=description, text_bytes=text_bytes)


def check_manifest_tokenizer(tokenizer, entry: dict, path: str) -> None:
    """The tokenizer file is the one data.json names: by `identity` when it records one
    (what decides the ids: a file `transformers` re-saved still matches), else by
    `sha256` (a dataset prepared before identities: the canonical JSON's hash; or a
    hand-written manifest's `sha256sum` of the file). Neither recorded: taken as it is."""
    from ringpipe.engine.data.tokenizer import file_sha256
    if "identity" in entry:
        if entry["identity"] == tokenizer.identity:
            return
        recorded, found, what = entry["identity"], tokenizer.identity, "identity"
    elif "sha256" in entry:
        if entry["sha256"] in (tokenizer.sha256, file_sha256(tokenizer.to_json())):
            return
        recorded, found, what = entry["sha256"], tokenizer.sha256, "sha256"
    else:
        return
    raise ValueError(f"{path} is not the tokenizer the data was prepared with: data.json records tokenizer.{what} "
                     f"{recorded[:12]}..., this file's is {found[:12]}... (ringpipe's {what}: "
                     "docs/data-format.md). If it was replaced after `ringpipe prepare`, prepare the data again; if "
                     f"data.json was written by hand, leave tokenizer.{what} out (the file is then taken as it is) "
                     f"or write {found}")


def peer_shards(data_dir: str) -> dict | None:
    """{split: [file names, in order]} of a folder without data.json holding a peer's
    shards, or None: nanoGPT's train.bin + val.bin, else llm.c's PREFIX_train*.bin +
    PREFIX_val*.bin (LLMC_NAME), all of one prefix. Names of one split alone (llm.c's
    hellaswag_val.bin, an evaluation file) are left out; two datasets are refused."""
    if all(os.path.exists(os.path.join(data_dir, n)) for n in NANOGPT_NAMES):
        return {s: [f"{s}.bin"] for s in SPLITS}
    groups: dict = {}
    for name in sorted(os.listdir(data_dir)):
        match = LLMC_NAME.match(name)
        if match:
            groups.setdefault(match.group(1), {s: [] for s in SPLITS})[match.group(2)].append(name)
    complete = sorted(prefix for prefix, g in groups.items() if all(g.values()))
    if len(complete) > 1:
        raise ValueError(f"--data {data_dir} holds the llm.c shards of {len(complete)} datasets "
                         f"({', '.join(complete)}): put each in a folder of its own")
    if not complete:
        if groups:
            lone = ", ".join(f"{p}_{s}*.bin" for p, g in sorted(groups.items()) for s in SPLITS if g[s])
            raise ValueError(f"--data {data_dir} holds llm.c shards of one split only ({lone}): a dataset needs "
                             "a train and a val split (PREFIX_train*.bin and PREFIX_val*.bin)")
        return None
    return groups[complete[0]]


def _open_peer(data_dir, names, seq_len, seed):
    """A peer's shards (peer_shards): the vocabulary from DATA_DIR/tokenizer.json when
    there is one; else llm.c's magic says whose tokens they are (LLMC_VOCAB); else
    (headerless) the largest id + 1, a guess, said so."""
    splits = {s: [inspect_shard(os.path.join(data_dir, f)) for f in names[s]] for s in SPLITS}
    every = [shard for s in SPLITS for shard in splits[s]]
    kinds = {(shard.headerless, shard.dtype) for shard in every}
    if len(kinds) > 1:
        raise ValueError(f"--data {data_dir} mixes token files of different formats ({_format_of(every[0])} in "
                         f"{os.path.basename(every[0].path)}, {_format_of(every[-1])} in "
                         f"{os.path.basename(every[-1].path)}): a dataset's shards share one format; convert them "
                         "or put them in separate folders")
    what = f"{names['train'][0]}... ({_format_of(every[0])})" if len(names["train"]) > 1 else \
        f"{'/'.join(names['train'] + names['val'])} ({_format_of(every[0])})"
    tokenizer, vocab_size, source, assumed = _peer_vocabulary(data_dir, splits, every[0])
    dataset = ShardDataset(splits, seq_len, seed, vocab_size, tokenizer, name=data_dir,
                           description=f"{data_dir}: {what}, {source}")
    dataset.assumed_vocab = assumed
    return dataset


def _format_of(shard: Shard) -> str:
    return "nanoGPT's headerless uint16" if shard.headerless else f"llm.c shards, {shard.dtype.name} tokens"


def _peer_vocabulary(data_dir, splits, shard):
    """(tokenizer or None, vocab_size, what to say of it, None or how it was assumed)."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    tokenizer_path = os.path.join(data_dir, "tokenizer.json")
    if os.path.lexists(tokenizer_path):
        tokenizer = load_tokenizer(tokenizer_path)
        return (tokenizer, tokenizer.vocab_size,
                f"tokenizer {tokenizer.kind} from tokenizer.json (vocab {tokenizer.vocab_size:,})", None)
    hint = "put the tokenizer.json the data was made with beside the shards to use its vocabulary"
    if not shard.headerless:
        vocab_size, whose = LLMC_VOCAB[shard.dtype]
        assumed = f"{whose} vocabulary, {vocab_size:,} tokens, what llm.c's {shard.dtype.name} shards hold"
        return None, vocab_size, f"no tokenizer.json: vocab {vocab_size:,} ({assumed}; {hint})", assumed
    # No tokenizer to say how many ids there are: the largest id in the data sets the
    # vocabulary (GPT-2's 50257 for nanoGPT's OpenWebText, whose <|endoftext|> is 50256).
    largest = -1
    for split in SPLITS:
        for block in ConcatenatedShards(splits[split]).blocks(block=16 << 20):
            largest = max(largest, int(block.max()))
    assumed = "the largest token id in the data + 1"
    return None, largest + 1, f"no tokenizer.json: vocab {largest + 1:,} = {assumed} ({hint})", assumed


# ---- prefetching --------------------------------------------------------------------------

class Prefetcher:
    """Reads the next batch in a background thread while the current step computes.

        batches = Prefetcher(dataset, batch_size, lo, hi)
        x, y = batches.get(step)      # this step's batch; step + 1 starts loading now

    get(step) returns exactly dataset.batch(step, batch_size, lo, hi, split): the
    prefetched one if it is the step asked for (else it is computed now). An error
    in the background read is raised by the get() that asks for that step.
    """

    def __init__(self, dataset, batch_size, lo=0, hi=None, split="train"):
        self.dataset, self.batch_size, self.lo, self.hi, self.split = dataset, batch_size, lo, hi, split
        self._thread = None
        self._step = None
        self._result = None
        self._error = None

    def _load(self, step):
        return self.dataset.batch(step, self.batch_size, self.lo, self.hi, split=self.split)

    def _run(self, step):
        try:
            self._result = self._load(step)
        except BaseException as e:           # handed to the get() that asks for this step
            self._error = e

    def _take(self, step):
        """The prefetched batch if it is `step`'s (waiting for it), else None."""
        if self._thread is None:
            return None
        self._thread.join()
        prefetched, result, error = self._step, self._result, self._error
        self._thread = self._step = self._result = self._error = None
        if prefetched != step:
            return None
        if error is not None:
            raise error
        return result

    def error_of(self, step):
        """The error reading `step`'s batch raised, or None: found before get(step) uses
        it, so the ranks can agree on it first (engine/train/run.py). Waits for the batch
        being read ahead, or reads it now; get(step) then returns it (or raises)."""
        if self._thread is None or self._step != step:
            self.close()
            self._step = step
            self._thread = threading.Thread(target=self._run, args=(step,), name="ringpipe-prefetch", daemon=True)
            self._thread.start()
        self._thread.join()
        return self._error

    def get(self, step):
        batch = self._take(step)
        if batch is None:
            batch = self._load(step)
        self._step = step + 1
        self._thread = threading.Thread(target=self._run, args=(step + 1,), name="ringpipe-prefetch", daemon=True)
        self._thread.start()
        return batch

    def close(self):
        """Wait for the batch being read (nothing keeps running after this)."""
        if self._thread is not None:
            self._thread.join()
        self._thread = self._step = self._result = self._error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
