"""relu_gates, gated_linear, gated_linear_backward (GReLU, paper 004 §2.1, §4.4) against the float64
references: the C++ CPU kernels through torch.ops, and the Triton kernels (launched directly, on CPU
tensors under TRITON_INTERPRET=1 or on CUDA tensors)."""
import itertools

import pytest
import torch

import ist_kernels.functional as F

import reference as ref
from conftest import BAD_INPUT, DEVICES, HAS_CUDA, HAS_TRITON, requires_cuda, requires_triton

ops = torch.ops.ist_kernels

# Normwise relative error bound max|got - ref| / max|ref|: the output rounding of the dtype and the
# accumulation error of a K <= 200 dot product. A wrong tile edge or a wrong bit is an O(1) error.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CPU_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# rows, in_features K, out_features N: N and K not multiples of 32 or of any tile.
CPU_SHAPES = [(1, 40, 70), (7, 33, 1), (33, 64, 97), (129, 200, 45), (1000, 17, 131)]
TRITON_SHAPES = [(1, 40, 70), (7, 33, 5), (33, 20, 97), (129, 40, 70)]
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"

if HAS_TRITON:
    from ist_kernels.ops.grelu import _triton as tg


def rel_err(got, want, mag=None):
    """max|got - want| over max|want|, or over max ``mag`` where given: the same sums taken over
    absolute values, which bound a dot product's rounding error even where it cancels (with one
    output feature a single cancelling sum made max|want| tiny: a 0.2% flake)."""
    if want.numel() == 0:
        return 0.0
    scale = (want if mag is None else mag).abs().max().clamp_min(1e-30)
    return ((got.double().cpu() - want.cpu()).abs().max() / scale).item()


def _abs(*tensors):
    return [None if t is None else t.detach().cpu().double().abs() for t in tensors]


def make(rows, K, N, dtype, gen, device="cpu", lead=None, bias=True):
    shape = (*lead, K) if lead is not None else (rows, K)
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if bias else None
    gates = ref.pack_gates(torch.rand((*shape[:-1], N), generator=gen) > 0.5).to(device)
    return x, w, b, gates


# A backend: (relu_gates, gated_linear, gated_linear_backward, device).
def _cpp():
    return F.relu_gates, lambda x, w, b, g: F.gated_linear(x, w, g, b), ops.gated_linear_backward, "cpu"


def _triton():
    return tg.relu_gates, tg.gated_linear, tg.gated_linear_backward, TRITON_DEVICE


def check_relu_gates(fn, x, w, b):
    out, gates = fn(x, w, b)
    want_out, want_gates = ref.relu_gates(x.cpu(), w.cpu(), None if b is None else b.cpu())
    N = w.shape[0]
    assert out.shape == (*x.shape[:-1], N) and out.dtype == x.dtype
    assert gates.shape == (*x.shape[:-1], (N + 31) // 32) and gates.dtype == torch.int32
    assert rel_err(out, want_out, ref._linear64(*_abs(x, w, b))) <= TOL[x.dtype]
    # The gates are exactly the on/off pattern of the kernel's own output ...
    torch.testing.assert_close(gates.cpu(), ref.pack_gates(out.cpu() > 0), rtol=0, atol=0)
    # ... and the reference's, except where z is within rounding of 0.
    z = ref._linear64(x.cpu(), w.cpu(), None if b is None else b.cpu())
    differ = ref.unpack_gates(gates.cpu(), N) != (z > 0)
    assert (z[differ].abs() <= 4 * TOL[x.dtype] * z.abs().max()).all()


def check_gated_linear(fwd, bwd, x, w, b, gates, gen, mask=(True, True, True)):
    y = fwd(x, w, b, gates)
    assert y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
    want = ref.gated_linear(x.cpu(), w.cpu(), None if b is None else b.cpu(), gates.cpu())
    assert rel_err(y, want, ref.gated_linear(*_abs(x, w, b), gates.cpu())) <= TOL[x.dtype]
    g = torch.randn(y.shape, generator=gen).to(x.dtype).to(x.device)
    got = bwd(g, x, w, gates, list(mask))
    want = ref.gated_linear_backward(g.cpu(), x.cpu(), w.cpu(), gates.cpu())
    mags = ref.gated_linear_backward(*_abs(g, x, w), gates.cpu())
    for on, t, r, m, like in zip(mask, got, want, mags, (x, w, w[:, 0])):
        if not on:
            assert t.shape == (0,)
            continue
        assert t.shape == like.shape and t.dtype == x.dtype, (t.shape, like.shape)
        assert rel_err(t, r, m) <= TOL[x.dtype]


# ---------------------------------------------------------------------------- C++ CPU kernels
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("rows,K,N", CPU_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_matches_reference(rows, K, N, dtype, bias, gen):
    x, w, b, gates = make(rows, K, N, dtype, gen, bias=bias)
    check_relu_gates(F.relu_gates, x, w, b)
    check_gated_linear(_cpp()[1], ops.gated_linear_backward, x, w, b, gates, gen)


@pytest.mark.parametrize("mask", list(itertools.product([False, True], repeat=3)))
def test_cpu_backward_output_mask(mask, gen):
    x, w, b, gates = make(33, 40, 70, torch.float64, gen)
    check_gated_linear(_cpp()[1], ops.gated_linear_backward, x, w, b, gates, gen, mask=mask)


# ---------------------------------------------------------------------------- Triton kernels
@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,K,N", TRITON_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_triton_matches_reference(rows, K, N, dtype, bias, gen):
    x, w, b, gates = make(rows, K, N, dtype, gen, device=TRITON_DEVICE, bias=bias)
    check_relu_gates(tg.relu_gates, x, w, b)
    check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen)


@requires_triton
def test_triton_float64(gen):
    x, w, b, gates = make(33, 40, 70, torch.float64, gen, device=TRITON_DEVICE)
    check_relu_gates(tg.relu_gates, x, w, b)
    check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen)


@requires_triton
@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
@pytest.mark.parametrize("tile", [dict(BM=16, BN=64), dict(BM=8, BN=32)])
def test_triton_backward_output_mask_and_tiles(mask, tile, gen, monkeypatch):
    """Every output_mask, and gate-pass tiles that leave partial tiles at both edges (70 x 45)."""
    monkeypatch.setattr(tg, "INTERPRET_GATE_GRAD_TILE" if not HAS_CUDA else "GATE_GRAD_TILE", tile)
    x, w, b, gates = make(70, 24, 45, torch.float32, gen, device=TRITON_DEVICE)
    check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen, mask=mask)


@requires_triton
@pytest.mark.parametrize("use_tma", [True, False])
def test_triton_fused_kernels_tma_and_pointer(use_tma, gen, monkeypatch):
    """Both fused forward GEMMs: the persistent TMA kernel (aligned, unit-stride operands) and the
    pointer kernel, on shapes with partial tiles; a K whose rows are not 16-byte aligned and a
    transposed x always take the pointer kernel."""
    monkeypatch.setattr(tg, "USE_TMA", use_tma)
    launched = []
    real = tg._launch_tma
    monkeypatch.setattr(tg, "_launch_tma", lambda *a: launched.append(1) or real(*a))
    dtype = torch.float32 if not HAS_CUDA else torch.float16
    for rows, K, N in [(45, 40, 100), (70, 24, 45), (5, 36, 200)]:
        x, w, b, gates = make(rows, K, N, dtype, gen, device=TRITON_DEVICE)
        check_relu_gates(tg.relu_gates, x, w, b)
        check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, None, gates, gen)
    assert bool(launched) == use_tma
    launched.clear()
    x, w, b, gates = make(9, 13, 40, dtype, gen, device=TRITON_DEVICE)  # 13 * 4 B rows: not 16-byte aligned
    check_relu_gates(tg.relu_gates, x, w, b)
    xt = torch.randn(40, 6, generator=gen).to(TRITON_DEVICE, dtype).t()
    check_relu_gates(tg.relu_gates, xt, torch.randn(33, 40, generator=gen).to(TRITON_DEVICE, dtype), None)
    assert not launched


@requires_triton
@pytest.mark.parametrize("tile", [dict(BM=16, BN=64), dict(BM=8, BN=32)])
def test_triton_cublas_epilogue_path(tile, gen, monkeypatch):
    """The forward as a torch GEMM + one gate pass (taken from K >= CUBLAS_EPILOGUE_MIN_K): forced
    here for small K, with pass tiles that leave partial tiles at both edges."""
    monkeypatch.setattr(tg, "CUBLAS_EPILOGUE_MIN_K", 0)
    monkeypatch.setattr(tg, "INTERPRET_GATE_GRAD_TILE" if not HAS_CUDA else "GATE_GRAD_TILE", tile)
    for rows, K, N in [(45, 40, 100), (7, 33, 31), (3, 5, 64)]:
        x, w, b, gates = make(rows, K, N, torch.float32, gen, device=TRITON_DEVICE)
        check_relu_gates(tg.relu_gates, x, w, b)
        check_relu_gates(tg.relu_gates, x, w, None)
        check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen)


@requires_triton
@pytest.mark.parametrize("config", [dict(BM=16, BN=32, BK=16, GROUP_M=1), dict(BM=32, BN=128, BK=32, GROUP_M=3)])
def test_triton_other_tiles(config, gen, monkeypatch):
    if HAS_CUDA:
        pytest.skip("tile configs are autotuned on a GPU")
    monkeypatch.setattr(tg, "INTERPRET_CONFIG", config)
    x, w, b, gates = make(45, 40, 100, torch.float32, gen, device=TRITON_DEVICE)
    check_relu_gates(tg.relu_gates, x, w, b)
    check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen)


@requires_cuda
@requires_triton
@pytest.mark.parametrize("rows,K,N", TRITON_SHAPES + [(1000, 256, 333)])
def test_triton_bf16_cuda(rows, K, N, gen):
    x, w, b, gates = make(rows, K, N, torch.bfloat16, gen, device="cuda")
    check_relu_gates(tg.relu_gates, x, w, b)
    check_gated_linear(tg.gated_linear, tg.gated_linear_backward, x, w, b, gates, gen)


# ---------------------------------------------------------------------------- layouts, edge sizes
BACKENDS = ["cpp"] + (["triton"] if HAS_TRITON else [])


def backend(name):
    return _cpp() if name == "cpp" else _triton()


@pytest.mark.parametrize("name", BACKENDS)
def test_leading_batch_dims(name, gen):
    rg, gl, glb, device = backend(name)
    x, w, b, gates = make(None, 40, 70, torch.float32, gen, device=device, lead=(2, 3, 5))
    check_relu_gates(rg, x, w, b)
    check_gated_linear(gl, glb, x, w, b, gates, gen)
    x1, w1, b1, g1 = make(None, 40, 70, torch.float32, gen, device=device, lead=())  # x is 1-D
    check_relu_gates(rg, x1, w1, b1)
    check_gated_linear(gl, glb, x1, w1, b1, g1, gen)


@pytest.mark.parametrize("name", BACKENDS)
def test_noncontiguous(name, gen):
    rg, gl, glb, device = backend(name)
    x = torch.randn(40, 33, generator=gen).to(device).t()  # [33, 40], column-major
    w = torch.randn(140, 40, generator=gen).to(device)[::2]  # [70, 40], strided rows
    b = torch.randn(140, generator=gen).to(device)[1::2]
    gates = ref.pack_gates(torch.rand(33, 70, generator=gen) > 0.5).to(device)
    gates = torch.stack([gates, gates], -1)[..., 1]  # non-contiguous words
    assert not (x.is_contiguous() or w.is_contiguous() or b.is_contiguous() or gates.is_contiguous())
    check_relu_gates(rg, x, w, b)
    y = gl(x, w, b, gates)
    assert rel_err(y, ref.gated_linear(x.cpu(), w.cpu(), b.cpu(), gates.cpu())) <= TOL[torch.float32]
    g = torch.randn(70, 33, generator=gen).to(device).t()  # non-contiguous grad_out
    got = glb(g, x, w, gates, [True, True, True])
    for t, r in zip(got, ref.gated_linear_backward(g.cpu(), x.cpu(), w.cpu(), gates.cpu())):
        assert rel_err(t, r) <= TOL[torch.float32]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("rows,K,N", [(0, 40, 70), (5, 0, 70), (5, 40, 0), (0, 0, 0)])
def test_empty(name, rows, K, N, gen):
    rg, gl, glb, device = backend(name)
    x, w, b, gates = make(None, K, N, torch.float32, gen, device=device, lead=(2, rows))
    out, g = rg(x, w, b)
    assert out.shape == (2, rows, N) and g.shape == (2, rows, (N + 31) // 32)
    torch.testing.assert_close(out.cpu(), ref.relu_gates(x.cpu(), w.cpu(), b.cpu())[0].float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(g.cpu(), ref.pack_gates(out.cpu() > 0), rtol=0, atol=0)
    y = gl(x, w, b, gates)
    torch.testing.assert_close(y.cpu(), ref.gated_linear(x.cpu(), w.cpu(), b.cpu(), gates.cpu()).float(),
                               rtol=0, atol=1e-6)
    grad = torch.randn(y.shape, generator=gen).to(device)
    got = glb(grad, x, w, gates, [True, True, True])
    for t, r in zip(got, ref.gated_linear_backward(grad.cpu(), x.cpu(), w.cpu(), gates.cpu())):
        assert t.shape == r.shape
        torch.testing.assert_close(t.cpu(), r.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_nan_propagates(name, gen):
    """relu keeps NaN (as torch.relu) with its gate off; the gate multiply keeps NaN at off gates
    (as z * mask does), so a NaN is never hidden."""
    rg, gl, glb, device = backend(name)
    x, w, b, _ = make(5, 16, 40, torch.float32, gen, device=device)
    x[2, 3] = float("nan")
    out, gates = rg(x, w, b)
    assert out[2].isnan().all() and not out[[0, 1, 3, 4]].isnan().any()
    assert (gates[2] == 0).all()
    y = gl(x, w, b, gates)  # row 2 has every gate off
    assert y[2].isnan().all() and not y[[0, 1, 3, 4]].isnan().any()


# ---------------------------------------------------------------------------- torch.library
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    x, w, b, gates = make(None, 37, 45, torch.float32, gen, device=device, lead=(3, 5))
    torch.library.opcheck(ops.relu_gates.default, (x, w, b))
    torch.library.opcheck(ops.relu_gates.default, (x, w, None))
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    torch.library.opcheck(ops.gated_linear.default, (xg, wg, bg, gates))
    torch.library.opcheck(ops.gated_linear.default, (xg, wg, None, gates))
    g = torch.randn(3, 5, 45, generator=gen).to(device)
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(ops.gated_linear_backward.default, (g, x, w, gates, mask))


def test_gradcheck(gen):
    x, w, b, gates = make(None, 5, 35, torch.float64, gen, lead=(2, 3))  # 35 features: 2 gate words
    args = [x.requires_grad_(), w.requires_grad_(), gates, b.requires_grad_()]
    assert torch.autograd.gradcheck(F.gated_linear, args)
    assert torch.autograd.gradcheck(lambda x, w: F.gated_linear(x, w, gates), (x, w), fast_mode=True)


def test_autograd_matches_reference(gen):
    x, w, b, gates = make(None, 20, 33, torch.float32, gen, lead=(4, 3))
    x.requires_grad_(), w.requires_grad_()  # bias without grad: no grad_bias is computed
    y = F.gated_linear(x, w, gates, b)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    dx, dw, _ = ref.gated_linear_backward(g, x.detach(), w.detach(), gates)
    assert rel_err(x.grad, dx) <= TOL[torch.float32] and rel_err(w.grad, dw) <= TOL[torch.float32]


def test_relu_gates_has_no_gradient(gen):
    x, w, b, _ = make(5, 8, 40, torch.float32, gen)
    out, gates = F.relu_gates(x, w.requires_grad_(), b)
    assert gates.dtype == torch.int32 and not gates.requires_grad
    with pytest.raises(RuntimeError, match="relu_gates has no gradient"):
        out.sum().backward()
    out, _ = F.relu_gates(x, w.detach(), b)  # the frozen gate network: no graph at all
    assert not out.requires_grad


def test_compile_forward_backward(gen):
    """A GReLU layer, gates from the frozen network, the trained layer gated: one graph, fwd + bwd."""
    x, psi, c, _ = make(None, 24, 70, torch.float32, gen, lead=(3, 11))
    _, w, b, _ = make(None, 24, 70, torch.float32, gen, lead=(3, 11))

    def layer(x, psi, c, w, b):
        _, gates = F.relu_gates(x, psi, c)
        return F.gated_linear(x, w, gates, b).square().sum()

    compiled = torch.compile(layer, fullgraph=True)
    grads = []
    for fn in (layer, compiled):
        wi, bi, xi = w.clone().requires_grad_(), b.clone().requires_grad_(), x.clone().requires_grad_()
        loss = fn(xi, psi, c, wi, bi)
        loss.backward()
        grads.append((loss.detach(), xi.grad, wi.grad, bi.grad))
    for e, c_ in zip(*grads):
        torch.testing.assert_close(c_, e, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- bad input
def _bad_cases():
    x = torch.randn(7, 40)
    w = torch.randn(70, 40)
    b = torch.randn(70)
    G = torch.zeros(7, 3, dtype=torch.int32)
    g = torch.randn(7, 70)
    return [
        ("gated_linear", (x, w, b, G.long()), "gates must be int32"),
        ("gated_linear", (x, w, b, G[:, :2]), r"gates must be \[7, 3\]"),
        ("gated_linear", (x, w, b, torch.zeros(1, 7, 3, dtype=torch.int32)), r"gates must be \[7, 3\]"),
        ("gated_linear", (x, w[:, :39], b, G), "x has 40 features .* weight expects 39"),
        ("gated_linear", (x, w, b[:69], G), r"bias must be \[70\]"),
        ("gated_linear", (x, w, b.double(), G), "bias must have x's dtype"),
        ("gated_linear", (x, w.double(), b, G), "weight must have x's dtype"),
        ("gated_linear", (x.int(), w.int(), b.int(), G), "x must be float32, float64, bfloat16 or float16"),
        ("gated_linear", (x, w[0], b, G), "weight must be 2-D"),
        ("gated_linear", (x, w.to("meta"), b, G), "weight is on meta but x is on cpu"),
        ("gated_linear", (x, w, b, G.to("meta")), "gates is on meta but x is on cpu"),
        ("relu_gates", (x, w[:, :39], b), "x has 40 features"),
        ("relu_gates", (x, w, b[:3]), r"bias must be \[70\]"),
        ("relu_gates", (x.long(), w.long(), None), "x must be float32"),
        ("relu_gates", (torch.tensor(1.0), w, b), "x must have at least 1 dimension"),
        ("relu_gates", (x, w, b.to("meta")), "bias is on meta but x is on cpu"),
        ("gated_linear_backward", (g[:, :69], x, w, G, [True] * 3), r"grad_out must be \[7, 70\]"),
        ("gated_linear_backward", (g.double(), x, w, G, [True] * 3), "grad_out must have x's dtype"),
        ("gated_linear_backward", (g, x, w, G[:6], [True] * 3), r"gates must be \[7, 3\]"),
        ("gated_linear_backward", (g, x, w[:, :3], G, [True] * 3), "x has 40 features"),
    ]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input(name, case):
    op, args, match = _bad_cases()[case]
    if name == "cpp":
        fn = getattr(ops, op)
    else:
        if HAS_CUDA:
            args = tuple(a.cuda() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args)
            match = match.replace("on cpu", "on cuda:0")
        fn = getattr(tg, op)
    before = [a.clone() for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    with pytest.raises(BAD_INPUT, match=match):
        fn(*args)
    after = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    for u, v in zip(before, after):  # nothing written
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("name", BACKENDS + ["fake"])
def test_output_mask_of_the_wrong_length(name, gen):
    """Issue 10, item 8: output_mask of the wrong length got the dispatcher's "Tried to convert a
    List with 2 elements to a fixed-size array"; every path names output_mask."""
    x, w, _, gates = make(3, 5, 7, torch.float32, gen)
    g = torch.randn(3, 7, generator=gen)
    if name == "fake":
        fn, (g, x, w, gates) = ops.gated_linear_backward, (t.to("meta") for t in (g, x, w, gates))
    else:
        fn = backend(name)[2]
    for mask in ([True, True], [True] * 4, []):
        with pytest.raises(ValueError, match=rf"output_mask must have 3 entries \(grad_x, grad_weight, grad_bias\), "
                                             rf"got {len(mask)}"):
            fn(g, x, w, gates, mask)
