"""The data axis: replicas of the inner rank model, each on its rows of the batch.

DataParallel wraps the local or the pipeline model and owns:
- gradient reduction: GradBuckets all-reduce (average) buckets of gradients
  over the data axis while backward still runs (the inner model says when
  each gradient is final); done when the inner model's step says so;
- the update: the whole buffer, or under ZeRO-1 this rank's slice of it
  (its optimizer state is that slice only), then an all-gather of the
  parameters along the axis;
- checkpoint state: the ZeRO slices of the optimizer state gathered first; only
  the first replica's pipeline gathers the arrays for world rank 0;
- identical replicas at a fresh start (a broadcast of the first replica).
With one data-parallel rank it adds nothing and communicates nothing.
"""
from __future__ import annotations

import numpy as np

from ringpipe import comm
from ringpipe.comm.device import Transport
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.optim import make_optimizer
from ringpipe.engine.parallel import NO_SYNC, GradSync


def bucket_sizes(bucket_mb, grad_bytes):
    """(bucket bytes, first bucket bytes). Given bucket_mb: that size for every
    bucket. Auto: about an eighth of the gradients, within [256 KiB, 25 MiB], so
    a small model still gets several buckets to overlap with backward (one
    bucket as big as the model cannot start before backward ends); the first
    bucket (the model's last layers, ready first) at most 1 MiB, as in PyTorch
    DDP, so communication starts early."""
    if bucket_mb is not None:
        return max(1, int(bucket_mb * 2**20)), None
    size = int(min(25 * 2**20, max(256 * 2**10, grad_bytes / 8)))
    return size, min(size, 2**20)


class _BucketSync(GradSync):
    def __init__(self, buckets):
        self.on_ready = buckets.mark_ready
        self.finish = buckets.wait


class DataParallel:
    def __init__(self, inner, grid, zero=False, bucket_mb=None, overlap=True):
        self.inner, self.params = inner, inner.params
        self.data_comm = grid.comm("data")
        self.dp, self.index = grid.size("data"), grid.index("data")
        self.zero = zero and self.dp > 1
        # This rank updates (and keeps optimizer state for) this slice of the flat buffer.
        self.update_slice = comm.chunk_bounds(self.params.size, self.dp)[self.index] if self.zero \
            else (0, self.params.size)
        self.buckets, self.sync = None, NO_SYNC
        if self.dp > 1:
            bucket_bytes, first_bytes = bucket_sizes(bucket_mb, self.params.grad.nbytes)
            self.buckets = comm.GradBuckets(self.params.grad, self.params.ranges(), comm=self.data_comm,
                                            bucket_bytes=bucket_bytes, first_bucket_bytes=first_bytes,
                                            op="avg", overlap=overlap)
            self.sync = _BucketSync(self.buckets)
        self.auto_buckets = bucket_mb is None

    # ---- a step ------------------------------------------------------------------------
    def forward_backward(self, x, y, grad_scale):
        return self.inner.forward_backward(x, y, grad_scale, sync=self.sync)

    def forward_loss(self, x, y):
        return self.inner.forward_loss(x, y)

    def grad_norm_sq(self):
        return self.inner.grad_norm_sq()      # the gradients are the same on every replica now

    def make_optimizer(self, name, weight_decay):
        lo, hi = self.update_slice
        return make_optimizer(name, hi - lo, self.params.dtype, self.params.xp, self.params.wd_mask[lo:hi],
                              weight_decay)

    def update(self, opt, lr):
        lo, hi = self.update_slice
        opt.step(self.params.data[lo:hi], self.params.grad[lo:hi], lr)
        if self.zero:
            comm.allgather(self.params.data, self.data_comm)

    def start_identical(self):
        # Every replica initialised identically from the seed; broadcasting the first
        # one's copy makes that a guarantee rather than an assumption.
        if self.dp > 1:
            Transport(self.params.xp).in_place(self.params.data, lambda buf: self.data_comm.Bcast(buf, root=0))

    # ---- checkpoint state ----------------------------------------------------------------
    def gather_state(self, opt):
        full = {}
        for state_name, buf in opt.state().items():
            if self.zero:
                flat = np.zeros(self.params.size, dtype=self.params.dtype)
                flat[self.update_slice[0]:self.update_slice[1]] = to_host(buf)
                comm.allgather(flat, self.data_comm)
            else:
                flat = buf
            full[state_name] = flat
        # Every replica holds the same state: the first one's pipeline gathers it.
        return self.inner.named_arrays(full) if self.index == 0 else {}

    def state_shapes(self, opt):
        return self.inner.named_shapes(opt.state_names)

    def restore_state(self, arrays, opt):
        full = self.inner.load_named(arrays, opt.state_names)
        lo, hi = self.update_slice
        for state_name, buf in opt.state().items():
            buf[...] = self.params.xp.asarray(full[state_name][lo:hi])

    # ---- reporting and shutdown -------------------------------------------------------------
    def describe(self):
        parts = [self.inner.describe()]
        if self.buckets:
            largest = max((hi - lo) * self.params.grad.itemsize for lo, hi, _, _ in self.buckets.buckets)
            algorithms = "/".join(sorted(set(self.buckets.algorithms)))
            parts.append(f"{len(self.buckets.buckets)} gradient bucket(s) of <= {largest / 2**20:.2f} MiB"
                         f"{' (auto; --bucket-mb sets it)' if self.auto_buckets else ''}, all-reduce {algorithms}")
            if self.buckets.cost_model is not None:
                parts.append(self.buckets.cost_model.describe())
        if self.zero:
            parts.append("zero-1")
        return " | ".join(p for p in parts if p)

    def summary(self):
        return self.inner.summary()

    def notes(self):
        return self.inner.notes()

    def comm_hidden_fraction(self):
        """Share of this step's bucket all-reduce time hidden behind backward (None without buckets)."""
        return self.buckets.stats().get("hidden") if self.buckets else None

    def close(self):
        if self.buckets:
            self.buckets.close()
        self.inner.close()
