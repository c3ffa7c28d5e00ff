"""The `ringpipe train` command line (also `python -m ringpipe.train`, `ringpipe-train`):
flags in (each the Config field of the same name), engine.train.run.run() out,
library errors to messages and exit codes.

Runs the same way under plain `python`, `mpiexec -n N` and `srun`. Defaults
train the small byte-level GPT on the Python standard library's own source.
Exit codes: 0 done, 85 stopped on SIGUSR1/SIGTERM with a checkpoint (requeue),
130 the same after Ctrl-C, 2 a refused configuration, 1 a failure every rank
agreed on (a full disk), else an abort naming the rank.
"""
from __future__ import annotations

import os
import sys

from ringpipe import threads
from ringpipe.engine.job import runtime  # stdlib only: safe before numpy

runtime.set_thread_defaults()        # (ringpipe's import set them, before numpy loads BLAS)
threads.leave_warning_to_report()    # rank 0's start-up report says the threads, and any oversubscription
runtime.reuse_freed_memory()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

from ringpipe.engine.train.config import Config  # noqa: E402
from ringpipe.engine.model.registry import RECIPES  # noqa: E402
from ringpipe.engine.job.errors import ConfigError, Diverged, JobFailure, spell  # noqa: E402


def _launcher_rank():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class UsageError(SystemExit):
    """A refused command line. Raised, not printed: main() first makes sure every
    rank knows (a rank that exits alone would leave the others waiting).
    The code is usage + error, as argparse prints it; `short` is the error alone."""

    def __init__(self, usage: str, short: str):
        super().__init__(usage + short)
        self.short = short


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(self.format_usage(), f"{self.prog}: error: {message}")


def parse_args(argv=None, prog="ringpipe train"):
    p = _Parser(
        prog=prog,
        description="Train a hand-written GPT, Llama-family model or MLP (numpy + Numba on the CPU, CuPy on a "
                    "GPU) with MPI data parallelism (our ring all-reduce, ZeRO-1/2/3), pipeline stages (GPipe, 1F1B, "
                    "interleaved, zero-bubble) and tensor parallelism, alone or as a DP x PP x TP grid. "
                    "Launch with plain python, `mpiexec -n N`, or `srun`.",
        epilog="Examples:\n"
               "  ringpipe train --steps 50                      # small GPT, stdlib corpus, 1 rank\n"
               "  mpiexec -n 4 ringpipe train --dp 4             # data-parallel over 4 ranks\n"
               "  ringpipe train --model llama --preset llama-tiny   # a tiny Llama-family model\n"
               "  ringpipe train --model mlp --data synthetic\n"
               "  ringpipe train --resume auto --out runs/gpt    # continue from the latest checkpoint\n"
               "(python -m ringpipe.train ... is the same command)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    for add_flags in (_model_flags, _data_flags, _optimization_flags, _parallelism_flags, _output_flags,
                      _monitoring_flags, _cluster_flags):
        add_flags(p)
    return p.parse_args(argv)


def _model_flags(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(RECIPES), default=None,
                   help="model family to train (default: the family of --init-from's folder, else gpt)")
    g.add_argument("--preset", choices=sorted({name for r in RECIPES.values() for name in r.presets}), default=None,
                   help="a standard shape of the --model's family: sets --layers, --d-model, --heads and --context "
                        "(gpt2-124m: 12, 768, 12, 1024; the llama presets also the rest of the shape, and the real "
                        "models' the vocabulary); flags given as well must agree with it")
    g.add_argument("--init-from", default=None, metavar="hf:HF_DIR",
                   help="start from the weights of a Hugging Face folder (ringpipe export's, or a local GPT-2 or "
                        "Llama-style download with model.safetensors): its family and shape replace --model and the "
                        "shape flags, and --data must use its tokenizer")
    g.add_argument("--layers", type=int, default=None, help="transformer blocks / MLP hidden layers (default 4 / 2)")
    g.add_argument("--d-model", type=int, default=None, help="GPT width / MLP hidden width (default 128 / 256)")
    g.add_argument("--heads", type=int, default=None, help="GPT attention heads (default 4)")
    g.add_argument("--context", type=int, default=None, help="GPT maximum sequence length (default 128)")
    g.add_argument("--kv-heads", type=int, default=None,
                   help="llama: key/value heads, dividing --heads (default --heads: multi-head attention; "
                        "1: multi-query; between: grouped-query)")
    g.add_argument("--d-ff", type=int, default=None,
                   help="llama: SwiGLU intermediate size (default 8/3 --d-model, rounded up to a multiple of 32)")
    g.add_argument("--rope-theta", type=float, default=None, help="llama: rotary embedding base theta (default 10000)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="llama: the output head reuses the token embedding (default), or has its own (--no-...)")
    g.add_argument("--qk-norm", choices=["none", "head", "all"], default=None,
                   help="llama: head normalises each attention head's q and k (an RMSNorm over the head's "
                        "channels, before the rotation) as Qwen3 does; all normalises a position's whole q and "
                        "whole k (every head's channels) as OLMo 2 does; none (default) as Llama and Qwen2")
    g.add_argument("--norm-place", choices=["pre", "post"], default=None,
                   help="llama: where a block's two RMSNorms sit: pre (default) before attention and the MLP, "
                        "as Llama; post after each, before the residual add, as OLMo 2")
    g.add_argument("--nope-layers", default=None, metavar="I,J,...",
                   help="llama: the blocks (0-based, comma-separated) whose attention has no rotary positions, "
                        "as SmolLM3's every fourth (NoPE: 3,7,11,...); default none")
    g.add_argument("--sliding-window", type=int, default=None, metavar="W",
                   help="llama: a sliding window: each position attends to the W positions up to itself only "
                        "(Mistral's; default none: the whole causal past)")
    g.add_argument("--window-layers", default=None, metavar="I,J,...",
                   help="llama: with --sliding-window, the blocks (0-based, comma-separated) that have it, as "
                        "Qwen's and Gemma's local layers (default: every block)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="compute dtype (default float32)")
    g.add_argument("--precision", choices=["float32", "bf16"], default="float32",
                   help="matmul inputs: float32, or bf16 (rounded to bfloat16, float32 accumulation, "
                        "float32 master weights and optimizer state; tensor cores with --device cuda, on the "
                        "CPU oneDNN's bf16 GEMM where it has AVX512_BF16/AMX-BF16, else emulated with no "
                        "speed-up: RINGPIPE_BF16_GEMM). Needs --dtype float32")
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (numpy + Numba) or cuda (CuPy + CUDA kernels; rank takes GPU local_rank %% n_gpus; "
                        "MPI gets GPU buffers directly if RINGPIPE_CUDA_AWARE_MPI=1, or if unset when the MPI "
                        "library reports CUDA support or MPICH_GPU_SUPPORT_ENABLED=1 / MV2_USE_CUDA=1 is set; "
                        "else through pinned host memory)")


def _data_flags(p):
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, metavar="{stdlib,synthetic,fashion-mnist,text,DATA_DIR}",
                   help="dataset: a folder written by `ringpipe prepare` (token shards, read window by window; its "
                        "tokenizer sets the GPT's vocabulary; a nanoGPT train.bin/val.bin folder works too), or "
                        "stdlib (default for gpt; the interpreter's own library source), fashion-mnist (default "
                        "for mlp; Debian package dataset-fashion-mnist), synthetic (tiny, for tests), text (a "
                        "file or folder given by --data-path)")
    g.add_argument("--data-path", default=None,
                   help="file/folder for --data text (given alone, it implies --data text for the GPT), or the "
                        "IDX folder for fashion-mnist; a folder's text files are read in sorted order, binary "
                        "files skipped, and what was read is printed")
    g.add_argument("--max-data-mb", type=float, default=64.0,
                   help="--data text folders: read at most this many MiB into memory on every rank (default "
                        "64; the run says when the folder holds more); a single file is memory-mapped instead, "
                        "whatever its size. --data stdlib: the MiB of library source prepared (once, as token "
                        "shards in $RINGPIPE_CACHE, default ~/.cache/ringpipe) and read like them. For corpora of "
                        "any size use `ringpipe prepare` and --data DATA_DIR")
    g.add_argument("--seq-len", type=int, default=None, help="GPT training sequence length (default: the context)")
    g.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch size in sequences/examples (default 16)")


def _optimization_flags(p):
    g = p.add_argument_group("optimization")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    g.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 adamw, 0.05 sgd; "
                   "a tenth of that with --init-from)")
    g.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%% of --decay-steps; 1%% with "
                   "--init-from)")
    g.add_argument("--decay-steps", type=int, default=None,
                   help="steps the warmup + cosine LR schedule spans (default --steps); after them the LR stays "
                        "at --min-lr-ratio x --lr. To continue a finished run to a larger --steps on its "
                        "original schedule, pass its old --steps here (the run says so when resuming)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    g.add_argument("--seed", type=int, default=1337, help="initialisation and data order (>= 0; default 1337)")


def _parallelism_flags(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel ranks (default: all ranks / (pp x tp)); ranks = dp x pp x tp")
    g.add_argument("--bucket-mb", type=float, default=None,
                   help="gradient bucket size in MiB (default: auto, about 1/8 of the gradients, between "
                        "0.25 and 25 MiB, so backward overlaps several all-reduces; the first bucket is "
                        "capped at 1 MiB like PyTorch DDP's)")
    g.add_argument("--no-overlap", action="store_true",
                   help="reduce the gradients after backward instead of during it (and, with --zero 3, gather "
                        "each layer when it is needed instead of prefetching it on a thread)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="split training state across the data-parallel ranks (ZeRO), float32 AdamW bytes per "
                        "parameter with N ranks: 0 none (16); 1 the optimizer state (8 + 8/N); 2 the gradients "
                        "too, reduce-scattered as backward makes them (4 + 12/N; with micro-batches only after the "
                        "last one's backward); 3 the parameters too, each layer gathered just before it runs "
                        "(16/N + the gathered layers; 1.5x the traffic with --zero-gather use and one micro-batch, "
                        "1x with step). Composes with --pp and --tp. Same math at every stage")
    g.add_argument("--zero-gather", choices=["auto", "use", "step"], default="auto",
                   help="with --zero 3: when a gathered layer is dropped again. use: after each use (least "
                        "memory; 2 gathers per micro-batch); step: at the end of the step (one gather per layer "
                        "per step, all layers in memory by then). auto (default): step with --pp, else use")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); ranks = dp x pp x tp")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per layer (default 1; GPT and Llama): attention heads, MLP features "
                        "and the vocabulary split across tp ranks, 2 all-reduces per sub-layer. Must divide "
                        "--heads (Llama: --kv-heads). The innermost axis: keep tp within a node")
    g.add_argument("--tp-overlap", choices=["auto", "on", "off"], default="auto",
                   help="with --tp: reduce a column-parallel layer's input gradient on a thread while its "
                        "weight gradient is computed. auto (default): on with --device cuda (the GPU computes "
                        "while the CPU runs MPI), off on the CPU, where the copies compete with the GEMM for "
                        "the core (benchmarks/tensor_parallel.py measured 0.96x)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and the residual stream split along the sequence between the "
                        "tensor-parallel regions (all-gather/reduce-scatter instead of all-reduce; activation "
                        "memory there / tp). --seq-len must be a multiple of --tp")
    g.add_argument("--recompute", choices=["auto", "none", "full", "selective"], default="auto",
                   help="activation recomputation of transformer blocks (GPT, Llama): auto (default) is selective "
                        "where the attention probabilities would be a third or more of what a block keeps (long "
                        "sequences: GPT-2 124M at T 1024), else none; none keeps every "
                        "activation until backward; full keeps only each block's input and runs the block's "
                        "forward again in backward (about a third more compute; a block keeps T x C numbers a sequence); selective "
                        "drops only the attention probabilities (heads x T x T per sequence) and recomputes "
                        "them from q and k (two kernel calls a block). Gradients are bit-identical")
    g.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zbh1"], default=None,
                   help="pipeline schedule (default 1f1b; zbh1 = zero-bubble H1; interleaved needs --chunks "
                        ">= 2); needs --pp >= 2 or --chunks >= 2")
    g.add_argument("--microbatches", type=int, default=1,
                   help="micro-batches per step on each data-parallel replica (pipeline depth / accumulation)")
    g.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved schedule)")
    g.add_argument("--partition", choices=["uniform", "balanced"], default=None,
                   help="split layers evenly (default), or balance measured per-layer cost across stages")
    g.add_argument("--reduce-order", choices=["fast", "canonical"], default="fast",
                   help="how the data axis sums gradients: fast (default: the fastest algorithm for the size, "
                        "ring or recursive doubling; the bits of the sum depend on the number of ranks) or "
                        "canonical (every micro-batch's gradient summed in one fixed pairwise tree over the global "
                        "batch: float32 weights bit-identical at --dp 1, 2, 4 with the same global micro-batches, "
                        "e.g. --dp 1 --microbatches 4 = --dp 2 --microbatches 2; dp and micro-batches powers of two, "
                        "no pipeline, no ZeRO yet)")
    g.add_argument("--sync", choices=["allreduce", "ps"], default="allreduce",
                   help="how the data axis syncs gradients: allreduce (default: every rank sums them, then "
                        "updates all parameters) or ps (a parameter server: each rank pushes its gradient's 4 MiB "
                        "chunks to their owners, each owner sums them in a fixed pairwise tree, updates its chunks "
                        "and every rank pulls the new parameters; the same math and per-rank traffic as the ring, "
                        "the optimizer state split like --zero 1; with --pp/--tp one server group per stage and "
                        "tensor rank). Needs dp >= 2; no --zero or cuda yet")
    g.add_argument("--ps-servers", type=int, default=0, metavar="K",
                   help="with --sync ps: dedicated server ranks, the last K of the job (launch K more ranks; "
                        "they hold the master weights and the optimizer state, clip and update; with --pp/--tp "
                        "they serve every stage and tensor rank; without clipping they stream the step). 0 (default): every data-parallel rank serves its share of the chunks (colocated, "
                        "sharded)")
    g.add_argument("--ps-mode", default="sync", metavar="MODE",
                   help="with --sync ps --ps-servers K >= 1: sync (default: every step sums every worker's "
                        "gradient, the all-reduce's math exactly), ssp:S (bounded staleness, S <= 1000: a step computes on "
                        "parameters S updates old while the pulls travel; repeats bit for bit, but not sync's "
                        "math) or async (each worker's gradient applied alone as it arrives, lr / workers each; "
                        "varies run to run). ssp and async change the math: the log and metrics say so")
    g.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome/Perfetto trace per rank and a merged DIR/trace.json")


class _OldName(argparse.Action):
    """A renamed flag's old spelling: still works, with a note (on the launcher's rank 0) naming the new one."""

    def __init__(self, option_strings, dest, new, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        if _launcher_rank() == 0:
            print(f"note: {option_string} is now {self.new} (it counts tokens); the old name still works",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def _output_flags(p):
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="run directory (default runs/<model>)")
    g.add_argument("--overwrite", action="store_true",
                   help="start fresh even if --out holds checkpoints: the earlier run's checkpoints, metrics "
                        "and logs are moved to OUT/previous/ (replacing what was kept there before)")
    g.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0: all)")
    g.add_argument("--checkpoint-format", choices=("sharded", "whole"), default="sharded",
                   help="sharded (default): every rank writes its own slices in parallel, one manifest says where "
                        "each is, and a resume at any layout reads only its own; whole: one .npz gathered on the "
                        "first rank (the format before 0.4; both load at any layout)")
    g.add_argument("--checkpoint-async", action="store_true",
                   help="write each --checkpoint-every checkpoint in the background: the step's state is copied "
                        "to host memory and training goes on while every rank writes its slices (sharded only; "
                        "the next save, a stop signal and the end wait for it)")
    g.add_argument("--resume", default=None, help="checkpoint (.json), run directory, or 'auto' (latest valid "
                                                  "checkpoint in --out, or a fresh start if none)")
    g.add_argument("--eval-every", type=int, default=None,
                   help="steps between validation passes (default steps/5; steps/10 with --init-from, which also "
                        "validates once before the first step)")
    g.add_argument("--keep-best", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the checkpoint of the best validation loss in OUT/best/ (for `ringpipe export "
                        "OUT/best` and `ringpipe sample OUT/best`) and say at the end which step it was "
                        "(default: on with --init-from, off otherwise)")
    g.add_argument("--eval-batches", type=_eval_batches, default=None, metavar="N|all",
                   help="global batches per validation pass (default 4; at most the validation split of a "
                        "classification set, whose pass counts each example once), or all: a classification set's "
                        "whole validation split, each example once (the default for the MLP's last pass)")
    g.add_argument("--log-every", type=int, default=None, help="steps between progress lines (default ~20 lines)")
    g.add_argument("--sample-tokens", type=int, default=200,
                   help="GPT: tokens of text to sample at the end (0: none; at most 1,000,000; a stop signal ends "
                        "the sample early)")
    # The flag's first name: it always counted tokens (bytes only for the byte tokenizer).
    g.add_argument("--sample-bytes", type=int, dest="sample_tokens", action=_OldName, new="--sample-tokens",
                   help=argparse.SUPPRESS)
    g.add_argument("--quiet", action="store_true",
                   help="print warnings and notes only: no start-up report, progress lines or summary "
                        "(metrics.jsonl and the log are still written)")
    g.add_argument("--memory-report", action="store_true",
                   help="print the predicted memory per rank item by item at start-up (parameters, gradients, "
                        "optimizer state, activations, communication buffers; docs/memory.md), after step 2 "
                        "the measured peak (the largest rank's) next to it, and at the end each moment's peak "
                        "(start-up, import, resume, steps, saves) against the steady state")


def _eval_batches(text):
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of batches or all, got {text!r}") from None


def _monitor_every(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps or auto, got {text!r}") from None


def _monitoring_flags(p):
    g = p.add_argument_group("monitoring (docs/monitoring.md)")
    g.add_argument("--monitor-every", type=_monitor_every, default="auto", metavar="N|auto",
                   help="steps between per-rank measurements (time split, memory, CPU, network): one small "
                        "gather to rank 0, written to metrics.jsonl's per-rank section and the sinks below; auto "
                        "(default): about every 2 seconds of steps, about 0.1%% of the step time (measured: "
                        "benchmarks/monitor_overhead.py); 0: off")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard event files in OUT/tensorboard (tensorboard --logdir OUT/tensorboard); default: "
                        "on when the tensorboard package is installed (pip install 'ringpipe[monitor]')")
    g.add_argument("--metrics-textfile", default=None, metavar="FILE.prom",
                   help="write Prometheus metrics to this file (atomically, each interval) for node_exporter's "
                        "textfile collector; no port is opened")
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics from rank 0 on this port (bound to --metrics-host)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                   help="the address --metrics-port binds (default 127.0.0.1: only this node; 0.0.0.0: every "
                        "interface)")
    g.add_argument("--straggler-ratio", type=float, default=1.5, metavar="X",
                   help="name a rank whose compute time (or data wait, or memory) is X times its peers' median "
                        "(default 1.5) ...")
    g.add_argument("--straggler-intervals", type=int, default=3, metavar="K",
                   help="... for K intervals in a row (default 3)")


def _cluster_flags(p):
    g = p.add_argument_group("cluster")
    g.add_argument("--watchdog", type=float, default=0.0, metavar="SECONDS",
                   help="report ranks that made no progress for this long (0: off); names the stuck ranks")
    g.add_argument("--watchdog-abort", action="store_true", help="abort the job after a watchdog report")


# ---- settings as flags ---------------------------------------------------------------

# Names that messages use (<field>) and the flag that sets each.
_MODEL_FIELD_FLAGS = {"n_layer": "--layers", "n_head": "--heads", "hidden": "--d-model", "d_model": "--d-model",
                      "context": "--context", "vocab": "the vocabulary",
                      "n_kv_head": "--kv-heads"}
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


def flag_name(field: str) -> str | None:
    """The flag for a Config (or model shape) field; None for any other word."""
    if field in _MODEL_FIELD_FLAGS:
        return _MODEL_FIELD_FLAGS[field]
    if field in _CONFIG_FIELDS:
        return "--" + field.replace("_", "-")
    return None


def config_from_args(args) -> Config:
    settings = vars(args)
    if settings["model"] is None:
        settings["model"] = (_family_from_checkpoint(settings.get("resume"), settings.get("out"))
                             or _family_from_init(settings.get("init_from"))
                             or _family_of_preset(settings.get("preset")) or "gpt")
    return Config(**settings)


def _family_of_preset(preset):
    """--preset NAME without --model: the one family whose preset it is (llama-tiny is a Llama)."""
    families = [name for name, recipe in RECIPES.items() if preset in recipe.presets]
    return families[0] if len(families) == 1 else None


def _family_from_checkpoint(resume, out_dir):
    """--resume without --model: the checkpoint it continues names its family (a Llama run
    continues as one with `--resume auto --out RUN`, as its shape already does). None when
    there is nothing to read yet; the run then says what is wrong with the checkpoint."""
    if not resume or (resume == "auto" and not out_dir):       # the default --out depends on the family
        return None
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.model.registry import RECIPES
    try:
        path = checkpoint.resolve(out_dir if resume == "auto" else resume)
        family = checkpoint.read_manifest(path).get("model")
    except (checkpoint.CheckpointError, OSError, ValueError, TypeError):
        return None
    return family if family in RECIPES else None


def _family_from_init(init_from):
    """--init-from hf:DIR without --model: the folder's config.json says the family (a
    Llama-style folder trains as llama without the user repeating it)."""
    if not init_from or not init_from.startswith("hf:"):
        return None
    from ringpipe.engine.interop.hf import family_of
    return family_of(init_from[3:])


def run_flags(argv, world=None, stop=None):
    """Train from a command line, in this process (tests and notebooks): what `ringpipe
    train ARGV` does, with errors raised as SystemExit("error: ...") as the command
    line prints them, and a stop with a checkpoint as SystemExit(code)."""
    from ringpipe.engine.train.run import run
    cfg = config_from_args(parse_args(argv))
    try:
        result = run(cfg, world=world, stop=stop, render=flag_name)
    except (ConfigError, JobFailure, Diverged) as e:
        raise SystemExit(f"error: {_spelled(e)}") from None
    if result.exit_code:
        raise SystemExit(result.exit_code)
    return result


def _spelled(e: BaseException) -> str:
    return e.render(flag_name) if isinstance(e, ConfigError) else spell(str(e), flag_name)


# ---- the command ---------------------------------------------------------------------

def main(argv=None, prog="ringpipe train"):
    # Catch stop signals before anything else, MPI_Init included: MPICH installs
    # a SIGUSR1 handler of its own there that would swallow the signal.
    from ringpipe.engine.job import lifecycle
    stop = lifecycle.StopFlag()
    try:
        args, usage_error = parse_args(argv, prog), None
    except UsageError as e:
        args, usage_error = None, e
    try:
        from ringpipe import comm    # MPI_Init happens here
    except ImportError as e:
        if lifecycle.missing_mpi(e) is None:
            raise
        print(f"{prog}: error: {lifecycle.missing_mpi(e)}", file=sys.stderr)
        sys.exit(2)
    from ringpipe.engine.train.run import run
    stop.install()                   # take SIGUSR1 back from MPICH
    comm.install_abort_handler()
    code = 0
    try:
        # Refuse a launch where srun's MPI plugin did not wire the ranks together.
        lifecycle.check_launcher()
        agree_on_command_line(usage_error)
        code = run(config_from_args(args), stop=stop, render=flag_name).exit_code
    except lifecycle.LauncherError as e:
        # Every task is alone in its own world: each says so, since srun may
        # kill task 0 before it gets to print.
        print(f"error: {_spelled(e)}", file=sys.stderr, flush=True)
        code = 2
    except UsageError as e:
        print(e.code, file=sys.stderr, flush=True)
        code = 2
    except (ConfigError, JobFailure, Diverged) as e:
        # Every rank reached the same verdict (engine/job/agreement.py sees to that),
        # so every rank exits quietly, no abort needed; rank 0 prints it.
        if _launcher_rank() == 0:
            print(f"error: {_spelled(e)}", file=sys.stderr, flush=True)
        code = 1 if isinstance(e, JobFailure) else 2
    finally:
        # The outcome is decided (and its checkpoint written): a signal during
        # interpreter and MPI shutdown must not turn the exit code into "killed".
        stop.ignore_from_now_on()
    sys.exit(code)


def agree_on_command_line(usage_error):
    """A command line refused on some ranks only (an MPMD launch, `a : b`) must
    stop all ranks, not leave the others waiting in their first collective."""
    from mpi4py import MPI

    from ringpipe.engine.job.agreement import agree
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        if usage_error is not None:
            raise usage_error
        return

    def refused_here():
        if usage_error is not None:
            raise ConfigError(usage_error.short)

    try:
        agree(world, refused_here, "command line", hint="were the ranks launched with different arguments?")
    except ConfigError as e:
        if usage_error is not None and e.message == usage_error.short:
            raise usage_error from None    # refused alike on every rank: show the usage, as one process would
        raise


if __name__ == "__main__":
    main()
