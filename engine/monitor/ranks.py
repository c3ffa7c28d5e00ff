"""Every rank's numbers on rank 0, every N steps, in one small gather; stragglers named.

Each rank sums its step times and their split (clock.py) over an interval of N steps;
at the interval's last step every rank samples its resources (probes.py) and one
MPI_Gather of VALUES (a few float64s a rank: 112 bytes) brings them to rank 0, which
adds them to that step's metrics.jsonl record ("ranks", "stragglers": docs/monitoring.md)
and looks for stragglers. Nothing per rank is written anywhere per step.

N: `interval` steps, or "auto": after the second step of a (re)start (the first compiles
the kernels) the ranks agree on the slowest step time and take N so an interval lasts
about AUTO_SECONDS: a gather and a few /proc reads cost well under a millisecond, so the
overhead stays far below 1% of the step time, and `ringpipe top` still sees the job
move every few seconds. The last step of a run always gathers.

A straggler is a rank whose compute time (not its step time: in a synchronous step every
rank waits for the slowest, so the others show its delay as communication) stays at least
`ratio` x the median of its peers for `intervals` intervals in a row. Its peers are the
ranks of its pipeline stage (stages differ in work: the embedding, the head), or every rank
when each stage has a single rank. The same for a rank's data wait (when it is a notable
share of the step) and for its resident memory (when it is also at least 1 GiB above theirs).
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time

import numpy as np

from ringpipe import comm, threads
from ringpipe.engine.job.files import write_text_atomic
from ringpipe.engine.monitor.probes import Probe, allowed_cpus, cpu_seconds
from ringpipe.engine.monitor.read import FORMAT, header_path

VALUES = ("step_ms", "compute_ms", "comm_ms", "bubble_ms", "data_ms", "other_ms", "items_per_s", "rss_bytes",
          "peak_bytes", "cpu_percent", "net_rx_bytes_per_s", "net_tx_bytes_per_s", "gpu_util_percent",
          "gpu_mem_bytes")
SPLIT = ("compute", "comm", "bubble", "data", "other")
AUTO_SECONDS = 2.0
MAX_AUTO_INTERVAL = 1000
# A data wait below this share of the step is noise, however it compares with the others'.
DATA_SHARE_NOTED = 0.05
# Resident memory this much above the peers' median at least, besides the ratio: rank 0
# legitimately holds more (the sinks' libraries, the checkpoint it gathers), a few hundred MiB.
MEMORY_EXCESS_NOTED = 1 << 30


def auto_interval(step_seconds: float) -> int:
    return int(min(MAX_AUTO_INTERVAL, max(1, math.ceil(AUTO_SECONDS / max(step_seconds, 1e-6)))))


class Stragglers:
    """Which ranks stand out, interval after interval (rank 0)."""

    def __init__(self, ratio: float, intervals: int, peers: list[list[int]]):
        self.ratio, self.intervals, self.peers = ratio, intervals, peers
        self.streak: dict[tuple[int, str], int] = {}

    def _outliers(self, rows: list[dict]):
        """(rank, what, ratio) of this interval's outliers."""
        for group in self.peers:
            if len(group) < 2:
                continue
            for what, key in (("compute", "compute_ms"), ("data", "data_ms"), ("memory", "rss_bytes")):
                values = {r: rows[r][key] for r in group if key in rows[r]}
                if len(values) < 2:
                    continue
                for r, v in values.items():
                    # The median of the others: with two peers, the other one itself.
                    middle = statistics.median([u for q, u in values.items() if q != r])
                    if middle <= 0 or v < self.ratio * middle:
                        continue
                    if what == "data" and v < DATA_SHARE_NOTED * rows[r]["step_ms"]:
                        continue
                    if what == "memory" and v - middle < MEMORY_EXCESS_NOTED:
                        continue
                    yield r, what, v / middle

    def update(self, rows: list[dict]) -> tuple[list[dict], list[dict], list[tuple[int, str]]]:
        """(named now, newly named, no longer named) after this interval's rows."""
        seen = {(r, what): ratio for r, what, ratio in self._outliers(rows)}
        gone = [key for key, n in self.streak.items() if key not in seen and n >= self.intervals]
        self.streak = {key: self.streak.get(key, 0) + 1 for key in seen}
        named, new = [], []
        for (r, what), ratio in sorted(seen.items()):
            n = self.streak[(r, what)]
            if n >= self.intervals:
                entry = {"rank": r, "node": rows[r]["node"], "what": what, "ratio": round(ratio, 3), "intervals": n}
                named.append(entry)
                if n == self.intervals:
                    new.append(entry)
        return named, new, gone


def describe_straggler(entry: dict, interval: int) -> str:
    return (f"straggler: rank {entry['rank']} on node {entry['node']}, {entry['what']} "
            f"{entry['ratio']:.1f}x the median of its peers ({entry['intervals']} intervals of {interval} steps)")


class RankMonitor:
    """One per rank; collective where it says so (every rank calls it at the same steps)."""

    def __init__(self, world, *, out_dir: str, interval, ratio: float, intervals: int, coords: dict,
                 header: dict, say=None, note=None, gpu_index: int | None = None):
        """Collective. interval: steps between gathers, "auto", or 0 (no gathers: off).
        coords: this rank's {"dp", "pp", "tp"} indices. header: monitor.json's fields the
        trainer knows (steps, start_step, model, unit, items_per_step, ...). say(text): a fact
        (the interval chosen: Reporter.say, silent under quiet); note(text): a warning (a
        straggler named, or no longer one: Reporter.note, printed quiet or not)."""
        self.world, self.rank, self.size = world, world.Get_rank(), world.Get_size()
        self.out_dir = out_dir
        self.say, self.note = say or (lambda text: None), note or (lambda text: None)
        self.enabled = interval != 0
        self.interval = None if interval == "auto" else int(interval)
        self.agree_at = header["start_step"] + 2 if interval == "auto" else None
        self.steps = header["steps"]
        self.probe = Probe(gpu_index)
        self.t_start = time.perf_counter()
        self.cpu_start = cpu_seconds()
        self.sums = dict.fromkeys(SPLIT + ("step",), 0.0)
        self.count = 0
        self.totals = dict.fromkeys(SPLIT + ("step",), 0.0)
        self.total_steps = 0
        self.gpu_util = []
        node = socket.gethostname()
        # Once: who runs where (a few bytes a rank). The pid maps a launcher's "pid 1234 killed"
        # to its rank when a rank dies before it can say anything.
        table = world.gather((node, os.getpid(), coords), root=0)
        self.header = None
        if self.rank == 0:
            ranks = [{"rank": r, "node": n, "pid": pid, **c} for r, (n, pid, c) in enumerate(table)]
            stages: dict[int, list[int]] = {}
            for entry in ranks:
                stages.setdefault(entry.get("pp", 0), []).append(entry["rank"])
            peers = list(stages.values()) if any(len(g) > 1 for g in stages.values()) else [list(range(self.size))]
            self.stragglers = Stragglers(ratio, intervals, peers)
            self.nodes = [entry["node"] for entry in ranks]
            self.header = {"format": FORMAT, "version": 1, "started": time.time(), **header, "world": self.size,
                           "ranks": ranks, "interval": self.interval,
                           "straggler": {"ratio": ratio, "intervals": intervals}, "slurm": slurm_job()}
            self.write_header()

    def write_header(self) -> None:
        write_text_atomic(header_path(self.out_dir), json.dumps(self.header, indent=1) + "\n")

    # ---- every step, every rank --------------------------------------------------------------
    def step_done(self, done: int, step_s: float, split: dict, items_per_replica: int, record: dict) -> None:
        """Add this step to the interval; at an interval's end gather (collective) and, on
        rank 0, put the ranks' numbers and the stragglers into `record`."""
        for part in SPLIT:
            self.sums[part] += split[part]
            self.totals[part] += split[part]
        self.sums["step"] += step_s
        self.totals["step"] += step_s
        self.count += 1
        self.total_steps += 1
        if not self.enabled:
            return
        if done == self.agree_at:
            slowest = np.array([step_s])
            comm.allreduce(slowest, self.world, op="max")
            self.interval = auto_interval(float(slowest[0]))
            if self.rank == 0:
                self.header["interval"] = self.interval
                self.write_header()
                self.say(f"monitoring: per-rank numbers every {self.interval} steps (the slowest step {done} took "
                         f"{float(slowest[0]):.3g} s; about {AUTO_SECONDS:g} s an interval)")
        if done == self.agree_at or done == self.steps or (self.interval and done % self.interval == 0):
            self._gather(record, items_per_replica)

    def _gather(self, record: dict, items_per_replica: int) -> None:
        n = max(self.count, 1)
        mine = {f"{part}_ms": 1e3 * self.sums[part] / n for part in SPLIT}
        mine["step_ms"] = 1e3 * self.sums["step"] / n
        mine["items_per_s"] = items_per_replica * n / self.sums["step"] if self.sums["step"] > 0 else 0.0
        mine.update(self.probe.sample())
        if "gpu_util_percent" in mine:
            self.gpu_util.append(mine["gpu_util_percent"])
        vector = np.array([mine.get(k, math.nan) for k in VALUES], dtype=np.float64)
        table = np.empty((self.size, len(VALUES))) if self.rank == 0 else None
        self.world.Gather(vector, table, root=0)
        steps = self.count
        self.sums = dict.fromkeys(self.sums, 0.0)
        self.count = 0
        if self.rank != 0:
            return
        rows = []
        for r in range(self.size):
            row = {"rank": r, "node": self.nodes[r]}
            row.update({k: float(v) for k, v in zip(VALUES, table[r]) if not math.isnan(v)})
            rows.append(row)
        named, new, gone = self.stragglers.update(rows)
        for entry in new:
            self.note(describe_straggler(entry, steps))
        for r, what in gone:
            self.note(f"straggler no more: rank {r} on node {self.nodes[r]} ({what} back within "
                     f"{self.stragglers.ratio:g}x the median)")
        record.update(interval_steps=steps, ranks=rows, stragglers=named)

    # ---- the end of a run ------------------------------------------------------------------
    def totals_at_end(self) -> list[dict] | None:
        """Collective: every rank's totals for the job summary (rank 0; None elsewhere)."""
        wall = time.perf_counter() - self.t_start
        chosen = threads.apply_defaults()
        others_now, _ = threads.node_load(os.environ, chosen.ranks * chosen.per_rank, chosen.cores)
        mine = {"wall_s": wall, "cpu_s": cpu_seconds() - self.cpu_start, "cores": allowed_cpus(), "peak_bytes": float(self.probe.sample()["peak_bytes"]),
                "steps": self.total_steps, **{f"{part}_s": self.totals[part] for part in SPLIT},
                "threads": chosen.per_rank, "others_runnable": max(chosen.others, others_now)}
        if self.gpu_util:
            mine["gpu_util_percent"] = sum(self.gpu_util) / len(self.gpu_util)
        try:
            mine["cpus"] = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            pass
        gathered = self.world.gather(mine, root=0)
        if self.rank != 0:
            return None
        return [{"rank": r, "node": self.nodes[r], **values} for r, values in enumerate(gathered)]


def slurm_job(env=os.environ) -> dict | None:
    """The Slurm job this run is part of (None outside Slurm)."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return {"job_id": env["SLURM_JOB_ID"], "job_name": env.get("SLURM_JOB_NAME"),
            "nodelist": env.get("SLURM_JOB_NODELIST"), "cluster": env.get("SLURM_CLUSTER_NAME")}
