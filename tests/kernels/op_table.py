"""The test table of the kernel op table: one small call of each op of kernels/ops.py.

Each row builds the arguments of one call (host arrays, in the dtype asked for); `outputs`
makes that call through the public API (kernels.<op>) on the arrays of one backend and
returns what it gives and what it writes: the results, then every array argument after
the call (the ops that update in place, optimizers and accumulators, are checked on those).
The same row run on the reference ("numpy", host arrays) and on any other backend must agree:
tests/kernels/test_cuda_kernels.py runs it for every GPU backend ("cuda", the production
path, "cublas" and "numba_cuda"), so both GPU kernel sets answer to one table, and a new op
without a row fails there.
"""
import numpy as np


def _n(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _layernorm_backward(rng, dtype):
    from ringpipe.kernels import reference as ref
    x, weight = _n(rng, (5, 7), dtype), _n(rng, (7,), dtype)
    _, mean, rstd = ref.layernorm_forward(x, weight, _n(rng, (7,), dtype))
    return (_n(rng, (5, 7), dtype), x, weight, mean, rstd), dict(dweight=_n(rng, (7,), dtype),
                                                                  dbias=_n(rng, (7,), dtype))


def _softmax_backward(rng, dtype):
    from ringpipe.kernels import reference as ref
    probs = ref.softmax_causal_forward(_n(rng, (2, 1, 5, 5), dtype), 0.5)
    return (_n(rng, (2, 1, 5, 5), dtype), probs, 0.5), {}


def _rmsnorm_backward(rng, dtype):
    from ringpipe.kernels import reference as ref
    x, w = _n(rng, (2, 3, 37), dtype), _n(rng, (37,), dtype)
    _, rstd = ref.rmsnorm_forward(x, w, 1e-6)
    return (_n(rng, (2, 3, 37), dtype), x, w, rstd), {}


def _rope_tables(T, hd, dtype):
    from ringpipe.kernels import rope_tables
    return rope_tables(T, hd, 10000.0, dtype=dtype)


def _update(rng, dtype, *state):
    return tuple(_n(rng, (37,), dtype) for _ in range(2 + len(state)))


CASES = {
    "matmul": lambda rng, dt: ((_n(rng, (6, 9), dt), _n(rng, (5, 9), dt)), dict(trans_b=True)),
    "linear_forward": lambda rng, dt: ((_n(rng, (6, 8), dt), _n(rng, (4, 8), dt), _n(rng, (4,), dt)),
                                       dict(gelu=True)),
    "column_sum": lambda rng, dt: ((_n(rng, (9, 5), dt),), dict(out=_n(rng, (5,), dt), accumulate=True)),
    "layernorm_forward": lambda rng, dt: ((_n(rng, (5, 7), dt), _n(rng, (7,), dt), _n(rng, (7,), dt)), {}),
    "layernorm_backward": _layernorm_backward,
    "gelu_forward": lambda rng, dt: ((_n(rng, (4, 6), dt, 2.0),), {}),
    "gelu_backward": lambda rng, dt: ((_n(rng, (4, 6), dt), _n(rng, (4, 6), dt, 2.0)), {}),
    "softmax_causal_forward": lambda rng, dt: ((_n(rng, (2, 1, 5, 5), dt), 0.5), {}),
    "softmax_causal_backward": _softmax_backward,
    "cross_entropy_forward_backward": lambda rng, dt: ((_n(rng, (6, 11), dt), rng.integers(0, 11, 6)),
                                                       dict(dlogits=np.zeros((6, 11), dt), grad_scale=0.25)),
    "adamw_update": lambda rng, dt: (_update(rng, dt, "m", "v")[:2] + (np.zeros(37, dt), np.ones(37, dt)),
                                     dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3,
                                          wd_mask=(np.arange(37) % 3 > 0).astype(dt))),
    "sgd_momentum_update": lambda rng, dt: (_update(rng, dt, "buf"),
                                            dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sum_of_squares": lambda rng, dt: ((_n(rng, (37,), dt),), {}),
    "rmsnorm_forward": lambda rng, dt: ((_n(rng, (2, 3, 37), dt), _n(rng, (37,), dt), 1e-6), {}),
    "rmsnorm_backward": _rmsnorm_backward,
    "rope_forward": lambda rng, dt: ((_n(rng, (2, 5, 3, 6), dt),) + _rope_tables(5, 6, dt), {}),
    "rope_backward": lambda rng, dt: ((_n(rng, (2, 5, 3, 6), dt),) + _rope_tables(5, 6, dt), {}),
    "swiglu_forward": lambda rng, dt: ((_n(rng, (4, 37), dt, 3.0), _n(rng, (4, 37), dt)), {}),
    "swiglu_backward": lambda rng, dt: ((_n(rng, (4, 37), dt), _n(rng, (4, 37), dt, 3.0), _n(rng, (4, 37), dt)), {}),
}


def outputs(kernels, op, args, kwargs, backend, to_device, to_host):
    """[host arrays]: what kernels.<op>(*args, **kwargs, backend=backend) returns, then every
    array argument after the call; the arguments are copied onto the device first."""
    args = [to_device(np.array(a)) if isinstance(a, np.ndarray) else a for a in args]
    kwargs = {k: to_device(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    result = getattr(kernels, op)(*args, **kwargs, backend=backend)
    results = list(result) if isinstance(result, tuple) else [result]
    written = [a for a in args if not isinstance(a, (int, float))] + \
        [v for v in kwargs.values() if not isinstance(v, (int, float, bool))]
    return [np.asarray(to_host(r) if not isinstance(r, (int, float)) else r, dtype=np.float64)
            for r in results + written if r is not None]
