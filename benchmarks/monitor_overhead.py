"""What watching a job costs: tokens/s with monitoring off and on (its defaults), in one run.

    python benchmarks/monitor_overhead.py [--ranks 2] [--rounds 5] [--steps 60] [--json PATH]

Each round trains the same GPT twice, alternating which goes first, as
`mpiexec -n RANKS python benchmarks/monitor_overhead.py --child MODE SPEC RESULT`:

    off   --monitor-every 0 --no-tensorboard: no per-rank gathers, no sinks (the step's
          spans are still timed: that part is always on, and as cheap as a trace list)
    on    the defaults (--monitor-every auto: a gather about every 2 s of steps, TensorBoard
          event files) plus a Prometheus text file (--metrics-textfile)

Tokens/s of a run: the tokens of the steps between step 3 and the last step, over the wall
time between their records (metrics.jsonl's "time": everything the loop does, the gathers,
the sinks' queue and the metrics line included; the first two steps compile the kernels).
The table gives each mode's median over the rounds; the verdict is the median of the rounds'
on/off ratios (a round's two runs are neighbours in time, so the machine's drift between
rounds cancels), with their range: the machine's noise. Besides that end-to-end ratio, the "on" child times the
monitor's own calls on rank 0 (RankMonitor.step_done with its gathers, Sinks.publish) and
the CPU time of the sinks' writer thread: the direct account of what monitoring adds, which
noise does not blur.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import output_path, positive_int, table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
MODES = ("off", "on")


# ---- the child: one training run on every rank ------------------------------------------------

def child(mode: str, spec: dict, result: str) -> None:
    from mpi4py import MPI
    from ringpipe.engine.job import runtime
    from ringpipe.engine.monitor import ranks, sinks
    # As `ringpipe train` does at start-up: without it glibc unmaps every large freed block, and
    # the page faults of each step's fresh activations move with any other allocation (the
    # GEMM peak's matrices, the sinks' libraries): 10% between two runs, neither of them the CLI's.
    runtime.reuse_freed_memory()
    from ringpipe.engine.train.config import Config
    from ringpipe.engine.train.run import run

    world = MPI.COMM_WORLD
    spent = {"step_done_s": 0.0, "publish_s": 0.0, "gathers": 0}
    thread_cpu = {"s": 0.0}

    def timed(method, key):
        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return wrapper
    ranks.RankMonitor.step_done = timed(ranks.RankMonitor.step_done, "step_done_s")
    sinks.Sinks.publish = timed(sinks.Sinks.publish, "publish_s")
    gather = ranks.RankMonitor._gather

    def counted(self, *args):
        spent["gathers"] += 1
        return gather(self, *args)
    ranks.RankMonitor._gather = counted
    sink_loop = sinks.Sinks._run

    def cpu_timed_loop(self):
        t0 = time.thread_time()
        try:
            sink_loop(self)
        finally:
            thread_cpu["s"] = time.thread_time() - t0
    sinks.Sinks._run = cpu_timed_loop

    out = os.path.join(spec["out_root"], mode)
    extra = ({"monitor_every": 0, "tensorboard": False} if mode == "off" else
             {"metrics_textfile": os.path.join(spec["out_root"], "ringpipe.prom")})
    cfg = Config(steps=spec["steps"], out=out, overwrite=True, sample_tokens=0, quiet=True,
                 eval_every=spec["steps"], seed=1, **spec["shape"], **extra)
    t0 = time.perf_counter()
    run(cfg, world=world)
    wall = time.perf_counter() - t0
    if world.Get_rank() != 0:
        return
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    timed_records = [r for r in records if 3 <= r["step"] < spec["steps"]]
    first, last = timed_records[0], timed_records[-1]
    tokens = (last["step"] - first["step"]) * spec["tokens_per_step"]
    per_s = tokens / (last["time"] - first["time"])
    steps = last["step"] - first["step"]
    with open(os.path.join(out, "monitor.json")) as fh:
        interval = json.load(fh)["interval"]
    with open(result, "w") as fh:
        json.dump({"mode": mode, "tokens_per_s": per_s, "wall_s": wall, "interval": interval,
                   "median_step_ms": statistics.median(r["step_ms"] for r in timed_records),
                   "monitor_ms_per_step": 1e3 * (spent["step_done_s"] + spent["publish_s"]) / spec["steps"],
                   "gathers": spent["gathers"], "sink_thread_cpu_s": thread_cpu["s"], "timed_steps": steps}, fh)


# ---- the parent: alternating rounds -------------------------------------------------------------

def run_child(mode: str, spec: dict, ranks: int) -> dict:
    fd, result = tempfile.mkstemp(prefix=f"monitor-{mode}-", suffix=".json")
    os.close(fd)
    try:
        subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--child", mode,
                        json.dumps(spec), result], check=True, cwd=ROOT)
        with open(result) as fh:
            return json.load(fh)
    finally:
        os.unlink(result)


def blas_note() -> str:
    try:
        from threadpoolctl import threadpool_info
        info = [f"{i['internal_api']} {i.get('architecture', '?')} ({i['num_threads']} threads)"
                for i in threadpool_info() if i["user_api"] == "blas"]
        return ", ".join(info) or "no BLAS found by threadpoolctl"
    except ImportError:
        return "threadpoolctl not installed"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ranks", type=positive_int, default=2, help="MPI ranks of each run (default 2)")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds of off/on pairs (default 5)")
    p.add_argument("--steps", type=positive_int, default=60, help="steps of each run (default 60)")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], json.loads(args.child[1]), args.child[2])
        return 0
    if args.batch_size % args.ranks:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --ranks {args.ranks}")
    out_root = tempfile.mkdtemp(prefix="ringpipe-monitor-overhead-")
    shape = {"layers": args.layers, "d_model": args.d_model, "heads": 4, "context": args.seq_len,
             "seq_len": args.seq_len, "batch_size": args.batch_size}
    spec = {"steps": args.steps, "shape": shape, "out_root": out_root,
            "tokens_per_step": args.batch_size * args.seq_len}
    print(f"monitoring overhead: GPT {args.layers} x {args.d_model}, batch {args.batch_size} x {args.seq_len}, "
          f"{args.ranks} ranks, {args.steps} steps a run, {args.rounds} rounds alternating off/on; "
          f"BLAS: {blas_note()}", flush=True)
    runs = []
    for k in range(args.rounds):
        order = MODES if k % 2 == 0 else MODES[::-1]
        pair = {mode: run_child(mode, spec, args.ranks) for mode in order}
        runs.append(pair)
        print(f"round {k + 1}: off {pair['off']['tokens_per_s']:.0f} tok/s, on {pair['on']['tokens_per_s']:.0f} "
              f"tok/s (on/off {pair['on']['tokens_per_s'] / pair['off']['tokens_per_s']:.4f})", flush=True)
    ratios = [r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in runs]
    rows = []
    for mode in MODES:
        rows.append({"mode": mode, "tok_s": statistics.median(r[mode]["tokens_per_s"] for r in runs),
                     "step_ms": statistics.median(r[mode]["median_step_ms"] for r in runs),
                     "interval": runs[-1][mode]["interval"] or 0,
                     "monitor_ms": statistics.median(r[mode]["monitor_ms_per_step"] for r in runs),
                     "sink_cpu": statistics.median(r[mode]["sink_thread_cpu_s"] for r in runs)})
    print()
    print(table(rows, [("mode", "monitoring", ""), ("tok_s", "tokens/s (median)", ".0f"),
                       ("step_ms", "step ms (median)", ".1f"), ("interval", "interval (steps)", "d"),
                       ("monitor_ms", "monitor calls ms/step (rank 0)", ".3f"),
                       ("sink_cpu", "sink thread CPU s/run", ".3f")]))
    on = rows[1]
    direct = on["monitor_ms"] / on["step_ms"]
    median_ratio = statistics.median(ratios)
    print(f"\non/off tokens/s, the median of the rounds' ratios: {median_ratio:.4f} ({1 - median_ratio:+.2%} slower "
          f"with monitoring); rounds {min(ratios):.4f} .. {max(ratios):.4f} (the machine's noise); ratio of the "
          f"medians {rows[1]['tok_s'] / rows[0]['tok_s']:.4f}")
    print(f"direct account: the monitor's calls take {on['monitor_ms']:.3f} ms of a {on['step_ms']:.1f} ms step on "
          f"rank 0 ({direct:.3%}); the sinks' thread used {on['sink_cpu']:.3f} s of CPU in a run")
    if args.json:
        write_json(args.json, {"benchmark": "monitor_overhead", "ranks": args.ranks, "rounds": args.rounds,
                               "shape": shape, "steps": args.steps, "blas": blas_note(), "runs": runs,
                               "summary": rows, "ratio_median": median_ratio, "ratios": ratios,
                               "direct_fraction": direct})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
