"""Owner-averaged exchange of partitioned slices between rounds (ResIST §2.5, Figure 3).

After round t, rank s holds subnetwork s of plan t (decentralized storage: only its compact tensors
and the shared ones) or the whole model (replicated storage). :class:`Exchange` gives every rank its
part of round t+1 in two collectives:

1. pack, with one ``gather_slices``, the slices every other rank needs (decentralized: the slices
   that rank owns in plan t+1; replicated: everything this rank updated), peers in rank order;
2. one ``all_to_all_single`` with per-peer split sizes (both ends know them from the plans);
3. one flat ``all_reduce`` (sum, then / S) of the shared tensors;
4. unpack with one ``scatter_slices_(reduce="mean")`` whose segments come in ascending source rank,
   so a slice owned by several subnetworks is the mean of their values taken in the same order
   as in the simulated single-process path (``scatter_slices_`` over subnetworks 0..S-1, then
   ``gather_slices`` of the next subnetwork): the partitioned part is bit-identical to it.

The shared part: ``shared="all_reduce"`` (default) sums in the backend's order (ring chunks), so
it equals the simulated mean to a few ulps (|error| <= (S-1) * eps * max|x| per element), not bit
for bit. ``shared="exact"`` moves the shared tensors through the same all-to-all (as one slice that
every subnetwork owns) and averages them with the same ``scatter_slices_``: bit-identical to the
simulated path, one collective per round, (S-1) times the shared bytes per rank instead of the
ring all-reduce's 2(S-1)/S.

Plans are never sent: every rank derives both from the shared seed.

A product in a plan (a tensor partitioned along two dims, ``TensorSlices.product``: rows x cols)
is held as its compact rows x cols tensor, or, by a rank that keeps holder blocks of it
(``SlicePlan.with_holders``), as one 1-D tensor, its blocks one after another
(``TensorSlices.stacked``). It is routed on its index lists, never element by element: what rank
k sends rank q is, per pair of a block k holds now and one q holds next, rows both hold x cols
both hold (:func:`.routing.product_pieces`), gathered with two index lists and written back with
the owners' mean per block (``ops.slices.product``); O(blocks^2 x (rows + cols)) to route. The
values and bytes equal those of the plan stated flat (``TensorSlices.flat``: one slice per
element, which is also how codecs see a product's elements). :func:`plan_bytes` and
:func:`gather_bytes` count a product from its blocks the same way.
"""
import time
from dataclasses import dataclass, field
from datetime import timedelta
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .. import functional as F
from ..ops.slices.product import gather_product, overlaps, scatter_products_
from ..partition.aggregate import aggregate_slices_
from ..partition.plan import SlicePlan, TensorSlices
from . import blockwise as B, compress as C, quantize as Q
from .blockwise import BlockCode
from .group import all_to_all_single, collective_timeout, wait_collective
from .ledger import all_reduce_wire_bytes, normalise_spec as _normalise_spec, two_stage_sent
from .routing import (
    Entry,
    Part,
    Piece,
    Routing,
    add_product,
    first_held_counts,
    first_held_parts,
    first_owner,
    held_parts,
    meet_pieces,
    owner_ids,
    passthrough_entries,
    per_entry_count,
    route,
    sole_owner_in_place,
    union_sizes,
)

Spec = Mapping[str, Union[Tensor, Tuple[Sequence[int], torch.dtype]]]

_STORAGE = ("decentralized", "replicated")
_SHARED = ("all_reduce", "exact")


@dataclass
class CommStats:
    """What one call moved, counted from the buffers passed to the collectives (this rank)."""
    round: Optional[int]
    world_size: int
    collectives: int = 0
    all_to_all_bytes_sent: int = 0  # to other ranks (the part addressed to this rank itself excluded)
    all_to_all_bytes_received: int = 0
    all_reduce_bytes: int = 0  # bytes of the flat buffer(s) passed to all_reduce
    seconds: float = 0.0
    collective_seconds: Dict[str, float] = field(default_factory=dict)
    #: of ``seconds``: copying slices into the send buffers (and quantising), and out of the
    #: receive buffers into the targets (owner means); the rest is the collectives and the routing
    pack_seconds: float = 0.0
    unpack_seconds: float = 0.0
    #: compressed averages (``compress``): bytes this rank sent / received in their two all-to-alls
    #: (they replace the ring all_reduce, whose buffer ``all_reduce_bytes`` then does not count)
    average_bytes_sent: int = 0
    average_bytes_received: int = 0
    #: per collective this call issued, ``(time.perf_counter() when issued, its seconds)``: the
    #: ranks' entries, compared, say how long each waited for the last to arrive (at most those
    #: seconds: a collective that completed before a peer entered it, e.g. gloo's point-to-point
    #: all-to-all with nothing to receive, did not wait for that peer)
    entries: List[Tuple[float, float]] = field(default_factory=list)

    def collective(self, name: str, issue, *, round, timeout: timedelta, group) -> float:
        """Issue one collective (``issue()``, async) under ``timeout`` (:func:`wait_collective`),
        noted in :attr:`entries`; returns its seconds."""
        t = time.perf_counter()
        secs = wait_collective(issue, name=name, round=round, timeout=timeout, group=group)
        self.entries.append((t, secs))
        return secs

    @property
    def all_reduce_wire_bytes(self) -> int:
        """Bytes a rank sends (and receives) in a bandwidth-optimal (ring) all-reduce of the buffer:
        2 (S - 1) / S of it."""
        return all_reduce_wire_bytes(self.all_reduce_bytes, self.world_size)

    @property
    def bytes_sent(self) -> int:
        return self.all_to_all_bytes_sent + self.all_reduce_wire_bytes + self.average_bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.all_to_all_bytes_received + self.all_reduce_wire_bytes + self.average_bytes_received


def _functional():
    if not hasattr(F, "gather_slices") or not hasattr(F, "scatter_slices_"):
        raise RuntimeError("ist_kernels.distributed needs ist_kernels.functional.gather_slices / scatter_slices_")
    return F


_SCRATCH = None


def _scratch():
    """The process's reusable exchange buffers (pack, wire, receive: at most three per dtype and
    device, each reused only when nothing views it any more). release_buffers() drops them."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = _functional().GatherBuffers(capacity=3)
    return _SCRATCH


def release_buffers() -> None:
    """Drop the buffers the exchanges keep for the next round (about one round's pack and receive
    buffers)."""
    if _SCRATCH is not None:
        _SCRATCH.clear()


class _Mover:
    """Pack -> (quantise) -> one all_to_all_single -> unpack with owner means, for one routing.

    Buffer layout: per destination rank in rank order its segments (tensors in entry order: floating
    ones first, then integer ones), then this rank's own part, which never goes on the wire.
    Quantised wire chunk per peer: [fp32 scale per floating segment][integer segments, raw in the
    buffer dtype][int8 codes of the floating segments], each part padded to the alignment.
    Compressed (``compress``, :mod:`.compress`) chunk per peer: [fp32 scale per slice of every coded
    segment (int8)][uncoded segments (integer tensors; int8: slices of one element), raw][codes:
    int8 or bf16], the chunk padded to the alignment (the padding is not counted as sent).
    """

    def __init__(self, entries: List[Entry], routing: Routing, dtype: torch.dtype):
        self.entries = entries
        self.routing = routing
        self.dtype = dtype
        self.esize = torch.empty(0, dtype=dtype).element_size()
        self.align = max(4, self.esize)
        r, S = routing.rank, routing.world_size
        self.peers = [q for q in range(S) if q != r]
        self.pack = [seg for q in self.peers for seg in routing.send[q]] + routing.send[r]
        self.wire_numel = sum(routing.send_numel[q] for q in self.peers)
        self.recv_wire_numel = sum(routing.recv_numel[k] for k in self.peers)
        self.q_send = [self._qlayout(routing.send[q]) if q != r else (0, 0, 0, 0, 0) for q in range(S)]
        self.q_recv = [self._qlayout(routing.recv[k]) if k != r else (0, 0, 0, 0, 0) for k in range(S)]
        self._blocks = self._product_blocks()
        self._on_device: Dict[torch.device, Tuple[list, list]] = {}

    def _product_blocks(self):
        """The unpack of the products, from the routing alone: per target block (entry, offset in
        its storage, height, width), the pieces written into it in ascending source rank, each as
        (from this rank's own part, start in that buffer, rows, cols), and whether two of them
        share an element (decided here, on the host: the write-back never asks the device)."""
        r, S = self.routing.rank, self.routing.world_size
        blocks: Dict[Tuple[int, int], Tuple[int, int, list]] = {}
        recv_off = 0
        for k in range(S):
            off = 0 if k == r else recv_off
            for seg in self.routing.recv[k]:
                if seg.pieces is not None:
                    at = off
                    for p in seg.pieces:
                        blocks.setdefault((seg.entry, p.offset), (p.height, p.width, []))[2].append(
                            (k == r, at, p.rows, p.cols))
                        at += p.numel
                off += seg.numel
            if k != r:
                recv_off = off
        return [(entry, offset, h, w, pieces, overlaps([(p[2], p[3]) for p in pieces], (h, w)))
                for (entry, offset), (h, w, pieces) in blocks.items()]

    def _device_pieces(self, device) -> Tuple[list, list]:
        """The products' index lists on ``device``, moved once per mover and device (one copy of
        them all): per pack segment with pieces its [(piece, rows, cols)], per target block its
        [(rows, cols)] (``_blocks``' order)."""
        device = torch.device(device)
        if device not in self._on_device:
            host = [x for s in self.pack if s.pieces is not None for p in s.pieces for x in (p.rows, p.cols)]
            host += [x for b in self._blocks for _, _, rows, cols in b[4] for x in (rows, cols)]
            moved = iter(torch.split(torch.cat(host).to(device), [x.numel() for x in host]) if host else ())
            pack = [[(p, next(moved), next(moved)) for p in s.pieces] for s in self.pack if s.pieces is not None]
            unpack = [[(next(moved), next(moved)) for _ in b[4]] for b in self._blocks]
            self._on_device[device] = (pack, unpack)
        return self._on_device[device]

    def _qlayout(self, segs):
        """(bytes, scales, raw integer part offset, codes offset, floating elements) of one chunk."""
        pad = lambda n: (n + self.align - 1) // self.align * self.align  # noqa: E731
        n_f = sum(1 for s in segs if not self.entries[s.entry].integral)
        f_el = sum(s.numel for s in segs if not self.entries[s.entry].integral)
        i_el = sum(s.numel for s in segs if self.entries[s.entry].integral)
        raw = pad(4 * n_f)
        codes = raw + pad(self.esize * i_el)
        return pad(codes + f_el), n_f, raw, codes, f_el

    def coded(self, e: Entry, compress) -> bool:
        if isinstance(compress, BlockCode):  # an optimizer moment's partitioned slices (a shared one: exact)
            return not e.integral and not e.shared and compress.coded(e.slice_numel, self.esize)
        return C.coded(compress, e.slice_numel, not e.integral)

    def _scale_count(self, e: Entry, s, compress) -> int:
        """fp32 scales of coded segment ``s``: int8, one a slice; a block code, one a block of a slice."""
        n = s.index.numel()
        if isinstance(compress, BlockCode):
            return n * compress.scales(e.slice_numel)
        return n if compress == "int8" else 0

    def _code_bytes(self, e: Entry, s, compress) -> int:
        """Bytes of coded segment ``s``'s codes."""
        if isinstance(compress, BlockCode):
            return s.index.numel() * compress.code_bytes(e.slice_numel)
        return C.code_bytes(compress) * s.numel

    @staticmethod
    def _rows(v: Tensor, e: Entry, s) -> Tensor:
        """Segment ``s``'s flat values ``v`` as [its slices, values of a slice] (each slice in
        row-major order of the other dims: the order :mod:`.blockwise` codes a slice in)."""
        return B.slices(v.view(e.compact_shape(s.index.numel())), e.dim)

    @staticmethod
    def _set_rows(v: Tensor, e: Entry, s, rows: Tensor) -> None:
        """Write [slices, values] ``rows`` back into segment ``s``'s flat values ``v``."""
        x3 = C.view3(v.view(e.compact_shape(s.index.numel())), e.dim)
        x3.copy_(rows.view(s.index.numel(), x3.shape[0], x3.shape[2]).transpose(0, 1))

    def _clayout(self, segs, compress):
        """(wire size, payload bytes, raw part offset, codes offset) of one compressed chunk:
        [fp32 scale per coded slice (int8) or block of a slice (a block code)][pad to the dtype]
        [uncoded segments, raw in the buffer dtype][codes]."""
        n_sc = raw_el = code_b = 0
        for s in segs:
            e = self.entries[s.entry]
            if self.coded(e, compress):
                code_b += self._code_bytes(e, s, compress)
                n_sc += self._scale_count(e, s, compress)
            else:
                raw_el += s.numel
        # the raw part starts at a multiple of its element size (after an odd count of fp32 scales a
        # float64 view would be misaligned); the padding is not payload
        raw = (C.SCALE_BYTES * n_sc + self.esize - 1) // self.esize * self.esize
        codes = raw + self.esize * raw_el
        payload = C.SCALE_BYTES * n_sc + self.esize * raw_el + code_b
        end = codes + code_b
        return (end + self.align - 1) // self.align * self.align, payload, raw, codes

    def _encode(self, send: Tensor, compress: str, device) -> Tuple[Tensor, List[int], List[int]]:
        """Compressed: the wire buffer of every peer's chunk; ``send``'s own part (this rank's copy)
        left as its receivers decode it. Returns (wire, split sizes, payload bytes) per rank."""
        r, S = self.routing.rank, self.routing.world_size
        views = torch.split(send, [s.numel for s in self.pack])
        block = isinstance(compress, BlockCode)
        scales: List[Optional[Tensor]] = []
        codes_of: Dict[int, Tensor] = {}  # a block code's packed codes of each coded segment
        for j, s in enumerate(self.pack):  # codes in place (int8), one scale per slice
            e = self.entries[s.entry]
            if block and self.coded(e, compress):
                sc, codes_of[j] = B.encode(self._rows(views[j], e, s), compress)
                scales.append(sc.reshape(-1))
            elif compress == "int8" and self.coded(e, compress):
                x3 = C.view3(views[j].view(e.compact_shape(s.index.numel())), e.dim)
                sc = C.scales_of(x3)
                C.to_codes_(x3, sc)
                scales.append(sc)
            else:
                scales.append(None)
        lay = {q: self._clayout(self.routing.send[q], compress) for q in self.peers}
        wire = _scratch().take(sum(lay[q][0] for q in self.peers), torch.uint8, device)
        off = j = 0
        for q in self.peers:
            size, payload, raw, codes = lay[q]
            chunk = wire[off:off + size]
            sc_off, raw_off, code_off = 0, raw, codes
            for s in self.routing.send[q]:
                e, v = self.entries[s.entry], views[j]
                if not self.coded(e, compress):
                    chunk[raw_off:raw_off + self.esize * s.numel].view(self.dtype).copy_(v)
                    raw_off += self.esize * s.numel
                elif block:
                    k, nb = scales[j].numel(), codes_of[j].numel()
                    chunk[sc_off:sc_off + C.SCALE_BYTES * k].view(torch.float32).copy_(scales[j])
                    chunk[code_off:code_off + nb].copy_(codes_of[j].reshape(-1))
                    sc_off, code_off = sc_off + C.SCALE_BYTES * k, code_off + nb
                elif compress == "int8":
                    k = scales[j].numel()
                    chunk[sc_off:sc_off + C.SCALE_BYTES * k].view(torch.float32).copy_(scales[j])
                    chunk[code_off:code_off + s.numel].view(torch.int8).copy_(v)
                    sc_off, code_off = sc_off + C.SCALE_BYTES * k, code_off + s.numel
                else:
                    chunk[code_off:code_off + 2 * s.numel].view(torch.bfloat16).copy_(v)
                    code_off += 2 * s.numel
                j += 1
            off += size
        for s in self.routing.send[r]:  # this rank's own copy: decoded as its receivers decode it
            e, v = self.entries[s.entry], views[j]
            if self.coded(e, compress):
                if block:
                    self._set_rows(v, e, s, B.decode(scales[j], codes_of[j], e.slice_numel, compress))
                elif compress == "int8":
                    C.from_codes_(C.view3(v.view(e.compact_shape(s.index.numel())), e.dim), scales[j])
                else:
                    v.copy_(v.to(torch.bfloat16))
            j += 1
        splits = [lay[q][0] if q != r else 0 for q in range(S)]
        pays = [lay[q][1] if q != r else 0 for q in range(S)]
        return wire, splits, pays

    def _decode(self, out: Tensor, compress: str, device) -> Tuple[Tensor, List[int], List[int]]:
        """Compressed: the received chunks decoded into one flat buffer in rank order."""
        r, S = self.routing.rank, self.routing.world_size
        recv = _scratch().take(self.recv_wire_numel, self.dtype, device)
        lay = {k: self._clayout(self.routing.recv[k], compress) for k in self.peers}
        off = el = 0
        for k in self.peers:
            size, payload, raw, codes = lay[k]
            chunk = out[off:off + size]
            sc_off, raw_off, code_off = 0, raw, codes
            for s in self.routing.recv[k]:
                e, v = self.entries[s.entry], recv[el:el + s.numel]
                if not self.coded(e, compress):
                    v.copy_(chunk[raw_off:raw_off + self.esize * s.numel].view(self.dtype))
                    raw_off += self.esize * s.numel
                elif isinstance(compress, BlockCode):
                    k, nb = self._scale_count(e, s, compress), self._code_bytes(e, s, compress)
                    n = s.index.numel()
                    sc = chunk[sc_off:sc_off + C.SCALE_BYTES * k].view(torch.float32).view(n, -1)
                    self._set_rows(v, e, s, B.decode(sc, chunk[code_off:code_off + nb].view(n, -1),
                                                     e.slice_numel, compress))
                    sc_off, code_off = sc_off + C.SCALE_BYTES * k, code_off + nb
                elif compress == "int8":
                    n = s.index.numel()
                    sc = chunk[sc_off:sc_off + C.SCALE_BYTES * n].view(torch.float32)
                    v.copy_(chunk[code_off:code_off + s.numel].view(torch.int8))
                    C.from_codes_(C.view3(v.view(e.compact_shape(n)), e.dim), sc)
                    sc_off, code_off = sc_off + C.SCALE_BYTES * n, code_off + s.numel
                else:
                    v.copy_(chunk[code_off:code_off + 2 * s.numel].view(torch.bfloat16))
                    code_off += 2 * s.numel
                el += s.numel
            off += size
        splits = [lay[k][0] if k != r else 0 for k in range(S)]
        pays = [lay[k][1] if k != r else 0 for k in range(S)]
        return recv, splits, pays

    def _indices(self, device):
        """The index lists of the pack and unpack (segments along one dim), kept on the host whatever
        ``device`` is: the slice ops read CPU index lists without waiting for the device (no
        device->host sync in a round)."""
        return ([s.index.cpu() for s in self.pack if s.pieces is None],
                [[s.index.cpu() for s in segs if s.pieces is None] for segs in self.routing.recv])

    def _pack(self, send: Tensor, sources: Dict[int, Tensor], pack_idx: List[Tensor], device) -> None:
        """Gather every pack segment into ``send``, in pack order: the segments along one dim with
        one ``gather_slices`` launch per run of them (one in all where no product is routed), a
        product's pieces each with :func:`~ist_kernels.ops.slices.product.gather_product`."""
        F = _functional()
        flat = [j for j, s in enumerate(self.pack) if s.pieces is None]
        entries = sorted({self.pack[j].entry for j in flat})
        src_list = [sources[e] if not self.entries[e].integral else
                    _as_buffer(sources[e], self.dtype, self.entries[e].name, "Exchange") for e in entries]
        src_pos = {e: i for i, e in enumerate(entries)}
        dims = [self.entries[e].dim for e in entries]
        if len(flat) == len(self.pack):
            F._gather_flat(src_list, [src_pos[s.entry] for s in self.pack], pack_idx, dims, out=send)
            return
        offs = [0]
        for s in self.pack:
            offs.append(offs[-1] + s.numel)
        pieces = iter(self._device_pieces(device)[0])
        k = 0  # position in pack_idx (flat segments only)
        j = 0
        while j < len(self.pack):
            s = self.pack[j]
            if s.pieces is not None:
                _gather_pieces(sources[s.entry], next(pieces), send[offs[j]:offs[j + 1]])
                j += 1
                continue
            end = j
            while end < len(self.pack) and self.pack[end].pieces is None:
                end += 1
            F._gather_flat(src_list, [src_pos[x.entry] for x in self.pack[j:end]], pack_idx[k:k + end - j], dims,
                           out=send[offs[j]:offs[end]])
            k, j = k + end - j, end

    def run(self, sources: Dict[int, Tensor], targets: Dict[int, Tensor], *, quantize: bool, device,
            name: str, round: Optional[int], group, timeout: timedelta, stats: CommStats,
            compress: Optional[str] = None) -> None:
        """sources: entry -> this rank's tensor, viewed as the entry's compact shape;
        targets: entry -> tensor to write the owner means into (same views, own dtype).
        compress: None, "bf16" or "int8" (per slice, :mod:`.compress`; replaces ``quantize``)."""
        t_pack = time.perf_counter()
        r, S = self.routing.rank, self.routing.world_size
        pack_idx, recv_idx = self._indices(device)
        scratch = _scratch()
        if self.pack:  # the pack, wire and receive buffers never leave run(): reused across rounds
            send = scratch.take(sum(s.numel for s in self.pack), self.dtype, device)
            self._pack(send, sources, pack_idx, device)
        else:
            send = torch.empty(0, dtype=self.dtype, device=device)
        own = send[self.wire_numel:]

        if compress is not None:
            wire, in_splits, sent_pay = self._encode(send, compress, device)
            out = scratch.take(sum(self._clayout(self.routing.recv[k], compress)[0] for k in self.peers),
                               torch.uint8, device)
            out_splits = [self._clayout(self.routing.recv[k], compress)[0] if k != r else 0 for k in range(S)]
            esize = 1
        elif quantize:
            # one scale per (this rank, tensor) over everything it sends of that tensor; its own
            # part is dequantised too, so every copy of a slice ends up equal on every rank
            views = torch.split(send, [s.numel for s in self.pack])
            fl = [j for j, s in enumerate(self.pack) if not self.entries[s.entry].integral]
            seg_entry = torch.tensor([self.pack[j].entry for j in fl], dtype=torch.int64, device=device)
            fviews = [views[j] for j in fl]
            scales = Q.segment_scales(fviews, seg_entry, len(self.entries))
            Q.quantize_(fviews, scales)  # send's floating segments now hold the codes, as floats
            n_own = sum(1 for s in self.routing.send[r] if not self.entries[s.entry].integral)
            Q.dequantize_(fviews[len(fviews) - n_own:], scales[len(fviews) - n_own:])
            wire = scratch.take(sum(c[0] for c in self.q_send), torch.uint8, device)
            off = f_seg = el = 0
            for q in self.peers:
                size, n_f, raw, codes, f_el = self.q_send[q]
                i_el = self.routing.send_numel[q] - f_el
                chunk = wire[off:off + size]
                chunk[:4 * n_f].view(torch.float32).copy_(scales[f_seg:f_seg + n_f])
                chunk[raw:raw + self.esize * i_el].view(self.dtype).copy_(send[el + f_el:el + f_el + i_el])
                chunk[codes:codes + f_el].view(torch.int8).copy_(send[el:el + f_el])
                off, f_seg, el = off + size, f_seg + n_f, el + f_el + i_el
            out = scratch.take(sum(c[0] for c in self.q_recv), torch.uint8, device)
            in_splits, out_splits, esize = [c[0] for c in self.q_send], [c[0] for c in self.q_recv], 1
        else:
            wire = send[:self.wire_numel]
            out = scratch.take(self.recv_wire_numel, self.dtype, device)
            in_splits = [self.routing.send_numel[q] if q != r else 0 for q in range(S)]
            out_splits = [self.routing.recv_numel[k] if k != r else 0 for k in range(S)]
            esize = self.esize

        stats.pack_seconds += time.perf_counter() - t_pack
        stats.collective_seconds[name] = stats.collective_seconds.get(name, 0.0) + stats.collective(
            name, lambda: all_to_all_single(out, wire, out_splits, in_splits, group=group),
            round=round, timeout=timeout, group=group)  # one mover per dtype: summed
        t_unpack = time.perf_counter()
        stats.collectives += 1
        if compress is not None:  # the payload (a chunk's alignment padding is not counted)
            recv, _, recv_pay = self._decode(out, compress, device)
            stats.all_to_all_bytes_sent += sum(sent_pay)
            stats.all_to_all_bytes_received += sum(recv_pay)
        else:
            stats.all_to_all_bytes_sent += sum(in_splits) * esize
            stats.all_to_all_bytes_received += sum(out_splits) * esize

        if compress is not None:
            pass
        elif quantize:  # decode every peer's chunk into one flat buffer in rank order
            recv = scratch.take(self.recv_wire_numel, self.dtype, device)
            off = el = 0
            scales_in, fviews = [], []
            for k in self.peers:
                size, n_f, raw, codes, f_el = self.q_recv[k]
                i_el = self.routing.recv_numel[k] - f_el
                chunk = out[off:off + size]
                scales_in.append(chunk[:4 * n_f].view(torch.float32))
                recv[el:el + f_el].copy_(chunk[codes:codes + f_el].view(torch.int8))
                recv[el + f_el:el + f_el + i_el].copy_(chunk[raw:raw + self.esize * i_el].view(self.dtype))
                fviews += list(torch.split(recv[el:el + f_el], [s.numel for s in self.routing.recv[k]
                                                                 if not self.entries[s.entry].integral]))
                off, el = off + size, el + f_el + i_el
            Q.dequantize_(fviews, torch.cat(scales_in) if scales_in else torch.zeros(0, device=device))
        else:
            recv = out

        # unpack: segments from ranks 0..S-1 in order (this rank's own part taken from `own`),
        # aggregated as the simulated path does (floating: owner means; integer counters, which
        # travel as exact floats, back in their dtype: the owners' maximum)
        flat_targets = sorted({s.entry for segs in self.routing.recv for s in segs if s.pieces is None})
        tgt_list = [targets[e] for e in flat_targets]
        tgt_pos = {e: i for i, e in enumerate(flat_targets)}
        updates, ids, idx = [], [], []
        recv_off = 0
        for k in range(S):
            buf, off = (own, 0) if k == r else (recv, recv_off)
            flat_idx = iter(recv_idx[k])
            for seg in self.routing.recv[k]:
                e = self.entries[seg.entry]
                if seg.pieces is not None:  # the products' pieces: below, per target block
                    off += seg.numel
                    continue
                index = next(flat_idx)
                u = buf[off:off + seg.numel].view(e.compact_shape(index.numel()))
                updates.append(u.to(e.dtype) if e.integral else u)
                ids.append(tgt_pos[seg.entry])
                idx.append(index)
                off += seg.numel
            if k != r:
                recv_off = off
        if updates:
            aggregate_slices_(tgt_list, ids, updates, idx, [self.entries[e].dim for e in flat_targets])
        for (entry, offset, h, w, pieces, overlap), index in zip(self._blocks, self._device_pieces(device)[1]):
            ups = [(own if mine else recv)[at:at + rows.numel() * cols.numel()].view(rows.numel(), cols.numel())
                   for mine, at, rows, cols in pieces]  # owners in ascending source rank
            scatter_products_(targets[entry][offset:offset + h * w].view(h, w), (0, 1), index, ups, "mean", overlap)
        stats.unpack_seconds += time.perf_counter() - t_unpack


def _gather_pieces(source: Tensor, pieces, out: Tensor) -> None:
    """A product segment: ``pieces`` (piece, its rows and cols on the device) of ``source`` (a rank's
    compact 1-D storage) into ``out``, one after another, each row-major."""
    at = 0
    for p, rows, cols in pieces:
        block = source[p.offset:p.offset + p.height * p.width].view(p.height, p.width)
        gather_product(block, (0, 1), (rows, cols), out[at:at + p.numel].view(rows.numel(), cols.numel()))
        at += p.numel


def _all_reduce_mean_(tensors: List[Tensor], *, name: str, round, group, timeout, stats: CommStats) -> None:
    """Average ``tensors`` over the group in place: one flat all_reduce per dtype (sum, then / S)."""
    S = dist.get_world_size(group)
    by_dtype: Dict[torch.dtype, List[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        if not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"{name}: can only average floating tensors, got {dtype}")
        t_pack = time.perf_counter()
        flat = torch.cat([t.reshape(-1) for t in ts])
        stats.pack_seconds += time.perf_counter() - t_pack
        stats.collective_seconds[name] = stats.collective_seconds.get(name, 0.0) + stats.collective(
            name, lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True),
            round=round, timeout=timeout, group=group)
        stats.collectives += 1
        stats.all_reduce_bytes += flat.numel() * flat.element_size()
        t_unpack = time.perf_counter()
        flat.div_(S)
        views = list(torch.split(flat, [t.numel() for t in ts]))
        torch._foreach_copy_(ts, [v.view(t.shape) for v, t in zip(views, ts)])
        stats.unpack_seconds += time.perf_counter() - t_unpack


def _compressed_mean_(tensors: List[Tensor], compress: str, *, name: str, round, group, timeout,
                      stats: CommStats) -> None:
    """Average ``tensors`` over the group in place, compressed (:mod:`.compress`): per dtype, the
    flat buffer cut into S chunks; one all_to_all_single sends every rank its chunk of this rank's
    values, encoded; each rank decodes the S copies of its chunk, sums them in rank order, divides
    by S and encodes the mean; a second all_to_all_single sends it to every other rank. Equal to
    :func:`ist_kernels.distributed.compress.two_stage_mean` of the ranks' buffers bit for bit."""
    S, r = dist.get_world_size(group), dist.get_rank(group)
    by_dtype: Dict[torch.dtype, List[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        if not dtype.is_floating_point:
            raise TypeError(f"{name}: can only average floating tensors, got {dtype}")
        t_pack = time.perf_counter()
        sizes = [t.numel() for t in ts]
        flat = torch.cat([t.reshape(-1) for t in ts])
        chunks = C.chunk_segments(sizes, S)
        lo = [segs[0][0] if segs else 0 for segs in chunks]
        hi = [segs[-1][1] if segs else 0 for segs in chunks]
        pay = [C.chunk_payload(segs, compress) for segs in chunks]
        enc = {q: C.encode_chunk(flat[lo[q]:hi[q]], chunks[q], compress, lo[q]) for q in range(S) if q != r}
        C.fake_segments_(flat[lo[r]:hi[r]], chunks[r], compress, lo[r])  # this rank's own copy
        wire = torch.cat([enc[q] for q in range(S) if q != r]) if S > 1 else torch.zeros(0, dtype=torch.uint8)
        in_splits = [enc[q].numel() if q != r else 0 for q in range(S)]
        out_splits = [C.padded(pay[r]) if k != r else 0 for k in range(S)]
        out = torch.empty(sum(out_splits), dtype=torch.uint8, device=flat.device)
        stats.pack_seconds += time.perf_counter() - t_pack
        secs = stats.collective(f"{name}, stage 1 of 2",
                                lambda: all_to_all_single(out, wire, out_splits, in_splits, group=group),
                                round=round, timeout=timeout, group=group)
        t_mid = time.perf_counter()
        mine, off = flat[lo[r]:hi[r]], 0
        acc = None
        for k in range(S):  # the S copies of this rank's chunk, summed in rank order
            if k == r:
                v = mine
            else:
                v = C.decode_chunk(out[off:off + out_splits[k]], chunks[r], compress, torch.empty_like(mine), lo[r])
                off += out_splits[k]
            acc = v.clone() if acc is None else acc.add_(v)
        acc.div_(S)
        own = C.encode_chunk(acc, chunks[r], compress, lo[r])  # acc: now as the others decode it
        wire2 = own.repeat(S - 1)
        in2 = [own.numel() if q != r else 0 for q in range(S)]
        out2_splits = [C.padded(pay[k]) if k != r else 0 for k in range(S)]
        out2 = torch.empty(sum(out2_splits), dtype=torch.uint8, device=flat.device)
        mid = time.perf_counter() - t_mid
        secs += stats.collective(f"{name}, stage 2 of 2",
                                 lambda: all_to_all_single(out2, wire2, out2_splits, in2, group=group),
                                 round=round, timeout=timeout, group=group)
        t_unpack = time.perf_counter()
        flat[lo[r]:hi[r]].copy_(acc)
        off = 0
        for k in range(S):
            if k != r:
                C.decode_chunk(out2[off:off + out2_splits[k]], chunks[k], compress, flat[lo[k]:hi[k]], lo[k])
                off += out2_splits[k]
        views = list(torch.split(flat, sizes))
        torch._foreach_copy_(ts, [v.view(t.shape) for v, t in zip(views, ts)])
        stats.collective_seconds[name] = stats.collective_seconds.get(name, 0.0) + secs
        stats.collectives += 2
        stats.average_bytes_sent += two_stage_sent(pay, r)
        stats.average_bytes_received += two_stage_sent(pay, r)
        stats.unpack_seconds += time.perf_counter() - t_unpack + mid


def _plan_masks(plan: SlicePlan, spec, S: int, shared_as_slice: bool, what: str):
    """The all-to-all entries of a plan (partitioned tensors, plus the shared ones as one slice each
    when shared_as_slice; floating tensors first, then integer ones) and its [S, N] owner mask.

    Integer partitioned tensors (e.g. the BN step counters of a ResIST block) travel with their
    block, as exact integers in the floating buffer; integer shared tensors are counters that every
    rank keeps as they are. A 0-d tensor is one slice (viewed as [1]). Products are left out: they
    are routed and counted on their blocks (:func:`_product_entries`, :func:`_product_bytes`)."""
    missing = [t.name for t in plan.tensors if t.name not in spec]
    if missing:
        raise KeyError(f"spec lacks tensors of the {what} plan: {missing[:8]}")
    found = []
    everyone = [torch.zeros(1, dtype=torch.int64)] * S
    for t in plan.tensors:
        shape, dtype = spec[t.name]
        if t.shared:
            if not shared_as_slice or not dtype.is_floating_point:
                continue
            found.append((Entry(t.name, 0, (1, prod(shape)), shape, dtype, True), everyone))
            continue
        if t.product:  # routed on its blocks (_product_entries, routing.product_pieces), not in the masks
            continue
        if not shape:
            if t.dim not in (0, -1):
                raise ValueError(f"the {what} plan partitions the scalar {t.name!r} along dim {t.dim}; use 0")
            e = Entry(t.name, 0, (1,), shape, dtype, False)
        elif not -len(shape) <= t.dim < len(shape):
            raise ValueError(f"the {what} plan partitions {t.name!r} of shape {shape} along dim {t.dim}, "
                             f"which it does not have")
        else:
            e = Entry(t.name, t.dim % len(shape), shape, shape, dtype, False)
        found.append((e, [o.cpu() for o in t.owners]))
    found = [f for f in found if not f[0].integral] + [f for f in found if f[0].integral]
    base = 0
    for e, _ in found:
        e.base = base
        base += e.size
    entries = [e for e, _ in found]
    return entries, owner_ids(entries, [o for _, o in found], S, f"the {what} plan")


def _product_shapes(plan: Optional[SlicePlan], rank: int) -> Dict[str, Tuple[int, ...]]:
    """name -> the compact shape ``rank`` holds of every product of ``plan``: (rows, cols), or
    (elements,) where it keeps holder blocks (``TensorSlices.stacked``)."""
    if plan is None:
        return {}
    return {t.name: (t.count(rank),) if t.stacked(rank) else (t.owners[rank].numel(), t.cols[rank].numel())
            for t in plan.tensors if t.product}


def _check_floating_product(t: TensorSlices, dtype: torch.dtype, what: str) -> None:
    if not dtype.is_floating_point:
        raise ValueError(f"the {what} plan partitions the integer tensor {t.name!r} as a product; only "
                         "floating tensors can be")


def _product_entries(plan: SlicePlan, spec, what: str) -> List[Tuple[Entry, TensorSlices]]:
    """The products of ``plan`` as all-to-all entries (each viewed flat, one slice per element:
    codecs and byte counts see what the plan stated flat would move) with their plan tensors."""
    out = []
    for t in plan.tensors:
        if not t.product:
            continue
        shape, dtype = spec[t.name]
        _check_floating_product(t, dtype, what)
        if len(shape) != 2 or (t.dim % 2, t.col_dim % 2) != (0, 1):
            raise ValueError(f"the {what} plan partitions {t.name!r} of shape {list(shape)} as a product along "
                             f"dims ({t.dim}, {t.col_dim}); the exchange moves products of 2-D tensors along (0, 1)")
        out.append((Entry(t.name, 0, (prod(shape),), shape, dtype, False), t))
    return out


def _first_held(t: TensorSlices, shape) -> List[int]:
    """Per rank k, how many elements of product ``t`` (2-D ``shape``) k holds that no rank below k
    holds (the copies :func:`gather_full_model` takes from k with reduce="copy"), from the blocks."""
    return first_held_counts([t.blocks(k) for k in range(len(t.owners))], shape)


def _same_blocks(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for p, q in zip(a, b) for x, y in zip(p, q))


def _check_products_covered(products, what: str, hint: str) -> None:
    for e, t in products:
        S = len(t.owners)
        hole = e.size - union_sizes([t.blocks(k) for k in range(S)], e.real_shape, [S])[0]
        if hole:
            raise ValueError(f"{what} {hole} elements of the product {e.name!r} have no owner, and no rank would "
                             f"hold them; {hint}")


def _buffer_dtype(entries: List[Entry], who: str) -> torch.dtype:
    """The one floating dtype of the all-to-all buffer (float64 when only integers travel)."""
    floats = sorted({e.dtype for e in entries if not e.integral}, key=str)
    if len(floats) > 1:
        raise TypeError(f"{who}: the tensors moved through the all-to-all must share one floating dtype "
                        f"(one buffer), got {floats}; exchange each dtype's tensors in a separate call (names=...)")
    return floats[0] if floats else torch.float64


def _as_buffer(t: Tensor, dtype: torch.dtype, name: str, who: str) -> Tensor:
    """An integer tensor as exact floats of the buffer dtype (checked: |v| <= 1 / eps)."""
    limit = 1 / torch.finfo(dtype).eps
    if t.numel() and int(t.abs().max()) > limit:
        raise ValueError(f"{who}: integer tensor {name!r} holds values beyond {limit:g}, which {dtype} cannot "
                         f"carry exactly; exchange it in a separate call (names=...), which moves it in float64")
    return t.to(dtype)


def _check_covered(entries: List[Entry], mask: Tensor, what: str, hint: str) -> None:
    hole = (~mask.any(0)).nonzero().flatten()
    if hole.numel():
        i = int(hole[0])
        e = max((x for x in entries if x.base <= i), key=lambda x: x.base)
        raise ValueError(f"{what} slice {i - e.base} along dim {e.dim} of {e.name!r} ({hole.numel()} slices in "
                         f"all) has no owner, and no rank would hold it; {hint}")


def plan_fingerprint(plan: SlicePlan) -> int:
    """A 32-bit checksum of a plan (names, dims, owner indices), equal on ranks that derived the same plan."""
    import ctypes
    import zlib

    h = zlib.crc32(repr((plan.num_subnetworks, [(t.name, t.dims, [len(b) for b in t.holds]) for t in plan.tensors])).encode())
    for t in plan.partitioned:
        for o in t.owners + t.cols + tuple(x for blocks in t.holds for b in blocks for x in b):
            o = o.detach().to("cpu", torch.int64).contiguous()
            h = zlib.crc32(ctypes.string_at(o.data_ptr(), o.nbytes), h)  # the raw bytes, without numpy
            h = zlib.crc32(b"|", h)
    return h


def _bytes_matrix(entries: List[Entry], src: Tensor, dst: Tensor, chosen, compress: Optional[str] = None,
                  esize: Optional[int] = None) -> Tensor:
    """[S, S] float64: bytes rank k sends rank q when k contributes ``src[k]`` and q needs ``dst[q]``
    (the diagonal is a rank's message to itself, which never goes on the wire); ``compress``: each
    slice encoded (:func:`.compress.slice_bytes`)."""
    w = torch.zeros(src.shape[1], dtype=torch.float64)
    picked = [e for e in entries if e.name in chosen]
    if esize is None:
        esize = torch.empty(0, dtype=_buffer_dtype(picked, "plan_bytes")).element_size() if picked else 0
    for e in picked:
        w[e.base:e.base + e.size] = C.slice_bytes(compress, e.slice_numel, esize, not e.integral)
    return (src.double() * w) @ dst.double().T


def _product_bytes(current: SlicePlan, next: Optional[SlicePlan], spec, chosen, esize: int,
                   compress: Optional[str]) -> Tensor:
    """[S, S] float64: the bytes of the chosen products rank k sends rank q (as
    :func:`_bytes_matrix` counts them on the flat view, one slice per element), from the blocks:
    the elements k holds now and q next are the union over block pairs of (rows meeting) x (cols
    meeting), the blocks of one rank disjoint; ``next`` None: q needs every element (replicated).
    O(S^2 x blocks^2 x (rows + cols))."""
    S = current.num_subnetworks
    M = torch.zeros(S, S, dtype=torch.float64)
    nxt = {t.name: t for t in next.tensors} if next is not None else {}
    for t in current.tensors:
        if not t.product or t.name not in chosen:
            continue
        w = C.slice_bytes(compress, 1, esize, True)
        if next is None:
            M += torch.tensor([float(t.count(k)) * w for k in range(S)], dtype=torch.float64).unsqueeze(1)
            continue
        shape = spec[t.name][0]
        u = nxt[t.name]
        marks = []  # per rank k: its blocks' rows and cols as [blocks, n] marks
        for k in range(S):
            bl = t.blocks(k)
            r = torch.zeros(len(bl), shape[t.dim], dtype=torch.float64)
            c = torch.zeros(len(bl), shape[t.col_dim], dtype=torch.float64)
            for i, (rows, cols) in enumerate(bl):
                r[i, rows.cpu()] = 1
                c[i, cols.cpu()] = 1
            marks.append((r, c))
        for q in range(S):
            for rows, cols in u.blocks(q):
                if not rows.numel() or not cols.numel():
                    continue
                for k, (r, c) in enumerate(marks):
                    M[k, q] += float((r[:, rows.cpu()].sum(1) * c[:, cols.cpu()].sum(1)).sum()) * w
    return M


def plan_bytes(current: SlicePlan, next: Optional[SlicePlan], spec: Spec, *, storage: str = "decentralized",
               shared: str = "all_reduce", names: Optional[Sequence[str]] = None,
               compress: Optional[str] = None) -> List[CommStats]:
    """What every rank's :class:`Exchange` call will move, from the plans alone (no process group):
    one CommStats per rank (bytes without ``quantize``; with the Exchange's ``compress``; ``seconds`` 0)."""
    if storage not in _STORAGE or shared not in _SHARED:
        raise ValueError(f"plan_bytes: storage in {_STORAGE}, shared in {_SHARED}")
    compress = C.check(compress, "plan_bytes")
    spec = _normalise_spec(spec)
    S = current.num_subnetworks
    chosen = set(names if names is not None else current.names())
    entries, cur = _plan_masks(current, spec, S, shared == "exact", "current")
    if storage == "decentralized":
        if next is None:
            raise ValueError("plan_bytes: decentralized storage needs the next plan")
        dst = _plan_masks(next, spec, S, shared == "exact", "next")[1]
    else:
        dst = torch.ones_like(cur)
    products = [t for t in current.tensors if t.product and t.name in chosen]
    for t in products:
        _check_floating_product(t, spec[t.name][1], "current")
    picked = [e.dtype for e in entries if e.name in chosen] + [spec[t.name][1] for t in products]
    floats = sorted({d for d in picked if d.is_floating_point}, key=str)
    if len(floats) > 1:
        raise TypeError(f"plan_bytes: the tensors moved through the all-to-all must share one floating dtype "
                        f"(one buffer), got {floats}; exchange each dtype's tensors in a separate call (names=...)")
    esize = torch.empty(0, dtype=floats[0] if floats else torch.float64).element_size()
    M = _bytes_matrix(entries, cur, dst, chosen, compress, esize)
    if products:
        M = M + _product_bytes(current, next if storage == "decentralized" else None, spec, chosen, esize, compress)
    diag = M.diagonal()
    sent, recv = (M.sum(1) - diag).tolist(), (M.sum(0) - diag).tolist()
    ar_bytes, ar_sizes = 0, {}
    if shared == "all_reduce":
        for t in current.shared:
            shape, dtype = spec[t.name]
            if t.name in chosen and dtype.is_floating_point:
                ar_bytes += prod(shape) * torch.empty(0, dtype=dtype).element_size()
                ar_sizes.setdefault(dtype, []).append(prod(shape))
    a2a = 1 if products or any(e.name in chosen for e in entries) else 0
    if compress is None:
        return [CommStats(None, S, a2a + len(ar_sizes), int(sent[r]), int(recv[r]), ar_bytes) for r in range(S)]
    avg = [0] * S  # the two-stage compressed average of the shared tensors (per dtype)
    for sizes in ar_sizes.values():
        avg = [a + b for a, b in zip(avg, C.two_stage_bytes(sizes, S, compress))]
    return [CommStats(None, S, a2a + 2 * len(ar_sizes), int(sent[r]), int(recv[r]), 0,
                      average_bytes_sent=avg[r], average_bytes_received=avg[r]) for r in range(S)]


def _gather_masks(plan: SlicePlan, spec, S: int, dst: int, reduce: str, who: str):
    """(entries, held [S, N], contributes [S, N], needs [S, N]) of assembling ``plan``'s full model
    on ``dst`` (products left out: :func:`_product_entries`)."""
    entries, cur = _plan_masks(plan, spec, S, True, "gathered")
    _check_covered(entries, cur, f"{who}: in the plan", "the full model cannot be assembled")
    src = cur
    if reduce == "copy":
        src = first_owner(cur)
        for e in entries:
            if e.shared:
                src[:, e.base] = False
                src[dst, e.base] = True
    need = torch.zeros_like(cur)
    need[dst] = True
    return entries, cur, src, need


def gather_bytes(plan: SlicePlan, spec: Spec, *, dst: int = 0, reduce: str = "copy") -> List[CommStats]:
    """What every rank's :func:`gather_full_model` call will move, from the plan alone: one CommStats per rank."""
    if reduce not in ("copy", "mean"):
        raise ValueError(f"gather_bytes: reduce must be 'copy' or 'mean', got {reduce!r}")
    spec = _normalise_spec(spec)
    S = plan.num_subnetworks
    entries, _, src, need = _gather_masks(plan, spec, S, dst, reduce, "gather_bytes")
    products = [t for t in plan.tensors if t.product]
    for t in products:  # as gather_full_model refuses them
        _check_floating_product(t, spec[t.name][1], "gathered")
    floats = sorted({d for d in [e.dtype for e in entries] + [spec[t.name][1] for t in products]
                     if d.is_floating_point}, key=str)
    if len(floats) > 1:
        raise TypeError(f"gather_bytes: the tensors moved through the all-to-all must share one floating dtype "
                        f"(one buffer), got {floats}; exchange each dtype's tensors in a separate call (names=...)")
    esize = torch.empty(0, dtype=floats[0] if floats else torch.float64).element_size()
    M = _bytes_matrix(entries, src, need, {e.name for e in entries}, None, esize)
    for t in products:  # from the blocks: each element from its lowest holder (copy) or from all (mean)
        shape = spec[t.name][0]
        first = _first_held(t, shape)
        if sum(first) != shape[0] * shape[1]:
            raise ValueError(f"gather_bytes: in the plan {shape[0] * shape[1] - sum(first)} elements of the product "
                             f"{t.name!r} have no holder; the full model cannot be assembled")
        for k in range(S):
            M[k, dst] += float(first[k] if reduce == "copy" else t.count(k)) * esize
    diag = M.diagonal()
    sent, recv = (M.sum(1) - diag).tolist(), (M.sum(0) - diag).tolist()
    return [CommStats(None, S, 1 if entries or products else 0, int(sent[r]), int(recv[r]), 0) for r in range(S)]


def _messages(contrib: Sequence[Sequence[Part]], need: Sequence[Sequence[Part]], rank: int, shape: Tuple[int, int]
              ) -> Tuple[List[List[Piece]], List[List[Piece]]]:
    """``rank``'s messages of a product of 2-D ``shape`` that rank k contributes ``contrib[k]`` of and
    rank q needs ``need[q]`` of: per peer, the pieces it sends and those it receives, in two batches
    (its parts against every rank's needs, every rank's parts against its needs; a message's pairs
    in the order :func:`.routing.product_pieces` lists them)."""
    S = len(contrib)
    send: List[List[Piece]] = [[] for _ in range(S)]
    recv: List[List[Piece]] = [[] for _ in range(S)]
    of_need = [q for q in range(S) for _ in need[q]]
    for _, j, piece, _ in meet_pieces(contrib[rank], [b for q in range(S) for b in need[q]], shape):
        send[of_need[j]].append(piece)
    of_contrib = [k for k in range(S) for _ in contrib[k]]
    for a, _, _, piece in meet_pieces([a for k in range(S) for a in contrib[k]], need[rank], shape):
        recv[of_contrib[a]].append(piece)
    return send, recv


def route_products(routing: Routing, entries: List[Entry], pairs, rank: int, S: int, decentralized: bool,
                   coded: bool) -> Tuple[List[int], List[int], List[int]]:
    """Add products to ``rank``'s ``routing``, on their blocks (rows x cols), never element by
    element: ``pairs`` of (entry, this round's plan tensor, the next round's) are appended to
    ``entries`` (their ids in the all-to-all's numbering go on after the last entry's) and their
    pieces to the messages. Returns the elements ``rank`` holds of each now and next, and the
    products it hands back as they are (held alone in both rounds as the same blocks; not where
    ``coded``: every copy is encoded then). Replicated storage (``decentralized`` False): every
    rank holds and needs the full tensor."""
    base = entries[-1].base + entries[-1].size if entries else 0
    cur, nxt, passthrough = [], [], []
    for e, t, u in pairs:
        i = len(entries)
        entries.append(Entry(e.name, e.dim, e.shape, e.real_shape, e.dtype, False, base))
        base += e.size
        n0, n1 = e.real_shape
        if decentralized:
            contrib = [held_parts(t.blocks(k)) for k in range(S)]
            need = [held_parts(u.blocks(q)) for q in range(S)]
            cur.append(t.count(rank))
            nxt.append(u.count(rank))
        else:
            contrib = [[Part(rows.cpu(), cols.cpu()) for rows, cols in t.blocks(k)] for k in range(S)]
            need = [[Part(torch.arange(n0), torch.arange(n1))]] * S
            cur.append(e.size)
            nxt.append(e.size)
        send, recv = _messages(contrib, need, rank, (n0, n1))
        if (decentralized and not coded and send[rank] and not any(send[q] or recv[q] for q in range(S) if q != rank)
                and _same_blocks(t.blocks(rank), u.blocks(rank)) and t.stacked(rank) == u.stacked(rank)):
            send[rank] = recv[rank] = []
            passthrough.append(i)
        add_product(routing, i, send, recv)
    return cur, nxt, passthrough


class Exchange:
    """Move every rank from its part of ``current``'s round to its part of ``next``'s.

    current, next: this round's and the next round's plans (next unused with replicated storage).
    spec: name -> global tensor (a meta tensor will do) or (shape, dtype), for every plan tensor;
        required with decentralized storage (a rank does not hold the tensors it does not own).
    storage: "decentralized": rank s holds subnetwork s's compact tensors
        (``global[t].index_select(dim, current.owners[s])`` for every partitioned t it owns, none
        for the others) and the shared tensors; the call returns its next compact tensors (new
        ones, or the same tensor where it stays unchanged with its sole owner, e.g. a ResIST block
        that does not move) and the shared ones (averaged in place). Every slice must be owned by
        >= 1 subnetwork in both plans (otherwise nobody would hold it). "replicated": every rank holds every tensor
        full size and gets the whole aggregated model in place: owner means where >= 1 subnetwork
        owned a slice this round, unchanged elsewhere.
    shared: "all_reduce" (one flat all_reduce; ulp-close) or "exact" (through the all-to-all;
        bit-identical to the simulated path). See the module docstring.
    quantize: None or "int8" (paper 003 A.5; the all-to-all part only, one scale per (rank, tensor)
        over what the rank sends of it).
    compress: None, "bf16" or "int8" (the trainer's ``--compress``; :mod:`.compress`): every value
        a rank contributes is encoded, its own copy included (no tensor is handed back as it is):
        int8 with one scale per slice; the shared tensors' ring all_reduce becomes a two-stage
        compressed average (``shared="exact"``: through the all-to-all, one scale per tensor).
        Equal to the simulated path that encodes the same values (``ist_kernels.train.comm``).
    Integer tensors: a shared one (a counter such as BN num_batches_tracked) is returned as it is,
    never averaged; a partitioned one (a ResIST block's counter) moves with its slices, exactly, in
    the floating buffer, and takes its owners' maximum (``partition.aggregate_slices_``, as the
    simulated aggregation does), never a truncated mean.
    round: the round number, named in errors. timeout: seconds each collective may wait (default:
        the one given to init_process_group).

    verify_plans: check, with one all_gather at construction, that every rank derived the same plans
        (for debugging; plans are otherwise never communicated).
    drop_unowned: decentralized storage only: slices that no subnetwork owns in the next plan are
        dropped (e.g. pruned filters) instead of being an error.

    ``last_stats`` holds what the last call moved; ``history`` every call's stats.
    """

    def __init__(self, current: SlicePlan, next: Optional[SlicePlan] = None, spec: Optional[Spec] = None, *,
                 storage: str = "decentralized", shared: str = "all_reduce", quantize: Optional[str] = None,
                 round: Optional[int] = None, group=None, timeout: Union[None, float, timedelta] = None,
                 verify_plans: bool = False, drop_unowned: bool = False, compress: Optional[str] = None):
        compress = C.check(compress, "Exchange")
        if compress is not None and quantize is not None:
            raise ValueError("Exchange: give quantize or compress, not both")
        if storage not in _STORAGE:
            raise ValueError(f"Exchange: storage must be one of {_STORAGE}, got {storage!r}")
        if shared not in _SHARED:
            raise ValueError(f"Exchange: shared must be one of {_SHARED}, got {shared!r}")
        if quantize not in (None, "int8"):
            raise ValueError(f"Exchange: quantize must be None or 'int8', got {quantize!r}")
        if storage == "decentralized" and (next is None or spec is None):
            raise ValueError("Exchange: decentralized storage needs the next plan and the spec (global shapes)")
        if not dist.is_initialized():
            raise RuntimeError("Exchange: no process group; call ist_kernels.distributed.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        for what, plan in (("current", current), ("next", next)):
            if plan is not None and plan.num_subnetworks != self.world_size:
                raise ValueError(f"Exchange: the {what} plan has {plan.num_subnetworks} subnetworks but the group "
                                 f"has {self.world_size} ranks (one subnetwork per rank)")
        self.current, self.next, self.storage, self.shared = current, next, storage, shared
        self.quantize, self.round, self.drop_unowned = quantize, round, drop_unowned
        self.compress = compress
        self.timeout = collective_timeout(timeout)
        self.last_stats: Optional[CommStats] = None
        self.history: List[CommStats] = []
        self._layouts: Dict[Tuple[str, ...], tuple] = {}
        self._spec = _normalise_spec(spec) if spec is not None else None
        if self._spec is not None:
            self._prepare(self._spec)
        if verify_plans:
            self._verify_plans()

    def _verify_plans(self) -> None:
        """One all_gather of the plans' fingerprints: every rank must have derived the same plans
        (a mismatch would make the all-to-all split sizes disagree)."""
        mine = torch.tensor([plan_fingerprint(self.current),
                             plan_fingerprint(self.next) if self.next is not None else 0], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        wait_collective(lambda: dist.all_gather(everyone, mine, group=self.group, async_op=True),
                        name="all_gather (plan fingerprints)", round=self.round, timeout=self.timeout,
                        group=self.group)
        differ = [k for k, fp in enumerate(everyone) if not torch.equal(fp, mine)]
        if differ:
            raise ValueError(f"Exchange: rank {self.rank} derived different plans than ranks {differ} in round "
                             f"{self.round}; every rank must build the plans from the same seed and round")

    # ---- plans -> owner masks over every plan tensor (once), routing per name set (cached)
    def _prepare(self, spec):
        cur, nxt = self.current, self.next
        if nxt is not None:
            a = {t.name: t.dims for t in cur.tensors}
            b = {t.name: t.dims for t in nxt.tensors}
            if a != b:
                diff = sorted(n for n in set(a) | set(b) if a.get(n, "absent") != b.get(n, "absent"))
                raise ValueError(f"Exchange: the current and next plans must hold the same tensors with the same "
                                 f"dims (shared: None); they differ at {diff[:8]}")
        exact = self.shared == "exact"
        self._entries, self._cur_mask = _plan_masks(cur, spec, self.world_size, exact, "current")
        self._cur_2d, self._nxt_2d = _product_shapes(cur, self.rank), _product_shapes(nxt, self.rank)
        self._nxt_mask = (_plan_masks(nxt, spec, self.world_size, exact, "next")[1]
                          if nxt is not None else None)
        self._products = _product_entries(cur, spec, "current")
        nxt_products = dict((e.name, t) for e, t in _product_entries(nxt, spec, "next")) if nxt is not None else {}
        self._products_next = [nxt_products.get(e.name) for e, _ in self._products]
        self._shared_names = [t.name for t in cur.tensors if t.shared and spec[t.name][1].is_floating_point]
        self._counters = {t.name for t in cur.tensors if t.shared and not spec[t.name][1].is_floating_point}
        if self.storage == "decentralized":
            checked = (("current", self._cur_mask),) + (() if self.drop_unowned else (("next", self._nxt_mask),))
            for what, mask in checked:
                _check_covered(self._entries, mask, f"Exchange: decentralized storage needs every partitioned "
                               f"slice owned by >= 1 subnetwork, but in the {what} plan (round {self.round})",
                               "use storage='replicated' for plans with unowned slices (e.g. Bernoulli masks)")
                plan_products = self._products if what == "current" else [
                    (e, t) for (e, _), t in zip(self._products, self._products_next)]
                _check_products_covered(plan_products, f"Exchange: decentralized storage needs every partitioned "
                                        f"slice owned by >= 1 subnetwork, but in the {what} plan (round "
                                        f"{self.round})", "use storage='replicated' for plans with unowned slices "
                                        "(e.g. Bernoulli masks), or SlicePlan.with_holders")

    def _layout(self, names: Tuple[str, ...], quantized: Union[bool, str, BlockCode]):
        key = (names, quantized)
        if key in self._layouts:
            return self._layouts[key]
        chosen = set(names)
        sel = [e for e in self._entries if e.name in chosen]
        cols, sub, base = [], [], 0
        for e in sel:
            cols.append(torch.arange(e.base, e.base + e.size))
            sub.append(Entry(e.name, e.dim, e.shape, e.real_shape, e.dtype, e.shared, base))
            base += e.size
        cols = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.int64)
        cur = self._cur_mask[:, cols]
        r = self.rank
        coded = self.compress is not None or isinstance(quantized, BlockCode)
        if self.storage == "decentralized":
            # a compact tensor that stays with its sole owner is handed back as it is
            nxt = self._nxt_mask[:, cols]
            passthrough = passthrough_entries(sub, cur, nxt, r)
            if coded:  # every copy is encoded, this rank's own too
                passthrough = []
            flag = torch.zeros(len(sub), dtype=torch.bool)
            flag[passthrough] = True
            keep = torch.repeat_interleave(flag, torch.tensor([e.size for e in sub], dtype=torch.int64))
            routing = route(sub, r, cur, nxt, source_held=cur[r], target_held=nxt[r], keep_own=keep)
            cur_rows = per_entry_count(cur[r], sub).tolist() if sub else []
            nxt_rows = per_entry_count(nxt[r], sub).tolist() if sub else []
        else:
            # a slice only this rank updated is already in place (unless quantised: then every
            # replica, this one too, takes the dequantised value, so that replicas stay equal)
            passthrough = []
            keep = None if quantized else sole_owner_in_place(cur, r)
            routing = route(sub, r, cur, torch.ones_like(cur), source_held=None, target_held=None, keep_own=keep)
            cur_rows = [e.size for e in sub]
            nxt_rows = list(cur_rows)
        pairs = [(e, t, u) for (e, t), u in zip(self._products, self._products_next) if e.name in chosen]
        c, n, p = route_products(routing, sub, pairs, r, self.world_size, self.storage == "decentralized", coded)
        cur_rows, nxt_rows, passthrough = cur_rows + c, nxt_rows + n, passthrough + p
        mover = _Mover(sub, routing, _buffer_dtype(sub, "Exchange"))
        ar = [n for n in self._shared_names if n in chosen] if self.shared == "all_reduce" else []
        lay = (sub, mover, cur_rows, nxt_rows, ar, set(passthrough))
        self._layouts[key] = lay
        return lay

    def prepare(self, names: Optional[Sequence[str]] = None) -> "Exchange":
        """Derive this rank's routing for ``names`` now (the first call would otherwise), e.g. while
        the last local steps run. Needs the spec. Returns self."""
        if self._spec is None:
            raise ValueError("Exchange.prepare: needs the spec (given at construction)")
        plan_names = self.current.names()
        chosen = set(plan_names if names is None else names)
        self._layout(tuple(n for n in plan_names if n in chosen), self.compress or self.quantize == "int8")
        return self

    def _names(self, local: Mapping[str, Tensor], names: Optional[Sequence[str]]) -> Tuple[str, ...]:
        plan_names = self.current.names()
        if names is None:
            names = plan_names
        unknown = [n for n in names if n not in set(plan_names)]
        if unknown:
            raise KeyError(f"Exchange: names not in the plan: {unknown[:8]}")
        extra = [n for n in local if n not in set(names)]
        if extra:
            raise KeyError(f"Exchange: local holds tensors outside the exchanged names: {extra[:8]} "
                           f"(pass names=..., or leave them out)")
        chosen = set(names)
        return tuple(n for n in plan_names if n in chosen)

    # ---- the exchange
    @torch.no_grad()
    def __call__(self, local: Mapping[str, Tensor], names: Optional[Sequence[str]] = None, *,
                 quantize: Union[None, str, bool] = False, code: Optional[BlockCode] = None) -> Dict[str, Tensor]:
        """Exchange ``local`` (this rank's tensors, parameters and buffers or optimizer state keyed
        like them) and return this rank's tensors for the next round (see the class docstring).

        names: the plan tensors this call moves (default: all); the same on every rank.
        quantize: False keeps the exchange's setting; None / "int8" override it for this call.
        code: ``local`` is one optimizer moment (``momentum_state=int8|int8-v4``): each partitioned
        slice travels block-wise coded (:class:`~.blockwise.BlockCode`; slices it does not pay for
        and shared tensors exactly), and every copy, this rank's own and one that stays, becomes
        what its receivers decode (:func:`~.blockwise.fake_quantize_` of its slices). Not with
        ``compress`` or ``quantize``.
        """
        t0 = time.perf_counter()
        if self._spec is None:  # replicated storage without a spec: the full local tensors are it
            self._spec = _normalise_spec(local)
            self._prepare(self._spec)
        q = self.quantize if quantize is False else quantize
        if q not in (None, "int8"):
            raise ValueError(f"Exchange: quantize must be None or 'int8', got {q!r}")
        if code is not None:
            if not isinstance(code, BlockCode):
                raise TypeError(f"Exchange: code must be a blockwise.BlockCode or None, got {type(code).__name__}")
            if self.compress is not None or q is not None:
                raise ValueError(f"Exchange: code (a moment's block code) cannot be combined with compress "
                                 f"({self.compress!r}) or quantize ({q!r})")
        names = self._names(local, names)
        sub, mover, cur_rows, nxt_rows, ar, passthrough = self._layout(names, code or self.compress or q == "int8")
        r = self.rank
        decentral = self.storage == "decentralized"

        index_of = {e.name: i for i, e in enumerate(sub)}
        device = None
        for n in names:
            shape, dtype = self._spec[n]
            i = index_of.get(n)
            if decentral and i is not None and not sub[i].shared:
                expect, held = self._cur_2d.get(n, sub[i].local_shape(cur_rows[i])), cur_rows[i] > 0
            else:
                expect, held = shape, True
            t = local.get(n)
            if t is None:
                if held:
                    raise KeyError(f"Exchange: rank {r} holds {n!r} in round {self.round} ({self.storage} storage) "
                                   f"but local lacks it")
                continue
            if tuple(t.shape) != tuple(expect) or t.dtype != dtype:
                raise ValueError(f"Exchange: {n!r} on rank {r} must have shape {tuple(expect)} and dtype {dtype} "
                                 f"(round {self.round}, {self.storage} storage), got {tuple(t.shape)} {t.dtype}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"Exchange: all tensors must be on one device, {n!r} is on {t.device}, not {device}")
        if device is None:
            device = torch.device("cpu")

        sources, targets = {}, {}
        stats = CommStats(self.round, self.world_size)
        out: Dict[str, Tensor] = {}
        for i, e in enumerate(sub):
            t = local.get(e.name)
            if t is not None:
                if not t.is_contiguous():
                    if not decentral or e.shared:
                        raise ValueError(f"Exchange: {e.name!r} is written in place and must be contiguous")
                    t = t.contiguous()
                sources[i] = t.view(e.compact_shape(cur_rows[i]))
            if e.shared or not decentral:
                targets[i] = sources[i]  # in place
                out[e.name] = local[e.name]
            elif i in passthrough:
                out[e.name] = t
            elif nxt_rows[i] > 0:
                tgt = torch.empty(self._nxt_2d.get(e.name, e.local_shape(nxt_rows[i])), dtype=e.dtype, device=device)
                targets[i] = tgt.view(e.compact_shape(nxt_rows[i]))
                out[e.name] = tgt
        if sub:
            mover.run(sources, targets, quantize=q == "int8", device=device,
                      name="all_to_all_single (partitioned slices)", round=self.round, group=self.group,
                      timeout=self.timeout, stats=stats, compress=code or self.compress)
        for n in names:
            if n in self._counters and n in local:
                out[n] = local[n]
        if ar and self.compress is not None:
            _compressed_mean_([local[n] for n in ar], self.compress, name="all_to_all_single (shared tensors' "
                              "compressed average)", round=self.round, group=self.group, timeout=self.timeout,
                              stats=stats)
        elif ar:
            _all_reduce_mean_([local[n] for n in ar], name="all_reduce (shared tensors)", round=self.round,
                              group=self.group, timeout=self.timeout, stats=stats)
        for n in ar:
            out[n] = local[n]
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats
        self.history.append(stats)
        return {n: out[n] for n in names if n in out}


@torch.no_grad()
def gather_full_model(local: Mapping[str, Tensor], plan: SlicePlan, spec: Spec, *, dst: int = 0,
                      reduce: str = "copy", round: Optional[int] = None, group=None,
                      timeout: Union[None, float, timedelta] = None,
                      stats: Optional[List[CommStats]] = None) -> Optional[Dict[str, Tensor]]:
    """Assemble the full model on rank ``dst`` from decentralized storage, in one all_to_all_single.

    local: this rank's compact tensors under ``plan`` and its shared tensors (as for Exchange).
    reduce: "copy": every slice from its lowest-rank owner and the shared tensors from ``dst``
        (right after an Exchange, when all copies of a slice are equal); "mean": owner means (the
        owners' maximum for integer counters) and the mean of the shared tensors over all ranks
        (the aggregate, e.g. at the end of a round before the exchange; bit-identical to the
        simulated aggregation).
    Returns name -> full tensor (new) on ``dst``, None on the other ranks. ``local`` is not changed.
    """
    t0 = time.perf_counter()
    if reduce not in ("copy", "mean"):
        raise ValueError(f"gather_full_model: reduce must be 'copy' or 'mean', got {reduce!r}")
    if not dist.is_initialized():
        raise RuntimeError("gather_full_model: no process group; call init_process_group first")
    r, S = dist.get_rank(group), dist.get_world_size(group)
    if plan.num_subnetworks != S:
        raise ValueError(f"gather_full_model: the plan has {plan.num_subnetworks} subnetworks, the group {S} ranks")
    if not 0 <= dst < S:
        raise ValueError(f"gather_full_model: dst must be in [0, {S}), got {dst}")
    spec = _normalise_spec(spec)
    entries, cur, src, need = _gather_masks(plan, spec, S, dst, reduce, "gather_full_model")
    routing = route(entries, r, src, need, source_held=cur[r], target_held=None)
    rows = per_entry_count(cur[r], entries).tolist() if entries else []
    products = _product_entries(plan, spec, "gathered")
    _check_products_covered(products, "gather_full_model: in the plan", "the full model cannot be assembled")
    base = entries[-1].base + entries[-1].size if entries else 0
    for e, t in products:  # on their blocks: each element from its lowest holder (copy) or from all (mean)
        i, e.base = len(entries), base
        entries.append(e)
        base += e.size
        n0, n1 = e.real_shape
        held = [t.blocks(k) for k in range(S)]
        contrib = first_held_parts(held, (n0, n1)) if reduce == "copy" else [held_parts(b) for b in held]
        full = [Part(torch.arange(n0), torch.arange(n1))]
        add_product(routing, i, *_messages(contrib, [full if q == dst else [] for q in range(S)], r, (n0, n1)))
        rows.append(t.count(r))
    mover = _Mover(entries, routing, _buffer_dtype(entries, "gather_full_model"))
    shapes = _product_shapes(plan, r)
    sources, targets, device = {}, {}, None
    for i, e in enumerate(entries):
        t = local.get(e.name)
        expect = shapes.get(e.name, e.local_shape(rows[i]))
        if t is None:
            if rows[i] > 0:
                raise KeyError(f"gather_full_model: rank {r} holds {e.name!r} but local lacks it")
            continue
        if tuple(t.shape) != tuple(expect) or t.dtype != e.dtype:
            raise ValueError(f"gather_full_model: {e.name!r} on rank {r} must have shape {tuple(expect)} and dtype "
                             f"{e.dtype}, got {tuple(t.shape)} {t.dtype}")
        device = device or t.device
        sources[i] = t.contiguous().view(e.compact_shape(rows[i]))
    device = device or torch.device("cpu")
    out = {}
    if r == dst:
        for i, e in enumerate(entries):
            out[e.name] = torch.empty(e.real_shape, dtype=e.dtype, device=device)
            targets[i] = out[e.name].view(e.shape)
    st = CommStats(round, S)
    mover.run(sources, targets, quantize=False, device=device, name="all_to_all_single (gather full model)",
              round=round, group=group, timeout=collective_timeout(timeout), stats=st)
    st.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.append(st)
    if r != dst:
        return None
    for t in plan.tensors:  # counters (non-floating shared tensors): dst's own
        if t.name not in out and t.name in local:
            out[t.name] = local[t.name].clone()
    return {t.name: out[t.name] for t in plan.tensors if t.name in out}


@torch.no_grad()
def average_model_(tensors: Union[Mapping[str, Tensor], Sequence[Tensor]], *, round: Optional[int] = None,
                   group=None, timeout: Union[None, float, timedelta] = None,
                   compress: Optional[str] = None) -> CommStats:
    """The local-SGD baseline: average the whole model over the group in place, one flat all_reduce
    (per dtype); ``compress`` ("bf16", "int8"): the two-stage compressed average instead
    (:mod:`.compress`; equal to ``compress.two_stage_mean`` bit for bit). Returns what it moved."""
    compress = C.check(compress, "average_model_")
    t0 = time.perf_counter()
    ts = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    bad = [i for i, t in enumerate(ts) if not t.is_contiguous()]
    if bad:
        raise ValueError(f"average_model_: tensors are averaged in place and must be contiguous (not: {bad[:8]})")
    st = CommStats(round, dist.get_world_size(group))
    if compress is not None:
        _compressed_mean_(ts, compress, name="all_to_all_single (local SGD, compressed average)", round=round,
                          group=group, timeout=collective_timeout(timeout), stats=st)
    else:
        _all_reduce_mean_(ts, name="all_reduce (local SGD, full model)", round=round, group=group,
                          timeout=collective_timeout(timeout), stats=st)
    st.seconds = time.perf_counter() - t0
    return st
