"""A made-up run directory in the monitor's formats (docs/monitoring.md), for the tools'
tests: `ringpipe top` and `ringpipe report` read it as they read a real run.

    write_run(tmp_path, ranks=8, steps=40, interval=5, straggler=3, classifier=False)
"""
from __future__ import annotations

import json
import math
import os
import time


def write_run(folder, ranks=4, steps=40, interval=5, straggler=None, classifier=False, layout=None,
              done=None, nodes=2, val_every=10):
    """A run of `ranks` ranks on `nodes` nodes that has written `done` (default all) of
    `steps` steps; rank `straggler` computes 1.8x as long as the others from the start."""
    os.makedirs(folder, exist_ok=True)
    layout = layout or {"dp": ranks, "pp": 1, "tp": 1}
    done = steps if done is None else done
    per_node = max(1, ranks // nodes)
    node = [f"n{r // per_node + 1}" for r in range(ranks)]
    unit = "examples" if classifier else "tokens"
    t0 = time.time() - done * 0.5
    header = {"format": "ringpipe-monitor", "version": 1, "started": t0, "start_step": 0, "steps": steps,
              "model": "mlp" if classifier else "gpt2", "unit": unit, "items_per_step": 4096,
              "precision": "float32", "world": ranks, "layout": layout,
              "ranks": [{"rank": r, "node": node[r], "dp": r % layout["dp"], "pp": 0, "tp": 0} for r in range(ranks)],
              "interval": interval, "gemm_peak_flops_per_rank": 1e11,
              "straggler": {"ratio": 1.5, "intervals": 3}, "slurm": None}
    with open(os.path.join(folder, "monitor.json"), "w") as fh:
        json.dump(header, fh)
    lines, streak = [], 0
    for step in range(1, done + 1):
        # A synchronous step lasts as long as its slowest rank's: the others wait (comm).
        step_ms = (300.0 * (1.8 if straggler is not None else 1.0) + 60.0) + 10 * math.sin(step)
        rec = {"step": step, "time": t0 + step * 0.5, "loss": 4.0 * math.exp(-step / 30) + 1.0,
               "lr": 6e-4, "grad_norm": 1.0, "step_ms": step_ms, f"{unit}_per_s": 4096 / (step_ms / 1e3),
               "model_flops_per_s": 2e11, "mfu": 2e11 / (ranks * 1e11)}
        if step % val_every == 0 or step == steps:
            rec["val_loss"] = rec["loss"] + 0.1
            if classifier:
                confusion = [[8 if i == j else (1 if j == (i + 1) % 3 else 0) for j in range(3)] for i in range(3)]
                rec.update(val_accuracy=24 / 27, val_precision=[8 / 9] * 3, val_recall=[8 / 9] * 3,
                           val_confusion=confusion)
            else:
                rec["val_bpb"] = rec["val_loss"] / math.log(2) / 4.0
        if step % interval == 0 or step == steps:
            rows = []
            for r in range(ranks):
                compute = 300.0 * (1.8 if r == straggler else 1.0)
                comm = step_ms - compute - 20.0          # bubble, data and other below: 20 ms
                rows.append({"rank": r, "node": node[r], "step_ms": step_ms, "compute_ms": compute,
                             "comm_ms": max(comm, 1.0), "bubble_ms": 10.0, "data_ms": 5.0, "other_ms": 5.0,
                             "items_per_s": 4096 / (step_ms / 1e3) / layout["dp"], "rss_bytes": 1.0e9 + r * 1e7,
                             "peak_bytes": 1.2e9 + r * 1e7, "cpu_percent": 95.0 + r,
                             "net_rx_bytes_per_s": 2e6, "net_tx_bytes_per_s": 2e6})
            streak = streak + 1 if straggler is not None else 0
            rec.update(interval_steps=interval, ranks=rows,
                       stragglers=[{"rank": straggler, "node": node[straggler], "what": "compute", "ratio": 1.8,
                                    "intervals": streak}] if straggler is not None and streak >= 3 else [])
        lines.append(json.dumps(rec))
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        fh.write("\n".join(lines) + ("\n" if lines else ""))
    return header
