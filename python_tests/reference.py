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
    subnetwork holding them; a slice nobody owns keeps its value. Integer tensors (counters such
    as BN num_batches_tracked) take the largest of their owners' values instead."""
    out = {}
    for name, g in global_tensors.items():
        if not g.is_floating_point():
            out[name] = _owner_max64(g, dims[name], owners[name], [v.get(name) for v in sub_values])
            continue
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


def _owner_max64(g, dim, owners, values):
    """An integer tensor's slices: each the largest of its owners' copies (element by element)."""
    out = g.detach().double().cpu().clone().reshape(g.shape or (1,))
    best = {}
    for s, v in enumerate(values):
        if v is None:
            continue
        v = v.detach().double().cpu().reshape(v.shape or (1,))
        idx = range(out.shape[0]) if dim is None else ([] if owners[s] is None else [int(i) for i in owners[s]])
        d = 0 if dim is None else dim
        for k, i in enumerate(idx):
            x = v.select(d, k)
            best[i] = x.clone() if i not in best else torch.maximum(best[i], x)
    for i, x in best.items():
        out.select(0 if dim is None else dim, i).copy_(x)
    return out.view(g.shape)


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
# ---- GReLU MLP (paper 004 §2.1, eq. 1): y = B D_L W_L ... D_1 W_1 [C x]^+, D_k from the frozen net
def grelu_mlp_gates(x, C, psi, C_bias=None, psi_bias=None):
    """D_1..D_L of the frozen network z_0 = [Cx + c]^+, z_k = [Ψ_k z_{k-1} + ψ_k]^+, as bool [..., L, m]."""
    z = torch.relu(x.double() @ C.double().T + (0 if C_bias is None else C_bias.double()))
    gates = []
    for k in range(psi.shape[0]):
        pre = z @ psi[k].double().T + (0 if psi_bias is None else psi_bias[k].double())
        gates.append(pre > 0)
        z = torch.relu(pre)
    return torch.stack(gates, dim=-2)


def grelu_mlp(x, C, psi, weights, B, gates=None, C_bias=None, psi_bias=None, biases=None, B_bias=None):
    """Float64 output of the GReLU network; ``gates`` (bool [..., L, m]) default to the frozen net's."""
    if gates is None:
        gates = grelu_mlp_gates(x, C, psi, C_bias, psi_bias)
    h = torch.relu(x.double() @ C.double().T + (0 if C_bias is None else C_bias.double()))
    for k, w in enumerate(weights):
        h = (h @ w.double().T + (0 if biases is None else biases[k].double())) * gates[..., k, :].double()
    return h @ B.double().T + (0 if B_bias is None else B_bias.double())
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
# ---- multi-tensor slices (partitions). Aggregation of paper 001 Algorithm 1 (step size N⊥/N): a
# slice (neuron, filter, channel) is averaged over the subnetworks that own it and keeps its value
# when none does.
def slice_gather(sources, source_ids, indices, dims):
    """Segment j = sources[source_ids[j]].index_select(dim, indices[j]), flattened and concatenated."""
    parts = [sources[s].index_select(dims[s] % sources[s].dim(), indices[j].to(sources[s].device)).reshape(-1)
             for j, s in enumerate(source_ids)]
    return torch.cat(parts) if parts else sources[0].new_empty(0)


def slice_scatter(targets, target_ids, updates, indices, dims, reduce):
    """New tensors (float64 for floating targets, complex128 for complex ones, int64 for integer and
    bool ones; inputs untouched): for every
    slice i of every target, its owners are the segments j with target_ids[j] == t listing i, in
    segment order; copy = the last owner, sum = target + sum of owners, mean = sum / number of owners
    (toward zero for integers). Unowned slices keep their value."""
    out = []
    for t, x in enumerate(targets):
        wide = torch.complex128 if x.is_complex() else torch.float64 if x.is_floating_point() else torch.int64
        y = x.detach().to(wide).clone()
        d = dims[t] % x.dim()
        for i in range(x.shape[d]):
            owners = []
            for j, (tid, idx) in enumerate(zip(target_ids, indices)):
                if tid != t:
                    continue
                hit = (idx.cpu() == i).nonzero().flatten()
                if hit.numel():
                    owners.append(updates[j].to(wide).select(d, int(hit[0])))
            if not owners:
                continue
            if reduce == "copy":
                y.select(d, i).copy_(owners[-1])
            elif reduce == "sum":
                y.select(d, i).add_(sum(owners))
            elif wide == torch.int64:
                y.select(d, i).copy_(torch.div(sum(owners), len(owners), rounding_mode="trunc"))
            else:
                y.select(d, i).copy_(sum(owners) / len(owners))
        out.append(y)
    return out


def owner_average(target, updates, indices, dim=0):
    """Every slice of `target` along `dim` owned by k >= 1 of the compact updates becomes their mean."""
    return slice_scatter([target], [0] * len(updates), updates, indices, [dim], "mean")[0]
# ---- GReLU layers (paper 004 §2.1: z = x Wᵀ + b; gate layer relu(z) with D = [z > 0];
# trained layer y = z ⊙ D; backward g' = g ⊙ D, dx = g' W, dW = g'ᵀ x, db = Σ g')
def _linear64(x, weight, bias):
    z = x.double() @ weight.double().T
    return z if bias is None else z + bias.double()


def linear_magnitude(x, weight, bias=None):
    """|x| |W|ᵀ + |b| in float64: the Σ|terms| of every sum of x Wᵀ + b, the magnitude its rounding
    error scales with (a chain of them on absolute values bounds a chain of layers)."""
    return _linear64(x.detach().abs(), weight.detach().abs(), None if bias is None else bias.detach().abs())


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
