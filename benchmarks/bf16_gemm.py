"""
The CPU's bf16 GEMM (kernels/bf16.py) next to the GEMMs a user would otherwise run, same
run, same threads, alternating calls (issue 25).

    python benchmarks/bf16_gemm.py [--threads 1,2 --rounds 7] [--json PATH]
    python benchmarks/bf16_gemm.py --quick          # small shapes, a smoke test

Shapes (M x N x K, 2*M*N*K flops): 2048^3 as C = A @ B, and 4096 x 768 x 3072, a GPT-2
MLP-down forward over 4096 tokens, as C = X @ W.T with W stored (768, 3072).
Rows, each float32 in and float32 out unless said:
  ringpipe bf16 native      kernels.matmul(precision="bf16"): float32 operands rounded to bf16
                            (one Numba pass each), oneDNN's dnnl_gemm_bf16bf16f32
  ringpipe bf16 operands    the same GEMM on operands already bf16 (kernels.to_bf16 once,
                            outside the timing): what a step that keeps bf16 weights pays
  ringpipe bf16 emulated    the fallback where the CPU has no bf16 dot products: round to
                            bf16 values in float32 (one Numba pass each), the float32 BLAS
  ringpipe bf16 before      the same numbers as ringpipe ran them before issue 25 (and the
                            reference backend still does): the rounding in numpy
  ringpipe float32          kernels.matmul(precision="float32"): numpy's BLAS
  numpy float32             np.matmul, the same BLAS without ringpipe's checks
  torch bf16                torch.matmul on bf16 tensors (oneDNN; bf16 output), operands
                            converted outside the timing, as under autocast's cache
Each thread count runs in its own child process whose thread variables (OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS, MKL_NUM_THREADS, NUMBA_NUM_THREADS) are set before numpy loads, and
torch.set_num_threads. OPENBLAS_CORETYPE is removed from the children's environment
(a value forcing an older kernel, e.g. Haswell on AVX-512 machines, slows the float32
rows; --keep-coretype keeps it); the BLAS that really ran (threadpoolctl, when installed)
is in the output. Per round every row runs once in turn; a row's time is the median over
rounds, after one warm-up call each. Each timed call comes --pause seconds after the one
before: OpenBLAS's idle workers spin for a while after a call (measured here: oneDNN and
torch at 2 threads fell to their 1-thread speed when timed right after a float32 call),
and a row must not pay for the previous row's library. "max rel err" is max|C - C64| / max|C64| against a
float64 product of the bf16-rounded inputs (float32 rows: of the float32 inputs).
The 1-minute load average before and after each child is printed: the machine is shared.
"""

import argparse
import json
import os
import sys
import time

from _common import (int_list, median, nonneg_float, output_path, positive_int, run_child, table,  # noqa: E402
                     write_json)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
# (label, M, N, K, trans_b)
SHAPES = [("2048^3 a@b", 2048, 2048, 2048, False), ("4096x768x3072 x@W.T", 4096, 768, 3072, True)]
QUICK_SHAPES = [("256^3 a@b", 256, 256, 256, False), ("512x96x384 x@W.T", 512, 96, 384, True)]
ROWS = ("ringpipe bf16 native", "ringpipe bf16 operands", "ringpipe bf16 emulated", "ringpipe bf16 before",
        "ringpipe float32",
        "numpy float32", "torch bf16")


def blas_info():
    try:
        from threadpoolctl import threadpool_info
        return [{k: d.get(k) for k in ("internal_api", "version", "architecture", "num_threads", "threading_layer")}
                for d in threadpool_info() if d.get("user_api") in ("blas", "openmp")]
    except ImportError:
        import numpy as np
        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
        return [{"internal_api": blas.get("name"), "version": blas.get("version"), "source": "numpy.show_config"}]


def child(spec):
    """One thread count: every row on every shape, alternating; returns the rows."""
    import numpy as np

    from ringpipe import kernels
    from ringpipe.kernels import bf16
    try:
        import torch
        torch.set_num_threads(spec["threads"])
    except ImportError:
        torch = None

    def row_fns(a, b, tb, out):
        a16, b16 = kernels.to_bf16(a), kernels.to_bf16(b)
        fns = {}
        if bf16.native() is not None:
            fns["ringpipe bf16 native"] = lambda: kernels.matmul(a, b, out, trans_b=tb, precision="bf16")
            fns["ringpipe bf16 operands"] = lambda: kernels.matmul(a16, b16, out, trans_b=tb)
        fns["ringpipe bf16 emulated"] = lambda: bf16.emulated_matmul(a, b, out, trans_b=tb)
        fns["ringpipe bf16 before"] = lambda: kernels.matmul(a, b, out, trans_b=tb, precision="bf16",
                                                             backend="numpy")
        fns["ringpipe float32"] = lambda: kernels.matmul(a, b, out, trans_b=tb, precision="float32")
        bb = b.T if tb else b
        fns["numpy float32"] = lambda: np.matmul(a, bb, out=out)
        if torch is not None:
            ta_, tb_ = torch.from_numpy(a).bfloat16(), torch.from_numpy(b).bfloat16()
            tbb = tb_.T if tb else tb_
            fns["torch bf16"] = lambda: torch.matmul(ta_, tbb)
        return fns

    rng = np.random.default_rng(0)
    rows = []
    for label, M, N, K, tb in spec["shapes"]:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
        out = np.empty((M, N), np.float32)
        fns = row_fns(a, b, tb, out)
        ref16 = kernels.round_to_bf16(a).astype(np.float64) @ (kernels.round_to_bf16(b).astype(np.float64).T if tb
                                                               else kernels.round_to_bf16(b).astype(np.float64))
        ref32 = a.astype(np.float64) @ (b.astype(np.float64).T if tb else b.astype(np.float64))
        errs = {}
        for name, fn in fns.items():        # warm-up, and the answer's error
            c = fn()
            c = out if c is None else c
            c = c.float().numpy() if torch is not None and isinstance(c, torch.Tensor) else c
            want = ref32 if "float32" in name else ref16
            errs[name] = float(np.abs(c - want).max() / np.abs(want).max())
        times = {name: [] for name in fns}
        for _ in range(spec["rounds"]):
            for name, fn in fns.items():
                time.sleep(spec["pause"])
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name in fns:
            s = median(times[name])
            rows.append(dict(shape=label, M=M, N=N, K=K, threads=spec["threads"], impl=name, ms=s * 1e3,
                             gflops=2.0 * M * N * K / s / 1e9, max_rel_err=errs[name]))
    return dict(rows=rows, bf16_gemm=kernels.bf16_gemm(), blas=blas_info(),
                openblas_coretype=os.environ.get("OPENBLAS_CORETYPE"),
                torch=None if torch is None else torch.__version__)


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, _, spec, result = sys.argv
        with open(result, "w") as f:
            json.dump(child(json.loads(spec)), f)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int_list(1), default=[1, 2], help="thread counts, one child each (default 1,2)")
    ap.add_argument("--rounds", type=positive_int, default=7, help="timed calls of each row, alternating (median)")
    ap.add_argument("--pause", type=nonneg_float, default=0.2,
                    help="seconds of rest before each timed call, so the previous row's threads go idle (0.2)")
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 rounds: a smoke test")
    ap.add_argument("--keep-coretype", action="store_true", help="leave OPENBLAS_CORETYPE in the children's environment")
    ap.add_argument("--json", metavar="PATH", type=output_path, default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = 2 if args.quick else args.rounds
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    if not args.keep_coretype:
        os.environ.pop("OPENBLAS_CORETYPE", None)
    children, rows = [], []
    for n in args.threads:
        spec = dict(threads=n, rounds=rounds, shapes=shapes, pause=0.0 if args.quick else args.pause)
        out = run_child(os.path.abspath(__file__), "all", spec, THREAD_VARS, ROOT, f" at {n} thread(s)")
        children.append({k: v for k, v in out.items() if k != "rows"})
        rows += out["rows"]
    by = {(r["shape"], r["threads"], r["impl"]): r for r in rows}
    for r in rows:
        base = lambda impl: by.get((r["shape"], r["threads"], impl), {}).get("gflops")  # noqa: E731
        r["x_float32"] = r["gflops"] / base("ringpipe float32") if base("ringpipe float32") else None
        r["x_torch_bf16"] = r["gflops"] / base("torch bf16") if base("torch bf16") else None
    cols = [("shape", "shape", ""), ("threads", "thr", "d"), ("impl", "impl", ""), ("ms", "ms", ".1f"),
            ("gflops", "GFLOP/s", ".0f"), ("x_float32", "x rp f32", ".2f"), ("x_torch_bf16", "x torch bf16", ".2f"),
            ("max_rel_err", "max rel err", ".1e")]
    print(table(rows, cols))
    c0 = children[0]
    print(f"({c0['bf16_gemm']}; medians of {rounds} alternating rounds, {spec['pause']} s before each call; torch {c0['torch']}; "
          f"OPENBLAS_CORETYPE {'kept: ' + str(coretype) if args.keep_coretype else 'unset (was ' + str(coretype) + ')'};"
          f" BLAS: {c0['blas']})")
    for n, c in zip(args.threads, children):
        print(f"  {n} thread(s): load average {c['load_before']:.2f} before, {c['load_after']:.2f} after; "
              f"{c['involuntary_switches']} involuntary context switches")
    if args.json:
        write_json(args.json, dict(rows=rows, children=children, rounds=rounds, pause_s=spec["pause"],
                                   openblas_coretype=coretype,
                                   coretype_kept=args.keep_coretype, cpus=os.cpu_count()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
