"""The parity harness: a layout of ranks trains exactly as one process does (invariant 1).

Every parity test (tests/engine/parallel/test_dp.py, test_pipeline.py, test_tensor.py,
tests/engine/train/test_prepared_training.py) asks the same three things of it, as
nanotron's tests ask init_distributed(tp, dp, pp):

    layouts(size, tp=(2, 4), pp=(1, 2))   the (dp, pp, tp) grids of those choices that fill `size` ranks
    ref = reference(cfg)                  cfg trained by one process (on COMM_SELF, on every rank)
    par = train(cfg2, world)              the same run on a layout of the world's ranks
    assert_same_run(par, ref, tol)        losses, validation, gradients, weights, checkpoint: equal

Both sides go through the library entry point, run(Config, world), as a user's run does;
`reference` keeps the one-process run of a configuration for the session, so the layouts
compared with it share one. tol: ~1e-10 in float64, ~1e-5 in float32 (sums in another order).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import numpy as np

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run


class Trained(NamedTuple):
    model: Any      # the rank model (its buffers stay readable after the run)
    out: str        # the run directory: metrics.jsonl, checkpoints/


def layouts(size: int, tp=(1,), pp=(1,), dp=(1, 2)) -> list:
    """(dp, pp, tp) for each tp, pp, dp given (in that nesting) whose product is `size`."""
    return [(d, p, t) for t in tp for p in pp for d in dp if d * p * t == size]


def train(cfg: Config, world) -> Trained:
    return Trained(run(cfg, world=world).model, cfg.out)


_references = {}


def reference(cfg: Config) -> Trained:
    """cfg trained by one process, on COMM_SELF (every rank runs its own, in cfg.out, which
    must be the rank's own folder). Kept for the session: a configuration that differs only
    in its folder gets the run already made."""
    from mpi4py import MPI
    key = json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "overwrite")},
                     sort_keys=True, default=str)
    if key not in _references or not os.path.isdir(_references[key].out):    # (a test's folder goes with it)
        _references[key] = train(cfg, MPI.COMM_SELF)
    return _references[key]


def metrics(out: str) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def losses(out: str) -> list:
    return [m["loss"] for m in metrics(out)]


def final_arrays(out: str) -> dict:
    """The last checkpoint's arrays: parameters and optimizer state, by full name."""
    return checkpoint.load(os.path.join(out, "checkpoints"))[0]


def assert_same_arrays(got: dict, expected: dict, tol: float, what: str = "") -> None:
    assert got.keys() == expected.keys(), f"{what}: {sorted(got.keys() ^ expected.keys())}"
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=tol, atol=tol, err_msg=f"{what} {k}".strip())


def _kept_elements(bounds, owned):
    """Indices, within the parameter at flat bounds (lo, hi), of the elements in `owned` ranges."""
    lo, hi = bounds
    return np.concatenate([np.arange(max(lo, a), min(hi, b)) - lo for a, b in owned if max(lo, a) < min(hi, b)]
                          or [np.zeros(0, dtype=np.int64)])


def assert_same_run(par: Trained, ref: Trained, tol: float, *, grad_norm: bool = False,
                    holdings: bool = True) -> dict:
    """par trained as ref did: the losses of every step, the last validation loss (when both
    record one), the grad norms (grad_norm: every parameter counted once, which sets the
    clipping), this rank's part of every gradient and weight it holds (holdings), and the
    final checkpoint whole. Returns par's checkpoint manifest."""
    par_m, ref_m = metrics(par.out), metrics(ref.out)
    np.testing.assert_allclose([m["loss"] for m in par_m], [m["loss"] for m in ref_m], rtol=tol, atol=tol,
                               err_msg="losses")
    if grad_norm:
        np.testing.assert_allclose([m["grad_norm"] for m in par_m], [m["grad_norm"] for m in ref_m], rtol=tol,
                                   err_msg="grad norms")
    if "val_loss" in par_m[-1] and "val_loss" in ref_m[-1]:
        np.testing.assert_allclose(par_m[-1]["val_loss"], ref_m[-1]["val_loss"], rtol=tol, err_msg="val_loss")
    if holdings:
        # Under ZeRO a rank keeps its chunks of the gradients (and from stage 3 of the
        # parameters): those are compared, the rest it does not hold.
        owned, stage = getattr(par.model, "owned", None), getattr(par.model, "stage", 0)
        for spec in par.model.params.specs:
            for view in ("grad_view", "view"):
                whole = getattr(ref.model.params, view)(spec.name)
                got = getattr(par.model.params, view)(spec.name)
                want = spec.split.take(whole) if spec.split else whole
                if owned is not None and (view == "grad_view" or stage == 3):
                    kept = _kept_elements(par.model.params.offsets[spec.name], owned)
                    got, want = np.asarray(got).reshape(-1)[kept], np.asarray(want).reshape(-1)[kept]
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{view} {spec.name}")
    par_arrays, manifest = checkpoint.load(os.path.join(par.out, "checkpoints"))
    assert_same_arrays(par_arrays, final_arrays(ref.out), tol, "checkpoint")
    return manifest


def assert_continues(tail: str, whole: str, resumed_at: int, steps: int, tol: float, what: str = "") -> None:
    """The run in `tail`, resumed from a checkpoint of step `resumed_at`, ended where the
    uninterrupted run in `whole` did: its final checkpoint (step `steps`) and the losses of
    the steps it ran."""
    arrays, manifest = checkpoint.load(os.path.join(tail, "checkpoints"))
    assert manifest["step"] == steps
    assert_same_arrays(arrays, final_arrays(whole), tol, what)
    np.testing.assert_allclose([m["loss"] for m in metrics(tail)], [m["loss"] for m in metrics(whole)][resumed_at:],
                               rtol=tol, atol=tol)


def job(ranks: int):
    """A communicator of the world's first `ranks` ranks (collective over the world; None on
    the others, which sit the run out): a layout smaller than the test's launch."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.rank < ranks else MPI.UNDEFINED, world.rank)
    return None if comm == MPI.COMM_NULL else comm

