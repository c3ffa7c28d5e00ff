"""Device buffers and MPI (comm/device.py): straight to a CUDA-aware MPI, or staged through pinned host memory.

Without a GPU both paths run on the CPU emulation of CuPy (tests/support/fake_cupy.py,
whose "device" memory is host memory, so MPICH can play a CUDA-aware MPI):
collectives, gradient buckets and whole training runs must give the same bits
either way, and only the staged path may copy through the host.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from ringpipe.comm import device
from tests.kernels.test_cuda_kernels import _emu_env, _need_gxx

from tests.support import ROOT
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.fixture
def fresh_decision(monkeypatch):
    device._reset_decision()
    yield monkeypatch
    device._reset_decision()


@pytest.mark.parametrize("value,expect", [("1", True), ("yes", True), ("0", False), ("off", False)])
def test_environment_decides_the_path(fresh_decision, value, expect):
    fresh_decision.setenv(device.ENV_CUDA_AWARE, value)
    assert device.cuda_aware() is expect


def test_auto_asks_the_mpi_library(fresh_decision):
    fresh_decision.setenv(device.ENV_CUDA_AWARE, "auto")
    asked = device.query_library()
    assert isinstance(asked, bool)
    assert device.cuda_aware() is asked
    # The MPICH wheel from PyPI is built without CUDA.
    from mpi4py import MPI
    if "MPICH" in MPI.Get_library_version() and not os.environ.get("MPIR_CVAR_ENABLE_GPU"):
        assert asked is False


@pytest.mark.parametrize("var", device.GPU_SUPPORT_VARIABLES)
def test_auto_takes_the_mpis_own_gpu_switch(fresh_decision, var):
    # Cray MPICH and MVAPICH2-GDR may not answer MPIX_Query_cuda_support: their
    # users' switch counts; switched off (or unset) the library's answer stands.
    for v in device.GPU_SUPPORT_VARIABLES:
        fresh_decision.delenv(v, raising=False)
    fresh_decision.setenv(device.ENV_CUDA_AWARE, "auto")
    fresh_decision.setenv(var, "0")
    assert device.cuda_aware() is device.query_library()
    device._reset_decision()
    fresh_decision.setenv(var, "1")
    assert device.cuda_aware() is True
    t = device.Transport(np)
    assert t.direct is False            # host arrays never take the device path
    assert device.enabled_by_environment() == f"{var}=1"
    if not device.query_library():      # the run's header says why it went direct
        assert device.Transport(object()).describe() == \
            f"device buffers straight to MPI ({var}=1 switches its GPU support on)"


def test_bad_setting_names_the_variable_and_the_choices(fresh_decision):
    fresh_decision.setenv(device.ENV_CUDA_AWARE, "maybe")
    with pytest.raises(ValueError, match=r"RINGPIPE_CUDA_AWARE_MPI='maybe'.*1 .*0 .*auto"):
        device.cuda_aware()


@pytest.mark.slow
def test_training_refuses_a_bad_setting_before_any_work(tmp_path):
    _need_gxx()
    with tempfile.TemporaryDirectory() as tmp:
        env = _emu_env(tmp, sanitize=False)
        env[device.ENV_CUDA_AWARE] = "maybe"
        r = _run([sys.executable, "-m", "ringpipe.train", "--device", "cuda", *TRAIN, "--out", str(tmp_path)], env)
    assert r.returncode != 0
    assert "error: RINGPIPE_CUDA_AWARE_MPI='maybe': use 1" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_host_arrays_pass_through_untouched():
    t = device.Transport(np)
    assert not t.device and not t.direct and t.describe() == "host memory"
    before = device.stats["staged_bytes"]
    a = np.arange(12.0).reshape(3, 4)
    assert t.send_buffer(a) is a
    assert t.send_buffer(a.T).flags.c_contiguous          # MPI needs contiguous memory
    buf = t.recv_buffer((2, 3), np.float32)
    assert type(buf) is np.ndarray and buf.dtype == np.float32 and t.received(buf) is buf
    t.in_place(a, lambda b: b.__imul__(2))
    assert a[1, 1] == 10.0 and device.stats["staged_bytes"] == before


def _run(cmd, env, timeout=600):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def _need_mpiexec():
    if not os.path.exists(MPIEXEC):
        pytest.skip("no mpiexec next to this python")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("aware", ["1", "0"], ids=["direct", "staged"])
def test_collectives_on_device_arrays_equal_host_ones(ranks, aware):
    _need_gxx()
    _need_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        env = _emu_env(tmp, sanitize=False)
        env[device.ENV_CUDA_AWARE] = aware
        r = _run([MPIEXEC, "-n", str(ranks), sys.executable, os.path.join("tests", "support", "mpi_scripts",
                                                                          "device_comm_check.py")], env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ok"], result["problems"][:10]
    assert result["direct"] is (aware == "1")
    if aware == "1":
        assert result["staged_bytes"] == 0, "the direct path copied through host memory"
    else:
        assert result["staged_bytes"] > 0


# --monitor-every 0: the monitor's start-up GEMM peak (four 768^3 GEMMs, engine/monitor/probes.py)
# took most of each run on the emulation (one OS thread per CUDA thread); these check the GPU path's
# transfers and math, not the monitor.
TRAIN = ["--steps", "3", "--layers", "2", "--d-model", "32", "--heads", "2", "--context", "16",
         "--batch-size", "4", "--eval-every", "3", "--eval-batches", "1", "--sample-tokens", "0", "--overwrite",
         "--dtype", "float64", "--monitor-every", "0"]          # not --quiet: the device lines are start-up facts


def _losses(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


@pytest.fixture(scope="module")
def cpu_losses(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cpu"))
    r = _run([sys.executable, "-m", "ringpipe.train", "--device", "cpu", *TRAIN, "--out", out], {})
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--dp", "2", "--zero", "1"], ["--pp", "2", "--microbatches", "2"],
                                    ["--tp", "2", "--sequence-parallel"], ["--dp", "2", "--zero", "2"],
                                    ["--dp", "2", "--zero", "3", "--recompute", "full"]],
                         ids=["dp2", "dp2-zero1", "pp2", "tp2-sp", "dp2-zero2", "dp2-zero3-recompute"])
def test_training_with_cuda_aware_mpi_equals_one_cpu_process(tmp_path, cpu_losses, layout):
    # Gradient buckets, ZeRO all-gather, pipeline activations, the tied-embedding
    # sum and the tensor axis's collectives (on its thread: --tp-overlap auto is on
    # for cuda) all hand device buffers to MPI: no host copies, same losses.
    _need_gxx()
    _need_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        env = _emu_env(tmp, sanitize=False)
        env[device.ENV_CUDA_AWARE] = "1"
        r = _run([MPIEXEC, "-n", "2", sys.executable, "-m", "ringpipe.train", "--device", "cuda", *TRAIN, *layout,
                  "--out", str(tmp_path)], env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "device: GPU 0 of 1 (cuda_emu (CPU emulation)) on rank 0" in r.stdout
    # Forced direct on an MPI that does not report CUDA support (the MPICH wheel): said so.
    assert ("GPU buffers and MPI: device buffers straight to MPI, as RINGPIPE_CUDA_AWARE_MPI=1 says, although "
            "the MPI library does not report CUDA support") in r.stdout
    assert re.search(r"GPU buffers and MPI on rank 0: 0\.0 MiB copied through host memory", r.stdout), r.stdout
    np.testing.assert_allclose(_losses(tmp_path), cpu_losses, rtol=1e-10)


@pytest.mark.slow
def test_training_staged_through_host_says_so_and_counts_the_copies(tmp_path, cpu_losses):
    _need_gxx()
    _need_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        env = _emu_env(tmp, sanitize=False)
        env[device.ENV_CUDA_AWARE] = "0"
        r = _run([MPIEXEC, "-n", "2", sys.executable, "-m", "ringpipe.train", "--device", "cuda", *TRAIN, "--dp", "2",
                  "--out", str(tmp_path)], env)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "staged through pinned host memory (MPI is not CUDA-aware; set RINGPIPE_CUDA_AWARE_MPI=1" in r.stdout
    staged = re.search(r"GPU buffers and MPI on rank 0: ([0-9.]+) MiB copied", r.stdout)
    assert staged and float(staged.group(1)) > 0, r.stdout
    np.testing.assert_allclose(_losses(tmp_path), cpu_losses, rtol=1e-10)
