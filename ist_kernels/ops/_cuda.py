"""How the Python CUDA backends of the ops (Triton launchers, ATen compositions) are registered, so
that eager calls launch them directly and torch.compile / Inductor sees the Triton kernels inside.

The ops are defined in C++ (csrc/ops.cpp: schemas, CPU kernels, autocast). ``torch.library.
triton_op`` (torch >= 2.6) cannot attach to them: it creates a new op through ``custom_op``, which
defines the schema again ("Tried to register an operator ... multiple times"). What ``triton_op``
does is two registrations, and both work on an op defined anywhere, so :func:`register_triton`
makes them on ours:

1. the eager CUDA kernel (``torch.library.register_kernel(op, "cuda")``): the launcher with
   ``wrap_triton`` switched off, i.e. a plain Triton launch (through the higher-order op an eager
   launch costs about a millisecond);
2. a ``FunctionalTensorMode`` rule (``torch.library.register_torch_dispatch``): when AOTAutograd
   functionalizes a graph (torch.compile), an op on CUDA tensors is decomposed into what its
   launcher runs -- torch ops and ``wrap_triton(kernel)[grid](...)`` calls, which become
   ``triton_kernel_wrapper_functional`` nodes that Inductor compiles, autotunes and fuses around.
   The launcher knows it is being traced (``_triton_common.tracing``): no data pointers, no device
   guard, and no autotune pre-hooks (Inductor refuses them), so the forward takes the pointer GEMM
   instead of the TMA one there. CPU tensors are left to the C++ kernel (one op in the graph), and
   torch.export keeps the op whole, as it does a triton_op;

plus the kernels' entry in ``torch._library.triton.triton_ops_to_kernels``, as ``triton_op`` makes,
so the AOTAutograd cache key covers their source. With an older torch (no ``wrap_triton``) only
the eager kernel is registered: the op stays opaque to Inductor, as before.

Without Triton, :func:`register_composition` registers an ATen composition for CUDA instead
(the family's ``_aten`` module, e.g. ist_kernels/ops/grelu/_aten.py), chosen at import with one warning
(:func:`warn_no_triton`; none where there is no CUDA device).

Every kernel registered here runs with autocast excluded (:func:`never_autocast`), the Python
counterpart of ``ist::NoAutocast`` (csrc/checks.h): the ops' autocast kernels (csrc/autocast.cpp)
cast once, outside, and nothing inside casts again.
"""
import functools
import warnings

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
if HAS_TRITON:  # triton is optional; _triton_common.py imports it (and nothing of ist_kernels)
    from ._triton_common import tracing

#: torch.library.wrap_triton / triton_op exist (torch >= 2.6): Inductor can trace Triton launches
TRACEABLE = hasattr(torch.library, "wrap_triton") and hasattr(torch.library, "triton_op")

_AUTOCAST_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)


def never_autocast(kernel):
    """``kernel`` with the autocast dispatch keys excluded while it runs: its torch calls (cuBLAS
    GEMMs, sums) keep their inputs' dtype, so its outputs have the dtype its fake kernel promises."""
    @functools.wraps(kernel)
    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return kernel(*args, **kwargs)
    return run


def _eager(launcher):
    """The launcher with wrap_triton off (a direct Triton launch), as triton_op's eager path."""
    try:
        from torch._library.triton import set_wrap_triton_enabled
    except ImportError:  # pragma: no cover (torch < 2.6: wrap_triton is not used)
        return launcher

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        with set_wrap_triton_enabled(False):
            return launcher(*args, **kwargs)
    return run


def _decomposition(launcher):
    """FunctionalTensorMode rule: an op on CUDA tensors is traced through its launcher (see the
    module docstring); anything else is handled by the mode as usual (the op stays one node)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    def rule(mode, func, types, args, kwargs):
        if any(t not in (torch.Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # another tensor subclass: its own rules first (as triton_op)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or any(t.device.type != "cuda" for t in tensors) or _exporting():
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, tracing():
            return launcher(*args, **kwargs)
    return rule


def _exporting():
    """torch.export keeps Triton ops whole (a serializable, backend-neutral program), as triton_op does."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # pragma: no cover (older torch)
        return False
    return custom_triton_ops_decomposition_disabled()


def register_triton(qualname, launcher, kernels):
    """Register ``launcher`` (a Python function running Triton kernels through
    ``_triton_common.launch``) as the CUDA kernel of ``qualname``, traceable by Inductor where the
    torch version allows. ``kernels``: the Triton kernels it may launch."""
    launcher = never_autocast(launcher)
    torch.library.register_kernel(qualname, "cuda", _eager(launcher) if TRACEABLE else launcher)
    if not TRACEABLE:
        return
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    torch.library.register_torch_dispatch(qualname, FunctionalTensorMode, _decomposition(launcher))
    table = getattr(getattr(torch._library, "triton", None), "triton_ops_to_kernels", None)
    if table is not None:
        table[qualname] = list(kernels)


def register_composition(qualname, kernel):
    """Register ``kernel`` (a composition of torch ops) as the CUDA kernel of ``qualname``."""
    torch.library.register_kernel(qualname, "cuda", never_autocast(kernel))


def warn_no_triton(ops, instead):
    """The one warning at import that ``ops`` run on CUDA as ``instead`` without Triton; only where a
    CUDA device exists: a CPU-only install (or torch build) never takes that path. ``device_count``
    asks NVML where it can, so the check initialises no CUDA context (nor poisons a later fork)."""
    if torch.cuda.device_count() == 0:
        return
    warnings.warn(f"ist_kernels: triton is not installed, so {', '.join(ops)} run on CUDA as {instead} "
                  f"(pip install triton for the fused kernels)", RuntimeWarning, stacklevel=2)
