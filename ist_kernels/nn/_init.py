"""Initialisation shared by the modules.

Values are drawn on the parameter's own device (no CPU draw then move; nothing on ``meta``). A
parameter sharded by FSDP2 (a DTensor) gets its shard of the full tensor's draw, so the module
equals one built unsharded from the same seed, whatever the sharding."""
import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover (torch built without distributed)
    DTensor, distribute_tensor = (), None


def like(full: Tensor, t: Tensor) -> Tensor:
    """``full`` laid out as ``t``: its local shard (as a DTensor) when ``t`` is a DTensor."""
    if isinstance(t, DTensor):
        return distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
    return full


def draw_(t: Tensor, fill: Callable[[Tensor, Optional[torch.Generator]], Tensor],
          generator: Optional[torch.Generator] = None) -> None:
    """``fill(tensor, generator)`` in place on ``t``'s device.

    With a generator on another device (e.g. a CPU generator for a CUDA model, for the same values
    on every machine), or for a DTensor, the full tensor is drawn on a scratch tensor (on the
    generator's device, else ``t``'s) and copied in."""
    if t.device.type == "meta":
        return
    if isinstance(t, DTensor) or (generator is not None and generator.device != t.device):
        local = t.to_local().device if isinstance(t, DTensor) else t.device
        scratch = torch.empty(t.shape, dtype=t.dtype, device=generator.device if generator is not None else local)
        t.copy_(like(fill(scratch, generator).to(local), t))
    else:
        fill(t, generator)


@torch.no_grad()
def linear_init_(weight: Tensor, bias: Optional[Tensor], generator: Optional[torch.Generator] = None) -> None:
    """``nn.Linear`` / ``nn.Conv2d``'s ``reset_parameters`` (same draws in the same order), through
    :func:`draw_`: kaiming-uniform weight (a = √5), bias U(-1/√fan_in, 1/√fan_in)."""
    draw_(weight, lambda u, g: nn.init.kaiming_uniform_(u, a=math.sqrt(5), generator=g), generator)
    if bias is not None:
        fan_in, _ = nn.init._calculate_fan_in_and_fan_out(weight)
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        draw_(bias, lambda u, g: nn.init.uniform_(u, -bound, bound, generator=g), generator)
