"""What a training run needs, as data: `Config`, and the checks that refuse a
configuration that cannot work before any work is done.

    cfg = Config(steps=100, dp=2, pp=2, microbatches=4)   # every field has a default
    notes = check(cfg, world_size=4)    # ConfigError for what cannot work, notes for what has no effect

The command line (engine/train/cli.py) is one way to fill a Config: each field is
the flag of the same name (`batch_size` is `--batch-size`; `layers`, `heads`,
`d_model` also shape the MLP). Messages name settings as <field> (see
engine/job/errors.py), so the CLI can show them as flags and the library as fields.
Defaults that depend on other settings (the learning rate, the schedule's
length, the pipeline schedule) are resolved by the methods below, never by
rewriting the fields, so a Config always says what the user asked for.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import numpy as np

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.chain import RECOMPUTE
from ringpipe.engine.model.registry import names_of
from ringpipe.engine.train.memory import recompute_of
from ringpipe.engine.train.ranges import MAX_STALENESS, check_ranges

# Fine-tuning (init_from) defaults, each used only where the setting was not given
# (fine_tuning_notes prints which, and docs/fine-tuning.md says why):
FINE_TUNING_LR_FACTOR = 0.1       # of the scratch LR: steps that large undo what the model learned
FINE_TUNING_WARMUP_DIVISOR = 100  # warmup = 1% of the schedule (5% from scratch): Adam's moments settle fast
FINE_TUNING_EVALS = 10            # validation every 10% of the steps (every 20% from scratch)
DATASET_NAMES = ("stdlib", "synthetic", "fashion-mnist", "text")
# The datasets of each kind of data a model family trains on (engine/model/recipe.py
# DATA_KINDS); "prepared" is a folder of token shards. SYNTHETIC is of both kinds.
DATASETS = {"tokens": ("prepared", "stdlib", "synthetic", "text"), "classes": ("fashion-mnist", "synthetic")}
DATA_WORDS = {"tokens": "a text corpus", "classes": "a classification set"}
# The Config fields that set a model's shape; a family takes those its recipe maps.
SHAPE_FIELDS = ("layers", "d_model", "heads", "context", "kv_heads", "d_ff", "rope_theta", "tie_embeddings",
                "qk_norm", "nope_layers", "norm_place", "sliding_window", "window_layers")


@dataclass
class Config:
    # ---- model
    model: str = "gpt"                 # gpt | mlp: a family of engine/model/registry.py
    preset: str | None = None          # a standard GPT shape (engine/model/gpt.py PRESETS): gpt2-124m, ...
    init_from: str | None = None       # "hf:HF_DIR": start from a Hugging Face GPT-2 folder's weights
    layers: int | None = None          # GPT blocks / MLP hidden layers (4 / 2)
    d_model: int | None = None         # GPT width / MLP hidden width (128 / 256)
    heads: int | None = None           # GPT attention heads (4)
    context: int | None = None         # GPT maximum sequence length (128)
    kv_heads: int | None = None        # llama: key/value heads, dividing heads (heads)
    d_ff: int | None = None            # llama: SwiGLU intermediate size (8/3 d_model, rounded up to 32s)
    rope_theta: float | None = None    # llama: rotary embedding base (10000)
    tie_embeddings: bool | None = None   # llama: the head reuses the token embedding (True)
    qk_norm: str | None = None         # llama: none | head (Qwen3's per-head q/k RMSNorm) | all (OLMo 2's) (none)
    norm_place: str | None = None      # llama: pre | post (OLMo 2: norms after attention and the MLP) (pre)
    sliding_window: int | None = None  # llama: a query sees this many positions, itself included (no window)
    window_layers: str | None = None   # llama: the blocks with that window, "1,3" (every block)
    nope_layers: str | None = None     # llama: blocks without rotary positions, "3,7,11" (SmolLM3's NoPE) (none)
    dtype: str = "float32"             # float32 | float64
    precision: str = "float32"         # float32 | bf16 (GEMM inputs; float32 master weights)
    device: str = "cpu"                # cpu | cuda
    # ---- data
    data: str | None = None            # a prepared DATA_DIR, or stdlib | synthetic | fashion-mnist | text
    data_path: str | None = None       # file/folder for text (alone it means text), IDX folder for fashion-mnist
    max_data_mb: float = 64.0          # text folders: MiB read into memory per rank; stdlib: MiB prepared
    seq_len: int | None = None         # GPT training sequence length (the context)
    batch_size: int = 16               # GLOBAL batch in sequences/examples
    # ---- optimization
    steps: int = 300
    optimizer: str = "adamw"           # adamw | sgd
    lr: float | None = None            # peak LR (2e-3 adamw, 0.05 sgd)
    warmup: int | None = None          # warmup steps (5% of decay_steps)
    decay_steps: int | None = None     # steps the warmup + cosine schedule spans (steps)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0             # global-norm clip (0: off)
    seed: int = 1337
    # ---- parallelism
    dp: int | None = None              # data-parallel ranks (all ranks / pp)
    bucket_mb: float | None = None     # gradient bucket MiB (auto)
    no_overlap: bool = False           # all-reduce after backward instead of during it
    zero: int = 0                      # ZeRO stage over the data axis: 1 optimizer state, 2 + gradients, 3 + parameters
    zero_gather: str = "auto"          # ZeRO-3: use | step | auto (step with a pipeline, else use)
    reduce_order: str = "fast"         # fast | canonical: gradients summed in one fixed tree (bits independent of dp)
    sync: str = "allreduce"            # allreduce | ps: how the data axis syncs (ps: a parameter server)
    ps_servers: int = 0                # with sync ps: dedicated server ranks (0: every rank serves its chunks)
    ps_mode: str = "sync"              # with sync ps: sync | ssp:S (bounded staleness) | async (ps_modes.py)
    pp: int = 1                        # pipeline stages
    tp: int = 1                        # tensor-parallel ranks (GPT, Llama): heads, MLP features, vocabulary split
    sequence_parallel: bool = False    # with tp > 1: the stream between the TP regions split along T
    tp_overlap: str = "auto"           # auto | on | off: input-gradient reductions beside weight-gradient GEMMs
    recompute: str = "auto"            # auto | none | full | selective: activations a block recomputes in backward
    schedule: str | None = None        # gpipe | 1f1b | interleaved | zbh1 (1f1b)
    microbatches: int = 1              # per step and data-parallel replica
    chunks: int = 1                    # model chunks per pipeline rank (interleaved)
    partition: str | None = None       # uniform | balanced (uniform)
    trace: str | None = None           # folder for per-rank Chrome/Perfetto traces
    # ---- output
    out: str | None = None             # run directory (runs/<model>)
    overwrite: bool = False            # start over in `out` (the old run goes to OUT/previous/)
    checkpoint_every: int = 0          # 0: only at the end
    keep: int = 3                      # valid checkpoints kept (0: all)
    checkpoint_format: str = "sharded"  # "sharded": every rank its slices (engine/job/sharded.py); "whole": one .npz
    checkpoint_async: bool = False     # --checkpoint-every saves written by a thread while training goes on
    resume: str | None = None          # checkpoint (.json), run directory, or "auto"
    eval_every: int | None = None      # steps between validation passes (steps/5; steps/10 fine-tuning)
    keep_best: bool | None = None      # keep the checkpoint of the best validation loss in OUT/best/ (on fine-tuning)
    eval_batches: int | str | None = None   # batches per validation pass, or "all" (a classification set's
    #                                  whole split); None: 4 (at most the split), a classifier's last pass all
    log_every: int | None = None       # steps between progress lines (steps/20)
    sample_tokens: int = 200           # GPT: tokens sampled at the end
    quiet: bool = False
    memory_report: bool = False        # the predicted memory per rank item by item, and the measured peak
    # ---- monitoring (docs/monitoring.md)
    monitor_every: int | str = "auto"  # steps between per-rank gathers: N, "auto" (~2 s of steps), 0 (off)
    tensorboard: bool | None = None    # TensorBoard event files in OUT/tensorboard (None: when tensorboard is installed)
    metrics_textfile: str | None = None   # a Prometheus text file (*.prom) for node_exporter's textfile collector
    metrics_port: int | None = None    # rank 0 serves Prometheus metrics on this port
    metrics_host: str = "127.0.0.1"    # ... bound to this address (localhost: nothing outside the node reaches it)
    straggler_ratio: float = 1.5       # a rank's compute (data wait, memory) this many times its peers' median ...
    straggler_intervals: int = 3       # ... for this many intervals in a row is named a straggler
    # ---- cluster
    watchdog: float = 0.0              # seconds without progress before a report (0: off)
    watchdog_abort: bool = False

    # ---- defaults that depend on other settings ---------------------------------------
    @property
    def sharded_checkpoints(self) -> bool:
        """Every rank writes its slices of each checkpoint (engine/train/saving.py); the parameter
        server's are whole-file whatever <checkpoint_format> says."""
        return self.checkpoint_format == "sharded" and self.sync != "ps"

    @property
    def ps_mode_parts(self) -> tuple[str, int]:
        """<ps_mode> as ("sync", 0), ("ssp", S) or ("async", 0) (parse_ps_mode)."""
        return parse_ps_mode(self.ps_mode)

    @property
    def inexact_mode(self) -> str | None:
        """<ps_mode> when it changes the math (ssp:S with S > 0, async), else None: the
        run's header, log lines and metrics carry it as a label."""
        mode, bound = self.ps_mode_parts
        return self.ps_mode if mode == "async" or bound > 0 else None

    def workers(self, world_size: int) -> int:
        """The ranks that train: all but --sync ps's dedicated servers (the last <ps_servers> ranks)."""
        return world_size - (self.ps_servers if self.sync == "ps" else 0)

    def data_parallel(self, world_size: int) -> int:
        """dp of a `world_size`-rank job (the dedicated parameter servers' ranks included)."""
        return self.dp if self.dp is not None else max(1, self.workers(world_size) // (self.pp * max(1, self.tp)))

    @property
    def tensor_overlap(self) -> bool:
        """auto: on for the GPU (it computes while the CPU thread runs MPI), off on the CPU."""
        return self.tp_overlap == "on" or (self.tp_overlap == "auto" and self.device == "cuda")

    @property
    def pipelined(self) -> bool:
        return self.pp > 1 or self.chunks > 1

    @property
    def zero_gather_mode(self) -> str:
        """ZeRO-3's gathers: auto is "step" with a pipeline (its many micro-batches would
        multiply the per-use gathers: torchtitan's choice), "use" without (FSDP's default)."""
        if self.zero_gather != "auto":
            return self.zero_gather
        return "step" if self.pipelined else "use"

    @property
    def dataset(self) -> str:
        """A dataset name (DATASET_NAMES), or "prepared" for a folder of token shards."""
        if self.data is not None:
            return self.data if self.data in DATASET_NAMES else "prepared"
        return self.recipe.data_path_data if self.data_path is not None else self.recipe.default_data

    @property
    def recipe(self):
        """The model family's ModelRecipe (engine/model/recipe.py): what the run asks of the model."""
        from ringpipe.engine.model.registry import recipe_named
        return recipe_named(self.model)

    @property
    def fine_tuning(self) -> bool:
        """Starting from a trained model's weights (init_from): the defaults below change
        (fine_tuning_notes says how and why)."""
        return self.init_from is not None

    @property
    def hf_dir(self) -> str | None:
        """The folder of init_from ("hf:PATH")."""
        return self.init_from[3:] if self.init_from else None

    @property
    def schedule_name(self) -> str:
        return self.schedule or "1f1b"

    @property
    def partition_name(self) -> str:
        return self.partition or "uniform"

    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return self.scratch_lr * (FINE_TUNING_LR_FACTOR if self.fine_tuning else 1.0)

    @property
    def scratch_lr(self) -> float:
        """The default peak LR for training from random weights."""
        return 2e-3 if self.optimizer == "adamw" else 0.05

    @property
    def schedule_steps(self) -> int:
        return self.decay_steps or self.steps

    @property
    def warmup_steps(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return max(1, self.schedule_steps // (FINE_TUNING_WARMUP_DIVISOR if self.fine_tuning else 20))

    @property
    def eval_period(self) -> int:
        """Steps between validation passes."""
        if self.eval_every:
            return self.eval_every
        return max(1, self.steps // (FINE_TUNING_EVALS if self.fine_tuning else 5))

    @property
    def best_kept(self) -> bool:
        """Whether OUT/best/ keeps the checkpoint of the best validation loss."""
        return self.keep_best if self.keep_best is not None else self.fine_tuning

    @property
    def out_dir(self) -> str:
        return self.out or os.path.join("runs", self.model)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check(cfg: Config, world_size: int) -> list[str]:
    """Refuse impossible shapes, values and combinations (ConfigError, the same on
    every rank: it depends on the configuration and the world size only); return
    notes for settings that have no effect in this layout."""
    _check_values(cfg)
    _check_servers(cfg, world_size)
    _check_ps_mode(cfg)
    notes = _check_combinations(cfg, cfg.data_parallel(world_size), world_size)
    _check_layout(cfg, world_size)
    _check_reduce_order(cfg, cfg.data_parallel(world_size))
    notes += _check_sync(cfg, cfg.data_parallel(world_size), world_size)
    return notes + _check_checkpoints(cfg) + fine_tuning_notes(cfg)


def _check_checkpoints(cfg: Config) -> list[str]:
    """<checkpoint_format> and <checkpoint_async> (engine/train/saving.py)."""
    if cfg.checkpoint_format not in ("sharded", "whole"):
        raise ConfigError(f"<checkpoint_format> {cfg.checkpoint_format!r}: use sharded (every rank writes its "
                          "slices) or whole (one .npz)")
    if cfg.checkpoint_async and cfg.checkpoint_format != "sharded":
        raise ConfigError("<checkpoint_async> writes sharded checkpoints in the background: leave out "
                          "<checkpoint_format> whole, or <checkpoint_async>")
    if cfg.checkpoint_async and cfg.sync == "ps":
        return ["note: <checkpoint_async> has no effect with <sync> ps, whose checkpoints are whole-file (gathered "
                "on the first rank): the parameter server's chunks are not cut into sharded slices yet"]
    if cfg.checkpoint_async and not cfg.checkpoint_every:
        return ["note: <checkpoint_async> has no effect without <checkpoint_every>: the final checkpoint is "
                "written at once (the run ends with it)"]
    return []


def fine_tuning_notes(cfg: Config) -> list[str]:
    """What a run from init_from's weights does differently, said once at start-up: the
    defaults for training from scratch made held-out validation worse in a fine-tune
    (issue 21: 1.599 -> 1.673 bits per byte), and nothing showed it."""
    if not cfg.fine_tuning:
        return []
    applied = []
    if cfg.lr is None:
        applied.append(f"<lr> {cfg.peak_lr:.1e} ({FINE_TUNING_LR_FACTOR:g} x the {cfg.scratch_lr:.0e} for training "
                       "from scratch: larger steps undo what the model learned)")
    if cfg.warmup is None:
        applied.append(f"<warmup> {cfg.warmup_steps} (1% of the schedule, not 5%)")
    if not cfg.eval_every:
        applied.append(f"<eval_every> {cfg.eval_period} (validation every 10% of the steps, not 20%)")
    if cfg.keep_best is None:
        applied.append("<keep_best> on (the checkpoint of the best validation loss is kept in OUT/best/)")
    said = [f"fine-tuning from <init_from> {cfg.init_from}: a run that starts from it validates once before the "
            "first step too, so step 0 shows the model as given"]
    if applied:
        said.append("fine-tuning defaults, for the settings not given: " + "; ".join(applied)
                    + " (docs/fine-tuning.md; give a setting to override its default)")
    return said


def _check_values(cfg: Config) -> None:
    cfg.recipe                                 # an unknown <model> is refused first, naming the families
    for field, value in sorted(cfg.to_dict().items()):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"<{field}> must be a finite number, got {value}")
    check_ranges(cfg)                          # every numeric setting, each against its range (ranges.py)
    if cfg.precision == "bf16" and cfg.dtype != "float32":
        raise ConfigError(f"<precision> bf16 needs <dtype> float32 (bf16 matmuls keep float32 master "
                          f"weights), got <dtype> {cfg.dtype}")
    if cfg.peak_lr * cfg.weight_decay >= 1:
        # AdamW multiplies each weight by 1 - lr x wd every step (SGD's decay moves it by as
        # much): at 1 or more the weights are zeroed or flipped in sign, step after step.
        raise ConfigError(f"<lr> {cfg.peak_lr:g} x <weight_decay> {cfg.weight_decay:g} = "
                          f"{cfg.peak_lr * cfg.weight_decay:g}: weight decay multiplies every weight by 1 - lr x "
                          "weight_decay each step, so the product must stay below 1 (real runs: about 1e-4); "
                          "lower <weight_decay> or <lr>")
    if cfg.eval_batches == "all" and cfg.recipe.data != "classes":
        raise ConfigError(f"<eval_batches> all evaluates a classification set's validation split, each example "
                          f"once; <model> {cfg.model} reads windows of a text drawn at random: give a number of "
                          "batches")
    _check_monitoring(cfg)


def _check_monitoring(cfg: Config) -> None:
    if cfg.metrics_textfile is not None:
        if not cfg.metrics_textfile.endswith(".prom"):
            raise ConfigError(f"<metrics_textfile> {cfg.metrics_textfile}: node_exporter's textfile collector "
                              "reads only files named *.prom; name the file so (e.g. "
                              "/var/lib/node_exporter/textfile/ringpipe.prom)")
        folder = os.path.dirname(os.path.abspath(cfg.metrics_textfile))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"<metrics_textfile> {cfg.metrics_textfile}: the folder {folder} does not exist or "
                              "is not writable; name a file in a folder you can write to (node_exporter's "
                              "--collector.textfile.directory)")
        if os.path.isdir(cfg.metrics_textfile):
            raise ConfigError(f"<metrics_textfile> {cfg.metrics_textfile} is a folder; name a file in it, e.g. "
                              f"{os.path.join(cfg.metrics_textfile, 'ringpipe.prom')}")


def _check_reduce_order(cfg: Config, dp: int) -> None:
    """--reduce-order canonical sums the global batch's micro-batches in one pairwise tree: the
    replicas and each replica's micro-batches must split it into halves (powers of two)."""
    if cfg.reduce_order not in ("fast", "canonical"):
        raise ConfigError(f"<reduce_order> is fast or canonical, got {cfg.reduce_order!r}")
    if cfg.reduce_order != "canonical":
        return
    if cfg.pipelined:
        raise ConfigError("<reduce_order> canonical works with data and tensor parallelism, not with a pipeline "
                          "yet (the schedule accumulates micro-batches in its own order): leave out <pp> and "
                          "<chunks>, or use <reduce_order> fast")
    if cfg.zero:
        raise ConfigError("<reduce_order> canonical works without ZeRO for now (the gradient norm of sharded "
                          "gradients is summed in another order): leave out <zero>, or use <reduce_order> fast")
    for name, value in (("dp", dp), ("microbatches", cfg.microbatches)):
        if value & (value - 1):
            raise ConfigError(f"<reduce_order> canonical needs <{name}> to be a power of two (one pairwise tree "
                              f"over the global batch's micro-batches), got {value}")


def _check_servers(cfg: Config, world_size: int) -> None:
    """<sync> and <ps_servers> themselves, before anything counts the workers (cfg.workers)."""
    if cfg.sync not in ("allreduce", "ps"):
        raise ConfigError(f"<sync> is allreduce or ps, got {cfg.sync!r}")
    if isinstance(cfg.ps_servers, bool) or not isinstance(cfg.ps_servers, int) or cfg.ps_servers < 0:
        raise ConfigError(f"<ps_servers> is a number of server ranks >= 0, got {cfg.ps_servers!r}")
    if cfg.sync != "ps":
        # A refusal, not a note: a user who asked for servers and silently got an all-reduce
        # would measure the wrong thing.
        if cfg.ps_servers:
            raise ConfigError(f"<ps_servers> {cfg.ps_servers} sets the parameter server's ranks, and this run "
                              "syncs by all-reduce: add <sync> ps, or leave out <ps_servers>")
        return
    if cfg.ps_servers >= world_size:
        raise ConfigError(f"<ps_servers> {cfg.ps_servers} with {world_size} rank(s) leaves no rank to compute "
                          f"gradients: launch more ranks than servers (the last <ps_servers> ranks serve), or use "
                          "<ps_servers> 0 (every rank serves)")


def parse_ps_mode(text: str) -> tuple[str, int]:
    """("sync", 0), ("ssp", S) or ("async", 0) from <ps_mode>'s text; ConfigError saying
    what to pass otherwise."""
    if text in ("sync", "async"):
        return text, 0
    if text == "ssp" or str(text).startswith("ssp:"):
        bound = text[4:]
        if not bound:
            raise ConfigError("<ps_mode> ssp needs its bound: ssp:S, S the updates a worker may run ahead of the "
                              "slowest (e.g. <ps_mode> ssp:2; ssp:0 is sync)")
        if not (bound.isascii() and bound.isdigit()):
            raise ConfigError(f"<ps_mode> ssp:S takes a whole number of updates >= 0 as S, got {bound!r} "
                              "(e.g. ssp:2)")
        # Compared as text first: int() of thousands of digits is refused by Python itself.
        if len(bound.lstrip("0")) > len(str(MAX_STALENESS)) or int(bound) > MAX_STALENESS:
            raise ConfigError(f"<ps_mode> ssp:{bound if len(bound) <= 30 else bound[:30] + '...'}: S is the "
                              f"updates a worker may run ahead of the slowest, at most {MAX_STALENESS} (runs with "
                              "bounded staleness use 1 to tens; a bound that never binds is <ps_mode> async)")
        return "ssp", int(bound)
    raise ConfigError(f"<ps_mode> is sync, ssp:S (bounded staleness) or async, got {text!r}")


def _check_ps_mode(cfg: Config) -> None:
    """<ps_mode>: its text, and the modes that change the math only on dedicated servers."""
    mode, bound = parse_ps_mode(cfg.ps_mode)
    if mode == "sync" or (mode == "ssp" and bound == 0):
        return
    if cfg.sync != "ps":
        raise ConfigError(f"<ps_mode> {cfg.ps_mode} is a parameter server's mode, and this run syncs by "
                          "all-reduce: add <sync> ps <ps_servers> K, or leave out <ps_mode>")
    if not cfg.ps_servers:
        raise ConfigError(f"<ps_mode> {cfg.ps_mode} needs dedicated servers (<ps_servers> 1 or more): a "
                          "colocated server is the worker itself, which serves every step in lockstep with the "
                          "others. Add <ps_servers> K (K more ranks), or use <ps_mode> sync")
    if cfg.reduce_order == "canonical":
        raise ConfigError(f"<ps_mode> {cfg.ps_mode} changes the math, and <reduce_order> canonical promises "
                          "bits that do not depend on the layout: leave out one of them")


def _check_sync(cfg: Config, dp: int, world_size: int) -> list[str]:
    """--sync ps: the parameter server on the data axis (engine/parallel/ps.py), colocated
    (with any pipeline and tensor axis) or on <ps_servers> dedicated ranks (data axis alone)."""
    if cfg.sync != "ps":
        return []
    if dp < 2:
        servers = (f" and {cfg.ps_servers} of the {world_size} ranks serve, so the workers' layout has {dp}: launch "
                   f"at least {cfg.ps_servers + 2} ranks for <ps_servers> {cfg.ps_servers}" if cfg.ps_servers else
                   f", and this layout has {dp}: launch more ranks (e.g. `mpiexec -n 2 ringpipe train ...`)")
        raise ConfigError(f"<sync> ps needs dp >= 2 (the parameter server sums the data-parallel ranks' gradients)"
                          f"{servers}, or leave out <sync>")
    if cfg.zero:
        raise ConfigError(f"<sync> ps shards the optimizer state over its servers already: leave out <zero> "
                          f"{cfg.zero} (or use <sync> allreduce with ZeRO)")
    if cfg.device != "cpu":
        raise ConfigError(f"<sync> ps moves host (numpy) buffers only for now: use <device> cpu, or <sync> "
                          f"allreduce on {cfg.device}")
    notes = []
    mode, bound = parse_ps_mode(cfg.ps_mode)
    if mode == "ssp" and bound and cfg.eval_period <= bound:
        exact = " (sync's math)" if cfg.eval_period == 1 else ""
        notes.append(f"note: validation every {cfg.eval_period} step(s) waits for the updates in flight (a drain), "
                     f"so a step runs at most {cfg.eval_period - 1} update(s) behind, not <ps_mode> ssp:{bound}'s "
                     f"{bound}{exact}: raise <eval_every> above {bound} to measure ssp:{bound}")
    if cfg.bucket_mb is not None:
        return notes + ["note: <bucket_mb> has no effect with <sync> ps: gradients are pushed per parameter, in the "
                "parameter server's chunks of <= 4 MiB"]
    return notes


def _check_layout(cfg: Config, world_size: int) -> None:
    if cfg.pp < 1:
        raise ConfigError(f"<pp> must be >= 1, got {cfg.pp}")
    if cfg.tp < 1:
        raise ConfigError(f"<tp> must be >= 1, got {cfg.tp}")
    model_parallel = cfg.pp * cfg.tp
    workers = cfg.workers(world_size)         # the ranks less --sync ps's dedicated servers
    if cfg.dp is None and workers % model_parallel:
        what = f"<pp> {cfg.pp} pipeline stages" + (f" x <tp> {cfg.tp} tensor-parallel ranks" if cfg.tp > 1 else "")
        raise ConfigError(f"{world_size} ranks do not split into {what}; launch a multiple of {model_parallel} "
                          f"ranks (ranks = dp x pp x tp)")
    dp = cfg.data_parallel(world_size)
    if dp < 1 or dp * model_parallel != workers:
        tp = f" x <tp> {cfg.tp}" if cfg.tp > 1 else ""
        servers = world_size - workers
        if servers:
            raise ConfigError(f"<dp> {dp} x <pp> {cfg.pp}{tp} = {dp * model_parallel} does not match the {workers} "
                              f"workers of this job ({world_size} ranks less <ps_servers> {servers}): launch "
                              f"dp x pp x tp + ps_servers ranks, e.g. mpiexec -n {dp * model_parallel + servers}")
        raise ConfigError(f"<dp> {dp} x <pp> {cfg.pp}{tp} = {dp * model_parallel} does not match the {world_size} "
                          f"ranks of this job (launch dp x pp x tp ranks, e.g. mpiexec -n {dp * model_parallel})")
    if cfg.chunks > 1 and cfg.schedule_name != "interleaved":
        raise ConfigError(f"<chunks> {cfg.chunks} needs <schedule> interleaved")
    if cfg.batch_size % dp == 0 and (cfg.batch_size // dp) % cfg.microbatches:
        raise ConfigError(f"the per-replica batch {cfg.batch_size // dp} (<batch_size> {cfg.batch_size} / "
                          f"dp {dp}) does not split into <microbatches> {cfg.microbatches}; use a batch size "
                          f"that is a multiple of dp x microbatches = {dp * cfg.microbatches}")
    if cfg.batch_size % dp:
        raise ConfigError(f"<batch_size> {cfg.batch_size} does not divide among {dp} data-parallel ranks; "
                          f"use a multiple of {dp} (e.g. {dp * max(1, cfg.batch_size // dp)})")


def _check_combinations(cfg: Config, dp: int, world_size: int = 0) -> list[str]:
    """Settings that would have no effect: refused when the user clearly expected
    something to happen, noted when the same settings are reasonably reused across
    layouts (a scaling sweep from one rank up)."""
    if cfg.schedule is not None and not cfg.pipelined:
        raise ConfigError(f"<schedule> {cfg.schedule} has no effect without pipeline stages: add <pp> N "
                          "(N >= 2; ranks = pp x dp), or drop <schedule>")
    if cfg.schedule == "interleaved" and cfg.chunks < 2:
        raise ConfigError("<schedule> interleaved needs <chunks> >= 2 (model chunks per pipeline rank); "
                          "with one chunk it is 1F1B: pass <chunks> 2, or <schedule> 1f1b")
    if cfg.data_path is not None and cfg.data not in (None, "text", "fashion-mnist"):
        raise ConfigError(f"<data_path> is read only with <data> text (or fashion-mnist for the MLP), but "
                          f"<data> {cfg.data} was given: drop one of the two")
    _check_recipe(cfg)
    if cfg.tp_overlap not in ("auto", "on", "off"):
        raise ConfigError(f"<tp_overlap> must be auto, on or off, got {cfg.tp_overlap!r}")
    if cfg.recompute not in ("auto", *RECOMPUTE):
        raise ConfigError(f"<recompute> must be auto, {', '.join(RECOMPUTE)}, got {cfg.recompute!r}")
    if cfg.recompute not in ("auto", "none") and not cfg.recipe.blocks:
        raise ConfigError(f"<recompute> {cfg.recompute} recomputes transformer blocks in backward, and <model> "
                          f"{cfg.model} has none: it works for <model> {names_of(lambda r: r.blocks)}; leave "
                          f"<recompute> none for <model> {cfg.model}")
    if cfg.sequence_parallel and cfg.tp < 2:
        raise ConfigError("<sequence_parallel> splits the sequence across tensor-parallel ranks: it needs "
                          "<tp> >= 2")
    if cfg.data is not None and cfg.data not in DATASET_NAMES and not os.path.isdir(cfg.data):
        raise ConfigError(f"<data> {cfg.data!r} is neither a dataset name ({', '.join(DATASET_NAMES)}) nor a folder "
                          "written by `ringpipe prepare`" + (f" ({cfg.data} does not exist)"
                                                             if not os.path.exists(cfg.data) else ""))
    if cfg.dataset == "prepared" and cfg.recipe.data != "tokens":
        raise ConfigError(f"a prepared token dataset (<data> DATA_DIR) trains <model> "
                          f"{names_of(lambda r: r.data == 'tokens')}")
    if cfg.init_from is not None:
        if not cfg.init_from.startswith("hf:") or not cfg.hf_dir:
            raise ConfigError(f"<init_from> {cfg.init_from!r}: give hf:HF_DIR, a Hugging Face model folder")
        if not os.path.isdir(cfg.hf_dir):
            raise ConfigError(f"<init_from>: the folder {cfg.hf_dir} does not exist")
        if cfg.preset:
            raise ConfigError("<init_from>'s model has its own shape; <preset> would be ignored: pass one of them")
    if (cfg.preset and not cfg.recipe.presets) or (cfg.init_from and not cfg.recipe.hf_format):
        raise ConfigError(f"<model> {cfg.model} has no {'presets' if cfg.preset else 'Hugging Face format'}: "
                          f"<preset> and <init_from> are for <model> {names_of(lambda r: r.presets and r.hf_format)}")
    if cfg.watchdog_abort and not cfg.watchdog:
        raise ConfigError("<watchdog_abort> needs <watchdog> SECONDS (the stall that triggers it)")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"<zero> {cfg.zero}: use 0 (none), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters)")
    if cfg.zero_gather not in ("auto", "use", "step"):
        raise ConfigError(f"<zero_gather> {cfg.zero_gather!r}: use auto, use or step")
    if cfg.zero >= 2 and dp == 1:
        why = ("this run has one rank: launch several (e.g. `mpiexec -n 2 ringpipe train ...`)"
               if world_size == 1 else
               f"this layout has one (its {world_size} ranks are all pipeline or tensor ranks): give more ranks "
               "(ranks = dp x pp x tp) or lower <pp> or <tp>")
        raise ConfigError(f"<zero> {cfg.zero} shards over the data-parallel ranks, and {why}; or use <zero> 0")
    notes = []
    if cfg.zero_gather != "auto" and cfg.zero != 3:
        notes.append(f"note: <zero_gather> {cfg.zero_gather} has no effect without <zero> 3")
    if cfg.zero == 3 and cfg.bucket_mb is not None and dp > 1:
        notes.append("note: <bucket_mb> has no effect with <zero> 3: a bucket is one layer's parameters (the "
                     "unit ZeRO-3 gathers)")
    if cfg.zero == 2 and dp > 1 and (cfg.microbatches > 1 or cfg.pipelined):
        notes.append("note: with micro-batches the gradients stay whole until the last micro-batch's backward, "
                     "so <zero> 2 saves their memory only after it (its peak is <zero> 1's); <zero> 3 shards "
                     "the parameters too")
    if dp == 1:
        unused = [flag for flag, on in (("<zero> 1", cfg.zero), ("<bucket_mb>", cfg.bucket_mb is not None),
                                        ("<no_overlap>", cfg.no_overlap)) if on]
        if unused:
            notes.append(f"note: {', '.join(unused)} ha{'s' if len(unused) == 1 else 've'} no effect with one "
                         "data-parallel rank")
    if cfg.tp == 1 and cfg.tp_overlap != "auto":
        notes.append(f"note: <tp_overlap> {cfg.tp_overlap} has no effect without tensor parallelism (<tp>)")
    if cfg.partition is not None and not cfg.pipelined:
        notes.append(f"note: <partition> {cfg.partition} has no effect without pipeline stages (<pp>)")
    if cfg.data is None and cfg.data_path is not None and cfg.recipe.data_path_data != cfg.recipe.default_data:
        notes.append(f"note: <data_path> given without <data>: reading it as <data> {cfg.recipe.data_path_data}")
    return notes


def _check_recipe(cfg: Config) -> None:
    """Refuse what the model family does not offer: another family's shape settings, an axis."""
    recipe = cfg.recipe
    takes = set(recipe.fields) | ({"seq_len"} if recipe.data == "tokens" else set())
    others = [f for f in SHAPE_FIELDS + ("seq_len",) if f not in takes and getattr(cfg, f) is not None]
    if others:
        given = [f"<{f}>" for f in others]
        whose = names_of(lambda r: all(f in r.fields or (f == "seq_len" and r.data == "tokens") for f in others))
        raise ConfigError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to <model> {whose} only"
                          + (f"; {recipe.fields_hint}" if recipe.fields_hint else ""))
    if cfg.pipelined and "pipe" not in recipe.axes:
        raise ConfigError(f"pipeline stages (<pp>/<chunks> > 1) are implemented for <model> "
                          f"{names_of(lambda r: 'pipe' in r.axes)} only")
    if cfg.tp > 1 and "tensor" not in recipe.axes:
        raise ConfigError(f"tensor parallelism (<tp> > 1) is implemented for <model> "
                          f"{names_of(lambda r: 'tensor' in r.axes)} only (<dp> spreads a small model's "
                          "batch): drop <tp>")


# ---- the model's shape ---------------------------------------------------------------

def model_config(cfg: Config, saved: dict | None = None, vocab: int | None = None, init: dict | None = None):
    """The model's shape. The first of these that exists fixes it: a checkpoint when
    resuming, the Hugging Face model of init_from, a preset; settings given explicitly
    must agree with it, and fill in the rest. `vocab`: the data's tokenizer's size."""
    recipe = cfg.recipe
    given = {key: getattr(cfg, field) for field, key in recipe.fields.items()}
    shape = recipe.shape()
    fixed, source = _fixed_shape(cfg, saved, init)
    for key, value in fixed.items():
        if key in given and given[key] is not None and given[key] != value:
            raise ConfigError(f"{source} has <{key}> {_shown(value)}, but <{key}> {_shown(given[key])} was given; "
                              "drop the setting"
                              + (" or use a new <out>" if saved else ""))
        setattr(shape, key, value)
    for key, value in given.items():
        if value is not None and key not in fixed:
            setattr(shape, key, value)
    if vocab is not None and recipe.data == "tokens":
        if "vocab" in fixed and fixed["vocab"] != vocab:
            raise ConfigError(f"the data's tokenizer has {vocab} tokens, but {source} has a vocabulary of "
                              f"{fixed['vocab']}: train on data prepared with the model's tokenizer")
        shape.vocab = vocab
    return shape.validate()


def _shown(value):
    """A shape value as a message shows it: on/off for a switch (--no-tie-embeddings is <tie_embeddings> off)."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def check_tensor_parallel(cfg: Config, shape, seq_len) -> None:
    """Refuse a tensor-parallel size the model's shape cannot split."""
    if cfg.tp == 1 or "tensor" not in cfg.recipe.axes:
        return
    kv_heads = getattr(shape, "n_kv_head", None)        # grouped-query attention (the Llama family)
    if kv_heads is not None and kv_heads % cfg.tp:
        from ringpipe.engine.parallel.tensor import valid_tp
        raise ConfigError(f"<tp> {cfg.tp} does not divide the model's {kv_heads} key/value heads (each "
                          f"tensor-parallel rank holds whole key/value heads and the query heads that read them); "
                          f"<tp> can be {', '.join(map(str, valid_tp(kv_heads, kv_heads)))} for this model, or "
                          + ("spread the other ranks over <dp> or <pp> (the model's shape is fixed)"
                             if cfg.init_from or cfg.resume or cfg.preset else "change <kv_heads>"))
    if shape.n_head % cfg.tp:
        from ringpipe.engine.parallel.tensor import valid_tp
        raise ConfigError(f"<tp> {cfg.tp} does not divide the model's {shape.n_head} attention heads (each "
                          f"tensor-parallel rank holds whole heads); <tp> can be "
                          f"{', '.join(map(str, valid_tp(shape.n_head, shape.n_head)))} for this model, or "
                          "change <heads>")
    if cfg.sequence_parallel and seq_len % cfg.tp:
        raise ConfigError(f"<sequence_parallel> splits each sequence into <tp> {cfg.tp} equal parts, but "
                          f"<seq_len> is {seq_len}: use a <seq_len> that is a multiple of {cfg.tp}")


def _fixed_shape(cfg: Config, saved, init) -> tuple[dict, str]:
    presets = cfg.recipe.presets
    if saved:
        if cfg.preset in presets:
            preset = presets[cfg.preset]
            differ = {k: v for k, v in preset.items() if saved.get(k) != v}
            if differ:
                raise ConfigError(f"the checkpoint was written with a shape other than <preset> {cfg.preset}'s ("
                                  + ", ".join(f"{k} {saved.get(k)}, not {v}" for k, v in differ.items())
                                  + "): drop <preset> to continue it, or use a new <out>")
        if init and any(saved.get(k) != v for k, v in init.items()):
            raise ConfigError(f"the checkpoint to resume holds another model ({_shape_words(saved)}) than "
                              f"<init_from> {cfg.init_from} ({_shape_words(init)}): drop <init_from> to continue "
                              "the checkpoint's run, or pass a new <out> to start from the model")
        return saved, "the checkpoint"
    if init:
        return init, f"the model of <init_from> {cfg.init_from}"
    if cfg.preset:
        if cfg.preset not in presets:
            owner = names_of(lambda r: cfg.preset in r.presets)      # a shape of another family: say which
            raise ConfigError(f"unknown <preset> {cfg.preset!r} for <model> {cfg.model}"
                              + (f" (it is a shape of <model> {owner}: add <model> {owner})" if owner else "")
                              + f": use one of {', '.join(sorted(presets))}")
        return dict(presets[cfg.preset]), f"<preset> {cfg.preset}"
    return {}, ""


def _shape_words(shape: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(shape.items()))


# ---- validation: how many batches a pass takes ----------------------------------------

DEFAULT_EVAL_BATCHES = 4       # batches per validation pass when <eval_batches> is not given


def split_examples(dataset) -> int | None:
    """Examples in the validation split of a classification set; None for text, whose
    validation windows are drawn at random."""
    examples = getattr(dataset, "examples", None)
    return examples("val") if examples is not None else None


def validation_pass(cfg: Config, dataset, final: bool = False) -> tuple[int, int]:
    """(batches, examples) of one validation pass; `final`: the run's last one."""
    asked = cfg.eval_batches
    split = split_examples(dataset)
    if split is None:
        batches = asked or DEFAULT_EVAL_BATCHES
        return batches, batches * cfg.batch_size
    whole = -(-split // cfg.batch_size)              # the split once, the last batch partial
    if asked == "all" or (asked is None and final):
        batches = whole
    elif asked is None:
        batches = min(DEFAULT_EVAL_BATCHES, whole)
    else:
        batches = asked
    return batches, min(batches * cfg.batch_size, split)


def check_validation(cfg: Config, dataset) -> None:
    """Refuse <eval_batches> N that would go past a classification set's validation split:
    a pass counts each example once (batches drawn at random, 1000 of 16 once counted 16,000
    examples of Fashion-MNIST's 10,000, some many times over)."""
    split = split_examples(dataset)
    if split is None or not isinstance(cfg.eval_batches, int):
        return
    whole = -(-split // cfg.batch_size)
    if cfg.eval_batches > whole:
        last = split - (whole - 1) * cfg.batch_size
        raise ConfigError(f"<eval_batches> {cfg.eval_batches} x <batch_size> {cfg.batch_size} = "
                          f"{cfg.eval_batches * cfg.batch_size:,} examples, but the validation split of "
                          f"{dataset.name} holds {split:,}, and a pass counts each once: use <eval_batches> all "
                          f"(the whole split: {whole} batches, the last of {last}) or at most {whole}")


# ---- memory: refuse what cannot fit, in milliseconds -----------------------------------

def memory_floor(cfg: Config, shape, dp: int) -> tuple[float, str]:
    """(bytes, what): a LOWER bound on what one rank must allocate for this run
    (parameters, gradients and optimizer state, plus the activations of one
    micro-batch), so a run that cannot possibly fit is refused at once instead
    of failing with a MemoryError minutes in. Real use is higher."""
    itemsize = np.dtype(cfg.dtype).itemsize
    n_params, elements = cfg.recipe.memory(shape, cfg.batch_size // dp, cfg.microbatches, cfg.seq_len, cfg.pp)
    if recompute_of(cfg, shape, cfg.seq_len or getattr(shape, "context", 0)) != "none" and hasattr(shape, "n_layer"):
        # Recomputation holds one block's activations whole at a time (full: the one it runs
        # again; selective: the probabilities of the one in backward): count one block a stage.
        # (blocks named by index, a Llama's NoPE or windowed ones, kept where they are among the first)
        lists = {k: [i for i in getattr(shape, k) if i < cfg.pp] or None
                 for k in ("nope_layers", "window_layers") if getattr(shape, k, None) is not None}
        one_block = dataclasses.replace(shape, n_layer=cfg.pp, **lists)
        elements = min(elements, cfg.recipe.memory(one_block, cfg.batch_size // dp, cfg.microbatches,
                                                   cfg.seq_len, cfg.pp)[1])
    activations = elements * itemsize
    states = 2 if cfg.optimizer == "adamw" else 1
    # Tensor parallelism splits nearly all of both (a lower bound may divide all of it).
    # bytes per parameter, in itemsizes: ZeRO-1 splits the optimizer state, 2 the gradients too, 3 all.
    shards = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[cfg.zero if dp > 1 else 0]
    weights = n_params / cfg.pp / cfg.tp * itemsize * (1 / shards[0] + 1 / shards[1] + states / shards[2])
    activations /= cfg.tp
    what = (f"{n_params:.3g} parameters: {_gib(weights)} for weights, gradients and optimizer state, "
            f"{_gib(activations)} for one micro-batch's activations")
    if shards[0] > 1:
        # ZeRO-3 gathers each layer's parameters whole before it runs: the largest must fit.
        unit = largest_unit(cfg, shape) / cfg.tp * itemsize
        weights += unit
        what += f", {_gib(unit)} for the largest layer gathered whole (ZeRO-3's unit; <tp> splits it)"
    return weights + activations, what


def largest_unit(cfg: Config, shape) -> int:
    """Parameters of the model's largest layer (ZeRO-3 gathers a layer whole)."""
    return max((sum(s.size for s in layer.specs()) for layer in cfg.recipe.layers(shape)), default=0)


def check_memory(cfg: Config, shape, dp: int, ranks_on_node: int) -> None:
    """Refuse a run whose lower-bound memory per rank exceeds this node's share."""
    if cfg.device != "cpu":
        return                    # GPU memory is checked by the allocator itself, quickly
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need, what = memory_floor(cfg, shape, dp)
    if need > total / max(1, ranks_on_node):
        raise ConfigError(f"this run needs at least {_gib(need)} per rank ({what}), but this node has "
                          f"{_gib(total)} for {ranks_on_node} rank(s); use a smaller model (<d_model>, <layers>) "
                          f"or batch (<batch_size>, <microbatches>), more ranks (<pp> splits the layers, <tp> each layer, <zero> 1-3 "
                          "shard the optimizer state, gradients, parameters), or nodes with more memory")


def _gib(nbytes):
    return f"{nbytes / 2**30:.3g} GiB"


# Settings whose change on resume makes the run differ from the uninterrupted one
# (the layout settings dp/pp/... and steps may change freely).
TRAJECTORY_FIELDS = ("seed", "data", "data_path", "max_data_mb", "dtype", "precision", "batch_size", "seq_len",
                     "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip")


def resume_differences(saved: dict, cfg: Config, resolved: dict | None = None) -> list[str]:
    """A note for each trajectory setting that differs from the checkpoint's run.
    `resolved`: values as the run resolved them (the checkpoint records <seq_len> and
    <data> so), compared in place of the fields left at their defaults."""
    resolved = resolved or {}
    notes = []
    for field in TRAJECTORY_FIELDS:
        value = getattr(cfg, field)
        if value is None and field in resolved:
            value = resolved[field]
        if field in saved and not same_value(saved[field], value):
            notes.append(f"note: resuming with <{field}> {value} where the checkpoint's run had "
                         f"{saved[field]}: it continues, but no longer as that run would have")
    if "init_from" in saved and bool(saved["init_from"]) != cfg.fine_tuning:
        notes.append(_fine_tuning_changed(saved["init_from"], cfg))
    return notes


def _fine_tuning_changed(saved_init_from: str | None, cfg: Config) -> str:
    """The settings left out default otherwise for a fine-tune (Config.fine_tuning): say so
    when a resume changes whether the run is one."""
    now = "a fine-tune" if cfg.fine_tuning else "training from scratch"
    said = (f"note: the checkpoint's run had {f'<init_from> {saved_init_from}' if saved_init_from else 'no <init_from>'}"
            f", this one {f'<init_from> {cfg.init_from}' if cfg.init_from else 'none'}: the settings not given "
            f"(<lr>, <warmup>, <eval_every>, <keep_best>) now default as for {now}")
    if saved_init_from:
        said += (f"; pass <init_from> {saved_init_from} again (its weights are not used when resuming) to continue "
                 "as that run would have")
    return said


def same_value(a, b) -> bool:
    # NaN != NaN: without this, one rank given lr=nan would "differ from itself".
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b
