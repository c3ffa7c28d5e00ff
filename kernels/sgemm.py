"""
The float32 GEMM on the CPU: numpy's BLAS, or oneDNN's dnnl_sgemm where that is faster
on this host (issue 35).

Hosts of one kind differ: numpy's OpenBLAS picks its kernel for the CPU it sees, or the
one OPENBLAS_CORETYPE names (this project's machines set Haswell: AVX2 kernels on an
AVX-512 CPU), and PyTorch's MKL has its own. On the project's 2-core AMD EPYC (Zen 5)
oneDNN's sgemm ran a linear layer's GEMMs at about twice OpenBLAS's GFLOP/s on one thread
(benchmarks/vs_pytorch.py prints the host's rates beside every ratio). oneDNN is already
loaded for the bf16 GEMM (kernels/onednn.py), so it costs nothing more to offer.

Chosen once per process by RINGPIPE_SGEMM:
  auto    (default) a short calibration picks oneDNN where it runs a linear layer's three
          GEMMs (forward, and both products of backward; CALIBRATION) at least MARGIN
          times faster than the BLAS, timed alternately; else the BLAS. The result is
          cached per host in CACHE/sgemm-KEY.json (CACHE: ringpipe/cache.py; KEY: the CPU,
          both libraries, OPENBLAS_CORETYPE and the thread count), so every later process
          on the host, a resumed run's included, takes the same choice without measuring.
  blas    numpy's BLAS (np.matmul), as before issue 35
  onednn  oneDNN's sgemm, or SgemmUnavailable saying what is missing

GEMMs of fewer multiply-adds than SMALL_MACS per matrix stay with numpy whatever the
choice (one ctypes call per matrix costs more than it gains there), as do operands that
are not float32 numpy arrays. Two libraries sum in different orders: their results differ
in the last bits, as between any two BLAS builds. One process runs one library for every
GEMM of a shape, and the trainer has every rank take rank 0's choice (use()).
"""

import hashlib
import json
import os
import platform
import tempfile
import time

import numpy as np

from ringpipe import threads
from ringpipe.cache import cache_root

from . import onednn

ENV = "RINGPIPE_SGEMM"
MODES = ("auto", "blas", "onednn")
CHOICES = ("blas", "onednn")
MARGIN = 1.2                      # oneDNN must be this much faster to be chosen
SMALL_MACS = 1 << 17              # per matrix: below, numpy's batched loop wins (measured)
# (M, K, N, trans_a, trans_b): a linear layer of 256 -> 768 on 1024 rows: forward x @ W^T,
# backward dx = dy @ W, dW = dy^T @ x
CALIBRATION = ((1024, 256, 768, False, True), (1024, 768, 256, False, False), (768, 1024, 256, True, False))
CACHE_FORMAT = "ringpipe-sgemm-choice"
CACHE_MAX_BYTES = 1 << 16


class SgemmUnavailable(ValueError):
    """RINGPIPE_SGEMM=onednn on a machine without the library."""


_state = {"choice": None}        # (name, why)


def mode():
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: valid values are {', '.join(MODES)}")
    return value


# ---------------------------------------------------------------------------
# the choice


def _blas_name():
    """numpy's BLAS as numpy says (its name and version), or "numpy's BLAS"."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name', 'BLAS')} {blas.get('version', '')}".strip()
    except (KeyError, TypeError, AttributeError):
        return "numpy's BLAS"


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(1 << 16)
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return " ".join(fields.get(k, "").strip() for k in ("model name", "flags")) or platform.machine()


def host_key(lib) -> dict:
    """What the choice depends on: the CPU, both libraries, the BLAS's core type, the threads."""
    return {"cpu": hashlib.sha256(_cpu_name().encode()).hexdigest()[:16], "machine": platform.machine(),
            "blas": _blas_name(), "numpy": np.__version__, "onednn": lib.describe(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
            "threads": threads.apply_defaults().per_rank}


def _cache_path(key) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"sgemm-{digest}.json")


def _read_cache(path, key):
    """The cached record for KEY, or None (missing, damaged, another format or key)."""
    try:
        if os.path.getsize(path) > CACHE_MAX_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    if (not isinstance(record, dict) or record.get("format") != CACHE_FORMAT or record.get("key") != key
            or record.get("choice") not in CHOICES):
        return None
    return record


def _ours(path):
    """Is PATH missing, or a file this module wrote (its format named in it, damaged or not)?
    Nothing else is replaced."""
    try:
        if os.path.getsize(path) > CACHE_MAX_BYTES:
            return False
        with open(path, "rb") as f:
            return f'"format": "{CACHE_FORMAT}"'.encode() in f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _write_cache(path, record):
    """Atomically (a temp file renamed into place), and only over a file of this format; a
    cache that cannot be written is skipped (the next process calibrates again)."""
    if not _ours(path):
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sgemm-", suffix=".tmp", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate(lib, repeats=5) -> dict:
    """{"blas": GFLOP/s, "onednn": GFLOP/s} over CALIBRATION's GEMMs, each library timed
    alternately (one warm-up call each first), medians: a busy neighbour slows both alike."""
    rng = np.random.default_rng(0)
    seconds = {"blas": 0.0, "onednn": 0.0}
    flops = 0
    for M, K, N, ta, tb in CALIBRATION:
        a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
        b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
        c = np.empty((M, N), np.float32)
        run = {"blas": lambda: np.matmul(a.T if ta else a, b.T if tb else b, out=c),
               "onednn": lambda: onednn.gemm(lib, lib.sgemm, "dnnl_sgemm", a, ta, b, tb, c, False, "")}
        for fn in run.values():
            fn()
        for _ in range(2):
            for name, fn in run.items():
                seconds[name] += _timed(fn, repeats)
        flops += 2 * 2 * M * N * K
    return {name: flops / s / 1e9 for name, s in seconds.items()}


def _choose():
    m = mode()
    if m == "blas":
        return "blas", f"{ENV}=blas"
    lib, why = onednn.library()
    if lib is None:
        if m == "onednn":
            raise SgemmUnavailable(f"{ENV}=onednn, but {why}; unset {ENV} (or set it to blas) to run numpy's BLAS")
        return "blas", why
    if m == "onednn":
        return "onednn", f"{ENV}=onednn"
    key = host_key(lib)
    path = _cache_path(key)
    record = _read_cache(path, key)
    if record is None:
        rates = calibrate(lib)
        choice = "onednn" if rates["onednn"] >= MARGIN * rates["blas"] else "blas"
        record = {"format": CACHE_FORMAT, "version": 1, "key": key, "choice": choice,
                  "gflops": {k: round(v, 1) for k, v in rates.items()}, "margin": MARGIN,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_cache(path, record)
        how = "calibrated now"
    else:
        how = f"calibrated {record.get('measured', 'earlier')}, cached in {path}"
    g = record.get("gflops", {})
    rates = f"oneDNN {g.get('onednn', '?')} vs BLAS {g.get('blas', '?')} GFLOP/s" if g else "rates unknown"
    return record["choice"], f"{rates} on a linear layer's GEMMs ({how})"


def choice():
    """("blas" | "onednn", why); chosen on the first call (calibrating, or from the cache)."""
    if _state["choice"] is None:
        _state["choice"] = _choose()
    return _state["choice"]


def use(name, why="chosen by the caller"):
    """Run NAME ("blas" or "onednn") from now on: the trainer gives every rank rank 0's choice."""
    if name not in CHOICES:
        raise ValueError(f"kernels.use_float32_gemm: {name!r} is not one of {', '.join(CHOICES)}")
    lib, missing = onednn.library()
    if name == "onednn" and lib is None:
        raise SgemmUnavailable(f"oneDNN's sgemm was chosen, but {missing}")
    _state["choice"] = (name, why)


def reset():
    """Forget the choice (tests change the environment)."""
    _state["choice"] = None


def describe():
    """One line: which float32 GEMM this process runs, and why."""
    name, why = choice()
    if name == "onednn":
        return f"float32 GEMM: {onednn.library()[0].describe()} dnnl_sgemm ({why})"
    return f"float32 GEMM: numpy's BLAS, {_blas_name()} ({why})"


# ---------------------------------------------------------------------------
# the GEMM


def _operand(x, trans):
    """(x with unit column stride and rows apart, trans): a transposed view is passed as its
    base with the flag flipped; anything else the library cannot read is copied."""
    if x.strides[-1] != 4 and x.strides[-2] == 4 and x.shape[-1] > 1:
        x, trans = x.swapaxes(-1, -2), not trans
    rows, cols = x.shape[-2:]
    row_ok = rows <= 1 or (x.strides[-2] % 4 == 0 and x.strides[-2] >= 4 * cols)
    if (x.strides[-1] != 4 and cols > 1) or not row_ok or not x.flags.aligned:
        x = np.ascontiguousarray(x)
    return x, trans


def wants(a, b, out, trans_a=False, trans_b=False):
    """Does this GEMM go to oneDNN? float32 numpy operands (and out), matrices of at least
    SMALL_MACS multiply-adds, and oneDNN chosen."""
    arrays = (a, b) if out is None else (a, b, out)
    if not all(type(x) is np.ndarray and x.dtype == np.float32 and x.flags.aligned and x.ndim >= 2 for x in arrays):
        return False
    # numpy's own checks and copies where the library would write blindly: a read-only out,
    # or an out that overlaps an operand
    if out is not None and (not out.flags.writeable or np.may_share_memory(out, a) or np.may_share_memory(out, b)):
        return False
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    N = b.shape[-2] if trans_b else b.shape[-1]
    return M * N * K >= SMALL_MACS and choice()[0] == "onednn"


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False):
    """C = op(a) @ op(b) in float32 through oneDNN's sgemm, as kernels.matmul (batch dims
    broadcast; out overwritten, or added into with accumulate). Callers ask wants() first."""
    lib = onednn.library()[0]
    a, ta = _operand(a, trans_a)
    b, tb = _operand(b, trans_b)
    return onednn.gemm(lib, lib.sgemm, "dnnl_sgemm", a, ta, b, tb, out, accumulate,
                       f"set {ENV}=blas to run numpy's BLAS")
