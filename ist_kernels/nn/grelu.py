"""GReLU modules (paper 004): fixed-gate layers and the Gated ReLU MLP of §2.1.

A GReLU network trains layers W_1..W_L whose ReLU on/off pattern D_k is decided by a frozen random
network (C, Ψ_1..Ψ_L), independently of the trained weights (§2.1). The gates are one bit per
neuron (``ist_kernels.functional.pack_gates`` layout); the trained layers run through
``functional.gated_linear`` and the frozen network through ``functional.relu_gates``.
"""
import copy
import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import functional
from ._init import draw_, linear_init_

__all__ = ["GatedLinear", "GReLUMLP"]


def _words(num_features: int) -> int:
    return (num_features + 31) // 32


class GatedLinear(nn.Module):
    """y = (x Wᵀ + b) ⊙ G, with G the bit-packed gates ``[..., ceil(out_features/32)]`` int32
    (bit j of word w is output feature 32w+j): a trained GReLU layer D_k W_k (paper 004 §2.1).

    Parameters are initialised as ``nn.Linear``'s; :class:`GReLUMLP` re-initialises its layers
    as §2.1 says.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """As ``nn.Linear`` (the same draws), on the parameters' device, from ``generator``
        (default: the global one)."""
        linear_init_(self.weight, self.bias, generator)

    def forward(self, input: Tensor, gates: Tensor) -> Tensor:
        return functional.gated_linear(input, self.weight, gates, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class GReLUMLP(nn.Module):
    """The GReLU network of paper 004 §2.1 (Figure 1)::

        gate network (frozen):  z_0 = [C x]^+,   z_k = [Ψ_k z_{k-1}]^+,   D_k = diag([Ψ_k z_{k-1}]_+)
        trained network:        h_0 = z_0,       h_k = D_k W_k h_{k-1},   y = B h_L

    i.e. y = B D_L W_L ... D_1 W_1 D_0 C x (eq. 1). Only W_1..W_L (``layers``, :class:`GatedLinear`
    of width × width) are trained; C (width × in_features), Ψ_1..Ψ_L (``psi``, L × width × width)
    and B (out_features × width) are fixed buffers. Initialisation (§2.1), all independent:
    [W_k]_ij, [Ψ_k]_ij ~ N(0, 2/m), [C]_ij ~ N(0, 2/d_x), [B]_ij ~ N(0, 2/d_y).

    The paper's network has no biases (``bias=False``, the default). With ``bias=True`` every layer
    has one (zero-initialised), which is what :meth:`from_relu` needs for an ``nn.Linear`` network.

    ``forward(x)`` computes the gates through the frozen network layer by layer;
    ``cache_gates(x_all)`` stores the gates of a whole data set bit-packed (n × L × ceil(m/32) int32,
    the n × m × L lookup table of §4.4) and ``forward(x, index=sample_ids)`` reads them instead.
    """

    def __init__(self, in_features: int, width: int, depth: int, out_features: int, bias: bool = False,
                 device=None, dtype=None, generator: Optional[torch.Generator] = None):
        super().__init__()
        if min(in_features, width, out_features) < 1 or depth < 1:
            raise ValueError(f"GReLUMLP: in_features, width, out_features and depth must be >= 1, got "
                             f"{in_features}, {width}, {out_features}, {depth}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.width, self.depth, self.out_features = in_features, width, depth, out_features
        m = width
        # Frozen gate network and output layer (§2.1: "remain fixed during training").
        self.register_buffer("C", torch.empty(m, in_features, **factory))
        self.register_buffer("psi", torch.empty(depth, m, m, **factory))
        self.register_buffer("B", torch.empty(out_features, m, **factory))
        for name, shape in (("C_bias", (m,)), ("psi_bias", (depth, m)), ("B_bias", (out_features,))):
            self.register_buffer(name, torch.zeros(shape, **factory) if bias else None)
        # Trained layers W_1..W_L.
        self.layers = nn.ModuleList(GatedLinear(m, m, bias=bias, **factory) for _ in range(depth))
        # Gates of a cached data set, [n, L, ceil(m/32)] int32 (derived data: not in the state dict).
        self.register_buffer("gate_cache", None, persistent=False)
        self.reset_parameters(generator)

    # ---- initialisation (§2.1)
    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """§2.1's initialisation, drawn on the module's device from ``generator`` (default: the
        global one; a generator on another device draws there and the values are copied); the
        gate cache is dropped."""
        m, d_x, d_y = self.width, self.in_features, self.out_features

        def normal_(t: Tensor, var: float) -> None:
            draw_(t, lambda u, g: u.normal_(0.0, math.sqrt(var), generator=g), generator)

        for layer in self.layers:
            normal_(layer.weight, 2.0 / m)
            if layer.bias is not None:
                layer.bias.zero_()
        normal_(self.psi, 2.0 / m)
        normal_(self.C, 2.0 / d_x)
        normal_(self.B, 2.0 / d_y)
        for b in (self.C_bias, self.psi_bias, self.B_bias):
            if b is not None:
                b.zero_()
        self.gate_cache = None

    # ---- gates
    @torch.no_grad()
    def compute_gates(self, x: Tensor) -> Tensor:
        """Gates D_1..D_L of the frozen network for inputs ``x [..., in_features]``:
        int32 ``[..., L, ceil(width/32)]``."""
        z, _ = functional.relu_gates(x, self.C, self.C_bias)
        gates = []
        for k in range(self.depth):
            z, g = functional.relu_gates(z, self.psi[k], None if self.psi_bias is None else self.psi_bias[k])
            gates.append(g)
        return torch.stack(gates, dim=-2)

    @torch.no_grad()
    def cache_gates(self, x_all: Tensor) -> Tensor:
        """Compute and store the gates of a whole data set ``x_all [n, in_features]`` (§4.4: the
        activations are fixed, so the n × m × L binary table is made once). Sample i's gates are
        then read by ``forward(x, index=...)`` with i in ``index``. Returns the cache."""
        if x_all.dim() != 2 or x_all.shape[-1] != self.in_features:
            raise ValueError(f"GReLUMLP.cache_gates: x_all must be [n, {self.in_features}], "
                             f"got {tuple(x_all.shape)}")
        self.gate_cache = self.compute_gates(x_all).contiguous()
        return self.gate_cache

    def _check_index(self, x: Tensor, index: Tensor) -> None:
        cache = self.gate_cache
        if cache is None:
            raise RuntimeError("GReLUMLP.forward: index was given but no gates are cached; call cache_gates(x_all) first")
        if index.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"GReLUMLP.forward: index must be an integer tensor of sample ids, got {index.dtype}")
        if index.device != cache.device:
            raise ValueError(f"GReLUMLP.forward: index is on {index.device} but the gate cache is on {cache.device}")
        if tuple(index.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"GReLUMLP.forward: index must have x's batch shape {tuple(x.shape[:-1])}, "
                             f"got {tuple(index.shape)}")
        if not torch.compiler.is_compiling() and index.numel() > 0:
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= cache.shape[0]:
                raise IndexError(f"GReLUMLP.forward: index must lie in [0, {cache.shape[0]}) (cached samples), "
                                 f"got values in [{lo}, {hi}]")

    # ---- forward
    def forward(self, x: Tensor, index: Optional[Tensor] = None) -> Tensor:
        """y = B D_L W_L ... D_1 W_1 [C x]^+ (eq. 1). Without ``index`` the gates come from the frozen
        network; with ``index`` (sample ids into the cached data set, shape ``x.shape[:-1]``) they are
        read from the cache made by :meth:`cache_gates`."""
        h, g0 = functional.relu_gates(x, self.C, self.C_bias)  # h_0 = z_0 = D_0 C x
        if x.requires_grad:  # relu_gates has no gradient; D_0 (C x) is the same h_0, differentiable in x
            h = functional.gated_linear(x, self.C, g0, self.C_bias)
        if index is None:
            z = h
            for k, layer in enumerate(self.layers):
                z, g = functional.relu_gates(z, self.psi[k], None if self.psi_bias is None else self.psi_bias[k])
                h = layer(h, g)
        else:
            self._check_index(x, index)
            for k, layer in enumerate(self.layers):
                h = layer(h, self.gate_cache[:, k][index])
        return nn.functional.linear(h, self.B, self.B_bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, width={self.width}, depth={self.depth}, "
                f"out_features={self.out_features}, bias={self.C_bias is not None}, "
                f"cached_samples={0 if self.gate_cache is None else self.gate_cache.shape[0]}")

    # ---- ReLU <-> GReLU (§4.1)
    @classmethod
    def from_relu(cls, relu_mlp: nn.Sequential) -> "GReLUMLP":
        """Train an existing ReLU MLP as a GReLU network (§4.1, Remark 4): its activation pattern is
        fixed by Ψ_k ← W_k, and the trained W_k start from the same weights, so at step 0 the GReLU
        network computes exactly the ReLU network's outputs.

        ``relu_mlp`` must be ``nn.Sequential(Linear(d, m), ReLU(), [Linear(m, m), ReLU()] * L,
        Linear(m, d_y))`` with L >= 1; the first Linear becomes C, the last B. Biases are carried
        over when the Linear layers have them (all or none)."""
        mods = list(relu_mlp)
        linears = mods[0::2]
        relus = mods[1::2]
        shape_ok = (len(mods) >= 5 and len(mods) % 2 == 1
                    and all(isinstance(m, nn.Linear) for m in linears)
                    and all(isinstance(m, nn.ReLU) for m in relus))
        if not shape_ok:
            raise ValueError("GReLUMLP.from_relu: relu_mlp must be nn.Sequential(Linear, ReLU, Linear, ReLU, ..., "
                             f"Linear) with at least 3 Linear layers, got {[type(m).__name__ for m in mods]}")
        first, hidden, last = linears[0], linears[1:-1], linears[-1]
        m = first.out_features
        for lin in hidden:
            if (lin.in_features, lin.out_features) != (m, m):
                raise ValueError(f"GReLUMLP.from_relu: hidden Linear layers must all be {m} x {m} (one width), "
                                 f"got {lin.out_features} x {lin.in_features}")
        if last.in_features != m:
            raise ValueError(f"GReLUMLP.from_relu: the last Linear must read {m} features, got {last.in_features}")
        has_bias = {lin.bias is not None for lin in linears}
        if len(has_bias) != 1:
            raise ValueError("GReLUMLP.from_relu: either every Linear layer has a bias or none does")
        bias = has_bias.pop()
        w = first.weight
        net = cls(first.in_features, m, len(hidden), last.out_features, bias=bias, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            net.C.copy_(first.weight)
            net.B.copy_(last.weight)
            for k, lin in enumerate(hidden):
                net.psi[k].copy_(lin.weight)  # Ψ_k ← W_k
                net.layers[k].weight.copy_(lin.weight)
            if bias:
                net.C_bias.copy_(first.bias)
                net.B_bias.copy_(last.bias)
                for k, lin in enumerate(hidden):
                    net.psi_bias[k].copy_(lin.bias)
                    net.layers[k].bias.copy_(lin.bias)
        return net

    @torch.no_grad()
    def _features(self, x: Tensor, gates: Tensor, dtype: torch.dtype) -> List[Tensor]:
        """h_0..h_L of the trained network for fixed gates ``[..., L, W]``, computed in ``dtype``."""
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        h, _ = functional.relu_gates(x.to(dtype), cast(self.C), cast(self.C_bias))
        feats = [h]
        for k, layer in enumerate(self.layers):
            h = functional.gated_linear(h, cast(layer.weight), gates[..., k, :].contiguous(), cast(layer.bias))
            feats.append(h)
        return feats

    @torch.no_grad()
    def to_relu(self, x_train: Tensor) -> Tuple[nn.Sequential, float]:
        """The equivalent ReLU network of Theorem 2 (§4.1, proof in §10.7), fitted on ``x_train [n, d]``.

        It keeps C and B and replaces each W_k by W̃_k so that the ReLU network's pre-activation of
        layer k equals the GReLU feature h_k on every training sample (10.7, eq. 48):
        W̃_k ReLU(u_{k-1}) = h_k, solved layer by layer by least squares in float64 (minimum-norm
        solution, the pseudo-inverse of eq. 49). B reads layer L's pre-activation u_L = h_L, so the
        returned network is ``Sequential(Linear C, ReLU, Linear W̃_1, ReLU, ..., Linear W̃_L, Linear B)``
        (no ReLU between W̃_L and B). The fit is exact (round-off level) when ReLU(h_{k-1}) over the n
        samples has full row rank, which needs n ≤ width; only about a quarter of its entries are
        nonzero, so in practice n should stay clearly below the width (e.g. n=100, m=512 is exact).

        Returns the network (this module's dtype and device) and the largest deviation of its
        outputs from this network's on ``x_train``, max_i ‖ŷ_i − y_i‖ / rms_i ‖y_i‖, both evaluated in
        float64 with the gates this network uses."""
        if x_train.dim() != 2 or x_train.shape[-1] != self.in_features:
            raise ValueError(f"GReLUMLP.to_relu: x_train must be [n, {self.in_features}], got {tuple(x_train.shape)}")
        f64 = torch.float64
        gates = self.compute_gates(x_train)  # the gates forward() uses (computed in this module's dtype)
        feats = [h.cpu() for h in self._features(x_train, gates, f64)]
        has_bias = self.C_bias is not None
        dtype, device = self.C.dtype, self.C.device

        def linear(weight: Tensor, bias: Optional[Tensor]) -> nn.Linear:
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=device, dtype=dtype)
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
            return lin

        mods: List[nn.Module] = [linear(self.C, self.C_bias), nn.ReLU()]
        r = feats[0]  # ReLU(u_0) = [C x]^+ = h_0
        for k in range(1, self.depth + 1):
            a = torch.cat([r, torch.ones(r.shape[0], 1, dtype=f64)], 1) if has_bias else r
            sol = torch.linalg.lstsq(a, feats[k], driver="gelsd").solution  # [m(+1), m] = [W̃_k | b̃_k]ᵀ
            w_k, b_k = (sol[:-1].T, sol[-1]) if has_bias else (sol.T, None)
            mods.append(linear(w_k, b_k))
            u = a @ sol
            if k < self.depth:
                mods.append(nn.ReLU())
                r = u.clamp_min(0)
        mods.append(linear(self.B, self.B_bias))
        relu_net = nn.Sequential(*mods)

        y_grelu = nn.functional.linear(feats[-1], self.B.to("cpu", f64), None if self.B_bias is None else self.B_bias.to("cpu", f64))
        y_relu = copy.deepcopy(relu_net).to("cpu", f64)(x_train.to("cpu", f64))
        scale = y_grelu.norm(dim=-1).pow(2).mean().sqrt().clamp_min(torch.finfo(f64).tiny)
        max_rel_dev = ((y_relu - y_grelu).norm(dim=-1).max() / scale).item() if x_train.shape[0] else 0.0
        return relu_net, max_rel_dev
