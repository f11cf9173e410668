"""CIFAR-style ResNets (3x3 stem, no max-pool): pre-activation, post-activation and wide.

Layer names follow the usual checkpoints (``conv1``, ``bn1``, ``layer1`` .. ``layer4``, ``shortcut``,
``fc``). Global average pooling is adaptive, so any input of at least 8x8 works.

Every residual block carries ``residual_scale`` (a plain float, 1.0 by default, not a buffer): the
block computes ``residual_scale * branch(x) + shortcut(x)``. ResIST sets it on the full model's
partitioned blocks to the expected fraction of subnetworks that own them (paper 003 §2.6).
"""
from typing import List, Optional, Sequence, Type

import torch.nn.functional as F
from torch import Tensor, nn


def _conv3x3(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)


def _add_residual(branch: Tensor, shortcut: Tensor, scale: float) -> Tensor:
    if scale != 1.0:
        branch = branch * scale
    return branch + shortcut


class _ResidualBlock(nn.Module):
    """What every block shares: the projection shortcut (None when the shapes already match) and
    the ResIST ``residual_scale`` of the branch."""

    def _init_residual(self, in_planes: int, out_planes: int, stride: int, bn: bool) -> None:
        self.shortcut: Optional[nn.Sequential] = None
        if stride != 1 or in_planes != out_planes:
            proj = [nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)]
            self.shortcut = nn.Sequential(*proj, *([nn.BatchNorm2d(out_planes)] if bn else []))
        self.residual_scale = 1.0

    def extra_repr(self) -> str:
        return f"residual_scale={self.residual_scale}" if self.residual_scale != 1.0 else ""


class PreActBlock(_ResidualBlock):
    """Pre-activation basic block (He et al. 2016b): BN-ReLU-conv3x3-BN-ReLU-conv3x3."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self._init_residual(in_planes, planes, stride, bn=False)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return _add_residual(out, shortcut, self.residual_scale)


class PreActBottleneck(_ResidualBlock):
    """Pre-activation bottleneck block: BN-ReLU-conv1x1-BN-ReLU-conv3x3-BN-ReLU-conv1x1 (x4)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        out_planes = self.expansion * planes
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self._init_residual(in_planes, out_planes, stride, bn=False)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return _add_residual(out, shortcut, self.residual_scale)


class BasicBlock(_ResidualBlock):
    """Post-activation basic block (He et al. 2016a): conv3x3-BN-ReLU-conv3x3-BN, add, ReLU."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self._init_residual(in_planes, planes, stride, bn=True)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = self.shortcut(x) if self.shortcut is not None else x
        return F.relu(_add_residual(out, shortcut, self.residual_scale))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3x3 stem, stages ``layer1..layerN`` (the first at stride 1, the others
    at stride 2), global average pooling, ``fc``. ``preact`` adds the final BN-ReLU of
    pre-activation networks (``bn``) and drops the stem's BN-ReLU."""

    def __init__(self, block: Type[nn.Module], num_blocks: Sequence[int], num_classes: int = 10,
                 in_channels: int = 3, widths: Sequence[int] = (64, 128, 256, 512),
                 stem_width: Optional[int] = None, preact: bool = True):
        super().__init__()
        if len(widths) != len(num_blocks) or not all(n >= 1 for n in num_blocks):
            raise ValueError(f"ResNet: expected one width and >= 1 block per stage, got widths="
                             f"{list(widths)}, num_blocks={list(num_blocks)}")
        if num_classes < 1 or in_channels < 1 or min(widths) < 1:
            raise ValueError(f"ResNet: num_classes, in_channels and widths must be >= 1, got "
                             f"{num_classes}, {in_channels}, {list(widths)}")
        self.preact = preact
        stem_width = widths[0] if stem_width is None else stem_width
        self.conv1 = _conv3x3(in_channels, stem_width)
        self.bn1 = None if preact else nn.BatchNorm2d(stem_width)
        in_planes = stem_width
        for i, (planes, n) in enumerate(zip(widths, num_blocks)):
            blocks: List[nn.Module] = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_planes, planes, stride))
                in_planes = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.num_stages = len(widths)
        self.bn = nn.BatchNorm2d(in_planes) if preact else None
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv1(x)
        if self.bn1 is not None:
            out = F.relu(self.bn1(out))
        for i in range(self.num_stages):
            out = getattr(self, f"layer{i + 1}")(out)
        if self.bn is not None:
            out = F.relu(self.bn(out))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def _widths(width: int, stages: int = 4) -> List[int]:
    return [width * 2**i for i in range(stages)]


def preact_resnet18(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBlock, [2, 2, 2, 2], num_classes, in_channels, _widths(width))


def preact_resnet34(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBlock, [3, 4, 6, 3], num_classes, in_channels, _widths(width))


def preact_resnet50(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBottleneck, [3, 4, 6, 3], num_classes, in_channels, _widths(width))


def preact_resnet101(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBottleneck, [3, 4, 23, 3], num_classes, in_channels, _widths(width))


def preact_resnet101_basic(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    """The "ResNet101" of paper 003 (ResIST, Figure 2): basic pre-activation blocks in stages of
    [3, 4, 23, 3], 41.4M parameters for 100 classes; 2·S times its fp32 parameter bytes is the
    local-SGD column of Table 1 (0.662 / 1.325 / 2.649 GB for S = 2 / 4 / 8). ResIST partitions
    the 22 blocks of layer3 after its first."""
    return ResNet(PreActBlock, [3, 4, 23, 3], num_classes, in_channels, _widths(width))


def preact_resnet152(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBottleneck, [3, 8, 36, 3], num_classes, in_channels, _widths(width))


def preact_resnet200(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(PreActBottleneck, [3, 24, 36, 3], num_classes, in_channels, _widths(width))


def resnet18(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, in_channels, _widths(width), preact=False)


def resnet34(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, in_channels, _widths(width), preact=False)


def wide_resnet34(k: int = 10, num_classes: int = 10, in_channels: int = 3) -> ResNet:
    """WRN-34-k (Zagoruyko and Komodakis 2016): three stages of five pre-activation blocks of
    widths 16k, 32k, 64k after a 16-filter stem."""
    if k < 1:
        raise ValueError(f"wide_resnet34: widening factor k must be >= 1, got {k}")
    return ResNet(PreActBlock, [5, 5, 5], num_classes, in_channels, [16 * k, 32 * k, 64 * k],
                  stem_width=16)
