"""Build ``ist_kernels._C``.

The C++ CPU kernels are always built. The CUDA sources (``csrc/cuda``) are built when the
installed torch has CUDA (or ``FORCE_CUDA=1``); ``FORCE_ONLY_CPU=1`` skips them. The build
never queries a GPU and never downloads anything: build with
``pip install --no-build-isolation -e .`` against the torch already installed.
"""
import glob
import os

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def extensions():
    use_cuda = (torch.version.cuda is not None and CUDA_HOME is not None) or _flag("FORCE_CUDA")
    if _flag("FORCE_ONLY_CPU"):
        use_cuda = False
    debug = _flag("DEBUG")
    cxx = ["-O0" if debug else "-O3", "-std=c++20", "-fdiagnostics-color=always"]
    if not debug:
        cxx.append("-fopenmp")
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")  # ops.cpp (schemas), autocast.cpp
    include_dirs = [os.path.join(HERE, "csrc")]
    kwargs = dict(
        name="ist_kernels._C",
        include_dirs=include_dirs,
        extra_link_args=[] if debug else ["-fopenmp"],
    )
    if use_cuda:
        # .cu kernels need only the CUDA toolkit; csrc/cuda/*.cpp are the thin torch bindings.
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp")
        return [CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx + ["-DIST_WITH_CUDA"], "nvcc": nvcc}, **kwargs)]
    return [CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
