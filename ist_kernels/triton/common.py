"""Pieces every Triton GEMM in ist_kernels shares."""
import os

import triton
import triton.language as tl

# Kernels are defined in interpreter mode when this is set before ist_kernels is imported (tests
# on CPU); then a single small tile config is used instead of GPU autotuning.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# IST_KERNELS_AUTOTUNE=0 pins every GPU kernel to its one pinned config (the tests do this: one
# compile per specialisation instead of one per config, and the same tiles on every run).
AUTOTUNE = os.environ.get("IST_KERNELS_AUTOTUNE", "1") != "0"


def tuned(kernel, configs, key, pinned):
    """``kernel`` autotuned over ``configs`` on a GPU (keyed on ``key``), or over ``[pinned]`` alone
    when IST_KERNELS_AUTOTUNE=0; None under the interpreter (the launchers pass a fixed config)."""
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
