"""Neuron partitions of a layer among S subnetworks (paper 001 §3.1, Algorithm 1 line 3).

A plan for one round is made from a generator seeded by (seed, round) with
:func:`round_generator`, on the CPU, so every rank that calls the same function with the same
(seed, round) gets the same plan without sending it. Index lists are sorted int64 tensors.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    # One splitmix64 step: nearby (seed, round) pairs give unrelated generator seeds.
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def round_seed(seed: int, round: int) -> int:
    """The 63-bit seed of round ``round`` of a run seeded with ``seed`` (same on every rank)."""
    if seed < 0 or round < 0:
        raise ValueError(f"round_seed: seed and round must be >= 0, got seed={seed}, round={round}")
    return _splitmix64(_splitmix64(seed) ^ round) >> 1


def round_generator(seed: int, round: int) -> torch.Generator:
    """A CPU generator seeded from (seed, round): the same masks on every rank for that round."""
    return torch.Generator().manual_seed(round_seed(seed, round))


def _check(fn: str, num_neurons: int, S: int) -> None:
    if num_neurons < 0:
        raise ValueError(f"{fn}: num_neurons must be >= 0, got {num_neurons}")
    if S < 1:
        raise ValueError(f"{fn}: S (number of subnetworks) must be >= 1, got {S}")


def bernoulli_masks(
    num_neurons: int, S: int, xi: float, generator: Optional[torch.Generator] = None
) -> Tensor:
    """Masks m_r^l ~ Bern(xi), i.i.d. over subnetworks l and neurons r (paper 001 §4).

    Returns bool ``[S, num_neurons]``; row l is subnetwork l's mask. A neuron may be selected by
    several subnetworks or by none.
    """
    _check("bernoulli_masks", num_neurons, S)
    if not 0.0 <= xi <= 1.0:
        raise ValueError(f"bernoulli_masks: xi (selection probability) must be in [0, 1], got {xi}")
    return torch.rand(S, num_neurons, generator=generator) < xi


def parse_probs(text: str) -> Tuple[float, ...]:
    """``"0.7:0.3"`` -> (0.7, 0.3): a categorical ξ vector as the trainer's ``probs`` option and the
    masked experiment's ``--xi-vectors`` write it (>= 2 entries >= 0 summing to 1 within 1e-6);
    ValueError saying what is wrong."""
    try:
        p = tuple(float(e) for e in text.split(":"))
    except ValueError:
        raise ValueError(f"expected vectors like 0.7:0.3, got {text!r}") from None
    if len(p) < 2 or any(not (e >= 0) for e in p) or abs(sum(p) - 1) > 1e-6:
        raise ValueError(f"a ξ vector needs >= 2 entries >= 0 summing to 1, got {text!r}")
    return p


def categorical_probabilities(probs, S: int, who: str = "categorical_assignment") -> Tensor:
    """The float64 vector ξ of a categorical mask (paper 001 §3: neuron r goes to subnetwork l with
    probability ξ_l), checked: S finite entries >= 0 summing to 1 (within 1e-6)."""
    p = torch.as_tensor(probs, dtype=torch.float64).flatten().cpu()
    if p.numel() != S:
        raise ValueError(f"{who}: xi (categorical probabilities) must have S={S} entries, got {p.numel()}")
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"{who}: xi (categorical probabilities) must be finite, >= 0 and sum to 1, "
                         f"got {p.tolist()}")
    return p


def categorical_assignment(
    num_neurons: int, S: int, generator: Optional[torch.Generator] = None, balanced: bool = False,
    probs=None,
) -> Tensor:
    """The subnetwork (0..S-1) each neuron belongs to, int64 ``[num_neurons]``.

    ``balanced=False``: each neuron i.i.d. Categorical(ξ) (paper 001 §3), with ξ = ``probs`` (S
    probabilities) or 1/S · 1_S (Theorem 4) when None, so the subnetwork sizes are random
    (multinomial). ``balanced=True``: a random permutation dealt in S near-equal chunks (sizes
    differ by at most one), as the IST code does; it takes no ``probs``.
    """
    _check("categorical_assignment", num_neurons, S)
    if balanced:
        if probs is not None:
            raise ValueError("categorical_assignment: balanced=True deals equal groups; it takes no probs (xi)")
        perm = torch.randperm(num_neurons, generator=generator)
        owner = torch.empty(num_neurons, dtype=torch.int64)
        # chunk c of the permutation is subnetwork c: sizes ceil/floor(num_neurons / S)
        owner[perm] = torch.arange(num_neurons) * S // max(num_neurons, 1)
        return owner
    if probs is not None:
        p = categorical_probabilities(probs, S)
        if num_neurons == 0:
            return torch.empty(0, dtype=torch.int64)
        # inverse CDF of one uniform per neuron (the last edge is 1 exactly: rounding cannot
        # give an owner S); an owner with ξ_l = 0 is never drawn
        cdf = p.cumsum(0)
        cdf[-1] = 1.0
        u = torch.rand(num_neurons, generator=generator, dtype=torch.float64)
        return torch.searchsorted(cdf, u, right=True).clamp_(max=S - 1)
    return torch.randint(0, S, (num_neurons,), generator=generator)


def categorical_partition(
    num_neurons: int, S: int, generator: Optional[torch.Generator] = None, balanced: bool = False,
    probs=None,
) -> List[Tensor]:
    """S disjoint sorted int64 index lists covering every neuron exactly once.

    See :func:`categorical_assignment` for the ways of drawing the owner of each neuron (``probs``:
    the general categorical ξ vector).
    """
    owner = categorical_assignment(num_neurons, S, generator, balanced, probs)
    return masks_to_indices(owner.unsqueeze(0) == torch.arange(S).unsqueeze(1))


def random_subsets(
    num_neurons: int, S: int, size: int, generator: Optional[torch.Generator] = None
) -> List[Tensor]:
    """S independent uniformly random subsets of ``size`` neurons each (sorted int64 lists)."""
    _check("random_subsets", num_neurons, S)
    if not 0 <= size <= num_neurons:
        raise ValueError(f"random_subsets: size must be in [0, num_neurons={num_neurons}], got {size}")
    keys = torch.rand(S, num_neurons, generator=generator)
    picked = keys.topk(size, dim=1).indices if size else torch.empty(S, 0, dtype=torch.int64)
    return list(picked.sort(dim=1).values.unbind(0))


def masks_to_indices(masks: Tensor) -> List[Tensor]:
    """bool ``[S, num_neurons]`` -> S sorted int64 index lists (row l: neurons with mask set)."""
    if masks.dim() != 2:
        raise ValueError(f"masks_to_indices: masks must be 2-D [S, num_neurons], got shape {tuple(masks.shape)}")
    return [row.nonzero().flatten() for row in masks.bool().unbind(0)]


def indices_to_masks(indices: List[Tensor], num_neurons: int) -> Tensor:
    """Inverse of :func:`masks_to_indices`: S index lists -> bool ``[S, num_neurons]``."""
    masks = torch.zeros(len(indices), num_neurons, dtype=torch.bool)
    for l, idx in enumerate(indices):
        masks[l, idx.cpu()] = True
    return masks


def owner_counts(indices: List[Tensor], num_neurons: int) -> Tensor:
    """X_r = number of subnetworks that selected neuron r (paper 001 §3.1), int64 ``[num_neurons]``."""
    counts = torch.zeros(num_neurons, dtype=torch.int64)
    for idx in indices:
        counts.index_add_(0, idx.cpu(), torch.ones_like(idx, device="cpu"))
    return counts
