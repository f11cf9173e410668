"""Local SGD, the baseline of papers 000 (Table 1) and 003 (Tables 1-9): every worker trains the
whole model for tau local steps on its own shard, then the full model is averaged with one flat
all_reduce. Momentum buffers stay local to each worker (as in the reference codes; option
``momentum_state=reset`` clears them after every average instead: an ablation of the subnetwork
methods' default).

LOFT's paper baseline (paper 000 §6, Table 1) is local SGD through the same pipeline as LOFT:
with ``pretrain_fraction`` < 1, local SGD pre-trains the dense model for that fraction of the
rounds, the lowest-L2-norm filters are pruned (``prune_filters(model, cfg.prune_ratio)``, as LOFT
prunes) and local SGD fine-tunes the pruned model, with fresh optimizers, for the rest.
``ist-train --method loft --baseline`` runs this (``Loft.baseline_options``).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from ...prune import prune_filters
from ..phases import Phase, Phases
from ..rounds import LocalModels, count_params, phase_rounds
from . import ConfigError, Method, Option, register_method


@register_method("localsgd")
class LocalSGD(Method):
    options = {
        "pretrain_fraction": Option(1.0, float, "fraction of the rounds before the filters are pruned by L2 norm "
                                    "(--prune-ratio) and the pruned model is fine-tuned: LOFT's paper baseline; "
                                    "1: dense local SGD throughout", check=lambda v: 0 < v <= 1,
                                    expected="a number in (0, 1]"),
        "momentum_state": Option("local", str, "the workers' optimizer state across rounds: local (each keeps its "
                                 "own, as the papers' baseline) or reset (cleared after every average, as the "
                                 "subnetwork methods' default momentum_state=reset: an ablation)",
                                 check=lambda v: v in ("local", "reset"), expected="local or reset"),
    }
    phases = ("pretrain", "finetune")
    outer_optimizer = True
    outer_compress = True  # --compress codes the pseudo-gradient of the outer step

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.options.get("pretrain_fraction", 1.0) < 1 and hp.model == "mlp":
            raise ConfigError("options.pretrain_fraction", "pruning filters needs a ResNet model (e.g. "
                              "preact_resnet18), got mlp; leave pretrain_fraction at 1")

    def __init__(self, ctx):
        super().__init__(ctx)
        # (.get: a subclass may bring its own options)
        self.pretrain_rounds = phase_rounds(ctx.rounds, ctx.options.get("pretrain_fraction", 1.0))
        self.prunes = self.pretrain_rounds < ctx.rounds
        self.reset_state = ctx.options.get("momentum_state", "local") == "reset"
        self.local = LocalModels(ctx, {s: ctx.build_model() for s in ctx.local_workers}, outer=True,
                                 reset_state=self.reset_state)
        self.full_params = count_params(self.local.model)
        self.full_state_bytes = ctx.full_state_bytes(self.local.model)
        self.dense = None  # the pre-trained model, once pruned
        first = Phase(self.pretrain_rounds, lambda r: self.local)
        self.schedule = Phases(ctx, [first, Phase(None, self._prune)] if self.prunes else [first])

    @property
    def models(self) -> Dict[int, nn.Module]:
        """The local workers' models (pruned ones once fine-tuning started)."""
        return self.local.models

    @property
    def optimizers(self) -> Dict[int, torch.optim.Optimizer]:
        return self.local.optimizers

    def _prune(self, r: Optional[int] = None) -> LocalModels:
        """Fine-tuning (from round ``r``): the pre-trained model pruned, one copy per local worker."""
        self.dense = self.local.model
        # every local worker gets the same pruned copy (deterministic, so equal on every rank)
        ratio = self.ctx.hp.prune_ratio
        self.local = LocalModels(self.ctx, {s: prune_filters(self.dense, ratio) for s in self.ctx.local_workers},
                                 outer=True, reset_state=self.reset_state)
        return self.local

    def begin_round(self, r: int):
        return self.schedule.begin(r)

    def end_round(self, r: int, losses):
        return self.schedule.end(r, losses)

    def global_model(self):
        return self.local.model

    def summary(self):
        if not self.prunes:
            return {}
        out = {"pretrain_rounds": self.pretrain_rounds, "prune_ratio": self.ctx.hp.prune_ratio,
               "params_full": self.full_params}
        if self.dense is not None:
            out["params_pruned"] = count_params(self.local.model)
        return out

    # resume: the pre-trained dense model is kept, the pruned structure is rebuilt from it on load
    def state_dict(self):
        state = self.local.state_dict()
        if self.dense is not None:
            state["pretrain"] = self.dense.state_dict()
        return state

    def load_state_dict(self, state):
        if "pretrain" in state and self.dense is None:
            self.local.model.load_state_dict(state["pretrain"])
            self.schedule.resume(self.pretrain_rounds, self._prune())
        self.local.load_state_dict(state)
