"""The stdlib corpus (engine/data/datasets.py's), prepared once into a cache folder of
token shards that every later run reuses (`--data stdlib`)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from ringpipe.cache import cache_root
from ringpipe.engine.data import shards
from ringpipe.engine.data import tokenizer as tokenizers_
from ringpipe.engine.data.errors import PrepareError
from ringpipe.engine.data.parts import build_manifest

STDLIB_CACHE_VERSION = 1          # raise when what the cached folder holds changes


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
