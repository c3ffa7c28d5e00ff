"""The data axis: replicas of the inner rank model, each on its rows of the batch.

DataParallel wraps the local or the pipeline model and owns:
- gradient reduction: GradBuckets all-reduce (average) buckets of gradients
  over the data axis while backward still runs (the inner model says when
  each gradient is final); done when the inner model's step says so; under
  ZeRO (any stage) they reduce-scatter them instead, each rank keeping its
  chunk of each bucket (engine/parallel/zero.py);
- the update: the whole buffer, or under ZeRO this rank's chunks (its
  optimizer state is those only), then, unless the parameters are sharded
  too (ZeRO-3), an all-gather of each bucket's parameters;
- the memory of what a rank does not keep: ZeRO-1 keeps the whole gradient
  buffer (the other chunks zeroed), ZeRO-2 gives theirs back to the OS, ZeRO-3
  the parameters' too (zero.py ShardedParams);
- checkpoint state: the chunks gathered on the first replica; only the first
  replica's pipeline gathers the arrays for world rank 0;
- identical replicas at a fresh start (a broadcast of the first replica).
With one data-parallel rank it adds nothing and communicates nothing.
"""
from __future__ import annotations

import time

import numpy as np

from ringpipe import comm
from ringpipe.comm.device import Transport, synchronize
from ringpipe.comm.ps import ordered_sum, server_norm_sq
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.optim import make_optimizer
from ringpipe.engine.parallel import NO_SYNC, GradSync
from ringpipe.engine.parallel import ps as ps_axis
from ringpipe.engine.parallel import slices
from ringpipe.engine.parallel.zero import ShardedParams, bucket_breaks, gather_chunks, owned_ranges

# ZeRO-3 cuts one bucket per unit (a layer's parameters), whatever its size.
_UNBOUNDED = 2**62


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
    def __init__(self, buckets, owned=None):
        self.on_ready = buckets.mark_ready
        self.finish = buckets.wait
        self.owned = owned          # ZeRO: the (lo, hi) this rank keeps of each bucket

    def kept(self, lo, hi):
        if self.owned is None:
            return [(lo, hi)]
        return [(max(lo, a), min(hi, b)) for a, b in self.owned if max(lo, a) < min(hi, b)]


class DataParallel:
    def __init__(self, inner, grid, zero=0, bucket_mb=None, overlap=True, gather_mode="use", trace=None,
                 canonical=False, seed=None):
        """seed: the inner model was built without its parameters' values (compose.py, under ZeRO-3):
        this axis draws them, under ZeRO-3 only the chunks this rank keeps (ParamBuffer.init's
        ranges: the values are the same in every layout), else all of them.

        canonical (--reduce-order canonical): every bucket is summed in one fixed pairwise tree
        over the replicas, ((r0 + r1) + (r2 + r3)) ..., by recursive doubling (comm/small.py: log2(dp)
        exchanges of the bucket, against the ring's 2(dp-1)/dp of it), whatever its size: with the
        inner model's pairwise micro-batch tree (LocalModel), the gradient's bits depend on the
        global batch and its micro-batches only, not on the number of replicas. Without a tensor
        axis the gradient norm is then the parameter server's (engine/parallel/ps.py): each of its
        chunks' float64 sum of squares, added in chunk order, so --sync ps gives the same bits."""
        self.inner, self.params = inner, inner.params
        self.trace = trace             # list-like to append (name, category, t0, t1), or None
        self.data_comm = grid.comm("data")
        self.dp, self.index = grid.size("data"), grid.index("data")
        self.stage = int(zero) if self.dp > 1 else 0        # the ZeRO stage (0: none)
        self.gather_mode = gather_mode
        self.buckets, self.sync, self.owned, self.sharded = None, NO_SYNC, None, None
        if self.dp > 1:
            bucket_bytes, first_bytes = bucket_sizes(bucket_mb, self.params.grad.nbytes)
            if self.stage == 3:
                bucket_bytes, first_bytes = _UNBOUNDED, None
            sharding = self.stage > 0
            breaks = bucket_breaks(inner.chains, self.params, inner.separate_ranges(), units=self.stage == 3) \
                if sharding else ()
            self.buckets = comm.GradBuckets(self.params.grad, self.params.ranges(), comm=self.data_comm,
                                            bucket_bytes=bucket_bytes, first_bucket_bytes=first_bytes,
                                            op="avg", overlap=overlap, algorithm="small" if canonical else "auto",
                                            collective="reduce_scatter" if sharding else "allreduce",
                                            breaks=breaks, on_reduced=self._keep_chunk if sharding else None)
            if sharding:
                self.owned = owned_ranges(self.buckets.buckets, self.dp, self.data_comm.Get_rank())
            self.sync = _BucketSync(self.buckets, self.owned)
            if self.stage == 3:
                self.sharded = ShardedParams(self.params, self.buckets.buckets, self.data_comm, inner.chains,
                                             gather_mode, overlap, trace=trace)
        if seed is not None:
            self.params.init(seed, ranges=self.owned if self.stage == 3 else None)
        self.auto_buckets = bucket_mb is None
        # --reduce-order canonical without a tensor axis: the norm over the PS's chunks (its bounds).
        self.norm_chunks = None
        if canonical and grid.size("tensor") == 1:
            layout = comm.ps_layout(self.params.size, self.params.grad.itemsize, [0], [0], ps_axis.CHUNK_BYTES)
            self.norm_chunks = [layout.bounds(c) for c in range(layout.n_chunks)]

    # ---- this rank's chunks ------------------------------------------------------------------
    def _keep_chunk(self, k):
        """Bucket k is reduce-scattered: the other ranks' chunks of it hold partial sums.
        Zero them (the norm sums every rank's chunks), and from ZeRO-2 on give their
        memory back."""
        lo, hi, _, _ = self.buckets.buckets[k]
        own_lo, own_hi = self.owned[k]
        for a, b in ((lo, own_lo), (own_hi, hi)):
            if self.stage == 1:
                self.params.grad[a:b] = 0
            else:
                self.params.release(self.params.grad, a, b)
        if self.params.xp is not np:
            # On a device the zeroing is queued on the bucket thread's own stream: it must be
            # done before wait() returns, or the norm (main stream) could read partial sums.
            synchronize(self.params.grad)

    def _unpack(self, packed, flat):
        at = 0
        for a, b in self.owned:
            flat[a:b] = packed[at:at + b - a]
            at += b - a

    # ---- a step ------------------------------------------------------------------------
    def zero_grad(self):
        if self.stage >= 2:       # memory too: backward takes only what it writes
            self.params.release(self.params.grad, 0, self.params.size)
        else:
            self.params.zero_grad()

    def forward_backward(self, x, y, grad_scale):
        if self.sharded:
            self.sharded.begin_step()
        loss = self.inner.forward_backward(x, y, grad_scale, sync=self.sync)
        if self.sharded:
            self.sharded.end_step()
        return loss

    def forward_loss(self, x, y):
        loss = self.inner.forward_loss(x, y)
        if self.sharded:
            self.sharded.end_step()
        return loss

    def grad_norm_sq(self):
        if self.norm_chunks is not None:          # the same on every replica, as the gradients are
            grad = to_host(self.params.grad)
            return ordered_sum(server_norm_sq([grad[lo:hi] for lo, hi in self.norm_chunks]))
        if self.owned is None:
            return self.inner.grad_norm_sq()      # the gradients are the same on every replica now
        # Each rank holds its chunks of the reduced gradients, zeros elsewhere: the
        # squares of its chunks, summed over the replicas, are the norm's.
        part = np.array([self.inner.grad_norm_sq()])
        t0 = time.perf_counter()
        comm.allreduce(part, self.data_comm, op="sum")
        self._event("norm all-reduce", "comm", t0)
        return float(part[0])

    def scale_grads(self, scale):
        """Multiply the gradients this rank updates from by `scale` (clipping)."""
        if scale == 1.0:
            return
        for a, b in self.owned or [(0, self.params.size)]:
            self.params.grad[a:b] *= scale

    def make_optimizer(self, name, weight_decay):
        mask = self.params.decay_mask(self.owned)
        return make_optimizer(name, len(mask), self.params.dtype, self.params.xp, mask, weight_decay)

    def update(self, opt, lr):
        # Under ZeRO the optimizer's state is this rank's chunks, packed one after another.
        opt.step(self.params.data, self.params.grad, lr, chunks=self.owned)
        if self.owned is not None and self.stage < 3:
            t0 = time.perf_counter()
            for lo, hi, _, _ in self.buckets.buckets:
                comm.allgather(self.params.data[lo:hi], self.data_comm)
            self._event("ZeRO parameter all-gather", "comm", t0)

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))

    def start_identical(self):
        # Every replica initialised identically from the seed; broadcasting the first
        # one's copy makes that a guarantee rather than an assumption. Not under ZeRO-3:
        # each rank drew only its own chunks (the init is the same in every layout), and
        # a broadcast of the whole buffer would back all of it on every rank again.
        if self.dp > 1 and self.stage != 3:
            Transport(self.params.xp).in_place(self.params.data, lambda buf: self.data_comm.Bcast(buf, root=0))
        if self.sharded:
            self.sharded.drop_all()

    # ---- checkpoint state ----------------------------------------------------------------
    def gather_state(self, opt):
        first = self.index == 0
        full = {}
        for state_name, buf in opt.state().items():
            if self.owned is None:
                full[state_name] = buf
                continue
            # Only the first replica holds the whole state, and only while it is written.
            flat = np.zeros(self.params.size, dtype=self.params.dtype) if first else None
            packed = to_host(buf)
            at = 0
            for (lo, hi, _, _), (a, b) in zip(self.buckets.buckets, self.owned):
                if first:
                    flat[a:b] = packed[at:at + b - a]
                gather_chunks(flat, lo, hi, packed[at:at + b - a], self.data_comm)
                at += b - a
            full[state_name] = flat
        if self.sharded:
            self.sharded.gather_to_first()
        # Every replica holds the same state: the first one's pipeline gathers it.
        arrays = self.inner.named_arrays(full) if first else {}
        if self.sharded:
            self.sharded.drop_all()
        return arrays

    def state_shapes(self, opt):
        return self.inner.named_shapes(opt.state_names)

    def restore_state(self, arrays, opt):
        full = self.inner.load_named(arrays, opt.state_names)
        if self.sharded:
            self.sharded.drop_all()
        for state_name, buf in opt.state().items():
            flat = full.pop(state_name)           # (its memory goes before the next is packed)
            if self.owned is not None:
                flat = np.concatenate([flat[a:b] for a, b in self.owned])
            buf[...] = self.params.xp.asarray(flat)

    # ---- reporting and shutdown -------------------------------------------------------------
    def describe(self):
        parts = [self.inner.describe()]
        if self.buckets:
            largest = max((hi - lo) * self.params.grad.itemsize for lo, hi, _, _ in self.buckets.buckets)
            reduction = "reduce-scatter ring" if self.owned is not None else \
                "all-reduce " + "/".join(sorted(set(self.buckets.algorithms)))
            sizing = " (one a layer: ZeRO-3's units)" if self.stage == 3 else \
                " (auto; --bucket-mb sets it)" if self.auto_buckets else ""
            parts.append(f"{len(self.buckets.buckets)} gradient bucket(s) of <= {largest / 2**20:.2f} MiB"
                         f"{sizing}, {reduction}")
            if self.buckets.cost_model is not None and self.owned is None:
                parts.append(self.buckets.cost_model.describe())
        if self.stage == 1:
            parts.append("zero-1: optimizer state 1/N")
        elif self.stage == 2:
            parts.append("zero-2: gradients and optimizer state 1/N")
        elif self.stage == 3:
            parts.append(f"zero-3: parameters, gradients and optimizer state 1/N; parameters gathered per layer "
                         f"({len(self.owned)} units), dropped after each {self.gather_mode}"
                         f"{', the next prefetched' if self.sharded.overlap else ''}")
        return " | ".join(p for p in parts if p)

    def summary(self):
        parts = [self.inner.summary()]
        if self.sharded:
            s = self.sharded
            exposed = (f"the compute waited {s.wait_s:.2f} s for them" if s.overlap
                       else "the compute waited for all of it (no gather thread: --no-overlap)")
            parts.append(f"zero-3: {s.gathers_per_step} parameter all-gathers a step "
                         f"({self.gather_mode} mode), {s.gather_s:.2f} s gathering in all; {exposed}")
        return "\n".join(p for p in parts if p)

    def notes(self):
        return self.inner.notes()

    def comm_hidden_fraction(self):
        """Share of this step's bucket reduction time hidden behind backward (None without buckets)."""
        return self.buckets.stats().get("hidden") if self.buckets else None

    def close(self):
        if self.sharded:
            self.sharded.close()
        if self.buckets:
            self.buckets.close()
        self.inner.close()

    # ---- sharded checkpoints (engine/parallel/slices.py) -------------------------------------
    def local_slices(self, opt):
        """What this rank holds of the checkpoint state and what it writes: under ZeRO its
        chunks (ZeRO-3: of the parameters too), else an equal share of the flat buffer per
        replica; never a range another rank writes the same values of."""
        excluded = self.inner.norm_excluded()
        if self.owned is not None:
            written = slices.subtract(self.owned, excluded)
        else:
            written = slices.share(self.params.size, self.dp, self.index, excluded)
        whole = [(0, self.params.size)]
        params = self.owned if self.stage == 3 else whole
        held = {"param": [(a, b, self.params.data[a:b]) for a, b in params]}
        for state_name, buf in opt.state().items():
            segments, at = [], 0
            for a, b in self.owned or whole:
                segments.append((a, b, buf[at:at + b - a]))
                at += b - a
            held[f"opt/{state_name}"] = segments
        return slices.LocalSlices(self.params, held, written)

    def restored_slices(self):
        """After slices.fill wrote this rank's ranges: ZeRO-3 keeps only its chunks."""
        if self.sharded:
            self.sharded.drop_all()
