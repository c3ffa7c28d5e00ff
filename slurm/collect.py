#!/usr/bin/env python3
"""Scaling results: make one point from a run, merge a sweep into a table and a plot.

    python slurm/collect.py point --metrics RUN/metrics.jsonl --warmup 5 --out R/train-strong-n4.json \\
        --kind train --mode strong --ranks 4 [--nodes 1 --batch-size 32 ...] [-- trainer args]
    python slurm/collect.py merge R [--no-plot]

point: throughput of one run = the median over the steps after --warmup of the
per-step tokens/s (examples/s for the MLP) in metrics.jsonl, plus the median
step time. Called by slurm/scaling.sbatch.

merge: reads R/train-*.json and R/allreduce-n*.json (benchmarks/allreduce.py
--json output) and writes
  R/scaling.md, R/scaling.json, R/scaling.png       training, strong and/or weak
  R/allreduce.md, R/allreduce.json, R/allreduce.png  bus bandwidth per size and rank count
and prints the markdown. Speedup and efficiency are relative to the smallest
rank count of each mode: ideal throughput = thr_ref * ranks / ranks_ref (for
weak scaling this is "constant step time", as the work grows with the ranks),
efficiency = measured / ideal. The PNGs need matplotlib (imported only here);
without it the tables and JSON are still written and the command fails with a
message saying so (or pass --no-plot).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time


# ---------------------------------------------------------------------------- point

def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl records; a resumed run may repeat steps: the last record of a step wins."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue            # a torn last line from a killed run
            if "step" in rec:
                by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def point(args) -> dict:
    recs = read_metrics(args.metrics)
    timed = [r for r in recs if r["step"] > args.warmup]
    if not timed:
        raise SystemExit(f"collect.py: {args.metrics} has {len(recs)} steps, none after --warmup {args.warmup}: "
                         "run more --steps or lower --warmup")
    metric = "tokens_per_s" if "tokens_per_s" in timed[0] else "examples_per_s"
    thr = [r[metric] for r in timed]
    env = os.environ
    res = {
        "kind": args.kind, "mode": args.mode, "ranks": args.ranks, "nodes": args.nodes,
        "batch_size": args.batch_size, "metric": metric,
        "throughput": statistics.median(thr),
        "throughput_min": min(thr), "throughput_max": max(thr),
        "step_ms": statistics.median(r["step_ms"] for r in timed),
        "steps": len(recs), "warmup": args.warmup, "timed_steps": len(timed),
        "final_loss": recs[-1].get("loss"),
        "mpi_plugin": args.mpi_plugin, "mpi_library": args.mpi_library,
        "job_id": env.get("SLURM_JOB_ID"), "node_list": env.get("SLURM_JOB_NODELIST"),
        "cpus_per_task": env.get("SLURM_CPUS_PER_TASK"), "tasks_per_node": env.get("SLURM_TASKS_PER_NODE"),
        "args": args.extra, "metrics": os.path.abspath(args.metrics),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write_json(args.out, res)
    print(f"collect.py: {args.ranks} ranks ({args.mode}): median {res['throughput']:.1f} {metric} over "
          f"{len(timed)} steps, {res['step_ms']:.1f} ms/step -> {args.out}")
    return res


# ---------------------------------------------------------------------------- merge

def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _load(pattern: str) -> list[dict]:
    out = []
    for p in sorted(glob.glob(pattern)):
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            print(f"collect.py: skipping {p}: {e}", file=sys.stderr)
            continue
        d["_file"] = os.path.basename(p)
        out.append(d)
    return out


def train_table(points: list[dict]) -> tuple[list[dict], str]:
    """Rows with speedup/ideal/efficiency per mode; and the markdown table."""
    rows = []
    for mode in ("strong", "weak"):
        pts = sorted((p for p in points if p.get("mode") == mode), key=lambda p: p["ranks"])
        if not pts:
            continue
        ref = pts[0]
        for p in pts:
            ideal = ref["throughput"] * p["ranks"] / ref["ranks"]
            rows.append({"mode": mode, "ranks": p["ranks"], "nodes": p.get("nodes"),
                         "batch_size": p.get("batch_size"), "metric": p.get("metric", "tokens_per_s"),
                         "throughput": p["throughput"], "step_ms": p.get("step_ms"),
                         "speedup": p["throughput"] / ref["throughput"], "ideal": ideal,
                         "efficiency": p["throughput"] / ideal, "ref_ranks": ref["ranks"],
                         "job_id": p.get("job_id")})
    unit = rows[0]["metric"].replace("_per_s", "/s") if rows else "tokens/s"
    md = [f"| mode | ranks | nodes | global batch | {unit} | step ms | speedup | ideal {unit} | efficiency |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['mode']} | {r['ranks']} | {r['nodes'] or '-'} | {r['batch_size'] or '-'} | "
                  f"{r['throughput']:.1f} | {r['step_ms']:.1f} | {r['speedup']:.2f} | {r['ideal']:.1f} | "
                  f"{100 * r['efficiency']:.0f}% |")
    return rows, "\n".join(md)


def allreduce_table(results: list[dict]) -> tuple[list[dict], str]:
    """One row per (message size, algorithm): busbw at each rank count."""
    results = sorted(results, key=lambda d: d["ranks"])
    ranks = [d["ranks"] for d in results]
    algos: list[str] = []
    cells: dict = {}
    for d in results:
        for r in d.get("rows", []):
            if r["algo"] not in algos:
                algos.append(r["algo"])
            cells.setdefault((r["size"], r["algo"]), {})[d["ranks"]] = r["busbw"]
    rows = [{"size": s, "algo": a, "busbw": {str(p): v for p, v in cells[(s, a)].items()}}
            for s, a in sorted(cells, key=lambda k: (k[0], algos.index(k[1])))]
    md = ["| size | algo | " + " | ".join(f"busbw GB/s, {p} ranks" for p in ranks) + " |",
          "|---:|---|" + "---:|" * len(ranks)]
    for r in rows:
        md.append(f"| {_fmt_size(r['size'])} | {r['algo']} | "
                  + " | ".join(f"{r['busbw'][str(p)]:.3f}" if str(p) in r["busbw"] else "-" for p in ranks) + " |")
    avg = ["", "**average**"]
    for a in algos:
        line = [f"| avg | {a} |"]
        for p in ranks:
            v = [r["busbw"][str(p)] for r in rows if r["algo"] == a and str(p) in r["busbw"]]
            line.append(f" {statistics.mean(v):.3f} |" if v else " - |")
        avg.append("".join(line))
    return rows, "\n".join(md + avg[2:])


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_train(rows: list[dict], path: str, plt) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, color in (("strong", "tab:blue"), ("weak", "tab:orange")):
        rs = [r for r in rows if r["mode"] == mode]
        if not rs:
            continue
        x = [r["ranks"] for r in rs]
        ax1.plot(x, [r["throughput"] for r in rs], "o-", color=color, label=f"{mode}: measured")
        ax1.plot(x, [r["ideal"] for r in rs], "--", color=color, alpha=0.6, label=f"{mode}: ideal")
        ax2.plot(x, [100 * r["efficiency"] for r in rs], "o-", color=color, label=mode)
    ax2.axhline(100, color="gray", ls="--", lw=1, label="ideal")
    unit = rows[0]["metric"].replace("_per_s", "/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("MPI ranks")
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    ax1.set_ylabel(unit)
    ax1.set_title("training throughput")
    ax2.set_ylabel("parallel efficiency (%)")
    ax2.set_ylim(0, max(110, max(100 * r["efficiency"] for r in rows) * 1.1))
    ax2.set_title("efficiency vs the smallest run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_allreduce(rows: list[dict], results: list[dict], path: str, plt) -> None:
    ranks = sorted(d["ranks"] for d in results)
    algos = []
    for r in rows:
        if r["algo"] not in algos:
            algos.append(r["algo"])
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    cmap = plt.get_cmap("viridis")
    for i, p in enumerate(ranks):
        for j, a in enumerate(algos):
            # One rank count: a colour per algorithm; several: a colour per rank count.
            color = plt.get_cmap("tab10")(j) if len(ranks) == 1 else cmap(i / max(1, len(ranks) - 1))
            pts = [(r["size"], r["busbw"][str(p)]) for r in rows if r["algo"] == a and str(p) in r["busbw"]]
            if pts:
                ax.plot(*zip(*pts), styles[j % len(styles)], marker="o", ms=3, color=color, label=f"{p} ranks, {a}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    links = sorted({d.get("link") for d in results if d.get("link")})
    hosts = sorted({len(set(d["hosts"])) for d in results if d.get("hosts")})
    where = (f", {'/'.join(map(str, hosts))} node(s)" if hosts else "") + (f", link {', '.join(links)}" if links else "")
    ax.set_title(f"all-reduce busbw = algbw * 2(p-1)/p{where}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(args) -> int:
    d = args.results
    train = [p for p in _load(os.path.join(d, "train-*.json")) if p.get("kind", "train") == "train"]
    ar = _load(os.path.join(d, "allreduce-n*.json"))
    if not train and not ar:
        raise SystemExit(f"collect.py: no train-*.json or allreduce-n*.json in {d}")
    plt = None if args.no_plot else _pyplot()
    missing_plot = []
    if train:
        rows, md = train_table(train)
        with open(os.path.join(d, "scaling.md"), "w") as f:
            f.write("# ringpipe training scaling\n\n" + md + "\n")
        _write_json(os.path.join(d, "scaling.json"), {"rows": rows, "points": train})
        print(md)
        if plt is not None:
            plot_train(rows, os.path.join(d, "scaling.png"), plt)
            print(f"collect.py: wrote {d}/scaling.md, scaling.json, scaling.png")
        else:
            missing_plot.append("scaling.png")
    if ar:
        rows, md = allreduce_table(ar)
        with open(os.path.join(d, "allreduce.md"), "w") as f:
            f.write("# all-reduce bus bandwidth by rank count\n\n" + md + "\n")
        _write_json(os.path.join(d, "allreduce.json"),
                    {"ranks": sorted(x["ranks"] for x in ar), "rows": rows,
                     "mpi": sorted({x.get("mpi", "") for x in ar})})
        print(md)
        if plt is not None:
            plot_allreduce(rows, ar, os.path.join(d, "allreduce.png"), plt)
            print(f"collect.py: wrote {d}/allreduce.md, allreduce.json, allreduce.png")
        else:
            missing_plot.append("allreduce.png")
    if missing_plot and not args.no_plot:
        raise SystemExit(f"collect.py: matplotlib is not installed, so {', '.join(missing_plot)} were not drawn "
                         "(the tables and JSON were written). Install it: pip install matplotlib "
                         "(or pip install -e '.[plot]'), or pass --no-plot.")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("point", help="one scaling point from a run's metrics.jsonl")
    p.add_argument("--metrics", required=True)
    p.add_argument("--warmup", type=int, default=5, help="steps to skip (compilation, caches)")
    p.add_argument("--out", required=True)
    p.add_argument("--kind", default="train")
    p.add_argument("--mode", default="strong", choices=["strong", "weak"])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--mpi-plugin", default=None)
    p.add_argument("--mpi-library", default=None)
    p.add_argument("extra", nargs="*", help="the trainer's extra arguments (after --), recorded")
    m = sub.add_parser("merge", help="merge a sweep's results into tables, JSON and plots")
    m.add_argument("results", help="the folder with train-*.json / allreduce-n*.json")
    m.add_argument("--no-plot", action="store_true", help="tables and JSON only")
    args = ap.parse_args(argv)
    if args.cmd == "point":
        point(args)
        return 0
    return merge(args)


if __name__ == "__main__":
    sys.exit(main())
