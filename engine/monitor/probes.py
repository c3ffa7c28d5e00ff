"""What this process and its node use, read where Linux keeps it: cheap enough to read
every monitoring interval (a few small /proc reads; NVML calls on a GPU).

    probe = Probe(gpu_index=None)      # gpu_index: the CUDA device this rank uses, if any
    probe.sample()                     # {"rss_bytes", "peak_bytes", "cpu_percent", "net_rx_bytes_per_s", ...}

CPU and network numbers are rates since the previous sample (the first sample: since
the probe was made). The network bytes are the node's (every interface but loopback:
/proc/net/dev of the rank's network namespace), the same for every rank of a node.
GPU numbers come from NVML through nvidia-ml-py (`import pynvml`) when it is installed
and a device is in use; otherwise they are left out.
"""
from __future__ import annotations

import os
import resource
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm), 0 where unknown."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def peak_bytes() -> int:
    """This process's peak resident memory (VmHWM; getrusage's maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_seconds() -> float:
    """CPU time of every thread of this process so far (user + system)."""
    t = os.times()
    return t.user + t.system


def network_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this node's interfaces but loopback, since they came up."""
    rx = tx = 0
    try:
        with open("/proc/net/dev", "rb") as fh:
            lines = fh.read().decode("ascii", "replace").splitlines()[2:]
    except OSError:
        return 0, 0
    for line in lines:
        name, _, counters = line.partition(":")
        fields = counters.split()
        if name.strip() == "lo" or len(fields) < 9:
            continue
        try:
            rx += int(fields[0])
            tx += int(fields[8])
        except ValueError:
            continue
    return rx, tx


def allowed_cpus() -> int:
    """The CPUs this process may run on (its affinity: what Slurm or mpirun gave it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _GPU:
    """NVML's view of one device; None from open() when NVML cannot be had."""

    def __init__(self, nvml, handle):
        self.nvml, self.handle = nvml, handle

    @classmethod
    def open(cls, index: int):
        try:
            import pynvml                      # nvidia-ml-py
            pynvml.nvmlInit()
            return cls(pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
        except Exception:                       # no package, no driver, no such device: no GPU numbers
            return None

    def sample(self) -> dict:
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
            return {"gpu_util_percent": float(util.gpu), "gpu_mem_bytes": float(mem.used)}
        except Exception:
            return {}


class Probe:
    def __init__(self, gpu_index: int | None = None):
        self.gpu = _GPU.open(gpu_index) if gpu_index is not None else None
        self._last = self._counters()

    @staticmethod
    def _counters():
        return (time.perf_counter(), cpu_seconds(), *network_bytes())

    def sample(self) -> dict:
        now = self._counters()
        wall = max(now[0] - self._last[0], 1e-9)
        values = {"rss_bytes": float(resident_bytes()), "peak_bytes": float(peak_bytes()),
                  "cpu_percent": 100.0 * (now[1] - self._last[1]) / wall,
                  "net_rx_bytes_per_s": max(0, now[2] - self._last[2]) / wall,
                  "net_tx_bytes_per_s": max(0, now[3] - self._last[3]) / wall}
        self._last = now
        if self.gpu is not None:
            values.update(self.gpu.sample())
        return values


def gemm_peak_flops(xp, dtype, precision: str, n: int = 768, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n GEMM through the kernels the layers use, in the run's dtype
    and precision: the peak MFU is measured against (the best of `repeats`, after one
    warm-up). Every rank measures at once, so ranks sharing a node's cores share them here
    too. About 0.05 s on a CPU core (n = 768: large enough for BLAS to reach its pace); milliseconds on a GPU."""
    from ringpipe import kernels as K
    from ringpipe.comm.device import synchronize
    a = xp.full((n, n), 0.5, dtype=dtype)          # the values do not matter to the time (no denormals)
    b = xp.full((n, n), 0.25, dtype=dtype)
    out = xp.empty((n, n), dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        synchronize(a)
        t0 = time.perf_counter()
        K.matmul(a, b, out, precision=precision)
        synchronize(out)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best
