"""The range of every numeric setting of a run, as one table (RANGES), and its check.

    check_ranges(cfg)        # ConfigError naming the first setting out of its range

A value outside its range is refused before any work, whichever way it came (a flag, a
Config made in a notebook): a count of 10^20 validation batches or sampled tokens would run
until killed, a head count of 10^20 would spin in the divisor search of the error message,
a weight decay of 10^20 scales the weights by -2e17 in one step. The upper bounds are sane
maxima far past real use (GPT-2 1.5B's and Llama 405B's shapes, 128k and 10M-token contexts,
millions of steps, thousands of ranks all fit well inside them); what fits in memory is
check_memory's to say (engine/train/config.py), once the shape is known. Settings that
bind two values (lr x weight_decay, validation rows against the split) are checked next
to the table, where both are known.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.gpt import MAX_NEW_TOKENS
# The model's shape: the bounds every model config's validate() holds, the same for a flag,
# a checkpoint and a Hugging Face config.json (MAX_CONTEXT bounds <seq_len> too).
from ringpipe.engine.model.limits import MAX_CONTEXT, MAX_FFN, MAX_HEADS, MAX_LAYERS, MAX_ROPE_THETA, MAX_WIDTH

MAX_STEPS = 10**9              # a step a millisecond for 11 days; real runs: up to a few million
MAX_RANKS = 1 << 24            # the largest machines have millions of cores
MAX_BATCH = 1 << 24            # sequences or examples in one global batch
MAX_EVAL_BATCHES = 1_000_000   # a validation pass (nanoGPT: 200 batches; Megatron: 100)
MAX_SEED = 2**63 - 1           # what an int64 holds (numpy's generators take any whole number >= 0)
MAX_DATA_MB = 1 << 30          # 1 PiB
MAX_BUCKET_MB = 1 << 20        # 1 TiB: past the gradients' size a bucket is just one bucket
MAX_SECONDS = 10**7            # 4 months: longer than any job runs
MAX_STALENESS = 1000           # ssp:S (bounded staleness runs use S of 1 to tens)


@dataclass(frozen=True)
class Range:
    """What a numeric setting may be: low <= value <= high (low < value with `above`), a
    whole number unless `real`. `hint`: what the setting means or what to do, said with a
    refusal; `words`: the whole rule in words, for a setting whose rule is not a plain
    range (said in place of "must be >= low"); `also`: words a setting takes besides
    numbers (auto, all)."""
    low: float
    high: float
    hint: str = ""
    above: bool = False
    real: bool = False
    words: str = ""
    also: tuple = ()


_STEPS = f"at most {MAX_STEPS:,} steps"
# Every numeric field of Config. None (the default where a field has one that depends on
# other settings) is not checked here.
RANGES = {
    # ---- model
    "layers": Range(1, MAX_LAYERS, "transformer blocks / MLP hidden layers; the deepest real models have a few "
                                   "hundred"),
    "d_model": Range(1, MAX_WIDTH, "the model's width; the widest real models are about 25,000"),
    "heads": Range(1, MAX_HEADS, "attention heads, dividing <d_model>; real models have up to 128"),
    "context": Range(1, MAX_CONTEXT, "the longest sequence the model reads, in tokens"),
    "kv_heads": Range(1, MAX_HEADS, "key/value heads, dividing <heads>"),
    "d_ff": Range(1, MAX_FFN, "the SwiGLU intermediate size; real models use 2.5 to 4 x <d_model>"),
    "sliding_window": Range(1, MAX_CONTEXT, "positions a query attends to, itself included; real models use 512 "
                                            "to 4096"),
    "rope_theta": Range(1, MAX_ROPE_THETA, "the rotary base: its powers theta^(-2i/d) must fall from 1 for the "
                                           "frequencies to span long wavelengths; real models use 10^4 to 10^7",
                        above=True, real=True),
    # ---- data
    "max_data_mb": Range(0, MAX_DATA_MB, "MiB of a text folder read into memory per rank", above=True, real=True),
    "seq_len": Range(1, MAX_CONTEXT, "tokens in a training sequence, at most the <context>"),
    "batch_size": Range(1, MAX_BATCH, "the GLOBAL batch in sequences or examples"),
    # ---- optimization
    "steps": Range(1, MAX_STEPS, "optimizer steps"),
    "lr": Range(0, 1e6, "the peak learning rate; real runs use 1e-5 to 1, SGD with LARS up to about 30 (one that "
                        "diverges stops the run at that step, naming the last good checkpoint)", above=True, real=True),
    "warmup": Range(0, MAX_STEPS, "warmup steps"),
    "decay_steps": Range(1, MAX_STEPS, "the steps the LR schedule spans"),
    "min_lr_ratio": Range(0, 1, real=True, words="is the fraction of <lr> the schedule decays to: it must be between "
                                                 "0 and 1"),
    "weight_decay": Range(0, 100, "real runs use 0 to 1 (AdamW 0.1, SGD 5e-4); <lr> x <weight_decay> must also "
                                  "stay below 1", real=True),
    "grad_clip": Range(0, 1e6, "0 disables clipping", real=True),
    "seed": Range(0, MAX_SEED, "it seeds numpy's generators"),
    # ---- parallelism
    "dp": Range(1, MAX_RANKS, "data-parallel ranks; ranks = dp x pp x tp"),
    "bucket_mb": Range(0, MAX_BUCKET_MB, "a bucket larger than the gradients is one bucket anyway: leave <bucket_mb> "
                                         "out for the automatic size, or give a size in MiB", above=True, real=True),
    "zero": Range(0, 3, words="must be 0 (none), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)"),
    "ps_servers": Range(0, MAX_RANKS, "dedicated server ranks, the last of the job; 0: every rank serves its chunks"),
    "pp": Range(1, MAX_RANKS, "pipeline stages; ranks = dp x pp x tp"),
    "tp": Range(1, MAX_RANKS, "tensor-parallel ranks; ranks = dp x pp x tp"),
    "microbatches": Range(1, MAX_BATCH, "micro-batches per step and data-parallel replica, dividing its batch"),
    "chunks": Range(1, MAX_LAYERS, "model chunks per pipeline rank, each at least one layer"),
    # ---- output
    "checkpoint_every": Range(0, MAX_STEPS, "steps between checkpoints; 0: only at the end"),
    "keep": Range(0, MAX_STEPS, "checkpoints kept; 0: all"),
    "eval_every": Range(1, MAX_STEPS, "steps between validation passes; leave it out for <steps>/5"),
    "eval_batches": Range(1, MAX_EVAL_BATCHES, "batches per validation pass; all: a classifier's whole validation "
                                               "split, each example once", also=("all",)),
    "log_every": Range(1, MAX_STEPS, "steps between progress lines; leave it out for about 20 lines"),
    "sample_tokens": Range(0, MAX_NEW_TOKENS, "tokens sampled at the end of the run; 0: none"),
    # ---- monitoring
    "monitor_every": Range(0, MAX_STEPS, also=("auto",), words="is the steps between per-rank measurements: a whole "
                                                               f"number >= 0 (0: off) or auto, {_STEPS}"),
    "metrics_port": Range(1, 65535, words="must be a TCP port, 1 to 65535"),
    "straggler_ratio": Range(1, 1000, "a rank this many times its peers' median is named", above=True, real=True),
    "straggler_intervals": Range(1, MAX_STEPS, "intervals in a row before a rank is named a straggler"),
    # ---- cluster
    "watchdog": Range(0, MAX_SECONDS, "seconds without progress before a report; 0: off", real=True),
}


def check_ranges(cfg) -> None:
    """Refuse the first setting of RANGES (in the table's order) that is not a number of
    its kind in its range: ConfigError naming it, the rule, the value and what it means."""
    for field, allowed in RANGES.items():
        value = getattr(cfg, field)
        if value is None or (isinstance(value, str) and value in allowed.also):
            continue
        problem = _out_of_range(value, allowed)
        if problem is not None:
            rule, hint = problem
            shown = value if isinstance(value, numbers.Real) and not isinstance(value, bool) else repr(value)
            raise ConfigError(f"<{field}> {rule}, got {shown}" + (f" ({hint})" if hint else ""))


def _out_of_range(value, allowed: Range) -> tuple[str, str] | None:
    """(the rule `value` breaks, in the words after "<field> "; a hint), or None."""
    kind = numbers.Real if allowed.real else numbers.Integral
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "a number" if allowed.real else "a whole number"
        return allowed.words or f"must be {what}" + "".join(f" or {word}" for word in allowed.also), allowed.hint
    below = value <= allowed.low if allowed.above else value < allowed.low
    if not below and value <= allowed.high:
        return None
    if allowed.words:
        return allowed.words, ""
    rule = f"{'>' if allowed.above else '>='} {_shown(allowed.low)}" if below else f"<= {_shown(allowed.high)}"
    return f"must be {rule}", allowed.hint


def _shown(bound) -> str:
    """A bound as a message shows it: 1,000,000 for a whole number, 1e+12 for a large real one."""
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"
