"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105, Algorithm 1): local SGD with AdamW inside and an outer optimizer, for any model.

It is local SGD (the round engine's :class:`~ist_kernels.train.rounds.LocalModels`) with two
settings of its own: every round each worker starts from the global parameters θ and takes
``--local-steps`` steps of AdamW (the inner optimizer: learning rate ``--lr`` and its schedule,
``weight_decay``, ``beta1``, ``beta2``, ``eps``; its state is the worker's own and persists across
rounds); then the pseudo-gradient Δ = θ - θ_worker is averaged over the workers (one collective)
and the outer optimizer (the engine's one :class:`~ist_kernels.train.outer.OuterOptimizer`: SGD
with Nesterov momentum, ``outer_lr`` 0.7, ``outer_momentum`` 0.9, the paper's values) takes one step
on θ with the mean Δ as its gradient. Floating buffers (BatchNorm statistics) are averaged as
values, as local SGD averages them.

How Δ travels is ``--compress``, as for every method: ``none`` (one ring all_reduce: local SGD's
bytes), ``bf16`` / ``int8`` (coded, int8 with one absmax scale per chunk, in a reduce-scatter and an
all-gather with float32 sums: ``ctx.comm.average_coded_``): a rank sends 2 (S - 1) / S of the
parameters at 2 or 1 byte per element. Both byte conventions count the coded size (parameter-server:
each worker uploads its Δ and downloads the mean, coded). (The option ``outer_grad`` that did this
before is ``--compress`` now.)
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping

import torch

from ..outer import OuterOptimizer
from ..rounds import LocalModels
from . import ConfigError, Method, Option, RoundResult, WorkerTurn, boolean, register_method


def _finite_positive(v) -> bool:
    return v > 0 and math.isfinite(v)


@register_method("diloco")
class DiLoCo(Method):
    options = {
        "outer_lr": Option(0.7, float, "outer SGD learning rate (DiLoCo: 0.7)", check=_finite_positive,
                           expected="a finite number > 0"),
        "outer_momentum": Option(0.9, float, "outer SGD momentum (DiLoCo: 0.9)", check=lambda v: 0 <= v < 1,
                                 expected="a number in [0, 1)"),
        "nesterov": Option(True, boolean, "Nesterov outer momentum (DiLoCo: on)"),
        "weight_decay": Option(0.1, float, "inner AdamW weight decay (DiLoCo: 0.1)",
                               check=lambda v: v >= 0 and math.isfinite(v), expected="a finite number >= 0"),
        "beta1": Option(0.9, float, "inner AdamW beta1", check=lambda v: 0 <= v < 1, expected="a number in [0, 1)"),
        "beta2": Option(0.999, float, "inner AdamW beta2", check=lambda v: 0 <= v < 1,
                        expected="a number in [0, 1)"),
        "eps": Option(1e-8, float, "inner AdamW epsilon", check=_finite_positive, expected="a finite number > 0"),
    }

    inner_optimizer = "adamw"
    outer_compress = True  # --compress codes the pseudo-gradient

    @classmethod
    def resolve_options(cls, given: Mapping[str, Any]) -> Dict[str, Any]:
        if "outer_grad" in given:
            raise ConfigError("options.outer_grad", "how the pseudo-gradient travels is --compress now "
                              "(--compress bf16 or int8; fp32: --compress none)")
        return super().resolve_options(given)

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.outer_optimizer != "none":
            raise ConfigError("outer_optimizer", "diloco has its own outer optimizer (Nesterov SGD: --option "
                              "outer_lr=..., --option outer_momentum=...); leave --outer-optimizer at none")

    def __init__(self, ctx):
        super().__init__(ctx)
        o = ctx.options
        self.outer_lr, self.outer_momentum = o["outer_lr"], o["outer_momentum"]
        outer = OuterOptimizer.of("nesterov" if o["nesterov"] else "sgd", self.outer_lr, self.outer_momentum)
        inner = dict(betas=(o["beta1"], o["beta2"]), eps=o["eps"], weight_decay=o["weight_decay"])
        self.local = LocalModels(ctx, {s: ctx.build_model() for s in ctx.local_workers}, outer=outer,
                                 make_optimizer=lambda ps: ctx.make_optimizer(ps, **inner))  # AdamW, its options
        params = [p for p in self.model.parameters() if p.requires_grad]
        # a worker holds its model, AdamW's state, θ (the round's start) and the outer momentum
        self.full_state_bytes = ctx.full_state_bytes(self.model) + \
            (1 + outer.tensors_per_param) * sum(p.numel() * p.element_size() for p in params)

    @property
    def model(self) -> torch.nn.Module:
        """θ, the global model (every worker's copy equals it after a round)."""
        return self.local.model

    @property
    def momentum(self) -> List[torch.Tensor]:
        """The outer momentum of θ's parameters (the outer optimizer's ``momentum_buffer``)."""
        return [self.local.outer.state[n]["momentum_buffer"] for n in self.local._names]

    def begin_round(self, r: int) -> List[WorkerTurn]:
        return self.local.begin(r)

    def end_round(self, r: int, losses) -> RoundResult:
        return self.local.end(r, losses)

    def global_model(self):
        return self.model

    def summary(self) -> Dict[str, object]:
        return {"outer_grad": self.ctx.hp.compress if self.ctx.hp.compress != "none" else "fp32",
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}

    # resume: every local worker's model and AdamW state, and the outer state
    def state_dict(self):
        return self.local.state_dict()

    def load_state_dict(self, state):
        self.local.load_state_dict(state)
