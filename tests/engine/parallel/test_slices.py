"""Sharded checkpoints, one process playing every rank: what any layout writes tiles each
whole array exactly once, and any other layout reads back exactly its own part
(engine/parallel/slices.py over engine/job/sharded.py's files)."""
import json
import os

import numpy as np
import pytest

from ringpipe.engine.job import checkpoint, sharded
from ringpipe.engine.model.params import ParamBuffer, ParamSpec, Split
from ringpipe.engine.parallel import slices

# (name, whole shape, how the tensor axis splits it: (dim, groups) or None, padded rows at tp 3)
PARAMS = [("wte", (10, 6), (0, 1), 2),            # vocabulary-parallel: 10 rows pad to 12 at tp 3
          ("qkv.w", (6, 18), (1, 3), 0),          # q, k and v blocks, each cut over the tensor ranks
          ("qkv.b", (18,), (0, 3), 0),
          ("proj.w", (12, 6), (0, 1), 0),         # row-parallel
          ("ln.w", (6,), None, 0),                # replicated on every tensor rank
          ("head.w", (6, 12), (1, 1), 0)]
STATES = ("param", "opt/m", "opt/v")


def specs_for(tp, index):
    out = []
    for name, shape, split, pad in PARAMS:
        if split is None:
            out.append(ParamSpec(name, shape))
            continue
        dim, groups = split
        pad = pad if tp == 3 else 0
        s = Split(dim, index, tp, groups, pad)
        local = list(shape)
        local[dim] = (shape[dim] + pad) // tp
        out.append(ParamSpec(name, tuple(local), split=s))
    return out


@pytest.fixture
def whole():
    rng = np.random.default_rng(0)
    return {f"{key}/{name}": rng.normal(size=shape) for key in STATES for name, shape, _, _ in PARAMS}


def rank_buffers(whole, tp, index):
    """A tensor rank's buffer, and its flat arrays of each state (its parts of the whole arrays)."""
    params = ParamBuffer(specs_for(tp, index), dtype=np.float64)
    flats = {}
    for key in STATES:
        flat = np.zeros(params.size)
        params.load_flat(flat, {n.split("/")[-1]: v for n, v in whole.items() if n.rsplit("/", 1)[0] == key})
        flats[key] = flat
    return params, flats


def replicated(params, index):
    """What norm_excluded says on tensor rank `index`: the replicated parameters, except on the first."""
    return [params.offsets[s.name] for s in params.specs if s.split is None] if index else []


def chunks(size, dp, index, seed):
    """ZeRO-like owned ranges: a few cut points, this replica's chunk of each piece."""
    cuts = sorted({0, size, *np.random.default_rng(seed).integers(1, size, 4).tolist()})
    return [(a + (b - a) * index // dp, a + (b - a) * (index + 1) // dp) for a, b in zip(cuts, cuts[1:])]


def write(folder, whole, tp, dp, zero):
    """Every rank of a tp x dp layout writes its slices; returns the committed manifest path."""
    os.makedirs(folder, exist_ok=True)
    tmp = checkpoint.start_sharded(folder, 5)
    records, declared = [], {}
    for t in range(tp):
        params, flats = rank_buffers(whole, tp, t)
        for d in range(dp):
            excluded = replicated(params, t)
            owned = chunks(params.size, dp, d, seed=t) if zero else None
            written = slices.subtract(owned, excluded) if zero else slices.share(params.size, dp, d, excluded)
            local = slices.LocalSlices(params, {k: [(0, params.size, f)] for k, f in flats.items()}, written)
            pieces = list(slices.pieces(local))
            records.append(sharded.write_rank_file(tmp, len(records), pieces) if pieces else None)
            declared.update(slices.whole_shapes(local))
    meta = dict(model="gpt", model_config=dict(context=8, d_model=6, n_head=2, n_layer=1, vocab=10),
                optimizer="adamw", opt_step_count=5, loss=1.0, dtype="float64", args={}, precision="float64",
                layout=dict(dp=dp, pp=1, tp=tp, chunks=1))
    return checkpoint.commit_sharded(folder, 5, meta, records, declared, keep=0)


def read_as(path, whole, tp, index, held):
    """Tensor rank `index` of tp reads its ranges `held` (None: all) of every state."""
    params = ParamBuffer(specs_for(tp, index), dtype=np.float64)
    flats = {k: np.zeros(params.size) for k in STATES}
    ranges = held(params.size) if held else [(0, params.size)]
    local = slices.LocalSlices(params, {k: [(a, b, f[a:b]) for a, b in ranges] for k, f in flats.items()}, [])
    _, reader = checkpoint.open_sharded(path)
    try:
        slices.fill(local, lambda name, box, out: checkpoint.read_box(reader, name, box, out))
    finally:
        reader.close()
    _, expected = rank_buffers(whole, tp, index)
    for key in STATES:
        mask = np.zeros(params.size, dtype=bool)
        for a, b in ranges:
            mask[a:b] = True
        assert np.array_equal(flats[key][mask], expected[key][mask]), (key, tp, index)
        assert not flats[key][~mask].any()              # nothing outside its ranges is touched


@pytest.mark.parametrize("tp,dp,zero", [(1, 1, False), (2, 2, False), (3, 1, True), (2, 3, True), (1, 4, True)])
def test_any_layout_writes_each_whole_array_once_and_any_layout_reads_its_part(tmp_path, whole, tp, dp, zero):
    path = write(str(tmp_path), whole, tp, dp, zero)
    assert checkpoint.inspect(path) is None
    arrays, manifest = checkpoint.load(path)
    assert manifest["format"] == sharded.FORMAT_SHARDED
    assert sorted(arrays) == sorted(whole)
    for name, values in whole.items():
        assert np.array_equal(arrays[name], values), name
    for tp2 in (1, 2, 3):
        for index in range(tp2):
            read_as(path, whole, tp2, index, None)
            read_as(path, whole, tp2, index, lambda size: chunks(size, 2, 1, seed=7))     # a ZeRO-3 reader


def test_a_piece_is_at_most_three_boxes_and_each_is_contiguous():
    spec = ParamSpec("w", (5, 7))
    for a in range(35):
        for b in range(a + 1, 36):
            boxes = slices._part_boxes(spec, a, b)
            assert len(boxes) <= 3
            assert sum(slices._volume(box) for _, box in boxes) == b - a
            at = a
            for flat, ((r0, r1), (c0, c1)) in boxes:
                assert flat == at == r0 * 7 + c0 and (r1 - r0 == 1 or (c0, c1) == (0, 7))
                at += (r1 - r0) * (c1 - c0)


def test_a_damaged_piece_is_refused_naming_the_checkpoint(tmp_path, whole):
    path = write(str(tmp_path), whole, 2, 1, False)
    shard = os.path.join(str(tmp_path), "ckpt_00000005.shards", "rank_00001.bin")
    with open(shard, "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 8)
    assert "corrupt" in checkpoint.inspect(path)
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        read_as(path, whole, 1, 0, None)
    os.truncate(shard, 100)
    assert "truncated" in checkpoint.inspect(path)


@pytest.mark.parametrize("edit,says", [
    (lambda e: e["pieces"].pop(), "do not cover"),
    (lambda e: e["pieces"].append(list(e["pieces"][0])), "do not cover"),
    (lambda e: e["pieces"][0][3][0].__setitem__(1, 10**6), "not inside its shape"),
    (lambda e: e["files"][0].__setitem__("name", "../x.bin"), "rank_RRRRR.bin"),
    (lambda e: e.__setitem__("folder", "elsewhere"), "expected 'ckpt_00000005.shards'"),
    (lambda e: e["pieces"][0].__setitem__(2, 2**40), "runs past its end"),
])
def test_a_manifest_whose_pieces_do_not_tile_the_arrays_is_refused(tmp_path, whole, edit, says):
    path = write(str(tmp_path), whole, 2, 2, True)
    with open(path) as fh:
        manifest = json.load(fh)
    edit(manifest["shards"])
    manifest["checksum"] = checkpoint._checksum(manifest)      # the schema, not the checksum, must catch it
    with open(path, "w") as fh:
        json.dump(manifest, fh)
    assert says in checkpoint.inspect(path)


def test_overlapping_pieces_are_refused():
    with pytest.raises(sharded.Problem, match="do not cover"):
        sharded._check_tiling("x", [4, 4], [[[0, 2], [0, 4]], [[1, 3], [0, 4]], [[3, 4], [0, 4]]])
    # The volumes add up to the array's, but rows 1 and 2 are written twice and a corner never.
    with pytest.raises(sharded.Problem, match="overlap"):
        sharded._check_tiling("x", [4, 4], [[[0, 2], [0, 4]], [[1, 2], [0, 4]], [[2, 4], [0, 2]]])


def test_a_killed_save_leaves_nothing_that_counts_and_the_next_run_removes_it(tmp_path, whole):
    path = write(str(tmp_path), whole, 1, 2, False)
    tmp = checkpoint.start_sharded(str(tmp_path), 9)                  # a save of step 9 killed mid-write
    open(os.path.join(tmp, "rank_00000.bin"), "wb").write(b"x" * 10)
    orphan = os.path.join(str(tmp_path), "ckpt_00000011.shards")       # renamed, killed before its manifest
    os.mkdir(orphan)
    assert checkpoint.find_latest(str(tmp_path)) == path
    removed = checkpoint.remove_stale_temp_files(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == ["ckpt_00000009.shards.tmp", "ckpt_00000011.shards"]
    assert os.path.isdir(os.path.join(str(tmp_path), "ckpt_00000005.shards"))      # the committed one stays


def test_pruning_removes_old_shards_folders(tmp_path, whole):
    write(str(tmp_path), whole, 1, 1, False)
    tmp = checkpoint.start_sharded(str(tmp_path), 6)
    record = sharded.write_rank_file(tmp, 0, [("param/x", [[0, 2]], np.ones(2))])
    meta = dict(model="gpt", model_config=dict(context=8, d_model=6, n_head=2, n_layer=1, vocab=10),
                optimizer="adamw", opt_step_count=6, loss=1.0, dtype="float64", args={}, precision="float64",
                layout=dict(dp=1, pp=1, tp=1, chunks=1))
    checkpoint.commit_sharded(str(tmp_path), 6, meta, [record], {"param/x": ((2,), np.float64)}, keep=1)
    assert sorted(os.listdir(str(tmp_path))) == ["ckpt_00000006.json", "ckpt_00000006.shards"]
