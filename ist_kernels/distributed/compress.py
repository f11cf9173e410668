"""Compressed communication for the trainer's ``--compress {none,bf16,int8}``: the math, written
once, that the distributed collectives (:mod:`.exchange`) and the simulated single-process path
(``ist_kernels.train.comm``) both run, so that the two give the same values bit for bit.

What is compressed is every value a worker *sends*; the receiver decodes it; a worker's own copy of
what it sends (its own part of an exchange, a slice that stays with it, its own chunk of an
average) is replaced by the decoded value too, so every copy of a value is the same on every rank.

- ``bf16``: each value cast to bfloat16 (round to nearest even), 2 bytes; decoded exactly to fp32.
- ``int8``: ``scale = absmax / 127`` per group, ``q = clamp(round(x * (1 / scale)), -127, 127)``
  (1 byte) and the group's fp32 scale (4 bytes); decoded ``q * scale``. Error per element: at most
  scale / 2 (plus fp32 rounding).

Groups (int8), chosen so that they do not depend on who sends what to whom (which a simulated run
does not know): in an exchange of subnetworks, one scale per *slice* (a plan's slice along the
partitioned dim: a filter, a neuron's row, a block's tensor slice; a shared tensor moved through the
all-to-all is one slice); a slice of one element travels uncompressed (a code and its scale would
take 5 bytes instead of 4); integer tensors (step counters) always travel exactly. In an
average (local SGD, shared tensors with the ring all_reduce), one scale per segment of
:func:`chunk_segments`.

Averages (:func:`two_stage_mean`): an int8 or bf16 ring all-reduce would have to re-encode partial
sums; instead the average runs in two stages, each an all-to-all of encoded chunks: the flat buffer is
cut into S chunks; rank k receives every rank's chunk k (encoded), decodes it and sums the S
copies in rank order, divides by S, encodes the mean and sends it to every other rank. A rank sends
2 (S - 1) / S of the buffer, encoded: the ring all-reduce's bytes at 1/2 (bf16) or about 1/4 (int8).
The sum in rank order makes the result equal to the simulated one bit for bit.

The byte counts (``COMPRESS``, ``SCALE_BYTES``, :func:`coded`, :func:`slice_bytes`, a codec's
size) are :mod:`.ledger`'s, imported here under their old names.
"""
from __future__ import annotations

from math import prod
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .ledger import COMPRESS, SCALE_BYTES, check, code_bytes, coded, coded_bytes, slice_bytes, two_stage_sent  # noqa: F401

QMAX = 127


def view3(x: Tensor, dim: int) -> Tensor:
    """``x`` as [outer, size, inner] along ``dim`` (a view)."""
    shape = tuple(x.shape)
    if not shape:
        return x.view(1, 1, 1)
    return x.view(prod(shape[:dim]), shape[dim], prod(shape[dim + 1:]))


# ---------------------------------------------------------------- int8 per slice / per segment

def scales_of(x3: Tensor) -> Tensor:
    """float32 [size]: absmax / 127 of each slice of an [outer, size, inner] view."""
    if x3.numel() == 0:
        return torch.zeros(x3.shape[1], dtype=torch.float32, device=x3.device)
    return x3.abs().amax(dim=(0, 2)).float() / QMAX


def _inverse(scales: Tensor) -> Tensor:
    return torch.where(scales > 0, 1.0 / scales.clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def to_codes_(x3: Tensor, scales: Tensor) -> Tensor:
    """In place: each slice of ``x3`` becomes its int8 codes (still floats). Returns x3."""
    x3.mul_(_inverse(scales).view(1, -1, 1).to(x3.dtype)).round_().clamp_(-QMAX, QMAX)
    return x3


def from_codes_(x3: Tensor, scales: Tensor) -> Tensor:
    """In place: codes (as floats) times their slice's scale. Returns x3."""
    return x3.mul_(scales.view(1, -1, 1).to(x3.dtype))


def fake_(x: Tensor, dim: int, compress: Optional[str]) -> Tensor:
    """In place: ``x`` becomes what its receiver decodes, every slice along ``dim`` encoded on its
    own (int8: one scale per slice; slices of one element, and integer tensors, unchanged).
    Returns x."""
    if compress is None or x.numel() == 0 or not x.is_floating_point():
        return x
    if compress == "bf16":
        return x.copy_(x.to(torch.bfloat16))
    x3 = view3(x, dim)
    if x3.shape[0] * x3.shape[2] < 2:
        return x
    s = scales_of(x3)
    from_codes_(to_codes_(x3, s), s)
    return x


# ---------------------------------------------------------------- averages: chunks and segments

def chunk_segments(sizes: Sequence[int], S: int) -> List[List[Tuple[int, int]]]:
    """The flat buffer of tensors of ``sizes`` elements cut into S chunks (chunk k: elements
    [k n // S, (k + 1) n // S)), each chunk into segments at the tensors' boundaries: per chunk,
    its (start, end) offsets in the buffer. int8 gives each segment its own scale."""
    n = sum(sizes)
    bounds, acc = [], 0
    for sz in sizes:
        acc += sz
        bounds.append(acc)
    out = []
    for k in range(S):
        lo, hi = k * n // S, (k + 1) * n // S
        segs, start = [], lo
        for b in bounds:
            if b <= start:
                continue
            end = min(b, hi)
            if end > start:
                segs.append((start, end))
                start = end
            if start >= hi:
                break
        out.append(segs)
    return out


def chunk_payload(segs: Sequence[Tuple[int, int]], compress: str) -> int:
    """Bytes of one encoded chunk (int8: every segment's codes and its scale; bf16: 2 per value)."""
    return coded_bytes(sum(b - a for a, b in segs), compress, scales=len(segs))


def padded(nbytes: int) -> int:
    """A chunk's size in the wire buffer (aligned to 4 bytes; the padding is not counted as sent)."""
    return (nbytes + 3) // 4 * 4


def two_stage_bytes(sizes: Sequence[int], S: int, compress: str) -> List[int]:
    """Bytes each rank sends (and receives) in :func:`two_stage_mean` of tensors of ``sizes``
    elements: the S - 1 other ranks' encoded chunks, then its own encoded mean chunk to each of them."""
    if S < 2:
        return [0] * S
    pay = [chunk_payload(segs, compress) for segs in chunk_segments(sizes, S)]
    return [two_stage_sent(pay, r) for r in range(S)]


def _qdq_(x3: Tensor) -> Tensor:
    s = scales_of(x3)
    return from_codes_(to_codes_(x3, s), s)


def fake_segments_(flat: Tensor, segs: Sequence[Tuple[int, int]], compress: str, base: int = 0) -> Tensor:
    """In place: the segments (offsets minus ``base`` into ``flat``) as their receiver decodes them
    (int8: one scale per segment, whatever its length)."""
    for a, b in segs:
        seg = flat[a - base:b - base]
        if compress == "bf16":
            seg.copy_(seg.to(torch.bfloat16))
        else:
            _qdq_(seg.view(1, 1, b - a))
    return flat


def encode_chunk(chunk: Tensor, segs: Sequence[Tuple[int, int]], compress: str, base: int) -> Tensor:
    """uint8 [padded(payload)]: a chunk (elements ``base`` ..) encoded; ``chunk`` is left as its
    receiver decodes it. int8 layout: [fp32 scale per segment][int8 codes]."""
    payload = chunk_payload(segs, compress)
    out = torch.zeros(padded(payload), dtype=torch.uint8, device=chunk.device)
    n = chunk.numel()
    if compress == "bf16":
        if n:
            out[:2 * n].view(torch.bfloat16).copy_(chunk)
            chunk.copy_(out[:2 * n].view(torch.bfloat16))
        return out
    scales = out[:SCALE_BYTES * len(segs)].view(torch.float32)
    codes = out[SCALE_BYTES * len(segs):SCALE_BYTES * len(segs) + n].view(torch.int8)
    for i, (a, b) in enumerate(segs):
        x3 = chunk[a - base:b - base].view(1, 1, b - a)
        s = scales_of(x3)
        scales[i:i + 1].copy_(s)
        to_codes_(x3, s)
        codes[a - base:b - base].copy_(x3.view(-1))
        from_codes_(x3, s)
    return out


def decode_chunk(wire: Tensor, segs: Sequence[Tuple[int, int]], compress: str, out: Tensor, base: int) -> Tensor:
    """Write the decoded chunk of ``wire`` (from :func:`encode_chunk`) into ``out``; returns out."""
    n = out.numel()
    if compress == "bf16":
        if n:
            out.copy_(wire[:2 * n].view(torch.bfloat16))
        return out
    scales = wire[:SCALE_BYTES * len(segs)].view(torch.float32)
    codes = wire[SCALE_BYTES * len(segs):SCALE_BYTES * len(segs) + n].view(torch.int8)
    out.copy_(codes)
    for i, (a, b) in enumerate(segs):
        from_codes_(out[a - base:b - base].view(1, 1, b - a), scales[i:i + 1])
    return out


def two_stage_mean(flats: Sequence[Tensor], sizes: Sequence[int], compress: str) -> Tensor:
    """The simulated :func:`ist_kernels.distributed.exchange.compressed_average_`: the mean of the S
    workers' flat buffers (tensors of ``sizes`` elements concatenated; worker order = rank order) as
    every rank gets it: each worker's values encoded per segment, summed in rank order, divided by S,
    the mean encoded per segment again. The inputs are not changed."""
    S = len(flats)
    segs = [s for chunk in chunk_segments(sizes, S) for s in chunk]
    total = fake_segments_(flats[0].clone(), segs, compress)
    for f in flats[1:]:
        total += fake_segments_(f.clone(), segs, compress)
    total.div_(S)
    return fake_segments_(total, segs, compress)
