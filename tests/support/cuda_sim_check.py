"""
Numba CUDA kernels (kernels/cuda/numba_kernels.py) against the numpy references.

Runs in its own process because the CUDA simulator must be switched on before numba
is first imported (tests/kernels/test_cuda_kernels.py calls this script in a subprocess).

  python tests/cuda_sim_check.py                      all checks, in the CUDA simulator
  python tests/cuda_sim_check.py --only gemm,softmax  checks whose name contains a word
  python tests/cuda_sim_check.py --mutate gemm-ktile  the same checks against a copy of
                                                      the kernels with a planted bug:
                                                      they must FAIL (exit 1)
  python tests/cuda_sim_check.py --gpu                on a real GPU (numba-cuda), with the
                                                      production tiles and larger shapes
  python tests/cuda_sim_check.py --ptx                compile every kernel to PTX for
                                                      sm_80 and sm_90 with NVVM (no GPU
                                                      needed) and report registers/spills
                                                      through ptxas when it is on PATH

Exit status: 0 all passed, 1 a check failed, 2 setup error (e.g. a mutation whose
target text is gone from the kernel source: update MUTATIONS), 3 --ptx with no
libnvvm to compile with.

Simulator shapes are small and odd (7x13x5, 17x9x33, LN 5x7, softmax T=5, CE 6x11)
and the tiles/blocks tiny (GEMM 8x8x4 tiles of 2x2 per thread, 4-8 thread rows), so
that every kernel crosses tile edges, strides over rows wider than its block and
runs several K-tiles and row chunks: the simulator runs every thread as a Python
thread, so this is both the fast and the thorough choice.
"""

import os
import sys
import time
import traceback

GPU = "--gpu" in sys.argv
PTX = "--ptx" in sys.argv
if not GPU and not PTX:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if "numba" in sys.modules and not GPU and not PTX:  # pragma: no cover - guards misuse as a module
    raise RuntimeError("cuda_sim_check: numba was imported before the simulator was enabled")

import numpy as np  # noqa: E402

from ringpipe.kernels import reference as ref  # noqa: E402

KERNEL_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "kernels", "cuda", "numba_kernels.py")

# Planted bugs: name -> (check words they should trip, [(old text, new text), ...]).
# Each replacement must match the kernel source at least once (all matches replaced).
MUTATIONS = {
    # the classic: loop over floor(K/BK) tiles, dropping the K tail
    "gemm-ktile": ("gemm", [("n_ktiles = (K + BK - 1) // BK", "n_ktiles = K // BK")]),
    # no row guard on A's tile load: reads past the last row of A
    "gemm-edge": ("gemm", [("v = a[za, m, k] if (m < M and k < K) else ZERO",
                            "v = a[za, m, k] if (k < K) else ZERO")]),
    # causal softmax normalizer misses the diagonal term
    "softmax-diag": ("softmax", [("for j in range(lo + tid, t + 1, nt):\n            tot += math.exp",
                                  "for j in range(lo + tid, t, nt):\n            tot += math.exp")]),
    # biased -> unbiased variance
    "ln-var": ("layernorm", [("var = _block_sum(sh, s) / C", "var = _block_sum(sh, s) / (C - 1)")]),
    # every row chunk of a column reduction drops its last row
    "colsum-chunk": ("layernorm,colsum", [("r1 = r0 + rows_per_chunk\n",
                                           "r1 = r0 + rows_per_chunk - 1\n")]),
}

SMALL_TILES = (8, 8, 4, 2, 2)
# relative to the largest magnitude involved (as in tests/kernels/test_kernels.py)
TOL = {np.float32: 5e-6, np.float64: 1e-12}


def load_kernels(mutation=None):
    if mutation is None:
        from ringpipe.kernels.cuda import numba_kernels

        return numba_kernels
    import types

    with open(KERNEL_FILE) as f:
        src = f.read()
    _, edits = MUTATIONS[mutation]
    for old, new in edits:
        if old not in src:
            print(f"SETUP mutation {mutation!r}: target text not found in {KERNEL_FILE}:\n{old}")
            sys.exit(2)
        src = src.replace(old, new)
    mod = types.ModuleType(f"numba_kernels_mutant_{mutation.replace('-', '_')}")
    mod.__file__ = KERNEL_FILE
    exec(compile(src, KERNEL_FILE + f" [mutant {mutation}]", "exec"), mod.__dict__)
    return mod


class Checker:
    def __init__(self, only):
        self.only = only
        self.results = []

    def wanted(self, name):
        return not self.only or any(w in name for w in self.only)

    def run(self, name, fn):
        if not self.wanted(name):
            return
        t0 = time.perf_counter()
        try:
            errs = fn()
            bad = [e for e in errs if not e[0]]
            worst = max((e[1] / e[2] for e in errs), default=0.0)
            ok = not bad
            detail = f"worst err/tol={worst:.2g}" + ("" if ok else "  " + "; ".join(e[3] for e in bad[:3]))
        except Exception as exc:  # a crash (e.g. an out-of-bounds index in the simulator) is a failure
            ok = False
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            detail = f"raised {tb}"
        dt = time.perf_counter() - t0
        self.results.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name:58s} {dt:6.2f}s  {detail}", flush=True)


def close(label, actual, expected, dtype, scale=1.0):
    """(ok, err, tol, message): max abs error relative to max(1, max |expected|)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        return (False, np.inf, 1.0, f"{label}: shape {actual.shape} != {expected.shape}")
    if actual.dtype != expected.dtype:
        return (False, np.inf, 1.0, f"{label}: dtype {actual.dtype} != {expected.dtype}")
    mag = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
    err = float(np.max(np.abs(actual.astype(np.float64) - expected))) / mag if expected.size else 0.0
    if not np.isfinite(err):
        err = np.inf
    tol = TOL[dtype] * scale
    return (err <= tol, err, tol, f"{label}: err {err:.3g} > tol {tol:.3g}")


def checks(nk, ck, gpu):
    rng = np.random.default_rng(20240607)
    dtypes = (np.float32, np.float64)

    def rnd(shape, dt, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    def tname(dt):
        return "f32" if dt == np.float32 else "f64"

    # -- GEMM ------------------------------------------------------------------------
    shapes = [(7, 13, 5), (17, 9, 33)]
    tiles = [SMALL_TILES]
    if gpu:
        shapes += [(257, 129, 300), (1024, 512, 768)]
        tiles = [nk.GEMM_TILES]
    variants = [(False, False), (False, True), (True, False), (True, True)]
    for ta, tb in variants:
        for M, N, K in shapes:
            for dt in dtypes:
                for tl in tiles:
                    if (ta, tb) == (True, True) and (M, N, K) != shapes[-1]:
                        continue  # TT is not used by the engine: one shape is enough

                    def f(ta=ta, tb=tb, M=M, N=N, K=K, dt=dt, tl=tl):
                        a = rnd((K, M) if ta else (M, K), dt)
                        b = rnd((N, K) if tb else (K, N), dt)
                        got = nk.matmul(a, b, trans_a=ta, trans_b=tb, tiles=tl)
                        exp = ref.matmul(a, b, trans_a=ta, trans_b=tb)
                        return [close("C", got, exp, dt, scale=max(1, K / 8))]

                    v = ("T" if ta else "N") + ("T" if tb else "N")
                    ck.run(f"gemm {v} {tname(dt)} {M}x{N}x{K} tiles={tl}", f)

    def gemm_production_tiles():
        a, b = rnd((7, 5), np.float32), rnd((5, 13), np.float32)
        return [close("C", nk.matmul(a, b), a @ b, np.float32)]

    if not gpu:
        ck.run(f"gemm NN f32 7x13x5 tiles={nk.GEMM_TILES} (production)", gemm_production_tiles)

    for dt in dtypes:
        def gemm_acc(dt=dt):
            a, b = rnd((17, 33), dt), rnd((9, 33), dt)
            c0 = rnd((17, 9), dt)
            c = c0.copy()
            nk.matmul(a, b, c, trans_b=True, accumulate=True, tiles=SMALL_TILES if not gpu else nk.GEMM_TILES)
            return [close("C+=", c, c0 + a @ b.T, dt, scale=4)]

        ck.run(f"gemm NT accumulate {tname(dt)} 17x9x33", gemm_acc)

    def gemm_batched():
        tl = SMALL_TILES if not gpu else nk.GEMM_TILES
        out = []
        a, b = rnd((2, 3, 5, 7), np.float64), rnd((7, 4), np.float64)  # 2D b broadcasts
        out.append(close("batched x 2D", nk.matmul(a, b, tiles=tl), a @ b, np.float64))
        a, b = rnd((3, 7, 5), np.float64), rnd((3, 7, 6), np.float64)  # TN per batch
        out.append(close("batched TN", nk.matmul(a, b, trans_a=True, tiles=tl),
                         np.swapaxes(a, -1, -2) @ b, np.float64))
        a, b = rnd((2, 1, 5, 3), np.float64), rnd((1, 3, 3, 4), np.float64)  # partial broadcast
        out.append(close("broadcast", nk.matmul(a, b, tiles=tl), a @ b, np.float64))
        a, b = rnd((5, 3), np.float64), rnd((3, 4), np.float64)  # strided out, accumulated into
        big = rnd((5, 8), np.float64)
        exp = big.copy()
        exp[:, ::2] += a @ b
        nk.matmul(a, b, big[:, ::2], accumulate=True, tiles=tl)
        out.append(close("strided out +=", big, exp, np.float64))
        a, b = rnd((3, 0), np.float32), rnd((0, 4), np.float32)  # K = 0
        out.append(close("K=0", nk.matmul(a, b, tiles=tl), np.zeros((3, 4), np.float32), np.float32))
        return out

    ck.run("gemm batched/broadcast/strided out/K=0", gemm_batched)

    # -- column sum (bias gradient) --------------------------------------------------
    for dt in dtypes:
        def colsum(dt=dt):
            x = rnd((9, 6), dt)
            o0 = rnd((6,), dt)
            o = o0.copy()
            nk.column_sum(x, o, accumulate=True, rows_per_chunk=4)
            fresh = nk.column_sum(x, rows_per_chunk=4)
            return [close("+=", o, (o0 + x.sum(0, dtype=np.float64)).astype(dt), dt),
                    close("=", fresh, x.sum(0, dtype=np.float64).astype(dt), dt)]

        ck.run(f"colsum {tname(dt)} 9x6 chunks of 4", colsum)

    # -- layernorm -------------------------------------------------------------------
    ln_shapes = [(5, 7), (3, 19)] + ([(512, 768), (64, 4099)] if gpu else [])
    blk = None if gpu else 8
    rpc = nk.ROWS_PER_CHUNK if gpu else 2
    for N, C in ln_shapes:
        for dt in dtypes:
            def ln(N=N, C=C, dt=dt):
                x, w, b = rnd((N, C), dt, 2.0) + dt(0.5), rnd((C,), dt), rnd((C,), dt)
                y, mu, rs = nk.layernorm_forward(x, w, b, 1e-5, block=blk)
                ye, mue, rse = ref.layernorm_forward(x, w, b, 1e-5)
                dy = rnd((N, C), dt)
                dw0, db0 = rnd((C,), dt), rnd((C,), dt)
                dw, db = dw0.copy(), db0.copy()
                dx = nk.layernorm_backward(dy, x, w, mue, rse, None, dw, db, block=blk, rows_per_chunk=rpc)
                dwe, dbe = dw0.copy(), db0.copy()
                dxe = ref.layernorm_backward(dy, x, w, mue, rse, None, dwe, dbe)
                return [close("out", y, ye, dt), close("mean", mu, mue, dt), close("rstd", rs, rse, dt),
                        close("dx", dx, dxe, dt, scale=4), close("dweight", dw, dwe, dt, scale=4),
                        close("dbias", db, dbe, dt, scale=4)]

            ck.run(f"layernorm fwd+bwd {tname(dt)} {N}x{C}", ln)

    # -- gelu ------------------------------------------------------------------------
    for dt in dtypes:
        def gelu(dt=dt):
            x, dy = rnd((3, 5, 7), dt, 3.0), rnd((3, 5, 7), dt)
            eb = 8 if not gpu else nk.ELT_BLOCK
            return [close("fwd", nk.gelu_forward(x, block=eb), ref.gelu_forward(x), dt),
                    close("bwd", nk.gelu_backward(dy, x, block=eb), ref.gelu_backward(dy, x), dt)]

        ck.run(f"gelu fwd+bwd {tname(dt)} 3x5x7", gelu)

    # -- causal softmax --------------------------------------------------------------
    sm_shapes = [(2, 1, 5)] + ([(4, 3, 129)] if gpu else [])
    for B, H, T in sm_shapes:
        for dt in dtypes:
            def sm(B=B, H=H, T=T, dt=dt):
                s = rnd((B, H, T, T), dt, 3.0)
                blk_ = None if gpu else 4
                p = nk.softmax_causal_forward(s, 0.37, block=blk_)
                pe = ref.softmax_causal_forward(s, 0.37)
                s2 = s.copy()
                nk.softmax_causal_forward(s2, 0.37, out=s2, block=blk_)  # in place
                dp = rnd((B, H, T, T), dt)  # garbage above the diagonal must be ignored
                g = nk.softmax_causal_backward(dp, pe, 0.37, block=blk_)
                ge = ref.softmax_causal_backward(dp, pe, 0.37)
                dp2 = dp.copy()
                nk.softmax_causal_backward(dp2, pe, 0.37, out=dp2, block=blk_)
                # a sliding window (Mistral's, Gemma 3's local layers): 0 before t - window + 1
                pw = nk.softmax_causal_forward(s, 0.37, window=2, block=blk_)
                pwe = ref.softmax_causal_forward(s, 0.37, window=2)
                return [close("fwd", p, pe, dt), close("fwd in place", s2, pe, dt),
                        close("bwd", g, ge, dt), close("bwd in place", dp2, ge, dt),
                        close("fwd window 2", pw, pwe, dt)]

            ck.run(f"softmax causal fwd+bwd {tname(dt)} B={B} H={H} T={T}", sm)

    # -- softmax cross-entropy -------------------------------------------------------
    ce_shapes = [(6, 11)] + ([(64, 50257)] if gpu else [])
    for N, V in ce_shapes:
        for dt in dtypes:
            def ce(N=N, V=V, dt=dt):
                blk_ = None if gpu else 4
                x = rnd((N, V), dt, 2.0)
                x[0] *= 40.0  # large logits: the max shift must keep everything finite
                t = rng.integers(0, V, size=N)
                t[1] = V - 1
                loss, dl = nk.cross_entropy_forward_backward(x, t, np.empty_like(x), 0.5, block=blk_)
                le, dle = ref.cross_entropy_forward_backward(x, t, np.empty_like(x), 0.5)
                lonly, none = nk.cross_entropy_forward_backward(x, t, None, block=blk_)
                x2 = x.copy()
                l2, _ = nk.cross_entropy_forward_backward(x2, t.astype(np.int32), x2, 0.5, block=blk_)  # in place
                return [close("loss", loss, le, dt, scale=8), close("dlogits", dl, dle, dt),
                        close("loss only", lonly, le, dt, scale=8),
                        (none is None, 0.0, 1.0, "dlogits should be None"),
                        close("loss in place", l2, le, dt, scale=8), close("dlogits in place", x2, dle, dt)]

            ck.run(f"crossentropy fwd+bwd {tname(dt)} N={N} V={V}", ce)

    # -- optimizers and norm ---------------------------------------------------------
    for dt in dtypes:
        def adamw(dt=dt):
            out = []
            n = 37 if not gpu else 100_003
            for mk in (None, "bool", "float32"):
                p, g = rnd((n,), dt), rnd((n,), dt)
                m, v = rnd((n,), dt, 0.1), np.abs(rnd((n,), dt, 0.1))
                mask = None if mk is None else (rng.random(n) < 0.5).astype(mk)
                pe, me, ve = p.copy(), m.copy(), v.copy()
                kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, wd_mask=mask)
                nk.adamw_update(p, g, m, v, block=8 if not gpu else nk.ELT_BLOCK, **kw)
                ref.adamw_update(pe, g, me, ve, **kw)
                out += [close(f"p mask={mk}", p, pe, dt), close("m", m, me, dt), close("v", v, ve, dt)]
            return out

        ck.run(f"adamw {tname(dt)} mask none/bool/float", adamw)

        def sgd(dt=dt):
            n = 37
            p, g, b = rnd((n,), dt), rnd((n,), dt), rnd((n,), dt)
            mask = (rng.random(n) < 0.5).astype(np.uint8)
            pe, be = p.copy(), b.copy()
            kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.1, wd_mask=mask)
            nk.sgd_momentum_update(p, g, b, block=8, **kw)
            ref.sgd_momentum_update(pe, g, be, **kw)
            return [close("p", p, pe, dt), close("buf", b, be, dt)]

        ck.run(f"sgd momentum {tname(dt)}", sgd)

        def ssq(dt=dt):
            x = rnd((101,), dt)
            got = nk.sum_of_squares(x, block=8 if not gpu else nk.ELT_BLOCK)
            exp = ref.sum_of_squares(x)
            return [(abs(got - exp) <= 1e-12 * exp, abs(got - exp) / exp, 1e-12, f"sumsq {got} vs {exp}")]

        ck.run(f"sumsq {tname(dt)} n=101", ssq)


def ptx_report():
    """Compile every kernel to PTX (NVVM, no GPU needed) for sm_80 and sm_90 and, when
    ptxas is available, print registers and spills per kernel."""
    import glob
    import re
    import shutil
    import subprocess
    import tempfile

    # numba finds libnvvm under CUDA_HOME/nvvm/lib64; some toolkit layouts (pip wheels,
    # this repo's CI image) keep it in CUDA_HOME/lib instead
    if "NUMBA_CUDA_NVVM" not in os.environ:
        nvcc = shutil.which("nvcc")
        roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"))
        if nvcc:
            roots.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
        for r in roots:
            hits = glob.glob(os.path.join(r, "nvvm", "lib64", "libnvvm.so*")) + glob.glob(os.path.join(r, "lib", "libnvvm.so*"))
            if r and hits:
                os.environ["NUMBA_CUDA_NVVM"] = hits[0]
                os.environ.setdefault("CUDA_HOME", r)
                libdev = os.path.join(r, "nvvm", "libdevice")
                if os.path.isdir(libdev):
                    os.environ.setdefault("NUMBA_CUDA_LIBDEVICE", libdev)
                break
    if "NUMBA_CUDA_NVVM" not in os.environ:
        print("SKIP no libnvvm found (set NUMBA_CUDA_NVVM or CUDA_HOME)")
        sys.exit(3)
    from numba import cuda, types

    from ringpipe.kernels.cuda import numba_kernels as nk

    # compile_ptx takes the target cc, but device functions called from a kernel
    # (the block reductions) are compiled for "the current device", which asks the
    # driver. With no GPU, answer for it: the cc being compiled for.
    import numba.cuda.dispatcher as _disp

    target = {"cc": (9, 0)}

    class _NoDevice:
        @property
        def compute_capability(self):
            return target["cc"]

    if not cuda.is_available():
        _disp.get_current_device = lambda: _NoDevice()

    def arr(dt, nd):
        return types.Array(dt, nd, "C")

    ptxas = shutil.which("ptxas")
    failures = 0
    for cc in ((8, 0), (9, 0)):
        target["cc"] = cc
        for dtname, dt in (("float32", types.float32), ("float64", types.float64)):
            f8 = types.float64
            i64 = types.int64
            a1, a2, a3 = arr(dt, 1), arr(dt, 2), arr(dt, 3)
            d2 = arr(types.float64, 2)
            u8 = arr(types.uint8, 1)
            k = nk.row_kernels(dtname)
            sigs = {
                "layernorm_forward": (a2, a1, a1, f8, a2, a1, a1),
                "layernorm_backward_dx": (a2, a2, a1, a1, a1, a2),
                "layernorm_backward_params_partial": (a2, a2, a1, a1, d2, d2, i64),
                "column_sum_partial": (a2, d2, i64),
                "column_sum_finish": (d2, a1, types.boolean),
                "gelu_forward": (a1, a1),
                "gelu_backward": (a1, a1, a1),
                "softmax_causal_forward": (a2, f8, a2, i64),
                "softmax_causal_backward": (a2, a2, f8, a2),
                "cross_entropy": (a2, arr(types.int64, 1), a1, a2, f8, types.boolean),
                "adamw": (a1, a1, a1, a1, f8, f8, f8, f8, f8, f8, f8, u8, types.boolean),
                "sgd_momentum": (a1, a1, a1, f8, f8, f8, u8, types.boolean),
                "sum_of_squares_partial": (a1, arr(types.float64, 1)),
            }
            jobs = [(name, k[name].py_func, sig) for name, sig in sigs.items()]
            # the Llama-family kernels (their simulator checks: tests/kernels/test_llama_kernels.py)
            lk = nk.llama_kernels(dtname)
            llama_sigs = {"rmsnorm_forward": (a2, a1, f8, a2, a1), "rmsnorm_backward_dx": (a2, a2, a1, a1, a2),
                          "rmsnorm_backward_dw_partial": (a2, a2, a1, d2, i64), "rope": (a3, a2, a2, a3, i64),
                          "swiglu_forward": (a1, a1, a1), "swiglu_backward": (a1, a1, a1, a1, a1)}
            jobs += [(name, lk[name].py_func, sig) for name, sig in llama_sigs.items()]
            for ta, tb in ((False, False), (False, True), (True, False)):
                g = nk.gemm_kernel(dtname, ta, tb, nk.GEMM_TILES)
                v = ("T" if ta else "N") + ("T" if tb else "N")
                jobs.append((f"gemm_{v}", g.py_func, (a3, a3, a3, types.boolean)))
            for name, fn, sig in jobs:
                label = f"sm_{cc[0]}{cc[1]} {dtname:7s} {name}"
                try:
                    ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
                except Exception as exc:
                    failures += 1
                    print(f"FAIL  {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    continue
                info = ""
                if ptxas:
                    with tempfile.TemporaryDirectory() as d:
                        src = os.path.join(d, "k.ptx")
                        with open(src, "w") as f:
                            f.write(ptx)
                        r = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", src, "-o", os.devnull],
                                           capture_output=True, text=True)
                    if r.returncode != 0:
                        failures += 1
                        print(f"FAIL  {label}: ptxas: {r.stderr.strip()[:300]}")
                        continue
                    regs = re.findall(r"Used (\d+) registers", r.stderr)
                    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
                    smem = re.findall(r"(\d+) bytes smem", r.stderr)
                    info = (f"registers={regs[-1] if regs else '?'} "
                            f"spill_stores={spill[-1][0] if spill else '?'} spill_loads={spill[-1][1] if spill else '?'} "
                            f"smem={smem[-1] if smem else 0}")
                print(f"PASS  {label:50s} {info}", flush=True)
    return failures


def main(argv):
    only, mutation = [], None
    args = list(argv)
    while args:
        a = args.pop(0)
        if a == "--only":
            only = [w for w in args.pop(0).split(",") if w]
        elif a == "--mutate":
            mutation = args.pop(0)
            if mutation not in MUTATIONS:
                print(f"SETUP unknown mutation {mutation!r}; known: {', '.join(MUTATIONS)}")
                return 2
            if not only:
                only = MUTATIONS[mutation][0].split(",")
        elif a in ("--gpu", "--ptx"):
            pass
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            print(__doc__)
            return 2
    if PTX:
        t0 = time.perf_counter()
        failures = ptx_report()
        print(f"ptx: {failures} failures, {time.perf_counter() - t0:.1f}s")
        return 1 if failures else 0
    t0 = time.perf_counter()
    nk = load_kernels(mutation)
    ck = Checker(only)
    mode = "gpu" if GPU else "simulator"
    print(f"numba CUDA kernels vs reference ({mode}{', mutant ' + mutation if mutation else ''})", flush=True)
    checks(nk, ck, GPU)
    n_fail = ck.results.count(False)
    print(f"{len(ck.results)} checks, {n_fail} failed, {time.perf_counter() - t0:.1f}s")
    if not ck.results:
        print("SETUP no check selected")
        return 2
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
