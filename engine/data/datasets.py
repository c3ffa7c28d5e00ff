"""Data: the stdlib corpus (bytes), Fashion-MNIST (IDX), and synthetic sets for tests.

Every dataset answers `batch(step, batch_size, lo, hi, split)`: rows lo:hi of
global batch number `step`. The global batch depends only on (seed, step,
split), never on how many ranks there are, so 1 rank and N data-parallel
ranks see exactly the same examples: parallelism never changes the math.
"""
from __future__ import annotations

import gzip
import os
import stat
import struct
import sysconfig
import zlib

import numpy as np

_SPLIT_IDS = {"train": 0, "val": 1}


def _rng(seed, step, split):
    return np.random.default_rng([seed, step, _SPLIT_IDS[split]])


class TokenDataset:
    """Byte-level tokens; a training example is a window of seq_len bytes and the
    same window shifted by one as targets. The splits may be memory-mapped files:
    a batch reads only the windows it samples. (Token shards written by `ringpipe
    prepare` are engine/data/shards.py's ShardDataset, with the same surface.)"""

    kind = "tokens"
    vocab_size = 256

    @property
    def tokenizer(self):
        from ringpipe.engine.data.tokenizer import load_tokenizer
        return load_tokenizer("bytes")

    def bytes_per_token(self, split="val"):
        return 1.0

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, seed: int, name: str,
                 description: str | None = None):
        for split, arr in (("train", train), ("val", val)):
            if len(arr) < seq_len + 2:
                raise ValueError(f"{name}: the {split} split has {len(arr)} tokens, fewer than "
                                 f"--seq-len {seq_len} + 2; use a shorter --seq-len or more data")
        self.splits = {"train": train, "val": val}
        self.seq_len, self.seed, self.name = seq_len, seed, name
        self.description = description or name

    def describe(self) -> str:
        """What was read, for the run's start-up lines."""
        train, val = (len(self.splits[k]) for k in ("train", "val"))
        return f"{self.description} | train {_size(train)}, val {_size(val)}"

    def batch(self, step, batch_size, lo=0, hi=None, split="train"):
        hi = batch_size if hi is None else hi
        tokens = self.splits[split]
        T = self.seq_len
        starts = _rng(self.seed, step, split).integers(0, len(tokens) - T - 1, size=batch_size)[lo:hi]
        idx = starts[:, None] + np.arange(T + 1)[None, :]
        window = tokens[idx].astype(np.int64)                 # (b, T+1)
        return window[:, :-1], window[:, 1:]

    def unigram_entropy(self):
        """Cross-entropy (nats/byte) of the best context-free model on the validation set,
        fit on the training set: the bar a language model must clear to have learned anything.
        On a corpus of more than 256 MiB per split, from its first 256 MiB."""
        counts = _byte_counts(self.splits["train"]) + 1.0
        logp = np.log(counts / counts.sum())
        val = _byte_counts(self.splits["val"])
        return float(-(val * logp).sum() / val.sum())


def _byte_counts(tokens, limit=256 << 20, block=16 << 20):
    """Histogram of byte values, in blocks: np.bincount of a whole memory-mapped
    file would first copy it into an int64 array (8x its size)."""
    counts = np.zeros(256, dtype=np.float64)
    for a in range(0, min(len(tokens), limit), block):
        counts += np.bincount(np.asarray(tokens[a:min(a + block, limit)]), minlength=256)[:256]
    return counts


def _size(n_bytes):
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.1f} KiB"


class ClassificationDataset:
    kind = "features"

    def __init__(self, x_train, y_train, x_val, y_val, seed, name, n_classes):
        self.splits = {"train": (x_train, y_train), "val": (x_val, y_val)}
        self.seed, self.name, self.n_classes = seed, name, n_classes
        self.n_features = x_train.shape[1]
        self._order = None         # the validation split's shuffle (_val_order), made on first use

    def describe(self) -> str:
        (x_train, _), (x_val, _) = self.splits["train"], self.splits["val"]
        return (f"{self.name}: {len(x_train)} train / {len(x_val)} val examples, {self.n_features} features, "
                f"{self.n_classes} classes")

    def examples(self, split="val") -> int:
        """How many examples `split` holds."""
        return len(self.splits[split][0])

    def batch(self, step, batch_size, lo=0, hi=None, split="train"):
        """Training: batch_size examples drawn at random (with replacement: an epoch is as
        many draws as the split holds). Validation: the examples at positions step x
        batch_size onwards of one fixed shuffle of the split, so the batches 0, 1, ... of a
        pass never count an example twice, and together cover the whole split; the last of
        them holds what is left (fewer rows, or none of this rank's lo:hi)."""
        hi = batch_size if hi is None else hi
        x, y = self.splits[split]
        if split != "val":
            idx = _rng(self.seed, step, split).integers(0, len(x), size=batch_size)[lo:hi]
            return x[idx], y[idx].astype(np.int64)
        if not 0 <= step * batch_size < len(x):
            raise ValueError(f"{self.name}: validation batch {step} of {batch_size} examples starts past the "
                             f"{len(x)} examples of the split")
        idx = self._val_order()[step * batch_size:(step + 1) * batch_size][lo:hi]
        return x[idx], y[idx].astype(np.int64)

    def _val_order(self):
        """The validation split's fixed shuffle (the seed's), made once: a subset of batches
        is a random sample of the split, even of one stored sorted by class."""
        if self._order is None:
            self._order = _rng(self.seed, 0, "val").permutation(self.examples("val"))
        return self._order


# ---- the stdlib corpus and text folders ---------------------------------------------

_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_files(root=None, extensions=(".py",)):
    """Sorted source files of the running interpreter's standard library (no site-packages),
    or of any folder `root`. extensions None: every regular file (hidden ones excluded)."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for f in sorted(files):
            if (f.endswith(extensions) if extensions else not f.startswith(".")):
                found.append(os.path.join(dirpath, f))
    return root, found


def looks_like_text(head: bytes) -> bool:
    """No NUL byte and valid UTF-8 (a character cut at the end of the sample is fine)."""
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3


def _read_regular(path):
    """The bytes of a regular file, or None for anything else (a FIFO would block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def load_stdlib_corpus(seq_len, seed, max_bytes=64 << 20, val_every=10, root=None, extensions=(".py",),
                       name=None):
    """Concatenate source files; each file goes to validation when crc32(path) % val_every == 0,
    so the split is deterministic and a file never straddles train and val.
    extensions None (text folders): every file that looks like text, binaries skipped.
    Reading stops once max_bytes are in (the file that crosses the limit included);
    the description says what was read and what was left out."""
    root, files = stdlib_files(root, extensions)
    if not files:
        if name:
            raise FileNotFoundError(f"no {'/'.join(extensions) if extensions else 'readable'} files under {root}")
        raise FileNotFoundError(f"no .py files under {root}: the stdlib corpus needs the Python "
                                "standard library sources (some minimal images strip them); "
                                "use --data synthetic, or --data text --data-path FOLDER")
    train, val, total, n_read, skipped = [], [], 0, 0, []
    for path in files:
        rel = os.path.relpath(path, root)
        data = _read_regular(path)
        if data is None or (extensions is None and not looks_like_text(data[:8192])):
            skipped.append(rel)
            continue
        (val if zlib.crc32(rel.encode()) % val_every == 0 else train).append(data)
        total += len(data)
        n_read += 1
        if total >= max_bytes:
            break
    left_out = len(files) - n_read - len(skipped)
    if total == 0:
        raise ValueError(f"{name or root}: the {n_read} text file(s) found are empty"
                         + (f" ({len(skipped)} binary or special file(s) skipped, e.g. {skipped[0]})"
                            if skipped else ""))
    if sum(map(len, val)) < seq_len + 2 or sum(map(len, train)) < seq_len + 2:
        # Too few (or too small) files for a per-file split: hold out the last tenth of the bytes instead.
        data = b"\n".join(train + val)
        cut = len(data) * 9 // 10
        train, val = [data[:cut]], [data[cut:]]
    description = f"{name or f'stdlib ({root})'}: {n_read} file(s), {_size(total)} read"
    if skipped:
        description += f"; {len(skipped)} binary or special file(s) skipped (e.g. {skipped[0]})"
    if left_out:
        description += (f"; stopped at the {max_bytes / 2**20:.3g} MiB limit, {left_out} file(s) not read "
                        "(--max-data-mb raises it)")
    as_tokens = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)  # noqa: E731
    return TokenDataset(as_tokens(train), as_tokens(val), seq_len, seed, name or f"stdlib ({root})",
                        description=description)


def load_text_folder(path, seq_len, seed, val_every=10, max_bytes=64 << 20):
    """A text file (memory-mapped: any size, nothing held in RAM; the last tenth is
    validation) or a folder of text files (read like the stdlib corpus, every
    file that looks like text, up to max_bytes)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"--data-path {path!r} does not exist") from None
    if stat.S_ISDIR(mode):
        return load_stdlib_corpus(seq_len, seed, max_bytes=max_bytes, val_every=val_every, root=path,
                                  extensions=None, name=f"text ({path})")
    if not stat.S_ISREG(mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise ValueError(f"--data-path {path!r} is {kind}; pass a text file or a folder of text files")
    size = os.stat(path).st_size
    if size == 0:
        raise ValueError(f"--data-path {path!r} is empty")
    with open(path, "rb") as fh:
        if not looks_like_text(fh.read(8192)):
            raise ValueError(f"--data-path {path!r} does not look like text (NUL bytes or invalid UTF-8 in "
                             "its first 8 KiB); the GPT trains on text bytes")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cut = size * 9 // 10
    return TokenDataset(data[:cut], data[cut:], seq_len, seed, path,
                        description=f"text ({path}): 1 file, {_size(size)}, memory-mapped")


def synthetic_tokens(seq_len, seed, n=20000):
    """A learnable byte stream: repeated random 'words', so tests can see loss fall fast."""
    rng = np.random.default_rng(12345)
    words = [bytes(rng.integers(97, 123, size=rng.integers(2, 7))) for _ in range(20)]
    picks = rng.integers(0, len(words), size=n // 4)
    data = np.frombuffer(b" ".join(words[i] for i in picks)[:n], dtype=np.uint8)
    cut = len(data) * 9 // 10
    return TokenDataset(data[:cut], data[cut:], seq_len, seed, "synthetic tokens")


# ---- Fashion-MNIST (IDX) ---------------------------------------------------------------

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    """Read an IDX file (optionally gzipped): magic 0x00 0x00 <type> <ndim>, big-endian dims, data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic {raw[:4]!r})")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} values) "
                         f"but the file holds {data.size}: truncated or corrupt")
    return data.reshape(dims)


def load_fashion_mnist(seed, root=FASHION_MNIST_DIR, dtype=np.float32):
    names = {k: os.path.join(root, f"{k}.gz") for k in
             ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
              "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
    missing = [p for p in names.values() if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found ({missing[0]} is missing). Install Debian's package: "
            "`apt-get install dataset-fashion-mnist`, or use --data synthetic for the MLP.")
    load = lambda k: read_idx(names[k])
    norm = lambda x: ((x.reshape(len(x), -1).astype(np.float64) / 255.0 - 0.2860) / 0.3530).astype(dtype)
    return ClassificationDataset(norm(load("train-images-idx3-ubyte")), load("train-labels-idx1-ubyte"),
                                 norm(load("t10k-images-idx3-ubyte")), load("t10k-labels-idx1-ubyte"),
                                 seed, "fashion-mnist", 10)


def synthetic_classification(seed, n_features=32, n_classes=4, n=2048, dtype=np.float32):
    """Gaussian blobs: linearly separable enough that an MLP's loss falls within a few steps."""
    rng = np.random.default_rng(777)
    centers = rng.normal(0, 2.0, size=(n_classes, n_features))
    y = rng.integers(0, n_classes, size=n)
    x = (centers[y] + rng.normal(0, 1.0, size=(n, n_features))).astype(dtype)
    cut = n * 9 // 10
    return ClassificationDataset(x[:cut], y[:cut], x[cut:], y[cut:], seed, "synthetic blobs", n_classes)
