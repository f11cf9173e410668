"""Owner aggregation: how slices held by several subnetworks are written back into the global
model. One place for both launch modes: :meth:`SubnetworkPlan.aggregate` (simulated) and the
distributed :class:`ist_kernels.distributed.Exchange` (its unpack) call :func:`aggregate_slices_`.
"""
from typing import Dict, List, Sequence

import torch
from torch import Tensor

from .. import functional as F
from ..ops._checks import check, check_index, check_type

WHO = "aggregate_slices_"


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

    Slices no segment owns keep their value. Everything is checked before anything is written;
    errors follow the ops' policy (``ist_kernels.ops._checks``: IndexError out of range, TypeError
    for a dtype, ValueError otherwise).
    """
    targets, target_ids, updates = list(targets), list(target_ids), list(updates)
    indices, dims = list(indices), list(dims)
    counters = [t for t, x in enumerate(targets) if not (x.is_floating_point() or x.is_complex())]
    if not counters:
        F.slice_scatter_(targets, target_ids, updates, indices, dims, reduce="mean")
        return
    check(len(dims) == len(targets) and len(target_ids) == len(updates) == len(indices), WHO,
          f"expected one dim per target and one target id, update and index list per segment, got "
          f"{len(targets)} targets, {len(dims)} dims, {len(target_ids)} target ids, {len(updates)} updates, "
          f"{len(indices)} index lists")
    for j, t in enumerate(target_ids):
        check_index(0 <= t < len(targets), WHO, f"target_ids[{j}] = {t} is out of range: there are "
                    f"{len(targets)} targets")
    is_counter = set(counters)
    floating = [t for t in range(len(targets)) if t not in is_counter]
    renumber = {t: i for i, t in enumerate(floating)}
    float_segs = [j for j, t in enumerate(target_ids) if t in renumber]
    # the counters' new values first, out of place: a bad segment raises before anything is written
    maxima: Dict[int, Tensor] = {}
    for t in counters:
        segs = [j for j, u in enumerate(target_ids) if u == t]
        if segs:
            maxima[t] = _owner_max(t, targets[t], dims[t], [updates[j] for j in segs],
                                   [indices[j] for j in segs], segs)
    if floating:
        F.slice_scatter_([targets[t] for t in floating], [renumber[target_ids[j]] for j in float_segs],
                         [updates[j] for j in float_segs], [indices[j] for j in float_segs],
                         [dims[t] for t in floating], reduce="mean")
    for t, new in maxima.items():
        targets[t].copy_(new)


def _owner_max(t: int, target: Tensor, dim: int, updates: List[Tensor], indices: List[Tensor],
               segs: List[int]) -> Tensor:
    """``target`` with every owned slice replaced by the maximum over its owners' values."""
    check_index(target.dim() >= 1 and -target.dim() <= dim < target.dim(), WHO,
                f"dims[{t}] = {dim} is out of range for targets[{t}] of shape {list(target.shape)}")
    d = dim % target.dim()
    size = target.shape[d]
    for j, u, idx in zip(segs, updates, indices):
        want = list(target.shape)
        want[d] = idx.numel()
        check_type(idx.dtype == torch.int64, WHO, f"indices[{j}] must be int64, got {idx.dtype}")
        check(idx.dim() == 1, WHO, f"indices[{j}] must be 1-D, got shape {list(idx.shape)}")
        check_type(u.dtype == target.dtype, WHO, f"updates[{j}] has dtype {u.dtype} but targets[{t}] has "
                   f"{target.dtype}")
        check(list(u.shape) == want, WHO, f"updates[{j}] has shape {list(u.shape)} but targets[{t}] sliced "
              f"along dim {d} by indices[{j}] needs {want}")
        check_index(idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < size), WHO,
                    f"indices[{j}] holds values outside [0, {size}) (dim {d} of targets[{t}])")
    src = torch.cat([u.to(target.device) for u in updates], d)
    idx = torch.cat([i.to(target.device) for i in indices])
    shape = [1] * target.dim()
    shape[d] = -1
    return target.scatter_reduce(d, idx.view(shape).expand_as(src), src, "amax", include_self=False)
