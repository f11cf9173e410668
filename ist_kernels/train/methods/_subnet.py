"""Rounds of subnetwork training from a CNN partition plan (LOFT, ResIST), shared by ``loft.py``
and ``resist.py``, in the storage the config asks for (``--storage``).

A round of plan t: every worker trains its subnetwork for ``local_steps``, then the subnetworks are
owner-averaged (a slice owned by several is their mean, shared tensors the mean of all) and cut
again by plan t+1 (the same plan at the end of a phase: aggregation only).

- simulated: the global model is the reference; ``plan.build`` cuts the S subnetworks (one slice
  gather), ``plan.aggregate`` puts them back (one slice scatter).
- distributed, decentralized storage (default; ResIST §2.5 / Figure 3, LOFT §4): a rank holds only
  its subnetwork's compact tensors and the shared ones (``plan.attach``: no copy), and one
  :class:`ist_kernels.distributed.Exchange` per round sends every slice straight to its next
  owners (all-to-all) and averages the shared tensors (ring all_reduce; ``--shared exact``:
  through the all-to-all, bit-identical to the simulated run). The global model is a structure on
  the meta device; the full model is assembled on rank 0 only to evaluate or save it
  (``gather_full_model``, bytes counted apart in ``ctx.gather_bytes``).
- distributed, replicated storage (``--storage replicated``, for testing): every rank holds the
  global model, writes its subnetwork into it and a replicated ``Exchange`` owner-averages every
  slice across the ranks.

Bytes: distributed, the exchanges' own counters; simulated, what those exchanges would move, from
the plans alone (``plan_bytes``), so both modes report the same numbers. ps_bytes: the papers'
parameter-server count (``ps_bytes``). state_bytes: the parameters, buffers and optimizer state a
worker holds during the round.

Momentum (option ``momentum_state``): ``"reset"`` (default; paper 000 Algorithm 1 and the ResIST
reference code aggregate only the weights) gives every subnetwork a fresh optimizer each round;
``"aggregate"`` slices the SGD momentum with the weights and aggregates / exchanges it too (its
bytes counted too).
"""
from __future__ import annotations

import copy
import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from . import Option, held_bytes

MOMENTUM_STATES = ("reset", "aggregate")
MOMENTUM_OPTION = Option("reset", str, "subnetwork momentum across rounds: reset (fresh optimizer each round, "
                         "only weights communicated) or aggregate (sliced, aggregated and communicated)",
                         check=lambda v: v in MOMENTUM_STATES, expected="reset or aggregate")


def model_tensors(model: nn.Module) -> Dict[str, Tensor]:
    """Every parameter and buffer by state-dict name (the plan's names), sharing storage."""
    return {k: v for k, v in model.state_dict(keep_vars=False).items()}


def momentum_of(named_params, optimizer) -> Dict[str, Tensor]:
    """name -> SGD momentum buffer of every parameter that has one."""
    out = {}
    for name, p in named_params:
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            out[name] = buf
    return out


class SubnetRounds:
    """Trains rounds of ``plan_of(t)`` (round t's plan, the same on every rank) on ``model``.

    Decentralized storage starts at round ``start`` (:meth:`start`): the rank cuts its part of that
    round's plan out of the (real, full) model, which then keeps only its structure (meta device).
    ``held`` is the round whose plan this process's tensors are cut by."""

    def __init__(self, ctx, model: nn.Module, momentum_state: str, plan_of: Callable[[int], object]):
        self.ctx = ctx
        self.model = model
        self.plan_of_round = plan_of
        self.aggregate_momentum = momentum_state == "aggregate"
        self.decentral = ctx.distributed and ctx.decentralized
        self.spec = {n: (tuple(t.shape), t.dtype) for n, t in model_tensors(model).items()}
        self.param_names = [n for n, _ in model.named_parameters()]
        self.optimizer = (ctx.make_optimizer(model.parameters())
                          if self.aggregate_momentum and not self.decentral else None)
        self.part: Optional[Dict[str, Tensor]] = None  # decentralized: plan name -> this rank's tensor
        self.momentum: Dict[str, Tensor] = {}  # decentralized, momentum aggregated: the same for SGD momentum
        self.held: Optional[int] = None
        self._plans: Dict[int, object] = {}

    # ---- plans (the last two are kept: this round's and the next)
    def plan(self, r: int):
        if r not in self._plans:
            if len(self._plans) >= 2:
                self._plans.pop(min(self._plans))
            self._plans[r] = self.plan_of_round(r)
        return self._plans[r]

    def start(self, r: int) -> None:
        """Hold round ``r``'s plan; decentralized: cut this rank's part, drop the rest of the model."""
        self.held = r
        if self.decentral:
            self.part = self.plan(r).part(self.ctx.rank)
            self.model.to("meta")

    # ---- one round
    def run(self, r: int, last: bool) -> Tuple[float, int, int, Dict[int, int]]:
        """Round r of plan r, aggregated and cut by plan r+1 (``last``: by plan r again). Returns
        (summed training loss, wire bytes, ps bytes, worker -> state bytes) of the local workers."""
        if self.held != r:
            raise RuntimeError(f"SubnetRounds: holds round {self.held}'s plan, asked to train round {r}")
        plan = self.plan(r)
        nxt = plan if last else self.plan(r + 1)
        ctx = self.ctx
        ps = ps_of(plan.slices, self.spec, ctx.local_workers, self.param_names if self.aggregate_momentum else None)
        out = self._decentral(plan, nxt, r) if self.decentral else self._global(plan, nxt, r)
        self.held = r if last else r + 1
        return out[0], out[1], ps, out[2]

    def _decentral(self, plan, nxt, r):
        from ...distributed import Exchange

        ctx, s = self.ctx, self.ctx.rank
        sub = plan.attach(s, self.part)
        params = plan.tensors_of(sub, detach=False)
        opt = ctx.make_optimizer(sub.module.parameters())
        for name, buf in self.momentum.items():
            opt.state[params[name]]["momentum_buffer"] = buf
        loss = ctx.train_local(sub.module, opt, s, r)
        state = held_bytes(sub.module, opt)
        ex = Exchange(plan.slices, nxt.slices, self.spec, storage="decentralized", shared=ctx.cfg.shared,
                      round=r + 1)
        self.part = ex(plan.tensors_of(sub))
        sent = ex.last_stats.bytes_sent
        if self.aggregate_momentum:
            mom = momentum_of(((n, params[n]) for n in params if n in set(self.param_names)), opt)
            self.momentum = ex(mom, names=list(mom))
            sent += ex.last_stats.bytes_sent
        return loss, sent, {s: state}

    def _global(self, plan, nxt, r):
        from ...distributed import Exchange, plan_bytes

        ctx = self.ctx
        subs = plan.build(self.optimizer)
        mine = [subs[s] for s in ctx.local_workers]
        loss, state = 0.0, {}
        # replicated storage: a worker also holds the global model (and its optimizer state)
        extra = (self.model, self.optimizer) if not ctx.decentralized else ()
        for sub in mine:
            opt = sub.optimizer if self.optimizer is not None else ctx.make_optimizer(sub.module.parameters())
            loss += ctx.train_local(sub.module, opt, sub.index, r)
            state[sub.index] = held_bytes(sub.module, opt, *extra)
        plan.aggregate(mine, self.optimizer)
        model = model_tensors(self.model)
        mom = momentum_of(self.model.named_parameters(), self.optimizer) if self.optimizer is not None else {}
        if ctx.distributed:  # replicated storage
            ex = Exchange(plan.slices, None, None, storage="replicated", shared=ctx.cfg.shared, round=r + 1)
            ex(model)
            sent = ex.last_stats.bytes_sent
            if mom:
                ex(mom, names=list(mom))
                sent += ex.last_stats.bytes_sent
            plan.after_aggregate()  # e.g. ResIST's full-model residual scales (already set; cheap)
            return loss, sent, state
        sent = 0
        if ctx.num_workers > 1:
            storage = "decentralized" if ctx.decentralized else "replicated"
            for names in [list(model)] + ([list(mom)] if mom else []):
                # the momentum buffers have their parameters' shapes: the model is the spec for both
                stats = plan_bytes(plan.slices, nxt.slices, self.spec, storage=storage, shared=ctx.cfg.shared,
                                   names=names)
                sent += sum(stats[s].bytes_sent for s in ctx.local_workers)
        return loss, sent, state

    # ---- the full model
    def global_model(self) -> Optional[nn.Module]:
        """The aggregated full model (rank 0); decentralized: assembled from every rank's part."""
        ctx = self.ctx
        if not self.decentral:
            if ctx.simulated and ctx.decentralized and ctx.num_workers > 1:
                ctx.gather_bytes += gather_bytes_of(self.plan(self.held).slices, self.spec)
            return self.model
        from ...distributed import gather_full_model

        plan, stats = self.plan(self.held), []
        full = gather_full_model(self.part, plan.slices, self.spec, dst=0, reduce="copy", round=self.held,
                                 stats=stats)
        ctx.gather_bytes += stats[0].bytes_sent
        if full is None:
            return None
        model = copy.deepcopy(self.model)  # the structure (meta device), then the gathered tensors
        model.load_state_dict(full, assign=True)
        plan.after_aggregate(model)
        return model

    # ---- resume: decentralized, this rank's part; otherwise the global model
    def state_dict(self):
        if self.decentral:
            return {"held": self.held, "part": self.part, "momentum": self.momentum}
        return {"held": self.held, "model": self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.held = state["held"]
        if self.decentral:
            self.part, self.momentum = state["part"], state["momentum"]
            self.model.to("meta")
            return
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def ps_of(plan, spec, workers: List[int], momentum_names: Optional[List[str]] = None) -> int:
    """The parameter-server bytes of ``workers`` in a round of ``plan`` (and of the momentum when
    it is aggregated: the parameters' names, the model's spec)."""
    from ...distributed import ps_bytes

    per = ps_bytes(plan, spec)
    if momentum_names:
        per = [a + b for a, b in zip(per, ps_bytes(plan, spec, names=momentum_names))]
    return sum(per[s] for s in workers)


def gather_bytes_of(plan, spec) -> int:
    """What assembling the full model on rank 0 moves, over all ranks (simulated runs report it)."""
    from ...distributed import gather_bytes

    return sum(st.bytes_sent for st in gather_bytes(plan, spec))


def state_split(plan, spec, param_names, momentum: bool) -> Dict[str, int]:
    """The whole model's state (parameters, buffers, an SGD momentum buffer per parameter when
    ``momentum``) split into what every subnetwork holds whole (``shared_state_bytes``) and what the
    plan partitions (``partitioned_state_bytes``): a worker of S holds about shared + partitioned / S."""
    params = set(param_names)
    out = {"shared_state_bytes": 0, "partitioned_state_bytes": 0}
    for t in plan.tensors:
        shape, dtype = spec[t.name]
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        key = "shared_state_bytes" if t.shared else "partitioned_state_bytes"
        out[key] += n * (2 if momentum and t.name in params else 1)
    return out


def phase_rounds(rounds: int, fraction: float) -> int:
    """Rounds of the first phase: ``fraction`` of ``rounds`` (rounded), at least 1 when fraction > 0."""
    if fraction <= 0:
        return 0
    return min(rounds, max(1, round(fraction * rounds)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
