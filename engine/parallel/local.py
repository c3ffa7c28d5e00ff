"""The whole model on this rank: one LayerChain, and micro-batch accumulation.

The inner rank model the data axis wraps when there is no pipeline: it
computes gradients and says when each one is final (sync.on_ready) so an
outer axis can reduce them while backward still runs; it reduces nothing
itself.
"""
from __future__ import annotations

import time

import numpy as np

from ringpipe import kernels as K
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.layers import bf16_step
from ringpipe.engine.parallel import NO_SYNC, load_named_state, named_state, state_shapes


def split_micro(arr, m):
    """m micro-batches of the rows of `arr`: equal in training (the caller checked
    divisibility); the last batch of a validation pass over a whole split may not divide,
    and then its rows are spread as evenly as they go (some one shorter, or empty), none left out."""
    return [arr[i * len(arr) // m:(i + 1) * len(arr) // m] for i in range(m)]


class LocalModel:
    """An inner model (engine/parallel/__init__.py InnerModel)."""

    def __init__(self, layers, dtype, seed, microbatches=1, xp=np, trace=None, canonical=False):
        """canonical: the micro-batches' gradients are summed in a fixed pairwise tree (each
        computed alone, then ((g0 + g1) + (g2 + g3)) ...), the tree the data axis continues
        across the replicas under --reduce-order canonical: the sum's bits then depend on the
        global micro-batches only, not on how many replicas computed them.
        seed None: the parameters are left unset (zero, their pages unbacked): an outer axis
        draws the part this rank keeps (ZeRO-3: engine/parallel/compose.py)."""
        self.xp = xp
        self.canonical = canonical and microbatches > 1
        self.chain = LayerChain(layers, dtype=dtype, xp=xp)
        if seed is not None:
            self.chain.params.init(seed)
        self.params = self.chain.params
        self.chains = [self.chain]
        self.m = microbatches
        self.trace = trace             # list to append (name, category, t0, t1), or None

    def forward_backward(self, x, y, grad_scale, sync=NO_SYNC):
        """Each micro-batch adds its share of the gradients; a parameter's gradient
        is final during the last micro-batch's backward."""
        loss = 0.0
        xs, ys = split_micro(self.xp.asarray(x), self.m), split_micro(self.xp.asarray(y), self.m)
        if self.canonical:
            return self._canonical_forward_backward(xs, ys, grad_scale, sync)
        with bf16_step(self.chains):       # under bf16: each weight rounded once for the step (layers.py BF16)
            for i in range(self.m):
                t0 = time.perf_counter()
                loss += self.chain.loss_and_grad(xs[i], ys[i], grad_scale,
                                                 on_ready=sync.on_ready if i == self.m - 1 else None)
                self._event(f"F+B {i}", "compute", t0)
        t0 = time.perf_counter()
        sync.finish()
        self._event("all-reduce wait", "allreduce", t0)
        return loss

    def _canonical_forward_backward(self, xs, ys, grad_scale, sync):
        """Each micro-batch's gradient computed into zeroed buffers, then added pairwise as a
        binary counter adds: a partial sum of 2^k micro-batches meets the one before it of the
        same size (at most log2(m) + 1 buffers). The reduction cannot start before the last
        addition: every gradient is final at once (sync.on_ready after the tree)."""
        loss, partials = 0.0, []            # [(level, buffer)], levels decreasing
        grad = self.params.grad
        with bf16_step(self.chains):
            for i in range(self.m):
                t0 = time.perf_counter()
                if i:
                    self.params.zero_grad()
                loss += self.chain.loss_and_grad(xs[i], ys[i], grad_scale)
                level, summed = 0, grad.copy()
                while partials and partials[-1][0] == level:
                    _, earlier = partials.pop()
                    summed = earlier + summed          # the earlier micro-batches first (one fixed tree)
                    level += 1
                partials.append((level, summed))
                self._event(f"F+B {i}", "compute", t0)
        # m is a power of two (the configuration checks it): one partial sum is left.
        grad[...] = partials.pop()[1]
        for index in range(len(self.params.specs)):
            sync.on_ready(index)
        t0 = time.perf_counter()
        sync.finish()
        self._event("all-reduce wait", "allreduce", t0)
        return loss

    def forward_loss(self, x, y):
        """Micro-batch by micro-batch, summed in the order the pipeline sums them,
        so one process and a pipeline evaluate to the same bits."""
        xs, ys = split_micro(self.xp.asarray(x), self.m), split_micro(self.xp.asarray(y), self.m)
        return sum((self.chain.loss(xs[i], ys[i]) for i in range(self.m)), 0.0)

    def separate_ranges(self):
        return []

    def grad_norm_sq(self, exclude=()):
        grad = self.params.grad
        return float(K.sum_of_squares(grad)) - sum(float(K.sum_of_squares(grad[a:b])) for a, b in exclude)

    def norm_excluded(self):
        return []

    def sum_norm(self, part):
        return part          # the whole model is here

    def named_arrays(self, opt_states):
        return named_state(self.params, opt_states)

    def named_shapes(self, state_names):
        return state_shapes(self.params, state_names)

    def load_named(self, arrays, state_names):
        return load_named_state(self.params, arrays, state_names)

    def notes(self):
        return []

    def describe(self):
        parts = [f"{self.m} micro-batches (gradient accumulation)" if self.m > 1 else "", self.chain.describe()]
        return " | ".join(p for p in parts if p)

    def summary(self):
        return ""

    def close(self):
        pass

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))
