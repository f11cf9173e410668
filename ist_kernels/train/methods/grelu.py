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

from ..config import ConfigError
from . import Method, Option, RoundResult, held_bytes, register_method
from .localsgd import average_models
from .masked import boolean

PLAN = 0x6E1D  # generator tag of the round's row partition


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
    def validate(cls, cfg):
        super().validate(cfg)
        if cfg.model != "mlp":
            raise ConfigError("model", f"method 'grelu' trains a GReLU MLP (model mlp), got {cfg.model!r}")
        if boolean(cfg.options.get("subnetworks", False)) and (cfg.width or 128) < cfg.num_workers:
            raise ConfigError("width", f"subnetworks=true partitions {cfg.width or 128} rows into "
                              f"{cfg.num_workers} groups; use width >= workers")

    def __init__(self, ctx):
        super().__init__(ctx)
        from ...nn.grelu import GReLUMLP

        cfg, o = ctx.cfg, ctx.options
        self.subnetworks = o["subnetworks"]
        self.workers = ctx.local_workers
        factory = lambda: Flat(GReLUMLP(ctx.in_features, cfg.width or 128, cfg.depth, ctx.num_outputs,  # noqa: E731
                                        bias=o["bias"]))
        # subnetworks: one replica per process (every worker starts each round from the aggregate)
        owners = self.workers[:1] if self.subnetworks else self.workers
        self.models = {s: ctx.build_model(factory) for s in owners}
        self.optimizers = ({} if self.subnetworks else
                           {s: ctx.make_optimizer(self.models[s].parameters()) for s in self.workers})
        self.full_state_bytes = ctx.full_state_bytes(next(iter(self.models.values())))

    def _trained(self, model) -> List[torch.Tensor]:
        return [p for p in model.parameters()]

    # ---- local SGD of W_1..W_L
    def _localsgd_round(self, r):
        ctx, S = self.ctx, self.ctx.num_workers
        loss = sum(ctx.train_local(self.models[s], self.optimizers[s], s, r) for s in self.workers)
        state = {s: held_bytes(self.models[s], self.optimizers[s]) for s in self.workers}
        sent = average_models([self.models[s] for s in self.workers], S, r, ctx.distributed, tensors=self._trained)
        trained = sum(t.numel() * t.element_size() for t in self._trained(self.models[self.workers[0]]))
        return loss, sent, (2 * trained * len(self.workers) if S > 1 else 0), state

    # ---- independent subnetworks of W_1..W_L
    def plan(self, r):
        """name -> S disjoint row lists (each trained tensor partitioned independently, in order)."""
        from ...partition.neurons import categorical_partition

        g = self.ctx.generator(PLAN, r)
        model = next(iter(self.models.values()))
        return {n: categorical_partition(p.shape[0], self.ctx.num_workers, g) for n, p in model.named_parameters()}

    def _subnet_round(self, r):
        ctx = self.ctx
        (model,) = self.models.values()
        plan = {n: [o.to(ctx.device) for o in owners] for n, owners in self.plan(r).items()}
        subs, loss, state = [], 0.0, {}
        for s in self.workers:
            sub = RowSubnet(model, {n: owners[s] for n, owners in plan.items()})
            opt = ctx.make_optimizer(list(sub.parameters()))
            loss += ctx.train_local(sub, opt, s, r)
            state[s] = held_bytes(model, sub.compact, opt)
            subs.append(sub)
        full = dict(model.named_parameters())
        with torch.no_grad():  # each row from its (single) owner
            for sub in subs:
                for n, rows in sub.rows.items():
                    full[n].index_copy_(0, rows, sub.compact[n].detach())
        if ctx.num_workers == 1:
            return loss, 0, 0, state
        from ...distributed import Exchange, plan_bytes, ps_bytes
        from ...partition.plan import SlicePlan, TensorSlices

        S = ctx.num_workers
        slice_plan = SlicePlan(S, tuple(TensorSlices(n, 0, tuple(o)) for n, o in plan.items()))
        local = {n: p.detach() for n, p in full.items()}
        whole = SlicePlan(S, tuple(TensorSlices(n, None) for n in plan))  # every worker needs every row
        ps = sum(ps_bytes(slice_plan, local, download=whole)[s] for s in self.workers)
        if ctx.distributed:
            ex = Exchange(slice_plan, storage="replicated", shared="exact", round=r + 1)
            ex(local)
            return loss, ex.last_stats.bytes_sent, ps, state
        stats = plan_bytes(slice_plan, None, local, storage="replicated", shared="exact")
        return loss, sum(stats[s].bytes_sent for s in self.workers), ps, state

    def run_round(self, r: int) -> RoundResult:
        loss, sent, ps, state = self._subnet_round(r) if self.subnetworks else self._localsgd_round(r)
        return RoundResult(loss_sum=loss, steps=len(self.workers) * self.ctx.cfg.local_steps, bytes_sent=sent,
                           ps_bytes=ps, state_bytes=state)

    def global_model(self):
        return next(iter(self.models.values()))

    def state_dict(self):
        return {"models": {s: m.state_dict() for s, m in self.models.items()},
                "optimizers": {s: o.state_dict() for s, o in self.optimizers.items()}}

    def load_state_dict(self, state):
        for s, m in self.models.items():
            m.load_state_dict(state["models"][s])
        for s, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][s])

    def summary(self):
        return {"subnetworks": self.subnetworks}
