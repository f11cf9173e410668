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
"""
from dataclasses import dataclass, field
from math import prod
from typing import List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor


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
class Segment:
    entry: int  # index into the entries
    index: Tensor  # int64 positions along the entry's dim, in the source (send) or target (recv)
    numel: int


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
    along entry e's dim). Raises ValueError naming the tensor on a bad index list."""
    total = entries[-1].base + entries[-1].size if entries else 0
    mask = torch.zeros(num, total, dtype=torch.bool)
    sizes = torch.tensor([e.size for e in entries], dtype=torch.int64)
    bases = torch.tensor([e.base for e in entries], dtype=torch.int64)
    for s in range(num):
        idx = [per_s[s] for per_s in owners]
        for e, i in enumerate(idx):
            if i.dtype != torch.int64 or i.dim() != 1:
                raise ValueError(f"{what}: tensor {entries[e].name!r}: owner indices of subnetwork {s} must be "
                                 f"a 1-D int64 tensor, got {i.dtype} with shape {tuple(i.shape)}")
        lens = torch.tensor([i.numel() for i in idx], dtype=torch.int64)
        if not int(lens.sum()):
            continue
        raw = torch.cat([i.cpu() for i in idx])
        lim = torch.repeat_interleave(sizes, lens)
        ok = (raw >= 0) & (raw < lim)
        inc = raw[1:] > raw[:-1]
        starts = lens.cumsum(0) - lens  # a new tensor begins at these positions
        inc[(starts[(lens > 0) & (starts > 0)] - 1)] = True
        if not bool(ok.all()) or not bool(inc.all()):
            for e, i in enumerate(idx):
                if i.numel() and (int(i.min()) < 0 or int(i.max()) >= entries[e].size or bool((i[1:] <= i[:-1]).any())):
                    raise ValueError(
                        f"{what}: tensor {entries[e].name!r}: owner indices of subnetwork {s} must be sorted, unique "
                        f"and in [0, {entries[e].size}) along dim {entries[e].dim}, got {i.tolist()[:16]}...")
        mask[s, raw + torch.repeat_interleave(bases, lens)] = True
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
    source_order: Optional[Mapping[int, Tensor]] = None,
    target_order: Optional[Mapping[int, Tensor]] = None,
) -> Routing:
    """Rank ``rank``'s messages.

    src [S, N] bool: rank k contributes slice i (its value enters the owner mean).
    dst [S, N] bool: rank q needs slice i after the exchange.
    source_held / target_held [N] bool for this rank: the slices its compact source tensors hold
    (positions along dim count only held slices) / its compact target tensors will hold; None:
    full tensors (positions are the slice indices themselves).
    keep_own [N] bool: slices this rank leaves out of its message to itself (they are already where
    they belong: see :func:`sole_owner_in_place`, :func:`passthrough_entries`).
    source_order / target_order: entry -> its held slices (entry-local ids) in the order of this
    rank's compact source / target tensor where that is not ascending (a product stored as blocks,
    ``TensorSlices.flat_ids``); positions are taken from it.
    """
    S, N = src.shape
    sizes = torch.tensor([e.size for e in entries], dtype=torch.int64)
    bases = torch.tensor([e.base for e in entries], dtype=torch.int64)
    tensor_of = torch.repeat_interleave(torch.arange(len(entries), dtype=torch.int64), sizes)
    local = torch.arange(N, dtype=torch.int64) - bases[tensor_of] if N else torch.zeros(0, dtype=torch.int64)
    src_pos = local if source_held is None else _positions(source_held, tensor_of, bases)
    dst_pos = local if target_held is None else _positions(target_held, tensor_of, bases)
    for pos, held, order in ((src_pos, source_held, source_order), (dst_pos, target_held, target_order)):
        for e, ids in (order or {}).items():
            if held is None:
                raise ValueError("routing: an order of held slices needs the held mask (compact tensors)")
            pos[bases[e] + ids] = torch.arange(ids.numel(), dtype=torch.int64)
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
