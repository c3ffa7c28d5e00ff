"""The ring algorithm (bandwidth-optimal): reduce-scatter, all-gather, and both
in one stream (all-reduce). Its schedule and its hot loop; the public calls,
validation and layout checks are comm/collectives.py's.

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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from . import device, fingerprint, settings
from .context import CommContext

__all__ = ["allreduce_ring", "reduce_scatter_ring", "allgather_ring", "chunk_bounds",
           "set_subchunk_bytes", "Phase", "Schedule"]


def set_subchunk_bytes(nbytes: int) -> None:
    """Ring sub-chunk size in bytes (tuning knob; default RINGPIPE_RING_SUBCHUNK,
    else 1 MiB). Must be the same on every rank, like set_crossover. Unlike the
    environment variable (4K..1G, comm/settings.py), any size from 1 byte is taken
    here: the tests use tiny sub-chunks to put many messages through small arrays."""
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


# --------------------------------------------------------------------------
# The schedule: everything about a call that does not depend on the buffer,
# computed once per (length, ranks, ...) and cached, so the hot loop only
# slices and calls MPI. Slices are built here for the same reason.
#
# Schedule and Phase name the fields; the cached schedule holds plain tuples
# in their field order (tuple(Phase(...))), which the hot loop unpacks.
# CPython unpacks an exact tuple on a fast path, but a NamedTuple (a tuple
# subclass) through the iterator protocol: that made a small all-reduce 2%
# slower. Schedule(*s) or Phase(*phase) reads one by name.


class Phase(NamedTuple):
    """One ring phase of a call: what it receives, and what it does with it."""
    t: int
    parts: tuple[slice, ...]            # the pieces it receives (buffer slices), in the order
                                        # the left neighbour sends them
    slots: tuple[slice, ...] | None     # a reduce-scatter phase: each piece's receive slot in
                                        # the scratch, reduced into its part from there;
                                        # None: an all-gather phase, received straight into the parts
    last_reduce: bool                   # the last reduce-scatter phase: an average divides here
    forward: bool                       # each piece goes on to the right once reduced or landed
                                        # (every phase of the call but its last)
    wait_for: int | None                # the phase whose sends must complete before the next phase
                                        # may receive into their memory; None: no such phase


class Schedule(NamedTuple):
    """A rank's ring phases [t0, t1) on one layout."""
    scratch_size: int               # elements of receive scratch
    first_sends: tuple[slice, ...]  # the pieces the first phase sends before it receives any
    phases: tuple[tuple, ...]       # Phase fields, as plain tuples (see Phase)
    tag: int                        # what our messages carry (comm/fingerprint.py)
    poisoned_tag: int               # what they carry once this rank saw a mismatch


@functools.lru_cache(maxsize=256)
def _subchunks(n: int, p: int, itemsize: int, subchunk: int):
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
              semantics: int, bits: int) -> tuple:
    """Rank r's Schedule of ring phases [t0, t1) on n elements, as a plain
    tuple (see above); the tags carry the layout fingerprint (`semantics`: the
    layout record's hash; `bits`: the tag width)."""
    subs = _subchunks(n, p, itemsize, subchunk)
    rs_end = p - 1  # phases below this reduce, the rest gather
    # Chunk-sized receive slots, alternating by phase: phase t+1 receives into
    # one while phase t is still being reduced out of the other. With a single
    # reduce phase (p = 2) one slot is enough.
    maxc = max((s[-1][1] - s[0][0] for s in subs if s), default=0)
    nslots = min(2, max(0, min(t1, rs_end) - t0))
    phases = []
    for t in range(t0, t1):
        sub = subs[(r - t - 2) % p]
        parts = tuple(slice(a, b) for a, b in sub)
        slots = None
        if t < rs_end:
            base = (t & 1 if nslots == 2 else 0) * maxc - (sub[0][0] if sub else 0)
            slots = tuple(slice(base + a, base + b) for a, b in sub)
        # Gathered data lands in the user's buffer, and MPI forbids writing
        # memory an unfinished Isend still reads: the chunk gather phase t+1
        # receives was sent by reduce-scatter phase t+2-p, same sub-chunks.
        wait_for = t + 2 - p if (t + 1 < t1 and t + 1 >= rs_end and t + 2 - p >= t0) else None
        phases.append(tuple(Phase(t=t, parts=parts, slots=slots, last_reduce=t == rs_end - 1,
                                  forward=t + 1 < t1, wait_for=wait_for)))
    tag, poisoned_tag = _ring_tags(n, p, itemsize, subchunk, t0, t1, semantics, bits)
    first_sends = tuple(slice(a, b) for a, b in subs[(r - t0 - 1) % p])
    return tuple(Schedule(scratch_size=nslots * maxc, first_sends=first_sends, phases=tuple(phases),
                          tag=tag, poisoned_tag=poisoned_tag))


# --------------------------------------------------------------------------
# The three calls: which phases each runs. Each returns True if this rank
# ended the call poisoned: the ranks passed different layouts with the same
# messages, and the caller must raise (comm/fingerprint.py).


def allreduce_ring(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc, avg: bool,
                   semantics: int) -> bool:
    """All-reduce `flat` in place: every phase, reduce-scatter then all-gather."""
    return _run(ctx, flat, wire, ufunc, avg, 0, 2 * ctx.size - 2, semantics, "allreduce (ring)")


def reduce_scatter_ring(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc, avg: bool,
                        semantics: int) -> bool:
    """Reduce-scatter `flat` in place: afterwards rank r's chunk r holds the result."""
    return _run(ctx, flat, wire, ufunc, avg, 0, ctx.size - 1, semantics, "reduce_scatter")


def allgather_ring(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, semantics: int) -> bool:
    """All-gather `flat` in place: rank r's chunk r goes to every rank."""
    return _run(ctx, flat, wire, None, False, ctx.size - 1, 2 * ctx.size - 2, semantics, "allgather")


def _run(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc, avg: bool,
         t0: int, t1: int, semantics: int, call: str) -> bool:
    """Run ring phases [t0, t1) in place on `flat`. `wire` is the same memory
    as MPI should see it (comm/collectives.py). The reductions (`ufunc`; None
    for gather phases only) run where `flat` lives: numpy on the host, cupy on
    the GPU (a CUDA-aware MPI moves device memory). `semantics`: the layout's
    semantics hash for the fingerprint; `call`: the call, for error messages."""
    ctx.ensure_usable()
    comm, p, r = ctx.comm, ctx.size, ctx.rank
    left, right = (r - 1) % p, (r + 1) % p
    scratch_size, first_sends, phases, tag, poisoned_tag = _schedule(
        flat.size, p, r, flat.itemsize, ctx.settings.subchunk, t0, t1, semantics, ctx.tag_bits)
    stag = tag              # what our sends carry: poisoned_tag once a mismatch is seen
    status, any_tag = ctx.status, MPI.ANY_TAG
    Isend, Irecv = comm.Isend, comm.Irecv
    xp, ufunc, sync = device.array_ops(flat, ufunc)
    if scratch_size:
        scratch = ctx.scratch(flat.dtype, scratch_size, xp)
        swire = scratch if wire is flat else scratch.view(wire.dtype)

    # Receives first: a message that finds its receive already posted skips
    # MPI's unexpected-message path.
    _, first_parts, first_slots, _, _, _ = phases[0]
    rq = ([Irecv(swire[slot], left, any_tag) for slot in first_slots] if first_slots is not None
          else [Irecv(wire[part], left, any_tag) for part in first_parts])
    nrq = []
    sends = {t0: [Isend(wire[part], right, stag) for part in first_sends]}
    try:
        # The hot loop. Its phases are plain tuples, unpacked (see Phase).
        for k, (t, parts, slots, last_reduce, forward, wait_for) in enumerate(phases):
            if forward:
                _, next_parts, next_slots, _, _, _ = phases[k + 1]
                n_next = len(next_parts)
                nrq = []
                forwarded = sends[t + 1] = []
                # the sends that read the memory the next phase receives into
                earlier_sends = sends[wait_for] if wait_for is not None else None
                j_next = 0
            for j, part in enumerate(parts):
                if forward and j < n_next:
                    if next_slots is not None:
                        # Into the other scratch slot: post it before blocking on
                        # phase t's piece j, one sub-chunk of lookahead.
                        nrq.append(Irecv(swire[next_slots[j]], left, any_tag))
                        rq[j].Wait(status)
                    else:
                        # Into memory our own earlier send reads: block on phase
                        # t's piece first, by when that send has nearly always
                        # completed too, so its Wait costs no extra round trip.
                        rq[j].Wait(status)
                        if earlier_sends is not None:
                            earlier_sends[j].Wait()
                        nrq.append(Irecv(wire[next_parts[j]], left, any_tag))
                    j_next = j + 1
                else:
                    rq[j].Wait(status)
                # Checked before this piece is forwarded, so a rank poisoned by
                # it passes the poison on with it.
                if status.Get_tag() != tag:
                    stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, left,
                                                       call, flat)
                if slots is not None:     # a reduce-scatter phase
                    d = flat[part]
                    ufunc(d, scratch[slots[j]], out=d)
                    if last_reduce and avg:
                        xp.divide(d, p, out=d)
                    if sync is not None:
                        sync()            # the GPU must finish the sum before MPI sends it
                if forward:
                    forwarded.append(Isend(wire[part], right, stag))
            if forward:
                # The next phase's pieces beyond this phase's count.
                for j in range(j_next, n_next):
                    if next_slots is not None:
                        nrq.append(Irecv(swire[next_slots[j]], left, any_tag))
                    else:
                        if earlier_sends is not None:
                            earlier_sends[j].Wait()
                        nrq.append(Irecv(wire[next_parts[j]], left, any_tag))
                rq = nrq
        for lst in sends.values():
            MPI.Request.Waitall(lst)
    except BaseException as e:
        # Broke off half-way: requests are still pending on our memory.
        error = e
        if fingerprint.is_truncation(e):
            error = fingerprint.truncation_error(ctx, left, call, flat)
        ctx.abandon(rq + (nrq if nrq is not rq else []), sends, f"{type(error).__name__}: {error}")
        if error is e:
            raise
        raise error from e
    return stag != tag
