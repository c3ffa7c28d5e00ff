"""What watching a job costs: tokens/s with monitoring off and on (its defaults), in one run.

    python benchmarks/monitor_overhead.py [--ranks 2] [--rounds 3] [--steps 400] [--block 40] [--json PATH]

Each round is one training run, `mpiexec -n RANKS python benchmarks/monitor_overhead.py --child
SPEC RESULT`, with monitoring on as a user gets it by default (--monitor-every auto: a gather
about every 2 s of steps; TensorBoard event files) plus a Prometheus text file. Its steps are cut
into blocks of --block steps that alternate on and off (the first block on, so the automatic
interval is agreed there): in an off block the monitor neither gathers nor samples (as with
--monitor-every 0) and nothing goes to TensorBoard or Prometheus. What stays in both is the
step's timed spans, the part that is always on, as cheap as a trace list.

Alternating blocks inside one process compare like with like: two processes differ by more than
the monitor costs (memory layout, which core, the neighbours on a shared machine: 5-10% between
two runs of the same thing here). A step's wall time is the time between its metrics.jsonl
record and the next one (everything the loop does: the gathers, the sinks' queue, the record);
a block's figure is its mean (a gather comes once an interval: a median would hide it). The
verdict: the median tokens/s of the on blocks over the median of the off blocks, per run and over
every run; beside it each off block against the mean of the on blocks on either side (which
cancels a drift of the machine's speed during the run): their range is the machine's noise. Besides, the child times the monitor's
own calls on rank 0 (RankMonitor.step_done with its gathers, Sinks.publish) in the on blocks,
and the CPU time of the sinks' writer thread: the direct account, which noise does not blur.
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


def on_block(step: int, block: int) -> bool:
    """Steps 1..block are on, the next block off, and so on."""
    return ((step - 1) // block) % 2 == 0


# ---- the child: one training run on every rank ------------------------------------------------

def child(spec: dict, result: str) -> None:
    from mpi4py import MPI
    from ringpipe.engine.job import runtime
    from ringpipe.engine.monitor import ranks, sinks
    from ringpipe.engine.train.config import Config
    from ringpipe.engine.train.run import run

    # As `ringpipe train` does at start-up (glibc keeps large freed blocks: no page faults on
    # each step's fresh activations).
    runtime.reuse_freed_memory()
    world = MPI.COMM_WORLD
    block = spec["block"]
    spent = {"step_done_s": 0.0, "publish_s": 0.0, "gathers": 0}
    thread_cpu = {"s": 0.0}
    step_done, publish, gather, sink_loop = (ranks.RankMonitor.step_done, sinks.Sinks.publish,
                                             ranks.RankMonitor._gather, sinks.Sinks._run)

    def step_done_in_blocks(self, done, *args):
        self.enabled = on_block(done, block)          # off: no gather, no sampling (--monitor-every 0)
        t0 = time.perf_counter()
        try:
            return step_done(self, done, *args)
        finally:
            spent["step_done_s"] += time.perf_counter() - t0

    def publish_in_blocks(self, record):
        if not on_block(record["step"], block):
            return                                     # off: nothing to TensorBoard or Prometheus
        t0 = time.perf_counter()
        publish(self, record)
        spent["publish_s"] += time.perf_counter() - t0

    def counted(self, *args):
        spent["gathers"] += 1
        return gather(self, *args)

    def cpu_timed_loop(self):
        t0 = time.thread_time()
        try:
            sink_loop(self)
        finally:
            thread_cpu["s"] = time.thread_time() - t0
    ranks.RankMonitor.step_done = step_done_in_blocks
    sinks.Sinks.publish = publish_in_blocks
    ranks.RankMonitor._gather = counted
    sinks.Sinks._run = cpu_timed_loop

    out = spec["out"]
    cfg = Config(steps=spec["steps"], out=out, overwrite=True, sample_tokens=0, quiet=True,
                 eval_every=spec["steps"], seed=1, metrics_textfile=os.path.join(out + "-prom", "ringpipe.prom"),
                 **spec["shape"])
    os.makedirs(out + "-prom", exist_ok=True)
    run(cfg, world=world)
    if world.Get_rank() != 0:
        return
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        times = {r["step"]: r["time"] for r in map(json.loads, fh)}
    with open(os.path.join(out, "monitor.json")) as fh:
        interval = json.load(fh)["interval"]
    # A step's wall time: from its record to the next (its monitor calls, the next step's work).
    wall = {s: times[s + 1] - times[s] for s in times if s + 1 in times}
    blocks = []
    for first in range(1 + block, spec["steps"], block):       # the first block also compiles: left out
        steps = [s for s in range(first, first + block) if s in wall]
        if len(steps) == block:
            blocks.append({"first": first, "on": on_block(first, block),
                           "mean_s": sum(wall[s] for s in steps) / len(steps)})
    on_steps = sum(block for b in blocks if b["on"]) + block   # the first (on) block's calls count too
    with open(result, "w") as fh:
        json.dump({"blocks": blocks, "interval": interval, "gathers": spent["gathers"],
                   "monitor_ms_per_on_step": 1e3 * (spent["step_done_s"] + spent["publish_s"]) / on_steps,
                   "sink_thread_cpu_s": thread_cpu["s"]}, fh)


# ---- the parent ------------------------------------------------------------------------------------

def run_child(spec: dict, ranks: int) -> dict:
    fd, result = tempfile.mkstemp(prefix="monitor-overhead-", suffix=".json")
    os.close(fd)
    try:
        subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--child",
                        json.dumps(spec), result], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
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
    p.add_argument("--rounds", type=positive_int, default=3, help="training runs (default 3)")
    p.add_argument("--steps", type=positive_int, default=400, help="steps of each run (default 400)")
    p.add_argument("--block", type=positive_int, default=40, help="steps in an on or off block (default 40)")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--d-model", type=positive_int, default=128)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child[0]), args.child[1])
        return 0
    if args.batch_size % args.ranks:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --ranks {args.ranks}")
    if args.steps < 4 * args.block:
        p.error(f"--steps {args.steps} must hold at least 4 blocks of --block {args.block}")
    out_root = tempfile.mkdtemp(prefix="ringpipe-monitor-overhead-")
    shape = {"layers": args.layers, "d_model": args.d_model, "heads": 4, "context": args.seq_len,
             "seq_len": args.seq_len, "batch_size": args.batch_size}
    tokens_per_step = args.batch_size * args.seq_len
    print(f"monitoring overhead: GPT {args.layers} x {args.d_model}, batch {args.batch_size} x {args.seq_len}, "
          f"{args.ranks} ranks, {args.rounds} runs of {args.steps} steps in blocks of {args.block} alternating on/off; "
          f"BLAS: {blas_note()}", flush=True)
    runs, ratios, rows, on_blocks, off_blocks = [], [], [], [], []
    for k in range(args.rounds):
        spec = {"steps": args.steps, "block": args.block, "shape": shape, "out": os.path.join(out_root, f"run{k}")}
        res = run_child(spec, args.ranks)
        runs.append(res)
        blocks = res["blocks"]
        # Each off block against its two on neighbours: off time / on time = on tok/s / off tok/s.
        mine = [b["mean_s"] / ((a["mean_s"] + c["mean_s"]) / 2) for a, b, c in zip(blocks, blocks[1:], blocks[2:])
                if a["on"] and not b["on"] and c["on"]]
        ratios += mine
        on_blocks += [tokens_per_step / b["mean_s"] for b in blocks if b["on"]]
        off_blocks += [tokens_per_step / b["mean_s"] for b in blocks if not b["on"]]
        on = statistics.median(b["mean_s"] for b in blocks if b["on"])
        off = statistics.median(b["mean_s"] for b in blocks if not b["on"])
        rows.append({"run": k + 1, "on_tok_s": tokens_per_step / on, "off_tok_s": tokens_per_step / off,
                     "ratio": off / on, "interval": res["interval"], "gathers": res["gathers"],
                     "monitor_ms": res["monitor_ms_per_on_step"], "step_ms": 1e3 * on,
                     "sink_cpu": res["sink_thread_cpu_s"]})
        print(f"run {k + 1}: on {tokens_per_step / on:.0f} tok/s, off {tokens_per_step / off:.0f} tok/s "
              f"(block medians, on/off {off / on:.4f}); off blocks against their neighbours {min(mine):.4f} .. "
              f"{max(mine):.4f}", flush=True)
    print()
    print(table(rows, [("run", "run", "d"), ("on_tok_s", "tok/s on", ".0f"), ("off_tok_s", "tok/s off", ".0f"),
                       ("ratio", "on/off", ".4f"), ("interval", "interval (steps)", "d"),
                       ("gathers", "gathers", "d"), ("monitor_ms", "monitor calls ms/step", ".3f"),
                       ("step_ms", "step ms", ".1f"), ("sink_cpu", "sink thread CPU s", ".3f")]))
    verdict = statistics.median(on_blocks) / statistics.median(off_blocks)
    direct = statistics.median(r["monitor_ms"] / r["step_ms"] for r in rows)
    print(f"\non/off tokens/s, median of the {len(on_blocks)} on blocks over the {len(off_blocks)} off blocks: "
          f"{verdict:.4f} ({1 - verdict:+.2%} slower with monitoring); runs {min(r['ratio'] for r in rows):.4f} .. "
          f"{max(r['ratio'] for r in rows):.4f}; an off block against its neighbours: median "
          f"{statistics.median(ratios):.4f}, {min(ratios):.4f} .. {max(ratios):.4f} (the machine's noise)")
    print(f"direct account: the monitor's calls take {direct:.3%} of a step on rank 0 (median of the runs); "
          "start-up adds the GEMM peak's ~0.1 s once")
    if args.json:
        write_json(args.json, {"benchmark": "monitor_overhead", "ranks": args.ranks, "rounds": args.rounds,
                               "steps": args.steps, "block": args.block, "shape": shape, "blas": blas_note(),
                               "runs": runs, "summary": rows, "ratio_of_medians": verdict, "neighbour_ratios": ratios,
                               "direct_fraction": direct})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
