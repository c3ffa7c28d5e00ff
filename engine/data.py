"""Data: the stdlib corpus (bytes), Fashion-MNIST (IDX), and synthetic sets for tests.

Every dataset answers `batch(step, batch_size, lo, hi, split)`: rows lo:hi of
global batch number `step`. The global batch depends only on (seed, step,
split), never on how many ranks there are, so 1 rank and N data-parallel
ranks see exactly the same examples: parallelism never changes the math.
"""
from __future__ import annotations

import gzip
import os
import struct
import sysconfig
import zlib

import numpy as np

_SPLIT_IDS = {"train": 0, "val": 1}


def _rng(seed, step, split):
    return np.random.default_rng([seed, step, _SPLIT_IDS[split]])


class TokenDataset:
    """Byte-level tokens; a training example is a window of seq_len bytes and the
    same window shifted by one as targets."""

    kind = "tokens"

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int, seed: int, name: str):
        for split, arr in (("train", train), ("val", val)):
            if len(arr) < seq_len + 2:
                raise ValueError(f"{name}: the {split} split has {len(arr)} tokens, fewer than "
                                 f"--seq-len {seq_len} + 2; use a shorter --seq-len or more data")
        self.splits = {"train": train, "val": val}
        self.seq_len, self.seed, self.name = seq_len, seed, name

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
        fit on the training set: the bar a language model must clear to have learned anything."""
        counts = np.bincount(self.splits["train"], minlength=256).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.splits["val"]].mean())


class ClassificationDataset:
    kind = "features"

    def __init__(self, x_train, y_train, x_val, y_val, seed, name, n_classes):
        self.splits = {"train": (x_train, y_train), "val": (x_val, y_val)}
        self.seed, self.name, self.n_classes = seed, name, n_classes
        self.n_features = x_train.shape[1]

    def batch(self, step, batch_size, lo=0, hi=None, split="train"):
        hi = batch_size if hi is None else hi
        x, y = self.splits[split]
        idx = _rng(self.seed, step, split).integers(0, len(x), size=batch_size)[lo:hi]
        return x[idx], y[idx].astype(np.int64)


# ---- the stdlib corpus ----------------------------------------------------------------

def stdlib_files(root=None, extensions=(".py",)):
    """Sorted source files of the running interpreter's standard library (no site-packages),
    or of any folder `root`."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(extensions):
                found.append(os.path.join(dirpath, f))
    return root, found


def load_stdlib_corpus(seq_len, seed, max_bytes=64 << 20, val_every=10, root=None, extensions=(".py",),
                       name=None):
    """Concatenate stdlib sources; each file goes to validation when crc32(path) % val_every == 0,
    so the split is deterministic and a file never straddles train and val."""
    root, files = stdlib_files(root, extensions)
    if not files:
        if name:
            raise FileNotFoundError(f"no {'/'.join(extensions)} files under {root}")
        raise FileNotFoundError(f"no .py files under {root}: the stdlib corpus needs the Python "
                                "standard library sources (some minimal images strip them); "
                                "use --data synthetic, or --data text --data-path FOLDER")
    train, val, total = [], [], 0
    for path in files:
        rel = os.path.relpath(path, root)
        with open(path, "rb") as fh:
            data = fh.read()
        (val if zlib.crc32(rel.encode()) % val_every == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not val or not train:
        # Too few files for a per-file split: hold out the last tenth of the bytes instead.
        data = b"\n".join(train + val)
        cut = len(data) * 9 // 10
        train, val = [data[:cut]], [data[cut:]]
    as_tokens = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    return TokenDataset(as_tokens(train), as_tokens(val), seq_len, seed, name or f"stdlib ({root})")


def load_text_folder(path, seq_len, seed, val_every=10):
    """Same as the stdlib corpus, for any folder of .py/.txt/.md files (or one file)."""
    if os.path.isfile(path):
        data = open(path, "rb").read()
        cut = len(data) * 9 // 10
        return TokenDataset(np.frombuffer(data[:cut], np.uint8), np.frombuffer(data[cut:], np.uint8),
                            seq_len, seed, path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--data-path {path!r} does not exist")
    return load_stdlib_corpus(seq_len, seed, val_every=val_every, root=path,
                              extensions=(".py", ".txt", ".md", ".rst"), name=f"text ({path})")


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
