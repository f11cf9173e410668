"""pack_gates / unpack_gates: 1-bit gates (bit j of int32 word w is feature 32w+j)."""
import torch

from .._checks import check, check_type, gate_words


@torch.library.register_fake("ist_kernels::pack_gates")
def _pack_gates_fake(mask):
    check(mask.dim() >= 1, "pack_gates", "mask must have at least 1 dimension (features last), got a 0-d tensor")
    check_type(mask.dtype == torch.bool or mask.dtype.is_floating_point, "pack_gates",
          f"mask must be bool or floating point (> 0 means on), got {mask.dtype}")
    return mask.new_empty((*mask.shape[:-1], gate_words(mask.shape[-1])), dtype=torch.int32)


@torch.library.register_fake("ist_kernels::unpack_gates")
def _unpack_gates_fake(words, num_features):
    check_type(words.dtype == torch.int32, "unpack_gates", f"words must be int32 (packed gates), got {words.dtype}")
    check(words.dim() >= 1, "unpack_gates", "words must have at least 1 dimension, got a 0-d tensor")
    check(num_features >= 0, "unpack_gates", f"num_features must be >= 0, got {num_features}")
    check(gate_words(num_features) == words.shape[-1], "unpack_gates",
          f"num_features={num_features} needs {gate_words(num_features)} words per row, but words has {words.shape[-1]}")
    return words.new_empty((*words.shape[:-1], num_features), dtype=torch.bool)
