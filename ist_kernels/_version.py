"""The version of ist_kernels, written only here: pyproject.toml reads it (setuptools' dynamic
version, without importing the package) and ``ist_kernels.__version__`` is it."""
__version__ = "0.1.0"
