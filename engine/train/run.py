"""The trainer: `run(config)` trains on every rank of `world` and returns how it ended.

    from ringpipe.engine.train.config import Config
from ringpipe.engine.train.evaluation import evaluate, sum_over_ranks
    from ringpipe.engine.train.run import run
    result = run(Config(steps=100, layers=2), world=MPI.COMM_WORLD)   # the same call on every rank

The loop reads top to bottom (llm.c's shape): zero the gradients, forward and
backward (gradients reduced along every parallel axis while backward runs),
the global gradient norm and clip, the optimizer update, then log, evaluate,
checkpoint, and the one small all-reduce per step that lets every rank agree
on a stop signal (and on the next batch: a rank whose rows of it cannot be used,
a token id outside the vocabulary, stops every rank there, before any uses it).
Everything before the first step is engine/train/assemble.py; everything parallel
is the rank model's (engine/parallel/).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpipe import kernels as K
from ringpipe.engine.job import checkpoint, lifecycle, rundir
from ringpipe.engine.train.saving import DivergedWeight
from ringpipe.engine.train.agreement import BadBatch, agree_batch, batch_error, batch_problem, stop_requested
from ringpipe.engine.train.assemble import Run, assemble
from ringpipe.engine.train import memory
from ringpipe.engine.monitor import jobstats
from ringpipe.engine.monitor.clock import span
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.evaluation import evaluate, sum_over_ranks
from ringpipe.engine.job.errors import ConfigError, Diverged, JobFailure
from ringpipe.engine.parallel.ps import ServerLink, serve
from ringpipe.engine.train import config as config_checks
from ringpipe.engine.train.agreement import check_same_config
from ringpipe.engine.model.optim import clip_scale, lr_at
from ringpipe.engine.train.reporting import hms, step_record
from ringpipe.engine.data.shards import Prefetcher


@dataclass
class RunResult:
    steps_done: int               # the step the run ended at
    loss: float                   # the last step's training loss
    exit_code: int = 0            # 0: finished; REQUEUE_EXIT_CODE / INTERRUPT_EXIT_CODE: stopped with a checkpoint
    stopped_by: str | None = None  # the signal's name, when stopped by one
    checkpoint: str | None = None  # the last checkpoint written
    model: Any = None             # the rank model: its buffers stay readable (its communicators are freed)


def run(cfg: Config, world=None, stop=None, render=None) -> RunResult:
    """Train. `world`: the communicator of all ranks of this job (default
    COMM_WORLD; tests pass COMM_SELF for a one-process reference). `stop`: the
    lifecycle.StopFlag to use (by default one is installed for the run and
    removed when it returns). `render`: how messages spell a setting (the CLI
    writes flags). Raises ConfigError, JobFailure or Diverged alike on every rank."""
    from mpi4py import MPI
    world = world or MPI.COMM_WORLD
    with contextlib.ExitStack() as cleanup:
        if stop is None:
            stop = lifecycle.StopFlag()
            cleanup.callback(stop.uninstall)
        # The precision is the kernels' module-wide GEMM default: the layers never pass one.
        cleanup.callback(K.set_matmul_precision, K.get_matmul_precision())
        K.set_matmul_precision(cfg.precision)
        servers = None
        if cfg.sync == "ps" and cfg.ps_servers:
            # Dedicated parameter servers: the last K ranks serve, the others train among
            # themselves (`world` becomes theirs); see engine/parallel/ps.py.
            servers = split_for_servers(cfg, world, cleanup)
            if servers.is_server:
                return served(serve(cfg, servers, stop), cfg, servers)
            world = servers.workers_comm
        training = assemble(cfg, world, stop, cleanup, render, servers)
        best = Best.from_manifest(training.manifest) if cfg.best_kept else None
        loss, stopped_at = train(training, best)
        result = finish(training, loss, stopped_at, best)
        if servers is not None:
            servers.outcome = {"steps_done": result.steps_done, "exit_code": result.exit_code,
                               "stopped_by": result.stopped_by}
        return result


# ---- dedicated parameter servers (--sync ps --ps-servers K) -----------------------------------

def split_for_servers(cfg: Config, world, cleanup) -> ServerLink:
    """Refuse a bad layout on every rank before any work, then split the job: the last
    K ranks serve. On the workers, the servers learn how the run ended when it does
    (the outcome, or the error every worker raised), after the model is closed."""
    check_same_config(cfg, world)
    config_checks.check(cfg, world.Get_size())
    link = ServerLink(world, cfg.ps_servers)
    cleanup.callback(link.free)
    # Where the servers run (monitor.json's header names them: a user who must find one,
    # or kill it, has its node and pid): one small gather, every rank.
    me = {"rank": link.rank, "node": socket.gethostname(), "pid": os.getpid()}
    link.server_places = [m for m in world.allgather(me) if m["rank"] in link.servers]
    if not link.is_server:
        cleanup.push(lambda kind, error, tb: tell_servers(link, error))    # runs after model.close()
    return link


def tell_servers(link: ServerLink, error) -> bool:
    link.stop()            # (when no model was built: an error before it)
    if error is not None:
        link.outcome = {"error": type(error).__name__, "message": str(error)}
    link.share_outcome(link.outcome)
    return False           # the error, if any, goes on


def served(outcome: dict, cfg: Config, link: ServerLink) -> RunResult:
    """A server rank's RunResult: the workers' outcome, or their error raised here too
    (the same class for a refusal or a divergence, so every rank exits alike). A run the
    workers finished gets this rank's completion marker too (`ringpipe finished` counts
    every rank of the job)."""
    if "error" in outcome:
        kinds = {"ConfigError": ConfigError, "Diverged": Diverged}
        raise kinds.get(outcome["error"], JobFailure)(
            f"the workers stopped ({outcome['error']}: {outcome['message']}); this parameter server with them")
    if outcome["exit_code"] == 0 and outcome["stopped_by"] is None:
        rundir.mark_finished(cfg.out_dir, link.rank, link.world.Get_size(), outcome["steps_done"])
    return RunResult(outcome["steps_done"], float("nan"), outcome["exit_code"], outcome["stopped_by"])


@dataclass
class Best:
    """The best validation loss so far and its step (<keep_best>). Every checkpoint's
    manifest records it, so a resumed run keeps the best an uninterrupted one would."""
    step: int | None = None
    val_loss: float | None = None

    @classmethod
    def from_manifest(cls, manifest: dict) -> Best:
        saved = manifest.get("best")
        return cls(saved["step"], saved["val_loss"]) if saved else cls()

    def improved_by(self, val_loss: float) -> bool:
        return self.val_loss is None or val_loss < self.val_loss


def train(training: Run, best: Best | None = None) -> tuple[float, int | None]:
    """The step loop. Returns (last loss, the step it stopped at on a signal, or None)."""
    # The next step's rows are read in a background thread while this step computes.
    with Prefetcher(training.dataset, training.cfg.batch_size, *training.rows) as batches:
        if training.start_step < training.cfg.steps:
            # The first batch is agreed on before the loop (one tiny all-reduce, once);
            # each later one inside the step before it (next_batch_problem).
            agree_batch(training.world, read_error(batches.error_of(training.start_step)))
        say_epochs(training)
        if training.cfg.fine_tuning and training.start_step == 0:
            validate_before_training(training, best)
        training.t_start = time.perf_counter()
        training.report.first_step_starts()
        return steps(training, batches, best)


def steps(training: Run, batches: Prefetcher, best: Best | None = None) -> tuple[float, int | None]:
    cfg, model, clock = training.cfg, training.model, training.clock
    loss = float("nan")
    for step in range(training.start_step, cfg.steps):
        t0 = time.perf_counter()
        clock.begin_step()               # the step's time split: every span below and in the layers
        lr = lr_at(step, cfg.peak_lr, cfg.warmup_steps, cfg.schedule_steps, cfg.min_lr_ratio)
        with span(clock, "next batch", "data"):
            x, y = batches.get(step)
        with span(clock, "zero gradients", "compute"):
            model.zero_grad()
        local_loss = model.forward_backward(x, y, training.grad_scale)
        with span(clock, "loss all-reduce", "comm"):
            loss = sum_over_ranks(training, local_loss) / training.items_per_step
        with span(clock, "gradient norm", "compute"):
            norm_sq = model.grad_norm_sq()
        refuse_non_finite(training, step + 1, loss=loss, grad_norm=math.sqrt(norm_sq) if norm_sq >= 0 else norm_sq)
        with span(clock, "update", "compute"):
            model.scale_grads(clip_scale(norm_sq, cfg.grad_clip))
            model.update(training.opt, lr)

        done = step + 1
        if cfg.memory_report and done == min(cfg.steps, training.start_step + 2):
            memory.report_measured(training, done)     # step 2: the first with the optimizer state in memory
            training.moments.end(memory.Moments.STEADY)
        step_s = time.perf_counter() - t0
        record = step_record(done, loss, lr, norm_sq, step_s, training.items_per_step,
                             training.flops_per_item, training.recipe.unit, model.comm_hidden_fraction(),
                             epochs_at(training, done), peak_flops=training.job_peak_flops)
        if cfg.inexact_mode:
            record["ps_mode"] = cfg.inexact_mode          # this run's losses are not sync's (ps_modes.py)
        # Every rank, every step (a gather every interval): the per-rank section, stragglers.
        training.monitor.step_done(done, step_s, clock.end_step(step_s),
                                   training.items_per_step // training.grid.size("data"), record)
        reported = saved_now = False
        try:
            if done % cfg.eval_period == 0 or done == cfg.steps:
                record.update(evaluate(training, final=done == cfg.steps))
                if "val_loss" in record:        # none: a stop signal ended the pass (evaluation.py)
                    refuse_non_finite(training, done, validation_loss=record["val_loss"])
            report_step(training, record)
            reported = True
            if training.sinks is not None:
                training.sinks.publish(record)         # TensorBoard, Prometheus: a background thread writes
            if "val_loss" in record:
                keep_if_best(training, best, done, record["val_loss"], loss)
            saved_now = bool(cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done != cfg.steps)
            if saved_now:
                save(training, done, loss, best, background=cfg.checkpoint_async)
            training.saver.poll()                      # commits a background save every rank has written
            training.dog.beat(done)
            stopping = agree_to_stop(training, next_batch_problem(training, batches, done))
        except BadBatch as e:
            # Every rank is here alike (the verdict was agreed): keep the steps done so far.
            if not reported:
                report_step(training, record)
            if not saved_now:
                save(training, done, loss, best)
            training.saver.wait()
            raise BadBatch(f"{e.message} (stopped after step {done}, before any rank used the batch; the "
                           f"checkpoint of step {done} holds the training so far)") from None
        if stopping and done != cfg.steps:
            if not saved_now:
                save(training, done, loss, best)
            return loss, done
    return loss, None


# ---- the pieces of a step -------------------------------------------------------------------

def refuse_non_finite(training: Run, step: int, **values) -> None:
    """A NaN/inf loss can be followed by a finite one; a NaN gradient norm with a finite
    loss (an overflow in backward) would poison every weight: stop before the update.
    The values are the same on every rank, so every rank stops here alike."""
    for what, value in values.items():
        if not math.isfinite(value):
            raise diverged(training, value, step, what.replace("_", " ").replace("grad ", "the gradient "))


def diverged(training: Run, value, step: int, what: str) -> Diverged:
    # Every checkpoint on disk is finite (save() refuses anything else), so the
    # newest valid one is a safe place to go back to.
    last = checkpoint.find_latest(training.ckpt_dir)
    then = (f"Nothing was saved after the last good checkpoint ({last}): lower <lr> or raise <warmup>, then "
            "resume from it with <resume> auto." if last else
            "No checkpoint was written yet: lower <lr> or raise <warmup> and start again.")
    return Diverged(f"{what} is {value} at step {step}: training diverged. {then}")


def report_step(training: Run, record: dict) -> None:
    try:
        training.report.step_done(record, training.start_step, training.recipe.rate_unit)
    except rundir.RunDirError as e:
        training.stop.fail(str(e))                  # every rank stops at the next boundary


# ---- what a fine-tune shows: the model as given, the epochs, the best step -------------------

def validate_before_training(training: Run, best: Best | None) -> None:
    """Step 0: validation of the weights as given (init_from), recorded like any step's,
    so a fine-tune that makes validation worse shows it against where it began."""
    val = evaluate(training)
    if not val:
        return                  # a stop signal ended the pass: the first step's boundary stops the run
    record = {"step": 0, **({"epoch": 0.0} if epochs_at(training, 0) is not None else {}), **val}
    refuse_non_finite(training, 0, validation_loss=record["val_loss"])
    try:
        training.report.validation_before_training(record)
    except rundir.RunDirError as e:
        training.stop.fail(str(e))                  # every rank stops at the first step's boundary
    keep_if_best(training, best, 0, record["val_loss"], None)


def train_items(dataset) -> int | None:
    """Tokens (GPT) or examples (MLP) in the training split; None for a dataset that does not say."""
    train = getattr(dataset, "splits", {}).get("train")
    if train is None:
        return None
    return len(train[0]) if isinstance(train, tuple) else len(train)     # (x, y) of a classification set


def epochs_at(training: Run, step: int) -> float | None:
    """Passes over the training split after `step` steps (a batch draws its windows at random,
    so an epoch is as many items as the split holds, not each item once)."""
    items = train_items(training.dataset)
    return step * training.items_per_step / items if items else None


# More passes than these over the training data: validation often gets worse (the model
# learns the text by heart). A fine-tune's data is usually small and the model already
# good, so it gets the note sooner than a run from scratch.
EPOCHS_NOTED = {"fine-tune": 3, "scratch": 10}


def say_epochs(training: Run) -> None:
    total, items = epochs_at(training, training.cfg.steps), train_items(training.dataset)
    if total is None:
        return
    unit = training.recipe.unit
    per_epoch = items / training.items_per_step
    resumed = f"; resuming at epoch {epochs_at(training, training.start_step):.2f}" if training.start_step else ""
    training.report.say(f"epochs: <steps> {training.cfg.steps} x {training.items_per_step:,} {unit} = {total:.2f} "
                        f"epoch(s) of the training split ({items:,} {unit}; one epoch is {per_epoch:,.1f} "
                        f"steps){resumed}")
    kind = "fine-tune" if training.cfg.fine_tuning else "scratch"
    if total > EPOCHS_NOTED[kind]:
        fewer = max(1, int(EPOCHS_NOTED[kind] * per_epoch))
        training.report.note(f"note: {total:.1f} epochs: the run sees its training data {total:.0f} times over; "
                             f"past about {EPOCHS_NOTED[kind]} a {'fine-tune' if kind == 'fine-tune' else 'model'} "
                             "often learns the text by heart and validation gets worse"
                             + (" than at step 0" if kind == "fine-tune" else "")
                             + f". Watch the val column; <keep_best> keeps the best checkpoint; for at most "
                             f"{EPOCHS_NOTED[kind]} epochs pass <steps> {fewer}, or train on more data")


def keep_if_best(training: Run, best: Best | None, step: int, val_loss: float, loss: float | None) -> None:
    """With <keep_best>: a validation loss lower than any before makes this step's
    checkpoint OUT/best/'s one (written as every checkpoint is, any layout)."""
    if best is None or not best.improved_by(val_loss):
        return
    best.step, best.val_loss = step, val_loss
    save(training, step, loss, best, directory=rundir.best_path(training.cfg.out_dir), alone=True)


def say_best(training: Run, best: Best) -> None:
    if best.step is None:
        return
    folder = rundir.best_path(training.cfg.out_dir)
    path = checkpoint.manifest_path(folder, best.step)
    per_token = getattr(training.dataset, "bytes_per_token", lambda split: None)("val")
    bpb = f" ({best.val_loss / math.log(2) / per_token:.3f} bits/byte)" if per_token else ""
    worse = (": no step improved on the model as given (lower <lr> or fewer <steps>)"
             if best.step == 0 and training.cfg.fine_tuning else "")
    if not training.report.is_main or os.path.exists(path):
        kept = f"its checkpoint is {path} (ringpipe export {folder} ..., ringpipe sample {folder} ...)"
    else:
        # Resumed from before a better step that this run, with other settings, did not reach
        # again: the folder holds that step's checkpoint, which is not this run's best.
        held = ", ".join(os.path.basename(p) for p in checkpoint.list_checkpoints(folder)) or "nothing"
        kept = (f"its checkpoint is not kept: {folder} holds {held}, written before this run resumed from step "
                f"{training.start_step}, by a trajectory this one left")
    training.report.say(f"best validation: step {best.step}, val {best.val_loss:.4f}{bpb}{worse}; {kept}")


# What stop.fail() is given when this rank's rows of the next batch cannot be used:
# the flag rides in the step's stop all-reduce, the message is gathered only then.
_BAD_BATCH = "ringpipe: a rank could not use its rows of the next batch"


def read_error(error):
    """The error a batch read raised that the ranks agree on and stop for (a bad token
    id, a shard that changed or cannot be read); anything else is a bug, raised as is."""
    if error is None or isinstance(error, (ValueError, OSError)):
        return error
    raise error


def next_batch_problem(training: Run, batches: Prefetcher, done: int):
    """Check this rank's rows of the next step's batch (read ahead while this step
    computed) before any rank uses them. Each rank reads only its rows (and every
    rank of a tensor group or pipeline the same ones), so a bad id one replica holds
    must stop all: the verdict is folded into the stop signal's all-reduce at the end
    of this step, costing no message of its own. (Checking the whole global batch on
    every rank would need no agreement, but multiplies each rank's reads by the
    data-parallel size: 64 rows of 1025 tokens take 190 us of preads, so dp 64 would
    spend 12 ms a step per rank and put 64x the reads on a shared filesystem.)"""
    if done >= training.cfg.steps:
        return None                              # the batch read ahead past the last step is never used
    problem = batch_problem(read_error(batches.error_of(done)), training.world.Get_rank())
    if problem is not None:
        training.stop.fail(_BAD_BATCH)
    return problem


def agree_to_stop(training: Run, problem=None) -> bool:
    """A collective every step: all ranks see the same answer, so none is left behind.
    `problem`: this rank's with the next batch (next_batch_problem), raised as
    BadBatch on every rank when any rank has one. A signal a dedicated parameter server
    got counts too (stop_requested)."""
    try:
        return stop_requested(training)
    except lifecycle.StopError as e:
        # Every rank holds the same StopError (the first failing rank's message), so
        # all take the same branch here, and the gather below is collective.
        if str(e).startswith(_BAD_BATCH):
            raise batch_error(training.world, problem) from None
        raise JobFailure(str(e)) from None


# ---- checkpoints ---------------------------------------------------------------------------

def save(training: Run, step: int, loss: float | None, best: Best | None = None, directory: str | None = None,
         alone: bool = False, background: bool = False) -> dict | None:
    """Write checkpoint `step` into `directory` (the run's checkpoints; `alone`: as the only
    one there, OUT/best/'s), sharded or whole-file, at once or (background) while the next
    steps run (engine/train/saving.py). Every rank learns whether it was written, so a full
    disk ends the job cleanly instead of with an abort. Returns the whole arrays on rank 0
    for a whole-file save, else None."""
    if training.moments:
        training.moments.end("steps")
    try:
        arrays = training.saver.save(step, checkpoint_meta(training, loss, best), directory or training.ckpt_dir,
                                     keep=training.cfg.keep, alone=alone, background=background)
    except DivergedWeight as e:
        raise diverged(training, e.why, e.step, "a weight") from None
    if training.moments:
        training.moments.end("save (staging, async)" if background and training.saver.sharded else "save")
    return arrays


def checkpoint_meta(training: Run, loss: float | None, best: Best | None = None) -> dict:
    settings = training.cfg.to_dict()
    # The settings as they were resolved, as older checkpoints recorded them.
    # A prepared folder is recorded by its real path (a resume from another directory, or
    # through a link, still names it so); older checkpoints say only "prepared".
    data = os.path.realpath(training.cfg.data) if training.cfg.dataset == "prepared" else training.cfg.dataset
    settings.update(data=data, seq_len=training.seq_len, schedule=training.cfg.schedule_name,
                    partition=training.cfg.partition_name)
    cfg, grid = training.cfg, training.grid
    meta = {"model": cfg.model, "model_config": training.shape.to_dict(), "optimizer": cfg.optimizer,
            "opt_step_count": training.opt.step_count, "loss": loss, "dtype": cfg.dtype, "precision": cfg.precision,
            "layout": {"dp": grid.size("data"), "pp": grid.size("pipe"), "tp": grid.size("tensor"),
                       "chunks": cfg.chunks},
            "args": settings}
    if training.tokenizer is not None:
        meta["tokenizer"] = {"kind": training.tokenizer.kind, "sha256": training.tokenizer.sha256,
                             "vocab_size": training.tokenizer.vocab_size, "file": "tokenizer.json"}
    if best is not None and best.step is not None:
        meta["best"] = {"step": best.step, "val_loss": best.val_loss}
    return meta


# ---- the end ---------------------------------------------------------------------------------

def finish(training: Run, loss: float, stopped_at: int | None, best: Best | None = None) -> RunResult:
    cfg, report = training.cfg, training.report
    training.saver.wait()            # a background save in flight is committed before the run ends
    if stopped_at is not None:
        code = lifecycle.INTERRUPT_EXIT_CODE if training.stop.signum == signal.SIGINT else lifecycle.REQUEUE_EXIT_CODE
        who = signalled(decide_exit(training, code, stopped_at), training.servers)
        then = ("so the batch script requeues the job (--resume auto continues)" if code == lifecycle.REQUEUE_EXIT_CODE
                else f"(interrupted); continue with <resume> auto <out> {cfg.out_dir}")
        report.note(f"{training.stop.signal_name} received: checkpoint at step {stopped_at} written; exiting with code "
                    f"{code} {then}{who}")
        report.log.warning("stopped by %s at step %d (checkpointed)%s", training.stop.signal_name, stopped_at, who)
        return RunResult(stopped_at, loss, code, training.stop.signal_name,
                         checkpoint.manifest_path(training.ckpt_dir, stopped_at), training.model)
    if training.tracer:
        training.tracer.write()
        report.say(f"trace: {training.tracer.merged_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    summary = training.model.summary()
    if summary:
        report.say(summary)
    arrays = save(training, cfg.steps, loss, best) if training.start_step < cfg.steps else None
    decide_exit(training, 0)
    if training.start_step >= cfg.steps:
        report.say(f"nothing to do: the checkpoint is already at step {training.start_step} of <steps> {cfg.steps}")
    if training.stop.requested:
        report.note(f"note: {training.stop.signal_name} arrived during the final checkpoint; the run is complete")
    final = checkpoint.manifest_path(training.ckpt_dir, max(cfg.steps, training.start_step))
    report.say(f"done: {max(0, cfg.steps - training.start_step)} steps in "
               f"{hms(time.perf_counter() - training.t_start)}; checkpoint {final}, "
               f"metrics {rundir.metrics_path(cfg.out_dir)}")
    if best is not None:
        say_best(training, best)
    if training.xp is not np and training.world.Get_size() > 1:
        from ringpipe.comm.device import stats
        report.say(f"GPU buffers and MPI on rank 0: {stats['staged_bytes'] / 2**20:.1f} MiB copied through host "
                   f"memory ({training.transport.describe()})")
    if training.recipe.generate is not None and cfg.sample_tokens > 0 and training.start_step < cfg.steps \
            and report.is_main:
        sample(training, arrays)
    memory.report_moments(training)
    summarize_job(training)
    # The last thing every rank does: what `ringpipe finished RUN_DIR` counts. With dedicated
    # parameter servers the job's ranks and rank numbers (the servers mark theirs: served()).
    world = training.servers.world if training.servers is not None else training.world
    rundir.mark_finished(cfg.out_dir, world.Get_rank(), world.Get_size(), max(cfg.steps, training.start_step))
    return RunResult(max(cfg.steps, training.start_step), loss, 0, None, final, training.model)


def decide_exit(training: Run, code: int, stopped_at: int | None = None) -> list | None:
    """The exit code is decided and covered by a checkpoint (the stop checkpoint of
    `stopped_at`, or the final one): a second signal from now on must not turn it into
    "killed", on any rank (dedicated servers are told: DECIDED). After a stop, every rank's
    own signal is gathered on rank 0 (returned there, None elsewhere): rank 0 announces
    the code only once every rank holds it. Without that, a second signal could end another
    rank (still on its way here) as "killed" after rank 0 had announced this code: the
    job's exit code would contradict what it said. A second signal before this point ends
    the job as killed, with nothing announced."""
    training.stop.decided(code, stopped_at)
    link = training.servers
    if link is not None:
        link.decided(code, stopped_at)
    if stopped_at is None:
        return None
    if link is not None:
        return link.gather_signals(training.stop.received)
    return training.world.gather(training.stop.received, root=0)


def signalled(signals: list | None, link=None) -> str:
    """'; SIGTERM to rank 2 (a parameter server)': who got which signal, from every rank's
    own (decide_exit's gather, indexed by the job's ranks); '' where not known (not rank 0)."""
    if not signals:
        return ""
    servers = set(link.servers) if link is not None else set()
    by_signal: dict = {}
    for rank, signum in enumerate(signals):
        if signum:
            by_signal.setdefault(signum, []).append(rank)
    parts = []
    for signum, ranks in sorted(by_signal.items()):
        name = lifecycle.signal_name(signum)
        if len(ranks) == len(signals) and len(ranks) > 1:
            parts.append(f"{name} to every rank")
            continue
        shown = ", ".join(f"{r} (a parameter server)" if r in servers else str(r) for r in ranks[:8])
        more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
        parts.append(f"{name} to rank{'s' if len(ranks) > 1 else ''} {shown}{more}")
    return "; " + "; ".join(parts) if parts else ""


def summarize_job(training: Run) -> None:
    """OUT/job_summary.{json,txt}: per node CPU, memory and time split, efficiency, and Slurm's
    accounting where it answers (collective: one gather of every rank's totals)."""
    totals = training.monitor.totals_at_end()
    if training.report.is_main:
        wall = max(t["wall_s"] for t in totals)
        json_path, text_path = jobstats.write_summary(training.cfg.out_dir, training.monitor.header, totals, wall)
        if text_path:
            training.report.say(f"job summary: {text_path}")


def sample(training: Run, arrays: dict) -> None:
    """Rank 0 may hold only the first pipeline stage: sample from a full copy."""
    if training.tokenizer is None:
        # Token ids without a tokenizer say nothing to a reader; a silent skip looked like a bug.
        training.report.note("no sample at the end: the data has no tokenizer (token shards, nanoGPT's or llm.c's, "
                             "without a tokenizer.json beside them), so nothing can turn token ids into text; put the "
                             "tokenizer.json the data was made with beside the shards, or prepare the text with "
                             "`ringpipe prepare`; "
                             "<sample_tokens> 0 skips the sample")
        return
    full = training.recipe.build(training.shape, dtype=training.dtype)
    if arrays is None:         # a sharded checkpoint: its parameters read back whole
        wanted = {f"param/{s.name}": s.full_shape for s in full.params.specs}
        arrays, _ = checkpoint.load(checkpoint.manifest_path(training.ckpt_dir, training.cfg.steps), expected=wanted)
    full.params.load_flat(full.params.data, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
    # Python source for the byte model of the stdlib; a document's start for other tokenizers.
    prompt = "def " if training.tokenizer.kind == "bytes" else ""
    ids = list(training.tokenizer.encode(prompt)) if prompt else list(training.tokenizer.separator)
    context = min(training.seq_len, training.shape.context)
    # Rank 0 samples alone: its own signal ends the sample (the job's launcher signals every rank).
    new = training.recipe.generate(full, ids, training.cfg.sample_tokens, context, temperature=0.8,
                                   seed=training.cfg.seed, stop=lambda: training.stop.requested)
    training.report.sample(prompt + training.tokenizer.decode(new))
    if len(new) < training.cfg.sample_tokens:
        training.report.note(f"note: {training.stop.signal_name} arrived while sampling: the sample above stops "
                             f"after {len(new)} of <sample_tokens> {training.cfg.sample_tokens} tokens")
