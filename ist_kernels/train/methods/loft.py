"""LOFT (paper 000 §4 Algorithm 1, §6): pre-train with filter-wise subnetworks, prune by filter
L2 norm, fine-tune.

1. Pre-train, the first ``pretrain_fraction`` of the rounds: each round a fresh
   ``loft_plan(model, S, ctx.generator(PLAN, r))`` (every rank derives the same plan, none is sent),
   each worker trains its narrower subnetwork for ``local_steps``, and the filters are put back and the
   shared layers averaged (``_subnet.SubnetRounds``: simulated ``plan.aggregate``; distributed one
   replicated ``Exchange``, bit-identical to it). The full CNN is never trained directly.
2. Prune (at the first fine-tune round): ``prune_filters(model, cfg.prune_ratio)`` removes the
   lowest-L2-norm filters of every partitioned conv; the result is a physically smaller model.
3. Fine-tune the pruned model for the remaining rounds with local SGD (every worker trains the whole
   pruned model, one flat all_reduce of it per round: ``localsgd.LocalModels``), fresh optimizers.

The learning-rate schedule runs over all rounds. Bytes: pre-train, the exchange's counters;
fine-tune, the local-SGD all_reduce of the pruned model. ``--baseline`` compares with the paper's
baseline, local SGD through the same pipeline (dense pre-training for the same rounds, the same
pruning, fine-tuning): ``localsgd`` with the same ``pretrain_fraction``.
"""
from __future__ import annotations

from . import ConfigError, Method, Option, RoundResult, register_method
from ._subnet import MOMENTUM_OPTION, SubnetRounds, count_params, phase_rounds
from .localsgd import pruned_local_models

PRETRAIN_FRACTION = 0.5

PLAN = 0x10F7  # generator tag of the round's plan


@register_method("loft")
class Loft(Method):
    options = {
        "pretrain_fraction": Option(PRETRAIN_FRACTION, float, "fraction of the rounds that pre-train with LOFT "
                                    "(the rest fine-tune the pruned model)", check=lambda v: 0 < v <= 1,
                                    expected="a number in (0, 1]"),
        "momentum_state": MOMENTUM_OPTION,
    }
    phases = ("pretrain", "finetune")

    @classmethod
    def baseline_options(cls, options):
        """Paper 000 §6: local SGD pre-trains for the same rounds, the same pruning, fine-tuning."""
        return {"pretrain_fraction": options.get("pretrain_fraction", PRETRAIN_FRACTION)}

    @classmethod
    def validate(cls, cfg):
        super().validate(cfg)
        if cfg.model == "mlp":
            raise ConfigError("model", "loft partitions the filters of a ResNet; use e.g. preact_resnet18")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.workers = ctx.local_workers
        o = ctx.options
        self.pretrain_rounds = phase_rounds(ctx.rounds, o["pretrain_fraction"])
        self.model = ctx.build_model()
        self.full_params = count_params(self.model)
        self.rounds = SubnetRounds(ctx, self.model, o["momentum_state"])
        self.finetune = None  # localsgd.LocalModels of the pruned model, once fine-tuning started

    def run_round(self, r: int) -> RoundResult:
        ctx = self.ctx
        steps = len(self.workers) * ctx.cfg.local_steps
        if r < self.pretrain_rounds:
            from ...partition import loft_plan

            plan = loft_plan(self.model, ctx.num_workers, ctx.generator(PLAN, r))
            loss, sent = self.rounds.run(plan, r)
            return RoundResult(loss, steps, sent, extra={"phase": 0})
        if self.finetune is None:  # the same deterministic pruning on every rank (equal replicas)
            self.finetune = pruned_local_models(ctx, self.model)
        loss, sent = self.finetune.run(r)
        return RoundResult(loss, steps, sent, extra={"phase": 1})

    def global_model(self):
        return self.model if self.finetune is None else self.finetune.model

    def summary(self):
        out = {"pretrain_rounds": self.pretrain_rounds, "prune_ratio": self.ctx.cfg.prune_ratio,
               "params_full": self.full_params}
        if self.finetune is not None:
            out["params_pruned"] = count_params(self.finetune.model)
        return out

    # ---- resume: the pre-trained model is kept unchanged after pruning, so the pruned structure
    # is rebuilt from it on load
    def state_dict(self):
        state = {"pretrain": self.rounds.state_dict(), "phase": "pretrain" if self.finetune is None else "finetune"}
        if self.finetune is not None:
            state.update(self.finetune.state_dict())
        return state

    def load_state_dict(self, state):
        self.rounds.load_state_dict(state["pretrain"])
        self.finetune = None
        if state["phase"] == "finetune":
            self.finetune = pruned_local_models(self.ctx, self.model)
            self.finetune.load_state_dict(state)
