"""Runs one rank's list of schedule actions over MPI point-to-point.

The schedule (engine.schedules.schedule) decides the order; this module only
carries it out, one handler per action kind (the table in __init__), with the
semantics the simulator models:

  SEND_*       Isend, completed lazily (at the end of the step), never blocks
  RECV_*       posts an Irecv into a fresh buffer, never blocks
  F, B, I      block only on the receive they consume
  W            uses what I left behind on this rank
  REDUCE_GRAD  the gradients of this step are complete here: calls the
               owner's hook (the data-parallel all-reduce finishes, the tied
               embedding is summed)

Tags encode (micro-batch, receiving virtual stage, direction), so messages
for different micro-batches or chunks can never be confused. Activations
(`ctx`) are dropped the moment their B (or W) has run; the executor counts
what it holds so tests can assert GPipe holds m micro-batches and 1F1B at
most p - s. A forward-only schedule (evaluation) runs the same way with no
gradients and keeps nothing.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ringpipe.comm.device import Transport
from ringpipe.engine.schedules.schedule import B, F, I, RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, W


def nbytes(obj):
    """Bytes of arrays reachable from a ctx (tuples/lists of arrays and scalars)."""
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    return int(getattr(obj, "nbytes", 0))


class _Step:
    """What one run of the action list carries from action to action."""

    def __init__(self, inputs, targets, grad_scale, on_ready, reduce_grad):
        self.inputs, self.targets, self.grad_scale = inputs, targets, grad_scale
        self.on_ready, self.reduce_grad = on_ready, reduce_grad
        self.received = {RECV_F: {}, RECV_B: {}}   # (mb, chunk) -> (buffer, request)
        self.local = {F: {}, B: {}}                # p == 1: neighbour stages on this rank
        self.to_send = {}                          # (kind, mb, chunk) -> array awaiting its SEND
        self.sends = []                            # (request, array): arrays must live until sent
        self.ctxs, self.wctxs, self.held_bytes = {}, {}, {}
        self.loss = 0.0


class PipelineExecutor:
    def __init__(self, schedule, rank, comm, chunks, act_shape, dtype, trace=None, xp=np):
        """schedule: a validated Schedule; rank: this rank's index in the pipeline
        (= its rank in `comm`, the pipeline communicator); chunks: LayerChain per
        model chunk held here (chunk c is virtual stage c*p + rank); act_shape:
        shape of one micro-batch's activation, e.g. (mb_size, T, C)."""
        self.s, self.rank, self.comm, self.chunks = schedule, rank, comm, chunks
        self.act_shape, self.dtype = tuple(act_shape), np.dtype(dtype)
        self.actions = schedule.ranks[rank]
        self.n_stages = schedule.num_stages
        self.trace = trace                       # list to append (name, category, t0, t1), or None
        # Device activations go to MPI directly (CUDA-aware MPI) or through pinned host buffers.
        self.xp = xp
        self.transport = Transport(xp)
        tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
        if 2 * schedule.m * self.n_stages >= tag_ub:
            raise ValueError(f"{schedule.m} micro-batches x {self.n_stages} stages exceed MPI's tag range "
                             f"({tag_ub}); use fewer micro-batches")
        # The last backward of each chunk in this step: only there are its
        # parameters' gradients final (earlier micro-batches keep accumulating).
        self.final_backward = {}
        for i, a in enumerate(self.actions):
            if a.kind in (B, W):
                self.final_backward[a.chunk] = i
        self.peak_in_flight = 0
        self.peak_activation_bytes = 0
        self._handlers = {RECV_F: self._recv, RECV_B: self._recv, SEND_F: self._send, SEND_B: self._send,
                          F: self._forward, B: self._backward, I: self._backward_input, W: self._backward_weight,
                          REDUCE_GRAD: self._reduce_grad}

    # ---- one step ---------------------------------------------------------------------
    def run(self, inputs, targets, grad_scale=1.0, on_ready=None, reduce_grad=None):
        """Execute this rank's actions for one step. inputs/targets: per-micro-batch
        arrays (only the first / last virtual stage reads them). on_ready(i): the
        gradient of parameter i is final; reduce_grad(): at REDUCE_GRAD. Returns the
        summed loss of the micro-batches whose loss this rank computed (0.0 elsewhere)."""
        step = _Step(inputs, targets, grad_scale, on_ready, reduce_grad)
        for index, a in enumerate(self.actions):
            if a.is_compute and step.sends:
                # Large messages go by rendezvous, which only advances while the
                # sender is inside MPI: poke the progress engine before computing
                # (a shared-memory MPI copies the message right here: communication).
                t0 = time.perf_counter()
                MPI.Request.Testall([req for req, _ in step.sends])
                self._event("progress sends", "send", t0)
            self._handlers[a.kind](step, index, a)
        t0 = time.perf_counter()
        MPI.Request.Waitall([req for req, _ in step.sends])
        self._event("wait sends", "send", t0)
        leftovers = [k for k in (*step.received.values(), step.ctxs, step.wctxs, step.to_send) if k]
        if leftovers:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule left unconsumed state {leftovers}")
        return step.loss

    # ---- the handlers, one per action kind ---------------------------------------------
    def _recv(self, step, index, a):
        t0 = time.perf_counter()
        peer, _ = self.s.peer(self.rank, a)
        buf = self.transport.recv_buffer(self.act_shape, self.dtype)
        req = self.comm.Irecv(buf, source=peer, tag=self._tag(a))
        step.received[a.kind][(a.mb, a.chunk)] = (buf, req)
        self._event(f"post {a}", "send", t0)        # posting a receive: communication, not the bubble

    def _send(self, step, index, a):
        t0 = time.perf_counter()
        peer, _ = self.s.peer(self.rank, a)
        data = self.transport.send_buffer(step.to_send.pop((a.kind, a.mb, a.chunk)))
        step.sends.append((self.comm.Isend(data, dest=peer, tag=self._tag(a)), data))
        self._event(str(a), "send", t0)

    def _forward(self, step, index, a):
        key, stage = (a.mb, a.chunk), self._stage(a.chunk)
        x = self._input(step, stage, key, F, str(a))
        t0 = time.perf_counter()
        last = stage == self.n_stages - 1
        out, ctx = self.chunks[a.chunk].forward(x, step.targets[a.mb] if last else None,
                                                grad_scale=step.grad_scale, need_grad=self.s.training)
        if self.s.training:
            step.ctxs[key] = ctx
            step.held_bytes[key] = nbytes(ctx)
            self._account(step.held_bytes)
        if last:
            step.loss += out
        elif self.s.p == 1:
            step.local[F][(a.mb, a.chunk + 1)] = out
        else:
            step.to_send[(SEND_F, a.mb, a.chunk)] = out
        self._event(str(a), "compute", t0)

    def _backward(self, step, index, a):
        self._backward_common(step, index, a, split=False)

    def _backward_input(self, step, index, a):
        self._backward_common(step, index, a, split=True)

    def _backward_common(self, step, index, a, split):
        key, stage = (a.mb, a.chunk), self._stage(a.chunk)
        dout = None if stage == self.n_stages - 1 else self._input(step, stage, key, B, str(a))
        t0 = time.perf_counter()
        chunk = self.chunks[a.chunk]
        if split:
            dx, step.wctxs[key] = chunk.backward_input(dout, step.ctxs.pop(key))
            step.held_bytes[key] = nbytes(step.wctxs[key])     # W still needs these
        else:
            dx = chunk.backward(dout, step.ctxs.pop(key), on_ready=self._ready_hook(step, index, a))
            step.held_bytes.pop(key)
        if stage > 0:
            if self.s.p == 1:
                step.local[B][(a.mb, a.chunk - 1)] = dx
            else:
                step.to_send[(SEND_B, a.mb, a.chunk)] = dx
        self._event(str(a), "compute", t0)

    def _backward_weight(self, step, index, a):
        t0 = time.perf_counter()
        key = (a.mb, a.chunk)
        self.chunks[a.chunk].backward_weight(step.wctxs.pop(key), on_ready=self._ready_hook(step, index, a))
        step.held_bytes.pop(key)
        self._event(str(a), "compute", t0)

    def _reduce_grad(self, step, index, a):
        if self.s.p > 1:
            # The stages reach the end of the schedule at different times (the last stage's
            # backward work ends first): the wait for the others is the schedule's drain, part of
            # its bubble. Waited for here (a barrier of the pipeline), it is counted as bubble, not
            # as the tied embedding's or the data axis's all-reduce that comes next.
            t0 = time.perf_counter()
            self.comm.Barrier()
            self._event("pipeline drain", "recv", t0)
        t0 = time.perf_counter()
        if step.reduce_grad is not None:
            step.reduce_grad()
        self._event("all-reduce", "allreduce", t0)

    # ---- helpers ------------------------------------------------------------------------
    def _ready_hook(self, step, index, a):
        """on_ready only for the chunk's last backward of the step: only then are its gradients final."""
        return step.on_ready if self.final_backward.get(a.chunk) == index else None

    def _stage(self, chunk):
        return self.s.stage(self.rank, chunk)

    def _tag(self, action):
        direction, mb, stage = self.s.message_key(self.rank, action)
        return (mb * self.n_stages + stage) * 2 + (0 if direction == "F" else 1)

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))

    def _input(self, step, stage, key, direction, label):
        """The activation (F) or output gradient (B/I) a compute consumes."""
        if direction == F and stage == 0:
            return step.inputs[key[0]]
        if self.s.p == 1:
            return step.local[direction].pop(key)
        buf, req = step.received[RECV_F if direction == F else RECV_B].pop(key)
        t0 = time.perf_counter()
        req.Wait()
        self._event(f"wait {label}", "recv", t0)
        return self.transport.received(buf)

    def _account(self, held_bytes):
        self.peak_in_flight = max(self.peak_in_flight, len(held_bytes))
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(held_bytes.values()))
