"""subnet_linear's argument checks and the dtypes each backend implements, in a leaf module: the
fake kernels (:mod:`ist_kernels.ops.subnet`), the CUDA composition (:mod:`._aten`) and the Triton
launchers (:mod:`._triton`) all import them, none imports back."""
import torch

from .._checks import check_index_list, check_same_device, fail

# dtypes each backend implements.
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # csrc/cpu/subnet.cpp
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # CUDA (_aten.py and _triton.py)


def _names(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_subnet(op, x, weight, bias, rows, cols, values=False, dtypes=None):
    """Shape, dtype and device checks shared by the fake kernels and the Triton launchers (the C++
    kernels check the same in csrc/cpu/subnet.cpp). With ``values`` the index entries are checked
    too (range, no repeats). ``dtypes``: those the kernel implements (default: those of weight's
    device). Returns (len(rows), len(cols)) with None meaning all. Builds no string on good input."""
    if weight.dim() != 2:
        fail(op, f"weight must be 2-D [out_features, in_features], got {weight.dim()} dimensions")
    if dtypes is None:
        dtypes = CPU_DTYPES if weight.device.type == "cpu" else TRITON_DTYPES
    if weight.dtype not in dtypes:
        fail(op, f"weight must be {_names(dtypes)} on {weight.device.type}, got {weight.dtype}", TypeError)
    if x.dim() < 1:
        fail(op, "x must have at least 1 dimension (features last), got a 0-d tensor")
    check_same_device(op, weight=weight, x=x, bias=bias)
    if x.dtype != weight.dtype:
        fail(op, f"x has dtype {x.dtype} but weight has dtype {weight.dtype}; they must match", TypeError)
    N, K = weight.shape
    if bias is not None:
        if bias.dtype != weight.dtype:
            fail(op, f"bias has dtype {bias.dtype} but weight has dtype {weight.dtype}; they must match", TypeError)
        if bias.dim() != 1 or bias.shape[0] != N:
            fail(op, f"bias must have shape [{N}] (weight's out_features), got {list(bias.shape)}")
    check_index_list(rows, N, op, "rows", "weight dim 0 (out_features)", weight.device, values=values)
    check_index_list(cols, K, op, "cols", "weight dim 1 (in_features)", weight.device, values=values)
    Nr = N if rows is None else rows.shape[0]
    Kc = K if cols is None else cols.shape[0]
    if x.shape[-1] != Kc:
        fail(op, f"x has {x.shape[-1]} features but the subnetwork has {Kc} "
                 + ("(len(cols))" if cols is not None else "(weight's in_features; cols is None)"))
    return Nr, Kc


def check_grad_out(op, grad_out, x, weight, Nr):
    check_same_device(op, weight=weight, grad_out=grad_out)
    if grad_out.dtype != weight.dtype:
        fail(op, f"grad_out has dtype {grad_out.dtype} but weight has dtype {weight.dtype}; they must match",
             TypeError)
    if grad_out.dim() != x.dim() or grad_out.shape[:-1] != x.shape[:-1] or grad_out.shape[-1] != Nr:
        want = (*x.shape[:-1], Nr)
        fail(op, f"grad_out must have shape {list(want)} (x's leading dims, len(rows) outputs), got "
                 f"{list(grad_out.shape)}")
