"""8-bit quantisation of communicated slices (paper 003 Appendix A.5): one scale per slice.

A "slice" here is what one rank sends of one tensor (the union of its segments of that tensor:
its compact tensor, or, with replicated storage, the part it owns): scale = absmax / 127, q = round(x / scale) in [-127, 127], x' = q * scale. Every
segment a rank cuts from the same tensor uses the same scale, so all ranks that receive a slice
(and the sender itself, which dequantises its own part the same way) end up with the same values.
Error bound per element: |x - x'| <= scale / 2 (plus fp32 rounding of the division and product);
an owner mean of k dequantised values is off by at most the largest of its owners' bounds.
"""
from typing import List, Sequence

import torch
from torch import Tensor

QMAX = 127


def slice_scales(x: Tensor, seg_numels: Tensor, seg_slice: Tensor, num_slices: int) -> Tensor:
    """float32 [num_slices]: absmax / 127 over all the segments of flat ``x`` that belong to each
    slice (segment j, of length seg_numels[j], belongs to slice seg_slice[j]); 0 where none."""
    out = torch.zeros(num_slices, dtype=torch.float32, device=x.device)
    if seg_numels.numel():
        seg_max = torch.segment_reduce(x.float().abs(), "max", lengths=seg_numels)
        out.scatter_reduce_(0, seg_slice, seg_max, "amax")
    return out / QMAX


def _per_element(scales: Tensor, numels: Tensor) -> Tensor:
    return torch.repeat_interleave(scales, numels)


def quantize(x: Tensor, seg_scales: Tensor, seg_numels: Tensor) -> Tensor:
    """int8 codes of flat ``x`` whose consecutive segments (lengths seg_numels) use seg_scales."""
    s = _per_element(seg_scales, seg_numels)
    q = torch.where(s > 0, x.float() / torch.where(s > 0, s, 1.0), 0.0)
    return torch.round(q).clamp_(-QMAX, QMAX).to(torch.int8)


def dequantize(q: Tensor, seg_scales: Tensor, seg_numels: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * _per_element(seg_scales, seg_numels)).to(dtype)


def error_bound(scales: Tensor) -> Tensor:
    """Largest |x - x'| for a slice quantised with ``scales``: half a step, plus fp32 rounding."""
    return scales * (0.5 + 1e-5 * QMAX)


def segment_numels(numels: List[int], device) -> Tensor:
    return torch.tensor(numels, dtype=torch.int64, device=device)
