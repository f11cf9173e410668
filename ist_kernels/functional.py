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
