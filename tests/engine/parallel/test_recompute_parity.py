"""Activation recomputation under every axis equals one process without it (float64 ~1e-10).

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_recompute_parity.py`.

Each layout (PP 2 with 1F1B and ZB-H1, TP 2 with sequence parallelism, DP, DP with ZeRO-3,
and under 4 ranks PP 2 x TP 2) trains with <recompute> full and selective and must equal the
one-process run with none (the parity harness, tests/support/parity.py): the recomputing
forward runs again inside backward, also between ZB-H1's B and W, around the tensor
axis's collectives, and inside the window where ZeRO-3 holds a layer's parameters. The
one-process measurement test (no MPI) checks that recomputation lowers the pipeline's
activation bytes (PipelineExecutor.peak_activation_bytes).
"""
import os

import pytest
from mpi4py import MPI

from ringpipe.engine.train.config import Config

from tests.support.parity import assert_same_run, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10


def base(**more):
    # grad_clip 0.1: the clipping acts, so every gradient enters the weights through the norm too
    return Config(**{**dict(data="synthetic", layers=2, d_model=16, heads=4, context=8, batch_size=8, steps=2,
                            grad_clip=0.1, dtype="float64", sample_tokens=0, quiet=True, overwrite=True,
                            eval_every=2, eval_batches=1), **more})


def _layouts(size):
    """(name, model, layout fields) for `size` ranks: every axis, and ZB-H1's split backward."""
    dp = size // 2
    cases = [(f"pp2-1f1b-dp{dp}", "gpt", dict(pp=2, dp=dp, schedule="1f1b", microbatches=2)),
             (f"pp2-zbh1-dp{dp}", "llama", dict(pp=2, dp=dp, schedule="zbh1", microbatches=2)),
             # the input-gradient reductions on the group's thread, beside the recomputing blocks
             (f"tp2-sp-overlap-dp{dp}", "gpt", dict(tp=2, dp=dp, sequence_parallel=True, tp_overlap="on",
                                                    microbatches=2)),
             (f"tp2-sp-dp{dp}", "llama", dict(tp=2, dp=dp, sequence_parallel=True, microbatches=2)),
             (f"dp{size}", "gpt", dict(dp=size, microbatches=2)),
             # ZeRO-3: the recomputing forward reads parameters gathered only around the layer's backward
             (f"dp{size}-zero3", "llama", dict(dp=size, zero=3, microbatches=2))]
    if size == 4:
        cases.append(("pp2-tp2-sp-zbh1", "gpt", dict(pp=2, tp=2, sequence_parallel=True, schedule="zbh1",
                                                     microbatches=2)))
    return cases


CASES = [(name, model, layout, mode) for name, model, layout in _layouts(world.size) if world.size in (2, 4)
         for mode in ("full", "selective")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,model,layout,mode", CASES or [(None,) * 4],
                         ids=[f"{m}-{n}-{mode}" for n, m, _, mode in CASES] or ["none"])
def test_recomputation_in_every_layout_equals_one_process_without_it(shared_dir, tmp_path_factory, name, model,
                                                                      layout, mode):
    if name is None:
        pytest.skip("written for 2 and 4 ranks")
    ref = reference(base(model=model, microbatches=2, out=str(tmp_path_factory.mktemp(f"ref-{model}"))))
    trained = train(base(model=model, recompute=mode, out=os.path.join(shared_dir, f"{model}-{name}-{mode}"),
                         **layout), world)
    world.Barrier()
    # ZeRO-3: a rank holds its chunks of the gradients and weights; the checkpoint holds them whole
    assert_same_run(trained, ref, TOL, grad_norm=True)
    assert f"recompute {mode}" in trained.model.describe()


def _peak_activation_bytes(tmp_path, mode, model):
    """One process, two chunks of an interleaved pipeline: the executor counts what each
    micro-batch keeps from its forward until its backward."""
    cfg = base(model=model, layers=4, chunks=2, schedule="interleaved", microbatches=2, recompute=mode,
               context=16, dtype="float32", out=os.path.join(tmp_path, f"{model}-{mode}"))
    return train(cfg, MPI.COMM_SELF).model.inner.executor.peak_activation_bytes


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_recomputation_lowers_the_pipelines_peak_activation_bytes(tmp_path, model):
    none, full, selective = (_peak_activation_bytes(tmp_path, mode, model) for mode in ("none", "full", "selective"))
    assert full < selective < none, (none, full, selective)
