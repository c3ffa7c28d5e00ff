"""Optimizers over flat buffers, global-norm clipping and the LR schedule.

Each optimizer updates one contiguous slice of the flat parameter buffer with
state of the same length: the whole buffer on one process, this rank's slice
under ZeRO-1. State is exposed as named flat arrays for checkpoints.
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

    def step(self, param, grad, lr):
        self.step_count += 1
        K.adamw_update(param, grad, self.m, self.v, lr=lr,
                       beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                       weight_decay=self.weight_decay, step=self.step_count, wd_mask=self.wd_mask)

    def state(self):
        return {"m": self.m, "v": self.v}


class SGD:
    state_names = ("momentum_buf",)

    def __init__(self, size, dtype, xp, wd_mask=None, momentum=0.9, weight_decay=0.0):
        self.momentum, self.weight_decay, self.wd_mask = momentum, weight_decay, wd_mask
        self.momentum_buf = xp.zeros(size, dtype=dtype)
        self.step_count = 0

    def step(self, param, grad, lr):
        self.step_count += 1
        K.sgd_momentum_update(param, grad, self.momentum_buf, lr=lr,
                              momentum=self.momentum, weight_decay=self.weight_decay, wd_mask=self.wd_mask)

    def state(self):
        return {"momentum_buf": self.momentum_buf}


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
