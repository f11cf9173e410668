import math
import subprocess
import sys

import pytest
import torch

import ist_kernels.functional as F

import reference as ref
from conftest import BAD_INPUT, DEVICES

ops = torch.ops.ist_kernels

# A model's worth of tensors in miniature: (shape, dim) with conv filters (dim 0), the next conv's
# input channels (dim 1), BN vectors, linear columns (last dim), a middle dim, odd sizes.
TENSORS = [((8, 5, 3, 3), 0), ((7, 8, 3, 3), 1), ((8,), 0), ((33, 7), -1), ((5, 129), 1), ((1,), 0),
           ((3, 4, 5, 6), 2), ((129, 2), 0), ((6, 48), 0), ((4, 6, 16), 1)]  # the last two: rows of 16-byte vectors
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float16: dict(rtol=1e-3, atol=1e-3), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def rand(shape, dtype, gen, device):
    if dtype == torch.bool:
        return (torch.randn(shape, generator=gen) > 0).to(device)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=gen).to(dtype).to(device)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def random_plan(gen, sizes, owners, *, p_empty=0.15, device="cpu"):
    """owners index lists per tensor (random subsets in random order, some empty, overlapping);
    segments interleaved owner-major, as a round's plan lists them."""
    ids, indices = [], []
    for s in range(owners):
        for t, n in enumerate(sizes):
            if torch.rand(1, generator=gen).item() < p_empty:
                k = 0
            else:
                k = int(torch.randint(1, n + 1, (1,), generator=gen))
            ids.append(t)
            indices.append(torch.randperm(n, generator=gen)[:k].to(device))
    return ids, indices


def model(gen, dtype, device, tensors=TENSORS):
    xs = [rand(shape, dtype, gen, device) for shape, _ in tensors]
    dims = [d for _, d in tensors]
    sizes = [x.shape[d] for x, d in zip(xs, dims)]
    return xs, dims, sizes


def compact_updates(gen, targets, ids, indices, dims, dtype, device):
    out = []
    for t, idx in zip(ids, indices):
        shape = list(targets[t].shape)
        shape[dims[t] % len(shape)] = idx.numel()
        out.append(rand(shape, dtype, gen, device))
    return out


def unowned_mask(target, dim, owned):
    keep = torch.ones(target.shape[dim], dtype=torch.bool)
    for idx in owned:
        keep[idx.cpu()] = False
    return keep


# ---- gather
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_gather_matches_reference(device, dtype, gen):
    xs, dims, sizes = model(gen, dtype, device)
    ids, indices = random_plan(gen, sizes, 3, device=device)
    out = F._gather_flat(xs, ids, indices, dims)
    assert out.dtype == dtype and out.dim() == 1
    assert torch.equal(out.cpu(), ref.slice_gather([x.cpu() for x in xs], ids, [i.cpu() for i in indices], dims))
    segs = F.gather_slices(xs, ids, indices, dims)
    for seg, t, idx in zip(segs, ids, indices):
        assert torch.equal(seg, xs[t].index_select(dims[t] % xs[t].dim(), idx))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_slices_are_views_of_one_buffer_per_dtype(device, gen):
    xs, dims, sizes = model(gen, torch.float32, device)
    ints = [torch.randint(0, 100, (6, 4), generator=gen).to(device), torch.arange(9, device=device)]
    sources = xs[:3] + ints + xs[3:]
    dims = dims[:3] + [1, 0] + dims[3:]
    sizes = [s.shape[d] for s, d in zip(sources, dims)]
    ids, indices = random_plan(gen, sizes, 2, p_empty=0.0, device=device)
    segs = F.gather_slices(sources, ids, indices, dims)
    storages = {}
    for seg, t, idx in zip(segs, ids, indices):
        assert seg.dtype == sources[t].dtype and seg.is_contiguous()
        assert torch.equal(seg, sources[t].index_select(dims[t] % sources[t].dim(), idx))
        storages.setdefault(seg.dtype, set()).add(seg.untyped_storage().data_ptr())
    assert {k: len(v) for k, v in storages.items()} == {torch.float32: 1, torch.int64: 1}


@pytest.mark.parametrize("device", DEVICES)
def test_gather_noncontiguous_and_empty(device, gen):
    base = torch.randn(10, 12, 7, generator=gen).to(device)
    sources = [base.transpose(0, 2), base[:, ::3], base[2:5].permute(2, 0, 1)]  # all non-contiguous
    assert not any(s.is_contiguous() for s in sources)
    dims = [0, 1, -1]
    ids = [0, 1, 2, 2, 0]
    indices = [torch.tensor([6, 0, 3]), torch.tensor([3, 1]), torch.tensor([], dtype=torch.int64),
               torch.tensor([4, 1]), torch.tensor([1])]
    indices = [i.to(device) for i in indices]
    out = F._gather_flat(sources, ids, indices, dims)
    assert torch.equal(out.cpu(), ref.slice_gather([s.cpu() for s in sources], ids, [i.cpu() for i in indices], dims))
    # Nothing gathered at all.
    empty = F._gather_flat(sources, [1], [torch.tensor([], dtype=torch.int64, device=device)], dims)
    assert empty.shape == (0,) and empty.dtype == base.dtype
    assert F._gather_flat(sources, [], [], dims).shape == (0,)
    assert F.gather_slices(sources, [], [], dims) == []


def test_gather_gradcheck(gen):
    xs, dims, sizes = model(gen, torch.float64, "cpu", TENSORS[:4])
    ids, indices = random_plan(gen, sizes, 3, p_empty=0.2)
    ids, indices = ids + [0], indices + [torch.tensor([2, 5])]  # the same slices twice across segments
    xs = [x.requires_grad_() for x in xs]
    torch.autograd.gradcheck(lambda *s: F._gather_flat(list(s), ids, indices, dims), xs)
    # Only some sources need a gradient.
    xs[1].requires_grad_(False)
    F._gather_flat(xs, ids, indices, dims).sum().backward()
    assert xs[1].grad is None and xs[0].grad is not None


def test_gather_segments_gradcheck_and_reference(gen):
    """gather_slices (the C++ slice_gather_segments: slice_gather viewed as its segments) against
    gradcheck and against the float64 reference gradient: each source's gradient is the sum of its
    segments' cotangents at their slices, zero elsewhere (also for a source no segment reads)."""
    xs, dims, sizes = model(gen, torch.float64, "cpu", TENSORS[:5])
    ids, indices = random_plan(gen, sizes, 3, p_empty=0.2)
    ids, indices = ids + [3], indices + [torch.tensor([6, 0, 2])]  # slices owned twice
    ids, indices = [i for i in ids if i != 4], [x for i, x in zip(ids, indices) if i != 4]  # xs[4] unread
    xs = [x.requires_grad_() for x in xs]
    torch.autograd.gradcheck(lambda *s: tuple(F.gather_slices(list(s), ids, indices, dims)), xs)
    torch.autograd.gradcheck(lambda *s: tuple(ops.slice_gather_segments(list(s), ids, indices, dims)), xs)
    segs = F.gather_slices(xs, ids, indices, dims)
    cot = [torch.randn(s.shape, generator=gen, dtype=torch.float64) for s in segs]
    got = torch.autograd.grad(segs, xs, cot)
    for t, x in enumerate(xs):
        want = torch.zeros_like(x)
        for j, (i, idx) in enumerate(zip(ids, indices)):
            if i == t:
                want.index_add_(dims[t] % x.dim(), idx, cot[j])
        # a slice is read by up to four segments (three overlapping owners, one listed twice): sums
        # of up to four float64 terms, whose order may differ: equal to a few ulps, not bit for bit
        torch.testing.assert_close(got[t], want, rtol=1e-14, atol=1e-14, msg=f"source {t}")
    # A strided cotangent reaching the flat gather, and a source that needs no gradient.
    xs[0].requires_grad_(False)
    flat = F._gather_flat(xs, ids, indices, dims)
    g = torch.randn(2 * flat.numel(), generator=gen, dtype=torch.float64)[::2]
    got = torch.autograd.grad(flat, [xs[1], xs[2]], g)
    want = torch.autograd.grad(ref.slice_gather([x if t == 1 else x.detach() for t, x in enumerate(xs)],
                                                ids, indices, dims), xs[1], g)[0]
    torch.testing.assert_close(got[0], want, rtol=1e-14, atol=1e-14)


def test_gather_segments_are_the_gather_viewed():
    """slice_gather_segments returns views of one fresh buffer: its shapes, the flat gather's values
    in order, and in-place writes to one segment show in no source."""
    a, b = torch.arange(20.).view(4, 5), torch.arange(6.)
    segs = ops.slice_gather_segments([a, b], [0, 1, 0], [torch.tensor([3, 1]), torch.tensor([5]), torch.tensor([0])],
                                     [0, 0])
    assert [list(s.shape) for s in segs] == [[2, 5], [1], [1, 5]]
    assert torch.equal(torch.cat([s.reshape(-1) for s in segs]), torch.cat([a[3], a[1], b[5:], a[0]]))
    assert len({s.untyped_storage().data_ptr() for s in segs}) == 1
    segs[0].zero_()
    assert torch.equal(a, torch.arange(20.).view(4, 5))
    assert ops.slice_gather_segments([a], [], [], [0]) == []


# ---- scatter
def run_scatter(gen, device, dtype, reduce, owners=4):
    targets, dims, sizes = model(gen, dtype, device)
    ids, indices = random_plan(gen, sizes, owners, device=device)
    updates = compact_updates(gen, targets, ids, indices, dims, dtype, device)
    before = [t.clone() for t in targets]
    expect = ref.slice_scatter([t.cpu() for t in targets], ids, [u.cpu() for u in updates],
                               [i.cpu() for i in indices], dims, reduce)
    F.scatter_slices_(targets, ids, updates, indices, dims, reduce)
    return targets, before, expect, ids, indices, dims


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_scatter_matches_reference(device, dtype, reduce, gen):
    targets, before, expect, ids, indices, dims = run_scatter(gen, device, dtype, reduce)
    for t, (x, x0, e) in enumerate(zip(targets, before, expect)):
        tol = dict(rtol=0, atol=0) if reduce == "copy" else TOL[dtype]
        torch.testing.assert_close(x.cpu().double(), e, **tol)
        # Slices no segment owns keep their value exactly.
        d = dims[t] % x.dim()
        keep = unowned_mask(x, d, [i for j, i in zip(ids, indices) if j == t])
        assert torch.equal(x.cpu().index_select(d, keep.nonzero().flatten()),
                           x0.cpu().index_select(d, keep.nonzero().flatten()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
def test_scatter_int64(device, reduce, gen):
    targets, _, expect, *_ = run_scatter(gen, device, torch.int64, reduce)
    for x, e in zip(targets, expect):
        assert torch.equal(x.cpu(), e)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_copy_bool(device, gen):
    targets, _, expect, *_ = run_scatter(gen, device, torch.bool, "copy")
    for x, e in zip(targets, expect):
        assert torch.equal(x.cpu(), e.bool())


@pytest.mark.parametrize("device", DEVICES)
def test_sum_and_copy_equal_the_index_loop_bit_for_bit(device, gen):
    """sum runs owners in segment order: exactly the fp32 loop of index_add_; copy: index_copy_."""
    targets, dims, sizes = model(gen, torch.float32, device)
    ids, indices = random_plan(gen, sizes, 4, device=device)
    updates = compact_updates(gen, targets, ids, indices, dims, torch.float32, device)
    for reduce, method in (("sum", "index_add_"), ("copy", "index_copy_")):
        loop = [t.clone() for t in targets]
        for t, u, idx in zip(ids, updates, indices):
            getattr(loop[t], method)(dims[t] % loop[t].dim(), idx, u)
        ours = [t.clone() for t in targets]
        F.scatter_slices_(ours, ids, updates, indices, dims, reduce)
        for a, b in zip(ours, loop):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_owner_average(device, dtype, gen):
    target = rand((13, 6, 3, 3), dtype, gen, device)
    original = target.clone()
    # slice 0: unowned; 1..3: one owner; 4..12: 2, 3 or 4 owners (overlapping, in scrambled order).
    owned = [[1, 4, 5, 6, 7, 8, 9, 10, 11, 12], [12, 2, 4, 5, 6, 7, 8], [3, 11, 10, 9, 4, 5], [6, 7, 8, 9, 10, 12]]
    indices = [torch.tensor(o, device=device) for o in owned]
    updates = [rand((len(o), 6, 3, 3), dtype, gen, device) for o in owned]
    out = F.owner_average_(target, updates, indices, dim=0)
    assert out is target
    assert torch.equal(target[0], original[0])  # unowned: unchanged
    assert torch.equal(target[1], updates[0][0])  # single owner: copied exactly
    assert torch.equal(target[2], updates[1][1]) and torch.equal(target[3], updates[2][0])
    torch.testing.assert_close(target.double().cpu(), ref.owner_average(original.cpu(), [u.cpu() for u in updates],
                                                                         [i.cpu() for i in indices]), **TOL[dtype])
    # Three owners of slice 8 (positions 5, 6 and 2 of lists 0, 1 and 3), four of slice 12.
    mean8 = (updates[0][5].double() + updates[1][6].double() + updates[3][2].double()) / 3
    torch.testing.assert_close(target[8].double(), mean8, **TOL[dtype])
    mean12 = (updates[0][9].double() + updates[1][0].double() + updates[3][5].double()) / 3
    torch.testing.assert_close(target[12].double(), mean12, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_idempotent_when_subnetworks_return_global_values(device, dtype, gen):
    """Aggregating unchanged subnetworks gives the model back, bit for bit (with -0.0, and with up
    to 7 owners per slice, where a plain sum-then-divide would round)."""
    targets, dims, sizes = model(gen, dtype, device)
    if dtype.is_floating_point:
        targets[0].view(-1)[:5] = -0.0
    ids, indices = random_plan(gen, sizes, 7, p_empty=0.1, device=device)
    updates = [targets[t].index_select(dims[t] % targets[t].dim(), idx) for t, idx in zip(ids, indices)]
    before = [t.clone() for t in targets]
    for reduce in ("mean", "copy"):
        F.scatter_slices_(targets, ids, updates, indices, dims, reduce)
        for a, b in zip(targets, before):
            assert torch.equal(a.view(-1).view(torch.uint8) if a.dtype.is_floating_point else a,
                               b.view(-1).view(torch.uint8) if b.dtype.is_floating_point else b)


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_targets_and_updates(device, gen):
    base = torch.randn(9, 14, 5, generator=gen).to(device)
    targets = [base.transpose(0, 1), base[:, ::2]]  # views of one tensor, written in place
    assert not targets[0].is_contiguous()
    dims = [1, 2]
    ids = [0, 0, 1]
    indices = [torch.tensor([8, 1, 4], device=device), torch.tensor([4, 0], device=device),
               torch.tensor([3, 0], device=device)]
    wide = torch.randn(14, 3, 2, 5, generator=gen).to(device)
    updates = [wide[:, :, 0], torch.randn(14, 2, 5, generator=gen).to(device),
               torch.randn(9, 7, 2, generator=gen).to(device)]
    assert not updates[0].is_contiguous()
    # The two views of `base` overlap in memory: one call may not write both.
    with pytest.raises(BAD_INPUT, match="shares memory with targets"):
        F.scatter_slices_(targets, ids, updates, indices, dims, "mean")
    expect = ref.slice_scatter([targets[0].cpu()], ids[:2], [u.cpu() for u in updates[:2]],
                               [i.cpu() for i in indices[:2]], dims[:1], "mean")[0]
    F.scatter_slices_(targets[:1], ids[:2], updates[:2], indices[:2], dims[:1], "mean")
    torch.testing.assert_close(base.transpose(0, 1).double().cpu(), expect, **TOL[torch.float32])
    expect = ref.slice_scatter([targets[1].cpu()], [0], [updates[2].cpu()], [indices[2].cpu()], [2], "sum")[0]
    F.scatter_slices_([targets[1]], [0], updates[2:], indices[2:], [2], "sum")
    torch.testing.assert_close(base[:, ::2].double().cpu(), expect, **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_empty_segments_and_untouched_targets(device, gen):
    targets, dims, sizes = model(gen, torch.float32, device)
    before = [t.clone() for t in targets]
    empty = torch.tensor([], dtype=torch.int64, device=device)
    F.scatter_slices_(targets, [1], [torch.empty(7, 0, 3, 3, device=device)], [empty], dims, "mean")
    F.scatter_slices_(targets, [], [], [], dims, "sum")
    F.owner_average_(targets[0], [torch.empty(8, 0, 3, 3, device=device)], [empty], dim=1)
    F.owner_average_(targets[0], [], [])
    F.scatter_slices_([], [], [], [], [])
    with pytest.raises(ValueError, match="targets is empty"):
        F.scatter_slices_([], [0], [targets[0]], [empty], [])
    for a, b in zip(targets, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_grouped(device, gen):
    w = torch.randn(6, 4, generator=gen).to(device)
    tracked = torch.arange(5, device=device) * 10
    half = torch.randn(3, 8, generator=gen).to(device).half()
    targets, dims = [w, tracked, half], [0, 0, 1]
    indices = [torch.tensor([0, 2], device=device), torch.tensor([1, 2, 4], device=device),
               torch.tensor([5, 0], device=device), torch.tensor([2], device=device)]
    ids = [0, 1, 2, 0]
    segs = F.gather_slices(targets, ids, indices, dims)
    segs = [s + 1 for s in segs]
    expect = ref.slice_scatter([t.cpu() for t in targets], ids, [s.cpu() for s in segs],
                               [i.cpu() for i in indices], dims, "mean")
    F.scatter_slices_(targets, ids, segs, indices, dims, "mean")
    for x, e in zip(targets, expect):
        torch.testing.assert_close(x.cpu().to(e.dtype), e, **(TOL[x.dtype] if x.is_floating_point() else {}))


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device, gen):
    targets, dims, sizes = model(gen, torch.float32, device)
    ids, indices = random_plan(gen, sizes, 6, device=device)
    updates = compact_updates(gen, targets, ids, indices, dims, torch.float32, device)
    for reduce in ("sum", "mean"):
        a = [t.clone() for t in targets]
        b = [t.clone() for t in targets]
        F.scatter_slices_(a, ids, updates, indices, dims, reduce)
        F.scatter_slices_(b, ids, updates, indices, dims, reduce)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_index_lists_on_cpu(device, gen):
    """Plans are made on the host: index lists may stay on the CPU for tensors on a device."""
    targets, dims, sizes = model(gen, torch.float32, device)
    ids, indices = random_plan(gen, sizes, 2)
    flat = F._gather_flat(targets, ids, indices, dims)
    assert torch.equal(flat, F._gather_flat(targets, ids, [i.to(device) for i in indices], dims))


# ---- registration: opcheck, torch.compile
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    xs, dims, sizes = model(gen, torch.float32, device, TENSORS[:5])
    ids, indices = random_plan(gen, sizes, 2, p_empty=0.2, device=device)
    for x in xs:
        x.requires_grad_()
    torch.library.opcheck(ops.slice_gather.default, (xs, ids, indices, dims))
    torch.library.opcheck(ops.slice_gather_segments.default, (xs, ids, indices, dims))
    targets = [x.detach().clone() for x in xs]
    updates = compact_updates(gen, targets, ids, indices, dims, torch.float32, device)
    for reduce in ("copy", "sum", "mean"):
        torch.library.opcheck(ops.slice_scatter_.default, (targets, ids, updates, indices, dims, reduce))


def test_compile(gen):
    xs, dims, sizes = model(gen, torch.float32, "cpu", TENSORS[:5])
    ids, indices = random_plan(gen, sizes, 3, p_empty=0.0)

    def round_trip(targets):
        segs = F.gather_slices(targets, ids, indices, dims)
        F.scatter_slices_(targets, ids, [2 * s for s in segs], indices, dims, "mean")
        return F._gather_flat(targets, ids, indices, dims)

    eager = [x.clone() for x in xs]
    compiled = [x.clone() for x in xs]
    expect = round_trip(eager)
    got = torch.compile(round_trip, fullgraph=True)(compiled)
    assert torch.equal(got, expect)
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


# ---- bad input: a clear error naming the argument, nothing written
def bad_cases(device):
    i64 = dict(dtype=torch.int64, device=device)
    w = torch.randn(6, 4, device=device)
    v = torch.randn(5, device=device)
    good = dict(targets=[w, v], target_ids=[0, 1], updates=[torch.ones(2, 4, device=device), torch.ones(1, device=device)],
                indices=[torch.tensor([1, 3], **i64), torch.tensor([4], **i64)], dims=[0, 0], reduce="mean")

    def case(match, **kw):
        return match, {**good, **kw}

    return good, [
        case(r"indices\[0\]\[1\] = 6 is out of range", indices=[torch.tensor([1, 6], **i64), good["indices"][1]]),
        case(r"indices\[1\]\[0\] = -1 is out of range", indices=[good["indices"][0], torch.tensor([-1], **i64)]),
        case(r"indices\[0\] must not repeat an index, but indices\[0\]\[1\] = 3 repeats indices\[0\]\[0\]", indices=[torch.tensor([3, 3], **i64), good["indices"][1]]),
        case(r"indices\[1\] must be int64", indices=[good["indices"][0], torch.tensor([4], dtype=torch.int32, device=device)]),
        case(r"indices\[1\] must be 1-D", indices=[good["indices"][0], torch.tensor([[4]], **i64)]),
        case(r"updates\[1\] has dtype", updates=[good["updates"][0], torch.ones(1, dtype=torch.float64, device=device)]),
        case(r"updates\[0\] has shape \[2, 3\] but targets\[0\] \[6, 4\]", updates=[torch.ones(2, 3, device=device), good["updates"][1]]),
        case(r"updates\[0\] has shape \[3, 4\].*needs \[2, 4\]", updates=[torch.ones(3, 4, device=device), good["updates"][1]]),
        case(r'reduce must be "copy", "sum" or "mean", got "max"', reduce="max"),
        case(r"target_ids, updates and indices must have one entry per segment", target_ids=[0]),
        case(r"dims must have one entry per targets", dims=[0]),
        case(r"dims\[1\] = 1 is out of range for targets\[1\]", dims=[0, 1]),
        case(r"target_ids\[1\] = 2 is out of range", target_ids=[0, 2]),
        case(r"targets\[0\] shares memory with updates\[0\]", updates=[w[1:3], good["updates"][1]]),
        # the op rejects mixed target dtypes; the wrapper groups them, then finds the update's dtype wrong
        case(r"(targets|updates)\[1\] has dtype", targets=[w, v.double()]),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_bad_input_writes_nothing(device):
    good, cases = bad_cases(device)
    for match, kw in cases:
        before = [t.clone() for t in kw["targets"]]
        with pytest.raises(BAD_INPUT, match=match):
            F.scatter_slices_(**kw)
        with pytest.raises(BAD_INPUT, match=match):  # the op itself, not only the wrapper
            ops.slice_scatter_(*kw.values())
        for a, b in zip(kw["targets"], before):
            assert torch.equal(a, b)
    b = torch.zeros(4, dtype=torch.bool, device=device)
    with pytest.raises(BAD_INPUT, match='reduce="sum" needs a floating or integer dtype'):
        F.scatter_slices_([b], [0], [b[:1].clone()], [torch.tensor([0], device=device)], [0], "sum")
    w = torch.randn(6, 4, device=device)
    with pytest.raises(BAD_INPUT, match=r"targets\[0\] shares memory with targets\[1\]"):
        F.scatter_slices_([w, w[2:]], [0, 1], [torch.ones(1, 4, device=device)] * 2,
                         [torch.tensor([0], device=device)] * 2, [0, 0], "copy")
    with pytest.raises(BAD_INPUT, match="expanded view"):
        F.scatter_slices_([torch.zeros(1, 3, device=device).expand(4, 3)], [0], [torch.ones(1, 3, device=device)],
                         [torch.tensor([0], device=device)], [0], "copy")


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtype_bad_input_writes_nothing(device):
    """Split into one launch per dtype, the call is still checked as a whole before any launch."""
    w = torch.randn(6, 4, device=device)
    n = torch.arange(5, device=device)
    before = [w.clone(), n.clone()]
    upd = [torch.ones(2, 4, device=device), torch.ones(1, dtype=torch.int64, device=device)]
    for match, idx in ((r"indices\[1\]\[0\] = 7 is out of range", torch.tensor([7])),
                       (r"indices\[1\] must not repeat an index, but indices\[1\]\[1\] = 2 repeats", torch.tensor([2, 2]))):
        u = upd if idx.numel() == 1 else [upd[0], torch.ones(2, dtype=torch.int64, device=device)]
        with pytest.raises(BAD_INPUT, match=match):
            F.scatter_slices_([w, n], [0, 1], u, [torch.tensor([0, 1], device=device), idx.to(device)], [0, 0])
    with pytest.raises(BAD_INPUT, match=r"targets\[0\] shares memory with updates\[0\]"):
        F.scatter_slices_([w, n], [0, 1], [w[:2], upd[1]], [torch.tensor([0, 1], device=device),
                                                            torch.tensor([0], device=device)], [0, 0])
    with pytest.raises(BAD_INPUT, match=r"updates\[1\] has dtype"):
        F.scatter_slices_([w, n], [0, 1], [upd[0], upd[0][0, :1]],
                         [torch.tensor([0, 1], device=device), torch.tensor([0], device=device)], [0, 0])
    assert torch.equal(w, before[0]) and torch.equal(n, before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_gather_bad_input(device):
    w = torch.randn(6, 4, device=device)
    i = torch.tensor([1], device=device)
    for match, args in [
        (r"indices\[0\]\[0\] = 4 is out of range for sources\[0\] along dim 1", ([w], [0], [torch.tensor([4], device=device)], [1])),
        (r"indices\[0\]\[2\] = 1 repeats indices\[0\]\[0\]", ([w], [0], [torch.tensor([1, 2, 1], device=device)], [0])),
        (r"source_ids\[0\] = 1 is out of range", ([w], [1], [i], [0])),
        (r"source_ids and indices must have one entry per segment", ([w], [0, 0], [i], [0])),
        (r"sources\[1\] has dtype", ([w, w.half()], [0], [i], [0, 0])),
        (r"dims\[0\] = 2 is out of range", ([w], [0], [i], [2])),
        (r"indices\[0\] must be int64", ([w], [0], [i.int()], [0])),
        (r"sources\[0\] is 0-d", ([torch.tensor(1.0, device=device)], [0], [i], [0])),
        (r"sources is empty", ([], [], [], [])),
    ]:
        with pytest.raises(BAD_INPUT, match=match):
            F._gather_flat(*args)


# ---- slice_gather_into_: the gather into a caller's buffer, and GatherBuffers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
def test_gather_into_matches_reference(device, dtype, gen):
    xs, dims, sizes = model(gen, dtype, device)
    ids, indices = random_plan(gen, sizes, 3, device=device)
    xs[1] = xs[1].transpose(2, 3)  # a non-contiguous source (same shape: 3x3 kernel)
    expect = ref.slice_gather([x.cpu() for x in xs], ids, [i.cpu() for i in indices], dims)
    out = rand((expect.numel(),), dtype, gen, device)  # stale data everywhere: all of it is overwritten
    assert F._gather_flat(xs, ids, indices, dims, out=out) is out
    assert torch.equal(out.cpu(), expect)
    out.zero_()
    assert ops.slice_gather_into_(out, xs, ids, indices, dims) is None
    assert torch.equal(out.cpu(), expect)
    segs = F.gather_slices(xs, ids, indices, dims, out=out.zero_())
    for seg, t, idx in zip(segs, ids, indices):
        assert seg.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert torch.equal(seg, xs[t].index_select(dims[t] % xs[t].dim(), idx))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_empty(device, gen):
    w = torch.randn(4, 3, device=device)
    out = torch.empty(0, device=device)
    F._gather_flat([w], [0, 0], [torch.tensor([], dtype=torch.int64, device=device)] * 2, [0], out=out)
    F._gather_flat([w], [], [], [0], out=out)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_opcheck(device, gen):
    xs, dims, sizes = model(gen, torch.float32, device, TENSORS[:5])
    ids, indices = random_plan(gen, sizes, 2, p_empty=0.2, device=device)
    n = F._gather_flat(xs, ids, indices, dims).numel()
    torch.library.opcheck(ops.slice_gather_into_.default, (torch.empty(n, device=device), xs, ids, indices, dims))


def test_gather_into_compile(gen):
    xs, dims, sizes = model(gen, torch.float32, "cpu", TENSORS[:5])
    ids, indices = random_plan(gen, sizes, 3, p_empty=0.0)
    n = F._gather_flat(xs, ids, indices, dims).numel()

    def fn(out):
        F._gather_flat(xs, ids, indices, dims, out=out)
        return out * 2

    got = torch.compile(fn, fullgraph=True)(torch.zeros(n))
    assert torch.equal(got, 2 * F._gather_flat(xs, ids, indices, dims))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_bad_input_writes_nothing(device):
    w = torch.randn(6, 4, device=device)
    i = [torch.tensor([1, 3], device=device)]
    big = torch.randn(64, device=device)
    for match, out, srcs in [
        (r"out must be 1-D with 8 elements .* got shape \[7\]", torch.zeros(7, device=device), [w]),
        (r"out must be 1-D with 8 elements .* got shape \[2, 4\]", torch.zeros(2, 4, device=device), [w]),
        (r"out has dtype torch.float64|out has dtype Double", torch.zeros(8, dtype=torch.float64, device=device), [w]),
        (r"out must be contiguous", torch.zeros(16, device=device)[::2], [w]),
        (r"out shares memory with sources\[0\]", big[8:16], [big[8:32].view(6, 4)]),
        (r"out shares memory with sources\[0\]", big[4:12], [big[:24].view(6, 4)]),
    ]:
        before = out.clone()
        with pytest.raises(BAD_INPUT, match=match):
            ops.slice_gather_into_(out, srcs, [0], i, [0])
        assert torch.equal(out, before)
    out = torch.zeros(8, device=device)
    with pytest.raises(BAD_INPUT, match=r"indices\[0\]\[1\] = 6 is out of range"):
        F._gather_flat([w], [0], [torch.tensor([1, 6], device=device)], [0], out=out)
    with pytest.raises(ValueError, match="out= is not differentiable"):
        F._gather_flat([w.requires_grad_()], [0], i, [0], out=out)
    with pytest.raises(ValueError, match="out is one tensor but the sources have 2 dtypes"):
        F.gather_slices([w.detach(), w.detach().double()], [0, 1], i * 2, [0, 0], out=out)
    assert torch.equal(out, torch.zeros(8, device=device))
    if device != "cpu":
        with pytest.raises(ValueError, match="out is on cpu"):
            ops.slice_gather_into_(torch.zeros(8), [w.detach()], [0], i, [0])


@pytest.mark.parametrize("device", DEVICES)
def test_gather_buffers_reuse_only_dead_buffers(device, gen):
    """A kept buffer is handed out again only once no result of an earlier call views it."""
    xs, dims, sizes = model(gen, torch.float32, device)
    xs.append(torch.arange(10, device=device))  # a second dtype: its own buffer
    dims.append(0)
    sizes.append(10)
    ids, indices = random_plan(gen, sizes, 2, p_empty=0.0, device=device)
    expect = [xs[t].index_select(dims[t] % xs[t].dim(), i) for t, i in zip(ids, indices)]
    holder = F.GatherBuffers(capacity=2)

    def ptr(segs):
        return segs[0].untyped_storage().data_ptr()

    a = F.gather_slices(xs, ids, indices, dims, out=holder)
    b = F.gather_slices(xs, ids, indices, dims, out=holder)  # a alive: another buffer
    assert ptr(a) != ptr(b) and holder.reused == 0
    c = F.gather_slices(xs, ids, indices, dims, out=holder)  # both alive, capacity 2: a fresh one
    assert ptr(c) not in (ptr(a), ptr(b))
    keep = a[3].view(-1)[1:]  # a view of a view keeps a's buffer alive
    pa = ptr(a)
    del a
    d = F.gather_slices(xs, ids, indices, dims, out=holder)
    assert ptr(d) not in (pa, ptr(b))
    assert holder.reused == 1  # a's int64 buffer was free: nothing kept it
    del keep, d
    e = F.gather_slices(xs, ids, indices, dims, out=holder)  # a's float buffer free again
    assert ptr(e) == pa and holder.reused == 3
    for got in (b, c, e):
        assert all(torch.equal(g, x) for g, x in zip(got, expect))
    p = torch.nn.Parameter(e[0])  # a parameter made from a segment holds the buffer too
    del e
    f = F.gather_slices(xs, ids, indices, dims, out=holder)
    assert ptr(f) != pa
    assert holder.nbytes > 0
    holder.clear()
    assert holder.nbytes == 0 and p.numel() > 0


def test_gather_buffers_grow_and_shrink():
    holder = F.GatherBuffers(capacity=1)
    a = holder.take(10, torch.float32, "cpu")
    pa = a.untyped_storage().data_ptr()
    del a
    b = holder.take(4, torch.float32, "cpu")  # a smaller request takes the kept buffer
    assert b.untyped_storage().data_ptr() == pa and b.shape == (4,) and b.is_contiguous()
    del b
    c = holder.take(20, torch.float32, "cpu")  # too small and free: replaced by a larger one
    assert c.numel() == 20 and holder.nbytes == 80
    d = holder.take(5, torch.float32, "cpu")  # c alive, capacity 1: a fresh, untracked buffer
    assert d.untyped_storage().data_ptr() != c.untyped_storage().data_ptr() and holder.nbytes == 80


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtype_bad_index_in_either_launch_writes_nothing(device):
    """Mixed dtypes run one launch per dtype, the group with the most indices first (it checks its
    own indices before writing); the others are checked before it. Errors name the caller's
    positions wherever the bad list is."""
    w = torch.randn(6, 4, device=device)
    n = torch.arange(5, device=device)
    v = torch.randn(3, device=device)
    before = [w.clone(), n.clone(), v.clone()]
    t = lambda *x: torch.tensor(x, device=device)  # noqa: E731
    for match, idx in (
            (r"indices\[0\]\[2\] = 9 is out of range", [t(0, 1, 9), t(2), t(0)]),       # first launch (float)
            (r"indices\[2\]\[0\] = 3 is out of range", [t(0, 1, 2), t(2), t(3)]),       # first launch, 2nd list
            (r"indices\[0\]\[1\] = 0 repeats indices\[0\]\[0\]", [t(0, 0, 1), t(2), t(0)]),
            (r"indices\[1\]\[0\] = 5 is out of range", [t(0, 1, 2), t(5), t(0)])):     # later launch (int64)
        upd = [torch.ones(3, 4, device=device), torch.ones(1, dtype=torch.int64, device=device),
               torch.ones(1, device=device)]
        with pytest.raises(BAD_INPUT, match=match):
            F.scatter_slices_([w, n, v], [0, 1, 2], upd, idx, [0, 0, 0], "mean")
        for a, b in zip((w, n, v), before):
            assert torch.equal(a, b)
        with pytest.raises(BAD_INPUT, match=match):
            F.gather_slices([w, n, v], [0, 1, 2], idx, [0, 0, 0])


# ---- regressions (issue 10): each reproduction gives the right result or a clean, named error
def test_gather_into_out_over_an_index_list_is_refused():
    """Item 1: out sharing memory with an int64 index list overwrote the indices while reading them
    (a segfault). Run as the issue did, in a fresh process, so that a crash fails this test."""
    code = ("import torch, ist_kernels; b = torch.tensor([0, 1, 0, 0]); "
            "torch.ops.ist_kernels.slice_gather_into_(b, [torch.full((4, 2), 10**12)], [0], [b[:2]], [0])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "ValueError: slice_gather_into_: out shares memory with indices[0]" in proc.stderr
    b = torch.tensor([0, 1, 0, 0])
    with pytest.raises(ValueError, match=r"out shares memory with indices\[0\]"):
        F._gather_flat([torch.full((4, 2), 10**12)], [0], [b[:2]], [0], out=b)
    assert torch.equal(b, torch.tensor([0, 1, 0, 0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_mean_is_overflow_safe(device, dtype):
    """Item 4: owners [inf, 3e38] and [inf, -3e38] gave [nan, -inf]; the mean is [inf, 0]. Near the
    largest finite value, opposite owners average to 0 and equal ones to themselves; nan and
    inf/-inf owners give nan, as the exact mean does."""
    big = torch.finfo(dtype).max * 0.9 if dtype != torch.float64 else 3e38
    inf, nan = math.inf, math.nan
    cases = [  # owners of each element -> mean
        ([inf, big], [inf, -big], [inf, 0.0]),
        ([big, -big], [big, big], [big, 0.0]),
        ([-big, inf], [-big, -inf], [-big, nan]),
        ([nan, 1.0], [2.0, 1.0], [nan, 1.0]),
    ]
    for first, second, want in cases:
        target = torch.zeros(2, dtype=dtype, device=device)
        upd = [torch.tensor(first, dtype=dtype, device=device), torch.tensor(second, dtype=dtype, device=device)]
        idx = [torch.tensor([0, 1], device=device)] * 2
        F.owner_average_(target, upd, idx)
        torch.testing.assert_close(target.cpu(), torch.tensor(want, dtype=dtype), equal_nan=True, rtol=0, atol=0)
    # three owners near the top of the range: (big + big - big) / 3 without overflow
    target = torch.zeros(1, dtype=dtype, device=device)
    F.owner_average_(target, [torch.tensor([v], dtype=dtype, device=device) for v in (big, big, -big)],
                     [torch.tensor([0], device=device)] * 3)
    torch.testing.assert_close(target.double().cpu(), torch.tensor([float(torch.tensor(big, dtype=dtype)) / 3],
                                                                  dtype=torch.float64), rtol=1e-2, atol=0)
    # owners that all return the target's values, inf and -0.0 included, leave it unchanged bit for bit
    target = torch.tensor([inf, -0.0, -inf, big, 1.5], dtype=dtype, device=device)
    before = target.clone()
    F.owner_average_(target, [target.clone()] * 3, [torch.arange(5, device=device)] * 3)
    assert torch.equal(target.view(torch.uint8 if dtype != torch.float64 else torch.int64),
                       before.view(torch.uint8 if dtype != torch.float64 else torch.int64))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtype_scatter_writes_nothing_before_its_checks(device):
    """Item 5: an int64 target that is the index list of another dtype's launch was written before
    that launch's check failed, and errors named per-group positions."""
    n = torch.arange(5, device=device)
    w = torch.randn(6, 4, device=device)
    before = (n.clone(), w.clone())
    t = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    with pytest.raises(ValueError, match=r"targets\[1\] shares memory with indices\[1\]"):
        F.scatter_slices_([w, n], [1, 0], [t(9, 9, 9, 9), torch.ones(4, 4, device=device)], [t(0, 1, 2, 3), n[:4]],
                         [0, 0], "copy")
    # the first launch (float32, the most indices) names the caller's position 3, not its own 1
    with pytest.raises(IndexError, match=r"indices\[3\]\[1\] = 9 is out of range for targets\[1\] along dim 0"):
        F.scatter_slices_([n, w], [0, 1, 0, 1], [t(9), torch.ones(1, 4, device=device), t(8),
                                                torch.ones(3, 4, device=device)],
                         [t(0), t(0), t(1), t(1, 9, 2)], [0, 0], "copy")
    # an expanded target of a later launch is named by the caller's position before anything runs
    with pytest.raises(ValueError, match=r"targets\[2\] has elements that share memory"):
        F.scatter_slices_([w, n, torch.zeros(1, device=device).expand(3)], [0, 1, 2],
                         [torch.ones(1, 4, device=device), t(7), torch.ones(1, device=device)], [t(0), t(1), t(2)],
                         [0, 0, 0], "copy")
    assert torch.equal(n, before[0]) and torch.equal(w, before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_sources_gather_into_a_buffer(device):
    """Item 6: a strided source made slice_gather_into_ / slice_gather(out=) /
    gather_slices(out=GatherBuffers) fail with "out shares memory" although nothing was shared."""
    src = torch.tensor([[5.0, 1, 0, 2, 3, 4]] * 4, device=device).cumsum(0)[:, ::2]
    idx = [torch.tensor([0, 2], device=device)]
    want = src.index_select(0, idx[0]).reshape(-1)
    out = torch.empty(6, device=device)
    ops.slice_gather_into_(out, [src], [0], idx, [0])
    assert torch.equal(out, want)
    assert torch.equal(F._gather_flat([src], [0], idx, [0], out=torch.empty(6, device=device)), want)
    holder = F.GatherBuffers()
    parts = F.gather_slices([src, torch.arange(3, device=device)], [0, 1], idx * 2, [0, 0], out=holder)
    assert torch.equal(parts[0].reshape(-1), want) and torch.equal(parts[1], torch.tensor([0, 2], device=device))
    # interleaved views of one buffer that share no element are fine as targets; sharing one is not
    buf = torch.zeros(24, device=device)
    F.scatter_slices_([buf[0::2].view(3, 4), buf[1::2].view(3, 4)], [0, 1],
                     [torch.ones(1, 4, device=device), 2 * torch.ones(1, 4, device=device)],
                     [torch.tensor([1], device=device)] * 2, [0, 0], "copy")
    assert buf.view(3, 8)[1].tolist() == [1.0, 2.0] * 4 and buf.view(3, 8)[[0, 2]].abs().sum() == 0
    with pytest.raises(ValueError, match=r"out shares memory with sources\[0\]"):
        ops.slice_gather_into_(buf[4:5], [buf[0::2]], [0], [torch.tensor([2], device=device)], [0])


def test_meta_index_list_is_named():
    """Item 8: a meta index list got "must be on the CPU or on cpu"."""
    with pytest.raises(ValueError, match=r"indices\[0\] is on meta but the tensors are on cpu; index lists must be "
                                         r"on the CPU$"):
        ops.slice_gather([torch.randn(3, 3)], [0], [torch.tensor([0], device="meta")], [0])
