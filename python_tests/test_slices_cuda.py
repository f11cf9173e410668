"""CUDA-only tests of the slice kernels (csrc/cuda/slices.cu): every (load, store) width path, odd
sizes, misaligned and non-contiguous views, index lists on the host and on the device, more owners
than one chunk, and the no-sync property of host index lists. References: python_tests/reference.py
(float64, written from the math). The CPU paths are covered by test_slices.py."""
import pytest
import torch
from test_slices import TOL, rand

import ist_kernels.functional as F

import reference as ref
from conftest import requires_cuda

ops = torch.ops.ist_kernels

# (shape, dim, dtype): the width path each case is built to reach (load bytes, store bytes), for an
# aligned base; the misaligned variants below shift every address by one element.
WIDTH_CASES = [
    ((16, 8, 3, 3), 1, torch.float32),   # 36-byte rows: 4-byte loads, 16-byte stores
    ((7, 5, 3, 3), 1, torch.float32),    # 36-byte rows, odd segment sizes: 4-byte loads and stores
    ((12, 6, 4), 1, torch.float32),      # 16-byte rows: 16 / 16
    ((10, 6, 2), 1, torch.float32),      # 8-byte rows: 8 / 8 or 8 / 16
    ((64,), 0, torch.float32),           # BN vectors: 4 / 4 or 4 / 16
    ((16, 8, 3, 3), 1, torch.float16),   # 18-byte rows: 2-byte loads, 16-byte stores (scatter: 8)
    ((9, 7, 3, 3), 1, torch.bfloat16),   # odd everything
    ((8, 6, 5), 1, torch.uint8),         # 5-byte rows: 1-byte loads
    ((16, 4, 16), 1, torch.int8),        # 16-byte rows of bytes
    ((6, 5, 3), 2, torch.float64),       # 8-byte loads
    ((33, 7), -1, torch.int64),          # columns: 8-byte loads, scattered rows
    ((5, 129), 0, torch.float32),        # long odd rows
]


def _case_id(c):
    shape, dim, dtype = c
    return f"{'x'.join(map(str, shape))}-d{dim}-{str(dtype).replace('torch.', '')}"


def placed(x, how):
    """x as an aligned contiguous tensor, a view one element off a 16-byte boundary, or a
    non-contiguous view (same values)."""
    if how == "aligned":
        return x.clone()
    if how == "misaligned":
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        v = buf[1:].view(x.shape)
        v.copy_(x)
        return v
    t = torch.empty(tuple(reversed(x.shape)), dtype=x.dtype, device=x.device).permute(*reversed(range(x.dim())))
    t.copy_(x)
    assert not t.is_contiguous() or x.dim() == 1
    return t


def plan(gen, n, owners, on_device):
    """owners random index lists over n slices (random order, one of them sometimes empty)."""
    out = []
    for s in range(owners):
        k = int(torch.randint(0 if s == owners - 1 else 1, n + 1, (1,), generator=gen))
        idx = torch.randperm(n, generator=gen)[:k]
        out.append(idx.cuda() if on_device else idx)
    return out


@requires_cuda
@pytest.mark.parametrize("how", ["aligned", "misaligned", "strided"])
@pytest.mark.parametrize("case", WIDTH_CASES, ids=_case_id)
@pytest.mark.parametrize("lists", ["host", "device"])
def test_gather_widths(case, how, lists, gen):
    shape, dim, dtype = case
    base = rand(shape, dtype, gen, "cuda")
    # two sources, one placed as asked and one aligned: segments of different widths in one launch
    xs = [placed(base, how), rand(shape, dtype, gen, "cuda")]
    d = dim % len(shape)
    ids, indices = [], []
    for t in (0, 1, 0):
        ids.append(t)
        indices += plan(gen, shape[d], 1, lists == "device")
    got = F._gather_flat(xs, ids, indices, [dim, dim])
    want = ref.slice_gather([x.cpu() for x in xs], ids, [i.cpu() for i in indices], [dim, dim])
    assert torch.equal(got.cpu(), want)  # a gather copies: bit for bit
    # into a buffer that starts one element off a 16-byte boundary: narrower stores
    buf = torch.full((got.numel() + 1,), 7, dtype=dtype, device="cuda")
    F._gather_flat(xs, ids, indices, [dim, dim], out=buf[1:])
    assert torch.equal(buf[1:].cpu(), want) and buf[0].item() == 7


@requires_cuda
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
@pytest.mark.parametrize("how", ["aligned", "misaligned", "strided"])
@pytest.mark.parametrize("case", WIDTH_CASES, ids=_case_id)
@pytest.mark.parametrize("owners", [1, 3, 6])  # 6: more owners than one chunk of loads
def test_scatter_widths(case, how, reduce, owners, gen):
    shape, dim, dtype = case
    d = dim % len(shape)
    original = rand(shape, dtype, gen, "cuda")
    target = placed(original, how)
    indices = plan(gen, shape[d], owners, on_device=False)
    updates = []
    for j, idx in enumerate(indices):
        u = rand([idx.numel() if a == d else s for a, s in enumerate(shape)], dtype, gen, "cuda")
        updates.append(placed(u, "misaligned") if j % 2 else u)  # owners of mixed alignment
    F.scatter_slices_([target], [0] * owners, updates, indices, [dim], reduce)
    want = ref.slice_scatter([original.cpu()], [0] * owners, [u.cpu() for u in updates], indices, [dim], reduce)[0]
    if dtype.is_floating_point and reduce == "mean":
        torch.testing.assert_close(target.cpu().to(want.dtype), want, **TOL[dtype])
    elif dtype.is_floating_point and reduce == "sum":
        torch.testing.assert_close(target.cpu().to(want.dtype), want.to(dtype).to(want.dtype), **TOL[dtype])
    else:  # copy moves bits; integer sums wrap like the dtype, means truncate
        assert torch.equal(target.cpu(), want.to(dtype))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_blocks_against_torch(dtype, gen):
    """A layer large enough for thousands of blocks and several segments per launch."""
    w = rand((256, 192, 3, 3), dtype, gen, "cuda")
    b = rand((256,), dtype, gen, "cuda")
    idx = [torch.randperm(192, generator=gen)[:97], torch.randperm(192, generator=gen)[:150]]
    bidx = [torch.randperm(256, generator=gen)[:129]]
    got = F.gather_slices([w, b], [0, 0, 1], idx + bidx, [1, 0])
    for g, (x, i, dd) in zip(got, [(w, idx[0], 1), (w, idx[1], 1), (b, bidx[0], 0)]):
        assert torch.equal(g, x.index_select(dd, i.cuda()))
    before = w.clone()
    upd = [g * 2 for g in got[:2]]
    F.scatter_slices_([w], [0, 0], upd, idx, [1], "mean")
    acc, cnt = torch.zeros_like(before, dtype=torch.float64), torch.zeros(192, dtype=torch.float64, device="cuda")
    for u, i in zip(upd, idx):
        acc.index_add_(1, i.cuda(), u.double())
        cnt.index_add_(0, i.cuda(), torch.ones(i.numel(), dtype=torch.float64, device="cuda"))
    want = torch.where(cnt.view(1, -1, 1, 1) > 0, acc / cnt.clamp(min=1).view(1, -1, 1, 1), before.double())
    torch.testing.assert_close(w.double(), want, **TOL[dtype])


@requires_cuda
def test_host_index_lists_never_sync(gen):
    """A round's calls with index lists on the host: no device->host synchronisation at all."""
    xs = [rand((32, 16, 3, 3), torch.float32, gen, "cuda"), rand((32,), torch.float32, gen, "cuda"),
          rand((16, 32, 3, 3), torch.float32, gen, "cuda")]
    dims = [0, 0, 1]
    ids = [0, 1, 2, 0, 1, 2]
    indices = [torch.randperm(32, generator=gen)[:k] for k in (10, 17, 20, 31, 5, 12)]
    out = torch.empty(sum(x.numel() // x.shape[d] * i.numel() for x, d, i in
                          zip([xs[t] for t in ids], [dims[t] for t in ids], indices)) + 0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flat = F._gather_flat(xs, ids, indices, dims)
        F._gather_flat(xs, ids, indices, dims, out=out)
        segs = F.gather_slices(xs, ids, indices, dims)
        for reduce in ("copy", "sum", "mean"):
            F.scatter_slices_(xs, ids, segs, indices, dims, reduce)
        F.owner_average_(xs[0], [segs[0], segs[3]], [indices[0], indices[3]], dim=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(flat, out)


@requires_cuda
def test_device_index_lists_sync_once_and_work(gen):
    """Lists on the device are accepted (documented: one device->host copy per call)."""
    x = rand((8, 6, 3, 3), torch.float32, gen, "cuda")
    idx = torch.tensor([5, 0, 3], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            F._gather_flat([x], [0], [idx], [1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(F._gather_flat([x], [0], [idx], [1]), x.index_select(1, idx).reshape(-1))


@requires_cuda
def test_bad_host_lists_leave_targets_unchanged_without_sync(gen):
    x = rand((8, 5, 3, 3), torch.float32, gen, "cuda")
    before = x.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(IndexError, match=r"indices\[1\]\[2\] = 5 is out of range"):
            F.scatter_slices_([x], [0, 0], [x[:, :2].contiguous(), x[:, :3].contiguous()],
                             [torch.tensor([0, 1]), torch.tensor([2, 3, 5])], [1], "mean")
        with pytest.raises(ValueError, match="must not repeat an index"):
            F._gather_flat([x], [0], [torch.tensor([1, 4, 1])], [1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(x, before)
