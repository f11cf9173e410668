"""Subnetwork plans for CNNs: which slice of every tensor each subnetwork owns, real standalone
subnetworks built from the global model with one slice gather, and aggregation back with one slice
scatter (mean over owners; unowned slices keep their value).

``plan.slices`` is the round as plain data (a :class:`SlicePlan`): for every parameter and buffer
of the global model (state_dict key), the dim it is partitioned along and per subnetwork the
indices it owns (empty: the subnetwork does not hold the tensor), or ``dim=None`` for a tensor
shared whole by all. A 0-dim tensor (``num_batches_tracked`` of a ResIST block) is partitioned
along dim 0 with owners ``[0]`` or empty.

Tied tensors (one tensor held by several modules: GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) are one plan tensor, named by the first place in module order (as
``named_parameters()`` names it; ``plan.aliases`` maps the other names to it): it is shared unless
that first name is partitioned, every subnetwork attaches one tensor object to all the places that
held it (the clone stays tied: its optimizer sees one parameter) and aggregation writes it once.

Optimizer state follows its parameter: a state tensor of the parameter's shape (SGD momentum, Adam
moments) is sliced like it, a 0-dim one (Adam step) is held whole by the parameter's owners. The
distributed exchange derives pack/unpack from this.
"""
import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .. import functional as F
from .aggregate import aggregate_slices_
from .plan import RoundPlan, SlicePlan, TensorSlices


def _off_device(state: Tensor, param: Tensor) -> bool:
    """A 0-dim optimizer state kept on another device than its parameter (torch's Adam keeps
    `step` on the CPU unless capturable/fused): it cannot ride the parameter's one-launch gather or
    scatter, so it is copied into subnetworks and averaged over owners in Python (a few scalars)."""
    return state.dim() == 0 and state.device != param.device


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
    # the cloned module tree (element 0 is ``module``), by position in the plan's _Tree
    parts: Optional[List[nn.Module]] = field(default=None, repr=False)


class _Tree:
    """The global model's module tree flattened once per plan (depth-first, shared modules once),
    so that a subnetwork's structure is cloned without walking names: a clone shares no container
    with the global model and holds no tensors until they are attached."""

    def __init__(self, model: nn.Module):
        self.modules: List[nn.Module] = []
        self.names: List[str] = []
        pos: Dict[int, int] = {}
        stack = [("", model)]
        while stack:
            name, m = stack.pop()
            if id(m) in pos:
                continue
            pos[id(m)] = len(self.modules)
            self.modules.append(m)
            self.names.append(name)
            kids = [(f"{name}.{k}" if name else k, c) for k, c in m._modules.items() if c is not None]
            stack.extend(reversed(kids))
        self.pos_of_name = {n: i for i, n in enumerate(self.names)}
        self.children = [[(k, None if c is None else pos[id(c)]) for k, c in m._modules.items()]
                         for m in self.modules]
        self.containers = [
            tuple(k for k, v in m.__dict__.items()
                  if isinstance(v, (dict, list, set)) and k not in ("_parameters", "_buffers", "_modules"))
            for m in self.modules]

    def clone(self) -> List[nn.Module]:
        clones = []
        for m, keys in zip(self.modules, self.containers):
            new = type(m).__new__(type(m))
            d = m.__dict__.copy()
            for k in keys:
                d[k] = d[k].copy()
            d["_parameters"] = dict.fromkeys(m._parameters)
            # non-persistent buffers (e.g. rotary embeddings' inv_freq: not in the state dict, never
            # exchanged) are constants of the structure: every clone shares the global model's
            d["_buffers"] = {k: (v if k in m._non_persistent_buffers_set else None) for k, v in m._buffers.items()}
            new.__dict__ = d
            clones.append(new)
        for new, kids in zip(clones, self.children):
            new.__dict__["_modules"] = {k: (None if j is None else clones[j]) for k, j in kids}
        return clones


def _put(module: nn.Module, attr: str, is_param: bool, t: Tensor, requires_grad: bool) -> Tensor:
    """``t`` as ``module``'s parameter (wrapped, sharing its storage) or buffer ``attr``; returns what
    the module now holds."""
    if is_param:
        t = nn.Parameter(t, requires_grad=requires_grad)
        module._parameters[attr] = t
    else:
        module._buffers[attr] = t
    return t


class SubnetworkPlan(RoundPlan):
    """Base of the CNN plans. Subclasses pass ``partitioned`` (name -> (dim, owned indices per
    subnetwork, None where not held)) and override ``_edit`` to shape subnetwork ``s``'s cloned
    structure (narrower convs, fewer blocks)."""

    who = "plan"

    def __init__(self, model: nn.Module, num_subnetworks: int,
                 partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]]):
        self.model = model
        self.num_subnetworks = S = num_subnetworks
        self._tree = tree = _Tree(model)
        # Where each global tensor lives: (module position, attribute, is parameter), by its first
        # name in module order; a tensor met again (tied weights) is that one tensor: its other
        # names are aliases of the first.
        where: Dict[str, Tuple[int, str, bool]] = {}
        first: Dict[int, str] = {}  # id(tensor) -> its plan name
        aliases: Dict[str, str] = {}
        for i, (m, mname) in enumerate(zip(tree.modules, tree.names)):
            for attrs, is_param in ((m._parameters, True), (m._buffers, False)):
                for attr, v in attrs.items():
                    if v is None or (not is_param and attr in m._non_persistent_buffers_set):
                        continue  # a non-persistent buffer (a constant of the structure): shared by reference
                    name = f"{mname}.{attr}" if mname else attr
                    if name in where or name in aliases:
                        continue
                    owner = first.setdefault(id(v), name)
                    if owner == name:
                        where[name] = (i, attr, is_param)
                    else:
                        aliases[name] = owner
        #: tied tensors: every other name of a tensor -> its plan name (the first in module order)
        self.aliases: Dict[str, str] = aliases
        self._check_tied(partitioned)
        tensors = {n: getattr(tree.modules[i], "_parameters" if p else "_buffers")[a]
                   for n, (i, a, p) in where.items()}
        device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
        if device.type == "meta":  # a structure-only model (decentralized storage): indices on the CPU
            device = torch.device("cpu")
        self._scalar_index = torch.zeros(1, dtype=torch.long, device=device)

        # Each subnetwork's structure names the tensors it holds; the first build() uses it.
        skeletons = [self._skeleton(s) for s in range(S)]
        self._unused_skeletons = skeletons
        # per subnetwork: (local name, plan name, module position, attr, is_param), one per tensor
        # (its first place in the clone), and the other places of tied tensors: (slot, local name,
        # module position, attr, is_param), where build / attach put the same tensor object
        slot_lists, tie_lists = [], []
        for s, clones in enumerate(skeletons):
            back = {id(c): i for i, c in enumerate(clones)}
            slots, ties, slot_of = [], [], {}
            for local_prefix, c in clones[0].named_modules():
                i = back[id(c)]
                gname = tree.names[i]
                gm = tree.modules[i]
                for attrs, is_param in ((gm._parameters, True), (gm._buffers, False)):
                    for attr, v in attrs.items():
                        if v is None or (not is_param and attr in gm._non_persistent_buffers_set):
                            continue
                        local_name = f"{local_prefix}.{attr}" if local_prefix else attr
                        full = f"{gname}.{attr}" if gname else attr
                        pname = aliases.get(full, full)
                        if pname in slot_of:
                            ties.append((slot_of[pname], local_name, i, attr, is_param))
                        else:
                            slot_of[pname] = len(slots)
                            slots.append((local_name, pname, i, attr, is_param))
            slot_lists.append(slots)
            tie_lists.append(ties)
        local: Dict[str, List[Optional[str]]] = {n: [None] * S for n in tensors}
        for s, slots in enumerate(slot_lists):
            for local_name, gname, _, _, _ in slots:
                local[gname][s] = local_name
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
                    tied = sorted(a for a, n in aliases.items() if n == name)
                    if tied:
                        raise ValueError(f"{self.who}: {name} is tied to {', '.join(tied)} (one tensor): subnetwork "
                                         f"{s} {'holds' if owned[s] is None else 'lacks'} a module holding it "
                                         f"but {'does not own' if owned[s] is None else 'owns'} it")
                    raise RuntimeError(f"{self.who}: internal error: subnetwork {s} structure and "
                                       f"ownership of {name} disagree")
            specs.append(_Spec(name, dim, owned, tuple(local[name]), shared))
        self._specs: Tuple[_Spec, ...] = tuple(specs)
        self._spec_of = {t.name: i for i, t in enumerate(specs)}
        self._where = [where[t.name] for t in specs]
        self._is_scalar = [tensors[t.name].dim() == 0 for t in specs]
        self._dims = [t.dim for t in specs]
        empty = torch.empty(0, dtype=torch.long, device=device)
        self.slices = SlicePlan(S, tuple(
            TensorSlices(t.name, None) if t.shared else
            TensorSlices(t.name, t.dim, tuple(empty if i is None else i for i in t.owned))
            for t in specs))
        self.local_names: Dict[str, Tuple[Optional[str], ...]] = {t.name: t.local_names for t in specs}
        # Index tables, once per plan. Segment order: subnetwork, then its tensors in module order.
        # _slots[s][k] = (spec index, module position in the clone, attr, is_param)
        self._slots = [[(self._spec_of[g], i, attr, is_param) for _, g, i, attr, is_param in slots]
                       for slots in slot_lists]
        # _ties[s] = (slot k in _slots[s], local name, module position, attr, is_param): another place
        # of that slot's tensor in subnetwork s's clone (tied weights)
        self._ties = tie_lists
        self._source_ids = [k for s in range(S) for (k, _, _, _) in self._slots[s]]
        self._indices = [specs[k].owned[s] for s in range(S) for (k, _, _, _) in self._slots[s]]
        # Flat gather buffers kept across build() calls (one per dtype, two while the previous
        # build's subnetworks are still alive): a buffer is reused only once no tensor of an earlier
        # build views it, so live subnetworks are never overwritten. release_buffers() drops them.
        self._buffers = F.GatherBuffers(capacity=2)

    def _check_tied(self, partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]]) -> None:
        """A tied tensor is partitioned by its plan name (the first); another name of it may be
        given only with the same division."""
        for alias, name in self.aliases.items():
            if alias not in partitioned:
                continue
            if name not in partitioned:
                raise ValueError(f"{self.who}: {alias} is tied to {name} (one tensor): it is partitioned by its "
                                 f"first name {name}, which is not partitioned")
            (da, oa), (dn, on) = partitioned[alias], partitioned[name]
            if da != dn or len(oa) != len(on) or any(
                    (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b.cpu()))
                    for a, b in zip(oa, on)):
                raise ValueError(f"{self.who}: {alias} is tied to {name} (one tensor) but partitioned differently")

    def _tie(self, s: int, clones: List[nn.Module], held: Sequence[Tensor]) -> None:
        """Put subnetwork ``s``'s tensor of slot k (``held[k]``) at the other places that held it."""
        for k, _, pos, attr, is_param in self._ties[s]:
            (clones[pos]._parameters if is_param else clones[pos]._buffers)[attr] = held[k]

    def release_buffers(self) -> None:
        """Drop the gather buffers this plan keeps for its next build() (memory of about two
        builds' subnetworks); subnetworks already built keep theirs."""
        self._buffers.clear()

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

    def _skeleton(self, s: int) -> List[nn.Module]:
        """Subnetwork ``s``'s module tree without tensors; element 0 is the root."""
        clones = self._tree.clone()
        glob = {n: clones[i] for n, i in self._tree.pos_of_name.items()}
        self._edit(s, glob, clones[0])
        return clones

    def _global(self) -> List[Tensor]:
        """The global tensors as the gather / scatter see them (detached; 0-dim as 1-element)."""
        out = []
        mods = self._tree.modules
        for (i, attr, is_param), scalar, spec in zip(self._where, self._is_scalar, self._specs):
            t = (mods[i]._parameters if is_param else mods[i]._buffers).get(attr)
            if t is None:
                raise RuntimeError(f"{self.who}: the model no longer has tensor {spec.name}")
            t = t.detach()
            out.append(t.view(1) if scalar else t)
        return out

    # -- build ----------------------------------------------------------------------------------
    def build(self, optimizer: Optional[torch.optim.Optimizer] = None) -> List[Subnetwork]:
        """Standalone subnetworks holding their slices of the global model's parameters and
        buffers (and, with the global ``optimizer``, optimizers of its class and hyperparameters
        holding the slices of its state): one slice gather for all of them."""
        S = self.num_subnetworks
        skeletons, self._unused_skeletons = self._unused_skeletons, None
        skeletons = [sk if sk is not None else self._skeleton(s)
                     for s, sk in enumerate(skeletons or [None] * S)]
        sources = self._global()
        dims = self._dims
        source_ids = self._source_ids
        indices = self._indices
        params = self._params() if optimizer is not None else None
        state_segments = []  # (s, k, key, scalar): optimizer state rides in the same gather
        if optimizer is not None:
            dims, source_ids, indices = list(dims), list(source_ids), list(indices)
            state_source: Dict[Tuple[int, str], int] = {}
            for s in range(S):
                for k, (i, _, _, is_param) in enumerate(self._slots[s]):
                    if not is_param:
                        continue
                    p = params[i]
                    for key, v in optimizer.state.get(p, {}).items():
                        if not isinstance(v, Tensor):
                            continue
                        scalar = v.dim() == 0
                        if _off_device(v, p):  # e.g. Adam's CPU `step`: copied, not gathered
                            continue
                        if not scalar and v.shape != p.shape:
                            raise ValueError(
                                f"{self.who}: optimizer state {key!r} of {self._specs[i].name} has "
                                f"shape {tuple(v.shape)}; only the parameter's shape or 0-dim can be sliced")
                        sid = state_source.get((i, key))
                        if sid is None:
                            sid = state_source[(i, key)] = len(sources)
                            sources.append(v.detach().view(1) if scalar else v.detach())
                            dims.append(0 if scalar else self._dims[i])
                        source_ids.append(sid)
                        indices.append(self._scalar_index if scalar else self._specs[i].owned[s])
                        state_segments.append((s, k, key, scalar))
        segments = F.gather_slices(sources, source_ids, indices, dims, out=self._buffers)

        subnetworks = []
        attached: List[List[Tensor]] = []
        j = 0
        requires_grad = self._requires_grad()
        for s, clones in enumerate(skeletons):
            held = []
            for (i, pos, attr, is_param) in self._slots[s]:
                seg = segments[j]
                j += 1
                if self._is_scalar[i]:
                    seg = seg.view(())
                held.append(_put(clones[pos], attr, is_param, seg, requires_grad[i]))
            self._tie(s, clones, held)
            attached.append(held)
            subnetworks.append(Subnetwork(s, clones[0], None, self, clones))

        if optimizer is not None:
            group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
            for s, sub in enumerate(subnetworks):
                groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                          for g in optimizer.param_groups]
                for k, (i, _, _, is_param) in enumerate(self._slots[s]):
                    gi = group_of.get(id(params[i])) if is_param else None
                    if gi is not None:
                        groups[gi]["params"].append(attached[s][k])
                sub.optimizer = type(optimizer)([g for g in groups if g["params"]])
                for k, (i, _, _, is_param) in enumerate(self._slots[s]):
                    st = optimizer.state.get(params[i]) if is_param else None
                    if st:  # non-tensor values and off-device scalars are copied; tensors come from the gather
                        sub.optimizer.state[attached[s][k]] = {
                            key: (v.clone() if isinstance(v, Tensor) else copy.copy(v)) for key, v in st.items()
                            if not isinstance(v, Tensor) or _off_device(v, params[i])}
            for (s, k, key, scalar) in state_segments:
                seg = segments[j]
                j += 1
                subnetworks[s].optimizer.state[attached[s][k]][key] = seg.view(()) if scalar else seg
        return subnetworks

    # -- decentralized storage: one subnetwork from its own compact tensors -------------------------
    def model_tensors(self) -> Dict[str, Tensor]:
        """The global model's parameters and buffers by plan name (detached; 0-dim stay 0-dim)."""
        return {t.name: (g.view(()) if scalar else g)
                for t, g, scalar in zip(self._specs, self._global(), self._is_scalar)}

    def part(self, s: int) -> Dict[str, Tensor]:
        """Subnetwork ``s``'s compact tensors cut from the global model (plan name -> new tensor):
        what a rank holds under decentralized storage (``slices.part``)."""
        return self.slices.part(self.model_tensors(), s)

    def attach(self, s: int, tensors: Dict[str, Tensor]) -> Subnetwork:
        """Subnetwork ``s`` built around ``tensors`` (plan name -> its compact tensor, as
        :meth:`part` or an ``Exchange`` returns them): no copy, the module's parameters and buffers
        are these tensors. The global model may be a structure on the meta device."""
        sk = self._unused_skeletons
        clones = sk[s] if sk is not None and sk[s] is not None else self._skeleton(s)
        if sk is not None:
            sk[s] = None
        requires_grad = self._requires_grad()
        held = []
        for (i, pos, attr, is_param) in self._slots[s]:
            spec = self._specs[i]
            t = tensors.get(spec.name)
            want = [] if self._is_scalar[i] else list(self._shape(i))
            if want:
                want[spec.dim] = spec.owned[s].numel()
            if t is None or tuple(t.shape) != tuple(want):
                raise ValueError(f"{self.who}.attach: subnetwork {s} needs {spec.name} of shape {tuple(want)}, "
                                 f"got {None if t is None else tuple(t.shape)}")
            held.append(_put(clones[pos], attr, is_param, t, requires_grad[i]))
        self._tie(s, clones, held)
        return Subnetwork(s, clones[0], None, self, clones)

    def tensors_of(self, sub: Subnetwork, detach: bool = True) -> Dict[str, Tensor]:
        """Plan name -> subnetwork ``sub``'s parameter or buffer (detached by default, sharing
        storage: the ``local`` of an ``Exchange``)."""
        out = {}
        for (i, pos, attr, is_param) in self._slots[sub.index]:
            t = (sub.parts[pos]._parameters if is_param else sub.parts[pos]._buffers)[attr]
            out[self._specs[i].name] = t.detach() if detach else t
        return out

    def _shape(self, i: int) -> Tuple[int, ...]:
        mi, attr, is_param = self._where[i]
        m = self._tree.modules[mi]
        return tuple((m._parameters if is_param else m._buffers)[attr].shape)

    def _params(self) -> List[Optional[Tensor]]:
        mods = self._tree.modules
        return [mods[i]._parameters[a] if p else None for (i, a, p) in self._where]

    def _requires_grad(self) -> List[bool]:
        return [p is not None and p.requires_grad for p in self._params()]

    # -- aggregate ------------------------------------------------------------------------------
    def aggregate(self, subnetworks: Sequence[Subnetwork],
                  optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        """Write the subnetworks back into the global model with one slice scatter
        (:func:`.aggregate.aggregate_slices_`): a slice owned by one subnetwork is copied, by
        several averaged over its owners, shared tensors (BN running statistics included) averaged
        over all given subnetworks; integer counters (BN ``num_batches_tracked``) take the owners'
        maximum, never a truncated mean; slices no given subnetwork owns keep their value. With ``optimizer`` (the global optimizer the subnetworks
        were built with) its state is aggregated the same way from the subnetworks' optimizers.
        Everything is checked before anything is written."""
        seen = set()
        for sub in subnetworks:
            if not isinstance(sub, Subnetwork) or sub.plan is not self or not sub.parts or \
                    sub.parts[0] is not sub.module or len(sub.parts) != len(self._tree.modules):
                raise ValueError(f"{self.who}.aggregate: expected Subnetwork objects built by this "
                                 f"plan's build(), got {type(sub).__name__}")
            if sub.index in seen:
                raise ValueError(f"{self.who}.aggregate: subnetwork {sub.index} given twice")
            seen.add(sub.index)
            for k, local_name, pos, attr, is_param in self._ties[sub.index]:
                i, p0, a0, ip0 = self._slots[sub.index][k]
                t0 = (sub.parts[p0]._parameters if ip0 else sub.parts[p0]._buffers).get(a0)
                t1 = (sub.parts[pos]._parameters if is_param else sub.parts[pos]._buffers).get(attr)
                if t1 is not t0:
                    raise ValueError(f"{self.who}.aggregate: subnetwork {sub.index}'s {local_name} is no longer "
                                     f"{self._specs[i].local_names[sub.index]} (tied in the model: one tensor)")
        # Owners reduced in ascending subnetwork order, as the distributed exchange does.
        subnetworks = sorted(subnetworks, key=lambda sub: sub.index)
        targets = self._global()
        dims = list(self._dims)
        target_ids: List[int] = []
        updates: List[Tensor] = []
        indices: List[Tensor] = []
        params = self._params() if optimizer is not None else None
        state_target: Dict[Tuple[int, str], int] = {}
        new_state = []  # (param, key, zeros) created only once every check has passed
        other_state = []  # (param, key, value): non-tensor state (rare), from the first holder
        off_device = {}  # (param index, key) -> (param, [owners' values]): scalars not on the param's device
        for sub in subnetworks:
            s = sub.index
            clones = sub.parts
            for (i, pos, attr, is_param) in self._slots[s]:
                spec = self._specs[i]
                t = (clones[pos]._parameters if is_param else clones[pos]._buffers).get(attr)
                u = None if t is None else t.detach()
                if u is not None and u.dim() == 0:
                    u = u.view(1)
                owned = spec.owned[s]
                if u is None or u.shape[spec.dim] != owned.numel() or u.dim() != targets[i].dim() or \
                        any(a != b for d, (a, b) in enumerate(zip(u.shape, targets[i].shape)) if d != spec.dim):
                    raise ValueError(
                        f"{self.who}.aggregate: subnetwork {s} tensor {spec.local_names[s]} has "
                        f"shape {None if u is None else tuple(u.shape)}, expected "
                        f"{self._expected_shape(targets[i], spec.dim, owned)}")
                target_ids.append(i)
                updates.append(u if u.is_contiguous() else u.contiguous())
                indices.append(owned)
                if optimizer is None or sub.optimizer is None or not is_param:
                    continue
                p = params[i]
                for key, v in sub.optimizer.state.get(t, {}).items():
                    if not isinstance(v, Tensor):
                        other_state.append((p, key, v))
                        continue
                    if _off_device(v, p):
                        off_device.setdefault((i, key), (p, []))[1].append(v.detach())
                        continue
                    scalar = v.dim() == 0
                    tid = state_target.get((i, key))
                    if tid is None:
                        g = optimizer.state.get(p, {}).get(key)
                        if g is None:  # first round: the global optimizer has no state yet
                            g = torch.zeros_like(v if scalar else p.detach())
                            new_state.append((p, key, g))
                        tid = state_target[(i, key)] = len(targets)
                        targets.append(g.view(1) if scalar else g)
                        dims.append(0 if scalar else spec.dim)
                    idx = self._scalar_index if scalar else owned
                    v = v.detach().view(1) if scalar else v.detach()
                    if tuple(v.shape) != self._expected_shape(targets[tid], dims[tid], idx):
                        raise ValueError(f"{self.who}.aggregate: subnetwork {s} optimizer state {key!r} "
                                         f"of {spec.local_names[s]} has shape {tuple(v.shape)}")
                    target_ids.append(tid)
                    updates.append(v if v.is_contiguous() else v.contiguous())
                    indices.append(idx)
        for p, key, g in new_state:
            optimizer.state[p][key] = g
        aggregate_slices_(targets, target_ids, updates, indices, dims)
        for (_, key), (p, vals) in off_device.items():  # the owners' mean; the value itself when all agree
            same = all(torch.equal(vals[0], u) for u in vals[1:])
            mean = vals[0] if same else torch.stack(vals).double().mean(0).to(vals[0].dtype)
            if optimizer.state[p].get(key) is None:
                optimizer.state[p][key] = mean.clone()
            else:
                optimizer.state[p][key].copy_(mean)
        for p, key, v in other_state:
            optimizer.state[p].setdefault(key, copy.copy(v))
        self.after_aggregate()

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        """What the full model (default: the plan's) needs once aggregated (e.g. ResIST's residual scales)."""

    @staticmethod
    def _expected_shape(target: Tensor, dim: int, idx: Tensor) -> Tuple[int, ...]:
        shape = list(target.shape)
        shape[dim] = idx.numel()
        return tuple(shape)
