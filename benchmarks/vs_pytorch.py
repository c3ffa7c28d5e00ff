"""ringpipe next to PyTorch eager on this host, every cell of issue 35 in one run, with the
host's GEMM rates printed beside the ratios.

    python benchmarks/vs_pytorch.py [--cells small256,small50k,gpt2,llama] [--threads 1,2]
                                    [--rounds 3] [--loads quiet,busy2,ringpipe] [--ranks] [--json PATH]
    python benchmarks/vs_pytorch.py --quick      # tiny shapes, one round: seconds (for tests)

Cells (the training step of benchmarks/gpt2_step.py and benchmarks/llama_step.py: forward,
loss, backward, global-norm clip, AdamW; each framework in a fresh child process):
  small256   small GPT 4 x 256, 8 heads, batch 16 x 128 tokens, vocabulary 256
  small50k   the same with GPT-2's vocabulary (50257)
  gpt2       GPT-2 124M, batch 1 x 1024 tokens
  llama      SmolLM2-135M's Llama shape (30 x 576, GQA 9/3, vocabulary 49152), batch 1 x 256
Each cell runs float32 (ringpipe against PyTorch eager) and, where the CPU multiplies bf16
(avx512_bf16 or amx_bf16), bf16 (ringpipe --precision bf16 against torch.autocast bf16), at
each --threads count (0: each framework's own default), alternating fresh children round by
round (ringpipe, torch, ringpipe-bf16, torch-bf16, ringpipe, ...). A cell's ratio is the median
of the per-round ratios (ringpipe's round n over torch's round n), with their range; the
peak-memory ratio is of the children's peak RSS.

Loads (--loads; each phase in this same run, so the "share kept" is against the quiet phase):
  quiet      nothing else started
  busy2      two processes spinning (`while True: pass`) for the whole phase, on every core
  ringpipe   a second ringpipe job training beside (a small GPT, restarted until the phase ends)
Busy phases run the small256 cell only (--busy-cells to change), at the same thread counts and
also at each framework's own default (0), and add ringpipe at 1 thread: default threads on a
loaded node must not be slower than 1 thread by more than 10%.

--ranks: `ringpipe train` (small256's model on synthetic data, the same global batch) at 2 and at
4 ranks on this node, alternating, tokens/s per job from each run's metrics.jsonl.

The host's GEMM rates (a child per thread count, 2048^3 and a linear layer's 2048 x 768 x 3072):
numpy's BLAS (with the environment's OPENBLAS_CORETYPE, and the core OpenBLAS actually runs),
oneDNN's sgemm, torch.mm float32, oneDNN's bf16 GEMM (ringpipe's), torch.mm bf16.
Timings are medians; the machine is shared, so every claim is a ratio of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from _common import choice_list, median, output_path, positive_int, table, write_json  # noqa: E402

import gpt2_step  # noqa: E402
import llama_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CELLS = {
    "small256": {"script": "gpt2", "shape": [4, 256, 8, 256], "vocab": 256, "batch": 16, "seq": 128,
                 "steps": 10, "warmup": 3, "label": "small GPT 4x256, T128 B16, vocab 256"},
    "small50k": {"script": "gpt2", "shape": [4, 256, 8, 256], "vocab": 50257, "batch": 16, "seq": 128,
                 "steps": 6, "warmup": 2, "label": "small GPT 4x256, T128 B16, vocab 50257"},
    "gpt2": {"script": "gpt2", "shape": [12, 768, 12, 1024], "vocab": 50257, "batch": 1, "seq": 1024,
             "steps": 3, "warmup": 1, "label": "GPT-2 124M, T1024 B1"},
    "llama": {"script": "llama", "shape": "smollm2-135m", "batch": 1, "seq": 256,
              "steps": 3, "warmup": 1, "label": "Llama SmolLM2-135M shape, T256 B1"},
}
QUICK_CELLS = {
    "small256": {"script": "gpt2", "shape": [2, 64, 2, 64], "vocab": 256, "batch": 2, "seq": 32,
                 "steps": 2, "warmup": 1, "label": "tiny GPT 2x64, vocab 256"},
    "llama": {"script": "llama", "shape": "hf-tiny", "batch": 2, "seq": 32, "steps": 2, "warmup": 1,
              "label": "tiny Llama (hf-tiny)"},
}
LOADS = ("quiet", "busy2", "ringpipe")
PAIRS = (("ringpipe", "torch"), ("ringpipe-bf16", "torch-bf16"), ("ringpipe-bf16-selective", "torch-bf16"))
SCRIPTS = {"gpt2": gpt2_step, "llama": llama_step}


# ---- the host's GEMM rates (a child per thread count) ----------------------------------------

def _openblas_core():
    """The core OpenBLAS runs ("Haswell", "SkylakeX", ...) and its config line, from the library itself."""
    import ctypes
    try:
        with open("/proc/self/maps") as fh:
            libs = sorted({line.split()[-1] for line in fh if "openblas" in line.split()[-1].lower()})
    except OSError:
        return None
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
            core = getattr(lib, f"{prefix}get_corename{suffix}", None)
            if core is not None:
                core.restype = ctypes.c_char_p
                return core().decode()
    return None


def gemm_child(threads):
    """{name: GFLOP/s} for this process's libraries at THREADS threads (set before they load)."""
    import numpy as np
    import torch
    from ringpipe import kernels as K
    from ringpipe.kernels import onednn
    torch.set_num_threads(threads)
    K.set_num_threads(threads)
    lib = onednn.library()[0]
    rng = np.random.default_rng(0)
    out = {"openblas_core": _openblas_core(), "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
           "torch": torch.__version__, "onednn": lib.describe() if lib else None, "rates": {}}

    def rate(fn, flops):
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(flops / median(times) / 1e9, 1)

    for label, (M, K_, N) in (("2048^3", (2048, 2048, 2048)), ("linear 2048x768x3072", (2048, 768, 3072))):
        a = rng.standard_normal((M, K_), dtype=np.float32)
        b = rng.standard_normal((K_, N), dtype=np.float32)
        c = np.empty((M, N), np.float32)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        flops = 2 * M * N * K_
        row = {"numpy BLAS float32": rate(lambda: np.matmul(a, b, out=c), flops),
               "torch float32": rate(lambda: torch.mm(ta, tb), flops)}
        if lib is not None:
            row["oneDNN sgemm"] = rate(lambda: onednn.gemm(lib, lib.sgemm, "dnnl_sgemm", a, False, b, False, c,
                                                           False, ""), flops)
            if llama_step.cpu_has_bf16():
                a16, b16 = K.to_bf16(a), K.to_bf16(b)
                row["oneDNN bf16"] = rate(lambda: K.matmul(a16, b16, c), flops)
                ta16, tb16 = ta.bfloat16(), tb.bfloat16()
                row["torch bf16"] = rate(lambda: torch.mm(ta16, tb16), flops)
        out["rates"][label] = row
    return out


def host_gemm_rates(thread_counts):
    rates = {}
    for t in sorted({t or (os.cpu_count() or 1) for t in thread_counts}):
        env = dict(os.environ, **{v: str(t) for v in gpt2_step.THREAD_VARS})
        fd, path = tempfile.mkstemp(prefix="vs_pytorch-gemm-", suffix=".json")
        os.close(fd)
        try:
            subprocess.run([sys.executable, os.path.abspath(__file__), "--gemm-child", str(t), path], env=env,
                           cwd=ROOT, check=True)
            with open(path) as fh:
                rates[t] = json.load(fh)
        finally:
            os.unlink(path)
    return rates


def print_rates(rates):
    for t, r in rates.items():
        print(f"# host GEMM rates, {t} thread(s), GFLOP/s (OpenBLAS core {r['openblas_core']}, OPENBLAS_CORETYPE="
              f"{r['openblas_coretype_env']}; {r['onednn']}; torch {r['torch']}):")
        for shape, row in r["rates"].items():
            print(f"#   {shape}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))


# ---- neighbours --------------------------------------------------------------------------------

class Neighbours:
    """The load of a phase: processes started here and stopped when it ends (only ours)."""

    def __init__(self, load, tmp):
        self.procs = []
        self.load, self.tmp = load, tmp

    def __enter__(self):
        if self.load == "busy2":
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        elif self.load == "ringpipe":
            out = os.path.join(self.tmp, "neighbour")
            loop = (f"while true; do rm -rf {out}; {sys.executable} -m ringpipe.cli train --data synthetic "
                    f"--layers 4 --d-model 256 --heads 8 --context 128 --batch-size 16 --steps 200 "
                    f"--eval-every 200 --eval-batches 1 --sample-tokens 0 --quiet --out {out} >/dev/null 2>&1; done")
            self.procs = [subprocess.Popen(["bash", "-c", loop], start_new_session=True)]
        time.sleep(2 if self.procs else 0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            try:
                if self.load == "ringpipe":           # the loop's shell and the trainer it started
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
            except ProcessLookupError:
                pass
            p.wait()


# ---- one cell ---------------------------------------------------------------------------------

def frameworks(bf16, selective=False):
    """The children of a round, in order; SELECTIVE adds ringpipe-bf16 with --recompute selective."""
    return ["ringpipe", "torch"] + (["ringpipe-bf16", "torch-bf16"] if bf16 else []) + \
        (["ringpipe-bf16-selective"] if bf16 and selective else [])


def run_cell(name, cell, threads, rounds, bf16, extra_one_thread=False, selective=False):
    """Alternating rounds of every framework on one cell: {framework: [round results]}."""
    script = SCRIPTS[cell["script"]]
    spec = {k: cell[k] for k in ("shape", "batch", "seq", "steps", "warmup")}
    spec.update(threads=threads, torch_attn="sdpa")
    if "vocab" in cell:
        spec["vocab"] = cell["vocab"]
    tokens = cell["batch"] * cell["seq"]
    runs = {}
    order = frameworks(bf16, selective and cell["script"] == "gpt2") + (["ringpipe@1"] if extra_one_thread else [])
    for n in range(rounds):
        for fw in order:
            one = fw == "ringpipe@1"
            r = script.run_child("ringpipe" if one else fw, dict(spec, threads=1) if one else spec)
            runs.setdefault(fw, []).append({"tokens_per_s": tokens / r["step_s"], "step_s": r["step_s"],
                                            "peak_rss_bytes": r["peak_rss_bytes"], "loss_first": r["losses"][0],
                                            "threads": r.get("threads"), "load_before": r["load_before"],
                                            "gemm": r.get("float32_gemm") or r.get("bf16_gemm")})
            print(f"#   {name} threads {threads or 'default'} round {n + 1}/{rounds} {fw}: "
                  f"{tokens / r['step_s']:,.0f} tokens/s", flush=True)
    return runs


def summarize(name, cell, threads, runs, load):
    rows = []
    for a, b in PAIRS:
        if a not in runs or b not in runs:
            continue
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b])]
        mem = [x["peak_rss_bytes"] / y["peak_rss_bytes"] for x, y in zip(runs[a], runs[b])]
        rows.append({"load": load, "cell": name, "label": cell["label"], "threads": threads or "default",
                     "precision": ("bf16, --recompute selective" if a.endswith("-selective") else "bf16")
                     if "bf16" in a else "float32",
                     "ringpipe_tokens_per_s": median([x["tokens_per_s"] for x in runs[a]]),
                     "torch_tokens_per_s": median([y["tokens_per_s"] for y in runs[b]]),
                     "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "ratio_range": f"{min(ratios):.2f}-{max(ratios):.2f}", "peak_rss_ratio": median(mem),
                     "gemm": runs[a][0]["gemm"], "rounds": ratios})
    if "ringpipe@1" in runs:
        default = median([x["tokens_per_s"] for x in runs["ringpipe"]])
        one = median([x["tokens_per_s"] for x in runs["ringpipe@1"]])
        rows.append({"load": load, "cell": name, "label": cell["label"], "threads": "default vs 1",
                     "precision": "float32", "ringpipe_tokens_per_s": default, "torch_tokens_per_s": None,
                     "ratio": default / one, "ratio_range": "(ringpipe default / ringpipe 1 thread)",
                     "one_thread_tokens_per_s": one})
    return rows


COLUMNS = [("load", "load", ""), ("label", "cell", ""), ("threads", "threads", ""), ("precision", "precision", ""),
           ("ringpipe_tokens_per_s", "ringpipe tok/s", ",.0f"), ("torch_tokens_per_s", "torch tok/s", ",.0f"),
           ("ratio", "ratio", ".2f"), ("ratio_range", "rounds", ""), ("peak_rss_ratio", "peak RSS ratio", ".2f")]


def kept_shares(rows):
    """Each busy row's share of its quiet twin's speed (same cell, threads and precision), per framework."""
    kept = []
    for r in rows:
        if r["load"] != "quiet" and r["torch_tokens_per_s"]:
            base = [q for q in rows if q["load"] == "quiet" and q["cell"] == r["cell"]
                    and q["threads"] == r["threads"] and q["precision"] == r["precision"]]
            if base:
                kept.append({"load": r["load"], "label": r["label"], "threads": r["threads"], "precision": r["precision"],
                             "ringpipe_kept": r["ringpipe_tokens_per_s"] / base[0]["ringpipe_tokens_per_s"],
                             "torch_kept": r["torch_tokens_per_s"] / base[0]["torch_tokens_per_s"]})
    return kept


# ---- ranks per job ----------------------------------------------------------------------------

def ranks_comparison(rounds, tmp, quick):
    """tokens/s of `ringpipe train` at 2 and 4 ranks on this node, alternating (median of each run's steps)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if not mpiexec:
        print("# --ranks: no mpiexec, skipped")
        return []
    steps = 6 if quick else 30
    model = ["--layers", "2", "--d-model", "64", "--heads", "2", "--context", "32", "--batch-size", "8"] if quick \
        else ["--layers", "4", "--d-model", "256", "--heads", "8", "--context", "128", "--batch-size", "16"]
    got = {2: [], 4: []}
    for n in range(rounds):
        for ranks in (2, 4):
            out = os.path.join(tmp, f"ranks{ranks}-{n}")
            cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "ringpipe.cli", "train", "--data", "synthetic",
                   *model, "--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1", "--sample-tokens", "0",
                   "--quiet",
                   "--monitor-every", "0", "--out", out]
            env = {k: v for k, v in os.environ.items() if k not in gpt2_step.THREAD_VARS}
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(out, "metrics.jsonl")) as fh:
                rates = [json.loads(line)["tokens_per_s"] for line in fh if '"tokens_per_s"' in line]
            got[ranks].append(median(rates[len(rates) // 3:]))
            print(f"#   ranks {ranks} round {n + 1}/{rounds}: {got[ranks][-1]:,.0f} tokens/s per job", flush=True)
    ratios = [a / b for a, b in zip(got[4], got[2])]
    print(f"4 ranks / 2 ranks on this node, tokens/s per job: {median(ratios):.2f}x "
          f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x; 2 ranks {median(got[2]):,.0f}, 4 ranks {median(got[4]):,.0f})")
    return [{"ranks": r, "tokens_per_s": got[r]} for r in got] + [{"ratio_4_over_2": ratios}]


# ---- main -------------------------------------------------------------------------------------

def thread_counts(text):
    """"1,2" -> [1, 2]: thread counts, 0 for each framework's own default."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = [-1]
    if any(n < 0 or n > 1024 for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of thread counts, 0 (each framework's default) "
                                         "to 1024")
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", type=choice_list(tuple(CELLS)), default=list(CELLS), help="comma list (default all)")
    p.add_argument("--busy-cells", type=choice_list(tuple(CELLS)), default=["small256"],
                   help="the cells the busy phases run (default small256)")
    p.add_argument("--threads", type=thread_counts, default=[1, 2],
                   help="comma list of thread counts (default 1,2; 0: each framework's default)")
    p.add_argument("--rounds", type=positive_int, default=3, help="fresh children per framework, alternating")
    p.add_argument("--loads", type=choice_list(LOADS), default=["quiet"], help=f"comma list of {', '.join(LOADS)}")
    p.add_argument("--selective", action="store_true",
                   help="GPT cells also run ringpipe bf16 with --recompute selective (no attention probabilities "
                        "kept, as PyTorch's SDPA)")
    p.add_argument("--ranks", action="store_true", help="also 2 vs 4 ranks of `ringpipe train` on this node")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one round (for tests)")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--gemm-child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gemm_child:
        return args
    if args.quick:
        args.cells = [c for c in args.cells if c in QUICK_CELLS] or ["small256"]
        args.busy_cells = [c for c in args.busy_cells if c in QUICK_CELLS] or ["small256"]
        args.rounds = 1
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.gemm_child:
        threads, path = args.gemm_child
        with open(path, "w") as fh:
            json.dump(gemm_child(int(threads)), fh)
        return 0
    cells = QUICK_CELLS if args.quick else CELLS
    bf16 = llama_step.cpu_has_bf16()
    print(f"# ringpipe vs PyTorch eager | cells {', '.join(args.cells)} | threads {args.threads} | "
          f"{args.rounds} round(s) | loads {', '.join(args.loads)} | bf16 {'yes' if bf16 else 'no (no bf16 CPU)'} | "
          f"cores {os.cpu_count()}", flush=True)
    rates = host_gemm_rates(args.threads)
    print_rates(rates)
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="vs_pytorch-") as tmp:
        for load in args.loads:
            names = args.cells if load == "quiet" else args.busy_cells
            counts = args.threads if load == "quiet" else sorted(set(args.threads) | {0})
            print(f"# phase {load}", flush=True)
            with Neighbours(load, tmp):
                for name in names:
                    for threads in counts:
                        runs = run_cell(name, cells[name], threads, args.rounds, bf16,
                                        extra_one_thread=load != "quiet" and threads == 0, selective=args.selective)
                        rows += summarize(name, cells[name], threads, runs, load)
                        raw.append({"load": load, "cell": name, "threads": threads, "runs": runs})
        ranks = ranks_comparison(max(2, args.rounds if not args.quick else 1), tmp, args.quick) if args.ranks else []
    print(table(rows, COLUMNS))
    kept = kept_shares(rows)
    if kept:
        print(table(kept, [("load", "load", ""), ("label", "cell", ""), ("threads", "threads", ""),
                           ("precision", "precision", ""), ("ringpipe_kept", "ringpipe keeps", ".0%"),
                           ("torch_kept", "torch keeps", ".0%")]))
    if args.json:
        write_json(args.json, {"benchmark": "vs_pytorch", "cells": {n: cells[n] for n in args.cells},
                               "threads": args.threads, "rounds": args.rounds, "loads": args.loads, "bf16": bf16,
                               "host_gemm_gflops": rates, "rows": rows, "kept": kept, "ranks": ranks, "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
