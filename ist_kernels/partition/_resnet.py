"""Finding the residual structure of a ResNet without editing it: stages, blocks, and in each block
the conv whose filters LOFT partitions, the BN that follows it and the conv that reads it.

A ResNet here is any module with children ``layer1``, ``layer2``, ... (consecutive, each an
``nn.Sequential`` of residual blocks): the models in ``ist_kernels.models``, and the usual CIFAR
and torchvision-style ResNets. In a block, the filter conv is its first ``Conv2d`` child, the BN
is the first ``BatchNorm2d`` child registered after it and the next conv the first ``Conv2d`` child
after that BN (pre-activation ``bn1, conv1, bn2, conv2`` and post-activation
``conv1, bn1, conv2, bn2`` both read correctly this way); the channel counts are checked.
"""
from dataclasses import dataclass
from typing import List, Optional, Tuple

from torch import nn


@dataclass(frozen=True)
class Block:
    """One residual block: ``name`` is its module path (``"layer2.1"``); ``stage`` counts from 1,
    ``index`` from 0 within the stage."""

    name: str
    module: nn.Module
    stage: int
    index: int
    strided: bool

    @property
    def partitionable(self) -> bool:
        """LOFT and pruning leave the first block of each stage and strided blocks whole (paper 000
        §4, §6)."""
        return self.index > 0 and not self.strided


def stages(model: nn.Module, who: str) -> List[List[Block]]:
    """The blocks of ``model``'s stages ``layer1..layerN``; a clear error if there are none."""
    children = dict(model.named_children())
    found = []
    i = 1
    while f"layer{i}" in children:
        stage = children[f"layer{i}"]
        if not isinstance(stage, nn.Sequential) or len(stage) == 0:
            raise ValueError(f"{who}: expected model.layer{i} to be a non-empty nn.Sequential of "
                             f"residual blocks, got {type(stage).__name__}")
        blocks = []
        for j, block in enumerate(stage):
            strided = any(isinstance(m, nn.Conv2d) and tuple(m.stride) != (1, 1) for m in block.modules())
            blocks.append(Block(f"layer{i}.{j}", block, i, j, strided))
        found.append(blocks)
        i += 1
    if not found:
        raise ValueError(f"{who}: expected a ResNet with residual stages model.layer1, model.layer2, "
                         f"... (nn.Sequential of blocks), found none in {type(model).__name__}")
    return found


def filter_layers(block: Block, who: str) -> Tuple[str, str, str]:
    """Child names ``(filter_conv, bn, next_conv)`` of a block: the first conv, the BN on its output
    filters, the conv reading those channels."""
    names = list(block.module._modules.keys())
    mods = block.module._modules

    def first(kind, start: int) -> Optional[int]:
        for k in range(start, len(names)):
            if isinstance(mods[names[k]], kind):
                return k
        return None

    c = first(nn.Conv2d, 0)
    b = first(nn.BatchNorm2d, c + 1) if c is not None else None
    n = first(nn.Conv2d, b + 1) if b is not None else None
    if n is None:
        raise ValueError(f"{who}: block {block.name} ({type(block.module).__name__}) has no "
                         f"Conv2d -> BatchNorm2d -> Conv2d children to partition by filters")
    conv, bn, nxt = mods[names[c]], mods[names[b]], mods[names[n]]
    if not (conv.out_channels == bn.num_features == nxt.in_channels) or conv.groups != 1 or nxt.groups != 1:
        raise ValueError(
            f"{who}: block {block.name}: {names[c]} ({conv.out_channels} filters), {names[b]} "
            f"({bn.num_features} channels) and {names[n]} ({nxt.in_channels} input channels) must "
            f"match, with groups=1")
    return names[c], names[b], names[n]


def skippable(block: Block) -> bool:
    """A block a shallower network can leave out: not strided and no projection shortcut."""
    if block.strided:
        return False
    for attr in ("shortcut", "downsample"):
        sc = getattr(block.module, attr, None)
        if isinstance(sc, nn.Module) and any(True for _ in sc.parameters()):
            return False
    return True
