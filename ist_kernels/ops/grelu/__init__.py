"""relu_gates / gated_linear / gated_linear_backward (GReLU, paper 004 §2.1, §4.4): fake kernels
and the choice of CUDA backend: the Triton kernels (:mod:`._triton`), or without triton the ATen
composition (:mod:`._aten`; see ops/_cuda.py). Argument checks: :mod:`._checks`. The CPU backend is
csrc/cpu/grelu.cpp; autocast, csrc/autocast.cpp; autograd, csrc/autograd.cpp.

Gradients (csrc/autograd.cpp):
* gated_linear: x, weight and bias, through the gated_linear_backward op (g' = g ⊙ G applied
  inside its kernels).
* relu_gates: none. It is the frozen gate network (C, Ψ_k); its outputs are constants of the
  trained network. Its autograd formula raises if a gradient ever has to flow through it, instead of
  silently returning zeros: detach the inputs, or make them buffers, as GReLU does.
"""
import torch

from .._checks import gate_words
from .._cuda import HAS_TRITON, register_composition, register_triton, warn_no_triton
from ._checks import check_gated_linear_backward, check_grelu_gates, check_grelu_linear

_ops = torch.ops.ist_kernels


# ---- fake kernels (shapes and checks for torch.compile / opcheck)
@torch.library.register_fake("ist_kernels::relu_gates")
def _relu_gates_fake(x, weight, bias):
    check_grelu_linear("relu_gates", x, weight, bias)
    lead = x.shape[:-1]
    N = weight.shape[0]
    return x.new_empty((*lead, N)), x.new_empty((*lead, gate_words(N)), dtype=torch.int32)


@torch.library.register_fake("ist_kernels::gated_linear")
def _gated_linear_fake(x, weight, bias, gates):
    check_grelu_linear("gated_linear", x, weight, bias)
    check_grelu_gates("gated_linear", gates, x, weight.shape[0])
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ist_kernels::gated_linear_backward")
def _gated_linear_backward_fake(grad_out, x, weight, gates, output_mask):
    N = check_gated_linear_backward(grad_out, x, weight, gates, output_mask)
    return (x.new_empty(x.shape if output_mask[0] else (0,)),
            x.new_empty(weight.shape if output_mask[1] else (0,)),
            x.new_empty((N,) if output_mask[2] else (0,)))


# ---- autograd: in C++ (csrc/autograd.cpp), on the Autograd key: a Python autograd.Function here
# cost more host time than the CPU kernel itself on small inputs (bench/bench_overhead.py).


# ---- CUDA backend: the Triton kernels, traceable by torch.compile where torch allows (ops/_cuda.py);
# without triton, the ATen composition of ops/grelu/_aten.py.
_OPS = ("relu_gates", "gated_linear", "gated_linear_backward")
if HAS_TRITON:
    from . import _triton as _triton_grelu

    for _name in _OPS:
        register_triton(f"ist_kernels::{_name}", getattr(_triton_grelu, _name), _triton_grelu.TRITON_KERNELS)
else:
    from . import _aten as _aten_grelu

    warn_no_triton(_OPS, "cuBLAS GEMMs with separate gate passes")
    for _name in _OPS:
        register_composition(f"ist_kernels::{_name}", getattr(_aten_grelu, _name))
