"""Layers with hand-written forward and backward passes (no autograd).

Every layer follows one contract, so that a pipeline stage can run any
contiguous run of them and the zero-bubble schedule can split backward in two:

    specs()                      parameters this layer declares (names are global)
    bind(params)                 take views into the flat ParamBuffer
    forward(x, ...)      -> (y, ctx)          ctx: what backward needs
    backward_input(dy, ctx) -> (dx, wctx)     activation gradient, overwritten
    backward_weight(wctx)                     parameter gradients, accumulated (+=)

Layers of a text model also offer `decode(x, cache, start)` for sampling with a KV
cache (LayerChain.decode): the forward of the T new positions start..start+T-1 only,
attention reading the earlier positions' keys and values from `cache` (a KVCache)
and appending its own; no ctx, no backward. Only whole layers decode: generate runs
on a whole copy of the model (engine/interop/sample.py, engine/train/run.py).

Only the matrix-weight gradients of Linear layers are deferred to
backward_weight (they are the GEMMs the zero-bubble schedule moves into the
bubbles); LayerNorm and embedding gradients are cheap and are accumulated in
backward_input, which is still exact because gradients only ever add.

Shapes: B batch, T time, C channels, H heads, hs = C/H head size, V vocab, N = B*T rows.

Every layer here is whole on its rank. The attention, MLP and block build their
linears through a `maker` (WHOLE below: plain Linear layers); the tensor axis
(engine/parallel/tensor.py) passes its group instead, which makes the column-
and row-parallel linears and the vocabulary-parallel embedding and head (its
subclasses of these layers), so nothing here knows how a layer is split. The
shape comments hold for a split layer with C_local = C/tp, H/tp heads.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ringpipe import kernels as K
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.params import ParamSpec


class Bf16Operands:
    """GEMM operands rounded to bf16 once, where they are reused, instead of in every GEMM.

    Under bf16 precision on the CPU (kernels.set_matmul_precision("bf16"), numpy arrays,
    float32) every GEMM rounds its float32 operands to bf16 anyway; a weight is read by
    the forward (x W^T) and again by the backward (dY W), an activation by the forward and
    again by the weight gradient (dY^T X), an output gradient by dX and dW. Rounding each
    once and passing the bf16 bits (uint16, kernels.to_bf16) gives the GEMMs the same bits
    (so the same numbers as the per-call rounding) without the repeated passes, and the
    activations a layer keeps for its backward take half the memory. Float32 master
    weights, float32 gradients and the float32 optimizer are untouched. Elsewhere (float32
    precision, float64, a GPU) every method returns its argument: no change at all.

    Weights: `weight(w)` is w's bf16 copy, made on the first call of a step and reused by
    every later GEMM of that step (all micro-batches, forward and backward). The copies
    exist only inside `step()`, which the inner models (LocalModel, PipelineModel) open
    around one step's forward and backward and close before the optimizer runs: nothing
    cached can outlive an update, a checkpoint restore, --init-from or any other write to
    the parameters, which all happen between steps. Copies are keyed by the weight's memory
    (address, shape, strides), so each tensor-parallel part, pipeline chunk or model has its
    own. Outside a step (evaluation, sampling, the kernels on their own) a weight is rounded
    by each GEMM, as before. Under ZeRO-3 (cache=False) nothing is cached: the parameters
    are gathered per layer and dropped again, and bf16 copies kept for the step would hold
    half the whole model on every rank; each GEMM rounds its weight, as before."""

    def __init__(self):
        self.copies = None      # {(address, shape, strides): bf16 bits} while a step caches; else None

    @staticmethod
    def applies(a):
        """Whether GEMM operands are rounded to bf16 here: bf16 precision, a float32 CPU array."""
        return K.get_matmul_precision() == "bf16" and a.dtype == np.float32 and K.get_array_module(a) is np

    def of(self, a):
        """An activation or gradient that several GEMMs read (or a backward keeps): its bf16
        bits (a new array) under bf16 on the CPU, else a itself."""
        return K.to_bf16(a) if self.applies(a) else a

    def bits_out(self, a):
        """Where a fused kernel writes the bf16 bits of a result shaped like the float32 a
        (kernels' bf16_out=, so no separate rounding pass): a new uint16 array under bf16 on
        the CPU, else None."""
        return np.empty(a.shape, np.uint16) if self.applies(a) else None

    def weight(self, w):
        """A weight as the GEMMs' operand: its bf16 copy for this step (made once) inside a
        caching step under bf16 on the CPU, else w itself (the GEMM rounds it)."""
        if self.copies is None or not self.applies(w):
            return w
        key = (w.__array_interface__["data"][0], w.shape, w.strides)
        copy = self.copies.get(key)
        if copy is None:
            copy = self.copies[key] = K.to_bf16(w)
        return copy

    @contextlib.contextmanager
    def step(self, cache=True):
        """One step's forward and backward: weights rounded once each (cache=False: per GEMM).
        The copies are dropped when it ends, before the update."""
        if self.copies is not None or not cache:     # nested (an outer model opened it), or off
            yield
            return
        self.copies = {}
        try:
            yield
        finally:
            self.copies = None


BF16 = Bf16Operands()


def bf16_step(chains):
    """BF16.step for one step of a model over these LayerChains: caching unless an outer
    axis shards the parameters per layer (ZeRO-3 sets a chain's residency)."""
    return BF16.step(cache=all(chain.residency is None for chain in chains))


class Layer:
    def specs(self):
        return []

    def bind(self, params):
        self.params = params

    def backward_weight(self, wctx):
        pass

    def backward(self, dy, ctx):
        dx, wctx = self.backward_input(dy, ctx)
        self.backward_weight(wctx)
        return dx


class Linear(Layer):
    """y = x @ w.T + b ; w (C_out, C_in) like PyTorch, so rows are output features.

    gelu=True applies GELU (tanh approximation) to y in the same kernels call: on the
    GPU it runs in the GEMM's epilogue instead of another pass over (N, C_out)."""

    def __init__(self, name, c_in, c_out, bias=True, std=0.02, gelu=False):
        self.name, self.c_in, self.c_out, self.has_bias, self.std = name, c_in, c_out, bias, std
        self.gelu = gelu

    def specs(self):
        out = [ParamSpec(f"{self.name}.w", (self.c_out, self.c_in), std=self.std)]
        if self.has_bias:
            out.append(ParamSpec(f"{self.name}.b", (self.c_out,), init="zeros", decay=False))
        return out

    def bind(self, params):
        self.w, self.dw = params.view(f"{self.name}.w"), params.grad_view(f"{self.name}.w")
        if self.has_bias:
            self.b, self.db = params.view(f"{self.name}.b"), params.grad_view(f"{self.name}.b")

    def forward(self, x):
        # x (..., C_in) -> y (..., C_out)
        x2 = BF16.of(x.reshape(-1, self.c_in))            # kept for dW: bf16 under bf16 precision (BF16)
        b = self.b if self.has_bias else None
        y, pre = K.linear_forward(x2, BF16.weight(self.w), b, gelu=self.gelu)   # (N, C_out); pre: before GELU, or None
        return y.reshape(*x.shape[:-1], self.c_out), (x2, pre)

    def backward_input(self, dy, ctx):
        x2, pre = ctx
        dy2 = dy.reshape(-1, self.c_out)
        if self.gelu:
            dy2 = K.gelu_backward(dy2, pre)              # (N, C_out) before GELU; a new array: dy is the caller's
        dy2, wctx = self.weight_grad_ctx(x2, dy2)
        dx = K.matmul(dy2, BF16.weight(self.w))          # (N, C_in)
        return dx.reshape(*dy.shape[:-1], self.c_in), wctx

    def weight_grad_ctx(self, x2, dy2):
        """(dy as the GEMMs' operand, wctx for backward_weight) from the input x2 and the
        output gradient dy2 (N, C_out). Under bf16 on the CPU dy2 is rounded once for dX and
        dW, and the bias gradient, which needs float32 dy2, is added now (gradients only
        add, so early is exact); wctx then says it is done."""
        dy_op = BF16.of(dy2)
        if dy_op is dy2:
            return dy2, (x2, dy2, True)
        if self.has_bias:
            K.column_sum(dy2, out=self.db, accumulate=True)
        return dy_op, (x2, dy_op, False)

    def backward_weight(self, wctx):
        x2, dy2, bias_here = wctx
        K.matmul_tn(dy2, x2, out=self.dw, accumulate=True)   # (C_out, C_in) += dy.T @ x
        if self.has_bias and bias_here:
            K.column_sum(dy2, out=self.db, accumulate=True)  # (C_out,) += sum over rows of dy


class LayerNorm(Layer):
    """partial=True: under sequence parallelism this rank normalises only its
    positions, so its gradients are its part of the sum (ParamSpec.partial)."""

    def __init__(self, name, c, eps=1e-5, partial=False):
        self.name, self.c, self.eps, self.partial = name, c, eps, partial

    def specs(self):
        return [ParamSpec(f"{self.name}.w", (self.c,), init="ones", decay=False, partial=self.partial),
                ParamSpec(f"{self.name}.b", (self.c,), init="zeros", decay=False, partial=self.partial)]

    def bind(self, params):
        self.w, self.dw = params.view(f"{self.name}.w"), params.grad_view(f"{self.name}.w")
        self.b, self.db = params.view(f"{self.name}.b"), params.grad_view(f"{self.name}.b")

    def forward(self, x):
        x2 = x.reshape(-1, self.c)
        y, mean, rstd = K.layernorm_forward(x2, self.w, self.b, self.eps)
        return y.reshape(x.shape), (x2, mean, rstd)

    def backward_input(self, dy, ctx):
        x2, mean, rstd = ctx
        dx = K.layernorm_backward(dy.reshape(-1, self.c), x2, self.w, mean, rstd,
                                  dweight=self.dw, dbias=self.db)
        return dx.reshape(dy.shape), None


class GELU(Layer):
    def forward(self, x):
        return K.gelu_forward(x), x

    def backward_input(self, dy, ctx):
        return K.gelu_backward(dy, ctx), None


class WholeLayers:
    """The layer maker for layers whole on this rank. A tensor group
    (engine/parallel/tensor.py TensorGroup) offers the same methods for its parts."""

    size = 1                      # ranks a layer is split over
    sequence_parallel = False     # the stream between the regions holds this rank's positions only

    def column(self, name, c_in, c_out, groups=1, gelu=False, std=0.02, bias=True):
        return Linear(name, c_in, c_out, bias=bias, std=std, gelu=gelu)

    def row(self, name, c_in, c_out, std=0.02, bias=True):
        return Linear(name, c_in, c_out, bias=bias, std=std)

    def embedding(self, vocab, context, c, wte="wte", wpe="wpe"):
        return Embedding(vocab, context, c, wte=wte, wpe=wpe)

    def head(self, vocab, c, wte="wte", used=None):
        return LMHead(vocab, c, wte=wte, used=used)


WHOLE = WholeLayers()


def _residual_std(n_layer):
    # GPT-2: scale residual projections by 1/sqrt(2 * n_layer) so the residual stream stays O(1).
    return 0.02 / math.sqrt(2 * n_layer)


class CausalSelfAttention(Layer):
    """Multi-head causal self-attention: qkv projection, softmax(q k^T / sqrt(hs)) v, output projection.
    Split by a maker over `maker.size` ranks: this rank's H/size heads (qkv
    column-parallel, proj row-parallel).
    keep_probs False (Block.set_recompute selective): the forward does not keep the attention
    probabilities (B, H, T, T); the backward computes them again from q and k."""

    keep_probs = True

    def __init__(self, name, c, n_head, n_layer_for_init, maker=WHOLE):
        if c % n_head:
            raise ValueError(f"d_model {c} is not divisible by heads {n_head}")
        if n_head % maker.size:
            raise ValueError(f"{n_head} heads do not split over tensor parallel {maker.size}")
        self.name, self.c, self.h, self.hs = name, c, n_head // maker.size, c // n_head    # self.h: heads here
        self.qkv = maker.column(f"{name}.qkv", c, 3 * c, groups=3)     # q, k and v of this rank's heads
        self.proj = maker.row(f"{name}.proj", c, c, std=_residual_std(n_layer_for_init))

    def specs(self):
        return self.qkv.specs() + self.proj.specs()

    def bind(self, params):
        self.qkv.bind(params)
        self.proj.bind(params)

    def forward(self, x):
        H, hs = self.h, self.hs
        xp = K.get_array_module(x)
        qkv, qkv_ctx = self.qkv.forward(x)                                  # (B, T, 3C)
        B, T, _ = qkv.shape          # the whole sequence, also when x is a sequence-parallel part
        qkv = xp.ascontiguousarray(qkv.reshape(B, T, 3, H, hs).transpose(2, 0, 3, 1, 4))
        qkv = BF16.of(qkv)           # each read by two GEMMs and kept: rounded once under bf16 (BF16)
        q, k, v = qkv[0], qkv[1], qkv[2]                                    # (B, H, T, hs) each
        scale = 1.0 / math.sqrt(hs)
        y, att = causal_attention(q, k, v, scale)                           # (B, T, H*hs)
        out, proj_ctx = self.proj.forward(y)
        return out, (qkv_ctx, q, k, v, att if self.keep_probs else None, scale, proj_ctx)

    def decode(self, x, cache, start):
        """x (B, T, C) of positions start..start+T-1 -> (B, T, C); appends their keys
        and values to `cache` and attends to every position so far."""
        H, hs = self.h, self.hs
        xp = K.get_array_module(x)
        qkv, _ = self.qkv.forward(x)                                        # (B, T, 3C)
        B, T, _ = qkv.shape
        qkv = xp.ascontiguousarray(qkv.reshape(B, T, 3, H, hs).transpose(2, 0, 3, 1, 4))  # (3, B, H, T, hs)
        k, v = cache.append(qkv[1], qkv[2], start)                          # (B, H, start+T, hs)
        y = attend_cached(qkv[0], k, v, start, 1.0 / math.sqrt(hs))         # (B, H, T, hs)
        y = xp.ascontiguousarray(y.transpose(0, 2, 1, 3)).reshape(B, T, H * hs)
        return self.proj.forward(y)[0]

    def backward_input(self, dout, ctx):
        qkv_ctx, q, k, v, att, scale, proj_ctx = ctx
        B, H, T, hs = q.shape
        xp = K.get_array_module(dout)
        dy, proj_w = self.proj.backward_input(dout, proj_ctx)               # (B, T, C)
        dqkv = xp.empty((3, B, H, T, hs), dtype=dout.dtype)
        causal_attention_backward(dy, q, k, v, att, scale, dq=dqkv[0], dk=dqkv[1], dv=dqkv[2])
        dqkv = xp.ascontiguousarray(dqkv.transpose(1, 3, 0, 2, 4)).reshape(B, T, 3 * H * hs)
        dx, qkv_w = self.qkv.backward_input(dqkv, qkv_ctx)
        return dx, (qkv_w, proj_w)

    def backward_weight(self, wctx):
        qkv_w, proj_w = wctx
        self.proj.backward_weight(proj_w)
        self.qkv.backward_weight(qkv_w)


class MLP(Layer):
    """fc (C -> 4C), GELU, proj (4C -> C); the GELU runs inside fc (Linear(gelu=True)).
    Split by a maker: fc column-parallel, proj row-parallel (4C/size hidden features here)."""

    def __init__(self, name, c, n_layer_for_init, maker=WHOLE):
        self.fc = maker.column(f"{name}.fc", c, 4 * c, gelu=True)
        self.proj = maker.row(f"{name}.proj", 4 * c, c, std=_residual_std(n_layer_for_init))

    def specs(self):
        return self.fc.specs() + self.proj.specs()

    def bind(self, params):
        self.fc.bind(params)
        self.proj.bind(params)

    def forward(self, x):
        g, fc_ctx = self.fc.forward(x)                   # (B, T, 4C), after GELU
        y, proj_ctx = self.proj.forward(g)
        return y, (fc_ctx, proj_ctx)

    def backward_input(self, dy, ctx):
        fc_ctx, proj_ctx = ctx
        dg, proj_w = self.proj.backward_input(dy, proj_ctx)
        dx, fc_w = self.fc.backward_input(dg, fc_ctx)    # through the GELU, then fc
        return dx, (fc_w, proj_w)

    def backward_weight(self, wctx):
        fc_w, proj_w = wctx
        self.proj.backward_weight(proj_w)
        self.fc.backward_weight(fc_w)


def _norm_forward(norm, x):
    """A block's norm slot: (norm(x), its ctx), or (x, None) where the slot is empty."""
    return (x, None) if norm is None else norm.forward(x)


def _norm_backward(norm, dy, ctx):
    return dy if norm is None else norm.backward_input(dy, ctx)[0]


class Block(Layer):
    """Residual Transformer block with a norm slot before and after each sub-layer:
        x1 = x + post1(attn(ln1(x))), then x1 + post2(mlp(ln2(x1))),
    an empty slot (None) being the identity. GPT's (and Llama's) is pre-norm: ln1 and ln2,
    no post norms. The Llama family's other wirings fill other slots (engine/model/llama.py
    LlamaBlock: OLMo 2's norms only after, Gemma 3's before and after).
    Under sequence parallelism x, the norms and the residual adds are this
    rank's T/tp positions; attention and MLP gather the sequence and scatter it back.

    A block is what activation recomputation works on (set_recompute; LayerChain's
    set_recompute calls it): its forward never writes into its input x (the residual
    adds make new arrays), so a chain may keep x alone and run forward again in backward."""

    def __init__(self, name, c, n_head, n_layer, maker=WHOLE):
        self.name = name
        self.ln1 = LayerNorm(f"{name}.ln1", c, partial=maker.sequence_parallel)
        self.attn = CausalSelfAttention(f"{name}.attn", c, n_head, n_layer, maker=maker)
        self.ln2 = LayerNorm(f"{name}.ln2", c, partial=maker.sequence_parallel)
        self.mlp = MLP(f"{name}.mlp", c, n_layer, maker=maker)
        self.parts = [self.ln1, self.attn, self.ln2, self.mlp]

    post1 = post2 = None          # the norms after attention and after the MLP: none (pre-norm)

    def specs(self):
        return [s for part in self.parts for s in part.specs()]

    def bind(self, params):
        for part in self.parts:
            part.bind(params)

    def set_recompute(self, mode):
        """none | full | selective (engine/model/chain.py LayerChain.set_recompute). Selective
        is this block's own: its attention forgets the probabilities (B, H, T, T) and its
        backward recomputes them; full is the chain's (it keeps only the input), and the
        forward it runs again in backward keeps everything, as without recomputation."""
        self.attn.keep_probs = mode != "selective"

    def forward(self, x):
        # x (B, T, C)
        a_in, ln1_ctx = _norm_forward(self.ln1, x)
        a, attn_ctx = self.attn.forward(a_in)
        a, post1_ctx = _norm_forward(self.post1, a)
        x1 = x + a
        m_in, ln2_ctx = _norm_forward(self.ln2, x1)
        m, mlp_ctx = self.mlp.forward(m_in)
        m, post2_ctx = _norm_forward(self.post2, m)
        return x1 + m, (ln1_ctx, attn_ctx, ln2_ctx, mlp_ctx, post1_ctx, post2_ctx)

    def decode(self, x, cache, start):
        # x (B, T, C) of positions start..start+T-1; cache: this block's KVCache
        a = self.attn.decode(_norm_forward(self.ln1, x)[0], cache, start)
        x1 = x + _norm_forward(self.post1, a)[0]
        m = self.mlp.forward(_norm_forward(self.ln2, x1)[0])[0]
        return x1 + _norm_forward(self.post2, m)[0]

    def backward_input(self, dx2, ctx):
        ln1_ctx, attn_ctx, ln2_ctx, mlp_ctx, post1_ctx, post2_ctx = ctx
        dm, mlp_w = self.mlp.backward_input(_norm_backward(self.post2, dx2, post2_ctx), mlp_ctx)
        dx1 = _norm_backward(self.ln2, dm, ln2_ctx)      # a new array: the MLP's or the norm's
        dx1 += dx2                                        # residual
        da, attn_w = self.attn.backward_input(_norm_backward(self.post1, dx1, post1_ctx), attn_ctx)
        dx = _norm_backward(self.ln1, da, ln1_ctx)
        dx += dx1                                         # residual
        return dx, (attn_w, mlp_w)

    def backward_weight(self, wctx):
        attn_w, mlp_w = wctx
        self.mlp.backward_weight(mlp_w)
        self.attn.backward_weight(attn_w)


class KVCache:
    """One attention layer's keys and values of the positions decoded so far (sampling,
    LayerChain.decode): (B, heads, capacity, hd) buffers, allocated at the first append
    and filled from position 0 on. A grouped-query layer stores its key/value heads
    once, not once per query head."""

    def __init__(self, capacity):
        self.capacity, self.k, self.v = capacity, None, None

    def append(self, k, v, start):
        """k, v (B, heads, T, hd) of positions start..start+T-1 -> the keys and values of
        every position so far, (B, heads, start+T, hd) views of the buffers."""
        B, heads, T, hd = k.shape
        if start + T > self.capacity:
            raise ValueError(f"positions up to {start + T} exceed the KV cache's capacity {self.capacity}")
        if self.k is None:
            xp = K.get_array_module(k)
            self.k = xp.empty((B, heads, self.capacity, hd), dtype=k.dtype)
            self.v = xp.empty_like(self.k)
        self.k[:, :, start:start + T] = k
        self.v[:, :, start:start + T] = v
        return self.k[:, :, :start + T], self.v[:, :, :start + T]


def causal_attention_probs(q, k, scale, bits=False, window=0):
    """softmax(scale q k^T, causal): q, k (B, H, T, hd) -> (B, H, T, T). The one place they
    are computed, for the forward and for a backward whose forward did not keep them
    (selective recomputation): the same kernels calls on the same q and k, the same bits.
    bits=True: (att, att's bf16 bits from the same pass under bf16 on the CPU, else None).
    window > 0: a sliding window, query t sees keys t - window < j <= t (0 elsewhere)."""
    att = K.matmul_nt(q, k)                                             # (B, H, T, T)
    if not bits:
        return K.softmax_causal_forward(att, scale, out=att, window=window)
    att_bits = BF16.bits_out(att)    # under bf16 the softmax writes att's bits too, for att @ v
    return K.softmax_causal_forward(att, scale, out=att, bf16_out=att_bits, window=window), att_bits


def causal_attention(q, k, v, scale, window=0):
    """softmax(scale q k^T, causal) v over whole sequences: q, k, v (B, H, T, hd) ->
    (y (B, T, H*hd), heads merged for the output projection; att (B, H, T, T), kept for
    the backward unless the caller recomputes it). GPT's and the Llama family's attention
    share it. window > 0: a sliding window (causal_attention_probs)."""
    xp = K.get_array_module(q)
    B, H, T, hd = q.shape
    att, att_bits = causal_attention_probs(q, k, scale, bits=True, window=window)   # (B, H, T, T)
    y = K.matmul(att if att_bits is None else att_bits, v)              # (B, H, T, hd)
    return xp.ascontiguousarray(y.transpose(0, 2, 1, 3)).reshape(B, T, H * hd), att


def causal_attention_backward(dy, q, k, v, att, scale, dq=None, dk=None, dv=None, window=0):
    """causal_attention's backward: dy (B, T, H*hd), the merged heads' gradient -> (dq, dk,
    dv) (B, H, T, hd) each, written into the given arrays when there are some (GPT's fused
    qkv gradient takes them in one buffer). att None: the forward did not keep the
    probabilities (selective recomputation); they are computed again here (with the forward's
    window), and dropped after. The softmax's backward needs no window: att is 0 outside it."""
    xp = K.get_array_module(dy)
    B, H, T, hd = q.shape
    att_bits = None                  # kept probabilities: dv's GEMM rounds them
    if att is None:
        att, att_bits = causal_attention_probs(q, k, scale, bits=True, window=window)
    dy = xp.ascontiguousarray(dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3))  # (B, H, T, hd)
    dy = BF16.of(dy)                 # read by two GEMMs: rounded once under bf16 (BF16)
    dv = K.matmul_tn(att if att_bits is None else att_bits, dy, out=dv)      # dv = att^T dy
    datt = K.matmul_nt(dy, v)                                           # (B, H, T, T)
    datt_bits = BF16.bits_out(datt)  # under bf16: only datt's bits, for its two GEMMs
    datt = K.softmax_causal_backward(datt, att, scale, out=None if datt_bits is not None else datt,
                                     bf16_out=datt_bits)
    dq = K.matmul(datt, k, out=dq)                                      # dq = datt k
    dk = K.matmul_tn(datt, q, out=dk)                                   # dk = datt^T q
    return dq, dk, dv


def attend_cached(q, k, v, start, scale, window=0):
    """Causal attention of T new queries to every key so far: q (B, H, T, hd) at positions
    start..start+T-1; k, v (B, Hkv, S, hd) at positions 0..S-1, S = start + T. Query head h
    reads key/value head h // G, G = H / Hkv (transformers' repeat_kv; G = 1: multi-head).
    Returns y (B, H, T, hd). The same softmax(scale q k^T) v as the forward's kernels, written
    with plain array operations: the scores are (T, S), not the square the fused kernel takes.
    window > 0: a key window or more positions before its query is not seen (sliding window)."""
    xp = K.get_array_module(q)
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    # The G query heads of one key/value head are rows of one product: keys are not repeated.
    att = K.matmul_nt(q.reshape(B, Hkv, G * T, hd), k) * scale          # (B, Hkv, G*T, S)
    att = att.reshape(B, Hkv, G, T, S)
    future = xp.arange(S)[None, :] > start + xp.arange(T)[:, None]      # (T, S): a key after its query
    if window:                                                          # or out of the window before it
        future |= xp.arange(S)[None, :] <= start + xp.arange(T)[:, None] - window
    att = xp.where(future, -xp.inf, att)
    att = xp.exp(att - att.max(axis=-1, keepdims=True))                  # the own position is never masked
    att /= att.sum(axis=-1, keepdims=True)
    y = K.matmul(att.reshape(B, Hkv, G * T, S), v)                       # (B, Hkv, G*T, hd)
    return y.reshape(B, H, T, hd)


class Embedding(Layer):
    """Token + position embedding: tokens (B, T) int -> (B, T, C).
    (engine/parallel/tensor.py VocabParallelEmbedding: the token table split by rows.)"""

    def __init__(self, vocab, context, c, wte="wte", wpe="wpe"):
        self.vocab, self.context, self.c, self.wte_name, self.wpe_name = vocab, context, c, wte, wpe

    def specs(self):
        return [ParamSpec(self.wte_name, (self.vocab, self.c)), self.wpe_spec()]

    def wpe_spec(self):
        return ParamSpec(self.wpe_name, (self.context, self.c), std=0.01)

    def bind(self, params):
        self.wte, self.dwte = params.view(self.wte_name), params.grad_view(self.wte_name)
        self.wpe, self.dwpe = params.view(self.wpe_name), params.grad_view(self.wpe_name)

    def check_length(self, T):
        if T > self.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.context}")

    def forward(self, tokens):
        self.check_length(tokens.shape[1])
        return self.wte[tokens] + self.wpe[:tokens.shape[1]], tokens

    def decode(self, tokens, cache, start):
        # tokens (B, T) at positions start..start+T-1 -> (B, T, C)
        self.check_length(start + tokens.shape[1])
        return self.wte[tokens] + self.wpe[start:start + tokens.shape[1]]

    def backward_input(self, dout, ctx):
        tokens = ctx
        B, T = tokens.shape
        self.dwpe[:T] += dout.sum(axis=0)
        scatter_add_rows(self.dwte, tokens.reshape(-1), dout.reshape(B * T, self.c))
        return None, None


def scatter_add_rows(target, rows, values):
    # target[rows[i]] += values[i], with repeated rows adding up (fancy-index += would not).
    if K.get_array_module(target) is np:
        np.add.at(target, rows, values)
    else:
        import cupyx
        cupyx.scatter_add(target, rows, values)


class LMHead(Layer):
    """Final LayerNorm, logits against the (tied) token embedding, fused softmax cross-entropy.

    forward computes the loss *and* the logits' gradient in one pass (the fused
    kernel writes dlogits over the logits), so backward is two GEMMs.
    `vocab` is the embedding's (padded) row count, `used` the tokenizer's: the
    logits of the padding rows are pushed to -1e9 before the softmax, so they get
    no probability (and their rows of wte no gradient).
    (engine/parallel/tensor.py VocabParallelHead: this rank's rows of wte, its logits.)
    """

    PAD_LOGIT = -1e9      # exp() of it, minus any real logit, is 0 in float32 and float64
    # softcap (Gemma 2's final_logit_softcapping): logits = cap tanh(logits / cap), before the padding
    # rows' mask; the gradient through it is (1 - tanh^2) times the capped logits' gradient.
    softcap = None

    def __init__(self, vocab, c, wte="wte", used=None):
        self.vocab, self.c, self.wte_name = vocab, c, wte
        self.used = vocab if used is None else used
        self.ln_f = LayerNorm("ln_f", c)

    def specs(self):
        # wte is declared again: tied to the embedding when both are in one stage
        # (ParamBuffer dedups by name), a synchronized copy when they are not.
        return self.ln_f.specs() + [ParamSpec(self.wte_name, (self.vocab, self.c))]

    def bind(self, params):
        self.ln_f.bind(params)
        self.wte, self.dwte = params.view(self.wte_name), params.grad_view(self.wte_name)

    def logits(self, h2, lo=0, slopes=None):
        """(N, rows of wte here) logits; columns of padding rows (vocabulary ids from
        `used` on, this rank's rows starting at id lo) masked. Under a softcap the logits are
        capped first, and `slopes`, a list, gets the cap's derivative (1 - tanh^2) for the
        backward (capped_slope)."""
        logits = K.matmul_nt(h2, BF16.weight(self.wte))
        if self.softcap:
            xp = K.get_array_module(logits)
            xp.tanh(logits / logits.dtype.type(self.softcap), out=logits)
            if slopes is not None:
                slopes.append(1 - logits * logits)
            logits *= logits.dtype.type(self.softcap)
        if self.used < lo + logits.shape[1]:
            logits[:, max(0, self.used - lo):] = self.PAD_LOGIT
        return logits

    @staticmethod
    def capped_slope(dlogits, slopes):
        """The capped logits' gradient made the raw logits' (a softcap's chain rule), in place."""
        if slopes and dlogits is not None:
            dlogits *= slopes[0]
        return dlogits

    def forward(self, x, targets=None, grad_scale=1.0, need_grad=True):
        """x (B, T, C), targets (B, T). Returns (loss_sum, ctx); without targets returns logits (B, T, V)."""
        h, ln_ctx = self.ln_f.forward(x)
        B, T, C = h.shape
        h2 = BF16.of(h.reshape(B * T, C))                     # kept for dW: bf16 under bf16 (BF16)
        if targets is not None and need_grad and h2.dtype == np.uint16:
            loss_sum, dlogits = self.loss_and_bf16_grad(h2, targets.reshape(-1), grad_scale)
            return loss_sum, (ln_ctx, h2, dlogits, (B, T, C))
        slopes = [] if targets is not None and need_grad else None
        logits = self.logits(h2, slopes=slopes)               # (N, V)
        if targets is None:
            return logits.reshape(B, T, self.vocab), None
        losses, dlogits = K.cross_entropy_forward_backward(
            logits, targets.reshape(-1), dlogits=logits if need_grad else None, grad_scale=grad_scale)
        return float(losses.sum()), (ln_ctx, h2, self.capped_slope(dlogits, slopes), (B, T, C))

    BF16_BLOCK_BYTES = 32 << 20          # float32 logits of one block of rows (loss_and_bf16_grad)

    def loss_and_bf16_grad(self, h2, targets, grad_scale):
        """forward's loss and logits' gradient under bf16 (h2 bf16 bits): the logits a block of
        rows at a time, each block's gradient rounded to bf16 (what both backward GEMMs read)
        into one (N, V) bf16 array. The float32 logits, the head's largest array, are never
        whole: the step's peak memory drops by about N x V x 2 bytes instead of rising by the
        bf16 copy. Each row's logits and gradient are its own, so the numbers are the same."""
        N = h2.shape[0]
        rows = max(1, self.BF16_BLOCK_BYTES // (4 * self.vocab))
        losses = np.empty(N, np.float32)
        dlogits = np.empty((N, self.vocab), np.uint16)
        for lo in range(0, N, rows):
            hi = min(N, lo + rows)
            slopes = []
            logits = self.logits(h2[lo:hi], slopes=slopes)    # (rows, V) float32
            losses[lo:hi], _ = K.cross_entropy_forward_backward(logits, targets[lo:hi], dlogits=logits,
                                                                grad_scale=grad_scale)
            K.to_bf16(self.capped_slope(logits, slopes), out=dlogits[lo:hi])
        return float(losses.sum()), dlogits

    def decode(self, x, cache, start):
        """x (B, T, C) -> the logits (B, V) of the last position only: the one sampled from."""
        h, _ = self.ln_f.forward(x[:, -1:])                      # (B, 1, C)
        return self.logits(h.reshape(x.shape[0], self.c))

    def backward_input(self, dloss, ctx):
        # dloss is unused: the gradient scale was applied in forward.
        ln_ctx, h2, dlogits, shape = ctx
        dlogits = BF16.of(dlogits)                            # read by dh and dW: rounded once under bf16
        dh = K.matmul(dlogits, BF16.weight(self.wte)).reshape(shape)   # (N, C)
        dx, _ = self.ln_f.backward_input(dh, ln_ctx)
        return dx, (h2, dlogits)

    def backward_weight(self, wctx):
        h2, dlogits = wctx
        K.matmul_tn(dlogits, h2, out=self.dwte, accumulate=True)   # (V, C) += dlogits^T h


class DenseGELU(Layer):
    """Linear followed by GELU (one fused Linear): the hidden layer of the MLP classifier."""

    def __init__(self, name, c_in, c_out):
        self.fc = Linear(name, c_in, c_out, std=math.sqrt(2.0 / c_in) * 0.5, gelu=True)

    def specs(self):
        return self.fc.specs()

    def bind(self, params):
        self.fc.bind(params)

    def forward(self, x):
        return self.fc.forward(x)

    def backward_input(self, dy, ctx):
        return self.fc.backward_input(dy, ctx)

    def backward_weight(self, wctx):
        self.fc.backward_weight(wctx)


class ClassifierHead(Layer):
    """Linear to class logits plus fused softmax cross-entropy: x (B, C) -> loss.

    `confusion`: None, or a host int64 array (n_classes, n_classes) that every forward with
    targets adds its rows to (confusion_counts): validation sets it (engine/train/evaluation.py)
    and sums it over the ranks, so the layer itself never communicates."""

    confusion = None

    def __init__(self, name, c_in, n_classes):
        self.n_classes = n_classes
        self.fc = Linear(name, c_in, n_classes, std=math.sqrt(1.0 / c_in))

    def specs(self):
        return self.fc.specs()

    def bind(self, params):
        self.fc.bind(params)

    def forward(self, x, targets=None, grad_scale=1.0, need_grad=True):
        logits, fc_ctx = self.fc.forward(x)
        if targets is None:
            return logits, None
        if self.confusion is not None:
            # Before the cross-entropy: with need_grad it overwrites the logits with their gradient.
            self.confusion += confusion_counts(logits, targets, self.n_classes)
        dlogits = logits if need_grad else None
        losses, dlogits = K.cross_entropy_forward_backward(
            logits, targets.reshape(-1), dlogits=dlogits, grad_scale=grad_scale)
        return float(losses.sum()), (fc_ctx, dlogits)

    def backward_input(self, dloss, ctx):
        fc_ctx, dlogits = ctx
        return self.fc.backward_input(dlogits, fc_ctx)

    def backward_weight(self, wctx):
        self.fc.backward_weight(wctx)


def confusion_counts(logits, targets, n_classes):
    """(n_classes, n_classes) int64 host counts of the rows of `logits` (B, n_classes):
    row = true class (targets), column = predicted class, the argmax of the row's logits
    (on a tie the lowest class, as numpy's argmax). numpy or cupy arrays alike."""
    xp = K.get_array_module(logits)
    predicted = logits.argmax(axis=1)
    pairs = targets.reshape(-1).astype(predicted.dtype) * n_classes + predicted
    counts = xp.bincount(pairs, minlength=n_classes * n_classes)
    return np.asarray(to_host(counts), dtype=np.int64).reshape(n_classes, n_classes)
