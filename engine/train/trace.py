"""Per-rank timelines in the Chrome trace / Perfetto JSON format.

Each rank records (name, category, t0, t1) from time.perf_counter(); times are
taken relative to a barrier at the start so ranks line up (to within the
barrier's exit skew, microseconds on one node). Each rank writes
DIR/trace_rank{R}.json; rank 0 merges them into DIR/trace.json, one row
(thread) per rank, so the pipeline bubbles show as gaps.
"""
from __future__ import annotations

import json
import os
import time


class Tracer:
    def __init__(self, directory, world):
        self.directory, self.world = directory, world
        self.events = []
        self.rank = world.Get_rank()
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
        world.Barrier()
        self.t_ref = time.perf_counter()

    @property
    def merged_path(self):
        return os.path.join(self.directory, "trace.json")

    def _chrome_events(self):
        return [{"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": self.rank,
                 "ts": (t0 - self.t_ref) * 1e6, "dur": (t1 - t0) * 1e6} for name, cat, t0, t1 in self.events]

    def write(self):
        os.makedirs(self.directory, exist_ok=True)
        mine = {"traceEvents": self._chrome_events() +
                [{"name": "thread_name", "ph": "M", "pid": 0, "tid": self.rank, "args": {"name": f"rank {self.rank}"}}]}
        with open(os.path.join(self.directory, f"trace_rank{self.rank}.json"), "w") as fh:
            json.dump(mine, fh)
        self.world.Barrier()
        if self.rank == 0:
            merged = []
            for r in range(self.world.Get_size()):
                with open(os.path.join(self.directory, f"trace_rank{r}.json")) as fh:
                    merged += json.load(fh)["traceEvents"]
            with open(self.merged_path, "w") as fh:
                json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, fh)
