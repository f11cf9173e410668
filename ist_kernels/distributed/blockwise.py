"""Block-wise quantisation of optimizer moments (``momentum_state=int8`` / ``int8-v4``; Dettmers et
al., 8-bit optimizers via block-wise quantization, arXiv 2110.02861): the codes a moment travels in,
written once for the simulated and the distributed rounds, so both give the same values bit for bit.

Blocks never cross a *slice* (one index of a plan tensor along its partitioned dim: a neuron's row,
a head's rows, a block's slice; a shared tensor is one slice): a slice's values, in row-major order
of the remaining dims, are cut into blocks of :data:`~.ledger.MOMENT_BLOCK` (256) values, the last
block of a slice shorter. Block boundaries then depend only on the plan, never on which slices a
rank holds, so a worker's compact tensor codes as its slices would in the global tensor.

- signed (first moments: AdamW's ``exp_avg``, SGD's ``momentum_buffer``), linear 8-bit: per block
  ``scale = absmax / 127``, ``q = clamp(round(x / scale), -127, 127)``, decoded ``q * scale``.
  Bound: ``|x - q(x)| <= absmax(block) / (2 * 127)`` (plus float32 rounding, a few ulps of absmax).
- unsigned (second moments, :data:`~.ledger.SECOND_MOMENTS`: ``v >= 0``), a dynamic-range (log)
  code of ``bits`` bits: per block ``top = max(v)``; code 0 is exactly 0 (``v == 0`` only), codes
  c = 1 .. L (L = 2^bits - 1) decode to ``top * 2^(-(L - c) / k)``, k codes per octave
  (:data:`OCTAVE_CODES`: 8-bit k = 8, down to top * 2^-31.75; 4-bit k = 1, down to top * 2^-14);
  ``c = L - round(k log2(top / v))`` clamped to [1, L]. Bound: for ``v >= top * 2^(-(L - 1) / k)``
  the decoded value is within a factor 2^(1 / (2k)) of v (8-bit: 4.4 %, 4-bit: 41 %; the Adam step
  divides by its square root: 2.2 % / 19 %); a smaller positive v decodes to the smallest code,
  ``top * 2^(-(L - 1) / k)`` (above v: a smaller step, never the division by ~0 that a linear code's
  zero would give). A positive value never decodes to 0.

A slice travels coded only where its code is smaller than its values (:func:`~.ledger.state_coded`:
a one-element slice stays exact). Empty tensors and all-zero blocks decode to zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .ledger import MOMENT_BLOCK, state_coded

QMAX = 127
#: codes per octave of the unsigned log code, by its bits
OCTAVE_CODES = {8: 8, 4: 1}


def slices(x: Tensor, dim: Optional[int]) -> Tensor:
    """[n_slices, m]: ``x``'s slices along ``dim`` (None: one slice), each in row-major order, float32."""
    if dim is None or x.dim() == 0:
        return x.reshape(1, -1).float()
    return x.movedim(dim, 0).reshape(x.shape[dim], -1).float()


def _blocks(rows: Tensor, block: int) -> Tensor:
    """[n, nb, block]: each row cut into blocks of ``block`` values, the last padded with zeros."""
    n, m = rows.shape
    nb = -(-m // block)
    pad = nb * block - m
    if pad:
        rows = torch.cat([rows, rows.new_zeros(n, pad)], 1)
    return rows.reshape(n, nb, block)


@dataclass(frozen=True)
class BlockCode:
    """How the slices of one optimizer moment travel: ``bits`` per value (signed: 8; ``unsigned``:
    8 or 4) in blocks of ``block`` values, one float32 scale (signed: absmax / 127; unsigned: the
    block's max) per block. A slice of ``m`` values is :func:`~.ledger.block_coded_bytes` on the
    wire: its codes packed (ceil(m bits / 8) bytes) and its scales."""
    bits: int
    unsigned: bool = False
    block: int = MOMENT_BLOCK

    def __post_init__(self):
        if self.unsigned and self.bits not in OCTAVE_CODES:
            raise ValueError(f"BlockCode: bits must be one of {sorted(OCTAVE_CODES)} for the unsigned code, "
                             f"got bits={self.bits}")
        if not self.unsigned and self.bits != 8:
            raise ValueError(f"BlockCode: the signed code has 8 bits, got bits={self.bits}")
        if self.block < 1:
            raise ValueError(f"BlockCode: block must be >= 1, got {self.block}")

    def coded(self, m: int, esize: int) -> bool:
        """Whether a slice of ``m`` values of ``esize`` bytes travels coded (else exactly)."""
        return state_coded(m, self.bits, esize, self.block)

    def scales(self, m: int) -> int:
        """float32 scales of one slice of ``m`` values."""
        return -(-m // self.block)

    def code_bytes(self, m: int) -> int:
        """Bytes of one slice's packed codes."""
        return -(-m * self.bits // 8)


def encode(rows: Tensor, code: BlockCode) -> Tuple[Tensor, Tensor]:
    """Block-code ``rows`` ([n slices, m values], float32): (scales float32 [n, ceil(m / block)],
    codes uint8 [n, code.code_bytes(m)]): signed, each code an int8's bits; unsigned 8-bit, the code;
    4-bit, two codes a byte (the lower nibble first, a slice's last byte padded with 0)."""
    n, m = rows.shape
    blocks = _blocks(rows.float(), code.block)
    nb = blocks.shape[1]
    if code.unsigned:
        if blocks.numel() and bool((blocks < 0).any()):
            raise ValueError("block code: a second moment must be >= 0; got negative values")
        k, L = OCTAVE_CODES[code.bits], 2 ** code.bits - 1
        scale = blocks.amax(-1, keepdim=True)
        pos = blocks > 0
        ratio = torch.where(pos, scale / torch.where(pos, blocks, torch.ones_like(blocks)), torch.ones_like(blocks))
        q = torch.where(pos, (L - torch.round(k * torch.log2(ratio))).clamp_(1, L), torch.zeros_like(blocks))
        q = q.reshape(n, nb * code.block)[:, :m].to(torch.uint8)
    else:
        scale = blocks.abs().amax(-1, keepdim=True) / QMAX
        inv = torch.where(scale > 0, 1.0 / scale.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(scale))
        q = torch.round(blocks * inv).clamp_(-QMAX, QMAX).reshape(n, nb * code.block)[:, :m].to(torch.int8)
        q = q.view(torch.uint8)
    if code.bits == 4:
        if m % 2:
            q = torch.cat([q, q.new_zeros(n, 1)], 1)
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return scale.reshape(n, nb), q.contiguous()


def decode(scales: Tensor, codes: Tensor, m: int, code: BlockCode) -> Tensor:
    """The values [n, m] (float32) of :func:`encode`'s ``scales`` and ``codes``: signed ``q * scale``;
    unsigned ``scale * 2^((c - L) / k)`` for a code c > 0, else 0."""
    n = codes.shape[0]
    if code.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], -1).reshape(n, 2 * codes.shape[1])[:, :m]
    nb = -(-m // code.block)
    q = (codes.view(torch.int8) if not code.unsigned else codes).float()
    q = _blocks(q, code.block)  # [n, nb, block], padded with 0
    scale = scales.reshape(n, nb, 1)
    if code.unsigned:
        k, L = OCTAVE_CODES[code.bits], 2 ** code.bits - 1
        out = torch.where(q > 0, scale * torch.exp2((q - L) / k), torch.zeros_like(q))
    else:
        out = q * scale
    return out.reshape(n, nb * code.block)[:, :m]


@torch.no_grad()
def fake_quantize_(x: Tensor, dim: Optional[int], bits: int, *, unsigned: bool = False,
                   block: int = MOMENT_BLOCK) -> Tensor:
    """In place: ``x`` becomes what its receivers decode when each slice of ``x`` along ``dim``
    (None: the whole tensor is one slice) travels block-wise coded: signed linear 8-bit
    (``unsigned=False``, ``bits`` 8) or the unsigned log code of ``bits`` (8 or 4) bits. Slices that
    travel exactly (:func:`~.ledger.state_coded`) and empty tensors are left as they are. Returns ``x``."""
    if not unsigned and bits != 8:
        raise ValueError(f"fake_quantize_: the signed code has 8 bits, got bits={bits}")
    if block < 1:
        raise ValueError(f"fake_quantize_: block must be >= 1, got {block}")
    if not x.is_floating_point():
        raise ValueError(f"fake_quantize_: x must be floating point, got {x.dtype}")
    if x.numel() == 0:
        return x
    rows = slices(x, dim)
    n, m = rows.shape
    if not state_coded(m, bits, x.element_size(), block):
        return x
    c = BlockCode(bits, unsigned, block)
    out = decode(*encode(rows, c), m, c)
    if dim is None or x.dim() == 0:
        x.copy_(out.reshape(x.shape))
    else:
        moved = list(x.movedim(dim, 0).shape)
        x.copy_(out.reshape(moved).movedim(0, dim))
    return x
