"""The layout-independent init (engine/model/params.py): a normal parameter is drawn per
block of its full, flattened tensor, so any slice of it (a tensor-parallel part, a ZeRO-3
chunk, any ranges of the buffer) is drawn alone and equals the whole draw restricted to it."""
import tracemalloc
import zlib

import numpy as np
import pytest

from ringpipe.engine.model.params import INIT_BLOCK, ParamBuffer, ParamSpec, Split

SEED = 11


def full_shape_for(split, length=600, other=330):
    """A full shape that `split` divides: about `length` along its dim (less its padding)."""
    per = split.count * split.groups
    shape = [other, other]
    shape[split.dim] = -(-length // per) * per - split.pad
    return tuple(shape)


def part_shape(full_shape, split):
    """The shape a rank of `split` holds of a full parameter (with its padding rows)."""
    shape = list(full_shape)
    shape[split.dim] = (shape[split.dim] + split.pad) // split.count
    return tuple(shape)


def specs(split=None):
    """Parameters of every init, sizes that cross block boundaries at odd offsets."""
    out = [ParamSpec("odd.b", (13,), init="zeros", decay=False),        # shifts what follows off the blocks
           ParamSpec("ln.w", (37,), init="ones", decay=False),
           ParamSpec("big.w", (3 * INIT_BLOCK // 512 + 5, 512), std=0.5),  # 3+ blocks, the last one short
           ParamSpec("small.w", (9, 7))]
    if split is not None:
        out.append(ParamSpec("split.w", part_shape(full_shape_for(split), split), split=split))
    return out


def whole(specs_, dtype=np.float64):
    params = ParamBuffer(specs_, dtype)
    params.init(SEED)
    return params


def random_ranges(size, rng, n=6):
    cuts = np.unique(rng.integers(0, size + 1, size=2 * n))
    pairs = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
    rng.shuffle(pairs)                # any order (ZeRO's chunks come in bucket order: model end first)
    return pairs


def test_element_i_is_block_i_over_B_of_the_named_stream():
    """The scheme itself, pinned: what any layout, and a checkpoint-free rerun, must reproduce."""
    spec = specs()[2]
    params = whole([spec])
    flat = params.view("big.w").reshape(-1)
    n = flat.size
    blocks = -(-n // INIT_BLOCK)
    assert blocks >= 4 and n % INIT_BLOCK
    for b in range(blocks):
        length = min(INIT_BLOCK, n - b * INIT_BLOCK)
        expected = np.random.default_rng([SEED, zlib.crc32(b"big.w"), b]).normal(0.0, 0.5, size=length)
        assert np.array_equal(flat[b * INIT_BLOCK:b * INIT_BLOCK + length], expected)


@pytest.mark.parametrize("trial", range(8))
def test_ranges_draw_the_whole_init_restricted_to_them_and_leave_the_rest(trial):
    rng = np.random.default_rng(trial)
    split = [None, Split(0, 1, 3, groups=3), Split(1, 2, 3), Split(0, 3, 4, pad=8)][trial % 4]
    full = whole(specs(split))
    ranges = random_ranges(full.size, rng)
    part = ParamBuffer(specs(split), np.float64)
    part.data[:] = np.nan                     # what init must not write
    part.init(SEED, ranges=ranges)
    inside = np.zeros(full.size, dtype=bool)
    for a, b in ranges:
        inside[a:b] = True
    assert np.array_equal(part.data[inside], full.data[inside])
    assert np.all(np.isnan(part.data[~inside]))


@pytest.mark.parametrize("split_args", [
    dict(dim=0, count=2), dict(dim=0, count=3, groups=3), dict(dim=1, count=2), dict(dim=1, count=3, groups=3),
    dict(dim=0, count=4, pad=8), dict(dim=1, count=4, pad=2)],
    ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_a_tensor_parallel_part_is_split_take_of_the_full_draw(split_args):
    full = whole([ParamSpec("w", full_shape_for(Split(index=0, **split_args)))])
    for index in range(split_args["count"]):
        split = Split(index=index, **split_args)
        spec = ParamSpec("w", part_shape(full.specs[0].shape, split), split=split)
        expected = split.take(full.view("w"))
        part = whole([spec])
        assert np.array_equal(part.view("w"), expected)
        # and any ranges of the part, of the part's own flat layout
        ranges = random_ranges(spec.size, np.random.default_rng(index))
        sliced = ParamBuffer([spec], np.float64)
        sliced.init(SEED, ranges=ranges)
        for a, b in ranges:
            assert np.array_equal(sliced.data[a:b], expected.reshape(-1)[a:b])
        if split.pad and index == split.count - 1:          # the padding rows (this rank's last) stay zero
            pad = [slice(None)] * 2
            pad[split.dim] = slice(-split.pad, None)
            assert not np.any(part.view("w")[tuple(pad)])


def test_the_values_do_not_depend_on_where_ranges_cut_the_blocks():
    """Cuts one element either side of each block boundary (of the buffer and of the
    parameter, which differ: parameters before it shift it), single elements, a range per
    element near a boundary: always the whole draw's values."""
    full = whole(specs(Split(1, 1, 2, groups=3)))
    lo, _ = full.offsets["big.w"]
    edges = sorted({0, full.size} | {e + d for k in range(1, 4) for e in (k * INIT_BLOCK, lo + k * INIT_BLOCK)
                                     for d in (-1, 0, 1)})
    for ranges in ([(a, b) for a, b in zip(edges, edges[1:])],
                   [(i, i + 1) for i in range(lo + INIT_BLOCK - 3, lo + INIT_BLOCK + 3)],
                   [(lo + INIT_BLOCK // 2, lo + 5 * INIT_BLOCK // 2)]):
        part = ParamBuffer(full.specs, np.float64)
        part.init(SEED, ranges=ranges)
        for a, b in ranges:
            assert np.array_equal(part.data[a:b], full.data[a:b]), (a, b)


def test_float32_is_the_float64_draw_cast_once():
    full64, full32 = whole(specs(Split(0, 0, 2))), whole(specs(Split(0, 0, 2)), np.float32)
    assert np.array_equal(full32.data, full64.data.astype(np.float32))


@pytest.mark.parametrize("split", [None, Split(1, 0, 2), Split(0, 1, 2, groups=3)])
def test_a_slice_is_drawn_without_the_whole_parameter_in_memory(split):
    """A parameter of 64 MB in float64: a rank drawing 1/16 of it never holds more than its
    slice (in its own pages) and a few blocks (the whole draw is what it took before)."""
    full_shape = (4096, 2048)
    spec = ParamSpec("w", part_shape(full_shape, split) if split else full_shape, split=split)
    params = ParamBuffer([spec], np.float32)
    keep = spec.size // 16
    tracemalloc.start()
    try:
        params.init(SEED, ranges=[(spec.size // 3, spec.size // 3 + keep)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB for a slice of {keep * 4 / 2**20:.1f} MiB"


def test_only_two_dimensional_parameters_are_split():
    spec = ParamSpec("w", (2, 3, 4), split=Split(0, 0, 2))
    with pytest.raises(AssertionError):
        ParamBuffer([spec]).init(SEED)
