"""Local SGD, the baseline of papers 000 (Table 1) and 003 (Tables 1-9): every worker trains the
whole model for tau local steps on its own shard, then the full model is averaged with one flat
all_reduce. Momentum buffers stay local to each worker (as in the reference codes).

LOFT's paper baseline (paper 000 §6, Table 1) is local SGD through the same pipeline as LOFT:
with ``pretrain_fraction`` < 1, local SGD pre-trains the dense model for that fraction of the
rounds, the lowest-L2-norm filters are pruned (``prune_filters(model, cfg.prune_ratio)``, as LOFT
prunes) and local SGD fine-tunes the pruned model, with fresh optimizers, for the rest.
``ist-train --method loft --baseline`` runs this (``Loft.baseline_options``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from ...distributed import average_model_
from . import ConfigError, Method, Option, RoundResult, all_reduce_wire_bytes, held_bytes, register_method
from ._subnet import count_params, phase_rounds


def averaged_tensors(model: torch.nn.Module) -> List[Tensor]:
    """Parameters and floating-point buffers (BN running statistics); integer buffers such as
    num_batches_tracked are equal on every worker and are not sent."""
    return [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]


def flat_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in averaged_tensors(model))


def ps_bytes_per_worker(model: torch.nn.Module) -> int:
    """The papers' parameter-server count of a local-SGD round, per worker: it uploads and downloads
    the whole model (papers 000 and 003, Table 1: 2 S models per round)."""
    return 2 * flat_bytes(model)


def average_models(models, num_workers: int, r: int, distributed: bool,
                   tensors: Callable[[torch.nn.Module], List[Tensor]] = averaged_tensors) -> int:
    """Average the full models over the S workers: distributed, one flat all_reduce per dtype
    (``ist_kernels.distributed.average_model_``: sum, then / S); simulated, the same sum over the
    local copies, then / S. Returns the bytes this process's workers sent (ring all_reduce wire
    bytes, as CommStats counts; simulated: what each of the S ranks would send). ``tensors`` picks
    what of a model is averaged (default: :func:`averaged_tensors`)."""
    if num_workers == 1:  # nothing to average, nothing sent
        return 0
    if distributed:
        (model,) = models
        return average_model_(tensors(model), round=r + 1).bytes_sent
    lists = [tensors(m) for m in models]
    with torch.no_grad():
        total = torch.cat([t.reshape(-1) for t in lists[0]])
        for ts in lists[1:]:
            total += torch.cat([t.reshape(-1) for t in ts])
        total /= num_workers
        for ts in lists:
            torch._foreach_copy_(ts, [v.view_as(t) for v, t in zip(total.split([t.numel() for t in ts]), ts)])
    return len(models) * all_reduce_wire_bytes(total.numel() * total.element_size(), num_workers)


class LocalModels:
    """This process's workers' copies of one model and their optimizers, trained with local SGD:
    ``run(r)`` is one round (local steps on every local worker, then the average)."""

    def __init__(self, ctx, models: Dict[int, nn.Module]):
        self.ctx = ctx
        self.models = models
        self.optimizers = {s: ctx.make_optimizer(m.parameters()) for s, m in models.items()}

    @property
    def model(self) -> nn.Module:
        """The first local worker's copy (after a round all copies are equal)."""
        return self.models[min(self.models)]

    def run(self, r: int, phase: Optional[int] = None) -> RoundResult:
        """The round's result: the local workers' summed loss, the bytes this process sent both ways
        (wire; parameter-server: each worker up- and downloads the whole model) and the state each
        worker held; ``phase`` tags it (``extra["phase"]``)."""
        ctx = self.ctx
        workers = sorted(self.models)
        loss = sum(ctx.train_local(self.models[s], self.optimizers[s], s, r) for s in workers)
        state = {s: held_bytes(self.models[s], self.optimizers[s]) for s in workers}
        sent = average_models([self.models[s] for s in workers], ctx.num_workers, r, ctx.distributed)
        ps = sum(ps_bytes_per_worker(self.models[s]) for s in workers) if ctx.num_workers > 1 else 0
        return RoundResult(loss, len(workers) * ctx.cfg.local_steps, sent, extra=None if phase is None else
                           {"phase": phase}, ps_bytes=ps, state_bytes=state)

    def state_dict(self):
        return {"models": {s: m.state_dict() for s, m in self.models.items()},
                "optimizers": {s: o.state_dict() for s, o in self.optimizers.items()}}

    def load_state_dict(self, state):
        for s in self.models:
            self.models[s].load_state_dict(state["models"][s])
            self.optimizers[s].load_state_dict(state["optimizers"][s])


def pruned_local_models(ctx, dense: nn.Module) -> LocalModels:
    """Fine-tuning after pre-training: every local worker gets the same pruned copy of ``dense``
    (``prune_filters`` with cfg.prune_ratio; deterministic, so equal on every rank) and a fresh
    optimizer."""
    from ...prune import prune_filters

    return LocalModels(ctx, {s: prune_filters(dense, ctx.cfg.prune_ratio) for s in ctx.local_workers})


@register_method("localsgd")
class LocalSGD(Method):
    options = {
        "pretrain_fraction": Option(1.0, float, "fraction of the rounds before the filters are pruned by L2 norm "
                                    "(--prune-ratio) and the pruned model is fine-tuned: LOFT's paper baseline; "
                                    "1: dense local SGD throughout", check=lambda v: 0 < v <= 1,
                                    expected="a number in (0, 1]"),
    }
    phases = ("pretrain", "finetune")

    @classmethod
    def validate(cls, cfg):
        super().validate(cfg)
        if cfg.options.get("pretrain_fraction", 1.0) < 1 and cfg.model == "mlp":
            raise ConfigError("options.pretrain_fraction", "pruning filters needs a ResNet model (e.g. "
                              "preact_resnet18), got mlp; leave pretrain_fraction at 1")

    def __init__(self, ctx):
        super().__init__(ctx)
        # (.get: a subclass may bring its own options)
        self.pretrain_rounds = phase_rounds(ctx.rounds, ctx.options.get("pretrain_fraction", 1.0))
        self.prunes = self.pretrain_rounds < ctx.rounds
        self.local = LocalModels(ctx, {s: ctx.build_model() for s in ctx.local_workers})
        self.full_params = count_params(self.local.model)
        self.full_state_bytes = ctx.full_state_bytes(self.local.model)
        self.dense = None  # the pre-trained model, once pruned

    @property
    def models(self) -> Dict[int, nn.Module]:
        """The local workers' models (pruned ones once fine-tuning started)."""
        return self.local.models

    @property
    def optimizers(self) -> Dict[int, torch.optim.Optimizer]:
        return self.local.optimizers

    def _prune(self):
        self.dense = self.local.model
        self.local = pruned_local_models(self.ctx, self.dense)

    def run_round(self, r: int) -> RoundResult:
        if self.prunes and r >= self.pretrain_rounds and self.dense is None:
            self._prune()
        return self.local.run(r, phase=int(self.dense is not None) if self.prunes else None)

    def global_model(self):
        return self.local.model

    def summary(self):
        if not self.prunes:
            return {}
        out = {"pretrain_rounds": self.pretrain_rounds, "prune_ratio": self.ctx.cfg.prune_ratio,
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
            self._prune()
        self.local.load_state_dict(state)
