"""Multi-tensor slice gather / scatter for a model's worth of tensors, against the Python loops
they replace (index_select / index_copy_ / index_add_ per tensor, as the reference IST, LOFT and
ResIST codes do).

The model: the convs and BN vectors of a ResNet-18-like network (conv filters sliced along dim 0,
the next conv's input channels along dim 1, BN vectors along dim 0), ~60 tensors. Each of S = 4
subnetworks owns a random half of every tensor's slices (IST Bernoulli masks with xi = 1/2, so
slices have 0-4 owners). Bytes counted: what the op must read and write (segment bytes in and out
for the gather; updates read and owned target elements written for the scatter, plus the target
read for sum). Index lists live on the host, as the Exchange keeps them: the ops then never wait
for the device (the loops get device copies).
"""
import pytest
import torch

import ist_kernels.functional as F

from conftest import DEVICE, record, run, sync

S = 4


def model_tensors(width: int, device, dtype=torch.float32):
    """(tensor, dim) for the residual blocks of a ResNet-18-like network of base width `width`, cut
    as LOFT cuts them: conv1's filters (dim 0), bn1's four vectors (dim 0), conv2's input channels
    (dim 1), and bn2's two affine vectors (dim 0): 8 tensors per block, 64 in all."""
    g = torch.Generator().manual_seed(0)
    out = []
    c_in = width
    for stage in range(4):
        c = width * 2**stage
        for _ in range(2):
            out.append((torch.randn(c, c_in, 3, 3, generator=g).to(device, dtype), 0))
            out += [(torch.randn(c, generator=g).to(device, dtype), 0) for _ in range(4)]
            out.append((torch.randn(c, c, 3, 3, generator=g).to(device, dtype), 1))
            out += [(torch.randn(c, generator=g).to(device, dtype), 0) for _ in range(2)]
            c_in = c
    return out


def plan(tensors, owners=S, keep=0.5):
    g = torch.Generator().manual_seed(1)
    ids, indices = [], []
    for s in range(owners):
        for t, (x, d) in enumerate(tensors):
            n = x.shape[d]
            k = max(1, int(round(keep * n)))
            ids.append(t)
            indices.append(torch.randperm(n, generator=g)[:k].sort().values)  # host lists: no sync
    return ids, indices


def setup(width):
    tensors = model_tensors(width, DEVICE)
    xs = [x for x, _ in tensors]
    dims = [d for _, d in tensors]
    ids, indices = plan(tensors)
    segs = F.gather_slices(xs, ids, indices, dims)
    updates = [s + 0.01 for s in segs]
    seg_bytes = sum(s.numel() * s.element_size() for s in segs)
    owned = 0
    for t, (x, d) in enumerate(tensors):
        mask = torch.zeros(x.shape[d], dtype=torch.bool)
        for j, i in zip(ids, indices):
            if j == t:
                mask[i.cpu()] = True
        owned += int(mask.sum()) * (x.numel() // x.shape[d]) * x.element_size()
    numel = sum(x.numel() for x in xs)
    return xs, dims, ids, indices, updates, seg_bytes, owned, numel


def on_device(indices):
    """The loops' index lists: torch's index ops want them on the data's device."""
    return [i.to(DEVICE) for i in indices]


WIDTHS = [pytest.param(60, id="resnet18-width60")] if DEVICE == "cpu" else [
    pytest.param(64, id="resnet18"), pytest.param(256, id="resnet18-width256")]


def device_copy(nbytes):
    """The floor of a memory-bound op: one flat device copy reading and writing ``nbytes`` each."""
    src = torch.randn(max(1, nbytes // 4), device=DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# ---- Python-loop baselines (one or more launches per tensor)
def loop_gather(xs, ids, indices, dims):
    return [xs[t].index_select(dims[t], i) for t, i in zip(ids, indices)]


def loop_scatter_copy(xs, ids, updates, indices, dims):
    for t, u, i in zip(ids, updates, indices):
        xs[t].index_copy_(dims[t], i, u)


def loop_scatter_sum(xs, ids, updates, indices, dims):
    for t, u, i in zip(ids, updates, indices):
        xs[t].index_add_(dims[t], i, u)


def loop_owner_average(xs, ids, updates, indices, dims):
    """Per tensor: sum the owners and count them with index_add_, then average where owned."""
    for t, x in enumerate(xs):
        d = dims[t]
        acc = torch.zeros_like(x)
        count = torch.zeros(x.shape[d], device=x.device, dtype=x.dtype)
        for j, u, i in zip(ids, updates, indices):
            if j == t:
                acc.index_add_(d, i, u)
                count.index_add_(0, i, torch.ones_like(i, dtype=x.dtype))
        shape = [1] * x.dim()
        shape[d] = -1
        count = count.view(shape)
        x.copy_(torch.where(count > 0, acc / count.clamp(min=1), x))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("provider", ["ist_kernels", "ist_kernels into a reused buffer",
                                      "ist_kernels planned (F.slice_plan)", "loop_index_select", "device copy"])
def test_gather(benchmark, peaks, width, provider):
    xs, dims, ids, indices, _, seg_bytes, _, numel = setup(width)
    buffers = F.GatherBuffers()
    dev_indices = on_device(indices)
    planned = F.slice_plan(xs, ids, indices, dims) if "planned" in provider else None
    fn = {"ist_kernels": lambda: F.gather_slices(xs, ids, indices, dims),
          "ist_kernels planned (F.slice_plan)": lambda: planned.gather(xs),
          "ist_kernels into a reused buffer": lambda: F.gather_slices(xs, ids, indices, dims, out=buffers),
          "loop_index_select": lambda: loop_gather(xs, ids, dev_indices, dims),
          "device copy": device_copy(seg_bytes)}[provider]
    record(benchmark, group=f"slice gather S={S} xi=1/2 {len(xs)} tensors {numel / 1e6:.1f}M el", provider=provider,
           bytes=2 * seg_bytes, dtype=torch.float32, peaks=peaks, segments=len(ids))
    run(benchmark, fn)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("reduce,provider", [
    ("mean", "ist_kernels"), ("mean", "ist_kernels planned (F.slice_plan)"), ("mean", "loop_index_add_count_where"),
    ("sum", "ist_kernels"), ("sum", "loop_index_add_"),
    ("copy", "ist_kernels"), ("copy", "loop_index_copy_"), ("copy", "device copy"),
])
def test_scatter(benchmark, peaks, width, reduce, provider):
    xs, dims, ids, indices, updates, seg_bytes, owned, numel = setup(width)
    loops = {"mean": loop_owner_average, "sum": loop_scatter_sum, "copy": loop_scatter_copy}
    nbytes = seg_bytes + owned * (2 if reduce == "sum" else 1)
    if provider == "device copy":
        fn = device_copy(nbytes // 2)
    elif provider == "ist_kernels":
        def fn():
            F.scatter_slices_(xs, ids, updates, indices, dims, reduce)
    elif provider.startswith("ist_kernels planned"):
        planned = F.slice_plan(xs, ids, indices, dims)

        def fn():
            planned.scatter_(xs, updates, reduce)
    else:
        dev_indices = on_device(indices)

        def fn():
            loops[reduce](xs, ids, updates, dev_indices, dims)
    record(benchmark, group=f"slice scatter {reduce} S={S} xi=1/2 {len(xs)} tensors {numel / 1e6:.1f}M el",
           provider=provider, bytes=nbytes, dtype=torch.float32, peaks=peaks, segments=len(ids))
    run(benchmark, fn)


# ---- Host time per call (issue 19 item 2): a round's gather and scatter of 64 small tensors, where
# the call's host work (checks, planning, launch) is all there is. The plan (F.slice_plan) is built
# once, outside the timing, as a round builds it once; target: <= 100 us per call.
def host_case():
    tensors = model_tensors(2, DEVICE)  # 64 tensors, base width 2: every copy is a few bytes
    xs = [x for x, _ in tensors]
    dims = [d for _, d in tensors]
    ids, indices = plan(tensors, owners=1)
    return xs, dims, ids, indices


def host_seconds(fn, calls=200, repeats=7):
    """Median host seconds per call of ``fn`` (no device sync inside the timing: what the host spends
    issuing the call; on a GPU the launches run behind it)."""
    import time

    for _ in range(20):
        fn()
    sync()
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls)
        sync()
    return sorted(per)[len(per) // 2]


HOST_PROVIDERS = {
    "gather": ["planned (F.slice_plan, built once)", "per call (F.gather_slices)", "per call op (slice_gather)",
               "torch.cat of index_select"],
    "scatter mean": ["planned (F.slice_plan, built once)", "per call (F.scatter_slices_)"],
}


@pytest.mark.parametrize("what,provider", [(w, p) for w, ps in HOST_PROVIDERS.items() for p in ps])
def test_host_time_per_call(benchmark, what, provider):
    xs, dims, ids, indices = host_case()
    planned = F.slice_plan(xs, ids, indices, dims)
    targets = [x.clone() for x in xs]
    parts = planned.gather(xs)
    dev_indices = on_device(indices)
    fn = {
        ("gather", HOST_PROVIDERS["gather"][0]): lambda: planned.gather(xs),
        ("gather", HOST_PROVIDERS["gather"][1]): lambda: F.gather_slices(xs, ids, indices, dims),
        ("gather", HOST_PROVIDERS["gather"][2]): lambda: torch.ops.ist_kernels.slice_gather(xs, ids, indices, dims),
        ("gather", HOST_PROVIDERS["gather"][3]):
            lambda: torch.cat([xs[t].index_select(dims[t], i).reshape(-1) for t, i in zip(ids, dev_indices)]),
        ("scatter mean", HOST_PROVIDERS["scatter mean"][0]): lambda: planned.scatter_(targets, parts, "mean"),
        ("scatter mean", HOST_PROVIDERS["scatter mean"][1]):
            lambda: F.scatter_slices_(targets, ids, parts, indices, dims, "mean"),
    }[(what, provider)]
    seconds = host_seconds(fn)
    record(benchmark, group=f"host time per call: slice {what}, {len(xs)} tensors, {len(ids)} segments",
           provider=provider, segments=len(ids), host_us=seconds * 1e6, target_us=100)
    print(f"\n{what:12s} {provider:40s} {seconds * 1e6:8.1f} us per call (host)")
    run(benchmark, fn)
