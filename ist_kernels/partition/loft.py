"""LOFT filter-wise partition of a CNN (paper 000 §4, Algorithm 1, Figure 2).

In every partitioned residual block the first conv's output filters are permuted at random and cut
into S disjoint sets; subnetwork s gets its set of filters, the BN channels that follow them and
the matching input channels of the next conv, so the block's input and output keep their width
and only its inner width shrinks. Not partitioned, hence shared and averaged over all subnetworks:
the stem, the first block of every stage, every strided block, shortcut convs, the classifier,
and within partitioned blocks everything outside the filter conv -> BN -> next conv path.

Blocks, stages and the filter conv -> BN -> next conv of a block are found from the module structure
(``resnet_blocks``: this package's ResNets, torchvision's and Hugging Face's layouts); ``layers[block]``
holds their paths relative to the block (``"conv1"``, ``"layer.0.convolution"``).
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .resnet_blocks import Block, find_resnet, loft_blocks  # noqa: F401 (find_resnet: re-exported)
from .subnetworks import SubnetworkPlan


class LoftPlan(SubnetworkPlan):
    """One round's LOFT partition. ``filters[block][s]``: the filter indices (sorted) subnetwork
    ``s`` owns in ``block``'s filter conv; ``layers[block]``: its (filter conv, BN, next conv)."""

    who = "loft_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int,
                 generator: Optional[torch.Generator] = None, *,
                 filters: Optional[Dict[str, List[Tensor]]] = None):
        # ``filters`` (block name -> per-subnetwork sorted filter indices) replaces the random
        # draw; pruning uses it with one subnetwork holding the kept filters.
        S = num_subnetworks
        if isinstance(S, bool) or not isinstance(S, int) or S < 1:
            raise ValueError(f"loft_plan: S (number of subnetworks) must be an int >= 1, got {S!r}")
        found = loft_blocks(model, self.who)
        blocks: List[Block] = [b for b, _ in found]
        self.blocks = blocks
        self.layers: Dict[str, Tuple[str, str, str]] = {}
        self.filters: Dict[str, List[Tensor]] = {}
        partitioned: Dict[str, Tuple[int, List[Tensor]]] = {}
        for b, layers in found:
            conv_name, bn_name, next_name = layers
            conv, bn, nxt = (b.module.get_submodule(n) for n in layers)
            num_filters = conv.out_channels
            if S > num_filters:
                raise ValueError(f"loft_plan: S={S} subnetworks but {b.name}.{conv_name} has only "
                                 f"{num_filters} filters (each subnetwork needs at least one)")
            if filters is None:
                perm = torch.randperm(num_filters, generator=generator)
                sets = [chunk.sort().values for chunk in perm.tensor_split(S)]
            else:
                sets = [torch.as_tensor(i, dtype=torch.long).cpu() for i in filters[b.name]]
            self.layers[b.name] = layers
            self.filters[b.name] = sets
            for mod_name, mod, attrs, dim in (
                    (conv_name, conv, ("weight", "bias"), 0),
                    (bn_name, bn, ("weight", "bias", "running_mean", "running_var"), 0),
                    (next_name, nxt, ("weight",), 1)):
                for attr in attrs:
                    if getattr(mod, attr, None) is not None:
                        partitioned[f"{b.name}.{mod_name}.{attr}"] = (dim, sets)
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        for b in self.blocks:
            conv_name, bn_name, next_name = self.layers[b.name]
            width = self.filters[b.name][s].numel()
            glob[f"{b.name}.{conv_name}"].out_channels = width
            glob[f"{b.name}.{bn_name}"].num_features = width
            glob[f"{b.name}.{next_name}"].in_channels = width


def loft_plan(model: nn.Module, S: int, generator: Optional[torch.Generator] = None) -> LoftPlan:
    """A random LOFT partition of ``model`` into ``S`` filter-wise subnetworks (paper 000 §4).

    ``plan.build(optimizer=None)`` makes the S standalone subnetworks (narrower convs) in one slice
    gather; ``plan.aggregate(subnetworks, optimizer=None)`` puts the filters back in one slice
    scatter and averages what is shared. ``generator`` (CPU) draws the permutations."""
    return LoftPlan(model, S, generator)
