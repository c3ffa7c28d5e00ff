"""The parameter server's modes that change the math (`--ps-mode ssp:S | async`), on
dedicated servers (`--ps-servers K >= 1`). `--ps-mode sync` (the default) is
engine/parallel/ps.py's ParameterServerData: the all-reduce's math exactly.

ssp:S, bounded staleness (BoundedStalenessPS). A worker does not wait for the
parameters its push produces: each step's pull lands in a buffer of its own
while the worker goes on, and step t computes on the parameters after update
max(t - S, d), d being the last drain (below). S = 0 is sync. The worker always
uses the oldest parameters the bound allows (the bound's worst case), never
"whatever has arrived": so a run repeats bit for bit, its trajectory does not
depend on the servers' count or the machine's timing, and the loss gap
measured against sync is the bound's. The servers do not change: each step is
summed over every worker in the fixed tree and updated (clipped by that
step's global norm) as in sync. What the worker sees of the norm is late: the
norm of step t arrives with its update, so grad_norm_sq at step t returns the
newest norm the worker has (that of step max(t - S, d) - 1; 0.0 before the
first): what the log and metrics show under ssp, and where a divergence is
caught, up to S steps after the step that diverged (the servers skip a
non-finite step's update in any mode).
Drains: validation and checkpoints first wait for every update in flight and
compute on the newest parameters; the steps after a drain restart the window
(as the first steps of a run do). A resumed run starts drained, as the
uninterrupted one is after the same checkpoint: the resume is bit-identical.
(A checkpoint that a signal asks for mid-interval drains where the
uninterrupted run did not; from there the two differ.)
Memory: up to S + 1 more copies of the parameters on each worker (the pulls in
flight); before a step overwrites its gradient buffer, the last step's pushes
must have left it (wait_sent: the servers took them).

async (AsynchronousPS). Each server applies each worker's gradient on its own
as it arrives (comm/ps.py serve_async): one optimizer update per worker push,
with lr_at(step) / n (n workers: a round of n updates moves about as far as
one sync update), and sends that worker its chunks so updated. The worker
clips its own gradient by its own norm, so it pushes after backward (the
norm needs the whole gradient), and the norm the trainer sees is the largest
of the workers' (one small all-reduce: every worker stops alike on a
non-finite one). Workers hold different parameters between updates: before
validation and checkpoints every worker fetches the servers' (FETCH). The
order of arrival, and so the bits, vary from run to run; the trainer's
per-step loss all-reduce keeps the workers within a step of each other, so a
gradient is at most about n - 1 updates old. Each server keeps one optimizer
per chunk (each counts its own updates: n per step; a resume sets them to n x
the steps); the checkpoint holds their state whole, as sync's does.

Both are labelled as changing the math in the run's header, its log and its
metrics (ps_mode, exact: false); benchmarks/ps_training.py measures their loss
gap against sync at equal steps.

Import rule: that of engine/parallel (its __init__.py).
"""
from __future__ import annotations

import time

import numpy as np

from ringpipe import comm
from ringpipe.engine.model.optim import clip_scale
from ringpipe.engine.parallel import GradSync
from ringpipe.engine.parallel.ps import _DATA_TAG, FETCH, STEP, ParameterServerData, _PushSync


class _NoPush(GradSync):
    """async: nothing leaves during backward (the worker clips its whole gradient first)."""


class BoundedStalenessPS(ParameterServerData):
    """ssp:S on dedicated servers (module docstring)."""

    def __init__(self, inner, grid, bound: int, overlap=True, trace=None, link=None):
        super().__init__(inner, grid, overlap=overlap, trace=trace, link=link)
        if link is None:
            raise ValueError("BoundedStalenessPS needs dedicated servers (a ServerLink)")
        self.bound = bound
        self._version = None           # the update the parameters hold (set at the first step)
        self._buffers: list = []       # pull buffers free for the next step
        self._landing: list = []       # the buffers of the steps in flight, oldest first
        self._last_norm_sq = 0.0

    def _step_index(self) -> int:
        return self._opt.step_count    # the updates counted: the trainer's step index

    def zero_grad(self):
        self.group.wait_sent()         # the last step's pushes still read the gradient buffer
        super().zero_grad()

    def _take(self) -> None:
        """The oldest step in flight: its parameters into the model's buffer."""
        norm_sq = self.group.wait_oldest()
        buf = self._landing.pop(0)
        self.params.data[...] = buf
        self._buffers.append(buf)
        self._version += 1
        self._last_norm_sq = norm_sq

    def drain(self) -> None:
        """Every update in flight taken: the newest parameters (validation, checkpoints)."""
        t0 = time.perf_counter()
        while self._landing:
            self._take()
        self._event("PS pulls in flight (drain)", "comm", t0)

    def forward_backward(self, x, y, grad_scale):
        self._pushed[:] = False
        self._start_servers()
        t = self._step_index()
        if self._version is None:
            self._version = t          # a fresh start or a resume: drained
        t0 = time.perf_counter()
        while self._version < t - self.bound:       # at most `bound` updates old
            self._take()
        self._event("PS pull (bounded staleness)", "comm", t0)
        if self.link.is_first_worker:
            self.link.tell(STEP, t)
        loss = self.inner.forward_backward(x, y, grad_scale, sync=_PushSync(self))
        buf = self._buffers.pop() if self._buffers else np.empty_like(self.params.data)
        self.group.start_pull(buf)
        self.group.end_step()
        self._landing.append(buf)
        return loss

    def forward_loss(self, x, y):
        self.drain()
        return super().forward_loss(x, y)

    def grad_norm_sq(self):
        return self._last_norm_sq

    def gather_state(self, opt):
        self.drain()
        return super().gather_state(opt)

    def describe(self):
        return (f"{super().describe()} | ps mode ssp:{self.bound} (changes the math): a step computes on "
                f"parameters {self.bound} update(s) old, drained at validation and checkpoints; the grad norm "
                f"shown is the newest one pulled")


class AsynchronousPS(ParameterServerData):
    """async on dedicated servers (module docstring)."""

    def __init__(self, inner, grid, grad_clip: float, overlap=True, trace=None, link=None):
        super().__init__(inner, grid, overlap=overlap, trace=trace, link=link, mode="async")
        if link is None:
            raise ValueError("AsynchronousPS needs dedicated servers (a ServerLink)")
        self.grad_clip = grad_clip
        self._own_norm_sq = 0.0
        self._fetched = True           # the parameters are the servers' (not one worker's pull)

    def forward_backward(self, x, y, grad_scale):
        self._start_servers()
        loss = self.inner.forward_backward(x, y, grad_scale, sync=_NoPush())
        # Its own gradient's norm: with a pipeline or tensor axis, over every stage and tensor
        # rank of its model (each part counted once): the inner model's, before any sync.
        self._own_norm_sq = self.inner.grad_norm_sq()
        return loss

    def grad_norm_sq(self):
        largest = np.array([self._own_norm_sq])
        t0 = time.perf_counter()
        comm.allreduce(largest, self.data_comm, op="max")
        self._event("norm all-reduce (largest)", "comm", t0)
        return float(largest[0])

    def scale_grads(self, scale):
        """The trainer's scale is from the largest norm: each worker clips by its own instead (update)."""

    def update(self, opt, lr):
        scale = clip_scale(self._own_norm_sq, self.grad_clip)
        if scale != 1.0:
            self.params.grad *= scale
        if self.link.is_first_worker:       # told only now: a step that diverged never pushes
            self.link.tell(STEP, opt.step_count)
        t0 = time.perf_counter()
        self.group.start_pull(self.params.data)
        self.group.push(self.params.grad, 0, self.params.size)
        self.group.wait_pull()
        self._event("PS push, asynchronous update and pull", "comm", t0)
        opt.step(self.params.data, self.params.grad, lr, chunks=self.owned)    # (none: counts the step)
        self._fetched = False

    def fetch(self) -> None:
        """Every worker gets the servers' parameters (collective over the workers)."""
        if self._fetched:
            return
        self._start_servers()
        t0 = time.perf_counter()
        link = self.link
        if link.is_first_worker:
            link.tell(FETCH)
        for i, server in enumerate(link.servers):
            for lo, hi in self._server_chunks(i):
                link.channel.Recv(self.params.data[lo:hi], source=server, tag=_DATA_TAG)
        self._fetched = True
        self._event("PS fetch of the servers' parameters", "comm", t0)

    def forward_loss(self, x, y):
        self.fetch()
        return super().forward_loss(x, y)

    def gather_state(self, opt):
        self.fetch()
        return super().gather_state(opt)

    def describe(self):
        return (f"{super().describe()} | ps mode async (changes the math): each worker's gradient applied "
                f"alone as it arrives (lr / {self.dp} each), clipped by its own norm")

