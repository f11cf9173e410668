# ---- Filter pruning by L2 norm (paper 000 §2, §6) ------------------------------------------------
from typing import Dict as _Dict

import torch as _torch
from torch import Tensor as _Tensor, nn as _nn


def filters_to_keep(model: _nn.Module, ratio: float) -> _Dict[str, _Tensor]:
    """The filters :func:`prune_filters` keeps: for every partitioned block (not the first of its
    stage, not strided; paper 000 §6), ``"block.conv" -> sorted indices`` of the highest-L2-norm
    ``F - floor(ratio * F)`` filters of its filter conv (ties: the lower index stays)."""
    from .partition._resnet import filter_layers, stages

    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
        raise ValueError(f"prune_filters: ratio must be a number in [0, 1), got {ratio!r}")
    kept = {}
    for stage in stages(model, "prune_filters"):
        for b in stage:
            if not b.partitionable:
                continue
            conv_name = filter_layers(b, "prune_filters")[0]
            w = b.module._modules[conv_name].weight.detach()
            num = w.shape[0]
            keep = num - int(ratio * num)
            norms = w.flatten(1).double().norm(dim=1)
            order = _torch.argsort(norms, descending=True, stable=True)
            kept[f"{b.name}.{conv_name}"] = order[:keep].sort().values.cpu()
    if not kept:
        raise ValueError("prune_filters: the model has no prunable block (every block is the first "
                         "of its stage or strided)")
    return kept


def prune_filters(model: _nn.Module, ratio: float) -> _nn.Module:
    """A physically smaller copy of ``model`` without the lowest-L2-norm ``ratio`` of the filters of
    each partitioned conv (the first conv of every block that is neither the first of its stage nor
    strided; paper 000 §6), the BN channels that follow them and the next conv's matching input
    channels. It computes what ``model`` computes with those filters zeroed (filter weights, conv
    bias and the following BN's weight and bias set to 0), in train and eval mode."""
    from .partition.loft import LoftPlan

    kept = filters_to_keep(model, ratio)
    filters = {name.rsplit(".", 1)[0]: [idx] for name, idx in kept.items()}
    plan = LoftPlan(model, 1, filters=filters)
    return plan.build()[0].module
