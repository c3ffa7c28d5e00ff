"""Do all ranks hold the same values? check_consistent answers with one small
Allgather, and raises the same error on every rank when they do not.

It is how a mismatch between ranks (different layouts, arguments, settings)
becomes an error on every rank instead of a hang: the ranks first agree on
what they were given, and only then validate it, so every rank raises the
same error (or none does).
"""

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

__all__ = ["check_consistent"]

# One fixed-size record per rank: a length slot plus up to _SLOTS-1 values.
# Fixed size matters: if ranks passed tuples of different lengths and we sized
# the Allgather by the tuple, the collective itself would be mismatched.
_SLOTS = 9


def _as_int(v) -> int:
    if isinstance(v, (bool, int, np.integer)):
        return int(v)
    # Anything else (a float, a string) is compared by its repr: 1.4 must not pass for 1.
    return zlib.crc32(repr(v).encode())


def _record(values) -> np.ndarray:
    vals = [_as_int(v) for v in values]
    rec = np.zeros(_SLOTS, dtype=np.int64)
    if len(vals) > _SLOTS - 1:
        # Fold the overflow into one slot; a collision only weakens the check.
        tail = np.asarray(vals[_SLOTS - 2 :], dtype=np.int64).tobytes()
        vals = vals[: _SLOTS - 2] + [zlib.crc32(tail)]
        rec[0] = -len(values)  # negative length flags "tail hashed"
    else:
        rec[0] = len(vals)
    rec[1 : 1 + len(vals)] = vals
    return rec


def check_consistent(comm, what: str, values, legend: str = "") -> None:
    """Raise the same RuntimeError on every rank unless all ranks passed equal
    `values` (a small tuple of ints; other values are compared by a CRC32 of
    their repr, and shown as that). One uppercase Allgather; collective.
    `legend`, if given, is appended to the message to decode the values."""
    comm = MPI.COMM_WORLD if comm is None else comm
    mine = _record(values)
    if comm.Get_size() == 1:
        return
    table = np.empty((comm.Get_size(), _SLOTS), dtype=np.int64)
    comm.Allgather(mine, table)
    if (table == table[0]).all():
        return
    lines = []
    for r, rec in enumerate(table):
        k = abs(int(rec[0]))
        shown = tuple(int(v) for v in rec[1 : 1 + min(k, _SLOTS - 1)])
        lines.append(f"  rank {r}: {shown}{'  (tail hashed)' if rec[0] < 0 else ''}")
    raise RuntimeError(
        f"ringpipe: inconsistent {what} across the {comm.Get_size()} ranks of the "
        f"communicator (every rank must pass the same values):\n" + "\n".join(lines)
        + (f"\n  ({legend})" if legend else "")
    )
