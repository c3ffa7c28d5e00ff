"""Layout fingerprints in the MPI tags of the ring's and the small path's messages.

The layout check (comm/collectives.py) compares a layout across the ranks
with an Allgather only on its first use per communicator. Ranks that pass
different layouts they have each used before skip it, and when the layouts
happen to need the same messages (float32[5000] on one rank, int32[5000] on
another) the call would "succeed" with different bytes on every rank. So
every message of a collective carries its sender's layout in its tag, and
every receive takes any tag (MPI.ANY_TAG) and compares it with its own. That
costs no extra message and no extra byte.

The tag is not needed for matching: MPI delivers the messages of one sender
on one communicator in the order they were sent, and the ring and the small
path post their receives in the order the peer sends (see comm/ring.py and
comm/small.py).

A tag has tag_bits() bits (from MPI_TAG_UB: 29 with MPICH; the standard only
promises 15), used as

    [ POISON | structure hash | semantics hash ]

structure: what decides the size and the number of the messages: algorithm,
    collective (its ring phases), element count, element size, ring
    sub-chunk size, communicator size.
semantics: a hash of the whole layout record (dtype, op, shape and memory
    order, ...: comm/layout.py's layout_record).

A rank receiving a tag unlike its own:

- structure differs: the messages do not line up (sizes, counts), so the call
  cannot finish. Raise at once (structure_error). The other ranks may wait
  for messages that never come; under comm.abort_on_error() (as the trainer
  runs) the whole job ends. An MPI truncation error (a message larger than
  its receive) means the same and raises the same way.
- semantics differ, or the POISON bit is set: the messages line up, so the
  call runs to its end, but this rank is poisoned: every message it sends from
  then on carries POISON. At the end every rank is poisoned (below), and all
  of them run the layout check's Allgather, which raises the same detailed
  error on every rank.

Why every rank ends the call poisoned. A rank X that ends unpoisoned
received only messages whose tag equals its own. Each was sent by a rank
that was unpoisoned then, so its own tag equals X's, and that rank had, before
the send, received only messages with that same tag; and so on back. A rank
checks a piece's tag before it forwards anything computed from it, so this
backward chain follows the data X's result is made of. In an all-reduce X's
result depends on every rank's input (that is what an all-reduce is), so the
chain reaches every rank: all have X's fingerprint, and there was no
mismatch. Hence a mismatch poisons every rank. In detail, ring: chunk 0
(never empty) is reduced along the whole ring and then passed along it
again, so every rank's copy of it comes from every rank; small path: a
butterfly, in which every rank's final buffer depends on every rank
(folded-out ranks get the result from their partner). Reduce_scatter alone:
rank X's own chunk travels through every other rank before X receives it
last; allgather alone: chunk X+1 travels from its owner through every other
rank to X. Both only if those chunks are not empty: with fewer elements than
ranks a rank may receive nothing at all, so there the semantics count as
structure (comm/ring.py).
"""

from __future__ import annotations

import functools
import zlib

from mpi4py import MPI

__all__ = ["tag_bits", "tags", "poison_or_raise", "structure_error", "truncation_error",
           "is_truncation"]


def tag_bits(comm) -> int:
    """Bits of tag this communicator's MPI takes: the largest b with 2**b - 1 <= MPI_TAG_UB."""
    ub = comm.Get_attr(MPI.TAG_UB)
    if ub is None:
        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return (int(ub) + 1).bit_length() - 1


def _split(bits: int) -> tuple[int, int]:
    """(structure bits, semantics bits) under the POISON bit."""
    semantics_bits = (bits - 1) // 2
    return bits - 1 - semantics_bits, semantics_bits


@functools.lru_cache(maxsize=512)
def tags(bits: int, structure: tuple, semantics: int) -> tuple[int, int]:
    """(tag, poisoned tag) for the messages of one collective call.
    `structure`: a tuple of what decides the message sizes and counts;
    `semantics`: a hash of the layout record."""
    structure_bits, semantics_bits = _split(bits)
    s = zlib.crc32(repr(structure).encode()) & ((1 << structure_bits) - 1)
    tag = (s << semantics_bits) | (semantics & ((1 << semantics_bits) - 1))
    return tag, tag | (1 << (bits - 1))


def _structure(bits: int, tag: int) -> int:
    structure_bits, semantics_bits = _split(bits)
    return (tag >> semantics_bits) & ((1 << structure_bits) - 1)


def poison_or_raise(ctx, got: int, tag: int, poisoned_tag: int, source: int, call: str, flat) -> int:
    """A message from `source` came with tag `got` instead of our `tag`.
    Raise if its structure differs; otherwise return the tag our sends carry
    from now on (poisoned)."""
    if _structure(ctx.tag_bits, got) != _structure(ctx.tag_bits, tag):
        raise structure_error(ctx, source, call, flat,
                              "whose layout fingerprint differs in what decides the size and the number "
                              "of the messages (length, dtype size, algorithm, collective or ring "
                              "sub-chunk size)")
    return poisoned_tag


def is_truncation(exc: BaseException) -> bool:
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE


def truncation_error(ctx, source: int, call: str, flat) -> RuntimeError:
    return structure_error(ctx, source, call, flat,
                           "larger than the part of the buffer it was meant for (MPI truncation error), "
                           "so the ranks passed different layouts (length, dtype size, algorithm, "
                           "collective or ring sub-chunk size)")


def structure_error(ctx, source: int, call: str, flat, what: str) -> RuntimeError:
    return RuntimeError(
        f"ringpipe: layout mismatch: rank {ctx.rank} of the {ctx.size}-rank communicator, in {call} of "
        f"{flat.dtype}[{flat.size}], received a message from rank {source} {what}. Every rank must pass "
        f"the same layout (length, dtype, op, algorithm, shape) to each collective call. This call cannot "
        f"complete, and ringpipe collectives on this communicator stop working; under "
        f"comm.abort_on_error() (as the trainer runs) the whole job ends here, otherwise other ranks may "
        f"wait forever. To find the call where the ranks diverge, run with RINGPIPE_COMM_CHECK=always "
        f"(every call then compares the layouts first and names each rank's).")
