"""Triton kernels for subnet_linear (IST, paper 001 §3.1): tiled GEMMs over one subnetwork.

The subnetwork weight W[rows][:, cols] is never materialised: the weight operand of every tile is
loaded straight from the full W at weight[rows[n], cols[k]] (gathered loads; plain loads when rows
or cols is None), and tl.dot runs on tensor cores for fp16/bf16. Gradients land in the full-size
parameters: grad_weight tiles are stored at the gathered rows x cols of a zeroed tensor (indices are
unique, so no two tiles touch one element and no atomics are needed), grad_bias at rows.

The launch functions take CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (the tests call
them directly). One tile config under the interpreter; a few autotuned ones on a GPU.
"""

import torch
import triton
import triton.language as tl

from .._checks import check_output_mask
from .._triton_common import INTERPRET, HopperKernel, grouped_tile, tuned
from ._checks import TRITON_DTYPES, check_grad_out, check_subnet


@triton.jit
def _index(idx_ptr, offs, ok, stride, HAS: tl.constexpr):
    """Entry offs of an optional index list read through its stride (offs itself when the list is
    absent), as int64. A strided view (rows[::2]) is read in place: entry p at base + p * stride."""
    if HAS:
        return tl.load(idx_ptr + offs.to(tl.int64) * stride, mask=ok, other=0)
    else:
        return offs.to(tl.int64)


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, b_ptr, rows_ptr, cols_ptr, y_ptr, M, NR, KC,
                s_xm, s_xk, s_wn, s_wk, s_b, s_ym, s_yn, s_r, s_c,
                HAS_BIAS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_COLS: tl.constexpr,
                PRECISION: tl.constexpr, ACC: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # y[m, n] = sum_k x[m, k] W[rows[n], cols[k]] + b[rows[n]]
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(NR, BN), GROUP)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < NR
    r = _index(rows_ptr, offs_n, n_ok, s_r, HAS_ROWS)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * s_xm
    w_rows = w_ptr + r[None, :] * s_wn
    acc = tl.zeros((BM, BN), dtype=ACC)
    for k0 in range(0, KC, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < KC
        c = _index(cols_ptr, offs_k, k_ok, s_c, HAS_COLS)
        a = tl.load(x_rows + offs_k.to(tl.int64)[None, :] * s_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + c[:, None] * s_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + r * s_b, mask=n_ok, other=0.0).to(ACC)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n.to(tl.int64)[None, :] * s_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grad_x_kernel(g_ptr, w_ptr, rows_ptr, cols_ptr, dx_ptr, M, NR, KC,
                   s_gm, s_gn, s_wn, s_wk, s_dxm, s_dxk, s_r, s_c,
                   HAS_ROWS: tl.constexpr, HAS_COLS: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # dx[m, k] = sum_n g[m, n] W[rows[n], cols[k]]; here BK tiles the output, BN the reduction.
    pid_m, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(KC, BK), GROUP)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    m_ok = offs_m < M
    k_ok = offs_k < KC
    c = _index(cols_ptr, offs_k, k_ok, s_c, HAS_COLS)
    g_rows = g_ptr + offs_m.to(tl.int64)[:, None] * s_gm
    w_cols = w_ptr + c[None, :] * s_wk
    acc = tl.zeros((BM, BK), dtype=ACC)
    for n0 in range(0, NR, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < NR
        r = _index(rows_ptr, offs_n, n_ok, s_r, HAS_ROWS)
        a = tl.load(g_rows + offs_n.to(tl.int64)[None, :] * s_gn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        b = tl.load(w_cols + r[:, None] * s_wn, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    dx = dx_ptr + offs_m.to(tl.int64)[:, None] * s_dxm + offs_k.to(tl.int64)[None, :] * s_dxk
    tl.store(dx, acc.to(dx_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])


@triton.jit
def _grad_weight_kernel(g_ptr, x_ptr, rows_ptr, cols_ptr, dw_ptr, M, NR, KC,
                        s_gm, s_gn, s_xm, s_xk, s_dwn, s_dwk, s_r, s_c,
                        HAS_ROWS: tl.constexpr, HAS_COLS: tl.constexpr, PRECISION: tl.constexpr,
                        ACC: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # dW[rows[n], cols[k]] = sum_m g[m, n] x[m, k]; BN x BK output tiles, BM the reduction.
    pid_n, pid_k = grouped_tile(tl.program_id(0), tl.cdiv(NR, BN), tl.cdiv(KC, BK), GROUP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = pid_k * BK + tl.arange(0, BK)
    n_ok = offs_n < NR
    k_ok = offs_k < KC
    g_cols = g_ptr + offs_n.to(tl.int64)[:, None] * s_gn
    x_cols = x_ptr + offs_k.to(tl.int64)[None, :] * s_xk
    acc = tl.zeros((BN, BK), dtype=ACC)
    for m0 in range(0, M, BM):
        offs_m = (m0 + tl.arange(0, BM)).to(tl.int64)
        m_ok = offs_m < M
        a = tl.load(g_cols + offs_m[None, :] * s_gm, mask=n_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(x_cols + offs_m[:, None] * s_xm, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)
    r = _index(rows_ptr, offs_n, n_ok, s_r, HAS_ROWS)
    c = _index(cols_ptr, offs_k, k_ok, s_c, HAS_COLS)
    dw = dw_ptr + r[:, None] * s_dwn + c[None, :] * s_dwk
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _grad_bias_kernel(g_ptr, rows_ptr, db_ptr, M, NR, s_gm, s_gn, s_db, s_r,
                      HAS_ROWS: tl.constexpr, ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # db[rows[n]] = sum_m g[m, n]
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = offs_n < NR
    acc = tl.zeros((BN,), dtype=ACC)
    for m0 in range(0, M, BM):
        offs_m = (m0 + tl.arange(0, BM)).to(tl.int64)
        m_ok = offs_m < M
        g = tl.load(g_ptr + offs_m[:, None] * s_gm + offs_n.to(tl.int64)[None, :] * s_gn,
                    mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.sum(g.to(ACC), axis=0)
    r = _index(rows_ptr, offs_n, n_ok, s_r, HAS_ROWS)
    tl.store(db_ptr + r * s_db, acc.to(db_ptr.dtype.element_ty), mask=n_ok)


# ---- tile configs: one under the interpreter; a few autotuned on a GPU (keyed on the problem).
def _gpu_configs():
    """128x256 / 256x128 tiles spilled 124-132 B in the forward (tools/hopper_report.py): dropped."""
    c = triton.Config
    return [
        c({"BM": 128, "BN": 128, "BK": 64, "GROUP": 8}, num_warps=8, num_stages=3),
        c({"BM": 128, "BN": 64, "BK": 64, "GROUP": 8}, num_warps=4, num_stages=4),
        c({"BM": 64, "BN": 128, "BK": 64, "GROUP": 8}, num_warps=4, num_stages=4),
        c({"BM": 64, "BN": 64, "BK": 32, "GROUP": 8}, num_warps=4, num_stages=4),
    ]


_INTERPRET_CONFIG = {"BM": 16, "BN": 16, "BK": 16, "GROUP": 4}


def _tuned(kernel, key):
    if INTERPRET:
        return kernel
    pinned = triton.Config({"BM": 64, "BN": 64, "BK": 32, "GROUP": 8}, num_warps=4, num_stages=3)
    return tuned(kernel, _gpu_configs(), key, pinned)


_fwd = _tuned(_fwd_kernel, ["M", "NR", "KC", "HAS_ROWS", "HAS_COLS"])
_grad_x = _tuned(_grad_x_kernel, ["M", "NR", "KC", "HAS_ROWS", "HAS_COLS"])
_grad_weight = _tuned(_grad_weight_kernel, ["M", "NR", "KC", "HAS_ROWS", "HAS_COLS"])


def _launch(kernel, tiles, *args, **meta):
    """Launch over a 1-D grid of ``tiles(META)`` programs; the tile sizes come from the autotuner
    on a GPU and from _INTERPRET_CONFIG under the interpreter."""
    if INTERPRET:
        meta.update(_INTERPRET_CONFIG)
        kernel[(tiles(meta),)](*args, **meta)
    else:
        kernel[lambda m: (tiles(m),)](*args, **meta)


def _precision(dtype):
    if dtype == torch.float32 and not INTERPRET and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


class _device:
    """The CUDA device of a tensor as the current device (Triton launches on the current one)."""

    def __init__(self, t):
        self.ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _stride(idx):
    """The element stride of an optional index list (the kernels read entry p at base + p * stride;
    0 when the list is absent and not read)."""
    return 0 if idx is None else idx.stride(0)


def _cdiv(a, b):
    return (a + b - 1) // b


def subnet_linear(x, weight, bias=None, rows=None, cols=None):
    """y = x W[rows][:, cols]^T + b[rows]; x [..., len(cols)] -> y [..., len(rows)]."""
    Nr, Kc = check_subnet("subnet_linear", x, weight, bias, rows, cols, values=True, dtypes=TRITON_DTYPES)
    M = x.shape[:-1].numel()
    x2 = x.reshape(M, Kc)
    y = torch.empty((M, Nr), dtype=x.dtype, device=x.device)
    if M > 0 and Nr > 0:
        with _device(x):
            _launch(_fwd, lambda m: _cdiv(M, m["BM"]) * _cdiv(Nr, m["BN"]),
                    x2, weight, bias if bias is not None else weight, rows if rows is not None else weight,
                    cols if cols is not None else weight, y, M, Nr, Kc,
                    x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                    bias.stride(0) if bias is not None else 0, y.stride(0), y.stride(1), _stride(rows), _stride(cols),
                    HAS_BIAS=bias is not None, HAS_ROWS=rows is not None, HAS_COLS=cols is not None,
                    PRECISION=_precision(x.dtype), ACC=_acc(x.dtype))
    return y.reshape(*x.shape[:-1], Nr)


def subnet_linear_backward(grad_out, x, weight, rows=None, cols=None, output_mask=(True, True, True)):
    """(grad_x [..., len(cols)], grad_weight [N, K], grad_bias [N]); the full-size gradients are
    zero outside rows x cols; an output not in output_mask is an empty tensor."""
    op = "subnet_linear_backward"
    Nr, Kc = check_subnet(op, x, weight, None, rows, cols, values=True, dtypes=TRITON_DTYPES)
    check_grad_out(op, grad_out, x, weight, Nr)
    check_output_mask(op, output_mask)
    N, K = weight.shape
    M = x.shape[:-1].numel()
    x2 = x.reshape(M, Kc)
    g2 = grad_out.reshape(M, Nr)
    empty = weight.new_empty((0,))
    flags = dict(HAS_ROWS=rows is not None, HAS_COLS=cols is not None)
    rows_arg = rows if rows is not None else weight
    cols_arg = cols if cols is not None else weight
    grad_x = grad_weight = grad_bias = empty
    with _device(x):
        if output_mask[0]:
            grad_x = torch.empty((M, Kc), dtype=x.dtype, device=x.device)
            if M > 0 and Kc > 0:
                _launch(_grad_x, lambda m: _cdiv(M, m["BM"]) * _cdiv(Kc, m["BK"]),
                        g2, weight, rows_arg, cols_arg, grad_x, M, Nr, Kc,
                        g2.stride(0), g2.stride(1), weight.stride(0), weight.stride(1),
                        grad_x.stride(0), grad_x.stride(1), _stride(rows), _stride(cols),
                        PRECISION=_precision(x.dtype), ACC=_acc(x.dtype), **flags)
            grad_x = grad_x.reshape(x.shape)
        if output_mask[1]:
            grad_weight = torch.zeros((N, K), dtype=weight.dtype, device=weight.device)
            if Nr > 0 and Kc > 0:
                _launch(_grad_weight, lambda m: _cdiv(Nr, m["BN"]) * _cdiv(Kc, m["BK"]),
                        g2, x2, rows_arg, cols_arg, grad_weight, M, Nr, Kc,
                        g2.stride(0), g2.stride(1), x2.stride(0), x2.stride(1),
                        grad_weight.stride(0), grad_weight.stride(1), _stride(rows), _stride(cols),
                        PRECISION=_precision(x.dtype), ACC=_acc(x.dtype), **flags)
        if output_mask[2]:
            grad_bias = torch.zeros((N,), dtype=weight.dtype, device=weight.device)
            if Nr > 0:
                BN = 16 if INTERPRET else 128
                _grad_bias_kernel[(_cdiv(Nr, BN),)](
                    g2, rows_arg, grad_bias, M, Nr, g2.stride(0), g2.stride(1), grad_bias.stride(0), _stride(rows),
                    HAS_ROWS=rows is not None, ACC=_acc(x.dtype), BM=16 if INTERPRET else 64, BN=BN)
    return grad_x, grad_weight, grad_bias


# ---- sm_90a report (tools/hopper_report.py): the gathered path (rows and cols given), contiguous operands.
def _hopper_args(unit_strides, **flags):
    unit_strides = (*unit_strides, "s_r", "s_c")  # contiguous index lists
    return lambda dtype, meta: dict(rows_ptr="*i64", cols_ptr="*i64", HAS_ROWS=True, HAS_COLS=True,
                                    PRECISION=_precision(dtype), ACC=_acc(dtype),
                                    **dict.fromkeys(unit_strides, 1), **flags)


HOPPER_KERNELS = [
    HopperKernel("subnet_linear fwd", _fwd_kernel, _hopper_args(("s_xk", "s_wk", "s_b", "s_yn"), HAS_BIAS=True)),
    HopperKernel("subnet_linear bwd dx", _grad_x_kernel, _hopper_args(("s_gn", "s_wk", "s_dxk"))),
    HopperKernel("subnet_linear bwd dW", _grad_weight_kernel, _hopper_args(("s_gn", "s_xk", "s_dwk"))),
]
