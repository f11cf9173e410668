"""Subnetwork plans for CNNs: which slice of every tensor each subnetwork owns, real standalone
subnetworks built from the global model with one slice gather, and aggregation back with one slice
scatter (mean over owners; unowned slices keep their value).

``plan.slices`` is the round as plain data (a :class:`SlicePlan`): for every parameter and buffer
of the global model (state_dict key), the dim it is partitioned along and per subnetwork the
indices it owns (empty: the subnetwork does not hold the tensor), or ``dim=None`` for a tensor
shared whole by all. A 0-dim tensor (``num_batches_tracked`` of a ResIST block) is partitioned
along dim 0 with owners ``[0]`` or empty. Optimizer state follows its parameter: a state tensor of
the parameter's shape (SGD momentum, Adam moments) is sliced like it, a 0-dim one (Adam step) is
held whole by the parameter's owners. The distributed exchange derives pack/unpack from this.
"""
import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import functional as F
from .plan import SlicePlan, TensorSlices


@dataclass(frozen=True)
class _Spec:
    """Internal form of one tensor's division: indices per subnetwork (None: not held); shared
    tensors carry the full index range for every subnetwork so gather/scatter treat all alike."""

    name: str
    dim: int
    owned: Tuple[Optional[Tensor], ...]
    local_names: Tuple[Optional[str], ...]
    shared: bool


@dataclass(eq=False)
class Subnetwork:
    """Subnetwork ``index`` of a plan: a standalone ``nn.Module`` (and, when the plan was built with
    the global optimizer, an optimizer of the same class and hyperparameters whose state is the
    matching slice of the global optimizer's)."""

    index: int
    module: nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    plan: "SubnetworkPlan" = field(default=None, repr=False)


@dataclass(frozen=True)
class _Slot:
    module: nn.Module  # module of the subnetwork holding the tensor
    attr: str
    is_param: bool
    spec: int  # index into plan.tensors


def _clone_structure(module: nn.Module, prefix: str, glob: Dict[str, nn.Module]) -> nn.Module:
    """A copy of the module tree that shares no containers with ``module`` and holds no tensors
    (parameters and buffers are ``None`` until attached); fills ``glob[name] = clone``."""
    new = type(module).__new__(type(module))
    d = module.__dict__.copy()
    for k, v in d.items():
        if isinstance(v, (dict, list, set)):
            d[k] = copy.copy(v)
    d["_parameters"] = dict.fromkeys(module._parameters)
    d["_buffers"] = dict.fromkeys(module._buffers)
    d["_modules"] = {k: (None if c is None else _clone_structure(c, f"{prefix}{k}.", glob))
                     for k, c in module._modules.items()}
    new.__dict__ = d
    glob[prefix[:-1]] = new
    return new


class SubnetworkPlan:
    """Base of the CNN plans. Subclasses fill ``_partitioned`` (name -> (dim, owned per
    subnetwork)) and override ``_edit`` to shape subnetwork ``s`` (narrower convs, fewer blocks)."""

    who = "plan"

    def __init__(self, model: nn.Module, num_subnetworks: int,
                 partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]]):
        self.model = model
        self.num_subnetworks = S = num_subnetworks
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        self._is_param = {n: True for n in params}
        self._is_param.update({n: False for n in buffers})
        tensors = {**params, **buffers}
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        self._scalar_index = torch.zeros(1, dtype=torch.long, device=device)

        # One throwaway structure per subnetwork names every tensor it holds.
        skeletons = [self._skeleton(s) for s in range(S)]
        local: Dict[str, List[Optional[str]]] = {n: [None] * S for n in tensors}
        for s, (_, slots) in enumerate(skeletons):
            for local_name, global_name, _, _ in slots:
                local[global_name][s] = local_name
        specs = []
        for name, t in tensors.items():
            if name in partitioned:
                dim, owned = partitioned[name]
                owned = tuple(None if i is None else i.to(device) for i in owned)
                shared = False
            else:
                dim = 0
                full = self._scalar_index if t.dim() == 0 else torch.arange(t.shape[0], device=device)
                owned = (full,) * S
                shared = True
            for s in range(S):
                if (owned[s] is None) != (local[name][s] is None):
                    raise RuntimeError(f"{self.who}: internal error: subnetwork {s} structure and "
                                       f"ownership of {name} disagree")
            specs.append(_Spec(name, dim, owned, tuple(local[name]), shared))
        self._specs: Tuple[_Spec, ...] = tuple(specs)
        self._is_scalar = [tensors[t.name].dim() == 0 for t in specs]
        self._spec_of = {t.name: i for i, t in enumerate(specs)}
        empty = torch.empty(0, dtype=torch.long, device=device)
        self.slices = SlicePlan(S, tuple(
            TensorSlices(t.name, None) if t.shared else
            TensorSlices(t.name, t.dim, tuple(empty if i is None else i for i in t.owned))
            for t in specs))
        self.local_names: Dict[str, Tuple[Optional[str], ...]] = {t.name: t.local_names for t in specs}
        # Index tables of the gather (segment order: subnetwork, then its tensors in module order).
        self._segments = [[self._spec_of[g] for _, g, _, _ in slots] for _, slots in skeletons]

    # -- description (the plain data of ``slices``, a SlicePlan) -------------------------------
    @property
    def tensors(self) -> Tuple[TensorSlices, ...]:
        return self.slices.tensors

    @property
    def partitioned(self) -> Tuple[TensorSlices, ...]:
        return self.slices.partitioned

    @property
    def shared(self) -> Tuple[TensorSlices, ...]:
        return self.slices.shared

    def owned(self, s: int) -> List[Tuple[str, Optional[int], Optional[Tensor]]]:
        """``(name, dim, indices)`` of every tensor subnetwork ``s`` holds; ``dim`` and
        ``indices`` are ``None`` for a shared tensor (held whole)."""
        return [(t.name, None, None) if t.shared else (t.name, t.dim, t.owned[s])
                for t in self._specs if t.owned[s] is not None]

    # -- structure ----------------------------------------------------------------------------
    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        raise NotImplementedError

    def _skeleton(self, s: int):
        glob: Dict[str, nn.Module] = {}
        root = _clone_structure(self.model, "", glob)
        self._edit(s, glob, root)
        global_name = {id(m): n for n, m in glob.items()}
        originals = dict(self.model.named_modules())
        slots = []
        for local_prefix, m in root.named_modules():
            g = global_name[id(m)]
            orig = originals[g]
            for attr_dict, is_param in ((orig._parameters, True), (orig._buffers, False)):
                for attr, v in attr_dict.items():
                    if v is None:
                        continue
                    pre = f"{local_prefix}." if local_prefix else ""
                    gpre = f"{g}." if g else ""
                    slots.append((pre + attr, gpre + attr, m, (attr, is_param)))
        return root, slots

    def _sources(self) -> List[Tensor]:
        """The global tensors as the gather / scatter see them (detached; 0-dim as 1-element)."""
        named = dict(self.model.named_parameters())
        named.update(self.model.named_buffers())
        out = []
        for spec in self._specs:
            t = named.get(spec.name)
            if t is None:
                raise RuntimeError(f"{self.who}: the model no longer has tensor {spec.name}")
            t = t.detach()
            out.append(t.view(1) if t.dim() == 0 else t)
        return out

    # -- build ----------------------------------------------------------------------------------
    def build(self, optimizer: Optional[torch.optim.Optimizer] = None) -> List[Subnetwork]:
        """Standalone subnetworks holding their slices of the global model's parameters and
        buffers (and of ``optimizer``'s state): one slice gather for all of them."""
        S = self.num_subnetworks
        skeletons = [self._skeleton(s) for s in range(S)]
        sources = self._sources()
        dims = [t.dim for t in self._specs]
        source_ids: List[int] = []
        indices: List[Tensor] = []
        for s in range(S):
            for i in self._segments[s]:
                source_ids.append(i)
                indices.append(self._specs[i].owned[s])
        # Optimizer state rides in the same gather: sources appended after the model's tensors.
        state_segments = []  # (s, slot position, key, scalar)
        group_of: Dict[int, int] = {}
        if optimizer is not None:
            named_params = dict(self.model.named_parameters())
            for gi, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    group_of[id(p)] = gi
            state_source: Dict[Tuple[int, str], int] = {}
            for s in range(S):
                for k, i in enumerate(self._segments[s]):
                    spec = self._specs[i]
                    if not self._is_param[spec.name]:
                        continue
                    p = named_params[spec.name]
                    for key, v in optimizer.state.get(p, {}).items():
                        if not isinstance(v, Tensor):
                            continue
                        scalar = v.dim() == 0
                        if not scalar and v.shape != p.shape:
                            raise ValueError(
                                f"{self.who}: optimizer state {key!r} of {spec.name} has shape "
                                f"{tuple(v.shape)}; only the parameter's shape or 0-dim can be sliced")
                        sid = state_source.get((i, key))
                        if sid is None:
                            sid = state_source[(i, key)] = len(sources)
                            sources.append(v.detach().view(1) if scalar else v.detach())
                            dims.append(0 if scalar else spec.dim)
                        source_ids.append(sid)
                        indices.append(self._scalar_index if scalar else spec.owned[s])
                        state_segments.append((s, k, key, scalar))
        segments = F.gather_slices(sources, source_ids, indices, dims)

        subnetworks = []
        j = 0
        slot_tensors: List[List[Tensor]] = []
        requires_grad = {n: p.requires_grad for n, p in self.model.named_parameters()}
        for s, (root, slots) in enumerate(skeletons):
            attached = []
            for k, (_, gname, m, (attr, is_param)) in enumerate(slots):
                seg = segments[j]
                j += 1
                if self._is_scalar[self._segments[s][k]]:
                    seg = seg.view(())
                if is_param:
                    t = nn.Parameter(seg, requires_grad=requires_grad[gname])
                    m._parameters[attr] = t
                else:
                    t = seg
                    m._buffers[attr] = t
                attached.append(t)
            slot_tensors.append(attached)
            subnetworks.append(Subnetwork(s, root, None, self))

        if optimizer is not None:
            named_params = dict(self.model.named_parameters())
            for s, sub in enumerate(subnetworks):
                groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []}
                          for g in optimizer.param_groups]
                for k, i in enumerate(self._segments[s]):
                    spec = self._specs[i]
                    if self._is_param[spec.name]:
                        gi = group_of.get(id(named_params[spec.name]))
                        if gi is not None:
                            groups[gi]["params"].append(slot_tensors[s][k])
                groups = [g for g in groups if g["params"]]
                sub.optimizer = type(optimizer)(groups)
                # Non-tensor state values (rare) are copied as they are.
                for k, i in enumerate(self._segments[s]):
                    spec = self._specs[i]
                    if self._is_param[spec.name]:
                        st = optimizer.state.get(named_params[spec.name])
                        if st:
                            sub.optimizer.state[slot_tensors[s][k]] = {
                                key: copy.copy(v) for key, v in st.items() if not isinstance(v, Tensor)}
            for (s, k, key, scalar) in state_segments:
                seg = segments[j]
                j += 1
                sub = subnetworks[s]
                sub.optimizer.state[slot_tensors[s][k]][key] = seg.view(()) if scalar else seg
        self._slot_info = [[(m, attr, is_param) for (_, _, m, (attr, is_param)) in slots]
                           for _, slots in skeletons]
        self._built = {id(sub.module): sub for sub in subnetworks}
        return subnetworks

    # -- aggregate ------------------------------------------------------------------------------
    def aggregate(self, subnetworks: Sequence[Subnetwork],
                  optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Write the subnetworks back into the global model with one slice scatter: a slice owned
        by one subnetwork is copied, by several averaged over its owners, shared tensors
        (BN running statistics included) averaged over all given subnetworks; slices no given
        subnetwork owns keep their value. With ``optimizer`` (the global optimizer the subnetworks
        were built with) its state is aggregated the same way from the subnetworks' optimizers."""
        seen = set()
        for sub in subnetworks:
            if not isinstance(sub, Subnetwork) or sub.plan is not self or id(sub.module) not in getattr(self, "_built", {}):
                raise ValueError(f"{self.who}.aggregate: expected Subnetwork objects built by this "
                                 f"plan's build(), got {type(sub).__name__}")
            if sub.index in seen:
                raise ValueError(f"{self.who}.aggregate: subnetwork {sub.index} given twice")
            seen.add(sub.index)
        targets = self._sources()
        dims = [t.dim for t in self._specs]
        target_ids: List[int] = []
        updates: List[Tensor] = []
        indices: List[Tensor] = []
        named_params = dict(self.model.named_parameters()) if optimizer is not None else None
        state_target: Dict[Tuple[int, str], int] = {}
        for sub in subnetworks:
            s = sub.index
            for k, i in enumerate(self._segments[s]):
                spec = self._specs[i]
                m, attr, is_param = self._slot_info[s][k]
                t = (m._parameters if is_param else m._buffers).get(attr)
                want = self._expected_shape(targets[i], spec.dim, spec.owned[s])
                u = None if t is None else t.detach()
                if u is not None and u.dim() == 0:
                    u = u.view(1)
                if u is None or tuple(u.shape) != want:
                    raise ValueError(
                        f"{self.who}.aggregate: subnetwork {s} tensor {spec.local_names[s]} has "
                        f"shape {None if u is None else tuple(u.shape)}, expected {want}")
                target_ids.append(i)
                updates.append(u.contiguous())
                indices.append(spec.owned[s])
                if optimizer is None or sub.optimizer is None or not is_param:
                    continue
                p = named_params[spec.name]
                for key, v in sub.optimizer.state.get(t, {}).items():
                    gstate = optimizer.state[p]
                    if not isinstance(v, Tensor):
                        gstate.setdefault(key, copy.copy(v))
                        continue
                    scalar = v.dim() == 0
                    tid = state_target.get((i, key))
                    if tid is None:
                        g = gstate.get(key)
                        if g is None:  # first round: the global optimizer has no state yet
                            g = gstate[key] = torch.zeros_like(v if scalar else p.detach())
                        tid = state_target[(i, key)] = len(targets)
                        targets.append(g.view(1) if scalar else g)
                        dims.append(0 if scalar else spec.dim)
                    target_ids.append(tid)
                    updates.append((v.detach().view(1) if scalar else v.detach()).contiguous())
                    indices.append(self._scalar_index if scalar else spec.owned[s])
        F.slice_scatter_(targets, target_ids, updates, indices, dims, reduce="mean")
        self._after_aggregate()

    def _after_aggregate(self) -> None:
        pass

    @staticmethod
    def _expected_shape(target: Tensor, dim: int, idx: Tensor) -> Tuple[int, ...]:
        shape = list(target.shape)
        shape[dim] = idx.numel()
        return tuple(shape)
