"""The tensor axis: each layer's matrices split across the ranks of a tensor group.

Megatron's split of a Transformer block, written out by hand like the layers:

    attention   qkv   column-parallel by heads (rank r: heads r*H/tp ...; q, k and v of them)
                proj  row-parallel (its input features are those heads' outputs)
    MLP         fc    column-parallel (rank r: hidden features r*4C/tp ...), GELU inside
                proj  row-parallel
    embedding   wte   vocabulary-parallel (rank r: rows r*V/tp ...; other tokens look up 0)
    LM head     wte   the same rows, tied; logits (N, V/tp) never gathered: the fused
                      cross-entropy all-reduces each row's max and sum of exponentials

The Llama family (engine/model/llama.py) asks the same maker for its parts: q, k and v
column-parallel by heads (rank r: query heads r*H/tp ... and key/value heads r*Hkv/tp ...,
the ones those query heads read), o row-parallel; gate and up column-parallel over d_ff,
down row-parallel (a d_ff tp does not divide is padded with zero features, as the
vocabulary is); the embedding without a position table (wpe=None); the head tied to wte
or with its own lm_head.w, split alike.

V is the model's padded vocabulary (GPTConfig.padded_vocab, the same for every
layout). Where tp does not divide it, the last ranks hold a few more zero rows,
in memory only (Split.pad): their logits are masked like any padding row's, and
a checkpoint or an export holds wte at its V rows whatever the tp.

Between the regions the activations are whole on every rank. Entering one is
Megatron's `f` (forward: identity; backward: all-reduce of the input gradient,
each rank having computed its share of it); leaving one is `g` (forward:
all-reduce of the partial sums of the row-parallel output; backward: identity).
That is one all-reduce of B*T*C in forward and one in backward per sub-layer.

Sequence parallelism (Megatron-SP) splits the stream *between* the regions
along the sequence: LayerNorm, the residual adds and the activations they keep
hold T/tp positions per rank. `f` becomes an all-gather along T (backward:
reduce-scatter), `g` a reduce-scatter (backward: all-gather): the same bytes on
the wire as the all-reduces (an all-reduce is a reduce-scatter plus an
all-gather), with activation memory between the regions cut by tp. The
LayerNorms' gradients are then each rank's part (ParamSpec.partial): summed
over the group once final, before the data axis reduces them.

Overlap: a column-parallel layer (and the head) starts its input gradient's
reduction on a communication thread and computes its weight gradient while it
runs, unless the schedule defers weight gradients to later actions (zero-bubble
W), which then fill that time instead.

TensorGroup holds the group and these operators, and makes the split layers (the
layer maker engine/model/layers.py's Block asks for its linears): ColumnParallelLinear
and RowParallelLinear (the two Linear layers), VocabParallelEmbedding and
VocabParallelHead (the Embedding and LMHead subclasses). TensorParallel is the
axis's inner model (engine/parallel/__init__.py InnerModel), wrapping the local or
pipeline model of the split layers.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ringpipe import comm, kernels as K
from ringpipe.comm.hierarchical import node_key, node_map
from ringpipe.engine.model.layers import BF16, Embedding, Layer, Linear, LMHead, LayerNorm, scatter_add_rows
from ringpipe.engine.parallel import NO_SYNC, GradSync
from ringpipe.engine.model.params import ParamSpec, Split


class _Done:
    """A reduction that already ran on the calling thread."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class _Running:
    """A reduction running on the group's communication thread."""

    def __init__(self, future, group):
        self.future, self.group = future, group

    def wait(self):
        t0 = time.perf_counter()
        value = self.future.result()
        self.group.stats["waited_s"] += time.perf_counter() - t0
        self.group.event("tensor-parallel wait", t0)
        return value


class TensorGroup:
    """The ranks of one tensor-parallel group, and the operators between its regions.

        into_region(x)            f: identity, or all-gather along T (sequence parallel)
        into_region_backward(dx)  f's backward: all-reduce, or reduce-scatter along T
        out_of_region(y)          g: all-reduce, or reduce-scatter along T
        out_of_region_backward(dy) g's backward: identity, or all-gather along T

    Activations are (B, T, C); under sequence parallelism a rank's part of the
    stream is (B, T/tp, C), positions index*T/tp ... . `stats` counts the calls
    and the buffer bytes of each collective, and the time spent in them.
    """

    def __init__(self, comm_, sequence_parallel=False, overlap=True, trace=None):
        self.comm, self.size, self.index = comm_, comm_.Get_size(), comm_.Get_rank()
        self.trace = trace             # list-like to append (name, category, t0, t1), or None
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap
        # False when the schedule runs weight gradients as actions of their own (zero-bubble W).
        self.weight_grads_early = True
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ringpipe-tensor") if overlap else None
        self.stats = {}
        self.reset_stats()
        # Which nodes the group spans (its traffic is heavy: it should not leave a node).
        self.nodes = node_map(comm_.allgather(node_key(comm_))).n_nodes

    def reset_stats(self):
        self.stats = {"all-reduce": [0, 0], "all-gather": [0, 0], "reduce-scatter": [0, 0],
                      "comm_s": 0.0, "async_s": 0.0, "waited_s": 0.0}

    def split(self, dim, groups=1, pad=0) -> Split:
        return Split(dim, self.index, self.size, groups, pad)

    def vocab_rows(self, vocab):
        """(lo, hi, pad): this rank's rows of a `vocab`-row table split across the group,
        with `pad` zero rows added at its end (in memory only) when size does not divide it."""
        part = -(-vocab // self.size)
        return self.index * part, (self.index + 1) * part, part * self.size - vocab

    # ---- the layers of a region (the layer maker: engine/model/layers.py WholeLayers) ------------
    def column(self, name, c_in, c_out, groups=1, gelu=False, std=0.02, bias=True):
        return ColumnParallelLinear(self, name, c_in, c_out, groups=groups, bias=bias, gelu=gelu, std=std)

    def row(self, name, c_in, c_out, std=0.02, bias=True):
        return RowParallelLinear(self, name, c_in, c_out, bias=bias, std=std)

    def embedding(self, vocab, context, c, wte="wte", wpe="wpe"):
        return VocabParallelEmbedding(self, vocab, context, c, wte=wte, wpe=wpe)

    def shared_input(self, columns):
        return SharedInputColumns(self, columns)

    def head(self, vocab, c, wte="wte", used=None):
        return VocabParallelHead(self, vocab, c, wte=wte, used=used)

    # ---- the conjugate operators ----------------------------------------------------------------
    def into_region(self, x):
        return self.all_gather_seq(x) if self.sequence_parallel else x

    def into_region_backward(self, dx):
        return self.reduce_scatter_seq(dx) if self.sequence_parallel else self.allreduce(dx)

    def out_of_region(self, y):
        return self.reduce_scatter_seq(y) if self.sequence_parallel else self.allreduce(y)

    def out_of_region_backward(self, dy):
        return self.all_gather_seq(dy) if self.sequence_parallel else dy

    def start(self, fn, x):
        """Run fn(x) on the communication thread (when overlapping); .wait() returns
        its result. At most one call is in flight: the caller waits before the next."""
        if self._thread is None:
            return _Done(fn(x))

        def timed():
            t0 = time.perf_counter()
            value = fn(x)
            self.stats["async_s"] += time.perf_counter() - t0
            return value
        return _Running(self._thread.submit(timed), self)

    def reduce_input_grad(self, dx, weight_grads, wctx):
        """f's backward of dx, with the layer's weight-gradient GEMMs (weight_grads(wctx))
        computed while it runs, when they may run now. Returns (dx reduced, wctx or None)."""
        pending = self.start(self.into_region_backward, dx)
        if self.weight_grads_early:
            weight_grads(wctx)
            wctx = None
        return pending.wait(), wctx

    # ---- the collectives (our own comm: ring or small path by size) ---------------------------
    def _count(self, kind, nbytes, t0):
        self.stats[kind][0] += 1
        self.stats[kind][1] += nbytes
        self.stats["comm_s"] += time.perf_counter() - t0
        self.event(f"tensor-parallel {kind}", t0)

    def event(self, name, t0):
        """A span of communication time for the trace and the step's time split (on the
        communication thread too: the clock counts only the thread that computes)."""
        if self.trace is not None:
            self.trace.append((name, "comm", t0, time.perf_counter()))

    def allreduce(self, x, op="sum"):
        t0 = time.perf_counter()
        x = K.get_array_module(x).ascontiguousarray(x)
        comm.allreduce(x, self.comm, op=op)
        self._count("all-reduce", x.nbytes, t0)
        return x

    def all_gather_seq(self, x):
        """(B, T/tp, C) on each rank -> (B, T, C), ranks' parts in position order."""
        t0 = time.perf_counter()
        xp = K.get_array_module(x)
        B, t, C = x.shape
        buf = xp.empty((self.size, B, t, C), dtype=x.dtype)
        buf[self.index] = x
        comm.allgather(buf, self.comm)
        self._count("all-gather", buf.nbytes, t0)
        return xp.ascontiguousarray(buf.transpose(1, 0, 2, 3)).reshape(B, self.size * t, C)

    def reduce_scatter_seq(self, x):
        """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) of their sum."""
        t0 = time.perf_counter()
        xp = K.get_array_module(x)
        B, T, C = x.shape
        t = T // self.size
        buf = xp.ascontiguousarray(x.reshape(B, self.size, t, C).transpose(1, 0, 2, 3))
        mine = comm.reduce_scatter(buf, self.comm, op="sum")
        self._count("reduce-scatter", buf.nbytes, t0)
        return mine.reshape(B, t, C).copy()       # a copy: the whole buffer need not stay alive

    def gather_columns(self, x):
        """(N, V/tp) on each rank -> (N, V): logits for callers that want them whole."""
        xp = K.get_array_module(x)
        N, v = x.shape
        buf = xp.empty((self.size, N, v), dtype=x.dtype)
        buf[self.index] = x
        comm.allgather(buf, self.comm)
        return xp.ascontiguousarray(buf.transpose(1, 0, 2)).reshape(N, self.size * v)

    # ---- the vocabulary-parallel cross-entropy ------------------------------------------------
    def cross_entropy(self, logits, targets, lo, want_grad, grad_scale):
        """Softmax cross-entropy over logits split by vocabulary columns: this rank
        holds columns lo ... lo + V/tp of (N, V). Each row's max, sum of exponentials
        and target logit are all-reduced (3 numbers a row, not V/tp); the full
        logits never exist. Returns (losses (N,), dlogits over the logits or None),
        the fused kernel's contract (engine/kernels reference)."""
        xp = K.get_array_module(logits)
        N, v = logits.shape
        rows = xp.arange(N)
        peak = self.allreduce(logits.max(axis=1), op="max")                      # (N,)
        local = targets - lo
        inside = (local >= 0) & (local < v)
        sums = xp.zeros((2, N), dtype=np.float64)
        sums[0] = xp.exp(logits - peak[:, None]).sum(axis=1, dtype=np.float64)
        sums[1] = xp.where(inside, logits[rows, xp.where(inside, local, 0)], 0)
        sums = self.allreduce(sums)                                               # sum-exp, target logit
        lse = peak + xp.log(sums[0])
        losses = (lse - sums[1]).astype(logits.dtype)
        if not want_grad:
            return losses, None
        dlogits = logits                       # in place, as the fused kernel writes them
        xp.subtract(logits, lse[:, None].astype(logits.dtype), out=dlogits)
        xp.exp(dlogits, out=dlogits)
        dlogits[rows[inside], local[inside]] -= 1.0
        dlogits *= grad_scale
        return losses, dlogits

    def hidden_fraction(self):
        """Share of the time spent in overlapped reductions that the caller did not wait for."""
        busy = self.stats["async_s"]
        return max(0.0, 1.0 - self.stats["waited_s"] / busy) if busy > 0 else None

    def describe_stats(self, steps=1):
        parts = []
        for kind in ("all-reduce", "all-gather", "reduce-scatter"):
            calls, nbytes = self.stats[kind]
            if calls:
                parts.append(f"{calls / steps:.0f} {kind}s ({nbytes / steps / 2**20:.2f} MiB)")
        if not parts:
            return "no collectives"
        hidden = self.hidden_fraction()
        return (", ".join(parts) + " per training step" +
                (f", {hidden:.0%} of the overlapped reduction time hidden" if hidden is not None else ""))

    def close(self):
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _features(name, n, tensor, groups=1):
    """(features on each rank, zero features padded in memory) of n features split over
    the group. Uneven splits (a SwiGLU's d_ff of 37 at tp 2) are padded like the
    vocabulary: the last rank holds zero rows, whose outputs are 0 and stay 0 (their
    gradients are 0: silu(0) * 0 and its derivatives vanish), so the math is unchanged.
    A split in `groups` blocks (GPT's qkv) must be even."""
    if groups == 1:
        part = -(-n // tensor.size)
        return part, part * tensor.size - n
    if n % (groups * tensor.size):
        raise ValueError(f"{name}: {n} features do not split into {groups} x {tensor.size} parts")
    return n // tensor.size, 0


class ColumnParallelLinear(Linear):
    """Rank r holds output features (rows of w, and of b) r of each of `groups`
    blocks: y_r = x @ w_r.T + b_r. Its input is the whole activation (f)."""

    def __init__(self, tensor, name, c_in, c_out, groups=1, bias=True, std=0.02, gelu=False):
        part, self.pad = _features(name, c_out, tensor, groups)
        super().__init__(name, c_in, part, bias=bias, std=std, gelu=gelu)
        self.tensor, self.groups = tensor, groups

    def specs(self):
        split = self.tensor.split(0, self.groups, pad=self.pad)
        return [_split(spec, split) for spec in super().specs()]

    def forward(self, x):
        # x (B, T, C_in), or (B, T/tp, C_in) under sequence parallelism -> y (B, T, C_out/tp)
        y, (x2, pre) = super().forward(self.tensor.into_region(x))
        # Sequence parallel: keep this rank's part of the input, gather it again in backward.
        kept = x if self.tensor.sequence_parallel else x2
        return y, (kept, pre)

    def backward_input(self, dy, ctx):
        kept, pre = ctx
        t = self.tensor
        gathering = t.start(t.all_gather_seq, kept) if t.sequence_parallel else None
        dy2 = dy.reshape(-1, self.c_out)
        if self.gelu:
            dy2 = K.gelu_backward(dy2, pre)                          # (N, C_out/tp) before GELU
        dy2, (_, _, bias_here) = self.weight_grad_ctx(None, dy2)        # (bf16 BF16: dy rounded once)
        dx = K.matmul(dy2, BF16.weight(self.w)).reshape(*dy.shape[:-1], self.c_in)   # (B, T, C_in): this rank's share
        x2 = (gathering.wait() if gathering else kept).reshape(-1, self.c_in)
        return t.reduce_input_grad(dx, super().backward_weight, (x2, dy2, bias_here))

    def backward_weight(self, wctx):
        if wctx is not None:              # None: computed during backward_input
            super().backward_weight(wctx)

    def forward_local(self, x_in):
        """y from the region's input already gathered (SharedInputColumns runs f once for several)."""
        return super().forward(x_in)[0]


class SharedInputColumns(Layer):
    """Column-parallel linears reading one input (the Llama family's q, k and v; gate and
    up): f runs once for them all (one all-gather under sequence parallelism, not one each),
    and the input gradient, the sum of their shares, is reduced once. A Llama block then
    reduces 2 activations in backward, as GPT's fused qkv and fc do, instead of 5.
    forward(x) -> ([y of each], ctx); backward_input([dy of each], ctx) -> (dx, wctx)."""

    def __init__(self, tensor, columns):
        self.tensor, self.columns = tensor, columns
        self.c_in = columns[0].c_in

    def specs(self):
        return [s for c in self.columns for s in c.specs()]

    def bind(self, params):
        for c in self.columns:
            c.bind(params)

    def forward(self, x):
        x_in = BF16.of(self.tensor.into_region(x))                   # (B, T, C_in): whole; bf16: rounded once
        # Sequence parallel: keep this rank's part of the input, gather it again in backward.
        kept = x if self.tensor.sequence_parallel else x_in.reshape(-1, self.c_in)
        return [c.forward_local(x_in) for c in self.columns], kept

    def backward_input(self, dys, kept):
        t = self.tensor
        gathering = t.start(t.all_gather_seq, kept) if t.sequence_parallel else None
        # (dy operand, bias done?) of each: under bf16 dy rounded once for dX and dW (BF16)
        dy2s = [c.weight_grad_ctx(None, dy.reshape(-1, c.c_out)) for c, dy in zip(self.columns, dys)]
        dy2s = [(dy2, bias_here) for dy2, (_, _, bias_here) in dy2s]
        dx = K.matmul(dy2s[0][0], BF16.weight(self.columns[0].w))    # (N, C_in): this rank's share
        for c, (dy2, _) in zip(self.columns[1:], dy2s[1:]):
            dx += K.matmul(dy2, BF16.weight(c.w))
        x2 = (gathering.wait() if gathering else kept).reshape(-1, self.c_in)
        return t.reduce_input_grad(dx.reshape(*dys[0].shape[:-1], self.c_in), self._weight_grads, (x2, dy2s))

    def _weight_grads(self, wctx):
        x2, dy2s = wctx
        for c, (dy2, bias_here) in zip(self.columns, dy2s):
            c.backward_weight((x2, dy2, bias_here))

    def backward_weight(self, wctx):
        if wctx is not None:              # None: computed during backward_input
            self._weight_grads(wctx)


class RowParallelLinear(Linear):
    """Rank r holds input features (columns of w) r: its input is the matching
    output of a column-parallel layer, its output a partial sum the group adds
    up (g). The bias is whole on every rank, added once after the sum."""

    def __init__(self, tensor, name, c_in, c_out, bias=True, std=0.02):
        part, self.pad = _features(name, c_in, tensor)    # padded columns meet the column layer's zero outputs
        super().__init__(name, part, c_out, bias=bias, std=std)
        self.tensor = tensor

    def specs(self):
        w, *bias = super().specs()
        return [_split(w, self.tensor.split(1, pad=self.pad))] + bias

    def forward(self, x):
        # x (B, T, C_in/tp) -> y (B, T, C_out), or (B, T/tp, C_out) under sequence parallelism
        x2 = BF16.of(x.reshape(-1, self.c_in))                      # kept for dW: bf16 under bf16 (BF16)
        partial, _ = K.linear_forward(x2, BF16.weight(self.w), None)
        y = self.tensor.out_of_region(partial.reshape(*x.shape[:-1], self.c_out))
        if self.has_bias:
            y += self.b
        return y, x2

    def backward_input(self, dy, ctx):
        x2 = ctx
        dy = self.tensor.out_of_region_backward(dy)                 # (B, T, C_out): whole
        # db from the whole dy: the same on every rank (the bias is replicated)
        dy2, wctx = self.weight_grad_ctx(x2, dy.reshape(-1, self.c_out))   # (bf16 BF16: dy rounded once)
        dx = K.matmul(dy2, BF16.weight(self.w))                    # (N, C_in/tp)
        return dx.reshape(*dy.shape[:-1], self.c_in), wctx


def _split(spec, split):
    return replace(spec, split=split)


class VocabParallelEmbedding(Embedding):
    """This rank holds rows lo ... hi of wte, looks up the tokens among them (0 for
    the others), and the group sums the parts (g: an all-reduce, or under sequence
    parallelism a reduce-scatter to this rank's positions). wpe=None: no position
    table (the Llama family's positions are rotary, inside attention)."""

    def __init__(self, tensor, vocab, context, c, wte="wte", wpe="wpe"):
        super().__init__(vocab, context, c, wte=wte, wpe=wpe)
        self.tensor = tensor
        self.lo, self.hi, self.pad = tensor.vocab_rows(vocab)

    def specs(self):
        wte = ParamSpec(self.wte_name, (self.hi - self.lo, self.c), split=self.tensor.split(0, pad=self.pad))
        return [wte] + ([self.wpe_spec()] if self.wpe_name else [])

    def bind(self, params):
        if self.wpe_name:
            super().bind(params)
        else:
            self.wte, self.dwte = params.view(self.wte_name), params.grad_view(self.wte_name)

    def forward(self, tokens):
        self.check_length(tokens.shape[1])
        xp = K.get_array_module(self.wte)
        local = tokens - self.lo
        inside = (local >= 0) & (local < self.hi - self.lo)
        local = xp.where(inside, local, 0)
        part = self.wte[local] * inside[..., None]                           # (B, T, C): 0 for others' tokens
        x = self.tensor.out_of_region(part)                                 # (B, T, C), or (B, T/tp, C)
        if self.wpe_name:
            first = self.tensor.index * x.shape[1] if self.tensor.sequence_parallel else 0
            x = x + self.wpe[first:first + x.shape[1]]
        return x, (tokens, local, inside)

    def backward_input(self, dout, ctx):
        tokens, local, inside = ctx
        dout = self.tensor.out_of_region_backward(dout)                     # (B, T, C): whole
        B, T = tokens.shape
        if self.wpe_name:
            self.dwpe[:T] += dout.sum(axis=0)        # from the whole dout: the same on every tensor rank
        keep = inside.reshape(-1)
        scatter_add_rows(self.dwte, local.reshape(-1)[keep], dout.reshape(B * T, self.c)[keep])
        return None, None


class VocabParallelHead(LMHead):
    """This rank's rows of the tied wte give its columns of the logits (N, V/tp); the
    loss comes from the vocabulary-parallel cross-entropy, the logits never whole;
    x is this rank's T/tp positions under sequence parallelism."""

    def __init__(self, tensor, vocab, c, wte="wte", used=None):
        super().__init__(vocab, c, wte=wte, used=used)
        self.tensor = tensor
        self.lo, self.hi, self.pad = tensor.vocab_rows(vocab)
        self.ln_f = LayerNorm("ln_f", c, partial=tensor.sequence_parallel)

    def specs(self):
        wte = ParamSpec(self.wte_name, (self.hi - self.lo, self.c), split=self.tensor.split(0, pad=self.pad))
        return self.ln_f.specs() + [wte]

    def forward(self, x, targets=None, grad_scale=1.0, need_grad=True):
        h, ln_ctx = self.ln_f.forward(x)
        h = self.tensor.into_region(h)                       # f, or the whole sequence gathered
        B, T, C = h.shape
        h2 = BF16.of(h.reshape(B * T, C))                    # kept for dW: bf16 under bf16 (BF16)
        slopes = [] if targets is not None and need_grad else None
        logits = self.logits(h2, self.lo, slopes=slopes)     # (N, V/tp): columns lo ... hi
        if targets is None:                                  # whole, without the in-memory padding
            return self.tensor.gather_columns(logits)[:, :self.vocab].reshape(B, T, self.vocab), None
        losses, dlogits = self.tensor.cross_entropy(logits, targets.reshape(-1), self.lo, need_grad, grad_scale)
        return float(losses.sum()), (ln_ctx, h2, self.capped_slope(dlogits, slopes), (B, T, C))

    def backward_input(self, dloss, ctx):
        ln_ctx, h2, dlogits, shape = ctx
        dlogits = BF16.of(dlogits)                            # read by dh and dW: rounded once under bf16
        dh = K.matmul(dlogits, BF16.weight(self.wte)).reshape(shape)   # (N, C): this rank's share
        dh, wctx = self.tensor.reduce_input_grad(dh, super().backward_weight, (h2, dlogits))
        dx, _ = self.ln_f.backward_input(dh, ln_ctx)
        return dx, wctx

    def backward_weight(self, wctx):
        if wctx is not None:              # None: computed during backward_input
            super().backward_weight(wctx)


# ---- the axis as a rank model ------------------------------------------------------------------

class _PartialSums(GradSync):
    """Sequence parallelism: a LayerNorm's gradient is each tensor rank's part; sum
    it over the group as soon as it is final, then hand it to the outer axis."""

    def __init__(self, outer, params, tensor, partial):
        self.outer, self.params, self.tensor, self.partial = outer, params, tensor, partial
        self.sum_separate_first = outer.sum_separate_first

    def on_ready(self, index):
        if index in self.partial:
            lo, hi = self.partial[index]
            self.params.grad[lo:hi] = self.tensor.allreduce(self.params.grad[lo:hi])
        self.outer.on_ready(index)

    def finish(self):
        self.outer.finish()

    def kept(self, lo, hi):
        return self.outer.kept(lo, hi)


class TensorParallel:
    """An inner model (engine/parallel/__init__.py InnerModel) wrapping the local or
    pipeline model built from the split layers. Owns:
    - the loss: every rank of the group computes the same one; the first reports it;
    - the gradient norm: split parameters add up over the group, replicated ones
      (LayerNorms, the row-parallel biases, wpe) are counted on the first rank only;
    - sequence-parallel partial gradients, summed over the group when final;
    - checkpoint state by full parameter name: parts gathered and joined on the
      group's first rank; a restore gets full arrays and each rank takes its part
      (ParamBuffer.load_flat), so any layout continues any other's checkpoint."""

    def __init__(self, inner, tensor: TensorGroup, specs):
        self.inner, self.tensor, self.params = inner, tensor, inner.params
        self.specs = {s.name: s for s in specs}          # every parameter of the model, split or not
        offsets = self.params.offsets
        self._replicated = [offsets[s.name] for s in self.params.specs if s.split is None]
        names = self.params.names()
        self._partial = {names.index(s.name): offsets[s.name] for s in self.params.specs if s.partial}
        self.steps = 0
        self.chains = inner.chains

    def separate_ranges(self):
        return self.inner.separate_ranges()

    def forward_backward(self, x, y, grad_scale, sync=NO_SYNC):
        if self._partial:
            sync = _PartialSums(sync, self.params, self.tensor, self._partial)
        loss = self.inner.forward_backward(x, y, grad_scale, sync=sync)
        self.steps += 1
        return loss if self.tensor.index == 0 else 0.0

    def forward_loss(self, x, y):
        # Evaluation's collectives are left out of the stats: they count a training step.
        kept = {k: list(v) if isinstance(v, list) else v for k, v in self.tensor.stats.items()}
        loss = self.inner.forward_loss(x, y)
        self.tensor.stats = kept
        return loss if self.tensor.index == 0 else 0.0

    def grad_norm_sq(self, exclude=()):
        return self._sum_over_group(self.inner.grad_norm_sq(exclude=[*exclude, *self._counted_elsewhere()]))

    def _counted_elsewhere(self):
        # The replicated parameters' gradients are the same on every rank of the group: the first counts them.
        return self._replicated if self.tensor.index else []

    def norm_excluded(self):
        return [*self.inner.norm_excluded(), *self._counted_elsewhere()]

    def sum_norm(self, part):
        return self._sum_over_group(self.inner.sum_norm(part))

    def _sum_over_group(self, value):
        total = np.array([value])
        t0 = time.perf_counter()
        comm.allreduce(total, self.tensor.comm, op="sum")
        self.tensor.event("norm all-reduce", t0)
        return float(total[0])

    def named_arrays(self, opt_states):
        arrays = self.inner.named_arrays(opt_states)
        parts = self.tensor.comm.gather(arrays, root=0)   # not a hot path: pickled named arrays
        if self.tensor.index != 0:
            return {}
        for key in list(arrays):
            spec = self.specs[key.split("/")[-1]]
            if spec.split is None:
                continue
            full = np.zeros(spec.full_shape, dtype=arrays[key].dtype)
            for r, part in enumerate(parts):
                replace(spec.split, index=r).place(full, part[key])
            arrays[key] = full
        return arrays

    def named_shapes(self, state_names):
        return self.inner.named_shapes(state_names)

    def load_named(self, arrays, state_names):
        return self.inner.load_named(arrays, state_names)

    def notes(self):
        return tensor_notes(self.tensor) + self.inner.notes()

    def describe(self):
        t = self.tensor
        what = (f"tensor parallel {t.size}{' + sequence parallel' if t.sequence_parallel else ''}"
                f"{', reductions overlapped with weight gradients' if t.overlap and t.weight_grads_early else ''}")
        inner = self.inner.describe()
        return f"{what}{f' | {inner}' if inner else ''}"

    def summary(self):
        parts = [self.inner.summary(),
                 f"tensor axis (rank 0): {self.tensor.describe_stats(max(1, self.steps))}"]
        return "\n".join(p for p in parts if p)

    def close(self):
        self.tensor.close()
        self.inner.close()


def tensor_notes(tensor: TensorGroup) -> list[str]:
    """Warnings about the group's placement, for the run's start-up lines."""
    if tensor.nodes > 1:
        return [f"warning: the tensor-parallel group of {tensor.size} ranks spans {tensor.nodes} nodes; it "
                "all-reduces activations twice per sub-layer, which is slow across a network: launch with "
                "tp <= ranks per node (the tensor axis is innermost, so a group is consecutive ranks)"]
    return []


def valid_tp(n_head: int, limit: int) -> list[int]:
    """The tensor-parallel sizes up to `limit` that split n_head heads evenly."""
    return [d for d in range(1, min(n_head, limit) + 1) if n_head % d == 0]
