"""Drop-in modules over ist_kernels.functional, with torch.nn's conventions: ``device`` / ``dtype``
factory kwargs, ``reset_parameters`` (construct on ``meta``, ``to_empty``, then reset), a ``repr``
that never reads data."""
from .grelu import GatedLinear, GReLUMLP
from .masked import MaskedConv2d, MaskedLinear
from .subnet import SubnetMLP

__all__ = ["GatedLinear", "GReLUMLP", "MaskedConv2d", "MaskedLinear", "SubnetMLP"]
