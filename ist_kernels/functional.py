"""Functional API over ``torch.ops.ist_kernels``: the entry points the modules and users call."""
from typing import Optional

import torch
from torch import Tensor

_ops = torch.ops.ist_kernels


def pack_gates(mask: Tensor) -> Tensor:
    """Pack a mask ``[..., F]`` (bool, or float where > 0 means on) into int32 words
    ``[..., ceil(F/32)]``; bit j of word w is feature 32w + j."""
    return _ops.pack_gates(mask)


def unpack_gates(words: Tensor, num_features: int) -> Tensor:
    """Inverse of :func:`pack_gates`: int32 words ``[..., W]`` -> bool ``[..., num_features]``."""
    return _ops.unpack_gates(words, num_features)


# ---- Multi-tensor slices (partitions: IST neurons, LOFT filters, ResIST blocks; the exchange)
from typing import List, Sequence  # noqa: E402

from .ops import slices as _slices  # noqa: E402


def slice_gather(sources: Sequence[Tensor], source_ids: Sequence[int], indices: Sequence[Tensor],
                 dims: Sequence[int]) -> Tensor:
    """Segment j = ``sources[source_ids[j]].index_select(dims[source_ids[j]], indices[j])``; all
    segments flattened (row-major) and concatenated into one 1-D buffer, in one launch.

    ``dims`` has one entry per source; ``source_ids`` and ``indices`` (int64, 1-D, no duplicates
    within a list) one per segment. All sources share one dtype and device (see
    :func:`gather_slices` for mixed dtypes). Differentiable with respect to the sources.
    """
    sources = list(sources)
    if not sources:  # the dispatcher needs a tensor; say what is wrong instead
        _slices.check_gather(sources, list(source_ids), list(indices), list(dims))
    return _ops.slice_gather(sources, list(source_ids), list(indices), list(dims))


def _dtype_groups(tensors: Sequence[Tensor]) -> dict:
    groups: dict = {}
    for t, x in enumerate(tensors):
        groups.setdefault(x.dtype, []).append(t)
    return groups


def _segment_group(ids: Sequence[int], members: Sequence[int]):
    """Segments whose tensor is in ``members`` and their tensor ids renumbered within the group."""
    local = {t: i for i, t in enumerate(members)}
    segs = [j for j, t in enumerate(ids) if t in local]
    return segs, [local[ids[j]] for j in segs]


def gather_slices(sources: Sequence[Tensor], source_ids: Sequence[int], indices: Sequence[Tensor],
                  dims: Sequence[int]) -> List[Tensor]:
    """Like :func:`slice_gather`, but returns the compact segments
    (``sources[source_ids[j]].index_select(dims[...], indices[j])``) as views of one flat buffer per
    dtype: mixed dtypes are grouped, one launch per dtype."""
    sources, source_ids, indices, dims = list(sources), list(source_ids), list(indices), list(dims)
    groups = _dtype_groups(sources)
    if len(groups) > 1:  # check the whole call first, so errors name the caller's positions
        d = _slices.check_gather(sources, source_ids, indices, dims, same_dtype=False)
        _slices.check_index_values("slice_gather", indices, [sources[s].shape[d[s]] for s in source_ids])
    out: List[Tensor] = [None] * len(indices)  # type: ignore[list-item]
    for members in groups.values():
        if len(groups) == 1:
            segs, ids = list(range(len(indices))), source_ids
        else:
            segs, ids = _segment_group(source_ids, members)
        srcs = [sources[t] for t in members]
        gdims = [dims[t] for t in members]
        flat = _ops.slice_gather(srcs, ids, [indices[j] for j in segs], gdims)
        views = _slices.split_segments(flat, [srcs[i].shape for i in ids],
                                       [gdims[i] % srcs[i].dim() for i in ids],
                                       [indices[j].shape[0] for j in segs])
        for j, v in zip(segs, views):
            out[j] = v
    return out


def slice_scatter_(targets: Sequence[Tensor], target_ids: Sequence[int], updates: Sequence[Tensor],
                   indices: Sequence[Tensor], dims: Sequence[int], reduce: str = "mean") -> None:
    """Write compact segments back into their targets, in place.

    Segment j (``updates[j]``: ``targets[target_ids[j]]`` with ``len(indices[j])`` slices along
    ``dims[target_ids[j]]``) owns the slices ``indices[j]`` of its target. ``reduce``: ``"copy"``
    (the last owning segment wins), ``"sum"`` (target + the owners' sum) or ``"mean"`` (the mean
    over the owners; owner counts come from the indices, never from the data). Slices no segment
    owns keep their value. Deterministic: owners are reduced in segment order, no atomics. Mixed
    dtypes are grouped, one launch per dtype, after the whole call is checked.
    """
    targets, target_ids, updates, indices, dims = (list(targets), list(target_ids), list(updates), list(indices),
                                                    list(dims))
    if not targets:  # nothing to write; segments without targets are an error
        if target_ids or updates or indices or dims:
            _slices.check_scatter(targets, target_ids, updates, indices, dims, reduce)
        return
    groups = _dtype_groups(targets)
    if len(groups) <= 1:
        _ops.slice_scatter_(targets, target_ids, updates, indices, dims, reduce)
        return
    # Several launches: check everything (index values and aliasing too) before the first one writes.
    d = _slices.check_scatter(targets, target_ids, updates, indices, dims, reduce, same_dtype=False)
    _slices.check_index_values("slice_scatter_", indices, [targets[t].shape[d[t]] for t in target_ids])
    _slices.check_no_alias("slice_scatter_", targets, target_ids, updates)
    for members in groups.values():
        segs, ids = _segment_group(target_ids, members)
        if segs:
            _ops.slice_scatter_([targets[t] for t in members], ids, [updates[j] for j in segs],
                                [indices[j] for j in segs], [dims[t] for t in members], reduce)


def owner_average_(target: Tensor, updates: Sequence[Tensor], indices: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Owner-averaged aggregation of one tensor (IST, paper 001 Algorithm 1), in place.

    ``indices[l]`` lists the slices of ``target`` along ``dim`` that the compact ``updates[l]``
    holds, in order. Every slice owned by k >= 1 updates becomes their mean; a slice no update owns
    keeps its value. Returns ``target``.
    """
    updates, indices = list(updates), list(indices)
    _ops.slice_scatter_([target], [0] * len(updates), updates, indices, [dim], "mean")
    return target
# ---- GReLU layers (paper 004 §2.1, §4.4)
def relu_gates(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The frozen gate layer of GReLU: ``out = relu(x Wᵀ + b)`` and ``gates = pack(x Wᵀ + b > 0)``
    (int32 ``[..., ceil(N/32)]``), from one kernel. No gradient: its backward raises."""
    return _ops.relu_gates(x, weight, bias)


def gated_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], gates: Tensor) -> Tensor:
    """A trained GReLU layer: ``y = (x Wᵀ + b) ⊙ unpack(gates)`` with 1-bit gates
    ``[..., ceil(N/32)]`` (e.g. from :func:`relu_gates`). Differentiable in x, weight and bias."""
    return _ops.gated_linear(x, weight, bias, gates)
def subnet_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, rows: Optional[Tensor] = None,
                  cols: Optional[Tensor] = None) -> Tensor:
    """The linear layer of one subnetwork of neurons (IST, paper 001 §3.1):
    ``y = x W[rows][:, cols]^T + b[rows]`` without materialising ``W[rows][:, cols]``.

    ``rows`` / ``cols`` are int64 index lists into ``weight``'s out / in features (unique, in any
    order; None = all). ``x`` is compact, ``[..., len(cols)]``; ``y`` is ``[..., len(rows)]``.
    Gradients: compact for ``x``; full-size for ``weight`` and ``bias``, zero outside rows x cols.
    """
    return _ops.subnet_linear(x, weight, bias, rows, cols)
