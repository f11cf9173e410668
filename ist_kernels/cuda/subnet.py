"""The CUDA backend of ``subnet_linear`` / ``subnet_linear_backward``: gather, then dense GEMMs.

A subnetwork's weight W[rows][:, cols] is gathered into a compact tensor once per call (one
memory-bound pass over |rows|·|cols| elements), and every GEMM runs dense in cuBLAS on compact
shapes: y = x Wcᵀ + b[rows], dx = g Wc, dWc = gᵀ x, db = Σ g. The full-size gradients are zero
outside rows x cols, so dW and db are scattered into zeroed full-size tensors (one index_put each).

Why not gather inside a Triton GEMM (ist_kernels/triton/subnet.py, still there and tested)? On an
H100 (bench/results/h100-baseline.md, bf16 8192³) the in-kernel gather along W's contiguous dim
ran at 0.05-0.21x the dense GEMM on pre-gathered weights: the weight operand is loaded with
scalar 2-byte gathers that cannot use cp.async/TMA, so the tensor cores starve. The compact gather
costs 2·|rows|·|cols| element moves, O(1/M) of the GEMM's work.
"""
import torch

from ..ops._checks import check_output_mask
from ..ops.subnet import TRITON_DTYPES, check_grad_out, check_subnet


def _compact(weight, rows, cols):
    """W[rows][:, cols] as a new contiguous tensor, one gather (rows/cols None: all)."""
    if rows is None and cols is None:
        return weight
    if rows is None:
        return weight.index_select(1, cols)
    if cols is None:
        return weight.index_select(0, rows)
    return weight[rows.unsqueeze(1), cols.unsqueeze(0)]


def _scatter_full(compact, shape, rows, cols):
    """A zeroed tensor of ``shape`` with ``compact`` written at rows x cols (None: all)."""
    if rows is None and cols is None:
        return compact
    full = compact.new_zeros(shape)
    if len(shape) == 1:
        full[rows] = compact
    elif rows is None:
        full[:, cols] = compact
    elif cols is None:
        full[rows] = compact
    else:
        full[rows.unsqueeze(1), cols.unsqueeze(0)] = compact
    return full


def subnet_linear(x, weight, bias=None, rows=None, cols=None):
    """y = x W[rows][:, cols]ᵀ + b[rows]; x [..., len(cols)] -> y [..., len(rows)]."""
    Nr, Kc = check_subnet("subnet_linear", x, weight, bias, rows, cols, values=True, dtypes=TRITON_DTYPES)
    b = None if bias is None else (bias if rows is None else bias.index_select(0, rows))
    return torch.nn.functional.linear(x, _compact(weight, rows, cols), b)


def subnet_linear_backward(grad_out, x, weight, rows=None, cols=None, output_mask=(True, True, True)):
    """(grad_x [..., len(cols)], grad_weight [N, K], grad_bias [N]); the full-size gradients are zero
    outside rows x cols; an output not in output_mask is an empty tensor."""
    op = "subnet_linear_backward"
    Nr, Kc = check_subnet(op, x, weight, None, rows, cols, values=True, dtypes=TRITON_DTYPES)
    check_grad_out(op, grad_out, x, weight, Nr)
    check_output_mask(op, output_mask)
    M = x.shape[:-1].numel()
    x2 = x.reshape(M, Kc)
    g2 = grad_out.reshape(M, Nr)
    grad_x = grad_weight = grad_bias = weight.new_empty((0,))
    if output_mask[0]:
        grad_x = torch.mm(g2, _compact(weight, rows, cols)).reshape(x.shape)
    if output_mask[1]:
        grad_weight = _scatter_full(torch.mm(g2.t(), x2), weight.shape, rows, cols)
    if output_mask[2]:
        db = g2.sum(0, dtype=torch.float32 if g2.dtype in (torch.float16, torch.bfloat16) else g2.dtype)
        grad_bias = _scatter_full(db.to(weight.dtype), (weight.shape[0],), rows, None)
    return grad_x, grad_weight, grad_bias
