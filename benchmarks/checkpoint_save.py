"""Saving a checkpoint at 1, 2 and 4 ranks: whole-file, sharded, sharded written in the
background; the time each save holds the training thread, the bytes each rank writes, and
what the disk itself allows.

    python benchmarks/checkpoint_save.py [--ranks 1,2,4] [--repeats 3] [--seq-len 64] [--rows 1]
                                         [--zero 0] [--save-at 4] [--saves 2] [--after 2]
                                         [--disk-mib 512] [--disk-rounds 3] [--dir DIR] [--json PATH]
    python benchmarks/checkpoint_save.py --quick     # a tiny GPT, 1 and 2 ranks, one repeat (tests)

Each run is `mpiexec -n R python benchmarks/checkpoint_save.py --child SPEC RESULT`, the
library's own training run (engine/train/run.py `run(Config, world)`) at GPT-2 124M's shape
(--preset gpt2-124m: 12 x 768, 12 heads, on random token ids below 50257, so the vocabulary
and the 124,475,904 parameters are GPT-2's), float32, AdamW, --rows sequences of --seq-len
tokens per rank, --zero 0 (every rank the whole model; a sharded save has each replica write
an equal share of it). A run saves --saves times on the way (--checkpoint-every --save-at:
after steps 4 and 8 by default) and once at its end, --after steps later (not measured: the
end's save is synchronous in every variant and first waits for a background one in flight).
Three variants, run by run in turn at each rank count (whole, sharded, async, whole, ...: a
drift of the machine falls on all three alike):

  whole    --checkpoint-format whole: the arrays gathered on the first rank, one .npz
  sharded  --checkpoint-format sharded (the default): every rank its own file, in parallel
  async    sharded + --checkpoint-async: the slices copied to host memory, a thread of each
           rank writes them while training goes on, committed at the first step all are done

Measured inside each rank (wrapping engine/train/saving.py, which already keeps the numbers):
  blocking  Saver.blocking_s of each save: its time on the training thread (the whole save
            for whole and sharded; for async the staging copy, the temp folder and the
            start), the slowest rank's (they leave a save together, after a broadcast).
            "first" is a run's first save, "later" the others; a later one's wait for the
            save before it, still being written (Saver.wait inside the save), is shown apart
            ("waited") and left out of "later" and "all".
  staging   async: the staging copy alone (Saver._stage: into the buffer kept for the run), the slowest rank's.
  write     the rank's own file write (saving._write; checkpoint.save on the first rank for
            whole), on the training thread or, for async, on the save's thread.
  bytes     each rank's files of the checkpoint (its rank_RRRRR.bin; the .npz and the
            manifest on the first rank), from the folder after the run; async: the bytes staged.
  steps     from metrics.jsonl: a step's wall time is the time from the record before it to
            its own (so a save after step S falls in step S+1): "no save" steps have none in
            them (step 1, which compiles, left out), "with save" is S+1, "write in flight"
            (async) the later steps that began before the commit. The steps' own step_ms
            (compute only: a background write slows it, a blocking save does not) is in the JSON.
  peak RSS  each rank's VmHWM after the run (the whole-file gather on the first rank, the
            staging copy on every rank).

The disk: --disk-mib MiB written with fsync into the runs' folder by 1, 2 and 4 processes at
once (an equal part each, 4 MiB writes of random bytes), --disk-rounds times per repeat before
its runs, writer counts in turn, after an os.sync() so that earlier writes are not timed; the
rate is the total over the wall time from the first start to the last fsync. A sharded save
can only fall with ranks as far as this rate rises.

Goals: the blocking part of an async save at most 5% of a synchronous whole-file save at 4
ranks; sharded write time falling with ranks where the disk allows. Every figure is a median
over the repeats (and saves) with its min-max; the machine is shared, so the times are noisy.
The run folders live under one temp folder this script makes (in --dir) and removes at the end.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import choice_list, int_list, median, output_path, positive_int, table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
GPT2_VOCAB = 50257
VARIANTS = ("whole", "sharded", "async")
VARIANT_FLAGS = {"whole": {"checkpoint_format": "whole"},
                 "sharded": {"checkpoint_format": "sharded"},
                 "async": {"checkpoint_format": "sharded", "checkpoint_async": True}}
QUICK_SHAPE = {"layers": 2, "d_model": 64, "heads": 2, "context": 64}
QUICK_VOCAB = 256
GOAL_ASYNC_FRACTION = 0.05
MiB = 2**20


# ---- the child: one training run, every rank timing its saves ---------------------------------

def child(spec: dict, result_path: str) -> None:
    from ringpipe.engine.job import runtime
    runtime.set_thread_defaults()            # as `ringpipe train` does (engine/train/cli.py)
    runtime.reuse_freed_memory()
    from mpi4py import MPI
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.train import memory, saving
    from ringpipe.engine.train.config import Config
    from ringpipe.engine.train.run import run

    world = MPI.COMM_WORLD
    savers, saves, commits, writes = [], [], [], []
    waited = {"s": 0.0, "inside": False, "staging_s": None, "staged_bytes": None}
    init, save, wait, commit_in_flight, write, whole_save, stage = (
        saving.Saver.__init__, saving.Saver.save, saving.Saver.wait, saving.Saver._commit_in_flight, saving._write,
        checkpoint.save, saving.Saver._stage)

    def init_kept(self, training):
        init(self, training)
        savers.append(self)

    def save_timed(self, step, meta, directory, keep, alone=False, background=False):
        t0 = time.time()
        waited.update(s=0.0, inside=True, staging_s=None, staged_bytes=None)
        try:
            return save(self, step, meta, directory, keep, alone=alone, background=background)
        finally:
            waited["inside"] = False
            saves.append({"step": step, "background": background, "alone": alone, "start": t0, "end": time.time(),
                          "waited_s": waited["s"], "staging_s": waited["staging_s"],
                          "staged_bytes": waited["staged_bytes"]})

    def wait_timed(self):
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            if waited["inside"]:
                waited["s"] += time.perf_counter() - t0

    def stage_timed(self, local):
        t0 = time.perf_counter()
        staged = stage(self, local)                   # the staging copy of an asynchronous save
        waited.update(staging_s=time.perf_counter() - t0, staged_bytes=sum(d.nbytes for _, _, d in staged))
        return staged

    def commit_timed(self):
        commits.append({"step": self.in_flight.step, "time": time.time()})
        return commit_in_flight(self)

    def write_timed(folder, rank, pieces, outcome, directory, step):
        t0 = time.perf_counter()
        try:
            return write(folder, rank, pieces, outcome, directory, step)
        finally:
            writes.append({"step": step, "write_s": time.perf_counter() - t0})

    def whole_timed(directory, step, *args, **kw):
        t0 = time.perf_counter()
        try:
            return whole_save(directory, step, *args, **kw)
        finally:
            writes.append({"step": step, "write_s": time.perf_counter() - t0})

    saving.Saver.__init__ = init_kept
    saving.Saver.save = save_timed
    saving.Saver.wait = wait_timed
    saving.Saver._stage = stage_timed
    saving.Saver._commit_in_flight = commit_timed
    saving._write = write_timed
    checkpoint.save = whole_timed

    cfg = Config(**spec["config"])
    result = run(cfg, world=world)
    saver = savers[-1]
    mine = {"rank": world.Get_rank(), "blocking_s": list(saver.blocking_s), "staged_bytes": saver.staged_bytes,
            "saves": saves, "commits": commits, "writes": writes, "peak_rss_bytes": memory.peak_rss()}
    every = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return
    with open(os.path.join(cfg.out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    out = {"steps_done": result.steps_done, "ranks": every, "files": {str(step): checkpoint_files(cfg.out, step) for step in spec["save_steps"]},
           "records": [{"step": r["step"], "time": r["time"], "step_ms": r["step_ms"]} for r in records
                       if "step_ms" in r]}
    with open(result_path, "w") as fh:
        json.dump(out, fh)


def checkpoint_files(out: str, step: int) -> list:
    """[{name, rank, bytes}] of checkpoint `step`'s files: a sharded folder's rank_RRRRR.bin
    are rank R's, the rest (manifest, .npz) the first rank's."""
    folder = os.path.join(out, "checkpoints")
    stem = f"ckpt_{step:08d}"
    files = []
    for name in sorted(os.listdir(folder)):
        if not name.startswith(stem):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            for part in sorted(os.listdir(path)):
                rank = int(part[5:10]) if part.startswith("rank_") else 0
                files.append({"name": f"{name}/{part}", "rank": rank,
                              "bytes": os.path.getsize(os.path.join(path, part))})
        else:
            files.append({"name": name, "rank": 0, "bytes": os.path.getsize(path)})
    return files


# ---- the parent: one run ----------------------------------------------------------------------

def run_child(spec: dict, ranks: int, timeout: float) -> dict:
    fd, result = tempfile.mkstemp(prefix="checkpoint-save-", suffix=".json", dir=spec["tmp"])
    os.close(fd)
    env = dict(os.environ, **{v: "1" for v in THREAD_VARS})
    os.sync()                               # the runs before: their writes are not this one's
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--child",
                               json.dumps(spec), result], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.getsize(result):
            raise SystemExit(f"checkpoint_save.py: the run at {ranks} rank(s) ({spec['variant']}) failed "
                             f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}")
        with open(result) as fh:
            out = json.load(fh)
    finally:
        os.unlink(result)
    out["wall_s"] = time.perf_counter() - t0
    return out


def summarise_run(out: dict, spec: dict, ranks: int) -> dict:
    """One run's figures: each periodic save's (steps save_at, 2 save_at, ...), and its steps."""
    saves = []
    for k, step in enumerate(spec["save_steps"]):
        blocking, waited, staging, writes, staged, commit = [], [], [], [], [], None
        for r in out["ranks"]:
            i = next(i for i, s in enumerate(r["saves"]) if s["step"] == step and not s["alone"])
            record = r["saves"][i]
            blocking.append(r["blocking_s"][i])
            waited.append(record["waited_s"])
            staging.append(record["staging_s"])
            staged.append(record["staged_bytes"])
            writes.append(sum(w["write_s"] for w in r["writes"] if w["step"] == step))
            if r["rank"] == 0:
                start = record["start"]
                commit = next((c["time"] for c in r["commits"] if c["step"] == step), None)
        per_rank = [0] * ranks
        for f in out["files"][str(step)]:
            per_rank[f["rank"]] += f["bytes"]
        # The slowest rank's own part (its wait for the save before, if any, left out).
        own = max(b - w for b, w in zip(blocking, waited))
        saves.append({"index": k + 1, "step": step, "blocking_s": max(blocking), "own_blocking_s": own,
                      "waited_s": max(waited), "blocking_s_ranks": blocking,
                      "staging_s": max(staging) if staging[0] is not None else None,
                      "write_s": max(writes), "write_s_ranks": writes, "bytes_ranks": per_rank,
                      "bytes_total": sum(per_rank),
                      "staged_bytes_ranks": staged if staged[0] is not None else None,
                      "start": start, "commit": commit,
                      "background_s": commit - start if commit is not None else None})
    # Steps: wall time from the record before to the step's own; step 1 (compiling) left out.
    recs = {r["step"]: r for r in out["records"]}
    clean, with_save, in_flight = [], [], []
    after_save = {s["step"] + 1: s for s in saves}
    for s in sorted(recs):
        if s < 2 or s - 1 not in recs:
            continue
        row = {"step": s, "wall_s": recs[s]["time"] - recs[s - 1]["time"], "step_s": recs[s]["step_ms"] / 1e3}
        if s in after_save:
            with_save.append(dict(row, save=after_save[s]["index"]))
        elif any(sv["commit"] is not None and s > sv["step"] + 1 and recs[s - 1]["time"] < sv["commit"]
                 for sv in saves):
            in_flight.append(row)
        else:
            clean.append(row)
    return {"saves": saves, "clean_steps": clean, "save_steps": with_save, "in_flight_steps": in_flight,
            "peak_rss_ranks": [r["peak_rss_bytes"] for r in out["ranks"]], "run_wall_s": out["wall_s"]}


# ---- the disk ----------------------------------------------------------------------------------

def _writer(path, nbytes, barrier, queue):
    import numpy as np
    block = np.random.default_rng(os.getpid()).integers(0, 256, size=4 * MiB, dtype=np.uint8).tobytes()
    barrier.wait()
    t0 = time.perf_counter()                # CLOCK_MONOTONIC: one clock for every process
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    queue.put((t0, time.perf_counter()))


def disk_rate(folder: str, total: int, writers: int) -> dict:
    """`total` bytes written with fsync by `writers` processes at once, an equal part each."""
    os.sync()                               # others' dirty pages written now, not inside the measurement
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(writers), ctx.Queue()
    part = total // writers
    paths = [os.path.join(folder, f"disk-{writers}-{i}.bin") for i in range(writers)]
    procs = [ctx.Process(target=_writer, args=(p, part, barrier, queue)) for p in paths]
    try:
        for p in procs:
            p.start()
        spans = [queue.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"writers": writers, "bytes": part * writers, "seconds": seconds, "mb_s": part * writers / seconds / 1e6}


# ---- the host ----------------------------------------------------------------------------------

def filesystem_of(path: str) -> str:
    real, best = os.path.realpath(path), ("?", "?", "")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                dev, mount, kind = line.split()[:3]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[2]):
                    best = (dev, kind, mount)
    except OSError:
        pass
    return f"{best[1]} on {best[0]} (mounted at {best[2] or '?'})"


def host_facts(folder: str, gemm: bool) -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "?")
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
        mem = f"{info['MemTotal'] / 2**30:.1f} GiB, {info['MemAvailable'] / 2**30:.1f} GiB available"
    except (OSError, KeyError, ValueError):
        pass
    import bf16_gemm
    facts = {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "load_1min": os.getloadavg()[0],
             "kernel": platform.release(), "filesystem": filesystem_of(folder), "blas": bf16_gemm.blas_info(),
             "gemm_gflops": None}
    if gemm:
        try:
            import vs_pytorch
            facts["gemm_gflops"] = vs_pytorch.host_gemm_rates([1])
        except Exception as e:             # torch or oneDNN missing: the rates are a note, not the measurement
            facts["gemm_gflops"] = {"error": f"{type(e).__name__}: {e}"}
    return facts


def print_host(facts: dict) -> None:
    print(f"# host: {facts['cpu']}, {facts['cores']} cores, {facts['memory']}, load {facts['load_1min']:.2f}, "
          f"Linux {facts['kernel']}")
    print(f"# folder: {facts['filesystem']}")
    print("# BLAS: " + ", ".join(f"{b.get('internal_api')} {b.get('version')} {b.get('architecture', '')} "
                                 f"({b.get('num_threads')} threads)" for b in facts["blas"]))
    rates = facts["gemm_gflops"]
    if rates and "error" not in rates:
        import vs_pytorch
        vs_pytorch.print_rates(rates)
    elif rates:
        print(f"# host GEMM rates: not measured ({rates['error']})")


# ---- the parent --------------------------------------------------------------------------------

def token_folder(folder: str, vocab: int) -> str:
    """nanoGPT's headerless uint16 train.bin/val.bin of random ids below `vocab`, the largest present
    (engine/data/shards.py infers the vocabulary from it)."""
    import numpy as np
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    for split, n in (("train", 1_000_000), ("val", 100_000)):
        ids = rng.integers(0, vocab, size=n)
        ids[0] = vocab - 1
        ids.astype(np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    return folder


def spread(xs) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_spread(s, scale=1.0, spec=".2f") -> str:
    if s is None:
        return "-"
    if s["n"] == 1:
        return format(s["median"] * scale, spec)
    return f"{s['median'] * scale:{spec}} ({s['min'] * scale:{spec}}-{s['max'] * scale:{spec}})"


def aggregate(runs: list, ranks: int, variant: str) -> dict:
    """A cell's medians over its runs; "first" is each run's first save, "later" the others."""
    mine = [r for r in runs if r["ranks"] == ranks and r["variant"] == variant]
    first = [r["saves"][0] for r in mine]
    later = [s for r in mine for s in r["saves"][1:]]
    every = first + later

    def steps(key, field):
        return spread([median([s[field] for s in r[key]]) for r in mine if r[key]])
    last = mine[-1]["saves"][0]
    return {"ranks": ranks, "variant": variant, "repeats": len(mine), "saves_per_run": len(mine[0]["saves"]),
            "blocking_first_s": spread([s["blocking_s"] for s in first]),
            "blocking_later_s": spread([s["own_blocking_s"] for s in later]),
            "waited_later_s": spread([s["waited_s"] for s in later]),
            "blocking_s": spread([s["own_blocking_s"] for s in every]),
            "staging_s": spread([s["staging_s"] for s in every]),
            "write_s": spread([s["write_s"] for s in every]),
            "background_s": spread([s["background_s"] for s in every]),
            "bytes_ranks": last["bytes_ranks"], "bytes_total": last["bytes_total"],
            "bytes_per_rank_max": max(last["bytes_ranks"]),
            "write_mb_s": spread([s["bytes_total"] / s["write_s"] / 1e6 for s in every if s["write_s"]]),
            "staged_bytes_max": max(last["staged_bytes_ranks"]) if last["staged_bytes_ranks"] else None,
            "peak_rss_max": max(max(r["peak_rss_ranks"]) for r in mine),
            "clean_step_wall_s": steps("clean_steps", "wall_s"), "clean_step_own_s": steps("clean_steps", "step_s"),
            "save_step_wall_s": steps("save_steps", "wall_s"), "save_step_own_s": steps("save_steps", "step_s"),
            "in_flight_wall_s": steps("in_flight_steps", "wall_s"),
            "in_flight_own_s": steps("in_flight_steps", "step_s"),
            "in_flight_steps": [len(r["in_flight_steps"]) for r in mine]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ranks", type=int_list(1), default=None, help="rank counts (default 1,2,4; --quick 1,2)")
    p.add_argument("--variants", type=choice_list(VARIANTS), default=list(VARIANTS),
                   help="whole,sharded,async (default all three, in this order)")
    p.add_argument("--repeats", type=positive_int, default=None, help="runs of each cell (default 3; --quick 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens a sequence (default 64; --quick 32)")
    p.add_argument("--rows", type=positive_int, default=1, help="sequences a rank per step (default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (default 0)")
    p.add_argument("--save-at", type=positive_int, default=None,
                   help="--checkpoint-every: steps before each save measured (default 4; --quick 2); at least 2")
    p.add_argument("--saves", type=positive_int, default=2, help="saves measured a run (default 2)")
    p.add_argument("--after", type=positive_int, default=2,
                   help="steps after the last of them before the run's end (default 2)")
    p.add_argument("--disk-mib", type=positive_int, default=None,
                   help="MiB each disk measurement writes in all (default 512; --quick 16)")
    p.add_argument("--disk-rounds", type=positive_int, default=None,
                   help="disk measurements of each writer count per repeat, in turn (default 3; --quick 1)")
    p.add_argument("--dir", default=None, help="where the temp folder goes: the disk measured (default: the "
                                               "system's temp folder)")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds a run may take (default 900)")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 1 and 2 ranks, one repeat: seconds")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    q = args.quick
    args.ranks = args.ranks or ([1, 2] if q else [1, 2, 4])
    args.repeats = args.repeats or (1 if q else 3)
    args.seq_len = args.seq_len or (32 if q else 64)
    args.save_at = args.save_at or (2 if q else 4)
    args.disk_mib = args.disk_mib or (16 if q else 512)
    args.disk_rounds = args.disk_rounds or (1 if q else 3)
    if max(args.ranks) > 8:
        p.error(f"--ranks {','.join(map(str, args.ranks))}: at most 8 ranks on one node")
    if args.save_at < 2:
        p.error(f"--save-at {args.save_at}: at least 2 (step 1 compiles, and a step before the save is measured)")
    if args.zero >= 2 and 1 in args.ranks:
        p.error(f"--zero {args.zero} shards over the data-parallel ranks: leave 1 out of --ranks, or use --zero 0 or 1")
    context = QUICK_SHAPE["context"] if q else 1024
    if args.seq_len > context:
        p.error(f"--seq-len {args.seq_len}: at most the model's context {context}")
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir!r} is not a folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(json.loads(args.child[0]), args.child[1])
        return 0
    root = tempfile.mkdtemp(prefix="ringpipe-checkpoint-save-", dir=args.dir)
    try:
        return measure(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)           # the folder this run made, and only it


def measure(args, root: str) -> int:
    shape = dict(QUICK_SHAPE) if args.quick else {"preset": "gpt2-124m"}
    vocab = QUICK_VOCAB if args.quick else GPT2_VOCAB
    data = token_folder(os.path.join(root, "data"), vocab)
    save_steps = [args.save_at * (k + 1) for k in range(args.saves)]
    steps = save_steps[-1] + args.after
    facts = host_facts(root, gemm=not args.quick)
    label = "tiny GPT 2 x 64 (--quick)" if args.quick else "GPT-2 124M (--preset gpt2-124m)"
    writer_counts = sorted({1, 2, 4} | set(args.ranks)) if not args.quick else [1, 2]
    print(f"checkpoint saving: {label}, vocab {vocab}, float32, AdamW, ZeRO {args.zero}, {args.rows} x "
          f"{args.seq_len} tokens a rank per step; {steps} steps a run, the saves after steps "
          f"{','.join(map(str, save_steps))} measured (and one at the end, not); ranks {','.join(map(str, args.ranks))}; "
          f"variants {','.join(args.variants)} in turn; {args.repeats} repeat(s); disk {args.disk_mib} MiB by "
          f"{'/'.join(map(str, writer_counts))} writers, {args.disk_rounds} round(s) a repeat", flush=True)
    print_host(facts)

    disk, runs = [], []
    for rep in range(args.repeats):
        for rnd in range(args.disk_rounds):
            for w in writer_counts:
                d = disk_rate(root, args.disk_mib * MiB, w)
                d["repeat"] = rep + 1
                disk.append(d)
            print(f"repeat {rep + 1}: disk MB/s at " + ", ".join(f"{d['writers']} writer(s) {d['mb_s']:.0f}"
                                                             for d in disk[-len(writer_counts):]), flush=True)
        for ranks in args.ranks:
            for variant in args.variants:
                out = os.path.join(root, f"r{ranks}-{variant}-{rep + 1}")
                config = dict(model="gpt", data=data, seq_len=args.seq_len, batch_size=args.rows * ranks,
                              steps=steps, zero=args.zero, out=out, overwrite=True, checkpoint_every=args.save_at,
                              keep=0, eval_every=steps, eval_batches=1, sample_tokens=0, quiet=True,
                              tensorboard=False, seed=1, **shape, **VARIANT_FLAGS[variant])
                spec = {"config": config, "variant": variant, "save_steps": save_steps, "tmp": root}
                res = summarise_run(run_child(spec, ranks, args.timeout), spec, ranks)
                res.update(repeat=rep + 1, ranks=ranks, variant=variant)
                runs.append(res)
                shutil.rmtree(out, ignore_errors=True)     # this run's folder: the disk stays as empty as it was
                parts = []
                for sv in res["saves"]:
                    part = f"blocking {sv['blocking_s']:.3f} s"
                    if sv["waited_s"] > 1e-3:
                        part += f" (waiting {sv['waited_s']:.3f})"
                    part += f", write {sv['write_s']:.2f} s"
                    if sv["background_s"] is not None:
                        part += f", committed after {sv['background_s']:.2f} s"
                    parts.append(part)
                print(f"repeat {rep + 1}: {ranks} rank(s) {variant:>7}: " + "; ".join(parts) +
                      f"; {res['saves'][0]['bytes_total'] / MiB:.1f} MiB a save (run {res['run_wall_s']:.0f} s)",
                      flush=True)

    disk_rows = []
    base = median([d["mb_s"] for d in disk if d["writers"] == 1])
    for w in writer_counts:
        sp = spread([d["mb_s"] for d in disk if d["writers"] == w])
        disk_rows.append({"writers": w, "mib": args.disk_mib, "mb_s": sp, "vs_1": sp["median"] / base})
    print(f"\nthe disk: {args.disk_mib} MiB written with fsync, split over N writers in parallel (median (min-max) of "
          f"{args.repeats * args.disk_rounds} measurement(s))")
    print(table([dict(r, rate=fmt_spread(r["mb_s"], spec=".0f")) for r in disk_rows],
                [("writers", "writers", "d"), ("mib", "MiB", "d"), ("rate", "MB/s", "s"),
                 ("vs_1", "vs 1 writer", ".2f")]))

    rows = [aggregate(runs, ranks, v) for ranks in args.ranks for v in args.variants]
    whole_at = {r["ranks"]: r for r in rows if r["variant"] == "whole"}
    for r in rows:
        w = whole_at.get(r["ranks"])
        r["vs_whole_first"] = r["blocking_first_s"]["median"] / w["blocking_first_s"]["median"] if w else None
        r["vs_whole"] = r["blocking_s"]["median"] / w["blocking_s"]["median"] if w else None
    print(f"\nsaves: median (min-max) over {args.repeats} run(s) x {args.saves} save(s). blocking: the save's time on "
          "the training thread (slowest rank); first: each run's first save; later: the others, less any wait for the "
          "save before (waited: that wait); all: every save, less the wait. write: the rank's file write (slowest "
          "rank; async: on its thread). steps: wall time record to record, the save's in the step after it")
    show = []
    for r in rows:
        show.append({"ranks": r["ranks"], "variant": r["variant"],
                     "first": fmt_spread(r["blocking_first_s"], 1, ".3f"),
                     "later": fmt_spread(r["blocking_later_s"], 1, ".3f"),
                     "waited": fmt_spread(r["waited_later_s"], 1, ".2f"),
                     "vs_whole": r["vs_whole"], "staging": fmt_spread(r["staging_s"], 1, ".3f"),
                     "write": fmt_spread(r["write_s"], 1, ".2f"),
                     "rate": fmt_spread(r["write_mb_s"], spec=".0f"), "per_rank": r["bytes_per_rank_max"] / MiB,
                     "total": r["bytes_total"] / MiB,
                     "staged": r["staged_bytes_max"] / MiB if r["staged_bytes_max"] is not None else None,
                     "clean": fmt_spread(r["clean_step_wall_s"], 1e3, ".0f"),
                     "save_step": fmt_spread(r["save_step_wall_s"], 1e3, ".0f"),
                     "in_flight": fmt_spread(r["in_flight_wall_s"], 1e3, ".0f"),
                     "rss": r["peak_rss_max"] / 2**30})
    print(table(show, [("ranks", "ranks", "d"), ("variant", "variant", "s"), ("first", "blocking s, first", "s"),
                       ("later", "blocking s, later", "s"), ("waited", "waited s", "s"),
                       ("vs_whole", "all / whole", ".3f"), ("staging", "staging s", "s"), ("write", "write s", "s"),
                       ("rate", "write MB/s", "s"), ("per_rank", "MiB/rank", ".1f"), ("total", "MiB total", ".1f"),
                       ("staged", "staged MiB/rank", ".1f"), ("clean", "step ms, no save", "s"),
                       ("save_step", "step ms with save", "s"), ("in_flight", "step ms, write in flight", "s"),
                       ("rss", "peak RSS GiB", ".2f")]))

    # Goals.
    top = max(args.ranks)
    verdicts = {}
    a, w = (next((r for r in rows if r["ranks"] == top and r["variant"] == v), None) for v in ("async", "whole"))
    print()
    if a and w:
        verdicts["async_over_whole"] = {"ranks": top, "goal": GOAL_ASYNC_FRACTION}
        for key, what in (("blocking_s", "every save"), ("blocking_first_s", "first saves"),
                          ("blocking_later_s", "later saves")):
            if a[key] is None or w[key] is None:
                continue
            frac = a[key]["median"] / w[key]["median"]
            verdicts["async_over_whole"][key] = {"fraction": frac, "pass": frac <= GOAL_ASYNC_FRACTION}
            print(f"goal: async blocking <= {GOAL_ASYNC_FRACTION:.0%} of a whole-file save at {top} ranks, {what}: "
                  f"{a[key]['median']:.3f} s / {w[key]['median']:.3f} s = {frac:.2%}: "
                  f"{'PASS' if frac <= GOAL_ASYNC_FRACTION else 'FAIL'}")
    sharded = {r["ranks"]: r for r in rows if r["variant"] == "sharded"}
    disk_by = {d["writers"]: d for d in disk_rows}
    if 1 in sharded and len(sharded) > 1:
        one = sharded[1]["blocking_s"]["median"]
        scaling = []
        for n, r in sorted(sharded.items()):
            scaling.append({"ranks": n, "blocking_s": r["blocking_s"]["median"],
                            "speedup": one / r["blocking_s"]["median"],
                            "disk_allows": disk_by[n]["vs_1"] if n in disk_by else None})
        verdicts["sharded_scaling"] = scaling
        print("sharded save against ranks (its time at 1 rank / at N; beside it the disk's rate at N writers / 1): " +
              "; ".join(f"{x['ranks']}: {x['speedup']:.2f}x" +
                        (f" (disk {x['disk_allows']:.2f}x)" if x["disk_allows"] else "") for x in scaling))
    if args.json:
        write_json(args.json, {"benchmark": "checkpoint_save", "quick": args.quick, "model": label, "vocab": vocab,
                               "shape": shape, "zero": args.zero, "rows": args.rows, "seq_len": args.seq_len,
                               "steps": steps, "save_steps": save_steps, "ranks": args.ranks,
                               "variants": args.variants, "repeats": args.repeats, "host": facts,
                               "disk": {"mib": args.disk_mib, "rounds": args.disk_rounds, "runs": disk,
                                        "rows": disk_rows},
                               "summary": rows, "goals": verdicts, "runs": runs})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
