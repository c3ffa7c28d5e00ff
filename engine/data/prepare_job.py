"""`ringpipe prepare`'s job, `prepare()`: text in, token shards and a manifest out (the format
is engine/data/shards.py's), the ranks sharing the files. Its parts: readers.py (the
inputs), parts.py (tokens into parts, parts into shards), outfolder.py (the lock),
swap.py (the old dataset replaced whole); prepare.py is its command line.

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
     (outfolder.py)
  4. the tokenizer: bytes, a tokenizer.json, or bpe:VOCAB trained by rank 0 on the text
     (at most --bpe-train-mb MB of it, sampled from every file)
  5. every rank tokenizes its share, a part file per input file
  6. rank 0 joins the parts in file order into the new dataset's shards, tokenizer.json and
     data.json in PARTS/dataset/, then swaps it in (swap.py; renames only): a journal of the names
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

import errno
import os
import shlex
import sys
import time

from ringpipe.engine.data import shards
from ringpipe.engine.data import tokenizer as tokenizers_
from ringpipe.engine.data.errors import PrepareError
from ringpipe.engine.data.outfolder import OutFolder, write_error
from ringpipe.engine.data.parts import build_manifest, join_parts, part_paths, tokenize_source
from ringpipe.engine.data.readers import check_source, cut_at, list_sources, read_pieces

DEFAULT_TOKENS_PER_SHARD = 100_000_000        # llm.c's fineweb shards
DEFAULT_VAL_EVERY = 10
DEFAULT_BPE_TRAIN_MB = 1024        # how much text bpe:VOCAB trains on at most (--bpe-train-mb)

# The range of each numeric setting (check_settings says why, with the refusal).
# --val-every: 1 in N documents goes to validation, and the split by document is kept only
# when validation holds at least 1% of the tokens (parts.py), so past 100 it never is.
MIN_VAL_EVERY, MAX_VAL_EVERY = 2, 100
# --tokens-per-shard: training opens and maps every shard, so shards are few and large
# (parts.MAX_SHARDS_PER_SPLIT bounds their number once the token count is known); the
# floor only keeps out a file per token. Tests cut tiny datasets into ~100-token shards.
MIN_TOKENS_PER_SHARD = 64
# --bpe-train-mb: under 10 KB a BPE learns next to nothing; 100 GB of text is far past what
# a vocabulary needs (a few GB) and would take the one training rank days.
MIN_BPE_TRAIN_MB, MAX_BPE_TRAIN_MB = 0.01, 100_000
# bpe:VOCAB: the largest vocabularies in use hold ~256k tokens (Gemma's); the trainer keeps a
# count for every candidate pair, so a vocabulary of billions (ids allow 2^32) never finishes.
MAX_BPE_VOCAB = 1 << 20


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


# ---- progress -------------------------------------------------------------------------------

class Progress:
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
        for text, _ in read_pieces(source, field, cut_at):
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

def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_settings(tokenizer: str, val_every, tokens_per_shard, bpe_train_mb, bpe_budget_given: bool) -> None:
    """Every setting in its range (the bounds above), before any work: a PrepareError
    naming the flag, its range and what to pass instead."""
    if not _whole(val_every) or not MIN_VAL_EVERY <= val_every <= MAX_VAL_EVERY:
        raise PrepareError(f"--val-every {val_every}: must be a whole number from {MIN_VAL_EVERY} to {MAX_VAL_EVERY} "
                           "(1 in N documents goes to validation; past 100 validation would hold under 1% of the "
                           "tokens, and prepare would take the last 10% instead); pass e.g. --val-every "
                           f"{DEFAULT_VAL_EVERY}, the default")
    if not _whole(tokens_per_shard) or not MIN_TOKENS_PER_SHARD <= tokens_per_shard <= shards.MAX_SHARD_TOKENS:
        raise PrepareError(f"--tokens-per-shard {tokens_per_shard}: must be a whole number from "
                           f"{MIN_TOKENS_PER_SHARD} to 2^31-1 (a shard's header counts its tokens in an int32); "
                           "training opens and maps every shard, so keep them few and large: pass e.g. "
                           f"{DEFAULT_TOKENS_PER_SHARD}, the default (llm.c's)")
    if bpe_budget_given and not tokenizer.startswith("bpe:"):
        # A setting without effect is refused, never silently ignored.
        raise PrepareError(f"--bpe-train-mb applies only to --tokenizer bpe:VOCAB (which trains a tokenizer); "
                           f"with --tokenizer {tokenizer} nothing is trained: drop --bpe-train-mb")
    if tokenizer.startswith("bpe:"):
        if tokenizers_.parse_vocab_spec(tokenizer) > MAX_BPE_VOCAB:
            raise PrepareError(f"--tokenizer {tokenizer}: a BPE trained here holds at most {MAX_BPE_VOCAB:,} tokens "
                               "(the largest vocabularies in use hold about 256,000; training billions would not "
                               "finish); use e.g. bpe:8192, or bpe:50257 as GPT-2")
        if (not isinstance(bpe_train_mb, (int, float)) or isinstance(bpe_train_mb, bool)
                or not MIN_BPE_TRAIN_MB <= bpe_train_mb <= MAX_BPE_TRAIN_MB):
            raise PrepareError(f"--bpe-train-mb {bpe_train_mb}: must be a number of MB from {MIN_BPE_TRAIN_MB} to "
                               f"{MAX_BPE_TRAIN_MB:,} (how much of the text bpe:VOCAB trains on at most; a "
                               f"vocabulary is learned from a few GB); pass e.g. {DEFAULT_BPE_TRAIN_MB}, the default")
    elif tokenizer != "bytes":
        tokenizers_.load_tokenizer(tokenizer)       # parse it now: a bad file is refused before any work


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

    _on_every_rank(world, lambda: check_settings(tokenizer, val_every, tokens_per_shard, bpe_train_mb,
                                                 bpe_budget_given), "settings")
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
    folder = OutFolder(out, overwrite) if rank == 0 else None
    try:
        notes = _on_rank0(world, folder.open if folder else None, "out folder")
        parts_dir = _on_rank0(world, lambda: folder.parts_dir, "parts folder")
        if rank == 0 and progress:
            for note in notes:
                print(f"note: {note}", file=sys.stderr, flush=True)
        tok = _make_tokenizer(world, tokenizer, sources, field, parts_dir, progress, bpe_train_mb)

        def tokenize_mine():
            bar = Progress(sum(sources[i].size for i in mine),
                            "tokenizing" if size == 1 else f"tokenizing (rank 0's {len(mine)} of {len(sources)} "
                            "files)", progress and rank == 0)
            try:
                for i in mine:
                    try:
                        tokenize_source(sources[i], i, tok, field, val_every, parts_dir, bar)
                    except OSError as e:
                        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                            raise
                        raise write_error(e, out, e.filename or part_paths(parts_dir, i)[0]) from None
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
                raise write_error(e, out) from None
            return manifest

        manifest = _on_rank0(world, write_dataset, "writing the shards")
    finally:
        if folder is not None:
            folder.close()
    return manifest


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
            bar = Progress(min(total, budget), f"training BPE ({vocab_size} tokens) on at most {bpe_train_mb:g} MB "
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
