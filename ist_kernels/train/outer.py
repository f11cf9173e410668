"""The outer optimizer: one object for every method that steps its model after a round.

After a round's aggregation A (the subnetworks owner-averaged, or the workers' models averaged) of
tensors that held ``previous`` before the round, the round's pseudo-gradient is
g = previous - A, and the outer optimizer takes one step of a ``torch.optim.Optimizer`` from
``previous`` with gradient g; the result replaces A (DiLoCo, arXiv 2311.08105, Algorithm 1; torchft's
``DiLoCo`` takes any optimizer the same way). ``--outer-optimizer``:

- ``nesterov``: SGD with Nesterov momentum (DiLoCo's: ``--outer-lr`` 0.7, ``--outer-momentum`` 0.9),
- ``sgd``: SGD with heavy-ball momentum (the same, not Nesterov),
- ``adam``: ``torch.optim.Adam`` (``--outer-lr``; betas and eps at torch's defaults),

and :class:`OuterOptimizer` takes any ``torch.optim.Optimizer`` class with its keyword arguments.

The two SGD kinds are :class:`ExactSGD`: torch.optim.SGD's update without dampening, with every
product and sum its own correctly rounded op (no fused multiply-add), so a compact slice and the
full tensor it was cut from give the same bits: the decentralized run, where a partitioned slice
takes its outer step on the rank that trained it, equals the simulated run bit for bit.

The state is kept per tensor name (:attr:`OuterOptimizer.state`: name -> the optimizer's state of
that tensor, e.g. ``momentum_buffer``; Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``), so that a
partitioned slice's state can travel with the slice to its next owners.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type

import torch
from torch import Tensor, nn

#: --outer-optimizer's choices ("none": no outer step)
OUTER_OPTIMIZERS = ("none", "nesterov", "sgd", "adam")


@torch.no_grad()
def outer_step_(params: List[Tensor], grads: List[Tensor], bufs: List[Tensor], lr: float, momentum: float,
                nesterov: bool = True) -> None:
    """One SGD step with momentum on ``params``: b = momentum b + g, then p -= lr (g + momentum b)
    (Nesterov) or p -= lr b: torch.optim.SGD's update without dampening, its buffer starting at zero.
    Every product and sum is its own correctly rounded op (no fused multiply-add), so a compact
    slice and the full tensor it was cut from give the same bits. ``grads`` is overwritten."""
    if not params:
        return
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    if nesterov:
        mb = torch._foreach_mul(bufs, momentum)
        torch._foreach_add_(grads, mb)
    else:
        torch._foreach_copy_(grads, bufs)
    torch._foreach_mul_(grads, lr)
    torch._foreach_sub_(params, grads)


class ExactSGD(torch.optim.Optimizer):
    """SGD with momentum (Nesterov by default) through :func:`outer_step_`: the values of
    ``torch.optim.SGD(lr, momentum, nesterov)`` without weight decay or dampening, rounded the same
    on any slice of a tensor. State: ``momentum_buffer`` per parameter, as torch.optim.SGD's."""

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = True):
        if not lr > 0:
            raise ValueError(f"ExactSGD: lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"ExactSGD: momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]
            outer_step_(params, [p.grad.clone() for p in params], bufs, group["lr"], group["momentum"],
                        group["nesterov"])
        return loss


class OuterOptimizer:
    """The outer step (see the module docstring): ``OuterOptimizer(torch.optim.Adam, lr=0.1)``, or
    :meth:`of` a run's ``--outer-optimizer``. ``state_keys``: the keys of the state tensors of a
    parameter's shape (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``), which
    travel with a partitioned slice under decentralized storage (every rank moves the same keys, in
    this order) and are counted in bytes; None: whatever the first step makes (then decentralized
    storage cannot move the state before it exists: give the keys). ``initial_state(tensor)``: the
    state a tensor starts with (what the optimizer would create at its first step), so that its
    bytes are held and counted from the first round; None: created by the first step."""

    def __init__(self, optimizer_cls: Type[torch.optim.Optimizer], state_keys: Optional[Sequence[str]] = None,
                 initial_state: Optional[Callable[[Tensor], Dict[str, Tensor]]] = None, **kwargs: Any):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"OuterOptimizer: optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.state_keys = None if state_keys is None else tuple(state_keys)
        self.initial_state = initial_state
        #: tensor name -> the optimizer's state of that tensor (its keys as the optimizer names them)
        self.state: Dict[str, Dict[str, Any]] = {}

    @classmethod
    def of(cls, kind: str, lr: float, momentum: float = 0.9) -> Optional["OuterOptimizer"]:
        """``--outer-optimizer`` ``kind`` at ``lr`` (``momentum``: the SGD kinds'); None for ``none``."""
        if kind == "none":
            return None
        if kind in ("nesterov", "sgd"):
            return cls(ExactSGD, ("momentum_buffer",), lambda t: {"momentum_buffer": torch.zeros_like(t)}, lr=lr,
                       momentum=momentum, nesterov=kind == "nesterov")
        if kind == "adam":  # torch.optim.Adam's first state (a 0-dim float32 step on the CPU)
            return cls(torch.optim.Adam, ("exp_avg", "exp_avg_sq"),
                       lambda t: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(t),
                                  "exp_avg_sq": torch.zeros_like(t)}, lr=lr)
        raise ValueError(f"outer optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {kind!r}")

    # ---- the step
    @torch.no_grad()
    def step_grad_(self, params: Sequence[Tensor], grads: Sequence[Tensor], names: Sequence[str]) -> None:
        """One step of the optimizer on ``params`` (updated in place) with gradients ``grads``, the
        state of ``names[i]`` for ``params[i]``."""
        if not params:
            return
        leaves = [nn.Parameter(p.detach(), requires_grad=True) for p in params]  # share the storage
        for leaf, g in zip(leaves, grads):
            leaf.grad = g.detach().to(leaf.dtype)
        opt = self.optimizer_cls(leaves, **self.kwargs)
        for leaf, n in zip(leaves, names):
            if n in self.state:
                opt.state[leaf] = self.state[n]
        opt.step()
        for leaf, n in zip(leaves, names):
            self.state[n] = opt.state[leaf]
            leaf.grad = None
        if self.state_keys is None:
            self.state_keys = tuple(self.param_states([names[0]], {names[0]: params[0]}))

    @property
    def tensors_per_param(self) -> int:
        """State tensors of a parameter's shape per parameter (0 while unknown)."""
        return len(self.state_keys or ())

    def init_state_(self, tensors: Mapping[str, Tensor]) -> None:
        """Give every named tensor without state its initial state (see ``initial_state``)."""
        if self.initial_state is None:
            return
        for n, t in tensors.items():
            if n not in self.state:
                self.state[n] = self.initial_state(t)

    @torch.no_grad()
    def step_(self, tensors: Mapping[str, Tensor], previous: Mapping[str, Tensor], names: Sequence[str]) -> None:
        """The outer step of the ``names`` held in ``tensors`` (the round's aggregate, replaced in place
        by the stepped model) from ``previous`` (the model before the round)."""
        names = [n for n in names if n in tensors]
        if not names:
            return
        now = [tensors[n] for n in names]
        before = [previous[n] for n in names]
        g = torch._foreach_sub(before, now)
        torch._foreach_copy_(now, before)
        self.step_grad_(now, g, names)

    # ---- the state, by tensor name
    def param_states(self, names: Sequence[str], shapes: Mapping[str, Any]) -> Dict[str, Dict[str, Tensor]]:
        """state key -> name -> the state tensor of that name, for every state tensor of its
        tensor's shape (``shapes[name]``: the tensor or its shape): what travels with a slice."""
        out: Dict[str, Dict[str, Tensor]] = {}
        for n in names:
            shape = tuple(getattr(shapes[n], "shape", shapes[n]))
            for key, v in self.state.get(n, {}).items():
                if isinstance(v, Tensor) and v.dim() > 0 and tuple(v.shape) == shape:
                    out.setdefault(key, {})[n] = v
        return out

    def set_param_states(self, states: Mapping[str, Mapping[str, Tensor]], names: Sequence[str]) -> None:
        """Replace the state tensors of ``names`` with ``states`` (key -> name -> tensor, e.g. the
        exchanged slices' state); a name's other state (0-dim: Adam's ``step``, the same count for
        every tensor that took as many steps) is the largest among the state of ``names`` held before
        (they took this round's step; the other names may take theirs later), else of any name."""
        scalars: Dict[str, Tensor] = {}
        for pool in ([self.state[n] for n in names if n in self.state], list(self.state.values())):
            for st in pool:
                for key, v in st.items():
                    if isinstance(v, Tensor) and v.dim() == 0 and (key not in scalars or float(v) > float(scalars[key])):
                        scalars[key] = v
            if scalars:
                break
        for n in names:
            self.state.pop(n, None)
        for key, by_name in states.items():
            for n, v in by_name.items():
                self.state.setdefault(n, {})[key] = v
        for n in names:
            if n in self.state:
                for key, v in scalars.items():
                    self.state[n].setdefault(key, v.clone())

    def scalar_bytes(self, names: Sequence[str]) -> int:
        """Bytes of the 0-dim state of ``names`` (Adam's ``step``): what a holder of their slices holds
        besides the state tensors of their shape."""
        return sum(v.numel() * v.element_size() for n in names for v in self.state.get(n, {}).values()
                   if isinstance(v, Tensor) and v.dim() == 0)

    def tensors(self) -> List[Tensor]:
        """Every state tensor (for the byte ledger's held-state count)."""
        return [v for st in self.state.values() for v in st.values() if isinstance(v, Tensor)]

    def state_dict(self) -> Dict[str, Dict[str, Any]]:
        return {n: dict(st) for n, st in self.state.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's state; an older checkpoint's SGD momentum (name -> tensor) is read as
        ``momentum_buffer``."""
        new = {n: ({"momentum_buffer": st} if isinstance(st, Tensor) else dict(st)) for n, st in state.items()}
        with torch.no_grad():  # into the state held (its device), where it has the same tensors
            for n, st in new.items():
                mine = self.state.get(n, {})
                for key, v in st.items():
                    if isinstance(v, Tensor) and isinstance(mine.get(key), Tensor) and mine[key].shape == v.shape:
                        mine[key].copy_(v)
                        st[key] = mine[key]
        self.state = new
