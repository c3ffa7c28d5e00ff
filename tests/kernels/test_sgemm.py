"""The float32 GEMM through oneDNN's sgemm where it is faster on this host (kernels/sgemm.py;
issue 35): the same products as numpy's BLAS to float32 rounding for every layout kernels.matmul
takes, the choice made once and cached per host, and the settings that force one."""
import json
import os

import numpy as np
import pytest

from ringpipe import kernels
from ringpipe.kernels import onednn, sgemm

needs_onednn = pytest.mark.skipif(onednn.library()[0] is None, reason="oneDNN (the bf16 extra) is not installed")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch, tmp_path):
    """Each test chooses anew, caching in its own folder (never the user's cache)."""
    monkeypatch.setenv("RINGPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(sgemm.ENV, raising=False)
    sgemm.reset()
    yield
    sgemm.reset()


def _ref(a, b, ta, tb):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.matmul(np.swapaxes(a64, -1, -2) if ta else a64, np.swapaxes(b64, -1, -2) if tb else b64)


@needs_onednn
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_onednn_products_match_the_blas_for_every_layout(monkeypatch, ta, tb):
    monkeypatch.setenv(sgemm.ENV, "onednn")
    rng = np.random.default_rng(0)
    M, K, N = 96, 80, 64                                        # 491,520 multiply-adds: oneDNN's
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    assert sgemm.wants(a, b, None, ta, tb)
    got = kernels.matmul(a, b, trans_a=ta, trans_b=tb)
    np.testing.assert_allclose(got, _ref(a, b, ta, tb), rtol=1e-4, atol=1e-4)
    # a transposed view (the library reads it as its base, flag flipped), and a strided copy-needing view
    at = np.ascontiguousarray(a.T).T
    np.testing.assert_allclose(kernels.matmul(at, b, trans_a=ta, trans_b=tb), got, rtol=1e-5, atol=1e-5)
    wide = np.zeros((a.shape[0], 2 * a.shape[1]), np.float32)
    wide[:, ::2] = a
    np.testing.assert_allclose(kernels.matmul(wide[:, ::2], b, trans_a=ta, trans_b=tb), got, rtol=1e-5, atol=1e-5)
    # accumulate adds into out, and a non-contiguous out is written through a temporary
    out = np.ones((M, N), np.float32)
    kernels.matmul(a, b, out, trans_a=ta, trans_b=tb, accumulate=True)
    np.testing.assert_allclose(out, got + 1, rtol=1e-5, atol=1e-5)
    big = np.zeros((M, 2 * N), np.float32)
    kernels.matmul(a, b, big[:, ::2], trans_a=ta, trans_b=tb)
    np.testing.assert_allclose(big[:, ::2], got, rtol=1e-5, atol=1e-5)
    assert not big[:, 1::2].any()


@needs_onednn
def test_batched_and_broadcast_gemms_and_small_ones_left_to_numpy(monkeypatch):
    monkeypatch.setenv(sgemm.ENV, "onednn")
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 2, 64, 48), dtype=np.float32)
    b = rng.standard_normal((2, 48, 64), dtype=np.float32)        # broadcast over the first dim
    np.testing.assert_allclose(kernels.matmul(a, b), _ref(a, b, False, False), rtol=1e-4, atol=1e-4)
    w = rng.standard_normal((64, 48), dtype=np.float32)
    np.testing.assert_allclose(kernels.matmul(a, w, trans_b=True), _ref(a, w, False, True), rtol=1e-4, atol=1e-4)
    # what the library cannot do safely goes to numpy: a read-only or overlapping out, vectors
    ro = np.zeros((64, 64), np.float32)
    ro.flags.writeable = False
    sq = rng.standard_normal((64, 64), dtype=np.float32)
    assert not sgemm.wants(sq, sq, ro) and not sgemm.wants(sq, sq, sq) and sgemm.wants(sq, sq, None)
    with pytest.raises(ValueError):
        kernels.matmul(sq, sq, ro)
    assert not sgemm.wants(sq[0], sq, None)
    small = rng.standard_normal((8, 8), dtype=np.float32)
    assert not sgemm.wants(small, small, None)                    # 512 multiply-adds: numpy's
    assert not sgemm.wants(a.astype(np.float64), b.astype(np.float64), None)
    np.testing.assert_array_equal(kernels.matmul(small, small), small @ small)


@needs_onednn
def test_the_choice_is_calibrated_once_and_cached_per_host(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(sgemm, "calibrate", lambda lib: calls.append(1) or {"blas": 100.0, "onednn": 200.0})
    name, why = sgemm.choice()
    assert name == "onednn" and "oneDNN 200.0 vs BLAS 100.0 GFLOP/s" in why and "calibrated now" in why
    files = os.listdir(tmp_path / "cache")
    assert len(files) == 1 and files[0].startswith("sgemm-") and files[0].endswith(".json")
    record = json.loads((tmp_path / "cache" / files[0]).read_text())
    assert record["format"] == "ringpipe-sgemm-choice" and record["choice"] == "onednn"
    assert record["key"]["threads"] >= 1 and "onednn" in record["key"]
    # a later process (the state forgotten) reads it: no second measurement
    sgemm.reset()
    assert sgemm.choice()[0] == "onednn" and "cached in" in sgemm.choice()[1] and calls == [1]
    assert "dnnl_sgemm" in kernels.float32_gemm()
    # not faster by the margin: the BLAS stays
    for f in files:
        os.unlink(tmp_path / "cache" / f)
    sgemm.reset()
    monkeypatch.setattr(sgemm, "calibrate", lambda lib: {"blas": 100.0, "onednn": 110.0})
    assert sgemm.choice()[0] == "blas" and "numpy's BLAS" in kernels.float32_gemm()


@needs_onednn
def test_a_damaged_or_foreign_cache_file_is_measured_again_and_a_foreign_one_never_replaced(monkeypatch, tmp_path):
    monkeypatch.setattr(sgemm, "calibrate", lambda lib: {"blas": 100.0, "onednn": 300.0})
    path = sgemm._cache_path(sgemm.host_key(onednn.library()[0]))
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write('{"not": "ours"}')
    assert sgemm.choice()[0] == "onednn" and "calibrated now" in sgemm.choice()[1]
    with open(path) as f:
        assert json.load(f) == {"not": "ours"}                    # left as it was
    with open(path, "w") as f:
        f.write('{"format": "ringpipe-sgemm-choice", "choice": "fast"')   # ours, cut short
    sgemm.reset()
    assert sgemm.choice()[0] == "onednn"
    with open(path) as f:
        assert json.load(f)["choice"] == "onednn"                 # ours: replaced, atomically


def test_the_settings_force_a_library_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv(sgemm.ENV, "blas")
    assert sgemm.choice() == ("blas", "RINGPIPE_SGEMM=blas")
    sgemm.reset()
    monkeypatch.setenv(sgemm.ENV, "fastest")
    with pytest.raises(ValueError, match="RINGPIPE_SGEMM='fastest': valid values are auto, blas, onednn"):
        sgemm.choice()
    sgemm.reset()
    monkeypatch.setenv(sgemm.ENV, "onednn")
    monkeypatch.setattr(onednn, "library", lambda: (None, "no oneDNN library is installed (pip install x)"))
    with pytest.raises(sgemm.SgemmUnavailable, match="RINGPIPE_SGEMM=onednn, but no oneDNN library"):
        sgemm.choice()
    sgemm.reset()
    monkeypatch.setenv(sgemm.ENV, "auto")                         # auto without the library: the BLAS
    assert sgemm.choice()[0] == "blas"
    with pytest.raises(sgemm.SgemmUnavailable):
        kernels.use_float32_gemm("onednn")
    with pytest.raises(ValueError, match="is not one of blas, onednn"):
        kernels.use_float32_gemm("mkl")
    kernels.use_float32_gemm("blas", "rank 0's choice")
    assert kernels.float32_gemm_choice() == "blas" and "rank 0's choice" in kernels.float32_gemm()


@needs_onednn
@pytest.mark.parametrize("bf16", [False, True])
def test_a_batch_of_small_gemms_shared_among_threads_gives_the_same_bits(bf16):
    """Attention's per-head GEMMs run one thread each; with 2 threads the batch is shared out
    between two Python threads (kernels/onednn.py _run_shared): every matrix computed as alone."""
    lib = onednn.library()[0]
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 3, 64, 32), dtype=np.float32)
    k = rng.standard_normal((4, 3, 64, 32), dtype=np.float32)
    if bf16:
        q, k = kernels.to_bf16(q), kernels.to_bf16(k)
    fn = lib.gemm if bf16 else lib.sgemm
    before = lib.get_num_threads()
    try:
        lib.set_num_threads(1)
        alone = onednn.gemm(lib, fn, "gemm", q, False, k, True, None, False, "")
        lib.set_num_threads(2)
        shared = onednn.gemm(lib, fn, "gemm", q, False, k, True, None, False, "")
        assert lib.get_num_threads() == 2                       # this thread's setting restored
    finally:
        lib.set_num_threads(before)
    np.testing.assert_array_equal(shared, alone)
    ref = np.matmul((kernels.from_bf16(q) if bf16 else q).astype(np.float64),
                    np.swapaxes(kernels.from_bf16(k) if bf16 else k, -1, -2).astype(np.float64))
    np.testing.assert_allclose(alone, ref, rtol=1e-4, atol=1e-4)
