"""IST's neuron partition of an MLP (paper 001 with categorical masks): every round the hidden
neurons are partitioned at random into S disjoint groups, worker s trains the subnetwork of group
s for ℓ = ``local_steps`` steps, and the full model is written back owner-averaged (each neuron
has exactly one owner; the shared output bias is averaged). The implementation is
:class:`.masked.Masked` with ``masks`` fixed to categorical; see there."""
from __future__ import annotations

from .masked import Masked
from . import register_method


@register_method("ist")
class IST(Masked):
    options = {k: v for k, v in Masked.options.items() if k not in ("masks", "xi")}
    fixed_masks = "categorical"
