"""ResIST block-wise partition of a ResNet into shallower sub-ResNets (paper 003 §2.2, §2.3, §2.6).

The blocks of the third stage except its first are permuted at random and dealt round-robin to the
S sub-ResNets; a sub-ResNet left with fewer than ``min_depth`` of them gets more, shared with
others, until it has ``min_depth``. Everything else is shared. A sub-ResNet skips the blocks it does
not own. At full-model evaluation a partitioned block's residual branch is scaled by the expected
fraction of sub-ResNets that own it (1/S without sharing): ``aggregate`` sets ``residual_scale``
on the global model's partitioned blocks, sub-ResNets train with 1.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ._resnet import Block, skippable, stages
from ._subnetworks import SubnetworkPlan


def check_min_depth(min_depth, who: str) -> None:
    """``min_depth`` (blocks every subnetwork holds at least) must be an int >= 0."""
    if isinstance(min_depth, bool) or not isinstance(min_depth, int) or min_depth < 0:
        raise ValueError(f"{who}: min_depth must be an int >= 0, got {min_depth!r}")


def deal_blocks(P: int, S: int, min_depth: int, generator: Optional[torch.Generator] = None) -> List[List[int]]:
    """The blocks ``0..P-1`` each of ``S`` subnetworks owns (sorted): a random permutation dealt
    round-robin (every block owned once), then shared, walking the same permutation cyclically,
    until every subnetwork has ``min_depth`` (<= P) blocks (paper 003 §2.2, §2.6)."""
    perm = torch.randperm(P, generator=generator).tolist()
    dealt: List[List[int]] = [[] for _ in range(S)]
    for t, k in enumerate(perm):
        dealt[t % S].append(k)
    pointer = 0
    while any(len(d) < min_depth for d in dealt):
        for s in range(S):
            if len(dealt[s]) >= min_depth:
                continue
            while perm[pointer % P] in dealt[s]:
                pointer += 1
            dealt[s].append(perm[pointer % P])
            pointer += 1
    return [sorted(d) for d in dealt]


class ResistPlan(SubnetworkPlan):
    """One round's ResIST partition. ``partitioned_blocks``: names of the blocks dealt out;
    ``blocks[s]``: the names of those sub-ResNet ``s`` owns (in depth order); ``owners[name]``:
    the sub-ResNets owning a block; ``residual_scale``: the full model's scale of their output."""

    who = "resist_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int, min_depth: int = 5,
                 generator: Optional[torch.Generator] = None):
        S = num_subnetworks
        if isinstance(S, bool) or not isinstance(S, int) or S < 1:
            raise ValueError(f"resist_plan: S (number of sub-ResNets) must be an int >= 1, got {S!r}")
        check_min_depth(min_depth, self.who)
        all_stages = stages(model, self.who)
        if len(all_stages) < 3:
            raise ValueError(f"resist_plan: expected a ResNet with at least three stages "
                             f"(layer1..layer3), got {len(all_stages)}")
        stage = all_stages[2]
        part: List[Block] = [b for b in stage[1:] if skippable(b)]
        if not part:
            raise ValueError("resist_plan: the third stage (layer3) has no block after its first "
                             "that can be skipped (unstrided, identity shortcut)")
        for b in part:
            if not isinstance(getattr(b.module, "residual_scale", None), float):
                raise ValueError(
                    f"resist_plan: block {b.name} ({type(b.module).__name__}) has no float "
                    f"attribute residual_scale; the full model must scale partitioned blocks' "
                    f"output at evaluation (paper 003 §2.6): use ist_kernels.models or add it")
        P = len(part)
        if min_depth > P:
            raise ValueError(f"resist_plan: min_depth={min_depth} is larger than the {P} "
                             f"partitioned blocks of layer3")
        dealt = deal_blocks(P, S, min_depth, generator)
        self.partitioned_blocks = [b.name for b in part]
        self.blocks: List[List[str]] = [[part[k].name for k in d] for d in dealt]
        self.owners: Dict[str, List[int]] = {b.name: [s for s in range(S) if k in dealt[s]]
                                             for k, b in enumerate(part)}
        self.residual_scale = sum(len(d) for d in dealt) / (P * S)
        self._stage_name = f"layer{stage[0].stage}"
        self._stage_len = len(stage)
        self._part_index = {b.index: k for k, b in enumerate(part)}
        self._dealt = [set(d) for d in dealt]
        self._part = part

        partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]] = {}
        for k, b in enumerate(part):
            for name, t in list(b.module.named_parameters()) + list(b.module.named_buffers()):
                full = torch.zeros(1, dtype=torch.long) if t.dim() == 0 else torch.arange(t.shape[0])
                partitioned[f"{b.name}.{name}"] = (0, [full if k in self._dealt[s] else None
                                                       for s in range(S)])
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        stage = glob[self._stage_name]
        kept = []
        for j in range(self._stage_len):
            k = self._part_index.get(j)
            if k is None:
                kept.append(stage._modules[str(j)])
            elif k in self._dealt[s]:
                block = stage._modules[str(j)]
                block.residual_scale = 1.0
                kept.append(block)
        stage.__dict__["_modules"] = {str(n): m for n, m in enumerate(kept)}

    def scale_residuals(self, model: Optional[nn.Module] = None) -> None:
        """Set ``residual_scale`` of the partitioned blocks of ``model`` (default: the plan's) to
        the expected fraction of sub-ResNets owning them, for full-model evaluation (§2.6)."""
        model = self.model if model is None else model
        for name in self.partitioned_blocks:
            model.get_submodule(name).residual_scale = self.residual_scale

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_residuals(model)


def resist_plan(model: nn.Module, S: int, min_depth: int = 5,
                generator: Optional[torch.Generator] = None) -> ResistPlan:
    """A random ResIST partition of ``model`` into ``S`` sub-ResNets of at least ``min_depth``
    partitioned blocks each (paper 003 §2.2, §2.6). ``plan.build(optimizer=None)`` makes the
    sub-ResNets in one slice gather; ``plan.aggregate(subnetworks, optimizer=None)`` writes them
    back in one slice scatter and sets the full model's residual scales."""
    return ResistPlan(model, S, min_depth, generator)
