"""The public collectives: allreduce, reduce_scatter and allgather, in place.

Each call takes the buffer to where MPI can use it (a flat view; a device
array directly or through pinned host memory, comm/device.py), has the ranks
agree on its layout (comm/layout.py; one small Allgather on its first use
per communicator, RINGPIPE_COMM_CHECK, see comm/context.py), validates it,
picks the algorithm (the ring, comm/ring.py, or recursive doubling for small
messages, comm/small.py) and runs it on the communicator's private context.
The layout fingerprints in the message tags catch the rest at no cost
(comm/fingerprint.py).

allreduce_on_context is the entry point for code that keeps its own private
context and checks its layouts itself (GradBuckets, comm/buckets.py).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import device, settings
from .consistency import check_consistent
from .context import CommContext, context_for
from .hierarchical import Hierarchy
from .layout import (LAYOUT_LEGEND, REDUCE_UFUNCS, is_buffer, layout_record, op_name, record_title,
                     semantics_hash, usable, validate)
from .ring import allgather_ring, allreduce_ring, chunk_bounds, reduce_scatter_ring
from .small import allreduce_small

__all__ = [
    "allreduce",
    "reduce_scatter",
    "allgather",
    "set_crossover",
    "get_crossover",
    "choose_algorithm",
    "allreduce_on_context",
]


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


def choose_algorithm(algorithm: str, nbytes: int, ctx: CommContext | None = None) -> str:
    """The algorithm a call of `nbytes` runs: "auto" becomes "small" at or below
    the crossover; above it, when `ctx`'s ranks span several nodes with the same
    number (> 1) of ranks on each, whichever of "hierarchical" (comm/hierarchical.py:
    the network carries 2(N-1)/N instead of 2(p-1)/p bytes per byte reduced) and
    "ring" the measured cost model predicts faster (comm/costmodel.py), else
    "ring". Anything else stays as given (validation refuses an unknown name).
    The same on every rank: the node map and the cost model are agreed when ctx
    is made."""
    if algorithm == "auto":
        if nbytes <= settings.current().crossover:
            return "small"
        cost = getattr(ctx, "cost", None)
        return cost.best(nbytes) if cost is not None else "ring"
    return algorithm


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
            return buf, None, None          # refused by validate, on either path
        if device.cuda_aware():
            device.synchronize(buf)
            return buf, buf.reshape(-1), None
        arr = device.to_pinned(buf)
        writeback = lambda host: device.copy_back(buf, host)  # noqa: E731
    elif isinstance(buf, np.ndarray):
        arr, writeback = buf, None
    else:
        # A list or scalar: validate refuses it (once the ranks agreed), since
        # the result would land in a copy the caller never sees.
        return np.asarray(buf), None, None
    if arr.flags.c_contiguous or arr.flags.f_contiguous:
        return arr, arr.reshape(-1, order="A"), writeback
    return arr, None, writeback


def _wire(flat: np.ndarray) -> np.ndarray:
    # float16 travels as uint16: not every MPI has a half-precision datatype,
    # and MPI only ever moves our bytes (numpy does all arithmetic).
    return flat.view(np.uint16) if flat.dtype.char == "e" else flat


def _raise_poisoned(ctx: CommContext, what: str, arr, flat, op: str, algo: str):
    """End a call this rank finished poisoned. Every rank of the call did
    (comm/fingerprint.py), so every rank enters this Allgather and raises the
    same error."""
    garbage = ("\n  The call had run to its end with these layouts before the ranks could tell: the "
               "buffer holds garbage now, on every rank.")
    try:
        check_consistent(ctx.comm, record_title(what), layout_record(arr, flat, op, algo), LAYOUT_LEGEND)
    except RuntimeError as e:
        raise RuntimeError(f"{e}{garbage}") from None
    raise RuntimeError(f"ringpipe: the ranks' layout fingerprints in {what} differed, although their "
                       "layout records agree (do all ranks run the same ringpipe version?)" + garbage)


def allreduce_on_context(ctx: CommContext, arr, flat: np.ndarray, op: str, algo: str, semantics: int,
                         what: str = "allreduce") -> None:
    """All-reduce `flat` (`arr` as a flat view) in place on the private context
    `ctx`, with algorithm `algo` ("ring" or "small", already chosen). The
    caller has had the ranks agree on the layout and validated it: no layout
    check here. `semantics`: the layout record's semantics_hash, which the
    message fingerprints carry, so ranks passing different layouts still get
    an error naming `what` instead of wrong bytes."""
    if ctx.size == 1 or flat.size == 0:
        return
    if algo == "hierarchical":
        # Three collectives on the node and cross-node communicators, each with
        # its own layout check and fingerprints.
        allreduce_hierarchical(ctx.hierarchy(), flat, op)
        return
    allreduce_algorithm = allreduce_small if algo == "small" else allreduce_ring
    if allreduce_algorithm(ctx, flat, _wire(flat), REDUCE_UFUNCS[op], op == "avg", semantics):
        _raise_poisoned(ctx, what, arr, flat, op, algo)


def allreduce_hierarchical(hierarchy: Hierarchy, flat, op: str) -> None:
    """All-reduce `flat` (contiguous, numpy or a device array) in place over the
    hierarchy's communicator. op: sum | avg | max | min (avg: summed, then divided
    by the number of ranks once, on the chunk each rank owns). The steps are in
    comm/hierarchical.py's docstring; each is a public collective of this module on the
    node or cross-node communicator, with its own layout check and fingerprints."""
    h = hierarchy
    inner = "sum" if op == "avg" else op
    if h.nodes.even:
        chunk = reduce_scatter(flat, h.node, op=inner) if h.local_size > 1 else flat
        if h.cross.Get_size() > 1:
            allreduce(chunk, h.cross, op=inner)          # ring or small, by the chunk's size
        if op == "avg":
            _divide(chunk, h.p)
        if h.local_size > 1:
            allgather(flat, h.node)
        return
    allreduce(flat, h.node, op=inner)
    if h.cross is not None and h.cross.Get_size() > 1:
        allreduce(flat, h.cross, op=inner)
    if op == "avg" and h.local_rank == 0:
        _divide(flat, h.p)
    if h.local_size > 1:
        _broadcast(flat, h.node)


def _divide(chunk, p: int) -> None:
    if chunk.size:
        chunk /= p                                      # numpy or cupy alike, in place


def _broadcast(flat, comm) -> None:
    wire = flat.view(np.uint16) if flat.dtype.char == "e" else flat
    if device.is_device_array(flat):
        device.synchronize(flat)
    comm.Bcast(wire, root=0)


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
        validate(what, arr, flat, op, algo, is_array)
        return 0
    key = (what, arr.size, arr.dtype, op, algo, usable(arr, flat, is_array), arr.shape,
           arr.flags.c_contiguous)
    semantics = ctx.valid.get(key)
    if semantics is not None and not ctx.always_check:
        return semantics
    record = layout_record(arr, flat, op, algo, is_array)
    ctx.ensure_checked(record_title(what), record, LAYOUT_LEGEND)
    # Only reached once the ranks agree, so they all raise the same error.
    validate(what, arr, flat, op, algo, is_array)
    semantics = semantics_hash(record)
    ctx.valid[key] = semantics
    return semantics


def allreduce(buf, comm=None, op: str = "sum", algorithm: str = "auto"):
    """In-place all-reduce of a contiguous buffer; returns `buf`.

    op: 'sum' | 'avg' | 'max' | 'min' (or MPI.SUM / MPI.MAX / MPI.MIN). algorithm: 'ring' (bandwidth-optimal),
    'small' (latency-optimal recursive doubling), 'hierarchical' (by node:
    reduce-scatter inside, all-reduce across, all-gather inside) or 'auto'
    (choose_algorithm: by byte size and the ranks' nodes). Every rank ends
    with bit-identical bytes.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    ctx = _context(comm)
    op = op_name(op)
    arr, flat, writeback = _host_flat(buf)
    algo = choose_algorithm(algorithm, arr.nbytes, ctx)
    semantics = _prepare("allreduce", ctx, arr, flat, op, algo, is_buffer(buf))
    if ctx is not None:
        allreduce_on_context(ctx, arr, flat, op, algo, semantics)
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
        if reduce_scatter_ring(ctx, flat, _wire(flat), REDUCE_UFUNCS[op], op == "avg", semantics):
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
        if allgather_ring(ctx, flat, _wire(flat), semantics):
            _raise_poisoned(ctx, "allgather", arr, flat, "none", "ring")
    if writeback is not None:
        writeback(arr)
    return buf
