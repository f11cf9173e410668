"""Functional API over ``torch.ops.ist_kernels``: the entry points the modules and users call.

These names are the public API. The op schemas behind them (``torch.ops.ist_kernels.slice_gather``,
``slice_gather_into_``, ``slice_scatter_``, ...; csrc/ops.cpp) are the registration layer and keep
their names; call them only to reach an op directly (opcheck, custom compositions).

Conventions, as in ``torch.nn.functional``: a single-tensor function takes ``input`` first (the
multi-tensor slice functions take ``sources`` / ``targets``, the names their errors use); ``bias``
defaults to None; ``out`` is keyword-only; a trailing ``_`` writes in place. Shapes: ``N`` out
features, ``K`` in features, ``...`` any batch dims.

Deprecated aliases (kept for one release; they warn with a ``FutureWarning``):
``slice_gather`` (the flat gather: use :func:`gather_slices`, with ``out=`` for a flat buffer) and
``slice_scatter_`` (use :func:`scatter_slices_`).
"""
import functools
import warnings
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from .ops import _checks, slices as _slices

__all__ = [
    "pack_gates",
    "unpack_gates",
    "gather_slices",
    "scatter_slices_",
    "owner_average_",
    "relu_gates",
    "gated_linear",
    "subnet_linear",
    "GatherBuffers",
    "slice_plan",
    "PlannedSlices",
]

_ops = torch.ops.ist_kernels


def pack_gates(input: Tensor) -> Tensor:
    """Pack a mask into 1-bit gates.

    ``input``: ``[..., F]`` bool, or floating where ``> 0`` means on. Returns int32
    ``[..., ceil(F/32)]``; bit j of word w is feature 32w + j (padding bits zero)."""
    return _ops.pack_gates(input)


def unpack_gates(input: Tensor, num_features: int) -> Tensor:
    """Inverse of :func:`pack_gates`: int32 words ``[..., W]`` -> bool ``[..., num_features]``
    (``num_features <= 32 W``)."""
    return _ops.unpack_gates(input, num_features)


# ---- Multi-tensor slices (partitions: IST neurons, LOFT filters, ResIST blocks; the exchange)


def _gather_flat(sources: Sequence[Tensor], source_ids: Sequence[int], indices: Sequence[Tensor],
                 dims: Sequence[int], out: Optional[Tensor] = None) -> Tensor:
    """The gather as one flat buffer (all sources of one dtype): segment j flattened row-major,
    concatenated. ``out``: a contiguous 1-D buffer with exactly the gather's numel, written in place
    and returned (no allocation; not differentiable). The exchange packs its send buffer with it."""
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
        raise ValueError("gather_slices: out= is not differentiable, but a source requires grad; detach the "
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
                  dims: Sequence[int], *, out: Union[None, Tensor, "GatherBuffers"] = None) -> List[Tensor]:
    """Gather slices of many tensors, each along its own dim, in one launch per dtype.

    Args:
        sources: any shapes and dtypes, one device.
        source_ids: ``J`` ints, segment j reads ``sources[source_ids[j]]``.
        indices: ``J`` int64 1-D tensors, the slices of segment j (no duplicates within a list).
        dims: one dim per source (negative allowed).
        out: None (fresh buffers, differentiable with respect to the sources), a contiguous 1-D
            tensor (one dtype only; exactly the gather's numel; it then holds every segment
            flattened row-major and concatenated: the flat wire format), or a :class:`GatherBuffers`
            whose buffers are reused across calls where no result of an earlier call still views
            them. With ``out`` the gather is not differentiable.

    Returns:
        ``J`` tensors, segment j = ``sources[source_ids[j]].index_select(dims[source_ids[j]], indices[j])``
        (shape: the source's with ``len(indices[j])`` along that dim), views of one flat buffer
        per dtype.
    """
    sources, source_ids, indices, dims = list(sources), list(source_ids), list(indices), list(dims)
    if out is None and sources and all(s.dtype == sources[0].dtype for s in sources[1:]):
        # one dtype (the common case): one op, which validates everything (errors name the
        # caller's positions) and returns the segment views built in C++ (csrc/autograd.cpp)
        return list(_ops.slice_gather_segments(sources, source_ids, indices, dims))
    groups = _dtype_groups(sources)
    if out is not None:
        _check_out_no_grad(sources)
        if isinstance(out, Tensor) and len(groups) > 1:
            raise ValueError(f"gather_slices: out is one tensor but the sources have {len(groups)} dtypes; "
                             "pass a GatherBuffers holder (one buffer per dtype)")
        if not isinstance(out, (Tensor, GatherBuffers)):
            raise TypeError(f"gather_slices: out must be None, a Tensor or a GatherBuffers, got {type(out).__name__}")
    # Several dtypes (several launches): check first, so that errors name the caller's positions.
    # One dtype: the one launch checks everything in C++ and its errors already name the caller's
    # positions, so nothing is checked here twice (the Python checks cost more than the launch:
    # bench_slices "into a reused buffer", H200 2026-11-27).
    if len(groups) > 1 or not sources:
        d = _slices.check_gather(sources, source_ids, indices, dims, same_dtype=False)
    # Index values are checked by each launch (in C++, O(n)); a launch that fails has written only
    # buffers the caller never sees, and the whole call is then re-checked so that the error names
    # the caller's positions.
    try:
        return _gather_groups(sources, source_ids, indices, dims, out, groups)
    except (ValueError, IndexError, TypeError):
        if len(groups) > 1:
            _slices.check_index_values("slice_gather", indices, [sources[s].shape[d[s]] for s in source_ids],
                                       what=[f"sources[{s}] along dim {d[s]}" for s in source_ids])
        raise


def _gather_groups(sources, source_ids, indices, dims, out, groups) -> List[Tensor]:
    result: List[Tensor] = [None] * len(indices)  # type: ignore[list-item]
    for members in groups.values():
        if len(groups) == 1:  # the caller's lists as they are (the op checks them)
            segs, ids, srcs, gdims = range(len(indices)), source_ids, sources, dims
        else:
            segs, ids = _segment_group(source_ids, members)
            srcs = [sources[t] for t in members]
            gdims = [dims[t] for t in members]
        if out is None:
            for j, v in zip(segs, _ops.slice_gather_segments(srcs, ids, [indices[j] for j in segs], gdims)):
                result[j] = v
            continue
        idx = indices if len(groups) == 1 else [indices[j] for j in segs]
        try:  # the segments' shapes, once (for the buffer's size and the views)
            shapes, numels = _slices.segment_layout(srcs, ids, idx, gdims)
        except Exception:  # bad arguments (one dtype: not checked yet): raise what the checks say
            _slices.check_gather(srcs, ids, idx, gdims)
            raise
        flat = out if isinstance(out, Tensor) else out.take(sum(numels), srcs[0].dtype, srcs[0].device)
        _ops.slice_gather_into_(flat, srcs, ids, idx, gdims)
        views = _slices.segment_views(flat, shapes, numels)
        for j, v in zip(segs, views):
            result[j] = v
    return result


def scatter_slices_(targets: Sequence[Tensor], target_ids: Sequence[int], updates: Sequence[Tensor],
                    indices: Sequence[Tensor], dims: Sequence[int], reduce: str = "mean") -> None:
    """Write compact segments back into their tensors, in place (the inverse of :func:`gather_slices`).

    Args:
        targets: written in place (any shapes and dtypes, one device).
        target_ids: ``J`` ints, segment j writes ``targets[target_ids[j]]``.
        updates: ``J`` tensors, segment j shaped as its target with ``len(indices[j])`` slices
            along ``dims[target_ids[j]]``.
        indices: ``J`` int64 1-D tensors: segment j owns those slices of its target.
        dims: one dim per target.
        reduce: ``"copy"`` (the last owning segment wins), ``"sum"`` (target + the owners' sum)
            or ``"mean"`` (the mean over the owners; owner counts come from the indices, never
            from the data).

    Slices no segment owns keep their value. Deterministic: owners are reduced in segment order,
    no atomics. Mixed dtypes are grouped, one launch per dtype, after the whole call is checked.
    Not differentiable.
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


def owner_average_(input: Tensor, updates: Sequence[Tensor], indices: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Owner-averaged aggregation of one tensor (IST, paper 001 Algorithm 1), in place.

    ``indices[l]`` (int64 ``[n_l]``) lists the slices of ``input`` along ``dim`` that the compact
    ``updates[l]`` (``input``'s shape with ``n_l`` along ``dim``) holds, in order. Every slice owned
    by k >= 1 updates becomes their mean; a slice no update owns keeps its value. Returns ``input``.
    """
    updates, indices = list(updates), list(indices)
    _checks.check_index(-input.dim() <= dim < input.dim(), "owner_average_",
                        f"dim = {dim} is out of range for input with {input.dim()} dimensions")
    _ops.slice_scatter_([input], [0] * len(updates), updates, indices, [dim], "mean")
    return input


PlannedSlices = _slices.PlannedSlices


def slice_plan(tensors: Sequence[Tensor], ids: Sequence[int], indices: Sequence[Tensor],
               dims: Sequence[int]) -> "PlannedSlices":
    """Plan a round's slices once: segment j is ``tensors[ids[j]]`` along ``dims[ids[j]]`` at
    ``indices[j]`` (arguments as :func:`gather_slices` takes them). Everything is validated here,
    index values included; the returned :class:`PlannedSlices` then gathers (``plan.gather(tensors)``)
    and scatters (``plan.scatter_(tensors, parts, reduce="mean")``) with only the cheap per-call
    checks (the tensors' count, dtypes, device and shapes match the plan), one launch per dtype."""
    return _slices.PlannedSlices(tensors, ids, indices, dims)


# ---- GReLU layers (paper 004 §2.1, §4.4)
def relu_gates(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The frozen gate layer of GReLU, from one kernel.

    ``input`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None. Returns
    ``out = relu(input Wᵀ + b)`` ``[..., N]`` and ``gates = pack(input Wᵀ + b > 0)`` int32
    ``[..., ceil(N/32)]``. No gradient: its backward raises."""
    return _ops.relu_gates(input, weight, bias)


def gated_linear(input: Tensor, weight: Tensor, gates: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """A trained GReLU layer (paper 004 §2.1): ``y = (input Wᵀ + b) ⊙ unpack(gates)``.

    ``input`` ``[..., K]``, ``weight`` ``[N, K]``, ``gates`` int32 ``[..., ceil(N/32)]`` (1 bit per
    output feature, e.g. from :func:`relu_gates`), ``bias`` ``[N]`` or None. Returns ``[..., N]``.
    Differentiable in input, weight and bias.

    The order was formerly ``(x, weight, bias, gates)``; that call (an int32 tensor where the
    bias goes) still works for one release, with a ``FutureWarning``."""
    if isinstance(bias, Tensor) and bias.dtype == torch.int32 and (gates is None or gates.dtype != torch.int32):
        warnings.warn("gated_linear(x, weight, bias, gates) is deprecated: the order is now "
                      "gated_linear(input, weight, gates, bias=None)", FutureWarning, stacklevel=2)
        gates, bias = bias, gates
    return _ops.gated_linear(input, weight, bias, gates)


def subnet_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, rows: Optional[Tensor] = None,
                  cols: Optional[Tensor] = None) -> Tensor:
    """The linear layer of one subnetwork of neurons (IST, paper 001 §3.1):
    ``y = input W[rows][:, cols]ᵀ + b[rows]`` without materialising ``W[rows][:, cols]``.

    ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None; ``rows`` / ``cols`` are int64 index lists into
    the out / in features (unique, in any order; None = all). ``input`` is compact,
    ``[..., len(cols)]``; the result is ``[..., len(rows)]``. Gradients: compact for ``input``;
    full-size for ``weight`` and ``bias``, zero outside rows x cols.
    """
    return _ops.subnet_linear(input, weight, bias, rows, cols)


# ---- Reusable gather buffers (the op slice_gather_into_): no fresh allocation, no fresh pages per round
class GatherBuffers:
    """Flat output buffers for :func:`gather_slices`, kept per dtype and
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


# ---- Deprecated aliases (one release)
def _deprecated(old: str, new: str, fn):
    @functools.wraps(fn)
    def alias(*args, **kwargs):
        warnings.warn(f"ist_kernels.functional.{old} is deprecated and will be removed in the next release; "
                      f"use {new}", FutureWarning, stacklevel=2)
        return fn(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated alias: use :func:`{new.split('(')[0]}`.\n\n" + (fn.__doc__ or "")
    return alias


slice_gather = _deprecated("slice_gather", "gather_slices (segments; out= a flat buffer for the flat form)",
                           _gather_flat)
slice_scatter_ = _deprecated("slice_scatter_", "scatter_slices_", scatter_slices_)
