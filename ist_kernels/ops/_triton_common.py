"""Pieces every Triton GEMM in ist_kernels shares (the families' ``_triton`` modules: ops/grelu/_triton.py,
ops/subnet/_triton.py). Imports triton, and nothing of ist_kernels."""
import contextlib
import os
import threading
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

# Kernels are defined in interpreter mode when this is set before ist_kernels is imported (tests
# on CPU); then a single small tile config is used instead of GPU autotuning.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# IST_KERNELS_AUTOTUNE=0 pins every GPU kernel to its one pinned config (the tests do this: one
# compile per specialisation instead of one per config, and the same tiles on every run).
AUTOTUNE = os.environ.get("IST_KERNELS_AUTOTUNE", "1") != "0"


_CHOSEN = {}  # kernel -> (its autotune configs, its pinned config), filled by tuned()

# torch.library.wrap_triton (torch >= 2.6): launches torch.compile can trace (ist_kernels/ops/_cuda.py)
_wrap_triton = getattr(torch.library, "wrap_triton", None)
_STATE = threading.local()


def launch(kernel):
    """``kernel`` ready for ``kernel[grid](...)``: while torch.compile traces the op (``tracing()``,
    ops/_cuda.py) the launch goes through wrap_triton, so that it lands in the graph; every other
    launch is direct. (wrap_triton refuses autotune configs with pre-hooks, which the TMA kernels
    have: an eager call of a launcher, e.g. ``ops.grelu._triton.relu_gates`` on CUDA tensors, failed
    with "pre_hook and post_hook are not supported" on an H200, 2026-11-27.)"""
    return _wrap_triton(kernel) if _wrap_triton is not None and is_tracing() else kernel


@contextlib.contextmanager
def tracing():
    """Marks the launchers as traced by torch.compile (fake tensors): they then read no data
    pointers, enter no device guard, and launch no kernel whose autotune configs have pre-hooks
    (Inductor refuses those)."""
    before = getattr(_STATE, "tracing", False)
    _STATE.tracing = True
    try:
        yield
    finally:
        _STATE.tracing = before


def is_tracing() -> bool:
    return getattr(_STATE, "tracing", False)


def tuned(kernel, configs, key, pinned):
    """``kernel`` autotuned over ``configs`` on a GPU (keyed on ``key``), or over ``[pinned]`` alone
    when IST_KERNELS_AUTOTUNE=0; None under the interpreter (the launchers pass a fixed config).
    Both lists are remembered for the sm_90a report (``chosen_configs``)."""
    _CHOSEN[kernel] = (list(configs), pinned)
    if INTERPRET:
        return None
    return triton.autotune(configs if AUTOTUNE else [pinned], key=key)(kernel)


@triton.jit
def grouped_tile(pid, num_a, num_b, GROUP: tl.constexpr):
    """Grouped ordering of output tiles: GROUP consecutive tiles along a share their tiles along
    b, so those stay in L2. num_a, num_b: tile counts. Returns (tile along a, tile along b)."""
    per_group = GROUP * num_b
    first_a = (pid // per_group) * GROUP
    size = tl.minimum(num_a - first_a, GROUP)
    pid_a = first_a + (pid % per_group) % size
    pid_b = (pid % per_group) // size
    return pid_a, pid_b


def chosen_configs(kernel):
    """(autotune configs, pinned config) that ``tuned`` was given for ``kernel``."""
    if kernel not in _CHOSEN:
        raise KeyError(f"{getattr(kernel, '__name__', kernel)} was never passed to tuned(); give its "
                       f"HopperKernel declaration its configs")
    return _CHOSEN[kernel]


def tuned_kernels():
    """Every kernel passed to ``tuned`` so far (the report lists those without a declaration)."""
    return list(_CHOSEN)


class HopperKernel(NamedTuple):
    """A Triton kernel as tools/hopper_report.py compiles it offline for sm_90a. Each module lists
    its kernels in a module-level ``HOPPER_KERNELS`` next to them.

    ``args(dtype, meta)`` (a torch dtype; the config's parameters, e.g. meta["BM"]) gives
    {parameter name: value} for one launch: every tl.constexpr parameter the config does not set;
    the Triton type of each parameter that is neither a pointer to ``dtype`` nor an i32 ("*i32",
    "tensordesc<{dtype}[128, 64]>", where {dtype} stands for ``dtype``'s Triton name); and each
    integer a contiguous launch passes as 1 (unit strides: the JIT turns those into constants).
    The remaining ``*_ptr`` parameters point to ``dtype``, the remaining ones are i32; pointers and
    integers are taken as multiples of 16, as the JIT specialises contiguous tensors whose sizes
    are multiples of 16. ``configs``: the chosen configs; None takes those the kernel was given to
    ``tuned`` (the autotune list, then the pinned one). ``gemm``: the main loop is a tl.dot, so the
    report requires wgmma (16-bit dtypes) and no spills of every chosen config; memory-bound
    kernels (gemm=False) are reported only."""
    name: str
    kernel: object
    args: Callable
    configs: Optional[Sequence] = None
    gemm: bool = True
