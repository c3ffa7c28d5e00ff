"""The token-data path: `ringpipe prepare` throughput, the loader's memory, and batch fetch vs a training step.

    python benchmarks/data_pipeline.py [--prepare-mb 32] [--corpus-tokens 512M] [--json PATH] [--keep]
    python benchmarks/data_pipeline.py --quick          # tiny sizes, seconds (what the tests run)

Measures, in one run:
  1. prepare: `mpiexec -n N python -m ringpipe prepare TEXT --tokenizer T` on a generated
     corpus (the interpreter's stdlib .py sources copied into --prepare-mb MiB of .txt files,
     one document each), for N in --ranks and T = bytes and a BPE trained once beforehand on
     the first --bpe-train-mb MiB (prepare then loads its tokenizer.json, so the row measures
     tokenizing, not training). tokens/s two ways: by the wall clock of the whole command
     (interpreter and MPI start-up included: what a user waits) and as prepare itself reports
     it (its summary line: from after MPI start-up to the manifest); the speedup of N ranks
     over 1. Medians of --repeats runs, interleaved.
  2. the loader's memory: a corpus of --corpus-tokens uint16 tokens (random ids of the bytes
     vocabulary) written with engine.data.shards.ShardWriter into shards of --tokens-per-shard,
     with the data.json prepare would write, in a temp folder under --tmp-dir. A fresh
     interpreter opens it with shards.open_dataset and fetches --batches batches (batch x
     seq-len) of the train split at random steps; the growth of its VmRSS (before opening ->
     the most seen after, and VmHWM) as a fraction of the corpus's size on disk. Twice: with
     the shards evicted from the page cache (posix_fadvise DONTNEED: read from disk) and with
     them in it (the kernel's fault-around then maps neighbouring cached pages too).
     Goal: < 10% in both.
  3. batch fetch vs a training step: the median time of dataset.batch(step, B) in those
     fresh interpreters (cold and warm page cache), and of the wait in Prefetcher.get(step)
     while a small GPT (--layers x --d-model, vocab 256) trains on the same shape in this
     process; each as a fraction of the median training step (forward + backward + AdamW).
     Goal: < 2%.
Nothing here asserts a time; ratios are against the same run's training step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

# The environment as given, before set_thread_defaults adds to it: what the subprocesses get.
_GIVEN_ENV = dict(os.environ)

from ringpipe.engine.job import runtime  # noqa: E402

runtime.set_thread_defaults()       # as ringpipe train does, before numpy loads BLAS
runtime.reuse_freed_memory()

import numpy as np  # noqa: E402

from _common import (choice_list, int_list, median, nonneg_int, output_path, positive_float,  # noqa: E402
                     positive_int, size_arg, table, write_json)
from ringpipe.engine.data import shards  # noqa: E402
from ringpipe.engine.data import tokenizer as tokenizers_  # noqa: E402
from ringpipe.engine.data.datasets import looks_like_text, stdlib_files  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_GOAL = 0.10       # RSS growth / corpus bytes on disk
FETCH_GOAL = 0.02        # batch fetch time / training step time
VAL_FRACTION = 0.01      # of the synthetic corpus
GEN_CHUNK = 16 << 20     # tokens generated and written at a time (32 MiB of uint16)
MiB = 2**20

QUICK = dict(prepare_mb=0.25, repeats=1, bpe_vocab=300, bpe_train_mb=0.1, corpus_tokens=2 << 20,
             tokens_per_shard=600_000, batches=20, batch_size=4, seq_len=128, layers=1, d_model=64, heads=2,
             steps=2, warmup=1)


# ---- argparse types -------------------------------------------------------------------------

def bpe_vocab(text: str) -> int:
    value = positive_int(text)
    if value <= 257:
        raise argparse.ArgumentTypeError(f"must be > 257 (the 256 bytes and <|endoftext|>, then merges), got {value}")
    return value


def token_count(text: str) -> int:
    """A number of tokens, with an optional K/M/G (binary) suffix: 512M = 536,870,912."""
    value = size_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return value


def shard_tokens(text: str) -> int:
    value = token_count(text)
    if value > shards.MAX_SHARD_TOKENS:
        raise argparse.ArgumentTypeError(f"a shard holds at most 2^31 - 1 tokens, got {value}")
    return value


def writable_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (seconds): " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                    + "; flags given explicitly still win")
    g = ap.add_argument_group("1. prepare throughput")
    g.add_argument("--prepare-mb", type=positive_float, default=32.0,
                   help="MiB of text to generate from the stdlib sources (default 32)")
    g.add_argument("--ranks", type=int_list(1), default=[1, 2], help="rank counts, must include 1 (default 1,2)")
    g.add_argument("--tokenizers", type=choice_list(["bytes", "bpe"]), default=["bytes", "bpe"],
                   help="comma list of bytes,bpe (default both)")
    g.add_argument("--bpe-vocab", type=bpe_vocab, default=8192, help="BPE vocabulary (default 8192)")
    g.add_argument("--bpe-train-mb", type=positive_float, default=4.0,
                   help="MiB of the corpus the BPE is trained on, once (default 4)")
    g.add_argument("--repeats", type=positive_int, default=3, help="prepare runs per row, median (default 3)")
    g = ap.add_argument_group("2. loader memory")
    g.add_argument("--corpus-tokens", type=token_count, default=512 * MiB,
                   help="tokens of the synthetic corpus, K/M/G binary (default 512M = 536,870,912: 1 GiB of uint16)")
    g.add_argument("--tokens-per-shard", type=shard_tokens, default=100_000_000,
                   help="tokens per shard (default 100000000, prepare's)")
    g.add_argument("--batches", type=positive_int, default=200, help="batches fetched per fresh process (default 200)")
    g.add_argument("--tmp-dir", type=writable_dir, default=tempfile.gettempdir(),
                   help=f"where the corpus's temp folder goes (default {tempfile.gettempdir()})")
    g.add_argument("--keep", action="store_true", help="keep the temp folder (its path is printed)")
    g = ap.add_argument_group("3. batch fetch vs a training step")
    g.add_argument("--batch-size", type=positive_int, default=8)
    g.add_argument("--seq-len", type=positive_int, default=1024)
    g.add_argument("--layers", type=positive_int, default=2, help="of the GPT timed (default 2)")
    g.add_argument("--d-model", type=positive_int, default=256)
    g.add_argument("--heads", type=positive_int, default=4)
    g.add_argument("--steps", type=positive_int, default=5, help="timed training steps (default 5)")
    g.add_argument("--warmup", type=nonneg_int, default=1, help="training steps before timing (default 1)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--json", type=output_path, default=None, help="write every figure here")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--quick", action="store_true")
    known, _ = pre.parse_known_args(argv)
    if known.quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    if 1 not in args.ranks:
        ap.error(f"--ranks {','.join(map(str, args.ranks))}: include 1, the baseline of the speedup")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    least = 4 * (args.seq_len + 2)
    if args.corpus_tokens < least:
        ap.error(f"--corpus-tokens {args.corpus_tokens} is too few for --seq-len {args.seq_len}: give at least "
                 f"{least}")
    need = 2 * args.corpus_tokens + int(args.prepare_mb * MiB) * 6 + 64 * MiB
    free = shutil.disk_usage(args.tmp_dir).free
    if free < need:
        ap.error(f"--tmp-dir {args.tmp_dir} has {free / MiB:.0f} MiB free, this run writes about {need / MiB:.0f} "
                 "MiB: give a smaller --corpus-tokens / --prepare-mb or another --tmp-dir")
    return args


# ---- helpers ----------------------------------------------------------------------------------

def child_env(**extra):
    """The environment as given, without an outer MPI launcher's variables (a child
    mpiexec would try to join that job)."""
    env = {k: v for k, v in _GIVEN_ENV.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_CVAR_"))}
    env.update(extra)
    return env


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


def evict(paths) -> bool:
    """Drop the files' pages from the page cache (they are clean: ShardWriter fsyncs)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def warm(paths) -> None:
    """Read the files through, so the page cache holds them."""
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(16 * MiB):
                pass


class MachineShare:
    """How busy the rest of the machine was: CPU seconds that all processes used (/proc/stat)
    minus this run's own (this process and its waited-for children), over the run."""

    def __init__(self):
        self.t0, self.busy0, self.mine0 = time.perf_counter(), self._busy(), self._mine()

    @staticmethod
    def _busy():
        try:
            with open("/proc/stat") as fh:
                ticks = [int(v) for v in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")     # all but idle and iowait

    @staticmethod
    def _mine():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def result(self):
        wall = time.perf_counter() - self.t0
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return {"wall_s": wall, "other_cpu_s": None, "other_share": None}
        others = max(0.0, busy - self.busy0 - (self._mine() - self.mine0))
        return {"wall_s": wall, "other_cpu_s": others, "other_share": others / (wall * (os.cpu_count() or 1))}


# ---- 1. prepare -------------------------------------------------------------------------------

def make_text_corpus(folder: str, total_bytes: int) -> tuple[list[str], int]:
    """The stdlib's .py files (UTF-8, non-empty) copied as .txt files until total_bytes;
    passes over the stdlib are repeated (p1/, p2/, ...) when it holds less."""
    root, files = stdlib_files()
    written, paths, n_pass = 0, [], 0
    while written < total_bytes:
        useful = 0
        for src in files:
            try:
                with open(src, "rb") as fh:
                    raw = fh.read()
            except OSError:
                continue
            if not raw or not looks_like_text(raw[:8192]):
                continue
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            dst = os.path.join(folder, f"p{n_pass}", os.path.relpath(src, root)[:-3] + ".txt")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as fh:
                fh.write(raw)
            paths.append(dst)
            written += len(raw)
            useful += 1
            if written >= total_bytes:
                break
        if not useful:
            raise RuntimeError(f"no UTF-8 .py file under {root} to build the text corpus from")
        n_pass += 1
    return paths, written


def train_bpe_once(paths, limit_bytes, vocab_size, folder):
    def texts():
        seen = 0
        for p in paths:
            if seen >= limit_bytes:
                return
            with open(p, encoding="utf-8") as fh:
                text = fh.read()
            seen += len(text)
            yield text
    t = time.perf_counter()
    tok = tokenizers_.train_bpe(texts(), vocab_size)
    seconds = time.perf_counter() - t
    return tok.save(folder), tok, seconds


_RATE = re.compile(r"([0-9.]+)M tokens/s over ([0-9.]+) s")


def run_prepare(text_dir, out, spec, ranks):
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "ringpipe", "prepare", text_dir, "--out", out,
           "--tokenizer", spec]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    with open(os.path.join(out, shards.MANIFEST_NAME)) as fh:
        m = json.load(fh)
    tokens = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    found = _RATE.search(r.stdout)
    own_rate = float(found.group(1)) * 1e6 if found else None
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "tokens": tokens, "own_tokens_per_s": own_rate}


def bench_prepare(args, tmp):
    text_dir = os.path.join(tmp, "text")
    paths, n_bytes = make_text_corpus(text_dir, int(args.prepare_mb * MiB))
    specs, bpe = [], None
    for name in args.tokenizers:
        if name == "bytes":
            specs.append(("bytes", "bytes"))
        else:
            path, tok, seconds = train_bpe_once(paths, args.bpe_train_mb * MiB, args.bpe_vocab,
                                                os.path.join(tmp, "bpe"))
            bpe = {"vocab_size": tok.vocab_size, "trained_on_bytes": int(args.bpe_train_mb * MiB),
                   "train_s": seconds, "tokenizer": path}
            specs.append((f"bpe:{tok.vocab_size}", path))
    runs = {(label, n): [] for label, _ in specs for n in args.ranks}
    for rep in range(args.repeats):                # interleaved: machine noise hits every row alike
        for label, spec in specs:
            for n in args.ranks:
                out = os.path.join(tmp, f"prepared-{rep}-{n}-{label.replace(':', '')}")
                runs[(label, n)].append(run_prepare(text_dir, out, spec, n))
    rows = []
    cores = os.cpu_count() or 1
    for label, _ in specs:
        for n in args.ranks:
            rs = runs[(label, n)]
            wall = median([r["wall_s"] for r in rs])
            own = [r["own_tokens_per_s"] for r in rs if r["own_tokens_per_s"] is not None]
            threads = _GIVEN_ENV.get("RAYON_NUM_THREADS") or str(max(1, cores // n))
            rows.append({"tokenizer": label, "ranks": n, "files": len(paths), "text_bytes": n_bytes,
                         "tokens": rs[0]["tokens"], "wall_s": wall, "tokens_per_s": rs[0]["tokens"] / wall,
                         "own_tokens_per_s": median(own) if own else None,
                         "tokenizer_threads_per_rank": int(threads) if label != "bytes" else 1,
                         "runs_wall_s": [r["wall_s"] for r in rs]})
    for row in rows:
        base = next(r for r in rows if r["tokenizer"] == row["tokenizer"] and r["ranks"] == 1)
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["own_speedup"] = (row["own_tokens_per_s"] / base["own_tokens_per_s"]
                              if row["own_tokens_per_s"] and base["own_tokens_per_s"] else None)
    shutil.rmtree(text_dir, ignore_errors=True)
    return {"files": len(paths), "text_bytes": n_bytes, "bpe": bpe, "rows": rows}


# ---- 2. the loader's memory ----------------------------------------------------------------

def write_corpus(folder, n_tokens, tokens_per_shard, seed, seq_len):
    """Random byte-vocabulary tokens as uint16 shards (generated GEN_CHUNK at a time) and
    the data.json prepare would write for them (open_dataset reads it)."""
    from ringpipe.engine.data import prepare
    tok = tokenizers_.bytes_tokenizer()
    n_val = max(seq_len + 2, int(n_tokens * VAL_FRACTION))
    sizes = {"train": n_tokens - n_val, "val": n_val}
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    splits = {}
    for split, total in sizes.items():
        files, left = [], total
        while left > 0:
            name = f"{split}_{len(files):06d}.bin"
            count = min(tokens_per_shard, left)
            with shards.ShardWriter(os.path.join(folder, name), tok.vocab_size) as writer:
                done = 0
                while done < count:
                    n = min(GEN_CHUNK, count - done)
                    writer.write(rng.integers(0, tok.vocab_size, size=n, dtype=np.uint16))
                    done += n
            files.append(name)
            left -= count
        splits[split] = {"shards": files, "tokens": total, "bytes": total, "documents": 1}
    split = {"method": "tail", "val_fraction": VAL_FRACTION,
             "why": "a synthetic corpus of random tokens written by benchmarks/data_pipeline.py"}
    manifest = prepare.build_manifest(tok, split, splits, [], [], tokens_per_shard,
                                      "benchmarks/data_pipeline.py (synthetic corpus)")
    tok.save(folder)
    shards.write_manifest(folder, manifest)
    paths = [os.path.join(folder, f) for s in shards.SPLITS for f in splits[s]["shards"]]
    return paths, sum(os.path.getsize(p) for p in paths)


# Runs in a fresh interpreter: only the loader is imported before the first reading.
_LOADER_PROBE = r"""
import json, sys, time
import numpy as np
from ringpipe.engine.data import shards, tokenizer

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out

data_dir, seq_len, batch_size, n_batches, seed = sys.argv[1], *map(int, sys.argv[2:])
before = status()
ds = shards.open_dataset(data_dir, seq_len, seed)
opened = status()
steps = np.random.default_rng(seed).integers(0, 2**40, size=n_batches)
peak, times = dict(opened), []
for step in steps:
    t = time.perf_counter()
    x, y = ds.batch(int(step), batch_size, 0, batch_size)
    times.append(time.perf_counter() - t)
    now = status()
    if now["VmRSS"] > peak["VmRSS"]:
        peak = now
    assert x.shape == (batch_size, seq_len) and y.shape == (batch_size, seq_len)
end = status()
print(json.dumps({"before": before, "opened": opened, "peak": peak, "end": end, "batch_s": times,
                  "train_tokens": len(ds.splits["train"])}))
"""


def probe_loader(data_dir, args):
    cmd = [sys.executable, "-c", _LOADER_PROBE, data_dir, str(args.seq_len), str(args.batch_size),
           str(args.batches), str(args.seed)]
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"the loader probe failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def memory_row(cache, probe, corpus_bytes):
    before = probe["before"]["VmRSS"]
    growth = probe["peak"]["VmRSS"] - before
    hwm_growth = probe["end"]["VmHWM"] - before        # catches a transient peak between two samples
    worst = max(growth, hwm_growth)
    return {"cache": cache, "rss_before": before, "rss_opened": probe["opened"]["VmRSS"],
            "rss_peak": probe["peak"]["VmRSS"], "hwm_end": probe["end"]["VmHWM"],
            "rss_file_peak": probe["peak"].get("RssFile"), "rss_anon_peak": probe["peak"].get("RssAnon"),
            "file_growth_bytes": probe["peak"]["RssFile"] - probe["before"]["RssFile"],
            "anon_growth_bytes": probe["peak"]["RssAnon"] - probe["before"]["RssAnon"],
            "growth_bytes": growth, "hwm_growth_bytes": hwm_growth, "growth_frac": worst / corpus_bytes,
            "pass": worst / corpus_bytes < MEMORY_GOAL, "batch_s": probe["batch_s"]}


# ---- 3. a training step and the prefetcher's wait -------------------------------------------

def bench_training(args, data_dir, shard_paths):
    from ringpipe.engine.model.gpt import GPTConfig, build_gpt
    from ringpipe.engine.model.optim import AdamW
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, context=args.seq_len, vocab=256)
    model = build_gpt(cfg, dtype=np.float32)
    opt = AdamW(model.params.size, np.float32, np, wd_mask=model.params.decay_mask())
    scale = 1.0 / (args.batch_size * args.seq_len)
    ds = shards.open_dataset(data_dir, args.seq_len, args.seed)
    evict(shard_paths)                    # the prefetcher reads from disk, as a first epoch would
    first = int(np.random.default_rng(args.seed + 1).integers(0, 2**40))
    waits, steps = [], []
    with shards.Prefetcher(ds, args.batch_size, 0, args.batch_size) as batches:
        for i in range(args.warmup + args.steps):
            t = time.perf_counter()
            x, y = batches.get(first + i)    # step first + i + 1 starts loading now, behind this step
            t1 = time.perf_counter()
            model.params.zero_grad()
            model.loss_and_grad(x, y, scale)
            opt.step(model.params.data, model.params.grad, 1e-4)
            t2 = time.perf_counter()
            if i >= args.warmup:
                waits.append(t1 - t)
                steps.append(t2 - t1)
    return {"config": cfg.to_dict(), "params": int(model.params.size), "step_s": median(steps),
            "steps_s": steps, "prefetch_wait_s": median(waits), "prefetch_waits_s": waits}


# ---- the run -----------------------------------------------------------------------------------

PREPARE_COLUMNS = [("tokenizer", "tokenizer", "s"), ("ranks", "ranks", "d"), ("threads", "tok threads", "d"),
                   ("mib", "text MiB", ".1f"), ("mtokens", "Mtokens", ".2f"), ("wall_s", "wall s", ".2f"),
                   ("wall_rate", "Mtok/s wall", ".3f"), ("speedup", "speedup", ".2f"),
                   ("own_rate", "Mtok/s own", ".2f"), ("own_speedup", "speedup own", ".2f")]
MEMORY_COLUMNS = [("cache", "page cache", "s"), ("before", "RSS before MiB", ".1f"),
                  ("opened", "after open MiB", ".1f"), ("peak", "peak MiB", ".1f"), ("growth", "growth MiB", ".1f"),
                  ("hwm", "HWM growth MiB", ".1f"), ("file", "file-backed MiB", ".1f"), ("anon", "anon MiB", ".1f"),
                  ("frac", "growth / corpus", ".2%"), ("verdict", "goal < 10%", "s")]
FETCH_COLUMNS = [("what", "what", "s"), ("ms", "median ms", ".3f"), ("frac", "of a step", ".3%"),
                 ("verdict", "goal < 2%", "s")]


def main(argv=None):
    args = parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="ringpipe-data-pipeline-", dir=args.tmp_dir)
    shard_paths = []
    share = MachineShare()
    result = {"machine": {"cores": os.cpu_count(), "kernel": platform.release(),
                          "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                          "rayon_threads": _GIVEN_ENV.get("RAYON_NUM_THREADS")},
              "config": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        # 1. prepare
        t = time.perf_counter()
        sections = {"prepare": MachineShare()}
        prep = bench_prepare(args, tmp)
        sections["prepare"] = sections["prepare"].result()
        result["prepare"] = prep
        print(f"# 1. ringpipe prepare: {prep['files']} .txt files from the stdlib sources, "
              f"{prep['text_bytes'] / MiB:.1f} MiB; medians of {args.repeats} run(s); "
              f"{os.cpu_count()} cores ({time.perf_counter() - t:.0f} s)")
        if prep["bpe"]:
            b = prep["bpe"]
            print(f"# BPE of {b['vocab_size']} tokens trained once on {b['trained_on_bytes'] / MiB:.1f} MiB in "
                  f"{b['train_s']:.1f} s, then loaded by prepare from its tokenizer.json")
        print("# wall: the whole mpiexec command (start-up included); own: prepare's own summary line; "
              "tok threads: the HF tokenizer's threads per rank (RAYON_NUM_THREADS = cores / ranks)")
        print(table([{"tokenizer": r["tokenizer"], "ranks": r["ranks"], "threads": r["tokenizer_threads_per_rank"],
                      "mib": r["text_bytes"] / MiB, "mtokens": r["tokens"] / 1e6, "wall_s": r["wall_s"],
                      "wall_rate": r["tokens_per_s"] / 1e6, "speedup": r["speedup"],
                      "own_rate": r["own_tokens_per_s"] / 1e6 if r["own_tokens_per_s"] else None,
                      "own_speedup": r["own_speedup"]} for r in prep["rows"]], PREPARE_COLUMNS), flush=True)

        # 2. the loader's memory, cache warm and cold
        t = time.perf_counter()
        sections["memory"] = MachineShare()
        data_dir = os.path.join(tmp, "corpus")
        shard_paths, corpus_bytes = write_corpus(data_dir, args.corpus_tokens, args.tokens_per_shard, args.seed,
                                                 args.seq_len)
        write_s = time.perf_counter() - t
        warm(shard_paths)
        probes = {"warm": probe_loader(data_dir, args)}
        evicted = evict(shard_paths)
        probes["cold" if evicted else "warm (no posix_fadvise)"] = probe_loader(data_dir, args)
        sections["memory"] = sections["memory"].result()
        rows = [memory_row(cache, p, corpus_bytes) for cache, p in probes.items()]
        worst = max(r["growth_frac"] for r in rows)
        result["memory"] = {"corpus_tokens": args.corpus_tokens, "train_tokens": probes["warm"]["train_tokens"],
                            "shards": len(shard_paths), "corpus_bytes": corpus_bytes, "write_s": write_s,
                            "batches": args.batches, "batch_size": args.batch_size, "seq_len": args.seq_len,
                            "rows": rows, "worst_growth_frac": worst, "goal_frac": MEMORY_GOAL,
                            "pass": worst < MEMORY_GOAL}
        print(f"\n# 2. the loader's resident memory (Linux {platform.release()}): {args.corpus_tokens:,} uint16 tokens "
              f"in {len(shard_paths)} shards "
              f"({corpus_bytes / MiB:.0f} MiB on disk, written in {write_s:.0f} s); a fresh interpreter opens it and "
              f"fetches {args.batches} batches of {args.batch_size} x {args.seq_len} at random steps")
        print(table([{"cache": r["cache"], "before": r["rss_before"] / MiB, "opened": r["rss_opened"] / MiB,
                      "peak": r["rss_peak"] / MiB, "file": r["file_growth_bytes"] / MiB,
                      "anon": r["anon_growth_bytes"] / MiB, "growth": r["growth_bytes"] / MiB,
                      "hwm": r["hwm_growth_bytes"] / MiB,
                      "frac": r["growth_frac"], "verdict": "PASS" if r["pass"] else "FAIL"} for r in rows],
                    MEMORY_COLUMNS))
        print("# growth: VmRSS, peak - before; file-backed / anon: RssFile / RssAnon growth (file-backed pages are the "
              "shards' page cache mapped into the process: shared, clean, reclaimable)")
        print(f"memory: worst growth {worst:.2%} of the corpus: {'PASS' if worst < MEMORY_GOAL else 'FAIL'} "
              f"(goal < {MEMORY_GOAL:.0%})", flush=True)

        # 3. batch fetch vs a training step
        sections["fetch"] = MachineShare()
        train = bench_training(args, data_dir, shard_paths)
        sections["fetch"] = sections["fetch"].result()
        step = train["step_s"]
        fetch = [(f"dataset.batch, page cache {r['cache']}", median(r["batch_s"])) for r in rows]
        fetch.append(("Prefetcher.get wait (during training)", train["prefetch_wait_s"]))
        fetch_rows = [{"what": what, "median_s": s, "frac_of_step": s / step, "pass": s / step < FETCH_GOAL}
                      for what, s in fetch]
        result["fetch"] = {"step_s": step, "model": train, "rows": fetch_rows, "goal_frac": FETCH_GOAL,
                           "pass": all(r["pass"] for r in fetch_rows)}
        c = train["config"]
        print(f"\n# 3. batch fetch vs one training step: GPT {c['n_layer']} x {c['d_model']} ({c['n_head']} heads, "
              f"vocab {c['vocab']}, {train['params']:,} params), batch {args.batch_size} x {args.seq_len}, "
              f"float32, BLAS threads {os.environ.get('OPENBLAS_NUM_THREADS')}; step median of {args.steps} "
              f"after {args.warmup} warm-up: {step * 1e3:.1f} ms")
        print(table([{"what": r["what"], "ms": r["median_s"] * 1e3, "frac": r["frac_of_step"],
                      "verdict": "PASS" if r["pass"] else "FAIL"} for r in fetch_rows]
                    + [{"what": "training step (forward + backward + AdamW)", "ms": step * 1e3, "frac": 1.0}],
                    FETCH_COLUMNS))
        print(f"fetch: {'PASS' if result['fetch']['pass'] else 'FAIL'} (goal: every fetch < {FETCH_GOAL:.0%} "
              "of a step)", flush=True)
        busy = share.result()
        result["machine"].update(busy, sections=sections)
        if busy["other_share"] is not None:
            parts = ", ".join(f"{name} {v['other_share']:.0%}" for name, v in sections.items())
            print(f"\n# other processes used {busy['other_share']:.0%} of the machine's CPU time during this run's "
                  f"{busy['wall_s']:.0f} s ({parts})")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            if shard_paths and os.path.isdir(os.path.join(tmp, "corpus")):
                evict(shard_paths)           # hand the page cache back before the files go
            shutil.rmtree(tmp, ignore_errors=True)
    result["temp_folder"] = tmp if args.keep else None
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
