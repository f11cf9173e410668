# ---- Filter distance between rankings of filters (paper 000 §3.1, Figure 1) ---------------------
from typing import Dict as _Dict, Mapping as _Mapping, Optional as _Optional, Sequence as _Sequence, Union as _Union

import torch as _torch
from torch import Tensor as _Tensor, nn as _nn


def _keep_count(keep, n: int, who: str) -> int:
    if keep is None:
        return n
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        raise ValueError(f"{who}: keep must be None, an int count or a float fraction, got {keep!r}")
    if isinstance(keep, float):
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"{who}: a fractional keep must be in (0, 1], got {keep}")
        return max(1, int(keep * n)) if n else 0
    if not 1 <= keep <= n:
        raise ValueError(f"{who}: keep must be in [1, {n}] (the number of filters), got {keep}")
    return keep


def filter_distance(norms_a: _Tensor, norms_b: _Tensor, keep: _Optional[_Union[int, float]] = None) -> float:
    """Filter distance (paper 000 §3.1) from the ranking of filters by ``norms_a`` to their ranking
    by ``norms_b`` (rank 1 = largest norm, ties to the lower index):
    ``sum_i (1/i) |ln i - ln sigma(i)|`` over the positions i of ranking a, sigma(i) the position
    in ranking b of a's i-th filter. With ``keep`` (a count l, or a fraction of the filters) only
    the top-l lists are compared and a filter of a's list missing from b's scores
    ``|ln(l+1) - ln i|``. Not normalised (the paper gives no normalisation); 0 iff the (top)
    rankings agree."""
    who = "filter_distance"
    a = _torch.as_tensor(norms_a).detach()
    b = _torch.as_tensor(norms_b).detach()
    if a.dim() != 1 or a.shape != b.shape:
        raise ValueError(f"{who}: norms_a and norms_b must be 1-D of the same length, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        raise ValueError(f"{who}: norms must be floating point, got {a.dtype} and {b.dtype}")
    if bool(_torch.isnan(a).any()) or bool(_torch.isnan(b).any()):
        raise ValueError(f"{who}: norms contain NaN")
    n = a.shape[0]
    if n == 0:
        return 0.0
    l = _keep_count(keep, n, who)
    a = a.double().cpu()
    b = b.double().cpu()
    order_a = _torch.argsort(a, descending=True, stable=True)
    order_b = _torch.argsort(b, descending=True, stable=True)
    rank_b = _torch.empty(n, dtype=_torch.float64)
    rank_b[order_b] = _torch.arange(1, n + 1, dtype=_torch.float64)
    i = _torch.arange(1, l + 1, dtype=_torch.float64)
    sigma = rank_b[order_a[:l]].clamp(max=l + 1)  # outside b's top-l list: l + 1
    return float(((i.log() - sigma.log()).abs() / i).sum())


def _conv_weights(model_or_state) -> _Dict[str, _Tensor]:
    sd = model_or_state.state_dict() if isinstance(model_or_state, _nn.Module) else model_or_state
    if not isinstance(sd, _Mapping):
        raise ValueError(f"expected an nn.Module or a state_dict, got {type(model_or_state).__name__}")
    return {k: v for k, v in sd.items() if k.endswith("weight") and isinstance(v, _Tensor) and v.dim() == 4}


def layer_filter_distances(a, b, keep: _Optional[_Union[int, float]] = None,
                           layers: _Optional[_Sequence[str]] = None) -> _Dict[str, float]:
    """Filter distance per conv layer between two models or state_dicts (checkpoints): for every
    4-D ``*weight`` both hold with the same shape (or the ``layers`` named), the distance from the
    ranking of its filters' L2 norms in ``a`` to that in ``b``."""
    wa, wb = _conv_weights(a), _conv_weights(b)
    names = [k for k in wa if k in wb and wa[k].shape == wb[k].shape] if layers is None else list(layers)
    out = {}
    for k in names:
        if k not in wa or k not in wb or wa[k].shape != wb[k].shape:
            raise ValueError(f"layer_filter_distances: conv weight {k!r} missing or of different "
                             f"shapes in the two models")
        out[k] = filter_distance(wa[k].flatten(1).double().norm(dim=1),
                                 wb[k].flatten(1).double().norm(dim=1), keep)
    return out


def pairwise_filter_distances(checkpoints: _Sequence, keep: _Optional[_Union[int, float]] = None,
                              layers: _Optional[_Sequence[str]] = None) -> _Dict[str, _Tensor]:
    """``{layer: D}`` with ``D[i, j]`` the filter distance of that layer from checkpoint i to
    checkpoint j (models or state_dicts), as in paper 000 Figure 1."""
    n = len(checkpoints)
    if layers is None:  # the conv layers every checkpoint holds with the same shape
        weights = [_conv_weights(c) for c in checkpoints]
        layers = [k for k, v in weights[0].items()
                  if all(k in w and w[k].shape == v.shape for w in weights[1:])] if weights else []
    out: _Dict[str, _Tensor] = {k: _torch.zeros(n, n, dtype=_torch.float64) for k in layers}
    for i in range(n):
        for j in range(n):
            for k, d in layer_filter_distances(checkpoints[i], checkpoints[j], keep, layers).items():
                out[k][i, j] = d
    return out


def plot_filter_distances(checkpoints: _Sequence, path: _Optional[str] = None,
                          keep: _Optional[_Union[int, float]] = None,
                          layers: _Optional[_Sequence[str]] = None,
                          labels: _Optional[_Sequence[str]] = None):
    """Heatmaps of the pairwise filter distance between checkpoints, one per layer (paper 000
    Figure 1: darker is closer). Uses matplotlib's Agg canvas (no display, no global pyplot
    state); saves to ``path`` when given; returns the Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mats = pairwise_filter_distances(checkpoints, keep, layers)
    if not mats:
        raise ValueError("plot_filter_distances: no conv layer common to the checkpoints")
    n = len(checkpoints)
    labels = [str(i) for i in range(n)] if labels is None else list(labels)
    cols = min(4, len(mats))
    rows = (len(mats) + cols - 1) // cols
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows))
    FigureCanvasAgg(fig)
    for k, (name, m) in enumerate(mats.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        im = ax.imshow(m.numpy(), cmap="Blues_r", origin="upper")
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(n), labels, fontsize=6)
        ax.set_yticks(range(n), labels, fontsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
