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


# ---- GReLU layers (paper 004 §2.1: z = x Wᵀ + b; gate layer relu(z) with D = [z > 0];
# trained layer y = z ⊙ D; backward g' = g ⊙ D, dx = g' W, dW = g'ᵀ x, db = Σ g')
def _linear64(x, weight, bias):
    z = x.double() @ weight.double().T
    return z if bias is None else z + bias.double()


def relu_gates(x, weight, bias=None):
    z = _linear64(x, weight, bias)
    return torch.relu(z), pack_gates(z > 0)


def gated_linear(x, weight, bias, gates):
    z = _linear64(x, weight, bias)
    return z * unpack_gates(gates, weight.shape[0]).double()


def gated_linear_backward(grad_out, x, weight, gates):
    """(grad_x, grad_weight, grad_bias) in float64."""
    N, K = weight.shape
    M = 1
    for s in x.shape[:-1]:
        M *= s
    gm = grad_out.double() * unpack_gates(gates, N).double()
    gm2 = gm.reshape(M, N)
    return gm @ weight.double(), gm2.T @ x.double().reshape(M, K), gm2.sum(0)
