"""What the ranks must agree on before a collective: the layout of its buffer.

A layout record is a few small integers (length, dtype, op, algorithm,
whether the buffer is usable, shape and memory order) that fits the fixed
record check_consistent exchanges (comm/consistency.py). The ranks first
compare their records, and only then validate them, so every rank raises the
same error (or none does). Its hash (semantics_hash) also travels in every
message's tag (comm/fingerprint.py).

Used by the collectives (comm/collectives.py) and GradBuckets (comm/buckets.py).
"""

from __future__ import annotations

import zlib

import numpy as np
from mpi4py import MPI

from .device import is_device_array

__all__ = ["DTYPE_CODES", "OP_CODES", "ALGO_CODES", "LAYOUT_LEGEND", "REDUCE_UFUNCS", "op_name",
           "is_buffer", "usable", "layout_record", "record_title", "semantics_hash", "validate"]

# Small stable integer codes so a layout fits in the fixed int64 record that
# check_consistent exchanges. 0 means "not supported": it still travels, so the
# ranks first agree on what they were given and then all raise the same error.
DTYPE_CODES = {
    np.dtype(np.float16): 1,
    np.dtype(np.float32): 2,
    np.dtype(np.float64): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
}
OP_CODES = {"none": 0, "sum": 1, "avg": 2, "max": 3, "min": 4}     # "none": allgather, which reduces nothing
ALGO_CODES = {"ring": 1, "small": 2, "hierarchical": 3}
LAYOUT_LEGEND = (
    "dtype " + ", ".join(f"{c}={d}" for d, c in DTYPE_CODES.items()) + "; op "
    + ", ".join(f"{c}={o}" for o, c in OP_CODES.items() if c) + "; algorithm "
    + ", ".join(f"{c}={a}" for a, c in ALGO_CODES.items())
    + "; ok 1=contiguous and writeable, -2=not an array; 0 or -1 = unsupported"
    + "; shape/order = a hash of the array's shape and memory order")

# What each reducing op combines two operands with ("avg" sums, and the
# algorithm divides by the number of ranks once, at the end).
REDUCE_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def op_name(op) -> str:
    """'sum'/'avg'/'max'/'min' as given, or MPI.SUM/MAX/MIN by name; anything
    else becomes a string that validation refuses (on every rank alike)."""
    if isinstance(op, str):
        return op
    for name, mpi_op in (("sum", MPI.SUM), ("max", MPI.MAX), ("min", MPI.MIN)):
        if op == mpi_op:
            return name
    return repr(op)


def is_buffer(buf) -> bool:
    """A numpy or device array: something an in-place collective can write into."""
    return isinstance(buf, np.ndarray) or is_device_array(buf)


def _writeable(arr) -> bool:
    # Device arrays (cupy) are always writeable, and have no flag saying so.
    return is_device_array(arr) or arr.flags.writeable


def _shape_code(arr) -> int:
    # Ranks must lay the same elements out the same way: (2, 3) against
    # (3, 2), or C against Fortran order, would mix up elements silently.
    order = "C" if arr.flags.c_contiguous else "F" if arr.flags.f_contiguous else "-"
    return zlib.crc32(repr((tuple(arr.shape), order)).encode()) & 0x7FFFFFFF


def usable(arr, flat, is_array: bool = True) -> bool:
    """Can the call work in place: an array, contiguous (`flat`: its flat
    view, None if it has none) and writeable. (_writeable inlined: every
    collective call asks.)"""
    return is_array and flat is not None and (is_device_array(arr) or arr.flags.writeable)


def layout_record(arr, flat, op: str, algo: str, is_array: bool = True) -> tuple:
    """The layout of a call on `arr` (`flat`: its flat view, None if it is not
    contiguous; is_array: False for a list or scalar the caller passed), as
    the record the ranks compare (see record_title for its fields)."""
    ok = -2 if not is_array else 1 if usable(arr, flat) else 0
    return (
        arr.size,
        DTYPE_CODES.get(arr.dtype, 0),
        OP_CODES.get(op, -1) if isinstance(op, str) else -1,
        ALGO_CODES.get(algo, -1) if isinstance(algo, str) else -1,
        ok,
        _shape_code(arr),
    )


def record_title(call: str) -> str:
    """What the consistency check calls a layout record of `call` in its error."""
    return f"{call} layout (length, dtype, op, algorithm, ok, shape/order)"


def semantics_hash(record: tuple) -> int:
    """The semantics half of a layout fingerprint (comm/fingerprint.py): a CRC
    of the whole record that the layout check compares."""
    return zlib.crc32(repr(record).encode())


def validate(what: str, arr, flat, op: str, algo: str, is_array: bool = True) -> None:
    """Raise if a call `what` cannot run on this layout. Call it only after
    the ranks agreed on the record, so every rank raises the same error here
    (or none does)."""
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
    if op not in REDUCE_UFUNCS and not (op == "none" and what == "allgather"):
        raise ValueError(f"{what}: unknown op {op!r}; use 'sum', 'avg', 'max' or 'min'")
    if op == "avg" and arr.dtype not in _FLOATS:
        raise TypeError(f"{what}: op='avg' needs a float dtype, got {arr.dtype}")
    if algo not in ALGO_CODES:
        raise ValueError(f"{what}: unknown algorithm {algo!r}; use 'auto', 'ring', 'small' or "
                         "'hierarchical'")
