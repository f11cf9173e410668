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

from ._init import like, linear_init_

__all__ = ["MaskedLinear", "MaskedConv2d", "keep_mask", "draw_seed"]


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """A seed in [0, 2**63) drawn from ``generator`` (default: torch's global CPU generator).

    A module built from a generator records such a seed, so that ``reset_parameters`` redraws the
    same mask later (after ``to_empty``, say) without holding on to the generator's state."""
    g_device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.empty((), dtype=torch.int64, device=g_device).random_(generator=generator))


def keep_mask(shape, p: float, seed: int, device=None) -> Tensor:
    """bool mask of ``shape`` with entries i.i.d. Bernoulli(1 - p): True = kept, False = pruned.

    Drawn on ``device`` from a fresh generator seeded with ``seed``: the same (seed, device type)
    gives the same mask. On ``meta`` nothing is drawn (an uninitialised mask).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"keep_mask: p (pruning rate) must be in [0, 1], got {p}")
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.bool, device=device)
    if p == 0.0:  # nothing pruned: draw nothing
        return torch.ones(shape, dtype=torch.bool, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=g, device=device) >= p


class _Masked:
    """Mixin for a layer whose ``weight`` is masked by the bool buffer ``mask``, drawn from the
    plain int ``mask_seed`` (not in the state dict, which holds the mask itself) at rate ``p``."""

    mask: Tensor
    weight: nn.Parameter
    p: float
    mask_seed: Optional[int]

    def _init_mask(self, p: float, seed: Optional[int], generator: Optional[torch.Generator]) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{type(self).__name__}: p (pruning rate) must be in [0, 1], got {p}")
        if seed is not None and generator is not None:
            raise ValueError(f"{type(self).__name__}: pass seed or generator, not both")
        self.p = float(p)
        # p == 0 draws nothing (the generator is left as it is); the mask is all ones.
        self.mask_seed = None if p == 0.0 else int(seed) if seed is not None else draw_seed(generator)
        self.register_buffer("mask", torch.empty(self.weight.shape, dtype=torch.bool, device=self.weight.device))
        self.reset_mask()

    @torch.no_grad()
    def reset_mask(self) -> None:
        """Redraw the mask from ``mask_seed`` (on the weight's device) and zero the pruned weights."""
        self.mask.copy_(keep_mask(self.mask.shape, self.p, self.mask_seed or 0, self.mask.device))
        self.apply_mask_()

    @torch.no_grad()
    def apply_mask_(self) -> None:
        """Zero the stored weight where the mask is zero (after loading or editing weights)."""
        self.weight.mul_(like(self.mask, self.weight))

    def reset_parameters(self) -> None:
        """The dense layer's initialisation (the same draws, from the global generator, on the
        weight's device), then the mask redrawn from ``mask_seed`` (the same mask every time)
        and applied."""
        linear_init_(self.weight, self.bias)
        if hasattr(self, "mask"):  # not yet during the dense layer's __init__
            self.reset_mask()

    def masked_weight(self) -> Tensor:
        """The effective weight W ⊙ M (differentiable in W; its gradient is masked)."""
        return self.weight * self.mask

    @property
    def sparsity(self) -> float:
        """Fraction of the weight entries that are pruned (mask zero); reads the mask."""
        n = self.mask.numel()
        return 1.0 - self.mask.count_nonzero().item() / n if n else 0.0

    def _mask_repr(self) -> str:  # never reads data (meta modules print too)
        return f"p={self.p}, mask_seed={self.mask_seed}"

    @classmethod
    def from_dense(cls, layer, p: float, generator: Optional[torch.Generator] = None, *, seed: Optional[int] = None):
        """A masked copy of ``layer`` (same shapes, dtype, device, weights ⊙ M, bias copied); the
        mask is drawn from ``seed``, or from a seed drawn from ``generator``."""
        masked = cls._empty_like(layer, p, seed, generator)
        with torch.no_grad():
            masked.weight.copy_(layer.weight)
            if layer.bias is not None:
                masked.bias.copy_(layer.bias)
            masked.reset_mask()
        masked.weight.requires_grad_(layer.weight.requires_grad)
        masked.train(layer.training)
        return masked


class MaskedLinear(_Masked, nn.Linear):
    """nn.Linear with a fixed random pruning mask: y = x (W ⊙ M)ᵀ + b.

    ``p``: pruning rate. The mask M ~ Bernoulli(1 - p) is drawn on the module's device from
    ``seed`` (an int), or from a seed drawn from ``generator`` (default: the global generator);
    the seed is kept as ``mask_seed``, so ``reset_parameters`` (e.g. after construction on
    ``meta`` and ``to_empty``) redraws the same mask."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, p: float = 0.0,
                 generator: Optional[torch.Generator] = None, device=None, dtype=None, *,
                 seed: Optional[int] = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_mask(p, seed, generator)

    @classmethod
    def _empty_like(cls, layer: nn.Linear, p, seed, generator) -> "MaskedLinear":
        w = layer.weight
        return cls(layer.in_features, layer.out_features, layer.bias is not None, p, generator,
                   device="meta", dtype=w.dtype, seed=seed).to_empty(device=w.device)

    def forward(self, input: Tensor) -> Tensor:
        return F.linear(input, self.masked_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._mask_repr()}"


class MaskedConv2d(_Masked, nn.Conv2d):
    """nn.Conv2d with a fixed random pruning mask on every weight entry: conv(x, W ⊙ M) + b.
    ``p``, ``seed``, ``generator``: as :class:`MaskedLinear`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 p: float = 0.0, generator: Optional[torch.Generator] = None, device=None, dtype=None, *,
                 seed: Optional[int] = None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, padding_mode, device=device, dtype=dtype)
        self._init_mask(p, seed, generator)

    @classmethod
    def _empty_like(cls, layer: nn.Conv2d, p, seed, generator) -> "MaskedConv2d":
        w = layer.weight
        return cls(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
                   layer.dilation, layer.groups, layer.bias is not None, layer.padding_mode, p, generator,
                   device="meta", dtype=w.dtype, seed=seed).to_empty(device=w.device)

    def forward(self, input: Tensor) -> Tensor:
        return self._conv_forward(input, self.masked_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._mask_repr()}"
