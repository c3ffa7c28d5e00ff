"""The pipeline axis: this rank's model chunks, stepped by a schedule.

Each pipeline rank holds v model chunks (virtual stages chunk * p + rank) on
one ParamBuffer and runs its action list through the executor, both for
training and, with a forward-only schedule, for evaluation. What the axis
owns besides:
- the tied embedding: the first and the last virtual stage both hold "wte"
  when they sit on different ranks; their gradients are summed between the
  two (after the data axis's all-reduce, or before its parameter server's
  push: GradSync.sum_separate_first), and the last one's copy is left out of
  the gradient norm;
- the gradient norm: every rank's part, summed over the pipeline;
- checkpoint state: each rank's named arrays gathered on pipeline rank 0.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ringpipe import comm, kernels as K
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.layers import bf16_step
from ringpipe.engine.parallel import NO_SYNC, load_named_state, named_state, state_shapes
from ringpipe.engine.parallel.local import split_micro
from ringpipe.engine.model.params import ParamBuffer
from ringpipe.engine.schedules import forward_only, make_schedule, validate
from ringpipe.engine.parallel.pipeline.executor import PipelineExecutor
from ringpipe.engine.parallel.pipeline.partition import balanced, measure_layer_costs, uniform


class PipelineModel:
    """An inner model (engine/parallel/__init__.py InnerModel)."""

    def __init__(self, layers_fn, grid, dtype, seed, schedule_name, microbatches, chunks, act_shape,
                 partition="uniform", cost_batch=None, xp=np, trace=None, tensor=None):
        """layers_fn(tensor): the model's layers (this rank's shards of them for a tensor group).
        seed None: the parameters are left unset: an outer axis draws the part this rank keeps
        (ZeRO-3: engine/parallel/compose.py)."""
        p, v = grid.size("pipe"), chunks
        rank = grid.index("pipe")
        self.grid, self.m, self.xp = grid, microbatches, xp
        self.pipe_comm = grid.comm("pipe")
        self.schedule = make_schedule(schedule_name, p, microbatches, v)
        validate(self.schedule)
        layers = layers_fn(tensor)
        n_stages = p * v
        if partition == "balanced":
            # Measured on one rank (whole layers: it runs alone) and broadcast: every rank must agree on the cut.
            # Its batch is read there too: a read that fails (a bad token id, a damaged shard)
            # is sent with the costs, so every rank raises it instead of waiting in the bcast.
            costs = error = None
            if grid.rank == 0:
                try:
                    costs = measure_layer_costs(layers_fn(None), cost_batch, dtype)
                except (ValueError, OSError) as e:
                    error = str(e)
            costs, error = grid.world.bcast((costs, error), root=0)
            if error:
                raise ValueError(error)
            self.bounds = balanced(costs, n_stages)
        else:
            self.bounds = uniform(len(layers), n_stages)
        mine = [layers[slice(*self.bounds[c * p + rank])] for c in range(v)]
        self.params = ParamBuffer([s for chunk in mine for layer in chunk for s in layer.specs()], dtype, xp)
        if seed is not None:
            self.params.init(seed)
        self.chunks = [LayerChain(chunk, params=self.params, has_head=(c * p + rank == n_stages - 1))
                       for c, chunk in enumerate(mine)]
        self.executor = PipelineExecutor(self.schedule, rank, self.pipe_comm, self.chunks, act_shape, dtype,
                                         trace=trace, xp=xp)
        evaluation = forward_only(p, microbatches, v)
        validate(evaluation)
        self.evaluator = PipelineExecutor(evaluation, rank, self.pipe_comm, self.chunks, act_shape, dtype, xp=xp)

        first_rank, last_rank = 0, (n_stages - 1) % p
        self._tied, self._tied_index, self._duplicate, self._tied_comm = [], set(), [], None
        if first_rank != last_rank:
            holds_wte = "wte" in self.params
            color = 0 if rank in (first_rank, last_rank) and holds_wte else MPI.UNDEFINED
            self._tied_comm = self.pipe_comm.Split(color, rank)
            if color == 0:
                self._tied = [self.params.offsets["wte"]]
                self._tied_index = {self.params.names().index("wte")}
                if rank == last_rank:
                    self._duplicate = list(self._tied)

    def forward_backward(self, x, y, grad_scale, sync=NO_SYNC):
        on_ready = sync.on_ready
        if sync.sum_separate_first and self._tied_index:
            # The tied embedding's gradient is final only once both ends' parts are summed.
            def on_ready(index):
                if index not in self._tied_index:
                    sync.on_ready(index)

        def gradients_complete():          # the schedule's REDUCE_GRAD
            if sync.sum_separate_first:
                for a, b in self._tied:
                    comm.allreduce(self.params.grad[a:b], self._tied_comm, op="sum")
                for index in sorted(self._tied_index):
                    sync.on_ready(index)
                sync.finish()
                return
            sync.finish()
            for a, b in self._tied:
                for lo, hi in sync.kept(a, b):     # (ZeRO-2/3: both ends keep the same chunk of it)
                    comm.allreduce(self.params.grad[lo:hi], self._tied_comm, op="sum")
        x, y = self.xp.asarray(x), self.xp.asarray(y)
        with bf16_step(self.chains):       # under bf16: each weight rounded once for the step (layers.py BF16)
            return self.executor.run(split_micro(x, self.m), split_micro(y, self.m), grad_scale,
                                     on_ready=on_ready, reduce_grad=gradients_complete)

    def forward_loss(self, x, y):
        x, y = self.xp.asarray(x), self.xp.asarray(y)
        return self.evaluator.run(split_micro(x, self.m), split_micro(y, self.m))

    @property
    def chains(self):
        return self.chunks

    def separate_ranges(self):
        return list(self._tied)

    def grad_norm_sq(self, exclude=()):
        grad = self.params.grad
        return self.sum_norm(K.sum_of_squares(grad) -
                             sum(K.sum_of_squares(grad[a:b]) for a, b in [*self.norm_excluded(), *exclude]))

    def norm_excluded(self):
        # The last stage's copy of the tied embedding is the first stage's: count it once.
        return list(self._duplicate)

    def sum_norm(self, part):
        norm_sq = np.array([part])
        t0 = time.perf_counter()
        comm.allreduce(norm_sq, self.pipe_comm, op="sum")
        if self.executor.trace is not None:     # the stages meet here: a faster one waits
            self.executor.trace.append(("norm all-reduce", "comm", t0, time.perf_counter()))
        return float(norm_sq[0])

    def named_arrays(self, opt_states):
        # Checkpointing is not a hot path: a pickled gather of named arrays is fine here.
        arrays = named_state(self.params, opt_states)
        parts = self.pipe_comm.gather(arrays, root=0)
        if self.grid.index("pipe") != 0:
            return {}        # only pipeline rank 0 holds the whole model (an outer axis need not join the rest)
        for part in parts:
            arrays.update(part)
        return arrays

    def named_shapes(self, state_names):
        return state_shapes(self.params, state_names)

    def load_named(self, arrays, state_names):
        return load_named_state(self.params, arrays, state_names)

    def notes(self):
        return []

    def describe(self):
        s = self.schedule
        micro = self.executor.act_shape[0]
        recompute = self.chunks[0].describe()          # every chunk has the same setting
        return (f"schedule {s.name}, {s.m} micro-batches of {micro}"
                f"{f', {s.v} chunks/rank' if s.v > 1 else ''} | stages (layers) {self.bounds}"
                f"{f' | {recompute}' if recompute else ''}")

    def summary(self):
        """What the pipeline held, for the end of the run (rank 0's line is printed)."""
        return (f"pipeline rank {self.grid.index('pipe')}: peak {self.executor.peak_in_flight} micro-batches in "
                f"flight, {self.executor.peak_activation_bytes / 2**20:.1f} MiB of activations")

    def close(self):
        if self._tied_comm is not None and self._tied_comm != MPI.COMM_NULL:
            self._tied_comm.Free()
