"""What a run tells its user: start-up lines, a progress line per log period
with an ETA and the epoch, OUT/metrics.jsonl (a record per step; a fine-tune's
first record is step 0's validation alone), the final summary and a text sample. Rank 0 prints and writes; every other rank's Reporter is silent.
Quiet (<quiet>) prints only warnings and notes (Reporter.note) and the sample asked for;
metrics.jsonl and the rank log are written as ever.

Messages may name settings as <field> (engine/job/errors.py); `render` spells them
(the command line passes one that writes flags).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time

from ringpipe.engine.job import rundir
from ringpipe.engine.job.errors import spell
from ringpipe.engine.monitor import confusion


class Reporter:
    def __init__(self, is_main: bool, quiet: bool, steps: int, log_every: int | None, render=None):
        self.is_main, self.quiet, self.steps = is_main, quiet, steps
        self.log_every = log_every or max(1, steps // 20)
        self.render = render or (lambda field: field)
        self.metrics: rundir.MetricsLog | None = None
        self.log = None                       # the rank's logger (lifecycle.setup_rank_logging)
        self._t_first_done = None
        self._jit_notice = None
        self._stdout_gone = False

    def say(self, text: str) -> None:
        """A fact (the start-up report, the end of a run): printed on rank 0 unless quiet."""
        if not self.quiet:
            self._print(text)

    def note(self, text: str) -> None:
        """A warning or a note, what the user must hear (a setting with no effect, files
        moved aside, a stop signal): printed on rank 0, quiet or not."""
        self._print(text)

    def _print(self, text: str) -> None:
        if self.is_main and not self._stdout_gone:
            try:
                print(spell(text, self.render), flush=True)
            except BrokenPipeError:
                self._reader_went_away()

    def _reader_went_away(self) -> None:
        """Whoever read stdout stopped (`ringpipe train | head`). That must not end the run:
        metrics.jsonl, the checkpoints and the rank log record everything. Later lines go to
        /dev/null, so neither they nor Python's flush at exit raise again."""
        self._stdout_gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        if self.log:
            self.log.warning("stdout was closed by its reader; the run goes on (metrics.jsonl and this log record it)")

    # ---- the first step ---------------------------------------------------------------
    def first_step_starts(self) -> None:
        """The first step compiles the kernels (Numba JIT, cached on disk afterwards):
        half a minute of silence on a cold cache unless somebody says so."""
        if self.is_main and not self.quiet:
            self._jit_notice = threading.Timer(5.0, self.say, (
                "step 1 is taking a while: the first step compiles the kernels (Numba JIT; once, cached for "
                "later runs) ...",))
            self._jit_notice.daemon = True
            self._jit_notice.start()

    def stop_notices(self) -> None:
        if self._jit_notice is not None:
            self._jit_notice.cancel()

    # ---- every step ---------------------------------------------------------------------
    def step_done(self, record: dict, first_step: int, items_name: str) -> None:
        """Write the step's record to metrics.jsonl and, every log period, a progress
        line. Raises rundir.RunDirError when the record cannot be written."""
        done, dt = record["step"], record["step_ms"] / 1e3
        if done == first_step + 1:
            self._t_first_done = time.perf_counter()
            self.stop_notices()
        if not self.is_main:
            return
        # A classifier's confusion matrix goes to a file of its own (the record stays one short line).
        self.metrics.write(confusion.split_off(record, os.path.dirname(self.metrics.path)))
        if self.quiet or not (done % self.log_every == 0 or done == self.steps or done == first_step + 1):
            return
        # The first step includes Numba's JIT compile (cached on disk afterwards): leave it out
        # of the estimate, and give none on the first step itself (the compile would dominate).
        timed = done - first_step - 1
        per_step = (time.perf_counter() - self._t_first_done) / timed if timed > 0 else dt
        eta = hms(per_step * (self.steps - done)) if timed > 0 or done == self.steps else "--"
        # step_record's {unit}_per_s, whatever the family counts (tokens, examples, rows, ...)
        rate = next(value for key, value in record.items() if key.endswith("_per_s") and key != "model_flops_per_s")
        line = (f"step {done:>{len(str(self.steps))}}/{self.steps} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.2e} | {_rate(rate)} {items_name}/s | {dt * 1e3:.0f} ms | ETA {eta}"
                f"{_epoch(record)}{_validation(record)}{_mode(record)}")
        self.say(line)
        if self.log:
            self.log.info(line)

    def validation_before_training(self, record: dict) -> None:
        """Step 0's record (validation only, before any update: the model as given) to
        metrics.jsonl and a line. Raises rundir.RunDirError like step_done."""
        if not self.is_main:
            return
        self.metrics.write(confusion.split_off(record, os.path.dirname(self.metrics.path)))
        line = f"step {0:>{len(str(self.steps))}}/{self.steps} | before the first update{_validation(record)}"
        if not self.quiet:
            self.say(line)
        if self.log:
            self.log.info(line)

    # ---- the end ---------------------------------------------------------------------------
    def sample(self, text: str) -> None:
        # what the run was asked to write (<sample_tokens>, 0 for none): printed, quiet or not
        shown = "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)
        self._print(f"---- sample ----\n{shown}\n----------------")

    def close(self) -> None:
        self.stop_notices()
        if self.metrics is not None:
            self.metrics.close()


def model_line(name: str, shape: dict, total: int, on_rank0: int, dtype: str, bf16: bool) -> str:
    """The start-up line that names the model: its shape and its parameters. total: the
    whole model's; on_rank0: what rank 0 holds, said too when tensor or pipeline
    parallelism splits the model (a reader takes the first number for the model's)."""
    held = "on rank 0" if on_rank0 == total else f"(rank 0 holds {on_rank0:,})"
    return f"ringpipe | {name} {shape} | {total:,} parameters {held} | {dtype}{', bf16 matmuls' if bf16 else ''}"


def model_parameters(layers) -> int:
    """The parameters of a whole model, counted from its layers' specs (a tied weight
    once), with no array made."""
    sizes = {spec.name: math.prod(spec.shape) for layer in layers for spec in layer.specs()}
    return sum(sizes.values())


def step_record(step, loss, lr, norm_sq, dt, items_per_step, flops_per_item, unit, hidden=None,
                epoch=None, peak_flops=None) -> dict:
    """One line of metrics.jsonl. unit: what the model counts (its recipe's: "tokens" gives
    tokens_per_s). epoch: passes over the training split so far (a float), when known.
    peak_flops: the job's (every rank's measured GEMM peak, summed): gives "mfu"."""
    record = {"step": step, "time": time.time(), "loss": loss, "lr": lr, "grad_norm": math.sqrt(norm_sq),
              "step_ms": dt * 1e3, f"{unit}_per_s": items_per_step / dt,
              "model_flops_per_s": flops_per_item * items_per_step / dt}
    if peak_flops:
        record["mfu"] = record["model_flops_per_s"] / peak_flops
    if epoch is not None:
        record["epoch"] = epoch
    if hidden is not None:
        record["comm_hidden_frac"] = hidden
    return record


def _mode(record: dict) -> str:
    """A parameter-server mode that changes the math, on every line it shaped."""
    return f" | ps {record['ps_mode']} (not sync's math)" if "ps_mode" in record else ""


def _epoch(record: dict) -> str:
    return f" | epoch {record['epoch']:.2f}" if "epoch" in record else ""


def _validation(record: dict) -> str:
    line = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
    if "val_bpb" in record:
        line += f" ({record['val_bpb']:.3f} bits/byte)"
    if "val_accuracy" in record:
        line += f" | acc {100 * record['val_accuracy']:.1f}%"
    return line


def _rate(per_s):
    return f"{per_s / 1e3:.1f}k" if per_s >= 1e4 else f"{per_s:.0f}"


def hms(seconds):
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
