"""F.slice_plan / PlannedSlices: a round's slice gather and scatter planned once (issue 19 item 2).

Equal to the per-call ops (bit for bit: the same kernels) and to the float64 references; odd
shapes, non-contiguous tensors, empty index lists, mixed dtypes; errors at build name the argument,
per-call mismatches are caught cheaply and write nothing; opcheck of the planned ops; on a GPU the
round's gather and scatter are captured in a CUDA graph and never synchronise.
"""
import pytest
import torch
from test_slices import TENSORS, compact_updates, model, random_plan

import ist_kernels.functional as F

import reference as ref
from conftest import DEVICES, requires_cuda

ops = torch.ops.ist_kernels


def plan_case(gen, device, dtype=torch.float32, owners=4, tensors=TENSORS, p_empty=0.15):
    xs, dims, sizes = model(gen, dtype, device, tensors)
    ids, indices = random_plan(gen, sizes, owners, p_empty=p_empty)  # host lists, as a round keeps them
    return xs, dims, ids, indices


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_gather_equals_per_call_and_reference(device, dtype, gen):
    xs, dims, ids, indices = plan_case(gen, device, dtype)
    plan = F.slice_plan(xs, ids, indices, dims)
    got = plan.gather(xs)
    want = F.gather_slices(xs, ids, indices, dims)
    expect = ref.slice_gather([x.cpu() for x in xs], ids, indices, dims)  # flat, concatenated
    assert len(got) == len(want) == len(ids)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    flat = torch.cat([g.reshape(-1) for g in got]) if got else expect
    assert torch.equal(flat.cpu(), expect)
    # The same views every call; a second gather of changed sources overwrites them.
    for x in xs:
        if dtype.is_floating_point:
            x.mul_(2)
    again = plan.gather(xs)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(again, got))  # the same views
    for g, w in zip(again, F.gather_slices(xs, ids, indices, dims)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_scatter_equals_per_call_and_reference(device, dtype, reduce, gen):
    xs, dims, ids, indices = plan_case(gen, device, dtype)
    updates = compact_updates(gen, xs, ids, indices, dims, dtype, device)
    a = [x.clone() for x in xs]
    b = [x.clone() for x in xs]
    expect = ref.slice_scatter([x.cpu() for x in xs], ids, [u.cpu() for u in updates], indices, dims, reduce)
    plan = F.slice_plan(a, ids, indices, dims)
    plan.scatter_(a, updates, reduce)
    F.scatter_slices_(b, ids, updates, indices, dims, reduce)
    for x, y, e in zip(a, b, expect):
        assert torch.equal(x, y)  # the same kernel, bit for bit
        if dtype.is_floating_point:
            tol = dict(rtol=0, atol=0) if reduce == "copy" else dict(rtol=8e-3, atol=8e-3)
            torch.testing.assert_close(x.cpu().double(), e.double(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_through_the_plans_views(device, gen):
    """A round: gather into the plan's views, change them in place, scatter them back (mean)."""
    xs, dims, ids, indices = plan_case(gen, device)
    ref_xs = [x.clone() for x in xs]
    plan = F.slice_plan(xs, ids, indices, dims)
    for _ in range(3):
        parts = plan.gather(xs)
        for k, p in enumerate(parts):
            p.mul_(0.5).add_(k)
        plan.scatter_(xs)  # default updates: the plan's views
        want = F.gather_slices(ref_xs, ids, indices, dims)
        want = [w.mul(0.5).add(k) for k, w in enumerate(want)]
        F.scatter_slices_(ref_xs, ids, want, indices, dims, "mean")
        for x, y in zip(xs, ref_xs):
            assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_and_empty(device, gen):
    xs, dims, ids, indices = plan_case(gen, device, p_empty=0.4)
    indices[0] = torch.empty(0, dtype=torch.int64)
    nc = [x.transpose(0, -1).contiguous().transpose(0, -1) if x.dim() > 1 else x[::1] for x in xs]
    assert any(not x.is_contiguous() for x in nc)
    plan = F.slice_plan(nc, ids, indices, dims)
    assert plan.gather(nc)[0].numel() == 0
    for g, w in zip(plan.gather(nc), F.gather_slices(xs, ids, indices, dims)):
        assert torch.equal(g, w)
    updates = compact_updates(gen, xs, ids, indices, dims, torch.float32, device)
    updates = [u.transpose(0, -1).contiguous().transpose(0, -1) if u.dim() > 1 else u for u in updates]
    b = [x.clone() for x in xs]
    plan.scatter_(nc, updates, "mean")
    F.scatter_slices_(b, ids, updates, indices, dims, "mean")
    for x, y in zip(nc, b):
        assert torch.equal(x, y)
    # A plan with no segments gathers nothing and leaves every target alone.
    empty = F.slice_plan(xs[:2], [], [], dims[:2])
    assert empty.gather(xs[:2]) == []
    before = [x.clone() for x in xs[:2]]
    empty.scatter_(xs[:2], [])
    assert all(torch.equal(x, y) for x, y in zip(xs[:2], before))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes(device, gen):
    xs, dims, ids, indices = plan_case(gen, device)
    xs = [x.double() if k % 3 == 1 else (x.half() if k % 3 == 2 else x) for k, x in enumerate(xs)]
    plan = F.slice_plan(xs, ids, indices, dims)
    for g, w in zip(plan.gather(xs), F.gather_slices(xs, ids, indices, dims)):
        assert g.dtype == w.dtype and torch.equal(g, w)
    updates = [torch.randn(u.shape, generator=gen).to(u.dtype).to(device) for u in plan.segments]
    a, b = [x.clone() for x in xs], [x.clone() for x in xs]
    plan.scatter_(a, updates, "mean")
    F.scatter_slices_(b, ids, updates, indices, dims, "mean")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_out(device, gen):
    xs, dims, ids, indices = plan_case(gen, device)
    plan = F.slice_plan(xs, ids, indices, dims)
    total = sum(p.numel() for p in plan.segments)
    out = torch.full((total,), 7.0, device=device)
    got = plan.gather(xs, out=out)
    assert all(g.numel() == 0 or g.data_ptr() >= out.data_ptr() for g in got)
    assert torch.equal(out, ops.slice_gather(xs, ids, indices, dims))


def test_build_errors_name_the_argument(gen):
    xs, dims, ids, indices = plan_case(gen, "cpu")
    with pytest.raises(ValueError, match="slice_plan: ids and indices"):
        F.slice_plan(xs, ids[:-1], indices, dims)
    with pytest.raises(IndexError, match=r"slice_plan: ids\[0\] = 99"):
        F.slice_plan(xs, [99] + ids[1:], indices, dims)
    bad = list(indices)
    bad[2] = torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"indices\[2\] must not repeat"):
        F.slice_plan(xs, ids, bad, dims)
    bad[2] = torch.tensor([10_000])
    with pytest.raises(IndexError, match=r"indices\[2\]\[0\] = 10000 is out of range for tensors\[2\]"):
        F.slice_plan(xs, ids, bad, dims)
    with pytest.raises(IndexError, match=r"dims\[0\]"):
        F.slice_plan(xs, ids, indices, [9] + dims[1:])
    with pytest.raises(ValueError, match="tensors is empty"):
        F.slice_plan([], [], [], [])
    mixed = [x.double() if k == 3 else x for k, x in enumerate(xs)]  # Python path: caller's positions
    bad[2] = torch.tensor([10_000])
    with pytest.raises(IndexError, match=r"indices\[2\]\[0\] = 10000"):
        F.slice_plan(mixed, ids, bad, dims)


def test_per_call_mismatch_writes_nothing(gen):
    xs, dims, ids, indices = plan_case(gen, "cpu")
    plan = F.slice_plan(xs, ids, indices, dims)
    parts = plan.gather(xs)
    snapshot = [p.clone() for p in parts]
    with pytest.raises(ValueError, match="built for 10 tensors, got 9 sources"):
        plan.gather(xs[:-1])
    wrong = list(xs)
    wrong[3] = torch.randn(34, 7)
    with pytest.raises(ValueError, match=r"sources\[3\] has shape \[34, 7\] but the plan was built for \[33, 7\]"):
        plan.gather(wrong)
    wrong[3] = xs[3].double()
    with pytest.raises(TypeError, match=r"sources\[3\] has dtype"):
        plan.gather(wrong)
    assert all(torch.equal(p, s) for p, s in zip(parts, snapshot))
    targets = [x.clone() for x in xs]
    before = [t.clone() for t in targets]
    bad = list(parts)
    bad[1] = bad[1][..., :0] if bad[1].dim() > 1 else bad[1][:0]
    with pytest.raises(ValueError, match=r"updates\[1\] has shape"):
        plan.scatter_(targets, bad, "mean")
    with pytest.raises(ValueError, match="segments but got"):
        plan.scatter_(targets, parts[:-1], "mean")
    with pytest.raises(ValueError, match='reduce must be "copy", "sum" or "mean"'):
        plan.scatter_(targets, parts, "max")
    alias = list(parts)
    alias[0] = targets[ids[0]]  # an update that is a target
    if alias[0].shape == parts[0].shape:
        with pytest.raises(ValueError):
            plan.scatter_(targets, alias, "mean")
    assert all(torch.equal(t, b) for t, b in zip(targets, before))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    xs, dims, ids, indices = plan_case(gen, device, tensors=TENSORS[:5], owners=2)
    plan = ops.slice_plan(xs, ids, indices, dims)
    total = int(plan[3])
    cache = F.slice_plan(xs, ids, indices, dims)._groups[0]
    out = torch.empty(total, device=device)
    torch.library.opcheck(ops.slice_plan_gather_.default, (out, xs, plan, cache.cache("gather_cache")))
    updates = compact_updates(gen, xs, ids, indices, dims, torch.float32, device)
    for reduce in ("copy", "sum", "mean"):
        torch.library.opcheck(ops.slice_plan_scatter_.default, (xs, updates, plan, reduce, cache.cache("scatter_cache")))


def test_repr_and_segments(gen):
    xs, dims, ids, indices = plan_case(gen, "cpu")
    plan = F.slice_plan(xs, ids, indices, dims)
    assert "segments=%d" % len(ids) in repr(plan)
    assert [tuple(p.shape) for p in plan.segments] == [tuple(w.shape) for w in F.gather_slices(xs, ids, indices, dims)]


# ---- CUDA: a round's gather / scatter captured in a graph, and no synchronisation
@requires_cuda
def test_cuda_graph_capture(gen):
    xs, dims, ids, indices = plan_case(gen, "cuda")
    plan = F.slice_plan(xs, ids, indices, dims)
    targets = [x.clone() for x in xs]
    plan.gather(xs)
    plan.scatter_(targets, reduce="mean")  # first calls upload the records
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        parts = plan.gather(xs)
        for p in parts:
            p.mul_(0.5)
        plan.scatter_(targets, parts, "mean")
    for _ in range(3):
        for x in xs:
            x.add_(1.0)
        expect = [t.clone() for t in targets]
        want = [w.mul(0.5) for w in F.gather_slices(xs, ids, indices, dims)]
        F.scatter_slices_(expect, ids, want, indices, dims, "mean")
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(p, w) for p, w in zip(parts, want))
        assert all(torch.equal(t, e) for t, e in zip(targets, expect))


@requires_cuda
def test_cuda_no_sync(gen):
    xs, dims, ids, indices = plan_case(gen, "cuda")
    plan = F.slice_plan(xs, ids, indices, dims)
    targets = [x.clone() for x in xs]
    plan.gather(xs)
    plan.scatter_(targets)  # first calls upload the records
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            parts = plan.gather(xs)
            plan.scatter_(targets, parts, "mean")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    b = [x.clone() for x in xs]
    F.scatter_slices_(b, ids, F.gather_slices(xs, ids, indices, dims), indices, dims, "mean")
    assert all(torch.equal(x, y) for x, y in zip(targets, b))
