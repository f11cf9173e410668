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

from typing import Optional

import torch
from torch import Tensor

from .ledger import MOMENT_BLOCK, state_coded

QMAX = 127
#: codes per octave of the unsigned log code, by its bits
OCTAVE_CODES = {8: 8, 4: 1}


def _slices(x: Tensor, dim: Optional[int]) -> Tensor:
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


def signed_8bit(blocks: Tensor) -> Tensor:
    """Decoded linear int8 codes of ``blocks`` ([..., block] float32), one absmax / 127 scale per block."""
    scale = blocks.abs().amax(-1, keepdim=True) / QMAX
    inv = torch.where(scale > 0, 1.0 / scale.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(scale))
    return torch.round(blocks * inv).clamp_(-QMAX, QMAX) * scale


def unsigned_log(blocks: Tensor, bits: int) -> Tensor:
    """Decoded ``bits``-bit log codes of non-negative ``blocks`` ([..., block] float32), one top (the
    block's max) per block (module docstring)."""
    if bits not in OCTAVE_CODES:
        raise ValueError(f"unsigned_log: bits must be one of {sorted(OCTAVE_CODES)}, got {bits}")
    if blocks.numel() and bool((blocks < 0).any()):
        raise ValueError("unsigned_log: a second moment must be >= 0; got negative values")
    k, L = OCTAVE_CODES[bits], 2 ** bits - 1
    top = blocks.amax(-1, keepdim=True)
    pos = blocks > 0
    ratio = torch.where(pos, top / torch.where(pos, blocks, torch.ones_like(blocks)), torch.ones_like(blocks))
    code = (L - torch.round(k * torch.log2(ratio))).clamp_(1, L)
    return torch.where(pos, top * torch.exp2((code - L) / k), torch.zeros_like(blocks))


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
    rows = _slices(x, dim)
    n, m = rows.shape
    if not state_coded(m, bits, x.element_size(), block):
        return x
    out = unsigned_log(_blocks(rows, block), bits) if unsigned else signed_8bit(_blocks(rows, block))
    out = out.reshape(n, -1)[:, :m]
    if dim is None or x.dim() == 0:
        x.copy_(out.reshape(x.shape))
    else:
        moved = list(x.movedim(dim, 0).shape)
        x.copy_(out.reshape(moved).movedim(0, dim))
    return x
