"""engine/train/memory.py: the predicted bytes per rank follow the ZeRO formulas, the
activations equal what the layers really keep (counted array by array), the trainer
prints the prediction, the breakdown and the measured peak, and warns when the node's
free memory is short of the prediction. (benchmarks/memory.py measures the prediction
against peak RSS: tests/benchmarks/test_memory.py.)"""
import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.model.llama import LlamaConfig, llama_layers
from ringpipe.engine.train import memory
from ringpipe.engine.train.config import Config, memory_floor
from ringpipe.engine.train.run import run

GPT_124M = GPTConfig(n_layer=12, d_model=768, n_head=12, context=1024, vocab=50257)


def _per_parameter(cfg, dp, shape=GPT_124M):
    """Bytes per parameter of parameters, gradients and optimizer state under cfg at dp ranks."""
    b = memory.predict(cfg, shape, 64, dp)
    return (b.items["parameters"] + b.items["gradients"] + b.items["optimizer state"]) / b.params


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_the_zero_stages_hold_the_papers_bytes_per_parameter(dp):
    base = dict(batch_size=2 * dp, seq_len=64)
    expected = {0: 16, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}
    for zero, per_parameter in expected.items():
        assert _per_parameter(Config(zero=zero, **base), dp) == pytest.approx(per_parameter, rel=1e-6), zero


def test_zero_2_keeps_whole_gradients_over_several_micro_batches():
    cfg = Config(zero=2, batch_size=8, microbatches=2, seq_len=64)
    assert _per_parameter(cfg, 4) == pytest.approx(4 + 4 + 8 / 4)


@pytest.mark.parametrize("settings,copies", [(dict(), 0), (dict(grad_clip=0.0), 1), (dict(ps_mode="ssp:2"), 3),
                                             (dict(ps_mode="async"), 0)])
def test_the_parameter_servers_workers_hold_their_pulls(settings, copies):
    """A worker beside dedicated servers holds no optimizer state; its pulls land beside the
    parameters when the step streams (no clipping) or runs ahead (ssp:S: up to S + 1)."""
    b = memory.predict(Config(sync="ps", ps_servers=1, batch_size=8, seq_len=64, **settings), GPT_124M, 64, 4)
    assert b.items["optimizer state"] == 0
    assert b.items.get("parameter pulls in flight", 0) == copies * b.items["parameters"]


def test_one_data_parallel_rank_shards_nothing():
    assert _per_parameter(Config(zero=3, batch_size=2, seq_len=64), 1) == pytest.approx(16)


def test_zero_3_gathers_two_units_or_all_of_them():
    use = memory.predict(Config(zero=3, zero_gather="use", batch_size=8, seq_len=64), GPT_124M, 64, 4)
    step = memory.predict(Config(zero=3, zero_gather="step", batch_size=8, seq_len=64), GPT_124M, 64, 4)
    assert step.items["gathered units"] == pytest.approx(4 * use.params * 3 / 4, rel=1e-6)
    # The embedding (its wte) and the largest block: two units, far less than every one.
    assert use.items["gathered units"] < step.items["gathered units"] / 2
    assert use.total < step.total


def test_the_pipeline_rank_with_the_most_is_reported():
    cfg = Config(pp=2, microbatches=4, batch_size=8, seq_len=64)
    b = memory.predict(cfg, GPT_124M, 64, 1)
    ranks = [memory._predict_rank(cfg, GPT_124M, 64, 1, r) for r in range(2)]
    assert b.total == max(r.total for r in ranks)
    # 1F1B: the first rank holds p = 2 micro-batches, the last one.
    assert memory.in_flight(cfg, 0) == {0: 2} and memory.in_flight(cfg, 1) == {0: 1}
    assert memory.in_flight(Config(pp=2, microbatches=4, schedule="gpipe"), 0) == {0: 4}


def test_the_floor_stays_a_lower_bound_of_the_prediction():
    for settings in (dict(), dict(zero=1, dp=4), dict(zero=3, dp=4), dict(pp=2, microbatches=4),
                     dict(recompute="full"), dict(tp=2)):
        cfg = Config(batch_size=8, seq_len=256, **settings)
        dp = settings.get("dp", 1)
        floor, _ = memory_floor(cfg, GPT_124M, dp)
        assert floor <= memory.predict(cfg, GPT_124M, 256, dp).total, settings


# ---- activations: the formula against what the layers keep ------------------------------

def _kept_bytes(ctx):
    """Bytes of the distinct memory a ctx keeps alive: every array, by the buffer it views."""
    bases = {}

    def walk(obj):
        if isinstance(obj, (tuple, list)):
            for o in obj:
                walk(o)
        elif isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            bases[id(base)] = base.nbytes
        elif hasattr(obj, "x"):            # chain.BlockInput: what full recomputation keeps
            walk(obj.x)
    walk(ctx)
    return sum(bases.values())


def _block_ctx(layers, recompute, tokens):
    chain = LayerChain(layers, dtype=np.float32)
    chain.params.init(0)
    chain.set_recompute(recompute)
    _, ctxs = chain.forward(tokens, tokens, grad_scale=1.0)
    return ctxs


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_block_activations_are_what_the_blocks_keep(family, recompute):
    B, T = 3, 16
    if family == "gpt":
        shape = GPTConfig(n_layer=2, d_model=32, n_head=4, context=T, vocab=256)
        layers = gpt_layers(shape)
    else:
        shape = LlamaConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=48, context=T, vocab=256)
        layers = llama_layers(shape)
    tokens = np.random.default_rng(0).integers(0, 256, size=(B, T))
    ctxs = _block_ctx(layers, recompute, tokens)
    kept, _ = memory.block_activations(shape, B, T, recompute=recompute)
    assert _kept_bytes(ctxs[1]) == pytest.approx(kept) and _kept_bytes(ctxs[2]) == pytest.approx(kept)
    assert _kept_bytes(ctxs[0]) == memory.embedding_activations(B, T)
    assert _kept_bytes(ctxs[-1]) == pytest.approx(memory.head_activations(shape, B, T))


# ---- the trainer's lines -------------------------------------------------------------------

def _small(tmp_path, **settings):
    return Config(steps=2, layers=1, d_model=32, heads=2, context=32, data="synthetic", batch_size=4,
                  out=str(tmp_path / "run"), sample_tokens=0, quiet=False, **settings)   # they read the start-up report


def test_the_start_up_line_says_the_predicted_peak(tmp_path, capsys):
    run(_small(tmp_path), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    assert "memory: predicted peak" in said and "per rank" in said
    assert "measured peak" not in said and "optimizer state" in said       # the largest items, named


def test_memory_report_prints_the_breakdown_and_the_measured_peak(tmp_path, capsys):
    # The peak is the process's (VmHWM): in a test session that already holds more than
    # a fresh process (bigger models run before), it is not this run's: judge it only
    # from a process about as small as a fresh one.
    fresh = memory.current_rss() < 2 * memory.FIXED_OVERHEAD_BYTES and memory.peak_rss() < 3 * 2**30
    run(_small(tmp_path, memory_report=True), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    for item in ("parameters", "weight-decay mask", "gradients", "optimizer state", "activations",
                 "communication buffers", "fixed overhead"):
        assert f"  {item} " in said, item
    assert "peak" in said and "(backward)" in said
    line = next(x for x in said.splitlines() if x.startswith("memory: measured peak"))
    assert "after step 2" in line and "predicted" in line
    ratio = float(line.rsplit(": ", 1)[1].rstrip("x"))
    if fresh:
        assert 0.3 < ratio < 3      # a tiny model: the fixed overhead is nearly all of it


def test_a_node_short_of_memory_is_warned_before_the_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(memory, "mem_available", lambda: 1)
    monkeypatch.setattr(memory, "current_rss", lambda: 0)      # pytest's process may hold more already
    run(_small(tmp_path), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    warning = next(x for x in said.splitlines() if x.startswith("warning: the predicted peak"))
    assert "MemAvailable" in warning and "<zero>" not in warning      # spelled as fields by run()
    assert said.index(warning) < said.index("done:")


def test_shortfall():
    gib = 2**30
    assert memory.shortfall(4 * gib, 4, 20 * gib, 0) == 0
    assert memory.shortfall(6 * gib, 4, 20 * gib, 0) == 4 * gib
    assert memory.shortfall(6 * gib, 4, 20 * gib, gib) == 0           # each rank holds 1 GiB already
    assert memory.shortfall(6 * gib, 4, None, 0) == 0                  # unknown: no warning
