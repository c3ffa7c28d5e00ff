"""GPT-2 124M training step on this CPU: ringpipe next to PyTorch eager, same shapes, same run.

    python benchmarks/gpt2_step.py [--batch 1 --seq 1024 --steps 5 --warmup 2 --rounds 2 --threads N] [--json PATH]
    python benchmarks/gpt2_step.py --quick          # 2 layers x 64, a few seconds per framework
    python benchmarks/gpt2_step.py --frameworks ringpipe,ringpipe-bf16,torch-bf16 [--shape small]

One training step = forward + loss + backward + global-norm clip (1.0) + AdamW update
(betas 0.9/0.95, weight decay 0.1 on the matrices only, constant lr), float32, on one
fixed batch of random GPT-2 token ids (batch x seq).
  * ringpipe: the trainer's own pieces (engine.parallel.local.LocalModel over
    engine.model.gpt.gpt_layers, engine.model.optim.make_optimizer("adamw"), optim.clip), with the
    trainer's process settings (runtime.set_thread_defaults, reuse_freed_memory);
    vocabulary 50257 padded to 50304 rows, the padding's logits masked.
  * ringpipe-bf16: the same with kernels.set_matmul_precision("bf16") (the trainer's --precision
    bf16: bf16 GEMMs, float32 sums, master weights and AdamW; kernels.bf16_gemm() says which GEMM).
  * ringpipe-bf16-selective: ringpipe-bf16 with the trainer's --recompute selective (attention's
    probabilities computed again in the backward instead of kept: what PyTorch's SDPA does).
  * torch-bf16: the PyTorch model below in float32 with torch.autocast("cpu", torch.bfloat16)
    around forward and loss (the loss on float32 logits), what a PyTorch user on a bf16 CPU runs.
  * --shape small: 4 layers x 256, 8 heads, context 256, GPT-2's vocabulary (a small GPT).
  * PyTorch: transformers.GPT2LMHeadModel of the same shape (n_positions = the preset's
    context, dropout 0, vocab_size 50304 = ringpipe's padded rows, so every GEMM has the
    same shape; the 47 extra logits are not masked, which moves the loss at init by
    ln(50304/50257) = 0.001), F.cross_entropy, torch.optim.AdamW (its default
    implementation), clip_grad_norm_; attention --torch-attn (sdpa, transformers' default).
Each framework runs in a fresh subprocess, one after the other, so its peak memory is its
own: peak RSS is the child's ru_maxrss (from wait4), next to the RSS after the imports
and, for both, the bytes of parameters + gradients + AdamW moments; for ringpipe also the
trainer's own lower bound (engine.train.config.memory_floor, what it refuses runs with).
Both children get the same thread count: OMP_NUM_THREADS, OPENBLAS_NUM_THREADS,
MKL_NUM_THREADS, NUMBA_NUM_THREADS = --threads, and torch.set_num_threads(--threads).
Model FLOP/s uses engine.model.gpt.flops_per_token (matmuls only, 3x forward, the full T x T
attention product) for both; next to it each child's own float32 GEMM peak (square 1024:
numpy's BLAS for ringpipe, torch.mm for PyTorch, different libraries) and the step's
fraction of it, which separates "whose BLAS is faster" from "who uses it better".
Step times are medians over --steps after --warmup; the claim is the ratio ringpipe /
torch of the same run. On a shared machine --rounds N alternates N fresh children per
framework and keeps each one's fastest round (each child also records the load average
around it and its involuntary context switches). The first step's loss must be within
1 nat of ln(vocab) (a freshly initialised model), or the script exits 1 after printing.
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
FRAMEWORKS = ("ringpipe", "torch", "ringpipe-bf16", "torch-bf16", "ringpipe-bf16-selective")
GPT2_VOCAB = 50257
PRESET = "gpt2-124m"                 # engine/model/gpt.py PRESETS: (n_layer, d_model, n_head, context)
SMALL_SHAPE = (4, 256, 8, 256)       # --shape small
QUICK_SHAPE = (2, 64, 2, 64)
QUICK = {"batch": 2, "seq": 64, "steps": 3, "warmup": 1, "rounds": 1}
DEFAULTS = {"batch": 1, "seq": 1024, "steps": 5, "warmup": 2, "rounds": 2}
LR = 6e-4
LOSS_TOLERANCE = 1.0      # nats around ln(vocab) for the first step's loss
GEMM_N = 1024            # the square float32 GEMM each child times with its own BLAS
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


# ---- the children: one framework each, in a fresh process ---------------------------------

def _peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # KiB on Linux


def _tokens(spec):
    import numpy as np
    rng = np.random.default_rng(0)
    shape = (spec["batch"], spec["seq"])
    vocab = spec.get("vocab", GPT2_VOCAB)
    return rng.integers(0, vocab, size=shape), rng.integers(0, vocab, size=shape)


def _gemm_peak(matmul, make, n=GEMM_N, repeats=5):
    """FLOP/s of this framework's own float32 GEMM (square n), median of repeats after one
    call: what its step could reach if it were all GEMM, measured in the same process."""
    a, b = make(n, 0), make(n, 1)
    matmul(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / median(times)


def _blas_threads():
    """OpenBLAS's thread count as numpy's BLAS reports it (None where it cannot be asked)."""
    import ctypes
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "openblas" in line.split()[-1].lower()}
    except OSError:
        return None
    for path in sorted(libs):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    return None


def child_ringpipe(spec, precision="float32", recompute="auto"):
    from ringpipe.engine.job import runtime
    runtime.set_thread_defaults()          # as `ringpipe train` does, before numpy loads BLAS
    runtime.reuse_freed_memory()
    import numpy as np
    from ringpipe import kernels as K
    from ringpipe.engine.train.config import Config, memory_floor
    from ringpipe.engine.train.memory import recompute_of
    from ringpipe.engine.model.gpt import GPTConfig, flops_per_token, gpt_layers
    from ringpipe.engine.model.optim import clip, make_optimizer
    from ringpipe.engine.parallel.local import LocalModel
    import_rss = rss_bytes()

    K.set_matmul_precision(precision)
    n_layer, d_model, n_head, context = spec["shape"]
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, context=context,
                    vocab=spec.get("vocab", GPT2_VOCAB))
    dtype = np.dtype(np.float32)
    model = LocalModel(gpt_layers(cfg), dtype, seed=1337)
    # The trainer's --recompute: auto (its default) is selective where attention's probabilities
    # would be a third of a block's activations (GPT-2 124M at T 1024), else none.
    x, y = _tokens(spec)
    recompute = recompute_of(Config(recompute=recompute), cfg, x.shape[1])
    model.chain.set_recompute(recompute)
    params = model.params
    opt = make_optimizer("adamw", params.size, dtype, np, params.decay_mask(), 0.1)
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
    out["gemm_flops"] = _gemm_peak(np.matmul, lambda n, seed: np.random.default_rng(seed).standard_normal(
        (n, n)).astype(np.float32))
    state = params.data.nbytes + params.grad.nbytes + params.size + opt.m.nbytes + opt.v.nbytes
    floor, floor_what = memory_floor(Config(model="gpt", batch_size=spec["batch"], seq_len=spec["seq"],
                                            recompute=recompute), cfg, 1)
    out.update(params=int(params.size), recompute=recompute, vocab_rows=cfg.padded_vocab, loss_vocab=cfg.vocab,
               flops_per_token=flops_per_token(cfg, spec["seq"]), import_rss_bytes=import_rss,
               dtype="bf16 matmuls" if precision == "bf16" else "float32",
               **({"bf16_gemm": K.bf16_gemm()} if precision == "bf16" else {"float32_gemm": K.float32_gemm()}),
               state_bytes=int(state), memory_floor_bytes=int(floor), memory_floor_what=floor_what,
               threads={"blas": _blas_threads(), **{v: os.environ.get(v) for v in THREAD_VARS},
                        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
               versions={"numpy": np.__version__})
    return out


def child_torch(spec, bf16=False):
    import contextlib
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    import_rss = rss_bytes()

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])        # 0: torch's own default (a thread per core)
    torch.manual_seed(0)
    n_layer, d_model, n_head, context = spec["shape"]
    vocab_rows = -(-spec.get("vocab", GPT2_VOCAB) // 128) * 128    # ringpipe's padded rows (GPTConfig.padded_vocab)
    config = GPT2Config(vocab_size=vocab_rows, n_positions=context, n_embd=d_model, n_layer=n_layer,
                        n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        layer_norm_epsilon=1e-5, activation_function="gelu_new", tie_word_embeddings=True,
                        bos_token_id=min(50256, vocab_rows - 1), eos_token_id=min(50256, vocab_rows - 1))
    config._attn_implementation = spec["torch_attn"]
    model = GPT2LMHeadModel(config).to(torch.float32)
    model.train()
    params = list(model.parameters())                 # tied wte counted once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    xs, ys = _tokens(spec)
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
    with torch.no_grad():
        out["gemm_flops"] = _gemm_peak(torch.mm, lambda n, seed: torch.randn(
            n, n, generator=torch.Generator().manual_seed(seed)))
    state = sum(p.numel() * p.element_size() for p in params)
    state += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0)
    out.update(params=int(sum(p.numel() for p in params)), vocab_rows=vocab_rows, loss_vocab=vocab_rows,
               import_rss_bytes=import_rss, state_bytes=int(state), attn_implementation=model.config._attn_implementation,
               dtype="bf16 autocast" if bf16 else "float32",
               threads={"torch": torch.get_num_threads(), **{v: os.environ.get(v) for v in THREAD_VARS},
                        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
               versions={"torch": torch.__version__, "transformers": transformers.__version__,
                         "numpy": np.__version__})
    return out


def child_main(framework, spec_json, result_path):
    spec = json.loads(spec_json)
    if framework.startswith("ringpipe"):
        out = child_ringpipe(spec, "bf16" if framework.startswith("ringpipe-bf16") else "float32",
                             "selective" if framework.endswith("-selective") else "auto")
    else:
        out = child_torch(spec, bf16=framework == "torch-bf16")
    out["peak_rss_self_bytes"] = _peak_rss_bytes()
    with open(result_path, "w") as fh:
        json.dump(out, fh)


# ---- the parent: runs the children, prints and writes ---------------------------------------

def run_child(framework, spec):
    return common_run_child(__file__, framework, spec, THREAD_VARS, ROOT)


def row(framework, r, spec, fpt):
    tokens = spec["batch"] * spec["seq"]
    first = r["losses"][0]
    expected = math.log(r["loss_vocab"])
    return {"framework": framework, "dtype": r["dtype"], "step_s": r["step_s"], "fwd_bwd_s": r["fwd_bwd_s"], "update_s": r["update_s"],
            "tokens_per_s": tokens / r["step_s"], "model_tflops": fpt * tokens / r["step_s"] / 1e12,
            "gemm_gflops": r["gemm_flops"] / 1e9, "fraction_of_gemm": fpt * tokens / r["step_s"] / r["gemm_flops"],
            "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "import_rss_gib": r["import_rss_bytes"] / 2**30,
            "state_gib": r["state_bytes"] / 2**30,
            "memory_floor_gib": r["memory_floor_bytes"] / 2**30 if "memory_floor_bytes" in r else None,
            "loss_first": first, "loss_last": r["losses"][-1], "loss_expected": expected,
            "loss_ok": bool(math.isfinite(first) and abs(first - expected) <= LOSS_TOLERANCE
                            and all(math.isfinite(v) for v in r["losses"])),
            "params": r["params"], "first_step_s": r["first_step_s"], "step_times_s": r["step_times_s"],
            "losses": r["losses"], "threads": r["threads"], "versions": r["versions"],
            **{k: r[k] for k in ("wall_s", "cpu_s", "involuntary_switches", "load_before", "load_after")},
            **({"attn_implementation": r["attn_implementation"]} if "attn_implementation" in r else {}),
            **({"bf16_gemm": r["bf16_gemm"]} if "bf16_gemm" in r else {}),
            **({"float32_gemm": r["float32_gemm"]} if "float32_gemm" in r else {})}


COLUMNS = [("framework", "framework", ""), ("dtype", "dtype", ""), ("step_s", "step s", ".3f"), ("fwd_bwd_s", "fwd+bwd s", ".3f"),
           ("update_s", "clip+AdamW s", ".3f"), ("tokens_per_s", "tokens/s", ".0f"),
           ("model_tflops", "model TFLOP/s", ".4f"), ("gemm_gflops", "own GEMM GFLOP/s", ".1f"),
           ("fraction_of_gemm", "of GEMM", ".1%"), ("peak_rss_gib", "peak RSS GiB", ".2f"),
           ("import_rss_gib", "after imports GiB", ".2f"), ("state_gib", "params+grads+Adam GiB", ".2f"),
           ("loss_first", "loss step 1", ".3f"), ("loss_last", "loss last", ".3f")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=positive_int, default=None,
                   help=f"sequences per step (default {DEFAULTS['batch']}; --quick {QUICK['batch']})")
    p.add_argument("--seq", type=positive_int, default=None,
                   help=f"tokens per sequence, at most the context (default {DEFAULTS['seq']}; --quick {QUICK['seq']})")
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"timed steps per framework (default {DEFAULTS['steps']}; --quick {QUICK['steps']})")
    p.add_argument("--warmup", type=nonneg_int, default=None,
                   help=f"untimed steps first (default {DEFAULTS['warmup']}; --quick {QUICK['warmup']})")
    p.add_argument("--threads", type=nonneg_int, default=os.cpu_count() or 1,
                   help="threads for BLAS/OpenMP/Numba and torch, alike for both (default: every core, %(default)s); "
                        "0: each framework's own default (ringpipe's choice from the cores and the node's load, "
                        "torch's thread per core)")
    p.add_argument("--vocab", type=positive_int, default=GPT2_VOCAB,
                   help=f"vocabulary (default GPT-2's, {GPT2_VOCAB}; the issue's small GPT also runs 256)")
    p.add_argument("--frameworks", type=choice_list(FRAMEWORKS), default=["ringpipe", "torch"],
                   help="comma list, run in this order (default ringpipe,torch; ringpipe-bf16 and torch-bf16: "
                        "bf16 matmuls and torch's bf16 autocast)")
    p.add_argument("--shape", choices=(PRESET, "small"), default=PRESET,
                   help=f"{PRESET} (default) or small: {SMALL_SHAPE[0]} layers x {SMALL_SHAPE[1]}, "
                        f"{SMALL_SHAPE[2]} heads, context {SMALL_SHAPE[3]}")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="fresh children per framework, alternating (ringpipe, torch, ringpipe, ...); each row is "
                        f"its fastest round, for a shared machine (default {DEFAULTS['rounds']}; --quick {QUICK['rounds']})")
    p.add_argument("--torch-attn", choices=("sdpa", "eager"), default="sdpa",
                   help="transformers' attention implementation (default sdpa, its own default)")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny GPT ({QUICK_SHAPE[0]} layers x {QUICK_SHAPE[1]}, GPT-2's vocabulary) for tests")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.frameworks = list(dict.fromkeys(args.frameworks))      # each once, in the order given
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from ringpipe.engine.model.gpt import PRESETS       # not in the children: they import what they measure
    args.shape_name = "quick" if args.quick else args.shape
    args.shape = QUICK_SHAPE if args.quick else SMALL_SHAPE if args.shape == "small" else PRESETS[PRESET]
    if args.seq > args.shape[3]:
        p.error(f"argument --seq: {args.seq} exceeds the model's context {args.shape[3]}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    spec = {"shape": list(args.shape), "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup, "threads": args.threads, "torch_attn": args.torch_attn, "vocab": args.vocab}
    from ringpipe.engine.model.gpt import GPTConfig, flops_per_token
    n_layer, d_model, n_head, context = args.shape
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, context=context, vocab=args.vocab)
    fpt = flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    name = args.shape_name
    print(f"# GPT-2 train step ({name}: {n_layer} layers x {d_model}, {n_head} heads, context {context}, vocab "
          f"{args.vocab} -> {cfg.padded_vocab} rows) | batch {args.batch} x seq {args.seq} = {tokens} tokens/step | "
          f"{', '.join(args.frameworks)} | {args.threads} thread(s) | median of {args.steps} steps after {args.warmup} | "
          f"{fpt * tokens / 1e12:.3f} TFLOP/step (engine.model.gpt.flops_per_token)", flush=True)
    runs = {fw: [] for fw in args.frameworks}
    for n in range(args.rounds):
        for fw in args.frameworks:
            r = row(fw, run_child(fw, spec), spec, fpt)
            r["round"] = n + 1
            runs[fw].append(r)
            print(f"# round {n + 1}/{args.rounds} {fw}: median step {r['step_s']:.3f} s, done in {r['wall_s']:.0f} s "
                  f"(first step {r['first_step_s']:.2f} s; load {r['load_before']:.2f} -> {r['load_after']:.2f}, "
                  f"{r['involuntary_switches']} involuntary context switches)", flush=True)
    # Each framework's row: its least disturbed round (the fastest median step); every round is in the JSON.
    rows = [dict(min(runs[fw], key=lambda r: r["step_s"]), rounds_step_s=[r["step_s"] for r in runs[fw]])
            for fw in args.frameworks]
    print(table(rows, COLUMNS))
    ratio = None
    by = {r["framework"]: r for r in rows}
    if "ringpipe" in by and "torch" in by:
        a, b = by["ringpipe"], by["torch"]
        ratio = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"], "peak_rss": a["peak_rss_gib"] / b["peak_rss_gib"],
                 "peak_rss_minus_imports": (a["peak_rss_gib"] - a["import_rss_gib"])
                 / (b["peak_rss_gib"] - b["import_rss_gib"]),
                 "fwd_bwd_s": a["fwd_bwd_s"] / b["fwd_bwd_s"], "update_s": a["update_s"] / b["update_s"],
                 "gemm_flops": a["gemm_gflops"] / b["gemm_gflops"]}
        print(f"ringpipe / torch: tokens/s {ratio['tokens_per_s']:.2f}x, peak RSS {ratio['peak_rss']:.2f}x "
              f"({ratio['peak_rss_minus_imports']:.2f}x above the imports), fwd+bwd time "
              f"{ratio['fwd_bwd_s']:.2f}x, clip+AdamW time {ratio['update_s']:.2f}x; own GEMM peak "
              f"{ratio['gemm_flops']:.2f}x")
    # bf16: ringpipe's against torch's autocast and against its own float32, each round alike
    pairs = [(a, b) for a, b in (("ringpipe-bf16", "torch-bf16"), ("ringpipe-bf16", "ringpipe"),
                                 ("torch-bf16", "torch")) if a in by and b in by]
    bf16_ratios = {}
    for a, b in pairs:
        per_round = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b])]
        bf16_ratios[f"{a}/{b}"] = {"tokens_per_s": by[a]["tokens_per_s"] / by[b]["tokens_per_s"],
                                   "tokens_per_s_rounds": per_round,
                                   "peak_rss": by[a]["peak_rss_gib"] / by[b]["peak_rss_gib"]}
        print(f"{a} / {b}: tokens/s {bf16_ratios[f'{a}/{b}']['tokens_per_s']:.2f}x (round by round "
              f"{', '.join(f'{v:.2f}' for v in per_round)}x), peak RSS {bf16_ratios[f'{a}/{b}']['peak_rss']:.2f}x "
              f"({by[a]['peak_rss_gib']:.2f} vs {by[b]['peak_rss_gib']:.2f} GiB)")
    if "ringpipe-bf16" in by:
        print(f"ringpipe-bf16: {by['ringpipe-bf16']['bf16_gemm']}")
    if "ringpipe" in by:
        r = by["ringpipe"]
        print(f"ringpipe's own lower bound (engine.train.config.memory_floor): {r['memory_floor_gib']:.2f} GiB "
              f"vs {r['peak_rss_gib'] - r['import_rss_gib']:.2f} GiB measured above the imports")
    if "torch" in by:
        print(f"torch: attention {by['torch'].get('attn_implementation')}, {by['torch']['threads']['torch']} "
              f"thread(s); vocab_size {cfg.padded_vocab} (unmasked)")
    bad = [r["framework"] for r in rows if not r["loss_ok"]]
    for r in rows:
        print(f"{r['framework']}: first loss {r['loss_first']:.4f}, ln(vocab) = {r['loss_expected']:.4f}: "
              f"{'ok' if r['loss_ok'] else 'NOT within %.1f nat' % LOSS_TOLERANCE}")
    if args.json:
        write_json(args.json, {"benchmark": "gpt2_step", "preset": name, "config": cfg.to_dict(),
                               "padded_vocab": cfg.padded_vocab, "batch": args.batch, "seq": args.seq,
                               "tokens_per_step": tokens, "steps": args.steps, "warmup": args.warmup,
                               "threads": args.threads, "dtype": "float32", "lr": LR,
                               "flops_per_token": fpt, "torch_attn": args.torch_attn,
                               "rounds": args.rounds, "rows": rows, "all_rounds": [r for fw in runs for r in runs[fw]],
                               "ratio_ringpipe_over_torch": ratio, "bf16_ratios": bf16_ratios,
                               "frameworks": args.frameworks})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
