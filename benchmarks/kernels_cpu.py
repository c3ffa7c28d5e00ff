"""
CPU kernel benchmark: Numba kernels vs the numpy reference at training-like shapes.

    python benchmarks/kernels_cpu.py                 # float32, default shapes
    python benchmarks/kernels_cpu.py --dtype float64 --repeats 15 --json runs/kernels_cpu.json
    python benchmarks/kernels_cpu.py --threads 1     # per-rank view when ranks fill the cores

Reports medians over repeats (after a warm-up call that also triggers the numba
compile/cache load), so the numbers are relative, not absolute claims: on a shared
machine read the speedup column, and rerun before trusting a single row.
matmul has no numba version (BLAS is the CPU path); its row reports GFLOP/s.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np


from ringpipe import kernels  # noqa: E402
from ringpipe.kernels.ops import OP_NAMES  # noqa: E402
from _common import choice_list, output_path, positive_int  # noqa: E402

# The ops this benchmark times (cases() yields them, plus the BLAS matmul row), by
# their names in the kernel op table (kernels/ops.py): the names --only takes.
OPS = ("layernorm_forward", "layernorm_backward", "gelu_forward", "gelu_backward",
       "softmax_causal_forward", "softmax_causal_backward", "cross_entropy_forward_backward",
       "adamw_update", "sgd_momentum_update", "sum_of_squares", "matmul")
if not set(OPS) <= set(OP_NAMES):
    raise SystemExit(f"benchmarks/kernels_cpu.py: {sorted(set(OPS) - set(OP_NAMES))} not in the kernel op table")


def median_ms(fn, repeats, reset=None):
    """Median wall time of fn() in ms; reset() (untimed) restores inputs between calls."""
    if reset is not None:
        reset()
    fn()  # warm-up: numba compile or cache load, page faults, BLAS thread start
    times = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cases(dt, N, C, B, H, T, V, NV, P):
    """Yields (op, shape, make) where make(backend) -> (fn, reset)."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dt)

    # layernorm (N, C)
    x, w, b = r(N, C), r(C), r(C)
    out, mean, rstd = kernels.layernorm_forward(x, w, b)
    yield "layernorm_forward", f"N={N} C={C}", lambda be: (
        lambda: kernels.layernorm_forward(x, w, b, out=out, backend=be), None)
    dout, dx, dw, db = r(N, C), np.empty((N, C), dt), np.zeros(C, dt), np.zeros(C, dt)
    yield "layernorm_backward", f"N={N} C={C}", lambda be: (
        lambda: kernels.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db, backend=be), None)

    # gelu on the MLP hidden activation (N, 4C)
    h, hout, dh = r(N, 4 * C), np.empty((N, 4 * C), dt), r(N, 4 * C)
    yield "gelu_forward", f"N={N} 4C={4 * C}", lambda be: (
        lambda: kernels.gelu_forward(h, hout, backend=be), None)
    yield "gelu_backward", f"N={N} 4C={4 * C}", lambda be: (
        lambda: kernels.gelu_backward(dh, h, hout, backend=be), None)

    # attention softmax (B, H, T, T)
    s = r(B, H, T, T)
    p = np.empty_like(s)
    scale = 1.0 / np.sqrt(C // H)
    yield "softmax_causal_forward", f"B={B} H={H} T={T}", lambda be: (
        lambda: kernels.softmax_causal_forward(s, scale, p, backend=be), None)
    kernels.softmax_causal_forward(s, scale, p)
    dp, ds = r(B, H, T, T), np.empty_like(s)
    yield "softmax_causal_backward", f"B={B} H={H} T={T}", lambda be: (
        lambda: kernels.softmax_causal_backward(dp, p, scale, ds, backend=be), None)

    # fused cross-entropy, in place on logits as in training
    logits0 = r(NV, V)
    targets = rng.integers(0, V, NV)
    logits = np.empty_like(logits0)

    def reset_logits():
        logits[...] = logits0

    yield "cross_entropy_forward_backward", f"N={NV} V={V}", lambda be: (
        lambda: kernels.cross_entropy_forward_backward(logits, targets, logits, 1.0 / NV, backend=be), reset_logits)

    # optimizer over a flat parameter vector
    param, grad, m, v = r(P), r(P), np.zeros(P, dt), np.zeros(P, dt)
    mask = (rng.random(P) < 0.8).astype(np.uint8)
    yield "adamw_update", f"P={P}", lambda be: (
        lambda: kernels.adamw_update(param, grad, m, v, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                                     weight_decay=0.1, step=10, wd_mask=mask, backend=be), None)
    buf = np.zeros(P, dt)
    yield "sgd_momentum_update", f"P={P}", lambda be: (
        lambda: kernels.sgd_momentum_update(param, grad, buf, lr=1e-4, momentum=0.9, weight_decay=0.1,
                                            wd_mask=mask, backend=be), None)
    yield "sum_of_squares", f"P={P}", lambda be: (lambda: kernels.sum_of_squares(grad, backend=be), None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=sorted(kernels.DTYPES))
    ap.add_argument("--repeats", type=positive_int, default=9, help="timed calls per op and backend (median reported)")
    ap.add_argument("--N", type=positive_int, default=4096, help="rows B*T for layernorm/gelu")
    ap.add_argument("--C", type=positive_int, default=768, help="channels")
    ap.add_argument("--B", type=positive_int, default=8, help="attention batch")
    ap.add_argument("--H", type=positive_int, default=12, help="attention heads")
    ap.add_argument("--T", type=positive_int, default=256, help="attention sequence length")
    ap.add_argument("--V", type=positive_int, default=256, help="vocab size for cross-entropy")
    ap.add_argument("--NV", type=positive_int, default=8192, help="rows for cross-entropy")
    ap.add_argument("--P", type=positive_int, default=10_000_000, help="flat parameter count for optimizers")
    ap.add_argument("--only", type=choice_list(OPS), default=None,
                    help="comma-separated op names to run, from: " + ",".join(OPS))
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="numba threads (default: all cores; under MPI each rank should get cores/ranks)")
    ap.add_argument("--json", metavar="PATH", type=output_path, default=None,
                    help="also write the rows as JSON to PATH")
    args = ap.parse_args(argv)
    if args.H > args.C:
        ap.error(f"--H ({args.H}) is larger than --C ({args.C}): heads split the channels, give --H <= --C")

    dt = kernels.resolve_dtype(args.dtype)
    if args.threads is not None:
        import numba

        if args.threads > numba.config.NUMBA_NUM_THREADS:
            ap.error(f"--threads {args.threads} is more than numba's pool of {numba.config.NUMBA_NUM_THREADS} "
                     "(set by NUMBA_NUM_THREADS or the core count): lower --threads or raise NUMBA_NUM_THREADS")
        numba.set_num_threads(args.threads)
    only = set(args.only) if args.only else None
    rows = []
    for op, shape, make in cases(dt, args.N, args.C, args.B, args.H, args.T, args.V, args.NV, args.P):
        assert op in OPS, f"{op} is missing from OPS"
        if only and op not in only:
            continue
        fn, reset = make("numba")
        t_numba = median_ms(fn, args.repeats, reset)
        fn, reset = make("numpy")
        t_numpy = median_ms(fn, args.repeats, reset)
        rows.append(dict(op=op, shape=shape, dtype=args.dtype, numba_ms=t_numba, numpy_ms=t_numpy,
                         speedup=t_numpy / t_numba))

    # matmul: BLAS on both paths, so report throughput instead of a speedup
    if not only or "matmul" in only:
        rng = np.random.default_rng(1)
        M, K, Nn = args.N, args.C, 4 * args.C
        a = rng.standard_normal((M, K)).astype(dt)
        w = rng.standard_normal((Nn, K)).astype(dt)  # (out, in) as the engine stores weights
        out = np.empty((M, Nn), dt)
        t = median_ms(lambda: kernels.matmul_nt(a, w, out), args.repeats)
        rows.append(dict(op="matmul_nt (BLAS)", shape=f"{M}x{K} @ ({Nn}x{K}).T", dtype=args.dtype,
                         numba_ms=None, numpy_ms=t, speedup=None, gflops=2.0 * M * K * Nn / (t * 1e-3) / 1e9))

    print(f"{'op':<30} {'shape':<26} {'dtype':<8} {'numba_ms':>9} {'numpy_ms':>9} {'speedup':>8}")
    for r in rows:
        nb = f"{r['numba_ms']:9.2f}" if r["numba_ms"] is not None else f"{'-':>9}"
        sp = f"{r['speedup']:7.2f}x" if r["speedup"] is not None else f"{r['gflops']:.0f} GF/s".rjust(8)
        print(f"{r['op']:<30} {r['shape']:<26} {r['dtype']:<8} {nb} {r['numpy_ms']:9.2f} {sp}")
    try:
        import numba

        threads = numba.get_num_threads()
    except Exception:
        threads = None
    print(f"(medians of {args.repeats}; numba threads={threads}, cpus={os.cpu_count()})")

    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, repeats=args.repeats, numba_threads=threads, cpus=os.cpu_count()), f, indent=2)


if __name__ == "__main__":
    main()
