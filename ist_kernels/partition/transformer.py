"""Partitions of a decoder-only transformer (:class:`ist_kernels.models.GPT`: ``model.blocks`` of
pre-LayerNorm blocks with ``attn.qkv``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``) into subnetworks,
with the same slice plans, gather/scatter and exchange as the CNN partitions.

- IST (:func:`transformer_ist_plan`): in every block the FFN's hidden units (``partition=ffn``:
  rows of ``mlp.fc`` and its bias, columns of ``mlp.proj``) and/or the attention heads
  (``partition=heads``: each head's ``head_dim`` rows of q, k and v in ``attn.qkv`` and its bias,
  its columns of ``attn.proj``) are permuted at random and cut into S disjoint groups (FFN units:
  sizes differing by at most one; heads: S must divide them), as IST cuts an MLP's neurons.
  Everything else (embeddings, positions, LayerNorms, the output biases) is shared and averaged.
  A subnetwork computes its branch from its own units; the full model scales the partitioned units'
  outputs by 1/S before the output projection (``output_scale``; the projection's bias is shared),
  so each branch is exactly the mean of the subnetworks' branches (paper 001 §4's ξ scaling of a
  masked network's hidden outputs, ξ = 1/S here).
- ResIST (:func:`transformer_resist_plan`): the blocks between the first and the last are dealt
  among the S subnetworks exactly as ResIST deals a ResNet's third stage (paper 003 §2.2:
  a random permutation round-robin, then shared up to ``min_depth`` each); the first and last
  blocks, embeddings and the final LayerNorm are shared. A subnetwork skips the blocks it does not
  own; the full model scales both branches of a partitioned block by the expected fraction of
  subnetworks owning it (§2.6, ``residual_scale``; 1/S without sharing).
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ._subnetworks import SubnetworkPlan
from .resist import check_min_depth, deal_blocks

#: what ``partition`` (the IST option) may name
PARTITIONS = ("ffn", "heads", "both")


def _check_S(S, who: str) -> None:
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"{who}: S (number of subnetworks) must be an int >= 1, got {S!r}")


def is_transformer(model: nn.Module) -> bool:
    """``model`` has ``blocks`` (an ``nn.Sequential``) of transformer blocks (``attn.qkv``,
    ``attn.proj``, ``mlp.fc``, ``mlp.proj``)."""
    blocks = getattr(model, "blocks", None)
    return isinstance(blocks, nn.Sequential) and len(blocks) > 0 and all(
        all(isinstance(getattr(getattr(b, part, None), lin, None), nn.Linear)
            for part, lin in (("attn", "qkv"), ("attn", "proj"), ("mlp", "fc"), ("mlp", "proj")))
        for b in blocks)


def transformer_blocks(model: nn.Module, who: str) -> List[Tuple[str, nn.Module]]:
    """``(name, block)`` of every block of ``model.blocks``; a clear error for other models."""
    if not is_transformer(model):
        raise ValueError(f"{who}: expected a transformer with model.blocks, an nn.Sequential of blocks with "
                         f"attn.qkv, attn.proj, mlp.fc and mlp.proj (ist_kernels.models.GPT), got "
                         f"{type(model).__name__}")
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


def head_rows(heads: Tensor, num_heads: int, head_dim: int) -> Tuple[Tensor, Tensor]:
    """(rows of ``attn.qkv``, columns of ``attn.proj``) of the heads ``heads`` (sorted): the q, k
    and v rows of each head, in the order ``[q heads | k heads | v heads]`` the module reads."""
    cols = (heads.view(-1, 1) * head_dim + torch.arange(head_dim)).flatten()
    rows = torch.cat([j * num_heads * head_dim + cols for j in range(3)])
    return rows, cols


class TransformerISTPlan(SubnetworkPlan):
    """One round's IST partition of a transformer. ``units[block][s]``: the FFN units (sorted) of
    subnetwork ``s``; ``heads[block][s]``: its attention heads (sorted); ``partition``: which of
    the two are partitioned; ``scale``: the full model's ``output_scale`` of a partitioned branch."""

    who = "transformer_ist_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int, partition: str = "ffn",
                 generator: Optional[torch.Generator] = None):
        S = num_subnetworks
        _check_S(S, self.who)
        if partition not in PARTITIONS:
            raise ValueError(f"{self.who}: partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
        blocks = transformer_blocks(model, self.who)
        self.partition = partition
        self.block_names = [n for n, _ in blocks]
        self.units: Dict[str, List[Tensor]] = {}
        self.heads: Dict[str, List[Tensor]] = {}
        self.head_dims: Dict[str, int] = {}
        self.scale = 1.0 / S
        partitioned: Dict[str, Tuple[int, List[Tensor]]] = {}
        for name, b in blocks:
            if partition in ("ffn", "both"):
                hidden = b.mlp.fc.weight.shape[0]
                if S > hidden:
                    raise ValueError(f"{self.who}: S={S} subnetworks but {name}.mlp has only {hidden} units")
                sets = [c.sort().values for c in torch.randperm(hidden, generator=generator).tensor_split(S)]
                self.units[name] = sets
                partitioned[f"{name}.mlp.fc.weight"] = (0, sets)
                if b.mlp.fc.bias is not None:
                    partitioned[f"{name}.mlp.fc.bias"] = (0, sets)
                partitioned[f"{name}.mlp.proj.weight"] = (1, sets)
            if partition in ("heads", "both"):
                hd = b.attn.head_dim
                H = b.attn.qkv.weight.shape[0] // (3 * hd)
                if H % S:
                    raise ValueError(f"{self.who}: {name}.attn has {H} heads, not divisible by S={S}")
                heads = [c.sort().values for c in torch.randperm(H, generator=generator).tensor_split(S)]
                self.heads[name] = heads
                self.head_dims[name] = hd
                rows, cols = zip(*(head_rows(h, H, hd) for h in heads))
                partitioned[f"{name}.attn.qkv.weight"] = (0, list(rows))
                if b.attn.qkv.bias is not None:
                    partitioned[f"{name}.attn.qkv.bias"] = (0, list(rows))
                partitioned[f"{name}.attn.proj.weight"] = (1, list(cols))
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        for name in self.block_names:
            if name in self.units:
                n = self.units[name][s].numel()
                glob[f"{name}.mlp"].output_scale = 1.0
                glob[f"{name}.mlp.fc"].out_features = n
                glob[f"{name}.mlp.proj"].in_features = n
            if name in self.heads:
                n = self.heads[name][s].numel() * self.head_dims[name]
                glob[f"{name}.attn"].output_scale = 1.0
                glob[f"{name}.attn.qkv"].out_features = 3 * n
                glob[f"{name}.attn.proj"].in_features = n

    def scale_outputs(self, model: Optional[nn.Module] = None) -> None:
        """Set ``output_scale`` of the partitioned branches of ``model`` (default: the plan's) to 1/S."""
        model = self.model if model is None else model
        for name in self.block_names:
            if name in self.units:
                model.get_submodule(f"{name}.mlp").output_scale = self.scale
            if name in self.heads:
                model.get_submodule(f"{name}.attn").output_scale = self.scale

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_outputs(model)


class TransformerResistPlan(SubnetworkPlan):
    """One round's ResIST partition of a transformer's blocks. ``partitioned_blocks``: the names of
    the blocks dealt out (all but the first and the last); ``blocks[s]``: those subnetwork ``s``
    owns (in depth order); ``owners[name]``: the subnetworks owning a block; ``residual_scale``:
    the full model's scale of their branches."""

    who = "transformer_resist_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int, min_depth: int = 1,
                 generator: Optional[torch.Generator] = None):
        S = num_subnetworks
        _check_S(S, self.who)
        check_min_depth(min_depth, self.who)
        blocks = transformer_blocks(model, self.who)
        if len(blocks) < 3:
            raise ValueError(f"{self.who}: the first and last blocks are shared, so a transformer needs at least "
                             f"3 blocks to deal, got {len(blocks)}")
        part = blocks[1:-1]
        for name, b in part:
            if not isinstance(getattr(b, "residual_scale", None), float):
                raise ValueError(f"{self.who}: block {name} ({type(b).__name__}) has no float attribute "
                                 f"residual_scale (paper 003 §2.6): use ist_kernels.models.GPT or add it")
        P = len(part)
        if min_depth > P:
            raise ValueError(f"{self.who}: min_depth={min_depth} is larger than the {P} partitioned blocks")
        dealt = deal_blocks(P, S, min_depth, generator)
        self.partitioned_blocks = [n for n, _ in part]
        self.blocks: List[List[str]] = [[part[k][0] for k in d] for d in dealt]
        self.owners: Dict[str, List[int]] = {n: [s for s in range(S) if k in dealt[s]] for k, (n, _) in enumerate(part)}
        self.residual_scale = sum(len(d) for d in dealt) / (P * S)
        self._depth = len(blocks)
        self._dealt = [set(d) for d in dealt]
        partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]] = {}
        for k, (name, b) in enumerate(part):
            for tname, t in list(b.named_parameters()) + list(b.named_buffers()):
                full = torch.zeros(1, dtype=torch.long) if t.dim() == 0 else torch.arange(t.shape[0])
                partitioned[f"{name}.{tname}"] = (0, [full if k in self._dealt[s] else None for s in range(S)])
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        seq = glob["blocks"]
        kept = []
        for j in range(self._depth):
            block = seq._modules[str(j)]
            if j in (0, self._depth - 1):
                kept.append(block)
            elif j - 1 in self._dealt[s]:
                block.residual_scale = 1.0
                kept.append(block)
        seq.__dict__["_modules"] = {str(n): m for n, m in enumerate(kept)}

    def scale_residuals(self, model: Optional[nn.Module] = None) -> None:
        """Set ``residual_scale`` of the partitioned blocks of ``model`` (default: the plan's) to the
        expected fraction of subnetworks owning them (§2.6)."""
        model = self.model if model is None else model
        for name in self.partitioned_blocks:
            model.get_submodule(name).residual_scale = self.residual_scale

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_residuals(model)


def transformer_ist_plan(model: nn.Module, S: int, partition: str = "ffn",
                         generator: Optional[torch.Generator] = None) -> TransformerISTPlan:
    """A random IST partition of a transformer's FFN units (``partition="ffn"``), attention heads
    (``"heads"``) or both into ``S`` subnetworks; ``build``/``aggregate`` as for the CNN plans."""
    return TransformerISTPlan(model, S, partition, generator)


def transformer_resist_plan(model: nn.Module, S: int, min_depth: int = 1,
                            generator: Optional[torch.Generator] = None) -> TransformerResistPlan:
    """A random ResIST partition of a transformer's middle blocks into ``S`` shallower subnetworks of
    at least ``min_depth`` partitioned blocks each (paper 003 §2.2, §2.6)."""
    return TransformerResistPlan(model, S, min_depth, generator)
