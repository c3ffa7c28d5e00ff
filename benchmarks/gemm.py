"""
GPU benchmark: the hand-written GEMMs against cuBLAS, and the fused kernels' memory
bandwidth against the device's copy bandwidth.

    python benchmarks/gemm.py                      # all shapes
    python benchmarks/gemm.py --quick --json runs/gemm.json
    python benchmarks/gemm.py --no-numba --peak-bw 4800

GEMM rows (C = op(A) @ op(B), M x N x K, 2*M*N*K flops):
  float32  cublas        cupy.matmul (cuBLAS SGEMM; CUPY_TF32 is reported: TF32 off
                         means a true FP32 SGEMM, the fair yardstick)
           cupy_sgemm    kernels/cuda/sgemm.cu
           numba_tiled   kernels/cuda/numba_kernels.py (host launch overhead included)
  bf16     cublas_bf16   torch.matmul on bf16 (cuBLAS; bf16 output), if torch is there
           wmma_bf16     kernels/cuda/wmma_gemm.cu (float32 output)
  fp16     cublas_f16    cupy.matmul on float16 (cuBLAS; float16 output)
           wmma_f16      kernels/cuda/wmma_gemm.cu (float32 output)
Columns: median time over timed samples (CUDA events, after warm-up; small GEMMs
repeat the launch inside one sample), TFLOP/s, ratio to the cuBLAS row of the same
dtype, and the max relative error max|C - C_ref| / max|C_ref| against a float64
product of the same (rounded) inputs computed on the GPU.

Shapes: square 512..8192 and a GPT-2-small training step with 8192 tokens (C=768):
the QKV/MLP-up/MLP-down forward products (x @ W.T, "nt"), an input gradient
(dy @ W, "nn") and a weight gradient (dy.T @ x, "tn", K = tokens).

Fused rows: layernorm fwd/bwd, causal softmax fwd, softmax cross-entropy fwd+bwd.
GB/s counts the compulsory bytes (each input read once, each output written once);
the kernels re-read some rows (from L2 mostly), which the count leaves out. "% peak"
is against --peak-bw (the H200's datasheet 4800 GB/s by default) and "% copy" against
a device-to-device copy measured in the same run (read + write counted), the
practical ceiling. "ref ms" is the same op through kernels/reference.py on cupy
(several unfused cupy kernels): the speedup of fusing.
"""

import argparse
import math
import os
import platform
import sys

import numpy as np


from _common import median, table, write_json  # noqa: E402

SQUARE = [512, 1024, 2048, 4096, 8192]
SQUARE_QUICK = [1024, 4096]
TOKENS, WIDTH = 8192, 768
# (label, M, N, K, variant)
TRAINING = [
    ("qkv fwd x@W.T", TOKENS, 3 * WIDTH, WIDTH, "nt"),
    ("mlp-up fwd x@W.T", TOKENS, 4 * WIDTH, WIDTH, "nt"),
    ("mlp-down fwd x@W.T", TOKENS, WIDTH, 4 * WIDTH, "nt"),
    ("mlp-up dx dy@W", TOKENS, WIDTH, 4 * WIDTH, "nn"),
    ("mlp-up dW dy.T@x", 4 * WIDTH, WIDTH, TOKENS, "tn"),
]
TRAINING_QUICK = TRAINING[1:2] + TRAINING[4:5]


# ---------------------------------------------------------------------------
# timing


class Timer:
    """Median seconds per call of fn, timed with CUDA events (cupy's, or torch's for
    torch work, so each runs on its own library's current stream)."""

    def __init__(self, cp, warmup, samples, target_s=2e-3):
        self.cp, self.warmup, self.samples, self.target_s = cp, warmup, samples, target_s

    def __call__(self, fn, torch=None):
        if torch is not None:
            new_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            sync = torch.cuda.synchronize
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            cp = self.cp
            new_event = cp.cuda.Event
            sync = cp.cuda.Device().synchronize
            elapsed = lambda a, b: cp.cuda.get_elapsed_time(a, b) / 1e3  # noqa: E731
        for _ in range(self.warmup):
            fn()
        sync()
        start, end = new_event(), new_event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        one = max(elapsed(start, end), 1e-7)
        # small kernels: several launches per sample, so event resolution and launch
        # gaps do not dominate
        inner = int(min(100, max(1, math.ceil(self.target_s / one))))
        times = []
        for _ in range(self.samples):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(elapsed(start, end) / inner)
        return median(times)


def max_rel_err(cp, c, ref):
    ref_max = float(cp.abs(ref).max())
    return float(cp.abs(c.astype(cp.float64) - ref).max()) / max(ref_max, 1e-30)


# ---------------------------------------------------------------------------
# GEMM


def _operands(cp, M, N, K, variant, dtype=np.float32, seed=0):
    rs = cp.random.RandomState(seed)
    ta, tb = variant[0] == "t", variant[1] == "t"
    a = rs.standard_normal((K, M) if ta else (M, K), dtype=np.float32).astype(dtype)
    b = rs.standard_normal((N, K) if tb else (K, N), dtype=np.float32).astype(dtype)
    return a, b, ta, tb


def _ref64(cp, a, b, ta, tb):
    a64, b64 = a.astype(cp.float64), b.astype(cp.float64)
    return cp.matmul(a64.T if ta else a64, b64.T if tb else b64)


def gemm_rows(cp, ck, nk, torch, timer, shapes, log):
    rows = []
    for label, M, N, K, variant in shapes:
        flops = 2.0 * M * N * K
        shape = f"{M}x{N}x{K} {variant}"
        # ---- float32
        a, b, ta, tb = _operands(cp, M, N, K, variant)
        ref = _ref64(cp, a, b, ta, tb)
        out = cp.empty((M, N), dtype=cp.float32)
        aa, bb = (a.T if ta else a), (b.T if tb else b)
        impls = [("cublas", lambda: cp.matmul(aa, bb, out=out)),
                 ("cupy_sgemm", lambda: ck.sgemm(a, b, out, trans_a=ta, trans_b=tb))]
        if nk is not None:
            impls.append(("numba_tiled", lambda: nk.matmul(a, b, out, trans_a=ta, trans_b=tb)))
        base = None
        for name, fn in impls:
            try:
                t = timer(fn)
                err = max_rel_err(cp, out, ref)
            except Exception as exc:
                log(f"  {label} {name}: FAILED {type(exc).__name__}: {exc}")
                rows.append(dict(case=label, shape=shape, dtype="float32", impl=name, error=str(exc)))
                continue
            base = t if name == "cublas" else base
            rows.append(dict(case=label, shape=shape, dtype="float32", impl=name, ms=t * 1e3,
                             tflops=flops / t / 1e12, vs_cublas=(base / t) if base else None, max_rel_err=err))
            log(f"  {label:20s} {shape:22s} float32 {name:12s} {t * 1e3:9.3f} ms {flops / t / 1e12:7.2f} TFLOP/s "
                f"err {err:.1e}")
        ref = None    # free the GPU memory (the timed lambdas are done with it)
        # ---- bf16 and fp16 (same float32 operands, rounded)
        for kind in ("bf16", "f16"):
            if kind == "bf16":
                a16, b16 = ck.to_bf16(a), ck.to_bf16(b)
                ar, br = ck.from_bf16(a16), ck.from_bf16(b16)
            else:
                a16, b16 = a.astype(cp.float16), b.astype(cp.float16)
                ar, br = a16.astype(cp.float32), b16.astype(cp.float32)
            ref = _ref64(cp, ar, br, ta, tb)
            out32 = cp.empty((M, N), dtype=cp.float32)
            impls = []
            if kind == "bf16" and torch is not None:
                tA = torch.from_dlpack(a).to(torch.bfloat16)  # round to nearest even, as to_bf16
                tB = torch.from_dlpack(b).to(torch.bfloat16)
                tA, tB = (tA.t() if ta else tA), (tB.t() if tb else tB)
                holder = {}

                def torch_mm(tA=tA, tB=tB, holder=holder):
                    holder["c"] = torch.matmul(tA, tB)

                impls.append((f"cublas_{kind}", torch_mm, "torch"))
            elif kind == "f16":
                a16v, b16v = (a16.T if ta else a16), (b16.T if tb else b16)
                out16 = cp.empty((M, N), dtype=cp.float16)
                impls.append((f"cublas_{kind}", lambda: cp.matmul(a16v, b16v, out=out16), "cupy"))
            impls.append((f"wmma_{kind}", lambda: ck.gemm_tc(a16, b16, out32, trans_a=ta, trans_b=tb, kind=kind),
                          "cupy"))
            base = None
            for name, fn, lib in impls:
                try:
                    t = timer(fn, torch=torch if lib == "torch" else None)
                    if name.startswith("cublas") and lib == "torch":
                        c = cp.from_dlpack(holder["c"].float().contiguous())
                    elif name.startswith("cublas"):
                        c = out16
                    else:
                        c = out32
                    err = max_rel_err(cp, c, ref)
                except Exception as exc:
                    log(f"  {label} {name}: FAILED {type(exc).__name__}: {exc}")
                    rows.append(dict(case=label, shape=shape, dtype=kind, impl=name, error=str(exc)))
                    continue
                base = t if name.startswith("cublas") else base
                rows.append(dict(case=label, shape=shape, dtype=kind, impl=name, ms=t * 1e3,
                                 tflops=flops / t / 1e12, vs_cublas=(base / t) if base else None, max_rel_err=err))
                log(f"  {label:20s} {shape:22s} {kind:7s} {name:12s} {t * 1e3:9.3f} ms {flops / t / 1e12:7.2f} "
                    f"TFLOP/s err {err:.1e}")
            ref = out32 = None    # free the GPU memory (the timed lambdas are done with it)
        a = b = out = None    # free the GPU memory (the timed lambdas are done with it)
        cp.get_default_memory_pool().free_all_blocks()
    return rows


# ---------------------------------------------------------------------------
# fused kernels: bandwidth


def copy_bandwidth(cp, timer, nbytes=1 << 30):
    # 1 GiB: well past the 60 MB L2, so this is HBM bandwidth
    a = cp.ones(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    t = timer(lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes, 3,
                                                    cp.cuda.get_current_stream().ptr))
    return 2 * a.nbytes / t / 1e9  # read + write


def fused_rows(cp, ck, ref, timer, peak_bw, copy_bw, quick, log):
    rows = []
    rs = cp.random.RandomState(1)
    f32 = cp.float32
    if quick == "smoke":
        N, C, B, H, T, NCE, V = 9, 70, 1, 2, 33, 5, 301
    else:
        N, C = (16384, 768) if quick else (32768, 768)
        B, H, T = (8, 12, 512) if quick else (16, 12, 512)
        NCE, V = (4096 if quick else 8192), 50304

    def add(op, shape, nbytes, fn, ref_fn, check):
        t = timer(fn)
        tr = timer(ref_fn) if ref_fn is not None else None
        err = check()
        gbs = nbytes / t / 1e9
        rows.append(dict(op=op, shape=shape, ms=t * 1e3, GBs=gbs, pct_peak=100 * gbs / peak_bw,
                         pct_copy=100 * gbs / copy_bw, ref_ms=tr * 1e3 if tr else None,
                         speedup=(tr / t) if tr else None, max_rel_err=err))
        log(f"  {op:28s} {shape:22s} {t * 1e3:8.3f} ms {gbs:8.1f} GB/s {100 * gbs / peak_bw:5.1f}% peak "
            f"{100 * gbs / copy_bw:5.1f}% copy  ref {tr * 1e3 if tr else float('nan'):8.3f} ms  err {err:.1e}")

    def rel(x, y):
        return float(cp.abs(x.astype(cp.float64) - y.astype(cp.float64)).max()) / max(1.0, float(cp.abs(y).max()))

    x = rs.standard_normal((N, C), dtype=f32)
    w, b = rs.standard_normal(C, dtype=f32), rs.standard_normal(C, dtype=f32)
    out = cp.empty_like(x)
    res = {}

    def ln_fwd():
        res["fwd"] = ck.layernorm_forward(x, w, b, 1e-5, out)

    add("layernorm_forward", f"{N}x{C} f32", 4 * (2 * N * C + 2 * C + 2 * N), ln_fwd,
        lambda: ref.layernorm_forward(x, w, b, 1e-5), lambda: rel(out, ref.layernorm_forward(x, w, b, 1e-5)[0]))
    _, mean, rstd = ck.layernorm_forward(x, w, b, 1e-5)
    dy = rs.standard_normal((N, C), dtype=f32)
    dx = cp.empty_like(x)
    dw, db = cp.zeros(C, f32), cp.zeros(C, f32)
    add("layernorm_backward (+dW,db)", f"{N}x{C} f32", 4 * (3 * N * C + 3 * C + 2 * N),
        lambda: ck.layernorm_backward(dy, x, w, mean, rstd, dx, dw, db),
        lambda: ref.layernorm_backward(dy, x, w, mean, rstd, None, dw, db),
        lambda: rel(ck.layernorm_backward(dy, x, w, mean, rstd), ref.layernorm_backward(dy, x, w, mean, rstd)))
    x = out = dy = dx = None    # free the GPU memory (the timed lambdas are done with it)
    s = rs.standard_normal((B, H, T, T), dtype=f32)
    p = cp.empty_like(s)
    add("softmax_causal_forward", f"{B}x{H}x{T}x{T} f32", 4 * 2 * s.size,
        lambda: ck.softmax_causal_forward(s, 0.125, p), lambda: ref.softmax_causal_forward(s, 0.125),
        lambda: rel(p, ref.softmax_causal_forward(s, 0.125)))
    s = p = None    # free the GPU memory (the timed lambdas are done with it)
    cp.get_default_memory_pool().free_all_blocks()
    logits = rs.standard_normal((NCE, V), dtype=f32)
    tg = rs.randint(0, V, size=NCE).astype(cp.int64)
    dl = cp.empty_like(logits)
    add("cross_entropy fwd+bwd", f"{NCE}x{V} f32", 4 * (2 * NCE * V + NCE) + 8 * NCE,
        lambda: ck.cross_entropy_forward_backward(logits, tg, dl, 1.0 / NCE),
        lambda: ref.cross_entropy_forward_backward(logits, tg, cp.empty_like(logits), 1.0 / NCE),
        lambda: rel(dl, ref.cross_entropy_forward_backward(logits, tg, cp.empty_like(logits), 1.0 / NCE)[1]))
    logits = dl = None    # free the GPU memory (the timed lambdas are done with it)
    cp.get_default_memory_pool().free_all_blocks()
    return rows


# ---------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes and samples (a few minutes at most)")
    p.add_argument("--json", metavar="PATH", help="write all rows and the environment here")
    p.add_argument("--peak-bw", type=float, default=4800.0, help="GB/s for the %% peak column (default 4800: H200)")
    p.add_argument("--samples", type=int, default=None, help="timed samples per row (default 10, --quick 5)")
    p.add_argument("--no-numba", action="store_true", help="skip the Numba tiled GEMM")
    p.add_argument("--no-fused", action="store_true", help="skip the fused-kernel bandwidth rows")
    p.add_argument("--square", default=None, help="comma-separated square sizes (default 512..8192)")
    p.add_argument("--no-training", action="store_true", help="skip the training-step GEMM shapes")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one sample: checks that the script runs (numbers meaningless)")
    args = p.parse_args(argv)

    from ringpipe.kernels.cuda import available

    ok, why = available()
    if not ok:
        print(f"benchmarks/gemm.py needs cupy and a CUDA GPU: {why}", file=sys.stderr)
        return 2
    import cupy as cp

    from ringpipe.kernels import reference as ref
    from ringpipe.kernels.cuda import cupy_kernels as ck

    def log(msg):
        print(msg, flush=True)

    env = {"python": platform.python_version(), "cupy": cp.__version__, "numpy": np.__version__,
           "CUPY_TF32": os.environ.get("CUPY_TF32", "0"), "quick": args.quick}
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        env["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        env["cc"] = f"{props['major']}.{props['minor']}"
        env["sms"] = props.get("multiProcessorCount")
        env["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        env["cuda_driver"] = cp.cuda.runtime.driverGetVersion()
    except Exception as exc:
        env["device"] = f"? ({exc})"
    log(f"device: {env.get('device')} cc {env.get('cc')}  cupy {cp.__version__}  CUPY_TF32={env['CUPY_TF32']}")

    nk = None
    if not args.no_numba:
        try:
            from numba import cuda as ncuda

            if ncuda.is_available():
                from ringpipe.kernels.cuda import numba_kernels as nk
            else:
                log("numba.cuda sees no GPU: numba_tiled rows skipped")
        except Exception as exc:
            log(f"numba.cuda unusable ({type(exc).__name__}: {exc}): numba_tiled rows skipped")
    torch = None
    try:
        import torch as _torch

        if _torch.cuda.is_available():
            torch = _torch
            env["torch"] = torch.__version__
    except Exception:
        pass
    if torch is None:
        log("torch with CUDA not found: no cuBLAS bf16 baseline (fp16 rows still compare with cuBLAS)")

    samples = args.samples or (1 if args.smoke else 5 if args.quick else 10)
    timer = Timer(cp, warmup=1 if args.smoke else 2 if args.quick else 3, samples=samples,
                  target_s=0.0 if args.smoke else 2e-3)
    square = [int(s) for s in args.square.split(",")] if args.square else (
        [37] if args.smoke else SQUARE_QUICK if args.quick else SQUARE)
    training = [] if args.no_training else (
        [("smoke nt", 70, 36, 20, "nt"), ("smoke tn", 36, 20, 70, "tn")] if args.smoke
        else TRAINING_QUICK if args.quick else TRAINING)
    shapes = [(f"square {n}", n, n, n, "nn") for n in square] + training

    log("GEMM (median ms, TFLOP/s, max relative error vs a float64 product of the same inputs)")
    g_rows = gemm_rows(cp, ck, nk, torch, timer, shapes, log)
    cols = [("case", "case", ""), ("shape", "M x N x K", ""), ("dtype", "dtype", ""), ("impl", "impl", ""),
            ("ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".2f"), ("vs_cublas", "x cuBLAS", ".2f"),
            ("max_rel_err", "max rel err", ".1e")]
    print("\n" + table(g_rows, cols) + "\n", flush=True)

    f_rows, copy_bw = [], None
    if not args.no_fused:
        copy_bw = copy_bandwidth(cp, timer, 1 << 20 if args.smoke else 1 << 30)
        log(f"device-to-device copy: {copy_bw:.1f} GB/s (read + write), {100 * copy_bw / args.peak_bw:.1f}% of "
            f"--peak-bw {args.peak_bw:.0f}")
        f_rows = fused_rows(cp, ck, ref, timer, args.peak_bw, copy_bw, "smoke" if args.smoke else args.quick, log)
        cols = [("op", "op", ""), ("shape", "shape", ""), ("ms", "ms", ".3f"), ("GBs", "GB/s", ".1f"),
                ("pct_peak", "% peak", ".1f"), ("pct_copy", "% copy", ".1f"), ("ref_ms", "ref ms", ".3f"),
                ("speedup", "x ref", ".2f"), ("max_rel_err", "max rel err", ".1e")]
        print("\n" + table(f_rows, cols) + "\n", flush=True)

    if args.json:
        write_json(args.json, {"env": env, "peak_bw_GBs": args.peak_bw, "copy_bw_GBs": copy_bw,
                               "samples": samples, "gemm": g_rows, "fused": f_rows})
        log(f"wrote {args.json}")
    failed = [r for r in g_rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
