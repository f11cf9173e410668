"""What a transformer or MLP partition finds in any model's module graph (shapes and module
structure, never names or classes), and the small explicit spec a user passes where nothing is found.

- **FFN** (IST's hidden units): a module whose only parametrized children are two or three
  projections (``nn.Linear`` or GPT-2's ``Conv1D``, weight stored ``[in, out]``) registered in the
  order ``in -> out``: ``A: d -> h`` then ``B: h -> e`` (``Linear -> act -> Linear``: our GPT's
  ``FeedForward``, GPT-2's ``GPT2MLP``), or ``A, B: d -> h`` then ``C: h -> e`` (a gated FFN:
  Llama's ``LlamaMLP``). In an ``nn.Sequential`` a projection, any parameter-free modules, then a
  projection reading its ``h`` outputs (a user's ``Sequential(Flatten, Linear, ReLU, Linear)``);
  pairs do not overlap (a Linear that would be both a pair's output and the next pair's input is
  left to the first pair). Hidden unit ``i``: row ``i`` of every input projection (and its bias),
  column ``i`` of the output projection (its bias is shared).
- **FFN from the data flow**: in any module holding two or more projections not taken above as
  direct children (a decoder layer with ``fc1`` / ``fc2`` or ``up_proj`` / ``gate_proj`` /
  ``down_proj`` beside its attention and norms: OPT, BART, Whisper, ``nn.TransformerEncoderLayer``,
  a hand-written layer; an ``nn.Sequential`` with a norm between its projections), the pairs
  :mod:`.dataflow` reads from its forward: an output projection reading the input projections'
  outputs through nothing but ops on each hidden unit alone (activations, dropout, casts, products:
  a gated FFN) and norms of the hidden units, the hidden values read by nothing else.
  **A norm between the projections** (``Linear -> LayerNorm -> GELU -> Dropout -> Linear``): its
  weight and bias (BatchNorm1d: also its running statistics) go with the units (``FFN.norms``),
  and a subnetwork normalizes over its own units (its clone's ``normalized_shape`` /
  ``num_features`` narrowed). That is the same architecture at ``1/S`` of the width, what IST
  trains, and with units drawn at random every round its mean and variance estimate the full
  width's; what it gives up: unlike an elementwise FFN, a subnetwork is not the full model with the
  other units removed (the statistics differ), so the full model's branch is close to, not exactly,
  the mean of the subnetworks'. Refusing would leave a common MLP out of IST, and a BatchNorm1d
  (statistics per unit over the batch) is exact. ``FFN.norms`` lists them, ``describe`` says so.
- **Attention** (IST's heads): a module without parameters of its own whose head count or head
  size is readable (``num_heads`` / ``num_attention_heads`` / ``n_head`` / ``n_heads`` /
  ``config.num_attention_heads``; ``head_dim`` / ``attention_head_size`` / ``head_size``), holding
  either four projections (q, k, v then o, registered in that order: Llama) or two (a fused
  ``[q | k | v]`` one then o: our GPT's ``qkv``, GPT-2's ``c_attn``). The key/value heads are read
  from the shapes (grouped-query attention: a key/value head goes with its group of query heads).
  In a module with a readable head count holding more projections (a hand-written decoder layer
  with ``q_proj`` ... ``o_proj`` beside its FFN), the same shapes among the projections whose
  outputs reach a projection ``o`` in its data flow. An ``nn.MultiheadAttention``: its
  ``in_proj_weight`` (or ``q/k/v_proj_weight``), ``in_proj_bias``, ``bias_k`` / ``bias_v`` and
  ``out_proj`` (``q = k = v`` = the module's name, ``o`` = its ``out_proj``); a subnetwork's clone
  is a :class:`.mha.HeadsMultiheadAttention` computing its heads only.
- **Residual layers** (ResIST): the ``nn.ModuleList`` / ``nn.Sequential`` with the most children
  (at least 2) all of one class, each a module with submodules and parameters (HF Llama's
  ``model.layers``, GPT-2's ``transformer.h``, our GPT's ``blocks``); layer outputs are assumed to
  have their inputs' shape (not checked: nothing is run).

Where a module's projections are seen but not taken (their outputs reach the next projection
through a softmax, a reshape, a parameter), ``Structure.notes`` says so, and the errors show it.

Where discovery does not fit, pass ``spec`` (a :class:`Structure` or a dict with any of the keys
``ffns``, ``attentions``, ``layers``; a key given replaces discovery of that kind)::

    spec = {"ffns": [(("mlp.fc1",), "mlp.fc2"),                        # (in_projs, out_proj[, norms])
                     (("mlp2.fc1",), "mlp2.fc2", ("mlp2.ln",))],
            "attentions": [{"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
                            "num_heads": 8, "head_dim": 64}],          # num_kv_heads: from k's shape
            "layers": "encoder.blocks"}
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from torch import nn

from . import dataflow

#: attributes read as the number of (query) heads / the head size / narrowed on a subnetwork's clone
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size")
#: int attributes of an attention module equal to (query heads * head_dim): narrowed on clones
WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim")

LOOKED_FOR_FFN = ("an FFN: a module whose only parametrized children are nn.Linear / Conv1D projections "
                  "d->h then h->e (or two gated d->h then h->e), or in an nn.Sequential a projection, "
                  "parameter-free modules, then a projection reading its h outputs, or in any module holding "
                  "two or more projections a projection reading another's h outputs (in the data flow of its "
                  "forward) through only activations, dropout, products and norms of the h units")
LOOKED_FOR_ATTENTION = ("attention: a module with a readable head count or head size (num_heads, "
                        "num_attention_heads, n_head, head_dim, config.num_attention_heads) holding q, k, v, "
                        "o projections (four, or more where o reads q, k, v in its data flow) or a fused [q|k|v] "
                        "one and o (two), or an nn.MultiheadAttention")
LOOKED_FOR_LAYERS = ("residual layers: an nn.ModuleList / nn.Sequential of at least 2 layers of one class, "
                     "each with submodules and parameters")
SPEC_HINT = ("pass spec= (ist_kernels.partition.Structure or a dict with keys ffns=[(in_projs, out_proj[, norms])], "
             "attentions=[{q, k, v, o, num_heads, head_dim}], layers='<container name>'; ist-train: --model-spec "
             "with that dict as JSON)")


@dataclass(frozen=True)
class FFN:
    """An FFN's hidden units: ``in_projs`` (module names, ``d -> hidden``: their output rows),
    ``out_proj`` (``hidden -> e``: its input columns); ``name``: the module holding them;
    ``norms``: modules between them over the hidden units (a LayerNorm, RMSNorm, BatchNorm1d, any
    module of ``hidden``-vectors), whose vectors go with the units and which a subnetwork computes
    over its own units (see the module doc)."""

    in_projs: Tuple[str, ...]
    out_proj: str
    hidden: int = 0
    name: str = ""
    norms: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Attention:
    """Attention heads: projections ``q``, ``k``, ``v`` (the same name for a fused ``[q|k|v]``
    projection) and ``o``; ``num_heads`` query heads, ``num_kv_heads`` key/value heads (a divisor
    of ``num_heads``), ``head_dim``; ``name``: the module whose head-count attributes a subnetwork's
    clone narrows."""

    q: str
    k: str
    v: str
    o: str
    num_heads: int
    head_dim: int
    num_kv_heads: int = 0
    name: str = ""

    @property
    def fused(self) -> bool:
        return self.q == self.k == self.v


@dataclass
class Structure:
    """What a partition found in a model (or what the user said): ``ffns``, ``attentions`` (in
    module order), ``layers`` (the residual layers container's name, or None) and ``num_layers``;
    ``notes``: projections seen but not taken, and why."""

    ffns: List[FFN] = field(default_factory=list)
    attentions: List[Attention] = field(default_factory=list)
    layers: Optional[str] = None
    num_layers: int = 0
    notes: List[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line per thing found (and per note), for errors and logs."""
        lines = [f"FFN {f.name or '<root>'}: {f.hidden} units ({', '.join(f.in_projs)} -> {f.out_proj}"
                 + (f"; normalized over a subnetwork's units by {', '.join(f.norms)})" if f.norms else ")")
                 for f in self.ffns]
        lines += [f"attention {a.name or '<root>'}: {a.num_heads} heads ({a.num_kv_heads} key/value) of "
                  f"{a.head_dim} ({'fused ' + a.q if a.fused else ', '.join((a.q, a.k, a.v))} -> {a.o})"
                  for a in self.attentions]
        lines.append(f"residual layers {self.layers}: {self.num_layers}" if self.layers is not None
                     else "residual layers: none")
        lines += [f"not taken: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------- projections

def projection(m: nn.Module) -> Optional[Tuple[int, int, str]]:
    """``(in, out, kind)`` of a projection: ``nn.Linear`` (weight ``[out, in]``, kind ``linear``) or
    a GPT-2 ``Conv1D``-like module (ints ``nx``, ``nf``, weight ``[nx, nf]``, kind ``conv1d``)."""
    w = getattr(m, "_parameters", {}).get("weight")
    if w is None or w.dim() != 2:
        return None
    if isinstance(m, nn.Linear):
        return int(w.shape[1]), int(w.shape[0]), "linear"
    nx, nf = getattr(m, "nx", None), getattr(m, "nf", None)
    if isinstance(nx, int) and isinstance(nf, int) and tuple(w.shape) == (nx, nf):
        return nx, nf, "conv1d"
    return None


def out_dim(kind: str) -> int:
    """The weight dim of a projection's outputs."""
    return 0 if kind == "linear" else 1


def in_dim(kind: str) -> int:
    """The weight dim of a projection's inputs."""
    return 1 if kind == "linear" else 0


def narrow(m: nn.Module, kind: str, n_in: Optional[int] = None, n_out: Optional[int] = None) -> None:
    """Set a (cloned) projection's feature counts."""
    a_in, a_out = ("in_features", "out_features") if kind == "linear" else ("nx", "nf")
    if n_in is not None:
        setattr(m, a_in, n_in)
    if n_out is not None:
        setattr(m, a_out, n_out)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _param_children(m: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(k, c) for k, c in m._modules.items() if c is not None and _has_params(c)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _int_attr(m: Any, names: Sequence[str]) -> Optional[int]:
    for a in names:
        v = getattr(m, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# ---------------------------------------------------------------- discovery

def _head_attrs(m: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """(number of query heads, head size) readable on ``m`` (None where not)."""
    H = _int_attr(m, HEAD_COUNT_ATTRS)
    if H is None:
        H = _int_attr(getattr(m, "config", None), ("num_attention_heads",))
    return H, _int_attr(m, HEAD_DIM_ATTRS)


def _find_attention(name: str, m: nn.Module) -> Optional[Attention]:
    if m._parameters and any(p is not None for p in m._parameters.values()):
        return None
    H, hd = _head_attrs(m)
    if H is None and hd is None:
        return None
    kids = _param_children(m)
    projs = [(k, projection(c)) for k, c in kids]
    if len(projs) not in (2, 4) or any(p is None for _, p in projs):
        return None
    return _heads_of(name, H, hd, projs[:-1], projs[-1])


def _heads_of(name: str, H: Optional[int], hd: Optional[int], qkv: List[Tuple[str, Tuple[int, int, str]]],
              o: Tuple[str, Tuple[int, int, str]]) -> Optional[Attention]:
    """The attention of projections ``qkv`` (one fused, or three in registration order; names under
    ``name``) and ``o`` if their shapes fit ``H`` heads of ``hd`` (one may be None)."""
    o_name, (o_in, o_out, _) = o
    if hd is None:
        if o_in % H:
            return None
        hd = o_in // H
    if H is None:
        if o_in % hd:
            return None
        H = o_in // hd
    if o_in != H * hd:
        return None
    d = o_out
    if len(qkv) == 1:  # fused [q | k | v]
        f_name, (f_in, f_out, _) = qkv[0]
        rest = f_out - H * hd
        if f_in != d or rest <= 0 or rest % (2 * hd):
            return None
        KV = rest // (2 * hd)
        q = k = v = f_name
    else:
        shapes = [p for _, p in qkv]
        if any(p[0] != d for p in shapes):
            return None
        outs = [p[1] for p in shapes]
        qi = next((i for i, x in enumerate(outs) if x == H * hd), None)
        if qi is None:
            return None
        kv = [i for i in range(3) if i != qi]
        if outs[kv[0]] != outs[kv[1]] or outs[kv[0]] % hd:
            return None
        KV = outs[kv[0]] // hd
        q, k, v = qkv[qi][0], qkv[kv[0]][0], qkv[kv[1]][0]
    if KV < 1 or H % KV:
        return None
    return Attention(_join(name, q), _join(name, k), _join(name, v), _join(name, o_name), H, hd, KV, name)


def _mha_attention(name: str, m: nn.MultiheadAttention) -> Attention:
    """An ``nn.MultiheadAttention``'s heads: ``q = k = v`` its name (its in-projection is its own
    parameter), ``o`` its ``out_proj``."""
    return Attention(name, name, name, _join(name, "out_proj"), m.num_heads, m.head_dim, m.num_heads, name)


def _module_ffn(name: str, m: nn.Module) -> Optional[FFN]:
    if m._parameters and any(p is not None for p in m._parameters.values()):
        return None
    kids = _param_children(m)
    if len(kids) not in (2, 3):
        return None
    projs = [projection(c) for _, c in kids]
    if any(p is None for p in projs):
        return None
    *ins, out = projs
    h = out[0]
    if any(p[:2] != ins[0][:2] for p in ins) or ins[0][1] != h:
        return None
    return FFN(tuple(_join(name, k) for k, _ in kids[:-1]), _join(name, kids[-1][0]), h, name)


def _sequential_ffns(name: str, m: nn.Sequential) -> List[FFN]:
    kids = [(k, c) for k, c in m._modules.items() if c is not None]
    found = []
    i = 0
    while i < len(kids):
        a = projection(kids[i][1])
        if a is None:
            i += 1
            continue
        j = i + 1
        while j < len(kids) and projection(kids[j][1]) is None and not _has_params(kids[j][1]):
            j += 1
        b = projection(kids[j][1]) if j < len(kids) else None
        if b is not None and b[0] == a[1]:
            found.append(FFN((_join(name, kids[i][0]),), _join(name, kids[j][0]), a[1], name))
            i = j + 1
        else:
            i = j if b is not None else j + 1
    return found


def _find_layers(model: nn.Module) -> Tuple[Optional[str], int]:
    best, best_key = None, None
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [c for c in m._modules.values()]
        if len(kids) < 2 or any(c is None for c in kids) or len({type(c) for c in kids}) != 1:
            continue
        if not all(c._modules and _has_params(c) for c in kids):
            continue
        key = (len(kids), sum(p.numel() for p in m.parameters()))
        if best_key is None or key > best_key:
            best, best_key = name, key
    return best, (0 if best_key is None else best_key[0])


def discover(model: nn.Module) -> Structure:
    """Everything :func:`find_structure` finds without a spec."""
    attentions: List[Attention] = []
    ffns: List[FFN] = []
    claimed = set()  # projections already in an FFN or attention
    for name, m in model.named_modules():
        if projection(m) is not None:
            continue
        a = _mha_attention(name, m) if isinstance(m, nn.MultiheadAttention) else _find_attention(name, m)
        if a is not None and not {a.q, a.k, a.v, a.o} & claimed:
            attentions.append(a)
            claimed |= {a.q, a.k, a.v, a.o}
            continue
        found = _sequential_ffns(name, m) if isinstance(m, nn.Sequential) else [f for f in [_module_ffn(name, m)] if f]
        for f in found:
            mods = {*f.in_projs, f.out_proj}
            if not mods & claimed:
                ffns.append(f)
                claimed |= mods
    notes: List[str] = []
    _flow_pass(model, ffns, attentions, claimed, notes)
    layers, n = _find_layers(model)
    return Structure(ffns, attentions, layers, n, notes)


def _flow_pass(model: nn.Module, ffns: List[FFN], attentions: List[Attention], claimed: Set[str],
               notes: List[str]) -> None:
    """FFNs (and attentions) in the data flow of every module holding two or more projections not
    yet claimed as direct children (see :mod:`.dataflow`), the deepest modules first (a layer's
    before the model's: what a layer claims is a leaf in its parent's flow), appended in module order."""
    mods = dict(model.named_modules())
    free = {n for n, m in mods.items() if projection(m) is not None} - claimed
    found = False
    for name in sorted(mods, key=lambda n: -len(n.split(".")) if n else 0):
        m = mods[name]
        if name in claimed or projection(m) is not None or isinstance(m, nn.MultiheadAttention):
            continue
        direct = [k for k, c in m._modules.items() if c is not None and _join(name, k) in free]
        if len(direct) < 2:
            continue
        prefix = f"{name}." if name else ""
        mine = frozenset(n[len(prefix):] for n in free if n.startswith(prefix))
        a_rel, f_rel, why = dataflow.remembered(m, ("structure", mine), lambda: _module_flow(m, mine))
        for a in a_rel:
            a = Attention(*(_join(name, x) for x in (a.q, a.k, a.v, a.o)), a.num_heads, a.head_dim,
                          a.num_kv_heads, name)
            attentions.append(a)
            claimed |= {a.q, a.k, a.v, a.o}
        for f in f_rel:
            ffns.append(FFN(tuple(_join(name, x) for x in f.in_projs), _join(name, f.out_proj), f.hidden, name,
                            tuple(_join(name, x) for x in f.norms)))
            claimed |= {*ffns[-1].in_projs, ffns[-1].out_proj}
        notes += [f"{name or '<root>'}: {w}" for w in why]
        free -= claimed
        found = found or bool(a_rel or f_rel)
    if found:  # in module order, as the structural ones
        order = {n: i for i, n in enumerate(mods)}
        ffns.sort(key=lambda f: order[f.out_proj])
        attentions.sort(key=lambda a: order[a.o])


def _module_flow(m: nn.Module, free: Set[str]) -> Tuple[List[Attention], List[FFN], List[str]]:
    """The attentions and FFNs (names under ``m``) among the projections ``free`` in ``m``'s data
    flow, and notes on what was seen but not taken."""
    holds = set()  # modules (not projections) holding a free projection: traced through
    for n in free:
        parts = n.split(".")
        holds |= {id(m.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts))}

    def leaf(c: nn.Module) -> bool:
        if projection(c) is not None:
            return True
        if id(c) in holds:
            return False
        if any(True for _ in c.parameters()) or any(True for _ in c.buffers()):
            return True
        return c.__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(c, nn.Sequential)

    widths: Dict[int, int] = {}
    for k, c in m._modules.items():
        p = projection(c) if k in free else None
        if p is not None:
            widths[p[0]] = widths.get(p[0], 0) + 1
    try:
        ops = dataflow.read_flow(m, leaf, sorted(widths, key=lambda w: -widths[w]))
    except dataflow.NoFlow as e:
        return [], [], [f"projections {', '.join(sorted(free))} seen, their data flow not read: {e}"]
    order = {n: i for i, (n, _) in enumerate(m.named_modules())}
    atts: List[Attention] = []
    H, hd = _head_attrs(m)
    if H is not None or hd is not None:
        ffn_outs = {p.out_proj for p in dataflow.find_pairs(ops, projection, free)[0]}
        proj = dataflow.free_projections(ops, projection, free)
        used: Set[str] = set()
        for op in ops:
            if proj(op) is None or op.name in ffn_outs or op.name in used:
                continue
            ups = sorted(dataflow.upstream(op, proj), key=lambda u: order.get(u.name, 0))
            if len(ups) not in (1, 3) or used & {u.name for u in ups}:
                continue
            a = _heads_of("", H, hd, [(u.name, proj(u)) for u in ups], (op.name, proj(op)))
            if a is not None:
                atts.append(a)
                used |= {a.q, a.k, a.v, a.o}
        free = free - used
    pairs, notes = dataflow.find_pairs(ops, projection, free)
    ffns = [FFN(p.in_projs, p.out_proj, projection(m.get_submodule(p.out_proj))[0], "", p.norms) for p in pairs]
    return atts, ffns, notes


# ---------------------------------------------------------------- the user's spec

def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"spec: {what} {name!r} is not a module of {type(model).__name__}") from None


def _proj_of(model: nn.Module, name: str, what: str) -> Tuple[int, int, str]:
    p = projection(_module(model, name, what))
    if p is None:
        raise ValueError(f"spec: {what} {name!r} is not an nn.Linear or Conv1D projection")
    return p


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _spec_ffn(model: nn.Module, item: Any) -> FFN:
    norms: Any = ()
    if isinstance(item, FFN):
        ins, out, norms = item.in_projs, item.out_proj, item.norms
    elif isinstance(item, dict):
        ins, out, norms = item.get("in_projs"), item.get("out_proj"), item.get("norms", ())
    elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
        ins, out, *rest = item
        norms = rest[0] if rest else ()
    else:
        raise ValueError(f"spec: an FFN is (in_projs, out_proj[, norms]): module names, got {item!r}")
    ins = (ins,) if isinstance(ins, str) else tuple(ins or ())
    norms = (norms,) if isinstance(norms, str) else tuple(norms or ())
    if not ins or not isinstance(out, str):
        raise ValueError(f"spec: an FFN is (in_projs, out_proj[, norms]): module names, got {item!r}")
    ps = [_proj_of(model, n, "FFN input projection") for n in ins]
    po = _proj_of(model, out, "FFN output projection")
    if any(p[1] != po[0] for p in ps) or any(p[:2] != ps[0][:2] for p in ps):
        raise ValueError(f"spec: FFN {ins} -> {out}: the input projections' outputs "
                         f"{[p[1] for p in ps]} must all equal the output projection's inputs {po[0]}")
    for n in norms:
        if not dataflow.unit_module(_module(model, n, "FFN norm"), po[0]):
            raise ValueError(f"spec: FFN norm {n!r} is not a LayerNorm / RMSNorm over, a BatchNorm1d of, or a "
                             f"module of vectors of the {po[0]} hidden units")
    return FFN(ins, out, po[0], _parent(out), norms)


def _spec_attention(model: nn.Module, item: Any) -> Attention:
    if isinstance(item, Attention):
        item = dict(q=item.q, k=item.k, v=item.v, o=item.o, num_heads=item.num_heads, head_dim=item.head_dim,
                    num_kv_heads=item.num_kv_heads or None, name=item.name or None)
    if not isinstance(item, dict):
        raise ValueError(f"spec: an attention is a dict with q, k, v, o, num_heads, head_dim, got {item!r}")
    unknown = set(item) - {"q", "k", "v", "o", "num_heads", "head_dim", "num_kv_heads", "name", "module"}
    if unknown:
        raise ValueError(f"spec: unknown attention keys {sorted(unknown)}")
    if isinstance(item.get("q"), str) and all(item.get(x, item["q"]) == item["q"] for x in "kv") and \
            isinstance(_module(model, item["q"], "attention q"), nn.MultiheadAttention):
        return _mha_attention(item["q"], model.get_submodule(item["q"]))
    try:
        q, k, v, o = (item[x] for x in "qkvo")
    except KeyError as e:
        raise ValueError(f"spec: attention needs q, k, v and o (module names; the same name for a fused "
                         f"[q|k|v] projection or an nn.MultiheadAttention), missing {e}") from None
    pq, pk, po = (_proj_of(model, n, f"attention {w}") for n, w in ((q, "q"), (k, "k"), (o, "o")))
    _proj_of(model, v, "attention v")
    H = item.get("num_heads")
    hd = item.get("head_dim")
    if H is None and hd is None:
        raise ValueError("spec: attention needs num_heads or head_dim")
    hd = hd or po[0] // H
    H = H or po[0] // hd
    if po[0] != H * hd:
        raise ValueError(f"spec: attention {o} reads {po[0]} inputs, not num_heads * head_dim = {H} * {hd}")
    fused = q == k == v
    if fused:
        rest = pq[1] - H * hd
        KV = rest // (2 * hd) if rest > 0 and rest % (2 * hd) == 0 else 0
    else:
        if pq[1] != H * hd:
            raise ValueError(f"spec: attention q {q} has {pq[1]} outputs, not num_heads * head_dim = {H * hd}")
        KV = pk[1] // hd if pk[1] % hd == 0 else 0
    KV_given = item.get("num_kv_heads")
    if KV < 1 or H % KV or (KV_given is not None and KV_given != KV):
        raise ValueError(f"spec: attention {q}/{k}/{v} shapes do not give key/value heads of {hd} dividing "
                         f"the {H} query heads" + (f" (num_kv_heads={KV_given})" if KV_given else ""))
    name = item.get("name") or item.get("module")
    if name is None:
        name = _parent(o)
    return Attention(q, k, v, o, H, hd, KV, name)


def _spec_layers(model: nn.Module, name: Any) -> Tuple[str, int]:
    if not isinstance(name, str):
        raise ValueError(f"spec: layers is the name of the residual layers container, got {name!r}")
    m = _module(model, name, "layers")
    if not isinstance(m, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"spec: layers {name!r} must be an nn.ModuleList or nn.Sequential, got {type(m).__name__}")
    return name, len(m)


def find_structure(model: nn.Module, spec: Union[None, Structure, Dict[str, Any]] = None) -> Structure:
    """The FFNs, attentions and residual layers IST / ResIST partition in ``model`` (see the
    module doc): found from the module graph, or, for each kind ``spec`` names, as it says."""
    found = discover(model)
    if spec is None:
        return found
    if isinstance(spec, Structure):
        spec = {"ffns": spec.ffns, "attentions": spec.attentions, "layers": spec.layers}
    if not isinstance(spec, dict):
        raise ValueError(f"spec must be a Structure or a dict, got {type(spec).__name__}")
    unknown = set(spec) - {"ffns", "attentions", "layers"}
    if unknown:
        raise ValueError(f"spec: unknown keys {sorted(unknown)} (expected ffns, attentions, layers)")
    if "ffns" in spec:
        found.ffns = [_spec_ffn(model, f) for f in spec["ffns"] or ()]
    if "attentions" in spec:
        found.attentions = [_spec_attention(model, a) for a in spec["attentions"] or ()]
    if "layers" in spec:
        found.layers, found.num_layers = (None, 0) if spec["layers"] is None else _spec_layers(model, spec["layers"])
    mods = [m for f in found.ffns for m in (*f.in_projs, f.out_proj, *f.norms)] + \
           [m for a in found.attentions for m in dict.fromkeys((a.q, a.k, a.v, a.o))]
    dup = sorted({m for m in mods if mods.count(m) > 1})
    if dup:
        raise ValueError(f"spec: projections {dup} belong to more than one FFN / attention (one dim each)")
    return found
