"""subnet_linear: the linear layer of one subnetwork of neurons (IST, paper 001 §3.1).

y = x W[rows][:, cols]^T + b[rows]; the backward gives grad_x for the compact x and full-size
grad_weight / grad_bias that are zero outside the selected rows x cols. Fake kernels and the CUDA
registration here; argument checks in :mod:`._checks`; autograd in csrc/autograd.cpp; CPU kernels in
csrc/cpu/subnet.cpp; CUDA: a compact gather + cuBLAS (:mod:`._aten`); the Triton gathered-load GEMMs
(:mod:`._triton`) are the alternative kernel.
"""
import torch

from .._checks import check, check_index_list, check_output_mask, check_same_device, check_type  # noqa: F401
from .._cuda import HAS_TRITON, register_composition
from . import _aten
from ._checks import CPU_DTYPES, TRITON_DTYPES, check_grad_out, check_subnet  # noqa: F401  (re-exported)


@torch.library.register_fake("ist_kernels::subnet_linear")
def _subnet_linear_fake(x, weight, bias, rows, cols):
    Nr, _ = check_subnet("subnet_linear", x, weight, bias, rows, cols)
    return x.new_empty((*x.shape[:-1], Nr))


@torch.library.register_fake("ist_kernels::subnet_linear_backward")
def _subnet_linear_backward_fake(grad_out, x, weight, rows, cols, output_mask):
    op = "subnet_linear_backward"
    Nr, _ = check_subnet(op, x, weight, None, rows, cols)
    check_grad_out(op, grad_out, x, weight, Nr)
    check_output_mask(op, output_mask)
    grad_x = x.new_empty(x.shape) if output_mask[0] else weight.new_empty((0,))
    grad_weight = weight.new_empty(weight.shape) if output_mask[1] else weight.new_empty((0,))
    grad_bias = weight.new_empty((weight.shape[0],)) if output_mask[2] else weight.new_empty((0,))
    return grad_x, grad_weight, grad_bias


# autograd: in C++ (csrc/autograd.cpp), on the Autograd key, through subnet_linear_backward.


# CUDA: gather the compact weight once, then cuBLAS GEMMs (ops/subnet/_aten.py explains why this
# beats the in-kernel gather of ops/subnet/_triton.py, which stays as the Triton variant).
register_composition("ist_kernels::subnet_linear", _aten.subnet_linear)
register_composition("ist_kernels::subnet_linear_backward", _aten.subnet_linear_backward)

# The Triton variant (ops/subnet/_triton.py; tested and benchmarked, not registered). Its
# launchers check everything and read the index lists through their strides, so these are the
# launchers themselves (kept under these names for the tests and benchmarks).
if HAS_TRITON:
    from . import _triton
else:  # pragma: no cover (no triton)
    _triton = None


def triton_subnet_linear(x, weight, bias=None, rows=None, cols=None):
    """subnet_linear on the Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    return _triton.subnet_linear(x, weight, bias, rows, cols)


def triton_subnet_linear_backward(grad_out, x, weight, rows=None, cols=None, output_mask=(True, True, True)):
    """subnet_linear_backward on the Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    return _triton.subnet_linear_backward(grad_out, x, weight, rows, cols, output_mask)
