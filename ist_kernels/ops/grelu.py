"""relu_gates / gated_linear / gated_linear_backward (GReLU, paper 004 §2.1, §4.4): fake kernels,
autograd, and the CUDA backend: the Triton kernels (an ATen composition without triton; see
ops/_cuda.py). The CPU backend is csrc/cpu/grelu.cpp; autocast, csrc/autocast.cpp.

Gradients:
* gated_linear: x, weight and bias, through the gated_linear_backward op (g' = g ⊙ G applied
  inside its kernels).
* relu_gates: none. It is the frozen gate network (C, Ψ_k); its outputs are constants of the
  trained network. Its autograd formula raises if a gradient ever has to flow through it, instead of
  silently returning zeros: detach the inputs, or make them buffers, as GReLU does.
"""
import torch

from ._checks import check_gated_linear_backward, check_grelu_gates, check_grelu_linear, gate_words
from ._cuda import HAS_TRITON, register_composition, register_triton, warn_no_triton

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


# ---- autograd
def _gated_linear_setup(ctx, inputs, output):
    x, weight, bias, gates = inputs
    ctx.save_for_backward(x, weight, gates)
    ctx.has_bias = bias is not None


def _gated_linear_grad(ctx, grad):
    x, weight, gates = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and ctx.has_bias
    dx, dw, db = _ops.gated_linear_backward(grad, x, weight, gates, [need_x, need_w, need_b])
    return (dx if need_x else None, dw if need_w else None, db if need_b else None, None)


torch.library.register_autograd("ist_kernels::gated_linear", _gated_linear_grad, setup_context=_gated_linear_setup)


def _relu_gates_setup(ctx, inputs, output):
    pass


def _relu_gates_grad(ctx, grad_out, grad_gates):
    raise RuntimeError(
        "ist_kernels::relu_gates has no gradient: it is GReLU's frozen gate network (paper 004 §2.1), "
        "whose outputs are constants of the trained network. Pass inputs that do not require grad "
        "(buffers, or .detach()), or use gated_linear / torch.relu for a trainable layer.")


torch.library.register_autograd("ist_kernels::relu_gates", _relu_gates_grad, setup_context=_relu_gates_setup)


# ---- CUDA backend: the Triton kernels, traceable by torch.compile where torch allows (ops/_cuda.py);
# without triton, the ATen composition of ist_kernels/cuda/grelu.py.
_OPS = ("relu_gates", "gated_linear", "gated_linear_backward")
if HAS_TRITON:
    from ..triton import grelu as _triton_grelu

    for _name in _OPS:
        register_triton(f"ist_kernels::{_name}", getattr(_triton_grelu, _name), _triton_grelu.TRITON_KERNELS)
else:
    from ..cuda import grelu as _aten_grelu

    warn_no_triton(_OPS, "cuBLAS GEMMs with separate gate passes")
    for _name in _OPS:
        register_composition(f"ist_kernels::{_name}", getattr(_aten_grelu, _name))
