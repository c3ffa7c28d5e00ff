"""A LayerChain: a contiguous run of layers over one ParamBuffer.

The first layer takes the batch input (tokens or features); the last layer of the
whole model is a head that takes targets and returns the summed loss. A single
process runs every layer in one LayerChain; a pipeline rank holds one chain per
model chunk (each chunk a virtual stage of the schedule), all on one buffer.

Words with one meaning each: a *layer chain* is this container; a *pipeline
rank* is a process of the pipeline axis; a *(virtual) stage* is a position in
the pipeline's order of chunks (engine/schedules/schedule.py).
"""
from __future__ import annotations

import numpy as np

from ringpipe.engine.model.layers import KVCache
from ringpipe.engine.model.params import ParamBuffer


class LayerChain:
    # Set by an outer axis that shards the parameters (ZeRO-3, engine/parallel/zero.py):
    # acquire(chain, i) before layer i reads its parameters, release(chain, i) after.
    # None: every parameter is always in memory.
    residency = None

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

    # ---- forward ---------------------------------------------------------------
    def forward(self, x, targets=None, grad_scale=1.0, need_grad=True):
        """Run every layer. Returns (output, ctxs): the loss sum if this stage ends in
        the head and targets are given, else the activation (or logits)."""
        ctxs = []
        for i, layer in enumerate(self.layers):
            self._acquire(i)
            if self.has_head and i == len(self.layers) - 1:
                x, ctx = layer.forward(x, targets, grad_scale=grad_scale, need_grad=need_grad)
            else:
                x, ctx = layer.forward(x)
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
            self._acquire(i)
            dout, wctx = self.layers[i].backward_input(dout, ctxs[i])
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
            self._acquire(i)
            dout, wctxs[i] = self.layers[i].backward_input(dout, ctxs[i])
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
    def _acquire(self, i):
        if self.residency is not None:
            self.residency.acquire(self, i)

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
