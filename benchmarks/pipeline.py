"""Pipeline schedules measured: bubble vs the simulator and theory, activation memory, throughput.

    mpiexec -n 2 python benchmarks/pipeline.py --json pp2.json
    mpiexec -n 4 python benchmarks/pipeline.py --json pp4.json

Runs the GPT split over p = (number of ranks) stages for each schedule and
m in {p, 2p, 4p, 8p} micro-batches, with the real executor and MPI. For each:
  * measured bubble per rank: 1 - (compute time) / (step makespan), steps
    aligned by a barrier, median over steps;
  * the simulator's prediction, fed with the per-action costs measured on each
    rank in the same run (so the comparison tests the schedule + executor, not
    a cost guess), and the closed-form theory for uniform costs;
  * peak activation memory per stage from the executor's own accounting
    (micro-batches in flight and bytes), GPipe vs 1F1B;
  * tokens/s.
Note: with more ranks than cores (4 ranks on 2 cores here) ranks compete for
CPU, so an idle rank speeds the others up and measured bubbles skew; p = 2 on
2 cores is the clean case. Reported as measured.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
# ringpipe.comm first: it settles what the launch needs before MPI_Init (comm/launcher.py),
# and the import of mpi4py.MPI below initializes MPI.
from ringpipe import comm  # noqa: E402
from mpi4py import MPI  # noqa: E402


from _common import choice_list, int_list, output_path, positive_int  # noqa: E402
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers  # noqa: E402
from ringpipe.engine.schedules import SCHEDULE_NAMES, simulate, theoretical_bubble  # noqa: E402
from ringpipe.engine.parallel.pipeline.stage import PipelineModel  # noqa: E402


def run_config(grid, cfg, schedule, m, v, mb_size, seq, steps):
    world, p = grid.world, grid.size("pipe")
    model = PipelineModel(lambda tensor=None: gpt_layers(cfg, tensor), grid, np.float32, 0, schedule, m, v,
                          act_shape=(mb_size, seq, cfg.d_model))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(m * mb_size, seq))
    y = rng.integers(0, 256, size=(m * mb_size, seq))
    bubbles, step_times, costs = [], [], defaultdict(list)
    for step in range(steps + 1):                       # step 0 warms up
        events = []
        model.executor.trace = events
        model.params.zero_grad()
        world.Barrier()
        t0 = time.perf_counter()
        model.forward_backward(x, y, 1.0 / (m * mb_size * seq))
        t_end = time.perf_counter()
        span = np.array([t_end - t0])
        world.Allreduce(MPI.IN_PLACE, span, op=MPI.MAX)
        if step == 0:
            continue
        busy = sum(t1 - ta for _, cat, ta, t1 in events if cat == "compute")
        bubbles.append(1.0 - busy / span[0])
        step_times.append(span[0])
        for name, cat, ta, t1 in events:
            if cat == "compute":
                costs[name[0]].append(t1 - ta)
    my_costs = {k: float(np.median(vals)) for k, vals in costs.items()}
    all_costs = world.allgather(my_costs)
    all_bubbles = world.allgather(float(np.median(bubbles)))
    peaks = world.allgather((model.executor.peak_in_flight, model.executor.peak_activation_bytes))
    sim = simulate(model.schedule, costs={r: c for r, c in enumerate(all_costs)})
    return {
        "schedule": schedule, "p": p, "m": m, "v": v,
        "measured_bubble": all_bubbles, "measured_bubble_mean": float(np.mean(all_bubbles)),
        "simulated_bubble": sim.bubble, "simulated_bubble_mean": sim.mean_bubble,
        "theory_bubble": theoretical_bubble(schedule, p, m, v),
        "peak_in_flight": [a for a, _ in peaks], "peak_activation_bytes": [b for _, b in peaks],
        "tokens_per_s": m * mb_size * seq / float(np.median(step_times)),
        "costs_ms": [{k: v * 1e3 for k, v in c.items()} for c in all_costs],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=choice_list(SCHEDULE_NAMES), default="gpipe,1f1b,zbh1,interleaved",
                    help="comma list of " + ",".join(SCHEDULE_NAMES))
    ap.add_argument("--ms", type=int_list(1), default=None,
                    help="comma list of micro-batch counts, each >= 1 (default p,2p,4p,8p)")
    ap.add_argument("--d-model", type=positive_int, default=128, help="model width (divisible by the 4 heads)")
    ap.add_argument("--seq-len", type=positive_int, default=64)
    ap.add_argument("--mb-size", type=positive_int, default=2, help="sequences per micro-batch")
    ap.add_argument("--steps", type=positive_int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--json", type=output_path, default=None)
    args = ap.parse_args()
    # Every rank parses the same argv, so every rank refuses alike, before any collective.
    if args.d_model % 4:
        ap.error(f"--d-model {args.d_model} must be divisible by 4 (the benchmark's GPT has 4 heads)")
    comm.install_abort_handler()
    world = MPI.COMM_WORLD
    p = world.Get_size()
    if p < 2:
        ap.error("run under mpiexec -n P with P >= 2 (P = pipeline stages)")
    grid = comm.ProcessGrid(world, [("pipe", p), ("data", 1)])
    ms = args.ms or [p, 2 * p, 4 * p, 8 * p]
    rows = []
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        cfg = GPTConfig(n_layer=2 * p, d_model=args.d_model, n_head=4, context=args.seq_len)
        for m in ms:
            row = run_config(grid, cfg, schedule, m, v, args.mb_size, args.seq_len, args.steps)
            rows.append(row)
            if world.rank == 0:
                print(f"{schedule:<12}{p:>3}{m:>4} | meas {row['measured_bubble_mean']:6.1%} "
                      f"sim {row['simulated_bubble_mean']:6.1%} theory {row['theory_bubble']:6.1%} | "
                      f"stage0 {row['peak_in_flight'][0]:>3} mb {row['peak_activation_bytes'][0] / 2**20:7.1f} MiB | "
                      f"{row['tokens_per_s']:8.0f} tok/s", flush=True)
    if world.rank == 0:
        print(f"\n# pipeline bubbles and memory, p = {p} ranks on {os.cpu_count()} cores "
              f"(GPT {2 * p} layers, d_model {args.d_model}, micro-batch {args.mb_size} x {args.seq_len})")
        print(f"{'schedule':<12}{'p':>3}{'m':>4}{'measured':>10}{'simulated':>10}{'|diff| pp':>10}{'theory':>8}"
              f"{'st0 mb':>8}{'st0 MiB':>9}{'tok/s':>9}")
        for r in rows:
            print(f"{r['schedule']:<12}{r['p']:>3}{r['m']:>4}{r['measured_bubble_mean']:>10.1%}"
                  f"{r['simulated_bubble_mean']:>10.1%}"
                  f"{abs(r['measured_bubble_mean'] - r['simulated_bubble_mean']) * 100:>10.1f}"
                  f"{r['theory_bubble']:>8.1%}{r['peak_in_flight'][0]:>8}"
                  f"{r['peak_activation_bytes'][0] / 2**20:>9.1f}{r['tokens_per_s']:>9.0f}")
        by = {(r["schedule"], r["m"]): r for r in rows}
        print("\n# 1F1B vs GPipe activation memory on stage 0 (bytes ratio; bound p/m + small constant)")
        for m in ms:
            if ("gpipe", m) in by and ("1f1b", m) in by:
                ratio = by[("1f1b", m)]["peak_activation_bytes"][0] / by[("gpipe", m)]["peak_activation_bytes"][0]
                print(f"m={m:<4} 1f1b/gpipe = {ratio:.3f}   p/m = {p / m:.3f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"p": p, "cores": os.cpu_count(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
