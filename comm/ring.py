"""Ring collectives (bandwidth-optimal) and the public all-reduce entry points.

The ring runs as one stream of sub-chunks: reduce-scatter phases t = 0..p-2
and all-gather phases t = p-1..2p-3. In phase t a rank sends chunk
(rank - t - 1) % p to its right neighbour and receives chunk
(rank - t - 2) % p from its left one, so after the last reduce-scatter phase
rank r owns the fully reduced chunk r, the layout reduce_scatter promises.
A sub-chunk is forwarded as soon as it is reduced (or, in the gather, as soon
as it lands), so phase t+1 starts moving before phase t has finished.

Every message carries its sender's layout fingerprint in its tag, and every
receive takes any tag and compares it (comm/fingerprint.py). Matching does
not need the tag: all of one rank's messages come from its left neighbour,
which sends phase t's pieces in order and all of them before any of phase
t+1; the receives are posted in that same order (all of phase t's before any
of phase t+1's), and MPI keeps the messages of one sender in order.

Before a call, the ranks compare the layout with one small Allgather on its
first use per communicator (RINGPIPE_COMM_CHECK, see comm/safety.py's
CommContext); the fingerprints catch the rest at no cost.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
from mpi4py import MPI

from . import device, fingerprint, settings
from .safety import (ALGO_CODES, DTYPE_CODES, LAYOUT_LEGEND, OP_CODES, CommContext, check_consistent,
                     context_for)
from .settings import DEFAULT_CROSSOVER, DEFAULT_SUBCHUNK  # noqa: F401  (documented there)
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

_REDUCE = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def set_crossover(nbytes: int) -> None:
    """Byte size at or below which algorithm="auto" uses the small path
    (default RINGPIPE_ALLREDUCE_CROSSOVER, else 32 KiB). Must be the same on
    every rank: a rank whose choice differs for a call gets a layout mismatch
    error (comm/fingerprint.py) instead of a wrong result."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"set_crossover: need a size in bytes >= 0, got {nbytes}")
    settings.current().crossover = nbytes


def get_crossover() -> int:
    return settings.current().crossover


def set_subchunk_bytes(nbytes: int) -> None:
    """Ring sub-chunk size in bytes (tuning knob; default RINGPIPE_RING_SUBCHUNK,
    else 1 MiB). Must be the same on every rank, like set_crossover."""
    settings.current().subchunk = max(1, int(nbytes))


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


def _ring_tags(n: int, p: int, itemsize: int, subchunk: int, t0: int, t1: int, semantics: int,
               bits: int) -> tuple[int, int]:
    """(tag, poisoned tag) of the messages of ring phases [t0, t1) (comm/fingerprint.py)."""
    structure = ("ring", t0, t1, n, itemsize, subchunk, p)
    if n < p and t1 - t0 < 2 * p - 2:
        # A reduce_scatter or allgather alone with some chunk empty: a rank may
        # receive nothing, so a poisoned rank could not count on every rank
        # noticing (comm/fingerprint.py). Any difference then is structural.
        structure += (semantics,)
    return fingerprint.tags(bits, structure, semantics)


@functools.lru_cache(maxsize=256)
def _schedule(n: int, p: int, r: int, itemsize: int, subchunk: int, t0: int, t1: int,
              semantics: int, bits: int):
    """Everything about phases [t0, t1) that does not depend on the buffer,
    so the hot loop only slices and calls MPI.

    Returns (scratch elements, initial sends, phases, (tag, poisoned tag));
    the tags carry the layout fingerprint (`semantics`: the layout record's
    hash; `bits`: the tag width). A phase is
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
    tags = _ring_tags(n, p, itemsize, subchunk, t0, t1, semantics, bits)
    return nslots * maxc, subs[(r - t0 - 1) % p], tuple(phases), tags


def _call_name(t0: int, t1: int, p: int) -> str:
    """Which collective ring phases [t0, t1) are, for error messages."""
    if t0 == 0:
        return "allreduce (ring)" if t1 == 2 * p - 2 else "reduce_scatter"
    return "allgather"


def _ring(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc, avg: bool,
          t0: int, t1: int, semantics: int) -> bool:
    """Run ring phases [t0, t1) in place on `flat`. `wire` is the same memory
    as MPI should see it (see _wire). The reductions run where `flat` lives:
    numpy on the host, cupy on the GPU (a CUDA-aware MPI moves device memory).
    `semantics`: the layout's semantics hash for the fingerprint. Returns True
    if this rank ended the call poisoned: the ranks passed different layouts
    with the same messages, and the caller must raise (comm/fingerprint.py)."""
    ctx.ensure_usable()
    comm, p, r = ctx.comm, ctx.size, ctx.rank
    left, right = (r - 1) % p, (r + 1) % p
    nscratch, init, phases, (tag, poisoned_tag) = _schedule(
        flat.size, p, r, flat.itemsize, ctx.settings.subchunk, t0, t1, semantics, ctx.tag_bits)
    stag = tag              # what our sends carry: poisoned_tag once a mismatch is seen
    status, any_tag = ctx.status, MPI.ANY_TAG
    Isend, Irecv = comm.Isend, comm.Irecv
    xp, ufunc, sync = device.array_ops(flat, ufunc)
    if nscratch:
        scratch = ctx.scratch(flat.dtype, nscratch, xp)
        swire = scratch if wire is flat else scratch.view(wire.dtype)

    # Receives first: a message that finds its receive already posted skips
    # MPI's unexpected-message path.
    rq = [Irecv(swire[sa:sb] if sa >= 0 else wire[a:b], left, any_tag)
          for a, b, sa, sb in phases[0][1]]
    nrq = []
    sends = {t0: [Isend(wire[a:b], right, stag) for a, b in init]}
    try:
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
                        nrq.append(Irecv(swire[nsa:nsb], left, any_tag))
                        rq[j].Wait(status)
                    else:
                        # Into memory our own earlier send reads: block on phase
                        # t's piece first, by when that send has nearly always
                        # completed too, so its Wait costs no extra round trip.
                        rq[j].Wait(status)
                        if old is not None:
                            old[j].Wait()
                        nrq.append(Irecv(wire[na:nb], left, any_tag))
                    j_next = j + 1
                else:
                    rq[j].Wait(status)
                # Checked before this piece is forwarded, so a rank poisoned by
                # it passes the poison on with it.
                if status.Get_tag() != tag:
                    stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, left,
                                                       _call_name(t0, t1, p), flat)
                if red:
                    d = flat[a:b]
                    ufunc(d, scratch[sa:sb], out=d)
                    if last and avg:
                        xp.divide(d, p, out=d)
                    if sync is not None:
                        sync()            # the GPU must finish the sum before MPI sends it
                if fwd:
                    out.append(Isend(wire[a:b], right, stag))
            if fwd:
                for j in range(j_next, n_next):
                    na, nb, nsa, nsb = nrecvs[j]
                    if nsa >= 0:
                        nrq.append(Irecv(swire[nsa:nsb], left, any_tag))
                    else:
                        if old is not None:
                            old[j].Wait()
                        nrq.append(Irecv(wire[na:nb], left, any_tag))
                rq = nrq
        for lst in sends.values():
            MPI.Request.Waitall(lst)
    except BaseException as e:
        # Broke off half-way: requests are still pending on our memory.
        error = e
        if fingerprint.is_truncation(e):
            error = fingerprint.truncation_error(ctx, left, _call_name(t0, t1, p), flat)
        ctx.abandon(rq + (nrq if nrq is not rq else []), sends, f"{type(error).__name__}: {error}")
        if error is e:
            raise
        raise error from e
    return stag != tag


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
        return "small" if nbytes <= settings.current().crossover else "ring"
    return algorithm


_LAYOUT = "{} layout (length, dtype, op, algorithm, ok, shape/order)"


def _semantics(record: tuple) -> int:
    """The semantics half of a layout fingerprint: a CRC of the whole record
    that the layout check compares."""
    return zlib.crc32(repr(record).encode())


def _raise_poisoned(ctx: CommContext, what: str, arr, flat, op: str, algo: str):
    """End a call this rank finished poisoned. Every rank of the call did
    (comm/fingerprint.py), so every rank enters this Allgather and raises the
    same error."""
    garbage = ("\n  The call had run to its end with these layouts before the ranks could tell: the "
               "buffer holds garbage now, on every rank.")
    try:
        check_consistent(ctx.comm, _LAYOUT.format(what), _codes(arr, flat, op, algo), LAYOUT_LEGEND)
    except RuntimeError as e:
        raise RuntimeError(f"{e}{garbage}") from None
    raise RuntimeError(f"ringpipe: the ranks' layout fingerprints in {what} differed, although their "
                       "layout records agree (do all ranks run the same ringpipe version?)" + garbage)


def _allreduce_ctx(ctx: CommContext, arr, flat: np.ndarray, op: str, algo: str, semantics: int,
                   what: str = "allreduce") -> None:
    """All-reduce a validated flat buffer (`arr` reshaped) on a private context.
    No layout check of its own: the fingerprints with `semantics` (the hash of
    the layout record) still catch ranks passing different layouts."""
    if ctx.size == 1 or flat.size == 0:
        return
    if algo == "small":
        poisoned = allreduce_small(ctx, flat, _wire(flat), _REDUCE[op], op == "avg", semantics)
    else:
        poisoned = _ring(ctx, flat, _wire(flat), _REDUCE[op], op == "avg", 0, 2 * ctx.size - 2, semantics)
    if poisoned:
        _raise_poisoned(ctx, what, arr, flat, op, algo)


def _context(comm):
    """The private context of `comm`, or None on a single rank. Creating it
    compares the comm settings across the ranks, so a bad or differing
    RINGPIPE_* value raises on every rank alike (a single rank checks its own)."""
    if comm.Get_size() == 1:
        settings.current()
        return None
    return context_for(comm)


def _prepare(what: str, ctx, arr, flat, op: str, algo: str, is_array: bool = True) -> int:
    """Agree on the layout across ranks (per RINGPIPE_COMM_CHECK), then
    validate it. Returns the layout's semantics hash for the fingerprints."""
    if ctx is None:
        _validate(what, arr, flat, op, algo, is_array)
        return 0
    ok = is_array and flat is not None and _writeable(arr)
    key = (what, arr.size, arr.dtype, op, algo, ok, arr.shape, arr.flags.c_contiguous)
    semantics = ctx.valid.get(key)
    if semantics is not None and not ctx.always_check:
        return semantics
    record = _codes(arr, flat, op, algo, is_array)
    ctx.ensure_checked(_LAYOUT.format(what), record, LAYOUT_LEGEND)
    # Only reached once the ranks agree, so they all raise the same error.
    _validate(what, arr, flat, op, algo, is_array)
    semantics = _semantics(record)
    ctx.valid[key] = semantics
    return semantics


def allreduce(buf, comm=None, op: str = "sum", algorithm: str = "auto"):
    """In-place all-reduce of a contiguous buffer; returns `buf`.

    op: 'sum' | 'avg' | 'max' | 'min' (or MPI.SUM / MPI.MAX / MPI.MIN). algorithm: 'ring' (bandwidth-optimal),
    'small' (latency-optimal recursive doubling) or 'auto' (by byte size
    against get_crossover()). Every rank ends with bit-identical bytes.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    ctx = _context(comm)
    op = op_name(op)
    arr, flat, writeback = _host_flat(buf)
    algo = _resolve(algorithm, arr.nbytes)
    semantics = _prepare("allreduce", ctx, arr, flat, op, algo, is_buffer(buf))
    if ctx is not None:
        _allreduce_ctx(ctx, arr, flat, op, algo, semantics)
    if writeback is not None:
        writeback(arr)
    return buf


def reduce_scatter(buf, comm=None, op: str = "sum"):
    """In-place ring reduce-scatter: afterwards this rank's chunk
    (chunk_bounds(buf.size, p)[rank]) holds the reduced values; returns that
    view of the flattened buffer. The rest of `buf` is left as scratch."""
    comm = MPI.COMM_WORLD if comm is None else comm
    ctx = _context(comm)
    op = op_name(op)
    arr, flat, writeback = _host_flat(buf)
    semantics = _prepare("reduce_scatter", ctx, arr, flat, op, "ring", is_buffer(buf))
    lo, hi = chunk_bounds(flat.size, comm.Get_size())[comm.Get_rank()]
    if ctx is not None and flat.size:
        if _ring(ctx, flat, _wire(flat), _REDUCE[op], op == "avg", 0, ctx.size - 1, semantics):
            _raise_poisoned(ctx, "reduce_scatter", arr, flat, op, "ring")
    if writeback is not None:
        writeback(arr)
        return buf.reshape(-1)[lo:hi]
    return flat[lo:hi]


def allgather(buf, comm=None):
    """In-place ring all-gather: chunk r of `buf` (chunk_bounds) is valid on
    rank r beforehand; afterwards all of `buf` is filled on every rank."""
    comm = MPI.COMM_WORLD if comm is None else comm
    ctx = _context(comm)
    arr, flat, writeback = _host_flat(buf)
    semantics = _prepare("allgather", ctx, arr, flat, "none", "ring", is_buffer(buf))
    if ctx is not None and flat.size:
        if _ring(ctx, flat, _wire(flat), None, False, ctx.size - 1, 2 * ctx.size - 2, semantics):
            _raise_poisoned(ctx, "allgather", arr, flat, "none", "ring")
    if writeback is not None:
        writeback(arr)
    return buf
