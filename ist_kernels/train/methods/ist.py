"""IST's neuron partition of an MLP: every round the hidden neurons of each layer are permuted at
random and cut into S groups whose sizes differ by at most one (as IST_Release does; never an
empty group, width >= S is checked), worker s trains the subnetwork of group s for
ℓ = ``local_steps`` steps, and the full model is written back owner-averaged (each neuron has
exactly one owner; the shared output bias is averaged). The implementation is
:class:`.masked.Masked` with ``masks`` fixed to balanced; ``masked --option masks=categorical``
is the multinomial draw of paper 001 instead."""
from __future__ import annotations

from . import register_method
from .masked import Masked


@register_method("ist")
class IST(Masked):
    options = {k: v for k, v in Masked.options.items() if k not in ("masks", "xi")}
    fixed_masks = "balanced"
