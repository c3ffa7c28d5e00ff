"""
Llama-family kernels (RMSNorm, RoPE, SwiGLU; forward and backward): the fused Numba
CPU kernels against their numpy references, in the same run.

    python benchmarks/llama_kernels.py                     # float32, smollm2-135m widths
    python benchmarks/llama_kernels.py --dtype float64 --repeats 21 --json runs/llama_kernels.json
    python benchmarks/llama_kernels.py --threads 1         # per-rank view when ranks fill the cores

The two implementations of an op are timed alternately (numba, numpy, numpy, numba,
...) after one untimed warm-up call each (the numba compile or cache load), so a
machine that speeds up or slows down during the run shifts both alike; the table
shows medians. The numbers are relative: on a shared machine read the speedup column
and rerun before trusting a single row.
Default shapes are SmolLM2-135M's (hidden 576, 9 heads of 64, intermediate 1536) at
B*T = 4*512 rows: RMSNorm on (rows, hidden), RoPE on the queries (B, T, heads, 64),
SwiGLU on (rows, intermediate).
"""

import argparse
import os
import time

import numpy as np

from ringpipe import kernels
from ringpipe.kernels.ops import OP_NAMES
from _common import choice_list, median, output_path, positive_int, table, write_json

OPS = ("rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "swiglu_forward", "swiglu_backward")
if not set(OPS) <= set(OP_NAMES):
    raise SystemExit(f"benchmarks/llama_kernels.py: {sorted(set(OPS) - set(OP_NAMES))} not in the kernel op table")
BACKENDS = ("numba", "numpy")


def alternating_ms(calls, repeats):
    """{backend: median ms} of calls {backend: fn}, timed in alternating order."""
    for fn in calls.values():
        fn()  # warm-up: numba compile or cache load, page faults
    times = {name: [] for name in calls}
    order = list(calls)
    for _ in range(repeats):
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t0) * 1e3)
        order.reverse()
    return {name: median(ts) for name, ts in times.items()}


def cases(dt, B, T, C, H, hd, ff):
    """Yields (op, shape, call) with call(backend) running the op once."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dt)

    N = B * T
    x, w, dy = r(N, C), r(C), r(N, C)
    _, rstd = kernels.rmsnorm_forward(x, w, 1e-5)
    yield "rmsnorm_forward", f"N={N} C={C}", lambda be: kernels.rmsnorm_forward(x, w, 1e-5, backend=be)
    yield "rmsnorm_backward", f"N={N} C={C}", lambda be: kernels.rmsnorm_backward(dy, x, w, rstd, backend=be)
    q = r(B, T, H, hd)
    cos, sin = kernels.rope_tables(T, hd, 100000.0, dtype=dt)
    shape = f"B={B} T={T} H={H} hd={hd}"
    yield "rope_forward", shape, lambda be: kernels.rope_forward(q, cos, sin, backend=be)
    yield "rope_backward", shape, lambda be: kernels.rope_backward(q, cos, sin, backend=be)
    gate, up, dh = r(N, ff), r(N, ff), r(N, ff)
    yield "swiglu_forward", f"N={N} ff={ff}", lambda be: kernels.swiglu_forward(gate, up, backend=be)
    yield "swiglu_backward", f"N={N} ff={ff}", lambda be: kernels.swiglu_backward(dh, gate, up, backend=be)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=sorted(kernels.DTYPES))
    ap.add_argument("--repeats", type=positive_int, default=15, help="timed calls per op and backend (median)")
    ap.add_argument("--B", type=positive_int, default=4, help="batch")
    ap.add_argument("--T", type=positive_int, default=512, help="sequence length")
    ap.add_argument("--C", type=positive_int, default=576, help="hidden size (RMSNorm width)")
    ap.add_argument("--H", type=positive_int, default=9, help="query heads (RoPE)")
    ap.add_argument("--hd", type=positive_int, default=64, help="head size (RoPE; even)")
    ap.add_argument("--ff", type=positive_int, default=1536, help="intermediate size (SwiGLU)")
    ap.add_argument("--only", type=choice_list(OPS), default=None,
                    help="comma-separated op names to run, from: " + ",".join(OPS))
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="numba threads (default: ringpipe's share of the cores)")
    ap.add_argument("--json", metavar="PATH", type=output_path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.hd % 2:
        ap.error(f"--hd {args.hd} is odd: RoPE rotates the two halves of a head, give an even --hd")
    return ap, args


def main(argv=None):
    ap, args = parse_args(argv)
    import numba

    if args.threads is not None:
        if args.threads > numba.config.NUMBA_NUM_THREADS:
            ap.error(f"--threads {args.threads} is more than numba's pool of {numba.config.NUMBA_NUM_THREADS} "
                     "(set by NUMBA_NUM_THREADS or the core count): lower --threads or raise NUMBA_NUM_THREADS")
        numba.set_num_threads(args.threads)
    dt = kernels.resolve_dtype(args.dtype)
    rows = []
    for op, shape, call in cases(dt, args.B, args.T, args.C, args.H, args.hd, args.ff):
        if args.only and op not in args.only:
            continue
        ms = alternating_ms({be: (lambda be=be: call(be)) for be in BACKENDS}, args.repeats)
        rows.append(dict(op=op, shape=shape, dtype=args.dtype, numba_ms=ms["numba"], numpy_ms=ms["numpy"],
                         speedup=ms["numpy"] / ms["numba"]))
    print(table(rows, [("op", "op", "<"), ("shape", "shape", "<"), ("dtype", "dtype", "<"),
                       ("numba_ms", "numba_ms", ".3f"), ("numpy_ms", "numpy_ms", ".3f"),
                       ("speedup", "speedup", ".2f")]))
    threads = numba.get_num_threads()
    print(f"(medians of {args.repeats}, alternating; numba threads={threads}, cpus={os.cpu_count()})")
    if args.json:
        write_json(args.json, dict(rows=rows, repeats=args.repeats, numba_threads=threads, cpus=os.cpu_count(),
                                   shapes=dict(B=args.B, T=args.T, C=args.C, H=args.H, hd=args.hd, ff=args.ff)))


if __name__ == "__main__":
    main()
