"""Validation: the loss on the validation split (every <eval_period> steps and at the end),
bits per byte for text, and what a classifier's validation says besides its loss:
accuracy, per-class precision and recall, and the confusion matrix they come from.

The ranks agree on each validation batch before any uses it (engine/train/agreement.py),
as they do for training batches, and on whether a stop signal came (a long pass must
not keep a SIGTERM waiting: the job would be killed before its checkpoint). A
classifier's head counts its rows in plain numpy (engine/model/layers.py
ClassifierHead.confusion); the sum over the ranks is here.

A pass of a classification set walks its validation split in batches of <batch_size>
(engine/data/datasets.py), so no example is counted twice: <eval_batches> N batches (at
most the split), or all of it (the last batch holding what is left). By default a pass
takes 4 batches (config.py DEFAULT_EVAL_BATCHES), and a classifier's last one the whole split.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ringpipe import comm
from ringpipe.engine.job import lifecycle
from ringpipe.engine.job.errors import JobFailure
from ringpipe.engine.model.layers import ClassifierHead
from ringpipe.engine.train.agreement import agree_batch, stop_requested
from ringpipe.engine.train.assemble import Run
from ringpipe.engine.train.config import validation_pass


def sum_over_ranks(training: Run, local: float) -> float:
    """The loss summed over every rank (only the ranks that compute a loss add to it)."""
    buf = np.array([local])
    comm.allreduce(buf, training.world, op="sum")
    return float(buf[0])


def stop_agreed(training: Run) -> bool:
    """stop_requested (the step loop's collective stop check) inside a validation pass; a
    failure another rank reported ends the job as the step boundary would."""
    try:
        return stop_requested(training)
    except lifecycle.StopError as e:
        raise JobFailure(str(e)) from None


def evaluate(training: Run, final: bool = False) -> dict:
    """Validation loss (nats per item) and, for text, bits per byte: comparable across
    tokenizers, since a token covers bytes_per_token bytes of the text on average.
    A classifier (its recipe's `classifier`) adds val_accuracy, val_precision, val_recall
    and val_confusion (classifier_metrics). `final`: the run's last pass (a classifier's
    is the whole split unless <eval_batches> says otherwise).
    Returns {} on every rank when a stop signal came during the pass: the step loop then
    stops at its boundary, as after any step, with no validation for this one."""
    batches, examples = validation_pass(training.cfg, training.dataset, final)
    total = 0.0
    confusion = np.zeros((training.shape.n_classes,) * 2, dtype=np.int64) if training.recipe.classifier else None
    with counting(training, confusion):
        for i in range(batches):
            if stop_agreed(training):
                return {}
            try:
                batch, error = training.dataset.batch(i, training.cfg.batch_size, *training.rows, split="val"), None
            except (ValueError, OSError) as e:
                batch, error = None, e
            # Agreed before any rank uses it: one 8-byte all-reduce per validation batch,
            # next to the forward pass it guards (evaluation is not every step).
            agree_batch(training.world, error)
            total += training.model.forward_loss(*batch)
    val = {"val_loss": sum_over_ranks(training, total) / (examples * training.items_per_example)}
    per_token = getattr(training.dataset, "bytes_per_token", lambda split: None)("val")
    if per_token:
        val["val_bpb"] = val["val_loss"] / math.log(2) / per_token
    if confusion is not None:
        # Every rank's rows once: a data-parallel replica counted its own rows, a rank
        # without the head (a pipeline's earlier stages) added nothing.
        comm.allreduce(confusion, training.world, op="sum")
        val.update(classifier_metrics(confusion))
    return val


@contextlib.contextmanager
def counting(training: Run, confusion):
    """The heads this rank holds add the validation rows they see to `confusion` (None:
    nothing is counted); afterwards (a refused batch too) they count nothing again."""
    # The data axis is the outermost rank model; its inner model's chains hold the layers.
    heads = [layer for chain in training.model.inner.chains for layer in chain.layers
             if isinstance(layer, ClassifierHead)] if confusion is not None else []
    for head in heads:
        head.confusion = confusion
    try:
        yield
    finally:
        for head in heads:
            head.confusion = None


def classifier_metrics(confusion: np.ndarray) -> dict:
    """What a confusion matrix (rows: true class, columns: predicted class) says, as JSON
    values. A class never predicted has no precision, a class absent from the validation
    rows no recall: None (JSON null), not NaN, which strict JSON readers refuse."""
    right = np.diag(confusion)
    predicted, actual = confusion.sum(axis=0), confusion.sum(axis=1)
    return {"val_accuracy": float(right.sum() / confusion.sum()),       # a pass counts >= 1 row
            "val_precision": [float(r / n) if n else None for r, n in zip(right, predicted)],
            "val_recall": [float(r / n) if n else None for r, n in zip(right, actual)],
            "val_confusion": confusion.tolist()}
