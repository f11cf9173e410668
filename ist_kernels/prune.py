"""Pruning: filters by L2 norm (paper 000 §2, §6) and random pruning at initialisation (paper 002 §2.1)."""
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from .nn.masked import MaskedConv2d, MaskedLinear
from .partition.loft import LoftPlan
from .partition.resnet_blocks import loft_blocks

# ---- Filter pruning by L2 norm (paper 000 §2, §6) ------------------------------------------------


def kept_filters_by_block(model: nn.Module, ratio: float) -> Dict[str, Tuple[str, Tensor]]:
    """For every partitioned block (full module path; not the first of its stage, not strided;
    paper 000 §6): ``(filter conv path relative to the block, sorted kept filter indices)``, the
    highest-L2-norm ``F - floor(ratio * F)`` filters (ties: the lower index stays)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"prune_filters: ratio must be a number in [0, 1), got {ratio!r}")
    kept = {}
    for b, (conv_name, _, _) in loft_blocks(model, "prune_filters"):
        w = b.module.get_submodule(conv_name).weight.detach()
        kept[b.name] = (conv_name, keep_largest(filter_norms(w), ratio))
    return kept


def filters_to_keep(model: nn.Module, ratio: float) -> Dict[str, Tensor]:
    """The filters :func:`prune_filters` keeps: for every partitioned block (not the first of its
    stage, not strided; paper 000 §6), ``"block.conv" -> sorted indices`` of the highest-L2-norm
    ``F - floor(ratio * F)`` filters of its filter conv (ties: the lower index stays)."""
    return {f"{block}.{conv}": idx for block, (conv, idx) in kept_filters_by_block(model, ratio).items()}


def filter_norms(weight: Tensor) -> Tensor:
    """The L2 norm of every filter (output channel) of a conv weight, in float64."""
    return weight.flatten(1).double().norm(dim=1)


def keep_largest(norms: Tensor, ratio: float) -> Tensor:
    """Sorted indices of the ``F - floor(ratio * F)`` largest of ``norms`` (ties: the lower index stays)."""
    num = norms.numel()
    order = torch.argsort(norms, descending=True, stable=True)
    return order[:num - int(ratio * num)].sort().values.cpu()


def prune_filters(model: nn.Module, ratio: float) -> nn.Module:
    """A physically smaller copy of ``model`` without the lowest-L2-norm ``ratio`` of the filters of
    each partitioned conv (the first conv of every block that is neither the first of its stage nor
    strided; paper 000 §6), the BN channels that follow them and the next conv's matching input
    channels. It computes what ``model`` computes with those filters zeroed (filter weights, conv
    bias and the following BN's weight and bias set to 0), in train and eval mode."""
    filters = {block: [idx] for block, (_, idx) in kept_filters_by_block(model, ratio).items()}
    plan = LoftPlan(model, 1, filters=filters)
    return plan.build()[0].module


# ---- Random pruning at initialisation (paper 002 §2.1) -------------------------------------------
# Every weight entry of every Linear/Conv2d layer is kept with probability 1 - p, the mask is fixed
# for the whole of training.


def random_prune_(model: nn.Module, p: float, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Replace every nn.Linear and nn.Conv2d in ``model`` (recursively, in ``named_modules`` order)
    by a :class:`MaskedLinear` / :class:`MaskedConv2d` pruned at rate ``p`` (fraction of weights
    removed), in place; weights where the mask is one and biases are kept. Layers that are already
    masked are left as they are. Returns ``model`` (a bare Linear/Conv2d is returned converted)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"random_prune_: p (pruning rate) must be in [0, 1], got {p}")

    def convert(layer: nn.Module) -> Optional[nn.Module]:
        if isinstance(layer, (MaskedLinear, MaskedConv2d)):
            return None
        if type(layer) is nn.Linear:
            return MaskedLinear.from_dense(layer, p, generator)
        if type(layer) is nn.Conv2d:
            return MaskedConv2d.from_dense(layer, p, generator)
        return None

    root = convert(model)
    if root is not None:
        return root
    converted = {}  # a layer shared by several parents gets one mask
    for _, module in list(model.named_modules()):
        for child_name, child in list(module._modules.items()):  # every reference, shared too
            if child is None:
                continue
            if id(child) not in converted:
                converted[id(child)] = convert(child)
            if converted[id(child)] is not None:
                setattr(module, child_name, converted[id(child)])
    return model
