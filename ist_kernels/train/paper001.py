"""Algorithm 1 of paper 001 (RandomlyMaskedTraining), simulated: the S subnetworks of a round are
trained one after another in one process, then aggregated.

The pieces are separate so that a distributed trainer can reuse them: :func:`sample_neurons`
(the round's plan, the same on every rank for the same (seed, round)), :func:`local_train`
(τ local steps of one subnetwork on its compact parameters) and :func:`aggregate` (owner-averaged
write-back into the full model).
"""
from dataclasses import dataclass, field
from typing import Callable, List, Sequence

import torch
from torch import Tensor

from ..nn.subnet import SubnetMLP
from ..partition.neurons import (
    bernoulli_masks,
    categorical_partition,
    categorical_probabilities,
    masks_to_indices,
    round_generator,
)

# bernoulli: each subnetwork keeps each neuron with probability xi (paper 001 §4); categorical: each
# neuron's owner drawn uniformly, so group sizes are multinomial (paper 001, Theorem 4); balanced:
# a random permutation cut into S groups whose sizes differ by at most one (IST, as IST_Release does)
MASKS = ("bernoulli", "categorical", "balanced")
# an empty subnetwork is re-drawn (sample_neurons); the trainer rejects settings where a draw is
# good with probability < MIN_NONEMPTY, so MAX_DRAWS fail together with probability < 1e-40
MAX_DRAWS = 10_000
MIN_NONEMPTY = 0.01


def regression_loss(pred: Tensor, y: Tensor) -> Tensor:
    """L = ½‖y − f‖² (paper 001 §3.1; summed over samples and outputs)."""
    return 0.5 * (pred - y.reshape(pred.shape)).square().sum()


def selection_probability(masks: str, S: int, xi) -> float:
    """ξ: the probability that a subnetwork selects a neuron, the full model's output scale
    (paper 001 §4). Categorical: 1/S for any ξ vector (``xi``: None for the uniform 1/S · 1_S,
    or S probabilities): every neuron has exactly one owner, so u = (1/S) Σ_l û^l (Appendix F)."""
    if masks == "bernoulli":
        if xi is None:
            raise ValueError("bernoulli masks need xi (the selection probability)")
        return float(xi)
    if masks in ("categorical", "balanced"):
        if xi is not None:
            if masks == "balanced":
                raise ValueError("balanced groups have equal sizes; they take no xi (categorical probabilities)")
            categorical_probabilities(xi, S, "selection_probability")
        return 1.0 / S
    raise ValueError(f"masks must be one of {MASKS}, got {masks!r}")


def nonempty_probability(masks: str, num_neurons: int, S: int, xi=None) -> float:
    """The probability that one layer's draw of ``masks`` over ``num_neurons`` neurons gives each of
    the S subnetworks at least one neuron (exact; inclusion-exclusion for the categorical draw).
    With a categorical ξ vector: Σ_K (-1)^|K| (1 − Σ_{l∈K} ξ_l)^n over the sets K of subnetworks
    left empty, exact for S <= 16; beyond, the positive lower bound 1 − Σ_l (1 − ξ_l)^n."""
    selection_probability(masks, S, xi)  # checks masks and xi
    n = num_neurons
    if masks == "balanced":
        return 1.0 if n >= S else 0.0
    if masks == "bernoulli":
        return (1.0 - (1.0 - xi) ** n) ** S
    if xi is not None:
        q = categorical_probabilities(xi, S).tolist()
        if n < S or min(q) == 0.0:
            return 0.0
        if S > 16:
            return max(1.0 - sum((1.0 - v) ** n for v in q), 5e-324)
        from itertools import combinations

        total = sum((-1) ** k * max(0.0, 1.0 - sum(c)) ** n for k in range(S + 1) for c in combinations(q, k))
        return min(1.0, max(total, 5e-324))
    from fractions import Fraction
    from math import comb

    # surjections of n neurons onto S subnetworks over all S^n assignments, in exact integers
    return float(Fraction(sum((-1) ** k * comb(S, k) * (S - k) ** n for k in range(S + 1)), S ** n))


def _draw(masks: str, n: int, S: int, xi, generator) -> List[Tensor]:
    if masks == "bernoulli":
        return masks_to_indices(bernoulli_masks(n, S, xi, generator))
    return categorical_partition(n, S, generator, balanced=masks == "balanced", probs=xi)


def sample_neurons(model: SubnetMLP, S: int, masks: str, xi,
                   generator: torch.Generator) -> List[List[Tensor]]:
    """Algorithm 1 line 3: the neurons of each of the S subnetworks, one sorted index list per
    hidden layer (layers drawn independently, in order), from ``generator``. ``xi``: Bernoulli,
    the selection probability; categorical, None (uniform) or the vector of S probabilities.

    An empty subnetwork is never trained (it would only move the shared output layer): a layer's
    draw that leaves some subnetwork without a neuron is drawn again from the same generator, so
    the plan is the draw conditioned on every subnetwork holding >= 1 neuron in every layer (the
    same on every rank). Balanced groups are never empty when width >= S. A ValueError says when
    the masks cannot give every subnetwork a neuron, or did not in ``MAX_DRAWS`` draws."""
    selection_probability(masks, S, xi)
    plan: List[List[Tensor]] = [[] for _ in range(S)]
    p = None
    for layer in range(model.depth):
        for _ in range(MAX_DRAWS):
            per_subnet = _draw(masks, model.width, S, xi, generator)
            if all(idx.numel() for idx in per_subnet):
                break
            p = nonempty_probability(masks, model.width, S, xi) if p is None else p
            if p == 0.0:
                raise ValueError(f"sample_neurons: {masks} masks over {model.width} neurons cannot give each of "
                                 f"{S} subnetworks a neuron; use width >= {S}" + (" and xi > 0" if xi == 0 else ""))
        else:
            raise ValueError(f"sample_neurons: {MAX_DRAWS} draws of {masks} masks (xi={xi}) over {model.width} "
                             f"neurons all left one of {S} subnetworks empty in hidden layer {layer} (a draw "
                             f"succeeds with probability {p:.3g}); raise the width or xi")
        for s in range(S):
            plan[s].append(per_subnet[s])
    return plan


def local_train(model: SubnetMLP, params: Sequence[Tensor], neurons, x: Tensor, y: Tensor,
                local_steps: int, lr: float,
                loss_fn: Callable[[Tensor, Tensor], Tensor] = regression_loss) -> Tensor:
    """Algorithm 1 lines 6-8: τ = ``local_steps`` steps of gradient descent on the surrogate loss
    of one subnetwork, in place on its compact parameters. Returns the loss before each step."""
    params = [p.requires_grad_(True) for p in params]
    return _local_steps(lambda inp: model.subnet_forward(inp, params, neurons), params, x, y, local_steps, lr,
                        loss_fn)


def _local_steps(forward: Callable[[Tensor], Tensor], params: Sequence[Tensor], x: Tensor, y: Tensor,
                 local_steps: int, lr: float, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """τ steps of gradient descent on ``params`` (in place) through ``forward``; the losses before
    each step."""
    params = list(params)
    losses = []
    for _ in range(local_steps):
        loss = loss_fn(forward(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        losses.append(loss.detach())
    return torch.stack(losses) if losses else x.new_zeros(0)


def aggregate(model: SubnetMLP, params_list: Sequence[Sequence[Tensor]], neurons_list) -> None:
    """Algorithm 1 lines 11-13: owner-averaged write-back (η_r = N⊥_r / N_r), one scatter."""
    model.aggregate_(params_list, neurons_list)


@torch.no_grad()
def training_error(model: SubnetMLP, x: Tensor, y: Tensor, keep: float = 1.0) -> float:
    """‖y − u‖² with u the full model scaled by the selection probability (paper 001 §4)."""
    return float((model(x, keep=keep) - y.reshape(-1, model.out_features)).square().sum())


@dataclass
class History:
    """Per-round record of a run of Algorithm 1.

    errors[k]: training error of the full model before round k (errors[K]: after the last round).
    sampled[k]: mean surrogate loss ½‖y − û‖² of round k's subnetworks right after sampling.
    local[k]: the same mean after local training (before aggregation).
    """

    errors: List[float] = field(default_factory=list)
    sampled: List[float] = field(default_factory=list)
    local: List[float] = field(default_factory=list)


def train_round(model: SubnetMLP, x: Tensor, y: Tensor, neurons_list, local_steps: int, lr: float,
                loss_fn: Callable[[Tensor, Tensor], Tensor] = regression_loss):
    """One global iteration: compact every subnetwork once (one planned gather: dense compact
    modules, :meth:`SubnetMLP.compact`), train each for τ steps of dense GEMMs, one after another,
    aggregate (one planned scatter, = :meth:`SubnetMLP.aggregate_`). Returns (mean sampled loss,
    mean local loss)."""
    rnd = model.compact(neurons_list)
    first, last = [], []
    for mod in rnd.modules:
        losses = _local_steps(mod, list(mod.parameters()), x, y, local_steps, lr, loss_fn)
        with torch.no_grad():
            last.append(loss_fn(mod(x), y))
        first.append(losses[0] if len(losses) else last[-1])
    rnd.write_back()
    return float(torch.stack(first).mean()), float(torch.stack(last).mean())


def train(model: SubnetMLP, x: Tensor, y: Tensor, *, subnetworks: int, rounds: int, local_steps: int,
          lr: float, masks: str = "bernoulli", xi=None, seed: int = 0,
          loss_fn: Callable[[Tensor, Tensor], Tensor] = regression_loss, progress=None) -> History:
    """Algorithm 1: K = ``rounds`` global iterations of S = ``subnetworks`` subnetworks with
    ``masks`` ("bernoulli" with selection probability ``xi``, or "categorical" with ``xi`` None
    for ξ = 1/S · 1_S or a vector of S probabilities), τ =
    ``local_steps`` GD steps of size ``lr`` each. Round k's masks come from
    ``round_generator(seed, k)``. The training error is measured on the full model scaled by ξ."""
    keep = selection_probability(masks, subnetworks, xi)
    hist = History(errors=[training_error(model, x, y, keep)])
    for k in range(rounds):
        plan = sample_neurons(model, subnetworks, masks, xi, round_generator(seed, k))
        sampled, local = train_round(model, x, y, plan, local_steps, lr, loss_fn)
        hist.sampled.append(sampled)
        hist.local.append(local)
        hist.errors.append(training_error(model, x, y, keep))
        if progress is not None:
            progress(k, hist)
    return hist
