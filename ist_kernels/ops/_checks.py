"""Argument checks shared by fake kernels and Python-registered (Triton) kernels of several op
families; a family's own checks live in its package (ops/grelu/_checks.py, ops/subnet/_checks.py).

The C++ kernels check the same things in csrc/checks.h and csrc/slices_plan.h.

Error policy: one exception type per kind of mistake, the same whichever path runs the op (the C++
kernels through ``TORCH_CHECK_TYPE`` / ``TORCH_CHECK_INDEX`` / ``TORCH_CHECK_VALUE``, the fake
kernels, the Triton launchers and the functional wrappers):

* ``TypeError``: a tensor of the wrong dtype (or an argument of the wrong Python type);
* ``IndexError``: an index out of range: an index-list entry, a source / target id, a dim;
* ``ValueError``: everything else: shapes and sizes, devices, list lengths (``output_mask``
  included), repeated indices, an output or written tensor sharing memory with an input (index
  lists included), an unknown ``reduce``.

Every message starts with the op's name, names the argument as the caller passed it
(``indices[3]``, ``targets[5]``, ``output_mask``) and says what was expected. Every check runs
before anything is written, so a failed call leaves every tensor unchanged.
"""
from typing import Optional

import torch


def check(cond: bool, op: str, msg: str, kind: type = ValueError) -> None:
    """Raise ``kind`` (ValueError unless told otherwise; see the policy above) with "op: msg".
    ``msg`` is built before the call: on a hot path, test the condition first and call
    :func:`fail` (the checks below build no string when the input is good)."""
    if not cond:
        raise kind(f"{op}: {msg}")


def fail(op: str, msg: str, kind: type = ValueError):
    """Raise ``kind`` with "op: msg" (a failed check; the message is built only here)."""
    raise kind(f"{op}: {msg}")


def check_type(cond: bool, op: str, msg: str) -> None:
    """A dtype mistake: TypeError (TORCH_CHECK_TYPE in C++)."""
    check(cond, op, msg, TypeError)


def check_index(cond: bool, op: str, msg: str) -> None:
    """An index out of range: IndexError (TORCH_CHECK_INDEX in C++)."""
    check(cond, op, msg, IndexError)


def gate_words(num_features: int) -> int:
    return (num_features + 31) // 32


def check_same_device(op: str, **tensors) -> None:
    dev = None
    for n, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            first, dev = n, t.device
        elif t.device != dev:
            fail(op, f"{n} is on {t.device} but {first} is on {dev}; all tensors must be on one device")


def check_index_list(idx, size: int, op: str, name: str, what: str, device, values: bool = True,
                     allow_duplicates: bool = False) -> None:
    """An optional index list ``name`` (int64, 1-D, on ``device``) into a dimension of ``size``
    slices, described as ``what`` in messages. With ``values``, entries must also be in range and,
    unless ``allow_duplicates``, unique (one host sync on CUDA). Mirrors ist::check_index_list in
    csrc/checks.h (index math in csrc/common/indices.h)."""
    if idx is None:
        return
    if idx.dtype != torch.int64:
        fail(op, f"{name} must be an int64 index list, got {idx.dtype}", TypeError)
    if idx.dim() != 1:
        fail(op, f"{name} must be 1-D, got {idx.dim()} dimensions")
    if idx.device != torch.device(device):
        fail(op, f"{name} is on {idx.device} but the other tensors are on {device}")
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
        fail(op, f"{name}[{p}] = {int(idx[p])} is out of range for {what} of size {size}", IndexError)
    # First position (in list order) whose value appeared earlier, and where it first appeared.
    later = order[1:][repeats]
    p = int(later.min())
    v = int(idx[p])
    first = int((idx == v).nonzero()[0, 0])
    fail(op, f"{name} must not repeat an index, but {name}[{p}] = {v} repeats {name}[{first}]")


def check_output_mask(op: str, output_mask) -> None:
    """(grad_x, grad_weight, grad_bias) flags: exactly 3 (the schema's bool[3]; the dispatcher does
    not check the length)."""
    if len(output_mask) != 3:
        fail(op, f"output_mask must have 3 entries (grad_x, grad_weight, grad_bias), got {len(output_mask)}")


# ---- memory overlap (out= / in-place arguments against every input); mirrors ist::memory_overlap
# in csrc/checks.h.
EXACT_OVERLAP_MAX = 1 << 20  # elements compared one by one at most (interleaved strided views)


def byte_range(t: torch.Tensor):
    """[begin, end) addresses of the bytes t's elements occupy (t not empty)."""
    lo = sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    p, es = t.data_ptr(), t.element_size()
    return p + lo * es, p + (hi + 1) * es


def _element_starts(t: torch.Tensor) -> torch.Tensor:
    off = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        off = off[..., None] + torch.arange(n, dtype=torch.int64) * s
    return (t.data_ptr() + off.reshape(-1) * t.element_size()).sort().values


def memory_overlap(a: torch.Tensor, b: torch.Tensor) -> Optional[bool]:
    """Whether a and b share a byte: False when either is empty (or has no data: meta), their
    storages differ or their byte ranges are disjoint; True / False exactly when the ranges meet
    (both contiguous: True; else element by element up to EXACT_OVERLAP_MAX elements); None
    (unknown, to be treated as shared) beyond that."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    if a.numel() + b.numel() > EXACT_OVERLAP_MAX:
        return None
    sa, sb = _element_starts(a), _element_starts(b)
    # an element of b at [s, s + esb) meets one of a at [r, r + esa) iff s - esa < r < s + esb
    k = torch.searchsorted(sa, sb - a.element_size(), right=True)
    hit = k < sa.numel()
    return bool((sa[k[hit]] < sb[hit] + b.element_size()).any())


def overlap_words(shared: Optional[bool]) -> str:
    """" shares memory with " / " may share memory with ... " for a failed overlap check."""
    return (" shares memory with " if shared
            else " may share memory with (interleaved strided views too large to compare) ")
