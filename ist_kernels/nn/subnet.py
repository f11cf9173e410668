"""An MLP of ReLU neurons trained as independent subnetworks (paper 001 §3.1, Algorithm 1).

The full model is paper 001's shallow network, generalised to ``depth`` hidden layers:

    f(W, x) = 1/√m · Σ_r a_r σ(⟨w_r, x⟩),   w_r ~ N(0, κ² I),  a_r ~ Unif{-1, +1} and fixed,

with m = ``width``. Layers after the first see their input multiplied by 1/√m (the same scaling,
so deeper layers keep the NTK parametrisation), their weights start N(0, 1). A subnetwork is a
set of neurons per hidden layer; its surrogate f_m (§3.1) keeps only those neurons, with the same
1/√m scaling. Evaluating the full model as the paper does (§4) multiplies each neuron's output by
the selection probability ξ: ``forward(x, keep=xi)``.

Parameters of a subnetwork are compact tensors: hidden weight rows of its neurons (and, from the
second layer on, the columns of the previous layer's neurons), bias entries of its neurons, and,
when the output layer trains, output columns of its last layer's neurons plus the shared output
bias. :meth:`SubnetMLP.extract_all` gathers every subnetwork's tensors through one
:func:`~ist_kernels.functional.slice_plan`; :meth:`SubnetMLP.aggregate_` writes them back through
one with ``reduce="mean"`` (a hidden-to-hidden weight, owned by rows x columns, is planned as the
product of its two index lists, never element by element): every entry becomes
the mean over the subnetworks that own it, entries that no subnetwork owns keep their value —
Algorithm 1 line 12 with η_r = N⊥_r / N_r.
"""
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as IF
from ..partition.plan import SlicePlan, TensorSlices
from ._init import draw_

__all__ = ["SubnetMLP", "CompactSubnetMLP", "CompactRound"]

Neurons = Union[None, Tensor, Sequence[Optional[Tensor]]]


class SubnetMLP(nn.Module):
    """Full model of independent subnetwork training: ``depth`` hidden layers of ``width`` ReLU
    neurons and an output layer of ``out_features`` (fixed ±1 weights unless ``train_output``).

    The constructor order is ``(in_features, width, depth, out_features)``, as :class:`GReLUMLP`
    (formerly ``(in_features, width, out_features, depth=1)``; a call that leaves
    ``out_features`` out raises a TypeError that says so).

    Args:
        bias: hidden layers have biases (zero at init); with ``train_output`` the output layer has
            a bias too, shared by every subnetwork. Paper 001 has none.
        train_output: train the output weights (and bias); paper 001 keeps a fixed.
        kappa: standard deviation of the first layer's weights (paper 001: w_r ~ N(0, κ² I)).
        generator: for the initialisation (see :meth:`reset_parameters`).
        device, dtype: factory kwargs, as torch.nn's (``device="meta"`` allocates nothing; then
            ``to_empty(device=...)`` and ``reset_parameters(generator)``).
    """

    def __init__(self, in_features: int, width: int, depth: Optional[int] = None, out_features: Optional[int] = None,
                 *, bias: bool = False, train_output: bool = False, kappa: float = 1.0,
                 generator: Optional[torch.Generator] = None, device=None, dtype=None):
        super().__init__()
        if depth is None or out_features is None:
            raise TypeError("SubnetMLP: depth and out_features are required; the order is "
                            "SubnetMLP(in_features, width, depth, out_features) (formerly (in_features, width, "
                            "out_features, depth=1))")
        if depth < 1 or width < 1 or in_features < 1 or out_features < 1:
            raise ValueError("SubnetMLP: in_features, width, depth and out_features must be >= 1, got "
                             f"{in_features}, {width}, {depth}, {out_features}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.width, self.depth, self.out_features = in_features, width, depth, out_features
        self.train_output = train_output
        self.kappa = kappa
        self.scale = 1.0 / math.sqrt(width)
        fan_in = [in_features] + [width] * (depth - 1)
        self.hidden_weights = nn.ParameterList(nn.Parameter(torch.empty(width, f, **factory)) for f in fan_in)
        self.hidden_biases = (nn.ParameterList(nn.Parameter(torch.empty(width, **factory)) for _ in fan_in)
                              if bias else None)
        a = torch.empty(out_features, width, **factory)
        if train_output:
            self.output_weight = nn.Parameter(a)
            self.output_bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        else:
            self.register_buffer("output_weight", a)
            self.output_bias = None
        self.reset_parameters(generator)

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Paper 001's initialisation: first-layer weights N(0, κ²), later hidden layers N(0, 1),
        biases zero, output weights Unif{-1, +1}.

        Drawn in place on the parameters' device from ``generator`` (default: that device's global
        generator). A generator on another device (e.g. a CPU one for a CUDA model: the same model
        on every machine) draws there and the values are copied. Nothing is drawn on ``meta``."""
        for l, w in enumerate(self.hidden_weights):
            draw_(w, lambda t, g: t.normal_(0.0, self.kappa if l == 0 else 1.0, generator=g), generator)
        draw_(self.output_weight, lambda t, g: t.copy_(t.bernoulli_(0.5, generator=g) * 2 - 1), generator)
        for b in list(self.hidden_biases or []) + [self.output_bias]:
            if b is not None:
                b.zero_()

    # ---- neurons
    def _neurons(self, neurons: Neurons, device=None) -> List[Optional[Tensor]]:
        """One index list (or None = all) per hidden layer, on ``device`` (default: the model's)."""
        if neurons is None or isinstance(neurons, Tensor):
            if isinstance(neurons, Tensor) and self.depth > 1:
                raise ValueError(f"SubnetMLP: with depth={self.depth} pass one index list per hidden layer")
            neurons = [neurons] * self.depth
        neurons = list(neurons)
        if len(neurons) != self.depth:
            raise ValueError(f"SubnetMLP: neurons must list {self.depth} index tensors (one per hidden layer), "
                             f"got {len(neurons)}")
        dev = self.hidden_weights[0].device if device is None else device
        return [None if n is None else n.to(dev, torch.int64) for n in neurons]

    # ---- forward
    def forward(self, x: Tensor, neurons: Neurons = None, keep: float = 1.0) -> Tensor:
        """The full model (``neurons=None``) or the subnetwork of ``neurons`` (one sorted int64
        index list per hidden layer, or one tensor when depth == 1), on the full-size parameters
        through :func:`~ist_kernels.functional.subnet_linear` (gradients land in the selected rows
        and columns only). ``keep`` multiplies every hidden neuron's output (paper 001 §4: ξ)."""
        neurons = self._neurons(neurons)
        h, cols = x, None
        for l, rows in enumerate(neurons):
            b = self.hidden_biases[l] if self.hidden_biases is not None else None
            h = F.relu(IF.subnet_linear(h, self.hidden_weights[l], b, rows, cols)) * (keep * self.scale)
            cols = rows
        return IF.subnet_linear(h, self.output_weight, self.output_bias, None, cols)

    def subnet_forward(self, x: Tensor, params: Sequence[Tensor], neurons: Neurons) -> Tensor:
        """The subnetwork of ``neurons`` computed from its compact parameters ``params`` (as
        returned by :meth:`extract`): costs what the subnetwork costs. Only the fixed output
        weight (when it does not train) is read from the model, which may otherwise be on meta."""
        neurons = self._neurons(neurons, x.device)
        it = iter(params)
        h = x
        for l in range(self.depth):
            w = next(it)
            b = next(it) if self.hidden_biases is not None else None
            h = F.relu(F.linear(h, w, b)) * self.scale
        if self.train_output:
            w = next(it)
            b = next(it) if self.output_bias is not None else None
            return F.linear(h, w, b)
        return IF.subnet_linear(h, self.output_weight, None, None, neurons[-1])

    def subnet_parameters(self) -> List[Tensor]:
        """The full-size parameters a subnetwork holds slices of, in the order of :meth:`extract`:
        per hidden layer its weight (and bias), then the output weight (and bias) if trained."""
        out: List[Tensor] = []
        for l in range(self.depth):
            out.append(self.hidden_weights[l])
            if self.hidden_biases is not None:
                out.append(self.hidden_biases[l])
        if self.train_output:
            out.append(self.output_weight)
            if self.output_bias is not None:
                out.append(self.output_bias)
        return out

    # ---- the slices of a subnetwork: (global tensor, dim, indices, compact shape)
    def _flat(self, name: str) -> bool:
        """A hidden-to-hidden weight: owned by rows x columns (a product; flat in :meth:`slice_plan`)."""
        return name.startswith("hidden_weights.") and name != "hidden_weights.0"

    def _layout(self, neurons: Neurons, device) -> List[Tuple[str, object, object, Tuple[int, ...]]]:
        """(name, dims, index, compact shape) of every tensor a subnetwork holds, in the order of
        :meth:`extract`, as the slice ops take them: a hidden-to-hidden weight is the product of its
        rows (this layer's neurons) and columns (the previous layer's), dims ``(0, 1)`` and index
        ``(rows, cols)``; the shared output bias by all its indices."""
        all_neurons = torch.arange(self.width, device=device)
        rows_l = [all_neurons if n is None else n for n in self._neurons(neurons, device)]
        out = []
        for l, rows in enumerate(rows_l):
            if l == 0:
                out.append(("hidden_weights.0", 0, rows, (len(rows), self.in_features)))
            else:
                cols = rows_l[l - 1]
                out.append((f"hidden_weights.{l}", (0, 1), (rows, cols), (len(rows), len(cols))))
            if self.hidden_biases is not None:
                out.append((f"hidden_biases.{l}", 0, rows, (len(rows),)))
        if self.train_output:
            out.append(("output_weight", 1, rows_l[-1], (self.out_features, len(rows_l[-1]))))
            if self.output_bias is not None:
                out.append(("output_bias", 0, torch.arange(self.out_features, device=device), (self.out_features,)))
        return out

    def _planned(self, neurons_list: Sequence[Neurons], device=None):
        """The round's :class:`~ist_kernels.ops.slices.PlannedSlices` over the model's parameters
        (products for hidden-to-hidden weights) and each segment's compact shape. Index lists built
        on ``device`` (default: the model's)."""
        device = self.hidden_weights[0].device if device is None else device
        full = dict(self.named_parameters())
        targets, dims, ids, indices, shapes = [], [], [], [], []
        for s, neurons in enumerate(neurons_list):
            for t, (name, dim, idx, shape) in enumerate(self._layout(neurons, device)):
                if s == 0:
                    targets.append(full[name].detach())
                    dims.append(dim)
                ids.append(t)
                indices.append(idx)
                shapes.append(shape)
        return targets, IF.slice_plan(targets, ids, indices, dims), shapes

    def product_plan(self, neurons_list: Sequence[Neurons]) -> SlicePlan:
        """The round as a :class:`~ist_kernels.partition.SlicePlan` on the parameters' own shapes
        (:meth:`product_spec`; indices on the CPU; the output bias is shared): a hidden-to-hidden
        weight (layer l >= 1) is the product of its rows and columns (``dim`` 0, ``col_dim`` 1),
        O(rows + cols). The model itself may live on the meta device."""
        cpu = torch.device("cpu")
        per = [self._layout(n, cpu) for n in neurons_list]
        tensors = []
        for t, (name, dim, _, _) in enumerate(per[0] if per else []):
            if name == "output_bias":
                tensors.append(TensorSlices(name, None))
            elif isinstance(dim, tuple):
                tensors.append(TensorSlices(name, dim[0], tuple(p[t][2][0] for p in per),
                                            tuple(p[t][2][1] for p in per), dim[1]))
            else:
                tensors.append(TensorSlices(name, dim, tuple(p[t][2] for p in per)))
        return SlicePlan(len(neurons_list), tuple(tensors))

    def product_spec(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor of :meth:`product_plan` (the parameters' shapes)."""
        names = set(self.compact_names())
        return {n: (tuple(p.shape), p.dtype) for n, p in self.named_parameters() if n in names}

    def slice_plan(self, neurons_list: Sequence[Neurons]):
        """The round as a :class:`~ist_kernels.partition.SlicePlan` with one dim per tensor
        (state-dict names, indices on the CPU; the output bias is shared): :meth:`product_plan`
        with every hidden-to-hidden weight stated on its flat view (index ``row * width + col``
        along dim 0; :meth:`TensorSlices.flat <ist_kernels.partition.TensorSlices.flat>`), as
        :meth:`slice_spec` and :meth:`exchange_view` give it: for consumers that read one dim per
        tensor (it costs rows x columns). The model itself may live on the meta device."""
        return self.product_plan(neurons_list).flat({n: v[0] for n, v in self.product_spec().items()})

    def slice_spec(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every tensor of :meth:`slice_plan`, hidden-to-hidden weights
        flat: the spec of an ``Exchange`` of those plans."""
        return {n: ((math.prod(shape),) if self._flat(n) else shape, dtype)
                for n, (shape, dtype) in self.product_spec().items()}

    def compact_layout(self, neurons: Neurons) -> List[Tuple[str, int, Tuple[int, ...]]]:
        """(name, dim of :meth:`slice_plan`, compact shape) of every tensor a subnetwork of
        ``neurons`` holds, in the order of :meth:`extract` (a hidden-to-hidden weight's plan dim is
        that of its flat view; its compact shape is rows x columns)."""
        return [(name, 0 if isinstance(dim, tuple) else dim, shape)
                for name, dim, _, shape in self._layout(neurons, torch.device("cpu"))]

    def compact_names(self) -> List[str]:
        """The names of the tensors a subnetwork holds, in the order of :meth:`extract`."""
        return [name for name, _, _, _ in self._layout(None, torch.device("cpu"))]

    def exchange_view(self, name: str, t: Tensor) -> Tensor:
        """A compact tensor of ``name`` as :meth:`slice_plan` states it (hidden-to-hidden weights flat)."""
        return t.reshape(-1) if self._flat(name) else t

    # ---- extract / aggregate (Algorithm 1 lines 5 and 11-13)
    def extract_all(self, neurons_list: Sequence[Neurons]) -> List[List[Tensor]]:
        """Compact copies of every subnetwork's parameters, in one planned gather for all tensors
        (a hidden-to-hidden weight's rows x columns from its two index lists)."""
        if len(neurons_list) == 0:
            return []
        targets, plan, _ = self._planned(neurons_list)
        segments = plan.gather(targets)
        per = len(segments) // len(neurons_list)
        return [segments[s * per:(s + 1) * per] for s in range(len(neurons_list))]

    def extract(self, neurons: Neurons) -> List[Tensor]:
        """Compact copies of the parameters of the subnetwork of ``neurons`` (Algorithm 1 line 5)."""
        return self.extract_all([neurons])[0]

    @torch.no_grad()
    def aggregate_(self, params_list: Sequence[Sequence[Tensor]], neurons_list: Sequence[Neurons]) -> None:
        """Write the subnetworks' compact parameters back (Algorithm 1 lines 11-13): every entry
        becomes the mean over the subnetworks that own it; entries no subnetwork owns are
        unchanged. One planned scatter for all tensors of all subnetworks."""
        if len(params_list) != len(neurons_list):
            raise ValueError(f"SubnetMLP.aggregate_: got {len(params_list)} parameter lists for "
                             f"{len(neurons_list)} subnetworks")
        if len(neurons_list) == 0:
            return
        targets, plan, shapes = self._planned(neurons_list)
        updates = [p.detach() for params in params_list for p in params]
        if len(updates) != len(shapes):
            raise ValueError(f"SubnetMLP.aggregate_: expected {len(shapes) // len(neurons_list)} tensors per "
                             "subnetwork (as extract returns)")
        for u, shape in zip(updates, shapes):
            if tuple(u.shape) != shape:
                raise ValueError(f"SubnetMLP.aggregate_: compact parameter of shape {tuple(u.shape)}, expected {shape}")
        plan.scatter_(targets, [u.contiguous() for u in updates], reduce="mean")

    # ---- a round on dense compact modules (issue 19 item 3)
    def compact(self, neurons_list: Sequence[Neurons]) -> "CompactRound":
        """The round of ``neurons_list`` (one entry per subnetwork) as dense compact modules: every
        subnetwork's parameters gathered once (one :func:`~ist_kernels.functional.slice_plan`
        gather for all tensors of all subnetworks), so its local steps run plain dense GEMMs with
        compact gradients; ``write_back()`` (or leaving the ``with`` block without an error) is the
        owner-averaged write-back of :meth:`aggregate_`, bit for bit. See :class:`CompactRound`."""
        return CompactRound(self, neurons_list)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, width={self.width}, depth={self.depth}, "
                f"out_features={self.out_features}, bias={self.hidden_biases is not None}, "
                f"train_output={self.train_output}")


class CompactSubnetMLP(nn.Module):
    """One subnetwork of a :class:`SubnetMLP` as a dense MLP on compact tensors: hidden layer l is
    ``relu(h W_lᵀ + b_l) / √m`` with ``W_l`` [neurons_l, neurons_{l-1}] (the input features for
    l = 0), the output layer ``h Aᵀ + c`` with A [out_features, neurons_L] (fixed, a buffer, unless
    the model trains its output). Its parameters are views of its :class:`CompactRound`'s buffer,
    so training them in place is what the round writes back."""

    def __init__(self, params: Sequence[Tensor], depth: int, scale: float, bias: bool, train_output: bool,
                 output_bias: bool, fixed_output: Optional[Tensor]):
        super().__init__()
        it = iter(params)
        self.scale = scale
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList() if bias else None
        for _ in range(depth):
            self.weights.append(nn.Parameter(next(it)))
            if bias:
                self.biases.append(nn.Parameter(next(it)))
        if train_output:
            self.output_weight = nn.Parameter(next(it))
            self.output_bias = nn.Parameter(next(it)) if output_bias else None
        else:
            self.register_buffer("output_weight", fixed_output)
            self.output_bias = None

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for l, w in enumerate(self.weights):
            h = F.relu(F.linear(h, w, self.biases[l] if self.biases is not None else None)) * self.scale
        return F.linear(h, self.output_weight, self.output_bias)


class CompactRound:
    """A round of :class:`SubnetMLP` subnetworks compacted once (``model.compact(neurons_list)``).

    ``modules[s]`` is subnetwork s as a :class:`CompactSubnetMLP` (dense, compact; parameters in
    the order of :meth:`SubnetMLP.extract`, as ``params[s]``); train them for the round's local
    steps, then ``write_back()``: one planned scatter (reduce="mean") of every subnetwork's
    parameters into the model, equal bit for bit to ``model.aggregate_(params, neurons_list)``.
    As a context manager it writes back on leaving the block without an exception.

    The plan (:func:`~ist_kernels.functional.slice_plan`) is built once, here; ``refresh()``
    gathers the model's current values into the same compact tensors again (the next round of the
    same partition: no new plan, no allocation). A fixed output layer is compacted once as well
    (its columns of the last layer's neurons), so no local step gathers along the contiguous dim.
    """

    def __init__(self, model: SubnetMLP, neurons_list: Sequence[Neurons]):
        if len(neurons_list) == 0:
            raise ValueError("SubnetMLP.compact: give at least one subnetwork")
        self.model = model
        device = model.hidden_weights[0].device
        self.neurons = [model._neurons(n, device) for n in neurons_list]
        # The plan is built from the index lists (a hidden-to-hidden weight's rows and columns, on
        # the model's device): O(rows + cols) per tensor.
        self._targets, self._plan, shapes = model._planned(self.neurons, device)
        per = len(shapes) // len(self.neurons)
        compact = self._plan.gather(self._targets)
        self.params = [compact[s * per:(s + 1) * per] for s in range(len(self.neurons))]
        fixed = [None] * len(self.neurons)
        if not model.train_output:
            last = [n[-1] if n[-1] is not None else torch.arange(model.width, device=device) for n in self.neurons]
            fixed = [model.output_weight.detach().index_select(1, cols) for cols in last]
        self.modules = [CompactSubnetMLP(p, model.depth, model.scale, model.hidden_biases is not None,
                                         model.train_output, model.output_bias is not None, a)
                        for p, a in zip(self.params, fixed)]

    def refresh(self) -> "CompactRound":
        """Gather the model's current values into the compact tensors again (same plan)."""
        self._plan.gather(self._targets)
        return self

    @torch.no_grad()
    def write_back(self) -> None:
        """Owner-averaged write-back of every subnetwork (Algorithm 1 lines 11-13), one scatter."""
        self._plan.scatter_(self._targets, reduce="mean")

    def __enter__(self) -> "CompactRound":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.write_back()
