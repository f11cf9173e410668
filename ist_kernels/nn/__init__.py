"""Drop-in modules over ist_kernels.functional."""
from .masked import MaskedConv2d, MaskedLinear  # noqa: F401
from .subnet import SubnetMLP  # noqa: F401
