"""The rank model a layout needs, composed from the axes: the protocol
(parallel/__init__.py) knows none of them, this module knows them all."""
from __future__ import annotations

from ringpipe.engine.parallel.data import DataParallel
from ringpipe.engine.parallel.local import LocalModel
from ringpipe.engine.parallel.pipeline.stage import PipelineModel
from ringpipe.engine.parallel.ps import ParameterServerData
from ringpipe.engine.parallel.ps_modes import AsynchronousPS, BoundedStalenessPS
from ringpipe.engine.parallel.tensor import TensorGroup, TensorParallel


def build_rank_model(grid, layers_fn, cfg, dtype, xp, micro_shape, cost_batch, trace=None, servers=None):
    """This rank's model for the grid's layout: the pipeline (or local) model of
    this rank's (tensor-parallel: split) layers, wrapped by the tensor axis,
    then by the data axis (all-reduce, or --sync ps: the parameter server).
    layers_fn(tensor) builds the layers for a tensor group (None: whole layers).
    servers: --ps-servers K's ps.ServerLink (the grid is then the workers').

    Under ZeRO-3 the inner model is built without values and the data axis draws only the
    chunks this rank keeps (ParamBuffer.init's ranges): no rank holds the whole model at start."""
    sharded_start = cfg.sync != "ps" and cfg.zero == 3 and grid.size("data") > 1
    seed = None if sharded_start else cfg.seed
    tensor = None
    if grid.size("tensor") > 1:
        tensor = TensorGroup(grid.comm("tensor"), sequence_parallel=cfg.sequence_parallel,
                             overlap=cfg.tensor_overlap, trace=trace)
        if cfg.sequence_parallel:      # between the stages travel this rank's positions only
            micro_shape = (micro_shape[0], micro_shape[1] // tensor.size, *micro_shape[2:])
    if cfg.pipelined:
        inner = PipelineModel(layers_fn, grid, dtype, seed, cfg.schedule_name, cfg.microbatches, cfg.chunks,
                              act_shape=micro_shape, partition=cfg.partition_name, cost_batch=cost_batch, xp=xp,
                              trace=trace, tensor=tensor)
        if tensor is not None:
            # Zero-bubble W actions run the weight gradients later, in the bubbles.
            tensor.weight_grads_early = not inner.schedule.splits_backward
    else:
        inner = LocalModel(layers_fn(tensor), dtype, seed, cfg.microbatches, xp=xp, trace=trace,
                           canonical=cfg.reduce_order == "canonical")
    # Activation recomputation is each layer chain's: every chain this rank holds.
    # (auto is the trainer's choice from the model's shape, engine/train/assemble.py resolve_recompute; a
    # caller that builds a rank model itself with auto left in its Config keeps every activation.)
    for chain in (inner.chunks if cfg.pipelined else [inner.chain]):
        chain.set_recompute("none" if cfg.recompute == "auto" else cfg.recompute)
    if tensor is not None:
        inner = TensorParallel(inner, tensor, [s for layer in layers_fn(tensor) for s in layer.specs()])
    if cfg.sync == "ps":       # any inner model colocated; dedicated servers and ZeRO: the configuration's checks
        mode, bound = cfg.ps_mode_parts
        if mode == "ssp" and bound > 0:      # (dedicated servers: the configuration's checks)
            return BoundedStalenessPS(inner, grid, bound, overlap=not cfg.no_overlap, trace=trace, link=servers)
        if mode == "async":
            return AsynchronousPS(inner, grid, cfg.grad_clip, overlap=not cfg.no_overlap, trace=trace, link=servers)
        return ParameterServerData(inner, grid, overlap=not cfg.no_overlap, trace=trace, link=servers,
                                   streamed=cfg.grad_clip <= 0)
    return DataParallel(inner, grid, zero=cfg.zero, bucket_mb=cfg.bucket_mb, overlap=not cfg.no_overlap,
                        gather_mode=cfg.zero_gather_mode, trace=trace, canonical=cfg.reduce_order == "canonical",
                        seed=cfg.seed if sharded_start else None)
