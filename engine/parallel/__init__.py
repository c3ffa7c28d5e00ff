"""One module per parallel axis; the model a rank holds is a composition of them.

    local.py     LocalModel: every layer on this rank in one LayerChain, micro-batch
                 accumulation; no communication
    tensor.py    TensorParallel: the layers' matrices split over a tensor group (their
                 column- and row-parallel linears, vocabulary-parallel embedding and
                 cross-entropy, sequence parallelism); wraps the local or pipeline
                 model of those sharded layers
    pipeline/    PipelineModel (stage.py): this rank's model chunks of a pipeline, stepped
                 by a schedule through the executor (executor.py); the tied embedding
                 between the first and the last stage; evaluation through a forward-only
                 schedule; the partitioner that splits the layers (partition.py)
    data.py      DataParallel: wraps either one; gradient buckets all-reduced while
                 backward runs, or under ZeRO reduce-scattered, the update of this
                 rank's chunks, then an all-gather (ZeRO-3: parameters stay sharded)
    ps.py        ParameterServerData: the data axis as a parameter server (--sync ps),
                 colocated and sharded or on dedicated ranks: gradients pushed to the
                 owners of their chunks, summed there, the owners' update, the new
                 parameters pulled
    ps_modes.py  the parameter server's modes that change the math, on dedicated
                 servers: bounded staleness (--ps-mode ssp:S) and async
    zero.py      ZeRO's shards: the chunks a rank keeps, the unit cut, ShardedParams
                 (ZeRO-3's gathers around each layer's use, prefetched)
    compose.py   build_rank_model: DataParallel(TensorParallel(PipelineModel | LocalModel)),
                 or ParameterServerData(the same inner models), ps_modes.py's for ssp and async

Every rank model offers the same surface (RankModel below), so the trainer
knows nothing of buckets, tied communicators, duplicate ranges or shards.
The data axis, outermost, is the RankModel the trainer holds; what it wraps
(TensorParallel, PipelineModel, LocalModel) is an InnerModel: it takes the
outer axis's GradSync, leaves out the ranges the outer axis counts elsewhere,
and moves optimizer state as full flat arrays by state name (the data axis
owns the optimizer, and its ZeRO slices), under method names of its own.
Each axis says in one place how it reduces gradients, how it counts each
parameter once in the gradient norm, how it updates, and how it gathers and
restores checkpoint state by name.

Adding an axis: give the grid the axis (comm.ProcessGrid), write a module
here whose class implements RankModel (wrapping the rank model inside it, or
building the split layers, as tensor.py does both), and compose it in
compose.build_rank_model(): DataParallel(TensorParallel(PipelineModel | LocalModel)).
This file holds the protocol only, so the axes import it and it imports none of them.

Import rule (tests/test_architecture.py): model/, comm, kernels, schedules/, job/; never
train/, interop/, data/.
"""
from __future__ import annotations

from typing import Protocol

from ringpipe.engine.model.params import ParamBuffer


class GradSync:
    """How an outer axis reduces gradients while an inner one computes them.
    The default does nothing (no outer axis reduces anything)."""

    # Where the inner model sums its separate ranges (the tied embedding, between the
    # first and the last stage). False: after finish(), the parts kept() names (the
    # all-reduce reduces each end's copy over the data axis first). True: before finish(),
    # their on_ready held back until the sum is in, so the outer axis sees them final once
    # (the parameter server pushes a gradient as it is final: a sum after the push would
    # come too late).
    sum_separate_first = False

    def on_ready(self, param_index: int) -> None:
        """The gradient of parameter `param_index` (in the ParamBuffer) is final on this rank."""

    def finish(self) -> None:
        """Every gradient of this step is final: complete their reduction."""

    def kept(self, lo: int, hi: int) -> list:
        """After finish(): the (lo, hi) parts of [lo, hi) whose reduced gradients this rank
        holds (all of it, unless the outer axis shards the gradients: ZeRO-2/3)."""
        return [(lo, hi)]


NO_SYNC = GradSync()


class RankModel(Protocol):
    """What one rank holds of the model, and every parallel decision about it."""

    params: ParamBuffer          # this rank's flat parameters and gradients, with named views

    def forward_backward(self, x, y, grad_scale: float) -> float:
        """One step's forward and backward on this rank's rows of the batch. Returns
        this rank's loss sum (0.0 where it computes no loss); on return the gradients
        are reduced along every axis."""

    def forward_loss(self, x, y) -> float:
        """Loss sum without gradients (evaluation)."""

    def zero_grad(self) -> None:
        """Gradients to zero before a step (and, where they are sharded, their memory freed)."""

    def grad_norm_sq(self) -> float:
        """The squared global gradient norm, every parameter counted once, the same on every rank.
        (The inner models take `exclude`: (lo, hi) ranges an outer axis counts elsewhere.)"""

    def scale_grads(self, scale: float) -> None:
        """Multiply the gradients this rank updates from by `scale` (clipping)."""

    def make_optimizer(self, name: str, weight_decay: float):
        """An optimizer for the part of the parameters this rank updates."""

    def update(self, opt, lr: float) -> None:
        """Apply the optimizer step; afterwards every rank holds its current parameters."""

    def start_identical(self) -> None:
        """Fresh start: make the replicas' parameters identical (they were initialised alike; under
        ZeRO-3 each rank drew its own chunks and only drops what it does not keep)."""

    def gather_state(self, opt) -> dict:
        """Named host arrays of the parameters and the optimizer state ("param/<name>",
        "opt/<state>/<name>"), every array whole (its full, layout-independent shape):
        all of them on world rank 0, what is needed elsewhere."""

    def state_shapes(self, opt) -> dict:
        """{array name: shape} of the checkpoint arrays this rank restores: whole shapes,
        the same for every layout."""

    def restore_state(self, arrays: dict, opt) -> None:
        """Load parameters and optimizer state from named arrays (any layout's checkpoint).
        Consumes `arrays` (entries are removed as they are loaded, to free their memory)."""

    def describe(self) -> str:
        """The layout, for the run's start-up lines."""

    def notes(self) -> list[str]:
        """Warnings about the layout (a tensor group across nodes, ...), for the start-up lines."""

    def comm_hidden_fraction(self) -> float | None:
        """Share of the last step's overlapped gradient-reduction time hidden behind
        backward; None where nothing was overlapped."""

    def summary(self) -> str:
        """What the run used (pipeline memory, ...), for its last lines; may be empty."""

    def close(self) -> None:
        """Stop background threads, free communicators (collective)."""


class InnerModel(Protocol):
    """What an outer axis wraps: the tensor axis, the pipeline or the local model."""

    params: ParamBuffer          # this rank's flat parameters and gradients, with named views
    chains: list                 # the LayerChains over params (an outer axis may hook into them: ZeRO-3)

    def separate_ranges(self) -> list:
        """(lo, hi) ranges of params another rank of this axis holds too and sums its
        gradient with (the tied embedding): an outer axis that shards gradients must
        cut them as pieces of their own."""

    def forward_backward(self, x, y, grad_scale: float, sync: GradSync = NO_SYNC) -> float:
        """One step's forward and backward; sync.on_ready(i) as each gradient is final,
        sync.finish() once all are. Returns this rank's loss sum."""

    def forward_loss(self, x, y) -> float:
        """Loss sum without gradients (evaluation)."""

    def grad_norm_sq(self, exclude=()) -> float:
        """The squared gradient norm over this axis and those inside it, leaving out the
        (lo, hi) ranges of params.data in `exclude` (counted elsewhere)."""

    def norm_excluded(self) -> list:
        """(lo, hi) ranges of params this rank leaves out of the gradient norm because
        another rank of this axis, or of one inside it, counts them (the last stage's copy
        of the tied embedding; the replicated parameters on every tensor rank but the first).
        For an outer axis that takes its part of the norm itself (the parameter server:
        over the chunks it summed), then sums it with sum_norm."""

    def sum_norm(self, part: float) -> float:
        """This rank's part of the squared gradient norm (its gradients less norm_excluded()),
        summed over this axis and those inside it (collective): the whole model's."""

    def named_arrays(self, opt_states: dict) -> dict:
        """Named host arrays ("param/<name>", "opt/<state>/<name>") from the parameters
        and opt_states ({state name: flat array laid out like params.data}), every
        array whole: on this axis's first rank, {} elsewhere (collective)."""

    def named_shapes(self, state_names) -> dict:
        """{array name: whole shape} of the arrays load_named takes."""

    def load_named(self, arrays: dict, state_names) -> dict:
        """Load the parameters from named whole arrays; return the optimizer states
        {state name: flat host array laid out like params.data}."""

    def notes(self) -> list[str]:
        """Warnings about the layout, for the start-up lines."""

    def describe(self) -> str:
        """The layout, for the run's start-up lines (may be empty)."""

    def summary(self) -> str:
        """What the run used, for its last lines (may be empty)."""

    def close(self) -> None:
        """Stop background threads, free communicators (collective)."""


# ---- shared by the axes that hold a ParamBuffer (local, pipeline) ------------------------

def named_state(params: ParamBuffer, opt_state: dict) -> dict:
    """Host arrays by name: the parameters, and optimizer states given as flat
    arrays laid out like params.data (full size: ZeRO slices gathered first).
    The parameters are copies (ZeRO-3 drops what it gathered for them); the states
    are views: a checkpoint is written before the next update changes them, and
    a copy would double the whole optimizer state on the writing rank."""
    arrays = {f"param/{k}": v for k, v in params.state_dict(params.data).items()}
    for state_name, flat in opt_state.items():
        arrays.update({f"opt/{state_name}/{k}": v for k, v in params.state_dict(flat, copy=False).items()})
    return arrays


def state_shapes(params: ParamBuffer, state_names) -> dict:
    # Checkpoints hold whole parameters: a tensor-parallel rank reads the full array and takes its part.
    shapes = {f"param/{s.name}": s.full_shape for s in params.specs}
    shapes.update({f"opt/{state}/{s.name}": s.full_shape for state in state_names for s in params.specs})
    return shapes


def load_named_state(params: ParamBuffer, arrays: dict, state_names) -> dict:
    """Load the parameters from named arrays; return the optimizer states as full
    flat host arrays laid out like params.data. Consumes `arrays`: each entry is
    removed once loaded, so its memory goes while the next is laid out (a resume
    holds a whole stage's state on every rank for a moment)."""
    import numpy as np

    def take(prefix):
        named = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        for k in [k for k in arrays if k.startswith(prefix)]:
            del arrays[k]
        return named
    params.load_flat(params.data, take("param/"))
    full = {}
    for state_name in state_names:
        flat = np.zeros(params.size, dtype=params.dtype)
        params.load_flat(flat, take(f"opt/{state_name}/"), what=f"optimizer state {state_name}")
        full[state_name] = flat
    return full
