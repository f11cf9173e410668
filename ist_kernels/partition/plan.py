"""SlicePlan: the plain-data description of one round's partition that aggregation and the
distributed exchange read.

Every partition method (IST neuron partitions, LOFT filter partitions, ResIST block partitions)
can state a round as: for each tensor of the global model (by its state-dict name), the dim it is
partitioned along and, per subnetwork s, the sorted int64 indices along that dim that s owns
(empty: s does not hold that tensor at all, e.g. a ResIST block another subnetwork runs). A shared
tensor (dim None) is held whole by every subnetwork and averaged over all of them.

Subnetwork s's compact copy of tensor t is ``global[t].index_select(t.dim, t.owners[s])``;
aggregation is owner-averaging: a slice owned by k >= 1 subnetworks becomes the mean of their
copies, a slice nobody owned keeps its value (paper 001 §3.1, eta = N_perp / N).

Under decentralized storage rank s holds exactly ``plan.part(tensors, s)``; a plan that leaves
slices unowned (Bernoulli masks) is stored as ``plan.with_holders(sizes)``, which gives every
unowned slice to one holder that keeps it untrained, so that someone holds it and its value passes
through the owner mean unchanged.
"""
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSlices:
    name: str
    dim: Optional[int]  # None: shared by all subnetworks
    owners: Tuple[Tensor, ...] = ()  # per subnetwork: int64 indices along dim (empty for shared)

    @property
    def shared(self) -> bool:
        return self.dim is None


@dataclass(frozen=True)
class SlicePlan:
    num_subnetworks: int
    tensors: Tuple[TensorSlices, ...]

    def __post_init__(self):
        if self.num_subnetworks < 1:
            raise ValueError(f"SlicePlan: num_subnetworks must be >= 1, got {self.num_subnetworks}")
        for t in self.tensors:
            if not t.shared and len(t.owners) != self.num_subnetworks:
                raise ValueError(
                    f"SlicePlan: tensor {t.name!r} has {len(t.owners)} owner lists, expected {self.num_subnetworks}")

    @property
    def partitioned(self) -> Tuple[TensorSlices, ...]:
        return tuple(t for t in self.tensors if not t.shared)

    @property
    def shared(self) -> Tuple[TensorSlices, ...]:
        return tuple(t for t in self.tensors if t.shared)

    def names(self) -> Sequence[str]:
        return [t.name for t in self.tensors]

    def part(self, tensors: Mapping[str, Tensor], s: int) -> Dict[str, Tensor]:
        """Subnetwork ``s``'s tensors cut from the full ``tensors`` (name -> tensor): the slices it
        owns of every partitioned tensor (new, compact; none where it owns nothing; a 0-dim tensor
        stays 0-dim) and the shared tensors (cloned)."""
        if not 0 <= s < self.num_subnetworks:
            raise ValueError(f"SlicePlan.part: subnetwork must be in [0, {self.num_subnetworks}), got {s}")
        out = {}
        for t in self.tensors:
            full = tensors[t.name].detach()
            if t.shared:
                out[t.name] = full.clone()
            elif t.owners[s].numel():
                idx = t.owners[s].to(full.device)
                out[t.name] = full.clone() if full.dim() == 0 else full.index_select(t.dim, idx)
        return out

    def with_holders(self, sizes: Mapping[str, int]) -> "SlicePlan":
        """This plan with every slice that no subnetwork owns given to one holder, subnetwork
        ``slice index mod S`` (``sizes``: name -> length of each partitioned tensor along its dim).
        The plan itself when every slice is owned."""
        S = self.num_subnetworks
        tensors = []
        for t in self.tensors:
            if t.shared:
                tensors.append(t)
                continue
            n = sizes[t.name]
            owned = torch.zeros(n, dtype=torch.bool)
            for o in t.owners:
                owned[o.cpu()] = True
            free = (~owned).nonzero().flatten()
            if not free.numel():
                tensors.append(t)
                continue
            home = free % S
            owners = tuple(torch.cat([o.cpu(), free[home == s]]).sort().values for s, o in enumerate(t.owners))
            tensors.append(TensorSlices(t.name, t.dim, owners))
        return SlicePlan(S, tuple(tensors))


def positions(held: Tensor, owned: Tensor) -> Tensor:
    """Where each of ``owned`` (sorted indices, a subset of ``held``) sits in ``held`` (sorted): the
    positions of a subnetwork's slices inside the compact tensor of a rank that holds more."""
    return torch.searchsorted(held, owned)


class RoundPlan:
    """What the round engine (:class:`ist_kernels.train.rounds.SubnetRounds`) reads of one round's
    plan, with its defaults. Every plan it runs subclasses this: the CNN and transformer plans
    (:class:`~ist_kernels.partition.SubnetworkPlan`), ``masked``'s neuron plans and GReLU's row plans.

    - ``slices``: the round's :class:`SlicePlan` (what each subnetwork trains; the parameter-server
      count and replicated storage read it); ``storage_slices`` (default ``slices``): what each rank
      stores under decentralized storage; ``ps_download`` (default None: the next subnetwork): what
      each worker downloads in the parameter-server count;
    - simulated and replicated storage: ``build(optimizer)`` cuts this process's subnetworks from the
      global model (indexable by worker; each with ``index``, ``module`` and ``optimizer``),
      ``aggregate(subnetworks, optimizer)`` puts them back owner-averaged, ``after_aggregate(model)``
      (e.g. ResIST's residual scales; default: nothing);
    - decentralized storage: ``part(s)`` cuts rank s's stored tensors from the global model,
      ``attach(s, tensors)`` builds its subnetwork around them, ``tensors_of(sub, detach=True)`` is
      what it stores after training;
    - ``compact(sub)`` (default ``tensors_of``): a subnetwork's tensors in the plan's view (what a
      compressed exchange codes); ``held(sub, optimizer, extra)`` (default the module, the
      optimizer and ``extra``): what a worker holds while it trains, for the byte ledger (modules,
      optimizers, tensors, containers of them, or ints: bytes counted from the plan);
      ``reusable`` (default True): the engine may keep the compact module and its optimizer across
      rounds of equal shapes.
    """

    slices: SlicePlan
    ps_download: Optional[SlicePlan] = None
    reusable: bool = True

    @property
    def storage_slices(self) -> SlicePlan:
        return self.__dict__.get("_storage_slices", self.slices)

    @storage_slices.setter
    def storage_slices(self, value: SlicePlan) -> None:
        self.__dict__["_storage_slices"] = value

    def _missing(self, what: str):
        return NotImplementedError(f"{type(self).__name__} has no {what}: the round engine needs it for this storage")

    def build(self, optimizer=None):
        raise self._missing("build(optimizer)")

    def aggregate(self, subnetworks, optimizer=None) -> None:
        raise self._missing("aggregate(subnetworks, optimizer)")

    def after_aggregate(self, model=None) -> None:
        return None

    def part(self, s: int) -> Dict[str, Tensor]:
        raise self._missing("part(s)")

    def attach(self, s: int, tensors: Dict[str, Tensor]):
        raise self._missing("attach(s, tensors)")

    def tensors_of(self, sub, detach: bool = True) -> Dict[str, Tensor]:
        raise self._missing("tensors_of(sub)")

    def compact(self, sub) -> Dict[str, Tensor]:
        return self.tensors_of(sub)

    def held(self, sub, optimizer, extra: Sequence = ()) -> tuple:
        return (sub.module, optimizer, *extra)
