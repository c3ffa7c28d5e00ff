"""Where a rank's step time goes: compute, exposed communication, pipeline bubble, data wait.

The layers and the loop already time their spans for traces: each is an event
(name, category, t0, t1) appended to a list (engine/parallel: LocalModel, the pipeline
executor, the tensor group, DataParallel; engine/train/run.py: the data wait, the
norm and the update). StepClock takes those events instead of a plain list, adds each
one's duration to its part of the split, and hands them on to the trace when one is
written (--trace):

    clock = StepClock(trace=tracer.events if tracing else None)
    clock.begin_step()
    ... layers append events ...
    split = clock.end_step(step_seconds)   # {"compute": s, "comm": s, "bubble": s, "data": s, "other": s}

Categories map onto the split (PART): "compute"; "comm", "allreduce" and "send" are
exposed communication (time the rank waited for a collective or a send to finish);
"recv" is the pipeline bubble (a stage waiting for its neighbour's activations or
gradients: the schedule's bubble, plus a slower neighbour); "data" is the wait for the
next batch. "other" is what no span covered (Python between the spans, bookkeeping):
the split adds up to the step time by construction, and a large "other" says a span is
missing.

A communication span inside a compute span (a tensor-parallel all-reduce inside a
layer's forward, a ZeRO-3 gather waited for inside one) is taken out of that compute
span, so compute is time the rank computed. Only the thread that made the clock counts:
a collective that runs on a communication thread overlaps compute and costs the step
only where the main thread waits for it (that wait is a span of its own).
"""
from __future__ import annotations

import threading
import time

PARTS = ("compute", "comm", "bubble", "data")
PART = {"compute": "compute", "comm": "comm", "allreduce": "comm", "send": "comm", "recv": "bubble",
        "data": "data"}


class StepClock:
    """A list-like sink for timed spans (append((name, category, t0, t1))) that keeps
    this rank's time split of the current step."""

    def __init__(self, trace: list | None = None):
        self.trace = trace                          # the Tracer's events, or None
        self._thread = threading.get_ident()
        self.step = dict.fromkeys(PARTS, 0.0)        # the current step's seconds per part
        self._inside: list[tuple[float, float, float]] = []    # (t0, t1, seconds) not yet inside a compute span

    def append(self, event) -> None:
        if threading.get_ident() != self._thread:
            return                                   # overlapped work: only its wait costs the step
        if self.trace is not None:
            self.trace.append(event)
        _, category, t0, t1 = event
        part = PART.get(category)
        if part is None:
            return
        seconds = t1 - t0
        if part == "compute":
            # Spans appended since the last compute span that lie inside this one ran
            # within it (a layer's own collective): already counted as what they are.
            seconds -= sum(s for a, b, s in self._inside if a >= t0 and b <= t1)
            self._inside.clear()
        else:
            self._inside.append((t0, t1, seconds))
        self.step[part] += max(0.0, seconds)

    def begin_step(self) -> None:
        for part in PARTS:
            self.step[part] = 0.0
        self._inside.clear()

    def end_step(self, step_seconds: float) -> dict:
        """This step's split in seconds; "other" is what no span covered."""
        split = dict(self.step)
        split["other"] = max(0.0, step_seconds - sum(split.values()))
        return split


class span:
    """`with span(clock, "next batch", "data"):` appends the block's span to `clock`."""

    __slots__ = ("clock", "name", "category", "t0")

    def __init__(self, clock, name: str, category: str):
        self.clock, self.name, self.category = clock, name, category

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.clock.append((self.name, self.category, self.t0, time.perf_counter()))
        return False
