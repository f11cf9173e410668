"""GReLU networks (paper 004) trained with the trainer: a :class:`~ist_kernels.nn.GReLUMLP` whose
gates come from its frozen gate network, only W_1..W_L (and their biases) training.

Default: local SGD of the trained layers (every worker trains them for τ = ``local_steps`` steps on
its shard, momentum buffers local, then W_1..W_L are averaged: one flat all_reduce; the frozen C,
Ψ, B are equal on every worker and are not sent). ``--option subnetworks=true``: independent
subnetworks of the trained layers (paper 004's IST use of the fixed gates): every round the rows
(output neurons) of each W_k are partitioned at random into S groups (``ctx.generator(PLAN, r)``),
worker s trains only its rows — the other rows stay frozen in its forward pass — with a fresh
optimizer over its compact rows, and each row of the aggregated model is its owner's. Distributed,
the rows move through one replicated exchange (the round engine): bit-identical to the simulated
run, and each rank sends only its rows, once to every other rank. Storage: a worker's forward
reads every row of W_1..W_L (the rows it does not train, frozen), so every rank needs the whole
trained layers each round: decentralized and replicated storage are the same thing here (a rank
trains and sends only its rows, holds optimizer state only for them, and receives all the others).
Parameter-server count: a worker uploads its rows and downloads the whole W_1..W_L.

``--model mlp``: ``--width`` (default 128) and ``--depth`` (trained layers L) size the network.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn

from ...nn.grelu import GReLUMLP
from ...partition.neurons import categorical_partition
from ...partition.plan import RoundPlan, SlicePlan, TensorSlices
from ..errors import ConfigError
from ..rounds import LocalModels, SubnetRounds
from . import Method, Option, RoundResult, boolean, register_method

PLAN = 0x6E1D  # generator tag of the round's row partition


def _trained(model) -> List[torch.Tensor]:
    """What local SGD averages: the trained layers W_1..W_L (the frozen C, Psi, B are buffers,
    equal on every worker)."""
    return list(model.parameters())


class Flat(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x.flatten(1))


class RowSubnet(nn.Module):
    """The GReLU network with only ``rows[name]`` of each trained tensor training (compact leaves);
    the other rows are the frozen values of the full model."""

    def __init__(self, net, rows: Dict[str, torch.Tensor]):
        super().__init__()
        self._net = [net]
        full = dict(net.named_parameters())
        self.rows = rows
        self.compact = {n: full[n].detach().index_select(0, r).requires_grad_(True) for n, r in rows.items()}

    def parameters(self, recurse: bool = True):
        return iter(self.compact.values())

    def forward(self, x):
        net = self._net[0]
        full = dict(net.named_parameters())
        params = {n: full[n].detach().index_copy(0, self.rows[n], self.compact[n]) for n in self.rows}
        return torch.func.functional_call(net, params, (x.flatten(1),))


class _RowSub:
    def __init__(self, index, module):
        self.index, self.module, self.optimizer = index, module, None


class RowPlan(RoundPlan):
    """One round's row partition of W_1..W_L in the round engine's plan protocol
    (:class:`ist_kernels.train.rounds.SubnetRounds`, replicated storage: a worker's forward reads
    every row, so every rank holds every row; each uploads its rows and downloads all of them)."""

    def __init__(self, model, rows: Dict[str, List[torch.Tensor]], workers: List[int]):
        self.model, self.rows, self.workers = model, rows, workers
        S = len(next(iter(rows.values())))
        self.slices = SlicePlan(S, tuple(TensorSlices(n, 0, tuple(o.cpu() for o in owners))
                                         for n, owners in rows.items()))
        self.ps_download = SlicePlan(S, tuple(TensorSlices(n, None) for n in rows))  # every row

    def build(self, optimizer=None):
        return {s: _RowSub(s, RowSubnet(self.model, {n: owners[s] for n, owners in self.rows.items()}))
                for s in self.workers}

    def compact(self, sub):
        """Plan name -> the subnetwork's compact rows (sharing storage)."""
        return {n: t.detach() for n, t in sub.module.compact.items()}

    def aggregate(self, subs, optimizer=None):
        full = dict(self.model.named_parameters())
        with torch.no_grad():  # each row from its (single) owner
            for sub in subs:
                for n, rows in sub.module.rows.items():
                    full[n].index_copy_(0, rows, sub.module.compact[n].detach())

    def held(self, sub, opt, extra=()) -> tuple:
        return (self.model, sub.module.compact, opt)


@register_method("grelu")
class GReLU(Method):
    options = {
        "subnetworks": Option(False, boolean, "train independent subnetworks (row partitions) of W_1..W_L "
                              "instead of local SGD", expected="true or false"),
        "bias": Option(False, boolean, "biases in every layer (paper 004 has none)"),
    }

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.model != "mlp":
            raise ConfigError("model", f"method 'grelu' trains a GReLU MLP (model mlp), got {hp.model!r}")
        if boolean(hp.options.get("subnetworks", False)) and (hp.width or 128) < hp.num_workers:
            raise ConfigError("width", f"subnetworks=true partitions {hp.width or 128} rows into "
                              f"{hp.num_workers} groups; use width >= workers")

    def __init__(self, ctx):
        super().__init__(ctx)
        hp, o = ctx.hp, ctx.options
        self.subnetworks = o["subnetworks"]
        self.workers = ctx.local_workers
        factory = lambda: Flat(GReLUMLP(ctx.in_features, hp.width or 128, hp.depth or 1, ctx.num_outputs,  # noqa: E731
                                        bias=o["bias"]))
        # subnetworks: one replica per process (every worker starts each round from the aggregate),
        # rounds of row partitions on the round engine; otherwise local SGD of the trained layers
        # (the frozen gate network is never sent)
        if self.subnetworks:
            model = ctx.build_model(factory)
            self.models = {self.workers[0]: model}
            self.local = None
            params = lambda: {n: p.detach() for n, p in model.named_parameters()}  # noqa: E731
            self.rounds = SubnetRounds(ctx, model, "reset", self.plan, spec=params(), tensors=params,
                                       storage="replicated")
            self.rounds.start(0)
        else:
            self.local = LocalModels(ctx, {s: ctx.build_model(factory) for s in self.workers}, tensors=_trained)
            self.models = self.local.models
        self.full_state_bytes = ctx.full_state_bytes(next(iter(self.models.values())))

    # ---- independent subnetworks of W_1..W_L
    def plan(self, r) -> RowPlan:
        """S disjoint row lists of every trained tensor (each partitioned independently, in order)."""
        g = self.ctx.generator(PLAN, r)
        model = next(iter(self.models.values()))
        rows = {n: [o.to(self.ctx.device) for o in categorical_partition(p.shape[0], self.ctx.num_workers, g)]
                for n, p in model.named_parameters()}
        return RowPlan(model, rows, self.workers)

    def begin_round(self, r: int):
        if not self.subnetworks:
            return self.local.begin(r)
        return self.rounds.begin(r, last=r == self.ctx.rounds - 1)

    def end_round(self, r: int, losses) -> RoundResult:
        return (self.rounds if self.subnetworks else self.local).end(r, losses)

    def global_model(self):
        return next(iter(self.models.values()))

    def state_dict(self):
        return self.local.state_dict() if self.local is not None else self.rounds.state_dict()

    def load_state_dict(self, state):
        (self.local or self.rounds).load_state_dict(state)

    def summary(self):
        return {"subnetworks": self.subnetworks}
