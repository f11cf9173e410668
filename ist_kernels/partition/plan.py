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
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

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
