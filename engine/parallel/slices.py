"""A rank's slices of the checkpoint arrays, as boxes of the whole arrays.

A sharded checkpoint (engine/job/sharded.py) stores each array ("param/<name>",
"opt/<state>/<name>") as pieces, each a box of the whole array: the coordinates of
the model, the same at every layout. This module turns what a rank holds into such
boxes and back:

  - the rank's flat buffer (ParamBuffer: its parameters one after another, each its
    tensor-parallel part, Split) is cut by flat ranges: the data axis's chunks (ZeRO's,
    or, without ZeRO, an equal share per replica so that saving is parallel too), less
    the ranges another rank holds the same values of (norm_excluded: the tied embedding's
    second copy, the replicated parameters on every tensor rank but the first). What is
    left, over every rank, covers each whole array exactly once.
  - a flat range of one parameter is at most three boxes of its part (a partial row,
    whole rows, a partial row: each contiguous in memory), and a box of the part is
    one box of the whole array per block of the split (q, k and v: three), padding rows
    (the vocabulary-parallel wte's) left out.

Reading is the same walk the other way: each box the rank holds is filled from the
pieces that overlap it (sharded.Reader.read_box), whatever layout wrote them.

Every parameter is viewed as 2-D (a vector as one row) while cutting; boxes leave in
the parameter's own dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringpipe import comm
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.params import ParamBuffer


@dataclass
class LocalSlices:
    """What one rank holds of a checkpoint's state, and what it writes of it.

    held: {"param" or "opt/<state>": [(lo, hi, array)]}: the flat ranges of the rank's
          buffer layout (params.offsets) it holds, each with a 1-D array of its values
          (views of the live buffers: reading fills them in place).
    written: the flat ranges (lo, hi) this rank writes, of every key alike."""
    params: ParamBuffer
    held: dict
    written: list

    def only(self, key: str) -> "LocalSlices":
        """The same, of one of the arrays (key "param": the parameters alone)."""
        return LocalSlices(self.params, {key: self.held[key]}, self.written)


def share(size: int, count: int, index: int, excluded=()) -> list:
    """The flat ranges a replica writes without ZeRO: its equal share of [0, size), less
    `excluded`."""
    lo, hi = comm.chunk_bounds(size, count)[index]
    return subtract([(lo, hi)], excluded)


def subtract(ranges, excluded) -> list:
    """The parts of the (lo, hi) ranges outside every excluded range."""
    out = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for a, b in excluded:
            pieces = [p for x, y in pieces for p in ((x, min(y, a)), (max(x, b), y)) if p[0] < p[1]]
        out.extend(pieces)
    return out


def whole_shapes(local: LocalSlices) -> dict:
    """{array name: (whole shape, dtype)} of every array this rank holds a part of."""
    out = {}
    for key, segments in local.held.items():
        dtype = segments[0][2].dtype if segments else local.params.dtype
        for spec in local.params.specs:
            out[_array_name(key, spec)] = (spec.full_shape, np.dtype(dtype))
    return out


def pieces(local: LocalSlices):
    """(array name, whole box, host array) of every piece this rank writes, one at a time:
    a view where the buffer is on the host and the piece contiguous, else a copy of that
    piece (an asynchronous save copies them all into its staging buffer)."""
    for key, spec, array, at, pbox in _part_boxes_of(local, written=True):
        values = np.asarray(to_host(array[at:at + _volume(pbox)])).reshape([hi - lo for lo, hi in pbox])
        for sub, full in _to_whole(spec, pbox):
            part = values[_relative(sub, pbox)]
            part = part if part.flags.c_contiguous else part.copy()
            yield _array_name(key, spec), _own_dims(spec, full), _own_dims_array(spec, part)


def piece_bytes(local: LocalSlices) -> int:
    """The bytes of every piece `pieces` yields, from the geometry alone (no value is read)."""
    return sum(_volume(full) * array.dtype.itemsize
               for _, spec, array, _, pbox in _part_boxes_of(local, written=True) for _, full in _to_whole(spec, pbox))


def fill(local: LocalSlices, read_box) -> None:
    """Fill every range the rank holds from read_box(array name, whole box, out)
    (sharded.Reader.read_box); padding rows are left as they are (zeros)."""
    for key, spec, array, at, pbox in _part_boxes_of(local, written=False):
        dest = array[at:at + _volume(pbox)]
        host = dest if isinstance(dest, np.ndarray) else np.zeros(dest.size, dtype=dest.dtype)
        values = host.reshape([hi - lo for lo, hi in pbox])
        for sub, full in _to_whole(spec, pbox):
            read_box(_array_name(key, spec), _own_dims(spec, full), _own_dims_array(spec, values[_relative(sub, pbox)]))
        if host is not dest:
            dest[...] = local.params.xp.asarray(host)


# ---- the geometry ------------------------------------------------------------------------

def _array_name(key, spec):
    return f"{key}/{spec.name}"


def _part_boxes_of(local, written):
    """(key, spec, segment array, where the part box starts in it, part box) of every part box
    of the ranges this rank holds (written: only of those it writes), one held segment at a time."""
    for key, segments in local.held.items():
        for seg_lo, seg_hi, array in segments:
            ranges = [(max(lo, seg_lo), min(hi, seg_hi)) for lo, hi in local.written] if written else [(seg_lo, seg_hi)]
            for lo, hi in ranges:
                for spec, a, b in _params_in(local.params, lo, hi):
                    t_lo = local.params.offsets[spec.name][0]
                    for flat, pbox in _part_boxes(spec, a, b):
                        yield key, spec, array, t_lo + flat - seg_lo, pbox


def _params_in(params, lo, hi):
    """(spec, a, b) of each parameter overlapping the flat range [lo, hi): [a, b) its own
    flat range (of its part) inside it."""
    for spec in params.specs:
        t_lo, t_hi = params.offsets[spec.name]
        if max(lo, t_lo) < min(hi, t_hi):
            yield spec, max(lo, t_lo) - t_lo, min(hi, t_hi) - t_lo


def _shape2d(shape):
    if len(shape) == 1:
        return (1, shape[0])
    if len(shape) == 2:
        return tuple(shape)
    raise ValueError(f"a parameter of shape {shape}: sharded checkpoints cut 1-D and 2-D parameters")


def _volume(box):
    return (box[0][1] - box[0][0]) * (box[1][1] - box[1][0])


def _part_boxes(spec, a, b):
    """The flat range [a, b) of spec's part as (flat start, 2-D box) pieces, each
    contiguous in memory: a partial first row, the whole rows, a partial last row."""
    cols = _shape2d(spec.shape)[1]
    out = []
    while a < b:
        row, col = divmod(a, cols)
        if col or b - a < cols:                       # a partial row
            end = min(b, (row + 1) * cols)
            out.append((a, ((row, row + 1), (col, end - row * cols))))
        else:                                         # whole rows
            end = a + (b - a) // cols * cols
            out.append((a, ((row, end // cols), (0, cols))))
        a = end
    return out


def _to_whole(spec, pbox):
    """[(sub-box of the part box, the same values' box in the whole array)]: one per block
    of the split the part box crosses (Split.blocks), padding rows left out."""
    split = spec.split
    if split is None:
        return [(pbox, pbox)]
    d = split.dim + (2 - len(spec.shape))             # the split's dimension in the 2-D view
    whole_len = _shape2d(spec.full_shape)[d]
    blocks = split.blocks(whole_len)                  # each group's (start, end) in the padded whole array
    width = blocks[0][1] - blocks[0][0]               # this rank's part of each group
    lo, hi = pbox[d]
    out = []
    for g in range(lo // width, -(-hi // width)):
        p0, p1 = max(lo, g * width), min(hi, (g + 1) * width)
        f0 = blocks[g][0] + p0 - g * width
        f1 = min(f0 + p1 - p0, whole_len)
        if f0 >= f1:
            continue                                  # padding rows only
        sub, full = list(pbox), list(pbox)
        sub[d], full[d] = (p0, p0 + f1 - f0), (f0, f1)
        out.append((tuple(sub), tuple(full)))
    return out


def _relative(sub, box):
    return tuple(slice(s0 - b0, s1 - b0) for (s0, s1), (b0, _) in zip(sub, box))


def _own_dims(spec, box2d):
    return [list(box2d[1])] if len(spec.shape) == 1 else [list(pair) for pair in box2d]


def _own_dims_array(spec, values):
    return values[0] if len(spec.shape) == 1 else values
