"""tools/hopper_report.py: how it reads ptxas logs, PTX and SASS (the compiles themselves run in CI,
`python tools/hopper_report.py`, without TRITON_INTERPRET)."""
import importlib.util
import os
import shutil

import pytest

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "hopper_report.py")
_spec = importlib.util.spec_from_file_location("hopper_report", _PATH)
hr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hr)

LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_Z4gemmPf' for 'sm_90a'
ptxas info    : Function properties for _Z4gemmPf
    16 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 12.3 ms
ptxas info    : Compiling entry function 'copy' for 'sm_90a'
ptxas info    : Function properties for copy
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 0 barriers
"""


def test_ptxas_log_per_entry():
    props = hr.parse_ptxas_log(LOG)
    assert props == {
        "_Z4gemmPf": dict(regs=255, spill_st=12, spill_ld=20, stack=16, smem=1024),
        "copy": dict(regs=18, spill_st=0, spill_ld=0, stack=0, smem=0),
    }  # the device function's spills belong to no entry


def _code(*ops):
    """[(address, instruction)] at 16 bytes per instruction; "BRA n" branches to instruction n."""
    out = []
    for i, op in enumerate(ops):
        if op.startswith("BRA") or op.startswith("@P0 BRA"):
            op = op.rsplit(" ", 1)[0] + f" {hex(16 * int(op.rsplit(' ', 1)[1]))}"
        out.append((16 * i, op))
    return out


def test_main_loop_is_the_innermost_loop_with_a_matrix_instruction():
    code = _code("MOV", "LDG",                     # 0-1
                 "IADD3",                          # 2: outer (persistent) loop head
                 "LDGSTS", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", "IADD3", "@P0 BRA 3",  # 3-6: K loop
                 "STG", "@P0 BRA 2",               # 7-8: back to the outer head
                 "EXIT", "BRA 10")                 # 10: the self-branch after EXIT is no loop
    assert hr.main_loop(code) == (4, 1)


def test_main_loop_without_matrix_instructions_is_the_longest_leaf_loop():
    code = _code("LDG", "FFMA", "@P0 BRA 0",       # 0-2: 3 instructions
                 "LDG", "FFMA", "FFMA", "FFMA", "@P0 BRA 3",  # 3-7: 5 instructions
                 "IADD3", "@P0 BRA 0",             # 0-9 contains both: not a leaf
                 "EXIT")
    assert hr.main_loop(code) == (5, 0)
    assert hr.main_loop(_code("MOV", "@P0 BRA 3", "MOV", "EXIT")) is None  # forward branches only


def test_ptx_features_tell_bulk_tensor_copies_from_cp_async():
    tma = hr.ptx_features("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [r], [d];")
    assert tma["tma"] and not tma["cp_async"] and not tma["wgmma"]
    ldgsts = hr.ptx_features("cp.async.cg.shared.global [r], [p], 16;\nwgmma.mma_async.sync.aligned.m64n128k16")
    assert ldgsts["cp_async"] and ldgsts["wgmma"] and not ldgsts["tma"]
    assert hr.ptx_features("mma.sync.aligned.m16n8k16")["mma_sync"]


def test_ptx_entries_split_a_module():
    ptx = ".visible .entry a(\n.param .u64 p)\n{ wgmma.mma_async }\n.visible .entry b (\n)\n{ ret; }\n"
    e = hr.ptx_entries(ptx)
    assert set(e) == {"a", "b"} and "wgmma" in e["a"] and "wgmma" not in e["b"]


def _row(**kw):
    return dict(dict(dtype="bf16", gemm=True, wgmma=True, spill_st=0, spill_ld=0, shared=1024), **kw)


def test_verdicts():
    assert hr.verdict(_row()) == "ok"
    assert hr.verdict(_row(wgmma=False)) == "FAIL: no wgmma"
    assert hr.verdict(_row(wgmma=False, dtype="fp32")) == "ok"  # fp32/fp64 need no wgmma
    assert hr.verdict(_row(spill_ld=4, dtype="fp64")) == "FAIL: spills"
    assert hr.verdict(_row(spill_st=4, gemm=False)) == "ok"  # memory kernels are reported only
    assert hr.verdict(_row(shared=hr.SMEM_LIMIT + 1, spill_st=8)).startswith("skipped")
    assert hr.verdict(_row(error="CompilationError: x")).startswith("FAIL")


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs c++filt")
def test_short_kernel_names():
    mangled = "_ZN3ist4cuda12_GLOBAL__N_120slice_scatter_kernelIfLNS0_11SliceReduceE1EEEvPKfl"
    assert hr._short_names([mangled])[mangled] == "slice_scatter_kernel<float, (SliceReduce)1>"
