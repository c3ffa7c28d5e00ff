"""Split a model's layer list into pipeline stages.

The GPT's list is [Embedding, Block x n_layer, LMHead]. Every stage gets at
least one Block; the Embedding always rides with the first stage and the
LMHead (logits over the vocabulary, the heaviest single layer at small widths)
with the last, which is why "balanced" partitioning weighs them in.
"""
from __future__ import annotations

import time

import numpy as np


def _check(n_blocks, n_stages):
    if n_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {n_stages}")
    if n_stages > n_blocks:
        raise ValueError(f"{n_stages} pipeline stages (pp x chunks) but the model has only {n_blocks} "
                         f"layers: each stage needs at least one; use --pp/--chunks with pp*chunks <= {n_blocks} "
                         f"or more --layers")


def uniform(n_layers, n_stages):
    """[(lo, hi)] over the full layer list (embedding at 0, head at n_layers-1),
    blocks spread as evenly as possible (extra blocks go to the middle stages,
    since the first and last already carry the embedding and the head)."""
    n_blocks = n_layers - 2
    _check(n_blocks, n_stages)
    base, extra = divmod(n_blocks, n_stages)
    counts = [base] * n_stages
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
    for s in order[:extra]:
        counts[s] += 1
    return _bounds_from_block_counts(counts, n_layers)


def balanced(costs, n_stages):
    """Contiguous split minimizing the slowest stage's total cost (exact, by dynamic programming).
    costs: one number per layer of the full list, embedding and head included."""
    n_layers = len(costs)
    n_blocks = n_layers - 2
    _check(n_blocks, n_stages)
    blocks = list(costs[1:-1])
    first_extra, last_extra = costs[0], costs[-1]
    prefix = np.concatenate([[0.0], np.cumsum(blocks)])

    def cost(s, i, j):            # stage s holds blocks i..j-1
        c = prefix[j] - prefix[i]
        if s == 0:
            c += first_extra
        if s == n_stages - 1:
            c += last_extra
        return c

    INF = float("inf")
    # best[s][j]: minimal max-cost placing blocks 0..j-1 into stages 0..s
    best = [[INF] * (n_blocks + 1) for _ in range(n_stages)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages)]
    for j in range(1, n_blocks + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n_blocks + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    counts, j = [], n_blocks
    for s in reversed(range(n_stages)):
        i = cut[s][j] if s > 0 else 0
        counts.append(j - i)
        j = i
    return _bounds_from_block_counts(counts[::-1], n_layers)


def _bounds_from_block_counts(counts, n_layers):
    bounds, lo = [], 0
    for s, count in enumerate(counts):
        hi = lo + count + (1 if s == 0 else 0) + (1 if s == len(counts) - 1 else 0)
        bounds.append((lo, hi))
        lo = hi
    assert lo == n_layers
    return bounds


def time_layers(layers, x, y, repeats=3):
    """Median seconds of each layer's forward and of its backward on one batch
    (x into the first layer, targets y for the head); one untimed warm-up pass
    first (Numba compile, caches). Returns (forward_s, backward_s) lists."""
    fwd, bwd = np.zeros((repeats, len(layers))), np.zeros((repeats, len(layers)))
    for r in range(repeats + 1):
        h, ctxs = x, []
        for i, layer in enumerate(layers):
            t = time.perf_counter()
            if i == len(layers) - 1:
                h, ctx = layer.forward(h, y, grad_scale=1.0)
            else:
                h, ctx = layer.forward(h)
            if r:
                fwd[r - 1, i] = time.perf_counter() - t
            ctxs.append(ctx)
        d = None
        for i in reversed(range(len(layers))):
            t = time.perf_counter()
            d = layers[i].backward(d, ctxs[i])
            if r:
                bwd[r - 1, i] = time.perf_counter() - t
    return np.median(fwd, axis=0).tolist(), np.median(bwd, axis=0).tolist()


def measure_layer_costs(layers, make_batch, dtype, repeats=3):
    """Median seconds of forward + backward for each layer of a full model on one micro-batch."""
    from ringpipe.engine.model.chain import LayerChain
    stage = LayerChain(layers, dtype=dtype)
    stage.params.init(0)
    fwd, bwd = time_layers(layers, *make_batch(), repeats=repeats)
    return [f + b for f, b in zip(fwd, bwd)]


def stage_costs(costs, bounds):
    return [float(sum(costs[lo:hi])) for lo, hi in bounds]
