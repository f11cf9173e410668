import os

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter when there is no GPU. This must be set
# before any Triton kernel is defined, i.e. before ist_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ist_kernels  # noqa: E402,F401

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

# Devices every op is tested on: the CPU always, CUDA where present.
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.fixture
def gen():
    """A fresh, seeded generator per test: fresh random inputs, reproducible failures."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g
