"""Ring collectives (bandwidth-optimal) and the public all-reduce entry points.

The ring runs as one stream of sub-chunks: reduce-scatter phases t = 0..p-2
and all-gather phases t = p-1..2p-3. In phase t a rank sends chunk
(rank - t - 1) % p to its right neighbour and receives chunk
(rank - t - 2) % p from its left one, so after the last reduce-scatter phase
rank r owns the fully reduced chunk r, the layout reduce_scatter promises.
A sub-chunk is forwarded as soon as it is reduced (or, in the gather, as soon
as it lands), so phase t+1 starts moving before phase t has finished.
"""

from __future__ import annotations

import functools
import os
import zlib

import numpy as np
from mpi4py import MPI

from . import device
from .safety import (ALGO_CODES, ALWAYS_CHECK, DTYPE_CODES, LAYOUT_LEGEND, OP_CODES, CommContext,
                     context_for)
from .small import allreduce_small

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "chunk_bounds",
    "set_crossover",
    "get_crossover",
    "set_subchunk_bytes",
]

# Messages of at most this many bytes go to the latency-optimal path under
# algorithm="auto". Measured with benchmarks/allreduce.py on the 2-core dev
# box with the machine otherwise idle (MPICH 5 shared memory, float32, 2
# ranks, 2026-11-30): recursive doubling wins below 16 KiB, the ring wins from
# 32 KiB on (2x faster at 256 KiB-2 MiB, where the small path's full-buffer
# exchanges pay twice the copies). Runs taken while the machine was loaded put
# the switch at 4 MiB: measure on a quiet machine. With many ranks on a real
# network the ring's bandwidth advantage grows (log2(p)·n vs 2(p-1)/p·n bytes
# sent): rerun the benchmark there and set RINGPIPE_ALLREDUCE_CROSSOVER to the
# crossover it reports.
DEFAULT_CROSSOVER = 32 * 1024
# Sub-chunk size for the pipelined ring. Each extra message costs a
# rendezvous round trip; on the dev box 1 and 2 MiB tie, 512 KiB loses a few
# %, 256 KiB up to 2x (2 ranks, 1-64 MiB buffers).
DEFAULT_SUBCHUNK = 1024 * 1024

_crossover = int(os.environ.get("RINGPIPE_ALLREDUCE_CROSSOVER", DEFAULT_CROSSOVER))
_subchunk = int(os.environ.get("RINGPIPE_RING_SUBCHUNK", DEFAULT_SUBCHUNK))

_REDUCE = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def set_crossover(nbytes: int) -> None:
    """Byte size at or below which algorithm="auto" uses the small path.
    Must be the same on every rank. A differing choice is caught by the layout
    check on a layout's first use; on a layout already used, only with
    RINGPIPE_COMM_CHECK=always (see comm/safety.py), else it can hang."""
    global _crossover
    _crossover = int(nbytes)


def get_crossover() -> int:
    return _crossover


def set_subchunk_bytes(nbytes: int) -> None:
    """Ring sub-chunk size in bytes (tuning knob; same on every rank)."""
    global _subchunk
    _subchunk = max(1, int(nbytes))


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of chunk r for r in range(p), np.array_split convention:
    the first n % p chunks are one element longer."""
    if p < 1 or n < 0:
        raise ValueError(f"chunk_bounds needs n >= 0 and p >= 1, got n={n}, p={p}")
    q, rem = divmod(n, p)
    out, lo = [], 0
    for r in range(p):
        hi = lo + q + (1 if r < rem else 0)
        out.append((lo, hi))
        lo = hi
    return out


@functools.lru_cache(maxsize=256)
def _plan(n: int, p: int, itemsize: int, subchunk: int):
    """Per chunk, its sub-chunk bounds (absolute offsets). Sender and receiver
    of a chunk derive the same split from the same chunk, which is what lets
    in-order point-to-point matching line the pieces up."""
    per = max(1, subchunk // itemsize)
    subs = []
    for lo, hi in chunk_bounds(n, p):
        k = -(-(hi - lo) // per)  # ceil; 0 for an empty chunk: no messages
        subs.append(tuple((lo + a, lo + b) for a, b in chunk_bounds(hi - lo, k)) if k else ())
    return tuple(subs)


@functools.lru_cache(maxsize=256)
def _schedule(n: int, p: int, r: int, itemsize: int, subchunk: int, t0: int, t1: int):
    """Everything about phases [t0, t1) that does not depend on the buffer,
    so the hot loop only slices and calls MPI.

    Returns (scratch elements, initial sends, phases); a phase is
    (t, recvs, reduce, last_reduce, forward, conflict) where recvs holds
    (a, b, sa, sb): buffer slice [a:b] and, for reduce phases, its receive
    slot scratch[sa:sb] (sa = -1: gather straight into the buffer), and
    conflict is the phase whose sends must finish before phase t+1 may
    receive into their memory (-1: none).
    """
    subs = _plan(n, p, itemsize, subchunk)
    rs_end = p - 1  # phases below this reduce, the rest gather
    # Chunk-sized receive slots, alternating by phase: phase t+1 receives into
    # one while phase t is still being reduced out of the other. With a single
    # reduce phase (p = 2) one slot is enough.
    maxc = max((s[-1][1] - s[0][0] for s in subs if s), default=0)
    nslots = min(2, max(0, min(t1, rs_end) - t0))
    phases = []
    for t in range(t0, t1):
        sub = subs[(r - t - 2) % p]
        if t < rs_end:
            base = (t & 1 if nslots == 2 else 0) * maxc - (sub[0][0] if sub else 0)
            recvs = tuple((a, b, base + a, base + b) for a, b in sub)
        else:
            recvs = tuple((a, b, -1, -1) for a, b in sub)
        # Gathered data lands in the user's buffer, and MPI forbids writing
        # memory an unfinished Isend still reads: the chunk gather phase t+1
        # receives was sent by reduce-scatter phase t+2-p, same sub-chunks.
        conflict = t + 2 - p if (t + 1 < t1 and t + 1 >= rs_end and t + 2 - p >= t0) else -1
        phases.append((t, recvs, t < rs_end, t == rs_end - 1, t + 1 < t1, conflict))
    return nslots * maxc, subs[(r - t0 - 1) % p], tuple(phases)


def _ring(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc, avg: bool,
          t0: int, t1: int) -> None:
    """Run ring phases [t0, t1) in place on `flat`. `wire` is the same memory
    as MPI should see it (see _wire). The reductions run where `flat` lives:
    numpy on the host, cupy on the GPU (a CUDA-aware MPI moves device memory)."""
    comm, p, r = ctx.comm, ctx.size, ctx.rank
    left, right = (r - 1) % p, (r + 1) % p
    nscratch, init, phases = _schedule(flat.size, p, r, flat.itemsize, _subchunk, t0, t1)
    Isend, Irecv = comm.Isend, comm.Irecv
    xp, ufunc, sync = device.array_ops(flat, ufunc)
    if nscratch:
        scratch = ctx.scratch(flat.dtype, nscratch, xp)
        swire = scratch if wire is flat else scratch.view(wire.dtype)

    # Receives first: a message that finds its receive already posted skips
    # MPI's unexpected-message path.
    rq = [Irecv(swire[sa:sb] if sa >= 0 else wire[a:b], left, t0)
          for a, b, sa, sb in phases[0][1]]
    sends = {t0: [Isend(wire[a:b], right, t0) for a, b in init]}
    for k, (t, recvs, red, last, fwd, conflict) in enumerate(phases):
        if fwd:
            t_next = t + 1
            nrecvs = phases[k + 1][1]
            n_next = len(nrecvs)
            nrq = []
            out = sends[t_next] = []
            old = sends[conflict] if conflict >= 0 else None
            j_next = 0
        for j, (a, b, sa, sb) in enumerate(recvs):
            if fwd and j < n_next:
                na, nb, nsa, nsb = nrecvs[j]
                if nsa >= 0:
                    # Into the other scratch slot: post it before blocking on
                    # phase t's piece j, one sub-chunk of lookahead.
                    nrq.append(Irecv(swire[nsa:nsb], left, t_next))
                    rq[j].Wait()
                else:
                    # Into memory our own earlier send reads: block on phase
                    # t's piece first, by when that send has nearly always
                    # completed too, so its Wait costs no extra round trip.
                    rq[j].Wait()
                    if old is not None:
                        old[j].Wait()
                    nrq.append(Irecv(wire[na:nb], left, t_next))
                j_next = j + 1
            else:
                rq[j].Wait()
            if red:
                d = flat[a:b]
                ufunc(d, scratch[sa:sb], out=d)
                if last and avg:
                    xp.divide(d, p, out=d)
                if sync is not None:
                    sync()            # the GPU must finish the sum before MPI sends it
            if fwd:
                out.append(Isend(wire[a:b], right, t_next))
        if fwd:
            for j in range(j_next, n_next):
                na, nb, nsa, nsb = nrecvs[j]
                if nsa >= 0:
                    nrq.append(Irecv(swire[nsa:nsb], left, t_next))
                else:
                    if old is not None:
                        old[j].Wait()
                    nrq.append(Irecv(wire[na:nb], left, t_next))
            rq = nrq
    for lst in sends.values():
        MPI.Request.Waitall(lst)


# --------------------------------------------------------------------------
# Public entry points: validation, layout checks, dispatch.


def _host_flat(buf):
    """(array, flat view or None if not contiguous, writeback or None).

    Device arrays (cupy) go to MPI as they are when it is CUDA-aware (the
    ring then reduces on the GPU), otherwise through a pinned host copy that
    writeback copies back (comm/device.py).
    """
    if type(buf) is np.ndarray and buf.flags.c_contiguous:  # the hot path
        return buf, (buf if buf.ndim == 1 else buf.reshape(-1)), None
    if device.is_device_array(buf):
        if not buf.flags.c_contiguous:
            return buf, None, None          # refused by _validate, on either path
        if device.cuda_aware():
            device.synchronize(buf)
            return buf, buf.reshape(-1), None
        arr = device.to_pinned(buf)
        writeback = lambda host: device.copy_back(buf, host)  # noqa: E731
    elif isinstance(buf, np.ndarray):
        arr, writeback = buf, None
    else:
        # A list or scalar: _validate refuses it (once the ranks agreed), since
        # the result would land in a copy the caller never sees.
        return np.asarray(buf), None, None
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        return arr, arr.reshape(-1, order="A"), writeback
    return arr, None, writeback


def _writeable(arr) -> bool:
    return getattr(arr.flags, "writeable", True)      # cupy arrays are always writeable


def is_buffer(buf) -> bool:
    """A numpy or device array: something an in-place collective can write into."""
    return isinstance(buf, np.ndarray) or device.is_device_array(buf)


def op_name(op) -> str:
    """'sum'/'avg'/'max'/'min' as given, or MPI.SUM/MAX/MIN by name; anything
    else becomes a string that validation refuses (on every rank alike)."""
    if isinstance(op, str):
        return op
    for name, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
        if op == mpi_op:
            return name
    return repr(op)


def _shape_code(arr) -> int:
    # Ranks must lay the same elements out the same way: (2, 3) against
    # (3, 2), or C against Fortran order, would mix up elements silently.
    order = "C" if arr.flags.c_contiguous else "F" if arr.flags.f_contiguous else "-"
    return zlib.crc32(repr((tuple(arr.shape), order)).encode()) & 0x7FFFFFFF


def _codes(arr, flat, op: str, algo: str, is_array: bool = True) -> tuple:
    ok = -2 if not is_array else 1 if (flat is not None and _writeable(arr)) else 0
    return (
        arr.size,
        DTYPE_CODES.get(arr.dtype, 0),
        OP_CODES.get(op, -1) if isinstance(op, str) else -1,
        ALGO_CODES.get(algo, -1) if isinstance(algo, str) else -1,
        ok,
        _shape_code(arr),
    )


def _validate(what: str, arr, flat, op: str, algo: str, is_array: bool = True) -> None:
    # Runs only after the ranks agreed on the codes, so every rank raises the
    # same error here (or none does).
    if not is_array:
        raise TypeError(f"{what}: buffer must be a numpy or cupy array (the operation is in place: a "
                        f"list or scalar would be reduced into a copy you never see)")
    if flat is None:
        raise ValueError(f"{what}: buffer must be contiguous (got strides {arr.strides})")
    if not _writeable(arr):
        raise ValueError(f"{what}: buffer is read-only; the operation is in place")
    if arr.dtype not in DTYPE_CODES:
        raise TypeError(f"{what}: unsupported dtype {arr.dtype}; "
                        f"use one of {sorted(str(d) for d in DTYPE_CODES)}")
    if op not in _REDUCE and not (op == "none" and what == "allgather"):
        raise ValueError(f"{what}: unknown op {op!r}; use 'sum', 'avg', 'max' or 'min'")
    if op == "avg" and arr.dtype not in _FLOATS:
        raise TypeError(f"{what}: op='avg' needs a float dtype, got {arr.dtype}")
    if algo not in ALGO_CODES:
        raise ValueError(f"{what}: unknown algorithm {algo!r}; use 'auto', 'ring' or 'small'")


def _wire(flat: np.ndarray) -> np.ndarray:
    # float16 travels as uint16: not every MPI has a half-precision datatype,
    # and MPI only ever moves our bytes (numpy does all arithmetic).
    return flat.view(np.uint16) if flat.dtype.char == "e" else flat


def _resolve(algorithm: str, nbytes: int) -> str:
    if algorithm == "auto":
        return "small" if nbytes <= _crossover else "ring"
    return algorithm


def _allreduce_ctx(ctx: CommContext, flat: np.ndarray, op: str, algo: str) -> None:
    """All-reduce a validated flat buffer on a private context (no checks)."""
    if ctx.size == 1 or flat.size == 0:
        return
    if algo == "small":
        allreduce_small(ctx, flat, _wire(flat), _REDUCE[op], op == "avg")
    else:
        _ring(ctx, flat, _wire(flat), _REDUCE[op], op == "avg", 0, 2 * ctx.size - 2)


def _prepare(what: str, comm, arr, flat, op: str, algo: str, is_array: bool = True):
    """Agree on the layout across ranks (first use), then validate it.
    Returns the private context, or None on a single rank."""
    ctx = context_for(comm) if comm.Get_size() > 1 else None
    ok = is_array and flat is not None and _writeable(arr)
    key = (what, arr.size, arr.dtype, op, algo, ok, arr.shape, arr.flags.c_contiguous)
    if ctx is not None and key in ctx.valid and not ALWAYS_CHECK:
        return ctx
    if ctx is not None:
        ctx.ensure_checked(f"{what} layout (length, dtype, op, algorithm, ok, shape/order)",
                           _codes(arr, flat, op, algo, is_array), LAYOUT_LEGEND)
    # Only reached once the ranks agree, so they all raise the same error.
    _validate(what, arr, flat, op, algo, is_array)
    if ctx is not None:
        ctx.valid.add(key)
    return ctx


def allreduce(buf, comm=None, op: str = "sum", algorithm: str = "auto"):
    """In-place all-reduce of a contiguous buffer; returns `buf`.

    op: 'sum' | 'avg' | 'max' | 'min' (or MPI.SUM / MPI.MAX / MPI.MIN). algorithm: 'ring' (bandwidth-optimal),
    'small' (latency-optimal recursive doubling) or 'auto' (by byte size
    against get_crossover()). Every rank ends with bit-identical bytes.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    op = op_name(op)
    arr, flat, writeback = _host_flat(buf)
    algo = _resolve(algorithm, arr.nbytes)
    ctx = _prepare("allreduce", comm, arr, flat, op, algo, is_buffer(buf))
    if ctx is not None:
        _allreduce_ctx(ctx, flat, op, algo)
    if writeback is not None:
        writeback(arr)
    return buf


def reduce_scatter(buf, comm=None, op: str = "sum"):
    """In-place ring reduce-scatter: afterwards this rank's chunk
    (chunk_bounds(buf.size, p)[rank]) holds the reduced values; returns that
    view of the flattened buffer. The rest of `buf` is left as scratch."""
    comm = MPI.COMM_WORLD if comm is None else comm
    op = op_name(op)
    arr, flat, writeback = _host_flat(buf)
    ctx = _prepare("reduce_scatter", comm, arr, flat, op, "ring", is_buffer(buf))
    lo, hi = chunk_bounds(flat.size, comm.Get_size())[comm.Get_rank()]
    if ctx is not None and flat.size:
        _ring(ctx, flat, _wire(flat), _REDUCE[op], op == "avg", 0, ctx.size - 1)
    if writeback is not None:
        writeback(arr)
        return buf.reshape(-1)[lo:hi]
    return flat[lo:hi]


def allgather(buf, comm=None):
    """In-place ring all-gather: chunk r of `buf` (chunk_bounds) is valid on
    rank r beforehand; afterwards all of `buf` is filled on every rank."""
    comm = MPI.COMM_WORLD if comm is None else comm
    arr, flat, writeback = _host_flat(buf)
    ctx = _prepare("allgather", comm, arr, flat, "none", "ring", is_buffer(buf))
    if ctx is not None and flat.size:
        _ring(ctx, flat, _wire(flat), None, False, ctx.size - 1, 2 * ctx.size - 2)
    if writeback is not None:
        writeback(arr)
    return buf
