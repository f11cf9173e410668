"""Compile the GReLU Triton kernels for a GPU architecture without a GPU (Triton's bundled ptxas),
and report per kernel and dtype: shared memory, and whether tl.dot became wgmma / mma / FMA.

    python tools/check_triton_grelu.py [--arch 90] [--dump DIR]

Catches what the interpreter cannot: Triton compile errors, tensor-core use, shared-memory size.
Must run without TRITON_INTERPRET=1.
"""
import argparse
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_triton_grelu.py: unset TRITON_INTERPRET (this compiles for a GPU)")

import torch  # noqa: E402,F401  (loads libc10 for ist_kernels._C)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ist_kernels.triton import grelu as tg  # noqa: E402


# Strides that are 1 for contiguous row-major tensors (the JIT turns an int equal to 1 into a constant).
UNIT_STRIDES = {"stride_xk", "stride_wk", "stride_b", "stride_gw", "stride_on", "stride_gn", "stride_Gw", "stride_dk",
                "stride_bn"}


def compile_kernel(fn, ptr_types, constexprs, arch, num_warps=8, num_stages=3):
    """As the JIT specialises a launch on contiguous tensors with sizes that are multiples of 16:
    pointers and the other ints get tt.divisibility=16, unit strides become constants."""
    sig, attrs, cx, it = {}, {}, dict(constexprs), iter(ptr_types)
    for i, name in enumerate(fn.arg_names):
        if name in cx:
            sig[name] = "constexpr"
        elif name in UNIT_STRIDES:
            cx[name], sig[name] = 1, "constexpr"
        else:
            sig[name] = next(it) if name.endswith("_ptr") else "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}  # opt-in bytes per block


def dot_kind(k):
    ptx = k.asm["ptx"]
    return "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "fma"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtypes", default="bf16,fp16,fp32,fp64")
    p.add_argument("--dump", help="write each kernel's TTGIR here")
    p.add_argument("--configs", action="store_true", help="compile every autotune config (shared memory per config)")
    args = p.parse_args(argv)
    for dt in args.dtypes.split(","):
        acc = tl.float64 if dt == "fp64" else tl.float32
        prec = "ieee" if dt in ("fp32", "fp64") else "tf32"
        cfg = dict(BM=128, BN=128, BK=64 if dt in ("bf16", "fp16") else 32, GROUP_M=8)
        p_ = f"*{dt}"
        part = p_ if dt == "fp64" else "*fp32"
        jobs = [
            ("relu_gates fwd", tg._linear_gates_fwd, [p_, p_, p_, "*i32", p_],
             dict(HAS_BIAS=True, RELU_GATES=True, PRECISION=prec, ACC=acc, **cfg)),
            ("gated_linear fwd", tg._linear_gates_fwd, [p_, p_, p_, "*i32", p_],
             dict(HAS_BIAS=True, RELU_GATES=False, PRECISION=prec, ACC=acc, **cfg)),
            ("gated dx", tg._gated_dx, [p_, "*i32", p_, p_], dict(PRECISION=prec, ACC=acc, **cfg)),
            ("gated dW+db", tg._gated_dw, [p_, "*i32", p_, p_, p_],
             dict(HAS_DW=True, HAS_DB=True, SPLIT=1, PRECISION=prec, ACC=acc, **cfg)),
            ("gated dW+db split 4", tg._gated_dw, [p_, "*i32", p_, part, part],
             dict(HAS_DW=True, HAS_DB=True, SPLIT=4, PRECISION=prec, ACC=acc, **cfg)),
        ]
        if args.configs:
            for name, fn, ptrs, cx in jobs[1:4]:
                kind = {"_linear_gates_fwd": "fwd", "_gated_dx": "dx", "_gated_dw": "dw"}[fn.__name__]
                for c in tg.gpu_configs(kind):
                    cxc = {**{k: v for k, v in cx.items() if k not in c.kwargs}, **c.kwargs}
                    k = compile_kernel(fn, ptrs, cxc, args.arch, c.num_warps, c.num_stages)
                    fits = k.metadata.shared <= SMEM_LIMIT.get(args.arch, 0)
                    print(f"sm_{args.arch} {dt:5s} {name:18s} {c.kwargs} st{c.num_stages} w{c.num_warps}: "
                          f"{dot_kind(k)} shared {k.metadata.shared} {'ok' if fits else 'TOO BIG (autotune skips)'}",
                          flush=True)
            continue
        for name, fn, ptrs, cx in jobs:
            t0 = time.time()
            k = compile_kernel(fn, ptrs, cx, args.arch)
            print(f"sm_{args.arch} {dt:5s} {name:22s} {dot_kind(k):5s} shared {k.metadata.shared:7d} B  "
                  f"({time.time() - t0:.1f}s)", flush=True)
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{name.replace(' ', '_')}_{dt}.ttgir"), "w") as f:
                    f.write(k.asm["ttgir"])


if __name__ == "__main__":
    main()
