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
   pruned model, one flat all_reduce of it per round: ``localsgd.average_models``), fresh optimizers.

The learning-rate schedule runs over all rounds. Bytes: pre-train, the exchange's counters;
fine-tune, the local-SGD all_reduce of the pruned model.
"""
from __future__ import annotations

from . import ConfigError, Method, Option, RoundResult, register_method
from ._subnet import MOMENTUM_OPTION, SubnetRounds, count_params, phase_rounds
from .localsgd import average_models

PLAN = 0x10F7  # generator tag of the round's plan


@register_method("loft")
class Loft(Method):
    options = {
        "pretrain_fraction": Option(0.5, float, "fraction of the rounds that pre-train with LOFT (the rest "
                                    "fine-tune the pruned model)", check=lambda v: 0 < v <= 1,
                                    expected="a number in (0, 1]"),
        "momentum_state": MOMENTUM_OPTION,
    }

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
        self.pruned = None  # worker -> pruned model, once fine-tuning started
        self.optimizers = None

    # ---- phases
    def _prune(self):
        from ...prune import prune_filters

        ratio = self.ctx.cfg.prune_ratio
        # the same deterministic pruning on every rank (the replicated models are bit-identical)
        self.pruned = {s: prune_filters(self.model, ratio) for s in self.workers}
        self.optimizers = {s: self.ctx.make_optimizer(m.parameters()) for s, m in self.pruned.items()}

    def run_round(self, r: int) -> RoundResult:
        ctx = self.ctx
        steps = len(self.workers) * ctx.cfg.local_steps
        if r < self.pretrain_rounds:
            from ...partition import loft_plan

            plan = loft_plan(self.model, ctx.num_workers, ctx.generator(PLAN, r))
            loss, sent = self.rounds.run(plan, r)
            return RoundResult(loss, steps, sent, extra={"phase": 0})
        if self.pruned is None:
            self._prune()
        loss = sum(ctx.train_local(self.pruned[s], self.optimizers[s], s, r) for s in self.workers)
        sent = average_models([self.pruned[s] for s in self.workers], ctx.num_workers, r, ctx.distributed)
        return RoundResult(loss, steps, sent, extra={"phase": 1})

    def global_model(self):
        return self.model if self.pruned is None else self.pruned[self.workers[0]]

    def summary(self):
        out = {"pretrain_rounds": self.pretrain_rounds, "prune_ratio": self.ctx.cfg.prune_ratio,
               "params_full": self.full_params}
        if self.pruned is not None:
            out["params_pruned"] = count_params(self.pruned[self.workers[0]])
        return out

    # ---- resume: the pre-trained model is kept unchanged after pruning, so the pruned structure
    # is rebuilt from it on load
    def state_dict(self):
        state = {"pretrain": self.rounds.state_dict(), "phase": "pretrain" if self.pruned is None else "finetune"}
        if self.pruned is not None:
            state["models"] = {s: m.state_dict() for s, m in self.pruned.items()}
            state["optimizers"] = {s: o.state_dict() for s, o in self.optimizers.items()}
        return state

    def load_state_dict(self, state):
        self.rounds.load_state_dict(state["pretrain"])
        self.pruned = self.optimizers = None
        if state["phase"] == "finetune":
            self._prune()
            for s in self.workers:
                self.pruned[s].load_state_dict(state["models"][s])
                self.optimizers[s].load_state_dict(state["optimizers"][s])
