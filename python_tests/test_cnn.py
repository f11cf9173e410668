"""CNN subnetworks: models, LOFT filter partitions, ResIST block partitions, pruning, filter distance."""
import copy
import math

import pytest
import torch
from torch import nn

import ist_kernels.functional as F
import ist_kernels.models as M
from ist_kernels.metrics import (
    filter_distance,
    layer_filter_distances,
    pairwise_filter_distances,
    plot_filter_distances,
)
from ist_kernels.partition import SlicePlan, loft_plan, resist_plan
from ist_kernels.prune import filters_to_keep, prune_filters

import reference as ref
from conftest import DEVICES


def _x(gen, n=2, c=3, hw=8, dtype=torch.float64, device="cpu"):
    return torch.randn(n, c, hw, hw, generator=gen, dtype=dtype).to(device)


def _randomize_bn(model, gen):
    """Non-trivial BN statistics and affine parameters, so a wrong channel shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
    return model


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("factory,kwargs", [
    (M.preact_resnet18, {}), (M.resnet18, {}), (M.preact_resnet34, {"width": 8}),
    (M.resnet34, {"width": 8}), (M.preact_resnet50, {"width": 4}), (M.preact_resnet101, {"width": 2}),
    (M.preact_resnet152, {"width": 2}), (M.preact_resnet200, {"width": 2}), (M.wide_resnet34, {"k": 1}),
    (M.preact_resnet101_basic, {"width": 2}),
])
def test_models_forward_8x8(factory, kwargs, gen):
    model = factory(num_classes=7, in_channels=5, **kwargs)
    x = _x(gen, c=5, dtype=torch.float32)
    out = model(x)
    assert out.shape == (2, 7) and torch.isfinite(out).all()
    names = dict(model.named_children())
    assert "conv1" in names and "fc" in names and "layer1" in names and "layer3" in names
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_model_depths_and_sizes():
    blocks = lambda m: [len(getattr(m, f"layer{i}")) for i in range(1, m.num_stages + 1)]  # noqa: E731
    assert blocks(M.preact_resnet101(width=2)) == [3, 4, 23, 3]
    assert blocks(M.preact_resnet152(width=2)) == [3, 8, 36, 3]
    assert blocks(M.preact_resnet200(width=2)) == [3, 24, 36, 3]
    assert blocks(M.wide_resnet34(k=1)) == [5, 5, 5]
    # Parameter counts of the standard networks: PreActResNet-18 (11.17M), WRN-34-10 widths.
    assert sum(p.numel() for p in M.preact_resnet18().parameters()) == 11_172_170
    w = M.wide_resnet34(k=10, num_classes=10)
    assert w.layer1[0].conv1.out_channels == 160 and w.layer3[4].conv2.out_channels == 640
    with pytest.raises(ValueError, match="k must be >= 1"):
        M.wide_resnet34(k=0)


# Paper 003 Table 1, "Local SGD" row: GB (1e9 bytes) sent per round with ResNet101 on 2 / 4 / 8 machines.
PAPER_003_TABLE1_LOCAL_SGD = {2: 0.662, 4: 1.325, 8: 2.649}


def test_preact_resnet101_basic_is_paper_003s_resnet101():
    """Paper 003's ResNet101 has basic blocks: 41.4M parameters for CIFAR-100, and 2·S fp32 models
    (each worker uploads and downloads the whole model) give Table 1's local-SGD column exactly."""
    with torch.device("meta"):  # shapes only: no 165 MB to initialise
        basic = M.preact_resnet101_basic(num_classes=100)
        bottleneck = M.preact_resnet101(num_classes=100)
    blocks = [len(getattr(basic, f"layer{i}")) for i in range(1, 5)]
    assert blocks == [3, 4, 23, 3] and all(isinstance(b, M.PreActBlock) for b in basic.layer3)
    n = sum(p.numel() for p in basic.parameters())
    # stem + per stage (first block with its projection, then the rest) + final BN + fc, by hand
    conv = lambda cin, cout, k=3: cin * cout * k * k  # noqa: E731
    by_hand = conv(3, 64) + 2 * 512 + 512 * 100 + 100
    cin = 64
    for width, count in zip((64, 128, 256, 512), blocks):
        for j in range(count):
            proj = conv(cin, width, 1) if cin != width else 0
            by_hand += 2 * cin + conv(cin, width) + 2 * width + conv(width, width) + proj
            cin = width
    assert n == by_hand == 41_397_924
    assert round(n / 1e6, 1) == 41.4
    for S, gb in PAPER_003_TABLE1_LOCAL_SGD.items():
        assert round(2 * S * 4 * n / 1e9, 3) == gb, S
    # the bottleneck ResNet-101 (kept as preact_resnet101) does not match the table
    nb = sum(p.numel() for p in bottleneck.parameters())
    assert round(2 * 2 * 4 * nb / 1e9, 3) != PAPER_003_TABLE1_LOCAL_SGD[2]


def test_paper_003_table1_constants_match_the_paper():
    """The constants above are the paper's (where the papers' text is at hand)."""
    import glob
    import os
    import re

    files = glob.glob(os.path.join(os.environ.get("IST_PAPERS_DIR", "/work/shared/papers"), "003_*.txt"))
    if not files:
        pytest.skip("paper 003's text is not on this machine (set IST_PAPERS_DIR)")
    with open(files[0]) as f:
        row = next(line for line in f if re.match(r"\s*Local SGD\s+[\d.]+ GB", line))
    assert [float(v) for v in re.findall(r"([\d.]+) GB", row)] == list(PAPER_003_TABLE1_LOCAL_SGD.values())


def test_resist_plan_on_preact_resnet101_basic(gen):
    """ResIST partitions the 22 blocks of layer3 after its first; sub-ResNets run and aggregate."""
    model = M.preact_resnet101_basic(num_classes=5, width=2)
    before = _state(model)
    plan = resist_plan(model, 4, 5, gen)
    assert plan.partitioned_blocks == [f"layer3.{j}" for j in range(1, 23)]
    assert sorted(len(b) for b in plan.blocks) == [5, 5, 6, 6] and plan.residual_scale == pytest.approx(1 / 4)
    subs = plan.build()
    x = _x(gen, dtype=torch.float32)
    for s, sub in enumerate(subs):
        assert len(sub.module.layer3) == 1 + len(plan.blocks[s])
        assert sub.module.eval()(x).shape == (2, 5)
    plan.aggregate(subs)  # unchanged subnetworks: the model comes back as it was (BN stats too)
    after = _state(model)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ LOFT
LOFT_MODELS = [
    lambda: M.preact_resnet18(width=8),
    lambda: M.resnet18(width=8),
    lambda: M.preact_resnet50(width=4),
    lambda: M.wide_resnet34(k=1),
]


def _loft_reference(model, plan, s):
    """The full model with the next conv's input channels of the other subnetworks' filters zeroed."""
    full = copy.deepcopy(model)
    for b in plan.blocks:
        _, _, next_name = plan.layers[b.name]
        nxt = full.get_submodule(f"{b.name}.{next_name}")
        others = torch.ones(nxt.in_channels, dtype=torch.bool)
        others[plan.filters[b.name][s]] = False
        with torch.no_grad():
            nxt.weight[:, others.to(nxt.weight.device)] = 0
    return full


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", range(len(LOFT_MODELS)))
@pytest.mark.parametrize("S", [2, 3])
def test_loft_subnetwork_equals_zeroed_full_model(device, make, S, gen):
    model = _randomize_bn(LOFT_MODELS[make](), gen).double().to(device)
    plan = loft_plan(model, S, gen)
    subs = plan.build()
    x = _x(gen, device=device)
    for s, sub in enumerate(subs):
        full = _loft_reference(model, plan, s)
        # Physically narrower: the filter conv of each partitioned block has only s's filters.
        for b in plan.blocks:
            conv_name = plan.layers[b.name][0]
            assert sub.module.get_submodule(f"{b.name}.{conv_name}").weight.shape[0] == plan.filters[b.name][s].numel()
        for train in (False, True):
            full.train(train)
            sub.module.train(train)
            # Train-mode BN over 2 samples at 1x1 (layer4) amplifies float64 rounding of the
            # narrower convs' sums; a wrong channel would still be off by O(1).
            tol = 1e-7 if train else 1e-10
            torch.testing.assert_close(sub.module(x), full(x), rtol=tol, atol=tol)
        # Train-mode BN statistics of the owned channels move exactly as in the full model.
        for b in plan.blocks:
            bn_name = plan.layers[b.name][1]
            idx = plan.filters[b.name][s].to(device)
            torch.testing.assert_close(sub.module.get_submodule(f"{b.name}.{bn_name}").running_mean,
                                       full.get_submodule(f"{b.name}.{bn_name}").running_mean[idx],
                                       rtol=1e-7, atol=1e-9)


def test_loft_partition_properties(gen):
    model = M.preact_resnet34(width=8)
    S = 3
    plan = loft_plan(model, S, gen)
    assert isinstance(plan.slices, SlicePlan) and plan.slices.num_subnetworks == S
    expected_blocks = {f"layer{i}.{j}" for i, n in enumerate([3, 4, 6, 3], 1) for j in range(1, n)}
    assert {b.name for b in plan.blocks} == expected_blocks  # first of each stage and strided skipped
    for name in expected_blocks:
        sets = plan.filters[name]
        F_ = model.get_submodule(name).conv1.out_channels
        assert sorted(torch.cat(sets).tolist()) == list(range(F_))  # disjoint and covering
        assert max(len(i) for i in sets) - min(len(i) for i in sets) <= 1
        assert all(torch.equal(i, i.sort().values) for i in sets)
    part = {t.name: t for t in plan.partitioned}
    expected = set()
    for name in expected_blocks:
        expected |= {f"{name}.conv1.weight", f"{name}.conv2.weight", f"{name}.bn2.weight",
                     f"{name}.bn2.bias", f"{name}.bn2.running_mean", f"{name}.bn2.running_var"}
    assert set(part) == expected
    assert all(part[n].dim == (1 if n.endswith("conv2.weight") else 0) for n in part)
    shared = {t.name for t in plan.shared}
    for name in ["conv1.weight", "fc.weight", "fc.bias", "layer1.0.conv1.weight", "layer2.0.conv1.weight",
                 "layer2.0.shortcut.0.weight", "layer3.1.bn1.weight", "layer3.1.bn2.num_batches_tracked",
                 "bn.running_var"]:
        assert name in shared
    assert shared | set(part) == set(model.state_dict())
    # Reproducible from the generator; different draws differ.
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    p1 = loft_plan(model, S, torch.Generator().manual_seed(seed))
    p2 = loft_plan(model, S, torch.Generator().manual_seed(seed))
    p3 = loft_plan(model, S, torch.Generator().manual_seed(seed + 1))
    assert all(torch.equal(a, b) for n in expected_blocks for a, b in zip(p1.filters[n], p2.filters[n]))
    assert any(not torch.equal(a, b) for n in expected_blocks for a, b in zip(p1.filters[n], p3.filters[n]))


def test_loft_foreign_resnet(gen):
    """A user's ResNet (own block class, post-activation order, no residual_scale) partitions as is."""
    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv_a = nn.Conv2d(c, c, 3, padding=1, bias=True)
            self.norm_a = nn.BatchNorm2d(c)
            self.conv_b = nn.Conv2d(c, c, 3, padding=1, bias=True)
            self.norm_b = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.norm_b(self.conv_b(torch.relu(self.norm_a(self.conv_a(x))))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
            self.layer1 = nn.Sequential(Block(6), Block(6), Block(6))
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(self.layer1(self.conv1(x)).mean((2, 3)))

    model = _randomize_bn(Net(), gen).double()
    plan = loft_plan(model, 2, gen)
    assert [b.name for b in plan.blocks] == ["layer1.1", "layer1.2"]
    assert plan.layers["layer1.1"] == ("conv_a", "norm_a", "conv_b")
    assert "layer1.1.conv_a.bias" in {t.name for t in plan.partitioned}
    x = _x(gen)
    for s, sub in enumerate(plan.build()):
        full = _loft_reference(model, plan, s)
        for train in (False, True):
            full.train(train)
            sub.module.train(train)
            tol = 1e-7 if train else 1e-10
            torch.testing.assert_close(sub.module(x), full(x), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------- ResIST
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("S,min_depth", [(2, 2), (4, 1), (3, 4)])
def test_resist_subnetwork_equals_full_model_without_other_blocks(device, S, min_depth, gen):
    model = _randomize_bn(M.preact_resnet50(width=4), gen).double().to(device)  # 5 partitioned blocks
    plan = resist_plan(model, S, min_depth, gen)
    subs = plan.build()
    x = _x(gen, device=device)
    for s, sub in enumerate(subs):
        assert len(sub.module.layer3) == 1 + len(plan.blocks[s])
        full = copy.deepcopy(model)
        for name in plan.partitioned_blocks:
            full.get_submodule(name).residual_scale = 1.0 if name in plan.blocks[s] else 0.0
        for train in (False, True):
            full.train(train)
            sub.module.train(train)
            torch.testing.assert_close(sub.module(x), full(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("S,min_depth", [(2, 5), (4, 5), (8, 5), (8, 1), (3, 22), (1, 0)])
def test_resist_partition_properties(S, min_depth, gen):
    model = M.preact_resnet101(width=2)
    plan = resist_plan(model, S, min_depth, gen)
    P = 22
    assert plan.partitioned_blocks == [f"layer3.{j}" for j in range(1, 23)]
    depths = [len(b) for b in plan.blocks]
    assert all(d >= min_depth for d in depths)
    assert all(len(set(b)) == len(b) for b in plan.blocks)
    assert all(len(plan.owners[b]) >= 1 for b in plan.partitioned_blocks)  # every block owned
    if S * min_depth <= P:  # round-robin alone suffices: disjoint, depths differ by at most one
        assert sum(depths) == P and max(depths) - min(depths) <= 1
    assert plan.residual_scale == pytest.approx(sum(depths) / (P * S))
    if S * min_depth <= P:
        assert plan.residual_scale == pytest.approx(1 / S)
    owners_from_blocks = {b: [s for s in range(S) if b in plan.blocks[s]] for b in plan.partitioned_blocks}
    assert owners_from_blocks == plan.owners
    for t in plan.tensors:
        block = ".".join(t.name.split(".")[:2])
        if block in plan.partitioned_blocks:
            assert t.dim == 0
            assert [s for s in range(S) if t.owners[s].numel() > 0] == plan.owners[block]
        else:
            assert t.shared
    # The full model is scaled at evaluation once aggregated; sub-ResNets run unscaled.
    subs = plan.build()
    plan.aggregate(subs)
    assert all(model.get_submodule(b).residual_scale == plan.residual_scale for b in plan.partitioned_blocks)
    assert model.layer3[0].residual_scale == 1.0 and model.layer2[1].residual_scale == 1.0
    next_subs = resist_plan(model, S, min_depth, gen).build()
    assert all(b.residual_scale == 1.0 for sub in next_subs for b in sub.module.layer3)


# ----------------------------------------------------------------------------------- aggregation
def _plans(kind, gen, device="cpu"):
    if kind == "loft":
        model = M.preact_resnet18(width=8).to(device)
        return model, loft_plan(model, 3, gen)
    model = M.preact_resnet50(width=4).to(device)
    return model, resist_plan(model, 3, 3, gen)  # 5 blocks, 3 sub-ResNets of >= 3: shared blocks


def _step(model, opt, gen, device="cpu"):
    model.train()
    opt.zero_grad()
    model(_x(gen, n=4, dtype=torch.float32, device=device)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["loft", "resist"])
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_aggregate_unchanged_is_identity(device, kind, opt_kind, gen):
    model, plan = _plans(kind, gen, device)
    groups = [{"params": [p for n, p in model.named_parameters() if "bn" not in n], "weight_decay": 5e-4},
              {"params": [p for n, p in model.named_parameters() if "bn" in n], "weight_decay": 0.0}]
    opt = (torch.optim.SGD(groups, lr=0.1, momentum=0.9) if opt_kind == "sgd"
           else torch.optim.Adam(groups, lr=1e-3))
    _step(model, opt, gen, device)
    _step(model, opt, gen, device)
    before = _state(model)
    state_before = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    subs = plan.build(opt)
    for sub in subs:  # hyperparameters and groups carried over
        assert type(sub.optimizer) is type(opt)
        assert [g["weight_decay"] for g in sub.optimizer.param_groups] == [5e-4, 0.0]
        assert len(sub.optimizer.state) == sum(1 for _ in sub.module.parameters())
    plan.aggregate(subs, opt)
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    for n, p in model.named_parameters():
        for k, v in state_before[n].items():
            assert torch.equal(opt.state[p][k], v), (n, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["loft", "resist"])
@pytest.mark.parametrize("subset", [False, True])
def test_aggregate_after_updates_matches_reference(device, kind, subset, gen):
    model, plan = _plans(kind, gen, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _step(model, opt, gen, device)
    before = _state(model)
    mom_before = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    subs = plan.build(opt)
    for sub in subs:  # independent local SGD: parameters, BN statistics, momentum all move
        for _ in range(2):
            _step(sub.module, sub.optimizer, gen, device)
    if subset:
        subs = [subs[0], subs[2]]
    sub_states = [dict() for _ in range(plan.slices.num_subnetworks)]
    sub_moms = [dict() for _ in range(plan.slices.num_subnetworks)]
    for sub in subs:
        local = sub.module.state_dict()
        params = dict(sub.module.named_parameters())
        for t in plan.tensors:
            name = plan.local_names[t.name][sub.index]
            if name is not None:
                sub_states[sub.index][t.name] = local[name]
                if name in params:
                    sub_moms[sub.index][t.name] = sub.optimizer.state[params[name]]["momentum_buffer"]
    dims = {t.name: t.dim for t in plan.tensors}
    owners = {t.name: [None if i.numel() == 0 else i for i in t.owners] if not t.shared else None
              for t in plan.tensors}
    expected = ref.aggregate_owner_mean(before, dims, owners, sub_states)
    expected_mom = ref.aggregate_owner_mean(mom_before, dims, owners, sub_moms)
    plan.aggregate(subs, opt)
    after = model.state_dict()
    for k, v in expected.items():
        got = after[k].cpu()
        if got.dtype == torch.int64:
            assert torch.equal(got, v.long()), k
        else:
            _assert_mean_close(got, v, [st[k] for st in sub_states if k in st], k)
    for n, p in model.named_parameters():
        _assert_mean_close(opt.state[p]["momentum_buffer"].cpu(), expected_mom[n],
                           [st[n] for st in sub_moms if n in st], n)


def _assert_mean_close(got, expected, addends, name):
    """A float32 mean of S addends is within S rounding steps of the addends' magnitude."""
    scale = max([a.detach().abs().max().item() for a in addends if a.numel()] + [1e-30])
    err = (got.double() - expected).abs().max().item() if got.numel() else 0.0
    assert err <= 4 * 2**-23 * scale, (name, err, scale)


def test_aggregate_counters_take_the_owners_maximum(gen):
    """BN num_batches_tracked of a ResIST block owned by several sub-ResNets is the largest owner
    count, never a truncated mean; LOFT's shared counters the largest over all subnetworks."""
    model, plan = _plans("resist", gen)  # 5 blocks into 3 sub-ResNets of >= 3 blocks: shared blocks
    shared_block = next(b for b in plan.partitioned_blocks if len(plan.owners[b]) >= 2)
    subs = plan.build()
    counts = {}
    for sub in subs:
        for name in plan.blocks[sub.index]:
            local = plan.local_names[f"{name}.bn1.num_batches_tracked"][sub.index]
            c = 10 + sub.index if name == shared_block else 20 + sub.index
            sub.module.get_buffer(local).fill_(c)
            counts.setdefault(name, []).append(c)
    plan.aggregate(subs)
    for name, cs in counts.items():
        got = int(model.get_buffer(f"{name}.bn1.num_batches_tracked"))
        assert got == max(cs), (name, got, cs)
    assert len(counts[shared_block]) >= 2 and max(counts[shared_block]) != sum(counts[shared_block]) // \
        len(counts[shared_block])  # the mean would have been truncated below the maximum

    model, plan = _plans("loft", gen)
    subs = plan.build()
    for sub in subs:
        sub.module.bn.num_batches_tracked.fill_(7 + 2 * sub.index)
    plan.aggregate(subs)
    assert int(model.bn.num_batches_tracked) == 7 + 2 * 2


@pytest.mark.parametrize("device", DEVICES)
def test_aggregate_slices_matches_reference(device, gen):
    """Mixed floating and integer targets of odd shapes, overlapping and unowned slices: floating
    slices are their owners' mean, integer ones their owners' maximum, unowned ones unchanged."""
    from ist_kernels.partition import aggregate_slices_

    shapes = [((5, 3), 0, torch.float32), ((4, 7, 2), 1, torch.float64), ((6,), 0, torch.int64),
              ((3, 5), 1, torch.int32), ((0, 3), 0, torch.float32)]
    targets = [torch.randn(s, generator=gen, dtype=torch.float64).mul(50).to(dt).to(device) for s, _, dt in shapes]
    dims = [d for _, d, _ in shapes]
    before = {str(t): x.cpu().clone() for t, x in enumerate(targets)}
    S = 3
    owners = {str(t): [torch.randperm(x.shape[d], generator=gen)[:int(torch.randint(0, x.shape[d] + 1, (1,),
                                                                                      generator=gen))].sort().values
                       for _ in range(S)] for t, (x, d) in enumerate(zip(targets, dims))}
    sub_values = [{} for _ in range(S)]
    ids, updates, indices = [], [], []
    for s in range(S):
        for t, (x, d) in enumerate(zip(targets, dims)):
            idx = owners[str(t)][s]
            shape = list(x.shape)
            shape[d] = len(idx)
            u = torch.randn(shape, generator=gen, dtype=torch.float64).mul(50).to(x.dtype).to(device)
            sub_values[s][str(t)] = u.cpu()
            ids.append(t)
            updates.append(u)
            indices.append(idx.to(device))
    aggregate_slices_(targets, ids, updates, indices, dims)
    expected = ref.aggregate_owner_mean(before, {str(t): d for t, d in enumerate(dims)}, owners, sub_values)
    for t, x in enumerate(targets):
        want = expected[str(t)]
        if x.is_floating_point():
            tol = 1e-5 * 50 if x.dtype == torch.float32 else 1e-12 * 50
            torch.testing.assert_close(x.cpu().double(), want, rtol=0, atol=tol)
        else:
            assert torch.equal(x.cpu(), want.to(x.dtype)), t


def test_aggregate_slices_checks_before_writing(gen):
    from ist_kernels.partition import aggregate_slices_

    f, c = torch.randn(4, generator=gen), torch.arange(3)
    ok_f, ok_c = (torch.randn(2, generator=gen), torch.tensor([0, 3])), (torch.tensor([9]), torch.tensor([1]))
    cases = [  # (float segment, counter segment, error, message); the ops' error policy
        ((ok_f[0], torch.tensor([0, 4])), ok_c, IndexError, "out of range"),  # a float index: the op's check
        (ok_f, (torch.tensor([9]), torch.tensor([3])), IndexError, r"indices\[1\] holds values outside \[0, 3\)"),
        (ok_f, (torch.tensor([9, 9]), torch.tensor([1])), ValueError, r"updates\[1\] has shape \[2\].*needs \[1\]"),
        (ok_f, (torch.tensor([9.0]), torch.tensor([1])), TypeError, r"updates\[1\] has dtype torch.float32"),
        (ok_f, (torch.tensor([9]), torch.tensor([1.0])), TypeError, r"indices\[1\] must be int64"),
    ]
    for (fu, fi), (cu, ci), kind, why in cases:
        f0, c0 = f.clone(), c.clone()
        with pytest.raises(kind, match=why):
            aggregate_slices_([f, c], [0, 1], [fu, cu], [fi, ci], [0, 0])
        assert torch.equal(f, f0) and torch.equal(c, c0)  # nothing written
    with pytest.raises(IndexError, match=r"target_ids\[1\] = 2 is out of range"):
        aggregate_slices_([f, c], [0, 2], list(ok_f[:1]) + [ok_c[0]], [ok_f[1], ok_c[1]], [0, 0])
    aggregate_slices_([f, c], [0, 1, 1], [ok_f[0], ok_c[0], torch.tensor([4])], [ok_f[1], ok_c[1], ok_c[1]], [0, 0])
    assert c.tolist() == [0, 9, 2] and torch.equal(f[[0, 3]], ok_f[0])


def test_first_round_creates_optimizer_state(gen):
    """Before any global step the optimizer has no state; aggregation creates it from the
    subnetworks' momentum (every slice is owned, so nothing stays at zero)."""
    model, plan = _plans("resist", gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    subs = plan.build(opt)
    assert all(len(sub.optimizer.state) == 0 for sub in subs)
    for sub in subs:
        _step(sub.module, sub.optimizer, gen)
    plan.aggregate(subs, opt)
    for t in plan.tensors:
        if t.name not in dict(model.named_parameters()):
            continue
        p = model.get_parameter(t.name)
        mom = opt.state[p]["momentum_buffer"]
        holders = range(3) if t.shared else [s for s in range(3) if t.owners[s].numel()]
        subs_mom = [subs[s].optimizer.state[subs[s].module.get_parameter(plan.local_names[t.name][s])]
                    ["momentum_buffer"] for s in holders]
        _assert_mean_close(mom, torch.stack([m.double() for m in subs_mom]).mean(0), subs_mom, t.name)


def test_one_gather_and_one_scatter_per_round(gen, monkeypatch):
    calls = {"gather": 0, "scatter": 0}
    gather, scatter = F.gather_slices, F.scatter_slices_

    def counting_gather(*a, **k):
        calls["gather"] += 1
        return gather(*a, **k)

    def counting_scatter(*a, **k):
        calls["scatter"] += 1
        return scatter(*a, **k)

    monkeypatch.setattr(F, "gather_slices", counting_gather)
    monkeypatch.setattr(F, "scatter_slices_", counting_scatter)
    for kind in ("loft", "resist"):
        model, plan = _plans(kind, gen)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _step(model, opt, gen)
        calls.update(gather=0, scatter=0)
        subs = plan.build(opt)
        for sub in subs:
            _step(sub.module, sub.optimizer, gen)
        plan.aggregate(subs, opt)
        assert calls == {"gather": 1, "scatter": 1}


def test_subnetworks_are_standalone(gen):
    model, plan = _plans("loft", gen)
    before = _state(model)
    subs = plan.build()
    opt = torch.optim.Adam(subs[1].module.parameters(), lr=0.1)  # any optimizer
    _step(subs[1].module, opt, gen)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])  # the global model is untouched until aggregate
    assert not torch.equal(subs[0].module.conv1.weight, subs[1].module.conv1.weight)


@pytest.mark.parametrize("kind", ["loft", "resist"])
def test_attach_builds_a_subnetwork_around_its_own_tensors(kind, gen):
    """Decentralized storage: subnetwork s from its compact tensors alone (``part``), on a plan of
    the structure-only (meta) model, holds what ``build`` gives and trains those very tensors."""
    model, plan = _plans(kind, gen)
    built = plan.build()
    x = _x(gen, n=4, dtype=torch.float32)
    for s in range(plan.num_subnetworks):
        part = plan.part(s)
        held = {t.name for t in plan.tensors if t.shared or t.owners[s].numel()}
        assert set(part) == held
        meta = copy.deepcopy(model).to("meta")
        again = (loft_plan(meta, 3, torch.Generator().manual_seed(5)) if kind == "loft" else None)
        sub = plan.attach(s, part)
        for module in (sub.module, built[s].module):
            module.eval()
        assert {k: v.shape for k, v in sub.module.state_dict().items()} == \
            {k: v.shape for k, v in built[s].module.state_dict().items()}
        for k, v in sub.module.state_dict().items():
            assert torch.equal(v, built[s].module.state_dict()[k]), k
        # The same tensors and ops; a few ulps apart when the CPU convolution picks another
        # algorithm for the two modules' memory layouts (seen once in a full-suite run: 2 of 40
        # elements, 3.7e-9 absolute).
        torch.testing.assert_close(sub.module(x), built[s].module(x), rtol=1e-6, atol=1e-7)
        named = plan.tensors_of(sub)
        assert all(named[n].data_ptr() == part[n].data_ptr() for n in part)  # no copy
        if again is not None:  # a plan of the meta model states its indices on the CPU
            assert all(o.device.type == "cpu" for t in again.partitioned for o in t.owners)
    with pytest.raises(ValueError, match="needs"):
        plan.attach(0, {})


# --------------------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("make", [lambda: M.preact_resnet18(width=8), lambda: M.resnet34(width=4),
                                  lambda: M.preact_resnet50(width=4)])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.8])
def test_prune_filters(make, ratio, gen):
    model = _randomize_bn(make(), gen).double()
    with torch.no_grad():
        for p in model.parameters():  # distinct filter norms
            p.mul_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
    pruned = prune_filters(model, ratio)
    kept = filters_to_keep(model, ratio)
    zeroed = copy.deepcopy(model)
    expected_layers = set()
    for stage in range(1, model.num_stages + 1):
        for j, block in enumerate(getattr(model, f"layer{stage}")):
            if j == 0:
                continue
            name = f"layer{stage}.{j}.conv1"
            expected_layers.add(name)
            w = block.conv1.weight
            num = w.shape[0]
            norms = w.detach().flatten(1).norm(dim=1)
            keep = num - int(ratio * num)
            top = sorted(range(num), key=lambda i: -float(norms[i]))[:keep]
            assert kept[name].tolist() == sorted(top)
            assert pruned.get_submodule(name).weight.shape[0] == keep
            bn = zeroed.get_submodule(f"layer{stage}.{j}." + ("bn2" if model.preact else "bn1"))
            drop = torch.ones(num, dtype=torch.bool)
            drop[kept[name]] = False
            with torch.no_grad():
                zeroed.get_submodule(name).weight[drop] = 0
                bn.weight[drop] = 0
                bn.bias[drop] = 0
    assert set(kept) == expected_layers
    n_pruned = sum(p.numel() for p in pruned.parameters())
    n_full = sum(p.numel() for p in model.parameters())
    assert (n_pruned < n_full) == (ratio > 0)
    # 4 images of 16x16: the last stage's train-mode BN normalises over 4·2·2 values per channel. Over
    # 2 values at 1x1 (8x8 input) a channel whose two values nearly agree (|a − b| ~ √eps) has a gain
    # up to 1/√eps ≈ 316, and the float64 rounding differences of the pruned vs zero-filled
    # convolutions can grow past 1e-7 (seen once in ~1000 seeds, global RNG unseeded; 0 in 5000 seeded runs).
    x = _x(gen, n=4, hw=16)
    for train in (False, True):
        zeroed.train(train)
        pruned.train(train)
        tol = 1e-7 if train else 1e-10  # train-mode BN divides by batch statistics: a gain over eval mode
        torch.testing.assert_close(pruned(x), zeroed(x), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------- filter distance
def test_filter_distance_hand_computed():
    a = torch.tensor([3.0, 2.0, 1.0])
    b = torch.tensor([1.0, 2.0, 3.0])
    assert filter_distance(a, a) == 0.0
    # sigma = (3, 2, 1): |ln1 - ln3| + 1/2 |ln2 - ln2| + 1/3 |ln3 - ln1|
    assert filter_distance(a, b) == pytest.approx(4 / 3 * math.log(3), rel=1e-15)
    # keep=1: a's top filter is not b's top: |ln 2 - ln 1|
    assert filter_distance(a, b, keep=1) == pytest.approx(math.log(2), rel=1e-15)
    # keep=2: filter 0 missing from b's top 2 -> |ln 3 - ln 1|; filter 1 at position 2 in both -> 0
    assert filter_distance(a, b, keep=2) == pytest.approx(math.log(3), rel=1e-15)
    # a swap of the top two of four: |ln1 - ln2| + 1/2 |ln2 - ln1|
    assert filter_distance(torch.tensor([4.0, 3, 2, 1]), torch.tensor([3.0, 4, 2, 1])) == \
        pytest.approx(1.5 * math.log(2), rel=1e-15)
    assert filter_distance(a, a, keep=0.5) == 0.0
    assert filter_distance(torch.tensor([]), torch.tensor([])) == 0.0


@pytest.mark.parametrize("n,keep", [(1, None), (7, None), (33, 5), (129, 0.3), (64, 64)])
def test_filter_distance_matches_reference(n, keep, gen):
    a = torch.rand(n, generator=gen)
    b = a + 0.3 * torch.rand(n, generator=gen)
    b[: n // 3] = a[: n // 3]  # some ties between filters
    l = None if keep is None else (keep if isinstance(keep, int) else max(1, int(keep * n)))
    assert filter_distance(a, b, keep) == pytest.approx(ref.filter_distance(a, b, l), rel=1e-12, abs=1e-12)


def test_layer_filter_distances_and_plot(tmp_path, gen):
    m1 = M.preact_resnet18(width=4)
    m2 = copy.deepcopy(m1)
    with torch.no_grad():
        m2.layer2[1].conv1.weight.mul_(torch.rand(m2.layer2[1].conv1.weight.shape, generator=gen))
    d = layer_filter_distances(m1, m2.state_dict())
    assert set(d) == {k for k, v in m1.state_dict().items() if v.dim() == 4}
    assert d["layer2.1.conv1.weight"] > 0 and d["layer1.1.conv1.weight"] == 0.0
    w1, w2 = m1.layer2[1].conv1.weight, m2.layer2[1].conv1.weight
    assert d["layer2.1.conv1.weight"] == pytest.approx(
        ref.filter_distance(w1.flatten(1).norm(dim=1), w2.flatten(1).norm(dim=1)), rel=1e-12)
    mats = pairwise_filter_distances([m1, m2, m1], layers=["layer2.1.conv1.weight"])
    D = mats["layer2.1.conv1.weight"]
    assert D.shape == (3, 3) and (D.diagonal() == 0).all() and D[0, 2] == 0 and D[0, 1] > 0
    path = tmp_path / "distances.png"
    fig = plot_filter_distances([m1, m2, m1], path=str(path), layers=["layer1.1.conv1.weight",
                                                                      "layer2.1.conv1.weight"])
    assert path.stat().st_size > 1000 and len([a for a in fig.axes if a.images]) == 2


# ------------------------------------------------------------------------------------- bad input
def test_bad_input(gen):
    small = M.preact_resnet18(width=2)  # layer1 convs have 2 filters
    with pytest.raises(ValueError, match="S=3 subnetworks but layer1.1.conv1 has only 2 filters"):
        loft_plan(small, 3, gen)
    for bad_s in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            loft_plan(small, bad_s, gen)
        with pytest.raises(ValueError, match="must be an int >= 1"):
            resist_plan(small, bad_s, 1, gen)
    with pytest.raises(ValueError, match="min_depth=6 is larger than the 5 partitioned blocks"):
        resist_plan(M.preact_resnet50(width=2), 2, 6, gen)
    with pytest.raises(ValueError, match="min_depth must be an int >= 0"):
        resist_plan(M.preact_resnet50(width=2), 2, -1, gen)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for fn in (lambda: loft_plan(mlp, 2, gen), lambda: resist_plan(mlp, 2, 1, gen),
               lambda: prune_filters(mlp, 0.5)):
        with pytest.raises(ValueError, match="expected a ResNet with residual stages"):
            fn()
    with pytest.raises(ValueError, match="at least three stages"):
        resist_plan(_two_stage(), 2, 1, gen)
    with pytest.raises(ValueError, match="no Conv2d -> BatchNorm2d -> Conv2d"):
        loft_plan(_two_stage(block=lambda: nn.Sequential(nn.Conv2d(4, 4, 1))), 2, gen)
    no_scale = _two_stage(stages=3, block=lambda: nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)))
    with pytest.raises(ValueError, match="has no float attribute residual_scale"):
        resist_plan(no_scale, 2, 1, gen)
    with pytest.raises(ValueError, match=r"ratio must be a number in \[0, 1\)"):
        prune_filters(small, 1.0)
    with pytest.raises(ValueError, match="keep must be in"):
        filter_distance(torch.rand(4), torch.rand(4), keep=5)
    with pytest.raises(ValueError, match="1-D of the same length"):
        filter_distance(torch.rand(4), torch.rand(5))
    with pytest.raises(ValueError, match="NaN"):
        filter_distance(torch.tensor([1.0, float("nan")]), torch.rand(2))

    # aggregate: foreign or changed subnetworks are refused before anything is written.
    model, plan = _plans("loft", gen)
    other = loft_plan(model, 3, gen)
    subs = plan.build()
    with pytest.raises(ValueError, match="built by this plan"):
        other.aggregate(subs)
    with pytest.raises(ValueError, match="given twice"):
        plan.aggregate([subs[0], subs[0]])
    before = _state(model)
    with torch.no_grad():
        subs[0].module.fc.weight.add_(1.0)
    subs[2].module.layer1[1].conv1.weight = nn.Parameter(torch.zeros(3, 8, 3, 3))
    with pytest.raises(ValueError, match=r"subnetwork 2 tensor layer1.1.conv1.weight has shape \(3, 8, 3, 3\)"):
        plan.aggregate(subs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def _two_stage(stages=2, block=None):
    block = block or (lambda: M.PreActBlock(4, 4))
    net = nn.Module()
    for i in range(1, stages + 1):
        setattr(net, f"layer{i}", nn.Sequential(block(), block()))
    return net


# ------------------------------------------------------------------ gather buffers across rounds
@pytest.mark.parametrize("kind", ["loft", "resist"])
def test_build_reuses_gather_buffers_only_once_subnetworks_are_gone(kind, gen):
    """plan.build keeps its flat gather buffer for later builds, but never overwrites subnetworks
    (parameters, buffers, optimizer state) that are still alive."""
    model, plan = _plans(kind, gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _step(model, opt, gen)

    def storage(subs):
        return next(subs[0].module.parameters()).untyped_storage().data_ptr()

    def snapshot(subs):
        return [({k: v.clone() for k, v in s.module.state_dict().items()},
                 {k: v["momentum_buffer"].clone() for k, v in enumerate(s.optimizer.state.values())}) for s in subs]

    def same(subs, snap):
        return all(all(torch.equal(v, st[k]) for k, v in s.module.state_dict().items()) and
                   all(torch.equal(v["momentum_buffer"], mom[k]) for k, v in enumerate(s.optimizer.state.values()))
                   for s, (st, mom) in zip(subs, snap))

    kept, snaps, ptrs = [], [], []
    for _ in range(3):  # every round's subnetworks stay alive: every build takes another buffer
        subs = plan.build(opt)
        for sub in subs:
            _step(sub.module, sub.optimizer, gen)
        plan.aggregate(subs, opt)
        kept.append(subs)
        snaps.append(snapshot(subs))
        ptrs.append(storage(subs))
    assert len(set(ptrs)) == 3
    assert all(same(subs, snap) for subs, snap in zip(kept, snaps))
    first = ptrs[0]
    del kept[0], snaps[0], subs
    reused = plan._buffers.reused
    subs = plan.build(opt)  # round 1's subnetworks are gone: its buffer comes back
    assert storage(subs) == first and plan._buffers.reused > reused
    assert all(same(s, snap) for s, snap in zip(kept, snaps))
    # the reused buffer holds this build's values: aggregating unchanged subnetworks is the identity
    before = _state(model)
    plan.aggregate(subs, opt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for sub in subs:  # a reused build trains like a fresh one
        local = {n: p for n, p in sub.module.named_parameters()}
        for t in plan.partitioned:
            name = plan.local_names[t.name][sub.index]
            if name in local:
                full = model.get_parameter(t.name).detach()
                assert torch.equal(local[name], full.index_select(t.dim, t.owners[sub.index])), t.name
    del subs, kept, snaps
    plan.release_buffers()
    assert plan._buffers.nbytes == 0
