"""Independent subnetworks of an MLP's hidden neurons: paper 001's RandomlyMaskedTraining
(Algorithm 1) as ``masked``, and IST's neuron partition as ``ist`` (the same method with
balanced masks: :mod:`.ist`).

Every round r each of the S workers gets a subnetwork, a set of neurons per hidden layer drawn
from ``ctx.generator(PLAN, r)`` (the same on every rank, never sent) by
:func:`ist_kernels.train.paper001.sample_neurons`: ``masks=balanced`` partitions the neurons
into S disjoint groups whose sizes differ by at most one (ξ = 1/S; ``ist`` always does this),
``masks=categorical`` into S disjoint groups with each neuron's owner drawn uniformly
(multinomial sizes, paper 001 Theorem 4), ``masks=bernoulli`` lets each subnetwork keep each
neuron with probability ``xi`` (overlaps and unowned neurons); ``probs=0.7:0.3`` draws each
neuron's categorical owner from those S probabilities instead of uniformly (paper 001 §3's
general ξ). A draw that leaves a subnetwork without neurons in some layer is drawn again (an empty
subnetwork is never trained); settings where most draws would be are rejected before the run. The
model is the package's ``mlp`` or a user's :class:`~ist_kernels.nn.SubnetMLP` (``--model
MODULE:FACTORY``, ``Engine(model=factory)``). A worker copies its subnetwork's compact
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
layer's neurons: both dims partitioned, a product of the two index lists, ``SubnetMLP.product_plan``)
and the shared output bias. A slice no subnetwork selected (the entries between two subnetworks'
neurons; Bernoulli masks' unselected neurons) still needs a holder: the plan is stored as
``product_plan.with_holders`` (each unowned slice kept, untrained, by one rank; of a product as
rows x cols blocks after the rank's own block, which it trains in place), so its value passes
through the owner mean unchanged, as in Algorithm 1. A run with ``--compress`` (S > 1) states
the hidden-to-hidden weights on their flat views instead (``SubnetMLP.slice_plan``: the simulated
coding of the held slices reads one dim per tensor), with the same bytes and values. One exchange
(``ctx.comm``) per round moves every slice to its next holders and
averages the shared bias (ring all_reduce; ``--shared exact``: bit-identical to the simulated run);
the full model is assembled on rank 0 only to evaluate or save it. Replicated
(``--storage replicated``): every rank holds the full model, writes its subnetwork back into it and
a replicated exchange owner-averages the slices across the ranks. Simulated: the full model,
``SubnetMLP.aggregate_`` over the S subnetworks; bytes counted from the plans as the distributed
run would move them.

``repartition_every=k`` (an ablation, default 1): round r reuses round r - r % k's plan, so the
subnetworks are drawn anew only every k rounds (the optimizers still start afresh every round).

The full model is scored as paper 001 §4 does: each hidden neuron's output scaled by the
selection probability ξ (a subnetwork's output is about ξ times the full model's).
"""
from __future__ import annotations

import copy
from typing import List

import torch
from torch import nn

from ...nn.subnet import SubnetMLP
from ...partition import PARTITIONS
from ...partition.neurons import parse_probs
from ...partition.plan import RoundPlan, positions
from ..errors import ConfigError
from ..model_registry import is_external_model, language_models, load_model_spec, probe_model
from ..paper001 import MASKS, MIN_NONEMPTY, nonempty_probability, sample_neurons, selection_probability
from ..rounds import MOMENTUM_OPTION, SubnetRounds
from . import Method, Option, RoundResult, boolean, held_bytes, register_method
from .ist_transformer import TransformerIST

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


class _Sub:
    """One worker's subnetwork of neurons: its module, compact parameters and neurons; under
    decentralized storage also the stored tensors it was cut from (``part``) and the trained
    slices that are copies of stored ones (``copies``, Bernoulli masks' holders)."""

    def __init__(self, index, module, params, neurons, part=None, copies=()):
        self.index, self.module, self.params, self.neurons = index, module, params, neurons
        self.part, self.copies = part, list(copies)
        self.optimizer = None


class NeuronPlan(RoundPlan):
    """One round of neuron subnetworks in the round engine's plan protocol
    (:class:`ist_kernels.train.rounds.SubnetRounds`): ``slices`` is what each subnetwork trains,
    ``storage_slices`` what each rank stores (every unowned neuron kept, untrained, by one holder)."""

    reusable = False  # the neurons, hence the module, change every round

    def __init__(self, method: "Masked", neurons, trained, store):
        self.method = method
        self.neurons = neurons
        self.slices = trained
        self.storage_slices = store

    # simulated and replicated storage: the global model is the reference
    def build(self, optimizer=None):
        m = self.method
        device = m.ctx.device
        mine = [[n.to(device) for n in self.neurons[s]] for s in m.workers]
        params = m.net.extract_all(mine)
        return {s: _Sub(s, SubnetModule(m.net, p, ns), p, ns) for s, p, ns in zip(m.workers, params, mine)}

    def compact(self, sub):
        """Plan name -> the subnetwork's compact tensor in the plan's view (sharing storage; a
        hidden-to-hidden weight rows x cols in the product plan, flat in the flat one)."""
        m = self.method
        return {name: m.view(name, p.detach()) for (name, _, _), p in zip(m.net.compact_layout(sub.neurons), sub.params)}

    def aggregate(self, subs, optimizer=None):
        self.method.net.aggregate_([sub.params for sub in subs], [sub.neurons for sub in subs])

    # decentralized storage: a rank holds its stored tensors only
    def part(self, s: int):
        return self.storage_slices.part(self.method._tensors(), s)

    def attach(self, s: int, part):
        m = self.method
        device = m.ctx.device
        owned = {t.name: t for t in self.slices.tensors}
        held = {t.name: t for t in self.storage_slices.tensors}
        params, copies = [], []
        for name, dim, shape in m.net.compact_layout(self.neurons[s]):
            t = part.get(name)
            if t is None:  # this worker holds nothing of the tensor (an empty layer)
                params.append(torch.empty(shape, device=device))
            elif held[name].product:  # its own rows x cols first (holder blocks after it): a view
                params.append(t.view(-1)[:owned[name].count(s)].view(shape))
            elif owned[name].shared or held[name].owners[s].numel() == owned[name].owners[s].numel():
                params.append(t.view(shape))
            else:
                pos = positions(held[name].owners[s], owned[name].owners[s]).to(t.device)
                compact = t.index_select(dim, pos)
                params.append(compact.view(shape))
                copies.append((name, dim, pos, compact))
        neurons = [n.to(device) for n in self.neurons[s]]
        return _Sub(s, SubnetModule(m.net, params, neurons), params, neurons, part=part, copies=copies)

    def tensors_of(self, sub, detach: bool = True):
        """The stored tensors, with the trained slices written back among them."""
        with torch.no_grad():
            for name, dim, pos, compact in sub.copies:
                sub.part[name].index_copy_(dim, pos, compact)
        return {n: t.detach() if detach else t for n, t in sub.part.items()}

    def held(self, sub, opt, extra=()) -> tuple:
        m = self.method
        if sub.part is not None:  # decentralized: measured
            return (sub.part, sub.params, opt, m.fixed)
        if extra or not m.ctx.decentralized:  # replicated: the whole model too
            return (m.net, sub.params, opt)
        return (self._decentral_state(sub.index), opt)

    def _decentral_state(self, s: int) -> int:
        """What worker s holds under decentralized storage, from the plans (simulated runs report
        it): its stored slices, the compact copies of the trained ones where it stores more
        (unowned slices it keeps), the fixed output weight (the optimizer state is measured)."""
        m, trained, store = self.method, self.slices, self.storage_slices
        comm = m.ctx.comm
        # (a product's own block is a view of its stored blocks, counted as the measured run's
        # held_bytes counts it: a tensor apart)
        differ = [t.name for t, u in zip(trained.partitioned, store.partitioned) if t.count(s) != u.count(s)]
        copies = comm.ps_bytes_of(trained, m.spec, s, names=differ) // 2 if differ else 0
        return comm.ps_bytes_of(store, m.spec, s) // 2 + copies + held_bytes(m.fixed)


def _probs(v: str):
    """``0.7:0.3`` -> (0.7, 0.3), or None if it is no probability vector."""
    try:
        return parse_probs(v)
    except ValueError:
        return None


BUILT_IN_ONLY = ("train_output", "bias", "kappa")  # options of the package's mlp, not of a user's SubnetMLP


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
        "probs": Option("", str, "categorical: the probabilities xi_1:...:xi_S that a neuron's owner is worker "
                        "1..S (paper 001 §3's general categorical mask; default: uniform)",
                        check=lambda v: v == "" or _probs(v) is not None,
                        expected="S numbers >= 0 separated by ':' that sum to 1, e.g. 0.7:0.3"),
        "train_output": Option(True, boolean, "train the output layer (paper 001 keeps it fixed at ±1)"),
        "bias": Option(True, boolean, "hidden and output biases (paper 001 has none)"),
        "kappa": Option(1.0, float, "std of the first layer's initial weights (paper 001: κ)",
                        check=lambda v: v > 0, expected="a positive number"),
        "repartition_every": Option(1, int, "draw new subnetworks every this many rounds (round r trains round "
                                    "r - r % k's plan; 1: every round, as IST and paper 001 do; >= rounds: never)",
                                    check=lambda v: v >= 1, expected="an integer >= 1"),
    }
    fixed_masks = None  # ist: "balanced"
    outer_optimizer = True

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        width = hp.width or 128
        if is_external_model(hp.model):  # a user's model: it must be a SubnetMLP (its hidden neurons)
            net = probe_model(hp)
            if not isinstance(net, SubnetMLP):
                raise ConfigError("model", f"method {cls.name!r} trains the hidden neurons of an "
                                  f"ist_kernels.nn.SubnetMLP; {hp.model!r} built a {type(net).__name__}")
            for key in BUILT_IN_ONLY:
                if hp.options.get(key, cls.options[key].default) != cls.options[key].default:
                    raise ConfigError(f"options.{key}", f"applies to the package's mlp; {hp.model!r} builds its "
                                      "SubnetMLP itself (set it there)")
            width = net.width
        elif hp.model != "mlp":
            raise ConfigError("model", f"method {cls.name!r} trains an MLP of hidden neurons (model mlp, or "
                              f"MODULE:FACTORY returning a SubnetMLP), got {hp.model!r}")
        masks = cls.fixed_masks or hp.options.get("masks", "bernoulli")
        S = hp.num_workers
        xi = hp.options.get("xi") if masks == "bernoulli" else None
        if hp.options.get("probs", ""):
            if masks != "categorical":
                raise ConfigError("options.probs", f"is for masks=categorical, got masks={masks}")
            xi = _probs(hp.options["probs"])
            if len(xi) != S:
                raise ConfigError("options.probs", f"needs S={S} probabilities (one per worker), got {len(xi)}")
        # an empty subnetwork is re-drawn (sample_neurons); reject settings where most draws are
        p = nonempty_probability(masks, width, S, xi)
        if p == 0.0 and masks != "bernoulli":
            raise ConfigError("width", f"a partition of {width} neurons into {S} subnetworks leaves some "
                              "empty; use width >= workers" + (" and probabilities > 0" if hp.options.get("probs")
                                                              else ""))
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
        self.xi = o.get("xi") if self.masks == "bernoulli" else (_probs(o["probs"]) if o.get("probs") else None)
        hp = ctx.hp
        if is_external_model(hp.model):  # the user's SubnetMLP (validate checked it is one)
            self.net = ctx.build_model()
        else:
            self.net = ctx.build_model(lambda: SubnetMLP(
                ctx.in_features, hp.width or 128, hp.depth or 1, ctx.num_outputs, bias=o["bias"],
                train_output=o["train_output"], kappa=o["kappa"]))
        self.full_state_bytes = ctx.full_state_bytes(self.net)
        self.keep = selection_probability(self.masks, ctx.num_workers, self.xi)
        self.workers = ctx.local_workers
        # the hidden-to-hidden weights as products (rows x cols), or on their flat views where the
        # simulated --compress codes the held slices (comm.compress_held reads one dim per tensor)
        self.products = not (ctx.comm.compress is not None and ctx.num_workers > 1)
        self.spec = self.net.product_spec() if self.products else self.net.slice_spec()
        self.fixed = dict(self.net.named_buffers())  # the output weight when it does not train
        self.rounds = SubnetRounds(ctx, self.net, "reset", self.round_plan, spec=self.spec, tensors=self._tensors,
                                   assemble=self._assemble, full_model=FullModel(self.net, self.keep))
        self.rounds.start(0)  # decentralized: this rank's part of round 0; the net keeps its structure
        self._restore_fixed()

    def _restore_fixed(self):
        for name, b in self.fixed.items():  # the fixed buffers stay real when the net goes to meta
            setattr(self.net, name, b)

    def plan(self, r: int):
        """Round r's neurons per worker: drawn from round r - r % repartition_every's generator."""
        r -= r % self.ctx.options.get("repartition_every", 1)
        return sample_neurons(self.net, self.ctx.num_workers, self.masks, self.xi, self.ctx.generator(PLAN, r))

    def round_plan(self, r: int) -> "NeuronPlan":
        """Round r's subnetworks: the neurons per worker, the trained and the stored SlicePlans
        (``SubnetMLP.product_plan``: a hidden-to-hidden weight planned as rows x cols and its
        unowned elements kept as holder blocks, O(rows + cols); or ``slice_plan``, element by
        element, under a simulated ``--compress``)."""
        neurons = self.plan(r)
        trained = self.net.product_plan(neurons) if self.products else self.net.slice_plan(neurons)
        sizes = {t.name: self.spec[t.name][0] if t.product else self.spec[t.name][0][t.dim] for t in trained.partitioned}
        return NeuronPlan(self, neurons, trained, trained.with_holders(sizes))

    def view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` (full or compact) as the round's plans state it."""
        return t if self.products else self.net.exchange_view(name, t)

    def _tensors(self):
        """The full model's trained tensors as the plans state them (hidden-to-hidden weights rows x
        cols, or flat)."""
        return {n: self.view(n, p.detach()) for n, p in self.net.named_parameters()}

    def _assemble(self, full):
        net = copy.deepcopy(self.net)
        shapes = {n: p.shape for n, p in self.net.named_parameters()}
        net.load_state_dict({**self.fixed, **{n: t.view(shapes[n]) for n, t in full.items()}}, assign=True)
        return FullModel(net, self.keep)

    def begin_round(self, r: int):
        return self.rounds.begin(r, last=r == self.ctx.rounds - 1)

    def end_round(self, r: int, losses) -> RoundResult:
        return self.rounds.end(r, losses)

    def global_model(self):
        return self.rounds.global_model()

    def state_dict(self):
        # plans come from (seed, round) and optimizers are fresh every round: the model (decentralized:
        # this rank's part) is all
        return self.rounds.state_dict()

    def load_state_dict(self, state):
        self.rounds.load_state_dict(state)
        self._restore_fixed()

    def summary(self):
        out = {"masks": self.masks, "xi": self.keep}
        if self.masks == "categorical" and self.xi is not None:
            out["probs"] = list(self.xi)
        return out


@register_method("ist")
class IST(Masked):
    """IST's neuron partition of an MLP: ``masked`` with balanced masks (see the module docstring);
    on a transformer (``gpt_tiny``, ``gpt_small``) its FFN units and/or attention heads
    (:class:`.ist_transformer.TransformerIST`, which ``IST(ctx)`` then returns)."""

    options = {**{k: v for k, v in Masked.options.items() if k not in ("masks", "xi", "probs")},
               "partition": Option("ffn", str, "transformers: what each worker gets 1/S of in every block: ffn "
                                   "(FFN hidden units), heads (attention heads) or both; the mlp: ffn (its hidden "
                                   "neurons)", check=lambda v: v in PARTITIONS, expected=", ".join(PARTITIONS)),
               "momentum_state": MOMENTUM_OPTION}  # transformers only: the mlp's neurons start afresh each round
    fixed_masks = "balanced"

    def __new__(cls, ctx=None):
        if ctx is not None and (ctx.hp.model in language_models() or is_external_model(ctx.hp.model)):
            return TransformerIST(ctx)
        return super().__new__(cls)

    @classmethod
    def validate(cls, hp):
        """The package's mlp: its hidden neurons (masked's checks); its GPTs and a user's model
        (``MODULE:FACTORY``): the FFN units / heads found in its structure (TransformerIST)."""
        if hp.model in language_models() or is_external_model(hp.model):
            Method.validate.__func__(cls, hp)
            mlp_only = {k: v.default for k, v in cls.options.items() if k not in ("partition", "momentum_state")}
            if hp.model in language_models():
                return TransformerIST.validate_transformer(hp, mlp_only)
            for key, default in mlp_only.items():
                if hp.options.get(key, default) != default:
                    raise ConfigError(f"options.{key}", f"applies to ist on the mlp model, not to {hp.model!r}")
            TransformerIST.validate_model(probe_model(hp), hp.num_workers, hp.options.get("partition", "ffn"),
                                          load_model_spec(hp.model_spec))
            return None
        super().validate(hp)
        if hp.options.get("partition", "ffn") != "ffn":
            raise ConfigError("options.partition", f"partition={hp.options['partition']} needs a transformer "
                              f"(gpt_tiny, gpt_small); the mlp's partition is its hidden neurons (ffn)")
        if hp.options.get("momentum_state", "reset") != "reset":
            raise ConfigError("options.momentum_state", f"{hp.options['momentum_state']} needs a transformer "
                              "(gpt_tiny, gpt_small, a user's model); the mlp's neuron subnetworks start every "
                              "round with fresh optimizer state (reset)")
