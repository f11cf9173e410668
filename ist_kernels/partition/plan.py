"""SlicePlan: the plain-data description of one round's partition that aggregation and the
distributed exchange read.

Every partition method (IST neuron partitions, LOFT filter partitions, ResIST block partitions)
can state a round as: for each tensor of the global model (by its state-dict name), the dim it is
partitioned along and, per subnetwork s, the sorted int64 indices along that dim that s owns
(empty: s does not hold that tensor at all, e.g. a ResIST block another subnetwork runs). A shared
tensor (dim None) is held whole by every subnetwork and averaged over all of them.

Subnetwork s's compact copy of tensor t is ``global[t].index_select(t.dim, t.owners[s])``. A tensor
partitioned along two dims (an MLP's hidden-to-hidden weight: the rows of a layer's neurons x the
columns of the previous layer's) is a product: ``t.cols[s]`` lists the indices along ``t.col_dim``
too, and s's compact copy is ``global[t].index_select(t.dim, t.owners[s]).index_select(t.col_dim,
t.cols[s])``, planned from the two lists (O(rows + cols), never element by element;
``ist_kernels.ops.slices.product``). ``t.flat(shape)`` states it element by element on the flat
view instead (index ``row * shape[1] + col``), for consumers that read one dim per tensor.
A product stored with holders (:meth:`SlicePlan.with_holders`) lists, per subnetwork, the blocks
of unowned elements it keeps besides its own (``t.holds[s]``: pairs (rows, cols)); its compact copy
is then 1-D, the blocks one after another (:meth:`TensorSlices.blocks`), each row-major.
Aggregation is owner-averaging: a slice owned by k >= 1 subnetworks becomes the mean of their
copies, a slice nobody owned keeps its value (paper 001 §3.1, eta = N_perp / N).

Under decentralized storage rank s holds exactly ``plan.part(tensors, s)``; a plan that leaves
slices unowned (Bernoulli masks) is stored as ``plan.with_holders(sizes)``, which gives every
unowned slice to one holder that keeps it untrained, so that someone holds it and its value passes
through the owner mean unchanged. A product keeps its holders as rows x cols blocks (at most
S x the row patterns per holder), the same elements at the same holders as on its flat view.
"""
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSlices:
    name: str
    dim: Optional[int]  # None: shared by all subnetworks
    owners: Tuple[Tensor, ...] = ()  # per subnetwork: int64 indices along dim (empty for shared)
    cols: Tuple[Tensor, ...] = ()  # a product: per subnetwork, int64 indices along col_dim
    col_dim: Optional[int] = None  # a product's second dim (None: sliced along dim only)
    holds: Tuple[Tuple[Tuple[Tensor, Tensor], ...], ...] = ()  # a product: per subnetwork, the (rows, cols)
    # blocks of unowned elements it keeps besides rows x cols (empty: none; SlicePlan.with_holders)

    @property
    def shared(self) -> bool:
        return self.dim is None

    @property
    def product(self) -> bool:
        """Partitioned along two dims: subnetwork s owns rows ``owners[s]`` x columns ``cols[s]``."""
        return self.col_dim is not None

    @property
    def dims(self):
        """The dims as the slice ops take them: ``dim``, or the pair ``(dim, col_dim)`` of a product."""
        return (self.dim, self.col_dim) if self.product else self.dim

    def index(self, s: int):
        """Subnetwork s's index as the slice ops take it: ``owners[s]``, or ``(owners[s], cols[s])``
        (of a product with holder blocks: its own block, the first of :meth:`blocks`)."""
        return (self.owners[s], self.cols[s]) if self.product else self.owners[s]

    def blocks(self, s: int) -> List[Tuple[Tensor, Tensor]]:
        """A product's blocks (rows, cols) subnetwork s holds, in the order of its compact copy: its
        own rows x cols, then the holder blocks ``holds[s]`` (disjoint from it and each other)."""
        return [(self.owners[s], self.cols[s]), *(self.holds[s] if self.holds else ())]

    def stacked(self, s: int) -> bool:
        """Whether subnetwork s's compact copy of this product is 1-D, its blocks one after another
        (it keeps holder blocks); else rows x cols."""
        return bool(self.holds) and len(self.holds[s]) > 0

    def count(self, s: int) -> int:
        """How many slices subnetwork s holds (of a product: the elements of its blocks, each one
        element of the two dims)."""
        if self.product:
            return sum(r.numel() * c.numel() for r, c in self.blocks(s))
        return self.owners[s].numel()

    def select(self, full: Tensor, s: int) -> Tensor:
        """Subnetwork s's compact copy of ``full`` (new; a 0-dim tensor is cloned); of a product
        with holder blocks (:meth:`stacked`), its blocks flattened one after another."""
        if full.dim() == 0:
            return full.clone()
        if self.stacked(s):
            return torch.cat([full.index_select(self.dim, r.to(full.device))
                              .index_select(self.col_dim, c.to(full.device)).reshape(-1) for r, c in self.blocks(s)])
        rows = self.owners[s].to(full.device)
        out = full.index_select(self.dim, rows)
        return out.index_select(self.col_dim, self.cols[s].to(full.device)) if self.product else out

    def flat_ids(self, s: int, n_cols: int) -> Tensor:
        """The flat indices (``row * n_cols + col``) of subnetwork s's product elements in the order
        of its compact copy (blocks one after another, each row-major). Costs its element count."""
        ids = [(r.cpu().unsqueeze(1) * n_cols + c.cpu().unsqueeze(0)).reshape(-1) for r, c in self.blocks(s)]
        return torch.cat(ids) if len(ids) > 1 else ids[0]

    def flat(self, shape: Sequence[int]) -> "TensorSlices":
        """A product stated element by element on the flat view of its tensor of ``shape`` (2-D,
        dims (0, 1)): subnetwork s owns flat index ``row * shape[1] + col`` for every row of
        ``owners[s]`` and column of ``cols[s]``, row-major (the compact copy's order); with holder
        blocks it holds their elements too, all sorted (the stacked compact copy's own order is
        :meth:`flat_ids`). Itself when not a product. Costs rows x columns: for consumers that read
        one dim per tensor."""
        if not self.product:
            return self
        if len(shape) != 2 or (self.dim % 2, self.col_dim % 2) != (0, 1):
            raise ValueError(f"TensorSlices.flat: {self.name!r} is a product along dims ({self.dim}, {self.col_dim}) "
                             f"of shape {list(shape)}; the flat view needs a 2-D tensor sliced along (0, 1)")
        S = len(self.owners)
        for s in range(S):
            for r, c in self.blocks(s):
                for k, (idx, n) in enumerate(((r, shape[0]), (c, shape[1]))):
                    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                        raise ValueError(f"TensorSlices.flat: {self.name!r}: the {('rows', 'cols')[k]} of subnetwork "
                                         f"{s} must be in [0, {n}) (dim {(self.dim, self.col_dim)[k]} of shape "
                                         f"{list(shape)}), got {idx.tolist()[:16]}")
        flat = []
        for s in range(S):
            if self.stacked(s):  # the blocks' elements in ascending order (a mark per element: no sort)
                mark = torch.zeros(shape[0] * shape[1], dtype=torch.bool)
                mark[self.flat_ids(s, shape[1])] = True
                flat.append(mark.nonzero().flatten())
            else:
                flat.append((self.owners[s].unsqueeze(1) * shape[1] + self.cols[s].unsqueeze(0)).reshape(-1))
        return TensorSlices(self.name, 0, tuple(flat))


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
            if t.product and (t.shared or len(t.cols) != self.num_subnetworks or t.col_dim == t.dim):
                raise ValueError(f"SlicePlan: the product {t.name!r} needs a dim, a distinct col_dim and "
                                 f"{self.num_subnetworks} column lists; got dims ({t.dim}, {t.col_dim}) and "
                                 f"{len(t.cols)} column lists")
            if not t.product and t.cols:
                raise ValueError(f"SlicePlan: tensor {t.name!r} has column lists but no col_dim")
            if t.holds and (not t.product or len(t.holds) != self.num_subnetworks):
                raise ValueError(f"SlicePlan: tensor {t.name!r} has holder blocks; they need a product and "
                                 f"{self.num_subnetworks} lists of (rows, cols) blocks, got {len(t.holds)}")

    @property
    def partitioned(self) -> Tuple[TensorSlices, ...]:
        return tuple(t for t in self.tensors if not t.shared)

    @property
    def shared(self) -> Tuple[TensorSlices, ...]:
        return tuple(t for t in self.tensors if t.shared)

    def names(self) -> Sequence[str]:
        return [t.name for t in self.tensors]

    def flat(self, shapes: Mapping[str, Sequence[int]]) -> "SlicePlan":
        """This plan with every product stated element by element on its flat view
        (:meth:`TensorSlices.flat`; ``shapes``: name -> the tensor's shape). The plan itself when it
        has no product."""
        if not any(t.product for t in self.tensors):
            return self
        return SlicePlan(self.num_subnetworks, tuple(t.flat(shapes[t.name]) if t.product else t for t in self.tensors))

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
            elif t.count(s):
                out[t.name] = t.select(full, s)
        return out

    def with_holders(self, sizes: Mapping[str, int]) -> "SlicePlan":
        """This plan with every slice that no subnetwork owns given to one holder, subnetwork
        ``slice index mod S`` (``sizes``: name -> length of each partitioned tensor along its dim;
        of a product, its 2-D shape, and the slice index its flat one, ``row * shape[1] + col``).
        The plan itself when every slice is owned. A product stays a product: the unowned elements
        of each holder as rows x cols blocks in ``holds`` (:func:`holder_blocks`), exactly the
        elements its flat view gives that holder (``with_holders(...).flat(shapes)`` equals
        ``flat(shapes).with_holders(...)``), planned in O(S x patterns x (rows + cols))."""
        S = self.num_subnetworks
        tensors = []
        for t in self.tensors:
            if t.shared:
                tensors.append(t)
                continue
            if t.product:
                holds = holder_blocks(t, tuple(sizes[t.name]))
                tensors.append(t if holds is None else TensorSlices(t.name, t.dim, t.owners, t.cols, t.col_dim, holds))
                continue
            owned = torch.zeros(sizes[t.name], dtype=torch.bool)
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


def holder_blocks(t: TensorSlices, shape: Sequence[int]):
    """The holder blocks of product ``t`` of 2-D ``shape``: per subnetwork h, (rows, cols) blocks
    that together are the elements no subnetwork owns whose flat index ``row * shape[1] + col`` is
    ``h`` mod S (None when every element is owned). Rows are grouped by the set of subnetworks that
    own them (their pattern) and by ``row * shape[1]`` mod S; a group's unowned columns are those
    none of its owners holds, and holder h takes those congruent to ``h - row * shape[1]`` mod S:
    at most S x patterns blocks per holder, disjoint, each row's columns sorted."""
    S = len(t.owners)
    n_rows, n_cols = int(shape[0]), int(shape[1])
    if n_rows * n_cols == 0:
        return None
    member = torch.zeros(S, n_rows, dtype=torch.bool)
    for s, rows in enumerate(t.owners):
        member[s, rows.cpu()] = True
    shift = torch.arange(n_rows, dtype=torch.int64) * n_cols % S
    if S <= 56:  # a row's pattern (S bits) and its shift (< S: 6 bits) as one int64 key
        bits = torch.ones(S, dtype=torch.int64).cumsum(0).sub(1).unsqueeze(1)
        key = (member.to(torch.int64) << bits).sum(0) | (shift << S)
        keys, inverse = torch.unique(key, return_inverse=True)
        groups = ((keys.unsqueeze(1) >> torch.arange(S + 1, dtype=torch.int64)) & 1)
        groups[:, S] = keys >> S
    else:
        groups, inverse = torch.unique(torch.cat([member.to(torch.int64), shift.unsqueeze(0)]).T, dim=0,
                                       return_inverse=True)
    order = torch.argsort(inverse, stable=True)
    rows_of = torch.split(order, torch.bincount(inverse, minlength=groups.shape[0]).tolist())
    col_class = torch.arange(n_cols, dtype=torch.int64) % S
    holds = [[] for _ in range(S)]
    for g, rows in zip(groups.tolist(), rows_of):
        taken = torch.zeros(n_cols, dtype=torch.bool)
        for s in range(S):
            if g[s]:
                taken[t.cols[s].cpu()] = True
        if bool(taken.all()):
            continue
        free = ~taken
        a = g[S]
        for h in range(S):
            cols = (free & (col_class == (h - a) % S)).nonzero().flatten()
            if cols.numel():
                holds[h].append((rows, cols))
    if not any(holds):
        return None
    return tuple(tuple(b) for b in holds)


def positions(held, owned):
    """Where each of ``owned`` (sorted indices, a subset of ``held``) sits in ``held`` (sorted): the
    positions of a subnetwork's slices inside the compact tensor of a rank that holds more. Of a
    product (pairs ``(rows, cols)``), the pair of positions along its two dims."""
    if isinstance(held, (tuple, list)):
        return tuple(torch.searchsorted(h, o) for h, o in zip(held, owned))
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
