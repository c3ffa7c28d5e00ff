"""Everything a training run needs before its first step, in the order it is
built: the checks, the process grid, the run directory, the checkpoint to
resume from, the model's shape, the device, the data, the rank's model and
its optimizer, and the reporting. Every step that depends on one rank's own
state goes through engine/job/agreement.py, so all ranks reach the same verdict.

    training = assemble(cfg, world, stop, cleanup, render)    # a Run: the parts, by name
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringpipe import comm, kernels as K, threads
from ringpipe.engine.job import checkpoint, lifecycle, rundir, runtime
from ringpipe.engine.train import config as config_checks, memory
from ringpipe.engine.job.agreement import agree, agree_on_rank0
from ringpipe.engine.train.agreement import check_same_config
from ringpipe.engine.train.config import (DATA_WORDS, DATASETS, Config, check_memory, check_tensor_parallel,
                                          check_validation, model_config, resume_differences)
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.optim import lr_at
from ringpipe.engine.model.registry import names_of
from ringpipe.engine.parallel import slices
from ringpipe.engine.train.reporting import Reporter, model_line, model_parameters
from ringpipe.engine.train.saving import Saver
from ringpipe.engine.monitor.clock import StepClock
from ringpipe.engine.monitor.probes import gemm_peak_flops
from ringpipe.engine.monitor.ranks import RankMonitor
from ringpipe.engine.monitor.sinks import TENSORBOARD_DIR, MissingLibrary, Sinks, check_textfile


@dataclass
class Run:
    """The parts of one run, built by assemble() and used by engine/train/run.py."""
    cfg: Config
    world: Any
    grid: Any
    stop: lifecycle.StopFlag
    report: Reporter
    ckpt_dir: str
    resume_path: str | None = None
    manifest: dict = field(default_factory=dict)
    shape: Any = None                  # the recipe's shape: GPTConfig, MLPConfig, ...
    seq_len: int | None = None
    dtype: Any = None
    xp: Any = np
    transport: Any = None
    dataset: Any = None
    model: Any = None                  # the rank model (engine/parallel)
    opt: Any = None
    start_step: int = 0
    rows: tuple = (0, 0)               # this rank's rows of each global batch
    items_per_example: int = 1         # tokens per sequence (GPT) or 1 (MLP)
    flops_per_item: float = 0.0
    tokenizer: Any = None              # the data's (engine/data/tokenizer.py), None for data without one
    init: Any = None                   # init_from's (GPTConfig, named arrays, tokenizer.json or None)
    tracer: Any = None
    clock: Any = None                  # this rank's step time split (engine/monitor/clock.py)
    monitor: Any = None                # the per-rank gathers and stragglers (engine/monitor/ranks.py)
    sinks: Any = None                  # rank 0's TensorBoard and Prometheus writers (engine/monitor/sinks.py)
    servers: Any = None                # --ps-servers K: the parallel/ps.py ServerLink (world is then the workers')
    peak_flops: float | None = None    # a rank's GEMM FLOP/s measured at start-up (MFU's denominator)
    dog: Any = None
    saver: Any = None                  # writes the checkpoints, holds an asynchronous one in flight (saving.py)
    moments: Any = None                # <memory_report>: each moment's measured peak (memory.Moments)
    t_start: float = 0.0               # when the first step began

    @property
    def recipe(self):
        """The model family's recipe (engine/model/recipe.py): what this run asks of its model."""
        return self.cfg.recipe

    @property
    def items_per_step(self) -> int:
        return self.cfg.batch_size * self.items_per_example

    @property
    def job_peak_flops(self) -> float | None:
        """Every rank's measured GEMM peak together: what MFU divides by (None: not measured)."""
        return self.peak_flops * self.world.Get_size() if self.peak_flops else None

    @property
    def grad_scale(self) -> float:
        # Each micro-batch adds its share of this rank's mean; the data axis averages the ranks.
        return 1.0 / ((self.rows[1] - self.rows[0]) * self.items_per_example)


def assemble(cfg: Config, world, stop, cleanup, render=None, servers=None) -> Run:
    """servers: with --ps-servers K, the ServerLink; `world` is then the workers' communicator."""
    check_same_config(cfg, world)
    agree(world, comm.check_settings, "RINGPIPE_* settings", hint="is the environment the same on every node?")
    agree(world, threads.check_load_setting, "RINGPIPE_NODE_LOAD setting", hint="is the environment the same on every node?")
    ranks = servers.world.Get_size() if servers is not None else world.Get_size()    # the servers' included
    notes = config_checks.check(cfg, ranks) + runtime.unknown_variables()
    if cfg.hf_dir:
        # config.json alone, before anything is said: a model ringpipe cannot fine-tune is refused
        # first, not after the fine-tuning lines (which would not apply to it).
        from ringpipe.engine.interop import hf
        agree(world, lambda: hf.check_config(cfg.hf_dir), "Hugging Face config.json of <init_from>")
    # Tensor innermost: a tensor group is consecutive ranks, on one node as launchers place them.
    grid = comm.ProcessGrid(world, [("pipe", cfg.pp), ("data", cfg.data_parallel(ranks)), ("tensor", cfg.tp)])
    cleanup.callback(grid.free)
    report = Reporter(world.Get_rank() == 0, cfg.quiet, cfg.steps, cfg.log_every, render)
    cleanup.callback(report.close)
    training = Run(cfg, world, grid, stop, report, ckpt_dir=os.path.join(cfg.out_dir, "checkpoints"),
                   servers=servers)
    for note in notes:
        report.note(note)
    own_run_directory(training, cleanup)
    find_checkpoint(training)
    shape_data_device(training)
    agree_on_float32_gemm(training)
    # The shards' descriptors and the data folder's shared lock are let go when the run
    # ends, not whenever the dataset is collected (a prepare may wait for them).
    cleanup.callback(lambda: getattr(training.dataset, "close", lambda: None)())
    build_model(training, cleanup)
    start_reporting(training, cleanup)
    start_monitoring(training, cleanup)
    return training


# ---- the run directory ------------------------------------------------------------------

def make_writable_dir(field_name, path):
    """Create folder `path` (the setting `field_name`) or say clearly why it cannot be used."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the folder <{field_name}> {path} ({e.strerror}: {e.filename}); "
                          f"pass <{field_name}> a folder path that can be created") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"the folder <{field_name}> {path} is not writable; pass <{field_name}> a folder "
                          "you can write to")


def own_run_directory(training: Run, cleanup) -> None:
    """Before the data is loaded and the model built (a bad --out costs nothing yet):
    create it, take its lock for the run's life (rank 0), start it clean."""
    cfg = training.cfg

    def make_output_dirs():
        make_writable_dir("out", cfg.out_dir)
        if cfg.trace:
            make_writable_dir("trace", cfg.trace)

    # Rank 0 writes the Prometheus text file: its verdict (never replace another's file) for all,
    # before --out is made, so a refused run leaves no folder behind.
    agree_on_rank0(training.world, lambda: check_textfile(cfg.metrics_textfile, cfg.out_dir), "metrics text file")
    agree(training.world, make_output_dirs, "output directory")
    run_dir = rundir.RunDir(cfg.out_dir)
    if training.world.Get_rank() == 0:
        cleanup.callback(run_dir.unlock)
    for note in agree_on_rank0(training.world, lambda: prepare_run_dir(run_dir, cfg, training.ckpt_dir),
                               "run directory"):
        training.report.note(note)


def prepare_run_dir(run_dir: rundir.RunDir, cfg: Config, ckpt_dir: str) -> list[str]:
    """Rank 0: own the run directory and start it clean. Returns notes."""
    notes = run_dir.lock()
    if not cfg.resume:
        if checkpoint.list_checkpoints(ckpt_dir) and not cfg.overwrite:
            raise ConfigError(f"{ckpt_dir} already holds checkpoints; pass <resume> auto to continue that "
                              "run, <out> DIR for a new one, or <overwrite> to start over in it")
        # A fresh start: whatever an earlier run left (its checkpoints with --overwrite,
        # or the metrics and logs of a run that never saved one) goes to OUT/previous/,
        # so nothing of it can be resumed or pruned by mistake.
        moved = run_dir.move_previous_aside()
        if moved:
            notes.append(f"{'<overwrite>' if cfg.overwrite else 'fresh start'}: {moved}")
    rundir.clear_finished(cfg.out_dir)
    # Only this run writes here now (it holds the lock): temp files are leftovers
    # of killed runs, and would keep a nearly full disk full.
    removed = checkpoint.remove_stale_temp_files(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    if removed:
        notes.append(f"removed {len(removed)} temp file(s) left by an interrupted checkpoint write: "
                     f"{', '.join(os.path.basename(p) for p in removed[:3])}{' ...' if len(removed) > 3 else ''}")
    return notes


# ---- resume ------------------------------------------------------------------------------

def find_checkpoint(training: Run) -> None:
    """Every rank resolves and reads the checkpoint itself; they must all find the
    same one (a run directory on node-local disk would not)."""
    training.resume_path, notes = agree(training.world, lambda: _find_resume(training.cfg, training.ckpt_dir),
                                        "checkpoint to resume from", same_result=True, compared=lambda found: found[0])
    for note in notes:
        training.report.note(note)
    if training.resume_path:
        training.manifest = agree(training.world, lambda: checkpoint.read_manifest(training.resume_path), "checkpoint")
        if training.manifest.get("model") != training.cfg.model:
            raise ConfigError(f"checkpoint {training.resume_path} holds a {training.manifest.get('model')} model, "
                              f"not <model> {training.cfg.model}: pass <model> {training.manifest.get('model')} to "
                              "continue it, or a new <out> to start another run")
        # The manifest is a file anyone can edit: its model's every value (type and range: the
        # shape's validate) is checked here, naming the file, before any data is opened.
        try:
            training.recipe.shape(**training.manifest["model_config"]).validate()
        except ConfigError as e:
            raise ConfigError(f"checkpoint {training.resume_path}'s model_config: {e}; the manifest was edited: "
                              "resume from the checkpoint as it was written, or from an earlier one") from None


def load_init(training: Run) -> None:
    """--init-from's weights: each rank reads the boxes of the parameters it holds (any layout:
    its stage, its tensor part, its ZeRO-3 chunks), never a whole tensor it holds a part of
    (hf_folder.TensorBoxes)."""
    source, model = training.init[1], training.model
    if not hasattr(model, "local_slices"):     # the parameter server's: whole arrays, each rank takes its part
        model.params.load_flat(model.params.data, {name: source.read_whole(name) for name in model.params.names()})
        return
    params = model.local_slices(training.opt).only("param")
    agree(training.world, lambda: slices.fill(params, source.read_box), "Hugging Face weights of <init_from>")


def restore_slices(training: Run) -> None:
    """A sharded checkpoint: this rank reads only the boxes it holds (engine/parallel/slices.py),
    from whichever ranks' files hold them, its names and shapes checked before any data."""
    local = training.model.local_slices(training.opt)
    _, reader = checkpoint.open_sharded(training.resume_path)
    try:
        checkpoint.check_declared(training.resume_path, reader,
                                  {name: shape for name, (shape, _) in slices.whole_shapes(local).items()})
        slices.fill(local, lambda name, box, out: checkpoint.read_box(reader, name, box, out))
    finally:
        reader.close()


def _find_resume(cfg: Config, ckpt_dir: str):
    """(manifest path or None, notes)."""
    if not cfg.resume:
        return None, []
    if cfg.resume != "auto":
        return checkpoint.resolve(cfg.resume), []
    valid, invalid = checkpoint.scan(ckpt_dir) if os.path.isdir(ckpt_dir) else ([], [])
    bad = [f"{os.path.basename(p)} ({why})" for p, why in invalid]
    if not valid:
        if invalid:
            raise ConfigError(f"<resume> auto found no valid checkpoint in {ckpt_dir}, only invalid ones: "
                              f"{'; '.join(bad[:5])}. Starting fresh would silently drop that run: remove or "
                              "repair them, resume from a file with <resume> PATH, or start over with <overwrite>")
        return None, [f"<resume> auto: no checkpoint in {ckpt_dir} yet, starting fresh"]
    newer = [b for (p, _), b in zip(invalid, bad) if p > valid[-1]]
    notes = [f"<resume> auto: skipping invalid checkpoint(s) newer than {os.path.basename(valid[-1])}: "
             f"{'; '.join(newer)}"] if newer else []
    return valid[-1], notes


# ---- shape, data, device ---------------------------------------------------------------------

def shape_data_device(training: Run) -> None:
    """The model's shape, the data it trains on (whose tokenizer sets the vocabulary),
    and the device; every rank decides for itself, and all must agree."""
    cfg = training.cfg
    if cfg.hf_dir:
        from ringpipe.engine.interop import hf
        training.init = agree(training.world, lambda: hf.open_hf(cfg.hf_dir), "Hugging Face model of --init-from")
        if not isinstance(training.init[0], training.recipe.shape):     # the folder's config.json decides
            family = names_of(lambda recipe: recipe.shape is type(training.init[0]))
            raise ConfigError(f"<init_from> {cfg.init_from} holds a model of the {family} family, not "
                              f"{training.recipe.name}: pass <model> {family}")
    init_shape = training.init[0].to_dict() if training.init else None
    saved = training.manifest.get("model_config")
    training.dtype = K.resolve_dtype(cfg.dtype)
    if training.recipe.data == "tokens":
        # The sequence length comes from the shape, the vocabulary from the data: the shape
        # without the data's vocabulary first (only its context matters here), then with it.
        training.seq_len = cfg.seq_len or model_config(cfg, saved, init=init_shape).context
    stdlib_dir = None
    if cfg.dataset == "stdlib" and training.recipe.data == "tokens":
        # Token shards in a cache, written once by rank 0: no rank holds the corpus in memory.
        from ringpipe.engine.data.prepare import prepare_stdlib
        stdlib_dir = agree_on_rank0(training.world, lambda: prepare_stdlib(int(cfg.max_data_mb * 2**20)),
                                    "preparing the stdlib corpus")
    training.dataset = agree(training.world, lambda: open_dataset(cfg, training.seq_len, stdlib_dir), "dataset",
                             hint="is RINGPIPE_CACHE (where the stdlib corpus is prepared) on a filesystem every node "
                                  "sees?"
                             if stdlib_dir else "is the path on a filesystem every node sees?")
    training.tokenizer = getattr(training.dataset, "tokenizer", None)
    check_assumed_vocab(training)
    training.shape = model_config(cfg, saved, vocab=getattr(training.dataset, "vocab_size", None), init=init_shape)
    if training.recipe.data == "tokens" and training.seq_len > training.shape.context:
        fixed = next((f"<{name}> {value}" for name, value in (("resume", cfg.resume), ("init_from", cfg.init_from),
                                                               ("preset", cfg.preset)) if value), None)
        raise ConfigError(f"<seq_len> {training.seq_len} exceeds the model's context {training.shape.context}; lower "
                          + (f"<seq_len> (the context is {fixed}'s)" if fixed else
                             f"<seq_len> or raise <context> (at least {training.seq_len})"))
    check_tokenizer(training)
    cfg = training.cfg = resolve_recompute(training)
    check_tensor_parallel(cfg, training.shape, training.seq_len)
    # Nodes may differ in memory: every rank checks its own node, all agree.
    dp = training.grid.size("data")
    agree(training.world, lambda: check_memory(cfg, training.shape, dp, runtime.local_rank_count()), "memory check",
          hint="do the nodes differ in memory?")

    def pick_device():
        from ringpipe.comm.device import Transport
        from ringpipe.engine.job.array_module import select
        xp = select(cfg.device, training.grid.local_rank)
        return xp, Transport(xp)     # how device buffers reach MPI (direct or pinned staging)

    # A node without CuPy or a GPU must stop every rank, not only its own.
    training.xp, training.transport = agree(training.world, pick_device, "device setup",
                                            hint="does every node have CuPy and a visible GPU?")
    describe_data(training)


def resolve_recompute(training: Run) -> Config:
    """<recompute> auto made concrete from the model's shape (memory.recompute_of), said when it
    recomputes; the run's Config from here on carries the mode (the layers, the memory report,
    the checkpoint's arguments). The user's Config is left as it was."""
    cfg = training.cfg
    if cfg.recompute != "auto":
        return cfg
    mode = memory.recompute_of(cfg, training.shape, training.seq_len)
    if mode != "none":
        share = memory.probabilities_share(training.shape, training.seq_len)
        training.report.say(f"recompute {mode} (auto): the attention probabilities would be {share:.0%} of what a "
                            f"block keeps at T {training.seq_len}, so backward computes them again from q and k "
                            "(as SDPA does; a few percent more compute); --recompute none keeps them")
    return dataclasses.replace(cfg, recompute=mode)


def check_assumed_vocab(training: Run) -> None:
    """A peer's data without a tokenizer.json (nanoGPT's, llm.c's) has an assumed vocabulary
    (engine/data/shards.py: the largest id + 1, or the one llm.c's shard format implies). Starting
    from a model, or resuming one, of another size: say that and what to do, rather than
    blame a tokenizer the data does not have."""
    assumed = getattr(training.dataset, "assumed_vocab", None)
    saved = (training.manifest.get("model_config") or {}).get("vocab")
    if training.init:
        model, whose, tokenizer = training.init[0].vocab, "the model of <init_from>", training.init[2]
        missing = f"the model's folder has none at {os.path.join(training.cfg.hf_dir, 'tokenizer.json')}"
    else:
        model, whose, tokenizer = saved, "the checkpoint's model", None
        missing = "the run directory's tokenizer.json, where it has one"
    if not assumed or model is None or training.dataset.vocab_size == model:
        return
    fix = (f"copy the model's tokenizer into it (cp {tokenizer} {training.cfg.data}/)" if tokenizer else
           f"put the tokenizer.json the data was made with in it ({missing})")
    raise ConfigError(f"<data> {training.cfg.data} has no tokenizer.json, so its vocabulary was assumed to be "
                      f"{training.dataset.vocab_size} ({assumed}), but {whose} has {model} tokens. If the data was "
                      f"made with the model's tokenizer (GPT-2's for nanoGPT's and llm.c's GPT-2 data), {fix}: its "
                      "vocabulary is then the data's, and it is checked to be the model's")


def check_tokenizer(training: Run) -> None:
    """A run continues (or starts from a model) with the tokenizer its data was prepared with.
    Tokenizers are compared by identity (engine/data/tokenizer.py: what decides the ids), so a
    tokenizer.json that `transformers` re-saved is the same tokenizer."""
    mine = training.tokenizer.identity if training.tokenizer is not None else None
    saved = training.manifest.get("tokenizer")
    differs = saved and mine and saved["sha256"] != training.tokenizer.sha256
    kept = _saved_tokenizer(training, saved) if differs else None
    if kept is not None and kept.identity == mine:
        # The same tokenizer in another file (re-saved): the run keeps its own, which its
        # checkpoints' sha256 names (`ringpipe export` and `sample` check it by that).
        training.tokenizer = kept
    elif saved and mine and saved["sha256"] != training.tokenizer.sha256:
        raise ConfigError(f"the data was prepared with another tokenizer (identity {mine[:12]}...) than the "
                          f"checkpoint's run ({saved['file']} in its run directory, sha256 {saved['sha256'][:12]}"
                          "...): train on data prepared with that tokenizer (`ringpipe prepare ... --tokenizer "
                          "RUN_DIR/tokenizer.json`)")
    if training.init:
        # Without the model's tokenizer.json only the vocabulary's size can be checked (and a
        # larger one refused): say so rather than train silently on ids of another tokenizer.
        from ringpipe.engine.interop import hf
        vocab = getattr(training.dataset, "vocab_size", None)
        for note in hf.check_init_data(training.cfg.hf_dir, training.init, vocab, data_has_tokenizer=mine is not None):
            training.report.note(note)
    if training.init and training.init[2] and mine:
        theirs = _model_tokenizer_identity(training)
        if theirs != mine:
            raise ConfigError(f"the data was prepared with another tokenizer than the model of <init_from> "
                              f"({training.init[2]}; they give different ids: their vocabularies, merges, normalizers, "
                              "pre-tokenizers or special tokens differ): prepare it with "
                              f"`ringpipe prepare ... --tokenizer {training.init[2]}`")


def _model_tokenizer_identity(training: Run) -> str:
    """The identity of the tokenizer.json of the model of <init_from>, read to compare the data's
    tokenizer with it. Where it cannot be read (the `tokenizers` library is not installed, the
    file is damaged), a ConfigError that says what to do, not the reader's ValueError."""
    from ringpipe.engine.data.tokenizer import CHOOSE_ANOTHER, load_tokenizer
    path = training.init[2]
    try:
        return load_tokenizer(path).identity
    except ValueError as e:
        problem = str(e).removesuffix(f"; {CHOOSE_ANOTHER}")     # that advice is --tokenizer's, not this file's
    if importlib.util.find_spec("tokenizers") is None:
        raise ConfigError(f"install the Hugging Face tokenizers library (pip install 'tokenizers>=0.19', or pip "
                          f"install -e '.[data]'): the data has a tokenizer of its own, and checking that it is the "
                          f"tokenizer of the model of <init_from> ({path}) needs the library to read that file")
    raise ConfigError(f"the tokenizer of the model of <init_from> ({path}) cannot be read, so the data's cannot be "
                      f"checked against it: {problem}; replace it with the tokenizer.json the model was published "
                      "with")


def _saved_tokenizer(training: Run, saved: dict):
    """The tokenizer a checkpoint's run saved (RUN_DIR/FILE) when it is the file the checkpoint
    records, or None (missing, unreadable, or another file: then the sha256 decides alone)."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    try:
        tokenizer = load_tokenizer(os.path.join(training.cfg.out_dir, saved["file"]))
    except (ValueError, OSError):
        return None
    return tokenizer if tokenizer.sha256 == saved["sha256"] else None


def open_dataset(cfg: Config, seq_len, stdlib_dir=None):
    """The dataset <data> names, of the kind of data the model family trains on."""
    kind, wanted = cfg.dataset, cfg.recipe.data
    if kind not in DATASETS[wanted]:
        other = next(k for k, names in DATASETS.items() if kind in names)
        raise ConfigError(f"<data> {kind} is {DATA_WORDS[other]}; use it with <model> "
                          f"{names_of(lambda recipe: recipe.data == other)}")
    return _open_tokens(cfg, seq_len, stdlib_dir) if wanted == "tokens" else _open_classes(cfg)


def _open_tokens(cfg: Config, seq_len, stdlib_dir):
    from ringpipe.engine.data import datasets as data, shards
    kind = cfg.dataset
    if kind == "prepared":
        return shards.open_dataset(cfg.data, seq_len, cfg.seed)
    if kind == "stdlib":
        dataset = shards.open_dataset(stdlib_dir, seq_len, cfg.seed)
        source = shards.read_manifest(stdlib_dir)["sources"][0]["description"]
        dataset.name, dataset.description = "stdlib", f"{source}; prepared once as token shards in {stdlib_dir}"
        return dataset
    if kind == "synthetic":
        return data.synthetic_tokens(seq_len, cfg.seed)
    if not cfg.data_path:
        raise ConfigError("<data> text needs <data_path> FILE_OR_FOLDER")
    return data.load_text_folder(cfg.data_path, seq_len, cfg.seed, max_bytes=int(cfg.max_data_mb * 2**20))


def _open_classes(cfg: Config):
    from ringpipe.engine.data import datasets as data
    dtype = np.dtype(cfg.dtype)
    if cfg.dataset == "fashion-mnist":
        return data.load_fashion_mnist(cfg.seed, root=cfg.data_path or data.FASHION_MNIST_DIR, dtype=dtype)
    return data.synthetic_classification(cfg.seed, dtype=dtype)


def describe_data(training: Run) -> None:
    training.report.say(f"data: {training.dataset.describe()}")
    training.recipe.fit_to_data(training.shape, training.dataset)           # the MLP's features and classes
    if training.recipe.data == "tokens":
        training.items_per_example = training.seq_len
    training.flops_per_item = training.recipe.flops_per_item(training.shape, training.seq_len)
    local_batch = training.cfg.batch_size // training.grid.size("data")
    first = training.grid.index("data") * local_batch
    training.rows = (first, first + local_batch)
    check_validation(training.cfg, training.dataset)     # <eval_batches> within a classification set's split


# ---- the model and its optimizer --------------------------------------------------------

def build_model(training: Run, cleanup) -> None:
    from ringpipe.engine.parallel.compose import build_rank_model
    from ringpipe.engine.schedules import ScheduleError
    cfg = training.cfg
    # layers_fn(tensor): whole layers, or a tensor group's parts of them (a family with the tensor axis)
    def layers_fn(tensor=None):
        return training.recipe.layers(training.shape, tensor)
    micro = (training.rows[1] - training.rows[0]) // cfg.microbatches
    training.tracer = None
    if cfg.trace:
        from ringpipe.engine.train.trace import Tracer
        training.tracer = Tracer(cfg.trace, training.world)
    # Every timed span of the layers and the loop goes to the clock (the time split),
    # and from there to the trace when one is written.
    training.clock = StepClock(trace=training.tracer.events if training.tracer else None)
    try:
        training.model = build_rank_model(training.grid, layers_fn, cfg, training.dtype, training.xp,
                                          micro_shape=(micro, training.seq_len or 1,
                                                       getattr(training.shape, "d_model", 1)),
                                          cost_batch=lambda: training.dataset.batch(0, cfg.batch_size, 0, micro),
                                          trace=training.clock, servers=training.servers)
    except (ScheduleError, ValueError) as e:     # a layout the schedule or the partition cannot make
        raise ConfigError(str(e)) from None
    cleanup.callback(training.model.close)
    for note in training.model.notes():
        training.report.note(note)
    training.opt = training.model.make_optimizer(cfg.optimizer, cfg.weight_decay)
    training.saver = Saver(training)
    training.saver.prepare_staging()
    if cfg.memory_report:           # each moment's measured peak (memory.py Moments), from here on
        training.moments = memory.Moments(training.world)
        training.moments.end("start-up (until the model is built)")
    if training.init:
        load_init(training)
        training.report.say(f"initialised from the Hugging Face model in {cfg.hf_dir}")
        training.init = (training.init[0], None, training.init[2])           # the arrays are loaded: let them go
        if training.moments:
            training.moments.end("import (--init-from)")
    if not training.resume_path:
        training.model.start_identical()
        return
    if training.manifest.get("optimizer") != cfg.optimizer:
        raise ConfigError(f"the checkpoint was trained with <optimizer> {training.manifest.get('optimizer')}, "
                          f"not {cfg.optimizer}")
    # Only the arrays this rank holds, each checked against the model's shape
    # before its bytes are read (a damaged or hostile file costs nothing).
    # Whole arrays, the same for every layout: any layout's checkpoint loads as it is.
    if training.manifest.get("format") == checkpoint.FORMAT_SHARDED and hasattr(training.model, "local_slices"):
        agree(training.world, lambda: restore_slices(training), "checkpoint")
        training.model.restored_slices()
    else:
        expected = training.model.state_shapes(training.opt)
        arrays, _ = agree(training.world, lambda: checkpoint.load(training.resume_path, expected=expected),
                          "checkpoint")
        training.model.restore_state(arrays, training.opt)
    if training.moments:
        training.moments.end("resume")
    training.opt.step_count = training.manifest["opt_step_count"]
    training.start_step = training.manifest["step"]
    training.report.say(f"resumed from {training.resume_path} at step {training.start_step}")
    saved = dict(training.manifest.get("args", {}))
    resolved = {"seq_len": training.seq_len, "data": cfg.dataset}      # as checkpoint_meta records them
    if cfg.dataset == "prepared" and saved.get("data") is not None:
        # checkpoint_meta records a prepared folder by its real path; older checkpoints
        # recorded "prepared" alone, which says nothing of which folder: no note either way.
        if saved["data"] == "prepared" or saved["data"] == os.path.realpath(cfg.data):
            saved["data"] = cfg.data
    for note in resume_differences(saved, cfg, resolved) + schedule_change(saved, cfg, training.start_step):
        training.report.note(note)


def schedule_change(saved: dict, cfg: Config, start_step: int) -> list[str]:
    """A note when the resumed run's LR schedule spans other steps than the
    checkpoint's run (typically: continuing to a larger --steps)."""
    if not saved.get("steps"):
        return []
    saved_span = saved.get("decay_steps") or saved["steps"]
    if saved_span == cfg.schedule_steps:
        return []
    saved_lr = saved.get("lr") or cfg.peak_lr
    saved_warmup = saved.get("warmup")
    saved_warmup = saved_warmup if saved_warmup is not None else max(1, saved_span // 20)
    was = lr_at(start_step, saved_lr, saved_warmup, saved_span, saved.get("min_lr_ratio", cfg.min_lr_ratio))
    now = lr_at(start_step, cfg.peak_lr, cfg.warmup_steps, cfg.schedule_steps, cfg.min_lr_ratio)
    return [f"note: the LR schedule now spans {cfg.schedule_steps} steps where the checkpoint's run had "
            f"{saved_span}: step {start_step + 1} gets lr {now:.2e} where that run would have used {was:.2e}. "
            f"To continue on the original schedule (the LR then stays at its minimum), pass <decay_steps> "
            f"{saved_span}"]


def agree_on_float32_gemm(training: Run) -> None:
    """Every rank runs rank 0's float32 CPU GEMM (kernels/sgemm.py: numpy's BLAS, or oneDNN's
    sgemm where a calibration found it faster on this host): two libraries sum in different
    orders, and a job's ranks run one. A RINGPIPE_SGEMM nothing can use is refused on every rank."""
    if training.xp is not np or training.dtype != np.float32 or training.cfg.precision == "bf16":
        return
    world = training.world
    name = agree_on_rank0(world, K.float32_gemm_choice, "choice of the float32 GEMM (RINGPIPE_SGEMM)")
    # rank 0 already runs it; the others take it (an error where a rank lacks the library)
    agree(world, lambda: world.Get_rank() == 0 or K.use_float32_gemm(name, "rank 0's choice"),
          "float32 GEMM of rank 0")


# ---- reporting --------------------------------------------------------------------------------

def bf16_line(training: Run) -> str:
    """What --precision bf16 does on this machine: which GEMM runs it (kernels.bf16_gemm(): oneDNN's
    native bf16 GEMM, or the emulation and why) and which operands are rounded once
    (engine/model/layers.py BF16)."""
    if training.xp is not np:
        return "bf16: GEMM operands rounded to bf16 on the GPU (tensor cores), float32 sums and master weights"
    weights = ("per GEMM: ZeRO-3 gathers them per layer" if training.cfg.zero == 3 and training.grid.size("data") > 1
               else "once per step, after the update")
    return (f"{K.bf16_gemm()} | weights rounded to bf16 {weights}; kept activations bf16; float32 sums, "
            "master weights and optimizer")


def start_reporting(training: Run, cleanup) -> None:
    cfg, report, world = training.cfg, training.report, training.world
    # the whole model's parameters, whatever part of them rank 0 holds (tensor, pipeline)
    total = model_parameters(training.recipe.layers(training.shape))
    report.say(model_line(cfg.model, training.shape.to_dict(), total, training.model.params.size, cfg.dtype,
                          cfg.precision == "bf16"))
    if cfg.precision == "bf16":
        report.say(bf16_line(training))
    elif training.xp is np and training.dtype == np.float32:
        report.say(K.float32_gemm())
    layout = f"dp {training.grid.size('data')} x pp {training.grid.size('pipe')}" + \
        (f" x tp {training.grid.size('tensor')}" if training.grid.size("tensor") > 1 else "")
    described = training.model.describe()
    ranks = f"{world.Get_size()} ranks: {layout}"
    if training.servers is not None:
        ranks = (f"{training.servers.world.Get_size()} ranks: {world.Get_size()} workers ({layout}) + "
                 f"{len(training.servers.servers)} parameter server(s)")
    report.say(f"data {training.dataset.name} | global batch {cfg.batch_size} x {training.items_per_example} = "
               f"{training.items_per_step} {training.recipe.unit}/step | {ranks}{f' | {described}' if described else ''}")
    if cfg.inexact_mode:
        report.note(f"note: parameter-server mode {cfg.inexact_mode} changes the math: the losses and weights are not "
                    "those of sync (or of any other layout); every progress line and metrics record says so")
    memory.report_at_start(training)        # the predicted peak per rank; a warning if the node lacks it
    if comm.launcher.prepared:
        report.say(f"MPI: {comm.launcher.prepared}")
    # threads per rank and why (a fact); a warning if they oversubscribe
    threads_used, *warnings = runtime.thread_report()
    report.say(threads_used)
    for warning in warnings:
        report.note(warning)
    if training.xp is not np:
        from ringpipe.engine.job.array_module import describe as describe_device
        report.say(f"device: {describe_device(training.xp)} on rank 0")
        if world.Get_size() > 1:
            report.say(f"GPU buffers and MPI: {training.transport.describe()}")
    if training.recipe.data == "tokens":
        # Reads each split's first 256 MiB (and refuses a token id outside the vocabulary
        # there): a read error on one rank must stop every rank alike.
        nats = agree(world, training.dataset.unigram_entropy, "unigram baseline of the data")
        per_token = training.dataset.bytes_per_token("val")
        bpb = f" = {nats / math.log(2) / per_token:.3f} bits/byte" if per_token else ""
        report.say(f"unigram baseline (val): {nats:.4f} nats/token{bpb} (a model must beat it to have learned)")
    pp = training.grid.size("pipe")
    if pp > 1 and cfg.microbatches < 2 * pp:
        report.note(f"note: {cfg.microbatches} micro-batch(es) on {pp} stages leaves the pipeline mostly idle "
                    f"(bubble {(pp - 1) / (cfg.microbatches + pp - 1):.0%}); use <microbatches> >= {4 * pp} "
                    "to fill it")
    report.log = lifecycle.setup_rank_logging(cfg.out_dir, world.Get_rank(), world.Get_size())
    report.log.info("start: %s", " ".join(sys.argv) or "(in-process)")
    training.dog = lifecycle.Watchdog(world, cfg.watchdog, run_dir=cfg.out_dir, abort=cfg.watchdog_abort)
    cleanup.callback(training.dog.stop)
    if report.is_main:
        if training.tokenizer is not None:
            training.tokenizer.save(cfg.out_dir)          # OUT/tokenizer.json: `ringpipe sample` and `export` read it
        report.metrics = rundir.MetricsLog(os.path.join(cfg.out_dir, rundir.METRICS_NAME),
                                           append=bool(training.resume_path))
        for note in report.metrics.notes:
            report.note(note)


# ---- watching the job (docs/monitoring.md) --------------------------------------------------

def start_monitoring(training: Run, cleanup) -> None:
    """The GEMM peak MFU is measured against, the per-rank monitor (collective: it learns
    which node every rank is on and writes OUT/monitor.json), and rank 0's sinks."""
    cfg, world, grid, report = training.cfg, training.world, training.grid, training.report
    if cfg.monitor_every != 0:
        peak = np.array([gemm_peak_flops(training.xp, training.dtype, cfg.precision)])
        comm.allreduce(peak, world, op="avg")
        training.peak_flops = float(peak[0])
    # A resume past <steps> does nothing more: the run's last step is the checkpoint's.
    header = {"start_step": training.start_step, "steps": max(cfg.steps, training.start_step), "model": cfg.model,
              "unit": training.recipe.unit, "items_per_step": training.items_per_step, "precision": cfg.precision,
              "layout": {"dp": grid.size("data"), "pp": grid.size("pipe"), "tp": grid.size("tensor")},
              "gemm_peak_flops_per_rank": training.peak_flops, "sync": cfg.sync,
              "ps_mode": cfg.ps_mode if cfg.sync == "ps" else None, "exact": cfg.inexact_mode is None,
              "parameter_servers": training.servers.server_places if training.servers is not None else []}
    coords = {"dp": grid.index("data"), "pp": grid.index("pipe"), "tp": grid.index("tensor")}
    gpu = None
    if training.xp is not np:
        gpu = int(training.xp.cuda.Device().id)
    training.monitor = agree(world, lambda: RankMonitor(
        world, out_dir=cfg.out_dir, interval=cfg.monitor_every, ratio=cfg.straggler_ratio,
        intervals=cfg.straggler_intervals, coords=coords, header=header, say=report.say, note=report.note,
        gpu_index=gpu),
        "the monitor header (OUT/monitor.json)")

    def sinks_on_rank0():                 # the sinks stay on rank 0: only their verdict is shared
        training.sinks = open_sinks(training)
        cleanup.callback(training.sinks.close)
    agree_on_rank0(world, sinks_on_rank0, "monitoring sinks")
    if cfg.monitor_every == 0:
        report.say("monitoring: per-rank measurements off (<monitor_every> 0): metrics.jsonl has rank 0's step "
                   "records only; `ringpipe top` and `ringpipe report` show those")
    elif training.peak_flops:
        every = (f"about every 2 s (the steps between, agreed after step {training.start_step + 2})"
                 if cfg.monitor_every == "auto" else f"every {cfg.monitor_every} steps")
        report.say(f"monitoring: per-rank numbers {every}; MFU against a GEMM peak of {training.peak_flops / 1e9:.1f} GFLOP/s a rank (measured now, "
                   f"{cfg.precision}); `ringpipe top {cfg.out_dir}` watches, `ringpipe report {cfg.out_dir} --out "
                   "report.html` plots")


def open_sinks(training: Run):
    """Rank 0: the sinks asked for. A missing library or a port in use is a ConfigError."""
    cfg = training.cfg
    tensorboard = cfg.tensorboard
    if tensorboard is None:
        tensorboard = importlib.util.find_spec("tensorboard") is not None
        if not tensorboard:
            training.report.say("TensorBoard: off (the tensorboard package is not installed: pip install 'ringpipe[monitor]')")
    job = os.environ.get("SLURM_JOB_ID") or os.path.basename(os.path.abspath(cfg.out_dir))
    try:
        sinks = Sinks.open(cfg.out_dir, training.start_step, tensorboard=tensorboard, textfile=cfg.metrics_textfile,
                           port=cfg.metrics_port, host=cfg.metrics_host, job=job, say=training.report.note)
    except MissingLibrary as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"<metrics_port> {cfg.metrics_port} on {cfg.metrics_host} cannot be opened "
                          f"({e.strerror or e}); pick a free port, or leave <metrics_port> out") from None
    if tensorboard:
        training.report.say(f"TensorBoard: {os.path.join(cfg.out_dir, TENSORBOARD_DIR)} "
                            f"(tensorboard --logdir {os.path.join(cfg.out_dir, TENSORBOARD_DIR)})")
    if cfg.metrics_textfile:
        training.report.say(f"Prometheus: {cfg.metrics_textfile} (node_exporter's textfile collector)")
    if cfg.metrics_port is not None:
        training.report.say(f"Prometheus: http://{cfg.metrics_host}:{cfg.metrics_port}/metrics (rank 0)")
    return sinks
