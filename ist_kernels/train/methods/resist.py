"""ResIST (paper 003 §2.2-§2.6) with its local-SGD warm-up.

1. Warm-up ("warmup"), the first ``warmup_fraction`` of the rounds: local SGD on the full ResNet
   (every worker trains it, one flat all_reduce per round: the engine's ``LocalModels``), as §2.6 does
   for the first epochs, with the blocks ResIST will partition already scaled by the full model's
   ``residual_scale`` (§2.6, footnote 2: "to maintain consistency with ResIST"), so the full
   model computes the same function before, during and after the switch to ResIST rounds.
2. ResIST rounds ("resist"): each round a fresh ``resist_plan(model, S, min_depth,
   ctx.generator(PLAN, r))``; the third stage's blocks (except its first) are dealt round-robin to
   S shallower sub-ResNets, each worker trains its own for ``local_steps``, and every block goes
   straight to its next owners (the engine's ``SubnetRounds``; decentralized storage by default, §2.5
   Figure 3: a rank holds only its sub-ResNet, the full model is assembled only to evaluate or
   save). Aggregation sets the full model's residual scales (the expected fraction of sub-ResNets
   owning a block, 1/S without sharing), which evaluation of the full model uses.

``min_depth``: partitioned blocks per sub-ResNet (default: min(5, max(P / S rounded up, P // 2)) of the P
blocks of layer3 after its first: the paper's 5 on ResNet-101, fewer on shallower stages).

On a transformer (``gpt_tiny``, ``gpt_small``) the blocks between the first and the last are dealt
the same way (:func:`ist_kernels.partition.transformer_resist_plan`; default ``min_depth`` 1) and
a partitioned block's two branches carry the full model's ``residual_scale``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ...models.gpt import gpt_shape
from ...partition import check_resist, is_transformer, resist_plan, transformer_resist_plan
from ...partition.resnet_blocks import find_resnet
from ..model_registry import is_external_model, language_models, load_model_spec, probe_model
from ..phases import Phase, Phases
from ..rounds import MOMENTUM_OPTION, LocalModels, SubnetRounds, phase_rounds, state_split, warn_payoff
from . import ConfigError, Method, Option, register_method

PLAN = 0x2E51  # generator tag of the round's plan


@register_method("resist")
class ResIST(Method):
    options = {
        "warmup_fraction": Option(0.1, float, "fraction of the rounds of local-SGD warm-up (paper 003 §2.6)",
                                  check=lambda v: 0 <= v < 1, expected="a number in [0, 1)"),
        "min_depth": Option(-1, int, "partitioned blocks per sub-ResNet (-1: min(5, max(P/S rounded up, P//2)) of the P partitionable blocks; "
                            "transformers: 1)",
                            check=lambda v: v >= -1, expected="an integer >= 0, or -1"),
        "momentum_state": MOMENTUM_OPTION,
    }
    phases = ("warmup", "resist")
    outer_optimizer = True

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.model == "mlp":
            raise ConfigError("model", "resist partitions the blocks of a ResNet; use e.g. preact_resnet34")
        if is_external_model(hp.model):  # a user's model: a transformer's layers or a ResNet's blocks, by structure
            net, min_depth, spec = probe_model(hp), hp.options.get("min_depth", -1), load_model_spec(hp.model_spec)
            try:
                if spec is not None or is_transformer(net):
                    check_resist(net, hp.num_workers, max(min_depth, 1), spec, who="resist")
                else:
                    find_resnet(net, "resist")
            except ValueError as e:
                raise ConfigError("options.min_depth" if "min_depth" in str(e) else "model", str(e)) from None
        if hp.model in language_models():
            depth = gpt_shape(hp.model, hp.width, hp.depth)[1]
            if depth < 3:
                raise ConfigError("depth", f"resist deals the blocks between the first and the last of {hp.model}: "
                                  f"it needs depth >= 3, got {depth}")
            if hp.options.get("min_depth", -1) > depth - 2:
                raise ConfigError("options.min_depth", f"{hp.options['min_depth']} is more than the {depth - 2} "
                                  f"blocks between the first and the last of {hp.model}")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.workers = ctx.local_workers
        o = ctx.options
        self.warmup_rounds = phase_rounds(ctx.rounds, o["warmup_fraction"])
        self.momentum_state = o["momentum_state"]
        self.model = ctx.build_model()
        spec = ctx.model_spec
        if spec is not None or is_transformer(self.model):
            self.make_plan = functools.partial(transformer_resist_plan, spec=spec)
        else:
            self.make_plan = resist_plan
        # plans made here only describe the model: any permutation does, none touches the global RNG
        probe = lambda S, depth: self.make_plan(self.model, S, depth, torch.Generator().manual_seed(0))  # noqa: E731
        blocks = len(probe(1, 0).partitioned_blocks)  # checks the model (ValueError)
        # the paper's 5 (ResNet-101: 22 partitioned blocks), but never more than half the blocks (or the
        # round-robin share, if more): with 5 blocks, min_depth 5 would give every sub-ResNet all of them
        default = 1 if self.make_plan is not resist_plan else \
            min(5, max(-(-blocks // ctx.num_workers), blocks // 2, 1))
        self.min_depth = default if o["min_depth"] == -1 else o["min_depth"]
        if self.min_depth > blocks:
            where = "blocks between its first and last" if self.make_plan is not resist_plan else "layer3"
            raise ConfigError("options.min_depth", f"{self.min_depth} is more than the {blocks} partitionable "
                              f"blocks of {ctx.hp.model}'s {where}")
        self.full_state_bytes = ctx.full_state_bytes(self.model)
        full_model = self._full_model_scales()
        spec = {n: (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()}
        warn_payoff(state_split(full_model.slices, spec, [n for n, _ in self.model.named_parameters()],
                                ctx.param_state_tensors), ctx.num_workers, "resist", f" on {ctx.hp.model}")
        self.rounds = None
        models = {s: (self.model if s == self.workers[0] else ctx.build_model()) for s in self.workers}
        for m in models.values():  # the warm-up trains with the ResIST rounds' scales already
            full_model.scale_residuals(m)
        self.warmup = LocalModels(ctx, models, outer=True)
        self.schedule = Phases(ctx, [Phase(self.warmup_rounds, lambda r: self.warmup), Phase(None, self._start_resist)])

    def _full_model_scales(self):
        """A plan whose ``scale_residuals(model)`` sets the scale every ResIST round's aggregation
        sets: it depends on S and min_depth, not on the round's permutation (any generator does,
        none touches the global RNG)."""
        return self.make_plan(self.model, self.ctx.num_workers, self.min_depth, torch.Generator().manual_seed(0))

    def plan(self, r: int):
        return self.make_plan(self.model, self.ctx.num_workers, self.min_depth, self.ctx.generator(PLAN, r))

    def _start_resist(self, r: Optional[int] = None) -> SubnetRounds:
        """The sub-ResNets' rounds after the warm-up: holding round ``r``'s plan (None: restored
        from a checkpoint by the caller)."""
        self.warmup = None  # after the warm-up's averaging every copy is self.model
        self.rounds = SubnetRounds(self.ctx, self.model, self.momentum_state, self.plan)
        self.split = state_split(self.rounds.plan(self.warmup_rounds).slices, self.rounds.spec,
                                 self.rounds.param_names, self.ctx.param_state_tensors)
        if r is not None:
            self.rounds.start(r)
        return self.rounds

    def begin_round(self, r: int):
        return self.schedule.begin(r)

    def end_round(self, r: int, losses):
        return self.schedule.end(r, losses)

    def global_model(self):
        return self.model if self.rounds is None else self.rounds.global_model()

    def summary(self):
        return {"warmup_rounds": self.warmup_rounds, "min_depth": self.min_depth, **getattr(self, "split", {})}

    def state_dict(self):
        if self.rounds is None:
            return {"phase": "warmup", **self.warmup.state_dict()}
        return {"phase": "resist", "rounds": self.rounds.state_dict()}  # the scales follow from S and min_depth

    def load_state_dict(self, state):
        if state["phase"] == "warmup":
            self.warmup.load_state_dict(state)
            return
        self.schedule.resume(self.warmup_rounds, self._start_resist())
        self.rounds.load_state_dict(state["rounds"])
        self._full_model_scales().scale_residuals(self.model)  # attributes or hooks, as aggregation sets them
