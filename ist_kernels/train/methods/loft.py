"""LOFT (paper 000 §4 Algorithm 1, §6): pre-train with filter-wise subnetworks, prune by filter
L2 norm, fine-tune.

1. Pre-train ("pretrain"), the first ``pretrain_fraction`` of the rounds: each round a fresh
   ``loft_plan(model, S, ctx.generator(PLAN, r))`` (every rank derives the same plan, none is sent),
   each worker trains its narrower subnetwork for ``local_steps``, and the filters go to their next
   owners while the shared layers are averaged (the round engine's ``SubnetRounds``; decentralized
   storage by default: a rank never holds more than its subnetwork). The full CNN is never trained directly.
2. Prune (at the first fine-tune round): the lowest-L2-norm ``--prune-ratio`` of the filters of
   every partitioned conv go (``prune_filters``); the result is a physically smaller model on every
   worker. Decentralized, every rank computes the norms of its own filters, one all_reduce of the
   norm vectors (each filter has one owner, so the sums are exact) gives every rank the same kept
   filters, and one exchange sends each kept filter from its owner to every rank.
3. Fine-tune ("finetune") the pruned model for the remaining rounds with local SGD (every worker
   trains the whole pruned model, one flat all_reduce of it per round: the engine's ``LocalModels``),
   fresh optimizers.

The learning-rate schedule runs over all rounds. Bytes: pre-train, the exchanges' counters;
fine-tune, the pruning transfer and the local-SGD all_reduce of the pruned model. ``--baseline``
compares with the paper's baseline, local SGD through the same pipeline (dense pre-training for the
same rounds, the same pruning, fine-tuning): ``localsgd`` with the same ``pretrain_fraction``.
"""
from __future__ import annotations

import torch

from ...partition import loft_plan
from ...partition.loft import LoftPlan
from ...partition.resnet_blocks import find_resnet
from ...prune import filter_norms, keep_largest, kept_filters_by_block, prune_filters
from ..model_registry import is_external_model, probe_model
from ..phases import Phase, Phases
from ..rounds import MOMENTUM_OPTION, LocalModels, SubnetRounds, count_params, phase_rounds
from . import ConfigError, Method, Option, register_method

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
    outer_optimizer = True

    @classmethod
    def baseline_options(cls, options):
        """Paper 000 §6: local SGD pre-trains for the same rounds, the same pruning, fine-tuning."""
        return {"pretrain_fraction": options.get("pretrain_fraction", PRETRAIN_FRACTION)}

    @classmethod
    def validate(cls, hp):
        super().validate(hp)
        if hp.model == "mlp":
            raise ConfigError("model", "loft partitions the filters of a ResNet; use e.g. preact_resnet18")
        if is_external_model(hp.model):  # a user's model: its ResNet blocks, found by structure
            try:
                find_resnet(probe_model(hp), "loft")
            except ValueError as e:
                raise ConfigError("model", str(e)) from None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.workers = ctx.local_workers
        o = ctx.options
        self.pretrain_rounds = phase_rounds(ctx.rounds, o["pretrain_fraction"])
        self.model = ctx.build_model()
        find_resnet(self.model, "loft")  # the blocks LOFT partitions, found from structure (ValueError)
        self.full_params = count_params(self.model)
        self.full_state_bytes = ctx.full_state_bytes(self.model)
        self.rounds = SubnetRounds(ctx, self.model, o["momentum_state"], self.plan)
        self.split = self.rounds.open(0, "loft", f" on {ctx.hp.model}", ctx.param_state_tensors)
        self.finetune = None  # localsgd.LocalModels of the pruned model, once fine-tuning started
        self.kept = None  # block -> kept filters (decentralized: rebuilds the pruned structure on resume)
        self.schedule = Phases(ctx, [Phase(self.pretrain_rounds, lambda r: self.rounds),
                                   Phase(None, self._start_finetune)])

    def plan(self, r: int):
        return loft_plan(self.model, self.ctx.num_workers, self.ctx.generator(PLAN, r))

    # ---- phases
    def _start_finetune(self, r: int) -> LocalModels:
        self._prune(r)
        return self.finetune

    def _prune(self, r: int, resumed: bool = False) -> None:
        """The pre-trained model pruned on every worker (its bytes counted, unless ``resumed``:
        rebuilt from a checkpoint, nothing sent)."""
        ratio = self.ctx.hp.prune_ratio
        if self.rounds.decentral:
            return self._prune_decentral(r, ratio)
        # the same deterministic pruning on every rank (the replicated models are bit-identical)
        self.kept = {b: idx for b, (_, idx) in kept_filters_by_block(self.model, ratio).items()}
        self.finetune = LocalModels(self.ctx, {s: prune_filters(self.model, ratio) for s in self.workers},
                                    outer=True)
        if self.ctx.simulated and self.ctx.decentralized and not resumed:
            self._count_prune()

    def _pruned_plan(self):
        S = self.ctx.num_workers
        return LoftPlan(self.model, S, filters={b: [k] * S for b, k in self.kept.items()})

    def _prune_decentral(self, r: int, ratio: float) -> None:
        ctx, rounds, s = self.ctx, self.rounds, self.ctx.rank
        plan = rounds.plan(rounds.held)
        convs = [(b.name, f"{b.name}.{plan.layers[b.name][0]}.weight") for b in plan.blocks]
        owners = {t.name: t.owners[s] for t in plan.partitioned}
        norms = []
        for _, name in convs:
            n = torch.zeros(rounds.spec[name][0][0], dtype=torch.float64, device=ctx.device)
            if owners[name].numel():
                n[owners[name].to(ctx.device)] = filter_norms(rounds.part[name])
            norms.append(n)
        flat = torch.cat(norms)
        ctx.comm.all_reduce_sum_(flat, "filter norms", r)
        self.kept = {b: keep_largest(n, ratio) for (b, _), n in zip(convs, flat.split([n.numel() for n in norms]))}
        pruned = self._pruned_plan()
        names = [t.name for t in plan.partitioned]
        moved = ctx.comm.exchange(plan.slices, pruned.slices, rounds.spec,
                                  {n: rounds.part[n] for n in names if n in rounds.part}, names=names,
                                  round=r + 1, drop_unowned=True)
        self.finetune = LocalModels(ctx, {s: pruned.attach(s, {**rounds.part, **moved}).module}, outer=True)
        rounds.drop()  # the pre-trained subnetwork is no longer needed

    def _count_prune(self) -> None:
        """What :meth:`_prune_decentral` sends, from the plans (simulated runs report it)."""
        rounds, comm = self.rounds, self.ctx.comm
        plan, pruned = rounds.plan(rounds.held), self._pruned_plan()
        norms = sum(rounds.spec[f"{b.name}.{plan.layers[b.name][0]}.weight"][0][0] for b in plan.blocks)
        comm.count_all_reduce(8 * norms)
        comm.count_exchange(plan.slices, pruned.slices, rounds.spec, names=[t.name for t in plan.partitioned])

    def begin_round(self, r: int):
        return self.schedule.begin(r)

    def end_round(self, r: int, losses):
        return self.schedule.end(r, losses)

    def global_model(self):
        return self.rounds.global_model() if self.finetune is None else self.finetune.model

    def summary(self):
        out = {"pretrain_rounds": self.pretrain_rounds, "prune_ratio": self.ctx.hp.prune_ratio,
               "params_full": self.full_params, **self.split}
        if self.finetune is not None:
            out["params_pruned"] = count_params(self.finetune.model)
        return out

    # ---- resume. Replicated / simulated: the pre-trained model is kept unchanged after pruning, so
    # the pruned structure is rebuilt from it. Decentralized: from the kept filters.
    def state_dict(self):
        state = {"pretrain": self.rounds.state_dict(), "phase": "pretrain" if self.finetune is None else "finetune"}
        if self.finetune is not None:
            state.update(self.finetune.state_dict(), kept=self.kept)
        return state

    def load_state_dict(self, state):
        self.rounds.load_state_dict(state["pretrain"])
        self.finetune = None
        if state["phase"] != "finetune":
            return
        if self.rounds.decentral:
            self.kept = state["kept"]
            pruned = self._pruned_plan()
            self.finetune = LocalModels(self.ctx, {s: pruned.attach(s, dict(state["models"][s])).module
                                                   for s in self.workers}, outer=True)
        else:
            self._prune(self.pretrain_rounds, resumed=True)
        self.finetune.load_state_dict(state)
        self.schedule.resume(self.pretrain_rounds, self.finetune)
