"""Layer partitioning into pipeline stages."""
import numpy as np
import pytest

from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.parallel.pipeline.partition import balanced, measure_layer_costs, stage_costs, uniform


def test_uniform_spreads_blocks_and_pins_embedding_and_head():
    # 6 layers = embedding + 4 blocks + head
    assert uniform(6, 1) == [(0, 6)]
    assert uniform(6, 2) == [(0, 3), (3, 6)]
    assert uniform(6, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # 5 blocks on 3 stages: the extra block goes to the middle stage (ends carry embedding/head)
    assert uniform(7, 3) == [(0, 3), (3, 5), (5, 7)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="4 pipeline stages .* only 3 layers"):
        uniform(5, 4)
    with pytest.raises(ValueError, match="only 2 layers"):
        balanced([1, 1, 1, 1], 3)


def test_balanced_minimizes_the_slowest_stage():
    # a heavy head: the last stage should get fewer blocks
    costs = [0.5, 1, 1, 1, 1, 1, 1, 3.0]
    bounds = balanced(costs, 2)
    assert max(stage_costs(costs, bounds)) == min(
        max(stage_costs(costs, [(0, k), (k, 8)])) for k in range(2, 7))
    assert bounds == [(0, 5), (5, 8)]
    # exhaustive check on a random case
    rng = np.random.default_rng(0)
    costs = list(rng.uniform(0.1, 2.0, size=9))
    best = balanced(costs, 3)
    brute = min(max(stage_costs(costs, [(0, i), (i, j), (j, 9)]))
                for i in range(2, 8) for j in range(i + 1, 8))
    assert max(stage_costs(costs, best)) == pytest.approx(brute)


def test_measured_costs_cover_every_layer():
    cfg = GPTConfig(n_layer=2, d_model=16, n_head=2, context=8)
    rng = np.random.default_rng(0)
    costs = measure_layer_costs(gpt_layers(cfg), lambda: (rng.integers(0, 256, (2, 8)), rng.integers(0, 256, (2, 8))),
                                np.float32, repeats=2)
    assert len(costs) == 4 and all(c > 0 for c in costs)
