"""
kernels/: Numba kernels == numpy references (float32 and float64, odd shapes, edge
cases), references == finite differences (float64), the public API's accumulate /
overwrite / in-place contracts, backend dispatch, bf16 matmul precision, and
validation errors.

Shapes are deliberately small and odd (N=7, C=13, T=5, V=37) so that nothing lines
up with a vector width or block size; the first run pays the numba compile, later
runs load it from the on-disk cache.
"""

import inspect
import subprocess
import sys
import types

import numpy as np
import pytest

from ringpipe import kernels
from ringpipe.kernels import backend as kb
from ringpipe.kernels import cpu
from ringpipe.kernels import reference as ref
from ringpipe.kernels.ops import OP_NAMES, OPS

DTYPES = [np.float32, np.float64]
# relative to the largest magnitude involved: float32 kernels round differently from
# numpy (float64 accumulators, fused passes), float64 ones should agree to ~1e-15
TOL = {np.float32: 3e-6, np.float64: 1e-13}


def assert_close(actual, expected, dtype, scale=1.0):
    expected = np.asarray(expected)
    assert np.asarray(actual).dtype == expected.dtype
    mag = max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0)
    tol = TOL[dtype] * scale * mag
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol)


def rnd(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _restore_backend():
    saved = kernels.get_backend()
    yield
    kernels.set_backend(saved)


# ---------------------------------------------------------------------------
# backend module


def test_import_is_light_and_defaults_to_numba():
    code = (
        "import sys; from ringpipe import kernels; bad = {'numba', 'cupy'} & set(sys.modules); assert not bad, bad; "
        "assert kernels.get_backend() == 'numba'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_array_module_and_dtypes():
    a = np.zeros(3)
    assert kernels.get_array_module(a, None, a) is np
    assert not kernels.is_gpu_array(a)
    assert kernels.resolve_dtype("float32") is np.float32
    assert kernels.resolve_dtype(np.float64) is np.float64
    with pytest.raises(ValueError, match="float32.*float64"):
        kernels.resolve_dtype("bfloat16")


class _FakeCupyArray:
    """Stands in for a cupy array: detected by module name, never imported."""

    __module__ = "cupy._core.core"


@pytest.fixture
def restore_registry(monkeypatch):
    """The backend registry as it was, after the test, whatever it registers."""
    monkeypatch.setattr(kb, "_BACKENDS", dict(kb._BACKENDS))
    monkeypatch.setattr(kb, "_LOADED", dict(kb._LOADED))


def _fake_backend_module(monkeypatch, name, **functions):
    # a backend module is anything importable whose functions are named after ops
    mod = types.ModuleType(name)
    mod.__dict__.update(functions)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_gpu_arrays_dispatch_to_registered_impl(monkeypatch, restore_registry):
    fake = _FakeCupyArray()
    assert kernels.is_gpu_array(fake)
    with pytest.raises(NotImplementedError, match="gelu_forward"):
        kb._dispatch("gelu_forward", (fake,))
    # backend="numpy" means the xp-generic reference, on any device
    assert kb._dispatch("gelu_forward", (fake,), "numpy") is ref.gelu_forward

    def gpu_gelu(x, out=None):
        return "gpu"

    _fake_backend_module(monkeypatch, "fake_gpu_kernels", gelu_forward=gpu_gelu)
    kb.register_backend("cuda", "fake_gpu_kernels", device="gpu", ops=["gelu_forward"], fallback="numpy")
    assert kb._dispatch("gelu_forward", (np.zeros(2), fake)) is gpu_gelu
    assert kb._dispatch("gelu_forward", (fake,), "cuda") is gpu_gelu
    # a host backend name on GPU arrays runs the GPU default; ops it leaves out, its fallback
    assert kb._dispatch("gelu_forward", (fake,), "numba") is gpu_gelu
    assert kb._dispatch("gelu_backward", (fake,)) is ref.gelu_backward
    # a GPU backend name on host arrays still runs the fast CPU kernels
    kernels.set_backend("cuda")
    assert kb._dispatch("gelu_forward", (np.zeros(2),)) is cpu.gelu_forward


def test_set_backend(monkeypatch, rng):
    kernels.set_backend("numba")  # other test files may have changed the default
    with pytest.raises(ValueError, match="numba"):
        kernels.set_backend("tensorflow")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.gelu_forward(np.zeros(3), backend="tensorflow")

    calls = []
    real = ref.gelu_forward
    # the reference's entry in the dispatch table (what backend="numpy" runs)
    monkeypatch.setitem(kb.load_backend("numpy"), "gelu_forward", lambda *a: calls.append(1) or real(*a))
    x = rnd(rng, (4, 5), np.float64)
    kernels.gelu_forward(x)
    assert calls == []  # default: numba
    kernels.gelu_forward(x, backend="numpy")
    assert calls == [1]
    kernels.set_backend("numpy")
    kernels.gelu_forward(x)
    assert calls == [1, 1]


# ---------------------------------------------------------------------------
# the op table (kernels/ops.py): one list of ops, every backend registered against it


def _table_args(fn):
    """fn's parameters as the table writes an implementation's: without backend=, and
    precision as the boundary hands it on (resolved from None to a name)."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "backend"]
    params = [p.replace(default="float32") if p.name == "precision" else p for p in params]
    return str(inspect.Signature(params))[1:-1]


@pytest.mark.parametrize("op", OPS, ids=OP_NAMES)
def test_every_op_in_the_table_is_a_public_function(op):
    fn = getattr(kernels, op.name)
    assert op.name in kernels.__all__
    assert inspect.signature(fn).parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    assert _table_args(fn) == op.args


def test_the_public_ops_are_the_table_and_the_matmul_helpers():
    functions = [name for name in kernels.__all__ if inspect.isfunction(getattr(kernels, name))]
    public_ops = {name for name in functions if "backend" in inspect.signature(getattr(kernels, name)).parameters}
    assert public_ops == set(OP_NAMES)
    # matmul_nt / matmul_tn are matmul with a flag, defined once, in kernels/__init__.py
    for name in ("matmul_nt", "matmul_tn"):
        assert name not in OP_NAMES and name in kernels.__all__
        for module in (ref, cpu):
            assert not hasattr(module, name), f"{module.__name__}.{name} duplicates kernels.{name}"


@pytest.mark.parametrize("backend,module", [("numpy", ref), ("numba", cpu)])
def test_host_backends_implement_every_op_in_the_table(backend, module):
    impls = kb.load_backend(backend)  # raises if an op is missing or takes other arguments
    assert kb._BACKENDS[backend].module == module.__name__
    assert list(impls) == list(OP_NAMES)
    for op in OPS:
        assert impls[op.name] is getattr(module, op.name)
        assert kb._dispatch(op.name, (np.zeros(1),), backend) is impls[op.name]


def test_registration_refuses_ops_not_in_the_table_and_missing_ones(restore_registry):
    with pytest.raises(kb.RegistrationError, match="gelu_fwd not in the op table"):
        kb.register_backend("x", "fake_kernels", device="gpu", ops=["gelu_fwd"], fallback="numpy")
    with pytest.raises(kb.RegistrationError, match="leaves out sum_of_squares and names no fallback"):
        kb.register_backend("x", "fake_kernels", device="gpu", ops=[op for op in OP_NAMES if op != "sum_of_squares"])
    with pytest.raises(kb.RegistrationError, match="fallback 'nope' must be a registered backend with every op"):
        kb.register_backend("x", "fake_kernels", device="gpu", ops=["gelu_forward"], fallback="nope")
    with pytest.raises(kb.RegistrationError, match="fallback 'numba' must be .* for gpu arrays"):
        kb.register_backend("x", "fake_kernels", device="gpu", ops=["gelu_forward"], fallback="numba")
    with pytest.raises(kb.RegistrationError, match="device must be one of"):
        kb.register_backend("x", "fake_kernels", device="tpu")
    assert "x" not in kb._BACKENDS  # a refused registration registers nothing
    with pytest.raises(ValueError, match="unknown kernel backend 'x'"):
        kernels.set_backend("x")


def test_loading_a_backend_checks_its_module_against_the_table(monkeypatch, restore_registry):
    def gelu_forward(x, out=None, *, block=256):  # a launch knob with a default: allowed
        return "fake"

    def gelu_backward(dout, x):  # the table has dx=None
        pass

    def sum_of_squares(x, block):  # an extra argument without a default
        pass

    _fake_backend_module(monkeypatch, "fake_gpu_kernels", gelu_forward=gelu_forward, gelu_backward=gelu_backward,
                         sum_of_squares=sum_of_squares)
    kb.register_backend("fake", "fake_gpu_kernels", device="gpu", fallback="numpy",
                        ops=["gelu_forward", "gelu_backward", "softmax_causal_forward", "sum_of_squares"])
    with pytest.raises(kb.RegistrationError) as err:
        kb._dispatch("gelu_forward", (_FakeCupyArray(),), "fake")  # the first call loads the module
    msg = str(err.value)
    assert "kernel backend 'fake' (module fake_gpu_kernels)" in msg
    assert "gelu_backward(dout, x) does not take the table's arguments (dout, x, dx=None)" in msg
    assert "softmax_causal_forward is not defined there" in msg
    assert "sum_of_squares: arguments beyond the table's must be keywords with defaults: block" in msg
    assert "gelu_forward(" not in msg and "fake" not in kb._LOADED


# ---------------------------------------------------------------------------
# the float32 exp inside the numba kernels (vectorizable Cephes expf)


def test_float32_exp_accuracy_and_special_values():
    from numba import njit

    @njit(cache=True)
    def expf_array(x, out):
        for i in range(x.shape[0]):
            out[i] = cpu._expf(x[i])

    x = np.linspace(-87.3, 88.3, 400_001, dtype=np.float32)
    out = np.empty_like(x)
    expf_array(x, out)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - want) / want) < 2e-7  # ~1-2 ulp

    special = np.array([np.nan, -np.inf, -200.0, 0.0, np.inf, 100.0], np.float32)
    out = np.empty_like(special)
    expf_array(special, out)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], [0.0, 0.0, 1.0, np.inf, np.inf])


# ---------------------------------------------------------------------------
# matmul (BLAS on both backends; checks the transpose / broadcast / accumulate plumbing)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_transposes(rng, dtype, trans_a, trans_b):
    M, K, N = 7, 13, 5
    a = rnd(rng, (K, M) if trans_a else (M, K), dtype)
    b = rnd(rng, (N, K) if trans_b else (K, N), dtype)
    expected = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    c = kernels.matmul(a, b, trans_a=trans_a, trans_b=trans_b)
    assert c.shape == (M, N) and c.dtype == dtype
    assert_close(c, expected.astype(dtype), dtype, scale=10)

    out = np.full((M, N), 3.0, dtype)
    r = kernels.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=True)
    assert r is out
    assert_close(out, (expected + 3.0).astype(dtype), dtype, scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_batched_and_helpers(rng, dtype):
    a = rnd(rng, (2, 3, 7, 13), dtype)
    b = rnd(rng, (3, 5, 13), dtype)  # broadcasts over the leading 2
    c = kernels.matmul_nt(a, b)
    assert c.shape == (2, 3, 7, 5)
    assert_close(c, np.matmul(a, b.swapaxes(-1, -2)), dtype, scale=10)
    out = np.empty((2, 3, 7, 5), dtype)
    assert kernels.matmul(a, b, out, trans_b=True, backend="numpy") is out
    assert_close(out, c, dtype, scale=10)

    x, dy = rnd(rng, (9, 13), dtype), rnd(rng, (9, 5), dtype)
    dw = np.ones((13, 5), dtype)
    kernels.matmul_tn(x, dy, dw, accumulate=True)  # dW += x.T @ dy
    assert_close(dw, 1.0 + x.T @ dy, dtype, scale=10)


def test_matmul_errors(rng):
    a, b = np.zeros((7, 13)), np.zeros((12, 5))
    with pytest.raises(ValueError, match="inner dims"):
        kernels.matmul(a, b)
    with pytest.raises(ValueError, match="needs out"):
        kernels.matmul(a, a, trans_b=True, accumulate=True)
    with pytest.raises(ValueError, match="out has shape"):
        kernels.matmul(a, a, np.zeros((3, 7, 7)), trans_b=True, accumulate=True)
    with pytest.raises(ValueError, match="at least 2D"):
        kernels.matmul(np.zeros(13), a)
    with pytest.raises(TypeError, match="dtype"):
        kernels.matmul(a, a.astype(np.float32), trans_b=True)
    with pytest.raises(ValueError, match=r"batch dims of \(2, 7, 13\) and \(3, 13, 5\) do not broadcast"):
        kernels.matmul(np.zeros((2, 7, 13)), np.zeros((3, 13, 5)))


@pytest.mark.parametrize("call", [
    lambda L: kernels.matmul(L, np.zeros((2, 2))),
    lambda L: kernels.linear_forward(L, np.zeros((2, 2))),
    lambda L: kernels.column_sum(L),
    lambda L: kernels.layernorm_forward(L, L, L),
    lambda L: kernels.gelu_forward(L),
    lambda L: kernels.softmax_causal_forward(L, 1.0),
    lambda L: kernels.cross_entropy_forward_backward(L, [0, 1]),
    lambda L: kernels.cross_entropy_forward_backward(np.zeros((2, 2)), L[0]),
    lambda L: kernels.adamw_update(L, L, L, L, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1),
    lambda L: kernels.sum_of_squares(L),
], ids=["matmul", "linear_forward", "column_sum", "layernorm", "gelu", "softmax", "cross_entropy",
        "cross_entropy_targets", "adamw", "sum_of_squares"])
def test_a_list_instead_of_an_array_is_named(call):
    """Every op names the operand that is not an array."""
    with pytest.raises(TypeError, match=r"kernels\.\w+: \w+ must be a numpy or cupy array, got list"):
        call([[1.0, 2.0], [3.0, 4.0]])


# ---------------------------------------------------------------------------
# linear_forward and column_sum (a Linear layer's forward and bias gradient)

BACKENDS = ["numba", "numpy"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C_in,C_out", [(7, 13, 5), (1, 3, 1), (33, 17, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gelu", [False, True])
def test_linear_forward_equals_matmul_bias_gelu(rng, backend, dtype, N, C_in, C_out, bias, gelu):
    x, w = rnd(rng, (N, C_in), dtype), rnd(rng, (C_out, C_in), dtype)
    b = rnd(rng, (C_out,), dtype) if bias else None
    # what engine/model/layers.py did before linear_forward existed: bit for bit the same
    pre_exp = kernels.matmul_nt(x, w, backend=backend)
    if bias:
        pre_exp += b
    y_exp = kernels.gelu_forward(pre_exp, backend=backend) if gelu else pre_exp
    y, pre = kernels.linear_forward(x, w, b, gelu=gelu, backend=backend)
    assert y.dtype == dtype and y.shape == (N, C_out)
    np.testing.assert_array_equal(y, y_exp)
    if gelu:
        np.testing.assert_array_equal(pre, pre_exp)
        assert pre is not y
    else:
        assert pre is None
    # and against plain float64 math
    assert_close(pre_exp, (x.astype(np.float64) @ w.T.astype(np.float64) + (b if bias else 0)).astype(dtype),
                 dtype, scale=10)


def test_linear_forward_takes_strided_operands_like_matmul(rng):
    xt, w = rnd(rng, (13, 7), np.float64).T, rnd(rng, (13, 5), np.float64).T  # (7, 13), (5, 13) views
    y, _ = kernels.linear_forward(xt, w)
    np.testing.assert_array_equal(y, kernels.matmul_nt(xt, w))


def test_linear_forward_errors():
    x, w, b = np.zeros((7, 13), np.float32), np.zeros((5, 13), np.float32), np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"kernels.linear_forward: w has shape \(5, 12\), expected \(5, 13\)"):
        kernels.linear_forward(x, w[:, :12])
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(5,\)"):
        kernels.linear_forward(x, w, b[:4])
    with pytest.raises(ValueError, match="x must be 2D"):
        kernels.linear_forward(x[None], w)
    with pytest.raises(ValueError, match="w must be 2D"):
        kernels.linear_forward(x, w[None])
    with pytest.raises(TypeError, match="w has dtype float64"):
        kernels.linear_forward(x, w.astype(np.float64))
    with pytest.raises(TypeError, match="bias has dtype float64"):
        kernels.linear_forward(x, w, b.astype(np.float64))
    with pytest.raises(kernels.KernelDtypeError, match="x must be float32 or float64"):
        kernels.linear_forward(x.astype(np.float16), w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", [(7, 13), (1, 5), (0, 4), (130, 3)])
def test_column_sum(rng, backend, dtype, N, C):
    x = rnd(rng, (N, C), dtype)
    s = kernels.column_sum(x, backend=backend)
    assert s.dtype == dtype and s.shape == (C,)
    np.testing.assert_array_equal(s, x.sum(axis=0))  # what the engine's bias gradient always was
    assert_close(s, x.astype(np.float64).sum(axis=0).astype(dtype), dtype, scale=10)

    db0 = rnd(rng, (C,), dtype)
    db = db0.copy()
    assert kernels.column_sum(x, out=db, accumulate=True, backend=backend) is db
    exp = db0.copy()
    exp += x.sum(axis=0)
    np.testing.assert_array_equal(db, exp)
    assert kernels.column_sum(x, out=db, backend=backend) is db  # overwritten
    np.testing.assert_array_equal(db, x.sum(axis=0))


def test_column_sum_errors():
    x = np.zeros((7, 13), np.float32)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        kernels.column_sum(x, accumulate=True)
    with pytest.raises(ValueError, match=r"out has shape \(7,\), expected \(13,\)"):
        kernels.column_sum(x, np.zeros(7, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        kernels.column_sum(x, np.zeros(13))
    with pytest.raises(ValueError, match="x must be 2D"):
        kernels.column_sum(x[0])
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.column_sum(x, np.zeros((13, 2), np.float32)[:, 0])


# ---------------------------------------------------------------------------
# bf16 matmul precision (float32 master weights, bf16 GEMM inputs, float32 accumulation)


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
    yield
    kernels.set_matmul_precision("float32")


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_round_to_bf16_rounds_to_nearest_even():
    cases = {  # float32 bits -> bfloat16 bits (as float32: the low 16 bits are zero)
        0x3F800000: 0x3F800000,  # 1.0: exact
        0x3F807FFF: 0x3F800000,  # just below the halfway point: down
        0x3F808000: 0x3F800000,  # tie, kept bits even (0x3F80): stays
        0x3F808001: 0x3F810000,  # just above halfway: up
        0x3F818000: 0x3F820000,  # tie, kept bits odd (0x3F81): up to even
        0xBF808000: 0xBF800000,  # negative tie: magnitude to even, sign kept
        0xBF818000: 0xBF820000,
        0x3FFF8000: 0x40000000,  # carry through the mantissa into the exponent (1.99.. -> 2.0)
        0x7F7F0000: 0x7F7F0000,  # largest bfloat16
        0x7F7FFFFF: 0x7F800000,  # largest float32 rounds past it: inf
        0xFF7FFFFF: 0xFF800000,
        0x7F800000: 0x7F800000,  # inf, -inf
        0xFF800000: 0xFF800000,
        0x00000000: 0x00000000,  # zeros keep their sign
        0x80000000: 0x80000000,
        0x00008000: 0x00000000,  # subnormal tie: to even (zero)
        0x00018000: 0x00020000,
        0x00000001: 0x00000000,
    }
    src = np.array(list(cases), np.uint32).view(np.float32)
    np.testing.assert_array_equal(_bits(kernels.round_to_bf16(src)), np.array(list(cases.values()), np.uint32))
    # NaNs stay NaN, including ones whose payload sits only in the low 16 bits (plain
    # truncation-with-carry would turn 0x7F800001 into inf)
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0xFFFFFFFF, 0x7FBF0000], np.uint32).view(np.float32)
    r = kernels.round_to_bf16(nans)
    assert np.all(np.isnan(r)) and np.all(_bits(r) & 0xFFFF == 0)
    np.testing.assert_array_equal(np.signbit(r), np.signbit(nans))
    # any shape, strided input, input untouched, result float32
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)
    before = x.copy()
    r = kernels.round_to_bf16(x.T)
    assert r.shape == (6, 4) and r.dtype == np.float32
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(r, kernels.round_to_bf16(np.ascontiguousarray(x.T)))


def test_round_to_bf16_matches_a_float64_nearest_even_rounding(rng):
    # independent check: the nearest of the two neighbouring bfloat16 values, ties to
    # the one with an even last bit
    x = np.concatenate([rnd(rng, 20000, np.float32, 100.0), rnd(rng, 20000, np.float32, 1e-30)])
    u = _bits(x)
    lo = (u & 0xFFFF0000).view(np.float32).astype(np.float64)  # toward zero
    hi = ((u & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)  # away from zero
    d_lo, d_hi = np.abs(x - lo), np.abs(hi - x)
    even_lo = ((u >> 16) & 1) == 0
    want = np.where((d_lo < d_hi) | ((d_lo == d_hi) & even_lo), lo, hi)
    np.testing.assert_array_equal(kernels.round_to_bf16(x), want.astype(np.float32))


def test_matmul_precision_default_and_names():
    assert kernels.get_matmul_precision() == "float32"
    assert kernels.MATMUL_PRECISIONS == ("float32", "bf16")
    kernels.set_matmul_precision("bf16")
    assert kernels.get_matmul_precision() == "bf16"
    with pytest.raises(ValueError, match=r"unknown matmul precision 'tf32'; valid names: float32, bf16"):
        kernels.set_matmul_precision("tf32")
    assert kernels.get_matmul_precision() == "bf16"  # a bad name changes nothing
    with pytest.raises(ValueError, match="valid names: float32, bf16"):
        kernels.matmul(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32), precision="fp8")
    kernels.set_matmul_precision("float32")
    assert kernels.get_matmul_precision() == "float32"


def _bf16_expected(a, b, trans_a=False, trans_b=False):
    # float64 products and sums of the bf16-rounded inputs: the exact answer the
    # float32 accumulation approximates
    ar, br = (kernels.round_to_bf16(v).astype(np.float64) for v in (a, b))
    return ref.matmul(ar, br, trans_a=trans_a, trans_b=trans_b)


def _rel_err(got, exp):
    return float(np.max(np.abs(got.astype(np.float64) - exp))) / max(1.0, float(np.max(np.abs(exp))))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_matmul_bf16_is_float32_math_on_rounded_inputs(rng, backend, trans_a, trans_b):
    M, K, N = 7, 61, 5
    a = rnd(rng, (K, M) if trans_a else (M, K), np.float32)
    b = rnd(rng, (N, K) if trans_b else (K, N), np.float32)
    exp = _bf16_expected(a, b, trans_a, trans_b)
    c = kernels.matmul(a, b, trans_a=trans_a, trans_b=trans_b, precision="bf16", backend=backend)
    assert c.dtype == np.float32 and c.shape == (M, N)
    assert _rel_err(c, exp) < 1e-6
    # and it really is coarser than float32: bf16 keeps 8 mantissa bits
    c32 = kernels.matmul(a, b, trans_a=trans_a, trans_b=trans_b, backend=backend)
    assert _rel_err(c32, exp) > 1e-4
    # accumulate: out += op(a) @ op(b), same rounding of the inputs
    out = np.full((M, N), 2.0, np.float32)
    assert kernels.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=True, precision="bf16",
                          backend=backend) is out
    assert _rel_err(out, exp + 2.0) < 1e-6


def test_matmul_bf16_batched_attention_shapes(rng):
    B, H, T, hs = 2, 3, 9, 16
    q, k, v = (rnd(rng, (B, H, T, hs), np.float32) for _ in range(3))
    att = kernels.matmul_nt(q, k, precision="bf16")                      # (B, H, T, T)
    assert _rel_err(att, _bf16_expected(q, k, trans_b=True)) < 1e-6
    y = kernels.matmul(att, v, precision="bf16")                         # (B, H, T, hs)
    assert _rel_err(y, _bf16_expected(att, v)) < 1e-6
    dv = kernels.matmul_tn(att, y, precision="bf16")                     # (B, H, T, hs)
    assert _rel_err(dv, _bf16_expected(att, y, trans_a=True)) < 1e-6


def test_matmul_precision_default_reaches_every_gemm(rng):
    x, w, b = rnd(rng, (7, 13), np.float32), rnd(rng, (5, 13), np.float32), rnd(rng, (5,), np.float32)
    dy = rnd(rng, (7, 5), np.float32)
    explicit = [kernels.matmul(dy, w, precision="bf16"), kernels.matmul_nt(x, w, precision="bf16"),
                kernels.matmul_tn(dy, x, precision="bf16"),
                *kernels.linear_forward(x, w, b, gelu=True, precision="bf16")]
    kernels.set_matmul_precision("bf16")
    default = [kernels.matmul(dy, w), kernels.matmul_nt(x, w), kernels.matmul_tn(dy, x),
               *kernels.linear_forward(x, w, b, gelu=True)]
    for e, d in zip(explicit, default):
        np.testing.assert_array_equal(d, e)
    # a per-call precision overrides the default
    np.testing.assert_array_equal(kernels.matmul_nt(x, w, precision="float32"), x @ w.T)
    # linear_forward under bf16: the bf16 GEMM, then bias and GELU in float32
    pre = kernels.matmul_nt(x, w)
    pre += b
    y, p = kernels.linear_forward(x, w, b, gelu=True)
    np.testing.assert_array_equal(p, pre)
    np.testing.assert_array_equal(y, kernels.gelu_forward(pre))
    assert _rel_err(p, _bf16_expected(x, w, trans_b=True) + b) < 1e-6


def test_bf16_precision_needs_float32():
    a = np.zeros((3, 4))
    with pytest.raises(kernels.KernelDtypeError, match=r"bf16 precision needs float32 operands.*float64.*"
                                                       r"precision='bf16'"):
        kernels.matmul_nt(a, a, precision="bf16")
    with pytest.raises(kernels.KernelDtypeError, match="kernels.linear_forward: bf16 precision needs float32"):
        kernels.linear_forward(a, a, precision="bf16")
    kernels.set_matmul_precision("bf16")  # from the module default: the message says so
    with pytest.raises(kernels.KernelDtypeError, match=r"set_matmul_precision\('bf16'\)"):
        kernels.matmul_tn(a, a)
    # float64 still runs when the call asks for float32 explicitly
    assert kernels.matmul_tn(a, a, precision="float32").shape == (4, 4)


# ---------------------------------------------------------------------------
# layernorm

LN_SHAPES = [(7, 13), (1, 13), (5, 1), (33, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layernorm_numba_vs_reference(rng, dtype, shape):
    N, C = shape
    x = rnd(rng, shape, dtype, 2.0) + dtype(0.5)  # offset: the variance must not cancel
    w, b = rnd(rng, C, dtype), rnd(rng, C, dtype)
    out, mean, rstd = kernels.layernorm_forward(x, w, b)
    out_r, mean_r, rstd_r = kernels.layernorm_forward(x, w, b, backend="numpy")
    assert out.shape == (N, C) and mean.shape == rstd.shape == (N,)
    assert out.dtype == mean.dtype == rstd.dtype == dtype
    assert_close(mean, mean_r, dtype)
    # C=1 rows have zero variance: rstd = 1/sqrt(eps) is large, compare relatively
    assert_close(rstd, rstd_r, dtype)
    assert_close(out, out_r, dtype)

    dout = rnd(rng, shape, dtype)
    # dx is overwritten (start from garbage), dweight/dbias accumulate onto what is there
    dx = np.full(shape, np.nan, dtype)
    dw0, db0 = rnd(rng, C, dtype), rnd(rng, C, dtype)
    dw, db, dw_r, db_r = dw0.copy(), db0.copy(), dw0.copy(), db0.copy()
    assert kernels.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db) is dx
    dx_r = kernels.layernorm_backward(dout, x, w, mean, rstd, None, dw_r, db_r, backend="numpy")
    scale = 1.0 if C > 1 else 1e3  # C=1: dx is ~0 up to rounding times a huge rstd
    assert_close(dx, dx_r, dtype, scale=scale)
    assert_close(dw, dw_r, dtype, scale=N)  # sums over N rows
    assert_close(db, db_r, dtype, scale=N)
    assert_close(db - db0, dout.sum(0, dtype=np.float64).astype(dtype), dtype, scale=N)

    # param grads skipped when None; dx unchanged by that choice
    dx2 = kernels.layernorm_backward(dout, x, w, mean, rstd)
    np.testing.assert_array_equal(dx2, dx)


def test_layernorm_numba_is_deterministic_across_chunks(rng):
    # more rows than one partial-sum chunk, so dweight goes through the chunked reduction
    N, C = 100, 24
    x, w, dout = rnd(rng, (N, C), np.float32), rnd(rng, C, np.float32), rnd(rng, (N, C), np.float32)
    _, mean, rstd = kernels.layernorm_forward(x, w, w)
    dws = []
    for _ in range(3):
        dw = np.zeros(C, np.float32)
        kernels.layernorm_backward(dout, x, w, mean, rstd, dweight=dw)
        dws.append(dw)
    np.testing.assert_array_equal(dws[0], dws[1])
    np.testing.assert_array_equal(dws[0], dws[2])


def _fd_grad(f, arrays, G, h=1e-6):
    """Central differences of L = sum(f(*arrays) * G) w.r.t. each array (float64)."""
    grads = []
    for a in arrays:
        g = np.zeros_like(a)
        it = np.nditer(a, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = a[i]
            a[i] = old + h
            lp = np.sum(f(*arrays) * G)
            a[i] = old - h
            lm = np.sum(f(*arrays) * G)
            a[i] = old
            g[i] = (lp - lm) / (2 * h)
        grads.append(g)
    return grads


def test_layernorm_reference_vs_finite_differences(rng):
    N, C = 3, 5
    x, w, b = rnd(rng, (N, C), np.float64), rnd(rng, C, np.float64), rnd(rng, C, np.float64)
    G = rnd(rng, (N, C), np.float64)
    gx, gw, gb = _fd_grad(lambda x, w, b: ref.layernorm_forward(x, w, b)[0], [x, w, b], G)
    _, mean, rstd = ref.layernorm_forward(x, w, b)
    dw, db = np.zeros(C), np.zeros(C)
    dx = ref.layernorm_backward(G, x, w, mean, rstd, None, dw, db)
    np.testing.assert_allclose(dx, gx, atol=1e-7)
    np.testing.assert_allclose(dw, gw, atol=1e-7)
    np.testing.assert_allclose(db, gb, atol=1e-7)
    # and the forward against the textbook formula
    y = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(ref.layernorm_forward(x, w, b)[0], y, atol=1e-12)


# ---------------------------------------------------------------------------
# gelu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 13), (1,), (3, 2, 5)])
def test_gelu_numba_vs_reference(rng, dtype, shape):
    x = rnd(rng, shape, dtype, 3.0)
    x.flat[0] = 30.0  # saturated tails: tanh -> +-1 exactly, no overflow NaN
    x.flat[-1] = -30.0
    y = kernels.gelu_forward(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, kernels.gelu_forward(x, backend="numpy"), dtype, scale=3)

    dout = rnd(rng, shape, dtype)
    dx = np.full(shape, np.nan, dtype)
    assert kernels.gelu_backward(dout, x, dx) is dx
    assert_close(dx, kernels.gelu_backward(dout, x, backend="numpy"), dtype, scale=3)
    # in place on dout is allowed (read before write)
    expected = dx.copy()
    kernels.gelu_backward(dout, x, dout)
    np.testing.assert_array_equal(dout, expected)


def test_gelu_reference_vs_finite_differences_and_formula(rng):
    x = rnd(rng, (4, 6), np.float64, 2.0)
    G = rnd(rng, (4, 6), np.float64)
    (gx,) = _fd_grad(ref.gelu_forward, [x], G)
    np.testing.assert_allclose(ref.gelu_backward(G, x), gx, atol=1e-8)
    formula = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ref.gelu_forward(x), formula, atol=1e-14)


# ---------------------------------------------------------------------------
# causal softmax

SM_SHAPES = [(3, 2, 5, 5), (1, 1), (2, 6, 6), (4, 1, 1)]  # (..., T, T), incl. T=1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SM_SHAPES)
def test_softmax_causal_numba_vs_reference(rng, dtype, shape):
    T = shape[-1]
    scale = 1.0 / np.sqrt(8)
    s = rnd(rng, shape, dtype, 4.0)
    above = np.triu(np.ones((T, T), bool), 1)
    s[..., above] = np.nan  # masked scores must never be read
    p = kernels.softmax_causal_forward(s, scale)
    p_r = kernels.softmax_causal_forward(s, scale, backend="numpy")
    assert p.dtype == dtype
    assert_close(p, p_r, dtype)
    assert np.all(p[..., above] == 0.0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=TOL[dtype] * T)

    s2 = s.copy()
    assert kernels.softmax_causal_forward(s2, scale, out=s2) is s2  # in place
    np.testing.assert_array_equal(s2, p)

    dp = rnd(rng, shape, dtype)
    dp[..., above] = np.nan  # upstream grads above the diagonal are garbage too
    ds = kernels.softmax_causal_backward(dp, p, scale)
    ds_r = kernels.softmax_causal_backward(dp, p, scale, backend="numpy")
    assert_close(ds, ds_r, dtype)
    assert np.all(ds[..., above] == 0.0)
    assert kernels.softmax_causal_backward(dp, p, scale, out=dp) is dp  # in place
    np.testing.assert_array_equal(dp, ds)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 3, 7, 50])
def test_softmax_causal_with_a_sliding_window_numba_vs_reference(rng, dtype, window):
    """window W: query t sees keys t - W < j <= t (Mistral's and Gemma 3's local layers). Scores
    outside are never read (NaN there), their probabilities are exactly 0, and the backward,
    which takes no window, gives 0 there from those zeros; the bf16 bits come from the same pass."""
    T, scale = 9, 0.37
    s = rnd(rng, (2, 3, T, T), dtype, 4.0)
    t = np.arange(T)
    seen = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    s[..., ~seen] = np.nan
    p = kernels.softmax_causal_forward(s, scale, window=window)
    p_r = kernels.softmax_causal_forward(s, scale, window=window, backend="numpy")
    assert_close(p, p_r, dtype)
    assert np.all(p[..., ~seen] == 0.0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=TOL[dtype] * T)
    s2 = s.copy()
    np.testing.assert_array_equal(kernels.softmax_causal_forward(s2, scale, out=s2, window=window), p)
    if dtype == np.float32:
        bits = np.zeros(s.shape, np.uint16)
        kernels.softmax_causal_forward(s.copy(), scale, window=window, bf16_out=bits)
        np.testing.assert_array_equal(bits, kernels.to_bf16(p))
    dp = rnd(rng, s.shape, dtype)
    ds = kernels.softmax_causal_backward(dp, p, scale)
    assert_close(ds, kernels.softmax_causal_backward(dp, p, scale, backend="numpy"), dtype)
    assert np.all(ds[..., ~seen] == 0.0)
    with pytest.raises(ValueError, match="window must be a whole number >= 0"):
        kernels.softmax_causal_forward(s, scale, window=-1)


def test_softmax_causal_reference_vs_finite_differences(rng):
    scale = 0.7
    s = rnd(rng, (2, 4, 4), np.float64)
    G = rnd(rng, (2, 4, 4), np.float64)
    (gs,) = _fd_grad(lambda s: ref.softmax_causal_forward(s, scale), [s], G)
    p = ref.softmax_causal_forward(s, scale)
    np.testing.assert_allclose(ref.softmax_causal_backward(G, p, scale), gs, atol=1e-8)
    # forward against a per-row loop
    for b in range(2):
        for t in range(4):
            z = np.exp(scale * s[b, t, : t + 1] - np.max(scale * s[b, t, : t + 1]))
            np.testing.assert_allclose(p[b, t, : t + 1], z / z.sum(), atol=1e-15)


# ---------------------------------------------------------------------------
# cross-entropy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,V", [(7, 37), (1, 37), (5, 1)])
def test_cross_entropy_numba_vs_reference(rng, dtype, N, V):
    logits = rnd(rng, (N, V), dtype, 3.0)
    targets = rng.integers(0, V, N).astype(np.int32)  # any integer dtype is accepted
    gs = 1.0 / N

    losses, none = kernels.cross_entropy_forward_backward(logits, targets)
    assert none is None and losses.shape == (N,) and losses.dtype == dtype
    losses_r, _ = kernels.cross_entropy_forward_backward(logits, targets, backend="numpy")
    assert_close(losses, losses_r, dtype, scale=2)

    dl = np.full((N, V), np.nan, dtype)
    l2, d = kernels.cross_entropy_forward_backward(logits, targets, dl, grad_scale=gs)
    assert d is dl
    assert_close(l2, losses, dtype, scale=2)  # same math, differently ordered row sums
    _, dl_r = kernels.cross_entropy_forward_backward(logits, targets, np.empty_like(logits), gs, backend="numpy")
    assert_close(dl, dl_r, dtype)

    # in place on logits, both backends
    for be in ("numba", "numpy"):
        lg = logits.copy()
        l3, d3 = kernels.cross_entropy_forward_backward(lg, targets, lg, gs, backend=be)
        assert d3 is lg
        assert_close(l3, losses_r, dtype, scale=2)
        assert_close(lg, dl_r, dtype)


def test_cross_entropy_reference_vs_finite_differences(rng):
    N, V = 3, 7
    logits, targets = rnd(rng, (N, V), np.float64), rng.integers(0, V, N)
    (gl,) = _fd_grad(lambda lg: ref.cross_entropy_forward_backward(lg, targets)[0], [logits], np.ones(N))
    _, dl = ref.cross_entropy_forward_backward(logits, targets, np.empty_like(logits), grad_scale=1.0)
    np.testing.assert_allclose(dl, gl, atol=1e-8)
    _, dl2 = ref.cross_entropy_forward_backward(logits, targets, np.empty_like(logits), grad_scale=0.37)
    np.testing.assert_allclose(dl2, 0.37 * gl, atol=1e-8)
    # losses against log-softmax written out
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(ref.cross_entropy_forward_backward(logits, targets)[0],
                               -logp[np.arange(N), targets], atol=1e-14)


def test_cross_entropy_large_logits_stay_finite():
    logits = np.array([[1000.0, 0.0, -1000.0], [-1e4, 1e4, 0.0]], np.float32)
    targets = np.array([0, 0])
    losses, dl = kernels.cross_entropy_forward_backward(logits, targets, np.empty_like(logits))
    np.testing.assert_allclose(losses, [0.0, 2e4], rtol=1e-6)
    np.testing.assert_allclose(dl, [[0, 0, 0], [-1, 1, 0]], atol=1e-6)
    # a NaN logit must surface as a NaN loss (divergence detection), not be masked
    bad = np.array([[0.0, np.nan, 1.0], [np.nan, 0.0, 1.0], [0.0, 1.0, 2.0]], np.float32)
    for be in ("numba", "numpy"):
        losses, _ = kernels.cross_entropy_forward_backward(bad, np.array([0, 1, 2]), backend=be)
        assert np.isnan(losses[0]) and np.isnan(losses[1]) and np.isfinite(losses[2])


# ---------------------------------------------------------------------------
# optimizers and sum_of_squares

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _masks(rng, n):
    m = (rng.random(n) < 0.6).astype(np.uint8)
    return {"none": None, "uint8": m, "bool": m.astype(bool), "float": m.astype(np.float64) * 0.5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "uint8", "bool", "float"])
def test_adamw_numba_vs_reference(rng, dtype, mask_kind):
    n = 1031
    mask = _masks(rng, n)[mask_kind]
    if mask is not None and mask.dtype.kind == "f":
        mask = mask.astype(dtype)
    p, g = rnd(rng, n, dtype), rnd(rng, n, dtype)
    state = [p, np.zeros(n, dtype), np.zeros(n, dtype)]
    state_r = [a.copy() for a in state]
    for step in range(1, 4):
        g = rnd(rng, n, dtype)
        kernels.adamw_update(state[0], g, state[1], state[2], step=step, wd_mask=mask, **HP)
        kernels.adamw_update(state_r[0], g, state_r[1], state_r[2], step=step, wd_mask=mask, backend="numpy", **HP)
    for a, b in zip(state, state_r):
        assert_close(a, b, dtype, scale=3)


def test_adamw_reference_vs_scalar_formula(rng):
    n = 5
    p, m, v = rnd(rng, n, np.float64), rnd(rng, n, np.float64), np.abs(rnd(rng, n, np.float64))
    g, mask = rnd(rng, n, np.float64), np.array([1, 0, 1, 1, 0], np.uint8)
    want = []
    b1, b2, step = HP["beta1"], HP["beta2"], 7
    for i in range(n):
        mi = b1 * m[i] + (1 - b1) * g[i]
        vi = b2 * v[i] + (1 - b2) * g[i] ** 2
        mhat, vhat = mi / (1 - b1**step), vi / (1 - b2**step)
        pi = p[i] - HP["lr"] * (mhat / (np.sqrt(vhat) + HP["eps"]) + HP["weight_decay"] * mask[i] * p[i])
        want.append((pi, mi, vi))
    ref.adamw_update(p, g, m, v, step=step, wd_mask=mask, **HP)
    np.testing.assert_allclose(np.stack([p, m, v], 1), np.array(want), atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "uint8"])
def test_sgd_momentum_numba_vs_reference_and_formula(rng, dtype, mask_kind):
    n = 1031
    mask = _masks(rng, n)[mask_kind]
    p = rnd(rng, n, dtype)
    buf = np.zeros(n, dtype)
    p_r, buf_r = p.copy(), buf.copy()
    p64, buf64 = p.astype(np.float64), np.zeros(n)
    hp = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    mk = 1.0 if mask is None else mask
    for _ in range(3):
        g = rnd(rng, n, dtype)
        kernels.sgd_momentum_update(p, g, buf, wd_mask=mask, **hp)
        kernels.sgd_momentum_update(p_r, g, buf_r, wd_mask=mask, backend="numpy", **hp)
        buf64 = hp["momentum"] * buf64 + (g + hp["weight_decay"] * mk * p64)  # PyTorch, no dampening
        p64 = p64 - hp["lr"] * buf64
    assert_close(p, p_r, dtype, scale=3)
    assert_close(buf, buf_r, dtype, scale=3)
    assert_close(p_r, p64.astype(dtype), dtype, scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, 37, 3 * 16384 + 7])
def test_sum_of_squares(rng, dtype, n):
    x = rnd(rng, n, dtype)
    want = float(np.sum(x.astype(np.float64) ** 2))
    for be in ("numba", "numpy"):
        got = kernels.sum_of_squares(x, backend=be)
        assert isinstance(got, float)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_sum_of_squares_accumulates_in_float64():
    # float32 has an ulp of 8 at 1e8, so a float32 running sum would drop every +1
    x = np.ones(1001, np.float32)
    x[0] = 1e4
    assert kernels.sum_of_squares(x) == 1e8 + 1000


# ---------------------------------------------------------------------------
# validation


def test_validation_errors(rng):
    x, w = np.zeros((7, 13), np.float32), np.zeros(13, np.float32)
    with pytest.raises(ValueError, match=r"weight has shape \(12,\), expected \(13,\)"):
        kernels.layernorm_forward(x, w[:12].copy(), w)
    with pytest.raises(TypeError, match="bias has dtype float64"):
        kernels.layernorm_forward(x, w, w.astype(np.float64))
    with pytest.raises(ValueError, match="float32 or float64"):  # KernelDtypeError is both
        kernels.gelu_forward(x.astype(np.float16))
    with pytest.raises(ValueError, match="must be 2D"):
        kernels.layernorm_forward(x[None], w, w)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.gelu_forward(x, out=np.zeros((13, 7), np.float32).T)
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        kernels.softmax_causal_forward(np.zeros((2, 3, 4)), 1.0)
    with pytest.raises(ValueError, match="dx has shape"):
        kernels.layernorm_backward(x, x, w, w[:7], w[:7], dx=np.zeros((7, 12), np.float32))

    logits = np.zeros((4, 37), np.float32)
    with pytest.raises(ValueError, match=r"target 37 out of range \[0, 37\)"):
        kernels.cross_entropy_forward_backward(logits, np.array([0, 1, 37, 2]))
    with pytest.raises(ValueError, match="target -1 out of range"):
        kernels.cross_entropy_forward_backward(logits, np.array([0, -1, 3, 2]), backend="numpy")
    with pytest.raises(TypeError, match="integer"):
        kernels.cross_entropy_forward_backward(logits, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="targets has shape"):
        kernels.cross_entropy_forward_backward(logits, np.zeros(5, np.int64))

    p = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="grad has shape"):
        kernels.adamw_update(p, np.zeros(7, np.float32), p.copy(), p.copy(), step=1, **HP)
    with pytest.raises(ValueError, match="1-based"):
        kernels.adamw_update(p, p.copy(), p.copy(), p.copy(), step=0, **HP)
    with pytest.raises(TypeError, match="wd_mask"):
        kernels.sgd_momentum_update(p, p.copy(), p.copy(), lr=0.1, momentum=0.9, wd_mask=np.zeros(8, np.int64))


def test_noncontiguous_inputs_are_accepted(rng):
    xt = rnd(rng, (13, 7), np.float64).T  # (7, 13) view, not C-contiguous
    w, b = rnd(rng, 13, np.float64), rnd(rng, 13, np.float64)
    out, _, _ = kernels.layernorm_forward(xt, w, b)
    assert_close(out, ref.layernorm_forward(np.ascontiguousarray(xt), w, b)[0], np.float64)
    assert_close(kernels.gelu_forward(xt), ref.gelu_forward(xt), np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_outputs_are_refused_and_strided_grads_copied(backend):
    x = np.ones((4, 8), np.float32)
    out = np.empty_like(x)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="kernels.gelu_forward: output out is read-only"):
        kernels.gelu_forward(x, out, backend=backend)
    # grad is an input: a strided one is copied, like every other input
    p, m, v = np.ones(16, np.float32), np.zeros(16, np.float32), np.zeros(16, np.float32)
    g2 = np.arange(32, dtype=np.float32)
    p_ref = p.copy()
    kernels.adamw_update(p_ref, g2[::2].copy(), m.copy(), v.copy(), lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                         weight_decay=0.1, step=1, backend=backend)
    kernels.adamw_update(p, g2[::2], m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=1,
                         backend=backend)
    np.testing.assert_array_equal(p, p_ref)
    mask = np.ones(16, bool)
    mask.flags.writeable = False          # an input: read-only is fine
    kernels.sgd_momentum_update(p, g2[::2], np.zeros(16, np.float32), lr=1e-2, momentum=0.9, wd_mask=mask,
                                backend=backend)
    p.flags.writeable = False
    with pytest.raises(ValueError, match="output param is read-only"):
        kernels.sgd_momentum_update(p, g2[::2], np.zeros(16, np.float32), lr=1e-2, momentum=0.9, backend=backend)
