"""Drop-in modules over ist_kernels.functional."""
from .grelu import GatedLinear, GReLUMLP  # noqa: F401
