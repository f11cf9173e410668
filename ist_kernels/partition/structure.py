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
- **Attention** (IST's heads): a module without parameters of its own whose head count or head
  size is readable (``num_heads`` / ``num_attention_heads`` / ``n_head`` / ``n_heads`` /
  ``config.num_attention_heads``; ``head_dim`` / ``attention_head_size`` / ``head_size``), holding
  either four projections (q, k, v then o, registered in that order: Llama) or two (a fused
  ``[q | k | v]`` one then o: our GPT's ``qkv``, GPT-2's ``c_attn``). The key/value heads are read
  from the shapes (grouped-query attention: a key/value head goes with its group of query heads).
- **Residual layers** (ResIST): the ``nn.ModuleList`` / ``nn.Sequential`` with the most children
  (at least 2) all of one class, each a module with submodules and parameters (HF Llama's
  ``model.layers``, GPT-2's ``transformer.h``, our GPT's ``blocks``); layer outputs are assumed to
  have their inputs' shape (not checked: nothing is run).

Where discovery does not fit, pass ``spec`` (a :class:`Structure` or a dict with any of the keys
``ffns``, ``attentions``, ``layers``; a key given replaces discovery of that kind)::

    spec = {"ffns": [(("mlp.fc1",), "mlp.fc2")],                       # (in_projs, out_proj)
            "attentions": [{"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
                            "num_heads": 8, "head_dim": 64}],          # num_kv_heads: from k's shape
            "layers": "encoder.blocks"}
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torch import nn

#: attributes read as the number of (query) heads / the head size / narrowed on a subnetwork's clone
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "head_size")
#: int attributes of an attention module equal to (query heads * head_dim): narrowed on clones
WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim")

LOOKED_FOR_FFN = ("an FFN: a module whose only parametrized children are nn.Linear / Conv1D projections "
                  "d->h then h->e (or two gated d->h then h->e), or in an nn.Sequential a projection, "
                  "parameter-free modules, then a projection reading its h outputs")
LOOKED_FOR_ATTENTION = ("attention: a module with a readable head count or head size (num_heads, "
                        "num_attention_heads, n_head, head_dim, config.num_attention_heads) holding q, k, v, "
                        "o projections (four) or a fused [q|k|v] one and o (two)")
LOOKED_FOR_LAYERS = ("residual layers: an nn.ModuleList / nn.Sequential of at least 2 layers of one class, "
                     "each with submodules and parameters")
SPEC_HINT = ("pass spec= (ist_kernels.partition.Structure or a dict with keys ffns=[(in_projs, out_proj)], "
             "attentions=[{q, k, v, o, num_heads, head_dim}], layers='<container name>'; ist-train: --model-spec "
             "with that dict as JSON)")


@dataclass(frozen=True)
class FFN:
    """An FFN's hidden units: ``in_projs`` (module names, ``d -> hidden``: their output rows),
    ``out_proj`` (``hidden -> e``: its input columns); ``name``: the module holding them."""

    in_projs: Tuple[str, ...]
    out_proj: str
    hidden: int = 0
    name: str = ""


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
    module order), ``layers`` (the residual layers container's name, or None) and ``num_layers``."""

    ffns: List[FFN] = field(default_factory=list)
    attentions: List[Attention] = field(default_factory=list)
    layers: Optional[str] = None
    num_layers: int = 0

    def describe(self) -> str:
        """One line per thing found, for errors and logs."""
        lines = [f"FFN {f.name or '<root>'}: {f.hidden} hidden units ({', '.join(f.in_projs)} -> {f.out_proj})"
                 for f in self.ffns]
        lines += [f"attention {a.name or '<root>'}: {a.num_heads} heads ({a.num_kv_heads} key/value) of "
                  f"{a.head_dim} ({'fused ' + a.q if a.fused else ', '.join((a.q, a.k, a.v))} -> {a.o})"
                  for a in self.attentions]
        lines.append(f"residual layers {self.layers}: {self.num_layers}" if self.layers is not None
                     else "residual layers: none")
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

def _find_attention(name: str, m: nn.Module) -> Optional[Attention]:
    if m._parameters and any(p is not None for p in m._parameters.values()):
        return None
    H = _int_attr(m, HEAD_COUNT_ATTRS)
    if H is None:
        H = _int_attr(getattr(m, "config", None), ("num_attention_heads",))
    hd = _int_attr(m, HEAD_DIM_ATTRS)
    if H is None and hd is None:
        return None
    kids = _param_children(m)
    projs = [(k, projection(c)) for k, c in kids]
    if len(projs) not in (2, 4) or any(p is None for _, p in projs):
        return None
    *qkv, (o_name, (o_in, o_out, _)) = projs
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
        a = _find_attention(name, m)
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
    layers, n = _find_layers(model)
    return Structure(ffns, attentions, layers, n)


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
    if isinstance(item, FFN):
        ins, out = item.in_projs, item.out_proj
    elif isinstance(item, dict):
        ins, out = item.get("in_projs"), item.get("out_proj")
    else:
        ins, out = item
    ins = (ins,) if isinstance(ins, str) else tuple(ins or ())
    if not ins or not isinstance(out, str):
        raise ValueError(f"spec: an FFN is (in_projs, out_proj): module names, got {item!r}")
    ps = [_proj_of(model, n, "FFN input projection") for n in ins]
    po = _proj_of(model, out, "FFN output projection")
    if any(p[1] != po[0] for p in ps) or any(p[:2] != ps[0][:2] for p in ps):
        raise ValueError(f"spec: FFN {ins} -> {out}: the input projections' outputs "
                         f"{[p[1] for p in ps]} must all equal the output projection's inputs {po[0]}")
    return FFN(ins, out, po[0], _parent(out))


def _spec_attention(model: nn.Module, item: Any) -> Attention:
    if isinstance(item, Attention):
        item = dict(q=item.q, k=item.k, v=item.v, o=item.o, num_heads=item.num_heads, head_dim=item.head_dim,
                    num_kv_heads=item.num_kv_heads or None, name=item.name or None)
    if not isinstance(item, dict):
        raise ValueError(f"spec: an attention is a dict with q, k, v, o, num_heads, head_dim, got {item!r}")
    unknown = set(item) - {"q", "k", "v", "o", "num_heads", "head_dim", "num_kv_heads", "name", "module"}
    if unknown:
        raise ValueError(f"spec: unknown attention keys {sorted(unknown)}")
    try:
        q, k, v, o = (item[x] for x in "qkvo")
    except KeyError as e:
        raise ValueError(f"spec: attention needs q, k, v and o (module names; the same name for a fused "
                         f"[q|k|v] projection), missing {e}") from None
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
    mods = [m for f in found.ffns for m in (*f.in_projs, f.out_proj)] + \
           [m for a in found.attentions for m in dict.fromkeys((a.q, a.k, a.v, a.o))]
    dup = sorted({m for m in mods if mods.count(m) > 1})
    if dup:
        raise ValueError(f"spec: projections {dup} belong to more than one FFN / attention (one dim each)")
    return found
