"""The Llama family trains on every layout it offers exactly as one process does (float64
~1e-10): data parallelism, ZeRO-1, the pipeline with every schedule, and a checkpoint
continued in another layout, through the parity harness (tests/support/parity.py).

Run with `mpiexec -n 2 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_llama_parity.py`.
"""
import os

import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train.config import Config

from tests.support.parity import assert_same_arrays, assert_same_run, final_arrays, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10


def base(layers, batch, **more):
    return Config(**{**dict(model="llama", data="synthetic", layers=layers, d_model=8, heads=4, kv_heads=2, d_ff=12,
                            context=8, batch_size=batch, steps=3, dtype="float64", sample_tokens=0, quiet=True,
                            overwrite=True, eval_every=3, eval_batches=1), **more})


LAYOUTS = {
    "dp2": dict(dp=2),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-untied": dict(dp=2, tie_embeddings=False),
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=2),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "pp2-zbh1": dict(pp=2, schedule="zbh1", microbatches=4),
    "pp2-interleaved": dict(pp=2, schedule="interleaved", chunks=2, microbatches=2),
    "pp2-1f1b-untied": dict(pp=2, schedule="1f1b", microbatches=2, tie_embeddings=False),
    # Qwen3's per-head q/k norm (qk_norm head) under the pipeline and under ZeRO-3 with recomputation
    "pp2-1f1b-qwen3": dict(pp=2, schedule="1f1b", microbatches=4, qk_norm="head"),
    "dp2-zero3-qwen3-recompute": dict(dp=2, zero=3, qk_norm="head", recompute="full"),
    # SmolLM3's NoPE block (nope_layers): the second of two, on the second pipeline stage
    "pp2-zbh1-smollm3": dict(pp=2, schedule="zbh1", microbatches=4, nope_layers="1"),
    "dp2-zero3-smollm3-recompute": dict(dp=2, zero=3, nope_layers="0", recompute="full"),
    # OLMo 2's norms after attention and the MLP, its q/k norm over all heads
    "pp2-interleaved-olmo2": dict(pp=2, schedule="interleaved", chunks=2, microbatches=2, qk_norm="all",
                                  norm_place="post"),
    "dp2-zero2-olmo2-recompute": dict(dp=2, zero=2, qk_norm="all", norm_place="post", recompute="selective"),
    # a sliding window of 3 of the 8 positions: on block 1 under the pipeline, on every block under
    # ZeRO-3 with selective recomputation (the probabilities computed again with the window)
    "pp2-1f1b-window-layers": dict(pp=2, schedule="1f1b", microbatches=4, sliding_window=3, window_layers="1"),
    "dp2-zero3-window-recompute": dict(dp=2, zero=3, sliding_window=3, recompute="selective"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama_layout_equals_single_process(shared_dir, name):
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    layout = dict(LAYOUTS[name])
    shape = {k: layout.pop(k) for k in ("tie_embeddings", "qk_norm", "nope_layers", "norm_place", "sliding_window",
                                        "window_layers") if k in layout}
    layers = 4 if layout.get("chunks") else 2
    ref = reference(base(layers, 8, out=os.path.join(shared_dir, f"llama-ref-{name}-{world.rank}"), **shape))
    grid = train(base(layers, 8, out=os.path.join(shared_dir, f"llama-{name}"), **shape, **layout), world)
    world.Barrier()
    assert_same_run(grid, ref, TOL, grad_norm=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(dp=2, zero=3)],
                         ids=["tp2", "tp2-sp", "dp2-zero3"])
def test_llama_bf16_matmuls_equal_single_process(shared_dir, layout):
    """bf16 GEMMs, their operands rounded once where reused (engine/model/layers.py BF16: q, k,
    v and gate, up read one input rounded once; under tp its column parts): every layout is
    one process at float32 tolerance (SGD: see test_dp.py's bf16 test)."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    name = "-".join(f"{k}{v}" for k, v in layout.items())
    more = dict(dtype="float32", precision="bf16", optimizer="sgd")
    ref = reference(base(2, 8, out=os.path.join(shared_dir, f"llama-bf16-ref-{name}-{world.rank}"), **more))
    grid = train(base(2, 8, out=os.path.join(shared_dir, f"llama-bf16-{name}"), **more, **layout), world)
    world.Barrier()
    assert_same_run(grid, ref, 1e-5, holdings=False)


@pytest.mark.mpi(min_size=2)
def test_llama_checkpoint_continues_in_another_layout(shared_dir):
    """Written by pp 2, continued by dp 2 and by one process: both reach the uninterrupted
    single-process trajectory."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    ref = reference(base(2, 8, steps=4, out=os.path.join(shared_dir, f"llama-relayout-ref{world.rank}")))
    first = os.path.join(shared_dir, "llama-relayout-pp")
    train(base(2, 8, steps=4, pp=2, microbatches=2, checkpoint_every=2, out=first), world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000002.json")
    for name, layout, comm in (("dp", dict(dp=2), world), (f"one-{world.rank}", {}, MPI.COMM_SELF)):
        out = os.path.join(shared_dir, f"llama-relayout-{name}")
        train(base(2, 8, steps=4, resume=ckpt, out=out, **layout), comm)
        world.Barrier()
        arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
        assert manifest["step"] == 4 and manifest["model"] == "llama"
        assert_same_arrays(arrays, final_arrays(ref.out), TOL, name)


def gemma3(**more):
    # The gemma3-tiny preset: 6 blocks (5 windowed, window 8 of 16 positions), every Gemma 3 part.
    return Config(**{**dict(model="llama", preset="gemma3-tiny", data="synthetic", seq_len=16, batch_size=8,
                            steps=3, dtype="float64", sample_tokens=0, quiet=True, overwrite=True, eval_every=3,
                            eval_batches=1), **more})


GEMMA3_LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "tp2-sp-recompute": dict(tp=2, sequence_parallel=True, recompute="selective"),
    "pp2-zbh1": dict(pp=2, schedule="zbh1", microbatches=4),
    "dp2-zero3-recompute": dict(dp=2, zero=3, recompute="full"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(GEMMA3_LAYOUTS))
def test_gemma3_layout_equals_single_process(shared_dir, name):
    """Gemma 3's sandwich norms, (1 + w) scales, GeGLU, scaled embedding, local/global RoPE and
    windows on every layout as one process does (float64, 1e-10)."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    layout = dict(GEMMA3_LAYOUTS[name])
    m = dict(microbatches=layout.pop("microbatches", 2))
    ref = reference(gemma3(out=os.path.join(shared_dir, f"gemma3-ref-{name}-{world.rank}"), **m))
    grid = train(gemma3(out=os.path.join(shared_dir, f"gemma3-{name}"), **m, **layout), world)
    world.Barrier()
    assert_same_run(grid, ref, TOL, grad_norm=True)
