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


# ---- CNN subnetworks: owner-averaged aggregation (LOFT paper 000 §4, ResIST paper 003 §2.3)
def aggregate_owner_mean(global_tensors, dims, owners, sub_values):
    """float64 loop: ``global_tensors[name]`` (any shape), ``dims[name]`` the partitioned dim
    (None: shared), ``owners[name][s]`` the indices subnetwork s holds (None or empty: not held;
    ignored for shared), ``sub_values[s][name]`` subnetwork s's compact copy (missing: not held).
    Every slice becomes the mean of its owners' copies; shared tensors the mean over every
    subnetwork holding them; a slice nobody owns keeps its value."""
    out = {}
    for name, g in global_tensors.items():
        g64 = g.detach().double().cpu().clone()
        scalar = g64.dim() == 0
        if scalar:
            g64 = g64.view(1)
        d = 0 if dims[name] is None else dims[name]
        total = torch.zeros_like(g64)
        count = torch.zeros(g64.shape[d], dtype=torch.float64)
        for s, values in enumerate(sub_values):
            if name not in values:
                continue
            v = values[name].detach().double().cpu()
            v = v.view(1) if scalar else v
            if dims[name] is None:
                idx = list(range(g64.shape[0]))
            else:
                idx = owners[name][s]
                if idx is None:
                    continue
                idx = [int(i) for i in idx]
            idx = torch.as_tensor(idx, dtype=torch.long)
            total.index_add_(d, idx, v)
            count.index_add_(0, idx, torch.ones(len(idx), dtype=torch.float64))
        owned = (count > 0).nonzero().flatten()
        shape = [-1 if k == d else 1 for k in range(g64.dim())]
        g64.index_copy_(d, owned, total.index_select(d, owned) / count[owned].view(shape))
        out[name] = g64.view(()) if scalar else g64
    return out


# ---- Filter distance (paper 000 §3.1): position-weighted Spearman footrule on filter norms
def filter_distance(norms_a, norms_b, keep=None):
    """sum over the positions i (1-based) of ranking a (largest norm first, ties to the lower
    index) of (1/i)|ln i - ln sigma(i)|; with keep = l only a's top l, and sigma(i) = l + 1 where
    a's i-th filter is not in b's top l."""
    import math

    a = [float(x) for x in torch.as_tensor(norms_a).detach().double().cpu()]
    b = [float(x) for x in torch.as_tensor(norms_b).detach().double().cpu()]
    n = len(a)
    rank_a = sorted(range(n), key=lambda j: (-a[j], j))
    rank_b = sorted(range(n), key=lambda j: (-b[j], j))
    l = n if keep is None else keep
    top_b = {j: pos + 1 for pos, j in enumerate(rank_b[:l])}
    total = 0.0
    for pos, j in enumerate(rank_a[:l]):
        i = pos + 1
        sigma = top_b.get(j, l + 1)
        total += abs(math.log(i) - math.log(sigma)) / i
    return total
