"""Functional API over ``torch.ops.ist_kernels``: the entry points the modules and users call."""
from typing import Optional

import torch
from torch import Tensor

_ops = torch.ops.ist_kernels


def pack_gates(mask: Tensor) -> Tensor:
    """Pack a mask ``[..., F]`` (bool, or float where > 0 means on) into int32 words
    ``[..., ceil(F/32)]``; bit j of word w is feature 32w + j."""
    return _ops.pack_gates(mask)


def unpack_gates(words: Tensor, num_features: int) -> Tensor:
    """Inverse of :func:`pack_gates`: int32 words ``[..., W]`` -> bool ``[..., num_features]``."""
    return _ops.unpack_gates(words, num_features)


def subnet_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, rows: Optional[Tensor] = None,
                  cols: Optional[Tensor] = None) -> Tensor:
    """The linear layer of one subnetwork of neurons (IST, paper 001 §3.1):
    ``y = x W[rows][:, cols]^T + b[rows]`` without materialising ``W[rows][:, cols]``.

    ``rows`` / ``cols`` are int64 index lists into ``weight``'s out / in features (unique, in any
    order; None = all). ``x`` is compact, ``[..., len(cols)]``; ``y`` is ``[..., len(rows)]``.
    Gradients: compact for ``x``; full-size for ``weight`` and ``bias``, zero outside rows x cols.
    """
    return _ops.subnet_linear(x, weight, bias, rows, cols)
