"""Partitions of any transformer or MLP into subnetworks, found from the model's structure
(:mod:`.structure`: FFN pairs, attention heads, residual layers; or the user's ``spec``), with the
same slice plans, gather/scatter and exchange as the CNN partitions. The model's class is never
edited: the full model's scales are hooks that leave ``state_dict()`` as it was.

- IST (:func:`transformer_ist_plan`): every FFN's hidden units (``partition=ffn``: rows of its
  input projections and their biases, columns of its output projection) and/or every attention's
  heads (``partition=heads``: each head's ``head_dim`` rows of q, k and v, its columns of o; with
  grouped-query attention a key/value head goes with its group of query heads) are permuted at
  random and cut into S disjoint groups (FFN units: sizes differing by at most one; heads: S must
  divide the key/value heads), as IST cuts an MLP's neurons. Everything else (embeddings, norms, the
  output projections' biases) is shared and averaged, but for a norm between an FFN's projections
  (``FFN.norms``: its vectors go with the units, a subnetwork normalizes over its own units; see
  :mod:`.structure`). A subnetwork computes its branch from its own units; the full model scales
  the input of every partitioned output projection by 1/S (a forward pre-hook; the projection's
  bias is not scaled; an ``nn.MultiheadAttention``, whose forward reads ``out_proj``'s weight
  itself: a forward hook scaling its heads' sum, :class:`.mha.AttentionScale`), so each branch is
  exactly the mean of the subnetworks' branches (paper 001 §4's ξ scaling of a masked network's
  hidden outputs, ξ = 1/S; with a norm between the projections, close to it). A subnetwork's
  ``nn.MultiheadAttention`` is a :class:`.mha.HeadsMultiheadAttention` of its heads.
- ResIST (:func:`transformer_resist_plan`): the residual layers between the first and the last are
  dealt among the S subnetworks as ResIST deals a ResNet's third stage (paper 003 §2.2: a random
  permutation round-robin, then shared up to ``min_depth`` each); everything else is shared. A
  subnetwork skips (removes) the layers it does not own. The full model scales a partitioned layer
  by the expected fraction p of subnetworks owning it (§2.6; 1/S without sharing): a layer with a
  float attribute ``residual_scale`` (:class:`ist_kernels.models.GPT`'s blocks) gets it set, any
  other layer a forward hook ``h -> x + p (h - x)`` (``x`` the layer's input hidden states).

The hooks act only on the module they were registered on: a subnetwork's clone (which shares the
hook dicts) passes through unscaled, a ``copy.deepcopy`` of the full model keeps its scales.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .mha import AttentionScale, narrow_heads
from .resist import check_min_depth, deal_blocks
from .structure import (
    FFN,
    HEAD_COUNT_ATTRS,
    KV_COUNT_ATTRS,
    LOOKED_FOR_ATTENTION,
    LOOKED_FOR_FFN,
    LOOKED_FOR_LAYERS,
    SPEC_HINT,
    WIDTH_ATTRS,
    Attention,
    Structure,
    find_structure,
    in_dim,
    narrow,
    out_dim,
    projection,
)
from .subnetworks import SubnetworkPlan

#: what ``partition`` (the IST option) may name
PARTITIONS = ("ffn", "heads", "both")


def _check_S(S, who: str) -> None:
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"{who}: S (number of subnetworks) must be an int >= 1, got {S!r}")


# ---------------------------------------------------------------- the full model's scales (hooks)

class InputScale:
    """Forward pre-hook multiplying the input of ``owner`` (an output projection) by ``scale``; any
    other module calling it (a subnetwork's clone sharing the hook dict) passes through."""

    def __init__(self, owner: nn.Module, scale: float):
        self.owner = owner
        self.scale = scale

    def __call__(self, module, args, kwargs):
        if module is not self.owner or self.scale == 1.0:
            return None
        if args:
            return (args[0] * self.scale, *args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, Tensor)), None)
        if key is None:
            return None
        return args, {**kwargs, key: kwargs[key] * self.scale}


class ResidualScale:
    """Forward hook making ``owner`` (a residual layer, output ``h`` from input ``x``) compute
    ``x + scale * (h - x)``; ``x``: the first positional argument or the ``hidden_states`` keyword
    (else the first tensor keyword); ``h``: the output or, for a tuple, its first element. Any other
    module calling it (a subnetwork's clone) passes through."""

    def __init__(self, owner: nn.Module, scale: float):
        self.owner = owner
        self.scale = scale

    def __call__(self, module, args, kwargs, output):
        if module is not self.owner or self.scale == 1.0:
            return None
        if args and isinstance(args[0], Tensor):
            x = args[0]
        else:
            x = kwargs.get("hidden_states")
            if not isinstance(x, Tensor):
                x = next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        h = output if isinstance(output, Tensor) else output[0]
        if x is None or not isinstance(h, Tensor) or x.shape != h.shape:
            raise RuntimeError(f"ResIST residual scale on {type(module).__name__}: the layer's output "
                               f"{None if not isinstance(h, Tensor) else tuple(h.shape)} does not have its input's "
                               f"shape {None if x is None else tuple(x.shape)}")
        y = x + self.scale * (h - x)
        if isinstance(output, Tensor):
            return y
        if isinstance(output, list):
            return [y, *output[1:]]
        if hasattr(output, "keys"):  # a ModelOutput
            output[next(iter(output.keys()))] = y
            return output
        return (y, *output[1:])


def _hook(module: nn.Module, cls, hooks: Dict[int, Any]):
    return next((h for h in hooks.values() if isinstance(h, cls) and h.owner is module), None)


def set_input_scale(module: nn.Module, scale: float) -> None:
    """Scale ``module``'s input by ``scale`` (a forward pre-hook, registered once; 1.0 leaves it
    registered and idle); an ``nn.MultiheadAttention``: the input of its ``out_proj`` (a forward
    hook, :class:`.mha.AttentionScale`). Nothing is stored in the state dict."""
    if isinstance(module, nn.MultiheadAttention):
        h = _hook(module, AttentionScale, module._forward_hooks)
        if h is not None:
            h.scale = float(scale)
        elif scale != 1.0:
            module.register_forward_hook(AttentionScale(module, float(scale)))
        return
    h = _hook(module, InputScale, module._forward_pre_hooks)
    if h is not None:
        h.scale = float(scale)
    elif scale != 1.0:
        module.register_forward_pre_hook(InputScale(module, float(scale)), with_kwargs=True)


def set_residual_scale(layer: nn.Module, scale: float) -> None:
    """ResIST's full-model scale of a residual layer: its float ``residual_scale`` attribute where it
    has one (:class:`ist_kernels.models.GPT` blocks), else a forward hook ``h -> x + scale (h - x)``."""
    if isinstance(getattr(layer, "residual_scale", None), float):
        layer.residual_scale = float(scale)
        return
    h = _hook(layer, ResidualScale, layer._forward_hooks)
    if h is not None:
        h.scale = float(scale)
    elif scale != 1.0:
        layer.register_forward_hook(ResidualScale(layer, float(scale)), with_kwargs=True)


def input_scale(module: nn.Module) -> float:
    """The input scale :func:`set_input_scale` gave ``module`` (1.0 if none)."""
    if isinstance(module, nn.MultiheadAttention):
        h = _hook(module, AttentionScale, module._forward_hooks)
    else:
        h = _hook(module, InputScale, module._forward_pre_hooks)
    return 1.0 if h is None else h.scale


def residual_scale(layer: nn.Module) -> float:
    """ResIST's scale of a residual layer (its attribute, or its hook's; 1.0 if none)."""
    if isinstance(getattr(layer, "residual_scale", None), float):
        return layer.residual_scale
    h = _hook(layer, ResidualScale, layer._forward_hooks)
    return 1.0 if h is None else h.scale


# ---------------------------------------------------------------- what the trainer validates

def _need(found: bool, what: str, looked_for: str, model: nn.Module, who: str, extra: str = "",
          st: Optional[Structure] = None) -> None:
    if not found:
        seen = "" if st is None else "; found: " + "; ".join(st.describe().splitlines())
        raise ValueError(f"{who}: found no {what} in {type(model).__name__}{extra}: looked for {looked_for}"
                         f"{seen}; {SPEC_HINT}")


def is_transformer(model: nn.Module, spec=None) -> bool:
    """``model`` has readable attention heads, or residual layers each holding an FFN (a ResNet's
    stages do not): what ResIST deals as transformer layers rather than as a ResNet's blocks."""
    try:
        st = find_structure(model, spec)
    except ValueError:
        return False
    if st.attentions:
        return True
    if st.layers is None or not st.ffns:
        return False
    prefix = f"{st.layers}." if st.layers else ""
    owned = {_layer_of(f.out_proj, st.layers, st.num_layers) for f in st.ffns}
    return all(f"{prefix}{k}" in owned for k in model.get_submodule(st.layers)._modules)


def check_ist(model: nn.Module, S: int, partition: str = "ffn", spec=None,
              who: str = "transformer_ist_plan") -> Structure:
    """What :func:`transformer_ist_plan` would partition, checked against ``S`` (a ValueError saying
    what is missing or too small); the trainer calls this before launching."""
    _check_S(S, who)
    if partition not in PARTITIONS:
        raise ValueError(f"{who}: partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
    st = find_structure(model, spec)
    if partition in ("ffn", "both"):
        _need(bool(st.ffns), "FFN", LOOKED_FOR_FFN, model, who, f" (partition={partition})", st)
        for f in st.ffns:
            if S > f.hidden:
                raise ValueError(f"{who}: S={S} subnetworks but the FFN {f.name or f.out_proj} has only "
                                 f"{f.hidden} hidden units")
    if partition in ("heads", "both"):
        _need(bool(st.attentions), "attention", LOOKED_FOR_ATTENTION, model, who, f" (partition={partition})", st)
        for a in st.attentions:
            if a.num_kv_heads % S:
                kv = f" key/value heads ({a.num_heads} query heads)" if a.num_kv_heads != a.num_heads else " heads"
                raise ValueError(f"{who}: {a.name or a.o} has {a.num_kv_heads}{kv}, not divisible by S={S}")
    return st


def check_resist(model: nn.Module, S: int, min_depth: int = 1, spec=None,
                 who: str = "transformer_resist_plan") -> Structure:
    """What :func:`transformer_resist_plan` would deal (``num_layers - 2`` layers), checked against
    ``S`` and ``min_depth``; the trainer calls this before launching."""
    _check_S(S, who)
    check_min_depth(min_depth, who)
    st = find_structure(model, spec)
    _need(st.layers is not None, "residual layers", LOOKED_FOR_LAYERS, model, who, "", st)
    if st.num_layers < 3:
        raise ValueError(f"{who}: the first and last blocks are shared, so a transformer needs at least "
                         f"3 blocks to deal, got {st.num_layers} in {st.layers}")
    if min_depth > st.num_layers - 2:
        raise ValueError(f"{who}: min_depth={min_depth} is larger than the {st.num_layers - 2} partitioned blocks")
    return st


# ---------------------------------------------------------------- IST

def head_rows(heads: Tensor, num_heads: int, head_dim: int) -> Tuple[Tensor, Tensor]:
    """(rows of a fused ``[q | k | v]`` projection, columns of the output projection) of the heads
    ``heads`` (sorted), without grouped-query attention."""
    cols = _rows(heads, head_dim)
    rows = torch.cat([j * num_heads * head_dim + cols for j in range(3)])
    return rows, cols


def _rows(heads: Tensor, head_dim: int) -> Tensor:
    return (heads.view(-1, 1) * head_dim + torch.arange(head_dim)).flatten()


def narrow_norm(m: nn.Module, n: int) -> None:
    """Set a (cloned) norm of an FFN's hidden units to ``n`` units: a LayerNorm's / RMSNorm's
    ``normalized_shape``, a BatchNorm's ``num_features`` (any other module: its vectors' length)."""
    if isinstance(getattr(m, "normalized_shape", None), tuple):
        m.__dict__["normalized_shape"] = (n,)
    if isinstance(getattr(m, "num_features", None), int):
        m.__dict__["num_features"] = n


def _layer_of(name: str, layers: Optional[str], n: int) -> Optional[str]:
    if layers is None:
        return None
    prefix = f"{layers}." if layers else ""
    if not name.startswith(prefix):
        return None
    k = name[len(prefix):].split(".", 1)[0]
    return f"{prefix}{k}" if k.isdigit() and int(k) < n else None


class TransformerISTPlan(SubnetworkPlan):
    """One round's IST partition of a transformer or MLP. ``structure``: what was found;
    ``ffns[key]`` / ``attentions[key]``: the partitioned FFNs / attentions, keyed by their residual
    layer's name where a layer holds one of that kind (``"blocks.0"``), else by their output
    projection's name; ``units[key][s]``: the hidden units (sorted) of subnetwork ``s``;
    ``heads[key][s]``: its query heads (sorted) and ``kv_heads[key][s]`` its key/value heads;
    ``partition``: which are partitioned; ``scale``: the full model's scale of a partitioned branch."""

    who = "transformer_ist_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int, partition: str = "ffn",
                 generator: Optional[torch.Generator] = None, spec=None):
        S = num_subnetworks
        st = check_ist(model, S, partition, spec, self.who)
        self.structure = st
        self.partition = partition
        self.scale = 1.0 / S
        self.ffns: Dict[str, FFN] = {}
        self.attentions: Dict[str, Attention] = {}
        self.units: Dict[str, List[Tensor]] = {}
        self.heads: Dict[str, List[Tensor]] = {}
        self.kv_heads: Dict[str, List[Tensor]] = {}
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        nl = st.num_layers
        items = []  # (position, kind, key, item): drawn layer by layer, an FFN before the attention
        for kind, found in ((0, st.ffns if partition != "heads" else []),
                            (1, st.attentions if partition != "ffn" else [])):
            per_layer: Dict[Optional[str], int] = {}
            for it in found:
                own = it.out_proj if kind == 0 else it.o
                per_layer[_layer_of(own, st.layers, nl)] = per_layer.get(_layer_of(own, st.layers, nl), 0) + 1
            for it in found:
                own = it.out_proj if kind == 0 else it.o
                layer = _layer_of(own, st.layers, nl)
                key = layer if layer is not None and per_layer[layer] == 1 else own
                pos = order.get(layer if layer is not None else own, len(order))
                items.append((pos, kind, order.get(own, len(order)), key, it))
        items.sort(key=lambda t: t[:3])
        self.block_names = list(dict.fromkeys(key for *_, key, _ in items))
        partitioned: Dict[str, Tuple[int, List[Tensor]]] = {}

        def put(mod_name: str, w_dim: int, sets: List[Tensor]) -> None:
            m = model.get_submodule(mod_name)
            partitioned[f"{mod_name}.weight"] = (w_dim, sets)
            if m._parameters.get("bias") is not None and w_dim == out_dim(projection(m)[2]):
                partitioned[f"{mod_name}.bias"] = (0, sets)

        def kind_of(mod_name: str) -> str:
            return projection(model.get_submodule(mod_name))[2]

        def put_vectors(mod_name: str, sets: List[Tensor], n: int) -> None:  # a norm's vectors of the units
            m = model.get_submodule(mod_name)
            for attrs in (m._parameters, m._buffers):
                for attr, t in attrs.items():
                    if t is not None and t.dim() == 1 and t.shape[0] == n and \
                            attr not in m._non_persistent_buffers_set:
                        partitioned[f"{mod_name}.{attr}"] = (0, sets)

        def put_mha(a: Attention, q_rows: List[Tensor], kv_rows: List[Tensor], fused: List[Tensor]) -> None:
            m = model.get_submodule(a.q)
            for attr, dim, sets in (("in_proj_weight", 0, fused), ("in_proj_bias", 0, fused),
                                    ("q_proj_weight", 0, q_rows), ("k_proj_weight", 0, kv_rows),
                                    ("v_proj_weight", 0, kv_rows), ("bias_k", 2, kv_rows), ("bias_v", 2, kv_rows)):
                if m._parameters.get(attr) is not None:
                    partitioned[f"{a.q}.{attr}"] = (dim, sets)

        for _, kind, _, key, it in items:
            if kind == 0:
                f: FFN = it
                sets = [c.sort().values for c in torch.randperm(f.hidden, generator=generator).tensor_split(S)]
                self.ffns[key] = f
                self.units[key] = sets
                for p in f.in_projs:
                    put(p, out_dim(kind_of(p)), sets)
                put(f.out_proj, in_dim(kind_of(f.out_proj)), sets)
                for n in f.norms:
                    put_vectors(n, sets, f.hidden)
            else:
                a: Attention = it
                H, KV, hd = a.num_heads, a.num_kv_heads, a.head_dim
                g = H // KV
                kv = [c.sort().values for c in torch.randperm(KV, generator=generator).tensor_split(S)]
                q = [(c.view(-1, 1) * g + torch.arange(g)).flatten() for c in kv]
                self.attentions[key] = a
                self.heads[key] = q
                self.kv_heads[key] = kv
                q_rows = [_rows(c, hd) for c in q]
                kv_rows = [_rows(c, hd) for c in kv]
                fused = [torch.cat([qr, H * hd + kr, (H + KV) * hd + kr]) for qr, kr in zip(q_rows, kv_rows)]
                if isinstance(model.get_submodule(a.q), nn.MultiheadAttention):
                    put_mha(a, q_rows, kv_rows, fused)
                elif a.fused:
                    put(a.q, out_dim(kind_of(a.q)), fused)
                else:
                    put(a.q, out_dim(kind_of(a.q)), q_rows)
                    put(a.k, out_dim(kind_of(a.k)), kv_rows)
                    put(a.v, out_dim(kind_of(a.v)), kv_rows)
                put(a.o, in_dim(kind_of(a.o)), q_rows)
        self._kinds = {n: projection(model.get_submodule(n))[2]
                       for f in self.ffns.values() for n in (*f.in_projs, f.out_proj)}
        self._kinds.update({n: projection(model.get_submodule(n))[2]
                            for a in self.attentions.values() for n in (a.q, a.k, a.v, a.o)
                            if projection(model.get_submodule(n)) is not None})
        self._mha = {a.q for a in self.attentions.values() if isinstance(model.get_submodule(a.q), nn.MultiheadAttention)}
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        for key, f in self.ffns.items():
            n = self.units[key][s].numel()
            for p in f.in_projs:
                narrow(glob[p], self._kinds[p], n_out=n)
            narrow(glob[f.out_proj], self._kinds[f.out_proj], n_in=n)
            for name in f.norms:
                narrow_norm(glob[name], n)
        for key, a in self.attentions.items():
            nq, nkv, hd = self.heads[key][s].numel(), self.kv_heads[key][s].numel(), a.head_dim
            if a.q in self._mha:
                narrow(glob[a.o], "linear", n_in=nq * hd)
                narrow_heads(glob[a.q], self.heads[key][s], a.num_heads)
                continue
            if a.fused:
                narrow(glob[a.q], self._kinds[a.q], n_out=(nq + 2 * nkv) * hd)
            else:
                narrow(glob[a.q], self._kinds[a.q], n_out=nq * hd)
                narrow(glob[a.k], self._kinds[a.k], n_out=nkv * hd)
                narrow(glob[a.v], self._kinds[a.v], n_out=nkv * hd)
            narrow(glob[a.o], self._kinds[a.o], n_in=nq * hd)
            m = glob.get(a.name)
            if m is None:
                continue
            for attrs, old, new in ((HEAD_COUNT_ATTRS, a.num_heads, nq), (KV_COUNT_ATTRS, a.num_kv_heads, nkv),
                                    (WIDTH_ATTRS, a.num_heads * hd, nq * hd)):
                for attr in attrs:
                    v = m.__dict__.get(attr)
                    if isinstance(v, int) and not isinstance(v, bool) and v == old:
                        m.__dict__[attr] = new

    def output_projections(self) -> List[str]:
        """The names of the output projections whose input the full model scales by 1/S (for an
        ``nn.MultiheadAttention``, whose forward reads its ``out_proj``'s weight itself: the attention,
        see :func:`set_input_scale`)."""
        return [f.out_proj for f in self.ffns.values()] + \
            [a.q if a.q in self._mha else a.o for a in self.attentions.values()]

    def scale_outputs(self, model: Optional[nn.Module] = None) -> None:
        """Scale the input of every partitioned output projection of ``model`` (default: the plan's)
        by 1/S (forward pre-hooks: the state dict is unchanged; a subnetwork's clone is not scaled)."""
        model = self.model if model is None else model
        for name in self.output_projections():
            set_input_scale(model.get_submodule(name), self.scale)

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_outputs(model)


# ---------------------------------------------------------------- ResIST

class TransformerResistPlan(SubnetworkPlan):
    """One round's ResIST partition of a stack of residual layers. ``layers``: the container's
    name; ``partitioned_blocks``: the names of the layers dealt out (all but the first and the
    last); ``blocks[s]``: those subnetwork ``s`` owns (in depth order); ``owners[name]``: the
    subnetworks owning a layer; ``residual_scale``: the full model's scale of those layers."""

    who = "transformer_resist_plan"

    def __init__(self, model: nn.Module, num_subnetworks: int, min_depth: int = 1,
                 generator: Optional[torch.Generator] = None, spec=None):
        S = num_subnetworks
        st = check_resist(model, S, min_depth, spec, self.who)
        self.structure = st
        self.layers = st.layers
        container = model.get_submodule(st.layers)
        prefix = f"{st.layers}." if st.layers else ""
        blocks = [(f"{prefix}{k}", b) for k, b in container._modules.items()]
        self._keys = list(container._modules)
        part = blocks[1:-1]
        P = len(part)
        dealt = deal_blocks(P, S, min_depth, generator)
        self.partitioned_blocks = [n for n, _ in part]
        self.blocks: List[List[str]] = [[part[k][0] for k in d] for d in dealt]
        self.owners: Dict[str, List[int]] = {n: [s for s in range(S) if k in dealt[s]] for k, (n, _) in enumerate(part)}
        self.residual_scale = sum(len(d) for d in dealt) / (P * S)
        self._depth = len(blocks)
        self._dealt = [set(d) for d in dealt]
        partitioned: Dict[str, Tuple[int, List[Optional[Tensor]]]] = {}
        for k, (name, b) in enumerate(part):
            for tname, t in list(b.named_parameters()) + list(b.named_buffers()):
                full = torch.zeros(1, dtype=torch.long) if t.dim() == 0 else torch.arange(t.shape[0])
                partitioned[f"{name}.{tname}"] = (0, [full if k in self._dealt[s] else None for s in range(S)])
        super().__init__(model, S, partitioned)

    def _edit(self, s: int, glob: Dict[str, nn.Module], root: nn.Module) -> None:
        seq = glob[self.layers]
        kept = []
        for j, key in enumerate(self._keys):
            block = seq._modules[key]
            if j in (0, self._depth - 1):
                kept.append(block)
            elif j - 1 in self._dealt[s]:
                if isinstance(getattr(block, "residual_scale", None), float):
                    block.residual_scale = 1.0
                kept.append(block)
        seq.__dict__["_modules"] = {str(n): m for n, m in enumerate(kept)}

    def scale_residuals(self, model: Optional[nn.Module] = None) -> None:
        """Scale the partitioned layers of ``model`` (default: the plan's) by the expected fraction
        of subnetworks owning them (§2.6): their ``residual_scale`` attribute, else a forward hook."""
        model = self.model if model is None else model
        for name in self.partitioned_blocks:
            set_residual_scale(model.get_submodule(name), self.residual_scale)

    def after_aggregate(self, model: Optional[nn.Module] = None) -> None:
        self.scale_residuals(model)


def transformer_ist_plan(model: nn.Module, S: int, partition: str = "ffn",
                         generator: Optional[torch.Generator] = None, spec=None) -> TransformerISTPlan:
    """A random IST partition of a model's FFN units (``partition="ffn"``), attention heads
    (``"heads"``) or both into ``S`` subnetworks, found from its structure or given by ``spec``
    (:func:`.structure.find_structure`); ``build``/``aggregate`` as for the CNN plans."""
    return TransformerISTPlan(model, S, partition, generator, spec)


def transformer_resist_plan(model: nn.Module, S: int, min_depth: int = 1,
                            generator: Optional[torch.Generator] = None, spec=None) -> TransformerResistPlan:
    """A random ResIST partition of a model's residual layers between the first and the last into
    ``S`` shallower subnetworks of at least ``min_depth`` partitioned layers each (paper 003 §2.2,
    §2.6), found from its structure or given by ``spec``."""
    return TransformerResistPlan(model, S, min_depth, generator, spec)
