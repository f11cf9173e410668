"""One partition round (build S subnetworks from the global model + aggregate them back, parameters,
BN buffers and SGD momentum) for LOFT on PreActResNet-18 and ResIST on PreActResNet-101, against the
Python loop of index_select / index_copy_ per tensor that the reference implementations run; and
the forward+backward time of one LOFT S=4 subnetwork against the full model.

Providers per round:
  * ``ist_kernels round``: ``plan.build(optimizer)`` (standalone nn.Modules + optimizers) and
    ``plan.aggregate(subnetworks, optimizer)``: one slice gather and one slice scatter.
  * ``ist_kernels gather+scatter``: the two op calls alone, on the same index tables (the gather into
    a reused buffer, as the plans do).
  * ``loop index_select/index_copy_``: per tensor and subnetwork an index_select to build, then per
    tensor index_copy_ (one owner) or a stacked mean over the owners copied back (shared, or a
    ResIST block several sub-ResNets own).
  * ``plan construction``: drawing the partition, its index tables and the subnetworks' module
    structure (once per round, whichever provider moves the tensors; no bytes counted).
Bytes: the gather reads and writes every segment; the scatter reads every update and writes every
owned element of the targets once.
"""
import pytest
import torch

import ist_kernels.functional as F
import ist_kernels.models as M
from ist_kernels.partition import loft_plan, resist_plan

from conftest import DEVICE, record, run

CPU = DEVICE == "cpu"
ROUNDS_PER_CASE = 5 if CPU else 20


def _setup(kind, S):
    gen = torch.Generator().manual_seed(0)
    if kind == "loft":
        model = M.preact_resnet18().to(DEVICE)
        plan = loft_plan(model, S, gen)
    else:
        model = M.preact_resnet101().to(DEVICE)
        plan = resist_plan(model, S, 5, gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # momentum present, as after the first round
        opt.state[p]["momentum_buffer"] = torch.randn_like(p) * 0.01
    return model, plan, opt


def _tables(model, plan, opt):
    """The flat lists both providers move: (tensor, dim, owners per subnetwork) for every
    parameter, buffer and momentum buffer."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    S = plan.slices.num_subnetworks
    items = []
    for t in plan.tensors:
        x = named[t.name].detach()
        if x.dim() == 0:
            x = x.view(1)
        full = torch.arange(x.shape[0], device=x.device)
        owners = [full] * S if t.shared else [None if i.numel() == 0 else i for i in t.owners]
        dim = 0 if t.shared else t.dim
        items.append((x, dim, owners))
        if t.name in dict(model.named_parameters()):
            items.append((opt.state[named[t.name]]["momentum_buffer"], dim, owners))
    return items


def _bytes(items):
    total = 0
    for x, dim, owners in items:
        per_index = x.numel() // x.shape[dim] * x.element_size()
        held = [i for i in owners if i is not None]
        seg = sum(i.numel() for i in held) * per_index
        owned = torch.unique(torch.cat(held)).numel() * per_index
        total += 2 * seg + seg + owned  # gather read + write; scatter read updates + write owned
    return total


def _loop_round(items):
    subs = [[None if i is None else x.index_select(d, i) for i in owners] for x, d, owners in items]
    for (x, d, owners), copies in zip(items, subs):
        held = [(i, c) for i, c in zip(owners, copies) if i is not None]
        if len(held) == 1 or all(i.numel() < x.shape[d] for i, _ in held):  # disjoint slices
            for i, c in held:
                x.index_copy_(d, i, c)
        elif x.is_floating_point():  # whole tensor held by several: mean over its holders
            x.copy_(torch.stack([c for _, c in held]).mean(0))
        else:  # num_batches_tracked
            x.copy_(torch.stack([c for _, c in held]).sum(0) // len(held))


def _op_round(items):
    sources = [x for x, _, _ in items]
    dims = [d for _, d, _ in items]
    ids, indices = [], []
    for t, (_, _, owners) in enumerate(items):
        for i in owners:
            if i is not None:
                ids.append(t)
                indices.append(i)

    buffers = F.GatherBuffers()  # the flat buffer is reused across rounds, as plan.build does

    def go():
        segs = F.gather_slices(sources, ids, indices, dims, out=buffers)
        F.scatter_slices_(sources, ids, segs, indices, dims, reduce="mean")
    return go


ROUNDS = [("loft", 2), ("loft", 4), ("loft", 8), ("resist", 2), ("resist", 4), ("resist", 8)]


@pytest.mark.parametrize("kind,S", ROUNDS, ids=[f"{k}-S{s}" for k, s in ROUNDS])
@pytest.mark.parametrize("provider", ["ist_kernels round", "ist_kernels gather+scatter",
                                      "loop index_select/index_copy_", "plan construction"])
def test_round(benchmark, peaks, kind, S, provider):
    model, plan, opt = _setup(kind, S)
    items = _tables(model, plan, opt)
    name = "preact_resnet18 LOFT" if kind == "loft" else "preact_resnet101 ResIST"
    record(benchmark, group=f"round: {name} S={S}", provider=provider,
           bytes=0 if provider == "plan construction" else _bytes(items),
           dtype=torch.float32, peaks=peaks)
    if provider == "ist_kernels round":
        run(benchmark, lambda: plan.aggregate(plan.build(opt), opt), rounds=ROUNDS_PER_CASE)
    elif provider == "ist_kernels gather+scatter":
        run(benchmark, _op_round(items), rounds=ROUNDS_PER_CASE)
    elif provider == "plan construction":  # drawing the partition, index tables, module structure
        gen = torch.Generator().manual_seed(1)
        make = (lambda: loft_plan(model, S, gen)) if kind == "loft" else (lambda: resist_plan(model, S, 5, gen))
        run(benchmark, make, rounds=ROUNDS_PER_CASE)
    else:
        run(benchmark, lambda: _loop_round(items), rounds=ROUNDS_PER_CASE)


BATCH, HW = (16, 16) if CPU else (128, 32)


@pytest.mark.parametrize("provider", ["full model", "ist_kernels LOFT S=4 subnetwork"])
def test_forward_backward(benchmark, provider):
    model = M.preact_resnet18().to(DEVICE)
    if provider != "full model":
        model = loft_plan(model, 4, torch.Generator().manual_seed(0)).build()[0].module
    x = torch.randn(BATCH, 3, HW, HW, device=DEVICE)
    flops = 0
    record(benchmark, group=f"fwd+bwd preact_resnet18 batch {BATCH} {HW}x{HW}", provider=provider,
           flops=flops, params=sum(p.numel() for p in model.parameters()))

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
    run(benchmark, step)
