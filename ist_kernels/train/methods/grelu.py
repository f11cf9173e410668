"""GReLU networks (paper 004) trained with the trainer: a :class:`~ist_kernels.nn.GReLUMLP` whose
gates come from its frozen gate network, only W_1..W_L (and their biases) training.

Default: local SGD of the trained layers (every worker trains them for τ = ``local_steps`` steps on
its shard, momentum buffers local, then W_1..W_L are averaged: one flat all_reduce; the frozen C,
Ψ, B are equal on every worker and are not sent). ``--option subnetworks=true``: independent
subnetworks of the trained layers (paper 004's IST use of the fixed gates): every round the rows
(output neurons) of each W_k are partitioned at random into S groups (``ctx.generator(PLAN, r)``),
worker s trains only its rows — the other rows stay frozen in its forward pass — with a fresh
optimizer over its compact rows, and each row of the aggregated model is its owner's. Distributed,
the rows move through an :class:`ist_kernels.distributed.Exchange`: bit-identical to the simulated
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
from ...partition.plan import SlicePlan, TensorSlices
from ..engine import LocalModels
from ..errors import ConfigError
from . import Method, Option, RoundResult, boolean, held_bytes, register_method

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
        factory = lambda: Flat(GReLUMLP(ctx.in_features, hp.width or 128, hp.depth, ctx.num_outputs,  # noqa: E731
                                        bias=o["bias"]))
        # subnetworks: one replica per process (every worker starts each round from the aggregate);
        # otherwise local SGD of the trained layers (the frozen gate network is never sent)
        if self.subnetworks:
            self.models = {self.workers[0]: ctx.build_model(factory)}
            self.local = None
        else:
            self.local = LocalModels(ctx, {s: ctx.build_model(factory) for s in self.workers}, tensors=_trained)
            self.models = self.local.models
        self.full_state_bytes = ctx.full_state_bytes(next(iter(self.models.values())))

    # ---- independent subnetworks of W_1..W_L
    def plan(self, r):
        """name -> S disjoint row lists (each trained tensor partitioned independently, in order)."""
        g = self.ctx.generator(PLAN, r)
        model = next(iter(self.models.values()))
        return {n: categorical_partition(p.shape[0], self.ctx.num_workers, g) for n, p in model.named_parameters()}

    def _subnet_round(self, r):
        ctx = self.ctx
        (model,) = self.models.values()
        with ctx.clock("plan"):
            plan = {n: [o.to(ctx.device) for o in owners] for n, owners in self.plan(r).items()}
        subs, loss, state = [], 0.0, {}
        for s in self.workers:
            sub = RowSubnet(model, {n: owners[s] for n, owners in plan.items()})
            opt = ctx.make_optimizer(list(sub.parameters()))
            loss += ctx.train_local(sub, opt, s, r)
            state[s] = held_bytes(model, sub.compact, opt)
            subs.append(sub)
        full = dict(model.named_parameters())
        with ctx.clock("unpack"), torch.no_grad():  # each row from its (single) owner
            for sub in subs:
                for n, rows in sub.rows.items():
                    full[n].index_copy_(0, rows, sub.compact[n].detach())
        if ctx.num_workers == 1:
            return loss, 0, state
        S = ctx.num_workers
        slice_plan = SlicePlan(S, tuple(TensorSlices(n, 0, tuple(o)) for n, o in plan.items()))
        local = {n: p.detach() for n, p in full.items()}
        whole = SlicePlan(S, tuple(TensorSlices(n, None) for n in plan))  # every worker needs every row
        ps = ctx.comm.ps_bytes(slice_plan, local, download=whole)
        if ctx.distributed:
            with ctx.clock("plan"):
                ctx.comm.exchange(slice_plan, None, None, local, storage="replicated", shared="exact", round=r + 1)
        else:
            ctx.comm.count_exchange(slice_plan, None, local, storage="replicated", shared="exact")
        return loss, ps, state

    def run_round(self, r: int) -> RoundResult:
        if not self.subnetworks:
            return self.local.run(r)
        loss, ps, state = self._subnet_round(r)
        return RoundResult(loss_sum=loss, steps=len(self.workers) * self.ctx.local_steps, ps_bytes=ps,
                           state_bytes=state)

    def global_model(self):
        return next(iter(self.models.values()))

    def state_dict(self):
        if self.local is not None:
            return self.local.state_dict()
        return {"models": {s: m.state_dict() for s, m in self.models.items()}, "optimizers": {}}

    def load_state_dict(self, state):
        if self.local is not None:
            self.local.load_state_dict(state)
            return
        for s, m in self.models.items():
            m.load_state_dict(state["models"][s])

    def summary(self):
        return {"subnetworks": self.subnetworks}
