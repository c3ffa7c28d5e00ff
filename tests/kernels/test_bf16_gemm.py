"""The CPU's bf16 GEMM (kernels/bf16.py): oneDNN's bf16 x bf16 -> float32 GEMM behind
kernels.matmul(..., precision="bf16") where the CPU has bf16 dot products, the emulation
(round to bf16 values, float32 BLAS) elsewhere or when RINGPIPE_BF16_GEMM says so.

The native tests skip, saying why, where the CPU lacks the instructions or oneDNN is
not installed (the `bf16` extra); the fallback and error tests run everywhere."""

import numpy as np
import pytest

from ringpipe import kernels
from ringpipe.kernels import bf16, onednn
from ringpipe.kernels import reference as ref

SHAPES = [(1, 1, 1), (7, 13, 5), (129, 65, 257), (1, 300, 2), (64, 1, 513), (33, 47, 1)]
TRANSPOSES = [(False, False), (False, True), (True, False), (True, True)]


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    # each test chooses again, under its own environment and detection
    monkeypatch.delenv(bf16.ENV, raising=False)
    bf16.reset()
    yield
    bf16.reset()


@pytest.fixture
def rng():
    return np.random.default_rng(25)


def _native_or_skip():
    try:
        lib = bf16.native()
    except bf16.Bf16Unavailable as exc:   # only with RINGPIPE_BF16_GEMM=native, which the fixture unset
        pytest.skip(str(exc))
    if lib is None:
        pytest.skip(f"no native bf16 GEMM here: {bf16.describe()}")
    return lib


def _operands(rng, M, N, K, ta, tb):
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    return a, b


def _check_bf16_accuracy(c, a, b, ta, tb, label):
    """c against float64 references: the exact product of the bf16-rounded inputs up to
    float32 accumulation, and the unrounded float64 product up to bf16's rounding."""
    ar, br = (kernels.round_to_bf16(v).astype(np.float64) for v in (a, b))
    exact = ref.matmul(ar, br, trans_a=ta, trans_b=tb)
    mag = ref.matmul(np.abs(ar), np.abs(br), trans_a=ta, trans_b=tb)   # sum |a||b| per element
    K = a.shape[0] if ta else a.shape[-1]
    # float32 accumulation: at most K roundings of 2^-24 of the running |sum| <= mag
    assert np.all(np.abs(c - exact) <= (K + 2) * 2.0**-24 * mag + 1e-30), label + " vs rounded inputs"
    full = ref.matmul(a.astype(np.float64), b.astype(np.float64), trans_a=ta, trans_b=tb)
    # bf16 inputs: each factor off by at most 2^-9 relative, so a product by ~2^-8
    assert np.all(np.abs(c - full) <= 2.0**-7 * mag + 1e-30), label + " vs float64"


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("ta,tb", TRANSPOSES)
def test_native_gemm_matches_float64_at_bf16_tolerance(rng, M, N, K, ta, tb):
    _native_or_skip()
    a, b = _operands(rng, M, N, K, ta, tb)
    label = f"{M}x{N}x{K} ta={ta} tb={tb}"
    c = kernels.matmul(a, b, trans_a=ta, trans_b=tb, precision="bf16")
    assert c.dtype == np.float32 and c.shape == (M, N)
    _check_bf16_accuracy(c, a, b, ta, tb, label)
    # the same call again gives the same bits (the parity tests rely on it)
    np.testing.assert_array_equal(kernels.matmul(a, b, trans_a=ta, trans_b=tb, precision="bf16"), c)
    # transposed views (rounded as their base, flag flipped), bf16 operands, mixed
    at = np.ascontiguousarray(np.swapaxes(a, 0, 1)).T
    bt = np.ascontiguousarray(np.swapaxes(b, 0, 1)).T
    for name, x, y in (("views", at, bt), ("bf16 bits", kernels.to_bf16(a), kernels.to_bf16(b)),
                       ("bits x float32", kernels.to_bf16(a), b), ("float32 x bits", a, kernels.to_bf16(b))):
        got = kernels.matmul(x, y, trans_a=ta, trans_b=tb, precision="bf16")
        np.testing.assert_allclose(got, c, rtol=0, atol=4 * (K + 2) * 2.0**-24 * max(1.0, float(np.abs(c).max())),
                                   err_msg=f"{label} {name}")
    # out= overwritten, and accumulate=True adds into it
    out = np.full((M, N), np.nan, np.float32)
    assert kernels.matmul(a, b, out, trans_a=ta, trans_b=tb, precision="bf16") is out
    np.testing.assert_array_equal(out, c)
    out[...] = 2.0
    assert kernels.matmul(a, b, out, trans_a=ta, trans_b=tb, accumulate=True, precision="bf16") is out
    ar, br = (kernels.round_to_bf16(v).astype(np.float64) for v in (a, b))
    mag = ref.matmul(np.abs(ar), np.abs(br), trans_a=ta, trans_b=tb) + 2.0
    assert np.all(np.abs(out - (ref.matmul(ar, br, trans_a=ta, trans_b=tb) + 2.0)) <= (K + 3) * 2.0**-24 * mag), \
        label + " accumulate"


def test_native_batched_broadcast_and_strided_out(rng):
    _native_or_skip()
    B, H, T, hs = 2, 3, 9, 16
    q, k, v = (rng.standard_normal((B, H, T, hs)).astype(np.float32) for _ in range(3))
    att = kernels.matmul_nt(q, k, precision="bf16")
    _check_bf16_accuracy(att.reshape(-1, T, T)[4], q.reshape(-1, T, hs)[4], k.reshape(-1, T, hs)[4], False, True,
                         "q k^T")
    emu = ref.matmul(q, k, trans_b=True, precision="bf16")
    np.testing.assert_allclose(att, emu, rtol=0, atol=1e-5)
    # a 2D operand broadcast over the batch (a weight against a batch of activations)
    w = rng.standard_normal((hs, 5)).astype(np.float32)
    y = kernels.matmul(v, w, precision="bf16")
    assert y.shape == (B, H, T, 5)
    np.testing.assert_allclose(y, ref.matmul(v, w, precision="bf16"), rtol=0, atol=1e-5)
    # into a slice of a bigger buffer, then into a strided view (through a temporary)
    buf = np.zeros((3, B, H, T, T), np.float32)
    kernels.matmul_nt(q, k, out=buf[1], precision="bf16")
    np.testing.assert_array_equal(buf[1], att)
    assert not buf[0].any() and not buf[2].any()
    wide = np.ones((B, H, T, 2 * T), np.float32)
    kernels.matmul_nt(q, k, out=wide[..., ::2], accumulate=True, precision="bf16")
    np.testing.assert_allclose(wide[..., ::2], att + 1.0, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(wide[..., 1::2], 1.0)


def test_native_linear_forward_with_a_bf16_weight(rng):
    _native_or_skip()
    x = rng.standard_normal((37, 24)).astype(np.float32)
    w = rng.standard_normal((11, 24)).astype(np.float32)
    bias = rng.standard_normal(11).astype(np.float32)
    y, pre = kernels.linear_forward(x, w, bias, gelu=True, precision="bf16")
    y16, pre16 = kernels.linear_forward(x, kernels.to_bf16(w), bias, gelu=True)   # bf16 weight: bf16 GEMM
    np.testing.assert_array_equal(pre16, pre)
    np.testing.assert_array_equal(y16, y)
    _check_bf16_accuracy(pre - bias, x, w, False, True, "linear_forward")
    # empty and K = 0 GEMMs
    assert kernels.matmul(np.zeros((0, 3), np.float32), w[:3], precision="bf16").shape == (0, 24)
    out = np.full((4, 5), 3.0, np.float32)
    kernels.matmul(np.zeros((4, 0), np.float32), np.zeros((0, 5), np.float32), out, accumulate=True,
                   precision="bf16")
    np.testing.assert_array_equal(out, 3.0)
    np.testing.assert_array_equal(kernels.matmul(np.zeros((4, 0), np.float32), np.zeros((0, 5), np.float32),
                                                 precision="bf16"), 0.0)


def test_set_num_threads_reaches_the_native_gemm(rng):
    lib = _native_or_skip()
    if not lib.openmp:
        pytest.skip(f"{lib.describe()} does not run on OpenMP")
    import ctypes

    omp = ctypes.CDLL("libgomp.so.1")
    before = kernels.get_num_threads()
    try:
        kernels.set_num_threads(1)
        assert omp.omp_get_max_threads() == 1
        a, b = _operands(rng, 65, 33, 129, False, False)
        _check_bf16_accuracy(kernels.matmul(a, b, precision="bf16"), a, b, False, False, "1 thread")
    finally:
        kernels.set_num_threads(before)
    assert omp.omp_get_max_threads() == before


def test_to_bf16_rounds_as_round_to_bf16(rng):
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 5000),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                                  np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-45], np.float32)])
    x = x.astype(np.float32)
    want = kernels.round_to_bf16(x).view(np.uint32) >> 16
    np.testing.assert_array_equal(kernels.to_bf16(x), want.astype(np.uint16))
    # payload NaNs stay NaN, strided and transposed inputs round the same
    nan = np.array([0x7F800001, 0xFF80FFFF], np.uint32).view(np.float32)
    assert np.isnan(kernels.from_bf16(kernels.to_bf16(nan))).all()
    m = x[:4800].reshape(60, 80)
    np.testing.assert_array_equal(kernels.to_bf16(m.T), kernels.to_bf16(np.ascontiguousarray(m.T)))
    rows = np.zeros((m.shape[1] + 2, m.shape[0]), np.uint16)
    assert kernels.to_bf16(m.T, out=rows[1:-1]) is not None        # into rows of a larger array
    np.testing.assert_array_equal(rows[1:-1], kernels.to_bf16(m.T))
    assert not rows[0].any() and not rows[-1].any()
    with pytest.raises(kernels.KernelDtypeError, match="C-contiguous uint16"):
        kernels.to_bf16(m, out=np.zeros(m.shape, np.float32))
    np.testing.assert_array_equal(kernels.to_bf16(m[::3, 1::2]), kernels.to_bf16(np.ascontiguousarray(m[::3, 1::2])))
    np.testing.assert_array_equal(kernels.from_bf16(kernels.to_bf16(m)), kernels.round_to_bf16(m))
    np.testing.assert_array_equal(bf16.round_values(x).view(np.uint32), kernels.round_to_bf16(x).view(np.uint32))
    np.testing.assert_array_equal(bf16.round_values(m.T), kernels.round_to_bf16(m.T))
    with pytest.raises(kernels.KernelDtypeError, match="to_bf16: x must be float32"):
        kernels.to_bf16(m.astype(np.float64))


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_softmax_bf16_out_is_to_bf16_of_the_float32_result(rng, backend):
    # the fused softmaxes' bf16 bits (the Numba kernels round in the same pass, the reference
    # afterwards) are exactly to_bf16 of their float32 results, which stay as they were
    s = (rng.standard_normal((2, 3, 37, 37)) * 4).astype(np.float32)
    dp = rng.standard_normal(s.shape).astype(np.float32)
    p = kernels.softmax_causal_forward(s, 0.3, backend=backend)
    bits = np.full(s.shape, 7, np.uint16)
    p2 = kernels.softmax_causal_forward(s.copy(), 0.3, bf16_out=bits, backend=backend)
    np.testing.assert_array_equal(p2, p)
    np.testing.assert_array_equal(bits, kernels.to_bf16(p))
    ds = kernels.softmax_causal_backward(dp, p, 0.3, backend=backend)
    dbits = np.full(s.shape, 7, np.uint16)
    assert kernels.softmax_causal_backward(dp, p, 0.3, bf16_out=dbits, backend=backend) is dbits
    np.testing.assert_array_equal(dbits, kernels.to_bf16(ds))
    with pytest.raises(kernels.KernelDtypeError, match="bf16_out takes the bf16 bits"):
        kernels.softmax_causal_forward(s, 0.3, bf16_out=np.zeros(s.shape, np.float32), backend=backend)
    with pytest.raises(ValueError, match="not both"):
        kernels.softmax_causal_backward(dp, p, 0.3, out=np.empty_like(p), bf16_out=dbits, backend=backend)


@pytest.mark.parametrize("how", ["variable", "no instructions", "no library"])
def test_fallback_is_the_emulation(rng, monkeypatch, capsys, how):
    if how == "variable":
        monkeypatch.setenv(bf16.ENV, "emulate")
    elif how == "no instructions":
        monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda path=None: ())
    else:
        monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda path=None: ("avx512_bf16",))
        monkeypatch.setattr(onednn, "library", lambda: (None, f"no oneDNN library is installed ({onednn.INSTALL_HINT})"))
    a, b = _operands(rng, 19, 23, 70, False, True)
    for _ in range(2):
        c = kernels.matmul_nt(a, b, precision="bf16")
    assert bf16.native() is None
    # exactly today's path: round to bf16 values, float32 BLAS (views too: copied as the reference does)
    np.testing.assert_array_equal(c, ref.matmul(a, b, trans_b=True, precision="bf16"))
    bt = np.ascontiguousarray(b.T).T
    np.testing.assert_array_equal(kernels.matmul_nt(a, bt, precision="bf16"),
                                  ref.matmul(a, bt, trans_b=True, precision="bf16"))
    # bf16 operands widen exactly: the same numbers
    np.testing.assert_array_equal(kernels.matmul_nt(kernels.to_bf16(a), kernels.to_bf16(b)), c)
    err = capsys.readouterr().err
    if how == "variable":
        assert err == "" and "emulated" in bf16.describe() and "RINGPIPE_BF16_GEMM=emulate" in bf16.describe()
    else:
        # auto mode says why, once
        assert err.count("note: bf16 GEMMs are emulated") == 1, err
        assert ("no bf16 dot-product instructions" if how == "no instructions" else "pip install") in err


def test_native_forced_where_it_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(bf16.ENV, "native")
    monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda path=None: ())
    a = np.ones((3, 4), np.float32)
    with pytest.raises(bf16.Bf16Unavailable, match=r"RINGPIPE_BF16_GEMM=native, but this CPU has no bf16 "
                                                   r"dot-product instructions.*set it to emulate"):
        kernels.matmul_nt(a, a, precision="bf16")
    bf16.reset()
    monkeypatch.setattr(bf16, "cpu_bf16_flags", lambda path=None: ("avx512_bf16",))
    monkeypatch.setattr(onednn, "library", lambda: (None, f"no oneDNN library is installed ({onednn.INSTALL_HINT})"))
    with pytest.raises(bf16.Bf16Unavailable, match=r"no oneDNN library is installed \(pip install"):
        kernels.matmul_nt(a, a, precision="bf16")
    # float32 GEMMs never ask
    assert kernels.matmul_nt(a, a).shape == (3, 3)
    bf16.reset()
    monkeypatch.setenv(bf16.ENV, "fast")
    with pytest.raises(ValueError, match="RINGPIPE_BF16_GEMM='fast': valid values are auto, native, emulate"):
        kernels.matmul_nt(a, a, precision="bf16")


def test_bf16_operand_dtype_rules(rng):
    a16 = kernels.to_bf16(np.ones((3, 4), np.float32))
    with pytest.raises(kernels.KernelDtypeError, match="matmul: b has dtype float64; beside a bf16 operand"):
        kernels.matmul_nt(a16, np.ones((3, 4)))
    with pytest.raises(kernels.KernelDtypeError, match="out has dtype float64"):
        kernels.matmul_nt(a16, a16, out=np.zeros((3, 3)))
    with pytest.raises(kernels.KernelDtypeError, match="from_bf16: x must hold bf16"):
        kernels.from_bf16(np.ones(3, np.float32))
    # bf16 operands make a bf16 GEMM even under precision="float32": their values are bf16 already
    np.testing.assert_array_equal(kernels.matmul_nt(a16, a16, precision="float32"), np.full((3, 3), 4.0))
    # the reference backend widens them and runs the emulation
    np.testing.assert_array_equal(kernels.matmul_nt(a16, a16, backend="numpy"), np.full((3, 3), 4.0))


def test_ml_dtypes_bfloat16_operands_are_bf16_bits(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is optional: uint16 bits are the bf16 operands")
    a, b = _operands(rng, 9, 11, 70, False, True)
    ab = a.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ab.view(np.uint16), kernels.to_bf16(a))    # the same rounding
    want = kernels.matmul_nt(kernels.to_bf16(a), b)
    np.testing.assert_array_equal(kernels.matmul_nt(ab, b), want)
    np.testing.assert_array_equal(kernels.from_bf16(ab), kernels.round_to_bf16(a))


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx_vnni\n")
    assert bf16.cpu_bf16_flags(str(f)) == ("avx512_bf16",)
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert bf16.cpu_bf16_flags(str(f)) == ()
    assert bf16.cpu_bf16_flags(str(tmp_path / "missing")) == ()
