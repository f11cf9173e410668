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
from ..partition.neurons import (bernoulli_masks, categorical_partition, categorical_probabilities,
                                 masks_to_indices, round_generator)

MASKS = ("bernoulli", "categorical")


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
    if masks == "categorical":
        if xi is not None:
            categorical_probabilities(xi, S, "selection_probability")
        return 1.0 / S
    raise ValueError(f"masks must be one of {MASKS}, got {masks!r}")


def sample_neurons(model: SubnetMLP, S: int, masks: str, xi,
                   generator: torch.Generator) -> List[List[Tensor]]:
    """Algorithm 1 line 3: the neurons of each of the S subnetworks, one sorted index list per
    hidden layer (layers drawn independently, in order), from ``generator``. ``xi``: Bernoulli,
    the selection probability; categorical, None (uniform) or the vector of S probabilities."""
    plan: List[List[Tensor]] = [[] for _ in range(S)]
    for _ in range(model.depth):
        if masks == "bernoulli":
            selection_probability(masks, S, xi)
            per_subnet = masks_to_indices(bernoulli_masks(model.width, S, xi, generator))
        elif masks == "categorical":
            per_subnet = categorical_partition(model.width, S, generator, probs=xi)
        else:
            raise ValueError(f"masks must be one of {MASKS}, got {masks!r}")
        for s in range(S):
            plan[s].append(per_subnet[s])
    return plan


def local_train(model: SubnetMLP, params: Sequence[Tensor], neurons, x: Tensor, y: Tensor,
                local_steps: int, lr: float,
                loss_fn: Callable[[Tensor, Tensor], Tensor] = regression_loss) -> Tensor:
    """Algorithm 1 lines 6-8: τ = ``local_steps`` steps of gradient descent on the surrogate loss
    of one subnetwork, in place on its compact parameters. Returns the loss before each step."""
    params = [p.requires_grad_(True) for p in params]
    losses = []
    for _ in range(local_steps):
        loss = loss_fn(model.subnet_forward(x, params, neurons), y)
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
    """One global iteration: extract every subnetwork (one gather), train each for τ steps, one
    after another, aggregate (one scatter). Returns (mean sampled loss, mean local loss)."""
    device = model.hidden_weights[0].device  # plans are made on the CPU: move them once per round
    neurons_list = [neurons.to(device) if isinstance(neurons, Tensor)
                    else [None if n is None else n.to(device) for n in neurons] for neurons in neurons_list]
    params_list = model.extract_all(neurons_list)
    first, last = [], []
    for params, neurons in zip(params_list, neurons_list):
        losses = local_train(model, params, neurons, x, y, local_steps, lr, loss_fn)
        with torch.no_grad():
            last.append(loss_fn(model.subnet_forward(x, params, neurons), y))
        first.append(losses[0] if len(losses) else last[-1])
    aggregate(model, params_list, neurons_list)
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
