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
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from . import fingerprint
from .context import CommContext
from .device import array_ops

__all__ = ["allreduce_small", "Plan"]

_CALL = "allreduce (small path)"     # for error messages


class Plan(NamedTuple):
    """A rank's part in one call. _plan returns it as a plain tuple in this
    field order, tuple(Plan(...)), for the unpacking fast path (see the
    schedule in comm/ring.py); Plan(*plan) reads it by name."""
    hand_to: int | None     # fold: hand our data to this rank (r + 1) and sit out the
                            # doubling; it hands the result back
    take_from: int | None   # fold: combine this rank's (r - 1) data into ours first,
                            # hand it the result at the end
    exchanges: tuple[tuple[int, bool], ...]   # (peer, peer_is_lower) per doubling step: swap whole
                                              # buffers; the lower rank's operand goes first
    tag: int                # what our messages carry (comm/fingerprint.py)
    poisoned_tag: int       # what they carry once this rank saw a mismatch


@functools.lru_cache(maxsize=256)
def _plan(p: int, r: int, n: int, itemsize: int, semantics: int, bits: int) -> tuple:
    """Rank r's Plan among p ranks, as a plain tuple; the tags carry the
    layout fingerprint of n elements of `itemsize` bytes (`semantics`: the
    layout record's hash; `bits`: the tag width), comm/fingerprint.py."""
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    hand_to = take_from = None
    if r < 2 * rem:
        if r % 2 == 0:
            hand_to = r + 1
        else:
            take_from = r - 1
    exchanges = []
    if hand_to is None:
        # Our rank among the pof2 ranks that double: the odd ranks of the
        # folded pairs, then the rest.
        newrank = r // 2 if r < 2 * rem else r - rem
        mask = 1
        while mask < pof2:
            peer_new = newrank ^ mask
            peer = peer_new * 2 + 1 if peer_new < rem else peer_new + rem
            exchanges.append((peer, peer < r))
            mask <<= 1
    tag, poisoned_tag = fingerprint.tags(bits, ("small", n, itemsize, p), semantics)
    return tuple(Plan(hand_to=hand_to, take_from=take_from, exchanges=tuple(exchanges), tag=tag,
                      poisoned_tag=poisoned_tag))


def allreduce_small(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc,
                    avg: bool, semantics: int) -> bool:
    """All-reduce `flat` in place (`wire`: the same memory as MPI sees it).
    `semantics`: the layout's semantics hash for the fingerprint. Returns True
    if this rank ended the call poisoned: the ranks passed different layouts
    with the same messages, and the caller must raise (comm/fingerprint.py)."""
    ctx.ensure_usable()
    comm, p = ctx.comm, ctx.size
    hand_to, take_from, exchanges, tag, poisoned_tag = _plan(
        p, ctx.rank, flat.size, flat.itemsize, semantics, ctx.tag_bits)
    stag = tag              # what our sends carry: poisoned_tag once a mismatch is seen
    status, any_tag = ctx.status, MPI.ANY_TAG
    # On a device buffer (CUDA-aware MPI) the combines run on the GPU and
    # must finish before MPI sends their result.
    xp, ufunc, sync = array_ops(flat, ufunc)
    tmp = ctx.scratch(flat.dtype, flat.size, xp)
    tmpw = tmp if wire is flat else tmp.view(wire.dtype)

    peer = None             # whom we last received from, for the error message
    try:
        if hand_to is not None:
            comm.Send(wire, hand_to, stag)
        elif take_from is not None:
            peer = take_from
            comm.Recv(tmpw, peer, any_tag, status)
            if status.Get_tag() != tag:
                stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, peer,
                                                   _CALL, flat)
            ufunc(tmp, flat, out=flat)  # the lower rank (take_from) first
        for peer, peer_is_lower in exchanges:
            if sync is not None:
                sync()
            comm.Sendrecv(wire, peer, stag, tmpw, peer, any_tag, status)
            if status.Get_tag() != tag:
                stag = fingerprint.poison_or_raise(ctx, status.Get_tag(), tag, poisoned_tag, peer,
                                                   _CALL, flat)
            if peer_is_lower:
                ufunc(tmp, flat, out=flat)
            else:
                ufunc(flat, tmp, out=flat)
        if avg and hand_to is None:
            # Before the unfold, so the folded-out ranks receive these exact bytes.
            xp.divide(flat, p, out=flat)
        if sync is not None:
            sync()
        if take_from is not None:
            comm.Send(wire, take_from, stag)
        elif hand_to is not None:
            peer = hand_to
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
