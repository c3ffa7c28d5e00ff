"""The part of the model one rank holds, and how a training step runs on it.

`LocalModel`: every layer on this rank (no pipeline); gradient accumulation
over micro-batches when asked. `PipelineModel`: this rank's model chunks of a
DP x PP grid, stepped by a schedule through the executor. Both expose the
same small surface to the training loop:

    params                      the rank's flat ParamBuffer
    step(x, y, grad_scale, on_ready, reduce_grad) -> local loss sum (0 where no loss is computed)
    forward_loss(x, y)          -> local loss sum, no gradients
    duplicate_ranges            (lo, hi) of parameters that another stage also holds
                                (the tied embedding on the last stage): counted once in norms
    tied_ranges                 (lo, hi) whose gradients must be summed with `tied_comm`
"""
from __future__ import annotations

import time

import numpy as np

from ringpipe.engine.model import Stage
from ringpipe.engine.pipeline import make_schedule, validate
from ringpipe.engine.pipeline.executor import PipelineExecutor
from ringpipe.engine.pipeline.partition import balanced, measure_layer_costs, uniform
from ringpipe.engine.params import ParamBuffer


def split_micro(arr, m):
    return [arr[i * (len(arr) // m):(i + 1) * (len(arr) // m)] for i in range(m)]


class LocalModel:
    def __init__(self, layers, dtype, seed, microbatches=1, xp=np):
        self.xp = xp
        self.stage = Stage(layers, dtype=dtype, xp=xp)
        self.stage.params.init(seed)
        self.params = self.stage.params
        self.m = microbatches
        self.duplicate_ranges, self.tied_ranges, self.tied_comm = [], [], None
        self.is_loss_rank = True
        self.trace = None

    def step(self, x, y, grad_scale, on_ready=None, reduce_grad=None):
        loss = 0.0
        x, y = self.xp.asarray(x), self.xp.asarray(y)
        xs, ys = split_micro(x, self.m), split_micro(y, self.m)
        for i in range(self.m):
            t0 = time.perf_counter()
            loss += self.stage.loss_and_grad(xs[i], ys[i], grad_scale,
                                             on_ready=on_ready if i == self.m - 1 else None)
            if self.trace is not None:
                self.trace.append((f"F+B {i}", "compute", t0, time.perf_counter()))
        if reduce_grad is not None:
            t0 = time.perf_counter()
            reduce_grad()
            if self.trace is not None:
                self.trace.append(("all-reduce wait", "allreduce", t0, time.perf_counter()))
        return loss

    def forward_loss(self, x, y):
        return self.stage.loss(self.xp.asarray(x), self.xp.asarray(y))


class PipelineModel:
    def __init__(self, layers_fn, topo, dtype, seed, schedule_name, microbatches, chunks,
                 act_shape, partition="uniform", cost_batch=None, xp=np):
        from mpi4py import MPI
        p, v = topo.pp, chunks
        self.topo, self.m = topo, microbatches
        self.schedule = make_schedule(schedule_name, p, microbatches, v)
        validate(self.schedule)
        layers = layers_fn()
        n_stages = p * v
        if partition == "balanced":
            # Measured on one rank and broadcast: every rank must agree on the cut.
            costs = measure_layer_costs(layers_fn(), cost_batch, dtype) if topo.rank == 0 else None
            costs = topo.world.bcast(costs, root=0)
            self.bounds = balanced(costs, n_stages)
        else:
            self.bounds = uniform(len(layers), n_stages)
        mine = [layers[slice(*self.bounds[c * p + topo.stage])] for c in range(v)]
        self.xp = xp
        self.params = ParamBuffer([s for chunk in mine for layer in chunk for s in layer.specs()], dtype, xp)
        self.params.init(seed)
        self.chunks = [Stage(chunk, params=self.params, has_head=(c * p + topo.stage == n_stages - 1))
                       for c, chunk in enumerate(mine)]
        self.is_loss_rank = topo.stage == (n_stages - 1) % p
        self.trace = None
        self.executor = PipelineExecutor(self.schedule, topo.stage, topo.pp_comm, self.chunks, act_shape, dtype, xp=xp)

        # Tied embedding: the first and the last virtual stage each hold "wte" when
        # they sit on different ranks; their gradients are summed between the two.
        first_rank, last_rank = 0, (n_stages - 1) % p
        self.duplicate_ranges, self.tied_ranges, self.tied_comm = [], [], None
        tied = [name for name in self.params.names() if name == "wte"]
        if first_rank != last_rank:
            color = 0 if topo.stage in (first_rank, last_rank) and tied else MPI.UNDEFINED
            self.tied_comm = topo.pp_comm.Split(color, topo.stage)
            if color == 0:
                self.tied_ranges = [self.params.offsets[n] for n in tied]
                if topo.stage == last_rank:
                    self.duplicate_ranges = list(self.tied_ranges)

    def step(self, x, y, grad_scale, on_ready=None, reduce_grad=None):
        self.executor.trace = self.trace
        x, y = self.xp.asarray(x), self.xp.asarray(y)
        return self.executor.run(split_micro(x, self.m), split_micro(y, self.m), grad_scale,
                                 on_ready=on_ready, reduce_grad=reduce_grad)

    def forward_loss(self, x, y):
        """Forward only, one micro-batch through the chain of virtual stages."""
        from mpi4py import MPI
        p, comm, n = self.topo.pp, self.topo.pp_comm, len(self.bounds)
        transport = self.executor.transport
        x, y = self.xp.asarray(x), self.xp.asarray(y)
        h, sends = None, []
        loss = 0.0
        for c, chunk in enumerate(self.chunks):
            stage = c * p + self.topo.stage
            if stage == 0:
                h = x
            elif p > 1:
                h = transport.recv_buffer((len(x),) + self.executor.act_shape[1:], self.params.dtype)
                comm.Recv(h, source=(stage - 1) % p, tag=stage)
                h = transport.received(h)
            if stage == n - 1:
                loss += chunk.loss(h, y)
            else:
                h, _ = chunk.forward(h, need_grad=False)
                if p > 1:
                    buf = transport.send_buffer(h)
                    sends.append((comm.Isend(buf, dest=(stage + 1) % p, tag=stage + 1), buf))
        MPI.Request.Waitall([r for r, _ in sends])
        return loss
