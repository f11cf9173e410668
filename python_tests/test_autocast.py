"""Autocast, end to end (issue 11 item 1): every GEMM-shaped op casts its floating inputs to the
autocast dtype (csrc/autocast.cpp), its kernels never re-enter autocast themselves (so the real
output dtype is the fake kernel's), and every module trains under autocast, forward and backward,
eager and compiled, within the autocast dtype's tolerance of the float64 reference of the math
(python_tests/reference.py). CPU bf16 here; CUDA bf16 / fp16 in the GPU suite."""
import copy

import pytest
import torch
import torch.nn.functional as TF

from ist_kernels.nn import GatedLinear, GReLUMLP, MaskedConv2d, MaskedLinear, SubnetMLP

import reference as ref
from conftest import DEVICES

ops = torch.ops.ist_kernels
_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
AMP = [pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
       pytest.param("cuda", torch.bfloat16, marks=_gpu, id="cuda-bf16"),
       pytest.param("cuda", torch.float16, marks=_gpu, id="cuda-fp16")]
COMPILED = [pytest.param(False, id="eager"), pytest.param(True, id="compiled")]
# Largest error allowed, relative to the reference's largest magnitude: a few roundings of the
# autocast dtype (8 significant bits for bf16, 11 for fp16) on inputs, products and outputs.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def assert_amp_close(got, want, dtype, what, bound=None, scale=None):
    """``got`` (computed under autocast) is within TOL[dtype] of the float64 ``want``, relative to
    ``want``'s largest magnitude (elementwise relative errors are meaningless where want ~ 0), or
    to ``scale`` where given (the Σ|terms| of a last sum whose result may cancel below its terms).

    ``bound`` (want's shape), where given, is the same computation on absolute values (the Σ|terms|
    of every sum, the rounding-error bound of a chain of sums): each element's error must then be
    within TOL[dtype] of its own bound. Use it where cancellation makes want small against the
    terms summed, as in a multi-layer network, where want's max says nothing of the rounding."""
    assert got.shape == want.shape, what
    diff = (got.double() - want.double()).abs()
    if bound is not None:
        excess = diff - TOL[dtype] * bound.double()
        i = int(excess.argmax()) if excess.numel() else 0
        assert not excess.numel() or excess.reshape(-1)[i] <= 0, (
            f"{what}: error {diff.reshape(-1)[i]:.3g} at element {i} vs bound {bound.reshape(-1)[i]:.3g}")
        return
    if scale is None:
        scale = want.abs().max().item() if want.numel() else 0.0
    err = diff.max().item() if want.numel() else 0.0
    assert err <= TOL[dtype] * max(scale, 1e-6), f"{what}: max error {err:.3g} vs scale {scale:.3g}"


def randn(*shape, gen, device, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=dtype).to(device)


def maybe_compile(fn, compiled):
    """``fn`` compiled (fullgraph) or as is. Dynamo's cache is per code object, and every test's
    function is the same code (``under_autocast``'s ``run``) closing over other values: without a
    reset, one process's ninth compiled test hit the recompile limit (8) and fullgraph failed it
    (an H200 run with 4 xdist workers, 2026-11-27)."""
    if not compiled:
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=False)


def under_autocast(fn, device, dtype):
    """fn run inside torch.autocast(device, dtype) (inside the function, so a compiled fn traces it)."""
    def run(*args):
        with torch.autocast(device, dtype):
            return fn(*args)
    return run


def gates_agree(got_words, pre, dtype, what):
    """Gates computed under autocast equal pack(pre > 0) of the float64 pre-activations ``pre``
    wherever |pre| is clear of the autocast dtype's rounding (near 0 the sign may flip)."""
    on = ref.unpack_gates(got_words, pre.shape[-1])
    clear = pre.abs() > TOL[dtype] * pre.abs().max()
    assert torch.equal(on[clear], (pre > 0)[clear]), what
    assert clear.float().mean() > 0.5, what  # the comparison covered most gates


# ------------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_relu_gates(device, dtype, compiled, gen):
    x, w, b = randn(4, 3, 37, gen=gen, device=device), randn(45, 37, gen=gen, device=device), \
        randn(45, gen=gen, device=device)
    # x already in the autocast dtype (an earlier autocast layer's output), weight and bias fp32
    out, gates = maybe_compile(under_autocast(ops.relu_gates, device, dtype), compiled)(x.to(dtype), w, b)
    assert out.dtype == dtype and gates.dtype == torch.int32
    want, _ = ref.relu_gates(x, w, b)
    assert_amp_close(out, want, dtype, "relu_gates out")
    gates_agree(gates, ref._linear64(x, w, b), dtype, "relu_gates gates")


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_gated_linear_forward_backward(device, dtype, compiled, gen):
    x = randn(5, 37, gen=gen, device=device).requires_grad_()
    w = randn(45, 37, gen=gen, device=device).requires_grad_()
    b = randn(45, gen=gen, device=device).requires_grad_()
    gates = ref.pack_gates(torch.rand(5, 45, generator=gen) > 0.4).to(device)
    y = maybe_compile(under_autocast(ops.gated_linear, device, dtype), compiled)(x, w, b, gates)
    assert y.dtype == dtype
    assert_amp_close(y, ref.gated_linear(x.detach(), w.detach(), b.detach(), gates), dtype, "gated_linear")
    g = randn(5, 45, gen=gen, device=device).to(dtype)  # the reference gets the cotangent the backward gets
    y.backward(g)
    want = ref.gated_linear_backward(g, x.detach(), w.detach(), gates)
    for t, wt, name in zip((x, w, b), want, ("grad_x", "grad_weight", "grad_bias")):
        assert t.grad.dtype == torch.float32, name  # autograd casts back to the leaf's dtype
        assert_amp_close(t.grad, wt, dtype, name)


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_subnet_linear_forward_backward(device, dtype, compiled, gen):
    x = randn(2, 3, 6, gen=gen, device=device).requires_grad_()
    w = randn(11, 9, gen=gen, device=device).requires_grad_()
    b = randn(11, gen=gen, device=device).requires_grad_()
    rows = torch.tensor([7, 0, 3, 10], device=device)
    cols = torch.tensor([8, 2, 5, 0, 1, 4], device=device)  # int64 index lists: never cast
    y = maybe_compile(under_autocast(ops.subnet_linear, device, dtype), compiled)(x, w, b, rows, cols)
    assert y.dtype == dtype
    assert_amp_close(y, ref.subnet_linear(x.detach(), w.detach(), b.detach(), rows, cols), dtype, "subnet_linear")
    g = randn(2, 3, 4, gen=gen, device=device).to(dtype)  # the reference gets the cotangent the backward gets
    y.backward(g)
    want = ref.subnet_linear_backward(g, x.detach(), w.detach(), rows, cols)
    for t, wt, name in zip((x, w, b), want, ("grad_x", "grad_weight", "grad_bias")):
        assert t.grad.dtype == torch.float32, name
        assert_amp_close(t.grad, wt, dtype, name)


@pytest.mark.parametrize("device,dtype", AMP)
def test_backward_ops_autocast(device, dtype, gen):
    """The backward ops called inside an autocast region (a backward run there, or a user calling
    them) cast like the forwards; integer gates / index lists and the output mask pass through."""
    x, w = randn(5, 37, gen=gen, device=device), randn(45, 37, gen=gen, device=device)
    g = randn(5, 45, gen=gen, device=device)
    gates = ref.pack_gates(torch.rand(5, 45, generator=gen) > 0.5).to(device)
    with torch.autocast(device, dtype):
        got = ops.gated_linear_backward(g, x, w, gates, [True, True, True])
    for t, wt, name in zip(got, ref.gated_linear_backward(g, x, w, gates), ("grad_x", "grad_weight", "grad_bias")):
        assert t.dtype == dtype, name
        assert_amp_close(t, wt, dtype, f"gated_linear_backward {name}")
    rows, cols = torch.tensor([44, 3, 9], device=device), None
    g = randn(5, 3, gen=gen, device=device)
    with torch.autocast(device, dtype):
        got = ops.subnet_linear_backward(g.to(dtype), x, w, rows, cols, [True, True, False])
    want = ref.subnet_linear_backward(g, x, w, rows, cols)
    assert got[2].numel() == 0
    for t, wt, name in zip(got[:2], want[:2], ("grad_x", "grad_weight")):
        assert t.dtype == dtype, name
        assert_amp_close(t, wt, dtype, f"subnet_linear_backward {name}")


def test_float64_and_disabled_autocast_untouched(gen):
    """float64 tensors are not cast (as torch's own autocast ops), and autocast(enabled=False) is a no-op."""
    x, w = randn(4, 9, gen=gen, device="cpu", dtype=torch.float64), randn(6, 9, gen=gen, device="cpu",
                                                                         dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        assert ops.subnet_linear(x, w, None, None, None).dtype == torch.float64
    with torch.autocast("cpu", torch.bfloat16, enabled=False):
        assert ops.relu_gates(x.float(), w.float(), None)[0].dtype == torch.float32


@pytest.mark.parametrize("op", ["relu_gates", "gated_linear", "gated_linear_backward", "subnet_linear",
                                "subnet_linear_backward"])
def test_autocast_kernels_registered(op):
    for key in ("AutocastCPU", "AutocastCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ist_kernels::{op}", key), (op, key)


def test_cpu_kernels_never_reenter_autocast(gen):
    """Reaching a CPU kernel with autocast on but bypassing the op's autocast kernel (the dispatcher
    state a kernel sees when called from another kernel): its ATen GEMMs must not autocast, or its
    output dtype would differ from its inputs' (and from the fake kernel's)."""
    x, w, b = randn(5, 7, gen=gen, device="cpu"), randn(9, 7, gen=gen, device="cpu"), randn(9, gen=gen, device="cpu")
    gates = ref.pack_gates(torch.rand(5, 9, generator=gen) > 0.5)
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with torch.autocast("cpu", torch.bfloat16):
        outs = [ops.relu_gates.default.redispatch(cpu, x, w, b)[0],
                ops.gated_linear.default.redispatch(cpu, x, w, b, gates),
                *ops.gated_linear_backward.default.redispatch(cpu, x.new_ones(5, 9), x, w, gates, [True] * 3),
                ops.subnet_linear.default.redispatch(cpu, x, w, b, None, None),
                *ops.subnet_linear_backward.default.redispatch(cpu, x.new_ones(5, 9), x, w, None, None, [True] * 3)]
    assert [o.dtype for o in outs] == [torch.float32] * len(outs)


# --------------------------------------------------------------------------------------- modules
def _train_step(module, call, device, dtype, compiled, gen, out_shape):
    """Forward under autocast (eager or compiled) and backward of a random cotangent; returns
    (output, cotangent). The cotangent is drawn in the autocast dtype, as the output's gradient
    is, so the float64 reference differentiates with the very values the backward got (a
    reference with the unrounded one would charge the test's own rounding of g to the module:
    a bias gradient Σ g over 60 positions cancels to far below Σ|g|, and it did)."""
    y = maybe_compile(under_autocast(call, device, dtype), compiled)()
    assert y.dtype == dtype
    g = randn(*out_shape, gen=gen, device=device).to(dtype)
    y.backward(g)
    for p in module.parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype == torch.float32
    return y, g


def _ref_grads(params64, out64, g):
    return torch.autograd.grad(out64, params64, g.double())


def _leaf64(t):
    return t.detach().double().requires_grad_()


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_gated_linear_module(device, dtype, compiled, gen):
    layer = GatedLinear(37, 45, bias=True).to(device)
    x = randn(6, 37, gen=gen, device=device)
    gates = ref.pack_gates(torch.rand(6, 45, generator=gen) > 0.5).to(device)
    y, g = _train_step(layer, lambda: layer(x, gates), device, dtype, compiled, gen, (6, 45))
    w64, b64 = _leaf64(layer.weight), _leaf64(layer.bias)
    want = ref.gated_linear(x, w64, b64, gates)
    assert_amp_close(y, want, dtype, "GatedLinear")
    for p, wg, name in zip((layer.weight, layer.bias), _ref_grads([w64, b64], want, g), ("weight", "bias")):
        assert_amp_close(p.grad, wg, dtype, f"GatedLinear grad {name}")


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_grelu_mlp(device, dtype, compiled, gen):
    """The issue's failing case: GReLUMLP under autocast. The gates are a discontinuous function of
    the frozen network, so the reference runs on the gates the autocast forward used, and those
    gates are checked against the float64 ones wherever the sign is clear of bf16 rounding."""
    net = GReLUMLP(in_features=11, width=40, depth=2, out_features=3, generator=gen).to(device)
    x = randn(7, 11, gen=gen, device=device)
    y, g = _train_step(net, lambda: net(x), device, dtype, compiled, gen, (7, 3))
    with torch.autocast(device, dtype):
        words = net.compute_gates(x)  # [7, L, words]
    on = ref.unpack_gates(words, 40)
    # float64 pre-activations of the frozen network, layer by layer
    z = torch.relu(x.double() @ net.C.double().T)
    for k in range(2):
        pre = z @ net.psi[k].double().T
        gates_agree(words[:, k], pre, dtype, f"GReLUMLP gates of layer {k + 1}")
        z = torch.relu(pre)
    weights = [_leaf64(layer.weight) for layer in net.layers]
    want = ref.grelu_mlp(x, net.C, net.psi, weights, net.B, gates=on)
    # The 3-layer chain's outputs and gradients cancel (7 rows, 3 outputs) far below the terms
    # summed, so max|want| says nothing of the rounding. The output's error is held to the Σ|terms|
    # of its last sum B h_L (the scale of h_L's rounding that B carries to it); each gradient
    # element to its own rounding-error bound, the network on absolute values (C x's relu dropped:
    # bf16 may take either side of its kink, moving h_0 by a rounding) differentiated with |g|.
    # (That bound of the output is ~300x its error, too loose to see a wrong gate.)
    h_last = ref.grelu_mlp(x, net.C, net.psi, weights, torch.eye(net.width, dtype=torch.float64, device=device), gates=on)
    assert_amp_close(y, want, dtype, "GReLUMLP", scale=(h_last.abs() @ net.B.double().abs().T).max().item())
    abs_weights = [w.detach().abs().requires_grad_() for w in weights]
    out_bound = ref.grelu_mlp(x.abs(), net.C.abs(), net.psi, abs_weights, net.B.abs(), gates=on)
    grad_bounds = torch.autograd.grad(out_bound, abs_weights, g.double().abs())
    for layer, wg, bd in zip(net.layers, _ref_grads(weights, want, g), grad_bounds):
        assert_amp_close(layer.weight.grad, wg, dtype, "GReLUMLP grad W_k", bound=bd)


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
def test_subnet_mlp(device, dtype, compiled, gen):
    """The 3-layer chain's outputs and gradients cancel (5 rows, 3 outputs), so each element is
    checked against its own rounding-error bound (``_subnet_mlp_bounds``). The input is drawn clear
    of the relus' kinks, as gradcheck needs: a pre-activation within rounding of 0 may take either
    side in bf16, and a flipped relu changes a whole gradient row, not by a rounding."""
    net = SubnetMLP(in_features=9, width=24, out_features=3, depth=2, bias=True, train_output=True,
                    generator=gen).to(device)
    neurons = [torch.tensor([0, 3, 4, 9, 17, 23], device=device), torch.tensor([1, 2, 8, 20], device=device)]
    hw = [_leaf64(w) for w in net.hidden_weights]
    hb = [_leaf64(b) for b in net.hidden_biases]
    ow, ob = _leaf64(net.output_weight), _leaf64(net.output_bias)
    for _ in range(1000):
        x = randn(5, 9, gen=gen, device=device)
        if _clear_of_kinks(x, hw, hb, neurons, net.scale, margin=2 * TOL[dtype]):
            break
    else:
        pytest.fail("no input clear of the relu kinks in 1000 draws")
    y, g = _train_step(net, lambda: net(x, neurons), device, dtype, compiled, gen, (5, 3))
    want = ref.neurons_subnet_mlp(x, hw, hb, ow, ob, neurons, net.scale)
    out_bound, grad_bounds = _subnet_mlp_bounds(x, hw, hb, ow, ob, neurons, net.scale, g)
    assert_amp_close(y, want, dtype, "SubnetMLP", bound=out_bound)
    params = [*net.hidden_weights, *net.hidden_biases, net.output_weight, net.output_bias]
    for i, (p, wg, bd) in enumerate(zip(params, _ref_grads([*hw, *hb, ow, ob], want, g), grad_bounds)):
        assert_amp_close(p.grad, wg, dtype, f"SubnetMLP grad of parameter {i}", bound=bd)


def _subnet_mlp_layers(x, hw, hb, neurons, scale):
    """Yield (z, |z| bound, subnetwork mask) per hidden layer of neurons_subnet_mlp: the float64
    pre-activation and the same sum over absolute values (relus as in the float64 forward)."""
    h, habs = x.detach().double(), x.detach().double().abs()
    for layer, (w, b) in enumerate(zip(hw, hb)):
        z = h @ w.detach().T + b.detach()
        zabs = ref.linear_magnitude(habs, w, b)
        keep = torch.zeros(w.shape[0], dtype=torch.float64, device=z.device)
        keep[neurons[layer]] = 1.0
        yield z, zabs, keep
        h, habs = torch.relu(z) * keep * scale, zabs * (z > 0) * keep * scale


def _clear_of_kinks(x, hw, hb, neurons, scale, margin):
    """No pre-activation of a kept neuron within ``margin`` of its absolute bound from 0."""
    return all(bool((z.abs() > margin * zabs)[:, keep.bool()].all())
               for z, zabs, keep in _subnet_mlp_layers(x, hw, hb, neurons, scale))


def _subnet_mlp_bounds(x, hw, hb, ow, ob, neurons, scale, g):
    """Rounding-error bounds of neurons_subnet_mlp's output and of its parameters' gradients for the
    cotangent g: the forward on |x|, |W|, |b| (relus as in the float64 forward) and autograd of it
    with |g|, so every sum in the chain is replaced by its Σ|terms|."""
    leaves = [t.detach().abs().requires_grad_() for t in (*hw, *hb, ow, ob)]
    aw, ab, (aow, aob) = leaves[:len(hw)], leaves[len(hw):2 * len(hw)], leaves[-2:]
    habs = x.detach().double().abs()
    for layer, (z, _, keep) in enumerate(_subnet_mlp_layers(x, hw, hb, neurons, scale)):
        habs = (habs @ aw[layer].T + ab[layer]) * (z > 0) * keep * scale
    out = habs @ aow.T + aob
    return out.detach(), torch.autograd.grad(out, leaves, g.double().abs())


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("device,dtype", AMP)
@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_masked_layers(kind, device, dtype, compiled, gen):
    if kind == "linear":
        layer = MaskedLinear(13, 10, p=0.4, generator=gen).to(device)
        x, out_shape = randn(6, 13, gen=gen, device=device), (6, 10)
        math = lambda w, b: TF.linear(x.double(), w * layer.mask.double(), b)  # noqa: E731
    else:
        layer = MaskedConv2d(3, 5, 3, padding=1, p=0.4, generator=gen).to(device)
        x, out_shape = randn(2, 3, 6, 5, gen=gen, device=device), (2, 5, 6, 5)
        math = lambda w, b: TF.conv2d(x.double(), w * layer.mask.double(), b, padding=1)  # noqa: E731
    y, g = _train_step(layer, lambda: layer(x), device, dtype, compiled, gen, out_shape)
    w64, b64 = _leaf64(layer.weight), _leaf64(layer.bias)
    want = math(w64, b64)
    assert_amp_close(y, want, dtype, f"Masked {kind}")
    gw, gb = _ref_grads([w64, b64], want, g)
    assert_amp_close(layer.weight.grad, gw, dtype, f"Masked {kind} grad weight")
    assert torch.all(layer.weight.grad[~layer.mask.bool()] == 0)  # pruned entries get no gradient
    assert_amp_close(layer.bias.grad, gb, dtype, f"Masked {kind} grad bias")


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_grelu_train_steps_with_grad_scaler(gen, device):
    """fp16 GReLUMLP steps through torch.amp.GradScaler do what GradScaler promises: a step whose
    scaled gradients overflow fp16 is skipped (the parameters unchanged) and the scale lowered, and
    the first step taken has finite gradients equal to the float64 reference. An overflow happens
    exactly where the reference gradient times the scale passes fp16's largest value (65504): at the
    initial scale 2^16 a gradient above ~1 overflows, which is GradScaler's design, not the op's (the
    CUDA failure of 2026-11-28, seed 3384030034: its largest reference gradient x 2^16 was 66456)."""
    net = GReLUMLP(in_features=11, width=64, depth=2, out_features=3, generator=gen).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device)
    x = torch.randn(32, 11, generator=gen).to(device)
    y = torch.randint(0, 3, (32,), generator=gen).to(device)
    # the float64 reference of the unscaled gradients (the gates of the fixed gate network, as the net computes them)
    net64 = GReLUMLP(in_features=11, width=64, depth=2, out_features=3).to(device).double()
    net64.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in net.state_dict().items()})
    TF.cross_entropy(net64(x.double()), y).backward()
    want = {n: p.grad for n, p in net64.named_parameters()}
    for _ in range(8):  # the scale halves after each overflow: 2^16 -> 2^9 at most here
        scale = scaler.get_scale()
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.float16):
            loss = TF.cross_entropy(net(x).float(), y)
        scaler.scale(loss).backward()
        overflowed = not all(torch.isfinite(p.grad).all() for p in net.parameters())
        biggest = max(float(want[n].abs().max()) * scale for n, _ in net.named_parameters())
        if biggest < 0.9 * 65504:
            assert not overflowed, ("an overflow the scale does not explain", biggest)
        if biggest > 1.1 * 65504:
            assert overflowed, ("no overflow where the scaled gradient passes fp16's range", biggest)
        net_before = copy.deepcopy(net)
        scaler.step(opt)
        scaler.update()
        if overflowed:  # skipped, the scale lowered
            assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
            assert scaler.get_scale() < scale
            continue
        # unscaled by scaler.step: the gradients of the same fp16 step at scale 1 (a power-of-two scale is exact in
        # fp16 short of overflow and underflow; fp16's own gates may differ from float64's, so not the reference)
        got = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        with torch.autocast(device, torch.float16):
            TF.cross_entropy(net_before(x).float(), y).backward()
        for n, p in net_before.named_parameters():
            torch.testing.assert_close(got[n], p.grad, rtol=1e-3, atol=1e-3 * float(p.grad.abs().max()))
        assert not all(torch.equal(a, p) for a, p in zip(before, net.parameters()))
        return
    raise AssertionError("no step was taken in 8 tries")
