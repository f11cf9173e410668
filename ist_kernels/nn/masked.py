"""Randomly pruned layers: weight ⊙ M with M a Bernoulli keep-mask drawn once at initialisation
(paper 002 §2.1). ``p`` is the pruning rate, the fraction of weights removed, as in paper 002 §5.1
(§2.1 writes the keep probability as Bernoulli(p); here M ~ Bernoulli(1 - p)).

The stored weight is kept at zero where M = 0 and the forward uses weight ⊙ M, so the weight's
gradient is ∇_{W⊙M} L ⊙ M (§2.1): zero where M = 0. With a zero weight and a zero gradient there,
SGD with momentum and weight decay (and Adam/AdamW) leaves those entries at zero.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def keep_mask(shape, p: float, generator: Optional[torch.Generator] = None, device=None) -> Tensor:
    """bool mask of ``shape`` with entries i.i.d. Bernoulli(1 - p): True = kept, False = pruned.

    Drawn on the CPU (same mask for the same generator state on every machine), then moved.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"keep_mask: p (pruning rate) must be in [0, 1], got {p}")
    if p == 0.0:  # nothing pruned: draw nothing, leave the generator as it is
        return torch.ones(shape, dtype=torch.bool, device=device)
    return (torch.rand(shape, generator=generator) >= p).to(device)


class _Masked:
    """Mixin for a layer whose ``weight`` is masked by the bool buffer ``mask``."""

    mask: Tensor
    weight: nn.Parameter

    def _init_mask(self, p: float, generator: Optional[torch.Generator]) -> None:
        self.register_buffer("mask", keep_mask(self.weight.shape, p, generator, self.weight.device))
        self.apply_mask_()

    @torch.no_grad()
    def apply_mask_(self) -> None:
        """Zero the stored weight where the mask is zero (after loading or editing weights)."""
        self.weight.mul_(self.mask)

    def reset_parameters(self) -> None:
        super().reset_parameters()  # type: ignore[misc]
        if hasattr(self, "mask"):
            self.apply_mask_()

    def masked_weight(self) -> Tensor:
        """The effective weight W ⊙ M (differentiable in W; its gradient is masked)."""
        return self.weight * self.mask

    @property
    def sparsity(self) -> float:
        """Fraction of the weight entries that are pruned (mask zero)."""
        n = self.mask.numel()
        return 1.0 - self.mask.count_nonzero().item() / n if n else 0.0

    @classmethod
    def from_dense(cls, layer, p: float, generator: Optional[torch.Generator] = None):
        """A masked copy of ``layer`` (same shapes, dtype, device, weights ⊙ M, bias copied)."""
        masked = cls._empty_like(layer)
        with torch.no_grad():
            masked.weight.copy_(layer.weight)
            if layer.bias is not None:
                masked.bias.copy_(layer.bias)
        masked.weight.requires_grad_(layer.weight.requires_grad)
        masked._init_mask(p, generator)
        masked.train(layer.training)
        return masked


class MaskedLinear(_Masked, nn.Linear):
    """nn.Linear with a fixed random pruning mask: y = x (W ⊙ M)ᵀ + b."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, p: float = 0.0,
                 generator: Optional[torch.Generator] = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_mask(p, generator)

    @classmethod
    def _empty_like(cls, layer: nn.Linear) -> "MaskedLinear":
        w = layer.weight
        return nn.utils.skip_init(cls, layer.in_features, layer.out_features, layer.bias is not None,
                                  device=w.device, dtype=w.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.masked_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={self.sparsity:.3f}"


class MaskedConv2d(_Masked, nn.Conv2d):
    """nn.Conv2d with a fixed random pruning mask on every weight entry: conv(x, W ⊙ M) + b."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 p: float = 0.0, generator: Optional[torch.Generator] = None, device=None, dtype=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, padding_mode, device=device, dtype=dtype)
        self._init_mask(p, generator)

    @classmethod
    def _empty_like(cls, layer: nn.Conv2d) -> "MaskedConv2d":
        w = layer.weight
        return nn.utils.skip_init(cls, layer.in_channels, layer.out_channels, layer.kernel_size,
                                  layer.stride, layer.padding, layer.dilation, layer.groups,
                                  layer.bias is not None, layer.padding_mode,
                                  device=w.device, dtype=w.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.masked_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sparsity={self.sparsity:.3f}"
