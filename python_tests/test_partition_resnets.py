"""LOFT, ResIST and filter pruning on ResNets laid out as other libraries lay them out, found from
the module structure: Hugging Face's ``ResNetForImageClassification`` (basic and bottleneck layers)
and torchvision's layout (``layer1..4`` of ``BasicBlock``/``Bottleneck``, written out here since
torchvision does not import on this machine). Every subnetwork is compared, in float64, with the
full model with the other filters zeroed (LOFT) or the other blocks replaced by their identity
shortcut (ResIST), written from the math with the layer names of each layout spelled out here."""
import copy

import pytest
import torch
from torch import nn

import ist_kernels.models as M
from ist_kernels.partition import loft_plan, resist_plan
from ist_kernels.partition.resist import residual_scales, set_residual_scales
from ist_kernels.partition.resnet_blocks import find_resnet
from ist_kernels.prune import filters_to_keep, prune_filters


# ------------------------------------------------------------------ torchvision's layout, verbatim
def conv3x3(in_planes, out_planes, stride=1, groups=1, dilation=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation, groups=groups,
                     bias=False, dilation=dilation)


def conv1x1(in_planes, out_planes, stride=1):
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64, dilation=1,
                 norm_layer=None):
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None, groups=1, base_width=64, dilation=1,
                 norm_layer=None):
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        width = int(planes * (base_width / 64.0)) * groups
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride, groups, dilation)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        out = self.relu(out)
        out = self.conv3(out)
        out = self.bn3(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class TorchvisionResNet(nn.Module):
    """torchvision.models.ResNet's attributes and forward; the stage widths are a parameter (64,
    128, 256, 512 there) so the test models stay tiny."""

    def __init__(self, block, layers, num_classes=10, widths=(64, 128, 256, 512), norm_layer=None):
        super().__init__()
        if norm_layer is None:
            norm_layer = nn.BatchNorm2d
        self._norm_layer = norm_layer
        self.inplanes = widths[0]
        self.dilation = 1
        self.groups = 1
        self.base_width = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)

    def _make_layer(self, block, planes, blocks, stride=1):
        norm_layer = self._norm_layer
        downsample = None
        previous_dilation = self.dilation
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       norm_layer(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample, self.groups, self.base_width,
                        previous_dilation, norm_layer)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes, groups=self.groups, base_width=self.base_width,
                                dilation=self.dilation, norm_layer=norm_layer))
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


# ------------------------------------------------------------------------------------ the layouts
def _hf(layer_type):
    transformers = pytest.importorskip("transformers")
    if layer_type == "basic":
        cfg = transformers.ResNetConfig(num_channels=1, layer_type="basic", depths=[2, 2, 6, 2],
                                        hidden_sizes=[8, 16, 16, 16], embedding_size=8, num_labels=10)
    else:
        cfg = transformers.ResNetConfig(num_channels=1, layer_type="bottleneck", depths=[1, 2, 6, 1],
                                        hidden_sizes=[16, 32, 32, 32], embedding_size=8, num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


HF_STAGE = "resnet.encoder.stages.{}.layers"
# name -> (make, input channels, depths, stage paths, (filter conv, BN, next conv), branch end, shortcut)
LAYOUTS = {
    "hf_basic": (lambda: _hf("basic"), 1, [2, 2, 6, 2], [HF_STAGE.format(i) for i in range(4)],
                 ("layer.0.convolution", "layer.0.normalization", "layer.1.convolution"),
                 "layer.1.normalization", "shortcut"),
    "hf_bottleneck": (lambda: _hf("bottleneck"), 1, [1, 2, 6, 1], [HF_STAGE.format(i) for i in range(4)],
                      ("layer.0.convolution", "layer.0.normalization", "layer.1.convolution"),
                      "layer.2.normalization", "shortcut"),
    "tv_basic": (lambda: TorchvisionResNet(BasicBlock, [2, 2, 6, 2], widths=(8, 16, 16, 16)), 3, [2, 2, 6, 2],
                 [f"layer{i}" for i in range(1, 5)], ("conv1", "bn1", "conv2"), "bn2", "downsample"),
    "tv_bottleneck": (lambda: TorchvisionResNet(Bottleneck, [1, 2, 6, 1], widths=(4, 8, 8, 8)), 3, [1, 2, 6, 1],
                      [f"layer{i}" for i in range(1, 5)], ("conv1", "bn1", "conv2"), "bn3", "downsample"),
}


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20260)


def _randomize(model, gen):
    """float64, eval mode, random BN statistics and affine parameters, so a wrong channel shows."""
    model = model.double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
    return model


def _model(layout, gen):
    return _randomize(LAYOUTS[layout][0](), gen)


def _x(layout, gen, n=2, hw=32):
    return torch.randn(n, LAYOUTS[layout][1], hw, hw, generator=gen, dtype=torch.float64)


def _out(model, x):
    y = model(x)
    return y.logits if hasattr(y, "logits") else y


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _blocks(layout, stage):
    """Hand-written block paths of a stage (0-based) of a layout."""
    _, _, depths, paths, *_ = LAYOUTS[layout]
    return [f"{paths[stage]}.{j}" for j in range(depths[stage])]


def _partitionable(layout):
    # every layout here strides (or projects) only in the first block of a stage
    depths = LAYOUTS[layout][2]
    return [b for i in range(len(depths)) for b in _blocks(layout, i)[1:]]


def _assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_find_resnet_reads_the_layout(layout, gen):
    model = _model(layout, gen)
    _, _, depths, paths, layers, tail, shortcut = LAYOUTS[layout]
    d = find_resnet(model)
    assert d.stage_paths == paths
    assert [len(s) for s in d.stages] == depths
    assert [b.name for s in d.stages for b in s] == [b for i in range(4) for b in _blocks(layout, i)]
    assert sorted(d.loft) == sorted(_partitionable(layout))
    assert all(v == layers for v in d.loft.values())
    assert list(d.resist) == _blocks(layout, 2)[1:]
    assert d.loft_error is None and d.resist_error is None
    third = d.stages[2]
    assert third[0].shortcut == shortcut and third[0].strided
    assert all(b.shortcut is None and b.tail == tail and not b.strided for b in third[1:])
    assert find_resnet(model, "loft").loft == d.loft and find_resnet(model, "resist").resist == d.resist
    assert "stage 3: " + paths[2] in str(d)


@pytest.mark.parametrize("make,paths", [(lambda: M.preact_resnet18(width=4), [f"layer{i}" for i in range(1, 5)]),
                                        (lambda: M.wide_resnet34(k=1), ["layer1", "layer2", "layer3"]),
                                        (lambda: M.preact_resnet50(width=2), [f"layer{i}" for i in range(1, 5)])])
def test_find_resnet_on_the_package_models(make, paths):
    d = find_resnet(make())
    assert d.stage_paths == paths
    assert all(v == ("conv1", "bn2", "conv2") for v in d.loft.values())


# ------------------------------------------------------------------------------------------- LOFT
def _loft_reference(model, layout, plan, s):
    """The full model with every filter other subnetworks own in a partitioned block contributing
    nothing: its conv row, its BN's weight and bias and the next conv's input column zeroed (the BN
    output of that channel is then 0, and so is its activation)."""
    conv_name, bn_name, next_name = LAYOUTS[layout][4]
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for block in _partitionable(layout):
            conv = ref.get_submodule(f"{block}.{conv_name}")
            drop = torch.ones(conv.out_channels, dtype=torch.bool)
            drop[plan.filters[block][s]] = False
            conv.weight[drop] = 0
            bn = ref.get_submodule(f"{block}.{bn_name}")
            bn.weight[drop] = 0
            bn.bias[drop] = 0
            ref.get_submodule(f"{block}.{next_name}").weight[:, drop] = 0
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("S", [2, 3])
def test_loft_subnetworks_equal_the_full_model_without_the_other_filters(layout, S, gen):
    model = _model(layout, gen)
    plan = loft_plan(model, S, gen)
    conv_name = LAYOUTS[layout][4][0]
    assert [b.name for b in plan.blocks] == _partitionable(layout)
    for block in _partitionable(layout):
        F_ = model.get_submodule(f"{block}.{conv_name}").out_channels
        assert sorted(torch.cat(plan.filters[block]).tolist()) == list(range(F_))  # disjoint, covering
    x = _x(layout, gen)
    for s, sub in enumerate(plan.build()):
        for block in _partitionable(layout):  # physically narrower
            w = sub.module.get_submodule(f"{block}.{conv_name}").weight
            assert w.shape[0] == plan.filters[block][s].numel()
        sub.module.eval()
        _assert_close(_out(sub.module, x), _out(_loft_reference(model, layout, plan, s), x))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loft_aggregation_round_trip(layout, gen):
    model = _model(layout, gen)
    before = _state(model)
    S = 3
    plan = loft_plan(model, S, gen)
    subs = plan.build()
    plan.aggregate(subs)  # unchanged subnetworks: the model comes back exactly
    after = _state(model)
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    # every subnetwork adds s + 1 to all it holds: owned filters get their owner's s + 1, shared
    # tensors the mean 2
    with torch.no_grad():
        for sub in subs:
            for p in sub.module.parameters():
                p.add_(sub.index + 1)
    plan.aggregate(subs)
    conv_name, _, next_name = LAYOUTS[layout][4]
    got = model.state_dict()
    for block in _partitionable(layout):
        for s in range(S):
            idx = plan.filters[block][s]
            w = f"{block}.{conv_name}.weight"
            torch.testing.assert_close(got[w][idx], before[w][idx] + s + 1, rtol=0, atol=1e-12)
            w = f"{block}.{next_name}.weight"
            torch.testing.assert_close(got[w][:, idx], before[w][:, idx] + s + 1, rtol=0, atol=1e-12)
    first = _blocks(layout, 0)[0]
    shared = f"{first}.{conv_name}.weight"
    torch.testing.assert_close(got[shared], before[shared] + 2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["hf_basic", "tv_bottleneck"])
def test_prune_filters_equals_zeroed_full_model(layout, gen):
    model = _model(layout, gen)
    conv_name, bn_name, next_name = LAYOUTS[layout][4]
    ratio = 0.5
    pruned = prune_filters(model, ratio).eval()
    kept = filters_to_keep(model, ratio)
    assert sorted(kept) == sorted(f"{b}.{conv_name}" for b in _partitionable(layout))
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for block in _partitionable(layout):
            w = model.get_submodule(f"{block}.{conv_name}").weight
            norms = w.flatten(1).norm(dim=1)
            keep = sorted(sorted(range(len(norms)), key=lambda i: -float(norms[i]))[:len(norms) - int(ratio * len(norms))])
            assert kept[f"{block}.{conv_name}"].tolist() == keep
            drop = torch.ones(len(norms), dtype=torch.bool)
            drop[keep] = False
            ref.get_submodule(f"{block}.{conv_name}").weight[drop] = 0
            ref.get_submodule(f"{block}.{bn_name}").weight[drop] = 0
            ref.get_submodule(f"{block}.{bn_name}").bias[drop] = 0
            assert pruned.get_submodule(f"{block}.{next_name}").weight.shape[1] == len(keep)
    x = _x(layout, gen)
    _assert_close(_out(pruned, x), _out(ref, x))


# ----------------------------------------------------------------------------------------- ResIST
def _resist_reference(model, layout, owned):
    """The full model with the third stage's dealt blocks other than ``owned`` replaced by their
    identity shortcut."""
    ref = copy.deepcopy(model)
    stage = ref.get_submodule(LAYOUTS[layout][3][2])
    for j, name in enumerate(_blocks(layout, 2)):
        if j > 0 and name not in owned:
            stage[j] = nn.Identity()
    return ref


def _scaled_reference(model, layout, p):
    """The full model with the residual branch of the third stage's dealt blocks times ``p``: the
    BN ending the branch (eval mode: an affine map) has its weight and bias times ``p``."""
    ref = copy.deepcopy(model)  # a copy carries the hooks, not the global model's scales
    with torch.no_grad():
        for name in _blocks(layout, 2)[1:]:
            bn = ref.get_submodule(f"{name}.{LAYOUTS[layout][5]}")
            bn.weight.mul_(p)
            bn.bias.mul_(p)
    return ref


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("S,min_depth", [(2, 2), (3, 3)])
def test_resist_subnetworks_and_scaled_full_model(layout, S, min_depth, gen):
    model = _model(layout, gen)
    unscaled = copy.deepcopy(model)
    before = _state(model)
    x = _x(layout, gen)
    plan = resist_plan(model, S, min_depth, gen)
    assert plan.partitioned_blocks == _blocks(layout, 2)[1:]
    subs = plan.build()
    for s, sub in enumerate(subs):
        assert plan.blocks[s] and all(b in plan.partitioned_blocks for b in plan.blocks[s])
        assert len(sub.module.get_submodule(LAYOUTS[layout][3][2])) == 1 + len(plan.blocks[s])
        _assert_close(_out(sub.module.eval(), x), _out(_resist_reference(unscaled, layout, plan.blocks[s]), x))

    # aggregation sets the full model's scale; unchanged subnetworks bring the tensors back exactly,
    # and the scale leaves no trace in the state dict
    plan.aggregate(subs)
    assert plan.residual_scale == pytest.approx(sum(len(b) for b in plan.blocks) / (5 * S))
    after = _state(model)
    assert list(after) == list(before)
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    _assert_close(_out(model, x), _out(_scaled_reference(unscaled, layout, plan.residual_scale), x))
    assert not any("scale" in k for k in model.state_dict())
    fresh = _randomize(LAYOUTS[layout][0](), torch.Generator().manual_seed(1))
    fresh.load_state_dict(model.state_dict(), strict=True)
    _assert_close(_out(fresh, x), _out(unscaled, x))  # a model loaded from the state dict: unscaled

    # the next round's sub-ResNets (clones of the scaled global model, hooks included) run unscaled
    nxt = resist_plan(model, S, min_depth, gen)
    for s, sub in enumerate(nxt.build()):
        _assert_close(_out(sub.module.eval(), x), _out(_resist_reference(unscaled, layout, nxt.blocks[s]), x))
    _assert_close(_out(model, x), _out(_scaled_reference(unscaled, layout, plan.residual_scale), x))

    # a trainer's checkpoint: the scales by module path, restored on another copy
    scales = residual_scales(model)
    tail = LAYOUTS[layout][5]
    assert scales == {f"{b}.{tail}": plan.residual_scale for b in plan.partitioned_blocks}
    set_residual_scales(fresh, scales)
    _assert_close(_out(fresh, x), _out(model, x))
    set_residual_scales(fresh, scales)  # registered once: setting again does not scale twice
    _assert_close(_out(fresh, x), _out(model, x))
    set_residual_scales(fresh, {k: 1.0 for k in scales})
    _assert_close(_out(fresh, x), _out(unscaled, x))


def test_resist_stage_in_a_module_list(gen):
    """A user's ResNet whose stages are nn.ModuleLists iterated in forward."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 4, 3, padding=1, bias=False)
            self.stages = nn.ModuleList([nn.ModuleList([BasicBlock(4, 4) for _ in range(n)]) for n in (1, 2, 4)])
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            x = self.stem(x)
            for stage in self.stages:
                for block in stage:
                    x = block(x)
            return self.head(x.mean((2, 3)))

    model = _randomize(Net(), gen)
    d = find_resnet(model, "resist")
    assert d.stage_paths == ["stages.0", "stages.1", "stages.2"]
    assert list(d.resist) == ["stages.2.1", "stages.2.2", "stages.2.3"]
    plan = resist_plan(model, 2, 1, gen)
    x = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    for s, sub in enumerate(plan.build()):
        ref = copy.deepcopy(model)
        keep = [m for j, m in enumerate(ref.stages[2]) if j == 0 or f"stages.2.{j}" in plan.blocks[s]]
        ref.stages[2] = nn.ModuleList(keep)
        _assert_close(sub.module(x), ref(x))


# ----------------------------------------------------------------------------------------- errors
def test_errors_say_what_was_looked_for(gen):
    vgg = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)),
                        nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)),
                        nn.Flatten(), nn.LazyLinear(2))
    for fn in (lambda: find_resnet(vgg), lambda: find_resnet(vgg, "loft"), lambda: loft_plan(vgg, 2, gen),
               lambda: resist_plan(vgg, 2, 1, gen), lambda: prune_filters(vgg, 0.5)):
        with pytest.raises(ValueError, match=r"expected a ResNet with residual stages, i\.e\. an nn\.Sequential "
                                             r"or nn\.ModuleList whose items are all residual blocks"):
            fn()
    two = TorchvisionResNet(BasicBlock, [1, 2, 2, 2], widths=(4, 4, 4, 4))
    two.layer3 = nn.Sequential(BasicBlock(4, 4))  # layer3 holds one block: nothing to deal out
    d = find_resnet(two)
    assert d.resist == () and "third stage (layer3) has no block after its first" in d.resist_error
    with pytest.raises(ValueError, match=r"resist_plan: the third stage \(layer3\) has no block after its first"):
        find_resnet(two, "resist")
    with pytest.raises(ValueError, match="method must be"):
        find_resnet(two, "ist")
    short = TorchvisionResNet(BasicBlock, [1, 1, 1, 1], widths=(4, 4, 4, 4))
    with pytest.raises(ValueError, match="has no partitionable block"):
        find_resnet(short, "loft")
