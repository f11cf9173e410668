"""Functional API over ``torch.ops.ist_kernels``: the entry points the modules and users call."""
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .ops import _checks
from .ops import slices as _slices

_ops = torch.ops.ist_kernels


def pack_gates(mask: Tensor) -> Tensor:
    """Pack a mask ``[..., F]`` (bool, or float where > 0 means on) into int32 words
    ``[..., ceil(F/32)]``; bit j of word w is feature 32w + j."""
    return _ops.pack_gates(mask)


def unpack_gates(words: Tensor, num_features: int) -> Tensor:
    """Inverse of :func:`pack_gates`: int32 words ``[..., W]`` -> bool ``[..., num_features]``."""
    return _ops.unpack_gates(words, num_features)


# ---- Multi-tensor slices (partitions: IST neurons, LOFT filters, ResIST blocks; the exchange)


def slice_gather(sources: Sequence[Tensor], source_ids: Sequence[int], indices: Sequence[Tensor],
                 dims: Sequence[int], out: Optional[Tensor] = None) -> Tensor:
    """Segment j = ``sources[source_ids[j]].index_select(dims[source_ids[j]], indices[j])``; all
    segments flattened (row-major) and concatenated into one 1-D buffer, in one launch.

    ``dims`` has one entry per source; ``source_ids`` and ``indices`` (int64, 1-D, no duplicates
    within a list) one per segment. All sources share one dtype and device (see
    :func:`gather_slices` for mixed dtypes). Differentiable with respect to the sources.

    ``out``: a contiguous 1-D buffer of the sources' dtype and device with exactly the gather's
    numel, written in place and returned (no allocation; not differentiable).
    """
    sources = list(sources)
    if not sources:  # the dispatcher needs a tensor; say what is wrong instead
        _slices.check_gather(sources, list(source_ids), list(indices), list(dims))
    if out is None:
        return _ops.slice_gather(sources, list(source_ids), list(indices), list(dims))
    _check_out_no_grad(sources)
    _ops.slice_gather_into_(out, sources, list(source_ids), list(indices), list(dims))
    return out


def _check_out_no_grad(sources: Sequence[Tensor]) -> None:
    if torch.is_grad_enabled() and any(s.requires_grad for s in sources):
        raise ValueError("slice_gather: out= is not differentiable, but a source requires grad; detach the "
                         "sources, run under torch.no_grad(), or leave out unset")


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
                  dims: Sequence[int], out=None) -> List[Tensor]:
    """Like :func:`slice_gather`, but returns the compact segments
    (``sources[source_ids[j]].index_select(dims[...], indices[j])``) as views of one flat buffer per
    dtype: mixed dtypes are grouped, one launch per dtype.

    ``out``: None (fresh buffers), a flat tensor (one dtype only; exactly the gather's numel), or a
    :class:`GatherBuffers` holder whose buffers are reused across calls where no result of an
    earlier call still views them. With ``out`` the gather is not differentiable."""
    sources, source_ids, indices, dims = list(sources), list(source_ids), list(indices), list(dims)
    groups = _dtype_groups(sources)
    if out is not None:
        _check_out_no_grad(sources)
        if isinstance(out, Tensor) and len(groups) > 1:
            raise ValueError(f"gather_slices: out is one tensor but the sources have {len(groups)} dtypes; "
                             "pass a GatherBuffers holder (one buffer per dtype)")
        if not isinstance(out, (Tensor, GatherBuffers)):
            raise TypeError(f"gather_slices: out must be None, a Tensor or a GatherBuffers, got {type(out).__name__}")
    if len(groups) > 1 or isinstance(out, GatherBuffers):  # check first: errors name the caller's positions
        d = _slices.check_gather(sources, source_ids, indices, dims, same_dtype=False)
    # Index values are checked by each launch (in C++, O(n)); a launch that fails has written only
    # buffers the caller never sees, and the whole call is then re-checked so that the error names
    # the caller's positions.
    try:
        return _gather_groups(sources, source_ids, indices, dims, out, groups)
    except (ValueError, IndexError, TypeError):
        if len(groups) > 1 or isinstance(out, GatherBuffers):
            _slices.check_index_values("slice_gather", indices, [sources[s].shape[d[s]] for s in source_ids],
                                       what=[f"sources[{s}] along dim {d[s]}" for s in source_ids])
        raise


def _gather_groups(sources, source_ids, indices, dims, out, groups) -> List[Tensor]:
    result: List[Tensor] = [None] * len(indices)  # type: ignore[list-item]
    for members in groups.values():
        if len(groups) == 1:
            segs, ids = list(range(len(indices))), source_ids
        else:
            segs, ids = _segment_group(source_ids, members)
        srcs = [sources[t] for t in members]
        gdims = [dims[t] for t in members]
        if out is None:
            flat = _ops.slice_gather(srcs, ids, [indices[j] for j in segs], gdims)
        else:
            if isinstance(out, Tensor):
                flat = out
            else:
                numel = _slices.gather_numel(srcs, ids, [indices[j] for j in segs],
                                             [gdims[i] % srcs[i].dim() for i in range(len(srcs))])
                flat = out.take(numel, srcs[0].dtype, srcs[0].device)
            _ops.slice_gather_into_(flat, srcs, ids, [indices[j] for j in segs], gdims)
        views = _slices.split_segments(flat, [srcs[i].shape for i in ids],
                                       [gdims[i] % srcs[i].dim() for i in ids],
                                       [indices[j].shape[0] for j in segs])
        for j, v in zip(segs, views):
            result[j] = v
    return result


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
    # Several launches: nothing may be written unless the whole call is valid, and errors name the
    # caller's positions. Everything but the index values of the first launch is checked here, for
    # all segments, before any launch: shapes, dtypes, devices, ids, dims, aliasing (index lists
    # included, so no launch writes a list a later one reads) and the index values of the later
    # launches. The first launch is the group with the most indices (the costly part): its kernel
    # checks its own values before writing anything, and if that fails, the values of the whole call
    # are checked here to name the caller's position.
    d = _slices.check_scatter(targets, target_ids, updates, indices, dims, reduce, same_dtype=False)
    _slices.check_no_alias("slice_scatter_", targets, target_ids, updates, indices)
    launches = []
    for members in groups.values():
        segs, ids = _segment_group(target_ids, members)
        if segs:
            launches.append((members, segs, ids))
    launches.sort(key=lambda g: -sum(indices[j].numel() for j in g[1]))

    def check_values(segs):
        _slices.check_index_values("slice_scatter_", [indices[j] for j in segs],
                                   [targets[target_ids[j]].shape[d[target_ids[j]]] for j in segs], positions=segs,
                                   what=[f"targets[{target_ids[j]}] along dim {d[target_ids[j]]}" for j in segs])

    check_values([j for _, segs, _ in launches[1:] for j in segs])
    for k, (members, segs, ids) in enumerate(launches):
        try:
            _ops.slice_scatter_([targets[t] for t in members], ids, [updates[j] for j in segs],
                                [indices[j] for j in segs], [dims[t] for t in members], reduce)
        except (ValueError, IndexError, TypeError):
            if k == 0:  # nothing written yet
                check_values(segs)
            raise


def owner_average_(target: Tensor, updates: Sequence[Tensor], indices: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Owner-averaged aggregation of one tensor (IST, paper 001 Algorithm 1), in place.

    ``indices[l]`` lists the slices of ``target`` along ``dim`` that the compact ``updates[l]``
    holds, in order. Every slice owned by k >= 1 updates becomes their mean; a slice no update owns
    keeps its value. Returns ``target``.
    """
    updates, indices = list(updates), list(indices)
    _checks.check_index(-target.dim() <= dim < target.dim(), "owner_average_",
                        f"dim = {dim} is out of range for target with {target.dim()} dimensions")
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


# ---- Reusable gather buffers (slice_gather_into_): no fresh allocation, no fresh pages per round
class GatherBuffers:
    """Flat output buffers for :func:`gather_slices` / :func:`slice_gather`, kept per dtype and
    device and reused across calls.

    A buffer is handed out again only when nothing else references its memory: no view, parameter,
    optimizer state or other tensor made from an earlier result is alive (the reference count of
    its storage is back to the holder's own). So a result still in use is never overwritten; while
    one is, the next call takes another buffer (at most ``capacity`` are kept per dtype and device;
    beyond that a fresh, untracked one is allocated, as without a holder). A free buffer at least
    as large as needed is reused (its first elements). ``clear()`` drops every kept buffer.
    """

    def __init__(self, capacity: int = 2):
        if capacity < 1:
            raise ValueError(f"GatherBuffers: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._pools: dict = {}  # (dtype, device) -> [[buffer, storage handle, own reference count]]
        self.reused = 0  # calls served from a kept buffer (for tests and benchmarks)

    @staticmethod
    def _count(handle: int) -> int:
        return torch._C._storage_Use_Count(handle)

    def take(self, numel: int, dtype: torch.dtype, device) -> Tensor:
        """A contiguous 1-D buffer of ``numel`` elements that no live tensor shares."""
        device = torch.device(device)
        if not hasattr(torch._C, "_storage_Use_Count"):  # cannot tell when a buffer is free: never reuse
            return torch.empty(numel, dtype=dtype, device=device)
        pool = self._pools.setdefault((dtype, device), [])
        free = [e for e in pool if self._count(e[1]) == e[2]]
        fits = [e for e in free if e[0].numel() >= numel]
        if fits:
            self.reused += 1
            return min(fits, key=lambda e: e[0].numel())[0][:numel]
        if free:  # too small: replace the largest free one
            drop = max(free, key=lambda e: e[0].numel())
            pool[:] = [e for e in pool if e is not drop]
        elif len(pool) >= self.capacity:
            return torch.empty(numel, dtype=dtype, device=device)
        buf = torch.empty(numel, dtype=dtype, device=device)
        handle = buf.untyped_storage()._cdata
        pool.append([buf, handle, self._count(handle)])
        return buf[:numel]

    def clear(self) -> None:
        self._pools.clear()

    @property
    def nbytes(self) -> int:
        """Bytes the kept buffers hold."""
        return sum(e[0].numel() * e[0].element_size() for pool in self._pools.values() for e in pool)
