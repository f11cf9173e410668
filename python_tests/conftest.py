import os

import pytest
import torch

# Triton kernels run on CPU tensors under the interpreter when there is no GPU. This must be set
# before any Triton kernel is defined, i.e. before ist_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU the tests pin one tile config per kernel (ist_kernels.triton.common.AUTOTUNE).
os.environ.setdefault("IST_KERNELS_AUTOTUNE", "0")

import ist_kernels  # noqa: E402,F401

try:  # property tests (test_properties.py); the profile is picked by HYPOTHESIS_PROFILE (default "ci")
    from hypothesis import HealthCheck, settings

    # "ci": 200 examples per property, fresh random ones each run (derandomize=False), no deadline
    # (the Triton interpreter is slow), a failure printed with its reproduction blob.
    settings.register_profile("ci", max_examples=200, deadline=None, derandomize=False, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("dev", settings.get_profile("ci"), max_examples=25)  # a quick look
    settings.register_profile("long", settings.get_profile("ci"), max_examples=2000)  # a hunt
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover (test_properties.py skips)
    pass

HAS_CUDA = torch.cuda.is_available()
_skip_without_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def requires_cuda(obj):
    """Mark a GPU-only test: it carries the ``gpu`` marker (``pytest -m gpu`` selects it, also on a
    machine without a GPU, where it is collected and skipped) and skips without CUDA."""
    return pytest.mark.gpu(_skip_without_cuda(obj))


#: the CUDA entry of a ``device`` parametrization: marked ``gpu``, skipped without CUDA
CUDA_PARAM = pytest.param("cuda", marks=[pytest.mark.gpu, _skip_without_cuda])

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

#: the exception types bad input may raise (ist_kernels/ops/_checks.py: TypeError for a dtype,
#: IndexError for an index out of range, ValueError for the rest); test_bad_inputs.py checks which.
BAD_INPUT = (ValueError, TypeError, IndexError)

# Devices every op is tested on: the CPU always, CUDA where present.
DEVICES = ["cpu", CUDA_PARAM]


@pytest.fixture
def gen():
    """A fresh, seeded generator per test: fresh random inputs, reproducible failures."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return g
