"""Owner aggregation: how slices held by several subnetworks are written back into the global
model. One place for both launch modes: :meth:`SubnetworkPlan.aggregate` (simulated) and the
distributed :class:`ist_kernels.distributed.Exchange` (its unpack) call :func:`aggregate_slices_`.
"""
from typing import Dict, List, Sequence

import torch
from torch import Tensor

from .. import functional as F


def aggregate_slices_(targets: Sequence[Tensor], target_ids: Sequence[int], updates: Sequence[Tensor],
                      indices: Sequence[Tensor], dims: Sequence[int]) -> None:
    """Write compact segments back into their targets, in place (segments as in
    :func:`ist_kernels.functional.slice_scatter_`: ``updates[j]`` holds the slices ``indices[j]``
    along ``dims[target_ids[j]]`` of ``targets[target_ids[j]]``, one segment per owner).

    - Floating targets: the mean over the segments owning a slice, taken in segment order (paper
      001 §3.1, eta = N_perp / N), one ``slice_scatter_(reduce="mean")`` launch per dtype.
    - Integer targets (counters, e.g. BN ``num_batches_tracked`` of a block several ResIST
      sub-ResNets own): the owners' maximum. A mean of counters would be truncated toward zero
      (10 and 11 give 10), so a counter could go back; the maximum is the count of the owner that
      saw the most batches, and equals every owner's count when they agree. Computed in Python
      around the op (``scatter_reduce_(..., "amax")``): counters are a handful of elements.

    Slices no segment owns keep their value. Everything is checked before anything is written.
    """
    targets, target_ids, updates = list(targets), list(target_ids), list(updates)
    indices, dims = list(indices), list(dims)
    counters = [t for t, x in enumerate(targets) if not (x.is_floating_point() or x.is_complex())]
    if not counters:
        F.slice_scatter_(targets, target_ids, updates, indices, dims, reduce="mean")
        return
    if len(dims) != len(targets) or not len(target_ids) == len(updates) == len(indices):
        raise ValueError(f"aggregate_slices_: expected one dim per target and one target id, update and "
                         f"index list per segment, got {len(targets)} targets, {len(dims)} dims, "
                         f"{len(target_ids)} target ids, {len(updates)} updates, {len(indices)} index lists")
    for j, t in enumerate(target_ids):
        if not 0 <= t < len(targets):
            raise ValueError(f"aggregate_slices_: target_ids[{j}] = {t} is out of range: there are {len(targets)} targets")
    is_counter = set(counters)
    floating = [t for t in range(len(targets)) if t not in is_counter]
    renumber = {t: i for i, t in enumerate(floating)}
    float_segs = [j for j, t in enumerate(target_ids) if t in renumber]
    # the counters' new values first, out of place: a bad segment raises before anything is written
    maxima: Dict[int, Tensor] = {}
    for t in counters:
        segs = [j for j, u in enumerate(target_ids) if u == t]
        if segs:
            maxima[t] = _owner_max(t, targets[t], dims[t], [updates[j] for j in segs], [indices[j] for j in segs], segs)
    if floating:
        F.slice_scatter_([targets[t] for t in floating], [renumber[target_ids[j]] for j in float_segs],
                         [updates[j] for j in float_segs], [indices[j] for j in float_segs],
                         [dims[t] for t in floating], reduce="mean")
    for t, new in maxima.items():
        targets[t].copy_(new)


def _owner_max(t: int, target: Tensor, dim: int, updates: List[Tensor], indices: List[Tensor],
               segs: List[int]) -> Tensor:
    """``target`` with every owned slice replaced by the maximum over its owners' values."""
    who = "aggregate_slices_"
    if not -max(target.dim(), 1) <= dim < max(target.dim(), 1) or target.dim() == 0:
        raise ValueError(f"{who}: targets[{t}] needs >= 1 dimension and dims[{t}] in range, got shape "
                         f"{tuple(target.shape)} and dim {dim}")
    d = dim % target.dim()
    size = target.shape[d]
    for j, u, idx in zip(segs, updates, indices):
        want = list(target.shape)
        want[d] = idx.numel()
        if idx.dtype != torch.int64 or idx.dim() != 1:
            raise ValueError(f"{who}: indices[{j}] must be a 1-D int64 tensor, got {idx.dtype} of shape "
                             f"{tuple(idx.shape)}")
        if u.dtype != target.dtype or list(u.shape) != want:
            raise ValueError(f"{who}: updates[{j}] has dtype {u.dtype} and shape {list(u.shape)}; targets[{t}] "
                             f"sliced by indices[{j}] needs {target.dtype} and {want}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
            raise ValueError(f"{who}: indices[{j}] holds values outside [0, {size}) (dim {d} of targets[{t}])")
    src = torch.cat([u.to(target.device) for u in updates], d)
    idx = torch.cat([i.to(target.device) for i in indices])
    shape = [1] * target.dim()
    shape[d] = -1
    return target.scatter_reduce(d, idx.view(shape).expand_as(src), src, "amax", include_self=False)
