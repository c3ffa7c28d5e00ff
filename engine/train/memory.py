"""Memory per rank: predicted from the configuration before any work, measured after it.

    b = predict(cfg, shape, seq_len, dp)      # a Breakdown: bytes per item, the peak and its phase
    print(b.table())

What a rank holds, in bytes, with s the dtype's size, P the parameters this rank's
layers declare (after the pipeline and tensor splits), N the data-parallel size:

    parameters         s P; ZeRO-3: s P / N (plus the gathered units below)
    weight-decay mask  P (one byte a parameter: AdamW decays matrices only); ZeRO 1-3: P / N
    gradients          s P; ZeRO-2/3: s P / N once reduced (whole until the last
                       micro-batch's backward when there are several)
    optimizer state    2 s P (AdamW's m and v; SGD one buffer); ZeRO 1-3: / N
    activations        what the layers keep in their ctx from forward to backward
                       (engine/model/layers.py, llama.py; counted element by element
                       below), per micro-batch, times the micro-batches in flight
                       (the pipeline schedule's; one without a pipeline), plus one
                       block's backward working set
    gathered units     ZeRO-3: the parameters gathered for the layer in use and the
                       next one and the tied embedding's (--zero-gather use), or all of them (step)
    communication      the ring's receive slots: min(2, N - 1) x (largest bucket) / N
    fixed overhead     the interpreter, numpy, Numba's compiled kernels, MPI: measured
                       (FIXED_OVERHEAD_BYTES: how)

These are not all held at once. The peak is the largest of three phases:
    initialisation     every parameter written (ZeRO-3: this rank's chunks only), drawn
                       a block of INIT_BLOCK elements at a time in float64 (ParamBuffer.init)
    forward/backward   parameters, gradients, optimizer state, activations, units
    update             the optimizer steps over this rank's chunks in place: no copies
Each phase adds the fixed overhead, the mask and the communication buffers.

The float32/AdamW per-parameter figures are the ZeRO paper's: 16 (ZeRO-0), 8 + 8/N
(ZeRO-1), 4 + 12/N (ZeRO-2), 16/N (ZeRO-3), plus the mask's 1 (1/N under ZeRO).

Measured: VmHWM (/proc/self/status), the peak resident memory since the process
started; measured_peak() takes its maximum over the ranks. benchmarks/memory.py
compares the two for every ZeRO stage and recomputation mode.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ringpipe.engine.model.params import INIT_BLOCK
from ringpipe.engine.monitor.probes import peak_bytes, resident_bytes

# What a ringpipe rank holds before its model counts for anything: the interpreter,
# numpy, Numba and the kernels it compiled (loaded from its on-disk cache), mpi4py and
# MPICH's shared-memory buffers, the data loader. Measured 2026-12-02 on the 2-core VM
# (benchmarks/memory.py --baseline: a 1-layer, 64-wide GPT trained 3 steps, VmHWM minus
# that model's own prediction): 166, 169 and 171 MiB at 1, 2 and 4 ranks, rounded up. A
# first run that compiles the kernels (an empty Numba cache) holds more while LLVM works.
FIXED_OVERHEAD_BYTES = 176 * 2**20

# comm/ring.py: the ring receives into 2 chunk-sized slots while it reduces.
RING_SLOTS = 2
# engine/parallel/data.py bucket_sizes: auto buckets are ~1/8 of the gradients within these.
AUTO_BUCKET_MIN, AUTO_BUCKET_MAX, AUTO_FIRST_BUCKET = 256 * 2**10, 25 * 2**20, 2**20


def size_text(nbytes: float) -> str:
    """GiB from 1 GiB up, MiB below (a small model's items would all read 0.00 GiB)."""
    if abs(nbytes) >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass
class Breakdown:
    """Predicted bytes of one rank (the rank that needs the most: pipeline ranks differ)."""
    items: dict = field(default_factory=dict)      # name -> bytes (each item's largest value)
    notes: dict = field(default_factory=dict)      # name -> how it was counted
    phases: dict = field(default_factory=dict)     # phase -> bytes held then (fixed overhead included)
    params: int = 0                                # P: parameters of that rank
    pipe_rank: int = 0
    # Checkpoints, outside the training peak: the rank that writes one holds the whole
    # model's state for a moment ("save"); a resume holds a stage's whole state on
    # every rank while it is laid out ("resume"). Not in phases: the steps never see it.
    checkpoint: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        """The predicted peak: the largest phase."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def table(self) -> list[str]:
        """The breakdown as lines: one per item, then the phases and the peak."""
        width = max(len(name) for name in self.items)
        lines = [f"  {name:<{width}}  {size_text(nbytes):>10}  {self.notes.get(name, '')}"
                 for name, nbytes in self.items.items()]
        lines.append("  " + ", ".join(f"{phase} {size_text(nbytes)}" for phase, nbytes in self.phases.items())
                     + f": peak {size_text(self.total)} ({self.peak_phase})")
        return lines

    def to_dict(self) -> dict:
        return {"items": dict(self.items), "phases": dict(self.phases), "checkpoint": dict(self.checkpoint),
                "total": self.total,
                "peak_phase": self.peak_phase, "params": self.params, "pipe_rank": self.pipe_rank}


# ---- parameters: what each rank's layers declare ----------------------------------------

def _split(name, size, shape_dims, tp):
    """Elements of a parameter on one tensor-parallel rank: matrices (and the embedding
    tables but the position one) are split tp ways, vectors kept whole (a bias of a
    column-parallel linear is split too, and small: left whole, an upper bound)."""
    if tp == 1 or shape_dims < 2 or name == "wpe":
        return size
    return -(-size // tp)


def stage_bounds(cfg, n_layers):
    """[(lo, hi)] of the layer list for each virtual stage (the uniform partition)."""
    from ringpipe.engine.parallel.pipeline.partition import uniform
    stages = cfg.pp * cfg.chunks
    if stages == 1:
        return [(0, n_layers)]
    return uniform(n_layers, stages)


# ---- activations: what the layers keep, element by element -------------------------------

def block_activations(shape, rows, T, tp=1, sp=False, recompute="none"):
    """(kept, working) bytes of one transformer block for `rows` sequences of T tokens:
    kept from its forward to its backward, and its backward's own working set (the
    gradients it makes, among them the largest weight gradient's product before it is
    added in: kernels' matmul(accumulate=True) makes one temporary; and under full
    recomputation the ctx it rebuilds). From what
    the ctx holds (engine/model/layers.py Block, llama.py LlamaBlock), in elements:
      GPT    x, ln1 out, x1, ln2 out: 4NC (+4N means/rstds), kept whole (/ tp under sp);
             qkv 3NC, attention out NC, MLP pre-GELU 4NC and out 4NC: 12NC / tp;
             the probabilities H T^2 a sequence / tp
      Llama  x, norm1 out, x1, norm2 out: 4NC (+2N); q, k and v (repeated to the H query
             heads) and the attention out: 4 N H hd; gate, up and their product 3NF; H T^2
    N = rows x T. selective leaves out H T^2 (and adds it to the working set), full keeps
    x alone and rebuilds the rest one block at a time."""
    N, C, H = rows * T, shape.d_model, shape.n_head
    s = 4                           # float32 bytes; the caller scales for float64
    probs = rows * H * T * T / tp
    if hasattr(shape, "d_ff"):      # the Llama family: grouped-query attention, SwiGLU
        hd = getattr(shape, "head_dim", C // H)
        stream, region = 4 * N * C + 2 * N, (4 * N * H * hd + 3 * N * shape.d_ff) / tp
        grads = N * C + (2 * N * shape.d_ff + 4 * N * H * hd + shape.d_ff * C) / tp
    else:
        stream, region = 4 * N * C + 4 * N, 12 * N * C / tp
        grads = N * C + (8 * N * C + 4 * C * C) / tp
    if sp:
        stream /= tp
    whole = stream + region + probs
    working = grads + probs          # the probabilities' gradient (datt) is as large as they are
    if recompute == "full":
        return s * (N * C / (tp if sp else 1)), s * (whole + working)
    if recompute == "selective":
        return s * (whole - probs), s * (working + probs)
    return s * whole, s * working


# <recompute> auto: selective where the attention probabilities (H T^2 a sequence) would be at
# least this share of what a block keeps. They are what PyTorch's SDPA and every flash-attention
# trainer never keep; computing them again costs QK^T and the softmax, about T / (36 C) of the
# block's compute: 4% at GPT-2 124M's T = 1024, C = 768, where they are half of the block. A
# small model's short sequences keep them (a fifth of the block at T = 128, C = 256, H = 8).
AUTO_SELECTIVE_SHARE = 1 / 3


def probabilities_share(shape, T) -> float:
    """The share of a block's kept activations that are its attention probabilities
    (block_activations with recompute none; 0 for a model without blocks)."""
    if not hasattr(shape, "n_head") or not T:
        return 0.0
    kept, _ = block_activations(shape, 1, T)
    return 4 * shape.n_head * T * T / kept


def recompute_of(cfg, shape, T) -> str:
    """The run's recomputation: <recompute> as given, or auto's choice for this shape and
    sequence length (selective at AUTO_SELECTIVE_SHARE, else none; none without blocks)."""
    mode = getattr(cfg, "recompute", "none") or "none"
    if mode != "auto":
        return mode
    blocks = getattr(getattr(cfg, "recipe", None), "blocks", False)
    return "selective" if blocks and probabilities_share(shape, T) >= AUTO_SELECTIVE_SHARE else "none"


def embedding_activations(rows, T):
    return 8 * rows * T             # the token ids (int64) it keeps for its backward


def head_activations(shape, rows, T, tp=1):
    """LMHead: the final norm's input, statistics (LayerNorm's mean and rstd, RMSNorm's rstd)
    and output, and the logits (their gradient, written over them): 2NC + 2N (N) + NV/tp
    elements, float32."""
    N = rows * T
    stats = 1 if hasattr(shape, "d_ff") else 2
    return 4 * (2 * N * shape.d_model + stats * N + N * shape.padded_vocab / tp)


def head_working(shape, rows, T, tp=1):
    """The head's backward working set: its weight gradient's product (V, C) before it is
    added into wte's (one temporary, kernels' matmul(accumulate=True)) and dh (N, C)."""
    return 4 * (shape.padded_vocab * shape.d_model / tp + rows * T * shape.d_model)


def in_flight(cfg, pipe_rank):
    """{chunk: micro-batches whose activations this pipeline rank holds at once, at the
    schedule's worst moment} (without a pipeline: one; micro-batches run one by one)."""
    if not cfg.pipelined:
        return {0: 1}
    from ringpipe.engine.schedules import make_schedule
    from ringpipe.engine.schedules.schedule import B, F, W
    schedule = make_schedule(cfg.schedule_name, cfg.pp, cfg.microbatches, cfg.chunks)
    held, worst = set(), {}
    best = 0
    for a in schedule.ranks[pipe_rank]:
        if a.kind == F:
            held.add((a.mb, a.chunk))
        elif a.kind in (B, W):        # I keeps the weight gradients' inputs until W
            held.discard((a.mb, a.chunk))
        if len(held) > best:
            best = len(held)
            worst = {}
            for _, chunk in held:
                worst[chunk] = worst.get(chunk, 0) + 1
    return worst or {0: 1}


# ---- the prediction -------------------------------------------------------------------------

def bucket_bytes(cfg, grad_bytes):
    """The gradient buckets' size (engine/parallel/data.py bucket_sizes)."""
    if cfg.bucket_mb is not None:
        return int(cfg.bucket_mb * 2**20)
    return int(min(AUTO_BUCKET_MAX, max(AUTO_BUCKET_MIN, grad_bytes / 8)))


def _buckets(param_bytes, cap):
    """Bucket sizes in bytes, greedy from the model's end (comm/buckets.py _make_buckets)."""
    out, current = [], 0
    for nbytes in reversed(param_bytes):
        if current and current + nbytes > cap:
            out.append(current)
            current = 0
        current += nbytes
    if current:
        out.append(current)
    return out


def predict(cfg, shape, seq_len, dp: int) -> Breakdown:
    """The bytes one rank holds for `cfg` on `shape` (the recipe's), data-parallel size `dp`:
    the pipeline rank that needs the most, each item at its largest."""
    candidates = [_predict_rank(cfg, shape, seq_len, dp, r) for r in range(cfg.pp)]
    return max(candidates, key=lambda b: b.total)


def _predict_rank(cfg, shape, seq_len, dp, pipe_rank) -> Breakdown:
    """One pipeline rank's bytes: each item (in the table's order) with how it was counted,
    then the phases that hold them and the checkpoints' moments."""
    s = np.dtype(cfg.dtype).itemsize
    zero = int(getattr(cfg, "zero", 0) or 0) if dp > 1 else 0
    layers = cfg.recipe.layers(shape, None)          # the layer objects only: no arrays are made
    bounds = stage_bounds(cfg, len(layers))
    mine = [c * cfg.pp + pipe_rank for c in range(cfg.chunks)]       # this rank's virtual stages
    units = _units(layers, bounds, mine, cfg.tp)
    P = sum(units.sizes)
    b = Breakdown(params=P, pipe_rank=pipe_rank)
    buckets = _gradient_buckets(cfg, s, P, zero, dp, units, _param_list(layers, bounds, mine, cfg.tp))
    _predict_parameters(b, s, P, zero, dp)
    _predict_gradients(b, cfg, s, P, zero, dp, buckets)
    _predict_optimizer_state(b, cfg, s, P, zero, dp)
    _predict_activations(b, cfg, shape, seq_len, dp, pipe_rank, layers, bounds, mine)
    _predict_gathered_units(b, cfg, s, P, zero, dp, units)
    _predict_buffers_and_overhead(b, dp, buckets)
    _predict_staging(b, cfg, s, P, dp)
    # An <init_from> folder is read box by box (each rank its own slices, hf_folder.TensorBoxes).
    _predict_phases(b, s, P, zero, dp, units.largest, read_blocks=bool(getattr(cfg, "init_from", None)))
    _predict_checkpoints(b, cfg, s, P, layers, units.largest)
    b.items = {k: int(v) for k, v in b.items.items()}
    b.phases = {k: int(v) for k, v in b.phases.items()}
    return b


@dataclass
class _Units:
    """The parameters one rank holds, layer by layer: ZeRO-3 gathers a layer's unit around its use."""
    sizes: list         # elements of each layer's unit (a tied parameter in the first layer that declares it)
    shared: set         # units a later layer reads again (the tied wte): ZeRO-3 keeps them all step
    largest: int        # elements of the largest parameter, whole: init draws a block of at most that


def _units(layers, bounds, mine, tp) -> _Units:
    """The units of this rank's layers (its virtual stages `mine`), tied parameters counted once."""
    seen, unit_sizes, largest_param = {}, [], 0
    shared = set()
    for stage in mine:
        lo, hi = bounds[stage]
        for layer in layers[lo:hi]:
            unit = 0
            for spec in layer.specs():
                n = _split(spec.name, spec.size, len(spec.shape), tp)
                largest_param = max(largest_param, spec.size)
                if spec.name not in seen:
                    seen[spec.name] = len(unit_sizes)
                    unit += n
                elif seen[spec.name] != len(unit_sizes):
                    shared.add(seen[spec.name])
            unit_sizes.append(unit)
    return _Units(sizes=unit_sizes, shared=shared, largest=largest_param)


def _gradient_buckets(cfg, s, P, zero, dp, units, param_elements):
    """Bytes of each gradient bucket the data axis reduces (none on one data rank): ZeRO-3
    buckets by unit, the others by parameter (`param_elements`, in buffer order)."""
    if dp <= 1:
        return []
    cap = bucket_bytes(cfg, s * P)
    if zero >= 3:
        return _buckets([u * s for u in units.sizes if u], cap)
    return _buckets([s * n for n in param_elements], cap)


def _predict_parameters(b, s, P, zero, dp):
    """The parameters (ZeRO-3: this rank's shard) and the weight-decay mask (ZeRO 1-3: its chunks)."""
    sharded = zero >= 1
    b.items["parameters"] = s * P / (dp if zero >= 3 else 1)
    b.notes["parameters"] = (f"{P:,} parameters x {s} B" + (f" / {dp} (ZeRO-3 shards)" if zero >= 3 else ""))
    b.items["weight-decay mask"] = P / (dp if sharded else 1)
    b.notes["weight-decay mask"] = "1 B a parameter" + (" updated here" if sharded else "")


def _predict_gradients(b, cfg, s, P, zero, dp, buckets):
    """The gradients: whole, or under ZeRO-2/3 this rank's chunks plus the buckets in flight."""
    if zero >= 2:
        whole = cfg.microbatches > 1
        grads = s * P if whole else s * P / dp
        # Backward holds the bucket it writes and the one being reduced whole (two largest).
        flying = 0 if whole else sum(sorted(buckets)[-2:])
        b.items["gradients"] = grads
        b.notes["gradients"] = ("whole until the last micro-batch's backward" if whole else
                                f"1/{dp} kept after each bucket's reduce-scatter")
        b.items["gradient buckets in flight"] = flying
        b.notes["gradient buckets in flight"] = "the two largest buckets, whole while backward fills them"
    else:
        b.items["gradients"] = s * P
        b.notes["gradients"] = "whole"


def _optimizer_states(cfg) -> int:
    """Buffers the optimizer keeps a parameter: AdamW's m and v, SGD's one."""
    return 2 if cfg.optimizer == "adamw" else 1


def _predict_optimizer_state(b, cfg, s, P, zero, dp):
    """The optimizer state (ZeRO 1-3 and a colocated parameter server: this rank's chunks; a
    worker beside dedicated servers: none) and the parameter pulls a worker holds in flight."""
    states = _optimizer_states(cfg)
    sharded = zero >= 1
    optimizer = states * s * P / (dp if sharded else 1)
    held = f" / {dp} (ZeRO-{zero})" if sharded else ""
    if getattr(cfg, "sync", "allreduce") == "ps" and dp > 1:
        # The parameter server: a colocated rank keeps its chunks' state (1/dp, as ZeRO-1),
        # a worker beside dedicated servers none (the servers hold it).
        dedicated = bool(getattr(cfg, "ps_servers", 0))
        optimizer = 0 if dedicated else states * s * P / dp
        held = " on the parameter servers, none here" if dedicated else f" / {dp} (--sync ps: this rank's chunks)"
    b.items["optimizer state"] = optimizer
    b.notes["optimizer state"] = f"{cfg.optimizer}: {states} x {s} B a parameter{held}"
    pulls = _pull_copies(cfg) if getattr(cfg, "sync", "allreduce") == "ps" and dp > 1 else 0
    if pulls:
        b.items["parameter pulls in flight"] = pulls * s * P
        b.notes["parameter pulls in flight"] = (f"{pulls} more cop{'ies' if pulls > 1 else 'y'} of the parameters: "
                                                "the pulls land beside the parameters in use")


def _predict_activations(b, cfg, shape, seq_len, dp, pipe_rank, layers, bounds, mine):
    """The activations: what one micro-batch's layers keep on each of this rank's chunks, times
    the schedule's micro-batches in flight, plus the largest backward working set."""
    s = np.dtype(cfg.dtype).itemsize
    tp, sp = cfg.tp, bool(cfg.sequence_parallel)
    rows = cfg.batch_size // dp // cfg.microbatches
    T = seq_len or 1
    recompute = recompute_of(cfg, shape, T)
    scale = s / 4
    per_chunk, working = {}, 0.0
    is_text = cfg.recipe.data == "tokens" and hasattr(shape, "n_head")
    for c, stage in enumerate(mine):
        lo, hi = bounds[stage]
        kept = 0.0
        for i in range(lo, hi):
            if not is_text:
                continue
            if 0 < i < len(layers) - 1:
                k, w = block_activations(shape, rows, T, tp, sp, recompute)
                kept += k * scale
                working = max(working, w * scale)
            elif i == 0:
                kept += embedding_activations(rows, T)
            else:
                kept += head_activations(shape, rows, T, tp) * scale
                working = max(working, head_working(shape, rows, T, tp) * scale)
        if not is_text:            # a family without blocks: the recipe's activation count
            _, elements = cfg.recipe.memory(shape, cfg.batch_size // dp, cfg.microbatches, seq_len, cfg.pp)
            kept = elements * s / tp
        per_chunk[c] = kept
    flight = in_flight(cfg, pipe_rank)
    b.items["activations"] = sum(per_chunk.get(c, 0.0) * n for c, n in flight.items()) + working
    b.notes["activations"] = (f"{rows} x {T} tokens a micro-batch, {sum(flight.values())} in flight"
                              + (f", recompute {recompute}" if recompute != "none" else ""))


def _predict_gathered_units(b, cfg, s, P, zero, dp, units):
    """ZeRO-3's gathered parameters: every unit until the step ends (--zero-gather step), or the
    unit in use, the next one and the shared ones (use). No item without ZeRO-3."""
    if zero < 3:
        return
    gather = getattr(cfg, "zero_gather", None)
    if gather in (None, "auto"):
        gather = "step" if cfg.pipelined else "use"      # the default: --zero-gather auto
    if gather == "step":
        gathered = s * P * (dp - 1) / dp
    else:
        others = [u * s for i, u in enumerate(units.sizes) if u and i not in units.shared]
        kept = sum(units.sizes[i] * s for i in units.shared)
        gathered = (kept + sum(sorted(others)[-2:])) * (dp - 1) / dp
    b.items["gathered units"] = gathered
    b.notes["gathered units"] = ("every unit until the step ends" if gather == "step"
                                 else "the unit in use and the next one, and the tied embedding's all step")


def _predict_buffers_and_overhead(b, dp, buckets):
    """The ring's receive slots and the fixed overhead every rank holds."""
    # Two slots alternate between reduce phases; with two ranks there is only one phase.
    b.items["communication buffers"] = min(RING_SLOTS, dp - 1) * max(buckets, default=0) / dp if dp > 1 else 0
    b.notes["communication buffers"] = "ring receive slots: min(2, N - 1) x largest bucket / N"
    b.items["fixed overhead"] = FIXED_OVERHEAD_BYTES
    b.notes["fixed overhead"] = "interpreter, numpy, Numba kernels, MPI (measured)"


def _held_always(b) -> float:
    """What every phase holds: the fixed overhead, the ring's buffers and the mask."""
    return FIXED_OVERHEAD_BYTES + b.items["communication buffers"] + b.items["weight-decay mask"]


def _held_between_steps(b) -> float:
    """What lives from step to step besides: the parameters, the optimizer state, the pulls."""
    return (b.items["parameters"] + b.items["optimizer state"] + b.items.get("parameter pulls in flight", 0)
            + b.items.get("async checkpoint staging", 0))


READ_BLOCK = 64 << 20       # bytes of a Hugging Face tensor read at once (hf_folder.TensorBoxes)
SHARD_READ_BLOCK = 16 << 20    # bytes of a sharded checkpoint's piece read at once (sharded.Reader)


def _predict_staging(b, cfg, s, P, dp):
    """--checkpoint-async: the copy of what this rank writes (its share of the parameters and
    of each optimizer state), held from a save until every rank has written it."""
    if cfg.checkpoint_async and cfg.checkpoint_every and cfg.sharded_checkpoints:
        b.items["async checkpoint staging"] = s * P / dp * (1 + _optimizer_states(cfg))
        b.notes["async checkpoint staging"] = "this rank's share of parameters and optimizer state, copied"


def _predict_phases(b, s, P, zero, dp, largest_param, read_blocks=False):
    """The three phases of a step's life (init, backward, update) and what each holds at once.
    read_blocks: <init_from> reads the boxes this rank holds, a 64 MiB block of rows and its
    float32 cast at a time."""
    base, persistent = _held_always(b), _held_between_steps(b)
    grads = b.items["gradients"]
    # ParamBuffer.init writes the buffer (ZeRO-3: this rank's chunks, the rest never touched),
    # a block at a time: a float64 block drawn (never longer than the parameter), the float64
    # piece it fills, its cast; an import writes the same chunks, a block of rows at a time.
    written = s * P / dp if zero >= 3 else s * P
    b.phases["init"] = (base + written + (8 + 8 + s) * min(INIT_BLOCK, largest_param)
                        + (2 * READ_BLOCK if read_blocks else 0))
    b.phases["backward"] = (base + persistent + grads + b.items.get("gradient buckets in flight", 0)
                            + b.items["activations"] + b.items.get("gathered units", 0.0))
    b.phases["update"] = base + persistent + (grads if zero < 2 else s * P / dp)


def _predict_checkpoints(b, cfg, s, P, layers, largest_param):
    """The checkpoints' moments, outside the training peak (Breakdown.checkpoint)."""
    states = _optimizer_states(cfg)
    if cfg.sharded_checkpoints:
        # Every rank writes from its own buffers, one piece at a time (a copy only where the
        # piece is not contiguous: a part of a column-split matrix, at most a parameter's part),
        # and reads back into them, a block of rows at a time.
        b.checkpoint["save"] = int(b.phases["update"] + s * largest_param / max(1, cfg.tp))
        b.checkpoint["resume"] = int(_held_always(b) + _held_between_steps(b) + SHARD_READ_BLOCK + (4 << 20))
        return
    # Whole-file: the writer (world rank 0, pipeline rank 0) holds every stage's arrays whole:
    # the parameters copied, the optimizer state (gathered under ZeRO). A resume reads this
    # stage's arrays whole (tensor parts included) and lays out one state at a time.
    whole_model = sum(_param_list(layers, [(0, len(layers))], [0], 1))
    whole_stage = P * cfg.tp
    b.checkpoint["save"] = int(b.phases["update"] + s * whole_model * (1 + states))
    b.checkpoint["resume"] = int(_held_always(b) + _held_between_steps(b) + s * whole_stage * (1 + states) + 2 * s * P)


def _pull_copies(cfg) -> int:
    """Dedicated parameter servers: the parameter copies a worker's pulls land in beside its
    parameters (engine/parallel/ps.py, ps_modes.py): ssp:S up to S + 1, a streamed sync step
    (no clipping) 1, otherwise none (the pull lands after backward, in the parameters)."""
    if not getattr(cfg, "ps_servers", 0):
        return 0
    mode, bound = cfg.ps_mode_parts
    if mode == "ssp" and bound:
        return bound + 1
    return 1 if mode == "sync" and cfg.grad_clip <= 0 else 0


def _param_list(layers, bounds, mine, tp):
    """Elements of each parameter this rank holds, in buffer order (tied ones once)."""
    seen, out = set(), []
    for stage in mine:
        lo, hi = bounds[stage]
        for layer in layers[lo:hi]:
            for spec in layer.specs():
                if spec.name not in seen:
                    seen.add(spec.name)
                    out.append(_split(spec.name, spec.size, len(spec.shape), tp))
    return out


# ---- measured -----------------------------------------------------------------------------------

# This process's peak (VmHWM) and current resident memory: the monitor's probes, by the
# names this module's callers use.
peak_rss, current_rss = peak_bytes, resident_bytes


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the kernel does not say)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measured_peak(world) -> int:
    """The largest VmHWM over the ranks of `world` (one 8-byte all-reduce)."""
    from ringpipe import comm
    buf = np.array([float(peak_rss())])
    if world.Get_size() > 1:
        comm.allreduce(buf, world, op="max")
    return int(buf[0])


def reset_peak() -> bool:
    """Start a new measurement: VmHWM back to the current RSS (Linux's /proc/self/clear_refs,
    value 5). False where the kernel does not allow it (then a moment's peak is the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class Moments:
    """<memory_report>: the measured peak of each moment of a run (start-up, the import or the
    resume, the steps, each save), the largest rank's VmHWM since the moment began, against the
    steady state (the first two steps') and the prediction. Every call is collective (a max
    all-reduce), made by every rank at the same point of the run."""

    STEADY = "steps 1-2 (steady state)"

    def __init__(self, world):
        self.world, self.peaks, self.counts, self.resets = world, {}, {}, True

    def end(self, name: str) -> None:
        """The moment `name` ends now (a moment seen again keeps its largest peak)."""
        peak = measured_peak(self.world)
        self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self.counts[name] = self.counts.get(name, 0) + 1
        self.resets = reset_peak() and self.resets

    def table(self, predicted: dict) -> list[str]:
        """The moments in the order first seen; predicted: {moment: bytes} where known."""
        steady = self.peaks.get(self.STEADY)
        lines = [f"  {'moment':<36}{'measured':>12}{'x steady':>10}{'predicted':>12}"]
        for name, peak in self.peaks.items():
            ratio = f"{peak / steady:.2f}" if steady else "-"
            times = f" (x{self.counts[name]})" if self.counts[name] > 1 else ""
            guess = predicted.get(name.split(" (")[0])
            lines.append(f"  {name + times:<36}{size_text(peak):>12}{ratio:>10}"
                         f"{size_text(guess) if guess else '-':>12}")
        if not self.resets:
            lines.append("  (this kernel cannot reset a process's peak: each row is the peak so far)")
        return lines


def shortfall(predicted: int, ranks_on_node: int, available: int | None, held_now: int) -> int:
    """Bytes the node lacks for its ranks to reach the predicted peak: each rank holds
    `held_now` already and needs the rest from MemAvailable. 0 when it fits (or unknown)."""
    if available is None:
        return 0
    need = ranks_on_node * max(0, predicted - held_now)
    return max(0, need - available)


# ---- the trainer's lines --------------------------------------------------------------------

def report_at_start(training) -> Breakdown:
    """The start-up line (the predicted peak per rank), the breakdown with <memory_report>,
    and a warning when this node's free memory is short of it (before the first step,
    which is when the memory is taken: the optimizer state, the activations)."""
    from ringpipe.engine.job import runtime
    cfg, report = training.cfg, training.report
    b = predict(cfg, training.shape, training.seq_len, training.grid.size("data"))
    training.memory = b
    report.say(f"memory: predicted peak {size_text(b.total)} per rank ({b.peak_phase}; "
               f"{'; '.join(f'{k} {size_text(v)}' for k, v in _largest(b.items, 3))}"
               f"{'' if getattr(cfg, 'memory_report', False) else '; <memory_report> for the breakdown'})")
    if getattr(cfg, "memory_report", False):
        report.say(f"memory per rank, predicted (pipeline rank {b.pipe_rank}, the largest):")
        for line in b.table():
            report.say(line)
    save, resume = b.checkpoint.get("save", 0), b.checkpoint.get("resume", 0)
    if getattr(cfg, "memory_report", False) or max(save, resume) > 1.25 * b.total:
        how = ("sharded checkpoints are written from each rank's own state and read back into it: writing "
               f"one takes {size_text(save)} a rank" if cfg.sharded_checkpoints else
               f"checkpoints are written and read whole, not sharded: writing one takes {size_text(save)} on "
               "world rank 0")
        report.say(f"memory: {how} for a moment, resuming {size_text(resume)} a rank (the training peak: "
                   f"{size_text(b.total)})")
    ranks_here = runtime.local_rank_count()
    short = float(shortfall(b.total, ranks_here, mem_available(), current_rss()))
    buf = np.array([short])
    if training.world.Get_size() > 1:
        from ringpipe import comm
        comm.allreduce(buf, training.world, op="max")
    if buf[0] > 0:
        report.note(f"warning: the predicted peak, {size_text(b.total)} per rank x {ranks_here} rank(s) on a node, is "
                    f"{size_text(buf[0])} more than the node's free memory (MemAvailable): the run may be killed "
                    "when it takes it. Lower it with "
                    + ("" if cfg.zero == 3 else "<zero> (2 or 3 shard gradients and parameters), ")
                    + ("" if cfg.recompute == "full" else "<recompute> (selective or full), ")
                    + "a smaller <batch_size> or more <microbatches>, or more ranks")
    return b


def _largest(items, n):
    return sorted(((k, v) for k, v in items.items() if v), key=lambda kv: -kv[1])[:n]


def report_moments(training) -> None:
    """<memory_report>, at the end: every moment's measured peak against the steady state's."""
    moments, b = getattr(training, "moments", None), getattr(training, "memory", None)
    if moments is None or b is None:
        return
    predicted = {"start-up": b.phases.get("init"), "import": b.phases.get("init"), "resume": b.checkpoint.get("resume"),
                 Moments.STEADY.split(" (")[0]: b.total, "steps": b.total, "save": b.checkpoint.get("save")}
    training.report.say("memory per moment (VmHWM of the largest rank within each; x steady: against steps 1-2):")
    for line in moments.table(predicted):
        training.report.say(line)


def report_measured(training, after_step: int) -> None:
    """After `after_step`: the measured peak (max over ranks) next to the prediction."""
    measured = measured_peak(training.world)
    b = getattr(training, "memory", None)
    if not measured or b is None:
        return
    training.report.say(f"memory: measured peak {size_text(measured)} per rank after step {after_step} (VmHWM, the "
                        f"largest rank), predicted {size_text(b.total)}: {measured / b.total:.2f}x")
