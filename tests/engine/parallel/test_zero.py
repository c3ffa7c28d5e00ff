"""ZeRO never changes the math: every stage (0-3), with every recomputation mode, in every
layout, trains as one process does (float64 1e-10), and its checkpoints continue in
any other layout and stage on the same trajectory.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_zero.py`
(`-n 8`: the DP x PP x TP case). The parity harness: tests/support/parity.py.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train import config as config_checks
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

from tests.support.parity import assert_same_arrays, assert_same_run, final_arrays, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10
BASE = dict(data="synthetic", layers=2, d_model=16, heads=2, context=16, steps=3, dtype="float64",
            sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1)

# (name, layout) for each world size: the layouts issue 24 names.
LAYOUTS = {
    2: [("dp2", dict(dp=2)), ("dp2-m2", dict(dp=2, microbatches=2))],
    4: [("dp4", dict(dp=4)),
        ("pp2-dp2-1f1b", dict(pp=2, dp=2, microbatches=2, schedule="1f1b")),
        ("pp2-dp2-zbh1", dict(pp=2, dp=2, microbatches=2, schedule="zbh1")),
        ("tp2-dp2-sp", dict(tp=2, dp=2, sequence_parallel=True))],
}
CASES = [(name, layout, zero, recompute) for name, layout in LAYOUTS.get(world.size, [])
         for zero in (0, 1, 2, 3) for recompute in ("none", "selective", "full")]


def pair(shared_dir, tag, layout, model="gpt", **more):
    """(the layout's run, one process's run) of the same global batch and micro-batch split."""
    settings = dict(BASE, model=model, batch_size=8, microbatches=layout.get("microbatches", 1))
    ref = reference(Config(**settings, out=os.path.join(shared_dir, f"ref-{tag}-{world.rank}")))
    par = train(Config(**{**settings, **layout, **more}, out=os.path.join(shared_dir, tag)), world)
    world.Barrier()
    return par, ref


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,layout,zero,recompute", CASES or [(None, None, None, None)],
                         ids=[f"{c[0]}-zero{c[2]}-{c[3]}" for c in CASES] or ["none"])
def test_zero_stage_and_recomputation_equal_one_process(shared_dir, name, layout, zero, recompute):
    if name is None:
        pytest.skip("written for 2 and 4 ranks")
    par, ref = pair(shared_dir, f"{name}-{zero}-{recompute}", layout, zero=zero, recompute=recompute)
    # Losses, validation, grad norms and the whole checkpoint (parameters and optimizer
    # state gathered from the shards); a sharded rank holds only part of the rest.
    assert_same_run(par, ref, TOL, grad_norm=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("gather", ["use", "step"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_zero3_gather_modes_and_families(shared_dir, gather, model):
    if world.size not in (2, 4):
        pytest.skip("written for 2 and 4 ranks")
    layout = dict(dp=2, microbatches=2) if world.size == 2 else dict(pp=2, dp=2, microbatches=2)
    par, ref = pair(shared_dir, f"gather-{gather}-{model}", layout, model=model, zero=3, zero_gather=gather)
    assert_same_run(par, ref, TOL, grad_norm=True)
    sharded = par.model.sharded
    assert sharded.mode == gather
    # Between steps a rank holds only its chunks: everything else reads as zeros.
    data = par.model.params.data
    kept = np.zeros(data.size, dtype=bool)
    for a, b in sharded.owned:
        kept[a:b] = True
    assert not np.any(data[~kept])


@pytest.mark.mpi(min_size=8)
def test_dp_pp_tp_with_zero3_and_recomputation_equals_one_process(shared_dir):
    """All three axes at once, under 8 (oversubscribed) ranks: DP 2 x PP 2 x TP 2."""
    if world.size != 8:
        pytest.skip("written for 8 ranks")
    for zero, recompute in ((2, "selective"), (3, "full")):
        layout = dict(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True, schedule="zbh1")
        par, ref = pair(shared_dir, f"dpxppxtp-{zero}", layout, zero=zero, recompute=recompute)
        assert_same_run(par, ref, TOL, grad_norm=True)


@pytest.mark.mpi(min_size=4)
def test_zero_checkpoints_continue_in_any_layout_and_stage(shared_dir):
    """Written by ZeRO-3 on (dp 2, pp 2), continued by ZeRO-2 on dp 4, ZeRO-0 on
    (pp 2, tp 2) and one process: all reach the uninterrupted single-process trajectory."""
    if world.size != 4:
        pytest.skip("written for 4 ranks")
    steps = dict(steps=6, eval_every=6)
    ref = reference(Config(**{**BASE, **steps}, batch_size=8, microbatches=2,
                           out=os.path.join(shared_dir, f"resume-ref{world.rank}")))
    first = os.path.join(shared_dir, "resume-zero3")
    run(Config(**{**BASE, **steps}, batch_size=8, pp=2, dp=2, microbatches=2, zero=3, checkpoint_every=3,
               out=first), world=world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000003.json")
    for name, layout, comm_ in (("dp4-zero2", dict(dp=4, zero=2), world),
                                ("pp2-tp2", dict(pp=2, tp=2, microbatches=2), world),
                                (f"one-{world.rank}", dict(microbatches=2), MPI.COMM_SELF)):
        out = os.path.join(shared_dir, f"resume-{name}")
        train(Config(**{**BASE, **steps}, batch_size=8, resume=ckpt, out=out, **layout), comm_)
        world.Barrier()
        arrays, manifest = checkpoint.load(os.path.join(out, "checkpoints"))
        assert manifest["step"] == 6
        assert_same_arrays(arrays, final_arrays(ref.out), TOL, name)


@pytest.mark.mpi(min_size=2)
def test_zero_moves_the_bytes_of_the_formulas(shared_dir):
    """Per step and rank, over the data axis: ZeRO-1/2 reduce-scatter the gradients and
    all-gather the parameters (2 x Psi (N-1)/N); ZeRO-3 gathers each unit twice in its
    use mode with one micro-batch, once in step mode, plus the reduce-scatter."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    for gather in ("use", "step"):
        par, _ = pair(shared_dir, f"bytes-{gather}", dict(dp=2), zero=3, zero_gather=gather, steps=1)
        units = len(par.model.sharded.pieces)      # embedding, 2 blocks, final norm and head
        # use: every unit for the forward and again for the backward, but the embedding's
        # (the tied wte, which the head reads too) once, kept for the step; step: each unit once
        expected = 2 * units - 1 if gather == "use" else units
        gathers = par.model.sharded.gathers_per_step      # ShardedParams keeps its own count
        assert gathers == expected, (gather, gathers)


def _refused(match, world_size, **fields):
    with pytest.raises(ConfigError, match=match):
        config_checks.check(Config(**{**BASE, "batch_size": 8, **fields}), world_size)


def test_refusals_name_what_would_work():
    # a ZeRO stage that shards over one data-parallel rank
    _refused(r"zero 2 shards over the data-parallel ranks.*lower pp or tp", 2, zero=2, pp=2)
    _refused(r"zero 3 shards over the data-parallel ranks", 1, zero=3)
    # recomputation of a model without blocks
    _refused(r"recompute", 1, model="mlp", recompute="full", layers=None, d_model=None, heads=None, context=None)
    # a stage or gather mode that does not exist
    _refused(r"zero must be 0 \(none\), 1 .*or 3 .*got 4", 2, zero=4)
    _refused(r"zero_gather 'always'", 2, zero=3, zero_gather="always")


def test_zero1_with_one_rank_and_gather_without_zero3_are_noted():
    notes = config_checks.check(Config(**{**BASE, "batch_size": 8}, zero=1), 1)
    assert any("<zero> 1" in n and "no effect" in n for n in notes)
    notes = config_checks.check(Config(**{**BASE, "batch_size": 8}, zero=2, zero_gather="step"), 2)
    assert any("<zero_gather> step has no effect without <zero> 3" in n for n in notes)


def test_a_unit_that_does_not_fit_is_refused_before_work():
    # One block of d_model 40,000 is 19e9 parameters: ZeRO-3 would gather it whole.
    cfg = Config(**{**BASE, "batch_size": 8, "layers": 1, "d_model": 40_000, "heads": 2}, zero=3)
    shape = config_checks.model_config(cfg, vocab=256)
    need, what = config_checks.memory_floor(cfg, shape, dp=64)
    assert "largest layer gathered whole" in what
    with pytest.raises(ConfigError, match=r"largest layer gathered whole.*tp each layer"):
        config_checks.check_memory(cfg, shape, dp=64, ranks_on_node=1)


def test_settings_zero_changes_are_noted():
    notes = config_checks.check(Config(**{**BASE, "batch_size": 8}, zero=3, bucket_mb=1.0), 2)
    assert any("<bucket_mb> has no effect with <zero> 3" in n for n in notes)
    notes = config_checks.check(Config(**{**BASE, "batch_size": 8}, zero=2, microbatches=2), 2)
    assert any("gradients stay whole until the last micro-batch" in n for n in notes)
    # one process: the refusal says to launch several
    _refused(r"this run has one rank: launch several", 1, zero=2)
