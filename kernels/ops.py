"""
The kernel op table: the one list of the ops kernels/ provides.

Each Op names an op, says what it computes, and gives the arguments every backend's
implementation takes. Those are the public function's (kernels/__init__.py), minus
`backend=`, after the boundary has done its work: inputs validated and made
C-contiguous (matmul's and linear_forward's a, b, x, w may still be strided views),
and `precision` resolved to "float32" or "bf16" (never None).

Backends (kernels/backend.py) register against this table by op name. A module that
implements an op defines a top-level function with the op's name whose arguments
start with `args` exactly (names, order, defaults, keyword-only marker); it may add
keyword arguments of its own after them, each with a default (e.g. the Numba CUDA
kernels' `block=`), which the public API never passes.

matmul_nt and matmul_tn are not ops: they are kernels.matmul with a transpose flag
set, and exist only as public functions.

Only the standard library is imported here: `from ringpipe import kernels` reads this
on every start.
"""

import inspect
from typing import NamedTuple


class Op(NamedTuple):
    name: str
    args: str  # the implementation's parameter list, as inspect.signature prints it
    computes: str

    @property
    def arg_names(self):
        return tuple(a.split("=")[0] for a in self.args.split(", ") if a != "*")


OPS = (
    Op("matmul", "a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision='float32'",
       "out (+)= op(a) @ op(b), op a transpose of the last two dims if trans_*; leading dims broadcast; "
       "bf16: float32 operands rounded to bfloat16, float32 accumulation"),
    Op("linear_forward", "x, w, bias=None, *, gelu=False, precision='float32'",
       "(y, pre): y = x @ w.T (+ bias), then GELU if gelu; pre is the pre-activation if gelu, else None"),
    Op("column_sum", "x, out=None, *, accumulate=False",
       "out (+)= x (N, C) summed over rows: a bias gradient"),
    Op("layernorm_forward", "x, weight, bias, eps=1e-05, out=None",
       "(out, mean, rstd) of layernorm over the last dim of x (N, C)"),
    Op("layernorm_backward", "dout, x, weight, mean, rstd, dx=None, dweight=None, dbias=None",
       "dx (overwritten); dweight, dbias accumulated into (+=) when given"),
    Op("gelu_forward", "x, out=None",
       "GELU, tanh approximation, elementwise"),
    Op("gelu_backward", "dout, x, dx=None",
       "dx = gelu'(x) * dout; dx may alias dout"),
    Op("softmax_causal_forward", "scores, scale, out=None, *, bf16_out=None, window=0",
       "probs = softmax over j <= t of scale*scores (..., T, T), 0 above the diagonal (window > 0: over "
       "t - window < j <= t, 0 before); out may be scores; bf16_out (uint16) also gets probs' bf16 bits"),
    Op("softmax_causal_backward", "dprobs, probs, scale, out=None, *, bf16_out=None",
       "dscores = scale * probs * (dprobs - sum_j dprobs*probs), 0 above the diagonal; out may be dprobs; "
       "bf16_out (uint16, out None) gets dscores' bf16 bits instead and is returned"),
    Op("cross_entropy_forward_backward", "logits, targets, dlogits=None, grad_scale=1.0",
       "(losses, dlogits): -log softmax(logits)[target] per row; dlogits (may be logits) overwritten with "
       "(softmax - onehot) * grad_scale, or None"),
    Op("adamw_update", "param, grad, m, v, *, lr, beta1, beta2, eps, weight_decay, step, wd_mask=None",
       "one AdamW step in place on flat arrays (decoupled weight decay, 1-based step)"),
    Op("sgd_momentum_update", "param, grad, buf, *, lr, momentum, weight_decay=0.0, wd_mask=None",
       "one SGD-with-momentum step in place (PyTorch convention, no dampening)"),
    Op("sum_of_squares", "x",
       "sum(x**2) as a python float, accumulated in float64"),
    Op("rmsnorm_forward", "x, w, eps=1e-05",
       "(y, rstd): y = x * rstd * w over the last dim of x (..., C), rstd = 1/sqrt(mean(x^2) + eps) (...,)"),
    Op("rmsnorm_backward", "dy, x, w, rstd",
       "(dx, dw): dx new (..., C); dw (C,) new, summed over every row"),
    Op("rope_forward", "x, cos, sin",
       "y = x * cos + rotate_half(x) * sin, x (B, T, H, hd), cos/sin (T, hd), rotate_half(x) = cat(-x2, x1)"),
    Op("rope_backward", "dy, cos, sin",
       "dx = dy * cos - rotate_half(dy * sin): the transpose of rope_forward"),
    Op("swiglu_forward", "gate, up",
       "h = silu(gate) * up, elementwise"),
    Op("swiglu_backward", "dh, gate, up",
       "(dgate, dup) of h = silu(gate) * up, both new"),
)

OP_NAMES = tuple(op.name for op in OPS)
BY_NAME = {op.name: op for op in OPS}


def signature_problem(op, fn):
    """None if fn takes op's arguments (plus optional extras with defaults), else what is wrong."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # not introspectable (e.g. some builtins)
        return f"{op.name}: cannot read the signature of {fn!r}"
    n = len(op.arg_names)
    head = str(inspect.Signature(params[:n]))[1:-1]
    if head != op.args:
        return f"{op.name}({head}) does not take the table's arguments ({op.args})"
    extra = [p.name for p in params[n:] if p.default is p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if extra:
        return f"{op.name}: arguments beyond the table's must be keywords with defaults: {', '.join(extra)}"
    return None
