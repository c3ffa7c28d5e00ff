"""Training-step throughput of the GPT on one process, next to numpy BLAS's GEMM peak.

    python benchmarks/train_throughput.py [--layers 4 --d-model 512 --heads 8 --seq-len 256 --batch-size 8]

Measures, in the same run:
  * the practical peak: GEMM FLOP/s that numpy's BLAS reaches on this machine
    (square float32 matmul at --peak-n, median of repeats);
  * a full training step (forward + backward + AdamW): tokens/s and model FLOP/s
    (matmul FLOPs only, see engine.model.gpt.flops_per_token), and its fraction of the peak;
  * where the time goes: a per-op table (GEMM vs each fused kernel vs the rest)
    and a per-layer table (forward, backward), from instrumented steps.
Medians over --repeats steps after --warmup; no single absolute time is a claim,
the ratio to the same-run peak is. --json PATH writes everything.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict


from ringpipe.engine.job import runtime  # noqa: E402

runtime.set_thread_defaults()       # as ringpipe train does, before numpy loads BLAS
runtime.reuse_freed_memory()

import numpy as np  # noqa: E402

from ringpipe import kernels as K  # noqa: E402
from ringpipe.engine.model.gpt import GPTConfig, build_gpt, flops_per_token  # noqa: E402
from ringpipe.kernels.ops import OP_NAMES  # noqa: E402
from ringpipe.engine.model.optim import AdamW  # noqa: E402
from ringpipe.engine.parallel.pipeline.partition import time_layers  # noqa: E402


def gemm_peak(n, dtype, repeats):
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    b = np.random.default_rng(1).standard_normal((n, n)).astype(dtype)
    out = np.empty((n, n), dtype)
    np.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t)
    return 2.0 * n ** 3 / float(np.median(times))


class OpTimer:
    """Wraps the kernels API functions that the layers call to attribute time per op."""

    # Every op of the kernel table, and the two GEMM layouts the layers call (matmul underneath).
    OPS = list(OP_NAMES) + ["matmul_nt", "matmul_tn"]

    def __init__(self):
        self.totals = defaultdict(float)
        self._orig = {}
        self._depth = 0      # matmul_nt calls matmul: count only the outermost call

    def __enter__(self):
        for name in self.OPS:
            fn = getattr(K, name)
            self._orig[name] = fn

            def timed(*a, __fn=fn, __name=name, **kw):
                self._depth += 1
                t = time.perf_counter()
                try:
                    return __fn(*a, **kw)
                finally:
                    self._depth -= 1
                    if self._depth == 0:
                        self.totals[__name] += time.perf_counter() - t
            setattr(K, name, timed)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(K, name, fn)


def train_step(model, opt, x, y, grad_scale):
    model.params.zero_grad()
    model.loss_and_grad(x, y, grad_scale)
    opt.step(model.params.data, model.params.grad, 1e-4)


def layer_profile(model, x, y, repeats):
    names = [type(l).__name__ + (f" {getattr(l, 'name', '')}" if hasattr(l, "name") else "") for l in model.layers]
    fwd, bwd = time_layers(model.layers, x, y, repeats)
    return list(zip(names, fwd, bwd))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-n", type=int, default=1024, help="size of the square GEMM for the BLAS peak")
    p.add_argument("--json", default=None, help="write results here")
    args = p.parse_args()
    dtype = np.dtype(args.dtype)

    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, context=args.seq_len)
    model = build_gpt(cfg, dtype=dtype)
    opt = AdamW(model.params.size, dtype, np, wd_mask=model.params.decay_mask())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(args.batch_size, args.seq_len))
    y = rng.integers(0, 256, size=(args.batch_size, args.seq_len))
    tokens = args.batch_size * args.seq_len
    scale = 1.0 / tokens
    fpt = flops_per_token(cfg, args.seq_len)

    for _ in range(args.warmup):
        train_step(model, opt, x, y, scale)
    # Interleave peak and step measurements so machine noise hits both alike.
    peaks, steps = [], []
    for _ in range(args.repeats):
        peaks.append(gemm_peak(args.peak_n, dtype, 3))
        t = time.perf_counter()
        train_step(model, opt, x, y, scale)
        steps.append(time.perf_counter() - t)
    peak = float(np.median(peaks))
    step_s = float(np.median(steps))
    achieved = fpt * tokens / step_s

    # Shares are of the instrumented steps' own time: dividing by the plain steps'
    # median (another loop, other noise) could leave "other" negative and hide it.
    t = time.perf_counter()
    with OpTimer() as timer:
        for _ in range(args.repeats):
            train_step(model, opt, x, y, scale)
    step_instr = (time.perf_counter() - t) / args.repeats
    op_rows = sorted(((k, v / args.repeats) for k, v in timer.totals.items()), key=lambda r: -r[1])
    accounted = sum(v for _, v in op_rows)
    layers = layer_profile(model, x, y, max(3, args.repeats // 2))

    print(f"# GPT {cfg.to_dict()} | batch {args.batch_size} x seq {args.seq_len} = {tokens} tokens/step | "
          f"{model.params.size:,} params | {args.dtype} | BLAS threads: {os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    print(f"{'metric':<34}{'value':>16}")
    print(f"{'BLAS GEMM peak (n=%d)' % args.peak_n:<34}{peak / 1e9:>12.1f} GFLOP/s")
    print(f"{'train step (median)':<34}{step_s * 1e3:>13.1f} ms")
    print(f"{'tokens/s':<34}{tokens / step_s:>16.0f}")
    print(f"{'model FLOP/s':<34}{achieved / 1e9:>12.1f} GFLOP/s")
    print(f"{'fraction of BLAS peak':<34}{achieved / peak:>15.1%}")
    print(f"\n# where a step's time goes (per op, instrumented: mean of {args.repeats} steps, "
          f"{step_instr * 1e3:.1f} ms/step)")
    print(f"{'op':<34}{'ms/step':>10}{'share':>9}")
    for name, v in op_rows:
        print(f"{name:<34}{v * 1e3:>10.2f}{v / step_instr:>9.1%}")
    rest = max(0.0, step_instr - accounted)
    print(f"{'other (numpy elementwise, python)':<34}{rest * 1e3:>10.2f}{rest / step_instr:>9.1%}")
    print("\n# per layer (median ms)")
    print(f"{'layer':<34}{'forward':>10}{'backward':>10}")
    for name, f, b in layers:
        print(f"{name:<34}{f * 1e3:>10.2f}{b * 1e3:>10.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"config": cfg.to_dict(), "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "dtype": args.dtype, "gemm_peak_flops": peak, "step_s": step_s,
                       "tokens_per_s": tokens / step_s, "model_flops_per_s": achieved,
                       "fraction_of_peak": achieved / peak, "ops_s_per_step": dict(op_rows),
                       "instrumented_step_s": step_instr, "other_s_per_step": rest,
                       "layers_ms": [{"layer": n, "forward_ms": f * 1e3, "backward_ms": b * 1e3}
                                     for n, f, b in layers]}, fh, indent=1)


if __name__ == "__main__":
    main()
