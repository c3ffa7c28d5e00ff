"""
kernels/ for the Llama family (issue 23): RMSNorm, rotary position embedding (RoPE,
transformers' half-split layout) and SwiGLU, forward and backward.

  - the Numba kernels == the numpy references, float32 (~1e-6 relative) and float64
    (~1e-12), on odd shapes (C = 37, one row, T = 1, hd = 2, more rows than one dw chunk)
  - the references' backward == central finite differences of their forward (float64)
  - the references == transformers' own modules on the same inputs (float64, to the last
    bits), with a negative control: the interleaved RoPE layout must NOT match
  - kernels.rope_tables == transformers' tables (default and Llama 3 scaled), its code
    run in float64 (left alone it computes them in float32 for any model dtype)
  - validation errors name what is wrong
The GPU versions are checked in tests/kernels/test_cuda_kernels.py (test_gpu_rmsnorm,
test_gpu_rope, test_gpu_swiglu and the op-table rows), emulated when there is no GPU.
"""

import types

import numpy as np
import pytest

from ringpipe import kernels
from ringpipe.kernels import reference as ref

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-6, np.float64: 1e-12}
LLAMA3_SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def assert_close(actual, expected, dtype, scale=1.0):
    """max |actual - expected| <= tol * scale * max(1, max |expected|), same dtype"""
    expected = np.asarray(expected)
    assert np.asarray(actual).dtype == expected.dtype
    mag = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL[dtype] * scale * mag)


def rnd(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


@pytest.fixture
def rng():
    return np.random.default_rng(2323)


def _fd_grad(f, arrays, G, h=1e-6):
    """Central differences of L = sum(f(*arrays) * G) w.r.t. each array (float64)."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + h
            lp = np.sum(f(*arrays) * G)
            a[i] = old - h
            lm = np.sum(f(*arrays) * G)
            a[i] = old
            g[i] = (lp - lm) / (2 * h)
        grads.append(g)
    return grads


# ---------------------------------------------------------------------------
# RMSNorm

RMS_SHAPES = [(7, 37), (1, 37), (3, 5, 37), (5, 1), (100, 24), (37,), (0, 5)]  # (100, 24): several dw chunks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rmsnorm_numba_vs_reference(rng, dtype, shape):
    x, w, dy = rnd(rng, shape, dtype, 2.0), rnd(rng, shape[-1:], dtype), rnd(rng, shape, dtype)
    y, rstd = kernels.rmsnorm_forward(x, w, 1e-6)
    y_r, rstd_r = kernels.rmsnorm_forward(x, w, 1e-6, backend="numpy")
    assert y.shape == shape and rstd.shape == shape[:-1] and y.dtype == rstd.dtype == dtype
    assert_close(rstd, rstd_r, dtype)
    assert_close(y, y_r, dtype)
    dx, dw = kernels.rmsnorm_backward(dy, x, w, rstd_r)
    dx_r, dw_r = kernels.rmsnorm_backward(dy, x, w, rstd_r, backend="numpy")
    assert dx.shape == shape and dw.shape == shape[-1:] and dx.dtype == dw.dtype == dtype
    assert_close(dx, dx_r, dtype, scale=4)
    rows = int(np.prod(shape[:-1]))
    assert_close(dw, dw_r, dtype, scale=rows)  # a sum over the rows


def test_rmsnorm_numba_dw_is_reproducible(rng):
    # several partial-sum chunks: fixed by the rows, not the threads, so bitwise the same
    x, w, dy = rnd(rng, (100, 24), np.float32), rnd(rng, 24, np.float32), rnd(rng, (100, 24), np.float32)
    _, rstd = kernels.rmsnorm_forward(x, w)
    first = kernels.rmsnorm_backward(dy, x, w, rstd)[1]
    for _ in range(2):
        np.testing.assert_array_equal(kernels.rmsnorm_backward(dy, x, w, rstd)[1], first)


def test_rmsnorm_reference_vs_finite_differences_and_formula(rng):
    x, w, G = rnd(rng, (3, 7), np.float64), rnd(rng, 7, np.float64), rnd(rng, (3, 7), np.float64)
    gx, gw = _fd_grad(lambda x, w: ref.rmsnorm_forward(x, w, 1e-5)[0], [x, w], G)
    _, rstd = ref.rmsnorm_forward(x, w, 1e-5)
    dx, dw = ref.rmsnorm_backward(G, x, w, rstd)
    np.testing.assert_allclose(dx, gx, atol=1e-8)
    np.testing.assert_allclose(dw, gw, atol=1e-8)
    textbook = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(ref.rmsnorm_forward(x, w, 1e-5)[0], textbook, rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------------------
# RoPE

ROPE_SHAPES = [(2, 5, 3, 8), (1, 1, 1, 2), (3, 7, 2, 6), (1, 3, 4, 38)]  # T = 1, hd = 2, hd/2 odd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rope_numba_vs_reference(rng, dtype, shape):
    B, T, H, hd = shape
    cos, sin = kernels.rope_tables(T + 3, hd, 10000.0, dtype=dtype)
    cos, sin = cos[3:], sin[3:]  # positions 3.. (a cache offset): a row slice stays contiguous
    x = rnd(rng, shape, dtype)
    y = kernels.rope_forward(x, cos, sin)
    assert y.shape == shape and y.dtype == dtype
    assert_close(y, kernels.rope_forward(x, cos, sin, backend="numpy"), dtype)
    dx = kernels.rope_backward(x, cos, sin)
    assert_close(dx, kernels.rope_backward(x, cos, sin, backend="numpy"), dtype)
    # a rotation: backward (the transpose) undoes forward, and norms are kept
    assert_close(kernels.rope_backward(y, cos, sin), x, dtype, scale=2)
    np.testing.assert_allclose(np.linalg.norm(y.astype(np.float64)), np.linalg.norm(x.astype(np.float64)),
                               rtol=10 * TOL[dtype])


def test_rope_reference_vs_finite_differences_and_formula(rng):
    B, T, H, hd = 2, 3, 2, 6
    x, G = rnd(rng, (B, T, H, hd), np.float64), rnd(rng, (B, T, H, hd), np.float64)
    # general tables (not a rotation), so the transpose is checked in full
    cos, sin = rnd(rng, (T, hd), np.float64), rnd(rng, (T, hd), np.float64)
    (gx,) = _fd_grad(lambda x: ref.rope_forward(x, cos, sin), [x], G)
    np.testing.assert_allclose(ref.rope_backward(G, cos, sin), gx, atol=1e-8)
    np.testing.assert_allclose(kernels.rope_backward(G, cos, sin), gx, atol=1e-8)
    h = hd // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, None], sin[:, None]
    textbook = np.concatenate([x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]], axis=-1)
    np.testing.assert_allclose(ref.rope_forward(x, cos, sin), textbook, atol=1e-15)


# ---------------------------------------------------------------------------
# SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 37), (1,), (2, 3, 37)])
def test_swiglu_numba_vs_reference(rng, dtype, shape):
    g, u, dh = rnd(rng, shape, dtype, 4.0), rnd(rng, shape, dtype), rnd(rng, shape, dtype)
    g.flat[0] = -200.0  # exp(-g) overflows: silu -> -0, no NaN
    if g.size > 1:
        g.flat[1] = 200.0
    h = kernels.swiglu_forward(g, u)
    assert h.shape == shape and h.dtype == dtype and np.isfinite(h).all()
    assert_close(h, kernels.swiglu_forward(g, u, backend="numpy"), dtype, scale=4)
    dg, du = kernels.swiglu_backward(dh, g, u)
    dg_r, du_r = kernels.swiglu_backward(dh, g, u, backend="numpy")
    assert np.isfinite(dg).all() and np.isfinite(du).all()
    assert_close(dg, dg_r, dtype, scale=4)
    assert_close(du, du_r, dtype, scale=4)


def test_swiglu_reference_vs_finite_differences_and_formula(rng):
    g, u, G = rnd(rng, (3, 5), np.float64, 3.0), rnd(rng, (3, 5), np.float64), rnd(rng, (3, 5), np.float64)
    gg, gu = _fd_grad(ref.swiglu_forward, [g, u], G)
    dg, du = ref.swiglu_backward(G, g, u)
    np.testing.assert_allclose(dg, gg, atol=1e-8)
    np.testing.assert_allclose(du, gu, atol=1e-8)
    np.testing.assert_allclose(ref.swiglu_forward(g, u), g / (1 + np.exp(-g)) * u, rtol=1e-15, atol=1e-15)


# ---------------------------------------------------------------------------
# against transformers (float64)


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


class _TorchInFloat64:
    """The torch module as transformers' Llama code sees it, with float32 meaning float64.
    That code computes RMSNorm and the RoPE tables in float32 whatever the model's dtype
    (`hidden_states.to(torch.float32)`, `dtype=torch.float`); run this way, the same code
    computes them at the precision the float64 kernels are meant to have."""

    def __init__(self, torch):
        self._torch = torch
        self.float = self.float32 = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


@pytest.fixture
def hf_in_float64(torch, monkeypatch):
    from transformers import modeling_rope_utils
    from transformers.models.llama import modeling_llama

    for module in (modeling_rope_utils, modeling_llama):
        monkeypatch.setattr(module, "torch", _TorchInFloat64(torch))
    return modeling_llama


def test_rmsnorm_and_swiglu_equal_transformers(torch, hf_in_float64, rng):
    from transformers.activations import ACT2FN

    x, w = rnd(rng, (2, 5, 37), np.float64), rnd(rng, 37, np.float64)
    norm = hf_in_float64.LlamaRMSNorm(37, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        expected = norm(torch.from_numpy(x)).numpy()
    mag = np.max(np.abs(expected))
    np.testing.assert_allclose(kernels.rmsnorm_forward(x, w, 1e-6)[0], expected, rtol=0, atol=4e-16 * mag)
    np.testing.assert_allclose(ref.rmsnorm_forward(x, w, 1e-6)[0], expected, rtol=0, atol=4e-16 * mag)
    g, u = rnd(rng, (3, 37), np.float64, 3.0), rnd(rng, (3, 37), np.float64)
    expected = (ACT2FN["silu"](torch.from_numpy(g)) * torch.from_numpy(u)).numpy()
    np.testing.assert_allclose(kernels.swiglu_forward(g, u), expected, rtol=0, atol=1e-15)


def _interleaved_rope(x, cos, sin):
    # the GPT-J / Meta-checkpoint layout: pairs (0,1), (2,3), ... instead of (i, i + hd/2)
    y = np.empty_like(x)
    c, s = cos[:, None, : x.shape[-1] // 2], sin[:, None, : x.shape[-1] // 2]
    y[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    y[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return y


def test_rope_equals_transformers_apply_rotary_pos_emb_and_not_the_interleaved_layout(torch, rng):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, H, hd = 2, 6, 3, 8
    cos, sin = kernels.rope_tables(T, hd, 10000.0)
    q = rnd(rng, (B, T, H, hd), np.float64)
    # transformers' q is (B, H, T, hd) and cos/sin (B, T, hd)
    tq = torch.from_numpy(q.transpose(0, 2, 1, 3).copy())
    tc, ts = torch.from_numpy(cos)[None], torch.from_numpy(sin)[None]
    expected = apply_rotary_pos_emb(tq, tq, tc, ts)[0].numpy().transpose(0, 2, 1, 3)
    np.testing.assert_allclose(kernels.rope_forward(q, cos, sin), expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(kernels.rope_forward(q, cos, sin, backend="numpy"), expected, rtol=0, atol=1e-15)
    # negative control: a permuted layout is a different function, far outside the tolerance
    assert np.max(np.abs(_interleaved_rope(q, cos, sin) - expected)) > 1e-2


def _hf_config(hd, theta, scaling):
    from transformers import LlamaConfig

    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {"rope_type": "llama3", "rope_theta": theta, **scaling}
    return LlamaConfig(hidden_size=hd * 4, num_attention_heads=4, head_dim=hd, max_position_embeddings=131072,
                       rope_parameters=params)


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("hd,theta", [(64, 500000.0), (8, 10000.0), (2, 100000.0)])
def test_rope_tables_equal_transformers_in_float64(torch, hf_in_float64, scaling, hd, theta):
    T = 4096
    emb = hf_in_float64.LlamaRotaryEmbedding(_hf_config(hd, theta, scaling))
    assert emb.inv_freq.dtype == torch.float64 and emb.attention_scaling == 1.0
    hc, hs = (a[0].numpy() for a in emb(torch.zeros(1, dtype=torch.float64), torch.arange(T)[None]))
    cos, sin = kernels.rope_tables(T, hd, theta, scaling)
    assert cos.dtype == np.float64 and cos.shape == (T, hd)
    np.testing.assert_allclose(cos, hc, rtol=0, atol=1e-12)
    np.testing.assert_allclose(sin, hs, rtol=0, atol=1e-12)
    if scaling is not None and hd > 2:  # the scaling did something: long wavelengths are slower
        assert np.max(np.abs(kernels.rope_tables(T, hd, theta)[0] - cos)) > 1e-3


def test_transformers_own_tables_are_float32_accurate_only(torch):
    # why the test above runs transformers' code in float64: left alone it computes the
    # tables in float32 even for a float64 model, ~1e-4 off at position 4096
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(_hf_config(64, 500000.0, None))
    hc = emb(torch.zeros(1, dtype=torch.float64), torch.arange(4096)[None])[0][0].numpy()
    assert np.max(np.abs(kernels.rope_tables(4096, 64, 500000.0)[0] - hc)) > 1e-5


# ---------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("call,match", [
    (lambda: kernels.rmsnorm_forward(np.zeros((2, 3)), np.zeros(4)), r"w has shape \(4,\), expected \(3,\)"),
    (lambda: kernels.rmsnorm_forward(np.zeros((2, 3), np.float32), np.zeros(3)), "w has dtype float64"),
    (lambda: kernels.rmsnorm_backward(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros(3), np.zeros(3)),
     r"rstd has shape \(3,\), expected \(2,\)"),
    (lambda: kernels.rope_forward(np.zeros((1, 2, 1, 3)), np.zeros((2, 3)), np.zeros((2, 3))), "must be even"),
    (lambda: kernels.rope_forward(np.zeros((1, 2, 1, 4)), np.zeros((3, 4)), np.zeros((3, 4))),
     r"cos has shape \(3, 4\), expected \(2, 4\)"),
    (lambda: kernels.rope_backward(np.zeros((2, 1, 4)), np.zeros((2, 4)), np.zeros((2, 4))), "must be 4D"),
    (lambda: kernels.swiglu_forward(np.zeros(3), np.zeros(4)), r"up has shape \(4,\), expected \(3,\)"),
    (lambda: kernels.swiglu_backward(np.zeros(3, np.int64), np.zeros(3), np.zeros(3)), "dh has dtype int64"),
    (lambda: kernels.rope_tables(4, 7, 10000.0), "head size must be an even int"),
    (lambda: kernels.rope_tables(4, 8, 10000.0, {"factor": 8.0}), "lacks low_freq_factor"),
    (lambda: kernels.rope_tables(0, 8, 10000.0), "T .positions. must be an int >= 1"),
])
def test_bad_arguments_say_what_is_wrong(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_rope_tables_accepts_hf_rope_scaling_dicts_with_extra_keys():
    # a config.json's rope_scaling also carries rope_type: the extra key is ignored
    cos, _ = kernels.rope_tables(16, 8, 500000.0, dict(LLAMA3_SCALING, rope_type="llama3"))
    np.testing.assert_array_equal(cos, kernels.rope_tables(16, 8, 500000.0, LLAMA3_SCALING)[0])


def test_the_new_ops_are_in_the_table_and_public():
    from ringpipe.kernels.ops import OP_NAMES

    for name in ("rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "swiglu_forward",
                 "swiglu_backward"):
        assert name in OP_NAMES and name in kernels.__all__
    assert "rope_tables" in kernels.__all__ and isinstance(kernels.rope_tables, types.FunctionType)


# ---------------------------------------------------------------------------
# the benchmark (benchmarks/llama_kernels.py) runs and refuses bad flags; no timing is judged


def _bench(*args):
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join("benchmarks", "llama_kernels.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_benchmark_runs_every_op_on_tiny_shapes_and_writes_json(tmp_path):
    import json

    out = tmp_path / "llama_kernels.json"
    r = _bench("--repeats", "1", "--B", "1", "--T", "3", "--C", "37", "--H", "2", "--hd", "4", "--ff", "37",
               "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["op"] for row in rows] == ["rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward",
                                           "swiglu_forward", "swiglu_backward"]
    assert all(row["numba_ms"] > 0 and row["numpy_ms"] > 0 for row in rows)


@pytest.mark.parametrize("args,words", [(["--hd", "7"], "--hd 7 is odd"), (["--only", "rope_fwd"], "'rope_fwd'"),
                                        (["--repeats", "0"], "--repeats")])
def test_benchmark_refuses_bad_flags(args, words):
    r = _bench(*args)
    assert r.returncode == 2 and words in r.stderr, r.stderr


# ---------------------------------------------------------------------------
# the Numba CUDA twins (kernels/cuda/numba_kernels.py) in Numba's CUDA simulator: no GPU
# needed. Its own process, since the simulator must be on before numba is imported.
# Tiny blocks and row chunks, so every kernel strides past its block and crosses chunks.
# argv[1]: "" or a planted bug "old=>new" applied to the kernel source first.

NUMBA_CUDA_SIM = r"""
import sys, types
import numpy as np
from ringpipe.kernels import reference as ref, rope_tables

path = "kernels/cuda/numba_kernels.py"
src = open(path).read()
if sys.argv[1]:
    old, new = sys.argv[1].split("=>")
    assert old in src, "planted mutation not found"
    src = src.replace(old, new)
nk = types.ModuleType("numba_kernels_checked")
exec(compile(src, path, "exec"), nk.__dict__)
rng = np.random.default_rng(5)
worst = 0.0
for dt, tol in ((np.float32, 5e-6), (np.float64, 1e-12)):
    def check(label, got, exp, scale=1.0):
        global worst
        assert got.dtype == exp.dtype and got.shape == exp.shape, (label, got.dtype, got.shape, exp.shape)
        if not exp.size:
            return
        err = float(np.max(np.abs(got.astype(np.float64) - exp))) / max(1.0, float(np.max(np.abs(exp))))
        worst = max(worst, err / (tol * scale))
        assert err <= tol * scale, f"FAIL {label} {dt.__name__}: err {err:.3g}"
    for shape in ((2, 5, 13), (13,), (0, 5)):
        x, w, dy = (rng.standard_normal(s).astype(dt) for s in (shape, shape[-1:], shape))
        y, rstd = nk.rmsnorm_forward(x, w, 1e-6, block=4)
        ye, rstde = ref.rmsnorm_forward(x, w, 1e-6)
        check("rmsnorm y", y, ye)
        check("rmsnorm rstd", rstd, rstde)
        dx, dw = nk.rmsnorm_backward(dy, x, w, rstde, block=4, rows_per_chunk=3)
        dxe, dwe = ref.rmsnorm_backward(dy, x, w, rstde)
        check("rmsnorm dx", dx, dxe, 4)
        check("rmsnorm dw", dw, dwe, 10)
    q = rng.standard_normal((2, 3, 2, 6)).astype(dt)
    cos, sin = rope_tables(3, 6, 10000.0, dtype=dt)
    check("rope fwd", nk.rope_forward(q, cos, sin, block=8), ref.rope_forward(q, cos, sin))
    check("rope bwd", nk.rope_backward(q, cos, sin, block=8), ref.rope_backward(q, cos, sin))
    g, u, dh = (rng.standard_normal((3, 7)).astype(dt) * 3 for _ in range(3))
    check("swiglu fwd", nk.swiglu_forward(g, u, block=8), ref.swiglu_forward(g, u), 4)
    for lab, got, exp in zip(("dgate", "dup"), nk.swiglu_backward(dh, g, u, block=8), ref.swiglu_backward(dh, g, u)):
        check("swiglu " + lab, got, exp, 4)
print(f"ok, worst err/tol {worst:.2g}")
"""


def _numba_cuda_sim(mutation=""):
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", NUMBA_CUDA_SIM, mutation], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_numba_cuda_llama_kernels_match_reference_in_simulator():
    r = _numba_cuda_sim()
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("mutation", [
    "if r1 > N:  # not min(): see layernorm_backward_params_partial\n                r1 = N\n            s = 0.0\n"
    "            for r in range(r0, r1):=>if r1 > N:\n                r1 = N\n            s = 0.0\n"
    "            for r in range(r0, r1 - 1):",                                  # dw chunks drop a row
    "y[row, head, i] = a * cos[t, i] - b * sin[t, i]=>y[row, head, i] = a * cos[t, i] + b * sin[t, i]",  # sign
], ids=["rmsnorm-dw-chunk", "rope-sign"])
def test_numba_cuda_simulator_check_catches_planted_bug(mutation):
    r = _numba_cuda_sim(mutation)
    assert r.returncode != 0 and "FAIL" in r.stderr and "planted mutation not found" not in r.stderr, \
        r.stdout + r.stderr[-3000:]
