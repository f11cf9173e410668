"""8-bit quantisation of communicated slices (paper 003 Appendix A.5): one scale per slice.

A "slice" here is what one rank sends of one tensor (the union of its segments of that tensor:
its compact tensor, or, with replicated storage, the rows it owns): scale = absmax / 127,
q = round(x * (1 / scale)) in [-127, 127], x' = q * scale. Every segment a rank cuts from the
same tensor uses the same scale, so all ranks that receive a slice (and the sender itself, which
dequantises its own part the same way) end up with the same values. Error bound per element:
|x - x'| <= scale / 2 plus fp32 rounding (~127 eps scale); an owner mean of k dequantised values
is off by at most the largest of its owners' bounds. The elementwise work is multi-tensor
(``torch._foreach_*``) over the segments of the one packed buffer: no per-element scale index.
"""
from typing import Sequence

import torch
from torch import Tensor

from .ledger import CODEC_BYTES  # noqa: F401  (wire bytes per element of each outer-gradient codec)

QMAX = 127


def segment_scales(views: Sequence[Tensor], seg_slice: Tensor, num_slices: int) -> Tensor:
    """float32 [len(views)]: the scale of each segment = absmax / 127 over every segment of the same
    slice (segment j belongs to slice seg_slice[j])."""
    seg_max = torch.zeros(len(views), dtype=torch.float32, device=seg_slice.device)
    nonempty = [j for j, v in enumerate(views) if v.numel()]
    if nonempty:
        if seg_max.device.type == "cpu":  # vectorised per segment; the CPU foreach norm is not
            lo_hi = [torch.aminmax(views[j]) for j in nonempty]
            amax = torch.maximum(-torch.stack([m[0] for m in lo_hi]), torch.stack([m[1] for m in lo_hi]))
        else:  # one multi-tensor launch
            amax = torch.stack(torch._foreach_norm([views[j] for j in nonempty], float("inf")))
        seg_max[torch.tensor(nonempty, device=seg_max.device)] = amax.float()
    per_slice = torch.zeros(num_slices, dtype=torch.float32, device=seg_max.device)
    per_slice.scatter_reduce_(0, seg_slice, seg_max, "amax")
    return per_slice[seg_slice] / QMAX


def quantize_(views: Sequence[Tensor], seg_scales: Tensor) -> None:
    """In place: each segment view x becomes its codes clamp(round(x * (1 / scale)), -127, 127),
    still in its floating dtype (converted to int8 when copied onto the wire)."""
    if not views:
        return
    inv = torch.where(seg_scales > 0, 1.0 / seg_scales.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    views = list(views)
    torch._foreach_mul_(views, inv.tolist())
    torch._foreach_round_(views)
    torch._foreach_clamp_min_(views, -QMAX)
    torch._foreach_clamp_max_(views, QMAX)


def dequantize_(views: Sequence[Tensor], seg_scales: Tensor) -> None:
    """In place: codes (as floats) times their segment's scale."""
    if views:
        torch._foreach_mul_(list(views), seg_scales.tolist())


# ---- whole buffers of an averaged gradient (DiLoCo's outer gradient, ``outer_grad``)


def encode(x: Tensor, codec: str):
    """(codes, scale) of a float32 buffer: ``bf16`` the bfloat16 values (scale 1), ``int8`` one
    absmax / 127 scale for the buffer, codes clamp(round(x / scale), -127, 127). Elementwise ops
    only, so a buffer gives the same codes wherever it lies in memory."""
    if codec == "bf16":
        return x.to(torch.bfloat16), torch.ones((), dtype=torch.float32, device=x.device)
    if codec != "int8":
        raise ValueError(f"encode: codec must be bf16 or int8, got {codec!r}")
    amax = x.abs().max() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    scale = (amax / QMAX).float()
    inv = torch.where(scale > 0, 1.0 / scale.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    return torch.round(x * inv).clamp_(-QMAX, QMAX).to(torch.int8), scale


def decode(codes: Tensor, scale: Tensor) -> Tensor:
    """float32 values of :func:`encode`'s codes."""
    if codes.dtype == torch.bfloat16:
        return codes.float()
    return codes.float() * scale
