"""slice_gather / slice_scatter_: many tensors, each sliced along its own dim by index lists.

Segment j of a gather is ``sources[source_ids[j]].index_select(dims[source_ids[j]], indices[j])``;
all segments, flattened, make one 1-D buffer. A scatter writes compact segments back into their
targets with reduce = copy / sum / mean over the owners (csrc/ops.cpp has the schemas,
csrc/common/slices.h the math). The fake kernels check what can be checked without reading data
(list lengths, dtypes, devices, dims, shapes); the kernels also check the index values.
"""
import math
from typing import List, Optional, Sequence

import torch

from .._checks import byte_range, check, check_index, check_type, fail, memory_overlap, overlap_words
from .product import (
    check_product,
    gather_product,
    is_product,
    overlaps,
    product_shape,
    scatter_products_,
    wrap_pair,
)

REDUCES = ("copy", "sum", "mean")
MAX_SLICES = (1 << 31) - 1  # slices along one dim the kernels support (csrc/common/slices.h kFastDivMax)
# dtypes the sum / mean reductions support (copy moves any dtype)
REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
             torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def wrap_dims(op: str, tensors: Sequence[torch.Tensor], dims: Sequence[int], name: str,
              same_dtype: bool = True) -> List[int]:
    """One dim per tensor, wrapped; one device (and unless told otherwise one dtype) for all tensors.

    Per-tensor checks test first and build a message only on failure (``fail``): these run once
    per tensor and per segment on every call of the Python paths (GatherBuffers, mixed dtypes,
    fake kernels), where formatting a message per check cost more than the launch."""
    if len(tensors) == 0:
        fail(op, f"{name} is empty; give at least one tensor")
    if len(dims) != len(tensors):
        fail(op, f"dims must have one entry per {name} ({len(tensors)}), got {len(dims)}")
    dtype0, device0 = tensors[0].dtype, tensors[0].device
    out = []
    for t, (x, d) in enumerate(zip(tensors, dims)):
        if same_dtype and x.dtype != dtype0:
            fail(op, f"{name}[{t}] has dtype {x.dtype} but {name}[0] has {dtype0}; all {name} must share one "
                 "dtype (the functional wrappers group mixed dtypes)", TypeError)
        if x.device != device0:
            fail(op, f"{name}[{t}] is on {x.device} but {name}[0] is on {device0}; all tensors must be on one device")
        nd = x.dim()
        if nd < 1:
            fail(op, f"{name}[{t}] is 0-d; a sliced tensor needs at least 1 dimension")
        if not -nd <= d < nd:
            fail(op, f"dims[{t}] = {d} is out of range for {name}[{t}] with {nd} dimensions", IndexError)
        w = d % nd
        out.append(w)
        if x.shape[w] > MAX_SLICES:
            fail(op, f"{name}[{t}] has {x.shape[w]} slices along dim {w}; at most 2^31 - 1 are supported")
    return out


def check_ids(op: str, ids: Sequence[int], count: int, ids_name: str, name: str) -> None:
    for j, i in enumerate(ids):
        if not 0 <= i < count:
            fail(op, f"{ids_name}[{j}] = {i} is out of range: there are {count} {name}", IndexError)


def check_index_lists(op: str, indices: Sequence[torch.Tensor], device: torch.device) -> None:
    for j, idx in enumerate(indices):
        if idx.dtype != torch.int64:
            fail(op, f"indices[{j}] must be int64, got {idx.dtype}", TypeError)
        if idx.dim() != 1:
            fail(op, f"indices[{j}] must be 1-D, got {idx.dim()} dimensions")
        if idx.device.type != "cpu" and idx.device != device:
            fail(op, f"indices[{j}] is on {idx.device} but the tensors are on {device}; index lists must be on the "
                 "CPU" + ("" if torch.device(device).type == "cpu" else " or on the tensors' device"))


def segment_shape(shape: Sequence[int], dim: int, n: int) -> List[int]:
    out = list(shape)
    out[dim] = n
    return out


def check_gather(sources, source_ids, indices, dims, same_dtype: bool = True) -> List[int]:
    op = "slice_gather"
    if len(source_ids) != len(indices):
        fail(op, f"source_ids and indices must have one entry per segment, got {len(source_ids)} and {len(indices)}")
    d = wrap_dims(op, sources, dims, "sources", same_dtype)
    check_ids(op, source_ids, len(sources), "source_ids", "sources")
    check_index_lists(op, indices, sources[0].device)
    return d


def check_scatter(targets, target_ids, updates, indices, dims, reduce, same_dtype: bool = True) -> List[int]:
    op = "slice_scatter_"
    if not len(target_ids) == len(updates) == len(indices):
        fail(op, "target_ids, updates and indices must have one entry per segment, got "
             f"{len(target_ids)}, {len(updates)} and {len(indices)}")
    if reduce not in REDUCES:
        fail(op, f'reduce must be "copy", "sum" or "mean", got "{reduce}"')
    d = wrap_dims(op, targets, dims, "targets", same_dtype)
    device = targets[0].device
    for x in targets:
        if reduce != "copy" and x.dtype not in REDUCIBLE:
            fail(op, f'reduce="{reduce}" needs a floating or integer dtype, got {x.dtype}; use reduce="copy"', TypeError)
    check_ids(op, target_ids, len(targets), "target_ids", "targets")
    check_index_lists(op, indices, device)
    for j, (t, u, idx) in enumerate(zip(target_ids, updates, indices)):
        if u.dtype != targets[t].dtype:
            fail(op, f"updates[{j}] has dtype {u.dtype} but targets[{t}] has {targets[t].dtype}", TypeError)
        if u.device != device:
            fail(op, f"updates[{j}] is on {u.device} but targets are on {device}")
        want = segment_shape(targets[t].shape, d[t], idx.shape[0])
        if list(u.shape) != want:
            fail(op, f"updates[{j}] has shape {list(u.shape)} but targets[{t}] {list(targets[t].shape)} sliced along "
                 f"dim {d[t]} by indices[{j}] ({idx.shape[0]} slices) needs {want}")
    return d


@torch.library.register_fake("ist_kernels::slice_gather")
def _slice_gather_fake(sources, source_ids, indices, dims):
    d = check_gather(sources, source_ids, indices, dims)
    total = 0
    for s, idx in zip(source_ids, indices):
        shape = segment_shape(sources[s].shape, d[s], idx.shape[0])
        n = 1
        for x in shape:
            n = n * x
        total = total + n
    return sources[0].new_empty((total,))


def gather_numel(sources, source_ids, indices, dims) -> int:
    """Elements of the gather's flat output (dims already wrapped)."""
    total = 0
    for s, idx in zip(source_ids, indices):
        n = idx.shape[0]
        for k, x in enumerate(sources[s].shape):
            if k != dims[s]:
                n = n * x
        total = total + n
    return total


def check_gather_out(out, sources, source_ids, indices, dims) -> None:
    """The caller's buffer of slice_gather_into_: contiguous, 1-D, the sources' dtype and device,
    exactly the gather's numel (the kernel also checks that it shares no memory with a source or an
    index list)."""
    op = "slice_gather_into_"
    d = check_gather(sources, source_ids, indices, dims)
    check_type(out.dtype == sources[0].dtype, op, f"out has dtype {out.dtype} but the sources have {sources[0].dtype}")
    check(out.device == sources[0].device, op, f"out is on {out.device} but the sources are on {sources[0].device}")
    total = gather_numel(sources, source_ids, indices, d)
    check(out.dim() == 1 and out.shape[0] == total, op,
          f"out must be 1-D with {total} elements (every segment, flattened), got shape {list(out.shape)}")
    check(out.is_contiguous(), op, f"out must be contiguous (a flat buffer), got strides {list(out.stride())}")


@torch.library.register_fake("ist_kernels::slice_gather_into_")
def _slice_gather_into_fake(out, sources, source_ids, indices, dims):
    check_gather_out(out, sources, source_ids, indices, dims)
    return None


@torch.library.register_fake("ist_kernels::slice_scatter_")
def _slice_scatter_fake(targets, target_ids, updates, indices, dims, reduce):
    check_scatter(targets, target_ids, updates, indices, dims, reduce)
    return None


# ---- autograd of the gather: in C++ (csrc/autograd.cpp, the Autograd key): the gradient of a
# source is the sum of its segments' gradients scattered back (reduce="sum" into zeros), one
# launch for all sources. slice_gather_segments (the gather viewed as its segments) is composite,
# also in csrc/autograd.cpp.


def split_segments(flat: torch.Tensor, shapes, dims, lengths) -> List[torch.Tensor]:
    """Views of a flat gather buffer as the compact segment tensors (one split; a 1-D segment is
    its split piece as is, only the others take a ``view``)."""
    shapes = [segment_shape(shape, d, n) for shape, d, n in zip(shapes, dims, lengths)]
    if not shapes:
        return []
    numels = []
    for shape in shapes:
        n = 1
        for x in shape:
            n = n * x
        numels.append(n)
    return [part if len(shape) == 1 else part.view(shape) for part, shape in zip(torch.split(flat, numels), shapes)]


def segment_layout(sources, source_ids, indices, dims):
    """(shapes, numels) of a gather's segments: segment j has its source's shape with
    ``len(indices[j])`` along its dim (``dims`` per source, wrapped here). One pass, no checks:
    bad arguments raise whatever Python raises (the callers then run the checks)."""
    wrapped = [d % s.dim() for s, d in zip(sources, dims)]
    shapes, numels = [], []
    for s, idx in zip(source_ids, indices):
        shape = list(sources[s].shape)
        shape[wrapped[s]] = idx.shape[0]
        shapes.append(shape)
        numels.append(math.prod(shape))
    return shapes, numels


def segment_views(flat: torch.Tensor, shapes, numels) -> List[torch.Tensor]:
    """Views of a flat gather buffer as segments of ``shapes`` (``numels`` elements each): one
    split, and a ``view`` only for the segments that are not 1-D."""
    if not shapes:
        return []
    return [part if len(shape) == 1 else part.view(shape) for part, shape in zip(flat.split_with_sizes(numels), shapes)]


def check_index_values(op: str, indices: Sequence[torch.Tensor], sizes: Sequence[int],
                       positions: Optional[Sequence[int]] = None, what: Optional[Sequence[str]] = None) -> None:
    """Range and duplicate checks of index lists at once (a few vectorised ops, one sync): IndexError
    for an entry out of range, ValueError for a repeat, as the kernels (csrc/slices_plan.h).

    Used where one call is split into several kernel launches (mixed dtypes), so that bad input is
    rejected before the first launch writes anything; a single launch checks in C++.
    ``positions``: the caller's segment number of each list (messages name those); ``what``: the
    sliced dimension of each list, as in the kernels' messages ("targets[2] along dim 1").
    """
    if not indices:
        return
    pos = list(positions) if positions is not None else list(range(len(indices)))
    what = list(what) if what is not None else ["a dimension"] * len(indices)

    def out_of_range(j, k, v, size):
        check_index(False, op, f"indices[{pos[j]}][{k}] = {v} is out of range for {what[j]} of size {size}")

    def repeat(j, k, v, first):
        name = f"indices[{pos[j]}]"
        check(False, op, f"{name} must not repeat an index, but {name}[{k}] = {v} repeats {name}[{first}]; "
              "a segment holds each slice at most once")

    lengths = [i.shape[0] for i in indices]
    if sum(lengths) <= 4096:  # a few lists (e.g. BN counters): plain Python beats launching tensor ops
        for j, (idx, size) in enumerate(zip(indices, sizes)):
            seen = {}
            for k, v in enumerate(idx.tolist()):
                if not 0 <= v < size:
                    out_of_range(j, k, v, size)
                if v in seen:
                    repeat(j, k, v, seen[v])
                seen[v] = k
        return
    lengths = torch.tensor(lengths)
    flat = torch.cat([i.cpu() for i in indices])
    size = torch.repeat_interleave(torch.tensor(list(sizes), dtype=torch.int64), lengths)
    seg = torch.repeat_interleave(torch.arange(len(indices)), lengths)
    bad = ((flat < 0) | (flat >= size)).nonzero()
    if bad.numel():
        e = int(bad[0])
        j = int(seg[e])
        out_of_range(j, e - int(lengths[:j].sum()), int(flat[e]), int(size[e]))
    base = torch.cumsum(torch.tensor([0] + list(sizes[:-1]), dtype=torch.int64), 0)
    key = base.repeat_interleave(lengths) + flat
    if torch.unique(key).numel() != key.numel():
        for j, idx in enumerate(indices):
            idx = idx.cpu()
            for p in range(1, idx.numel()):
                earlier = (idx[:p] == idx[p]).nonzero()
                if earlier.numel():
                    repeat(j, p, int(idx[p]), int(earlier[0]))


def check_no_alias(op: str, targets, target_ids, updates, indices) -> None:
    """No written target may have elements that share memory, nor share memory with another target,
    an update or an index list (ValueError). The C++ kernels check the same per launch
    (ScatterPlan::check_no_overlap); this runs where one call is split into several launches, so
    that no launch writes what a later one reads."""
    spans = []  # (begin, end, kind, position); kind 0 = target
    names = ("targets", "updates", "indices")
    for t in sorted(set(target_ids)):
        x = targets[t]
        if x.numel() == 0 or x.device.type == "meta":
            continue
        check(torch._debug_has_internal_overlap(x) != 1, op,
              f"targets[{t}] has elements that share memory (an expanded view?); it cannot be written in place")
        spans.append((*byte_range(x), 0, t))
    for kind, tensors in ((1, updates), (2, indices)):
        spans += [(*byte_range(x), kind, j) for j, x in enumerate(tensors) if x.numel() and x.device.type != "meta"]
    spans.sort()
    for a in range(len(spans)):
        for b in range(a + 1, len(spans)):
            if spans[b][0] >= spans[a][1]:
                break
            if spans[a][2] and spans[b][2]:
                continue
            t, o = (spans[a], spans[b]) if spans[a][2] == 0 else (spans[b], spans[a])
            shared = memory_overlap(targets[t[3]], (targets, updates, indices)[o[2]][o[3]])
            if shared is False:
                continue
            check(False, op, f"targets[{t[3]}]{overlap_words(shared)}{names[o[2]]}[{o[3]}]; targets are written in "
                  "place and must not alias another target, an update or an index list")


# ---- A round's plan (slice_plan / slice_plan_gather_ / slice_plan_scatter_): validated once, reused
# by every gather and scatter of the round with only the cheap per-call checks.
@torch.library.register_fake("ist_kernels::slice_plan_gather_")
def _slice_plan_gather_fake(out, sources, plan, cache):
    return None


@torch.library.register_fake("ist_kernels::slice_plan_scatter_")
def _slice_plan_scatter_fake(targets, updates, plan, reduce, cache):
    check(reduce in REDUCES, "slice_plan_scatter_", f'reduce must be "copy", "sum" or "mean", got "{reduce}"')
    return None


RECORD_BYTES = 256  # an upper bound of one CUDA record (GatherSegment, ScatterTarget, ScatterSegment; slices.cuh)


class _Group:
    """The plan of the tensors of one dtype: the op's metadata, the flat gather buffer and its
    segment views, and on CUDA the device records' caches."""
    __slots__ = ("members", "segs", "meta", "buffer", "views", "gather_cache", "scatter_cache", "shapes")

    def __init__(self, members, segs, meta, buffer, views, shapes, gather_bytes, scatter_bytes):
        self.members, self.segs, self.meta, self.buffer, self.views = members, segs, meta, buffer, views
        self.shapes = shapes  # expected update shapes of the group's segments
        # CUDA: [host copy, device copy] of the launch records, allocated by the first gather /
        # scatter (a plan that only gathers holds no scatter records); none on the CPU.
        self.gather_cache = [] if buffer.device.type != "cuda" else gather_bytes
        self.scatter_cache = [] if buffer.device.type != "cuda" else scatter_bytes

    def cache(self, kind: str) -> list:
        c = getattr(self, kind)
        if isinstance(c, int):
            c = [torch.zeros(c, dtype=torch.uint8), torch.empty(c, dtype=torch.uint8, device=self.buffer.device)]
            setattr(self, kind, c)
        return c


class PlannedSlices:
    """One round's slice gather and scatter, planned once (``ist_kernels.functional.slice_plan``).

    Built from the round's ``tensors`` (any shapes and dtypes, one device), ``ids``, ``indices`` and
    ``dims`` as :func:`~ist_kernels.functional.gather_slices` takes them; everything is validated at
    build (errors name the argument), index lists included, and the index metadata is laid out once
    (csrc/slices_plan.h; one int64 host tensor per dtype, and on CUDA one device copy of the launch
    records, uploaded by the first call). Every later call checks only that the tensors are those
    the plan was built for (count, dtype, device, shape) and launches one kernel per dtype.

    ``gather(sources)`` writes every segment into the plan's own flat buffer (one per dtype,
    allocated at build) and returns the same segment views every call: the next gather overwrites
    them (a round trains them in place, then ``scatter_`` writes them back). ``out=`` gathers into
    a caller's flat buffer instead (one dtype). ``scatter_(targets, updates, reduce)`` is
    :func:`~ist_kernels.functional.scatter_slices_` with the plan's segments. Not differentiable.

    On CUDA a call that finds its tensors where the previous call found them neither allocates nor
    waits for the device, so a round's gathers and scatters can be captured in a CUDA graph (run
    each once before capturing: that call uploads the records).

    Products: a tensor whose ``dims`` entry is a pair ``(d0, d1)`` is sliced along both; each of
    its segments' ``indices`` is a pair ``(rows, cols)`` and the segment is ``x.index_select(d0,
    rows).index_select(d1, cols)``. Planned from the two lists (checked, moved to the tensors'
    device; O(rows + cols), never element by element) and run by :mod:`.product` (gather: a take
    per chunk of rows or an advanced index; write-back: ``index_put_``, with the owner reduction
    over the rows x cols block where segments overlap), bit for bit the kernels' flat scatter.
    Their segment views live in their own buffer (one per dtype); ``gather(out=)`` is not
    supported on a plan with products.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], ids: Sequence[int], indices: Sequence,
                 dims: Sequence):
        op = "slice_plan"
        tensors, ids, indices, dims = list(tensors), [int(i) for i in ids], list(indices), list(dims)
        check(len(tensors) > 0, op, "tensors is empty; give at least one tensor")
        check(len(ids) == len(indices), op,
              f"ids and indices must have one entry per segment, got {len(ids)} and {len(indices)}")
        check(len(dims) == len(tensors), op, f"dims must have one entry per tensors ({len(tensors)}), got {len(dims)}")
        check_ids(op, ids, len(tensors), "ids", "tensors")  # grouping by dtype reads them
        tensors = [t.detach() for t in tensors]
        self.num_tensors = len(tensors)
        self.num_segments = len(ids)
        self.device = tensors[0].device
        self._views = [None] * self.num_segments
        # Tensors sliced along a pair of dims: product segments (rows, cols), planned from their lists.
        pairs = [t for t, d in enumerate(dims) if is_product(d)]
        self._products = _Products(op, tensors, ids, indices, dims, pairs) if pairs else None
        if self._products is not None:
            for j, v in zip(self._products.segs, self._products.views):
                self._views[j] = v
        flat = [t for t in range(len(tensors)) if t not in set(pairs)]
        for j, t in enumerate(ids):
            if t in flat and is_product(indices[j]):
                fail(op, f"indices[{j}] is a pair but tensors[{t}] is sliced along one dim (dims[{t}] = {dims[t]}); "
                     "give a pair of dims for a product slice")
        groups: dict = {}
        for t in flat:
            groups.setdefault(tensors[t].dtype, []).append(t)
        if len(groups) > 1:  # checked whole first: errors then name the caller's positions
            fsegs = [j for j, t in enumerate(ids) if t in flat]
            d = dict(zip(flat, wrap_dims(op, [tensors[t] for t in flat], [dims[t] for t in flat], "tensors",
                                         same_dtype=False)))
            check_index_lists(op, [indices[j] for j in fsegs], tensors[0].device)
            check_index_values(op, [indices[j] for j in fsegs], [tensors[ids[j]].shape[d[ids[j]]] for j in fsegs],
                               positions=fsegs, what=[f"tensors[{ids[j]}] along dim {d[ids[j]]}" for j in fsegs])
        self._groups: List[_Group] = []
        for members in groups.values():
            local = {t: i for i, t in enumerate(members)}
            segs = [j for j, t in enumerate(ids) if t in local]
            srcs = [tensors[t] for t in members]
            gdims = [dims[t] for t in members]
            meta = torch.ops.ist_kernels.slice_plan(srcs, [local[ids[j]] for j in segs], [indices[j] for j in segs],
                                                    gdims)
            wrapped = [gdims[i] % srcs[i].dim() for i in range(len(srcs))]
            lengths = [indices[j].shape[0] for j in segs]
            seg_shapes = [segment_shape(tensors[ids[j]].shape, wrapped[local[ids[j]]], n) for j, n in zip(segs, lengths)]
            total = int(meta[3])  # kTotal (csrc/slices_plan.h)
            buffer = torch.empty(total, dtype=srcs[0].dtype, device=self.device)
            views = [v.view(s) for v, s in zip(torch.split(buffer, [_numel(s) for s in seg_shapes]), seg_shapes)]
            n_idx = sum(lengths)
            slices = sum(srcs[local[ids[j]]].shape[wrapped[local[ids[j]]]] for j in segs)
            gather_bytes = 32 + RECORD_BYTES * (len(segs) + 1) + 8 * n_idx
            scatter_bytes = 32 + RECORD_BYTES * (len(members) + len(segs) + 2) + 4 * slices
            self._groups.append(_Group(members, segs, meta, buffer, views, seg_shapes, gather_bytes, scatter_bytes))
            for j, v in zip(segs, views):
                self._views[j] = v
        # one C++ launch over every tensor: the plan's tensors are the launch's, in order
        self._single = len(self._groups) == 1 and self._products is None

    @property
    def segments(self) -> List[torch.Tensor]:
        """The plan's segment views (what the last gather wrote)."""
        return list(self._views)

    def _check_count(self, op: str, tensors, name: str) -> None:
        check(len(tensors) == self.num_tensors, op,
              f"the plan was built for {self.num_tensors} tensors, got {len(tensors)} {name}")

    def gather(self, sources: Sequence[torch.Tensor], *, out: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Every segment of ``sources`` (the tensors the plan was built for, or tensors of the same
        shapes, dtypes and device), as the plan's segment views (or views of ``out``)."""
        op = "slice_plan_gather_"
        self._check_count(op, sources, "sources")
        if out is not None:
            check(len(self._groups) == 1 and self._products is None, op,
                  f"out is one tensor but the plan has {len(self._groups)} dtypes" if self._products is None else
                  "out is not supported by a plan with product slices (tensors sliced along a pair of dims)")
            g = self._groups[0]
            with torch.no_grad():
                torch.ops.ist_kernels.slice_plan_gather_(out, sources, g.meta, g.cache("gather_cache"))
            return [v.view(s) for v, s in zip(torch.split(out, [_numel(s) for s in g.shapes]), g.shapes)]
        with torch.no_grad():
            if self._single:
                g = self._groups[0]
                torch.ops.ist_kernels.slice_plan_gather_(g.buffer, sources, g.meta, g.cache("gather_cache"))
            else:
                for g in self._groups:
                    torch.ops.ist_kernels.slice_plan_gather_(g.buffer, [sources[t] for t in g.members], g.meta,
                                                             g.cache("gather_cache"))
                if self._products is not None:
                    self._products.gather(sources)
        return list(self._views)

    def scatter_(self, targets: Sequence[torch.Tensor], updates: Optional[Sequence[torch.Tensor]] = None,
                 reduce: str = "mean") -> None:
        """Write ``updates`` (one per segment; default: the plan's segment views, as the last gather
        left them and the round changed them) back into ``targets`` in place, reduce = ``"copy"`` /
        ``"sum"`` / ``"mean"`` over the owners (as :func:`~ist_kernels.functional.scatter_slices_`)."""
        op = "slice_plan_scatter_"
        self._check_count(op, targets, "targets")
        updates = self._views if updates is None else updates
        check(len(updates) == self.num_segments, op,
              f"the plan has {self.num_segments} segments but got {len(updates)} updates")
        with torch.no_grad():
            if self._single:
                g = self._groups[0]
                torch.ops.ist_kernels.slice_plan_scatter_(targets, updates, g.meta, reduce, g.cache("scatter_cache"))
                return
            # Several launches: check every group's updates first, so that a failed call writes nothing.
            for g in self._groups:
                for j, shape in zip(g.segs, g.shapes):
                    u = updates[j]
                    check_type(u.dtype == g.buffer.dtype, op,
                               f"updates[{j}] has dtype {u.dtype} but its target has {g.buffer.dtype}")
                    check(list(u.shape) == shape, op, f"updates[{j}] has shape {list(u.shape)} but the plan's "
                          f"segment {j} needs {shape}")
            p = self._products
            if p is not None:
                check(reduce in REDUCES, op, f'reduce must be "copy", "sum" or "mean", got "{reduce}"')
                p.check_updates(op, targets, updates, reduce)
            members = sorted({t for g in self._groups for t in g.members} | (set(p.members) if p else set()))
            check_no_alias(op, targets, members, updates, [])
            for g in self._groups:
                torch.ops.ist_kernels.slice_plan_scatter_([targets[t] for t in g.members], [updates[j] for j in g.segs],
                                                          g.meta, reduce, g.cache("scatter_cache"))
            if p is not None:
                p.scatter_(targets, updates, reduce)

    def __repr__(self) -> str:
        dtypes = {str(g.buffer.dtype) for g in self._groups} | (self._products.dtypes() if self._products else set())
        return (f"PlannedSlices(tensors={self.num_tensors}, segments={self.num_segments}, "
                f"products={len(self._products.segs) if self._products else 0}, dtypes={sorted(dtypes)}, "
                f"device={self.device})")


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


class _Products:
    """The product segments of a plan (tensors sliced along a pair of dims): their index lists
    (checked once, moved to the tensors' device), the compact views (one flat buffer per dtype) and
    the gather / write-back of :mod:`.product`. Planned in O(rows + cols) per segment."""

    def __init__(self, op: str, tensors, ids, indices, dims, members):
        self.members = list(members)
        self.dims = {t: wrap_pair(op, tensors[t], dims[t], f"tensors[{t}]") for t in self.members}
        self.shapes = {t: tuple(tensors[t].shape) for t in self.members}
        self.dtype = {t: tensors[t].dtype for t in self.members}
        device = tensors[0].device
        for t in self.members:
            check(tensors[t].device == device, op, f"tensors[{t}] is on {tensors[t].device} but tensors[0] is on "
                  f"{device}; all tensors must be on one device")
        self.segs = [j for j, t in enumerate(ids) if t in self.dims]
        self.index = {}
        seg_shapes = []
        for j in self.segs:
            t = ids[j]
            check_product(op, j, indices[j], tensors[t], self.dims[t], f"tensors[{t}]")
            rows, cols = (i.to(device) for i in indices[j])
            self.index[j] = (rows, cols)
            seg_shapes.append(product_shape(self.shapes[t], self.dims[t], rows.numel(), cols.numel()))
        self.ids = {j: ids[j] for j in self.segs}
        self.overlap = {}  # per target: whether two of its segments share an element (the mean's slow path)
        for t in self.members:
            d = self.dims[t]
            self.overlap[t] = overlaps([self.index[j] for j in self.segs if ids[j] == t],
                                       (self.shapes[t][d[0]], self.shapes[t][d[1]]))
        self.seg_shapes = dict(zip(self.segs, seg_shapes))
        by_dtype: dict = {}
        for j in self.segs:
            by_dtype.setdefault(self.dtype[ids[j]], []).append(j)
        self.views = [None] * len(self.segs)
        pos = {j: k for k, j in enumerate(self.segs)}
        for dtype, segs in by_dtype.items():
            numels = [_numel(self.seg_shapes[j]) for j in segs]
            buffer = torch.empty(sum(numels), dtype=dtype, device=device)
            for j, part in zip(segs, torch.split(buffer, numels)):
                self.views[pos[j]] = part.view(self.seg_shapes[j])

    def dtypes(self) -> set:
        return {str(d) for d in self.dtype.values()}

    def gather(self, sources) -> None:
        for t in self.members:
            x = sources[t]
            check(tuple(x.shape) == self.shapes[t] and x.dtype == self.dtype[t], "slice_plan_gather_",
                  f"sources[{t}] is {list(x.shape)} {x.dtype} but the plan was built for {list(self.shapes[t])} "
                  f"{self.dtype[t]}")
        for j, v in zip(self.segs, self.views):
            t = self.ids[j]
            gather_product(sources[t], self.dims[t], self.index[j], v)

    def check_updates(self, op: str, targets, updates, reduce: str) -> None:
        for t in self.members:
            x = targets[t]
            check(tuple(x.shape) == self.shapes[t] and x.dtype == self.dtype[t], op,
                  f"targets[{t}] is {list(x.shape)} {x.dtype} but the plan was built for {list(self.shapes[t])} "
                  f"{self.dtype[t]}")
            if reduce != "copy" and x.dtype not in REDUCIBLE:
                fail(op, f'reduce="{reduce}" needs a floating or integer dtype, got {x.dtype}; use reduce="copy"',
                     TypeError)
        for j in self.segs:
            u, t = updates[j], self.ids[j]
            check_type(u.dtype == self.dtype[t], op, f"updates[{j}] has dtype {u.dtype} but its target has "
                       f"{self.dtype[t]}")
            check(list(u.shape) == list(self.seg_shapes[j]), op, f"updates[{j}] has shape {list(u.shape)} but the "
                  f"plan's segment {j} needs {list(self.seg_shapes[j])}")
            check(u.device == targets[t].device, op, f"updates[{j}] is on {u.device} but targets[{t}] is on "
                  f"{targets[t].device}")

    def scatter_(self, targets, updates, reduce: str) -> None:
        for t in self.members:
            segs = [j for j in self.segs if self.ids[j] == t]
            scatter_products_(targets[t], self.dims[t], [self.index[j] for j in segs], [updates[j] for j in segs],
                              reduce, self.overlap[t])
