"""Product slices: a tensor sliced along two dims at once, ``x.index_select(d0, rows).index_select(d1, cols)``.

A tensor partitioned along two dims (an MLP's hidden-to-hidden weight: the rows of a layer's neurons
x the columns of the previous layer's) is described by its two index lists, never element by
element: its plan, checks and write-back cost O(len(rows) + len(cols)) beyond the data they move.
The index math of every product consumer is here, once: the compact shape, the gather (two
``index_select``), the write-back with ``reduce`` = copy / sum / mean over the owners and the
index-list checks. :class:`~ist_kernels.ops.slices.PlannedSlices` runs a product segment through
these, a one-dim segment through the C++ plan.

The write-back equals, bit for bit, the kernels' scatter of the same segments stated on a flat
view (one slice per element, ``row * size(d1) + col``; csrc/common/slices.h): owners reduced in
segment order, counted from the index lists; copy: the last owner's value; sum: ``((target + u_1)
+ u_2) + ...``; mean: OwnerMean (``u_1 + (sum_{l>=2} (u_l - u_1)) / k``, exactly ``u_1`` where that
sum is 0, and ``(sum_l u_l 2^-64) / k 2^64`` where that form overflows), accumulated in float for
half / bfloat16 and in int64 for integers (the mean rounded toward zero), rounded once. Slices no
segment owns keep their value.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._checks import check, check_index, check_type, fail

Product = Tuple[Tensor, Tensor]  # (rows along d0, cols along d1)

_DOWN = 5.42101086242752217e-20  # 2^-64 (exact in float)
_UP = 1.8446744073709551616e19  # 2^64


def is_product(index) -> bool:
    """Whether an index entry (or a dims entry) is a pair: a product slice."""
    return isinstance(index, (tuple, list))


def wrap_pair(op: str, x: Tensor, dims, name: str) -> Tuple[int, int]:
    """The two dims of a product tensor, wrapped; distinct and in range."""
    if len(dims) != 2:
        fail(op, f"the dims of {name} must be one int or a pair (d0, d1), got {tuple(dims)}")
    nd = x.dim()
    if nd < 2:
        fail(op, f"{name} has {nd} dimensions; a product slice needs at least 2")
    out = []
    for d in dims:
        if not -nd <= int(d) < nd:
            fail(op, f"dim {d} of the pair {tuple(dims)} is out of range for {name} with {nd} dimensions", IndexError)
        out.append(int(d) % nd)
    if out[0] == out[1]:
        fail(op, f"the pair of dims of {name} names dim {out[0]} twice; give two distinct dims")
    return out[0], out[1]


def product_shape(shape: Sequence[int], dims: Tuple[int, int], rows: int, cols: int) -> List[int]:
    """The compact shape of a product slice: ``shape`` with ``rows`` along dims[0], ``cols`` along dims[1]."""
    out = list(shape)
    out[dims[0]], out[dims[1]] = rows, cols
    return out


def check_product(op: str, j: int, index, x: Tensor, dims: Tuple[int, int], name: str) -> None:
    """Segment ``j``'s product index ``(rows, cols)`` into ``x`` (``name``) along ``dims``: two
    int64 1-D lists on the CPU or ``x``'s device, in range, without repeats (vectorised, a sync each)."""
    if not is_product(index) or len(index) != 2:
        fail(op, f"indices[{j}] must be a pair (rows, cols) of index lists: {name} is sliced along the pair of dims "
             f"{dims}")
    for k, (idx, d) in enumerate(zip(index, dims)):
        what = f"indices[{j}][{k}]"
        if not isinstance(idx, Tensor):
            fail(op, f"{what} must be a tensor, got {type(idx).__name__}", TypeError)
        check_type(idx.dtype == torch.int64, op, f"{what} must be int64, got {idx.dtype}")
        check(idx.dim() == 1, op, f"{what} must be 1-D, got {idx.dim()} dimensions")
        check(idx.device.type == "cpu" or idx.device == x.device, op,
              f"{what} is on {idx.device} but {name} is on {x.device}; index lists must be on the CPU or the tensor's "
              "device")
        if idx.numel():
            size = x.shape[d]
            lo, hi = int(idx.min()), int(idx.max())
            check_index(lo >= 0 and hi < size, op, f"{what} holds {lo if lo < 0 else hi}, out of range for {name} "
                        f"along dim {d} of size {size}")
            check(not _meet([idx], size), op, f"{what} must not repeat an index; a segment holds each slice at most "
                  "once")


CHUNK = 1 << 15  # elements per take of a 2-D CPU gather: one serial pass of index_select (its grain size)


def gather_product(x: Tensor, dims: Tuple[int, int], index: Product, out: Tensor) -> Tensor:
    """``x.index_select(dims[0], rows).index_select(dims[1], cols)`` into ``out`` (contiguous, the
    compact shape), in one pass, without an intermediate of rows x the other dim.

    A contiguous 2-D CPU tensor along (0, 1) (an MLP's hidden weight) is read by a take of flat
    indices built per chunk of rows (``CHUNK`` elements; at most that index exists at a time): at
    4096 x 4096, keep 1/4, S = 4, 22.6 ms against 56 ms for the advanced index and 25 ms for the
    kernels' flat gather with its planned rows x cols index (this 2-core CPU). Elsewhere: an
    advanced index of the two lists broadcast against each other (one kernel on CUDA)."""
    rows, cols = index
    if tuple(dims) == (0, 1) and x.dim() == 2 and x.device.type == "cpu" and x.is_contiguous():
        flat, stride, o = x.view(-1), x.shape[1], out.view(rows.numel(), cols.numel())
        step = max(1, CHUNK // max(1, cols.numel()))
        for i in range(0, rows.numel(), step):
            take = (rows[i:i + step, None] * stride + cols[None, :]).view(-1)
            torch.index_select(flat, 0, take, out=o[i:i + step].view(-1))
        return out
    at = [rows[:, None], cols[None, :]]
    if tuple(dims) == (0, 1):  # the result's layout is the compact one: written in place
        return torch.ops.aten.index.Tensor_out(x, at, out=out)
    out.movedim(dims, (0, 1)).copy_(_front(x, dims)[tuple(at)])
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    return torch.int64


def _front(x: Tensor, dims: Tuple[int, int]) -> Tensor:
    """A view of ``x`` with dims[0], dims[1] moved to the front (written through)."""
    return x.movedim(dims, (0, 1))


def _meet(lists: Sequence[Tensor], size: int) -> bool:
    """Whether two of ``lists`` (each without repeats, in [0, size)) share an index."""
    return bool(lists) and int(torch.bincount(torch.cat(lists), minlength=size).max()) > 1


UNION_CHUNK = 1 << 22  # union_numels: column marks per chunk of row groups (~16 MB of float32)


def cat_lists(lists: Sequence[Tensor], place: bool = False) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The index lists one after another (on their device), which list each element came from, and
    (``place``) its place in that list. No host sync."""
    device = lists[0].device if lists else torch.device("cpu")
    sizes = [i.numel() for i in lists]
    lens = torch.tensor(sizes, dtype=torch.int64, device=device)
    which = torch.repeat_interleave(torch.arange(len(sizes), device=device), lens, output_size=sum(sizes))
    at = torch.arange(which.numel(), dtype=torch.int64, device=device) - (lens.cumsum(0) - lens)[which] if place else None
    return (torch.cat(list(lists)) if lists else torch.zeros(0, dtype=torch.int64)), which, at


def marks(lists: Sequence[Tensor], n: int, dtype: torch.dtype = torch.bool) -> Tensor:
    """[len(lists), n] on the lists' device: row i marks (True / 1) the indices of ``lists[i]``
    (each in [0, n)). One scatter, no host sync."""
    out = torch.zeros(len(lists), n, dtype=dtype, device=lists[0].device if lists else torch.device("cpu"))
    ids, which, _ = cat_lists(lists)
    out[which, ids] = 1
    return out


def row_groups(meet: Tensor) -> Tuple[Tensor, Tensor]:
    """Rows grouped by the segments they meet (``meet``: [segments, rows] bool): [groups, segments]
    float32 (1: the group's rows meet that segment) and each row's group. Up to 62 segments a row's
    pattern is the bits of one int64 key (one ``unique`` of a vector), beyond that ``unique`` of the
    columns."""
    if meet.shape[0] <= 62:
        bit = torch.arange(meet.shape[0], dtype=torch.int64, device=meet.device)
        keys, inverse = torch.unique((meet.to(torch.int64) << bit.unsqueeze(1)).sum(0), return_inverse=True)
        return ((keys.unsqueeze(1) >> bit) & 1).to(torch.float32), inverse
    groups, inverse = torch.unique(meet.T, dim=0, return_inverse=True)
    return groups.to(torch.float32), inverse


def union_numels(index: Sequence[Product], sizes: Tuple[int, int], upto: Sequence[int]) -> List[int]:
    """For each k of ``upto``, how many elements of a product of 2-D ``sizes`` the segments
    ``index[:k]`` own together: the union of their rows x cols, never element by element. The rows
    are grouped by the segments they meet (:func:`row_groups`); a group owns the OR of those
    segments' cols (one small matmul of 0/1 marks, exact in float32) for each of its rows:
    O(segments x (rows + cols) + groups x segments x cols), one host sync."""
    keep = [j for j, (r, c) in enumerate(index) if r.numel() and c.numel()]
    if not keep:
        return [0] * len(upto)
    n0, n1 = sizes
    rows = marks([index[j][0] for j in keep], n0)
    cols = marks([index[j][1] for j in keep], n1, torch.float32)
    groups, inverse = row_groups(rows)
    height = torch.bincount(inverse, minlength=groups.shape[0])  # rows per group
    step = max(1, UNION_CHUNK // max(1, n1))  # groups per chunk
    totals = []
    for k in upto:
        m = sum(j < k for j in keep)  # the kept segments below k: a prefix of them
        total = torch.zeros((), dtype=torch.int64, device=rows.device)
        for g in range(0, groups.shape[0] if m else 0, step):
            covered = (groups[g:g + step, :m] @ cols[:m]) > 0  # [groups, n1]: cols some segment of the group owns
            total = total + (covered.sum(1) * height[g:g + step]).sum()
        totals.append(total)
    return torch.stack(totals).tolist()


def overlaps(index: Sequence[Product], sizes: Tuple[int, int]) -> bool:
    """Whether some element is owned by two of the segments (their rows and their cols both meet),
    from the index lists (``sizes``: the two dims' lengths): at once False where the rows (or the
    cols) of all segments are disjoint, e.g. an IST partition (``bincount``: serial on the CPU, no
    parallel region for a few thousand indices); else the pairs in batches: the row marks of a
    batch of segments times those of every segment up to it count the rows each pair shares, the
    same for cols (small matmuls of 0/1 marks, exact in float32). The batches double (8, 8, 16,
    32, ... segments), so a shared pair among the first segments stops it early; a host sync per
    batch."""
    n = len(index)
    if n < 2 or not _meet([p[0] for p in index], sizes[0]) or not _meet([p[1] for p in index], sizes[1]):
        return False
    rows = torch.zeros(0, sizes[0], dtype=torch.float32, device=index[0][0].device)
    cols = torch.zeros(0, sizes[1], dtype=torch.float32, device=index[0][1].device)
    start = 0
    while start < n:
        end = min(n, max(8, 2 * start))
        rows = torch.cat([rows, marks([p[0] for p in index[start:end]], sizes[0], torch.float32)])
        cols = torch.cat([cols, marks([p[1] for p in index[start:end]], sizes[1], torch.float32)])
        # [batch, end]: segment start + b and segment i share rows and cols, for i < start + b
        both = ((rows[start:end] @ rows.T) > 0) & ((cols[start:end] @ cols.T) > 0)
        if bool(both.tril(start - 1).any()):
            return True
        start = end
    return False


@torch.no_grad()
def scatter_products_(target: Tensor, dims: Tuple[int, int], index: Sequence[Product], updates: Sequence[Tensor],
                      reduce: str, overlap: Optional[bool] = None) -> None:
    """Write ``updates[j]`` (the compact shape of ``index[j]``) back into ``target`` in place, the
    owners of each element reduced in segment order (``reduce`` = copy / sum / mean; see the module
    docstring). Arguments are checked by the caller; index lists are on ``target``'s device.
    ``overlap``: whether two segments share an element (:func:`overlaps`; computed when None)."""
    if not index:
        return
    t = _front(target, dims)
    ups = [_front(u, dims) for u in updates]
    rest = [1] * (t.dim() - 2)
    if overlap is None:
        overlap = overlaps(index, (t.shape[0], t.shape[1]))
    if not overlap:  # every element has at most one owner
        for (rows, cols), u in zip(index, ups):
            at = (rows[:, None], cols[None, :])
            if reduce == "sum":
                acc = _acc_dtype(t.dtype)
                u = (t[at].to(acc) + u.to(acc)).to(t.dtype)
            t.index_put_(at, u)  # copy, and the mean of one owner (u_1, exactly)
        return
    # Several owners somewhere: reduce over the union block of every segment's rows x cols.
    urows = torch.unique(torch.cat([p[0] for p in index]))
    ucols = torch.unique(torch.cat([p[1] for p in index]))
    block_at = (urows[:, None], ucols[None, :])
    old = t[block_at]
    if reduce == "copy":
        new = old.clone()
        for (rows, cols), u in zip(index, ups):
            new.index_put_(_block(urows, ucols, rows, cols), u)
        t.index_put_(block_at, new)
        return
    acc = _acc_dtype(t.dtype)
    integral = not (acc.is_floating_point or acc.is_complex)
    k = torch.zeros(urows.numel(), ucols.numel(), dtype=torch.int64, device=t.device)
    if reduce == "sum":
        total = old.to(acc)
        for (rows, cols), u in zip(index, ups):
            at = _block(urows, ucols, rows, cols)
            total.index_put_(at, total[at] + u.to(acc))
        t.index_put_(block_at, total.to(t.dtype))
        return
    first = torch.zeros(old.shape, dtype=acc, device=t.device)
    dev, scaled = torch.zeros_like(first), torch.zeros_like(first)
    for (rows, cols), u in zip(index, ups):
        at = _block(urows, ucols, rows, cols)
        u = u.to(acc)
        kk = k[at]
        new = (kk == 0).view(*kk.shape, *rest)
        f_old = first[at]
        first.index_put_(at, torch.where(new, u, f_old))
        if integral:
            dev.index_put_(at, torch.where(new, u, dev[at] + u))
        else:
            dev.index_put_(at, torch.where(new, torch.zeros_like(u), dev[at] + (u - f_old)))
            down = u * _DOWN
            scaled.index_put_(at, torch.where(new, down, scaled[at] + down))
        k.index_put_(at, kk + 1)
    owned = (k > 0).view(*k.shape, *rest)
    kf = k.clamp_min(1).view(*k.shape, *rest)
    if integral:
        mean = torch.div(dev, kf, rounding_mode="trunc")
    else:
        kf = kf.to(acc)
        m = first + dev / kf
        safe = torch.isfinite(dev) & torch.isfinite(m)
        mean = torch.where(dev == 0, first, torch.where(safe, m, scaled / kf * _UP))
    t.index_put_(block_at, torch.where(owned, mean.to(t.dtype), old))


def _block(urows: Tensor, ucols: Tensor, rows: Tensor, cols: Tensor):
    """The advanced index of a segment's rows x cols inside the union block ``urows`` x ``ucols``."""
    return torch.searchsorted(urows, rows)[:, None], torch.searchsorted(ucols, cols)[None, :]
