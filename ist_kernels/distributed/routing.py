"""Who sends which slices to whom: the per-rank routing of one exchange, derived from the plans.

Every rank computes the same routing from the same plans (derived from the shared seed), so split
sizes are known on both ends of every message and nothing but tensor data is ever sent.

The slices of all tensors of an exchange are numbered in one global id space: tensor e (viewed as
[outer, size, inner] along its partitioned dim) holds ids base[e] .. base[e] + size - 1. A shared
tensor moved through the all-to-all is viewed as [1, numel]: one slice that every subnetwork owns.
Given which ranks contribute which ids (``src``) and which ranks need which ids afterwards
(``dst``), rank k sends rank q the ids src[k] & dst[q], grouped per tensor in plan order, each
group one segment of the packed buffer; rank q receives from every k in rank order, so the owners
of a slice are visited in ascending rank in the unpack, as in the simulated single-process path
(scatter_slices_ over subnetworks 0..S-1).

A product (a tensor partitioned along two dims, ``TensorSlices.product``) is routed on its index
lists, never element by element: what rank k sends rank q is, for every pair of a block k
contributes (rows x cols) and a block q needs, the rows both hold x the cols both hold, a
:class:`Piece` of each end's compact storage (:func:`product_pieces`); O(blocks^2 x (rows + cols)),
all pairs in one batch of tensor operations (:func:`meet_pieces`). Whether the blocks cover a
product, and which elements a rank holds first, are unions of blocks (:func:`union_sizes`).
"""
from dataclasses import dataclass, field
from math import prod
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..ops.slices.product import UNION_CHUNK, cat_lists, marks, row_groups, union_numels


@dataclass
class Entry:
    """One tensor moved through the all-to-all, viewed as [outer, size, inner] along ``dim``."""
    name: str
    dim: int
    shape: Tuple[int, ...]  # shape of the view the slice ops see ([1, numel] shared, [1] a scalar)
    real_shape: Tuple[int, ...]
    dtype: torch.dtype  # the tensor's own dtype; integer tensors travel as floats of the buffer
    shared: bool  # a shared tensor viewed as one slice owned by everyone
    base: int = 0

    @property
    def integral(self) -> bool:
        return not self.dtype.is_floating_point

    @property
    def size(self) -> int:
        return self.shape[self.dim]

    @property
    def slice_numel(self) -> int:  # elements of one slice (outer * inner)
        return prod(self.shape) // self.size if self.size else 0

    def compact_shape(self, rows: int) -> Tuple[int, ...]:
        s = list(self.shape)
        s[self.dim] = rows
        return tuple(s)

    def local_shape(self, rows: int) -> Tuple[int, ...]:
        """The shape a rank holding ``rows`` slices stores (a held scalar stays a scalar)."""
        if self.shared or (not self.real_shape and rows == 1):
            return self.real_shape
        return self.compact_shape(rows)


@dataclass
class Piece:
    """Rows ``rows`` x cols ``cols`` (int64 positions) of the ``height`` x ``width`` block that starts
    at element ``offset`` of a rank's compact 1-D storage of a product."""
    offset: int
    height: int
    width: int
    rows: Tensor
    cols: Tensor

    @property
    def numel(self) -> int:
        return self.rows.numel() * self.cols.numel()


@dataclass
class Part:
    """Rows x cols (``rows``, ``cols``: indices of the full 2-D tensor) of a product that a rank
    contributes or needs, lying in the block of its compact storage that starts at element ``offset``
    and holds rows ``store_rows`` x cols ``store_cols`` (None: the storage is the full tensor)."""
    rows: Tensor
    cols: Tensor
    offset: int = 0
    store_rows: Optional[Tensor] = None
    store_cols: Optional[Tensor] = None

    def extent(self, axis: int, n: int) -> int:
        """The storage block's rows (axis 0) or cols (axis 1)."""
        store = (self.store_rows, self.store_cols)[axis]
        return n if store is None else store.numel()


@dataclass
class Segment:
    entry: int  # index into the entries
    index: Tensor  # int64 positions along the entry's dim, in the source (send) or target (recv)
    numel: int
    pieces: Optional[List[Piece]] = None  # a product's segment: its pieces, in order (``index`` unused)


@dataclass
class Routing:
    """Rank ``rank``'s side of one exchange."""
    rank: int
    world_size: int
    send: List[List[Segment]] = field(default_factory=list)  # per destination rank
    recv: List[List[Segment]] = field(default_factory=list)  # per source rank
    send_numel: List[int] = field(default_factory=list)
    recv_numel: List[int] = field(default_factory=list)


def owner_ids(entries: Sequence[Entry], owners: Sequence[Sequence[Tensor]], num: int, what: str) -> Tensor:
    """[S, N] bool: subnetwork s owns global slice id i (owners[e][s]: sorted, unique int64 indices
    along entry e's dim). Raises ValueError naming the tensor on a bad index list. Every subnetwork's
    lists of every entry checked and marked at once (a fixed number of tensor operations)."""
    total = entries[-1].base + entries[-1].size if entries else 0
    mask = torch.zeros(num, total, dtype=torch.bool)
    idx = [per_s[s] for s in range(num) for per_s in owners]  # subnetwork-major, entries in order
    for k, i in enumerate(idx):
        if i.dtype != torch.int64 or i.dim() != 1:
            raise ValueError(f"{what}: tensor {entries[k % len(entries)].name!r}: owner indices of subnetwork "
                             f"{k // len(entries)} must be a 1-D int64 tensor, got {i.dtype} with shape {tuple(i.shape)}")
    if not idx:
        return mask
    raw, which, _ = cat_lists([i.cpu() for i in idx])
    if not raw.numel():
        return mask
    lens = torch.tensor([i.numel() for i in idx], dtype=torch.int64)
    entry = which % len(entries)
    sizes = torch.tensor([e.size for e in entries], dtype=torch.int64)
    bases = torch.tensor([e.base for e in entries], dtype=torch.int64)
    ok = (raw >= 0) & (raw < sizes[entry])
    inc = torch.ones_like(ok)
    inc[1:] = raw[1:] > raw[:-1]
    inc[(lens.cumsum(0) - lens)[lens > 0]] = True  # a list's first index follows nothing
    if not bool((ok & inc).all()):
        k = int(which[~(ok & inc)][0])
        e, s, i = entries[k % len(entries)], k // len(entries), idx[k]
        raise ValueError(f"{what}: tensor {e.name!r}: owner indices of subnetwork {s} must be sorted, unique "
                         f"and in [0, {e.size}) along dim {e.dim}, got {i.tolist()[:16]}...")
    mask[which // len(entries), raw + bases[entry]] = True
    return mask


def first_owner(mask: Tensor) -> Tensor:
    """Keep, per slice, only its lowest-rank owner."""
    return mask & (mask.cumsum(0) == 1)


def _positions(held: Tensor, tensor_of: Tensor, bases: Tensor) -> Tensor:
    """[N] int64: position of each id among the ids of its tensor held in ``held`` ([N] bool),
    i.e. its index along dim in the compact tensor (-1 where not held)."""
    pos = torch.full(held.shape, -1, dtype=torch.int64)
    ids = held.nonzero().flatten()
    if ids.numel():
        t = tensor_of[ids]
        rank_in_all = torch.arange(ids.numel(), dtype=torch.int64)
        # first position of each tensor's run among the held ids
        first = torch.zeros(bases.numel(), dtype=torch.int64)
        counts = torch.bincount(t, minlength=bases.numel())
        first[1:] = counts.cumsum(0)[:-1]
        pos[ids] = rank_in_all - first[t]
    return pos


def route(
    entries: Sequence[Entry],
    rank: int,
    src: Tensor,
    dst: Tensor,
    *,
    source_held: Optional[Tensor],
    target_held: Optional[Tensor],
    keep_own: Optional[Tensor] = None,
) -> Routing:
    """Rank ``rank``'s messages.

    src [S, N] bool: rank k contributes slice i (its value enters the owner mean).
    dst [S, N] bool: rank q needs slice i after the exchange.
    source_held / target_held [N] bool for this rank: the slices its compact source tensors hold
    (positions along dim count only held slices) / its compact target tensors will hold; None:
    full tensors (positions are the slice indices themselves).
    keep_own [N] bool: slices this rank leaves out of its message to itself (they are already where
    they belong: see :func:`sole_owner_in_place`, :func:`passthrough_entries`).
    Products are added to the routing by :func:`add_product`.
    """
    S, N = src.shape
    sizes = torch.tensor([e.size for e in entries], dtype=torch.int64)
    bases = torch.tensor([e.base for e in entries], dtype=torch.int64)
    tensor_of = torch.repeat_interleave(torch.arange(len(entries), dtype=torch.int64), sizes)
    local = torch.arange(N, dtype=torch.int64) - bases[tensor_of] if N else torch.zeros(0, dtype=torch.int64)
    src_pos = local if source_held is None else _positions(source_held, tensor_of, bases)
    dst_pos = local if target_held is None else _positions(target_held, tensor_of, bases)
    slice_numel = [e.slice_numel for e in entries]

    def segments(ids: Tensor, pos: Tensor) -> List[Segment]:
        if not ids.numel():
            return []
        t = tensor_of[ids]
        counts = torch.bincount(t, minlength=len(entries)).tolist()
        pieces = torch.split(pos[ids], counts)
        return [Segment(e, pieces[e], counts[e] * slice_numel[e]) for e in range(len(entries)) if counts[e]]

    out = Routing(rank, S)
    for q in range(S):
        mask = src[rank] & dst[q]
        if q == rank and keep_own is not None:
            mask &= ~keep_own
        ids = mask.nonzero().flatten()
        if source_held is not None and ids.numel() and bool((src_pos[ids] < 0).any()):
            raise AssertionError("routing: a rank would send a slice it does not hold")
        out.send.append(segments(ids, src_pos))
    for k in range(S):
        mask = src[k] & dst[rank]
        if k == rank and keep_own is not None:
            mask &= ~keep_own
        ids = mask.nonzero().flatten()
        out.recv.append(segments(ids, dst_pos))
    out.send_numel = [sum(s.numel for s in segs) for segs in out.send]
    out.recv_numel = [sum(s.numel for s in segs) for segs in out.recv]
    return out


def add_product(routing: Routing, entry: int, send: Sequence[List[Piece]], recv: Sequence[List[Piece]]) -> None:
    """Add product ``entry``'s pieces to ``routing``: ``send[q]`` to rank q, ``recv[k]`` from rank k,
    one segment a message, after the products already there and before every tensor sliced along
    one dim (a message keeps its floating tensors first)."""
    for segs_of, pieces_of in ((routing.send, send), (routing.recv, recv)):
        for segs, pieces in zip(segs_of, pieces_of):
            if pieces:
                at = sum(1 for s in segs if s.pieces is not None)
                segs.insert(at, Segment(entry, _NO_INDEX, sum(p.numel for p in pieces), list(pieces)))
    routing.send_numel = [sum(s.numel for s in segs) for segs in routing.send]
    routing.recv_numel = [sum(s.numel for s in segs) for segs in routing.recv]


_NO_INDEX = torch.zeros(0, dtype=torch.int64)


def held_parts(blocks: Sequence[Tuple[Tensor, Tensor]]) -> List[Part]:
    """The parts of a rank that holds a product's ``blocks`` (rows, cols) as its compact storage,
    one after another (``TensorSlices.blocks``: one block, rows x cols, or holder blocks stacked)."""
    out, off = [], 0
    for rows, cols in blocks:
        rows, cols = rows.cpu(), cols.cpu()
        out.append(Part(rows, cols, off, rows, cols))
        off += rows.numel() * cols.numel()
    return out


def first_held_parts(blocks: Sequence[Sequence[Tuple[Tensor, Tensor]]], shape: Tuple[int, int]) -> List[List[Part]]:
    """Per rank k (``blocks[k]``: its blocks, held as :func:`held_parts`), the elements of a product
    of 2-D ``shape`` it holds and no rank below k holds, as parts of its storage: a block's rows
    grouped by the lower ranks' blocks they meet (one int64 key per row), each group's cols less
    those blocks' cols (one small matmul of the groups and the lower blocks' col marks)."""
    n0, n1 = shape
    out: List[List[Part]] = []
    low_rows = torch.zeros(0, n0, dtype=torch.bool)  # the lower ranks' blocks' rows and cols, marked
    low_cols = torch.zeros(0, n1, dtype=torch.float32)  # (exact: a sum of at most #blocks ones)
    for held in blocks:
        mine, parts = [], [p for p in held_parts(held) if p.rows.numel() and p.cols.numel()]
        L = low_rows.shape[0]
        for p in parts:
            if not L:
                mine.append(p)
                continue
            groups, inverse = row_groups(low_rows[:, p.rows])
            step = max(1, UNION_CHUNK // n1)
            for g0 in range(0, groups.shape[0], step):
                free = ((groups[g0:g0 + step] @ low_cols) == 0)[:, p.cols]  # [groups, cols]: no lower block has it
                for gi in range(free.shape[0]):
                    cols = p.cols[free[gi]]
                    if cols.numel():
                        mine.append(Part(p.rows[inverse == g0 + gi], cols, p.offset, p.store_rows, p.store_cols))
        out.append(mine)
        if parts:
            low_rows = torch.cat([low_rows, marks([q.rows for q in parts], n0)])
            low_cols = torch.cat([low_cols, marks([q.cols for q in parts], n1, torch.float32)])
    return out


def _stacked(parts: Sequence[Part], axis: int, n: int) -> Tuple[Tensor, Tensor]:
    """[len(parts), n] bool marks of the parts' rows (axis 0) or cols (axis 1) and [len(parts), n]
    int64 positions of each in its part's storage block (-1 where the storage lacks it)."""
    marked = marks([(p.rows, p.cols)[axis] for p in parts], n)
    stores = [(p.store_rows, p.store_cols)[axis] for p in parts]
    pos = torch.full((len(parts), n), -1, dtype=torch.int64)
    full = [i for i, st in enumerate(stores) if st is None]
    if full:
        pos[full] = torch.arange(n, dtype=torch.int64)
    kept = [i for i, st in enumerate(stores) if st is not None]
    if kept:
        ids, which, place = cat_lists([stores[i] for i in kept], True)
        pos[torch.tensor(kept, dtype=torch.int64)[which], ids] = place
    return marked, pos


def meet_pieces(contrib: Sequence[Part], need: Sequence[Part], shape: Tuple[int, int]
                ) -> List[Tuple[int, int, Piece, Piece]]:
    """Every pair (i, j), in order of i then j, where ``contrib[i]`` and ``need[j]`` of a product of
    2-D ``shape`` share rows and cols: (i, j, the rows both hold x the cols both hold as a piece of
    contrib[i]'s storage, the same as a piece of need[j]'s), rows and cols ascending as the parts
    list them. All pairs at once: a fixed number of tensor operations over len(contrib) x len(need)
    x the longest part's rows (cols) marks, whatever the number of parts, then one small Python
    object per piece."""
    A, Nb = len(contrib), len(need)
    if not A or not Nb:
        return []
    axes = []
    for axis in (0, 1):
        n = shape[axis]
        idx = [(a.rows, a.cols)[axis] for a in contrib]
        ids, owner, place = cat_lists(idx, True)
        width = max(i.numel() for i in idx)
        pad = torch.full((A, width), n, dtype=torch.int64)  # contrib i's ids in row i, padded with n
        pad[owner, place] = ids
        need_marks, need_pos = _stacked(need, axis, n + 1)  # column n (the padding) marked by none
        # [A, Nb, width]: contrib i's p-th id lies in need j; nonzero lists (i, j, p) in that order
        i, j, p = need_marks[:, pad].transpose(0, 1).nonzero().unbind(1)
        got = pad[i, p]
        stores = [(a.store_rows, a.store_cols)[axis] for a in contrib]
        if all(st is x for st, x in zip(stores, idx)):  # held parts: an id's place in its part is its position
            at = p
        elif all(st is None for st in stores):  # full tensors: positions are the ids
            at = got
        else:
            at = _stacked(contrib, axis, n)[1][i, got]
        axes.append((torch.bincount(i * Nb + j, minlength=A * Nb), at, need_pos[j, got]))
    (cr, src_r, dst_r), (cc, src_c, dst_c) = axes
    met = ((cr > 0) & (cc > 0)).nonzero().flatten().tolist()
    if not met:
        return []
    n_r, n_c = cr.tolist(), cc.tolist()
    (src_r, dst_r), (src_c, dst_c) = [(torch.split(x, n), torch.split(y, n)) for x, y, n in
                                      ((src_r, dst_r, n_r), (src_c, dst_c, n_c))]  # per pair (i, j)
    ext_a = [(a.offset, a.extent(0, shape[0]), a.extent(1, shape[1])) for a in contrib]
    ext_b = [(b.offset, b.extent(0, shape[0]), b.extent(1, shape[1])) for b in need]
    out = []
    for k in met:
        i, j = divmod(k, Nb)
        out.append((i, j, Piece(*ext_a[i], src_r[k], src_c[k]), Piece(*ext_b[j], dst_r[k], dst_c[k])))
    return out


def product_pieces(contrib: Sequence[Part], need: Sequence[Part], shape: Tuple[int, int]
                   ) -> Tuple[List[Piece], List[Piece]]:
    """What a rank that contributes ``contrib`` sends one that needs ``need`` of a product of 2-D
    ``shape``: per pair (a, b) in that order, rows of both x cols of both, as pieces of the sender's
    storage and, in the same order, of the receiver's (:func:`meet_pieces`)."""
    met = meet_pieces(contrib, need, shape)
    return [s for _, _, s, _ in met], [r for _, _, _, r in met]


def union_sizes(blocks: Sequence[Sequence[Tuple[Tensor, Tensor]]], shape: Tuple[int, int],
                upto: Sequence[int]) -> List[int]:
    """For each k of ``upto``, how many elements of a product of 2-D ``shape`` ranks 0..k-1 hold
    (``blocks[r]``: rank r's (rows, cols) blocks): their blocks' union
    (:func:`~ist_kernels.ops.slices.product.union_numels`, never element by element)."""
    flat = [(r.cpu(), c.cpu()) for held in blocks for r, c in held]
    below = [0]
    for held in blocks:
        below.append(below[-1] + len(held))  # blocks of the ranks below k
    return union_numels(flat, shape, [below[k] for k in upto])


def first_held_counts(blocks: Sequence[Sequence[Tuple[Tensor, Tensor]]], shape: Tuple[int, int]) -> List[int]:
    """Per rank k (``blocks[k]``: the (rows, cols) blocks it holds of a product of 2-D ``shape``),
    how many elements it holds that no rank below k holds: |U_<=k| - |U_<k| (:func:`union_sizes`)."""
    union = union_sizes(blocks, shape, range(len(blocks) + 1))
    return [union[k + 1] - union[k] for k in range(len(blocks))]


def sole_owner_in_place(src: Tensor, rank: int) -> Tensor:
    """[N] bool, full tensors on both ends (replicated storage): the slices only ``rank``
    contributes. Their owner mean is its own value, which its full tensor already holds."""
    return src[rank] & (src.sum(0) == 1)


def passthrough_entries(entries: Sequence[Entry], src: Tensor, dst: Tensor, rank: int) -> List[int]:
    """Compact tensors on both ends (decentralized storage): the entries whose compact tensor on
    ``rank`` is already its next one, unchanged: it holds the same slices in both rounds and is the
    only rank that holds them in either. (E.g. a ResIST block that stays with its sole owner.)"""
    if not entries:
        return []
    mine_now, mine_next = src[rank], dst[rank]
    sole = (src.sum(0) == 1) & (dst.sum(0) == 1)
    ok = (~mine_now & ~mine_next) | (mine_now & mine_next & sole)
    bad, held = per_entry_count(~ok, entries), per_entry_count(mine_now, entries)
    return ((bad == 0) & (held > 0)).nonzero().flatten().tolist()


def per_entry_count(mask: Tensor, entries: Sequence[Entry]) -> Tensor:
    """int64 [len(entries)]: the True slices of each entry in an [N] bool mask."""
    c = torch.zeros(mask.numel() + 1, dtype=torch.int64)
    c[1:] = mask.cumsum(0)
    starts = torch.tensor([e.base for e in entries], dtype=torch.int64)
    ends = starts + torch.tensor([e.size for e in entries], dtype=torch.int64)
    return c[ends] - c[starts]
