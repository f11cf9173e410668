"""Random pruning at initialisation (paper 002 §2.1): every weight entry of every Linear/Conv2d
layer is kept with probability 1 - p, the mask is fixed for the whole of training."""
from typing import Optional

import torch
from torch import nn

from .nn.masked import MaskedConv2d, MaskedLinear


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
