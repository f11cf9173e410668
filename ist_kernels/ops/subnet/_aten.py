"""The CUDA backend of ``subnet_linear`` / ``subnet_linear_backward``: gather, then dense GEMMs.

A subnetwork's weight W[rows][:, cols] is gathered into a compact tensor once per call (one
memory-bound pass over |rows|·|cols| elements), and every GEMM runs dense in cuBLAS on compact
shapes: y = x Wcᵀ + b[rows], dx = g Wc, dWc = gᵀ x, db = Σ g. The full-size gradients are zero
outside rows x cols, so dW and db are scattered into zeroed full-size tensors (one index_put each).

Why not gather inside a Triton GEMM (ist_kernels/ops/subnet/_triton.py, still there and tested)? On an
H100 (bench/results/h100-baseline.md, bf16 8192³) the in-kernel gather along W's contiguous dim
ran at 0.05-0.21x the dense GEMM on pre-gathered weights: the weight operand is loaded with
scalar 2-byte gathers that cannot use cp.async/TMA, so the tensor cores starve. The compact gather
costs 2·|rows|·|cols| element moves, O(1/M) of the GEMM's work.
"""
import weakref

import torch

from .._checks import check_index_list, check_output_mask
from ._checks import TRITON_DTYPES, check_grad_out, check_subnet


def _compact(weight, rows, cols):
    """W[rows][:, cols] as a new tensor: index_select along dim 0 (whole contiguous rows), then along
    dim 1 on the smaller result (rows/cols None: all). On an H100 (bench/results/h100.md) the
    index_select+matmul baseline ran 1.9-6x faster than this backend's first version, which used one
    advanced-indexing gather weight[rows[:, None], cols] and checked index values (sort + host sync)
    on every call; this version is not yet measured on a GPU."""
    w = weight if rows is None else weight.index_select(0, rows)
    return w if cols is None else w.index_select(1, cols)


def _scatter_full(compact, shape, rows, cols):
    """A zeroed tensor of ``shape`` with ``compact`` written at rows x cols (None: all), by
    index_copy_ along each dim (contiguous row copies, no per-element index math)."""
    if rows is None and cols is None:
        return compact
    if cols is not None:
        wide = compact.new_zeros((compact.shape[0], shape[1]))
        compact = wide.index_copy_(1, cols, compact)
    if rows is None:
        return compact
    return compact.new_zeros(shape).index_copy_(0, rows, compact)


def _checked(op, x, weight, bias, rows, cols):
    """check_subnet with the index values validated once per index tensor and version: IST keeps a
    round's rows/cols for many steps, and each value check costs a sort and a device->host sync."""
    Nr, Kc = check_subnet(op, x, weight, bias, rows, cols, values=False, dtypes=TRITON_DTYPES)
    for idx, name, size, what in ((rows, "rows", weight.shape[0], "weight dim 0 (out_features)"),
                                  (cols, "cols", weight.shape[1], "weight dim 1 (in_features)")):
        if idx is not None and not _VALIDATED.hit(idx, size):
            check_index_list(idx, size, op, name, what, weight.device, values=True)
            _VALIDATED.add(idx, size)
    return Nr, Kc


class _ValidatedIndices:
    """Index tensors whose values passed the range/uniqueness check, keyed by object identity (a weak
    reference: the same tensor object, not just the same address) and version counter (in-place
    writes bump it), for one dimension size. Small: the oldest entries are dropped."""

    def __init__(self, capacity=256):
        self.capacity = capacity
        self.entries = {}

    def hit(self, idx, size):
        e = self.entries.get(id(idx))
        return e is not None and e[0]() is idx and e[1] == idx._version and e[2] == size

    def add(self, idx, size):
        if len(self.entries) >= self.capacity:
            self.entries.pop(next(iter(self.entries)))
        self.entries[id(idx)] = (weakref.ref(idx), idx._version, size)


_VALIDATED = _ValidatedIndices()


def subnet_linear(x, weight, bias=None, rows=None, cols=None):
    """y = x W[rows][:, cols]ᵀ + b[rows]; x [..., len(cols)] -> y [..., len(rows)]."""
    Nr, Kc = _checked("subnet_linear", x, weight, bias, rows, cols)
    # linear takes its one-rounding addmm path (bias added in the GEMM's accumulation) only for a
    # 2-D x and a contiguous bias: for other x (a strided 1-D or 3-D one, say) or a strided bias,
    # torch adds the bias to the product already rounded to bf16/fp16 (two roundings: an error of
    # u |x w| instead of u |y|, property test). So x goes in as [M, len(cols)], as in the backward.
    b = None if bias is None else (bias.contiguous() if rows is None else bias.index_select(0, rows))
    y = torch.nn.functional.linear(x.reshape(x.shape[:-1].numel(), Kc), _compact(weight, rows, cols), b)
    return y.view(*x.shape[:-1], Nr)


def subnet_linear_backward(grad_out, x, weight, rows=None, cols=None, output_mask=(True, True, True)):
    """(grad_x [..., len(cols)], grad_weight [N, K], grad_bias [N]); the full-size gradients are zero
    outside rows x cols; an output not in output_mask is an empty tensor."""
    op = "subnet_linear_backward"
    Nr, Kc = _checked(op, x, weight, None, rows, cols)
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
