"""Data-parallel scaling of a training step: 1, 2, 4 ranks, weak and strong.

    python benchmarks/scaling.py [--ranks 1,2,4] [--json scaling.json]

Launches `mpiexec -n N python -m ringpipe.train --dp N` for each N and reads each
run's metrics.jsonl: median tokens/s after warm-up steps, and the fraction of
all-reduce time hidden behind backward (GradBuckets' own accounting).
  weak scaling:   per-rank batch fixed (global batch = N x --per-rank-batch);
                  efficiency = tokens/s(N) / (N x tokens/s(1))
  strong scaling: global batch fixed (--global-batch);
                  efficiency = tokens/s(N) / (N x tokens/s(1))
Every rank gets the same --threads-per-rank (default 1), so a 1-rank run is the
per-rank baseline rather than one process using the whole machine. Ranks x
threads beyond the machine's cores share cores, so efficiency there measures
oversubscription, not the engine: the table says how many cores there were.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np


from _common import int_list, nonneg_int, output_path, positive_float, positive_int  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec") or "mpiexec"


def run(n, global_batch, args, out):
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "ringpipe.train", "--dp", str(n),
           "--layers", str(args.layers), "--d-model", str(args.d_model), "--heads", str(args.heads),
           "--context", str(args.seq_len), "--batch-size", str(global_batch), "--steps", str(args.steps),
           "--bucket-mb", str(args.bucket_mb), "--eval-every", str(10 ** 9), "--eval-batches", "1",
           "--sample-tokens", "0", "--quiet", "--overwrite", "--out", out, "--data", "stdlib"]
    env = dict(os.environ)
    threads = str(args.threads_per_rank)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env[var] = threads
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=1800)
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh][args.warmup:]
    hidden = [r["comm_hidden_frac"] for r in records if r.get("comm_hidden_frac") is not None]
    return {"ranks": n, "global_batch": global_batch,
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in records])),
            "step_ms": float(np.median([r["step_ms"] for r in records])),
            "comm_hidden_frac": float(np.median(hidden)) if hidden else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int_list(1), default="1,2,4", help="comma list of rank counts (default 1,2,4)")
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--d-model", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--per-rank-batch", type=positive_int, default=8, help="weak scaling: sequences per rank")
    ap.add_argument("--global-batch", type=positive_int, default=16,
                    help="strong scaling: sequences per step; must divide by every --ranks count")
    ap.add_argument("--steps", type=positive_int, default=12)
    ap.add_argument("--warmup", type=nonneg_int, default=3, help="steps dropped before taking medians (< --steps)")
    ap.add_argument("--bucket-mb", type=positive_float, default=1.0)
    ap.add_argument("--threads-per-rank", type=positive_int, default=1,
                    help="BLAS/Numba threads of every rank (default 1)")
    ap.add_argument("--json", type=output_path, default=None)
    args = ap.parse_args(argv)
    ranks = args.ranks
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be less than --steps ({args.steps}): "
                 "the medians use the steps after the warm-up")
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")
    odd = [n for n in ranks if args.global_batch % n]
    if odd:
        lcm = math.lcm(*ranks)
        fits = -(-args.global_batch // lcm) * lcm      # smallest multiple of every count >= --global-batch
        ap.error(f"--global-batch {args.global_batch} does not divide by rank count(s) "
                 f"{','.join(map(str, odd))} of --ranks {','.join(map(str, ranks))}: strong scaling splits "
                 f"it evenly; use e.g. --global-batch {fits}, or drop those counts")
    tmp = tempfile.mkdtemp(prefix="ringpipe-scaling-")
    rows = []
    try:
        for mode in ("weak", "strong"):
            for n in ranks:
                gb = n * args.per_rank_batch if mode == "weak" else args.global_batch
                row = run(n, gb, args, os.path.join(tmp, f"{mode}{n}"))
                row["mode"] = mode
                rows.append(row)
                print(f"{mode:<7}{n:>3} ranks: {row['tokens_per_s']:9.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n# data-parallel scaling on {os.cpu_count()} cores, {args.threads_per_rank} thread(s) per rank "
          f"(GPT {args.layers}x{args.d_model}, seq {args.seq_len}); medians over steps after {args.warmup} warm-up")
    print(f"{'mode':<8}{'ranks':>6}{'batch':>7}{'tok/s':>10}{'speedup':>9}{'efficiency':>12}{'comm hidden':>13}")
    for mode in ("weak", "strong"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        base = mine[0]["tokens_per_s"] / mine[0]["ranks"]
        for r in mine:
            r["speedup"] = r["tokens_per_s"] / mine[0]["tokens_per_s"]
            r["efficiency"] = r["tokens_per_s"] / (base * r["ranks"])
            hidden = "-" if r["comm_hidden_frac"] is None else f"{r['comm_hidden_frac']:.0%}"
            print(f"{mode:<8}{r['ranks']:>6}{r['global_batch']:>7}{r['tokens_per_s']:>10.0f}"
                  f"{r['speedup']:>9.2f}{r['efficiency']:>12.1%}{hidden:>13}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cores": os.cpu_count(), "config": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
