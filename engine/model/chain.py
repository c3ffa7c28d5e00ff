"""A LayerChain: a contiguous run of layers over one ParamBuffer.

The first layer takes the batch input (tokens or features); the last layer of the
whole model is a head that takes targets and returns the summed loss. A single
process runs every layer in one LayerChain; a pipeline rank holds one chain per
model chunk (each chunk a virtual stage of the schedule), all on one buffer.

Words with one meaning each: a *layer chain* is this container; a *pipeline
rank* is a process of the pipeline axis; a *(virtual) stage* is a position in
the pipeline's order of chunks (engine/schedules/schedule.py).

Activation recomputation (set_recompute) trades compute for activation memory, per
transformer block (a layer with set_recompute: engine/model/layers.py Block):
    none       every layer keeps its ctx from forward to backward
    full       a block keeps only its input (BlockInput); its backward runs the block's
               forward again on it to rebuild the ctx (one more forward of every block)
    selective  a block's attention does not keep its probabilities (B, H, T, T); its
               backward computes them again from q and k (two kernels calls, Megatron's)
The ops run again are the same ops on the same inputs: the gradients are the same bits.
"""
from __future__ import annotations

import numpy as np

from ringpipe.engine.model.layers import KVCache
from ringpipe.engine.model.params import ParamBuffer


RECOMPUTE = ("none", "full", "selective")

# What each mode keeps and costs, in words (the start-up description, --help, docs/memory.md).
RECOMPUTE_WORDS = {
    "full": "each block keeps only its input and runs its forward again in backward",
    "selective": "attention probabilities (B, H, T, T) computed again in backward from q and k",
}


class BlockInput:
    """What a block recomputed in full keeps from forward to backward: its input.
    nbytes: what the pipeline executor counts (executor.py nbytes)."""
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    @property
    def nbytes(self):
        return int(self.x.nbytes)


class LayerChain:
    # Set by an outer axis that shards the parameters (ZeRO-3, engine/parallel/zero.py):
    # acquire(chain, i, direction) before layer i reads its parameters (direction: +1
    # in forward, -1 in backward: which layer comes next), release(chain, i) after.
    # None: every parameter is always in memory.
    residency = None
    recompute = "none"         # set_recompute

    def __init__(self, layers, dtype=np.float32, xp=np, has_head=True, params=None):
        """`params`: an existing ParamBuffer to bind to (a pipeline rank's model
        chunks share one buffer); by default the stage gets its own."""
        self.layers = list(layers)
        self.has_head = has_head              # the last layer computes the loss
        if params is None:
            params = ParamBuffer([s for layer in self.layers for s in layer.specs()], dtype, xp)
        self.params = params
        for layer in self.layers:
            layer.bind(self.params)
        # A parameter's gradient is final once the *first* layer (in forward
        # order) that uses it has run its backward: tied weights appear twice.
        self._ready_after = {}
        for i, layer in enumerate(self.layers):
            for spec in layer.specs():
                self._ready_after.setdefault(spec.name, i)
        names = self.params.names()
        self._ready_by_layer = [[] for _ in self.layers]
        for name, i in self._ready_after.items():
            self._ready_by_layer[i].append(names.index(name))
        self._recomputed = [False] * len(self.layers)    # layer i keeps only its input (full)

    # ---- activation recomputation ---------------------------------------------------
    @property
    def blocks(self) -> int:
        """How many layers activation recomputation applies to (transformer blocks)."""
        return sum(hasattr(layer, "set_recompute") for layer in self.layers)

    def set_recompute(self, mode):
        """none | full | selective (the module's docstring); layers that are not blocks (the
        embedding, the head, an MLP's layers) keep their ctx in every mode."""
        if mode not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {mode!r}")
        for layer in self.layers:
            if hasattr(layer, "set_recompute"):
                layer.set_recompute(mode)
        self._recomputed = [mode == "full" and hasattr(layer, "set_recompute") for layer in self.layers]
        self.recompute = mode

    def describe(self):
        """The recomputation in words for the start-up description; "" when none."""
        if self.recompute == "none":
            return ""
        return f"recompute {self.recompute}: {RECOMPUTE_WORDS[self.recompute]}"

    def _backward_ctx(self, i, ctx):
        """Layer i's ctx for its backward: a block recomputed in full runs its forward again
        on the kept input. Called between _acquire(i) and _release(i): the forward reads the
        parameters."""
        if isinstance(ctx, BlockInput):
            return self.layers[i].forward(ctx.x)[1]
        return ctx

    # ---- forward ---------------------------------------------------------------
    def forward(self, x, targets=None, grad_scale=1.0, need_grad=True):
        """Run every layer. Returns (output, ctxs): the loss sum if this stage ends in
        the head and targets are given, else the activation (or logits)."""
        ctxs = []
        for i, layer in enumerate(self.layers):
            self._acquire(i, +1)
            if self.has_head and i == len(self.layers) - 1:
                x, ctx = layer.forward(x, targets, grad_scale=grad_scale, need_grad=need_grad)
            else:
                y, ctx = layer.forward(x)
                if self._recomputed[i]:
                    ctx = BlockInput(x)       # the block's ctx goes now; backward rebuilds it from x
                x = y
            self._release(i)
            ctxs.append(ctx)
        return x, ctxs

    # ---- incremental forward (sampling with a KV cache) ---------------------------
    @property
    def decodes(self) -> bool:
        """Whether every layer offers decode (engine/model/layers.py): a whole text model."""
        return self.has_head and all(hasattr(layer, "decode") for layer in self.layers)

    def new_cache(self, capacity):
        """An empty KV cache for positions 0..capacity-1: one KVCache per layer (only
        the attention layers fill theirs)."""
        return [KVCache(capacity) for _ in self.layers]

    def decode(self, tokens, cache, start):
        """tokens (B, T) at positions start..start+T-1, the positions before them already
        in `cache` (new_cache; theirs are appended). Returns the logits (B, V) of the last
        new position: what forward's logits at that position are, up to rounding."""
        x = tokens
        for layer, layer_cache in zip(self.layers, cache):
            x = layer.decode(x, layer_cache, start)
        return x

    # ---- backward --------------------------------------------------------------
    def backward(self, dout, ctxs, on_ready=None):
        """Full backward; parameter gradients accumulate. `on_ready(param_index)` is
        called as soon as a parameter's gradient is final (gradient buckets start
        their all-reduce from it)."""
        for i in reversed(range(len(self.layers))):
            self._acquire(i, -1)
            dout, wctx = self.layers[i].backward_input(dout, self._backward_ctx(i, ctxs[i]))
            self._release(i)
            self.layers[i].backward_weight(wctx)      # reads activations only, never the parameters
            ctxs[i] = None                    # free activations as soon as possible
            if on_ready is not None:
                for index in self._ready_by_layer[i]:
                    on_ready(index)
        return dout

    def backward_input(self, dout, ctxs):
        """Zero-bubble split, part 1: activation gradients only. Returns (dx, wctxs)."""
        wctxs = [None] * len(self.layers)
        for i in reversed(range(len(self.layers))):
            self._acquire(i, -1)
            dout, wctxs[i] = self.layers[i].backward_input(dout, self._backward_ctx(i, ctxs[i]))
            self._release(i)
            ctxs[i] = None
        return dout, wctxs

    def backward_weight(self, wctxs, on_ready=None):
        """Zero-bubble split, part 2: the weight-gradient GEMMs."""
        for i in reversed(range(len(self.layers))):
            self.layers[i].backward_weight(wctxs[i])
            wctxs[i] = None
            if on_ready is not None:
                for index in self._ready_by_layer[i]:
                    on_ready(index)

    # ---- parameters sharded by an outer axis ----------------------------------------
    def first_params_by_layer(self):
        """For each layer, the indices (in params) of the parameters it is the first to use."""
        return [list(indices) for indices in self._ready_by_layer]

    def _acquire(self, i, direction):
        if self.residency is not None:
            self.residency.acquire(self, i, direction)

    def _release(self, i):
        if self.residency is not None:
            self.residency.release(self, i)

    # ---- conveniences for a single-stage model -----------------------------------
    def loss_and_grad(self, x, targets, grad_scale, on_ready=None):
        """Forward + backward of one (micro-)batch; gradients accumulate. Returns the loss sum."""
        loss_sum, ctxs = self.forward(x, targets, grad_scale=grad_scale)
        self.backward(None, ctxs, on_ready=on_ready)
        return loss_sum

    def loss(self, x, targets):
        loss_sum, _ = self.forward(x, targets, need_grad=False)
        return loss_sum
