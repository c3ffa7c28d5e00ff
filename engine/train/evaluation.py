"""Validation: the loss on the validation split (every <eval_period> steps and at the end),
bits per byte for text, and what a classifier's validation says besides its loss.

The ranks agree on each validation batch before any uses it (engine/train/agreement.py),
as they do for training batches.
"""
from __future__ import annotations

import math

import numpy as np

from ringpipe import comm
from ringpipe.engine.train.agreement import agree_batch
from ringpipe.engine.train.assemble import Run


def sum_over_ranks(training: Run, local: float) -> float:
    """The loss summed over every rank (only the ranks that compute a loss add to it)."""
    buf = np.array([local])
    comm.allreduce(buf, training.world, op="sum")
    return float(buf[0])


def evaluate(training: Run) -> dict:
    """Validation loss (nats per item) and, for text, bits per byte: comparable across
    tokenizers, since a token covers bytes_per_token bytes of the text on average."""
    total = 0.0
    for i in range(training.cfg.eval_batches):
        try:
            batch, error = training.dataset.batch(i, training.cfg.batch_size, *training.rows, split="val"), None
        except (ValueError, OSError) as e:
            batch, error = None, e
        # Agreed before any rank uses it: one 8-byte all-reduce per validation batch,
        # next to the forward pass it guards (evaluation is not every step).
        agree_batch(training.world, error)
        total += training.model.forward_loss(*batch)
    val = {"val_loss": sum_over_ranks(training, total) / (training.cfg.eval_batches * training.items_per_step)}
    per_token = getattr(training.dataset, "bytes_per_token", lambda split: None)("val")
    if per_token:
        val["val_bpb"] = val["val_loss"] / math.log(2) / per_token
    return val
