"""The trainer: train(args) runs one training job on every rank of `world`.

The loop reads top to bottom: build the communicators, the data, the model and
the optimizer; then each step: gradients (data-parallel buckets all-reduced
while backward runs), loss across ranks, clip, update, log, evaluate,
checkpoint. The command line is engine/cli.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time

import numpy as np

from ringpipe.engine import runtime


# ---- configuration -------------------------------------------------------------------

def model_config(args, saved=None):
    """Model shape from the flags, or from a checkpoint when resuming (flags given explicitly must agree)."""
    from ringpipe.engine.gpt import GPTConfig
    from ringpipe.engine.mlp import MLPConfig
    if args.model == "gpt":
        flags = {"n_layer": args.layers, "d_model": args.d_model, "n_head": args.heads, "context": args.context}
        cfg = GPTConfig()
    else:
        flags = {"n_layer": args.layers, "hidden": args.d_model}
        cfg = MLPConfig()
    flag_names = {"n_layer": "--layers", "d_model": "--d-model", "n_head": "--heads",
                  "context": "--context", "hidden": "--d-model"}
    for key, value in flags.items():
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag_names[key]} must be >= 1, got {value}")
    for key, value in (saved or {}).items():
        if key in flags and flags[key] is not None and flags[key] != value:
            raise SystemExit(f"error: the checkpoint was written with {flag_names[key]} {value}, "
                             f"but {flag_names[key]} {flags[key]} was given; drop the flag or use a new --out")
        setattr(cfg, key, value)
    for key, value in flags.items():
        if value is not None and not saved:
            setattr(cfg, key, value)
    try:
        return cfg.validate()
    except ValueError as e:
        raise SystemExit(f"error: {e}")


def load_dataset(args, model_cfg):
    from ringpipe.engine import data
    kind = args.data or ("stdlib" if args.model == "gpt" else "fashion-mnist")
    dtype = np.dtype(args.dtype)
    if args.model == "gpt":
        if kind == "stdlib":
            return data.load_stdlib_corpus(args.seq_len, args.seed, max_bytes=int(args.max_data_mb * 2**20))
        if kind == "synthetic":
            return data.synthetic_tokens(args.seq_len, args.seed)
        if kind == "text":
            if not args.data_path:
                raise SystemExit("error: --data text needs --data-path FILE_OR_FOLDER")
            return data.load_text_folder(args.data_path, args.seq_len, args.seed,
                                         max_bytes=int(args.max_data_mb * 2**20))
        raise SystemExit(f"error: --data {kind} is a classification set; use it with --model mlp")
    if kind == "fashion-mnist":
        return data.load_fashion_mnist(args.seed, root=args.data_path or data.FASHION_MNIST_DIR, dtype=dtype)
    if kind == "synthetic":
        return data.synthetic_classification(args.seed, dtype=dtype)
    raise SystemExit(f"error: --data {kind} is a text corpus; use it with --model gpt")


def agree(world, fn, what, same_result=False, hint="is the path on a filesystem every node sees?",
          compared=lambda result: result):
    """Run a step that depends on this rank's own state (its filesystem, its GPU,
    its command line) and make every rank reach the same outcome: if it failed
    anywhere, every rank stops with the error (naming the ranks, and `hint` when
    only some failed), never some ranks waiting forever in the next collective.
    same_result: the ranks' results (or what `compared` picks of them) must also be equal."""
    from ringpipe.engine import checkpoint
    try:
        result, error = fn(), None
    except SystemExit as e:
        result, error = None, str(e.code)
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        result, error = None, f"error: {e}"
    errors = world.allgather(error)
    failed = [r for r, e in enumerate(errors) if e]
    if failed:
        first = errors[failed[0]]
        if len(failed) == world.Get_size() and all(e == first for e in errors):
            raise SystemExit(first)
        raise SystemExit(f"error: the {what} failed on rank(s) {failed} only ({hint}): rank {failed[0]}: {first}")
    if same_result:
        results = world.allgather(compared(result))
        if any(r != results[0] for r in results):
            listing = ", ".join(f"rank {i}: {r}" for i, r in enumerate(results))
            raise SystemExit(f"error: the ranks found different results for the {what} ({listing}); put --out on a "
                             "filesystem every node sees, or pass the same --resume file to all")
    return result


def make_writable_dir(flag, path):
    """Create folder `path` (given by `flag`) or say clearly why it cannot be used."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot create the folder {flag} {path} ({e.strerror}: {e.filename}); "
                         f"pass {flag} a folder path that can be created") from None
    if not os.access(path, os.W_OK):
        raise SystemExit(f"error: the folder {flag} {path} is not writable; pass {flag} a folder you can write to")


def check_same_args(args, world):
    """Every rank must run the same configuration: ranks launched with different
    flags would take different communication paths and hang. One small
    allgather at start-up (not a hot path) turns that into an error on every
    rank that names the flags and ranks that differ."""
    mine = {k: v for k, v in sorted(vars(args).items())}
    everyone = world.allgather(mine)
    diffs = []
    for r, theirs in enumerate(everyone):
        for k in mine:
            if not _same_value(theirs.get(k), everyone[0].get(k)):
                diffs.append(f"rank {r} has --{k.replace('_', '-')} {theirs.get(k)!r} where rank 0 has "
                             f"{everyone[0].get(k)!r}")
    if diffs:
        raise SystemExit("error: the ranks were launched with different arguments; every rank must get the "
                         "same command line:\n  " + "\n  ".join(diffs[:10]))


def _same_value(a, b):
    # NaN != NaN: without this, one rank given --lr nan would "differ from itself".
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def check_layout(args, dp):
    """Refuse impossible shapes and values before any work (and identically on every rank)."""
    for flag, value in (("--layers", args.layers), ("--d-model", args.d_model), ("--heads", args.heads),
                        ("--context", args.context)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be >= 1, got {value}")
    for name, value in sorted(vars(args).items()):
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a finite number, got {value}")
    if args.lr is not None and args.lr <= 0:
        raise SystemExit(f"error: --lr must be > 0, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise SystemExit(f"error: --min-lr-ratio is the fraction of --lr the schedule decays to: it must be "
                         f"between 0 and 1, got {args.min_lr_ratio}")
    for flag, value in (("--warmup", args.warmup), ("--weight-decay", args.weight_decay),
                        ("--grad-clip", args.grad_clip)):
        if value is not None and value < 0:
            raise SystemExit(f"error: {flag} must be >= 0, got {value}"
                             f"{' (0 disables clipping)' if flag == '--grad-clip' else ''}")
    for flag, value, low in (("--bucket-mb", 1 if args.bucket_mb is None else args.bucket_mb, 1e-9), ("--checkpoint-every", args.checkpoint_every, 0),
                             ("--keep", args.keep, 0), ("--eval-batches", args.eval_batches, 1),
                             ("--eval-every", args.eval_every or 1, 1), ("--log-every", args.log_every or 1, 1),
                             ("--watchdog", args.watchdog, 0), ("--sample-bytes", args.sample_bytes, 0)):
        if value < low:
            raise SystemExit(f"error: {flag} must be {'> 0' if low == 1e-9 else f'>= {low}'}, got {value}")
    if args.precision == "bf16" and args.dtype != "float32":
        raise SystemExit(f"error: --precision bf16 needs --dtype float32 (bf16 matmuls keep float32 master "
                         f"weights), got --dtype {args.dtype}")
    if args.seq_len is not None and args.seq_len < 1:
        raise SystemExit(f"error: --seq-len must be >= 1, got {args.seq_len}")
    if args.microbatches < 1 or args.chunks < 1:
        raise SystemExit("error: --microbatches and --chunks must be >= 1")
    if args.chunks > 1 and args.schedule != "interleaved":
        raise SystemExit(f"error: --chunks {args.chunks} needs --schedule interleaved")
    if args.batch_size % dp == 0 and (args.batch_size // dp) % args.microbatches:
        raise SystemExit(f"error: the per-replica batch {args.batch_size // dp} (--batch-size {args.batch_size} / "
                         f"dp {dp}) does not split into --microbatches {args.microbatches}; use a batch size "
                         f"that is a multiple of dp x microbatches = {dp * args.microbatches}")
    if args.steps < 1:
        raise SystemExit(f"error: --steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        raise SystemExit(f"error: --batch-size must be >= 1, got {args.batch_size}")
    if args.batch_size % dp:
        raise SystemExit(f"error: --batch-size {args.batch_size} does not divide among {dp} data-parallel ranks; "
                         f"use a multiple of {dp} (e.g. {dp * max(1, args.batch_size // dp)})")
    if args.seed < 0:
        raise SystemExit(f"error: --seed must be >= 0 (it seeds numpy's generators), got {args.seed}")
    if args.decay_steps is not None and args.decay_steps < 1:
        raise SystemExit(f"error: --decay-steps must be >= 1, got {args.decay_steps}")
    if args.max_data_mb <= 0:
        raise SystemExit(f"error: --max-data-mb must be > 0, got {args.max_data_mb}")
    if args.bucket_mb is not None and args.bucket_mb > MAX_BUCKET_MB:
        raise SystemExit(f"error: --bucket-mb {args.bucket_mb:g} is more than {MAX_BUCKET_MB} MiB (1 TiB); a bucket "
                         "larger than the gradients is one bucket anyway: leave --bucket-mb out for the automatic "
                         "size, or give a size in MiB")


MAX_BUCKET_MB = 1 << 20


def check_flag_combinations(args, dp, pp):
    """Flags that would have no effect in this combination: refused when the user
    clearly expected something to happen, noted (returned) when the same command
    line is reasonably reused across layouts (a scaling sweep from 1 rank up)."""
    pipelined = pp > 1 or args.chunks > 1
    if args.schedule is not None and not pipelined:
        raise SystemExit(f"error: --schedule {args.schedule} has no effect without pipeline stages: add --pp N "
                         "(N >= 2; ranks = pp x dp), or drop --schedule")
    if args.schedule == "interleaved" and args.chunks < 2:
        raise SystemExit("error: --schedule interleaved needs --chunks >= 2 (model chunks per pipeline rank); "
                         "with one chunk it is 1F1B: pass --chunks 2, or --schedule 1f1b")
    if args.data_path is not None and args.data not in (None, "text", "fashion-mnist"):
        raise SystemExit(f"error: --data-path is read only with --data text (or fashion-mnist for the MLP), "
                         f"but --data {args.data} was given: drop one of the two")
    if args.model == "mlp":
        given = [flag for flag, value in (("--heads", args.heads), ("--context", args.context),
                                          ("--seq-len", args.seq_len)) if value is not None]
        if given:
            raise SystemExit(f"error: {', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --model gpt "
                             "only; the MLP takes --layers and --d-model (hidden width)")
    if args.watchdog_abort and not args.watchdog:
        raise SystemExit("error: --watchdog-abort needs --watchdog SECONDS (the stall that triggers it)")
    notes = []
    if dp == 1:
        unused = [flag for flag, on in (("--zero 1", args.zero), ("--bucket-mb", args.bucket_mb is not None),
                                        ("--no-overlap", args.no_overlap)) if on]
        if unused:
            notes.append(f"note: {', '.join(unused)} ha{'s' if len(unused) == 1 else 've'} no effect with one "
                         "data-parallel rank")
    if args.partition is not None and not pipelined:
        notes.append(f"note: --partition {args.partition} has no effect without pipeline stages (--pp)")
    return notes


def memory_floor(args, cfg, dp, pp):
    """(bytes, what) : a LOWER bound on what one rank must allocate for this run
    (parameters, gradients and optimizer state, plus the activations of one
    micro-batch), so a run that cannot possibly fit is refused in milliseconds
    instead of failing with a MemoryError minutes in. Real use is higher."""
    itemsize = np.dtype(args.dtype).itemsize
    if args.model == "gpt":
        C, L = cfg.d_model, cfg.n_layer
        n_params = cfg.vocab * C + cfg.context * C + L * 12 * C * C
        micro = args.batch_size // dp // args.microbatches
        T = args.seq_len or cfg.context
        # Per token and block at least the residual, LayerNorm, qkv, attention
        # output and MLP activations (about 16 C); plus the logits of the head.
        activations = micro * T * (max(1, L // pp) * 16 * C + cfg.vocab) * itemsize
    else:
        widths = [1] + [cfg.hidden] * cfg.n_layer + [1]    # features and classes are unknown yet
        n_params = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
        activations = args.batch_size // dp * sum(widths) * itemsize
    states = 2 if args.optimizer == "adamw" else 1
    weights = n_params / pp * itemsize * (2 + states / (dp if args.zero else 1))
    return weights + activations, (f"{n_params:.3g} parameters: {_gib(weights)} for weights, gradients and "
                                   f"optimizer state, {_gib(activations)} for one micro-batch's activations")


def node_memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(args, cfg, dp, pp, ranks_on_node):
    """Refuse a run whose lower-bound memory per rank exceeds this node's memory share."""
    if args.device != "cpu":
        return                    # GPU memory is checked by the allocator itself, quickly
    total = node_memory_bytes()
    if not total:
        return
    need, what = memory_floor(args, cfg, dp, pp)
    share = total / max(1, ranks_on_node)
    if need > share:
        raise SystemExit(f"error: this run needs at least {_gib(need)} per rank ({what}), but this node has "
                         f"{_gib(total)} for {ranks_on_node} rank(s); use a smaller model (--d-model, --layers) "
                         f"or batch (--batch-size, --microbatches), more ranks (--pp splits the layers, --zero 1 "
                         "the optimizer state), or nodes with more memory")


def _gib(nbytes):
    return f"{nbytes / 2**30:.3g} GiB"


# ---- the run -------------------------------------------------------------------------

class JobFailure(SystemExit):
    """A failure every rank has agreed on (a checkpoint that could not be written,
    a rank that could not write its metrics): each rank raises it alike, so the
    job ends without an abort; main() prints it once and exits with code 1."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def train(args, world=None, stop=None):
    """Run training. `world` is the communicator of all ranks of this job (default
    MPI.COMM_WORLD; tests pass COMM_SELF to get a single-process reference).
    `stop`: the lifecycle.StopFlag to use; by default one is installed for the
    run and removed when it returns (main() installs its own before MPI starts
    and keeps it to the end, so no signal is ever lost)."""
    from ringpipe import kernels as K
    from ringpipe.engine import lifecycle

    # What must be undone however the run ends (the run directory's lock, ...).
    with contextlib.ExitStack() as cleanup:
        if stop is None:
            stop = lifecycle.StopFlag()
            cleanup.callback(stop.uninstall)
        # --precision is the kernels' module-wide matmul default: the layers never pass one.
        cleanup.callback(K.set_matmul_precision, K.get_matmul_precision())
        K.set_matmul_precision(args.precision)
        return _train(args, world, stop, cleanup)


def agree_on_rank0(world, fn, what):
    """Run `fn` on world rank 0 only (the owner of the run directory) and give
    every rank its result, or make every rank stop with its error."""
    from ringpipe.engine import checkpoint, rundir
    result = error = None
    if world.Get_rank() == 0:
        try:
            result = fn()
        except SystemExit as e:
            error = str(e.code)
        except (checkpoint.CheckpointError, rundir.RunDirError, OSError, ValueError) as e:
            error = f"error: {e}"
    if world.Get_size() > 1:
        result, error = world.bcast((result, error), root=0)
    if error:
        raise SystemExit(error if error.startswith("error:") else f"error: the {what} failed: {error}")
    return result


def prepare_run_dir(run, args, ckpt_dir):
    """Rank 0: own --out for the run's life and start it clean. Returns notes."""
    from ringpipe.engine import checkpoint
    notes = run.lock()
    existing = checkpoint.list_checkpoints(ckpt_dir)
    if not args.resume:
        if existing and not args.overwrite:
            raise SystemExit(f"error: {ckpt_dir} already holds checkpoints; pass --resume auto to continue that "
                             "run, --out DIR for a new one, or --overwrite to start over in it")
        # A fresh start: whatever an earlier run left (its checkpoints with
        # --overwrite, or the metrics and logs of a run that never saved one)
        # goes to OUT/previous/, so nothing of it can be resumed or pruned by mistake.
        moved = run.move_previous_aside()
        if moved:
            notes.append(f"{'--overwrite' if args.overwrite else 'fresh start'}: {moved}")
    # Only this run writes here now (it holds the lock): temp files are leftovers
    # of killed runs, and would keep a nearly full disk full.
    removed = checkpoint.remove_stale_temp_files(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    if removed:
        notes.append(f"removed {len(removed)} temp file(s) left by an interrupted checkpoint write: "
                     f"{', '.join(os.path.basename(p) for p in removed[:3])}{' ...' if len(removed) > 3 else ''}")
    return notes


def find_resume(args, ckpt_dir):
    """(manifest path or None, notes): the checkpoint this run continues from.
    Every rank resolves it itself; the caller makes sure they agree."""
    from ringpipe.engine import checkpoint
    if not args.resume:
        return None, []
    if args.resume != "auto":
        return checkpoint.resolve(args.resume), []
    valid, invalid = checkpoint.scan(ckpt_dir) if os.path.isdir(ckpt_dir) else ([], [])
    bad = [f"{os.path.basename(p)} ({why})" for p, why in invalid]
    if not valid:
        if invalid:
            raise SystemExit(f"error: --resume auto found no valid checkpoint in {ckpt_dir}, only invalid ones: "
                             f"{'; '.join(bad[:5])}. Starting fresh would silently drop that run: remove or "
                             "repair them, resume from a file with --resume PATH, or start over with --overwrite")
        return None, [f"--resume auto: no checkpoint in {ckpt_dir} yet, starting fresh"]
    newer = [b for (p, _), b in zip(invalid, bad) if p > valid[-1]]
    notes = [f"--resume auto: skipping invalid checkpoint(s) newer than {os.path.basename(valid[-1])}: "
             f"{'; '.join(newer)}"] if newer else []
    return valid[-1], notes


def _train(args, world, stop, cleanup):
    from ringpipe import comm
    from ringpipe import kernels as K
    from ringpipe.engine import checkpoint, rundir
    from ringpipe.engine.gpt import build_gpt, flops_per_token, generate, gpt_layers
    from ringpipe.engine.mlp import flops_per_example, mlp_layers
    from ringpipe.engine.optim import clip_scale, lr_at, make_optimizer
    from ringpipe.engine.pipeline import ScheduleError
    from ringpipe.engine.pipeline.rank_model import LocalModel, PipelineModel
    from ringpipe.engine import lifecycle
    from ringpipe.comm.device import Transport
    from ringpipe.comm.device import stats as transfer_stats
    from ringpipe.engine.device import describe as describe_device
    from ringpipe.engine.device import select
    from ringpipe.engine.trace import Tracer
    from mpi4py import MPI

    # ---- communicators -------------------------------------------------------------
    world = world or MPI.COMM_WORLD
    check_same_args(args, world)
    agree(world, comm.check_settings, "RINGPIPE_* settings", hint="is the environment the same on every node?")
    flag_notes = check_flag_combinations(args, args.dp or max(1, world.Get_size() // args.pp), args.pp)
    if args.dp is None and world.Get_size() % args.pp:
        raise SystemExit(f"error: {world.Get_size()} ranks do not split into --pp {args.pp} pipeline stages; "
                         f"launch a multiple of {args.pp} ranks (ranks = pp x dp)")
    try:
        topo = comm.Topology(world, dp=args.dp, pp=args.pp)
    except ValueError as e:
        raise SystemExit(f"error: {e} (launch pp x dp ranks, e.g. mpiexec -n {(args.dp or 1) * args.pp})")
    rank, dp, dp_rank = world.Get_rank(), topo.dp, topo.dp_rank
    is_main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    check_layout(args, dp)
    for note in flag_notes + runtime.unknown_variables():
        say(note)
    args.schedule = args.schedule or "1f1b"
    args.partition = args.partition or "uniform"
    if args.data is None and args.data_path is not None and args.model == "gpt":
        args.data = "text"
        say("note: --data-path given without --data: reading it as --data text")
    out_dir = args.out or os.path.join("runs", args.model)
    ckpt_dir = os.path.join(out_dir, "checkpoints")

    # ---- the run directory: owned by this run, started clean -------------------------
    def make_output_dirs():
        make_writable_dir("--out", out_dir)
        if args.trace:
            make_writable_dir("--trace", args.trace)

    # Before the data is loaded and the model built: a bad --out costs nothing yet.
    agree(world, make_output_dirs, "output directory")
    run = rundir.RunDir(out_dir)
    if is_main:
        cleanup.callback(run.unlock)
    for note in agree_on_rank0(world, lambda: prepare_run_dir(run, args, ckpt_dir), "run directory"):
        say(note)

    # ---- resume? -------------------------------------------------------------------
    # Every rank resolves and reads the checkpoint itself; `agree` makes sure they
    # all found the same one (a run directory on node-local disk would not).
    resume_path, notes = agree(world, lambda: find_resume(args, ckpt_dir), "checkpoint to resume from",
                               same_result=True, compared=lambda found: found[0])
    for note in notes:
        say(note)
    manifest = {}
    if resume_path:
        manifest = agree(world, lambda: checkpoint.read_manifest(resume_path), "checkpoint")
        if manifest.get("model") != args.model:
            raise SystemExit(f"error: checkpoint {resume_path} holds a {manifest.get('model')} model, "
                             f"not --model {args.model}")

    # ---- data and model ----------------------------------------------------------------
    cfg = model_config(args, manifest.get("model_config"))
    dtype = K.resolve_dtype(args.dtype)
    if args.model == "gpt":
        if args.seq_len is None:
            args.seq_len = cfg.context
        if not 1 <= args.seq_len <= cfg.context:
            raise SystemExit(f"error: --seq-len {args.seq_len} exceeds the model's context {cfg.context}; "
                             f"lower --seq-len or raise --context (at least {args.seq_len})")
    # Nodes may differ in memory: every rank checks its own node, all agree.
    agree(world, lambda: check_memory(args, cfg, dp, topo.pp, runtime.local_rank_count()), "memory check",
          hint="do the nodes differ in memory?")

    def pick_device():
        xp = select(args.device, topo.local_rank)
        return xp, Transport(xp)     # how device buffers reach MPI (direct or pinned staging)

    # A node without CuPy or a GPU must stop every rank, not only its own.
    xp, transport = agree(world, pick_device, "device setup",
                          hint="does every node have CuPy and a visible GPU?")

    dataset = agree(world, lambda: load_dataset(args, cfg), "dataset")
    say(f"data: {dataset.describe()}")
    if args.model == "gpt":
        layers_fn = lambda: gpt_layers(cfg)  # noqa: E731
        items_per_example = args.seq_len
        flops_per_item = flops_per_token(cfg, args.seq_len)
    else:
        cfg.n_in, cfg.n_classes = dataset.n_features, dataset.n_classes
        layers_fn = lambda: mlp_layers(cfg)  # noqa: E731
        items_per_example = 1
        flops_per_item = flops_per_example(cfg)
    local_batch = args.batch_size // dp
    micro = local_batch // args.microbatches
    lo, hi = dp_rank * local_batch, (dp_rank + 1) * local_batch
    try:
        if topo.pp > 1 or args.chunks > 1:
            if args.model != "gpt":
                raise SystemExit("error: pipeline stages (--pp/--chunks > 1) are implemented for --model gpt only")
            model = PipelineModel(layers_fn, topo, dtype, args.seed, args.schedule, args.microbatches,
                                  args.chunks, act_shape=(micro, args.seq_len, cfg.d_model),
                                  partition=args.partition,
                                  cost_batch=lambda: dataset.batch(0, args.batch_size, 0, micro), xp=xp)
        else:
            model = LocalModel(layers_fn(), dtype, args.seed, args.microbatches, xp=xp)
    except (ScheduleError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    params = model.params

    # ---- optimizer ----------------------------------------------------------------------
    lr_base = args.lr if args.lr is not None else (2e-3 if args.optimizer == "adamw" else 0.05)
    decay_steps = args.decay_steps or args.steps
    warmup = args.warmup if args.warmup is not None else max(1, decay_steps // 20)
    # ZeRO-1: this rank updates (and keeps optimizer state for) one shard of the flat buffer.
    shard = comm.chunk_bounds(params.size, dp)[dp_rank] if args.zero else (0, params.size)
    opt = make_optimizer(args.optimizer, shard[1] - shard[0], dtype, params.xp,
                         params.wd_mask[shard[0]:shard[1]], lr_base, args.weight_decay)

    start_step = 0
    if resume_path:
        # Only the arrays this rank holds, each checked against the model's shape
        # before its bytes are read (a damaged or hostile file costs nothing).
        wanted = {f"param/{s.name}": s.shape for s in params.specs}
        wanted.update({f"opt/{state}/{s.name}": s.shape for state in opt.state() for s in params.specs})
        saved_arrays, _ = agree(world, lambda: checkpoint.load(resume_path, expected=wanted), "checkpoint")
        restore(params, opt, saved_arrays, manifest, shard, args.optimizer)
        del saved_arrays
        start_step = manifest["step"]
        say(f"resumed from {resume_path} at step {start_step}")
        for line in resume_differences(manifest.get("args", {}), args):
            say(line)
        for line in schedule_change(manifest.get("args", {}), args, start_step, lr_base, decay_steps, warmup):
            say(line)
    else:
        # Every rank initialised identically from the seed; broadcasting the first
        # data-parallel replica's copy makes that a guarantee rather than an assumption.
        transport.in_place(params.data, lambda buf: topo.dp_comm.Bcast(buf, root=0))

    buckets = None
    if dp > 1:
        bucket_bytes, first_bytes = bucket_sizes(args.bucket_mb, params.grad.nbytes)
        buckets = comm.GradBuckets(params.grad, params.ranges(), comm=topo.dp_comm, bucket_bytes=bucket_bytes,
                                   first_bucket_bytes=first_bytes, op="avg", overlap=not args.no_overlap)
    tracer = Tracer(args.trace, world) if args.trace else None
    model.trace = tracer.events if tracer else None

    def reduce_grad():
        if buckets:
            buckets.wait()
        for a, b in model.tied_ranges:           # tied embedding: first + last stage
            comm.allreduce(params.grad[a:b], model.tied_comm, op="sum")

    items_per_step = args.batch_size * items_per_example
    eval_every = args.eval_every or max(1, args.steps // 5)
    log_every = args.log_every or max(1, args.steps // 20)

    say(f"ringpipe | {args.model} {cfg.to_dict()} | {params.size:,} parameters on rank 0 | {args.dtype}"
        f"{', bf16 matmuls' if args.precision == 'bf16' else ''}")
    layout = f"dp {dp} x pp {topo.pp}"
    if isinstance(model, PipelineModel):
        layout += (f" | schedule {args.schedule}, {args.microbatches} micro-batches of {micro}"
                   f"{f', {args.chunks} chunks/rank' if args.chunks > 1 else ''} | stages (layers) {model.bounds}")
    elif args.microbatches > 1:
        layout += f" | {args.microbatches} micro-batches of {micro} (gradient accumulation)"
    if buckets:
        sizes = [(hi_ - lo_) * params.grad.itemsize for lo_, hi_, _, _ in buckets.buckets]
        layout += (f" | {len(sizes)} gradient bucket(s) of <= {_mib(max(sizes))}"
                   f"{'' if args.bucket_mb else ' (auto; --bucket-mb sets it)'}")
    say(f"data {dataset.name} | global batch {args.batch_size} x {items_per_example} = {items_per_step} "
        f"{'tokens' if args.model == 'gpt' else 'examples'}/step | {world.Get_size()} ranks: {layout}"
        f"{' | zero-1' if args.zero else ''}")
    if xp is not np:
        say(f"device: {describe_device(xp)} on rank 0")
        if world.Get_size() > 1:
            say(f"GPU buffers and MPI: {transport.describe()}")
    if args.model == "gpt" and is_main:
        say(f"unigram baseline (val): {dataset.unigram_entropy():.4f} nats/byte")
    if topo.pp > 1 and args.microbatches < 2 * topo.pp:
        say(f"note: {args.microbatches} micro-batch(es) on {topo.pp} stages leaves the pipeline mostly idle "
            f"(bubble {(topo.pp - 1) / (args.microbatches + topo.pp - 1):.0%}); use --microbatches "
            f">= {4 * topo.pp} to fill it")

    log = lifecycle.setup_rank_logging(out_dir, rank, world.Get_size())
    log.info("start: %s", " ".join(sys.argv) or "(in-process)")
    dog = lifecycle.Watchdog(world, args.watchdog, run_dir=out_dir, abort=args.watchdog_abort)
    cleanup.callback(dog.stop)
    metrics = None
    if is_main:
        metrics = rundir.MetricsLog(os.path.join(out_dir, rundir.METRICS_NAME), append=bool(resume_path))
        cleanup.callback(metrics.close)
        for note in metrics.notes:
            say(note)

    def evaluate():
        total = np.zeros(1)
        for i in range(args.eval_batches):
            x, y = dataset.batch(i, args.batch_size, lo, hi, split="val")
            total[0] += model.forward_loss(x, y)
        comm.allreduce(total, world, op="sum")       # only loss-computing ranks add non-zero
        return total[0] / (args.eval_batches * items_per_step)

    def diverged(value, step, what="loss"):
        # Every checkpoint on disk is finite (save() refuses anything else), so
        # the newest valid one is a safe place to go back to.
        last = checkpoint.find_latest(ckpt_dir)
        then = (f"Nothing was saved after the last good checkpoint ({last}): lower --lr or raise --warmup, "
                "then resume from it with --resume auto." if last else
                "No checkpoint was written yet: lower --lr or raise --warmup and start again.")
        return SystemExit(f"error: {what} is {value} at step {step}: training diverged. {then}")

    def save(step, loss):
        """Write checkpoint `step` (gathered on rank 0); every rank learns whether it
        was written, so a full disk ends the job cleanly instead of with an abort."""
        arrays = gather_state(params, opt, shard, topo, args.zero)
        failure = None
        if is_main:
            bad = next((k for k, v in arrays.items() if k.startswith("param/") and not np.isfinite(v).all()), None)
            if bad:
                failure = ("diverged", f"{bad} holds NaN or inf after step {step}")
            else:
                meta = {"model": args.model, "model_config": cfg.to_dict(), "optimizer": args.optimizer,
                        "opt_step_count": opt.step_count, "loss": loss, "dtype": args.dtype,
                        "precision": args.precision, "layout": {"dp": dp, "pp": topo.pp, "chunks": args.chunks},
                        "args": {k: v for k, v in vars(args).items()}}
                try:
                    checkpoint.save(ckpt_dir, step, arrays, meta, keep=args.keep)
                except checkpoint.CheckpointError as e:
                    failure = ("write", str(e))
        failure = world.bcast(failure, root=0) if world.Get_size() > 1 else failure
        if failure and failure[0] == "diverged":
            raise diverged(failure[1], step, "a weight")
        if failure:
            raise JobFailure(failure[1])
        return arrays

    # ---- the loop --------------------------------------------------------------------
    t_start = time.perf_counter()
    loss = float("nan")
    stopped_at = None
    # The first step compiles the kernels (Numba JIT, cached on disk afterwards):
    # half a minute of silence on a cold cache unless somebody says so.
    jit_notice = threading.Timer(5.0, say, ("step 1 is taking a while: the first step compiles the kernels "
                                            "(Numba JIT; once, cached for later runs) ...",))
    jit_notice.daemon = True
    if is_main and not args.quiet and start_step < args.steps:
        jit_notice.start()
    cleanup.callback(jit_notice.cancel)
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, lr_base, warmup, decay_steps, args.min_lr_ratio)
        x, y = dataset.batch(step, args.batch_size, lo, hi)

        params.zero_grad()
        # Each micro-batch adds its share of this rank's mean; the all-reduce averages ranks.
        local_loss = model.step(x, y, grad_scale=1.0 / (local_batch * items_per_example),
                                on_ready=buckets.mark_ready if buckets else None, reduce_grad=reduce_grad)
        loss_buf = np.array([local_loss])
        comm.allreduce(loss_buf, world, op="sum")        # only loss-computing ranks add non-zero
        loss = loss_buf[0] / items_per_step
        if not math.isfinite(loss):
            raise diverged(loss, step + 1)

        # Gradients are identical across data-parallel ranks now; pipeline stages
        # add their parts of the norm (the tied embedding counted once).
        norm_sq = np.array([K.sum_of_squares(params.grad) -
                            sum(K.sum_of_squares(params.grad[a:b]) for a, b in model.duplicate_ranges)])
        if topo.pp > 1:
            comm.allreduce(norm_sq, topo.pp_comm, op="sum")
        # A finite loss can still come with NaN/inf gradients (an overflow in
        # backward): applying them would poison every weight, so stop first.
        if not math.isfinite(norm_sq[0]):
            raise diverged(math.sqrt(norm_sq[0]) if norm_sq[0] >= 0 else norm_sq[0], step + 1, "the gradient norm")
        scale = clip_scale(float(norm_sq[0]), args.grad_clip)
        if scale != 1.0:
            params.grad *= scale
        if args.zero:
            opt.step(params.data[shard[0]:shard[1]], params.grad[shard[0]:shard[1]], lr)
            comm.allgather(params.data, topo.dp_comm)
        else:
            opt.step(params.data, params.grad, lr)

        # ---- bookkeeping (rank 0) ----------------------------------------------------
        dt = time.perf_counter() - t0
        if step == start_step:
            t_first_done = time.perf_counter()
            jit_notice.cancel()
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": math.sqrt(norm_sq[0]),
                  "step_ms": dt * 1e3, "tokens_per_s" if args.model == "gpt" else "examples_per_s": items_per_step / dt,
                  "model_flops_per_s": flops_per_item * items_per_step / dt}
        if buckets:
            record["comm_hidden_frac"] = buckets.stats().get("hidden")
        done = step + 1
        if done % eval_every == 0 or done == args.steps:
            record["val_loss"] = evaluate()
            if not math.isfinite(record["val_loss"]):
                raise diverged(record["val_loss"], done, "validation loss")
        if is_main:
            try:
                metrics.write(record)
            except rundir.RunDirError as e:
                stop.fail(str(e))                    # every rank stops at the boundary below
            if not args.quiet and (done % log_every == 0 or done == args.steps or done == start_step + 1):
                # The first step includes Numba's JIT compile (cached on disk afterwards): leave it out.
                timed = done - start_step - 1
                per_step = (time.perf_counter() - t_first_done) / timed if timed > 0 else dt
                # On the first step itself the compile time would dominate the estimate: give none.
                eta = _hms(per_step * (args.steps - done)) if timed > 0 or done == args.steps else "--"
                rate = record.get("tokens_per_s", record.get("examples_per_s"))
                line = (f"step {done:>{len(str(args.steps))}}/{args.steps} | loss {loss:.4f} | lr {lr:.2e} | "
                        f"{_rate(rate)} {'tok' if args.model == 'gpt' else 'ex'}/s | "
                        f"{dt * 1e3:.0f} ms | ETA {eta}")
                if "val_loss" in record:
                    line += f" | val {record['val_loss']:.4f}"
                say(line)
                log.info(line)
        saved_now = bool(args.checkpoint_every and done % args.checkpoint_every == 0 and done != args.steps)
        if saved_now:
            save(done, loss)
        dog.beat(done)
        # A collective every step: all ranks see the same answer, so none is left behind.
        try:
            stopping = stop.should_stop(world)
        except lifecycle.StopError as e:
            raise JobFailure(str(e)) from None
        if stopping and done != args.steps:
            if not saved_now:
                save(done, loss)
            stopped_at = done
            break

    if buckets:
        buckets.close()
    if stopped_at is not None:
        code = lifecycle.INTERRUPT_EXIT_CODE if stop.signum == signal.SIGINT else lifecycle.REQUEUE_EXIT_CODE
        # A second signal from here on must not turn this into "killed": the checkpoint is on disk.
        stop.forced_exit_code, stop.forced_note = code, f"the checkpoint of step {stopped_at} is written"
        then = ("so the batch script requeues the job (--resume auto continues)" if code == lifecycle.REQUEUE_EXIT_CODE
                else f"(interrupted); continue with --resume auto --out {out_dir}")
        say(f"{stop.signal_name} received: checkpoint at step {stopped_at} written; exiting with code {code} {then}")
        log.warning("stopped by %s at step %d (checkpointed)", stop.signal_name, stopped_at)
        raise SystemExit(code)
    if tracer:
        tracer.write()
        say(f"trace: {tracer.merged_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    if isinstance(model, PipelineModel) and is_main:
        say(f"pipeline rank 0: peak {model.executor.peak_in_flight} micro-batches in flight, "
            f"{model.executor.peak_activation_bytes / 2**20:.1f} MiB of activations")
    arrays = save(args.steps, loss) if start_step < args.steps else None
    stop.forced_exit_code, stop.forced_note = 0, "the run is complete and its final checkpoint written"
    if start_step >= args.steps:
        say(f"nothing to do: the checkpoint is already at step {start_step} of --steps {args.steps}")
    if stop.requested:
        say(f"note: {stop.signal_name} arrived during the final checkpoint; the run is complete")
    if is_main:
        final = checkpoint.manifest_path(ckpt_dir, max(args.steps, start_step))
        say(f"done: {max(0, args.steps - start_step)} steps in {_hms(time.perf_counter() - t_start)}; "
            f"checkpoint {final}, metrics {metrics.path}")
        if xp is not np and world.Get_size() > 1:
            say(f"GPU buffers and MPI on rank 0: {transfer_stats['staged_bytes'] / 2**20:.1f} MiB "
                f"copied through host memory ({transport.describe()})")
        if args.model == "gpt" and args.sample_bytes > 0 and arrays is not None:
            # Rank 0 may hold only the first pipeline stage: sample from a full copy.
            full = build_gpt(cfg, dtype=dtype)
            full.params.load_flat(full.params.data, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
            text = generate(full, b"def ", args.sample_bytes, min(args.seq_len, cfg.context),
                            temperature=0.8, seed=args.seed)
            shown = "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd"
                            for ch in text.decode("utf-8", errors="replace"))
            say("---- sample ----\ndef " + shown + "\n----------------")
    return model


def bucket_sizes(bucket_mb, grad_bytes):
    """(bucket bytes, first bucket bytes). Given --bucket-mb: that size for every
    bucket. Auto: about an eighth of the gradients, within [256 KiB, 25 MiB], so
    a small model still gets several buckets to overlap with backward (one
    bucket as big as the model cannot start before backward ends); the first
    bucket (the model's last layers, ready first) at most 1 MiB, as in PyTorch
    DDP, so communication starts early."""
    if bucket_mb is not None:
        size = max(1, int(bucket_mb * 2**20))
        return size, None
    size = int(min(25 * 2**20, max(256 * 2**10, grad_bytes / 8)))
    return size, min(size, 2**20)


def schedule_change(saved_args, args, start_step, lr_base, decay_steps, warmup):
    """A note when the resumed run's LR schedule spans other steps than the
    checkpoint's run (typically: continuing to a larger --steps)."""
    if not saved_args.get("steps"):
        return []
    from ringpipe.engine.optim import lr_at
    saved_decay = saved_args.get("decay_steps") or saved_args["steps"]
    if saved_decay == decay_steps:
        return []
    saved_lr = saved_args.get("lr") or lr_base
    saved_warmup = saved_args.get("warmup")
    saved_warmup = saved_warmup if saved_warmup is not None else max(1, saved_decay // 20)
    was = lr_at(start_step, saved_lr, saved_warmup, saved_decay, saved_args.get("min_lr_ratio", args.min_lr_ratio))
    now = lr_at(start_step, lr_base, warmup, decay_steps, args.min_lr_ratio)
    return [f"note: the LR schedule now spans {decay_steps} steps where the checkpoint's run had {saved_decay}: "
            f"step {start_step + 1} gets lr {now:.2e} where that run would have used {was:.2e}. To continue on the "
            f"original schedule (the LR then stays at its minimum), pass --decay-steps {saved_decay}"]


def _mib(nbytes):
    return f"{nbytes / 2**20:.2f} MiB"


# Flags whose change on resume makes the run differ from the uninterrupted one
# (the layout flags --dp/--pp/... and --steps may change freely).
TRAJECTORY_FLAGS = ("seed", "data", "data_path", "max_data_mb", "dtype", "precision", "batch_size", "seq_len", "lr",
                    "warmup", "min_lr_ratio", "weight_decay", "grad_clip")


def resume_differences(saved_args, args):
    """A note for each trajectory flag that differs from the checkpoint's run."""
    notes = []
    for key in TRAJECTORY_FLAGS:
        if key in saved_args and not _same_value(saved_args[key], getattr(args, key)):
            flag = "--" + key.replace("_", "-")
            notes.append(f"note: resuming with {flag} {getattr(args, key)} where the checkpoint's run had "
                         f"{saved_args[key]}: it continues, but no longer as that run would have")
    return notes


def restore(params, opt, arrays, manifest, shard, opt_name):
    """Load named parameters and optimizer state (any layout) into this rank's buffers."""
    params.load_flat(params.data, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
    if manifest.get("optimizer") != opt_name:
        raise SystemExit(f"error: the checkpoint was trained with --optimizer {manifest.get('optimizer')}, "
                         f"not {opt_name}")
    full = np.zeros(params.size, dtype=params.dtype)
    for state_name, buf in opt.state().items():
        prefix = f"opt/{state_name}/"
        params.load_flat(full, {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)},
                         what=f"optimizer state {state_name}")
        buf[...] = params.xp.asarray(full[shard[0]:shard[1]])
    opt.step_count = manifest["opt_step_count"]


def gather_state(params, opt, shard, topo, zero):
    """Named host arrays of all parameters and the full optimizer state, on world rank 0
    (other ranks get their own part). ZeRO shards are all-gathered within the
    data-parallel group, pipeline stages are gathered over the pipeline group."""
    from ringpipe import comm
    from ringpipe.engine.device import to_host
    arrays = {f"param/{k}": v for k, v in params.state_dict(params.data).items()}
    for state_name, buf in opt.state().items():
        if zero:
            full = np.zeros(params.size, dtype=params.dtype)
            full[shard[0]:shard[1]] = to_host(buf)
            comm.allgather(full, topo.dp_comm)
        else:
            full = buf
        arrays.update({f"opt/{state_name}/{k}": v for k, v in params.state_dict(full).items()})
    if topo.pp > 1 and topo.dp_rank == 0:
        # Checkpointing is not a hot path: a pickled gather of named arrays is fine here.
        parts = topo.pp_comm.gather(arrays, root=0)
        if topo.stage == 0:
            for part in parts:
                arrays.update(part)
    return arrays


def _rate(per_s):
    return f"{per_s / 1e3:.1f}k" if per_s >= 1e4 else f"{per_s:.0f}"


def _hms(seconds):
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
