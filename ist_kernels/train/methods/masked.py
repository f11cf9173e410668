"""Independent subnetworks of an MLP's hidden neurons: paper 001's RandomlyMaskedTraining
(Algorithm 1) as ``masked``, and IST's neuron partition as ``ist`` (the same method with
balanced masks: :mod:`.ist`).

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

``ist`` (IST's neuron partition, registered here too): every round the hidden neurons of each
layer are permuted at random and cut into S groups whose sizes differ by at most one (as
IST_Release does; never an empty group, width >= S is checked), worker s trains the subnetwork of
group s, and the full model is written back owner-averaged (each neuron has exactly one owner; the
shared output bias is averaged): this method with ``masks`` fixed to balanced.

Storage (``--storage``). Decentralized (default): a rank holds only its subnetwork's compact
tensors (for a hidden-to-hidden weight the rows of its neurons x the columns of its previous
layer's neurons: both dims partitioned, stated on the flat view, ``SubnetMLP.slice_plan``) and the
shared output bias. A neuron no subnetwork selected (Bernoulli masks) still needs a holder: the
plan is stored as ``slice_plan.with_holders`` (each unowned slice kept, untrained, by one rank),
so its value passes through the owner mean unchanged, as in Algorithm 1. One exchange
(``ctx.comm``) per round moves every slice to its next holders and
averages the shared bias (ring all_reduce; ``--shared exact``: bit-identical to the simulated run);
the full model is assembled on rank 0 only to evaluate or save it. Replicated
(``--storage replicated``): every rank holds the full model, writes its subnetwork back into it and
a replicated exchange owner-averages the slices across the ranks. Simulated: the full model,
``SubnetMLP.aggregate_`` over the S subnetworks; bytes counted from the plans as the distributed
run would move them.

The full model is scored as paper 001 §4 does: each hidden neuron's output scaled by the
selection probability ξ (a subnetwork's output is about ξ times the full model's).
"""
from __future__ import annotations

import copy
from typing import List

import torch
from torch import nn

from ...nn.subnet import SubnetMLP
from ...partition.plan import positions
from ..errors import ConfigError
from ..simulated import MASKS, MIN_NONEMPTY, nonempty_probability, sample_neurons, selection_probability
from . import Method, Option, RoundResult, boolean, held_bytes, register_method

PLAN = 0x1570  # generator tag of the round's neuron plan


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
    def validate(cls, hp):
        super().validate(hp)
        if hp.model != "mlp":
            raise ConfigError("model", f"method {cls.name!r} trains an MLP of hidden neurons (model mlp), "
                              f"got {hp.model!r}")
        masks = cls.fixed_masks or hp.options.get("masks", "bernoulli")
        xi = hp.options.get("xi") if masks == "bernoulli" else None
        width, S = hp.width or 128, hp.num_workers
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

    def __init__(self, ctx):
        super().__init__(ctx)
        o = ctx.options
        self.masks = self.fixed_masks or o["masks"]
        self.xi = o.get("xi") if self.masks == "bernoulli" else None
        hp = ctx.hp
        self.net = ctx.build_model(lambda: SubnetMLP(
            ctx.in_features, hp.width or 128, hp.depth, ctx.num_outputs, bias=o["bias"],
            train_output=o["train_output"], kappa=o["kappa"]))
        self.full_state_bytes = ctx.full_state_bytes(self.net)
        self.keep = selection_probability(self.masks, ctx.num_workers, self.xi)
        self.full = FullModel(self.net, self.keep)
        self.workers = ctx.local_workers
        self.spec = self.net.slice_spec()
        self.fixed = dict(self.net.named_buffers())  # the output weight when it does not train
        self.decentral = ctx.distributed and ctx.decentralized
        self._rounds = {}
        self.held = 0  # the round whose plan the stored tensors are cut by
        self.part = None
        if self.decentral:  # this rank's part of round 0; the full model keeps only its structure
            self.part = self.round_plans(0)[2].part(self._tensors(), ctx.rank)
            self.net.to("meta")
            for name, b in self.fixed.items():
                setattr(self.net, name, b)

    def plan(self, r: int):
        return sample_neurons(self.net, self.ctx.num_workers, self.masks, self.xi, self.ctx.generator(PLAN, r))

    def round_plans(self, r: int):
        """(neurons per worker, the trained SlicePlan, the storage SlicePlan) of round r (last two kept)."""
        if r not in self._rounds:
            with self.ctx.clock("plan"):
                if len(self._rounds) >= 2:
                    self._rounds.pop(min(self._rounds))
                neurons = self.plan(r)
                trained = self.net.slice_plan(neurons)
                sizes = {t.name: self.spec[t.name][0][t.dim] for t in trained.partitioned}
                self._rounds[r] = (neurons, trained, trained.with_holders(sizes))
        return self._rounds[r]

    def _tensors(self):
        """The full model's trained tensors as the plans state them (hidden-to-hidden weights flat)."""
        return {n: self.net.exchange_view(n, p.detach()) for n, p in self.net.named_parameters()}

    def run_round(self, r: int) -> RoundResult:
        ctx = self.ctx
        if self.held != r:
            raise RuntimeError(f"{self.name}: holds round {self.held}'s plan, asked to train round {r}")
        neurons, trained, store = self.round_plans(r)
        last = r == ctx.rounds - 1
        nxt = store if last else self.round_plans(r + 1)[2]
        ps = ctx.comm.ps_bytes(trained, self.spec) if ctx.num_workers > 1 else 0
        run = self._round_decentral if self.decentral else self._round_global
        loss, state = run(r, neurons, trained, store, nxt)
        self.held = r if last else r + 1
        return RoundResult(loss_sum=loss, steps=len(self.workers) * ctx.local_steps, ps_bytes=ps, state_bytes=state)

    def _round_global(self, r, neurons, trained, store, nxt):
        ctx, net = self.ctx, self.net
        with ctx.clock("pack"):
            mine = [[n.to(ctx.device) for n in neurons[s]] for s in self.workers]
            params = net.extract_all(mine)
        loss, state = 0.0, {}
        for s, p, ns in zip(self.workers, params, mine):
            with ctx.clock("plan"):
                sub = SubnetModule(net, p, ns)
                opt = ctx.make_optimizer(sub.params)
            loss += ctx.train_local(sub, opt, s, r)
            with ctx.clock("metrics"):
                state[s] = (held_bytes(net, p, opt) if not ctx.decentralized else
                            self._decentral_state(s, trained, store) + held_bytes(opt))
        with ctx.clock("unpack"):
            net.aggregate_(params, mine)  # distributed: this rank's subnetwork into its replica
        if ctx.distributed:  # replicated storage: the replicas exchanged
            with ctx.clock("plan"):
                ctx.comm.exchange(trained, None, None, self._tensors(), storage="replicated", round=r + 1)
            return loss, state
        storage = "decentralized" if ctx.decentralized else "replicated"
        cur = store if ctx.decentralized else trained
        ctx.comm.count_exchange(cur, nxt, self.spec, storage=storage)
        return loss, state

    def _decentral_state(self, s, trained, store) -> int:
        """What worker s holds under decentralized storage, from the plans: its stored slices, the
        compact copies of the trained ones where it stores more (unowned slices it keeps), the
        fixed output weight (the optimizer state is measured)."""
        comm = self.ctx.comm
        differ = [t.name for t, u in zip(trained.partitioned, store.partitioned) if t.owners[s].numel() !=
                  u.owners[s].numel()]
        copies = comm.ps_bytes_of(trained, self.spec, s, names=differ) // 2 if differ else 0
        return comm.ps_bytes_of(store, self.spec, s) // 2 + copies + held_bytes(self.fixed)

    def _round_decentral(self, r, neurons, trained, store, nxt):
        ctx, s = self.ctx, self.ctx.rank
        with ctx.clock("plan"):
            owned = {t.name: t for t in trained.tensors}
            held = {t.name: t for t in store.tensors}
            params, copies = [], []
            for name, dim, shape in self.net.compact_layout(neurons[s]):
                t = self.part.get(name)
                if t is None:  # this worker holds nothing of the tensor (an empty layer)
                    params.append(torch.empty(shape, device=ctx.device))
                elif owned[name].shared or held[name].owners[s].numel() == owned[name].owners[s].numel():
                    params.append(t.view(shape))
                else:
                    pos = positions(held[name].owners[s], owned[name].owners[s]).to(t.device)
                    compact = t.index_select(dim, pos)
                    params.append(compact.view(shape))
                    copies.append((name, dim, pos, compact))
            sub = SubnetModule(self.net, params, [n.to(ctx.device) for n in neurons[s]])
            opt = ctx.make_optimizer(sub.params)
        loss = ctx.train_local(sub, opt, s, r)
        with ctx.clock("metrics"):
            state = {s: held_bytes(self.part, params, opt, self.fixed)}
        with ctx.clock("plan"):
            with torch.no_grad():
                for name, dim, pos, compact in copies:  # the trained slices back among the stored ones
                    self.part[name].index_copy_(dim, pos, compact)
            self.part = ctx.comm.exchange(store, nxt, self.spec, {n: t.detach() for n, t in self.part.items()},
                                          round=r + 1)
        return loss, state

    def global_model(self):
        ctx = self.ctx
        store = self.round_plans(self.held)[2]
        if not self.decentral:
            if ctx.simulated and ctx.decentralized:
                ctx.comm.count_gather(store, self.spec)
            return self.full
        full = ctx.comm.gather_full(self.part, store, self.spec, round=self.held)
        if full is None:
            return None
        net = copy.deepcopy(self.net)
        shapes = {n: p.shape for n, p in self.net.named_parameters()}
        net.load_state_dict({**self.fixed, **{n: t.view(shapes[n]) for n, t in full.items()}}, assign=True)
        return FullModel(net, self.keep)

    def state_dict(self):
        # plans come from (seed, round) and optimizers are fresh every round: the model (decentralized:
        # this rank's part) is all
        if self.decentral:
            return {"held": self.held, "part": self.part}
        return {"held": self.held, "model": self.net.state_dict()}

    def load_state_dict(self, state):
        self.held = state["held"]
        if self.decentral:
            self.part = state["part"]
        else:
            self.net.load_state_dict(state["model"])

    def summary(self):
        return {"masks": self.masks, "xi": self.keep}


@register_method("ist")
class IST(Masked):
    """IST's neuron partition of an MLP: ``masked`` with balanced masks (see the module docstring)."""

    options = {k: v for k, v in Masked.options.items() if k not in ("masks", "xi")}
    fixed_masks = "balanced"
