"""subnet_linear (IST, paper 001 §3.1): y = x W[rows][:, cols]^T + b[rows], gradients full-size.

The op is tested on every device (CPU: the C++ kernels; CUDA: the Triton kernels); the Triton launch
functions are also called directly on CPU tensors under TRITON_INTERPRET=1 (fp32/fp16, tiny shapes).
"""
import pytest
import torch
import torch.nn.functional as TF

import ist_kernels.functional as F

import reference as ref
from conftest import BAD_INPUT, DEVICES, HAS_CUDA, HAS_TRITON, requires_cuda, requires_triton

op = torch.ops.ist_kernels.subnet_linear
op_backward = torch.ops.ist_kernels.subnet_linear_backward

# (leading dims of x, out_features N, in_features K, len(rows) or None, len(cols) or None)
CASES = [
    ((1,), 1, 1, None, None),
    ((7,), 33, 31, 5, None),
    ((33,), 129, 70, None, 33),
    ((2, 3), 70, 129, 64, 7),
    ((129,), 40, 33, 40, 33),  # every index, permuted
    ((5,), 20, 17, 0, 9),  # no outputs
    ((5,), 20, 17, 6, 0),  # no inputs: y = b[rows]
    ((0,), 20, 17, 6, 5),  # empty batch
    ((3,), 0, 0, None, None),  # empty layer
]
# Small cases for the Triton interpreter (slow): odd sizes, tile edges of the 16-wide test tiles.
TRITON_CASES = [((7,), 33, 31, 5, None), ((2, 9), 37, 45, 20, 17), ((17,), 19, 33, None, 33), ((4,), 20, 17, 6, 0),
                ((5,), 20, 17, 0, 9)]


def dtypes_of(device):
    return [torch.float32, torch.float64, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


def tol(dtype, K=64):
    """Tolerances vs the float64 reference: a few ulps of the output dtype at the sum's scale."""
    scale = max(K, 1) ** 0.5
    return {
        torch.float64: dict(rtol=1e-12, atol=1e-12 * scale),
        torch.float32: dict(rtol=1e-5, atol=2e-6 * scale),
        torch.float16: dict(rtol=2e-3, atol=1e-3 * scale),
        torch.bfloat16: dict(rtol=1.6e-2, atol=8e-3 * scale),
    }[dtype]


def make(gen, lead, N, K, nr, nc, dtype, device, bias=True):
    """Random layer and subnetwork: unsorted, unique rows/cols (None = all)."""
    rows = None if nr is None else torch.randperm(N, generator=gen)[:nr].to(device)
    cols = None if nc is None else torch.randperm(K, generator=gen)[:nc].to(device)
    Kc = K if nc is None else nc
    w = torch.randn(N, K, generator=gen).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype) if bias else None
    x = torch.randn(*lead, Kc, generator=gen).to(device, dtype)
    return x, w, b, rows, cols


def check_against_reference(fwd, bwd, x, w, b, rows, cols, gen, dtype):
    K = x.shape[-1]
    Nr = w.shape[0] if rows is None else rows.numel()
    t = tol(dtype, K)
    y = fwd(x, w, b, rows, cols)
    assert y.dtype == dtype and y.shape == (*x.shape[:-1], Nr)
    torch.testing.assert_close(y.double(), ref.subnet_linear(x, w, b, rows, cols), **t)
    g = torch.randn(y.shape, generator=gen).to(x.device, dtype)
    gx, gw, gb = bwd(g, x, w, rows, cols, [True, True, True])
    rx, rw, rb = ref.subnet_linear_backward(g, x, w, rows, cols)
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == (w.shape[0],)
    torch.testing.assert_close(gx.double(), rx, **tol(dtype, Nr))
    torch.testing.assert_close(gw.double(), rw, **tol(dtype, x.numel() // max(K, 1)))
    torch.testing.assert_close(gb.double(), rb, **tol(dtype, x.numel() // max(K, 1)))
    # Outside rows x cols the full-size gradients are exactly zero.
    assert (gw.double()[rw == 0] == 0).all() and (gb.double()[rb == 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference(device, case, bias, gen):
    for dtype in dtypes_of(device):
        x, w, b, rows, cols = make(gen, *case, dtype, device, bias)
        check_against_reference(op, op_backward, x, w, b, rows, cols, gen, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_reference(device, gen):
    x, w, b, rows, cols = make(gen, (3, 11), 45, 38, 21, 19, torch.float64, device)
    for t in (x, w, b):
        t.requires_grad_(True)
    y = F.subnet_linear(x, w, b, rows, cols)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device)
    y.backward(g)
    rx, rw, rb = ref.subnet_linear_backward(g, x.detach(), w.detach(), rows, cols)
    torch.testing.assert_close(x.grad, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, rw, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, rb, rtol=1e-12, atol=1e-12)
    # Only the weight asks for a gradient: the others are not computed.
    w.grad = None
    y = F.subnet_linear(x.detach(), w, None, rows, cols)
    y.backward(g)
    torch.testing.assert_close(w.grad, rw, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_all_indices_equal_dense_linear(device, gen):
    x, w, b, _, _ = make(gen, (2, 29), 67, 53, None, None, torch.float32, device)
    dense = TF.linear(x, w, b)
    t = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.subnet_linear(x, w, b), dense, **t)
    everything = dict(rows=torch.arange(67, device=device), cols=torch.arange(53, device=device))
    torch.testing.assert_close(F.subnet_linear(x, w, b, **everything), dense, **t)
    # Permuted rows permute the outputs; permuted cols pair with equally permuted features.
    rows, cols = torch.randperm(67, generator=gen).to(device), torch.randperm(53, generator=gen).to(device)
    torch.testing.assert_close(F.subnet_linear(x[..., cols], w, b, rows, cols), dense[..., rows], **t)


@pytest.mark.parametrize("device", DEVICES)
def test_output_mask(device, gen):
    x, w, _, rows, cols = make(gen, (6,), 21, 18, 9, 10, torch.float32, device, bias=False)
    g = torch.randn(6, 9, generator=gen).to(device)
    full = op_backward(g, x, w, rows, cols, [True, True, True])
    for mask in ([True, False, False], [False, True, False], [False, False, True], [False, False, False]):
        out = op_backward(g, x, w, rows, cols, mask)
        for asked, got, want in zip(mask, out, full):
            if asked:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            else:
                assert got.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous(device, gen):
    N, K, dtype = 37, 45, torch.float32
    w = torch.randn(K, 2 * N, generator=gen).to(device).t()[::2]  # [N, K], strides (2, 2N)
    b = torch.randn(2 * N, generator=gen).to(device)[::2]
    rows = torch.randperm(N, generator=gen).to(device)[:23]
    rows = torch.stack([rows, rows], 1)[:, 0]  # a strided index list
    cols = torch.randperm(K, generator=gen).to(device)[:19]
    x = torch.randn(19, 3, 5, generator=gen).to(device).permute(2, 1, 0)  # [5, 3, 19], non-contiguous
    assert not (w.is_contiguous() or b.is_contiguous() or rows.is_contiguous() or x.is_contiguous())
    y = F.subnet_linear(x, w, b, rows, cols)
    torch.testing.assert_close(y.double(), ref.subnet_linear(x, w, b, rows, cols), **tol(dtype, 19))
    g = torch.randn(23, 3, 5, generator=gen).to(device).permute(2, 1, 0)
    gx, gw, gb = op_backward(g, x, w, rows, cols, [True, True, True])
    for got, want in zip((gx, gw, gb), ref.subnet_linear_backward(g, x, w, rows, cols)):
        torch.testing.assert_close(got.double(), want, **tol(dtype, 23))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    for nr, nc, bias in ((7, 5, True), (None, 5, False), (7, None, True), (0, 3, True)):
        x, w, b, rows, cols = make(gen, (2, 3), 13, 11, nr, nc, torch.float32, device, bias)
        for t in (x, w, b):
            if t is not None:
                t.requires_grad_(True)
        torch.library.opcheck(op.default, (x, w, b, rows, cols))
        g = torch.randn(2, 3, 13 if nr is None else nr, generator=gen).to(device)
        torch.library.opcheck(op_backward.default, (g, x.detach(), w.detach(), rows, cols, [True, True, True]))
        torch.library.opcheck(op_backward.default, (g, x.detach(), w.detach(), rows, cols, [True, False, True]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nr,nc", [(5, 4), (None, 4), (5, None)])
def test_gradcheck(device, nr, nc, gen):
    x, w, b, rows, cols = make(gen, (3,), 9, 8, nr, nc, torch.float64, device)
    for t in (x, w, b):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w, b: F.subnet_linear(x, w, b, rows, cols), (x, w, b))


def test_compile(gen):
    x, w, b, rows, cols = make(gen, (4, 3), 23, 19, 11, 7, torch.float32, "cpu")
    for t in (x, w, b):
        t.requires_grad_(True)
    compiled = torch.compile(F.subnet_linear, fullgraph=True)
    y = compiled(x, w, b, rows, cols)
    g = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x, w, b), g)
    want = F.subnet_linear(x, w, b, rows, cols)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for got, ref_grad in zip(grads, torch.autograd.grad(want, (x, w, b), g)):
        torch.testing.assert_close(got, ref_grad, rtol=0, atol=0)


def bad_inputs(device):
    """(description to match, args) for subnet_linear(x, w, b, rows, cols) on a 10 x 8 layer."""
    w = torch.randn(10, 8, device=device)
    b = torch.randn(10, device=device)
    x = torch.randn(4, 3, device=device)
    ok_rows, ok_cols = torch.tensor([1, 5], device=device), torch.tensor([0, 7, 2], device=device)
    li = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    return [
        (r"rows must not repeat an index, but rows\[2\] = 5 repeats rows\[0\]", (x, w, b, li(5, 1, 5), ok_cols)),
        (r"cols must not repeat an index, but cols\[2\] = 7 repeats cols\[1\]", (x, w, b, ok_rows, li(0, 7, 7))),
        (r"rows\[1\] = 10 is out of range for weight dim 0 \(out_features\) of size 10",
         (x, w, b, li(1, 10), ok_cols)),
        (r"cols\[0\] = -1 is out of range for weight dim 1", (x, w, b, ok_rows, li(-1, 2, 3))),
        (r"rows must be an int64 index list", (x, w, b, ok_rows.int(), ok_cols)),
        (r"cols must be 1-D", (x, w, b, ok_rows, ok_cols[None])),
        (r"x has 3 features but the subnetwork has 2 \(len\(cols\)\)", (x, w, b, ok_rows, ok_cols[:2])),
        (r"x has 3 features but the subnetwork has 8", (x, w, b, ok_rows, None)),
        (r"bias must have shape \[10\]", (x, w, b[:9], ok_rows, ok_cols)),
        (r"bias has dtype .* but weight has dtype", (x, w, b.double(), ok_rows, ok_cols)),
        (r"x has dtype .* but weight has dtype", (x.double(), w, b, ok_rows, ok_cols)),
        (r"weight must be 2-D", (x, w[None], b, ok_rows, ok_cols)),
        (r"weight must be float32, float64, bfloat16 or float16|weight must be float16, bfloat16, float32, float64",
         (x.long(), w.long(), b.long(), ok_rows, ok_cols)),
        (r"x must have at least 1 dimension", (x[0, 0], w, b, ok_rows, ok_cols)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device, gen):
    for pattern, (x, w, b, rows, cols) in bad_inputs(device):
        before = [t.clone() for t in (x, w, b) if t is not None]
        with pytest.raises(BAD_INPUT, match=pattern):
            F.subnet_linear(x, w, b, rows, cols)
        for t, saved in zip([t for t in (x, w, b) if t is not None], before):
            assert torch.equal(t, saved)  # nothing written
    # The backward op validates the same way (and grad_out's shape).
    w = torch.randn(10, 8, device=device)
    x = torch.randn(4, 3, device=device)
    cols = torch.tensor([0, 7, 2], device=device)
    with pytest.raises(BAD_INPUT, match="rows must not repeat an index"):
        op_backward(torch.randn(4, 2, device=device), x, w, torch.tensor([3, 3], device=device), cols, [True] * 3)
    with pytest.raises(BAD_INPUT, match=r"grad_out must have shape \[4, 2\]"):
        op_backward(torch.randn(4, 3, device=device), x, w, torch.tensor([3, 4], device=device), cols, [True] * 3)
    if device == "cpu":
        with pytest.raises(BAD_INPUT, match="weight must be float32, float64, bfloat16 or float16 on the CPU"):
            F.subnet_linear(x.int(), w.int())


@requires_cuda
def test_devices_must_match(gen):
    w = torch.randn(10, 8, device="cuda")
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(BAD_INPUT, match="rows is on cpu"):
        F.subnet_linear(x, w, None, torch.tensor([1, 2]))
    with pytest.raises(BAD_INPUT, match="x is on cpu"):
        F.subnet_linear(x.cpu(), w)


# ---- the Triton kernels, called directly (CUDA tensors; CPU tensors under the interpreter)
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


@requires_triton
@pytest.mark.parametrize("case", TRITON_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(case, dtype, gen):
    from ist_kernels.ops.subnet import _triton as T

    x, w, b, rows, cols = make(gen, *case, dtype, TRITON_DEVICE, bias=True)
    check_against_reference(T.subnet_linear, T.subnet_linear_backward, x, w, b, rows, cols, gen, dtype)
    y = T.subnet_linear(x, w, None, rows, cols)
    torch.testing.assert_close(y.double(), ref.subnet_linear(x, w, None, rows, cols), **tol(dtype, x.shape[-1]))


@requires_triton
def test_triton_noncontiguous_and_mask(gen):
    from ist_kernels.ops.subnet import _triton as T

    N, K, dtype = 37, 45, torch.float32
    w = torch.randn(K, N, generator=gen).to(TRITON_DEVICE).t()
    b = torch.randn(2 * N, generator=gen).to(TRITON_DEVICE)[::2]
    rows = torch.randperm(N, generator=gen)[:23].to(TRITON_DEVICE)
    cols = torch.randperm(K, generator=gen)[:19].to(TRITON_DEVICE)
    x = torch.randn(19, 6, generator=gen).to(TRITON_DEVICE).t()
    y = T.subnet_linear(x, w, b, rows, cols)
    torch.testing.assert_close(y.double(), ref.subnet_linear(x, w, b, rows, cols), **tol(dtype, 19))
    g = torch.randn(23, 6, generator=gen).to(TRITON_DEVICE).t()
    want = ref.subnet_linear_backward(g, x, w, rows, cols)
    out = T.subnet_linear_backward(g, x, w, rows, cols, [True, False, True])
    torch.testing.assert_close(out[0].double(), want[0], **tol(dtype, 23))
    assert out[1].shape == (0,)
    torch.testing.assert_close(out[2].double(), want[2], **tol(dtype, 6))


@requires_triton
def test_triton_bad_input():
    from ist_kernels.ops.subnet import _triton as T

    for pattern, (x, w, b, rows, cols) in bad_inputs(TRITON_DEVICE):
        with pytest.raises(BAD_INPUT, match=pattern):
            T.subnet_linear(x, w, b, rows, cols)
    w = torch.randn(10, 8, device=TRITON_DEVICE)
    x = torch.randn(4, 3, device=TRITON_DEVICE)
    with pytest.raises(BAD_INPUT, match="rows must not repeat"):
        T.subnet_linear_backward(torch.randn(4, 2, device=TRITON_DEVICE), x, w,
                                 torch.tensor([3, 3], device=TRITON_DEVICE),
                                 torch.tensor([0, 7, 2], device=TRITON_DEVICE), [True] * 3)


@requires_cuda
@pytest.mark.parametrize("case", CASES)
def test_triton_bf16_cuda(case, gen):
    """bf16 tl.dot runs wrongly under the interpreter: bf16 is tested on a GPU only."""
    from ist_kernels.ops.subnet import _triton as T

    x, w, b, rows, cols = make(gen, *case, torch.bfloat16, "cuda", bias=True)
    check_against_reference(T.subnet_linear, T.subnet_linear_backward, x, w, b, rows, cols, gen, torch.bfloat16)


# ---- the CUDA backend (compact gather + cuBLAS, ist_kernels/ops/subnet/_aten.py): torch ops only, so it
# runs on CPU tensors too; on a GPU the registered kernel runs it through the dispatcher above.
@pytest.mark.parametrize("case", CASES + [((4,), 20, 17, 6, 0), ((3, 2), 25, 19, None, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_gemm_backend_matches_reference(case, dtype, gen):
    from ist_kernels.ops.subnet import _aten as C

    x, w, b, rows, cols = make(gen, *case, dtype, TRITON_DEVICE, bias=True)
    check_against_reference(C.subnet_linear, C.subnet_linear_backward, x, w, b, rows, cols, gen, dtype)


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_gather_gemm_backend_rounds_once(lead, gen):
    """In bf16/fp16, y = x W[rows][:, cols]ᵀ + b[rows] is accumulated in fp32 and rounded once for
    any layout of x: torch's linear added the bias to the already rounded product for a strided
    1-D or 3-D x (an error of u |x w|, not u |y|: 43% of 1-D and 90% of 3-D draws of 11 outputs
    broke the bound; the property test's example). Bound per element: (K + 2) u_fp32 Σ|terms| +
    2 u_out |y| (see test_properties.assert_within)."""
    from ist_kernels.ops.subnet import _aten as C

    N, K = 129, 7
    for dtype in (torch.bfloat16, torch.float16):
        w = torch.randn(N, K, generator=gen).to(dtype)
        b = torch.randn(N, generator=gen).to(dtype)
        rows, cols = torch.randperm(N, generator=gen)[:100], torch.randperm(K, generator=gen)[:5]
        x = torch.randn(*lead, 2 * len(cols), generator=gen).to(dtype)[..., ::2]  # strided
        y = C.subnet_linear(x, w, b, rows, cols)
        want = ref.subnet_linear(x, w, b, rows, cols)
        mag = ref.subnet_linear(x.double().abs(), w.double().abs(), b.double().abs(), rows, cols)
        bound = (len(cols) + 2) * 2.0**-24 * mag + torch.finfo(dtype).eps * want.abs()
        excess = (y.double() - want).abs() - bound
        assert (excess <= 0).all(), f"{dtype}: error {excess.max().item():.3g} over its one-rounding bound"


def test_gather_gemm_backend_strided_indices_and_views(gen):
    """Strided index views and non-contiguous operands (issue 10 item 3 for this backend)."""
    from ist_kernels.ops.subnet import _aten as C

    N, K = 37, 45
    w = torch.randn(K, N, generator=gen).to(TRITON_DEVICE).t()
    b = torch.randn(2 * N, generator=gen).to(TRITON_DEVICE)[::2]
    rows = torch.randperm(N, generator=gen)[:46 // 2 * 2].to(TRITON_DEVICE)[::2]
    cols = torch.randperm(K, generator=gen)[:38].to(TRITON_DEVICE)[::2]
    x = torch.randn(len(cols), 6, generator=gen).to(TRITON_DEVICE).t()
    assert not rows.is_contiguous() and not cols.is_contiguous()
    check_against_reference(C.subnet_linear, C.subnet_linear_backward, x, w, b, rows, cols, gen, torch.float32)


# ---- regressions (issue 10): each reproduction gives the right result or a clean, named error
def backends():
    """(forward, backward) of every backend that runs here: the op (C++ on CPU tensors), the CUDA
    backend's gather + GEMM code (torch ops: runs on CPU tensors too), and the Triton variant's
    launchers (on CPU tensors under the interpreter)."""
    from ist_kernels.ops.subnet import _aten as C

    out = [(op, op_backward), (C.subnet_linear, C.subnet_linear_backward)]
    if HAS_CUDA or HAS_TRITON:
        from ist_kernels.ops.subnet import triton_subnet_linear, triton_subnet_linear_backward
        out.append((triton_subnet_linear, triton_subnet_linear_backward))
    return out


@pytest.mark.parametrize("backend", range(len(backends())))
def test_empty_index_lists_give_zero_gradients(backend, gen):
    """Item 2: an empty cols list was taken for "all columns" and grad_weight came back
    uninitialised (garbage such as 1784.9); an empty rows list deserves the same test."""
    fwd, bwd = backends()[backend]
    device = TRITON_DEVICE if backend else "cpu"
    w = torch.randn(6, 5, generator=gen).to(device)
    empty = torch.tensor([], dtype=torch.int64, device=device)
    for _ in range(3):  # fresh allocations each time: reused garbage would show
        junk = torch.full((64, 64), 1784.9, device=device)
        del junk
        for rows, cols, x, g in ((None, empty, torch.randn(3, 0), torch.randn(3, 6)),
                                 (empty, None, torch.randn(3, 5), torch.randn(3, 0)),
                                 (empty, empty, torch.randn(3, 0), torch.randn(3, 0))):
            x, g = x.to(device), g.to(device)
            y = fwd(x, w, None, rows, cols)
            assert y.shape == g.shape and (y == 0).all()
            got = bwd(g, x, w, rows, cols, [True, True, True])
            for t, want in zip(got, ref.subnet_linear_backward(g, x, w, rows, cols)):
                assert t.shape == want.shape
                torch.testing.assert_close(t.double(), want, **tol(torch.float32, 3))
            assert (got[1] == 0).all()  # grad_weight: no (row, column) pair is selected
    x = torch.randn(3, 0, device=device)
    wr = w.clone().requires_grad_(True)
    if backend == 0:  # autograd through the op
        F.subnet_linear(x, wr, None, None, empty).sum().backward()
        assert (wr.grad == 0).all()


@pytest.mark.parametrize("backend", range(len(backends())))
def test_strided_index_lists(backend, gen):
    """Item 3: the Triton kernels read rows / cols with unit stride, so a strided view
    (torch.tensor([5, 1, 0, 2, 3, 4])[::2]) gave wrong values, and junk between the entries was
    read as indices. Junk here is in range, so a stride bug gives wrong values, not a crash."""
    fwd, bwd = backends()[backend]
    device = TRITON_DEVICE if backend else "cpu"
    w = torch.randn(7, 7, generator=gen).to(device)
    b = torch.randn(7, generator=gen).to(device)
    rows = torch.tensor([5, 1, 0, 2, 3, 4], device=device)[::2]
    cols = torch.tensor([5, 6, 1, 6, 0, 6, 2], device=device)[::2]
    assert rows.stride(0) == 2 and cols.stride(0) == 2
    x = torch.randn(3, 4, generator=gen).to(device)
    torch.testing.assert_close(fwd(x, w, b, rows, cols).double(), ref.subnet_linear(x, w, b, rows, cols), **tol(
        torch.float32, 4))
    g = torch.randn(3, 3, generator=gen).to(device)
    for got, want in zip(bwd(g, x, w, rows, cols, [True, True, True]), ref.subnet_linear_backward(g, x, w, rows, cols)):
        torch.testing.assert_close(got.double(), want, **tol(torch.float32, 3))


@pytest.mark.parametrize("backend", range(len(backends())))
def test_output_mask_of_the_wrong_length(backend):
    """Item 8: output_mask of the wrong length got the dispatcher's "Tried to convert a List"."""
    _, bwd = backends()[backend]
    device = TRITON_DEVICE if backend else "cpu"
    w, x, g = torch.randn(6, 5, device=device), torch.randn(3, 5, device=device), torch.randn(3, 6, device=device)
    for mask in ([True, True], [True] * 4, []):
        with pytest.raises(ValueError, match=rf"output_mask must have 3 entries .*got {len(mask)}"):
            bwd(g, x, w, None, None, mask)


def test_gather_gemm_backend_validates_each_index_version(gen):
    """Index values are checked once per tensor and version: an in-place write that makes a
    validated list invalid is caught at the next call."""
    from ist_kernels.ops.subnet import _aten as C

    w = torch.randn(10, 8, generator=gen).to(TRITON_DEVICE)
    rows = torch.tensor([1, 4, 7], device=TRITON_DEVICE)
    x = torch.randn(3, 8, generator=gen).to(TRITON_DEVICE)
    C.subnet_linear(x, w, None, rows, None)
    assert C._VALIDATED.hit(rows, 10)
    rows[2] = 10
    with pytest.raises((IndexError, ValueError), match=r"rows\[2\] = 10 is out of range"):
        C.subnet_linear(x, w, None, rows, None)
    rows[2] = 1
    with pytest.raises(ValueError, match="must not repeat"):
        C.subnet_linear_backward(torch.randn(3, 3, device=TRITON_DEVICE), x, w, rows, None, [True] * 3)
