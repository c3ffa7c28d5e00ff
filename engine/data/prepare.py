"""`ringpipe prepare`: the command line (flags, the summary, exit codes) of the job in
engine/data/prepare_job.py, and the names its callers import from here.

    ringpipe prepare corpus/ --out data/mine --tokenizer bpe:8192
    mpiexec -n 8 ringpipe prepare web/*.parquet --out data/web --tokenizer path/to/tokenizer.json
    ringpipe train --data data/mine

Where each part lives (each module says more):
    prepare_job.py   prepare(): the steps, each ending with every rank agreeing on its outcome;
                     the tokenizer (bytes, a file, or bpe:VOCAB trained on the inputs)
    readers.py       the input files, their cheap checks, their documents read in pieces
    parts.py         a file's tokens into a part; the parts into shards; data.json's contents
    outfolder.py     --out held by rank 0: its lock, its checks, the parts folder
    swap.py          the old dataset replaced whole, by renames and a journal
    stdlib_cache.py  the stdlib corpus prepared once into a cache
    errors.py        PrepareError
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from ringpipe.engine.data import shards
from ringpipe.engine.data.errors import PrepareError
from ringpipe.engine.data.outfolder import LOCK_NAME, PARTS_PREFIX
from ringpipe.engine.data.parts import MAX_SHARDS_PER_SPLIT, build_manifest, tokenize_source
from ringpipe.engine.data.prepare_job import (DEFAULT_BPE_TRAIN_MB, DEFAULT_TOKENS_PER_SHARD, DEFAULT_VAL_EVERY,
                                              MAX_BPE_TRAIN_MB, MIN_BPE_TRAIN_MB, MIN_TOKENS_PER_SHARD, OneProcess,
                                              prepare)
from ringpipe.engine.data.readers import SUPPORTED, Source, check_source, list_sources, read_documents, read_pieces
from ringpipe.engine.data.stdlib_cache import cache_root, prepare_stdlib
from ringpipe.engine.data.swap import PREVIOUS_NAME

# The names callers import from this module (tests, benchmarks, engine/train/assemble.py).
__all__ = ["DEFAULT_BPE_TRAIN_MB", "DEFAULT_TOKENS_PER_SHARD", "DEFAULT_VAL_EVERY", "LOCK_NAME", "PARTS_PREFIX",
           "PREVIOUS_NAME", "SUPPORTED", "OneProcess", "PrepareError", "Source", "build_manifest", "build_parser",
           "cache_root", "check_source", "list_sources", "main", "prepare", "prepare_stdlib", "read_documents",
           "read_pieces", "summary", "tokenize_source"]


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
                        "trained on the input, e.g. bpe:8192; VOCAB up to 2^20), or a Hugging Face tokenizer.json "
                        "(or its folder)")
    p.add_argument("--field", default="text", help="the JSON field / parquet column holding the text (default text)")
    p.add_argument("--val-every", type=int, default=DEFAULT_VAL_EVERY, metavar="N",
                   help="a document goes to validation when crc32(its file and index) %% N == 0 (default 10: about "
                        "1 in 10; N from 2 to 100); if that leaves validation under 1%% of the tokens (few "
                        "documents), the last 10%% of the tokens are validation instead")
    p.add_argument("--tokens-per-shard", type=int, default=DEFAULT_TOKENS_PER_SHARD, metavar="N",
                   help=f"tokens per shard file (default 100000000, llm.c's; from {MIN_TOKENS_PER_SHARD} to 2^31-1, "
                        f"and at most {MAX_SHARDS_PER_SPLIT:,} shards a split)")
    p.add_argument("--bpe-train-mb", type=float, default=DEFAULT_BPE_TRAIN_MB, metavar="MB", action=_Given,
                   help=f"bpe:VOCAB trains on at most this many MB of the text (default {DEFAULT_BPE_TRAIN_MB}; from "
                        f"{MIN_BPE_TRAIN_MB} to {MAX_BPE_TRAIN_MB}): the head of each file, its share in proportion "
                        "to its size; data.json records how much")
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
