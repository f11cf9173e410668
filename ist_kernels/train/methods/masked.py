"""Independent subnetworks of an MLP's hidden neurons: paper 001's RandomlyMaskedTraining
(Algorithm 1) as ``masked``, and IST's neuron partition as ``ist`` (the same method with
categorical masks: :mod:`.ist`).

Every round r each of the S workers gets a subnetwork, a set of neurons per hidden layer drawn
from ``ctx.generator(PLAN, r)`` (the same on every rank, never sent) by
:func:`ist_kernels.train.simulated.sample_neurons`: ``masks=balanced`` partitions the neurons
into S disjoint groups whose sizes differ by at most one (ξ = 1/S; ``ist`` always does this),
``masks=categorical`` into S disjoint groups with each neuron's owner drawn uniformly
(multinomial sizes, paper 001 Theorem 4), ``masks=bernoulli`` lets each subnetwork keep each
neuron with probability ``xi`` (overlaps and unowned neurons). A draw that leaves a subnetwork
without neurons in some layer is drawn again (an empty subnetwork is never trained); settings
where most draws would be are rejected before the run. A worker copies its subnetwork's compact
parameters out of the full :class:`~ist_kernels.nn.SubnetMLP` (``extract_all``), trains them for
τ = ``local_steps`` SGD steps on its shard (the trainer's optimizer and learning-rate schedule; a
fresh optimizer each round, since the subnetwork changes), and the full model is aggregated
owner-averaged: every entry becomes the mean over the subnetworks that own it, entries no
subnetwork owns keep their value (Algorithm 1 lines 11-13, η = N⊥/N).

Storage is replicated (every rank holds the full model; Bernoulli plans leave neurons unowned,
which decentralized storage cannot hold). Simulated: ``SubnetMLP.aggregate_`` over the S
subnetworks. Distributed: each rank writes its own subnetwork back into its copy, then an
:class:`ist_kernels.distributed.Exchange` (replicated storage, ``shared="exact"``) sends each
rank's updated slices to the others and owner-averages them with the same ``slice_scatter_`` in
the same rank order: the two launch modes give bit-identical models (with ``--threads 1``).
bytes_sent is the Exchange's all-to-all bytes (simulated: the same count, S - 1 copies of each
worker's compact tensors).

The full model is scored as paper 001 §4 does: each hidden neuron's output scaled by the
selection probability ξ (a subnetwork's output is about ξ times the full model's). The distributed
exchange needs a SlicePlan, which states one dim per tensor: depth > 1 trains only with --simulate.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from ..config import ConfigError
from ..simulated import MASKS, MIN_NONEMPTY, nonempty_probability, sample_neurons, selection_probability
from . import Method, Option, RoundResult, register_method

PLAN = 0x1570  # generator tag of the round's neuron plan


def boolean(v) -> bool:
    """An option's true/false (also 1/0, yes/no); anything else is a ValueError."""
    if isinstance(v, bool):
        return v
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if str(v).lower() not in words:
        raise ValueError(f"not a boolean: {v!r}")
    return words[str(v).lower()]


class SubnetModule(nn.Module):
    """One worker's subnetwork as a module for ``ctx.train_local``: its compact parameters
    (leaves, trained in place) and the neurons they belong to; inputs are flattened."""

    def __init__(self, net, params: List[torch.Tensor], neurons):
        super().__init__()
        self._net = [net]  # not a submodule: the full model is not this module's parameter
        self.params = [p.requires_grad_(True) for p in params]
        self.neurons = neurons

    def parameters(self, recurse: bool = True):
        return iter(self.params)

    def forward(self, x):
        return self._net[0].subnet_forward(x.flatten(1), self.params, self.neurons)


class FullModel(nn.Module):
    """The full SubnetMLP on flattened inputs, hidden outputs scaled by ``keep`` (ξ)."""

    def __init__(self, net, keep: float):
        super().__init__()
        self.net = net
        self.keep = keep

    def forward(self, x):
        return self.net(x.flatten(1), keep=self.keep)


@register_method("masked")
class Masked(Method):
    options = {
        "masks": Option("bernoulli", str, "bernoulli (paper 001 §4: each neuron kept with probability xi), "
                        "categorical (a partition, each neuron's owner drawn uniformly: multinomial group sizes, "
                        "paper 001 Theorem 4) or balanced (a partition into groups whose sizes differ by at most "
                        "one, as IST does)",
                        check=lambda v: v in MASKS, expected=", ".join(MASKS[:-1]) + " or " + MASKS[-1]),
        "xi": Option(0.5, float, "bernoulli: the probability a subnetwork keeps a neuron",
                     check=lambda v: 0 < v <= 1, expected="a probability in (0, 1]"),
        "train_output": Option(True, boolean, "train the output layer (paper 001 keeps it fixed at ±1)"),
        "bias": Option(True, boolean, "hidden and output biases (paper 001 has none)"),
        "kappa": Option(1.0, float, "std of the first layer's initial weights (paper 001: κ)",
                        check=lambda v: v > 0, expected="a positive number"),
    }
    fixed_masks = None  # ist: "balanced"

    @classmethod
    def validate(cls, cfg):
        super().validate(cfg)
        if cfg.model != "mlp":
            raise ConfigError("model", f"method {cls.name!r} trains an MLP of hidden neurons (model mlp), "
                              f"got {cfg.model!r}")
        masks = cls.fixed_masks or cfg.options.get("masks", "bernoulli")
        xi = cfg.options.get("xi") if masks == "bernoulli" else None
        width, S = cfg.width or 128, cfg.num_workers
        # an empty subnetwork is re-drawn (sample_neurons); reject settings where most draws are
        p = nonempty_probability(masks, width, S, xi)
        if p == 0.0 and masks != "bernoulli":
            raise ConfigError("width", f"a partition of {width} neurons into {S} subnetworks leaves some "
                              "empty; use width >= workers")
        if p < MIN_NONEMPTY:
            raise ConfigError("options.xi" if masks == "bernoulli" else "width",
                              f"a draw of {masks} masks over {width} neurons leaves one of the {S} subnetworks "
                              f"without neurons with probability {1 - p:.3g}; an empty subnetwork is never "
                              f"trained (such draws are re-drawn), so raise the width"
                              + (" or xi" if masks == "bernoulli" else ""))
        if cfg.precision != "fp32":
            raise ConfigError("precision", f"method {cls.name!r} runs subnet_linear, which does not autocast "
                              f"(its inputs and weights share one dtype); use --precision fp32")
        if cfg.depth > 1 and not cfg.simulate and cfg.num_workers > 1:
            raise ConfigError("depth", f"method {cls.name!r} exchanges subnetworks of depth-1 MLPs only "
                              f"(got depth={cfg.depth}); use --simulate for deeper ones")

    def __init__(self, ctx):
        super().__init__(ctx)
        from ...nn.subnet import SubnetMLP

        o = ctx.options
        self.masks = self.fixed_masks or o["masks"]
        self.xi = o.get("xi") if self.masks == "bernoulli" else None
        cfg = ctx.cfg
        self.net = ctx.build_model(lambda: SubnetMLP(
            ctx.in_features, cfg.width or 128, ctx.num_outputs, cfg.depth, bias=o["bias"],
            train_output=o["train_output"], kappa=o["kappa"]))
        self.keep = selection_probability(self.masks, ctx.num_workers, self.xi)
        self.full = FullModel(self.net, self.keep)
        self.workers = ctx.local_workers

    def plan(self, r: int):
        return sample_neurons(self.net, self.ctx.num_workers, self.masks, self.xi, self.ctx.generator(PLAN, r))

    def run_round(self, r: int) -> RoundResult:
        ctx, net = self.ctx, self.net
        plan = [[n.to(ctx.device) for n in neurons] for neurons in self.plan(r)]
        mine = [plan[s] for s in self.workers]
        params = net.extract_all(mine)
        loss = 0.0
        for s, p, neurons in zip(self.workers, params, mine):
            sub = SubnetModule(net, p, neurons)
            loss += ctx.train_local(sub, ctx.make_optimizer(sub.params), s, r)
        sent = self._aggregate(r, plan, params)
        return RoundResult(loss_sum=loss, steps=len(self.workers) * ctx.cfg.local_steps, bytes_sent=sent)

    def _spec(self):
        return {k: v.detach() for k, v in self.net.named_parameters()}

    def _aggregate(self, r: int, plan, params) -> int:
        S = self.ctx.num_workers
        if not self.ctx.distributed:
            self.net.aggregate_(params, [plan[s] for s in self.workers])
            # what the replicated exchange sends: each worker's compact tensors to the S - 1 others
            # (``plan_bytes(..., storage="replicated")``; also for depth > 1, which has no SlicePlan)
            return sum((S - 1) * sum(t.numel() * t.element_size() for t in p) for p in params)
        from ...distributed import Exchange

        (s,) = self.workers
        self.net.aggregate_(params, [plan[s]])  # this rank's subnetwork into its replica
        ex = Exchange(self.net.slice_plan(plan), storage="replicated", shared="exact", round=r + 1)
        ex(self._spec())
        return ex.last_stats.bytes_sent

    def global_model(self):
        return self.full

    def state_dict(self):
        # plans come from (seed, round) and optimizers are fresh every round: the model is all
        return {"model": self.net.state_dict()}

    def load_state_dict(self, state):
        self.net.load_state_dict(state["model"])

    def summary(self):
        return {"masks": self.masks, "xi": self.keep}
