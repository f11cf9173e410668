"""GatedLinear / GReLUMLP (paper 004 §2.1, §4.1, §4.4) and the §6.1 experiment."""
import math

import pytest
import torch
from torch import nn

import ist_kernels.functional as F
from ist_kernels.nn import GatedLinear, GReLUMLP

import reference as ref
from conftest import DEVICES


def perturb_(net, gen, scale=0.3):
    """Move the trained layers away from their initialisation, as training would."""
    with torch.no_grad():
        for p in net.layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) * scale * p.std().clamp_min(1e-3))


def ref_forward(net, x, gates=None):
    biases = None if net.C_bias is None else [layer.bias for layer in net.layers]
    return ref.grelu_mlp(x, net.C, net.psi, [layer.weight for layer in net.layers], net.B, gates,
                         net.C_bias, net.psi_bias, biases, net.B_bias)


def relu_mlp(d, m, depth, out, bias, gen, dtype=torch.float64):
    mods = [nn.Linear(d, m, bias=bias), nn.ReLU()]
    for _ in range(depth):
        mods += [nn.Linear(m, m, bias=bias), nn.ReLU()]
    mods.append(nn.Linear(m, out, bias=bias))
    net = nn.Sequential(*mods).to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / math.sqrt(p.shape[-1]) * 1.4)
    return net


def test_init_follows_section_2_1():
    gen = torch.Generator().manual_seed(0)
    d, m, L, dy = 150, 200, 3, 4
    net = GReLUMLP(d, m, L, dy, generator=gen)
    # [W_k], [Ψ_k] ~ N(0, 2/m), [C] ~ N(0, 2/d_x), [B] ~ N(0, 2/d_y); independent.
    for t, var in [(torch.stack([layer.weight for layer in net.layers]), 2 / m), (net.psi, 2 / m),
                   (net.C, 2 / d), (net.B, 2 / dy)]:
        assert abs(t.mean().item()) < 4 * math.sqrt(var / t.numel())
        assert abs(t.var().item() / var - 1) < 6 * math.sqrt(2 / t.numel()) + 0.02
    assert not torch.allclose(net.psi[0], net.layers[0].weight)
    # Only W_k are parameters; C, Ψ, B are buffers.
    assert {n for n, _ in net.named_parameters()} == {f"layers.{k}.weight" for k in range(L)}
    assert {n for n, _ in net.named_buffers()} == {"C", "psi", "B"}
    # Same generator seed -> same network.
    again = GReLUMLP(d, m, L, dy, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.psi, net.psi) and torch.equal(again.layers[1].weight, net.layers[1].weight)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [(1,), (7,), (33,), (2, 5), (0,)])
def test_gates_are_the_frozen_relu_pattern(device, bias, batch, gen):
    d, m, L = 19, 70, 3  # width not a multiple of 32
    net = GReLUMLP(d, m, L, 3, bias=bias, dtype=torch.float64, generator=gen).to(device)
    if bias:
        with torch.no_grad():
            for b in (net.C_bias, net.psi_bias):
                b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype).to(device) * 0.1)
    x = torch.randn(*batch, d, generator=gen, dtype=torch.float64).to(device)
    gates = net.compute_gates(x)
    assert gates.dtype == torch.int32 and gates.shape == (*batch, L, 3)
    expected = ref.grelu_mlp_gates(x.cpu(), net.C.cpu(), net.psi.cpu(), None if not bias else net.C_bias.cpu(),
                                   None if not bias else net.psi_bias.cpu())
    assert torch.equal(F.unpack_gates(gates, m).cpu(), expected)
    torch.testing.assert_close(net(x).cpu(), ref_forward(net, x).cpu(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_gates_float32(device, gen):
    """float32: the pattern equals the float64 one except where a pre-activation is at round-off."""
    d, m, L = 40, 100, 4
    net = GReLUMLP(d, m, L, 1, generator=gen).to(device)
    x = torch.randn(129, d, generator=gen).to(device)
    got = F.unpack_gates(net.compute_gates(x), m).cpu()
    x64, C, psi = x.double().cpu(), net.C.double().cpu(), net.psi.double().cpu()
    expected = ref.grelu_mlp_gates(x64, C, psi)
    # Pre-activations of the frozen net in float64 (fed by the float64 chain).
    z, pre = torch.relu(x64 @ C.T), []
    for k in range(L):
        pre.append(z @ psi[k].T)
        z = torch.relu(pre[-1])
    near_zero = torch.stack(pre, -2).abs() < 1e-4
    assert torch.equal(got[~near_zero], expected[~near_zero])
    assert 0.4 < expected.float().mean() < 0.6  # about half the gates are on (§4.4)
    torch.testing.assert_close(net(x).double().cpu(), ref_forward(net.cpu(), x.cpu(), got), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_cached_gates(device, gen):
    d, m, L, n = 23, 45, 3, 37
    net = GReLUMLP(d, m, L, 2, dtype=torch.float64, generator=gen).to(device)
    perturb_(net, gen)
    x_all = torch.randn(n, d, generator=gen, dtype=torch.float64).to(device)
    cache = net.cache_gates(x_all)
    assert cache.shape == (n, L, 2) and cache.dtype == torch.int32 and net.gate_cache is cache
    assert torch.equal(cache, net.compute_gates(x_all))
    assert "gate_cache" not in net.state_dict()
    # Full data set, a shuffled subset with repeats, leading batch dimensions.
    for idx in [torch.arange(n), torch.randint(0, n, (11,), generator=gen), torch.randperm(n, generator=gen)[:10].view(2, 5)]:
        idx = idx.to(device)
        xb = x_all[idx]
        torch.testing.assert_close(net(xb, index=idx), net(xb), rtol=0, atol=0)
        torch.testing.assert_close(net(xb, index=idx.int()), net(xb), rtol=0, atol=0)
    # The cache keeps the gates fixed even for other inputs: forward(x', index) uses sample i's gates.
    other = torch.randn(n, d, generator=gen, dtype=torch.float64).to(device)
    expected = ref_forward(net, other, ref.unpack_gates(cache.cpu(), m).to(device))
    torch.testing.assert_close(net(other, index=torch.arange(n, device=device)), expected, rtol=1e-12, atol=1e-12)


def test_cached_gates_bad_input(gen):
    net = GReLUMLP(5, 40, 2, 1, generator=gen)
    x = torch.randn(4, 5, generator=gen)
    with pytest.raises(RuntimeError, match="cache_gates"):
        net(x, index=torch.arange(4))
    net.cache_gates(x)
    with pytest.raises(IndexError, match=r"index must lie in \[0, 4\)"):
        net(x, index=torch.tensor([0, 1, 2, 4]))
    with pytest.raises(IndexError, match="index"):
        net(x, index=torch.tensor([0, -1, 2, 3]))
    with pytest.raises(ValueError, match="batch shape"):
        net(x, index=torch.arange(3))
    with pytest.raises(TypeError, match="integer"):
        net(x, index=torch.arange(4.0))
    with pytest.raises(ValueError, match=r"x_all must be \[n, 5\]"):
        net.cache_gates(torch.randn(4, 6))


def test_only_trained_layers_get_gradients(gen):
    d, m, L, n = 13, 40, 3, 9
    net = GReLUMLP(d, m, L, 2, dtype=torch.float64, generator=gen)
    perturb_(net, gen)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    target = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    net.cache_gates(x)
    for index in (None, torch.arange(n)):
        net.zero_grad(set_to_none=True)
        (0.5 * (net(x, index) - target).pow(2).sum()).backward()
        for b in net.buffers():
            assert not b.requires_grad and b.grad is None
        # Gradients equal autograd through the float64 reference with the same (fixed) gates.
        ws = [layer.weight.detach().clone().requires_grad_() for layer in net.layers]
        y = ref.grelu_mlp(x, net.C, net.psi, ws, net.B)
        grads = torch.autograd.grad(0.5 * (y - target).pow(2).sum(), ws)
        for layer, g in zip(net.layers, grads):
            torch.testing.assert_close(layer.weight.grad, g, rtol=1e-10, atol=1e-10)


def test_input_gradient(gen):
    """x.requires_grad: the gradient reaches x through D_0 C (relu_gates itself has no gradient)."""
    net = GReLUMLP(9, 40, 2, 3, dtype=torch.float64, generator=gen)
    x = torch.randn(7, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    net(x).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    ref_forward(net, x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-10)


def test_gated_linear_module(gen):
    layer = GatedLinear(33, 70, dtype=torch.float64)
    x = torch.randn(2, 7, 33, generator=gen, dtype=torch.float64)
    mask = torch.rand(2, 7, 70, generator=gen) > 0.5
    y = layer(x, F.pack_gates(mask))
    torch.testing.assert_close(y, (x @ layer.weight.T + layer.bias) * mask, rtol=1e-12, atol=1e-12)
    assert "in_features=33, out_features=70, bias=True" in repr(layer)
    assert GatedLinear(4, 5, bias=False).bias is None


@pytest.mark.parametrize("bias", [False, True])
def test_to_relu_is_equivalent(bias, gen):
    """Theorem 2 (§4.1, §10.7): with n ≤ width the ReLU network reproduces the GReLU one exactly."""
    d, m, L, dy, n = 12, 64, 3, 2, 24
    net = GReLUMLP(d, m, L, dy, bias=bias, dtype=torch.float64, generator=gen)
    perturb_(net, gen)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    # A few steps of gradient descent first ("trained for t steps").
    target = torch.randn(n, dy, generator=gen, dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        (0.5 * (net(x) - target).pow(2).sum()).backward()
        opt.step()
    relu_net, dev = net.to_relu(x)
    assert dev <= 1e-8
    kinds = [type(mod) for mod in relu_net]
    assert kinds == [nn.Linear, nn.ReLU] * L + [nn.Linear, nn.Linear]
    assert torch.equal(relu_net[0].weight, net.C) and torch.equal(relu_net[-1].weight, net.B)
    with torch.no_grad():
        y_relu, y = relu_net(x), net(x)
        assert ((y_relu - y).norm(dim=1).max() / y.norm(dim=1).pow(2).mean().sqrt()).item() <= 1e-8
        # Every intermediate feature map matches: ReLU pre-activation of layer k = GReLU h_k, to
        # the float64 rounding of both chains (the few SGD steps may blow the features up by many
        # orders, and W̃_k with them): elementwise within a few γ_{m+1} of their Σ|terms| bounds.
        gates = net.compute_gates(x)
        feats = net._features(x, gates, torch.float64)
        on = ref.unpack_gates(gates, m)
        h = relu_net[:2](x)
        habs = gabs = ref.linear_magnitude(x.abs(), net.C, net.C_bias) * (feats[0] > 0)  # ReLU(C x + c), both chains
        for k in range(1, L + 1):
            u = relu_net[2 * k](h)
            uabs = ref.linear_magnitude(habs, relu_net[2 * k].weight, relu_net[2 * k].bias)
            gabs = ref.linear_magnitude(gabs, net.layers[k - 1].weight, net.layers[k - 1].bias) * on[:, k - 1]
            tol = 4 * (m + 1) * torch.finfo(torch.float64).eps * (uabs + gabs)
            excess = (u - feats[k]).abs() - tol
            assert (excess <= 0).all(), f"layer {k}: error exceeds {tol.flatten()[excess.argmax()]:.3g} by {excess.max():.3g}"
            habs = uabs * (u > 0)
            h = torch.relu(u)
    # Beyond the train set the two networks differ (the equivalence holds on x_train only).
    x_new = torch.randn(n, d, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(relu_net(x_new), net(x_new), rtol=1e-3, atol=1e-3)


def test_to_relu_float32_and_overdetermined(gen):
    d, m, L, n = 10, 64, 2, 16
    net = GReLUMLP(d, m, L, 1, generator=gen)
    perturb_(net, gen)
    x = torch.randn(n, d, generator=gen)
    relu_net, dev = net.to_relu(x)
    assert relu_net[2].weight.dtype == torch.float32 and dev < 1e-5
    # n > width: a least-squares fit, no longer exact, but the deviation is reported honestly.
    x_big = torch.randn(5 * m, d, generator=gen)
    relu_net, dev_big = net.to_relu(x_big)
    y = net(x_big).double()
    y_relu = relu_net.double()(x_big.double())
    measured = ((y_relu - y).norm(dim=1).max() / y.norm(dim=1).pow(2).mean().sqrt()).item()
    assert dev_big > 1e-3 and abs(measured - dev_big) <= 1e-4 * (1 + dev_big)


@pytest.mark.parametrize("bias", [False, True])
def test_from_relu_reproduces_relu_at_step_0(bias, gen):
    d, m, L, dy = 17, 50, 3, 3
    relu_net = relu_mlp(d, m, L, dy, bias, gen)
    net = GReLUMLP.from_relu(relu_net)
    assert (net.depth, net.width, net.in_features, net.out_features) == (L, m, d, dy)
    x = torch.randn(33, d, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(net(x), relu_net(x), rtol=1e-12, atol=1e-12)
        # Ψ_k ← W_k: the gates are the ReLU network's own on/off pattern.
        pre, h = [], x
        for k, mod in enumerate(relu_net):
            h = mod(h)
            if isinstance(mod, nn.Linear) and 0 < k < len(relu_net) - 1:
                pre.append(h > 0)
        assert torch.equal(F.unpack_gates(net.compute_gates(x), m), torch.stack(pre, -2))
    # The copies are independent: training the GReLU net leaves the frozen Ψ (and the ReLU net) alone.
    net.cache_gates(x)
    (net(x, torch.arange(33)).pow(2).sum()).backward()
    torch.optim.SGD(net.parameters(), lr=1e-2).step()
    assert torch.equal(net.psi[0], relu_net[2].weight) and not torch.equal(net.layers[0].weight, relu_net[2].weight)


def test_from_relu_bad_input():
    with pytest.raises(ValueError, match="Linear, ReLU"):
        GReLUMLP.from_relu(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    with pytest.raises(ValueError, match="at least 3 Linear"):
        GReLUMLP.from_relu(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    with pytest.raises(ValueError, match="one width"):
        GReLUMLP.from_relu(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1)))
    with pytest.raises(ValueError, match="bias"):
        GReLUMLP.from_relu(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4, bias=False), nn.ReLU(),
                                         nn.Linear(4, 1)))


@pytest.mark.parametrize("cached", [False, True])
def test_compile_forward_backward(cached, gen):
    d, m, L, n = 11, 40, 2, 9
    net = GReLUMLP(d, m, L, 2, generator=gen)
    x = torch.randn(n, d, generator=gen)
    index = torch.arange(n) if cached else None
    if cached:
        net.cache_gates(x)

    # fullgraph forward; AOTAutograd compiles the backward graph with it.
    compiled = torch.compile(net, fullgraph=True, dynamic=False)
    loss = compiled(x, index).pow(2).sum()
    loss.backward()
    got = [layer.weight.grad.clone() for layer in net.layers]
    net.zero_grad(set_to_none=True)
    expected = net(x, index).pow(2).sum()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for g, layer in zip(got, net.layers):
        torch.testing.assert_close(g, layer.weight.grad, rtol=1e-5, atol=1e-5)
