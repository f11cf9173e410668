"""ResIST block-wise partition of a ResNet into shallower sub-ResNets (paper 003 §2.2, §2.3, §2.6).

The blocks of the third stage except its first are permuted at random and dealt round-robin to the
S sub-ResNets; a sub-ResNet left with fewer than ``min_depth`` of them gets more, shared with
others, until it has ``min_depth``. Everything else is shared. A sub-ResNet skips the blocks it does
not own. At full-model evaluation a partitioned block's residual branch is scaled by the expected
fraction of sub-ResNets that own it (1/S without sharing): ``aggregate`` sets it on the global
model's partitioned blocks, sub-ResNets train with 1.

How the full model scales a block's branch: a block with a float ``residual_scale`` attribute (the
models of ``ist_kernels.models``) scales it itself. Any other residual block (torchvision's,
Hugging Face's, a user's; found from structure by ``resnet_blocks``) is not edited: a forward hook on the
module ending its main branch (its last conv or norm, ``Block.tail``: ``bn2`` of torchvision's
BasicBlock, ``layer.1.normalization`` of Hugging Face's ResNetBasicLayer) multiplies that module's
output by the scale, which is what ``residual_scale`` does (``models.resnet._add_residual``: the
branch is scaled before the add, and the block's final activation comes after the add). The scale
is held in a ``weakref.WeakKeyDictionary`` keyed on that module of the global model, not on the
module: the state dict has no trace of it, and a subnetwork (whose modules are clones carrying the
same hook) or a deepcopy runs unscaled until a plan's ``scale_residuals`` names it.
"""
import weakref
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor, nn

from .resnet_blocks import has_scale_attribute, resist_blocks
from .subnetworks import SubnetworkPlan

_OUTPUT_SCALES: "weakref.WeakKeyDictionary[nn.Module, float]" = weakref.WeakKeyDictionary()


def _scale_output(module: nn.Module, inputs, output):
    """Forward hook: the module's output times its scale in ``_OUTPUT_SCALES`` (none: unchanged)."""
    p = _OUTPUT_SCALES.get(module)
    if p is None:
        return None
    return output * p


def set_output_scale(module: nn.Module, p: float) -> None:
    """Scale ``module``'s output by ``p`` (1.0: unscaled) with a forward hook, registered once (a
    deepcopy or clone that already carries it is not hooked twice), the scale held outside it."""
    if not any(h is _scale_output for h in module._forward_hooks.values()):
        module.register_forward_hook(_scale_output)
    if p == 1.0:
        _OUTPUT_SCALES.pop(module, None)
    else:
        _OUTPUT_SCALES[module] = float(p)


def residual_scales(model: nn.Module) -> Dict[str, float]:
    """Module path -> scale of everything scaled for ResIST in ``model``: modules with a float
    ``residual_scale`` attribute (any value) and modules whose output a hook scales (their scale
    when not 1.0). :func:`set_residual_scales` restores them (a trainer's checkpoint)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "residual_scale", None), float):
            out[name] = m.residual_scale
        elif m in _OUTPUT_SCALES:
            out[name] = _OUTPUT_SCALES[m]
    return out


def set_residual_scales(model: nn.Module, scales: Mapping[str, float]) -> None:
    """Set what :func:`residual_scales` returned: the attribute where the module has it, otherwise
    the scale of its output (hook)."""
    for name, p in scales.items():
        m = model.get_submodule(name)
        if isinstance(getattr(m, "residual_scale", None), float):
            m.residual_scale = float(p)
        else:
            set_output_scale(m, p)


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
        stage, part = resist_blocks(model, self.who)
        P = len(part)
        if min_depth > P:
            raise ValueError(f"resist_plan: min_depth={min_depth} is larger than the {P} "
                             f"partitioned blocks of {stage[0].stage_path}")
        dealt = deal_blocks(P, S, min_depth, generator)
        self.partitioned_blocks = [b.name for b in part]
        self.blocks: List[List[str]] = [[part[k].name for k in d] for d in dealt]
        self.owners: Dict[str, List[int]] = {b.name: [s for s in range(S) if k in dealt[s]]
                                             for k, b in enumerate(part)}
        self.residual_scale = sum(len(d) for d in dealt) / (P * S)
        self._stage_name = stage[0].stage_path
        self._stage_len = len(stage)
        # block -> path of the module whose output the full model scales; None: its residual_scale
        self._tails: Dict[str, Optional[str]] = {b.name: None if has_scale_attribute(b) else b.tail for b in part}
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
        # the clone of the stage container (nn.Sequential or nn.ModuleList) keeps the blocks s owns
        stage = glob[self._stage_name]
        items = list(stage._modules.values())
        if len(items) != self._stage_len:
            raise RuntimeError(f"{self.who}: internal error: stage {self._stage_name} has {len(items)} "
                               f"blocks, the plan was made for {self._stage_len}")
        kept = []
        for j, block in enumerate(items):
            k = self._part_index.get(j)
            if k is None:
                kept.append(block)
            elif k in self._dealt[s]:
                if isinstance(getattr(block, "residual_scale", None), float):
                    block.residual_scale = 1.0
                kept.append(block)
        stage.__dict__["_modules"] = {str(n): m for n, m in enumerate(kept)}

    def scale_residuals(self, model: Optional[nn.Module] = None) -> None:
        """Scale the residual branch of the partitioned blocks of ``model`` (default: the plan's) by
        the expected fraction of sub-ResNets owning them, for full-model evaluation (§2.6): their
        ``residual_scale``, or for blocks without one a hook on the module ending their branch
        (module docstring)."""
        model = self.model if model is None else model
        for name in self.partitioned_blocks:
            block = model.get_submodule(name)
            tail = self._tails[name]
            if tail is None:
                block.residual_scale = self.residual_scale
            else:
                set_output_scale(block.get_submodule(tail), self.residual_scale)

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_residuals(model)


def resist_plan(model: nn.Module, S: int, min_depth: int = 5,
                generator: Optional[torch.Generator] = None) -> ResistPlan:
    """A random ResIST partition of ``model`` into ``S`` sub-ResNets of at least ``min_depth``
    partitioned blocks each (paper 003 §2.2, §2.6). ``plan.build(optimizer=None)`` makes the
    sub-ResNets in one slice gather; ``plan.aggregate(subnetworks, optimizer=None)`` writes them
    back in one slice scatter and sets the full model's residual scales."""
    return ResistPlan(model, S, min_depth, generator)
