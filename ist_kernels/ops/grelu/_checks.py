"""Argument checks of the GReLU ops (relu_gates, gated_linear, gated_linear_backward), shared by
their fake kernels (:mod:`ist_kernels.ops.grelu`), the Triton launchers (:mod:`._triton`) and the
ATen composition (:mod:`._aten`); mirrors csrc/checks.h. Errors follow the policy of
:mod:`ist_kernels.ops._checks`."""
import torch

from .._checks import check_output_mask, check_same_device, fail, gate_words

GRELU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_grelu_linear(op: str, x, weight, bias) -> None:
    """x [..., K], weight [N, K], bias [N] or None: one device, one supported dtype, matching sizes."""
    if x.dim() < 1:
        fail(op, "x must have at least 1 dimension (features last), got a 0-d tensor")
    if weight.dim() != 2:
        fail(op, f"weight must be 2-D [out_features, in_features], got {weight.dim()}-D")
    if x.dtype not in GRELU_DTYPES:
        fail(op, f"x must be float32, float64, bfloat16 or float16, got {x.dtype}", TypeError)
    if weight.dtype != x.dtype:
        fail(op, f"weight must have x's dtype {x.dtype}, got {weight.dtype}", TypeError)
    check_same_device(op, x=x, weight=weight, bias=bias)
    if x.shape[-1] != weight.shape[1]:
        fail(op, f"x has {x.shape[-1]} features (last dim) but weight expects {weight.shape[1]} "
                 f"(weight is {list(weight.shape)})")
    if bias is not None:
        if bias.dtype != x.dtype:
            fail(op, f"bias must have x's dtype {x.dtype}, got {bias.dtype}", TypeError)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            fail(op, f"bias must be [{weight.shape[0]}] (out_features), got {list(bias.shape)}")


def check_grelu_gates(op: str, gates, x, num_features: int) -> None:
    """gates: int32 [*x.shape[:-1], ceil(num_features / 32)] on x's device."""
    check_same_device(op, x=x, gates=gates)
    if gates.dtype != torch.int32:
        fail(op, f"gates must be int32 (packed with pack_gates), got {gates.dtype}", TypeError)
    if gates.dim() != x.dim() or gates.shape[:-1] != x.shape[:-1] or gates.shape[-1] != gate_words(num_features):
        expected = [*x.shape[:-1], gate_words(num_features)]
        fail(op, f"gates must be {expected} (x's leading dims, ceil({num_features}/32) words), got "
                 f"{list(gates.shape)}")


def check_grelu_grad_out(op: str, grad_out, x, num_features: int) -> None:
    check_same_device(op, x=x, grad_out=grad_out)
    if grad_out.dtype != x.dtype:
        fail(op, f"grad_out must have x's dtype {x.dtype}, got {grad_out.dtype}", TypeError)
    if grad_out.dim() != x.dim() or grad_out.shape[:-1] != x.shape[:-1] or grad_out.shape[-1] != num_features:
        expected = [*x.shape[:-1], num_features]
        fail(op, f"grad_out must be {expected} (x's leading dims, out_features), got {list(grad_out.shape)}")


def check_gated_linear_backward(grad_out, x, weight, gates, output_mask) -> int:
    """All argument checks of gated_linear_backward; returns N (the output features)."""
    op = "gated_linear_backward"
    check_grelu_linear(op, x, weight, None)
    N = weight.shape[0]
    check_grelu_grad_out(op, grad_out, x, N)
    check_grelu_gates(op, gates, x, N)
    check_output_mask(op, output_mask)
    return N
