"""Llama-family training step on this CPU: ringpipe next to PyTorch eager LlamaForCausalLM,
same shapes, same threads, same run (issue 23).

    python benchmarks/llama_step.py [--shapes small,smollm2-135m --batch 1 --seq 256 --steps 3 --warmup 1
                                     --rounds 2 --threads N --frameworks ringpipe,torch,torch-bf16] [--json PATH]
    python benchmarks/llama_step.py --quick      # transformers' tiny test shape, seconds per framework

Shapes (engine/model/llama.py; both with SmolLM2's vocabulary, 49152, a multiple of 128 so
neither framework pads or masks anything):
  * small:        4 layers x 256, 8 heads, 2 KV heads, intermediate 768, tied, theta 100000
  * smollm2-135m: the preset (30 x 576, 9 heads, 3 KV heads, intermediate 1536, tied, theta 100000)
  * qwen3-0.6b:   the preset (28 x 1024, 16 heads of 128, 8 KV heads, intermediate 3072, the per-head
                  q/k norm, tied, vocabulary 151936), against transformers' Qwen3ForCausalLM (issue 36)
  * --quick:      hf-tiny (2 x 32, 4 heads, 2 KV heads, intermediate 37, vocab 99 -> 128 rows)
The sequence is short (default batch 1 x 256 tokens) so both shapes, every framework and two
rounds finish in a few minutes on 2 cores; the context does not enter the step's cost.

One training step = forward + loss + backward + global-norm clip (1.0) + AdamW update
(betas 0.9/0.95, weight decay 0.1 on the matrices only, constant lr), on one fixed batch of
random token ids.
  * ringpipe: the trainer's own pieces (engine.parallel.local.LocalModel over
    engine.model.llama.llama_layers, engine.model.optim.make_optimizer("adamw"), optim.clip),
    with the trainer's process settings (runtime.set_thread_defaults, reuse_freed_memory); float32.
  * torch: transformers.LlamaForCausalLM of the same shape (vocab_size = ringpipe's rows,
    rms_norm_eps 1e-5, no biases, attention sdpa, transformers' default), F.cross_entropy,
    clip_grad_norm_, torch.optim.AdamW (its default implementation); float32.
  * torch-bf16: the same model in float32 with torch.autocast("cpu", torch.bfloat16) around
    forward and loss (mixed precision: float32 weights, gradients and AdamW). Offered where the
    CPU multiplies bf16 natively (lscpu flags avx512_bf16 or amx_bf16).
  * ringpipe-bf16 (asked for with --frameworks): ringpipe with kernels.set_matmul_precision("bf16"),
    the trainer's --precision bf16 (bf16 GEMMs, float32 sums, master weights and AdamW).
Each framework runs in a fresh child process, so its peak memory (ru_maxrss, from wait4) is its
own; --rounds alternates the children (ringpipe, torch, torch-bf16, ringpipe, ...). Every child
gets the same thread count in OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS and
NUMBA_NUM_THREADS before it imports numpy or torch (so no threadpoolctl is needed: the pools
are born the right size), and torch.set_num_threads. A row's times are the median over rounds
of each round's median step; the ratio ringpipe / torch is taken round by round (ringpipe's
round n against torch's round n, the pair nearest in time) and reported as its median and its
range. Model FLOP/s uses engine.model.llama.flops_per_token (matmuls only) for every row.
The first step's loss must be within 1 nat of ln(vocab) (a freshly initialised model), or the
script exits 1 after printing.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from _common import (choice_list, measure_steps, median, nonneg_int, output_path, positive_int, rss_bytes,  # noqa: E402
                     table, write_json)
from _common import run_child as common_run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("ringpipe", "torch", "torch-bf16", "ringpipe-bf16")
SHAPES = {        # LlamaConfig fields; "small" is ours, the others are engine/model/llama.py PRESETS
    "small": dict(n_layer=4, d_model=256, n_head=8, n_kv_head=2, d_ff=768, context=2048, vocab=49152,
                  tie_embeddings=True, rope_theta=100000.0),
    "smollm2-135m": "smollm2-135m",
    "qwen3-0.6b": "qwen3-0.6b",
    "hf-tiny": "hf-tiny",
}
QUICK = {"shapes": ["hf-tiny"], "batch": 2, "seq": 32, "steps": 2, "warmup": 1, "rounds": 1}
DEFAULTS = {"shapes": ["small", "smollm2-135m"], "batch": 1, "seq": 256, "steps": 3, "warmup": 1, "rounds": 2}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
LR = 6e-4
LOSS_TOLERANCE = 1.0      # nats around ln(vocab) for the first step's loss
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def shape_config(name):
    """The LlamaConfig of a shape name, validated (its sizes filled in)."""
    from ringpipe.engine.model.llama import PRESETS, LlamaConfig
    fields = SHAPES[name]
    return LlamaConfig(**(PRESETS[fields] if isinstance(fields, str) else fields)).validate()


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (the flags lscpu shows, from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(fh.read().split())
    except OSError:
        return False
    return any(f in flags for f in BF16_FLAGS)


# ---- the children: one framework each, in a fresh process ---------------------------------

def _tokens(spec, vocab):
    import numpy as np
    rng = np.random.default_rng(0)
    shape = (spec["batch"], spec["seq"])
    return rng.integers(0, vocab, size=shape), rng.integers(0, vocab, size=shape)


def _threads(**own):
    return {**own, **{v: os.environ.get(v) for v in THREAD_VARS}}


def child_ringpipe(spec, precision="float32"):
    from ringpipe.engine.job import runtime
    runtime.set_thread_defaults()          # as `ringpipe train` does, before numpy loads BLAS
    runtime.reuse_freed_memory()
    import numba
    import numpy as np
    from ringpipe import kernels as K
    from ringpipe.engine.model.llama import llama_layers
    from ringpipe.engine.model.optim import clip, make_optimizer
    from ringpipe.engine.parallel.local import LocalModel
    from ringpipe.engine.train.config import Config, memory_floor
    import_rss = rss_bytes()

    K.set_matmul_precision(precision)
    cfg = shape_config(spec["shape"])
    dtype = np.dtype(np.float32)
    model = LocalModel(llama_layers(cfg), dtype, seed=1337)
    params = model.params
    opt = make_optimizer("adamw", params.size, dtype, np, params.decay_mask(), 0.1)
    x, y = _tokens(spec, cfg.vocab)
    tokens = x.size

    def step():
        t0 = time.perf_counter()
        params.zero_grad()
        loss = model.forward_backward(x, y, 1.0 / tokens) / tokens
        t1 = time.perf_counter()
        clip(params, model.grad_norm_sq(), 1.0)      # the trainer's own clipping and update
        opt.step(params.data, params.grad, LR)
        return float(loss), t1 - t0, time.perf_counter() - t1

    out = measure_steps(step, spec)
    state = params.data.nbytes + params.grad.nbytes + params.size + opt.m.nbytes + opt.v.nbytes
    floor, _ = memory_floor(Config(model="llama", batch_size=spec["batch"], seq_len=spec["seq"]), cfg, 1)
    out.update(params=int(params.size), vocab_rows=cfg.padded_vocab, loss_vocab=cfg.vocab, import_rss_bytes=import_rss,
               state_bytes=int(state), memory_floor_bytes=int(floor),
               dtype="bf16 matmuls" if precision == "bf16" else "float32",
               **({"bf16_gemm": K.bf16_gemm()} if precision == "bf16" else {"float32_gemm": K.float32_gemm()}),
               threads=_threads(numba=numba.get_num_threads()),
               versions={"numpy": np.__version__})
    return out


def _torch_model(cfg):
    """transformers' model of cfg's shape: LlamaForCausalLM, or Qwen3ForCausalLM for Qwen3's q/k norm."""
    import torch
    import transformers
    common = dict(vocab_size=cfg.padded_vocab, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.context, rms_norm_eps=cfg.rms_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, use_cache=False)
    if cfg.qk_norm == "head":
        hf, model_class = transformers.Qwen3Config(**common, use_sliding_window=False), transformers.Qwen3ForCausalLM
    else:
        hf, model_class = transformers.LlamaConfig(**common, mlp_bias=False), transformers.LlamaForCausalLM
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(hf).to(torch.float32).train()


def child_torch(spec, bf16):
    import contextlib
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    import_rss = rss_bytes()

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])        # 0: torch's own default (a thread per core)
    cfg = shape_config(spec["shape"])
    model = _torch_model(cfg)
    params = list(model.parameters())                 # tied embedding counted once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    xs, ys = _tokens(spec, cfg.vocab)
    x, y = torch.from_numpy(xs), torch.from_numpy(ys)
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with cast():
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.item()), t1 - t0, time.perf_counter() - t1

    out = measure_steps(step, spec)
    state = sum(p.numel() * p.element_size() for p in params)
    state += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    out.update(params=int(sum(p.numel() for p in params)), vocab_rows=cfg.padded_vocab, loss_vocab=cfg.padded_vocab,
               import_rss_bytes=import_rss, state_bytes=int(state), dtype="bf16 autocast" if bf16 else "float32",
               attn_implementation=model.config._attn_implementation, threads=_threads(torch=torch.get_num_threads()),
               versions={"torch": torch.__version__, "transformers": transformers.__version__,
                         "numpy": np.__version__})
    return out


def child_main(framework, spec_json, result_path):
    spec = json.loads(spec_json)
    if framework.startswith("ringpipe"):
        out = child_ringpipe(spec, "bf16" if framework == "ringpipe-bf16" else "float32")
    else:
        out = child_torch(spec, framework == "torch-bf16")
    with open(result_path, "w") as fh:
        json.dump(out, fh)


# ---- the parent: runs the children, prints and writes ---------------------------------------

def run_child(framework, spec):
    return common_run_child(__file__, framework, spec, THREAD_VARS, ROOT, what=f" ({spec['shape']})")


def round_row(framework, r, spec, fpt):
    tokens = spec["batch"] * spec["seq"]
    first, expected = r["losses"][0], math.log(r["loss_vocab"])
    return {"framework": framework, "dtype": r["dtype"], "step_s": r["step_s"], "fwd_bwd_s": r["fwd_bwd_s"],
            "update_s": r["update_s"], "tokens_per_s": tokens / r["step_s"],
            "model_gflops": fpt * tokens / r["step_s"] / 1e9, "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
            "import_rss_gib": r["import_rss_bytes"] / 2**30, "state_gib": r["state_bytes"] / 2**30,
            "memory_floor_gib": r["memory_floor_bytes"] / 2**30 if "memory_floor_bytes" in r else None,
            "loss_first": first, "loss_last": r["losses"][-1], "loss_expected": expected,
            "loss_ok": bool(math.isfinite(first) and abs(first - expected) <= LOSS_TOLERANCE
                            and all(math.isfinite(v) for v in r["losses"])),
            "params": r["params"], "step_times_s": r["step_times_s"], "losses": r["losses"], "threads": r["threads"],
            "versions": r["versions"], **{k: r[k] for k in ("wall_s", "involuntary_switches", "load_before",
                                                            "load_after")}}


MEDIAN_KEYS = ("step_s", "fwd_bwd_s", "update_s", "tokens_per_s", "model_gflops", "peak_rss_gib", "import_rss_gib")


def summary_row(rounds):
    """One framework's row: the median over rounds of each timing and memory figure; the
    other fields (losses, params, state: alike in every round; step_times_s) are round 1's.
    Every round is in the JSON's all_rounds."""
    row = dict(rounds[0])
    row.update({k: median([r[k] for r in rounds]) for k in MEDIAN_KEYS})
    row.update(rounds_step_s=[r["step_s"] for r in rounds], loss_ok=all(r["loss_ok"] for r in rounds))
    return row


def ratios(runs, other):
    """ringpipe / `other`, round by round: {measure: {"median", "min", "max", "rounds"}}; None
    when either framework did not run."""
    if "ringpipe" not in runs or other not in runs:
        return None
    pairs = list(zip(runs["ringpipe"], runs[other]))
    out = {}
    for key in ("tokens_per_s", "peak_rss_gib", "fwd_bwd_s", "update_s"):
        values = [a[key] / b[key] for a, b in pairs]
        out[key] = {"median": median(values), "min": min(values), "max": max(values), "rounds": values}
    return out


COLUMNS = [("framework", "framework", ""), ("dtype", "dtype", ""), ("step_s", "step s", ".3f"),
           ("fwd_bwd_s", "fwd+bwd s", ".3f"), ("update_s", "clip+AdamW s", ".3f"),
           ("tokens_per_s", "tokens/s", ".0f"), ("model_gflops", "model GFLOP/s", ".1f"),
           ("peak_rss_gib", "peak RSS GiB", ".2f"), ("import_rss_gib", "after imports GiB", ".2f"),
           ("state_gib", "params+grads+Adam GiB", ".2f"), ("loss_first", "loss step 1", ".3f")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=choice_list(tuple(SHAPES)), default=None,
                   help=f"comma list (default {','.join(DEFAULTS['shapes'])}; --quick {QUICK['shapes'][0]})")
    for name, kind, what in (("batch", positive_int, "sequences per step"), ("seq", positive_int, "tokens per sequence"),
                             ("steps", positive_int, "timed steps per child"),
                             ("warmup", nonneg_int, "untimed steps first")):
        p.add_argument(f"--{name}", type=kind, default=None,
                       help=f"{what} (default {DEFAULTS[name]}; --quick {QUICK[name]})")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                   help="threads for BLAS/OpenMP/Numba and torch, alike for all (default: every core, %(default)s)")
    p.add_argument("--frameworks", type=choice_list(FRAMEWORKS), default=None,
                   help="comma list, run in this order (default ringpipe,torch, and torch-bf16 where the CPU has "
                        f"{' or '.join(BF16_FLAGS)})")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="fresh children per framework, alternating; rows are medians over rounds "
                        f"(default {DEFAULTS['rounds']}; --quick {QUICK['rounds']})")
    p.add_argument("--quick", action="store_true", help="transformers' tiny test shape (hf-tiny), for tests")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.frameworks is None:
        args.frameworks = list(FRAMEWORKS) if cpu_has_bf16() else ["ringpipe", "torch"]
    args.frameworks = list(dict.fromkeys(args.frameworks))      # each once, in the order given
    args.shapes = list(dict.fromkeys(args.shapes))
    for name in args.shapes:
        context = shape_config(name).context
        if args.seq > context:
            p.error(f"argument --seq: {args.seq} exceeds the context {context} of shape {name}")
    return args


def run_shape(name, args):
    """Every round of every framework on one shape: (summary rows, every round, ratios)."""
    from ringpipe.engine.model.llama import flops_per_token
    cfg = shape_config(name)
    fpt = flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    spec = {"shape": name, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "threads": args.threads}
    print(f"# {name}: {cfg.n_layer} layers x {cfg.d_model}, {cfg.n_head} heads, {cfg.n_kv_head} KV heads, "
          f"intermediate {cfg.d_ff}, vocab {cfg.vocab} -> {cfg.padded_vocab} rows | batch {args.batch} x seq "
          f"{args.seq} = {tokens} tokens/step | {args.threads} thread(s) | median of {args.steps} steps after "
          f"{args.warmup} | {fpt * tokens / 1e9:.1f} GFLOP/step (engine.model.llama.flops_per_token)", flush=True)
    runs = {fw: [] for fw in args.frameworks}
    for n in range(args.rounds):
        for fw in args.frameworks:
            r = dict(round_row(fw, run_child(fw, spec), spec, fpt), round=n + 1, shape=name)
            runs[fw].append(r)
            print(f"# round {n + 1}/{args.rounds} {fw}: median step {r['step_s']:.3f} s, done in {r['wall_s']:.0f} s "
                  f"(load {r['load_before']:.2f} -> {r['load_after']:.2f}, {r['involuntary_switches']} "
                  "involuntary context switches)", flush=True)
    rows = [summary_row(runs[fw]) for fw in args.frameworks]
    print(table(rows, COLUMNS))
    against = {other: ratios(runs, other) for other in args.frameworks if other != "ringpipe"}
    for other, ratio in against.items():
        if ratio:
            t, m = ratio["tokens_per_s"], ratio["peak_rss_gib"]
            print(f"ringpipe / {other}: tokens/s {t['median']:.2f}x (rounds {t['min']:.2f}-{t['max']:.2f}x), "
                  f"peak RSS {m['median']:.2f}x (rounds {m['min']:.2f}-{m['max']:.2f}x)")
    for r in rows:
        print(f"{r['framework']}: first loss {r['loss_first']:.4f}, ln(vocab) = {r['loss_expected']:.4f}: "
              f"{'ok' if r['loss_ok'] else 'NOT within %.1f nat' % LOSS_TOLERANCE}")
    return {"shape": name, "config": cfg.to_dict(), "padded_vocab": cfg.padded_vocab, "flops_per_token": fpt,
            "tokens_per_step": tokens, "rows": rows, "all_rounds": [r for fw in runs for r in runs[fw]],
            "ratio_ringpipe_over": against}


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    results = [run_shape(name, args) for name in args.shapes]
    if args.json:
        write_json(args.json, {"benchmark": "llama_step", "quick": args.quick, "batch": args.batch, "seq": args.seq,
                               "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
                               "threads": args.threads, "lr": LR, "cpu_bf16": cpu_has_bf16(),
                               "frameworks": args.frameworks, "shapes": results})
    return 1 if any(not r["loss_ok"] for s in results for r in s["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
