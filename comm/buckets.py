"""Gradient bucketing: all-reduce gradients in buckets while backward runs.

Buckets are runs of consecutive parameters taken from the END of the model
(backward produces those gradients first), each a contiguous slice of the
flat gradient buffer of at most bucket_bytes. A smaller first_bucket_bytes
caps the first bucket alone, so its all-reduce can start early in backward
(PyTorch DDP caps its first bucket at 1 MiB for that reason); a parameter
larger than its bucket's cap forms a bucket of its own.

Overlap is a progress thread that all-reduces buckets on a private Dup'ed
communicator while the main thread keeps computing. It is real overlap
because the main thread's heavy work (BLAS, large numpy loops) and mpi4py's
blocking calls both release the GIL. The thread reduces buckets strictly in
bucket order, whatever order they become ready in: every rank must issue the
same sequence of collectives, and readiness order can differ between ranks.

Measured (benchmarks/allreduce.py --overlap, 2 ranks, 2-core box, 8 x 4 MiB
layers): with device-like backward work (the CPU idles) about 80-90% of the
all-reduce time is hidden in wall clock; with CPU-bound numpy work on one
core per rank almost none is, because the copies and adds of the all-reduce
need that same core (stats() then overstates "hidden": the thread's comm
time stretches while it shares the core).
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from . import device
from .collectives import _wire, allreduce_on_context, choose_algorithm
from .consistency import check_consistent
from .context import CommContext
from .ring import reduce_scatter_ring
from .layout import LAYOUT_LEGEND, REDUCE_UFUNCS, is_buffer, layout_record, op_name, semantics_hash, validate

__all__ = ["GradBuckets"]

_live: "weakref.WeakSet[GradBuckets]" = weakref.WeakSet()
_BUCKET = "GradBuckets bucket all-reduce"     # for error messages


@atexit.register
def _stop_all() -> None:
    # Runs before mpi4py's own atexit finalize (registered earlier, so later
    # in LIFO order): no progress thread may be inside MPI at MPI_Finalize.
    for gb in list(_live):
        gb._stop_thread()


def _make_buckets(param_ranges, itemsize: int, bucket_bytes: int, first_bucket_bytes: int | None = None,
                  breaks=()):
    """[(lo, hi, first_param, last_param)] in reduction order (model end first).
    Greedy: a bucket takes parameters until the next would exceed its cap,
    first_bucket_bytes (if given) for the first bucket, bucket_bytes after.
    breaks: parameter indices that begin a bucket whatever its size (a bucket
    never holds parameter i - 1 and parameter i for i in breaks)."""
    breaks = set(breaks)
    buckets = []
    cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    cur_first = cur_last = None
    cur_bytes = 0
    for i in range(len(param_ranges) - 1, -1, -1):
        lo, hi = param_ranges[i]
        nbytes = (hi - lo) * itemsize
        if cur_last is not None and (cur_bytes + nbytes > cap or cur_first in breaks):
            buckets.append((param_ranges[cur_first][0], param_ranges[cur_last][1], cur_first, cur_last))
            cur_first = cur_last = None
            cur_bytes = 0
            cap = bucket_bytes
        if cur_last is None:
            cur_last = i
        cur_first = i
        cur_bytes += nbytes
    if cur_last is not None:
        buckets.append((param_ranges[cur_first][0], param_ranges[cur_last][1], cur_first, cur_last))
    return buckets


class GradBuckets:
    """Bucketed, overlapped all-reduce of a flat gradient buffer.

    grad_flat: 1D contiguous gradient buffer. param_ranges: (lo, hi) slices of
    it, in forward order, sorted and non-overlapping (elements in gaps between
    parameters are reduced along with their bucket). Collective: construct on
    every rank of `comm` with the same layout. first_bucket_bytes: cap of the
    first bucket (the model's last parameters, reduced first) if smaller
    buckets should start the communication earlier in backward; default
    bucket_bytes.

    collective="reduce_scatter" (ZeRO-2/3): each bucket is reduce-scattered
    instead, rank r of `comm` keeping the reduced values of its chunk
    (chunk_bounds(hi - lo, size)[r], offset by lo); the rest of the bucket is
    scratch. breaks: parameter indices that begin a bucket whatever the sizes
    (so that two ranks' buffers can be cut alike). on_reduced(k): called on
    whichever thread reduced bucket k, once it is reduced (ZeRO releases the
    memory of the chunks this rank does not keep).
    """

    def __init__(self, grad_flat, param_ranges, comm=None, bucket_bytes: int = 25 * 2**20,
                 op: str = "avg", overlap: bool = True, algorithm: str = "auto",
                 first_bucket_bytes: int | None = None, collective: str = "allreduce", breaks=(),
                 on_reduced=None):
        comm = MPI.COMM_WORLD if comm is None else comm
        op = op_name(op)
        if collective not in ("allreduce", "reduce_scatter"):
            raise ValueError(f"GradBuckets: collective must be 'allreduce' or 'reduce_scatter', got {collective!r}")
        if collective == "reduce_scatter":
            algorithm = "ring"          # the ring's first half is the reduce-scatter
        # First, and collectively: our private communicator (bucket messages
        # never meet the caller's). Creating it compares the comm settings
        # across the ranks, among them the crossover that picks the buckets'
        # algorithms below.
        self._ctx = CommContext(comm)
        try:
            ranges, buckets, algos, flat = self._agree_on_layout(
                comm, grad_flat, param_ranges, bucket_bytes, first_bucket_bytes, op, algorithm, self._ctx,
                collective, breaks)
        except BaseException:
            self._ctx.free()
            raise
        on_device = device.is_device_array(grad_flat)

        self.grad_flat = flat
        # Device gradients: reduced on the GPU by a CUDA-aware MPI, else each
        # bucket goes through pinned host memory (comm/device.py).
        self._device = on_device
        self._staged = on_device and not device.cuda_aware()
        self._written = [None] * len(buckets)     # device: event per bucket, set by mark_ready
        self.param_ranges = ranges
        self.op = op
        self.collective = collective
        self._on_reduced = on_reduced
        self.algorithm = algorithm
        self.bucket_bytes = int(bucket_bytes)
        self.first_bucket_bytes = None if first_bucket_bytes is None else int(first_bucket_bytes)
        self.buckets = buckets
        self._algos = algos
        # Each bucket's layout hash for the message fingerprints (comm/fingerprint.py),
        # so a step whose buckets differ between ranks raises instead of mixing them.
        self._semantics = [semantics_hash(layout_record(flat[lo:hi], flat[lo:hi], op, a))
                           for (lo, hi, _, _), a in zip(buckets, algos)]
        self._bucket_of = np.empty(len(ranges), dtype=np.int64)
        self._size = np.empty(len(self.buckets), dtype=np.int64)
        for k, (_, _, first, last) in enumerate(self.buckets):
            self._bucket_of[first : last + 1] = k
            self._size[k] = last - first + 1

        if overlap and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn("GradBuckets: MPI is not initialized with MPI_THREAD_MULTIPLE; "
                          "falling back to overlap=False", RuntimeWarning, stacklevel=2)
            overlap = False
        self.overlap = bool(overlap)

        self._cond = threading.Condition()
        self._marked = np.zeros(len(ranges), dtype=bool)
        self._pending = self._size.copy()
        self._ready = [False] * len(self.buckets)
        self._next = 0          # next bucket the reducer will take
        self._busy = False      # reducer is inside an all-reduce
        self._error: BaseException | None = None
        self._stopping = False
        self._comm_s = 0.0
        self._last = {"comm_s": 0.0, "wait_s": 0.0, "hidden": 0.0}
        self._tot_comm = self._tot_wait = 0.0
        self._steps = 0
        self._thread = None
        if self.overlap and self.buckets:
            self._thread = threading.Thread(target=self._run, name="ringpipe-buckets", daemon=True)
            self._thread.start()
        _live.add(self)

    @staticmethod
    def _agree_on_layout(comm, grad_flat, param_ranges, bucket_bytes, first_bucket_bytes, op: str,
                         algorithm: str, ctx=None, collective: str = "allreduce", breaks=()):
        """(ranges, buckets, per-bucket algorithms, flat buffer) once every rank
        passed the same layout and it is valid; else the same error on every rank."""
        ranges = [(int(lo), int(hi)) for lo, hi in param_ranges]
        is_array = is_buffer(grad_flat)
        arr = grad_flat if is_array else np.asarray(grad_flat)
        flat = arr if (is_array and arr.ndim == 1 and arr.flags.c_contiguous) else None
        layout_ok = all(0 <= lo <= hi for lo, hi in ranges) and all(
            ranges[i][1] <= ranges[i + 1][0] for i in range(len(ranges) - 1)
        ) and (not ranges or ranges[-1][1] <= arr.size)
        first = None if first_bucket_bytes is None else int(first_bucket_bytes)
        buckets = _make_buckets(ranges, arr.itemsize, int(bucket_bytes), first, breaks)
        # "auto" is resolved once per bucket, so every step runs the same
        # algorithm; the choice depends on the crossover, hence in the check.
        algos = [choose_algorithm(algorithm, (hi - lo) * arr.itemsize, ctx) for lo, hi, _, _ in buckets]
        layout_crc = zlib.crc32(np.asarray(ranges, dtype=np.int64).tobytes()
                                + np.asarray([lo for lo, _, _, _ in buckets], dtype=np.int64).tobytes()
                                + ",".join([collective, *map(str, algos)]).encode())
        size, dtype_code, op_code, _, ok, _ = layout_record(arr, flat, op, "ring", is_array)
        codes = (size, dtype_code, op_code, ok, len(ranges), int(bucket_bytes),
                 0 if first is None else first, layout_crc)
        # Agree first, then validate, so a bad or mismatched layout raises the
        # same error on every rank instead of hanging in the first bucket.
        check_consistent(comm, "GradBuckets layout (length, dtype, op, ok, n_params, "
                         "bucket_bytes, first_bucket_bytes (0: none), crc of ranges and per-bucket "
                         "algorithms)", codes, LAYOUT_LEGEND)
        if not is_array:
            raise TypeError("GradBuckets: grad_flat must be a numpy or cupy array (the gradients are "
                            "reduced in place)")
        if flat is None:
            raise ValueError("GradBuckets: grad_flat must be a 1D C-contiguous array")
        for a in set(algos) or {"ring"}:
            validate("GradBuckets", arr, flat, op, a)
        if not layout_ok:
            raise ValueError("GradBuckets: param_ranges must be sorted, non-overlapping "
                             f"(lo, hi) pairs inside grad_flat[0:{arr.size}]")
        if bucket_bytes < 1:
            raise ValueError(f"GradBuckets: bucket_bytes must be positive, got {bucket_bytes}")
        if first is not None and first < 1:
            raise ValueError(f"GradBuckets: first_bucket_bytes must be positive (or None), got "
                             f"{first_bucket_bytes}")
        return ranges, buckets, algos, flat

    # -- backward side -------------------------------------------------------

    @property
    def algorithms(self) -> list[str]:
        """The all-reduce algorithm of each bucket ("auto" resolved once, at creation)."""
        return list(self._algos)

    @property
    def cost_model(self):
        """The measured cost per level that chose them (comm/costmodel.py), or None
        where the ranks are not several nodes of several ranks."""
        return self._ctx.cost

    def mark_ready(self, i: int) -> None:
        """Param i's gradient is final. Starts its bucket's all-reduce (in the
        background) once every param of the bucket is marked."""
        if not 0 <= i < len(self._marked):
            raise IndexError(f"GradBuckets.mark_ready({i}): only {len(self._marked)} params")
        if self._marked[i]:
            raise ValueError(f"GradBuckets.mark_ready({i}): already marked this step")
        self._marked[i] = True
        k = self._bucket_of[i]
        self._pending[k] -= 1
        if self._pending[k] == 0 and self._thread is not None:
            if self._device:
                # The bucket thread must wait for the kernels that wrote these
                # gradients, and only for those: mark them with an event.
                self._written[k] = device.record_event()
            with self._cond:
                self._ready[k] = True
                self._cond.notify_all()

    # -- optimizer side ------------------------------------------------------

    def wait(self) -> None:
        """Block until every bucket is reduced, then reset for the next step.
        Raises if some param was never marked ready."""
        t0 = time.perf_counter()
        missing = np.flatnonzero(~self._marked)
        if missing.size:
            self._abandon_step()
            shown = ", ".join(str(i) for i in missing[:20]) + (" ..." if missing.size > 20 else "")
            raise RuntimeError(
                f"GradBuckets.wait(): {missing.size} param(s) never marked ready this step: "
                f"[{shown}] (buckets {sorted(set(self._bucket_of[missing].tolist()))}). "
                "Every param must be marked once per step; the step was abandoned.")
        if self._thread is not None:
            with self._cond:
                while self._next < len(self.buckets) and self._error is None:
                    self._cond.wait()
                err = self._error
            if err is not None:
                raise RuntimeError("GradBuckets: bucket all-reduce failed") from err
        else:
            for k in range(len(self.buckets)):
                t = time.perf_counter()
                self._reduce(k)
                self._comm_s += time.perf_counter() - t
        blocked = time.perf_counter() - t0
        comm_s = self._comm_s
        self._last = {
            "comm_s": comm_s,
            "wait_s": blocked,
            "hidden": (max(0.0, 1.0 - blocked / comm_s) if comm_s > 0 else 0.0),
        }
        self._tot_comm += comm_s
        self._tot_wait += blocked
        self._steps += 1
        self._reset()

    def stats(self) -> dict:
        """Last step: comm_s (time inside bucket all-reduces), wait_s (time
        blocked in wait()), hidden = 1 - wait_s/comm_s; plus running totals."""
        tot_hidden = max(0.0, 1.0 - self._tot_wait / self._tot_comm) if self._tot_comm > 0 else 0.0
        return dict(self._last, steps=self._steps, buckets=len(self.buckets),
                    bytes=int(self.grad_flat.nbytes), overlap=self.overlap,
                    total_comm_s=self._tot_comm, total_wait_s=self._tot_wait,
                    total_hidden=tot_hidden)

    def close(self) -> None:
        """Stop the progress thread and free the private communicator
        (collective, like construction)."""
        self._stop_thread()
        self._ctx.free()
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -------------------------------------------------------------

    def _reset(self) -> None:
        with self._cond:
            self._marked[:] = False
            self._pending[:] = self._size
            self._ready = [False] * len(self.buckets)
            self._next = 0
            self._comm_s = 0.0

    def _abandon_step(self) -> None:
        # The reducer stops on its own at the first bucket that is not ready.
        # Wait for it to get there (never cut a collective in half), so ranks
        # that are missing the same params all stop after the same bucket.
        if self._thread is not None:
            with self._cond:
                while (self._error is None and self._next < len(self.buckets)
                       and (self._busy or self._ready[self._next])):
                    self._cond.wait()
        self._reset()

    def _reduce(self, k: int) -> None:
        lo, hi, _, _ = self.buckets[k]
        seg = self.grad_flat[lo:hi]
        if self._device:
            # backward's kernels for this bucket must be done: on the bucket thread
            # they were queued by the main thread (its event), else by this one
            written, self._written[k] = self._written[k], None
            if written is not None:
                written.synchronize()
            else:
                device.synchronize(seg)
        if self._staged:
            host = device.to_pinned(seg)
            self._collective(k, host)
            device.copy_back(seg, host)
        else:
            self._collective(k, seg)
        if self._on_reduced is not None:
            self._on_reduced(k)

    def _collective(self, k: int, seg) -> None:
        if self.collective == "allreduce":
            allreduce_on_context(self._ctx, seg, seg, self.op, self._algos[k], self._semantics[k], _BUCKET)
        elif self._ctx.size > 1 and seg.size:
            if reduce_scatter_ring(self._ctx, seg, _wire(seg), REDUCE_UFUNCS[self.op], self.op == "avg",
                                   self._semantics[k]):
                raise RuntimeError(f"{_BUCKET} (reduce-scatter): the ranks' bucket layouts differed")

    def _run(self) -> None:
        cond = self._cond
        if self._device:
            self.grad_flat.device.use()   # cupy's current device is per thread
            # Its own stream, so reductions and copies overlap backward; kept on self
            # because a stream is destroyed with its last reference.
            self._stream = device.use_own_stream()
        try:
            while True:
                with cond:
                    while not self._stopping and not (
                            self._next < len(self.buckets) and self._ready[self._next]):
                        cond.wait()
                    if self._stopping:
                        return
                    k = self._next
                    self._busy = True
                t = time.perf_counter()
                self._reduce(k)
                dt = time.perf_counter() - t
                with cond:
                    self._comm_s += dt
                    self._busy = False
                    self._next = k + 1
                    cond.notify_all()
        except BaseException as e:
            with cond:
                self._error = e  # wait() raises it on the main thread
                self._busy = False
                cond.notify_all()
            # Also let threading.excepthook see it: with install_abort_handler()
            # that aborts the job at once, instead of when (if ever) the main
            # thread reaches wait() while peers block in this bucket.
            raise

    def _stop_thread(self) -> None:
        th = self._thread
        if th is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is not th:
            th.join(timeout=10)
        self._thread = None
