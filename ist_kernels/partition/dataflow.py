"""Which modules read a projection's output before the next projection: the data flow inside one
module, for the FFNs whose projections do not sit alone in a module of their own (a decoder layer
holding ``fc1`` / ``fc2`` beside its attention and norms, as OPT, BART, Whisper and
``nn.TransformerEncoderLayer`` are written; an ``nn.Sequential`` with a norm between its projections).

The flow of a module is read, first that works:

- an ``nn.Sequential`` (its own forward): each child reads the previous child's output;
- a ``torch.fx`` symbolic trace of its forward: nothing is run; the arguments after the first
  required ones take their defaults; a module holding parameters (projections, norms, an
  attention found already) is a leaf, as are torch.nn's own modules;
- where the forward cannot be traced symbolically (control flow on a tensor's shape:
  ``nn.TransformerEncoderLayer``'s fast-path checks), one forward of a sample of shape
  ``[2, 3, d]`` (``d``: a width its projections read) on the meta device
  (``torch.func.functional_call`` with meta copies of its parameters and buffers: the model, its
  buffers and the random number generators are untouched, and every rank reads the same flow
  whatever device the model is on; attributes the forward sets are put back). Every torch function and method called outside the leaf
  modules is recorded (a ``TorchFunctionMode``) with the earlier outputs it read.

In that flow an FFN is an output projection B and the input projections A (one, or several of one
shape whose outputs are multiplied: a gated FFN) that B reads through nothing but

- ops that act on each hidden unit alone: activations, dropout, dtype casts, sums and products of
  such values with each other or with constants (torch.nn modules, functions or tensor methods);
- norms of the ``h`` hidden units: ``nn.LayerNorm`` / ``nn.RMSNorm`` over ``h``,
  ``nn.BatchNorm1d`` of ``h``, or any other module whose parameters are vectors of ``h``
  (their entries go with the units: see :class:`.structure.FFN`);

where nothing else reads A's outputs or any value between (the hidden units do not escape), and
A and B are each called once. Where a projection's outputs do reach the next one otherwise (a
softmax, a reshape, a parameter read between them), the reason is kept as a note for the error.
"""
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

#: torch.nn modules acting on each unit alone (no parameters)
ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
    nn.CELU, nn.Softplus, nn.Softsign, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardshrink,
    nn.Softshrink, nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Dropout, nn.AlphaDropout, nn.Identity,
)
#: functions / tensor methods of one tensor acting on each unit alone (names, in-place and
#: reflected spellings folded: ``relu_``, ``__rmul__``)
UNARY = frozenset((
    "relu", "relu6", "gelu", "silu", "mish", "tanh", "sigmoid", "elu", "selu", "celu", "leaky_relu",
    "softplus", "softsign", "hardswish", "hardsigmoid", "hardtanh", "logsigmoid", "tanhshrink", "softshrink",
    "hardshrink", "threshold", "dropout", "alpha_dropout", "feature_alpha_dropout", "neg", "abs", "exp",
    "erf", "square", "sqrt", "rsqrt", "clamp", "clip", "to", "float", "half", "bfloat16", "double",
    "type", "type_as", "contiguous", "clone",
))
#: of those, the ones whose other tensor arguments give only a dtype or device
CASTS = frozenset(("to", "type", "type_as"))
#: functions / tensor methods of several values acting on each unit alone
BINARY = frozenset(("mul", "add", "sub", "div", "truediv", "pow", "maximum", "minimum"))
_FOLD = {"rmul": "mul", "radd": "add", "rsub": "sub", "rtruediv": "truediv", "rdiv": "div", "rpow": "pow",
         "imul": "mul", "iadd": "add", "isub": "sub", "itruediv": "truediv", "idiv": "div", "ipow": "pow",
         "multiply": "mul", "subtract": "sub", "divide": "div", "true_divide": "truediv"}


@dataclass(eq=False)
class Op:
    """One step of a module's data flow: ``kind`` is ``input`` (an argument of the forward),
    ``tensor`` (a tensor read from elsewhere: a parameter, a buffer), ``module`` (a leaf module
    called: ``target`` the module, ``name`` its name under the traced module), ``call`` (a function
    or tensor method: ``target`` its name) or ``output``; ``args``: the Ops and constants it reads,
    positional first."""

    kind: str
    target: Any = None
    args: List[Any] = field(default_factory=list)
    name: str = ""

    def describe(self) -> str:
        if self.kind == "module":
            return f"{self.name} ({type(self.target).__name__})"
        if self.kind == "call":
            return f"{self.target}()"
        return f"{self.kind} {self.target}" if self.target else self.kind


@dataclass
class Pair:
    """An FFN found in the flow: names (under the traced module) of the input projections, the
    output projection and the norms between them."""

    in_projs: Tuple[str, ...]
    out_proj: str
    norms: Tuple[str, ...]


class NoFlow(Exception):
    """The flow of a module could not be read."""


def op_name(fn: Any) -> str:
    """A function's or method's name with in-place and reflected spellings folded."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", "") or ""
    name = name.strip("_")
    return _FOLD.get(name, name)


def _flat(x: Any, out: List[Any]) -> List[Any]:
    if isinstance(x, (tuple, list)):
        for v in x:
            _flat(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _flat(v, out)
    elif isinstance(x, slice):
        _flat((x.start, x.stop, x.step), out)
    else:
        out.append(x)
    return out


# ---------------------------------------------------------------- reading the flow

def sequential_flow(seq: nn.Sequential) -> List[Op]:
    """An ``nn.Sequential``'s flow (its own forward): child ``i`` reads child ``i - 1``'s output
    (a nested Sequential's children in line)."""
    x = Op("input", "input")
    ops = [x]

    def chain(s: nn.Sequential, prefix: str, x: Op) -> Op:
        for k, m in s._modules.items():
            if m is None:
                continue
            if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
                x = chain(m, f"{prefix}{k}.", x)  # a nested Sequential: its children in line
            else:
                x = Op("module", m, [x], f"{prefix}{k}")
                ops.append(x)
        return x

    ops.append(Op("output", None, [chain(seq, "", x)]))
    return ops


def _required(module: nn.Module) -> Tuple[Callable, int]:
    """The forward (decorators unwrapped) and its number of required positional arguments."""
    raw = inspect.unwrap(type(module).forward)
    params = list(inspect.signature(raw).parameters.values())[1:]
    n = sum(1 for p in params if p.default is p.empty and
            p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    if n < 1:
        raise NoFlow(f"{type(module).__name__}.forward takes no required argument")
    return raw, n


def fx_flow(module: nn.Module, leaf: Callable[[nn.Module], bool]) -> List[Op]:
    """The flow of ``module``'s forward from a ``torch.fx`` symbolic trace (its required arguments
    are placeholders, the others take their defaults); ``leaf(m)``: a module not entered."""
    import torch.fx as fx

    raw, n = _required(module)
    if n > 4:
        raise NoFlow(f"{type(module).__name__}.forward takes {n} required arguments")

    # a root whose forward calls the module's undecorated forward with n placeholders (a decorator's
    # (*args, **kwargs) wrapper cannot be traced); the module is its child "m"
    def f1(self, a):
        return raw(self.m, a)

    def f2(self, a, b):
        return raw(self.m, a, b)

    def f3(self, a, b, c):
        return raw(self.m, a, b, c)

    def f4(self, a, b, c, d):
        return raw(self.m, a, b, c, d)

    Root = type("_FlowRoot", (nn.Module,), {"forward": (f1, f2, f3, f4)[n - 1]})
    root = Root()
    root.m = module

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return m is not module and leaf(m)

    try:
        graph = Tracer().trace(root)
    except Exception as e:  # noqa: BLE001 (any failure of the user's forward under tracing)
        raise NoFlow(f"torch.fx could not trace {type(module).__name__}.forward ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
    ops: Dict[Any, Op] = {}
    out = []

    def ref(v):
        return ops[v] if isinstance(v, fx.Node) else v

    for node in graph.nodes:
        args = [ref(v) for v in _flat((node.args, node.kwargs), [])]
        if node.op == "placeholder":
            op = Op("input", node.target)
        elif node.op == "get_attr":
            op = Op("tensor", node.target)
        elif node.op == "call_module":
            name = node.target[2:] if node.target.startswith("m.") else node.target
            op = Op("module", root.get_submodule(node.target), args, name)
        elif node.op in ("call_function", "call_method"):
            op = Op("call", op_name(node.target), args)
        else:
            op = Op("output", None, args)
        ops[node] = op
        out.append(op)
    return out


def run_flow(module: nn.Module, leaf: Callable[[nn.Module], bool], widths: Sequence[int]) -> List[Op]:
    """The flow of one forward of ``module`` on a meta sample ``[2, 3, d]`` (the first of
    ``widths`` that runs), recorded outside the leaf modules."""
    from torch.func import functional_call
    from torch.overrides import TorchFunctionMode

    _, n = _required(module)
    if n != 1:
        raise NoFlow(f"{type(module).__name__}.forward takes {n} required arguments (one sample is tried)")
    named = dict(module.named_parameters())
    named.update(module.named_buffers())
    meta = {k: torch.empty_like(v, device="meta") for k, v in named.items()}
    dtype = next((v.dtype for v in named.values() if v.is_floating_point()), torch.get_default_dtype())

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.depth = 0
            self.ops: List[Op] = []
            self.of: Dict[int, Op] = {}
            self.keep: List[Any] = []  # every tensor seen stays alive: ids are not reused

        def ref(self, v):
            if not isinstance(v, torch.Tensor):
                return v
            op = self.of.get(id(v))
            if op is None:
                op = self.of[id(v)] = Op("tensor", "")
                self.keep.append(v)
                self.ops.append(op)
            return op

        def put(self, op, out):
            self.ops.append(op)
            for t in _flat(out, []):
                if isinstance(t, torch.Tensor):
                    self.of[id(t)] = op
                    self.keep.append(t)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if self.depth == 0 and any(isinstance(t, torch.Tensor) for t in _flat(out, [])):
                self.put(Op("call", op_name(func), [self.ref(v) for v in _flat((args, kwargs or {}), [])]), out)
            return out

    rec = Recorder()
    handles = []

    def hook_leaves(m: nn.Module, prefix: str) -> None:
        for k, c in m._modules.items():
            if c is None:
                continue
            name = f"{prefix}{k}"
            if not leaf(c):
                hook_leaves(c, f"{name}.")
                continue
            pending: List[List[Any]] = []

            def pre(mod, args, kwargs, pending=pending):
                if rec.depth == 0:
                    pending.append([rec.ref(v) for v in _flat((args, kwargs), [])])
                rec.depth += 1

            def post(mod, args, kwargs, out, pending=pending, name=name):
                rec.depth -= 1
                if rec.depth == 0:
                    rec.put(Op("module", mod, pending.pop(), name), out)

            handles.append(c.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            handles.append(c.register_forward_hook(post, with_kwargs=True, always_call=True))

    hook_leaves(module, "")
    errors = []
    try:
        for d in dict.fromkeys(widths):
            rec.ops, rec.of, rec.keep, rec.depth = [], {}, [], 0
            x = torch.empty(2, 3, d, dtype=dtype, device="meta")
            rec.of[id(x)] = first = Op("input", "input")
            rec.ops.append(first)
            rec.keep.append(x)
            try:  # tensors the forward creates without a device (a mask) are meta too
                with torch.no_grad(), torch.device("meta"), rec:
                    out = functional_call(module, meta, (x,))
            except Exception as e:  # noqa: BLE001 (any failure of the user's forward on the sample)
                errors.append(f"width {d}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            rec.ops.append(Op("output", None, [rec.ref(t) for t in _flat(out, [])]))
            return rec.ops
    finally:
        for h in handles:
            h.remove()
    raise NoFlow(f"one forward of {type(module).__name__} on a sample [2, 3, d] failed ({'; '.join(errors)})")


# ---------------------------------------------------------------- FFNs in a flow

def unit_module(m: nn.Module, h: int) -> bool:
    """``m`` may sit between an FFN's projections as a norm of its ``h`` hidden units: a LayerNorm /
    RMSNorm over ``h``, a BatchNorm1d of ``h``, or a module without children whose parameters and
    buffers are vectors of ``h`` (0-dim buffers allowed: BatchNorm's counter)."""
    if isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return tuple(m.normalized_shape) == (h,)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return isinstance(m, nn.BatchNorm1d) and m.num_features == h
    if m._modules:
        return False
    ps = [p for p in m._parameters.values() if p is not None]
    bs = [b for k, b in m._buffers.items() if b is not None and k not in m._non_persistent_buffers_set]
    return bool(ps) and all(p.dim() == 1 and p.shape[0] == h for p in ps) and \
        all(b.dim() == 0 or (b.dim() == 1 and b.shape[0] == h) for b in bs)


def call_counts(ops: List[Op]) -> Dict[str, int]:
    """How many times each leaf module is called in a flow."""
    calls: Dict[str, int] = {}
    for op in ops:
        if op.kind == "module":
            calls[op.name] = calls.get(op.name, 0) + 1
    return calls


def free_projections(ops: List[Op], projection, free: Set[str]) -> Callable[[Any], Optional[Tuple[int, int, str]]]:
    """``proj(op)``: the projection's ``(in, out, kind)`` where ``op`` calls a projection named in
    ``free`` that is called once in the flow, else None."""
    calls = call_counts(ops)

    def proj(op: Any) -> Optional[Tuple[int, int, str]]:
        if isinstance(op, Op) and op.kind == "module" and op.name in free and calls[op.name] == 1:
            return projection(op.target)
        return None
    return proj


def find_pairs(ops: List[Op], projection: Callable[[nn.Module], Optional[Tuple[int, int, str]]],
               free: Set[str]) -> Tuple[List[Pair], List[str]]:
    """The FFNs of a flow among the projections named in ``free`` (not yet in an FFN or attention),
    and notes on the projections whose outputs reach the next projection otherwise."""
    users: Dict[int, List[Op]] = {}
    for op in ops:
        for a in op.args:
            if isinstance(a, Op):
                users.setdefault(id(a), []).append(op)
    calls = call_counts(ops)
    proj = free_projections(ops, projection, free)

    pairs: List[Pair] = []
    notes: List[str] = []
    taken: Set[str] = set()
    for b in ops:
        pb = proj(b)
        if pb is None or not b.args or not isinstance(b.args[0], Op) or b.name in taken:
            continue
        h = pb[0]
        sources: List[Op] = []
        path: Dict[int, Op] = {}
        norms: List[str] = []
        why = None
        stack = [b.args[0]]
        while stack and why is None:
            n = stack.pop()
            if id(n) in path or any(n is s for s in sources):
                continue
            if proj(n) is not None:
                sources.append(n)
                continue
            path[id(n)] = n
            first = n.args[0] if n.args else None
            tensors = [a for a in n.args if isinstance(a, Op)]
            if n.kind == "module" and isinstance(n.target, ELEMENTWISE_MODULES) and isinstance(first, Op):
                stack.append(first)
            elif n.kind == "module" and unit_module(n.target, h) and isinstance(first, Op) and calls[n.name] == 1:
                norms.append(n.name)
                stack.append(first)
            elif n.kind == "call" and n.target in UNARY and isinstance(first, Op) and \
                    (n.target in CASTS or all(a is first for a in tensors)):
                stack.append(first)
            elif n.kind == "call" and n.target in BINARY and tensors:
                stack.extend(tensors)
            elif n.kind == "tensor":
                why = "a parameter or buffer is read between them"
            elif n.kind == "input":
                why = "the module's input is read between them"
            else:
                why = f"{n.describe()} is not elementwise per hidden unit nor a norm of the {h} units"
        if why is None and not sources:
            continue  # b is the first projection of its path
        if why is not None:
            ups = _upstream_projections(b, proj)
            if ups:
                notes.append(f"{', '.join(ups)} -> {b.name}: {why}")
            continue
        shapes = {projection(a.target)[:2] for a in sources}
        names = [a.name for a in sources]
        if len(shapes) != 1 or next(iter(shapes))[1] != h:
            notes.append(f"{', '.join(names)} -> {b.name}: the input projections' shapes {sorted(shapes)} "
                         f"are not one shape with {h} outputs")
            continue
        inside = set(path) | {id(a) for a in sources}
        leak = next((u for n in [*path.values(), *sources] for u in users.get(id(n), ())
                     if u is not b and id(u) not in inside), None)
        if leak is not None:
            notes.append(f"{', '.join(names)} -> {b.name}: the hidden values are also read by {leak.describe()}")
            continue
        if taken & {*names, b.name}:
            continue  # a projection already in the previous pair (a chain of FFNs: the first takes it)
        order = {op.name: i for i, op in enumerate(ops) if op.kind == "module"}
        pairs.append(Pair(tuple(sorted(names, key=order.get)), b.name, tuple(sorted(norms, key=order.get))))
        taken |= {*names, b.name}
    return pairs, notes


def _upstream_projections(b: Op, proj) -> List[str]:
    """The names of the projections (``proj(op)`` not None) whose outputs reach ``b``'s inputs
    without passing another projection."""
    return sorted(op.name for op in upstream(b, proj))


def upstream(b: Op, proj) -> List[Op]:
    """The projection ops (``proj(op)`` not None) whose outputs reach ``b``'s inputs without
    passing another projection, in flow order of discovery."""
    seen, found, stack = set(), [], list(a for a in b.args if isinstance(a, Op))
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if proj(n) is not None:
            found.append(n)
            continue
        stack.extend(a for a in n.args if isinstance(a, Op))
    return found


# ---------------------------------------------------------------- one module

def read_flow(module: nn.Module, leaf: Callable[[nn.Module], bool], widths: Sequence[int]) -> List[Op]:
    """``module``'s flow, first that works: an ``nn.Sequential``'s, a torch.fx trace, one forward
    of a meta sample (see the module doc); :class:`NoFlow` saying why none did."""
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        return sequential_flow(module)
    why = []
    # a forward may set attributes (a cache, a mask): whatever it set while read is put back
    saved = [(m, m.__dict__.copy()) for m in module.modules()]
    try:
        for read in (lambda: fx_flow(module, leaf), lambda: run_flow(module, leaf, widths)):
            try:
                return read()
            except NoFlow as e:
                why.append(str(e))
    finally:
        for m, d in saved:
            if m.__dict__ != d:
                m.__dict__.clear()
                m.__dict__.update(d)
    raise NoFlow("; ".join(why))


_CACHE: "weakref.WeakKeyDictionary[nn.Module, Tuple[Any, Any]]" = weakref.WeakKeyDictionary()


def remembered(module: nn.Module, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered for ``module`` while ``key`` and the module's structure (its
    modules' names, classes, modes and parameter shapes) stay the same. The value must not hold
    ``module``."""
    key = (key, tuple((k, type(m), m.training, tuple((a, tuple(p.shape), p.device.type)
                                                     for a, p in m._parameters.items() if p is not None))
                      for k, m in module.named_modules()))
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = compute()
    try:
        _CACHE[module] = (key, value)
    except TypeError:  # a module that cannot be weakly referenced: not remembered
        pass
    return value
