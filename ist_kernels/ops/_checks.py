"""Argument checks shared by fake kernels and Python-registered (Triton) kernels.

The C++ kernels check the same things in csrc/checks.h. Messages name the op and the argument.
"""
import torch


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{op}: {msg}")


def gate_words(num_features: int) -> int:
    return (num_features + 31) // 32


def check_same_device(op: str, **tensors) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    if not named:
        return
    dev = named[0][1].device
    for n, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{op}: {n} is on {t.device} but {named[0][0]} is on {dev}; all tensors must be on one device")


def check_index_list(idx, size: int, op: str, name: str, what: str, device, values: bool = True,
                     allow_duplicates: bool = False) -> None:
    """An optional index list ``name`` (int64, 1-D, on ``device``) into a dimension of ``size``
    slices, described as ``what`` in messages. With ``values``, entries must also be in range and,
    unless ``allow_duplicates``, unique (one host sync on CUDA). Mirrors ist::check_index_list in
    csrc/checks.h (index math in csrc/common/indices.h)."""
    if idx is None:
        return
    check(idx.dtype == torch.int64, op, f"{name} must be an int64 index list, got {idx.dtype}")
    check(idx.dim() == 1, op, f"{name} must be 1-D, got {idx.dim()} dimensions")
    check(idx.device == torch.device(device), op,
          f"{name} is on {idx.device} but the other tensors are on {device}")
    if not values or idx.numel() == 0:
        return
    out_of_range = (idx < 0) | (idx >= size)
    bad = out_of_range.any()
    if not allow_duplicates:
        ordered, order = torch.sort(idx, stable=True)
        repeats = ordered[1:] == ordered[:-1]
        bad = bad | repeats.any()
    if not bool(bad):  # the one host sync
        return
    if bool(out_of_range.any()):
        p = int(out_of_range.nonzero()[0, 0])
        check(False, op, f"{name}[{p}] = {int(idx[p])} is out of range for {what} of size {size}")
    # First position (in list order) whose value appeared earlier, and where it first appeared.
    later = order[1:][repeats]
    p = int(later.min())
    v = int(idx[p])
    first = int((idx == v).nonzero()[0, 0])
    check(False, op, f"{name} must not repeat an index, but {name}[{p}] = {v} repeats {name}[{first}]")
