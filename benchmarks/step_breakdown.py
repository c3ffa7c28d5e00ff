"""Where a small GPT training step's time goes, ringpipe next to PyTorch eager on the same
shapes: the GEMMs, and everything else (fused kernels, elementwise ops, Python, allocation),
forward + backward and the update (clip + AdamW) apart.

    python benchmarks/step_breakdown.py [--vocab 256] [--threads 1] [--steps 10] [--rounds 3] [--json PATH]
    python benchmarks/step_breakdown.py --quick

The model is benchmarks/gpt2_step.py's (small: 4 layers x 256, 8 heads; batch 16 x 128 tokens,
the issue's shape), each framework in a fresh child process, alternating rounds. In a child:
  * the step is timed plainly (median over --steps): the total;
  * then timed again with every GEMM timed:
      ringpipe: every call into the GEMM libraries (kernels/onednn.py's gemm, the BLAS through
        kernels/reference.py's matmul), by wrapping those two functions;
      torch: the self time of aten::mm, addmm, bmm, baddbmm under torch.autograd.profiler
        (attention in transformers' eager implementation, so its two products are GEMMs there
        too, as in ringpipe; sdpa would hide them inside one fused op);
  * "the rest" is the plain total minus the GEMMs: what the framework itself costs around them.
The claim is the rest's ratio ringpipe / torch: a hand-written engine's own overhead must be
smaller than PyTorch's. Medians over rounds; the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _common import median, nonneg_int, output_path, positive_int, table, write_json  # noqa: E402
from _common import run_child as common_run_child  # noqa: E402

import gpt2_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("ringpipe", "torch")
SHAPE = [4, 256, 8, 256]
QUICK_SHAPE = [2, 64, 2, 64]
TORCH_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _timed_steps(step, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times)


def child_ringpipe(spec):
    from ringpipe.engine.job import runtime
    runtime.set_thread_defaults()
    runtime.reuse_freed_memory()
    import numpy as np
    from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
    from ringpipe.engine.model.optim import clip, make_optimizer
    from ringpipe.engine.parallel.local import LocalModel
    from ringpipe.kernels import onednn, reference
    from ringpipe import kernels as K

    K.set_matmul_precision(spec["precision"])
    n_layer, d_model, n_head, context = spec["shape"]
    cfg = GPTConfig(n_layer=n_layer, d_model=d_model, n_head=n_head, context=context, vocab=spec["vocab"])
    model = LocalModel(gpt_layers(cfg), np.dtype(np.float32), seed=1337)
    params = model.params
    opt = make_optimizer("adamw", params.size, np.dtype(np.float32), np, params.decay_mask(), 0.1)
    rng = np.random.default_rng(0)
    x = rng.integers(0, spec["vocab"], (spec["batch"], spec["seq"]))
    y = rng.integers(0, spec["vocab"], (spec["batch"], spec["seq"]))
    spent = {"gemm": 0.0}

    def fwd_bwd():
        params.zero_grad()
        model.forward_backward(x, y, 1.0 / x.size)

    def update():
        clip(params, model.grad_norm_sq(), 1.0)
        opt.step(params.data, params.grad, 6e-4)

    def timing(fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["gemm"] += time.perf_counter() - t0
        return wrapped

    for _ in range(spec["warmup"]):
        fwd_bwd()
        update()
    out = {"fwd_bwd_s": _timed_steps(fwd_bwd, spec["steps"]), "update_s": _timed_steps(update, spec["steps"])}
    plain = (onednn.gemm, reference.matmul)
    onednn.gemm, reference.matmul = timing(onednn.gemm), timing(reference.matmul)
    try:
        for _ in range(spec["steps"]):
            fwd_bwd()
    finally:
        onednn.gemm, reference.matmul = plain
    out["gemm_s"] = spent["gemm"] / spec["steps"]
    out["gemm_library"] = K.bf16_gemm() if spec["precision"] == "bf16" else K.float32_gemm()
    return out


def child_torch(spec):
    import contextlib
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    n_layer, d_model, n_head, context = spec["shape"]
    rows = -(-spec["vocab"] // 128) * 128
    config = GPT2Config(vocab_size=rows, n_positions=context, n_embd=d_model, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, layer_norm_epsilon=1e-5,
                        activation_function="gelu_new", tie_word_embeddings=True,
                        bos_token_id=min(50256, rows - 1), eos_token_id=min(50256, rows - 1))
    config._attn_implementation = "eager"        # attention's products as GEMMs, as in ringpipe
    model = GPT2LMHeadModel(config).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    y = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    cast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if spec["precision"] == "bf16" \
        else contextlib.nullcontext

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        with cast():
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
        loss.backward()

    def update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    for _ in range(spec["warmup"]):
        fwd_bwd()
        update()
    out = {"fwd_bwd_s": _timed_steps(fwd_bwd, spec["steps"]), "update_s": _timed_steps(update, spec["steps"])}
    with torch.autograd.profiler.profile() as prof:
        for _ in range(spec["steps"]):
            fwd_bwd()
    gemm_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in TORCH_GEMMS)
    out["gemm_s"] = gemm_us / 1e6 / spec["steps"]
    out["gemm_library"] = f"torch {torch.__version__} ({'oneDNN bf16' if spec['precision'] == 'bf16' else 'MKL'})"
    return out


def child_main(framework, spec_json, result_path):
    spec = json.loads(spec_json)
    out = child_ringpipe(spec) if framework == "ringpipe" else child_torch(spec)
    with open(result_path, "w") as fh:
        json.dump(out, fh)


COLUMNS = [("framework", "framework", ""), ("precision", "precision", ""), ("fwd_bwd_ms", "fwd+bwd ms", ".1f"),
           ("gemm_ms", "GEMMs ms", ".1f"), ("rest_ms", "the rest ms", ".1f"), ("rest_share", "rest of fwd+bwd", ".0%"),
           ("update_ms", "clip+AdamW ms", ".1f"), ("gemm_library", "GEMM", "")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=positive_int, default=256, help="vocabulary (default 256)")
    p.add_argument("--threads", type=nonneg_int, default=1, help="threads for both (default 1; 0: each one's default)")
    p.add_argument("--precision", choices=("float32", "bf16"), default="float32")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per child (default 10)")
    p.add_argument("--rounds", type=positive_int, default=3, help="children per framework, alternating (default 3)")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, one round (for tests)")
    p.add_argument("--json", type=output_path, default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    spec = {"shape": QUICK_SHAPE if args.quick else SHAPE, "vocab": args.vocab, "batch": 2 if args.quick else 16,
            "seq": 32 if args.quick else 128, "steps": 2 if args.quick else args.steps, "warmup": 1 if args.quick else 3,
            "threads": args.threads, "precision": args.precision}
    rounds = 1 if args.quick else args.rounds
    print(f"# step breakdown | GPT {spec['shape'][0]} x {spec['shape'][1]}, vocab {args.vocab}, batch {spec['batch']} x "
          f"{spec['seq']} | {args.precision} | {args.threads or 'default'} thread(s) | {rounds} round(s)", flush=True)
    runs = {fw: [] for fw in FRAMEWORKS}
    for n in range(rounds):
        for fw in FRAMEWORKS:
            runs[fw].append(common_run_child(__file__, fw, spec, gpt2_step.THREAD_VARS, ROOT))
            r = runs[fw][-1]
            print(f"# round {n + 1}/{rounds} {fw}: fwd+bwd {r['fwd_bwd_s'] * 1e3:.1f} ms, GEMMs {r['gemm_s'] * 1e3:.1f} ms",
                  flush=True)
    rows = []
    for fw, rs in runs.items():
        fb, gemm = median([r["fwd_bwd_s"] for r in rs]), median([r["gemm_s"] for r in rs])
        rows.append({"framework": fw, "precision": args.precision, "fwd_bwd_ms": fb * 1e3, "gemm_ms": gemm * 1e3,
                     "rest_ms": (fb - gemm) * 1e3, "rest_share": (fb - gemm) / fb,
                     "update_ms": median([r["update_s"] for r in rs]) * 1e3, "gemm_library": rs[0]["gemm_library"]})
    print(table(rows, COLUMNS))
    a, b = rows
    rest = [(x["fwd_bwd_s"] - x["gemm_s"]) / (y["fwd_bwd_s"] - y["gemm_s"]) for x, y in zip(runs["ringpipe"], runs["torch"])]
    print(f"ringpipe / torch: the rest of fwd+bwd {median(rest):.2f}x (rounds {min(rest):.2f}-{max(rest):.2f}x), "
          f"GEMMs {a['gemm_ms'] / b['gemm_ms']:.2f}x, clip+AdamW {a['update_ms'] / b['update_ms']:.2f}x")
    if args.json:
        write_json(args.json, {"benchmark": "step_breakdown", "spec": spec, "rounds": rounds, "rows": rows,
                               "rest_ratio_rounds": rest, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
