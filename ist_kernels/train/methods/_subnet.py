"""One round of subnetwork training from a CNN partition plan (LOFT, ResIST), shared by
``loft.py`` and ``resist.py``.

Every process holds the whole global model (replicated storage). A round: build the S standalone
subnetworks from the plan (one slice gather), train this process's ones for ``local_steps``, then

- simulated: ``plan.aggregate`` all S (one slice scatter: owner means, shared tensors averaged);
- distributed: ``plan.aggregate`` writes this rank's own subnetwork into its copy of the model, then
  one :class:`ist_kernels.distributed.Exchange` (replicated storage, ``shared="exact"``) owner-averages
  every slice across the ranks in ascending rank order, as the simulated scatter does: the two launch
  modes give bit-identical models (with ``--threads 1``).

Bytes: distributed, the exchange's own counters (``CommStats.bytes_sent``); simulated, what those
exchanges would move, from the plan alone (:func:`ist_kernels.distributed.plan_bytes`), so both
modes report the same numbers.

Momentum (option ``momentum_state``): ``"reset"`` (default; paper 000 Algorithm 1 and the ResIST
reference code aggregate only the weights) gives every subnetwork a fresh optimizer each round;
``"aggregate"`` slices the global SGD momentum into the subnetworks and aggregates / exchanges it
like the weights (its bytes counted too).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor, nn

from . import Option

MOMENTUM_STATES = ("reset", "aggregate")
MOMENTUM_OPTION = Option("reset", str, "subnetwork momentum across rounds: reset (fresh optimizer each round, "
                         "only weights communicated) or aggregate (sliced, aggregated and communicated)",
                         check=lambda v: v in MOMENTUM_STATES, expected="reset or aggregate")


def model_tensors(model: nn.Module) -> Dict[str, Tensor]:
    """Every parameter and buffer by state-dict name (the plan's names), sharing storage."""
    return {k: v for k, v in model.state_dict(keep_vars=False).items()}


class SubnetRounds:
    """Trains rounds of a partition plan on the replicated global ``model``."""

    def __init__(self, ctx, model: nn.Module, momentum_state: str):
        self.ctx = ctx
        self.model = model
        self.optimizer = ctx.make_optimizer(model.parameters()) if momentum_state == "aggregate" else None

    def _momentum(self) -> Dict[str, Tensor]:
        if self.optimizer is None:
            return {}
        out = {}
        for name, p in self.model.named_parameters():
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[name] = buf
        return out

    def run(self, plan, r: int) -> Tuple[float, int]:
        """One round of ``plan``: returns (summed training loss of the local workers, bytes sent)."""
        ctx = self.ctx
        subs = plan.build(self.optimizer)
        mine = [subs[s] for s in ctx.local_workers]
        loss = 0.0
        for sub in mine:
            opt = sub.optimizer if self.optimizer is not None else ctx.make_optimizer(sub.module.parameters())
            loss += ctx.train_local(sub.module, opt, sub.index, r)
        plan.aggregate(mine, self.optimizer)
        from ...distributed import Exchange, plan_bytes

        model = model_tensors(self.model)
        groups: List[Dict[str, Tensor]] = [model]
        if ctx.distributed:
            ex = Exchange(plan.slices, None, None, storage="replicated", shared="exact", round=r + 1)
            ex(model)
            sent = ex.last_stats.bytes_sent
            mom = self._momentum()
            if mom:
                ex(mom, names=list(mom))
                sent += ex.last_stats.bytes_sent
            plan._after_aggregate()  # e.g. ResIST's full-model residual scales (already set; cheap)
            return loss, sent
        sent = 0
        mom = self._momentum()
        if mom:
            groups.append(mom)
        if ctx.num_workers > 1:
            for g in groups:
                # the momentum buffers have their parameters' shapes: the model is the spec for both
                stats = plan_bytes(plan.slices, None, model, storage="replicated", shared="exact", names=list(g))
                sent += sum(st.bytes_sent for st in stats)
        return loss, sent

    def state_dict(self):
        return {"model": self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def phase_rounds(rounds: int, fraction: float) -> int:
    """Rounds of the first phase: ``fraction`` of ``rounds`` (rounded), at least 1 when fraction > 0."""
    if fraction <= 0:
        return 0
    return min(rounds, max(1, round(fraction * rounds)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
