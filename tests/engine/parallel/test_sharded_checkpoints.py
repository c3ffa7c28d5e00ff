"""Sharded checkpoints at every layout: they hold the same bits as a whole-file one, a
resume from either at another layout continues on the same bits, an asynchronous save
changes nothing, and a rank reads only about its own part.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/parallel/test_sharded_checkpoints.py`.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train.config import Config

from tests.support.parity import assert_same_arrays, final_arrays, losses, metrics, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, dtype="float64", batch_size=8,
            sample_tokens=0, quiet=True, overwrite=True, eval_every=4, eval_batches=1, steps=4)

# (writer, reader) layouts for each world size: every axis written and read by another.
PAIRS = {
    2: [(dict(dp=2, zero=3), dict(tp=2)),
        (dict(tp=2), dict(pp=2, microbatches=2)),
        (dict(pp=2, microbatches=2), dict(dp=2, zero=1))],
    4: [(dict(pp=2, dp=2, zero=3, microbatches=2), dict(tp=2, dp=2, sequence_parallel=True, zero=2)),
        (dict(tp=2, dp=2, sequence_parallel=True), dict(dp=4, zero=3)),
        (dict(pp=2, tp=2, microbatches=2), dict(pp=2, dp=2, microbatches=2))],
}


def name_of(layout):
    return "-".join(f"{k}{v}" for k, v in sorted(layout.items()))


def arrays_at(out, step):
    return checkpoint.load(checkpoint.manifest_path(os.path.join(out, "checkpoints"), step))[0]


def assert_bitwise(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), f"{what}: {k}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pair", range(3))
def test_sharded_and_whole_hold_the_same_bits_and_continue_alike_at_another_layout(shared_dir, pair):
    if world.size not in PAIRS:
        pytest.skip("written for 2 and 4 ranks")
    writer, reader = PAIRS[world.size][pair]
    micro = dict(microbatches=max(writer.get("microbatches", 1), reader.get("microbatches", 1)))
    tag = f"{name_of(writer)}-to-{name_of(reader)}"
    outs = {}
    for fmt in ("sharded", "whole"):
        outs[fmt] = os.path.join(shared_dir, f"{tag}-{fmt}")
        train(Config(**{**BASE, **writer, **micro}, checkpoint_every=2, checkpoint_format=fmt, out=outs[fmt]), world)
        world.Barrier()
    sharded_manifest = checkpoint.read_manifest(checkpoint.manifest_path(os.path.join(outs["sharded"],
                                                                                      "checkpoints"), 2))
    assert sharded_manifest["format"] == "ringpipe-checkpoint-3"
    files = sharded_manifest["shards"]["files"]
    assert len(files) > 1                  # written by more than one rank
    for step in (2, 4):
        assert_bitwise(arrays_at(outs["sharded"], step), arrays_at(outs["whole"], step), f"{tag} step {step}")
    # Each resumed at the reader's layout, writing the other format: the same bits again.
    resumed = {}
    for fmt, other in (("sharded", "whole"), ("whole", "sharded")):
        resumed[fmt] = os.path.join(shared_dir, f"{tag}-from-{fmt}")
        ckpt = checkpoint.manifest_path(os.path.join(outs[fmt], "checkpoints"), 2)
        train(Config(**{**BASE, **reader, **micro}, resume=ckpt, checkpoint_format=other, out=resumed[fmt]), world)
        world.Barrier()
    assert_bitwise(final_arrays(resumed["sharded"]), final_arrays(resumed["whole"]), f"{tag} resumed")
    assert losses(resumed["sharded"]) == losses(resumed["whole"])
    ref = reference(Config(**BASE, **micro, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    assert_same_arrays(final_arrays(resumed["sharded"]), final_arrays(ref.out), TOL, tag)


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_save_writes_the_same_bits_and_changes_no_loss(shared_dir):
    if world.size not in PAIRS:
        pytest.skip("written for 2 and 4 ranks")
    layout = PAIRS[world.size][0][0]
    outs = {}
    for mode in ("sync", "async"):
        outs[mode] = os.path.join(shared_dir, f"async-{mode}")
        train(Config(**{**BASE, **layout, "steps": 5}, checkpoint_every=1, keep=0, out=outs[mode],
                     checkpoint_async=mode == "async"), world)
        world.Barrier()
    assert losses(outs["sync"]) == losses(outs["async"])
    for step in range(1, 6):
        assert_bitwise(arrays_at(outs["sync"], step), arrays_at(outs["async"], step), f"async step {step}")


@pytest.mark.mpi(min_size=2)
def test_a_rank_reads_only_its_own_part(shared_dir, monkeypatch):
    """Resumed at the layout that wrote it (dp N, ZeRO-3), each rank reads (and CRC-checks)
    the blocks of its own chunks only: what its own file holds, not the checkpoint."""
    if world.size not in PAIRS:
        pytest.skip("written for 2 and 4 ranks")
    first = os.path.join(shared_dir, "part-write")
    train(Config(**BASE, dp=world.size, zero=3, checkpoint_every=2, out=first), world)
    world.Barrier()
    readers = []
    opened = checkpoint.open_sharded

    def keeping(path):
        manifest, reader = opened(path)
        readers.append(reader)
        return manifest, reader
    monkeypatch.setattr(checkpoint, "open_sharded", keeping)
    ckpt = checkpoint.manifest_path(os.path.join(first, "checkpoints"), 2)
    train(Config(**BASE, dp=world.size, zero=3, resume=ckpt, out=os.path.join(shared_dir, "part-read")), world)
    world.Barrier()
    files = checkpoint.read_manifest(ckpt)["shards"]["files"]
    own = next(f["bytes"] for f in files if f["name"] == f"rank_{world.rank:05d}.bin")
    assert 0 < readers[0].bytes_checked <= own < sum(f["bytes"] for f in files)


@pytest.mark.mpi(min_size=2)
def test_a_llama_import_reads_only_each_ranks_slices_and_trains_as_one_process(shared_dir, monkeypatch):
    """--init-from hf:DIR under ZeRO-3 at dp N: each rank reads the rows of its own chunks
    (about 1/N of the folder's tensors, not all of them), and the run equals one process's."""
    from ringpipe.engine.interop import hf, hf_folder
    from ringpipe.engine.model.chain import LayerChain
    from ringpipe.engine.model.llama import PRESETS, LlamaConfig, llama_layers
    if world.size not in PAIRS:
        pytest.skip("written for 2 and 4 ranks")
    cfg = LlamaConfig(**dict(PRESETS["hf-tiny"], context=16, vocab=256, d_model=64, n_head=4, d_ff=96)).validate()
    folder = os.path.join(shared_dir, "hf-llama")
    if world.rank == 0:
        model = LayerChain(llama_layers(cfg), dtype=np.float64)
        rng = np.random.default_rng(5)
        arrays = {f"param/{n}": rng.normal(0, 0.2, model.params.view(n).shape).astype(np.float32)
                  for n in model.params.names()}
        hf.export_hf(arrays, cfg.to_dict(), folder, model="llama")
    world.Barrier()
    sources = []
    opened = hf.open_hf

    def keeping(path):
        found = opened(path)
        sources.append(found[1])
        return found
    monkeypatch.setattr(hf, "open_hf", keeping)
    settings = dict(BASE, model="llama", layers=None, d_model=None, heads=None, context=None, steps=2,
                    init_from=f"hf:{folder}", eval_every=2)
    par = train(Config(**settings, dp=world.size, zero=3, out=os.path.join(shared_dir, "hf-par")), world)
    world.Barrier()
    assert isinstance(sources[0], hf_folder.TensorBoxes)
    stored = os.path.getsize(os.path.join(folder, "model.safetensors"))
    assert 0 < sources[0].bytes_read < stored * (1 / world.size + 0.25), (sources[0].bytes_read, stored)
    monkeypatch.setattr(hf, "open_hf", opened)
    ref = reference(Config(**settings, out=os.path.join(shared_dir, f"hf-ref-{world.rank}")))
    def trained(out):           # step 0 of a fine-tune is a validation alone
        return [(m["step"], m.get("loss", 0.0), m.get("val_loss", 0.0)) for m in metrics(out)]
    assert [r[0] for r in trained(par.out)] == [r[0] for r in trained(ref.out)]
    for (_, *got), (_, *want) in zip(trained(par.out), trained(ref.out)):
        assert got == pytest.approx(want, rel=1e-10, abs=1e-10)
    assert_same_arrays(final_arrays(par.out), final_arrays(ref.out), TOL, "llama import")
