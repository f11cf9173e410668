"""Local SGD, the baseline of papers 000 (Table 1) and 003 (Tables 1-9): every worker trains the
whole model for tau local steps on its own shard, then the full model is averaged with one flat
all_reduce. Momentum buffers stay local to each worker (as in the reference codes)."""
from __future__ import annotations

from typing import Callable, List

import torch
from torch import Tensor

from ...distributed import average_model_
from . import Method, RoundResult, all_reduce_wire_bytes, held_bytes, register_method


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


def local_sgd_round(ctx, models, optimizers, r: int, phase: str = "train") -> RoundResult:
    """One local-SGD round of ``models`` (worker -> model, this process's workers): local steps,
    then the models averaged; bytes both ways and the state each worker held."""
    workers = list(models)
    loss = sum(ctx.train_local(models[s], optimizers[s], s, r) for s in workers)
    state = {s: held_bytes(models[s], optimizers[s]) for s in workers}
    sent = average_models([models[s] for s in workers], ctx.num_workers, r, ctx.distributed)
    ps = sum(ps_bytes_per_worker(models[s]) for s in workers) if ctx.num_workers > 1 else 0
    return RoundResult(loss_sum=loss, steps=len(workers) * ctx.cfg.local_steps, bytes_sent=sent, ps_bytes=ps,
                       phase=phase, state_bytes=state)


@register_method("localsgd")
class LocalSGD(Method):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.workers = ctx.local_workers
        self.models = {s: ctx.build_model() for s in self.workers}
        self.optimizers = {s: ctx.make_optimizer(self.models[s].parameters()) for s in self.workers}

        self.full_state_bytes = ctx.full_state_bytes(self.models[self.workers[0]])

    def run_round(self, r: int) -> RoundResult:
        return local_sgd_round(self.ctx, self.models, self.optimizers, r)

    def global_model(self):
        return self.models[self.workers[0]]

    def state_dict(self):
        return {"models": {s: m.state_dict() for s, m in self.models.items()},
                "optimizers": {s: o.state_dict() for s, o in self.optimizers.items()}}

    def load_state_dict(self, state):
        for s in self.workers:
            self.models[s].load_state_dict(state["models"][s])
            self.optimizers[s].load_state_dict(state["optimizers"][s])
