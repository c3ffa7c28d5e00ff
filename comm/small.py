"""Latency-optimal all-reduce for small messages: recursive doubling.

ceil(log2 p) exchanges of the whole buffer instead of the ring's 2(p-1)
messages. A non-power-of-two p is folded first (MPICH's scheme): among the
first 2*rem ranks each even rank hands its data to the odd rank above it and
sits out, the remaining power of two doubles, then the odd ranks hand the
result back. Every combine puts the lower rank's operand first, so both
sides of an exchange compute the identical bits (even for NaN payloads) and
every rank ends with the same bytes.
"""

from __future__ import annotations

import functools

import numpy as np

from .device import array_ops
from .safety import CommContext

__all__ = ["allreduce_small"]

_TAG_FOLD, _TAG_DOUBLE, _TAG_UNFOLD = 101, 102, 103


@functools.lru_cache(maxsize=64)
def _schedule(p: int, r: int):
    """(fold, peers): fold is +1 (hand data up to r+1, sit out), -1 (take
    r-1's data) or 0; peers lists (peer, peer_is_lower) per doubling step."""
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
    return fold, tuple(peers)


def allreduce_small(ctx: CommContext, flat: np.ndarray, wire: np.ndarray, ufunc,
                    avg: bool) -> None:
    comm, p, r = ctx.comm, ctx.size, ctx.rank
    fold, peers = _schedule(p, r)
    # On a device buffer (CUDA-aware MPI) the combines run on the GPU and
    # must finish before MPI sends their result.
    xp, ufunc, sync = array_ops(flat, ufunc)
    tmp = ctx.scratch(flat.dtype, flat.size, xp)
    tmpw = tmp if wire is flat else tmp.view(wire.dtype)

    if fold == 1:
        comm.Send(wire, r + 1, _TAG_FOLD)
    elif fold == -1:
        comm.Recv(tmpw, r - 1, _TAG_FOLD)
        ufunc(tmp, flat, out=flat)  # lower rank (r - 1) first
    for peer, lower in peers:
        if sync is not None:
            sync()
        comm.Sendrecv(wire, peer, _TAG_DOUBLE, tmpw, peer, _TAG_DOUBLE)
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
        comm.Send(wire, r - 1, _TAG_UNFOLD)
    elif fold == 1:
        comm.Recv(wire, r + 1, _TAG_UNFOLD)
