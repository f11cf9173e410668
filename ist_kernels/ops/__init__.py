"""Python side of the op registrations: fake kernels (shape functions for torch.compile and
opcheck), autograd formulas and the Triton CUDA kernels, one module per op family."""
from . import gates  # noqa: F401
from . import slices  # noqa: F401
from . import grelu  # noqa: F401
from . import subnet  # noqa: F401
