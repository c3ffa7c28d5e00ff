"""The data axis as a colocated sharded parameter server (`--sync ps --ps-servers 0`).

ParameterServerData wraps the local model as DataParallel does and offers the
same RankModel surface, so the trainer drives it alike (compose.py picks it);
the communication is comm/ps.py's ParameterServerGroup over the data axis,
every replica both a worker and a server:

- the cut: the flat buffer in chunks of <= 4 MiB (comm.ps_layout), chunk c
  owned by data-parallel rank c % dp (interleaved: every layer's gradient is
  spread over all servers);
- backward: each parameter's gradient is pushed as it is final (the chunks it
  completes leave at once, to their owners; --no-overlap: all after backward);
- then each rank, as a server, sums the dp copies of its chunks in the fixed
  pairwise tree (comm/ps.py tree_sum: recursive doubling's order), averages,
  and the servers agree on the global norm: each chunk's float64 sum of squares,
  added in chunk order, the same bits on every rank whoever owns which chunk;
  the summed chunks are written into this rank's gradient buffer (the others
  zeroed, as under ZeRO-1);
- the trainer clips (scale_grads: the owned chunks) and updates: the optimizer
  steps over the owned chunks only (its state is theirs, packed, as ZeRO-1's),
  then every chunk's new parameters go from its owner to every rank (the pull).

Per step a rank sends (dp-1)/dp of the gradients and receives (dp-1)/dp of the
parameters: the ring all-reduce's 2(dp-1)/dp M. This is the first half of
issue 27; dedicated server ranks (--ps-servers K >= 1) reuse the same group
with other workers and servers, and are refused by the configuration for now.

Checkpoints: the optimizer state of the owned chunks gathered whole on the
first replica (point to point, chunk by chunk), restored from any layout's
arrays by taking the owned chunks: a PS run resumes an all-reduce run's
checkpoint and back.

Host (numpy) buffers only (comm/ps.py's); no pipeline, no tensor axis yet (the
configuration refuses them: a tied embedding's cross-stage sum, and the tensor
ranks' shards of the norm, must come before the push).

Import rule: that of engine/parallel (its __init__.py).
"""
from __future__ import annotations

import time

import numpy as np

from ringpipe import comm
from ringpipe.comm.device import Transport
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.optim import make_optimizer
from ringpipe.engine.parallel import GradSync

_STATE_TAG = 1          # the checkpoint gather's messages, on a communicator of their own
# The chunks' size, read when a model is built (tests make it small, so a small model
# has many chunks: chunks across parameters, every rank a server of several).
CHUNK_BYTES = comm.ps.CHUNK_BYTES


class _PushSync(GradSync):
    """Pushes each parameter's gradient as the inner model says it is final."""

    def __init__(self, model):
        self.model = model

    def on_ready(self, param_index):
        if self.model.overlap:
            self.model._push(param_index)

    def finish(self):
        for i in range(len(self.model.ranges)):
            self.model._push(i)


class ParameterServerData:
    """A RankModel (engine/parallel/__init__.py): the data axis over a colocated sharded PS."""

    def __init__(self, inner, grid, overlap=True, trace=None):
        self.inner, self.params = inner, inner.params
        self.trace = trace             # list-like to append (name, category, t0, t1), or None
        self.data_comm = grid.comm("data")
        self.dp, self.index = grid.size("data"), grid.index("data")
        if self.dp < 2:
            raise ValueError("ParameterServerData needs >= 2 data-parallel ranks (one rank has nothing to sum)")
        if self.params.xp is not np:
            raise ValueError("ParameterServerData: the parameter server moves host (numpy) buffers only")
        self.overlap = overlap
        self.stage = 0                 # nothing sharded between steps but the optimizer state (the harness asks)
        ranks = list(range(self.dp))
        self.group = comm.ParameterServerGroup(self.data_comm, ranks, ranks, self.params.size, self.params.dtype,
                                               chunk_bytes=CHUNK_BYTES, op="avg")
        self.layout = self.group.layout
        self.me = self.data_comm.Get_rank()
        self.owned_chunks = list(self.layout.owned_by(self.me))
        self.owned = [self.layout.bounds(c) for c in self.owned_chunks]    # the optimizer's chunks
        self.ranges = self.params.ranges()
        self._pushed = np.zeros(len(self.ranges), dtype=bool)
        self._norm_sq = None
        self.state_comm = self.data_comm.Dup()      # the checkpoint gather's point-to-point messages

    # ---- a step ------------------------------------------------------------------------
    def _push(self, i):
        if not self._pushed[i]:
            self._pushed[i] = True
            lo, hi = self.ranges[i]
            self.group.push(self.params.grad, lo, hi)

    def zero_grad(self):
        self.params.zero_grad()

    def forward_backward(self, x, y, grad_scale):
        self._pushed[:] = False
        loss = self.inner.forward_backward(x, y, grad_scale, sync=_PushSync(self))
        t0 = time.perf_counter()
        self._norm_sq = self.group.reduce()      # this rank as a server: its chunks summed, the global norm
        self.group.wait_pushes()                 # this rank's gradient has left: its buffer may be written
        grad, at = self.params.grad, 0
        for (lo, hi), summed in zip(self.owned, self.group.summed):
            grad[at:lo] = 0                      # what it does not own: not its to clip or update
            grad[lo:hi] = summed
            at = hi
        grad[at:] = 0
        self._event("PS push and reduce", "comm", t0)
        return loss

    def forward_loss(self, x, y):
        return self.inner.forward_loss(x, y)

    def grad_norm_sq(self):
        return self._norm_sq

    def scale_grads(self, scale):
        """Multiply the gradients this rank updates from (its chunks) by `scale` (clipping)."""
        if scale == 1.0:
            return
        for a, b in self.owned:
            self.params.grad[a:b] *= scale

    def make_optimizer(self, name, weight_decay):
        mask = self.params.decay_mask(self.owned)
        return make_optimizer(name, len(mask), self.params.dtype, self.params.xp, mask, weight_decay)

    def update(self, opt, lr):
        # The optimizer's state is this rank's chunks, packed one after another (as ZeRO-1's).
        opt.step(self.params.data, self.params.grad, lr, chunks=self.owned)
        t0 = time.perf_counter()
        data = self.params.data
        self.group.start_pull(data)
        # Copies: this rank pulls its own chunks into the same buffer (MPI's send and
        # receive buffers may not overlap); they stay alive until the next step's reduce.
        self.group.send_params([data[lo:hi].copy() for lo, hi in self.owned])
        self.group.wait_pull()
        self._event("PS parameter pull", "comm", t0)

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))

    def start_identical(self):
        # Every replica initialised identically from the seed; broadcasting the first
        # one's copy makes that a guarantee rather than an assumption.
        Transport(self.params.xp).in_place(self.params.data, lambda buf: self.data_comm.Bcast(buf, root=0))

    # ---- checkpoint state ----------------------------------------------------------------
    def _gather_to_first(self, packed):
        """The whole flat array on the first replica (None elsewhere) from every rank's
        packed owned chunks: each chunk sent by its owner, received in chunk order."""
        first = self.me == 0
        flat = np.zeros(self.params.size, dtype=self.params.dtype) if first else None
        offsets, pos = {}, 0
        for lo, hi in self.owned:
            offsets[lo], pos = pos, pos + hi - lo
        for c in range(self.layout.n_chunks):
            lo, hi = self.layout.bounds(c)
            owner = self.layout.owner(c)
            if owner == self.me:
                mine = packed[offsets[lo]:offsets[lo] + hi - lo]
                if first:
                    flat[lo:hi] = mine
                else:
                    self.state_comm.Send(np.ascontiguousarray(mine), dest=0, tag=_STATE_TAG)
            elif first:
                self.state_comm.Recv(flat[lo:hi], source=owner, tag=_STATE_TAG)
        return flat

    def gather_state(self, opt):
        full = {name: self._gather_to_first(to_host(buf)) for name, buf in opt.state().items()}
        # Every replica holds the same parameters: the first one gathers the arrays.
        return self.inner.named_arrays(full) if self.me == 0 else {}

    def state_shapes(self, opt):
        return self.inner.named_shapes(opt.state_names)

    def restore_state(self, arrays, opt):
        full = self.inner.load_named(arrays, opt.state_names)
        for state_name, buf in opt.state().items():
            flat = full.pop(state_name)           # (its memory goes before the next is packed)
            parts = [flat[a:b] for a, b in self.owned] or [flat[:0]]     # (a rank may own no chunk)
            buf[...] = self.params.xp.asarray(np.concatenate(parts))

    # ---- reporting and shutdown -------------------------------------------------------------
    def describe(self):
        lay = self.layout
        largest = lay.chunk_elements * lay.itemsize if lay.n_chunks > 1 else lay.n_elements * lay.itemsize
        parts = [self.inner.describe(),
                 f"parameter server, colocated and sharded over {self.dp} ranks: {lay.n_chunks} chunk(s) of "
                 f"<= {largest / 2**20:.2f} MiB, {len(self.owned)} owned here (their optimizer state only); "
                 f"gradients pushed {'as backward makes them' if self.overlap else 'after backward'}, "
                 f"parameters pulled after the update"]
        return " | ".join(p for p in parts if p)

    def summary(self):
        return self.inner.summary()

    def notes(self):
        return self.inner.notes()

    def comm_hidden_fraction(self):
        return None

    def close(self):
        self.group.free()
        self.state_comm.Free()
        self.inner.close()
