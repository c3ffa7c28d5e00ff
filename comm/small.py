"""Latency-optimal all-reduce for small messages: recursive doubling.

ceil(log2 p) exchanges of the whole buffer instead of the ring's 2(p-1)
messages. A non-power-of-two p is folded first (MPICH's scheme): among the
first 2*rem ranks each even rank hands its data to the odd rank above it and
sits out, the remaining power of two doubles, then the odd ranks hand the
result back. Every combine puts the lower rank's operand first, so both
sides of an exchange compute the identical bits (even for NaN payloads) and
every rank ends with the same bytes.

Messages carry their sender's layout fingerprint in the tag and are received
with any tag (comm/fingerprint.py). Matching needs no tag: between two ranks
at most one message goes each way per stage (fold: even rank to odd; each
doubling step: one exchange with a different peer; unfold: odd to even), and
MPI keeps the messages of one sender in order.
"""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from . import fingerprint
from .device import array_ops
from .safety import CommContext

__all__ = ["allreduce_small"]

_CALL = "allreduce (small path)"     # for error messages


@functools.lru_cache(maxsize=256)
def _schedule(p: int, r: int, n: int, itemsize: int, semantics: int, bits: int):
    """(fold, peers, (tag, poisoned tag)): fold is +1 (hand data up to r+1,
    sit out), -1 (take r-1's data) or 0; peers lists (peer, peer_is_lower)
    per doubling step; the tags carry the layout fingerprint of n elements of
    `itemsize` bytes (`semantics`: the layout record's hash; `bits`: the tag
    width), comm/fingerprint.py."""
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if r < 2 * rem:
        fold = 1 if r % 2 == 0 else -1
        newrank = -1 if fold == 1 else r // 2
    else:
        fold, newrank = 0, r - rem
    peers = []
    if newrank >= 0:
        mask = 1
        while mask < pof2:
            peer_new = newrank ^ mask
            peer = peer_new * 2 + 1 if peer_new < rem else peer_new + rem
            peers.append((peer, peer < r))
            mask <<= 1
    tags = fingerprint.tags(bits, ("small", n, itemsize, p), semantics)
    return fold, tuple(peers), tags


def allreduce_small(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc,
                    avg: bool, semantics: int) -> bool:
    """All-reduce `flat` in place (`wire`: the same memory as MPI sees it).
    `semantics`: the layout's semantics hash for the fingerprint. Returns True
    if this rank ended the call poisoned: the ranks passed different layouts
    with the same messages, and the caller must raise (comm/fingerprint.py)."""
    ctx.ensure_usable()
    comm, p, r = ctx.comm, ctx.size, ctx.rank
    fold, peers, (tag, poisoned_tag) = _schedule(p, r, flat.size, flat.itemsize, semantics, ctx.tag_bits)
    stag = tag              # what our sends carry: poisoned_tag once a mismatch is seen
    status, any_tag = ctx.status, MPI.ANY_TAG
    # On a device buffer (CUDA-aware MPI) the combines run on the GPU and
    # must finish before MPI sends their result.
    xp, ufunc, sync = array_ops(flat, ufunc)
    tmp = ctx.scratch(flat.dtype, flat.size, xp)
    tmpw = tmp if wire is flat else tmp.view(wire.dtype)

    peer = None             # whom we last received from, for the error message
    try:
        if fold == 1:
            comm.Send(wire, r + 1, stag)
        elif fold == -1:
            peer = r - 1
            comm.Recv(tmpw, peer, any_tag, status)
            if status.Get_tag() != tag:
                stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, peer,
                                                   _CALL, flat)
            ufunc(tmp, flat, out=flat)  # lower rank (r - 1) first
        for peer, lower in peers:
            if sync is not None:
                sync()
            comm.Sendrecv(wire, peer, stag, tmpw, peer, any_tag, status)
            if status.Get_tag() != tag:
                stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, peer,
                                                   _CALL, flat)
            if lower:
                ufunc(tmp, flat, out=flat)
            else:
                ufunc(flat, tmp, out=flat)
        if avg and fold != 1:
            # Before the unfold, so the folded-out ranks receive these exact bytes.
            xp.divide(flat, p, out=flat)
        if sync is not None:
            sync()
        if fold == -1:
            comm.Send(wire, r - 1, stag)
        elif fold == 1:
            peer = r + 1
            comm.Recv(wire, peer, any_tag, status)
            if status.Get_tag() != tag:
                stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, peer,
                                                   _CALL, flat)
    except BaseException as e:
        # Blocking calls leave no request pending, but peers may have sent us
        # messages this call will never receive: the next call would take them.
        error = fingerprint.truncation_error(ctx, peer, _CALL, flat) if fingerprint.is_truncation(e) else e
        ctx.abandon((), (), f"{type(error).__name__}: {error}")
        if error is e:
            raise
        raise error from e
    return stag != tag
