"""Drop-in modules over ist_kernels.functional."""
from .grelu import GatedLinear, GReLUMLP  # noqa: F401
from .masked import MaskedConv2d, MaskedLinear  # noqa: F401
from .subnet import SubnetMLP  # noqa: F401
