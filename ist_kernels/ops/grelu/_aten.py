"""The CUDA backend of ``relu_gates`` / ``gated_linear`` / ``gated_linear_backward`` when Triton is
not installed (ist_kernels/ops/grelu/__init__.py picks it at import, with a warning): cuBLAS GEMMs through
torch, and the gates packed / unpacked by the C++ CUDA kernels of ``pack_gates`` /
``unpack_gates`` (csrc/cuda/gates.cu). Unlike the Triton kernels, the gate mask is materialised
(one [M, N] pass each way) instead of applied in the GEMM's epilogue; the math and the NaN
behaviour are the same (relu propagates NaN; a NaN is never an "on" gate; masking multiplies)."""
import torch

from ._checks import check_gated_linear_backward, check_grelu_gates, check_grelu_linear

_ops = torch.ops.ist_kernels


def _mask(gates, num_features, dtype):
    return _ops.unpack_gates(gates, num_features).to(dtype)


def relu_gates(x, weight, bias=None):
    check_grelu_linear("relu_gates", x, weight, bias)
    z = torch.nn.functional.linear(x, weight, bias)
    return torch.relu(z), _ops.pack_gates(z > 0)


def gated_linear(x, weight, bias, gates):
    check_grelu_linear("gated_linear", x, weight, bias)
    check_grelu_gates("gated_linear", gates, x, weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias) * _mask(gates, weight.shape[0], x.dtype)


def gated_linear_backward(grad_out, x, weight, gates, output_mask):
    N = check_gated_linear_backward(grad_out, x, weight, gates, output_mask)
    want_dx, want_dw, want_db = (bool(v) for v in output_mask)
    dx, dw, db = (x.new_empty((0,)) for _ in range(3))  # distinct: outputs must not alias
    if not (want_dx or want_dw or want_db):
        return dx, dw, db
    gm = (grad_out * _mask(gates, N, grad_out.dtype)).reshape(-1, N)
    if want_dx:
        dx = torch.mm(gm, weight).view(x.shape)
    if want_dw:
        dw = torch.mm(gm.t(), x.reshape(-1, x.shape[-1]))
    if want_db:  # summed in fp32 for 16-bit dtypes, as the Triton gate pass does
        db = gm.sum(0, dtype=torch.float32 if gm.dtype in (torch.float16, torch.bfloat16) else gm.dtype).to(x.dtype)
    return dx, dw, db
