"""ZeRO-3's sharded start: each data-parallel rank draws only the chunks of the parameters
it keeps (ParamBuffer.init's ranges), and they are the one-process model's values; the
rest of its buffer is never written, so no rank holds the whole model at start-up.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_sharded_start.py`.
"""
import mmap

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe import comm
from ringpipe.engine.model.registry import recipe_named
from ringpipe.engine.parallel.compose import build_rank_model
from ringpipe.engine.train.config import Config

world = MPI.COMM_WORLD
SEED = 7
# Units (a block: 12 d^2 parameters, 12 MiB) several huge pages long, so that what a rank
# never touches is measurable page by page even with transparent huge pages.
SHAPES = {"gpt": dict(n_layer=3, d_model=512, n_head=4, context=16),
          "llama": dict(n_layer=3, d_model=512, n_head=4, n_kv_head=2, context=16)}
LAYOUTS = {2: [("dp2", dict(dp=2))],
           4: [("dp4", dict(dp=4)), ("pp2-dp2", dict(pp=2, dp=2, microbatches=2)), ("tp2-dp2", dict(tp=2, dp=2))]}
CASES = [(name, layout, model) for name, layout in LAYOUTS.get(world.size, []) for model in SHAPES]


def huge_page_bytes():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except OSError:
        return mmap.PAGESIZE


def present_pages(array):
    """(first page's address, whether each page under `array` is backed by memory): the present
    bit of /proc/self/pagemap. Reading a page maps the shared zero page, which counts as
    present: ask before reading what was never written."""
    page = mmap.PAGESIZE
    first = array.ctypes.data // page
    last = (array.ctypes.data + array.nbytes - 1) // page + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first) * 8), dtype=np.uint64)
    return first * page, (entries >> np.uint64(63)).astype(bool)


def untouched_outside(array, owned, edges=()):
    """(pages of `array` backed though no owned range reaches their huge page (a write to a
    range backs the whole huge page around it when the kernel gives one), backed pages wholly
    inside owned ranges, such pages). edges: elements whose page may be backed too."""
    base, present = present_pages(array)
    page, huge, item, start = mmap.PAGESIZE, huge_page_bytes(), array.itemsize, array.ctypes.data
    may = np.zeros(len(present), dtype=bool)
    for a, b in owned:
        lo = (start + a * item) // huge * huge
        hi = -(-(start + b * item) // huge) * huge
        may[max(0, (lo - base) // page):max(0, (hi - base) // page)] = True
    for e in edges:
        may[(start + e * item - base) // page] = True
    inside = np.zeros(len(present), dtype=bool)           # pages wholly inside an owned range
    for a, b in owned:
        inside[-(-(start + a * item - base) // page):(start + b * item - base) // page] = True
    return int(np.count_nonzero(present & ~may)), int(np.count_nonzero(present[inside])), int(inside.sum())


def build(model, layout, zero):
    recipe = recipe_named(model)
    shape = recipe.shape(**SHAPES[model])
    cfg = Config(model=model, seed=SEED, zero=zero, batch_size=8, **layout)
    grid = comm.ProcessGrid(world, [("pipe", cfg.pp), ("data", cfg.dp), ("tensor", cfg.tp)])
    micro = cfg.batch_size // cfg.dp // cfg.microbatches
    return build_rank_model(grid, lambda tensor=None: recipe.layers(shape, tensor), cfg, np.float32, np,
                            micro_shape=(micro, shape.context, shape.d_model), cost_batch=None)


def one_process(model, params):
    """The one-process model's values, laid out as this rank's buffer (its part of each
    split parameter: ParamBuffer.load_flat)."""
    recipe = recipe_named(model)
    whole = recipe.build(recipe.shape(**SHAPES[model]), seed=SEED)
    expected = np.zeros(params.size, dtype=params.dtype)
    params.load_flat(expected, whole.params.state_dict(whole.params.data))
    return expected


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,layout,model", CASES or [(None, None, None)],
                         ids=[f"{c[0]}-{c[2]}" for c in CASES] or ["none"])
def test_zero3_ranks_draw_their_chunks_alone_with_the_one_process_values(name, layout, model):
    if name is None:
        pytest.skip("written for 2 and 4 ranks")
    rank_model = build(model, layout, zero=3)
    try:
        data, owned = rank_model.params.data, rank_model.owned
        # Built: only the owned chunks were written (the inner model drew nothing) ...
        stray, backed, whole_pages = untouched_outside(data, owned)
        assert stray == 0, f"{stray} pages beyond the owned chunks were written while building"
        assert backed == whole_pages, "the owned chunks were not drawn"   # (and the probe sees writes)
        rank_model.start_identical()
        # ... and after the start (no broadcast of the whole buffer) too, but for the page at
        # each end of each piece: releasing a piece's other chunks (ShardedParams.drop_all)
        # zeroes the part of a page at a range's end (ParamBuffer.release).
        edges = [e for lo, hi, _, _ in rank_model.buckets.buckets for e in (lo, hi - 1)]
        stray, _, _ = untouched_outside(data, owned, edges)
        assert stray == 0, f"{stray} pages beyond the owned chunks were written by start_identical"
        kept = np.zeros(data.size, dtype=bool)
        for a, b in owned:
            kept[a:b] = True
        expected = one_process(model, rank_model.params)
        assert np.array_equal(data[kept], expected[kept]), "a chunk differs from the one-process model"
        assert not np.any(data[~kept])
    finally:
        rank_model.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,layout,model", CASES or [(None, None, None)],
                         ids=[f"{c[0]}-{c[2]}" for c in CASES] or ["none"])
def test_without_zero3_every_rank_holds_the_one_process_model(name, layout, model):
    if name is None:
        pytest.skip("written for 2 and 4 ranks")
    rank_model = build(model, layout, zero=0)
    try:
        rank_model.start_identical()
        assert np.array_equal(rank_model.params.data, one_process(model, rank_model.params))
    finally:
        rank_model.close()
