"""The parameter server's modes that change the math against sync: their loss gap at equal
steps, and their tokens/s, in one run (issue 27's "the staleness modes' loss gap against sync
at equal steps").

    python benchmarks/ps_staleness.py [--workers 4] [--servers 1] [--steps 120] [--seeds 2]
        [--modes sync,ssp:1,ssp:2,ssp:4,async] [--json PATH] [--plot PATH]

Each (seed, mode) is one training run, `mpiexec -n WORKERS+SERVERS ringpipe train --sync ps
--ps-servers SERVERS --ps-mode MODE --seed SEED ...` on the stdlib text corpus (a small GPT,
AdamW, the default warmup + cosine schedule and clipping), into a fresh temp folder this
benchmark made and removes. For each seed the modes run in an order rotated from the seed
before, so a drift of the shared machine's speed hits them alike.

Per mode, over the seeds: the training loss at equal steps (the mean of the last 10 steps'
losses), the validation loss after the last step, each as a gap against sync's run of the
same seed (mode - sync, nats; > 0: worse), and the median tokens/s of the steps after the
first 5 (ratio to sync). sync is the all-reduce's math exactly; ssp:S computes each step on
parameters S updates old (deterministic: the same seed gives the same gap); async's gap
varies from run to run with the arrival order (its range over the seeds says how much).
The time of a run on one shared 2-core machine says little about a cluster: ssp's point
there is hiding the pull's latency behind the next steps' compute, which a CPU-bound run
with local links cannot show; the loss gap is what this measures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import output_path, positive_int, table, write_json  # noqa: E402

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
RINGPIPE = os.path.join(os.path.dirname(sys.executable), "ringpipe")
MODEL = ["--data", "stdlib", "--layers", "2", "--d-model", "64", "--heads", "4", "--context", "64",
         "--batch-size", "16", "--optimizer", "adamw", "--eval-batches", "4", "--sample-tokens", "0",
         "--monitor-every", "0", "--no-tensorboard", "--quiet"]
TAIL = 10                 # the training loss at equal steps: the mean over the last TAIL steps
WARM = 5                  # steps left out of tokens/s (the first compiles, the window fills)


def one_run(args, mode: str, seed: int, where: str) -> dict:
    out = os.path.join(where, f"{mode.replace(':', '')}-{seed}")
    cmd = [MPIEXEC, "-n", str(args.workers + args.servers), RINGPIPE, "train", *MODEL, "--steps",
           str(args.steps), "--eval-every", str(args.steps), "--seed", str(seed), "--sync", "ps",
           "--ps-servers", str(args.servers), "--ps-mode", mode, "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: the {mode} run (seed {seed}) failed with exit code {done.returncode}:\n"
                 f"{' '.join(cmd)}\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    steps = [r for r in records if "loss" in r and "step" in r]
    return {"mode": mode, "seed": seed, "wall_s": time.perf_counter() - t0,
            "losses": [r["loss"] for r in steps],
            "train_loss": statistics.fmean(r["loss"] for r in steps[-TAIL:]),
            "val_loss": steps[-1].get("val_loss"),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps[WARM:]),
            "labelled": all(r.get("ps_mode") == mode for r in steps) if mode not in ("sync", "ssp:0")
            else all("ps_mode" not in r for r in steps)}


def summarise(runs: list, modes: list) -> list:
    sync = {r["seed"]: r for r in runs if r["mode"] == "sync"}
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        gaps = [r["train_loss"] - sync[r["seed"]]["train_loss"] for r in mine]
        val_gaps = [r["val_loss"] - sync[r["seed"]]["val_loss"] for r in mine]
        speed = [r["tokens_per_s"] / sync[r["seed"]]["tokens_per_s"] for r in mine]
        rows.append({"mode": mode, "train_loss": statistics.fmean(r["train_loss"] for r in mine),
                     "gap": statistics.fmean(gaps), "gap_lo": min(gaps), "gap_hi": max(gaps),
                     "val_loss": statistics.fmean(r["val_loss"] for r in mine),
                     "val_gap": statistics.fmean(val_gaps),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                     "vs_sync": statistics.median(speed), "labelled": all(r["labelled"] for r in mine)})
    return rows


def plot(runs: list, modes: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in modes:
        curves = [r["losses"] for r in runs if r["mode"] == mode]
        mean = [statistics.fmean(c[i] for c in curves) for i in range(min(map(len, curves)))]
        window = 5                      # a moving mean: the per-step losses are one batch each
        smooth = [statistics.fmean(mean[max(0, i - window + 1):i + 1]) for i in range(len(mean))]
        ax.plot(range(1, len(smooth) + 1), smooth, label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean over seeds, {window}-step moving mean)")
    ax.set_title("parameter-server modes at equal steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=positive_int, default=4, help="workers (data-parallel ranks; default 4)")
    p.add_argument("--servers", type=positive_int, default=1, help="dedicated server ranks (default 1)")
    p.add_argument("--steps", type=positive_int, default=120, help="steps per run (default 120)")
    p.add_argument("--seeds", type=positive_int, default=2, help="seeds per mode (default 2)")
    p.add_argument("--modes", default="sync,ssp:1,ssp:2,ssp:4,async",
                   help="comma-separated --ps-mode values; sync is always run (the baseline)")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--plot", type=output_path, default=None, help="write the loss curves here (PNG)")
    args = p.parse_args(argv)
    modes = ["sync"] + [m for m in args.modes.split(",") if m and m != "sync"]
    print(f"# ps_staleness: {args.workers} workers + {args.servers} server(s), {args.steps} steps, seeds "
          f"{', '.join(str(1337 + i) for i in range(args.seeds))}; modes {', '.join(modes)}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    where = tempfile.mkdtemp(prefix="ringpipe-ps-staleness-")
    runs = []
    try:
        for i in range(args.seeds):
            seed = 1337 + i
            order = modes[i % len(modes):] + modes[:i % len(modes)]      # rotated each seed
            for mode in order:
                runs.append(one_run(args, mode, seed, where))
                r = runs[-1]
                print(f"#   seed {seed} {mode:>7}: loss(last {TAIL}) {r['train_loss']:.4f}  val {r['val_loss']:.4f}  "
                      f"{r['tokens_per_s']:.0f} tok/s  ({r['wall_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    rows = summarise(runs, modes)
    print(table(rows, [("mode", "mode", ""), ("train_loss", f"loss (last {TAIL})", ".4f"),
                       ("gap", "gap vs sync", "+.4f"), ("gap_lo", "[min", "+.4f"), ("gap_hi", "max]", "+.4f"),
                       ("val_loss", "val loss", ".4f"), ("val_gap", "val gap", "+.4f"),
                       ("tokens_per_s", "tokens/s", ".0f"), ("vs_sync", "vs sync", ".2f"),
                       ("labelled", "labelled", "")]))
    print("# gap: the mode's loss minus sync's at the same steps and seed (nats; > 0: worse); [min max] over "
          "the seeds. vs sync: tokens/s ratio (median over seeds). labelled: every metrics record names the "
          "mode (sync: none)")
    if args.json:
        write_json(args.json, {"benchmark": "ps_staleness", "workers": args.workers, "servers": args.servers,
                               "steps": args.steps, "model": MODEL, "rows": rows,
                               "runs": [{k: v for k, v in r.items()} for r in runs]})
        print(f"# wrote {args.json}")
    if args.plot:
        try:
            plot(runs, modes, args.plot)
            print(f"# wrote {args.plot}")
        except ImportError:
            print("# no plot: matplotlib is not installed (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
