"""Bad inputs, as a table: for each op, each argument, each kind of misuse (shape, dtype, device,
an index out of range / negative / huge / repeated, an output or written tensor sharing memory with
an input, index lists included, empty lists and tensors), the documented exception type
(ist_kernels/ops/_checks.py: TypeError for a dtype, IndexError for an index, ValueError for the
rest), a message naming the argument, and every input tensor unchanged (compared with clones).

Each probe runs on every path that can see the mistake: the C++ kernel (CPU tensors through
torch.ops), the fake kernel (the same arguments as meta tensors; mistakes that need the data,
such as index values or aliasing, are not visible there), the Triton launchers (under
TRITON_INTERPRET=1 on CPU tensors), and the functional wrappers. A few valid inputs of the same
kinds (empty lists, strided index lists, interleaved views that share no element) must pass and
give the reference's result.

Probes run in subprocesses, many per process; a probe that crashes its process (a segfault) is a
failure named by re-running the unfinished probes one at a time, and the rest go on.
"""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from typing import Callable, Optional

import pytest
import torch

import ist_kernels.functional as F

import reference as ref

ops = torch.ops.ist_kernels
CPP, FAKE, TRITON, GATHER_GEMM = "cpp", "fake", "triton", "gather-gemm"
BATCH = 400  # probes per subprocess


@dataclasses.dataclass(frozen=True)
class Probe:
    op: str  # an op of torch.ops.ist_kernels, or "F.<name>" (the functional wrapper)
    argument: str  # the misused argument, as the caller names it
    misuse: str  # shape, dtype, device, range, negative, huge, repeat, alias, empty, length, valid
    build: Callable[[], list]  # fresh positional arguments (CPU tensors)
    expect: Optional[type]  # the exception type; None: the call must succeed
    match: str = ""  # regex the message must contain (it names the argument)
    paths: tuple = (CPP,)
    check: Optional[Callable] = None  # (args) -> None for a valid probe: the result is right
    writes: tuple = ()  # positions of the arguments a valid call writes (not compared with clones)
    note: str = ""  # tells probes of one (op, argument, misuse) apart

    @property
    def name(self):
        return f"{self.op}:{self.argument}:{self.misuse}" + (f":{self.note}" if self.note else "")


# ------------------------------------------------------------------------------------- building
def t(*values):
    return torch.tensor(values, dtype=torch.int64)


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def on_meta(x):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def strided_list(*values, junk=10**12):
    """An index list as a stride-2 view with junk between the entries."""
    buf = torch.full((2 * len(values) + 1,), junk, dtype=torch.int64)
    buf[1::2] = torch.tensor(values, dtype=torch.int64)
    return buf[1::2]


def replace(build, pos, value):
    """build with argument pos replaced (value: a tensor/int/list, or fn(args) -> new value)."""
    def b():
        args = build()
        args[pos] = value(args) if callable(value) else value
        return args
    return b


def replace_in(build, pos, k, value):
    """build with entry k of the list argument pos replaced."""
    def b():
        args = build()
        items = list(args[pos])
        items[k] = value(args) if callable(value) else value
        args[pos] = items
        return args
    return b


PROBES: list = []


def add(*args, **kwargs):
    PROBES.append(Probe(*args, **kwargs))


# --------------------------------------------------------------------------------------- gates
def pack_args():
    return [rnd(3, 40) > 0]


def unpack_args():
    return [torch.tensor([[5, -1], [0, 7]], dtype=torch.int32), 40]


DATA_FREE = (CPP, FAKE)  # mistakes visible without reading data
add("pack_gates", "mask", "shape", replace(pack_args, 0, torch.tensor(True)), ValueError,
    r"mask must have at least 1 dimension", DATA_FREE)
add("pack_gates", "mask", "dtype", replace(pack_args, 0, torch.ones(3, 4, dtype=torch.int32)), TypeError,
    r"mask must be bool or floating", DATA_FREE)
add("pack_gates", "mask", "empty", replace(pack_args, 0, torch.ones(0, 5)), None, paths=DATA_FREE)
add("pack_gates", "mask", "empty", replace(pack_args, 0, torch.ones(4, 0)), None, paths=DATA_FREE, note="features")
add("unpack_gates", "words", "dtype", replace(unpack_args, 0, torch.zeros(2, 2)), TypeError, r"words must be int32",
    DATA_FREE)
add("unpack_gates", "words", "shape", replace(unpack_args, 0, torch.tensor(3, dtype=torch.int32)), ValueError,
    r"words must have at least 1 dimension", DATA_FREE)
add("unpack_gates", "num_features", "negative", replace(unpack_args, 1, -1), ValueError,
    r"num_features must be >= 0, got -1", DATA_FREE)
add("unpack_gates", "num_features", "range", replace(unpack_args, 1, 65), ValueError,
    r"num_features=65 needs 3 words per row, but words has 2", DATA_FREE)
add("unpack_gates", "num_features", "huge", replace(unpack_args, 1, 2**63 - 1), ValueError,
    r"num_features=9223372036854775807 needs 288230376151711744 words per row", DATA_FREE)
add("unpack_gates", "num_features", "huge", replace(unpack_args, 1, -2**63), ValueError,
    r"num_features must be >= 0", DATA_FREE, note="negative")
add("unpack_gates", "words", "empty", replace(replace(unpack_args, 0, torch.zeros(0, 2, dtype=torch.int32)), 1, 33),
    None, paths=DATA_FREE)

# ---------------------------------------------------------------------------------- GReLU layers
# x [3, 5], weight [7, 5], bias [7], gates [3, 1], grad_out [3, 7]
GEMM = (CPP, FAKE, TRITON)
GEMM_DEVICE = (CPP, TRITON)  # a meta tensor among CPU ones: the op dispatches to the fake kernel


def relu_gates_args():
    return [rnd(3, 5), rnd(7, 5, seed=1), rnd(7, seed=2)]


def gated_linear_args():
    return relu_gates_args() + [torch.tensor([[0x55], [-1], [3]], dtype=torch.int32)]


def gated_backward_args():
    x, w, _, g = gated_linear_args()
    return [rnd(3, 7, seed=3), x, w, g, [True, True, True]]


for op, build in (("relu_gates", relu_gates_args), ("gated_linear", gated_linear_args)):
    add(op, "x", "shape", replace(build, 0, torch.tensor(1.0)), ValueError, r"x must have at least 1 dimension", GEMM)
    add(op, "x", "shape", replace(build, 0, rnd(3, 4)), ValueError, r"x has 4 features \(last dim\)", GEMM,
        note="features")
    add(op, "x", "dtype", replace(build, 0, torch.ones(3, 5, dtype=torch.int32)), TypeError,
        r"x must be float32, float64, bfloat16 or float16", GEMM)
    add(op, "x", "device", replace(build, 0, lambda a: on_meta(a[0])), ValueError, r"x is on meta", GEMM_DEVICE)
    add(op, "x", "empty", replace(replace(build, 0, rnd(0, 5)), 3, torch.zeros(0, 1, dtype=torch.int32))
        if op == "gated_linear" else replace(build, 0, rnd(0, 5)), None, paths=GEMM)
    add(op, "weight", "shape", replace(build, 1, rnd(7)), ValueError, r"weight must be 2-D", GEMM)
    add(op, "weight", "dtype", replace(build, 1, rnd(7, 5, dtype=torch.float64)), TypeError,
        r"weight must have x's dtype", GEMM)
    add(op, "weight", "device", replace(build, 1, lambda a: on_meta(a[1])), ValueError, r"weight is on meta",
        GEMM_DEVICE)
    add(op, "bias", "shape", replace(build, 2, rnd(6)), ValueError, r"bias must be \[7\]", GEMM)
    add(op, "bias", "dtype", replace(build, 2, rnd(7, dtype=torch.float16)), TypeError, r"bias must have x's dtype",
        GEMM)
    add(op, "bias", "device", replace(build, 2, lambda a: on_meta(a[2])), ValueError, r"bias is on meta",
        GEMM_DEVICE)
add("relu_gates", "weight", "empty", lambda: [rnd(3, 5), rnd(0, 5), rnd(0)], None, paths=GEMM)
add("relu_gates", "x", "empty", lambda: [rnd(3, 0), rnd(7, 0), None], None, paths=GEMM, note="features")
add("gated_linear", "gates", "dtype", replace(gated_linear_args, 3, torch.zeros(3, 1, dtype=torch.int64)), TypeError,
    r"gates must be int32", GEMM)
add("gated_linear", "gates", "shape", replace(gated_linear_args, 3, torch.zeros(3, 2, dtype=torch.int32)),
    ValueError, r"gates must be \[3, 1\]", GEMM)
add("gated_linear", "gates", "device", replace(gated_linear_args, 3, lambda a: on_meta(a[3])), ValueError,
    r"gates is on meta", GEMM_DEVICE)

b = gated_backward_args
add("gated_linear_backward", "grad_out", "shape", replace(b, 0, rnd(3, 6)), ValueError, r"grad_out must be \[3, 7\]",
    GEMM)
add("gated_linear_backward", "grad_out", "dtype", replace(b, 0, rnd(3, 7, dtype=torch.float64)), TypeError,
    r"grad_out must have x's dtype", GEMM)
add("gated_linear_backward", "grad_out", "device", replace(b, 0, lambda a: on_meta(a[0])), ValueError,
    r"grad_out is on meta", GEMM_DEVICE)
add("gated_linear_backward", "x", "shape", replace(b, 1, rnd(3, 4)), ValueError, r"x has 4 features", GEMM)
add("gated_linear_backward", "x", "dtype", replace(b, 1, rnd(3, 5, dtype=torch.float64)), TypeError,
    r"weight must have x's dtype", GEMM)
add("gated_linear_backward", "weight", "shape", replace(b, 2, rnd(7, 5, 1)), ValueError, r"weight must be 2-D", GEMM)
add("gated_linear_backward", "weight", "device", replace(b, 2, lambda a: on_meta(a[2])), ValueError,
    r"weight is on meta", GEMM_DEVICE)
add("gated_linear_backward", "gates", "shape", replace(b, 3, torch.zeros(2, 1, dtype=torch.int32)), ValueError,
    r"gates must be \[3, 1\]", GEMM)
add("gated_linear_backward", "gates", "dtype", replace(b, 3, torch.zeros(3, 1)), TypeError, r"gates must be int32",
    GEMM)
add("gated_linear_backward", "output_mask", "length", replace(b, 4, [True, True]), ValueError,
    r"output_mask must have 3 entries \(grad_x, grad_weight, grad_bias\), got 2", GEMM)
add("gated_linear_backward", "output_mask", "length", replace(b, 4, [True] * 4), ValueError,
    r"output_mask must have 3 entries .*got 4", GEMM, note="4")
add("gated_linear_backward", "output_mask", "empty", replace(b, 4, [False] * 3), None, paths=GEMM)

# --------------------------------------------------------------------------------- subnet_linear
# weight [6, 5], bias [6], rows [4, 0, 2], cols [1, 4, 0], x [2, 3], grad_out [2, 3]


def subnet_args():
    return [rnd(2, 3), rnd(6, 5, seed=1), rnd(6, seed=2), t(4, 0, 2), t(1, 4, 0)]


def subnet_backward_args():
    x, w, _, rows, cols = subnet_args()
    return [rnd(2, 3, seed=3), x, w, rows, cols, [True, True, True]]


def check_subnet_forward(args):
    x, w, bias, rows, cols = args["inputs"]
    torch.testing.assert_close(args["result"].double(), ref.subnet_linear(x, w, bias, rows, cols))


def check_subnet_backward(args):
    g, x, w, rows, cols, mask = args["inputs"]
    for got, want, on in zip(args["result"], ref.subnet_linear_backward(g, x, w, rows, cols), mask):
        if on:  # full-size gradients are exactly zero outside rows x cols: never uninitialised memory
            torch.testing.assert_close(got.double(), want)
            assert (got.double()[want == 0] == 0).all()


for op, build, w_pos, check in (("subnet_linear", subnet_args, 1, check_subnet_forward),
                                ("subnet_linear_backward", subnet_backward_args, 2, check_subnet_backward)):
    for pos, name, size, dim in ((3, "rows", 6, 0), (4, "cols", 5, 1)):  # rows / cols: arguments 3 / 4 of both
        add(op, name, "dtype", replace(build, pos, lambda a, p=pos: a[p].int()), TypeError,
            rf"{name} must be an int64 index list", GEMM)
        add(op, name, "shape", replace(build, pos, lambda a, p=pos: a[p][None]), ValueError, rf"{name} must be 1-D",
            GEMM)
        add(op, name, "device", replace(build, pos, lambda a, p=pos: on_meta(a[p])), ValueError,
            rf"{name} is on meta", GEMM_DEVICE)
        add(op, name, "range", replace(build, pos, t(1, size, 0)), IndexError,
            rf"{name}\[1\] = {size} is out of range for weight dim {dim}", (CPP, TRITON))
        add(op, name, "negative", replace(build, pos, t(1, -1, 0)), IndexError, rf"{name}\[1\] = -1 is out of range",
            (CPP, TRITON))
        add(op, name, "huge", replace(build, pos, t(1, 2, 2**62)), IndexError,
            rf"{name}\[2\] = {2**62} is out of range", (CPP, TRITON))
        add(op, name, "repeat", replace(build, pos, t(2, 0, 2)), ValueError,
            rf"{name} must not repeat an index, but {name}\[2\] = 2 repeats {name}\[0\]", (CPP, TRITON))
        add(op, name, "valid", replace(build, pos, strided_list(3, 1, 0, junk=2**40)), None, paths=(CPP, TRITON),
            check=check, note="strided (issue 10 item 3)")
    add(op, "weight", "dtype", replace(build, w_pos, lambda a, p=w_pos: a[p].int()), TypeError,
        r"weight must be .*float32", GEMM)
add("subnet_linear", "bias", "shape", replace(subnet_args, 2, rnd(5)), ValueError, r"bias must have shape \[6\]", GEMM)
add("subnet_linear_backward", "output_mask", "length", replace(subnet_backward_args, 5, [True, False]), ValueError,
    r"output_mask must have 3 entries \(grad_x, grad_weight, grad_bias\), got 2", GEMM)

s, sb = subnet_args, subnet_backward_args
add("subnet_linear", "x", "shape", replace(s, 0, rnd(2, 4)), ValueError,
    r"x has 4 features but the subnetwork has 3 \(len\(cols\)\)", GEMM)
add("subnet_linear", "x", "shape", replace(s, 0, torch.tensor(1.0)), ValueError, r"x must have at least 1 dimension",
    GEMM, note="0-d")
add("subnet_linear", "x", "dtype", replace(s, 0, rnd(2, 3, dtype=torch.float64)), TypeError,
    r"x has dtype torch.float64 but weight has dtype|x has dtype Double but weight has dtype", GEMM)
add("subnet_linear", "x", "device", replace(s, 0, lambda a: on_meta(a[0])), ValueError, r"x is on meta", GEMM_DEVICE)
add("subnet_linear", "weight", "shape", replace(s, 1, rnd(6)), ValueError, r"weight must be 2-D", GEMM)
add("subnet_linear", "bias", "dtype", replace(s, 2, rnd(6, dtype=torch.float64)), TypeError, r"bias has dtype", GEMM)
add("subnet_linear", "bias", "device", replace(s, 2, lambda a: on_meta(a[2])), ValueError, r"bias is on meta",
    GEMM_DEVICE)
add("subnet_linear", "rows", "empty", replace(s, 3, t()), None, paths=(CPP, TRITON), check=check_subnet_forward)
add("subnet_linear", "cols", "empty", replace(replace(s, 4, t()), 0, rnd(2, 0)), None, paths=(CPP, TRITON),
    check=check_subnet_forward)
add("subnet_linear", "x", "empty", replace(s, 0, rnd(0, 3)), None, paths=(CPP, TRITON), check=check_subnet_forward)
add("subnet_linear_backward", "grad_out", "shape", replace(sb, 0, rnd(2, 4)), ValueError,
    r"grad_out must have shape \[2, 3\]", GEMM)
add("subnet_linear_backward", "grad_out", "dtype", replace(sb, 0, rnd(2, 3, dtype=torch.float64)), TypeError,
    r"grad_out has dtype", GEMM)
add("subnet_linear_backward", "grad_out", "device", replace(sb, 0, lambda a: on_meta(a[0])), ValueError,
    r"grad_out is on meta", GEMM_DEVICE)
add("subnet_linear_backward", "x", "shape", replace(sb, 1, rnd(2, 2)), ValueError, r"x has 2 features", GEMM)
add("subnet_linear_backward", "cols", "empty", replace(replace(sb, 4, t()), 1, rnd(2, 0)), None, paths=(CPP, TRITON),
    check=check_subnet_backward)
add("subnet_linear_backward", "rows", "empty", replace(replace(sb, 3, t()), 0, rnd(2, 0)), None, paths=(CPP, TRITON),
    check=check_subnet_backward)
add("subnet_linear_backward", "cols", "empty", lambda: [rnd(2, 3), rnd(2, 0), rnd(6, 5), t(4, 0, 2), t(), [False, True, False]],
    None, paths=(CPP, TRITON), check=check_subnet_backward, note="grad_weight only")


# ---------------------------------------------------------------------------------------- gather
# sources [w (6, 4), v (5,)], segments: w rows [1, 3], v [4], w rows [] -> 8 + 1 + 0 elements
def gather_args():
    return [[rnd(6, 4), rnd(5, seed=1)], [0, 1, 0], [t(1, 3), t(4), t()], [0, 0]]


def gather_into_args():
    return [torch.full((9,), 7.0)] + gather_args()


def check_gather(args):
    srcs, ids, idx, dims = args["inputs"][-4:]
    want = ref.slice_gather(srcs, ids, idx, dims)
    got = args["result"] if args["result"] is not None else args["inputs"][0]
    assert torch.equal(got, want)


def index_probes(op, build, pos, paths_data, what):
    """The misuses of index list 1 (into v, size 5) of a gather / scatter; pos: indices' position."""
    add(op, "indices[1]", "dtype", replace_in(build, pos, 1, t(4).int()), TypeError, r"indices\[1\] must be int64",
        DATA_FREE)
    add(op, "indices[1]", "shape", replace_in(build, pos, 1, t(4)[None]), ValueError, r"indices\[1\] must be 1-D",
        DATA_FREE)
    add(op, "indices[1]", "device", replace_in(build, pos, 1, on_meta(t(4))), ValueError,
        r"indices\[1\] is on meta but the tensors are on cpu; index lists must be on the CPU$", (CPP,))
    add(op, "indices[1]", "range", replace_in(build, pos, 1, t(5)), IndexError,
        rf"indices\[1\]\[0\] = 5 is out of range for {what}\[1\] along dim 0 of size 5", paths_data)
    add(op, "indices[1]", "negative", replace_in(build, pos, 1, t(-1)), IndexError,
        r"indices\[1\]\[0\] = -1 is out of range", paths_data)
    add(op, "indices[1]", "huge", replace_in(build, pos, 1, t(2**63 - 1)), IndexError,
        r"indices\[1\]\[0\] = 9223372036854775807 is out of range", paths_data)
    add(op, "indices[0]", "repeat", replace_in(build, pos, 0, t(3, 3)), ValueError,
        r"indices\[0\] must not repeat an index, but indices\[0\]\[1\] = 3 repeats indices\[0\]\[0\]", paths_data)
    add(op, "indices", "length", replace(build, pos, lambda a: a[pos][:2]), ValueError, r"one entry per segment",
        DATA_FREE)


for op, build, off in (("slice_gather", gather_args, 0), ("slice_gather_into_", gather_into_args, 1)):
    check = check_gather
    add(op, "sources", "dtype", replace_in(build, off, 1, rnd(5, dtype=torch.float64)), TypeError,
        r"sources\[1\] has dtype", DATA_FREE)
    add(op, "sources", "device", replace_in(build, off, 1, on_meta(rnd(5))), ValueError, r"sources\[1\] is on meta",
        (CPP,))
    add(op, "sources", "shape", replace_in(build, off, 1, torch.tensor(1.0)), ValueError, r"sources\[1\] is 0-d",
        DATA_FREE)
    add(op, "source_ids", "range", replace_in(build, off + 1, 1, 2), IndexError,
        r"source_ids\[1\] = 2 is out of range: there are 2 sources", DATA_FREE)
    add(op, "source_ids", "negative", replace_in(build, off + 1, 1, -1), IndexError, r"source_ids\[1\] = -1",
        DATA_FREE)
    add(op, "source_ids", "length", replace(build, off + 1, [0, 1]), ValueError,
        r"source_ids and indices must have one entry per segment, got 2 and 3", DATA_FREE)
    add(op, "dims", "range", replace(build, off + 3, [0, 1]), IndexError,
        r"dims\[1\] = 1 is out of range for sources\[1\] with 1 dimensions", DATA_FREE)
    add(op, "dims", "length", replace(build, off + 3, [0]), ValueError, r"dims must have one entry per sources",
        DATA_FREE)
    index_probes(op, build, off + 2, (CPP,), "sources")
    add(op, "indices", "valid", replace_in(replace_in(build, off + 2, 0, strided_list(3, 1)), off + 2, 1,
                                           strided_list(4, junk=-5)), None,
        check=check, writes=(0,) if off else (), note="strided")
    repeated = replace(build, off + 2, [t(1, 3), t(4), t(3, 1)])  # 8 + 1 + 8 elements
    add(op, "indices", "valid", replace(repeated, 0, torch.full((17,), 7.0)) if off else repeated, None, check=check,
        writes=(0,) if off else (), note="repeated across lists")
    add(op, "sources", "valid", replace_in(build, off, 0, lambda a, o=off: torch.empty(6, 8)[:, ::2].copy_(a[o][0])),
        None,
        check=check, writes=(0,) if off else (), note="strided")
add("slice_gather", "sources", "empty", replace(gather_args, 0, []), ValueError, r"sources is empty", DATA_FREE)
add("F._gather_flat", "sources", "empty", lambda: [[], [], [], []], ValueError, r"sources is empty")

g = gather_into_args
add("slice_gather_into_", "out", "dtype", replace(g, 0, torch.zeros(9, dtype=torch.float64)), TypeError,
    r"out has dtype", DATA_FREE)
add("slice_gather_into_", "out", "shape", replace(g, 0, torch.zeros(8)), ValueError,
    r"out must be 1-D with 9 elements .*got shape \[8\]", DATA_FREE)
add("slice_gather_into_", "out", "shape", replace(g, 0, torch.zeros(3, 3)), ValueError,
    r"out must be 1-D with 9 elements", DATA_FREE, note="2-D")
add("slice_gather_into_", "out", "layout", replace(g, 0, torch.zeros(18)[::2]), ValueError, r"out must be contiguous",
    DATA_FREE)
add("slice_gather_into_", "out", "device", replace(g, 0, on_meta(torch.zeros(9))), ValueError, r"out is on meta",
    (CPP,))


def out_in(source_pos, start):
    """out as 9 elements of the buffer that sources[source_pos] views (6 x 4 or 5 elements)."""
    def b():
        args = gather_into_args()
        buf = torch.zeros(64)
        src = args[1][source_pos]
        view = buf[16:16 + src.numel()].view(src.shape)
        view.copy_(src)
        args[1][source_pos] = view
        args[0] = buf[start:start + 9]
        return args
    return b


add("slice_gather_into_", "out", "alias", out_in(0, 20), ValueError, r"out shares memory with sources\[0\]",
    note="inside sources[0]")
add("slice_gather_into_", "out", "alias", out_in(1, 10), ValueError, r"out shares memory with sources\[1\]",
    note="overlapping the start of sources[1]")
add("slice_gather_into_", "out", "valid", out_in(0, 7), None, check=check_gather, writes=(0,),
    note="just before sources[0]")


def out_over_index_list():
    """issue 10, item 1: out (int64) is also the memory of an index list; it used to segfault."""
    b = torch.tensor([0, 1, 0, 0])
    return [b, [torch.full((4, 2), 10**12)], [0], [b[:2]], [0]]


add("slice_gather_into_", "out", "alias", out_over_index_list, ValueError, r"out shares memory with indices\[0\]",
    note="an index list (issue 10 item 1)")


def out_in_gap(start):
    """a source of every other element of a buffer, out one element long at buf[start]."""
    def b():
        buf = torch.arange(12.0)
        return [buf[start:start + 1], [buf[0::2]], [0], [t(2)], [0]]
    return b


add("slice_gather_into_", "out", "valid", out_in_gap(5), None, check=check_gather, writes=(0,),
    note="in a gap of a strided source")
add("slice_gather_into_", "out", "alias", out_in_gap(4), ValueError,
    r"out shares memory with sources\[0\]", note="on an element of a strided source")


def strided_source_issue():
    """issue 10, item 6: a strided source was rejected as 'out shares memory'."""
    src = torch.randn(4, 6)[:, ::2]
    return [torch.empty(6), [src], [0], [t(0, 2)], [0]]


add("slice_gather_into_", "sources", "valid", strided_source_issue, None, check=check_gather, writes=(0,),
    note="issue 10 item 6")


def gather_slices_into_holder_strided():
    return [[torch.randn(4, 6)[:, ::2], torch.randn(3, dtype=torch.float64)], [0, 1], [t(0, 2), t(1)], [0, 0]]


def check_gather_slices(args):
    srcs, ids, idx, dims = args["inputs"]
    for part, s, i in zip(args["result"], ids, idx):
        assert torch.equal(part, srcs[s].index_select(dims[s], i))


add("F.gather_slices(out=GatherBuffers)", "sources", "valid", gather_slices_into_holder_strided, None,
    check=check_gather_slices, note="strided, mixed dtypes (issue 10 item 6)")
add("F.gather_slices", "indices[2]", "range",
    lambda: [[rnd(4, 3), t(5, 6, 7)], [0, 1, 1], [t(1), t(0), t(3)], [0, 0]], IndexError,
    r"indices\[2\]\[0\] = 3 is out of range for sources\[1\] along dim 0 of size 3", note="mixed dtypes")
add("F._gather_flat(out=)", "out", "alias", lambda: (lambda b: [b, [torch.full((4, 2), 10**12)], [0], [b[:2]], [0]])(
    torch.tensor([0, 1, 0, 0])), ValueError, r"out shares memory with indices\[0\]")


# --------------------------------------------------------------------------------------- scatter
# targets [w (6, 4), v (5,)], segments: w rows [1, 3], v [4], w rows [5]


def scatter_args(reduce="mean"):
    return [[rnd(6, 4), rnd(5, seed=1)], [0, 1, 0], [rnd(2, 4, seed=2), rnd(1, seed=3), rnd(1, 4, seed=4)],
            [t(1, 3), t(4), t(5)], [0, 0], reduce]


def check_scatter(args):
    targets, ids, updates, idx, dims, reduce = args["inputs"]
    want = ref.slice_scatter(args["before"][0], ids, updates, idx, dims, reduce)
    for got, w in zip(targets, want):
        torch.testing.assert_close(got.to(w.dtype), w)


sc = scatter_args
add("slice_scatter_", "targets", "empty", replace(sc, 0, []), ValueError, r"targets is empty", DATA_FREE)
add("slice_scatter_", "targets", "dtype", replace_in(sc, 0, 1, rnd(5, dtype=torch.float64)), TypeError,
    r"targets\[1\] has dtype", DATA_FREE)
add("slice_scatter_", "targets", "dtype", lambda: [[torch.zeros(4, dtype=torch.bool)], [0], [torch.ones(1, dtype=torch.bool)],
                                                   [t(0)], [0], "sum"], TypeError,
    r'reduce="sum" needs a floating or integer dtype, got', DATA_FREE, note="bool with sum")
add("slice_scatter_", "targets", "device", replace_in(sc, 0, 1, on_meta(rnd(5))), ValueError,
    r"targets\[1\] is on meta", (CPP,))
add("slice_scatter_", "targets", "shape", replace_in(sc, 0, 1, torch.tensor(1.0)), ValueError, r"targets\[1\] is 0-d",
    DATA_FREE)
add("slice_scatter_", "targets", "layout", replace_in(sc, 0, 1, torch.zeros(1).expand(5)), ValueError,
    r"targets\[1\] has elements that share memory \(an expanded view\?\)")
add("slice_scatter_", "targets", "alias", replace_in(sc, 0, 1, lambda a: a[0][0].view(-1)[3:8]), ValueError,
    r"targets\[0\] shares memory with targets\[1\]", note="another target")
add("slice_scatter_", "targets", "alias", lambda: (lambda w: [[w, rnd(5)], [0, 1, 0], [w[2:4], rnd(1), rnd(1, 4)],
                                                               [t(1, 3), t(4), t(5)], [0, 0], "mean"])(rnd(6, 4)),
    ValueError, r"targets\[0\] shares memory with updates\[0\]", note="an update")
add("slice_scatter_", "targets", "alias", lambda: (lambda n: [[n], [0], [torch.tensor([7, 7])], [n[:2]], [0], "copy"])(
    torch.tensor([0, 1, 2, 3])), ValueError, r"targets\[0\] shares memory with indices\[0\]", note="an index list")
add("slice_scatter_", "targets", "valid",
    lambda: (lambda buf: [[buf[0::2].view(3, 4), buf[1::2].view(3, 4)], [0, 1], [rnd(1, 4), rnd(2, 4, seed=1)],
                          [t(2), t(0, 1)], [0, 0], "mean"])(rnd(24, seed=5)),
    None, check=check_scatter, writes=(0,), note="interleaved, no element shared")
add("slice_scatter_", "target_ids", "range", replace_in(sc, 1, 2, 2), IndexError,
    r"target_ids\[2\] = 2 is out of range: there are 2 targets", DATA_FREE)
add("slice_scatter_", "target_ids", "negative", replace_in(sc, 1, 2, -1), IndexError, r"target_ids\[2\] = -1",
    DATA_FREE)
add("slice_scatter_", "target_ids", "length", replace(sc, 1, [0, 1]), ValueError,
    r"target_ids, updates and indices must have one entry per segment, got 2, 3 and 3", DATA_FREE)
add("slice_scatter_", "updates", "shape", replace_in(sc, 2, 0, rnd(3, 4)), ValueError,
    r"updates\[0\] has shape \[3, 4\] but targets\[0\] \[6, 4\] sliced along dim 0 by indices\[0\] \(2 slices\) needs "
    r"\[2, 4\]", DATA_FREE)
add("slice_scatter_", "updates", "dtype", replace_in(sc, 2, 1, rnd(1, dtype=torch.float16)), TypeError,
    r"updates\[1\] has dtype", DATA_FREE)
add("slice_scatter_", "updates", "device", replace_in(sc, 2, 1, on_meta(rnd(1))), ValueError,
    r"updates\[1\] is on meta", (CPP,))
add("slice_scatter_", "dims", "range", replace(sc, 4, [0, -2]), IndexError,
    r"dims\[1\] = -2 is out of range for targets\[1\] with 1 dimensions", DATA_FREE)
add("slice_scatter_", "dims", "length", replace(sc, 4, [0, 0, 0]), ValueError,
    r"dims must have one entry per targets \(2\), got 3", DATA_FREE)
add("slice_scatter_", "reduce", "value", replace(sc, 5, "max"), ValueError,
    r'reduce must be "copy", "sum" or "mean", got "max"', DATA_FREE)
index_probes("slice_scatter_", sc, 3, (CPP,), "targets")
for reduce in ("copy", "sum", "mean"):
    add("slice_scatter_", "indices", "valid",
        lambda r=reduce: [[rnd(6, 4), rnd(5)], [0, 1, 0], [rnd(2, 4), rnd(1), rnd(2, 4)],
                          [strided_list(1, 3), t(4), t(3, 1)], [0, 0], r],
        None, check=check_scatter, writes=(0,), note=f"strided, repeated across lists, {reduce}")
add("slice_scatter_", "indices", "empty", replace(sc, 3, [t(), t(), t()]), ValueError,
    r"updates\[0\] has shape \[2, 4\] but targets\[0\] \[6, 4\] sliced along dim 0 by indices\[0\] \(0 slices\)",
    DATA_FREE)
add("slice_scatter_", "indices", "valid",
    lambda: [[rnd(6, 4), rnd(5)], [0, 1], [rnd(0, 4), rnd(0)], [t(), t()], [0, 0], "mean"], None,
    check=check_scatter, writes=(0,), note="empty lists")


def mean_overflow():
    """issue 10, item 4: owners [inf, 3e38] and [inf, -3e38] gave [nan, -inf] instead of [inf, 0]."""
    inf = math.inf
    return [torch.zeros(2), [torch.tensor([inf, 3e38]), torch.tensor([inf, -3e38])], [t(0, 1), t(0, 1)], 0]


def check_mean_overflow(args):
    assert torch.equal(args["inputs"][0], torch.tensor([math.inf, 0.0]))


add("F.owner_average_", "updates", "valid", mean_overflow, None, check=check_mean_overflow, writes=(0,),
    note="inf and +-3e38 (issue 10 item 4)")
add("F.owner_average_", "updates", "shape", lambda: [rnd(5, 3), [rnd(2, 3), rnd(2, 2)], [t(0, 1), t(1, 2)], 0],
    ValueError, r"updates\[1\] has shape \[2, 2\]")
add("F.owner_average_", "indices", "range", lambda: [rnd(5, 3), [rnd(2, 3), rnd(1, 3)], [t(0, 1), t(5)], 0],
    IndexError, r"indices\[1\]\[0\] = 5 is out of range")
add("F.owner_average_", "dim", "range", lambda: [rnd(5, 3), [rnd(2, 3)], [t(0, 1)], 2], IndexError,
    r"dim = 2 is out of range for input with 2 dimensions")


# Mixed dtypes: one launch per dtype, checked as a whole first; messages name the caller's positions
# (issue 10, item 5). targets: w (6, 4) float32, n (5,) int64, v (3,) float64.
def mixed(idx=None, updates=None, targets=None, reduce="copy"):
    def b():
        w, n, v = rnd(6, 4), torch.arange(5), rnd(3, dtype=torch.float64)
        tg = targets(w, n, v) if targets else [w, n, v]
        up = updates or [rnd(2, 4), torch.tensor([9]), rnd(1, dtype=torch.float64), torch.tensor([8, 8])]
        return [tg, [0, 1, 2, 1], up, idx or [t(0, 1), t(4), t(2), t(0, 1)], [0, 0, 0], reduce]
    return b


add("F.scatter_slices_", "indices[3]", "range", mixed(idx=[t(0, 1), t(4), t(2), t(0, 7)]), IndexError,
    r"indices\[3\]\[1\] = 7 is out of range for targets\[1\] along dim 0 of size 5", note="a later launch")
add("F.scatter_slices_", "indices[2]", "range", mixed(idx=[t(0, 1), t(4), t(3), t(0, 1)]), IndexError,
    r"indices\[2\]\[0\] = 3 is out of range for targets\[2\] along dim 0 of size 3", note="a later launch")
add("F.scatter_slices_", "indices[0]", "range", lambda: mixed(
    idx=[t(0, 9, 1, 2), t(4), t(2), t(0, 1)], updates=[rnd(4, 4), torch.tensor([9]), rnd(1, dtype=torch.float64),
                                                        torch.tensor([8, 8])])(), IndexError,
    r"indices\[0\]\[1\] = 9 is out of range for targets\[0\]", note="the first launch")
add("F.scatter_slices_", "indices[3]", "range",
    lambda: [[torch.arange(5), rnd(6, 4)], [0, 1, 0, 1], [torch.tensor([9]), rnd(1, 4), torch.tensor([8]), rnd(3, 4)],
             [t(0), t(0), t(1), t(1, 9, 2)], [0, 0], "copy"], IndexError,
    r"indices\[3\]\[1\] = 9 is out of range for targets\[1\] along dim 0 of size 6", note="the first launch, renumbered")
add("F.scatter_slices_", "indices[3]", "repeat", mixed(idx=[t(0, 1), t(4), t(2), t(3, 3)]), ValueError,
    r"indices\[3\] must not repeat an index, but indices\[3\]\[1\] = 3 repeats indices\[3\]\[0\]")
add("F.scatter_slices_", "updates[3]", "shape",
    mixed(updates=[rnd(2, 4), torch.tensor([9]), rnd(1, dtype=torch.float64), torch.tensor([8])]), ValueError,
    r"updates\[3\] has shape \[1\]")
add("F.scatter_slices_", "targets[2]", "layout",
    mixed(targets=lambda w, n, v: [w, n, torch.zeros(1, dtype=torch.float64).expand(3)]), ValueError,
    r"targets\[2\] has elements that share memory")
add("F.scatter_slices_", "targets[1]", "alias",  # the int64 target is the index list of the float32 segment
    lambda: (lambda n: [[rnd(6, 4), n], [1, 0], [torch.tensor([9, 9, 9, 9]), rnd(4, 4)], [t(0, 1, 2, 3), n[:4]],
                        [0, 0], "copy"])(torch.arange(5)),
    ValueError, r"targets\[1\] shares memory with indices\[1\]", note="an index list of another dtype's launch")
add("F.scatter_slices_", "indices", "valid", mixed(), None, check=check_scatter, writes=(0,), note="mixed dtypes")


# ----------------------------------------------------------------------------------- running them
def _entry(op, path):
    if path == GATHER_GEMM:  # subnet_linear's CUDA backend (torch ops, so it runs on CPU tensors)
        from ist_kernels.ops.subnet import _aten as C
        return {"subnet_linear": C.subnet_linear, "subnet_linear_backward": C.subnet_linear_backward}[op]
    if path == TRITON:
        from ist_kernels.ops.grelu import _triton as tg
        from ist_kernels.ops.subnet import _triton as ts  # the raw launchers (issue 19 item 7)
        return {"relu_gates": tg.relu_gates, "gated_linear": tg.gated_linear,
                "gated_linear_backward": tg.gated_linear_backward, "subnet_linear": ts.subnet_linear,
                "subnet_linear_backward": ts.subnet_linear_backward}[op]
    if op == "F._gather_flat(out=)":
        return lambda out, *a: F._gather_flat(*a, out=out)
    if op == "F.gather_slices(out=GatherBuffers)":
        return lambda *a: F.gather_slices(*a, out=F.GatherBuffers())
    if op.startswith("F."):
        return getattr(F, op[2:])
    return getattr(ops, op)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return on_meta(x)
    if isinstance(x, list):
        return [_to_meta(i) for i in x]
    return x


def _same(a, b):
    if a.device.type == "meta":
        return True
    if a.is_floating_point() or a.is_complex():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
    return torch.equal(a, b)


def evaluate(key):
    """Run one probe on one path; returns "" when it behaved as documented, else what went wrong."""
    name, path = key.rsplit("@", 1)
    probe = BY_NAME[name]
    torch.manual_seed(0)
    args = probe.build()
    if path == FAKE:
        args = _to_meta(args)
    written = {id(x) for p in probe.writes for x in _tensors(args[p])} if probe.expect is None else set()
    watched = [x for x in _tensors(args) if id(x) not in written]
    before = [x.clone() for x in watched]
    clones_of_args = [[x.clone() for x in _tensors(a)] for a in args]
    try:
        result = _entry(probe.op, path)(*args)
        error = None
    except Exception as e:  # noqa: BLE001 (the probe reports what it got)
        error = e
    for x, c in zip(watched, before):
        if not _same(x, c):
            return "an input tensor was changed"
    if probe.expect is None:
        if error is not None:
            return f"valid input raised {type(error).__name__}: {error}"
        if probe.check is not None and path != FAKE:
            try:
                probe.check({"inputs": args, "result": result, "before": clones_of_args})
            except AssertionError as e:
                return f"wrong result: {e}"
        return ""
    if error is None:
        return f"no error, expected {probe.expect.__name__}"
    if type(error) is not probe.expect:
        return f"raised {type(error).__name__} ({str(error).splitlines()[0][:300]}), expected {probe.expect.__name__}"
    if not re.search(probe.match, str(error)):
        return f"message {str(error).splitlines()[0][:300]!r} does not match {probe.match!r}"
    return ""


def _child():
    """Subprocess entry: evaluate the keys on stdin, one JSON line per probe, flushed at once."""
    for key in sys.stdin.read().split("\n"):
        if key:
            print(json.dumps({"key": key, "problem": evaluate(key)}), flush=True)


BY_NAME = {}
for p in PROBES:
    assert p.name not in BY_NAME, f"two probes named {p.name}"
    BY_NAME[p.name] = p


def _paths(probe):
    have_triton = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()
    if have_triton:
        try:
            import triton  # noqa: F401
        except ImportError:  # pragma: no cover
            have_triton = False
    paths = [p for p in probe.paths if p != TRITON or have_triton]
    if probe.op.startswith("subnet_linear") and TRITON in probe.paths:  # the CUDA backend sees what Triton sees
        paths.append(GATHER_GEMM)
    return paths


KEYS = [f"{p.name}@{path}" for p in PROBES for path in _paths(p)]


def _run(keys, timeout):
    """Evaluate keys in one subprocess: {key: problem} for those it finished, and its exit status."""
    code = ("import sys; sys.path.insert(0, {!r}); import test_bad_inputs as t; t._child()"
            .format(os.path.dirname(os.path.abspath(__file__))))
    try:
        proc = subprocess.run([sys.executable, "-c", code], input="\n".join(keys), capture_output=True, text=True,
                              timeout=timeout, env=os.environ.copy())
        out, rc, err = proc.stdout, proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, err = f"timeout after {timeout} s", ""
    done = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            done[r["key"]] = r["problem"]
    return done, rc, err


def run_all(keys):
    """All keys, BATCH per subprocess. When a subprocess dies (or hangs), the first probe it left
    unfinished is run alone: if that one dies too, it is named as the crash; the rest go on in a
    new batch."""
    results, todo = {}, list(keys)
    while todo:
        batch, todo = todo[:BATCH], todo[BATCH:]
        done, rc, err = _run(batch, timeout=600)
        results.update(done)
        left = [k for k in batch if k not in done]
        if left:
            first, rest = left[0], left[1:]
            alone, rc1, err1 = _run([first], timeout=120)
            results[first] = alone.get(first, f"the process died (exit status {rc1}): {err1.strip()[-500:]}")
            todo = rest + todo
    return results


@pytest.fixture(scope="module")
def outcomes():
    return run_all(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_probe(key, outcomes):
    problem = outcomes[key]
    assert not problem, f"{key}: {problem}"


def test_table_covers_every_op_and_kind():
    """The table has, for every op, the kinds of misuse its arguments admit; prints the counts."""
    kinds = {}
    for p in PROBES:
        kinds.setdefault(p.op, set()).add(p.misuse)
    need = {
        "pack_gates": {"shape", "dtype", "empty"},
        "unpack_gates": {"shape", "dtype", "negative", "range", "huge", "empty"},
        "relu_gates": {"shape", "dtype", "device", "empty"},
        "gated_linear": {"shape", "dtype", "device", "empty"},
        "gated_linear_backward": {"shape", "dtype", "device", "length", "empty"},
        "subnet_linear": {"shape", "dtype", "device", "range", "negative", "huge", "repeat", "empty", "valid"},
        "subnet_linear_backward": {"shape", "dtype", "device", "range", "negative", "huge", "repeat", "length",
                                   "empty", "valid"},
        "slice_gather": {"shape", "dtype", "device", "range", "negative", "huge", "repeat", "length", "empty",
                         "valid"},
        "slice_gather_into_": {"shape", "dtype", "device", "range", "negative", "huge", "repeat", "length", "alias",
                               "layout", "valid"},
        "slice_scatter_": {"shape", "dtype", "device", "range", "negative", "huge", "repeat", "length", "alias",
                           "layout", "empty", "value", "valid"},
    }
    for op, want in need.items():
        assert want <= kinds.get(op, set()), f"{op} lacks probes of kind {sorted(want - kinds.get(op, set()))}"
    by_type = {}
    for p in PROBES:
        by_type[p.expect.__name__ if p.expect else "valid"] = by_type.get(p.expect.__name__ if p.expect else "valid",
                                                                          0) + 1
    print(f"\nbad-input table: {len(PROBES)} probes, {len(KEYS)} (probe, path) runs; by outcome {by_type}; "
          f"by path { {path: sum(k.endswith('@' + path) for k in KEYS) for path in (CPP, FAKE, TRITON, GATHER_GEMM)} }")
