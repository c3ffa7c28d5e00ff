"""Helpers of the emulated-node and emulated-Slurm tests (tests/slurm/test_nodes.py,
test_cluster.py): the losses a run logged, and an action taken once a run is training."""
import importlib.util
import os
import threading
import time

from tests.support import ROOT

_spec = importlib.util.spec_from_file_location("collect", os.path.join(ROOT, "slurm", "collect.py"))
_collect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_collect)


def losses(out: str) -> list[float]:
    """The run's loss per step from OUT/metrics.jsonl (a redone step: the later record
    counts, as slurm/collect.py reads it)."""
    return [rec["loss"] for rec in _collect.read_metrics(os.path.join(out, "metrics.jsonl"))]


def when_training(out: str, action, min_bytes: int, wait_s: float):
    """Start a thread that runs action() once OUT/metrics.jsonl holds min_bytes (or after
    wait_s). Returns (thread, result): result["at"] is when action ran, and result
    ["value"] what it returned."""
    result: dict = {}
    started = time.time()
    metrics = os.path.join(out, "metrics.jsonl")

    def run():
        while time.time() - started < wait_s and not (os.path.exists(metrics)
                                                       and os.path.getsize(metrics) > min_bytes):
            time.sleep(0.2)
        result["value"] = action()
        result["at"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result
