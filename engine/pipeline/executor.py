"""Runs one rank's list of schedule actions over MPI point-to-point.

The schedule (engine.pipeline.schedule) decides the order; this module only
carries it out, with the semantics the simulator models:

  SEND_*  Isend, completed lazily (at the end of the step), never blocks
  RECV_*  posts an Irecv into a fresh buffer, never blocks
  F, B, I block only on the receive they consume
  W       uses what I left behind on this rank

Tags encode (micro-batch, receiving virtual stage, direction), so messages
for different micro-batches or chunks can never be confused. Activations
(`ctx`) are dropped the moment their B (or W) has run; the executor counts
what it holds so tests can assert GPipe holds m micro-batches and 1F1B at
most p - s.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ringpipe.comm.device import Transport
from ringpipe.engine.pipeline.schedule import B, F, I, OPT_STEP, RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, W


def nbytes(obj):
    """Bytes of arrays reachable from a ctx (tuples/lists of arrays and scalars)."""
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    return int(getattr(obj, "nbytes", 0))


class PipelineExecutor:
    def __init__(self, schedule, rank, comm, chunks, act_shape, dtype, trace=None, xp=np):
        """schedule: a validated Schedule; rank: this rank's index in the pipeline
        (= its rank in `comm`, the pipeline communicator); chunks: Stage per model
        chunk held here (chunk c is virtual stage c*p + rank); act_shape: shape of
        one micro-batch's activation, e.g. (mb_size, T, C)."""
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

    # ---- helpers ------------------------------------------------------------------
    def _stage(self, chunk):
        return self.s.stage(self.rank, chunk)

    def _tag(self, action):
        direction, mb, stage = self.s.message_key(self.rank, action)
        return (mb * self.n_stages + stage) * 2 + (0 if direction == "F" else 1)

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))

    # ---- one training step ----------------------------------------------------------
    def run(self, inputs, targets, grad_scale, on_ready=None, reduce_grad=None):
        """Execute this rank's actions for one step. inputs/targets: per-micro-batch
        arrays (only the first / last virtual stage reads them). Returns the summed
        loss of the micro-batches whose loss this rank computed (0.0 elsewhere)."""
        recv_f, recv_b = {}, {}          # (mb, chunk) -> (buffer, request)
        local_f, local_b = {}, {}        # p == 1: neighbour stages on this rank
        to_send = {}                     # (kind, mb, chunk) -> array awaiting its SEND
        sends = []                       # (request, array): arrays must live until sent
        ctxs, wctxs, held_bytes = {}, {}, {}
        loss = 0.0
        last_stage = self.n_stages - 1

        for index, a in enumerate(self.actions):
            key = (a.mb, a.chunk)
            if a.is_compute and sends:
                # Large messages go by rendezvous, which only advances while the
                # sender is inside MPI: poke the progress engine before computing.
                MPI.Request.Testall([req for req, _ in sends])
            t0 = time.perf_counter()
            if a.kind in (RECV_F, RECV_B):
                peer, _ = self.s.peer(self.rank, a)
                buf = self.transport.recv_buffer(self.act_shape, self.dtype)
                req = self.comm.Irecv(buf, source=peer, tag=self._tag(a))
                (recv_f if a.kind == RECV_F else recv_b)[key] = (buf, req)
            elif a.kind in (SEND_F, SEND_B):
                peer, _ = self.s.peer(self.rank, a)
                data = self.transport.send_buffer(to_send.pop((a.kind, a.mb, a.chunk)))
                sends.append((self.comm.Isend(data, dest=peer, tag=self._tag(a)), data))
                self._event(str(a), "send", t0)
            elif a.kind == F:
                stage = self._stage(a.chunk)
                x = self._input(stage, key, inputs, recv_f, local_f, str(a))
                t0 = time.perf_counter()
                out, ctx = self.chunks[a.chunk].forward(
                    x, targets[a.mb] if stage == last_stage else None, grad_scale=grad_scale)
                ctxs[key] = ctx
                held_bytes[key] = nbytes(ctx)
                self._account(held_bytes)
                if stage == last_stage:
                    loss += out
                elif self.s.p == 1:
                    local_f[(a.mb, a.chunk + 1)] = out
                else:
                    to_send[(SEND_F, a.mb, a.chunk)] = out
                self._event(str(a), "compute", t0)
            elif a.kind in (B, I):
                stage = self._stage(a.chunk)
                dout = None if stage == last_stage else self._input(stage, key, None, recv_b, local_b, str(a))
                t0 = time.perf_counter()
                chunk = self.chunks[a.chunk]
                if a.kind == B:
                    ready = on_ready if self.final_backward.get(a.chunk) == index else None
                    dx = chunk.backward(dout, ctxs.pop(key), on_ready=ready)
                    held_bytes.pop(key)
                else:
                    dx, wctxs[key] = chunk.backward_input(dout, ctxs.pop(key))
                    held_bytes[key] = nbytes(wctxs[key])     # W still needs these
                if stage > 0:
                    if self.s.p == 1:
                        local_b[(a.mb, a.chunk - 1)] = dx
                    else:
                        to_send[(SEND_B, a.mb, a.chunk)] = dx
                self._event(str(a), "compute", t0)
            elif a.kind == W:
                ready = on_ready if self.final_backward.get(a.chunk) == index else None
                self.chunks[a.chunk].backward_weight(wctxs.pop(key), on_ready=ready)
                held_bytes.pop(key)
                self._event(str(a), "compute", t0)
            elif a.kind == REDUCE_GRAD:
                if reduce_grad is not None:
                    reduce_grad()
                self._event("all-reduce", "allreduce", t0)
            elif a.kind == OPT_STEP:
                pass                      # the trainer steps the optimizer after clipping across stages

        t0 = time.perf_counter()
        MPI.Request.Waitall([req for req, _ in sends])
        self._event("wait sends", "send", t0)
        leftovers = [k for k in (recv_f, recv_b, ctxs, wctxs, to_send) if k]
        if leftovers:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule left unconsumed state {leftovers}")
        return loss

    def _input(self, stage, key, inputs, received, local, label):
        if inputs is not None and stage == 0:
            return inputs[key[0]]
        if self.s.p == 1:
            return local.pop(key)
        buf, req = received.pop(key)
        t0 = time.perf_counter()
        req.Wait()
        self._event(f"wait {label}", "recv", t0)
        return self.transport.received(buf)

    def _account(self, held_bytes):
        self.peak_in_flight = max(self.peak_in_flight, len(held_bytes))
        self.peak_activation_bytes = max(self.peak_activation_bytes, sum(held_bytes.values()))
