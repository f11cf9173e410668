"""Triton kernels for the GReLU layers (paper 004 §2.1, §4.4): the CUDA backend of
``relu_gates``, ``gated_linear`` and ``gated_linear_backward``.

Three tiled GEMMs with the 1-bit gates fused in (bit j of int32 word w is feature 32w + j, as in
csrc/common/gates.h):

* ``_linear_gates_fwd``: z = x Wᵀ + b, then in the epilogue either relu + pack (relu_gates: the
  [BM, BN] tile is viewed as [BM, BN/32, 32] and summed as bit << j, one int32 word per 32 features)
  or a multiply by the unpacked gate words of the tile (gated_linear).
* ``_gated_dx``: dx = (g ⊙ G) W, the gate words unpacked and applied to each grad_out tile as it is
  loaded, inside the K loop of the GEMM.
* ``_gated_dw``: dW = (g ⊙ G)ᵀ x and db = Σ_m g ⊙ G, the same masked load; db is accumulated by the
  programs of the first K tile. When N×K has too few tiles to fill the GPU (tall M, e.g.
  65536×1024×1024), M is split over SPLIT programs that write fp32 partials, summed afterwards.

BN (the feature tile) is always a multiple of 32, so a tile holds whole gate words. fp16/bf16 use
tensor cores through tl.dot with fp32 accumulation; fp32 uses input_precision="ieee" unless
torch.backends.cuda.matmul.allow_tf32 is set; fp64 accumulates in fp64. The launch functions take
CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (one fixed tile config there, autotuning on GPU).
"""
import contextlib

import torch
import triton
import triton.language as tl

from ..ops._checks import (check, check_gated_linear_backward, check_grelu_gates,
                          check_grelu_linear, gate_words)

from .common import INTERPRET as _INTERPRET, HopperKernel, grouped_tile, tuned


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
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn * stride_b).to(ACC)[None, :]

    m_ok = offs_m < M
    n_ok = offs_n < N
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
def _gated_dx(
    g_ptr, gates_ptr, w_ptr, dx_ptr, M, N, K,
    stride_gm, stride_gn, stride_Gm, stride_Gw, stride_wn, stride_wk, stride_dm, stride_dk,
    PRECISION: tl.constexpr, ACC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dx [M, K] = (g ⊙ G) [M, N] @ W [N, K]; BN is the reduction tile (a multiple of 32)."""
    pid_m, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(K, BK), GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_n = tl.arange(0, BN)
    offs_w = tl.arange(0, BN // 32)
    rm = (offs_m % M).to(tl.int64)
    rk = (offs_k % K).to(tl.int64)
    g_ptrs = g_ptr + rm[:, None] * stride_gm + offs_n[None, :] * stride_gn
    G_ptrs = gates_ptr + rm[:, None] * stride_Gm + offs_w[None, :] * stride_Gw
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + rk[None, :] * stride_wk
    words_total = tl.cdiv(N, 32)
    acc = tl.zeros((BM, BK), dtype=ACC)
    for n0 in range(0, N, BN):
        n_ok = offs_n < N - n0
        g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
        words = tl.load(G_ptrs, mask=(offs_w < words_total - n0 // 32)[None, :], other=0)
        g = g * _unpack(words, BM, BN).to(g.dtype)  # the gate mask, applied on load
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(g, w, acc, input_precision=PRECISION, out_dtype=ACC)
        g_ptrs += BN * stride_gn
        G_ptrs += (BN // 32) * stride_Gw
        w_ptrs += BN * stride_wn
    d_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dm + offs_k[None, :] * stride_dk
    tl.store(d_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_k < K)[None, :])


@triton.jit
def _gated_dw(
    g_ptr, gates_ptr, x_ptr, dw_ptr, db_ptr, M, N, K, K_TILES,
    stride_gm, stride_gn, stride_Gm, stride_Gw, stride_xm, stride_xk,
    stride_ds, stride_dn, stride_dk, stride_bs, stride_bn,
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dW [N, K] = (g ⊙ G)ᵀ @ x and db [N] = Σ_m g ⊙ G over this program's share of M (program_id(1)
    of SPLIT); BM is the reduction tile. K_TILES = max(1, K) so that db is made also when K == 0."""
    pid_n, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(K_TILES, BK), GROUP_M)
    split = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_w = pid_n * (BN // 32) + tl.arange(0, BN // 32)
    offs_m = tl.arange(0, BM)
    n_ok = offs_n < N
    k_ok = offs_k < K
    w_ok = offs_w < tl.cdiv(N, 32)
    m_per = tl.cdiv(tl.cdiv(M, SPLIT), BM) * BM
    m_lo = split * m_per
    m_hi = tl.minimum(M, m_lo + m_per)
    acc = tl.zeros((BN, BK), dtype=ACC)
    db = tl.zeros((BN,), dtype=ACC)
    for m0 in range(m_lo, m_hi, BM):
        rows = m0 + offs_m
        m_ok = rows < m_hi
        rows64 = rows.to(tl.int64)
        g = tl.load(g_ptr + rows64[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        words = tl.load(gates_ptr + rows64[:, None] * stride_Gm + offs_w[None, :] * stride_Gw,
                        mask=m_ok[:, None] & w_ok[None, :], other=0)
        g = g * _unpack(words, BM, BN).to(g.dtype)  # the gate mask, applied on load
        if HAS_DW:
            xt = tl.load(x_ptr + rows64[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(g), xt, acc, input_precision=PRECISION, out_dtype=ACC)
        if HAS_DB:
            if pid_k == 0:
                db += tl.sum(g.to(ACC), axis=0)
    if HAS_DW:
        d_ptrs = dw_ptr + split * stride_ds + offs_n[:, None] * stride_dn + offs_k[None, :] * stride_dk
        tl.store(d_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_DB:
        if pid_k == 0:
            tl.store(db_ptr + split * stride_bs + offs_n * stride_bn, db.to(db_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------- configs
# Under the interpreter one small config (fast, and several tiles per test shape so tile edges are
# exercised); tests may change it. On a GPU the kernels are autotuned over the lists below.
INTERPRET_CONFIG = dict(BM=16, BN=64, BK=16, GROUP_M=2)


# (output rows, output cols, reduction, stages, warps) per kernel; the autotuner skips configs that
# do not fit in shared memory for a dtype (fp32/fp64 use the smaller ones).
_TILES = [(128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4),
          (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 64, 32, 3, 4)]
# The pinned config (IST_KERNELS_AUTOTUNE=0): fits shared memory for every dtype, fp64 included.
_PINNED = (64, 64, 32, 3, 4)
# Which kernel parameter tiles which dimension: output rows, output cols, reduction.
_ROLES = {"fwd": ("BM", "BN", "BK"), "dx": ("BM", "BK", "BN"), "dw": ("BN", "BK", "BM")}


def gpu_configs(kind, tiles=_TILES):
    rows, cols, red = _ROLES[kind]
    return [triton.Config({rows: r, cols: c, red: k, "GROUP_M": 8}, num_stages=st, num_warps=w)
            for r, c, k, st, w in tiles]


def _tune(kernel, kind, key):
    return tuned(kernel, gpu_configs(kind), key, gpu_configs(kind, [_PINNED])[0])


# Tensor dtypes are part of every autotune key already; the variant switches are added here.
_fwd_tuned = _tune(_linear_gates_fwd, "fwd", ["M", "N", "K", "RELU_GATES", "HAS_BIAS", "PRECISION"])
_dx_tuned = _tune(_gated_dx, "dx", ["M", "N", "K", "PRECISION"])
_dw_tuned = _tune(_gated_dw, "dw", ["M", "N", "K", "HAS_DW", "HAS_DB", "SPLIT", "PRECISION"])


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
    """Launch on t's GPU (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


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
def _forward(op, x, weight, bias, gates, relu_gates):
    check_grelu_linear(op, x, weight, bias)
    N = weight.shape[0]
    if not relu_gates:
        check_grelu_gates(op, gates, x, N)
    _device_ok(op, x)
    x2 = _rows(x)
    M, K = x2.shape
    W = gate_words(N)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    g2 = torch.empty((M, W), dtype=torch.int32, device=x.device) if relu_gates else _rows(gates)
    if M > 0 and N > 0:
        kernel, cfg = _pick(_fwd_tuned, _linear_gates_fwd)
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        with _on(x):
            kernel[grid](
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


def _split_m(M, N, K, device):
    """How many programs share the M reduction of dW: enough (N, K) tiles to fill the GPU."""
    if device.type != "cuda" or M < 4096:
        return 1
    tiles = triton.cdiv(N, 128) * triton.cdiv(max(K, 1), 128)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), M // 2048, 16))


def gated_linear_backward(grad_out, x, weight, gates, output_mask, split_m=None):
    """(dx, dW, db) with g' = grad_out ⊙ G applied on load inside both GEMMs; an output that
    output_mask does not ask for is an empty tensor. ``split_m`` overrides the M split of dW/db."""
    op = "gated_linear_backward"
    N = check_gated_linear_backward(grad_out, x, weight, gates, output_mask)
    _device_ok(op, x)
    want_dx, want_dw, want_db = (bool(v) for v in output_mask)
    x2, g2, G2 = _rows(x), _rows(grad_out), _rows(gates)
    M, K = x2.shape
    dx, dw, db = (x.new_empty((0,)) for _ in range(3))  # distinct: outputs must not alias
    with _on(x):
        if want_dx:
            dx = torch.empty((M, K), dtype=x.dtype, device=x.device)
            if M > 0 and K > 0:
                kernel, cfg = _pick(_dx_tuned, _gated_dx)
                grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(K, meta["BK"]),)  # noqa: E731
                kernel[grid](
                    g2, G2, weight, dx, M, N, K,
                    g2.stride(0), g2.stride(1), G2.stride(0), G2.stride(1), weight.stride(0), weight.stride(1),
                    dx.stride(0), dx.stride(1), PRECISION=_precision(x), ACC=_acc(x), **cfg)
            dx = dx.view(x.shape)
        if (want_dw or want_db) and N > 0:
            split = split_m if split_m is not None else _split_m(M, N, K, x.device)
            part = torch.float64 if x.dtype == torch.float64 else torch.float32
            dw_buf = (torch.empty((split, N, K), dtype=part if split > 1 else x.dtype, device=x.device)
                      if want_dw else None)
            db_buf = (torch.empty((split, N), dtype=part if split > 1 else x.dtype, device=x.device)
                      if want_db else None)
            k_tiles = max(K, 1) if want_dw else 1
            kernel, cfg = _pick(_dw_tuned, _gated_dw)
            grid = lambda meta: (triton.cdiv(N, meta["BN"]) * triton.cdiv(k_tiles, meta["BK"]), split)  # noqa: E731
            kernel[grid](
                g2, G2, x2, dw_buf if want_dw else g2, db_buf if want_db else g2, M, N, K, k_tiles,
                g2.stride(0), g2.stride(1), G2.stride(0), G2.stride(1), x2.stride(0), x2.stride(1),
                N * K, K, 1, N, 1,
                HAS_DW=want_dw, HAS_DB=want_db, SPLIT=split, PRECISION=_precision(x), ACC=_acc(x), **cfg)
            if want_dw:
                dw = dw_buf[0] if split == 1 else dw_buf.sum(0).to(x.dtype)
            if want_db:
                db = db_buf[0] if split == 1 else db_buf.sum(0).to(x.dtype)
        else:
            if want_dw:
                dw = torch.zeros((N, K), dtype=x.dtype, device=x.device)
            if want_db:
                db = torch.zeros((N,), dtype=x.dtype, device=x.device)
    return dx, dw, db


# ---------------------------------------------------------------------------------------- sm_90a report
def _hopper_args(unit_strides, **flags):
    """HopperKernel.args: contiguous operands of one dtype, int32 gate words (tools/hopper_report.py)."""
    def args(dtype):
        probe = torch.empty(0, dtype=dtype)
        return dict(gates_ptr="*i32", PRECISION=_precision(probe), ACC=_acc(probe),
                    **dict.fromkeys(unit_strides, 1), **flags)
    return args


_FWD_UNIT = ("stride_xk", "stride_wk", "stride_b", "stride_gw", "stride_on")
HOPPER_KERNELS = [
    HopperKernel("relu_gates fwd", _linear_gates_fwd, _hopper_args(_FWD_UNIT, HAS_BIAS=True, RELU_GATES=True)),
    HopperKernel("gated_linear fwd", _linear_gates_fwd, _hopper_args(_FWD_UNIT, HAS_BIAS=True, RELU_GATES=False)),
    HopperKernel("gated_linear bwd dx", _gated_dx,
                 _hopper_args(("stride_gn", "stride_Gw", "stride_wk", "stride_dk"))),
    HopperKernel("gated_linear bwd dW+db", _gated_dw,
                 _hopper_args(("stride_gn", "stride_Gw", "stride_xk", "stride_dk", "stride_bn"),
                              HAS_DW=True, HAS_DB=True, SPLIT=1)),
]
