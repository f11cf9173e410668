"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105, Algorithm 1): local SGD with an inner and an outer optimizer, for any model.

Every round each worker starts from the global parameters θ, takes ``--local-steps`` steps of
AdamW (the inner optimizer: learning rate ``--lr`` and its schedule, ``weight_decay``, ``beta1``,
``beta2``, ``eps``; its state is the worker's own and persists across rounds), then the
pseudo-gradient Δ = θ - θ_worker is averaged over the workers (one collective) and the outer
optimizer, SGD with Nesterov momentum (``outer_lr`` 0.7, ``outer_momentum`` 0.9: the paper's
values), takes one step on θ with Δ as its gradient. Floating buffers (BatchNorm statistics) are
averaged as local SGD averages them.

``outer_grad``: how Δ travels. ``fp32``: one ring all_reduce (local SGD's bytes); ``bf16`` /
``int8``: coded (int8: one absmax scale per chunk) in a reduce-scatter and an all-gather, the sums
in float32 (``ctx.comm.average_coded_``): a rank sends 2 (S - 1) / S of the parameters at 2 or 1
byte per element. Both byte conventions count the coded size (parameter-server: each worker
uploads its Δ and downloads the mean, coded).
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..outer import OuterOptimizer
from . import ConfigError, Method, Option, RoundResult, WorkerTurn, boolean, held_bytes, register_method, summed

OUTER_GRADS = ("fp32", "bf16", "int8")  # the pseudo-gradient's codecs (their sizes: the byte ledger's)


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
        "outer_grad": Option("fp32", str, "how the pseudo-gradient travels: fp32 (ring all_reduce), bf16 or int8 "
                             "(coded reduce-scatter + all-gather, float32 sums)", check=lambda v: v in OUTER_GRADS,
                             expected="fp32, bf16 or int8"),
    }

    inner_optimizer = "adamw"
    compresses = False
    compress_refusal = "diloco codes its pseudo-gradients itself; use --option outer_grad=bf16 or outer_grad=int8 " \
        "(and --compress none)"

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.outer_optimizer != "none":
            raise ConfigError("outer_optimizer", "diloco has its own outer optimizer (Nesterov SGD: --option "
                              "outer_lr=..., --option outer_momentum=...); leave --outer-optimizer at none")

    def __init__(self, ctx):
        super().__init__(ctx)
        o = ctx.options
        self.workers = ctx.local_workers
        self.outer_lr, self.outer_momentum, self.nesterov = o["outer_lr"], o["outer_momentum"], o["nesterov"]
        self.codec = o["outer_grad"]
        self.model = ctx.build_model()  # θ, the global model
        self.models = {s: ctx.build_model() for s in self.workers}  # the same initialisation as θ
        self.optimizers = {s: torch.optim.AdamW(m.parameters(), lr=ctx.hp.lr, betas=(o["beta1"], o["beta2"]),
                                                eps=o["eps"], weight_decay=o["weight_decay"])
                           for s, m in self.models.items()}
        self.theta = [p for p in self.model.parameters() if p.requires_grad]
        # the outer step: the round engine's outer optimizer (SGD with Nesterov momentum by default)
        self.outer = OuterOptimizer.of("nesterov" if o["nesterov"] else "sgd", self.outer_lr, self.outer_momentum)
        self._names = [str(i) for i in range(len(self.theta))]
        self.outer.init_state_(dict(zip(self._names, self.theta)))
        self._params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in self.models.items()}
        self._buffers = {s: [b for b in m.buffers() if b.is_floating_point()] for s, m in self.models.items()}
        self._theta_buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        pbytes = sum(p.numel() * p.element_size() for p in self.theta)
        self._numel = sum(p.numel() for p in self.theta)
        self._buffer_bytes = sum(b.numel() * b.element_size() for b in self._theta_buffers)
        # a worker holds θ, its model, AdamW's two moments and the outer momentum
        self.full_state_bytes = 2 * sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) \
            + 3 * pbytes

    @torch.no_grad()
    def _average(self, r: int) -> None:
        """The workers' parameters become the mean pseudo-gradient; their buffers the mean buffers."""
        with self.ctx.clock("pack"):
            for s in self.workers:
                ps = self._params[s]
                torch._foreach_sub_(ps, self.theta)
                torch._foreach_neg_(ps)  # θ - θ_s, exactly
        comm = self.ctx.comm
        if self.codec == "fp32":
            comm.average_models_([self._params[s] + self._buffers[s] for s in self.workers], round=r + 1)
            return
        comm.average_coded_([self._params[s] for s in self.workers], self.codec, round=r + 1)
        if self._buffer_bytes:
            comm.average_models_([self._buffers[s] for s in self.workers], round=r + 1)

    def begin_round(self, r: int) -> List[WorkerTurn]:
        return [WorkerTurn(s, self.models[s], self.optimizers[s]) for s in self.workers]

    def end_round(self, r: int, losses) -> RoundResult:
        ctx = self.ctx
        with ctx.clock("metrics"):
            state = {s: held_bytes(self.models[s], self.optimizers[s], self.model, self.outer.tensors())
                     for s in self.workers}
        self._average(r)
        with ctx.clock("plan"), torch.no_grad():
            first = self.workers[0]
            delta = [d.clone() for d in self._params[first]]
            self.outer.step_grad_(self.theta, delta, self._names)
            if self._theta_buffers:
                torch._foreach_copy_(self._theta_buffers, self._buffers[first])
            for s in self.workers:  # every worker starts the next round from θ
                torch._foreach_copy_(self._params[s], self.theta)
        # parameter-server: each worker uploads its coded pseudo-gradient (int8: one scale) and buffers,
        # and downloads the same
        ps = 2 * (ctx.comm.coded_bytes(self._numel, self.codec) + self._buffer_bytes) * len(self.workers) \
            if ctx.num_workers > 1 else 0
        return RoundResult(summed(losses), len(self.workers) * ctx.local_steps, ps_bytes=ps, state_bytes=state)

    @property
    def momentum(self) -> List[torch.Tensor]:
        """The outer momentum of θ's parameters (the outer optimizer's ``momentum_buffer``)."""
        return [self.outer.state[n]["momentum_buffer"] for n in self._names]

    def global_model(self):
        return self.model

    def summary(self) -> Dict[str, object]:
        return {"outer_grad": self.codec, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}

    # resume: θ, the outer momentum, every local worker's model and AdamW state
    def state_dict(self):
        return {"model": self.model.state_dict(), "momentum": list(self.momentum),
                "models": {s: m.state_dict() for s, m in self.models.items()},
                "optimizers": {s: o.state_dict() for s, o in self.optimizers.items()}}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            torch._foreach_copy_(self.momentum, list(state["momentum"]))
        for s in self.workers:
            self.models[s].load_state_dict(state["models"][s])
            self.optimizers[s].load_state_dict(state["optimizers"][s])

