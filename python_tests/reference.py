"""Independent float64 references, written from the papers' math with plain PyTorch.

Nothing here imports ist_kernels: the tests and the benchmarks compare against these.
"""
import torch


# ---- gates (paper 004 §2.1: one bit per neuron)
def pack_gates(mask: torch.Tensor) -> torch.Tensor:
    on = (mask > 0) if mask.dtype != torch.bool else mask
    F = on.shape[-1]
    W = (F + 31) // 32
    padded = torch.zeros((*on.shape[:-1], W * 32), dtype=torch.int64)
    padded[..., :F] = on.to(torch.int64).cpu()
    bits = padded.reshape(*on.shape[:-1], W, 32)
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (bits * weights).sum(-1)  # unsigned 32-bit value in int64
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).to(mask.device)


def unpack_gates(words: torch.Tensor, num_features: int) -> torch.Tensor:
    w = words.cpu().to(torch.int64) & 0xFFFFFFFF
    bits = torch.stack([(w >> j) & 1 for j in range(32)], dim=-1)
    return bits.reshape(*words.shape[:-1], words.shape[-1] * 32)[..., :num_features].bool().to(words.device)


# ---- subnetworks of neurons (paper 001 §3.1): the linear layer of one subnetwork
def subnet_linear(x, weight, bias=None, rows=None, cols=None):
    """y = x W[rows][:, cols]^T + b[rows] in float64, by gathering the subnetwork weight."""
    N, K = weight.shape
    rows = torch.arange(N, device=weight.device) if rows is None else rows
    cols = torch.arange(K, device=weight.device) if cols is None else cols
    w = weight.double().index_select(0, rows).index_select(1, cols)
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double().index_select(0, rows)
    return y


def subnet_linear_backward(grad_out, x, weight, rows=None, cols=None):
    """Float64 (grad_x, grad_weight, grad_bias): grad_x = g W[rows][:, cols] (compact);
    grad_weight[rows, cols] = g^T x and grad_bias[rows] = sum g, zero elsewhere (full-size)."""
    N, K = weight.shape
    rows = torch.arange(N, device=weight.device) if rows is None else rows
    cols = torch.arange(K, device=weight.device) if cols is None else cols
    M = x.shape[:-1].numel()
    g = grad_out.double().reshape(M, rows.numel())
    xc = x.double().reshape(M, cols.numel())
    w = weight.double().index_select(0, rows).index_select(1, cols)
    grad_x = (g @ w).reshape(x.shape)
    grad_weight = torch.zeros(N, K, dtype=torch.float64, device=weight.device)
    grad_weight[rows[:, None], cols[None, :]] = g.T @ xc
    grad_bias = torch.zeros(N, dtype=torch.float64, device=weight.device)
    grad_bias[rows] = g.sum(0)
    return grad_x, grad_weight, grad_bias
