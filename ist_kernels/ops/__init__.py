"""Python side of the op registrations, one package per op family. An op is read in four places:
its schema (csrc/ops.cpp), its kernels per backend (C++ under csrc/cpu/ and csrc/cuda/; the Python
CUDA backends in its family's package here), its Python registration (the family's __init__.py) and
its tests (python_tests/, e.g. test_subnet.py).

Each family package holds everything Python of its ops:

* ``__init__.py``: the registration -- fake kernels (shapes and checks for torch.compile and
  opcheck), autograd formulas registered from Python (if any), and the choice of CUDA backend;
* ``_checks.py``: the family's argument checks (grelu, subnet), shared by its fake kernels and
  backends;
* ``_triton.py``: the Triton kernels and their launchers (imported only when triton is installed);
* ``_aten.py``: the ATen composition (torch ops) used as CUDA backend, or as the fallback when
  triton is not installed.

The families:

* :mod:`.gates`: pack_gates / unpack_gates (fake kernels; the kernels are C++);
* :mod:`.grelu`: relu_gates / gated_linear / gated_linear_backward (Triton on CUDA, ATen without
  triton);
* :mod:`.subnet`: subnet_linear / subnet_linear_backward (ATen gather + cuBLAS on CUDA; the Triton
  gathered-load GEMMs as the tested alternative);
* :mod:`.slices`: the slice gather / scatter and slice-plan ops.

Shared by the families (a family's modules import these and their own siblings, never another
family, so the op modules form no import circle):

* :mod:`._checks`: the error policy and the argument checks several families use;
* :mod:`._cuda`: how a Python CUDA backend is registered (Triton launchers traceable by Inductor,
  ATen compositions), and whether triton is installed (``HAS_TRITON``);
* :mod:`._triton_common`: pieces every Triton GEMM shares (autotuning, launch, ``HopperKernel``
  declarations read by tools/hopper_report.py); imports triton.
"""
from . import (
    gates,  # noqa: F401
    grelu,  # noqa: F401
    slices,  # noqa: F401
    subnet,  # noqa: F401
)
