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


# ---- subnetworks of neurons (paper 001 §3.1, Algorithm 1)
def neurons_subnet_mlp(x, hidden_weights, hidden_biases, output_weight, output_bias, neurons, scale, keep=1.0):
    """Float64 forward of the MLP with every hidden neuron outside ``neurons`` (one index list per
    hidden layer, None = all) removed, by zeroing its activation: h_l = relu(h_{l-1} W_lᵀ + b_l) ⊙ m_l,
    later layers see keep·scale·h. The output is 1/√m-scaled as f_m in §3.1."""
    h = x.double()
    for l, w in enumerate(hidden_weights):
        z = h @ w.double().T
        if hidden_biases is not None:
            z = z + hidden_biases[l].double()
        mask = torch.zeros(w.shape[0], dtype=torch.float64)
        mask[neurons[l].cpu() if neurons[l] is not None else slice(None)] = 1.0
        h = torch.relu(z) * mask.to(z.device) * (scale * keep)
    out = h @ output_weight.double().T
    return out if output_bias is None else out + output_bias.double()


def neurons_aggregate(w, updated, owned):
    """Algorithm 1 lines 11-13 for one tensor, literally: w + η ⊙ Σ_l ΔW_l with η = N⊥/N,
    N = max(X, 1), N⊥ = min(X, 1), X = number of owners per entry. ``updated[l]`` is subnetwork
    l's full-size tensor after local training, ``owned[l]`` (bool, full-size) the entries it owns."""
    w = w.double()
    X = torch.stack([o.double() for o in owned]).sum(0)
    delta = sum(torch.where(o, u.double() - w, torch.zeros_like(w)) for u, o in zip(updated, owned))
    return w + X.clamp(max=1) / X.clamp(min=1) * delta
