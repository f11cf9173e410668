"""ist_kernels: fast kernels for independent subnetwork training.

``torch.ops.ist_kernels.*`` are the ops (schemas in csrc/ops.cpp); ``ist_kernels.functional`` wraps
them; ``ist_kernels.nn`` holds drop-in modules over the functional API.
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from ._build import load_extension
from ._version import __version__  # noqa: F401

_C = load_extension()  # registers the op schemas and the C++ kernels; ImportError when built for another torch
# ops first: it registers what functional and nn call
# isort: off
from . import ops  # noqa: F401  (fake kernels, autograd, Triton CUDA kernels)
from . import functional  # noqa: F401
from . import nn  # noqa: F401
# isort: on

#: the public API: ``functional`` (the entry points, with their own ``__all__``) and ``nn`` (modules);
#: ``torch.ops.ist_kernels.*`` is the registration layer under them.
__all__ = ["functional", "nn", "__version__"]
