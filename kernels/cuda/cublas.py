"""
The "cublas" backend: the GEMM ops through cuBLAS (cupy.matmul), for cupy arrays.

The yardstick for the hand-written SGEMM in a training run (backend="cublas" or
kernels.set_backend("cublas")): only matmul and linear_forward are here, every other
op runs on "cuda" (kernels.cuda.register() registers it with that fallback).

Importing this module imports cupy (through cupy_kernels' GELU).
"""

from ringpipe.kernels import reference as _ref

from .cupy_kernels import gelu_forward as _gelu_forward


def matmul(a, b, out=None, *, trans_a=False, trans_b=False, accumulate=False, precision="float32"):
    # xp.matmul on cupy arrays = cuBLAS; bf16 = cuBLAS's float32 GEMM on bf16-rounded inputs
    return _ref.matmul(a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, precision=precision)


def linear_forward(x, w, bias=None, *, gelu=False, precision="float32"):
    # unfused: the cuBLAS GEMM, then bias and our GELU kernel
    return _ref.bias_gelu(matmul(x, w, trans_b=True, precision=precision), bias, gelu, _gelu_forward)
