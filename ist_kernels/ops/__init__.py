"""Python side of the op registrations: fake kernels (shape functions for torch.compile and
opcheck), autograd formulas and the Triton CUDA kernels, one module per op family."""
from . import (
    gates,  # noqa: F401
    grelu,  # noqa: F401
    slices,  # noqa: F401
    subnet,  # noqa: F401
)
