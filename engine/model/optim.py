"""Optimizers over flat buffers, global-norm clipping and the LR schedule.

Each optimizer updates the flat parameter buffer, or given chunks of it, with
state as long as what it updates: the whole buffer on one process, under ZeRO
this rank's chunks packed one after another (step's `chunks`). State is
exposed as named flat arrays for checkpoints.
"""
from __future__ import annotations

import math

from ringpipe import kernels as K


class AdamW:
    state_names = ("m", "v")

    def __init__(self, size, dtype, xp, wd_mask=None, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.beta1, self.beta2, self.eps, self.weight_decay = betas[0], betas[1], eps, weight_decay
        self.wd_mask = wd_mask
        self.m = xp.zeros(size, dtype=dtype)
        self.v = xp.zeros(size, dtype=dtype)
        self.step_count = 0

    def step(self, param, grad, lr, chunks=None):
        """chunks: the (lo, hi) of param and grad the state covers, in its order (None: all)."""
        self.step_count += 1
        for p, g, state, mask in _pieces(param, grad, chunks, (self.m, self.v), self.wd_mask):
            K.adamw_update(p, g, *state, lr=lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                           weight_decay=self.weight_decay, step=self.step_count, wd_mask=mask)

    def state(self):
        return {"m": self.m, "v": self.v}


class SGD:
    state_names = ("momentum_buf",)

    def __init__(self, size, dtype, xp, wd_mask=None, momentum=0.9, weight_decay=0.0):
        self.momentum, self.weight_decay, self.wd_mask = momentum, weight_decay, wd_mask
        self.momentum_buf = xp.zeros(size, dtype=dtype)
        self.step_count = 0

    def step(self, param, grad, lr, chunks=None):
        """chunks: the (lo, hi) of param and grad the state covers, in its order (None: all)."""
        self.step_count += 1
        for p, g, (buf,), mask in _pieces(param, grad, chunks, (self.momentum_buf,), self.wd_mask):
            K.sgd_momentum_update(p, g, buf, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay,
                                  wd_mask=mask)

    def state(self):
        return {"momentum_buf": self.momentum_buf}


def _pieces(param, grad, chunks, states, mask):
    """(param, grad, states, mask) views of each chunk: the updates are elementwise, so
    a step over the chunks one by one gives the bits of one step over them packed."""
    if chunks is None:
        yield param, grad, states, mask
        return
    at = 0
    for lo, hi in chunks:
        n = hi - lo
        yield (param[lo:hi], grad[lo:hi], tuple(s[at:at + n] for s in states),
               None if mask is None else mask[at:at + n])
        at += n


def make_optimizer(name, size, dtype, xp, wd_mask, weight_decay):
    """The learning rate is not the optimizer's: the schedule (lr_at) gives each step its own."""
    if name == "adamw":
        return AdamW(size, dtype, xp, wd_mask=wd_mask, weight_decay=weight_decay)
    if name == "sgd":
        return SGD(size, dtype, xp, wd_mask=wd_mask, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}: use adamw or sgd")


def clip_scale(norm_sq: float, max_norm: float) -> float:
    """Factor that brings the global gradient norm down to max_norm (1.0 when already below).
    Takes the squared norm so data-parallel and pipeline ranks can sum their parts first."""
    norm = math.sqrt(norm_sq)
    if max_norm <= 0 or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)


def clip(params, norm_sq: float, max_norm: float) -> None:
    """Scale the gradients in place so that their global norm is at most max_norm: the
    trainer's clipping (engine/train/run.py), which the benchmarks call as it is."""
    scale = clip_scale(norm_sq, max_norm)
    if scale != 1.0:
        params.grad *= scale


def lr_at(step, base_lr, warmup, total, min_ratio=0.1):
    """Linear warmup for `warmup` steps, then cosine decay to min_ratio*base_lr at `total`. step is 0-based."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
