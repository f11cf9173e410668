"""Load ``ist_kernels._C`` and check that it was built for the installed torch.

``_C`` is compiled against one torch (its C++ ABI, its CUDA): setup.py records that torch's version
and CUDA version in the extension (``_C.torch_version``, ``_C.cuda_version``). A ``_C`` built for
another torch either fails to load (undefined symbols) or loads and crashes later; both are turned
into an ImportError here that says which torch each side has and how to rebuild (as
torch_scatter does at import).
"""
import importlib
from typing import Optional

import torch

REBUILD = "pip install --no-build-isolation -e ."


def _public(version: str) -> str:
    """``2.13.0+cu128`` -> ``2.13.0``: the release; the local part names the wheel's CUDA, checked apart."""
    return str(version).split("+", 1)[0]


def mismatch(built_torch: str, built_cuda: Optional[str], torch_version: str,
             torch_cuda: Optional[str]) -> Optional[str]:
    """Why an extension built against (``built_torch``, ``built_cuda``) cannot run with the
    installed (``torch_version``, ``torch_cuda``); None when it can. A CPU-only build runs with a
    CUDA torch (CUDA tensors then take the Python/Triton kernels); a CUDA build needs a torch of the
    same CUDA major.minor."""
    if _public(built_torch) != _public(torch_version):
        return f"it was built against torch {built_torch}, but torch {torch_version} is installed"
    if built_cuda:
        if not torch_cuda:
            return f"it was built with CUDA {built_cuda}, but the installed torch {torch_version} has no CUDA"
        if built_cuda.split(".")[:2] != torch_cuda.split(".")[:2]:
            return (f"it was built with CUDA {built_cuda}, but the installed torch {torch_version} uses "
                    f"CUDA {torch_cuda}")
    return None


def _rebuild_hint() -> str:
    return (f"Rebuild it against the installed torch: `{REBUILD}` in the ist_kernels source folder "
            f"(or `python setup.py build_ext --inplace` for an in-place build)")


def load_extension():
    """Import ``ist_kernels._C`` (registers the op schemas and the C++ kernels); ImportError saying
    how to rebuild when it is missing, does not load, or was built for another torch."""
    try:
        _C = importlib.import_module(f"{__package__}._C")  # (`from . import _C` hides ModuleNotFoundError)
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == f"{__package__}._C":
            raise ImportError(f"ist_kernels._C, the compiled extension, is not built. {_rebuild_hint()}.") from e
        raise ImportError(f"ist_kernels._C cannot be loaded ({e}); it was probably built for another torch than "
                          f"the installed {torch.__version__}. {_rebuild_hint()}.") from e
    why = mismatch(getattr(_C, "torch_version", "unknown"), getattr(_C, "cuda_version", "") or None,
                   torch.__version__, torch.version.cuda)
    if why is not None:
        raise ImportError(f"ist_kernels._C does not match the installed torch: {why}. {_rebuild_hint()}.")
    return _C
