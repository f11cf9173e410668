"""Triton kernels for the GReLU layers (paper 004 §2.1, §4.4): the CUDA backend of
``relu_gates``, ``gated_linear`` and ``gated_linear_backward``.

A tiled GEMM with the 1-bit gates fused in, and a memory pass for the backward (bit j of int32
word w is feature 32w + j, as in csrc/common/gates.h):

* ``_linear_gates_fwd``: z = x Wᵀ + b, then in the epilogue either relu + pack (relu_gates: the
  [BM, BN] tile is viewed as [BM, BN/32, 32] and summed as bit << j, one int32 word per 32 features)
  or a multiply by the unpacked gate words of the tile (gated_linear).
* ``_gate_grad``: g' = g ⊙ G and per-tile column sums of g' (db) in one pass over grad_out; the
  backward's GEMMs dx = g' W and dW = g'ᵀ x then run unmasked (cuBLAS through torch.mm on a GPU).

BN (the feature tile) is always a multiple of 32, so a tile holds whole gate words. fp16/bf16 use
tensor cores through tl.dot with fp32 accumulation; fp32 uses input_precision="ieee" unless
torch.backends.cuda.matmul.allow_tf32 is set; fp64 accumulates in fp64. The launch functions take
CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (one fixed tile config there, autotuning on GPU).
"""
import contextlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .._checks import check, gate_words
from .._triton_common import INTERPRET as _INTERPRET, HopperKernel, grouped_tile, is_tracing, launch, tuned
from ._checks import check_gated_linear_backward, check_grelu_gates, check_grelu_linear


# ---------------------------------------------------------------------------------------- helpers
@triton.jit
def _unpack(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 words [ROWS, COLS // 32] -> on [ROWS, COLS] (bool); column 32w + j is bit j of word w.
    The compact tile (4 B per 32 features) is what the GEMM pipelines through shared memory; the
    [ROWS, COLS // 32, 32] -> [ROWS, COLS] reshape is a free relabelling of registers (checked in
    TTGIR with tools/hopper_report.py --dump), unlike a per-element load of each feature's word."""
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, (ROWS, COLS)) != 0


@triton.jit
def _pack(on, ROWS: tl.constexpr, COLS: tl.constexpr):
    """on [ROWS, COLS] (bool) -> int32 words [ROWS, COLS // 32]; the bits are distinct, so sum == or."""
    bits = tl.reshape(on.to(tl.uint32), (ROWS, COLS // 32, 32)) << tl.arange(0, 32).to(tl.uint32)[None, None, :]
    return tl.sum(bits, axis=2).to(tl.int32, bitcast=True)


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _linear_gates_fwd(
    x_ptr, w_ptr, b_ptr, gates_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_b, stride_gm, stride_gw, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, RELU_GATES: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    # Rows/columns past the edge read a wrapped, in-range row/column (no M/N masks in the K loop);
    # their results are never stored and never reach a gate bit.
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + rn[None, :] * stride_wn
    acc = tl.zeros((BM, BN), dtype=ACC)
    for k0 in range(0, K, BK):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    _epilogue(acc, pid_m, pid_n, b_ptr, gates_ptr, out_ptr, M, N, stride_b, stride_gm, stride_gw, stride_om,
              stride_on, HAS_BIAS, RELU_GATES, ACC, BM, BN)


@triton.jit
def _linear_gates_fwd_tma(
    x_desc, w_desc, b_ptr, gates_ptr, out_ptr, M, N, K,
    stride_b, stride_gm, stride_gw, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, RELU_GATES: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
):
    """The same GEMM + gate epilogue on a persistent grid (NUM_SMS programs walk the output tiles in
    grouped order) with x [M, K] and W [N, K] read through TMA tensor descriptors (block shapes
    [BM, BK] / [BN, BK], zero padding past the edges, so the K loop has no masks)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in range(tl.program_id(0), num_m * num_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=ACC)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BM, ki * BK])
            b = w_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION, out_dtype=ACC)
        _epilogue(acc, pid_m, pid_n, b_ptr, gates_ptr, out_ptr, M, N, stride_b, stride_gm, stride_gw, stride_om,
                  stride_on, HAS_BIAS, RELU_GATES, ACC, BM, BN)


@triton.jit
def _epilogue(acc, pid_m, pid_n, b_ptr, gates_ptr, out_ptr, M, N, stride_b, stride_gm, stride_gw, stride_om,
              stride_on, HAS_BIAS: tl.constexpr, RELU_GATES: tl.constexpr, ACC: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr):
    """Bias, then relu + pack (RELU_GATES) or the gate mask, and the stores of one [BM, BN] tile."""
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n.to(tl.int64) * stride_b, mask=n_ok, other=0.0).to(ACC)[None, :]
    offs_w = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    gw_ok = m_ok[:, None] & (offs_w < tl.cdiv(N, 32))[None, :]
    g_ptrs = gates_ptr + offs_m.to(tl.int64)[:, None] * stride_gm + offs_w[None, :] * stride_gw
    if RELU_GATES:
        on = (acc > 0) & n_ok[None, :]
        out = tl.where(on | (acc != acc), acc, 0.0)  # relu; NaN propagates as in torch.relu
        tl.store(g_ptrs, _pack(on, BM, BN), mask=gw_ok)
    else:
        out = acc * _unpack(tl.load(g_ptrs, mask=gw_ok, other=0), BM, BN).to(ACC)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_grad(
    g_ptr, gates_ptr, out_ptr, db_ptr, M, N,
    stride_gm, stride_gn, stride_Gm, stride_Gw, stride_om, stride_on, stride_dbt, stride_dbn,
    HAS_OUT: tl.constexpr, HAS_DB: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """One memory pass over grad_out: g' = g ⊙ G (stored when HAS_OUT) and this M-tile's column sums
    of g' (db partials [cdiv(M, BM), N], summed afterwards in a fixed order: deterministic)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_w = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows64 = offs_m.to(tl.int64)
    g = tl.load(g_ptr + rows64[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    words = tl.load(gates_ptr + rows64[:, None] * stride_Gm + offs_w[None, :] * stride_Gw,
                    mask=m_ok[:, None] & (offs_w < tl.cdiv(N, 32))[None, :], other=0)
    g = g * _unpack(words, BM, BN).to(g.dtype)  # a product, as g ⊙ G: NaN · 0 stays NaN, as on the CPU
    if HAS_OUT:
        tl.store(out_ptr + rows64[:, None] * stride_om + offs_n[None, :] * stride_on, g,
                 mask=m_ok[:, None] & n_ok[None, :])
    if HAS_DB:
        tl.store(db_ptr + pid_m * stride_dbt + offs_n * stride_dbn, tl.sum(g.to(ACC), axis=0), mask=n_ok)


@triton.jit
def _relu_pack(z_ptr, gates_ptr, M, N, stride_zm, stride_zn, stride_gm, stride_gw,
               BM: tl.constexpr, BN: tl.constexpr):
    """The relu_gates epilogue as a pass over z = x Wᵀ + b (from cuBLAS): z <- relu(z) in place
    (NaN propagates, as in torch.relu) and gates = pack(z > 0)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_w = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows64 = offs_m.to(tl.int64)
    z_ptrs = z_ptr + rows64[:, None] * stride_zm + offs_n[None, :] * stride_zn
    z = tl.load(z_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
    on = (z > 0) & n_ok[None, :]
    tl.store(z_ptrs, tl.where(on | (z != z), z, 0.0), mask=m_ok[:, None] & n_ok[None, :])
    tl.store(gates_ptr + rows64[:, None] * stride_gm + offs_w[None, :] * stride_gw, _pack(on, BM, BN),
             mask=m_ok[:, None] & (offs_w < tl.cdiv(N, 32))[None, :])


# ---------------------------------------------------------------------------------------- configs
# Under the interpreter one small config (fast, and several tiles per test shape so tile edges are
# exercised); tests may change it. On a GPU the kernels are autotuned over the lists below.
INTERPRET_CONFIG = dict(BM=16, BN=64, BK=16, GROUP_M=2)


# (output rows, output cols, reduction, stages, warps) per kernel; the autotuner skips configs that
# do not fit in shared memory for a dtype (fp32/fp64 use the smaller ones).
# Pruned by tools/hopper_report.py: 128x256x64 s3 w8, 256x128x64 s3 w8 and 128x128x64 s4 w4 spilled
# (4-20 B) in relu_gates' epilogue; the 2-warp config had no wgmma.
_TILES = [(128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 64, 32, 3, 4)]
# The pinned config (IST_KERNELS_AUTOTUNE=0): fits shared memory for every dtype, fp64 included.
_PINNED = (64, 64, 32, 3, 4)
# Which kernel parameter tiles which dimension: output rows, output cols, reduction.
_ROLES = {"fwd": ("BM", "BN", "BK")}
# The gate pass (memory-bound): [BM, BN] tiles of grad_out; BN a multiple of 32 (whole gate words).
GATE_GRAD_TILE = dict(BM=64, BN=128)
INTERPRET_GATE_GRAD_TILE = dict(BM=16, BN=64)


def gpu_configs(kind, tiles=_TILES):
    rows, cols, red = _ROLES[kind]
    return [triton.Config({rows: r, cols: c, red: k, "GROUP_M": 8}, num_stages=st, num_warps=w)
            for r, c, k, st, w in tiles]


def _tune(kernel, kind, key):
    return tuned(kernel, gpu_configs(kind), key, gpu_configs(kind, [_PINNED])[0])


# Tensor dtypes are part of every autotune key already; the variant switches are added here.
_FWD_KEY = ["M", "N", "K", "RELU_GATES", "HAS_BIAS", "PRECISION"]
_fwd_tuned = _tune(_linear_gates_fwd, "fwd", _FWD_KEY)


def _set_tma_blocks(nargs):
    """Autotune pre-hook: the descriptors' block shapes follow the config being tried."""
    nargs["x_desc"].block_shape = [nargs["BM"], nargs["BK"]]
    nargs["w_desc"].block_shape = [nargs["BN"], nargs["BK"]]


# The persistent TMA kernel serves 16-bit inputs only (fp32/fp64 take the pointer kernel).
_TMA_TILES = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (64, 128, 64, 4, 4)]  # 128x128x64 s4 w4 spilled 28 B
_TMA_PINNED = (128, 128, 64, 3, 8)


def _tma_configs(tiles):
    return [triton.Config({"BM": r, "BN": c, "BK": k, "GROUP_M": 8}, num_stages=st, num_warps=w,
                          pre_hook=_set_tma_blocks) for r, c, k, st, w in tiles]


_fwd_tma_tuned = tuned(_linear_gates_fwd_tma, _tma_configs(_TMA_TILES), _FWD_KEY, _tma_configs([_TMA_PINNED])[0])
# Which fused kernel the forward uses for 16-bit, TMA-compatible inputs (benchmarks compare both).
USE_TMA = True


def _device_ok(op, t):
    check(t.is_cuda or _INTERPRET, op,
          f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before ist_kernels is "
          f"imported, to run them on CPU tensors); x is on {t.device}")


def _pick(tuned, plain):
    """(kernel, config kwargs): autotuned on a GPU, the fixed interpreter config otherwise."""
    if tuned is not None:
        return tuned, {}
    return plain, dict(INTERPRET_CONFIG)


def _on(t):
    """Launch on t's GPU (Triton launches on the current device); traced, Inductor's code guards it."""
    return torch.cuda.device(t.device) if t.is_cuda and not is_tracing() else contextlib.nullcontext()


def _precision(t):
    """tl.dot input_precision: fp32 is exact ("ieee") unless the user allows tf32; the option only
    concerns fp32 operands, so 16-bit dtypes keep Triton's default."""
    if t.dtype == torch.float32:
        return "tf32" if t.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee" if t.dtype == torch.float64 else "tf32"


def _acc(t):
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def _rows(t):
    """[..., F] -> [M, F] (a view when possible), M the product of the leading dims (also when F == 0)."""
    m = 1
    for s in t.shape[:-1]:
        m *= s
    return t.reshape(m, t.shape[-1])


# ---------------------------------------------------------------------------------------- launches
# From this reduction length on, the forward runs as a cuBLAS GEMM (bias in its epilogue) followed by
# one gate pass over the output, instead of the fused Triton GEMM. The pass moves ~4.1 bytes per
# output element (bf16 z read + written, 1 gate bit), i.e. ~444/K of the GEMM's time at 3 TB/s and
# 650 TFLOP/s. Measured on an H100, bf16 (bench/results/h100.md, both forced side by side): at
# K = 4096 the persistent TMA kernel won (0.198 vs 0.203 ms at 4096³, 0.835 vs 0.858 ms at
# M = 16384), at K = 8192 cuBLAS + pass won (1.669 vs 1.715 ms); at K = 1024 TMA, 0.244 ms vs
# cuBLAS alone 0.205. The pointer kernel (non-TMA operands) was 1.18-1.40x slower than TMA.
CUBLAS_EPILOGUE_MIN_K = 8192


def _cublas_then_pass(x2, weight, bias, g2, relu_gates):
    """z = x Wᵀ + b by torch (cuBLAS on a GPU), then the gate epilogue in one pass, z in place."""
    z = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
    if relu_gates:
        M, N = z.shape
        tile = INTERPRET_GATE_GRAD_TILE if _INTERPRET else GATE_GRAD_TILE
        if M > 0 and N > 0:
            launch(_relu_pack)[(triton.cdiv(M, tile["BM"]), triton.cdiv(N, tile["BN"]))](
                z, g2, M, N, z.stride(0), z.stride(1), g2.stride(0), g2.stride(1), num_warps=4, **tile)
        return z
    return gate_grad(z, g2, want_out=True, want_db=False, out=z)[0]


# 16-bit inputs on a GPU; fp32 too under the interpreter, where the tests check the kernel's logic
# (bf16/fp16 tl.dot is only exercised on a GPU there).
_TMA_DTYPES = (torch.float16, torch.bfloat16) + ((torch.float32,) if _INTERPRET else ())


def _tma_ok(x2, weight):
    """TMA descriptors need unit inner strides, 16-byte aligned bases and row strides."""
    def ok(t):
        e = t.element_size()
        return t.stride(1) == 1 and (t.stride(0) * e) % 16 == 0 and t.data_ptr() % 16 == 0
    return x2.dtype in _TMA_DTYPES and x2.shape[1] > 0 and ok(x2) and ok(weight)


def _num_sms(t):
    if _INTERPRET:
        return 3  # a few programs, each walking several tiles: the persistent loop is exercised
    return torch.cuda.get_device_properties(t.device).multi_processor_count


def _launch_tma(x2, weight, bias, g2, out, relu_gates):
    M, K = x2.shape
    N = weight.shape[0]
    cfg = {} if _fwd_tma_tuned is not None else dict(INTERPRET_CONFIG)
    block = [cfg.get("BM", 1), cfg.get("BK", 1)], [cfg.get("BN", 1), cfg.get("BK", 1)]  # GPU: the pre-hook sets them
    x_desc = TensorDescriptor.from_tensor(x2, block[0])
    w_desc = TensorDescriptor.from_tensor(weight, block[1])
    sms = _num_sms(x2)
    kernel = _fwd_tma_tuned if _fwd_tma_tuned is not None else _linear_gates_fwd_tma
    grid = lambda meta: (min(sms, triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"])),)  # noqa: E731
    launch(kernel)[grid](
        x_desc, w_desc, bias if bias is not None else out, g2, out, M, N, K,
        bias.stride(0) if bias is not None else 0, g2.stride(0), g2.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, RELU_GATES=relu_gates, PRECISION=_precision(x2), ACC=_acc(x2), NUM_SMS=sms,
        **cfg)


def _forward(op, x, weight, bias, gates, relu_gates):
    check_grelu_linear(op, x, weight, bias)
    N = weight.shape[0]
    if not relu_gates:
        check_grelu_gates(op, gates, x, N)
    _device_ok(op, x)
    x2 = _rows(x)
    M, K = x2.shape
    W = gate_words(N)
    g2 = torch.empty((M, W), dtype=torch.int32, device=x.device) if relu_gates else _rows(gates)
    if K >= CUBLAS_EPILOGUE_MIN_K:
        with _on(x):
            out = _cublas_then_pass(x2, weight, bias, g2, relu_gates).view(*x.shape[:-1], N)
        return (out, g2.view(*x.shape[:-1], W)) if relu_gates else out
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M > 0 and N > 0:
        with _on(x):
            if USE_TMA and not is_tracing() and _tma_ok(x2, weight):  # traced: the pointer kernel
                _launch_tma(x2, weight, bias, g2, out, relu_gates)
            else:
                kernel, cfg = _pick(_fwd_tuned, _linear_gates_fwd)
                grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
                launch(kernel)[grid](
                    x2, weight, bias if bias is not None else out, g2, out, M, N, K,
                    x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                    bias.stride(0) if bias is not None else 0, g2.stride(0), g2.stride(1),
                    out.stride(0), out.stride(1),
                    HAS_BIAS=bias is not None, RELU_GATES=relu_gates, PRECISION=_precision(x), ACC=_acc(x), **cfg)
    out = out.view(*x.shape[:-1], N)
    if relu_gates:
        return out, g2.view(*x.shape[:-1], W)
    return out


def relu_gates(x, weight, bias=None):
    """out = relu(x Wᵀ + b), gates = pack(x Wᵀ + b > 0), in one kernel."""
    return _forward("relu_gates", x, weight, bias, None, True)


def gated_linear(x, weight, bias, gates):
    """y = (x Wᵀ + b) ⊙ unpack(gates), the mask applied in the GEMM's epilogue."""
    return _forward("gated_linear", x, weight, bias, gates, False)


def gate_grad(grad_out, gates, want_out=True, want_db=True, out=None):
    """(g' = grad_out ⊙ unpack(gates) or None, db = Σ_m g' or None) in one pass over [M, N] rows.
    db is summed in fp32 (fp64 for fp64) from per-tile partials, then cast to grad_out's dtype.
    ``out``: where g' goes ([M, N]; grad_out itself is allowed: each element is read before it is
    written, by the same program); a new tensor by default."""
    g2, G2 = _rows(grad_out), _rows(gates)
    M, N = g2.shape
    if want_out and out is None:
        out = torch.empty((M, N), dtype=g2.dtype, device=g2.device)
    tile = INTERPRET_GATE_GRAD_TILE if _INTERPRET else GATE_GRAD_TILE
    tiles_m = triton.cdiv(M, tile["BM"])
    part = torch.float64 if g2.dtype == torch.float64 else torch.float32
    partials = torch.empty((tiles_m, N), dtype=part, device=g2.device) if want_db else None
    if M > 0 and N > 0 and (want_out or want_db):
        with _on(g2):
            launch(_gate_grad)[(tiles_m, triton.cdiv(N, tile["BN"]))](
                g2, G2, out if want_out else g2, partials if want_db else g2, M, N,
                g2.stride(0), g2.stride(1), G2.stride(0), G2.stride(1),
                out.stride(0) if want_out else 0, out.stride(1) if want_out else 0,
                partials.stride(0) if want_db else 0, partials.stride(1) if want_db else 0,
                HAS_OUT=want_out, HAS_DB=want_db, ACC=_acc(g2), num_warps=4, **tile)
    db = None
    if want_db:
        db = (partials.sum(0) if M > 0 else torch.zeros((N,), dtype=part, device=g2.device)).to(g2.dtype)
    return out, db


def gated_linear_backward(grad_out, x, weight, gates, output_mask):
    """(dx, dW, db): one memory pass g' = grad_out ⊙ G that also sums db (``gate_grad``), then plain
    GEMMs dx = g' W and dW = g'ᵀ x (cuBLAS through torch.mm on a GPU). An output that output_mask does
    not ask for is an empty tensor.

    Why not mask inside the GEMMs? The fused design (mask applied to each grad_out tile on load, in
    the K loop of Triton dx/dW GEMMs) ran at 0.50-0.64x the unmasked torch linear fwd+bwd on an H100
    (bench/results/h100-baseline.md): the unpack+multiply sat on the main loop's critical path and
    dW needed a transposed masked tile. The pass costs one read and one write of grad_out."""
    check_gated_linear_backward(grad_out, x, weight, gates, output_mask)
    _device_ok("gated_linear_backward", x)
    want_dx, want_dw, want_db = (bool(v) for v in output_mask)
    x2 = _rows(x)
    M, K = x2.shape
    dx, dw, db = (x.new_empty((0,)) for _ in range(3))  # distinct: outputs must not alias
    with _on(x):
        gm, db_full = gate_grad(grad_out, gates, want_out=want_dx or want_dw, want_db=want_db)
        if want_dx:
            dx = torch.mm(gm, weight).view(x.shape)
        if want_dw:
            dw = torch.mm(gm.t(), x2)
        if want_db:
            db = db_full
    return dx, dw, db


#: every kernel the launchers above may run (the AOTAutograd cache key covers their source: ops/_cuda.py)
TRITON_KERNELS = (_linear_gates_fwd, _linear_gates_fwd_tma, _gate_grad, _relu_pack)


# ---------------------------------------------------------------------------------------- sm_90a report
def _hopper_args(unit_strides, extra):
    """HopperKernel.args (tools/hopper_report.py): contiguous operands, int32 gate words; ``extra``
    (dtype, meta) adds the kernel's own parameters."""
    return lambda dtype, meta: dict(gates_ptr="*i32", **dict.fromkeys(unit_strides, 1), **extra(dtype, meta))


def _fwd(relu_gates, tma=False):
    def extra(dtype, meta):
        probe = torch.empty(0, dtype=dtype)
        out = dict(HAS_BIAS=True, RELU_GATES=relu_gates, PRECISION=_precision(probe), ACC=_acc(probe))
        if tma:
            out.update(x_desc=f"tensordesc<{{dtype}}[{meta['BM']}, {meta['BK']}]>",
                       w_desc=f"tensordesc<{{dtype}}[{meta['BN']}, {meta['BK']}]>", NUM_SMS=132)  # an H100 SXM
        return out
    return extra


def _gate_grad_extra(dtype, meta):
    return dict(HAS_OUT=True, HAS_DB=True, ACC=_acc(torch.empty(0, dtype=dtype)),
                db_ptr="*fp64" if dtype == torch.float64 else "*fp32")


_UNIT = ("stride_b", "stride_gw", "stride_on")
_GATE_PASS = [triton.Config(GATE_GRAD_TILE, num_warps=4)]  # as gate_grad and _cublas_then_pass launch them
HOPPER_KERNELS = [
    HopperKernel("relu_gates fwd", _linear_gates_fwd, _hopper_args(_UNIT + ("stride_xk", "stride_wk"), _fwd(True))),
    HopperKernel("gated_linear fwd", _linear_gates_fwd, _hopper_args(_UNIT + ("stride_xk", "stride_wk"), _fwd(False))),
    HopperKernel("relu_gates fwd TMA", _linear_gates_fwd_tma, _hopper_args(_UNIT, _fwd(True, tma=True))),
    HopperKernel("gated_linear fwd TMA", _linear_gates_fwd_tma, _hopper_args(_UNIT, _fwd(False, tma=True))),
    HopperKernel("gate_grad pass", _gate_grad,
                 _hopper_args(("stride_gn", "stride_Gw", "stride_on", "stride_dbn"), _gate_grad_extra),
                 configs=_GATE_PASS, gemm=False),
    HopperKernel("relu_gates pass", _relu_pack, _hopper_args(("stride_zn", "stride_gw"), lambda dtype, meta: {}),
                 configs=_GATE_PASS, gemm=False),
]
