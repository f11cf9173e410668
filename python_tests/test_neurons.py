"""Neuron partitions, masked layers / random pruning, SubnetMLP and the simulated Algorithm 1
trainer (papers 001 §3.1 and 002 §2.1). References: python_tests/reference.py."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ist_kernels import partition
from ist_kernels.nn import MaskedConv2d, MaskedLinear, SubnetMLP
from ist_kernels.prune import random_prune_
from ist_kernels.train import paper001 as simulated

import reference as ref
from conftest import DEVICES

torch.set_num_threads(1)  # tiny shapes: threads only add overhead on the shared CI cores


# ---------------------------------------------------------------- partitions (paper 001 §3.1)
def test_round_generator_same_seed_and_round_same_masks():
    a = partition.bernoulli_masks(257, 5, 0.3, partition.round_generator(7, 3))
    b = partition.bernoulli_masks(257, 5, 0.3, partition.round_generator(7, 3))
    assert torch.equal(a, b)
    assert not torch.equal(a, partition.bernoulli_masks(257, 5, 0.3, partition.round_generator(7, 4)))
    assert not torch.equal(a, partition.bernoulli_masks(257, 5, 0.3, partition.round_generator(8, 3)))
    c1 = partition.categorical_partition(129, 4, partition.round_generator(1, 0))
    c2 = partition.categorical_partition(129, 4, partition.round_generator(1, 0))
    assert all(torch.equal(x, y) for x, y in zip(c1, c2))
    seeds = {partition.round_seed(s, r) for s in range(20) for r in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_bernoulli_masks_shape_and_rate(gen):
    m = partition.bernoulli_masks(5000, 8, 0.3, gen)
    assert m.shape == (8, 5000) and m.dtype == torch.bool
    # 40000 draws: std of the mean is 0.0023; 0.02 is > 8 standard deviations
    assert abs(m.float().mean().item() - 0.3) < 0.02
    assert (m.float().mean(1) - 0.3).abs().max() < 0.05
    assert partition.bernoulli_masks(33, 3, 0.0, gen).sum() == 0
    assert partition.bernoulli_masks(33, 3, 1.0, gen).all()
    assert partition.bernoulli_masks(0, 3, 0.5, gen).shape == (3, 0)


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("num_neurons,S", [(1, 1), (7, 3), (129, 4), (1000, 7), (3, 5)])
def test_categorical_partition_disjoint_covering_sorted(gen, num_neurons, S, balanced):
    parts = partition.categorical_partition(num_neurons, S, gen, balanced=balanced)
    assert len(parts) == S
    for p in parts:
        assert p.dtype == torch.int64 and p.dim() == 1
        assert torch.equal(p, p.sort().values)
    allidx = torch.cat(parts)
    assert torch.equal(allidx.sort().values, torch.arange(num_neurons))  # each neuron exactly once
    sizes = torch.tensor([len(p) for p in parts])
    if balanced:
        assert sizes.max() - sizes.min() <= 1


def test_categorical_assignment_is_uniform(gen):
    owner = partition.categorical_assignment(40000, 4, gen)
    freq = torch.bincount(owner, minlength=4).double() / 40000
    assert (freq - 0.25).abs().max() < 0.02  # paper 001 Theorem 4: Categorical(1/p · 1_p)


def test_random_subsets(gen):
    subs = partition.random_subsets(129, 6, 33, gen)
    assert len(subs) == 6
    for s in subs:
        assert len(s) == 33 and s.dtype == torch.int64
        assert torch.equal(s, s.unique())  # sorted and distinct
        assert 0 <= s.min() and s.max() < 129
    assert all(len(s) == 0 for s in partition.random_subsets(10, 2, 0, gen))
    assert all(torch.equal(s, torch.arange(10)) for s in partition.random_subsets(10, 2, 10, gen))
    # every neuron equally likely: 2000 subsets of 10 out of 20 -> each neuron ~1000 times
    counts = partition.owner_counts(partition.random_subsets(20, 2000, 10, gen), 20)
    assert (counts - 1000).abs().max() < 150


def test_masks_indices_roundtrip_and_owner_counts(gen):
    masks = partition.bernoulli_masks(77, 5, 0.4, gen)
    idx = partition.masks_to_indices(masks)
    assert torch.equal(partition.indices_to_masks(idx, 77), masks)
    assert torch.equal(partition.owner_counts(idx, 77), masks.sum(0))


def test_partition_bad_input():
    with pytest.raises(ValueError, match="xi"):
        partition.bernoulli_masks(10, 2, 1.5)
    with pytest.raises(ValueError, match="S"):
        partition.categorical_partition(10, 0)
    with pytest.raises(ValueError, match="size"):
        partition.random_subsets(10, 2, 11)
    with pytest.raises(ValueError, match="masks"):
        partition.masks_to_indices(torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------- masked layers (paper 002 §2.1)
def binomial_halfwidth(p, n, sigmas=6.0):
    """Half-width of a check on the fraction of n i.i.d. Bernoulli(p) draws: ``sigmas`` standard
    deviations, sqrt(p (1 - p) / n) each; at 6 the exact binomial tail is ~2e-9 for the sizes here
    (a fixed 0.2 on a 90-entry conv mask was 3.9 sigma: a 1.4e-4 flake)."""
    return sigmas * math.sqrt(p * (1 - p) / n)


def _layers(gen, p, device):
    lin = MaskedLinear(33, 7, p=p, generator=gen, device=device, dtype=torch.float64)
    conv = MaskedConv2d(3, 5, (3, 2), padding=1, p=p, generator=gen, device=device, dtype=torch.float64)
    return [(lin, torch.randn(4, 33, generator=gen, dtype=torch.float64).to(device), F.linear),
            (conv, torch.randn(2, 3, 7, 6, generator=gen, dtype=torch.float64).to(device),
             lambda x, w, b: F.conv2d(x, w, b, padding=1))]


@pytest.mark.parametrize("device", DEVICES)
def test_masked_gradients_are_masked(gen, device):
    for layer, x, fn in _layers(gen, 0.6, device):
        assert abs(layer.sparsity - 0.6) < binomial_halfwidth(0.6, layer.mask.numel()) and 0 < layer.sparsity < 1
        assert (layer.weight[~layer.mask] == 0).all()
        out = layer(x)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
        out.backward(g)
        # reference: the gradient of the effective weight W ⊙ M, masked (§2.1)
        w_eff = (layer.weight.detach() * layer.mask).requires_grad_(True)
        b = layer.bias.detach().requires_grad_(True)
        ref_out = fn(x, w_eff, b)
        ref_out.backward(g)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer.weight.grad, w_eff.grad * layer.mask, rtol=1e-12, atol=1e-12)
        assert (layer.weight.grad[~layer.mask] == 0).all()
        torch.testing.assert_close(layer.bias.grad, b.grad)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_masked_weights_stay_zero_through_optimizer(gen, opt):
    for layer, x, _ in _layers(gen, 0.5, "cpu"):
        before = layer.weight.detach().clone()
        if opt == "sgd":
            o = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        else:
            o = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=1e-2)
        for _ in range(3):
            o.zero_grad()
            layer(x).square().sum().backward()
            o.step()
        assert (layer.weight[~layer.mask] == 0).all()
        assert (layer.weight[layer.mask] != before[layer.mask]).any()  # the kept weights did train


def test_masked_sparsity_and_extremes(gen):
    assert MaskedLinear(40, 50, p=0.0, generator=gen).sparsity == 0.0
    full = MaskedLinear(40, 50, p=1.0, generator=gen)
    assert full.sparsity == 1.0 and (full.weight == 0).all()
    big = MaskedLinear(200, 100, p=0.3, generator=gen)
    assert abs(big.sparsity - 0.3) < binomial_halfwidth(0.3, 20000)  # std 0.0032: 0.019
    assert "p=0.3, mask_seed=" in repr(big)
    with pytest.raises(ValueError, match="p"):
        MaskedLinear(4, 4, p=1.5)


def test_from_dense_keeps_function_where_mask_is_one(gen):
    dense = nn.Linear(13, 9).double()
    x = torch.randn(5, 13, generator=gen, dtype=torch.float64)
    masked = MaskedLinear.from_dense(dense, 0.5, gen)
    assert masked.weight.dtype == torch.float64 and masked.mask.shape == dense.weight.shape
    torch.testing.assert_close(masked(x), F.linear(x, dense.weight * masked.mask, dense.bias), rtol=0, atol=1e-13)
    assert torch.equal(MaskedLinear.from_dense(dense, 0.0)(x), dense(x))
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False)
    mc = MaskedConv2d.from_dense(conv, 0.3, gen)
    assert (mc.stride, mc.padding, mc.groups, mc.bias) == ((2, 2), (1, 1), 2, None)
    xc = torch.randn(2, 4, 9, 9, generator=gen)
    torch.testing.assert_close(mc(xc), F.conv2d(xc, conv.weight * mc.mask, None, 2, 1, 1, 2))


def test_random_prune_converts_every_layer(gen):
    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Sequential(nn.Linear(4 * 5 * 5, 8), shared, shared), nn.Linear(8, 3))
    x = torch.randn(3, 2, 5, 5, generator=gen)
    dense = copy.deepcopy(model)
    random_prune_(model, 0.4, gen)
    kinds = [type(m) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert kinds.count(MaskedConv2d) == 1 and kinds.count(MaskedLinear) == 3 and len(kinds) == 4
    assert model[3][1] is model[3][2]  # a shared layer keeps one mask

    # the pruned model is the dense model with W ⊙ M (function kept where the mask is one)
    def reference(x):
        h = F.relu(F.conv2d(x, dense[0].weight * model[0].mask, dense[0].bias, padding=1)).flatten(1)
        h = F.linear(h, dense[3][0].weight * model[3][0].mask, dense[3][0].bias)
        for _ in range(2):
            h = F.linear(h, dense[3][1].weight * model[3][1].mask, dense[3][1].bias)
        return F.linear(h, dense[4].weight * model[4].mask, dense[4].bias)

    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    masks = [m.mask.clone() for m in model.modules() if hasattr(m, "mask")]
    random_prune_(model, 0.9, gen)  # already masked: left as is
    assert all(torch.equal(a, m.mask) for a, m in zip(masks, [m for m in model.modules() if hasattr(m, "mask")]))
    assert isinstance(random_prune_(nn.Linear(3, 3), 0.5, gen), MaskedLinear)
    # same generator state -> same masks
    a = random_prune_(copy.deepcopy(dense), 0.5, torch.Generator().manual_seed(3))
    b = random_prune_(copy.deepcopy(dense), 0.5, torch.Generator().manual_seed(3))
    assert all(torch.equal(x.mask, y.mask) for x, y in zip(
        [m for m in a.modules() if hasattr(m, "mask")], [m for m in b.modules() if hasattr(m, "mask")]))


# ---------------------------------------------------------------- SubnetMLP (paper 001 §3.1)
CONFIGS = [  # (depth, bias, train_output)
    (1, False, False),  # paper 001's network
    (1, True, True),
    (2, False, True),
    (3, True, False),
]


def _model(gen, depth, bias, train_output, width=37, d=7, out=3, device="cpu", dtype=torch.float64):
    m = SubnetMLP(d, width, depth, out, bias=bias, train_output=train_output, kappa=0.7, generator=gen,
                  device=device, dtype=dtype)
    with torch.no_grad():  # non-zero biases so that a wrong bias slice shows
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(generator=gen) if device == "cpu" else p.copy_(torch.randn(p.shape, generator=gen))
    return m


def _plan(gen, depth, width, S, xi):
    return [[torch.nonzero(torch.rand(width, generator=gen) < xi).flatten() for _ in range(depth)]
            for _ in range(S)]


def _ref_forward(m, x, neurons, keep=1.0):
    return ref.neurons_subnet_mlp(
        x, list(m.hidden_weights), None if m.hidden_biases is None else list(m.hidden_biases),
        m.output_weight, m.output_bias, neurons, m.scale, keep)


def test_subnet_mlp_paper_initialisation(gen):
    m = SubnetMLP(10, 4000, 1, 1, kappa=0.5, generator=gen)
    assert set(m.output_weight.unique().tolist()) == {-1.0, 1.0}  # a_r ~ Unif{-1, 1}
    assert not m.output_weight.requires_grad and m.output_bias is None and m.hidden_biases is None
    assert abs(m.hidden_weights[0].std().item() - 0.5) < 0.01  # w_r ~ N(0, κ² I)
    assert [n for n, _ in m.named_parameters()] == ["hidden_weights.0"]
    x = torch.randn(5, 10, generator=gen)
    expected = (torch.relu(x @ m.hidden_weights[0].T) @ m.output_weight.T) / math.sqrt(4000)
    torch.testing.assert_close(m(x), expected)  # f(W, x) = 1/√m Σ a_r σ(<w_r, x>)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    w1, w2 = (SubnetMLP(3, 9, 1, 2, generator=g).hidden_weights[0] for g in (g1, g2))
    assert torch.equal(w1, w2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth,bias,train_output", CONFIGS)
def test_subnet_forward_matches_reference(gen, device, depth, bias, train_output):
    m = _model(gen, depth, bias, train_output, device=device)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64).to(device)
    for neurons in _plan(gen, depth, 37, 3, 0.4) + [[torch.arange(37)] * depth, [torch.arange(0)] * depth]:
        y = m(x, neurons)
        torch.testing.assert_close(y, _ref_forward(m, x, neurons), rtol=1e-12, atol=1e-12)
        # compact parameters: same function, costs only the subnetwork
        y2 = m.subnet_forward(x, m.extract(neurons), neurons)
        torch.testing.assert_close(y2, y, rtol=1e-12, atol=1e-12)
    all_neurons = [None] * depth
    for keep in (1.0, 0.3):
        torch.testing.assert_close(m(x, keep=keep), _ref_forward(m, x, all_neurons, keep), rtol=1e-12, atol=1e-12)
    if depth == 1:  # one tensor is accepted for a single hidden layer
        idx = torch.tensor([0, 5, 36])
        torch.testing.assert_close(m(x, idx), m(x, [idx]), rtol=0, atol=0)


@pytest.mark.parametrize("depth,bias,train_output", CONFIGS)
def test_subnet_forward_gradients_only_on_selected(gen, depth, bias, train_output):
    m = _model(gen, depth, bias, train_output)
    x = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    neurons = _plan(gen, depth, 37, 1, 0.5)[0]
    m(x, neurons).square().sum().backward()
    ref_m = copy.deepcopy(m)
    ref_m.zero_grad()
    _ref_forward(ref_m, x, neurons).square().sum().backward()
    for (name, p), (_, q) in zip(m.named_parameters(), ref_m.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    owned = torch.zeros(37, dtype=torch.bool)
    owned[neurons[0]] = True
    assert (m.hidden_weights[0].grad[~owned] == 0).all()


def test_subnet_mlp_bad_input(gen):
    m = _model(gen, 2, False, False)
    x = torch.randn(2, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match="one index list per hidden layer"):
        m(x, torch.arange(3))
    with pytest.raises(ValueError, match="2 index tensors"):
        m(x, [torch.arange(3)])
    params = m.extract_all(_plan(gen, 2, 37, 2, 0.5))
    with pytest.raises(ValueError, match="parameter lists"):
        m.aggregate_(params, _plan(gen, 2, 37, 3, 0.5))


# ---------------------------------------------------------------- aggregation (Algorithm 1)
def _full_size(m, params, neurons):
    """Subnetwork's compact parameters placed into copies of the global tensors (test-side, by
    plain indexing), and the entries it owns."""
    neurons = [torch.arange(m.width) if n is None else n for n in neurons]
    full, owned = [], []
    it = iter(params)
    for l in range(m.depth):
        w = m.hidden_weights[l].detach().clone()
        o = torch.zeros_like(w, dtype=torch.bool)
        cols = slice(None) if l == 0 else neurons[l - 1]
        rows = neurons[l]
        if l == 0:
            w[rows] = next(it)
            o[rows] = True
        else:
            w[rows.unsqueeze(1), cols.unsqueeze(0)] = next(it)
            o[rows.unsqueeze(1), cols.unsqueeze(0)] = True
        full.append(w), owned.append(o)
        if m.hidden_biases is not None:
            b = m.hidden_biases[l].detach().clone()
            b[rows] = next(it)
            o = torch.zeros_like(b, dtype=torch.bool)
            o[rows] = True
            full.append(b), owned.append(o)
    if m.train_output:
        w = m.output_weight.detach().clone()
        w[:, neurons[-1]] = next(it)
        o = torch.zeros_like(w, dtype=torch.bool)
        o[:, neurons[-1]] = True
        full.append(w), owned.append(o)
        if m.output_bias is not None:
            full.append(next(it).clone()), owned.append(torch.ones_like(m.output_bias, dtype=torch.bool))
    return full, owned


@pytest.mark.parametrize("depth,bias,train_output", CONFIGS)
def test_aggregate_matches_algorithm1(gen, depth, bias, train_output):
    m = _model(gen, depth, bias, train_output)
    plan = _plan(gen, depth, 37, 4, 0.3)  # xi = 0.3, S = 4: unowned, single and multi-owner neurons
    counts = partition.owner_counts([p[0] for p in plan], 37)
    assert (counts == 0).any() and (counts == 1).any() and (counts >= 2).any()
    params_list = m.extract_all(plan)
    for params, neurons in zip(params_list, plan):  # extract = plain indexing of the global tensors
        full, _ = _full_size(m, params, neurons)
        for f, g in zip(full, m.subnet_parameters()):
            torch.testing.assert_close(f, g.detach(), rtol=0, atol=0)
    updated = [[p + torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params] for params in params_list]
    globals_before = [p.detach().clone() for p in m.subnet_parameters()]
    expected = []
    per_sub = [_full_size(m, params, neurons) for params, neurons in zip(updated, plan)]
    for t, w in enumerate(globals_before):
        expected.append(ref.neurons_aggregate(w, [ps[0][t] for ps in per_sub], [ps[1][t] for ps in per_sub]))
    m.aggregate_(updated, plan)
    for p, e in zip(m.subnet_parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)
    # the three cases of η = N⊥/N on the first layer, explicitly
    w0, before = m.hidden_weights[0].detach(), globals_before[0]
    for r in range(37):
        owners = [s for s, p in enumerate(plan) if (p[0] == r).any()]
        if not owners:
            assert torch.equal(w0[r], before[r])  # unowned: unchanged
        elif len(owners) == 1:
            s = owners[0]
            assert torch.equal(w0[r], updated[s][0][(plan[s][0] == r).nonzero().item()])  # copied
        else:
            rows = [updated[s][0][(plan[s][0] == r).nonzero().item()] for s in owners]
            torch.testing.assert_close(w0[r], torch.stack(rows).mean(0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("depth,bias,train_output", CONFIGS)
def test_aggregate_idempotent(gen, depth, bias, train_output):
    m = _model(gen, depth, bias, train_output)
    plan = _plan(gen, depth, 37, 3, 0.5)
    before = [p.detach().clone() for p in m.parameters()]
    m.aggregate_(m.extract_all(plan), plan)  # subnetworks return the global values
    for p, b in zip(m.parameters(), before):  # a mean of k equal values: exact up to rounding
        torch.testing.assert_close(p.detach(), b, rtol=1e-15, atol=0)


def test_extract_all_equals_extract(gen):
    m = _model(gen, 2, True, True)
    plan = _plan(gen, 2, 37, 3, 0.4)
    for a, neurons in zip(m.extract_all(plan), plan):
        for x, y in zip(a, m.extract(neurons)):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- simulated trainer
def _gd_reference(m, x, y, steps, lr):
    """Plain full-batch GD on ½‖y − f‖² of the full model, float64."""
    w = m.hidden_weights[0].detach().clone().requires_grad_(True)
    for _ in range(steps):
        f = torch.relu(x @ w.T) @ m.output_weight.T * m.scale
        loss = 0.5 * (f.flatten() - y).square().sum()
        (g,) = torch.autograd.grad(loss, w)
        w = (w - lr * g).detach().requires_grad_(True)
    return w.detach()


@pytest.mark.parametrize("masks,S,xi", [("categorical", 1, None), ("bernoulli", 3, 1.0)])
def test_simulated_reduces_to_gradient_descent(gen, masks, S, xi):
    # one subnetwork owning every neuron (or identical subnetworks, averaged) is plain GD
    x = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.randn(9, generator=gen, dtype=torch.float64)
    m = SubnetMLP(5, 33, 1, 1, generator=gen, dtype=torch.float64)
    w_ref = _gd_reference(m, x, y, 6, 0.3)
    simulated.train(m, x, y, subnetworks=S, rounds=3, local_steps=2, lr=0.3, masks=masks, xi=xi)
    torch.testing.assert_close(m.hidden_weights[0].detach(), w_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("masks,xi", [("bernoulli", 0.5), ("categorical", None)])
def test_simulated_trainer_decreases_error_and_is_deterministic(gen, masks, xi):
    # 16 features: well-conditioned enough that 25 rounds halve the error for every draw (with 4,
    # the ratio reached 0.45 in 60 draws and exceeded 0.5 now and then)
    x = torch.randn(12, 16, generator=gen)
    x = x / x.norm(dim=1, keepdim=True)
    y = torch.randn(12, generator=gen)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    runs = []
    for _ in range(2):
        m = SubnetMLP(16, 200, 1, 1, generator=torch.Generator().manual_seed(seed))
        hist = simulated.train(m, x, y, subnetworks=3, rounds=25, local_steps=2, lr=0.2, masks=masks, xi=xi,
                               seed=seed)
        runs.append((hist, m.hidden_weights[0].detach().clone()))
    hist = runs[0][0]
    assert len(hist.errors) == 26 and len(hist.sampled) == len(hist.local) == 25
    assert hist.errors[-1] < 0.5 * hist.errors[0]
    assert all(lo <= sa + 1e-6 for sa, lo in zip(hist.sampled, hist.local))  # local steps make progress
    assert runs[0][0].errors == runs[1][0].errors and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("subnetworks, xi", [(4, None), (3, [0.7, 0.2, 0.1])])
def test_simulated_categorical_aggregate_is_mean_of_subnetworks(gen, subnetworks, xi):
    # paper 001 Appendix F: with a categorical partition u_{k+1} = (1/p) Σ_l û^l_{k,τ} holds for any
    # ξ vector, so the full model keeps 1/S of the hidden units' output
    x = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(8, generator=gen, dtype=torch.float64)
    m = SubnetMLP(3, 60, 1, 1, generator=gen, dtype=torch.float64)
    assert simulated.selection_probability("categorical", subnetworks, xi) == pytest.approx(1 / subnetworks)
    plan = simulated.sample_neurons(m, subnetworks, "categorical", xi, gen)
    assert sorted(torch.cat([p[0] for p in plan]).tolist()) == list(range(60))
    params_list = m.extract_all(plan)
    outs = []
    for params, neurons in zip(params_list, plan):
        simulated.local_train(m, params, neurons, x, y, 3, 0.1)
        outs.append(m.subnet_forward(x, params, neurons).detach())
    simulated.aggregate(m, params_list, plan)
    torch.testing.assert_close(m(x, keep=1 / subnetworks), torch.stack(outs).mean(0), rtol=1e-12, atol=1e-12)
    hist = simulated.train(m, x, y, subnetworks=subnetworks, rounds=4, local_steps=2, lr=0.1,
                           masks="categorical", xi=xi)
    assert len(hist.errors) == 5 and all(math.isfinite(e) for e in hist.errors)


def test_slice_plan_names_and_owners(gen):
    m = _model(gen, 1, True, True)
    plan = _plan(gen, 1, 37, 3, 0.5)
    sp = m.slice_plan(plan)
    state = m.state_dict()
    assert sp.num_subnetworks == 3 and all(t.name in state for t in sp.tensors)
    assert [t.dim for t in sp.tensors] == [0, 0, 1, None]
    for t in sp.partitioned:
        assert all(torch.equal(o, p[0]) for o, p in zip(t.owners, plan))
    # the compact tensors a plan describes are what extract returns
    for s, params in enumerate(m.extract_all(plan)):
        for t, c in zip(sp.tensors, params):
            full = state[t.name]
            expected = full if t.shared else full.index_select(t.dim, t.owners[s])
            assert torch.equal(c, expected)
    # depth 2: the hidden-to-hidden weight is owned by rows x columns, stated on its flat view
    m2 = _model(gen, 2, True, True)
    plan2 = _plan(gen, 2, 37, 3, 0.5)
    sp2 = m2.slice_plan(plan2)
    spec = m2.slice_spec()
    state2 = m2.state_dict()
    assert spec["hidden_weights.1"][0] == (37 * 37,) and spec["hidden_weights.0"][0] == (37, state2["hidden_weights.0"].shape[1])
    for s, params in enumerate(m2.extract_all(plan2)):
        rows, cols = plan2[s][1], plan2[s][0]
        part = sp2.part({n: m2.exchange_view(n, v) for n, v in state2.items() if n in spec}, s)
        for name, c in zip(m2.compact_names(), params):
            assert torch.equal(part[name].view(c.shape), c), name
        assert torch.equal(part["hidden_weights.1"].view(len(rows), len(cols)), state2["hidden_weights.1"][rows][:, cols])
