"""ZeRO-2 and ZeRO-3 on the data axis: each replica keeps only its shard.

The flat buffers stay whole in address space (every layer keeps its views
into them), but on the host they are memory maps whose ranges are given back
to the OS when the rank does not need them (ParamBuffer.release): what a rank
holds in memory is what it keeps, not what the buffer could hold.

Shards. The gradient buckets (comm.GradBuckets, reduction order: model end
first) cut the flat buffer into pieces; each piece is split in N chunks
(comm.chunk_bounds) and data-parallel rank r keeps chunk r of every piece. The
same cut serves the gradients (a piece is reduce-scattered as soon as backward
has finished it), the optimizer state (packed: the chunks one after another),
and under ZeRO-3 the parameters (a piece is all-gathered before a layer that
reads it runs). Under ZeRO-3 a piece is a unit (FSDP's word): the parameters a
layer uses first, i.e. one transformer block, the embedding, the final norm and
head. A parameter that two pipeline ranks hold (the tied embedding) is always a
piece of its own, so both cut it alike and can sum their chunks of it.

    ZeRO-2  gradients: reduce-scatter per piece, the other chunks released;
            optimizer state 1/N; the update on the chunks kept, then each piece
            all-gathered: every rank holds all parameters again.
    ZeRO-3  as ZeRO-2, but the parameters stay sharded: ShardedParams gathers
            a layer's pieces just before it reads them (LayerChain's acquire /
            release hooks), prefetching the next layer's behind the compute.

When a gathered piece is dropped again is the user's choice (gather_mode):
    "use"   after each use (each micro-batch's forward, again for its backward):
            the least memory, 2 x micro-batches all-gathers per unit per step
            (FSDP's reshard-after-forward); a unit two layers read (the tied
            embedding) is kept until the step ends, gathered once;
    "step"  kept from its first use to the end of the step: one all-gather per
            unit per step, but every unit is in memory by the end of the step
            (torchtitan's choice with pipelines, whose many micro-batches would
            otherwise multiply the gathers).
Gradient accumulation keeps the gradients whole until the last micro-batch
(one reduce-scatter per piece per step, not one per micro-batch).

Every data-parallel rank issues the same collectives in the same order: the
buckets in bucket order (comm.GradBuckets), the gathers in the order the layers
ask for them, which the schedule makes the same on every replica.
"""
from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from ringpipe import comm
from ringpipe.engine.job.array_module import to_host

GATHER_MODES = ("use", "step")


def owned_ranges(buckets, dp, index):
    """(lo, hi) of the chunk this rank keeps of each bucket, in bucket order."""
    out = []
    for lo, hi, _, _ in buckets:
        a, b = comm.chunk_bounds(hi - lo, dp)[index]
        out.append((lo + a, lo + b))
    return out


def gather_chunks(flat, lo, hi, mine, data_comm, root=0):
    """Rank `root` of data_comm receives every rank's chunk of flat[lo:hi] (chunk_bounds)
    in place (its own is there already); the others send theirs (`mine`, host memory)
    and need no `flat` (None). For checkpoints: only one rank ever holds it all."""
    size, rank = data_comm.Get_size(), data_comm.Get_rank()
    bounds = comm.chunk_bounds(hi - lo, size)
    if rank != root:
        data_comm.Gatherv(np.ascontiguousarray(mine), None, root=root)
        return
    seg = flat[lo:hi]
    host = np.ascontiguousarray(to_host(seg))           # the segment itself on the host
    data_comm.Gatherv(MPI.IN_PLACE, [host, ([b - a for a, b in bounds], [a for a, _ in bounds]),
                                      from_numpy_dtype(host.dtype)], root=root)
    if host is not seg:
        seg[...] = host


def bucket_breaks(chains, params, separate, units):
    """Parameter indices that begin a bucket. separate: (lo, hi) ranges that must be
    pieces of their own (a parameter two pipeline ranks hold); units: also begin one
    at each layer's first parameter (ZeRO-3: a piece is a layer's unit)."""
    starts = [lo for lo, _ in params.ranges()]
    breaks = set()
    for lo, hi in separate:
        breaks.add(starts.index(lo))
        if hi in starts:
            breaks.add(starts.index(hi))
    if units:
        for chain in chains:
            for layer_params in chain.first_params_by_layer():
                if layer_params:
                    breaks.add(min(layer_params))
    return breaks


class ShardedParams:
    """ZeRO-3's parameters: this rank keeps its chunk of each piece in memory; the
    rest of a piece is gathered while a layer that reads it runs (LayerChain.residency)."""

    def __init__(self, params, buckets, data_comm, chains, gather_mode="use", overlap=True, trace=None):
        if gather_mode not in GATHER_MODES:
            raise ValueError(f"gather mode {gather_mode!r}: use one of {GATHER_MODES}")
        self.params, self.mode = params, gather_mode
        self.trace = trace             # list-like to append (name, category, t0, t1), or None
        self.pieces = [(lo, hi) for lo, hi, _, _ in buckets]
        self.owned = owned_ranges(buckets, data_comm.Get_size(), data_comm.Get_rank())
        piece_of = np.empty(len(params.specs), dtype=np.int64)
        for k, (_, _, first, last) in enumerate(buckets):
            piece_of[first:last + 1] = k
        # Which pieces each layer reads, per chain: every parameter it declares.
        self._reads = {}
        for chain in chains:
            self._reads[id(chain)] = [sorted({int(piece_of[params.index_of(s.name)]) for s in layer.specs()})
                                      for layer in chain.layers]
            chain.residency = self
        self._chains = list(chains)
        # A piece two layers read (the tied embedding: the embedding and the head) stays
        # from its first use to the step's end in every mode: dropping it between its
        # readers would gather it again twice a step, and it is often the largest unit.
        readers = [0] * len(self.pieces)
        for reads in self._reads.values():
            for layer_pieces in reads:
                for k in layer_pieces:
                    readers[k] += 1
        self.shared = {k for k, n in enumerate(readers) if n > 1}
        self.users = [0] * len(self.pieces)
        self.gathered = [False] * len(self.pieces)   # every chunk of the piece is in memory
        self.queued = [False] * len(self.pieces)      # asked for, not gathered yet
        self.gathers = self.step_gathers = 0           # all-gathers in all, and in the step under way
        # The all-gathers of the last training step (begin_step to end_step): what the gather
        # mode costs. An evaluation pass (end_step without begin_step) leaves it be.
        self.gathers_per_step = 0
        self._in_step = False
        self.gather_s = self.wait_s = 0.0
        # Gathers run on a communicator of their own, on a thread when MPI allows it,
        # so the next layer's pieces come while this layer computes.
        self.comm = data_comm.Dup()
        self.overlap = overlap and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._cond = threading.Condition()
        self._queue, self._error, self._stopping, self._busy = [], None, False, None
        self._thread = None
        if self.overlap:
            self._thread = threading.Thread(target=self._run, name="ringpipe-zero3-gathers", daemon=True)
            self._thread.start()

    # ---- LayerChain's hooks -------------------------------------------------------------
    def acquire(self, chain, i, direction=1):
        """Layer i of `chain` is about to read its parameters: gather its pieces (if not
        in memory) and wait for them; ask for the next layer's (i + direction) too."""
        reads = self._reads[id(chain)]
        for k in reads[i]:
            self.users[k] += 1
            self._ask(k)
        if 0 <= i + direction < len(reads):
            for k in reads[i + direction]:
                self._ask(k)
        self._wait(reads[i])

    def release(self, chain, i):
        for k in self._reads[id(chain)][i]:
            self.users[k] -= 1
            if self.mode == "use" and self.users[k] == 0 and not self.queued[k] and k not in self.shared:
                self._drop(k)

    # ---- the step -------------------------------------------------------------------------
    def begin_step(self):
        self.step_gathers = 0
        self._in_step = True

    def end_step(self):
        """Every piece back to this rank's chunk (the update changes only those)."""
        self._wait([k for k in range(len(self.pieces)) if self.queued[k]])
        for k in range(len(self.pieces)):
            if self.gathered[k]:
                self._drop(k)
        if self._in_step:
            self.gathers_per_step, self._in_step = self.step_gathers, False

    def gather_to_first(self):
        """Every parameter in memory on the first data-parallel rank only (a checkpoint
        is written from there); drop_all() afterwards."""
        first = self.comm.Get_rank() == 0
        for k, (lo, hi) in enumerate(self.pieces):
            own_lo, own_hi = self.owned[k]
            mine = to_host(self.params.data[own_lo:own_hi])
            gather_chunks(self.params.data if first else None, lo, hi, mine, self.comm)

    def drop_all(self):
        """Keep only this rank's chunks (after a load or a broadcast wrote them all)."""
        for k in range(len(self.pieces)):
            self.gathered[k] = True
        self.end_step()

    def close(self):
        stuck = False
        if self._thread is not None:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            self._thread.join(timeout=10)
            stuck = self._thread.is_alive()       # inside a gather a dead peer never finishes
            self._thread = None
        for chain in self._chains:
            chain.residency = None
        if self.comm != MPI.COMM_NULL and not stuck:     # never free a communicator in use
            self.comm.Free()

    # ---- internals ------------------------------------------------------------------------
    def _ask(self, k):
        if self.gathered[k] or self.queued[k]:
            return
        self.queued[k] = True
        self.gathers += 1
        self.step_gathers += 1
        if self._thread is None:
            self._gather(k)
            return
        with self._cond:
            self._queue.append(k)
            self._cond.notify_all()

    def _wait(self, pieces):
        pieces = [k for k in pieces if not self.gathered[k]]
        if not pieces:
            return
        t0 = time.perf_counter()
        with self._cond:
            while self._error is None and not all(self._done(k) for k in pieces):
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError("ZeRO-3: a parameter all-gather failed") from self._error
        for k in pieces:
            self.queued[k], self.gathered[k] = False, True
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        if self.trace is not None:
            self.trace.append(("ZeRO-3 gather wait", "comm", t0, t1))

    def _done(self, k):
        return k not in self._queue and self._busy != k

    def _gather(self, k):
        lo, hi = self.pieces[k]
        t0 = time.perf_counter()
        comm.allgather(self.params.data[lo:hi], self.comm)
        t1 = time.perf_counter()
        self.gather_s += t1 - t0
        if self.trace is not None:        # counted where it blocks the compute (without a gather thread)
            self.trace.append(("ZeRO-3 all-gather", "comm", t0, t1))
        if self._thread is None:
            self.queued[k], self.gathered[k] = False, True

    def _drop(self, k):
        lo, hi = self.pieces[k]
        own_lo, own_hi = self.owned[k]
        self.params.release(self.params.data, lo, own_lo)
        self.params.release(self.params.data, own_hi, hi)
        self.gathered[k] = False

    def _run(self):
        if self.params.xp is not np:
            self.params.data.device.use()       # cupy's current device is per thread
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._queue:
                        self._cond.wait()
                    if self._stopping:
                        return
                    k = self._busy = self._queue.pop(0)
                self._gather(k)
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()
        except BaseException as e:
            with self._cond:
                self._error, self._busy = e, None
                self._cond.notify_all()
            raise
