"""The round engine: the two ways the methods' rounds run, each written once, for every launch mode
and storage.

- :class:`SubnetRounds`: rounds of subnetworks cut from a partition plan (LOFT, ResIST): plan ->
  compact state -> local steps -> exchange. A round of plan t: every worker trains its subnetwork
  for ``local_steps``, then the subnetworks are owner-averaged (a slice owned by several is their
  mean, shared tensors the mean of all) and cut again by plan t+1 (the same plan at the end of a
  phase: aggregation only).

  * simulated: the global model is the reference; ``plan.build`` cuts the S subnetworks (one slice
    gather, ``pack``), ``plan.aggregate`` puts them back (one slice scatter, ``unpack``); the bytes
    are what the distributed exchanges would move (``Comm.count_exchange``).
  * distributed, decentralized storage (default; ResIST §2.5 / Figure 3, LOFT §4): a rank holds
    only its subnetwork's compact tensors and the shared ones, and one exchange per round sends
    every slice straight to its next owners (all-to-all) and averages the shared tensors (ring
    all_reduce; ``--shared exact``: through the all-to-all, bit-identical to the simulated run).
    The compact module and its optimizer are kept across rounds while the plan's shapes do not
    change (LOFT: every round): the exchanged tensors are copied into them in place, and the
    optimizer's state is cleared (``momentum_state=reset``: what a fresh optimizer has) or refilled
    with the exchanged or kept state (the other options: Momentum, below). The global model is a structure on the meta device;
    the full model is assembled on rank 0 only to evaluate or save it.
  * distributed, replicated storage (``--storage replicated``, for testing): every rank holds the
    global model, writes its subnetwork into it and a replicated exchange owner-averages every
    slice across the ranks.

- :class:`LocalModels`: local SGD of whole models (the local-SGD baseline, LOFT's fine-tuning,
  ResIST's warm-up, GReLU's default): local steps on every local worker, then one flat all_reduce.

A method drives them through its worker view (``ctx``: :class:`ist_kernels.train.context.RunContext`)
and never touches communication or counters itself: every byte goes through ``ctx.comm`` and every
second into ``ctx.clock`` (:mod:`.timing`).

Compression (``--compress bf16|int8``, ``ctx.comm.compress``): every round's exchange of weights and
every local-SGD average encode what a worker sends (its own copy too); the simulated path encodes
the same values (``plan.compact(sub)`` or ``plan.tensors_of(sub)``: a subnetwork's tensors in the
plan's view) before aggregating them. Momentum (``momentum_state``: its own codes, below) and the
one-time moves of pruning do not take ``--compress``. Nothing is kept between rounds (no error feedback): resume stays
exact.

Momentum (option ``momentum_state``): what happens to a slice's optimizer state (the state tensors
of its parameter's shape: SGD's momentum buffer, AdamW's exp_avg and exp_avg_sq) when the slice
changes owners at the end of a round. A 0-dim state (AdamW's step: the same count on every worker,
each takes ``local_steps`` steps a round) is never sent: under decentralized storage a rank gives the
slices it receives the step of the ones it trained (the simulated run's owner mean of equal counts).
The bytes of each option are :data:`ist_kernels.distributed.ledger.MOMENT_CODES`' (both conventions,
and ``rank_state_bytes``).

- ``"reset"`` (default; paper 000 Algorithm 1 and the ResIST reference code aggregate only the
  weights): every subnetwork starts its round with empty optimizer state; nothing is sent.
- ``"aggregate"``: the state travels with its slice, exactly, and is owner-averaged as the weights
  are (a slice's next owners get the mean of its current owners' state).
- ``"int8"``: as ``aggregate``, each moment sent block-wise coded (:mod:`ist_kernels.distributed.
  blockwise`: blocks of 256 values within a slice, first moments linear 8-bit with an absmax scale,
  second moments an unsigned 8-bit log code; a distributed run sends those codes and scales); its
  owners average the decoded values. The sender's own copy is the decoded value too, so the
  simulated and the distributed runs agree bit for bit. A shared tensor's moments travel exactly.
- ``"int8-v4"``: as ``int8`` with the second moment in a 4-bit log code.
- ``"second"``: the second moment travels exactly and is owner-averaged; the first moment is reset
  (zeros) every round; the step is kept (the first moment's bias correction then under-corrects:
  its first steps of a round are smaller, a momentum warm-up). SGD has no second moment: its
  momentum is reset, as ``reset``.
- ``"local"``: nothing is sent; every worker keeps the state of every slice it has trained (the
  latest values, a tensor of the global shape per state key and parameter) and a slice it trains
  again starts from that (stale) state; a slice it has never trained starts from zeros. The step of
  a parameter tensor is the worker's own count on it (0, a fresh optimizer, while the worker has
  trained no slice of it): a slice new to it in a tensor it has trained gets AdamW's bias
  correction of that count. Shared tensors keep each worker's own state, as local SGD's do. The
  kept state is held memory (``state_bytes``; the cost model: every slice's moments) and is in the
  checkpoint (per worker; decentralized: each rank its own), so resume stays exact.

Outer optimizer (``--outer-optimizer``: :class:`ist_kernels.train.outer.OuterOptimizer`, DiLoCo's
outer step for every method that takes one): after a round's aggregation A, one optimizer step from
θ_prev with the pseudo-gradient g = θ_prev - A. ``SubnetRounds`` keeps its state per plan tensor:
simulated and replicated, whole; decentralized, for the slices this rank stores: a partitioned slice
takes the step on the rank that trained it and goes to its next owners with its state (one more
exchange per state tensor of its shape), the shared tensors take it after their average.
``LocalModels`` keeps one state of the whole model.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..distributed import ledger
from ..distributed.blockwise import fake_quantize_
from ..distributed.ledger import payoff, state_split  # noqa: F401  (the engine's: methods import them here)
from .methods import Option, RoundResult, WorkerTurn, held_bytes, summed
from .outer import OuterOptimizer

MOMENTUM_STATES = tuple(ledger.MOMENT_CODES)
MOMENTUM_OPTION = Option("reset", str, "subnetwork optimizer state across rounds: reset (fresh each round, only "
                         "weights communicated), aggregate (sliced, owner-averaged and sent with the weights), int8 "
                         "(as aggregate, the moments block-wise 8-bit coded), int8-v4 (second moment 4-bit), second "
                         "(the second moment aggregated, the first reset) or local (each worker keeps the state of "
                         "the slices it trained; nothing sent)",
                         check=lambda v: v in MOMENTUM_STATES,
                         expected="reset or aggregate, or int8, int8-v4, second, local")
#: the moments (state tensors of a parameter's shape) of the local optimizers, by ``ctx.local_optimizer``
OPTIMIZER_MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def moment_keys(ctx) -> Tuple[str, ...]:
    """The state keys of the run's local optimizer's moments (SGD without momentum: none)."""
    return OPTIMIZER_MOMENTS.get(ctx.local_optimizer, ())[:ctx.param_state_tensors]


def model_tensors(model: nn.Module) -> Dict[str, Tensor]:
    """Every parameter and buffer by the plan's name, detached, sharing storage: the state dict
    with a tensor held by several modules (tied weights: GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) once, under its first name in module order (as ``named_parameters()``
    and the partition plans name it)."""
    out: Dict[str, Tensor] = {}
    seen = set()
    for n, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, Tensor):
            if id(t) in seen:
                continue
            seen.add(id(t))
            t = t.detach()
        out[n] = t
    return out


def tied_names(model: nn.Module) -> Dict[str, str]:
    """Tied tensors: every state-dict name of a tensor met before in module order -> its first name."""
    first: Dict[int, str] = {}
    out = {}
    for n, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, Tensor):
            owner = first.setdefault(id(t), n)
            if owner != n:
                out[n] = owner
    return out


def to_meta_(model: nn.Module) -> nn.Module:
    """``model.to("meta")`` keeping tied tensors tied (``Module.to`` gives every module holding a
    tensor its own new one) and non-persistent buffers real (constants of the structure, such as
    rotary embeddings' ``inv_freq``, which subnetworks share): the structure decentralized storage
    keeps."""
    new: Dict[int, Tensor] = {}
    for m in model.modules():
        for attrs in (m._parameters, m._buffers):
            for k, t in attrs.items():
                if t is None or (attrs is m._buffers and k in m._non_persistent_buffers_set):
                    continue  # non-persistent buffers (constants, not in the state dict) stay real: clones use them
                if id(t) not in new:
                    meta = t.detach().to("meta")
                    new[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
                        else meta
                attrs[k] = new[id(t)]
    return model


def assign_tensors_(model: nn.Module, tensors: Dict[str, Tensor]) -> nn.Module:
    """``model.load_state_dict(tensors, assign=True)`` (strict) where ``tensors`` names each tensor
    once (:func:`model_tensors`): every place that held one tensor gets the same new one, so tied
    weights stay tied."""
    params = dict(model.named_parameters())
    full = {n: nn.Parameter(t, requires_grad=params[n].requires_grad) if n in params and isinstance(t, Tensor)
            and not isinstance(t, nn.Parameter) else t for n, t in tensors.items()}
    for alias, name in tied_names(model).items():
        if name in full and alias not in full:
            full[alias] = full[name]
    model.load_state_dict(full, assign=True)
    return model


def param_states_of(named_params, optimizer) -> Dict[str, Dict[str, Tensor]]:
    """state key -> name -> the optimizer's state tensor of that parameter, for every state tensor of
    its parameter's shape (SGD's ``momentum_buffer``, AdamW's ``exp_avg`` and ``exp_avg_sq``)."""
    out: Dict[str, Dict[str, Tensor]] = {}
    for name, p in named_params:
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, Tensor) and v.dim() > 0 and v.shape == p.shape:
                out.setdefault(key, {})[name] = v
    return out


def scalar_states_of(params, optimizer) -> Dict[str, Tensor]:
    """state key -> the largest of the optimizer's 0-dim state tensors of ``params`` (AdamW's
    ``step``), cloned."""
    found: Dict[str, List[Tensor]] = {}
    for p in params:
        if p.dim() == 0:
            continue
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, Tensor) and v.dim() == 0:
                found.setdefault(key, []).append(v)
    return {key: max(vals, key=float).detach().clone() for key, vals in found.items()}


def phase_rounds(rounds: int, fraction: float) -> int:
    """Rounds of the first phase: ``fraction`` of ``rounds`` (rounded), at least 1 when fraction > 0."""
    if fraction <= 0:
        return 0
    return min(rounds, max(1, round(fraction * rounds)))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class PartitionPayoffWarning(UserWarning):
    """A partition plan moves too little of the model's state to send clearly fewer bytes than
    local SGD."""


#: the predicted bytes ratio (subnetwork rounds / local SGD) from which a plan cannot pay off
PAYOFF_LIMIT = 0.9
_warned = set()


def warn_payoff(split: Dict[str, int], num_workers: int, method: str, where: str = "") -> Optional[str]:
    """Warn once per (method, split) when the plan partitions so little of the state that its
    rounds send >= :data:`PAYOFF_LIMIT` of local SGD's bytes (e.g. ResIST on preact_resnet18, LOFT
    with nothing partitioned). Returns the message (None when the plan pays off)."""
    frac, ratio = payoff(split, num_workers)
    if num_workers < 2 or ratio < PAYOFF_LIMIT:
        return None
    msg = (f"{method}{where}: the partition holds {frac:.1%} of the model's state, so a round of S={num_workers} "
           f"subnetworks sends about {ratio:.2f}x the bytes of local SGD's all-reduce: it cannot pay off in "
           f"communication (partition more of the model: a deeper ResNet, more workers, or local SGD)")
    key = (method, tuple(sorted(split.items())), num_workers)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, PartitionPayoffWarning, stacklevel=2)
    return msg


class SubnetRounds:
    """Trains rounds of ``plan_of(t)`` (round t's plan, the same on every rank) on ``model``.

    A plan is a :class:`ist_kernels.partition.RoundPlan` (LOFT's, ResIST's and the transformer
    plans, ``masked``'s neuron plans, GReLU's row plans): its contract and defaults are written
    there, once.

    ``spec`` (default: the model's tensors) gives the plans' tensors' global shapes; ``tensors()``
    (default: the model's tensors) the global model's tensors as the plans state them; ``assemble(
    full)`` (default: the model's structure loaded with the gathered tensors) builds the evaluated
    model from gathered tensors, ``full_model`` is it without decentralized storage. ``storage``:
    the storage the method needs (default: the run's); a plan's optional ``ps_download`` is what
    each worker downloads in the parameter-server count (default: its next subnetwork).

    Decentralized storage starts at round ``start`` (:meth:`start`): the rank cuts its part of that
    round's plan out of the (real, full) model, which then keeps only its structure (meta device).
    ``held`` is the round whose plan this process's tensors are cut by."""

    def __init__(self, ctx, model: nn.Module, momentum_state: str, plan_of: Callable[[int], object], *,
                 spec=None, tensors: Optional[Callable[[], Dict[str, Tensor]]] = None,
                 assemble: Optional[Callable[[Dict[str, Tensor]], nn.Module]] = None,
                 full_model: Optional[nn.Module] = None, storage: Optional[str] = None):
        self.ctx = ctx
        self.model = model
        self.plan_of_round = plan_of
        if momentum_state not in MOMENTUM_STATES:
            raise ValueError(f"SubnetRounds: momentum_state must be one of {', '.join(MOMENTUM_STATES)}, "
                             f"got {momentum_state!r}")
        self.momentum_state = momentum_state
        # the moments of the run's optimizer and how each travels (None: not sent), the ledger's table
        self.moment_codes = {key: ledger.moment_code(momentum_state, key) for key in moment_keys(ctx)}
        # some state travels with the slices (owner-averaged): every option but reset and local
        self.aggregate_momentum = momentum_state not in ("reset", "local")
        self.keep_local = momentum_state == "local"
        # the run's --storage, unless the method needs one (e.g. GReLU rows: a worker reads every row)
        self.storage = storage or ("decentralized" if ctx.decentralized else "replicated")
        self.decentral = ctx.distributed and self.storage == "decentralized"
        self.spec = spec if spec is not None else {n: (tuple(t.shape), t.dtype)
                                                   for n, t in model_tensors(model).items()}
        self.tensors = tensors or (lambda: model_tensors(self.model))
        self.assemble = assemble or self._assemble
        self.full_model = model if full_model is None else full_model
        self.param_names = [n for n, _ in model.named_parameters()]
        self.optimizer = (ctx.make_optimizer(model.parameters())
                          if self.aggregate_momentum and not self.decentral else None)
        self.part: Optional[Dict[str, Tensor]] = None  # decentralized: plan name -> this rank's tensor
        # decentralized, momentum aggregated: state key -> plan name -> this rank's slice of the optimizer
        # state of that parameter's shape (SGD momentum, AdamW moments); 0-dim state (AdamW's step) by key
        self.momentum: Dict[str, Dict[str, Tensor]] = {}
        self.scalars: Dict[str, Tensor] = {}
        # momentum_state=local: worker -> {"moments": key -> plan name -> global-shape state, "scalars":
        # plan name -> key -> 0-dim state} of the slices it has trained (this process's workers)
        self.kept: Dict[int, dict] = {}
        self.held: Optional[int] = None
        self._plans: Dict[int, object] = {}
        # decentralized: the compact module, its optimizer and tensors, kept while the shapes hold
        self._kept: Optional[Tuple[tuple, object, torch.optim.Optimizer, Dict[str, Tensor]]] = None
        # --outer-optimizer: its state by plan name (decentralized: of this rank's stored slices)
        self.outer = OuterOptimizer.of(ctx.hp.outer_optimizer, ctx.hp.outer_lr, ctx.hp.outer_momentum)
        self.outer_on = self.outer is not None
        self.compress = ctx.comm.compress if ctx.num_workers > 1 else None
        self._open: Optional[dict] = None  # the round begun and not yet ended (begin -> end)

    # ---- the outer optimizer (--outer-optimizer)
    def _outer_names(self, plan) -> Tuple[List[str], List[str]]:
        """(partitioned, shared) floating parameters of the stored plan: what the outer step updates."""
        params = set(self.param_names)
        part, shared = [], []
        for t in self.stored(plan).tensors:
            if t.name in params and self.spec[t.name][1].is_floating_point:
                (shared if t.shared else part).append(t.name)
        return part, shared

    def _stored_names(self, plan, s: int, names) -> List[str]:
        """Which of ``names`` worker s stores a slice of under decentralized storage."""
        stored = {t.name: t for t in self.stored(plan).tensors}
        return [n for n in names if n in stored and (stored[n].shared or stored[n].owners[s].numel() > 0)]

    def _outer_(self, tensors: Dict[str, Tensor], previous: Dict[str, Tensor], names) -> None:
        """The outer step on ``tensors[n]`` (the aggregate, or a worker's trained slice) from
        ``previous[n]``, for ``names`` held here."""
        self.outer.step_(tensors, previous, names)

    # ---- the optimizer state across owners (momentum_state; the module docstring's rules)
    def _code(self, key: str):
        """How state ``key`` travels: None (not sent), "exact" or the bits of its block code."""
        return ledger.moment_code(self.momentum_state, key)

    def _code_moments_(self, states: Dict[str, Dict[str, Tensor]], slices) -> None:
        """int8 / int8-v4: every block-coded moment of ``states`` (key -> plan name -> a worker's
        compact state under ``slices``) coded and decoded in place, blocks within each slice."""
        # (a product's slices are single values and a shared tensor's moments are averaged: both exactly)
        dims = {t.name: t.dim for t in slices.tensors if not t.product and not t.shared}
        for key, bufs in states.items():
            code = self._code(key)
            if isinstance(code, int):
                for name, buf in bufs.items():
                    if name in dims:
                        fake_quantize_(buf, dims[name], code, unsigned=key in ledger.SECOND_MOMENTS)

    def _kept_fill(self, s: int, slices, params: Dict[str, Tensor], opt) -> None:
        """local: worker s's kept state of its compact ``params`` (plan name -> parameter, cut by
        ``slices``) into ``opt``: the kept slices' values, zeros for slices it never trained, the
        tensor's step; nothing for a tensor it never trained (a fresh optimizer's state)."""
        kept = self.kept.get(s)
        if not kept:
            return
        by_name = {t.name: t for t in slices.tensors}
        for name, p in params.items():
            steps = kept["scalars"].get(name)
            if steps is None:
                continue
            t, st = by_name[name], opt.state[p]
            for key, fulls in kept["moments"].items():
                full = fulls.get(name)
                if full is not None:
                    st[key] = full.clone() if t.shared else t.select(full, s)
            for key, v in steps.items():
                st[key] = v.clone()

    def _kept_store(self, s: int, slices, params: Dict[str, Tensor], opt) -> None:
        """local: worker s's state after its local steps written over its kept state (the slices it
        trained; a tensor's step replaced)."""
        kept = self.kept.setdefault(s, {"moments": {}, "scalars": {}})
        by_name = {t.name: t for t in slices.tensors}
        with torch.no_grad():
            for name, p in params.items():
                st = opt.state.get(p)
                if not st:
                    continue
                t = by_name[name]
                steps = kept["scalars"].setdefault(name, {})  # (also marks the tensor as trained)
                for key, v in st.items():
                    if not isinstance(v, Tensor):
                        continue
                    if v.dim() == 0:
                        steps[key] = v.detach().clone()
                    elif v.shape == p.shape:
                        fulls = kept["moments"].setdefault(key, {})
                        if name not in fulls:
                            fulls[name] = torch.zeros(self.spec[name][0], dtype=v.dtype, device=v.device)
                        rows = None if t.shared else t.owners[s].to(v.device)
                        if t.shared:
                            fulls[name].copy_(v)
                        elif t.product:  # rows x cols
                            view = fulls[name].movedim((t.dim, t.col_dim), (0, 1))
                            view[rows.unsqueeze(1), t.cols[s].to(v.device).unsqueeze(0)] = \
                                v.detach().movedim((t.dim, t.col_dim), (0, 1))
                        else:
                            fulls[name].index_copy_(t.dim, rows, v.detach())

    # ---- plans (the last two are kept: this round's and the next)
    def plan(self, r: int):
        if r not in self._plans:
            with self.ctx.clock("plan"):
                if len(self._plans) >= 2:
                    self._plans.pop(min(self._plans))
                self._plans[r] = self.plan_of_round(r)
        return self._plans[r]

    @staticmethod
    def stored(plan):
        """The plan's slices as the ranks store them (decentralized storage)."""
        return plan.storage_slices

    def open(self, r: int, method: str, where: str = "", momentum=0) -> Dict[str, int]:
        """What every subnetwork method does before its first subnetwork round, once: round r's
        plan's state split (:func:`state_split`, ``momentum`` optimizer tensors per parameter), the
        payoff warning when the plan partitions too little (:func:`warn_payoff`, as
        ``method + where``), then :meth:`start` at r. Returns the split (for summary.json)."""
        split = state_split(self.plan(r).slices, self.spec, self.param_names, momentum)
        warn_payoff(split, self.ctx.num_workers, method, where)
        self.start(r)
        return split

    def start(self, r: int) -> None:
        """Hold round ``r``'s plan; decentralized: cut this rank's part, drop the rest of the model."""
        self.held = r
        if self.decentral:
            with self.ctx.clock("plan"):
                self.part = self.plan(r).part(self.ctx.rank)
                to_meta_(self.model)

    # ---- one round, in two phases
    def begin(self, r: int, last: bool, phase: Optional[int] = None) -> List[WorkerTurn]:
        """Round r of plan r (aggregated and cut by plan r+1 at :meth:`end`; ``last``: by plan r
        again): the turns of this process's subnetworks, each with its optimizer."""
        if self.held != r:
            raise RuntimeError(f"SubnetRounds: holds round {self.held}'s plan, asked to train round {r}")
        if self._open is not None:
            raise RuntimeError(f"SubnetRounds: round {self._open['r']} was begun and not ended")
        plan = self.plan(r)
        nxt = plan if last else self.plan(r + 1)
        ctx = self.ctx
        with ctx.clock("metrics"):
            ps = (ctx.comm.ps_bytes(plan.slices, self.spec, download=plan.ps_download,
                                    compress=self.compress) if ctx.num_workers > 1 else 0)
            if ctx.num_workers > 1:  # each moment that travels, coded as it travels
                for code in self.moment_codes.values():
                    if code is not None:
                        ps += ctx.comm.ps_bytes(plan.slices, self.spec, names=self.param_names, state_code=code)
            if self.outer_on and self.storage == "decentralized" and ctx.num_workers > 1:
                ps += ctx.comm.ps_bytes(self.stored(plan), self.spec, names=self._outer_names(plan)[0]) * \
                    self.outer.tensors_per_param
        state = dict(r=r, plan=plan, nxt=nxt, last=last, phase=phase, ps=ps)
        turns = self._decentral_begin(plan, state) if self.decentral else self._global_begin(plan, state)
        self._open = state
        return turns

    def end(self, r: int, losses: Sequence) -> RoundResult:
        """Round r after its local steps (``losses``: each turn's summed loss): the exchange (or the
        simulated aggregation), the outer step, and the round's result."""
        state = self._open
        if state is None or state["r"] != r:
            raise RuntimeError(f"SubnetRounds: round {r} was not begun")
        self._open = None
        if len(losses) != len(state["turns"]):
            raise ValueError(f"SubnetRounds: {len(state['turns'])} turns in round {r}, got {len(losses)} losses")
        held = self._decentral_end(state) if self.decentral else self._global_end(state)
        ctx = self.ctx
        self.held = r if state["last"] else r + 1
        phase = state["phase"]
        return RoundResult(summed(losses), len(ctx.local_workers) * ctx.local_steps,
                           extra=None if phase is None else {"phase": phase}, ps_bytes=state["ps"], state_bytes=held)

    @staticmethod
    def _held_bytes(plan, sub, opt, extra=()) -> int:
        """The ledger's count of what the plan says a worker holds (ints: bytes the plan counted)."""
        things = plan.held(sub, opt, extra)
        return sum(x for x in things if isinstance(x, int)) + held_bytes(*(x for x in things if not isinstance(x, int)))

    def _compact(self, plan, s: int):
        """This rank's subnetwork and optimizer for ``plan``, around ``self.part``: the kept ones
        refilled in place when the shapes are those of the last round, else new ones."""
        key = (type(plan), tuple((n, tuple(t.shape)) for n, t in self.part.items()))
        if self._kept is not None and self._kept[0] == key:
            _, sub, opt, mine = self._kept
            names = list(mine)
            with torch.no_grad():
                torch._foreach_copy_([mine[n] for n in names], [self.part[n] for n in names])
            opt.state.clear()  # what a fresh optimizer holds
            return sub, opt, mine
        sub = plan.attach(s, self.part)
        opt = self.ctx.make_optimizer(sub.module.parameters())
        mine = plan.tensors_of(sub, detach=False)
        self._kept = (key, sub, opt, mine) if plan.reusable else None
        return sub, opt, mine

    def _decentral_begin(self, plan, state) -> List[WorkerTurn]:
        ctx, s = self.ctx, self.ctx.rank
        with ctx.clock("plan"):
            sub, opt, params = self._compact(plan, s)
            if self.keep_local:
                self._kept_fill(s, self.stored(plan), params, opt)
            for key, bufs in self.momentum.items():
                for name, buf in bufs.items():
                    opt.state[params[name]][key] = buf
                    for k, v in self.scalars.items():  # (AdamW's step: all of a parameter's state or none)
                        opt.state[params[name]].setdefault(k, v.clone())
            if self.outer_on:  # the model before the round, and the outer state of every slice held
                part_names, shared_names = self._outer_names(plan)
                prev = {n: self.part[n].detach().clone() for n in part_names + shared_names if n in self.part}
                self.outer.init_state_(prev)
                state.update(prev=prev, part_names=part_names, shared_names=shared_names)
        state.update(sub=sub, opt=opt, params=params, turns=[WorkerTurn(s, sub.module, opt)])
        return state["turns"]

    def _decentral_end(self, state) -> Dict[int, int]:
        ctx, s = self.ctx, self.ctx.rank
        plan, nxt, r, sub, opt, params = (state[k] for k in ("plan", "nxt", "r", "sub", "opt", "params"))
        with ctx.clock("metrics"):
            held = self._held_bytes(plan, sub, opt, (self.kept.get(s),) if self.keep_local else ())
            if self.outer_on:
                held += held_bytes(self.outer.tensors(), state["prev"])
        with ctx.clock("plan"):
            if self.keep_local:
                self._kept_store(s, self.stored(plan), params, opt)
            trained = plan.tensors_of(sub)
            if self.outer_on:
                prev, part_names, shared_names = state["prev"], state["part_names"], state["shared_names"]
                # a partitioned slice takes its outer step where it was trained and goes to its next
                # owners with its momentum (the step is linear: the owners' mean of the stepped slices
                # and momenta is the step of their mean); shared tensors take it after their average
                self._outer_(trained, prev, part_names)
            self.part = ctx.comm.exchange(self.stored(plan), self.stored(nxt), self.spec, trained, round=r + 1,
                                          compress=self.compress)
            if self.outer_on:  # every rank moves the same state keys, in the same order
                held_states = self.outer.param_states(part_names, prev)
                moved = {key: ctx.comm.exchange(self.stored(plan), self.stored(nxt), self.spec,
                                                held_states.get(key, {}), names=part_names, round=r + 1)
                         for key in self.outer.state_keys or ()}
                self.outer.set_param_states(moved, part_names)
                self._outer_(self.part, prev, shared_names)
            if self.aggregate_momentum:
                names = set(self.param_names)
                trained_params = [(n, params[n]) for n in params if n in names]
                states = param_states_of(trained_params, opt)
                self.scalars = scalar_states_of([p for _, p in trained_params], opt)
                # (the Exchange codes each moment's partitioned slices and decodes every copy)
                # every rank names the same tensors (the model's parameters), whatever its subnetwork holds:
                # the exchange's schedule is derived from the names, and ResIST's subnetworks hold different
                # layers (names of its own would give each rank another schedule: a hang)
                moved = {key: ctx.comm.exchange(plan.slices, nxt.slices, self.spec, bufs, names=self.param_names,
                                                round=r + 1, state_code=self._code(key),
                                                second=key in ledger.SECOND_MOMENTS)
                         for key, bufs in states.items() if self._code(key) is not None}
                if moved:  # a moment not sent (second: the first) starts the next round from zeros
                    shapes = next(iter(moved.values()))
                    for key in states:
                        if key not in moved:
                            moved[key] = {n: torch.zeros_like(v) for n, v in shapes.items()}
                self.momentum = moved
        return {s: held}

    def _global_begin(self, plan, state) -> List[WorkerTurn]:
        ctx = self.ctx
        if self.outer_on:
            with ctx.clock("plan"):
                part_names, shared_names = self._outer_names(plan)
                now = self.tensors()
                prev = {n: now[n].detach().clone() for n in part_names + shared_names}
                self.outer.init_state_(prev)
                outer_state = held_bytes(prev, self.outer.tensors())
                state.update(prev=prev, part_names=part_names, shared_names=shared_names, outer_state=outer_state)
        with ctx.clock("pack"):
            subs = plan.build(self.optimizer)
        mine = [subs[s] for s in ctx.local_workers]
        with ctx.clock("plan"):
            turns = [WorkerTurn(sub.index, sub.module, sub.optimizer if self.optimizer is not None
                                else ctx.make_optimizer(sub.module.parameters())) for sub in mine]
            if self.keep_local:
                for sub, turn in zip(mine, turns):
                    self._kept_fill(sub.index, plan.slices, plan.tensors_of(sub, detach=False), turn.optimizer)
        state.update(mine=mine, turns=turns)
        return turns

    def _global_end(self, state) -> Dict[int, int]:
        ctx = self.ctx
        plan, nxt, r, mine, turns = (state[k] for k in ("plan", "nxt", "r", "mine", "turns"))
        # replicated storage: a worker also holds the global model (and its optimizer state)
        replicated = self.storage == "replicated"
        extra = (self.model, self.optimizer) if replicated else ()
        held = {}
        with ctx.clock("metrics"):
            for sub, turn in zip(mine, turns):
                held[sub.index] = self._held_bytes(plan, sub, turn.optimizer,
                                                   extra + ((self.kept.get(sub.index),) if self.keep_local else ()))
                if self.outer_on:  # the outer state and the previous model of what the worker stores
                    names = state["part_names"] + state["shared_names"]
                    held[sub.index] += (state["outer_state"] if replicated else ctx.comm.ps_bytes_of(
                        self.stored(plan), self.spec, sub.index, names=names) // 2 * (1 + self.outer.tensors_per_param)
                        + self.outer.scalar_bytes(self._stored_names(plan, sub.index, names)))
        if self.keep_local:
            with ctx.clock("plan"):
                for sub, turn in zip(mine, turns):
                    self._kept_store(sub.index, plan.slices, plan.tensors_of(sub, detach=False), turn.optimizer)
        if (self.optimizer is not None and not ctx.distributed  # (distributed: the Exchange codes them)
                and any(isinstance(c, int) for c in self.moment_codes.values())):
            with ctx.clock("pack"):  # the moments as their receivers decode them
                names = set(self.param_names)
                for sub in mine:
                    params = [(n, p) for n, p in plan.tensors_of(sub, detach=False).items() if n in names]
                    self._code_moments_(param_states_of(params, sub.optimizer), plan.slices)
        shared_means = {}
        if self.compress is not None and not ctx.distributed:  # what the compressed exchange delivers
            shared_means = ctx.comm.compress_contributions(plan.slices, [plan.compact(sub) for sub in mine])
        with ctx.clock("unpack"):
            plan.aggregate(mine, self.optimizer)
        model = self.tensors()
        if self.compress is not None and not ctx.distributed:
            with ctx.clock("unpack"), torch.no_grad():
                for n, v in shared_means.items():
                    model[n].copy_(v)
            if not replicated:
                ctx.comm.compress_held(plan.slices, self.stored(plan), model)
        states = param_states_of(self.model.named_parameters(), self.optimizer) if self.optimizer is not None else {}
        for key in list(states):
            if self._code(key) is None:  # second: the first moment is not sent; every subnetwork starts from zeros
                for buf in states.pop(key).values():
                    buf.zero_()
        outer_names = state.get("part_names", []) + state.get("shared_names", [])
        if ctx.distributed:  # replicated storage
            with ctx.clock("plan"):
                ctx.comm.exchange(plan.slices, None, None, model, storage="replicated", round=r + 1,
                                  compress=self.compress)
                for key, mom in states.items():
                    ctx.comm.exchange(plan.slices, None, None, mom, names=list(mom), storage="replicated",
                                      round=r + 1, state_code=self._code(key), second=key in ledger.SECOND_MOMENTS)
                plan.after_aggregate()  # e.g. ResIST's full-model residual scales (already set; cheap)
                if self.outer_on:
                    self._outer_(self.tensors(), state["prev"], outer_names)
            return held
        if self.outer_on:
            with ctx.clock("plan"):
                self._outer_(self.tensors(), state["prev"], outer_names)
        cur = plan.slices if replicated else self.stored(plan)
        for names, comp, code in [(list(model), self.compress, None)] + [(list(mom), None, self._code(key))
                                                                         for key, mom in states.items()]:
            # the optimizer's state tensors have their parameters' shapes: the model is the spec for all
            ctx.comm.count_exchange(cur, self.stored(nxt), self.spec, storage=self.storage, names=names,
                                    compress=comp, state_code=code)
        if self.outer_on and self.storage == "decentralized":  # partitioned slices' outer state moves with them
            for _ in range(self.outer.tensors_per_param):
                ctx.comm.count_exchange(cur, self.stored(nxt), self.spec, storage=self.storage,
                                        names=state["part_names"])
        return held

    # ---- the full model
    def _assemble(self, full: Dict[str, Tensor]) -> nn.Module:
        model = copy.deepcopy(self.model)  # the structure (meta device, tied as the model), then the tensors
        assign_tensors_(model, full)
        self.plan(self.held).after_aggregate(model)
        return model

    def global_model(self) -> Optional[nn.Module]:
        """The aggregated full model (rank 0); decentralized: assembled from every rank's part."""
        ctx = self.ctx
        if not self.decentral:
            if ctx.simulated and self.storage == "decentralized":
                ctx.comm.count_gather(self.stored(self.plan(self.held)), self.spec)
            return self.full_model
        full = ctx.comm.gather_full(self.part, self.stored(self.plan(self.held)), self.spec, round=self.held)
        return None if full is None else self.assemble(full)

    def drop(self) -> None:
        """Forget this rank's part (decentralized), e.g. once a pruned model replaces it."""
        self.part = self.momentum = None
        self.scalars = {}
        self.kept = {}
        self._kept = None
        self._open = None
        if self.outer is not None:
            self.outer.state = {}

    # ---- resume: decentralized, this rank's part; otherwise the global model
    def state_dict(self):
        if self.decentral:
            return {"held": self.held, "part": self.part, "momentum": self.momentum, "scalars": self.scalars,
                    "outer": self._outer_state(), "kept": self.kept}
        return {"held": self.held, "model": self.model.state_dict(),
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(), "outer": self._outer_state(),
                "kept": self.kept}

    def _outer_state(self):
        return {} if self.outer is None else self.outer.state_dict()

    def load_state_dict(self, state):
        self.held = state["held"]
        self._kept = None
        self._open = None
        self.kept = dict(state.get("kept") or {})
        if self.outer is not None:
            self.outer.load_state_dict(state.get("outer") or {})
        if self.decentral:
            self.part, self.momentum = state["part"], dict(state.get("momentum") or {})
            if any(isinstance(v, Tensor) for v in self.momentum.values()):  # a checkpoint of SGD momentum only
                self.momentum = {"momentum_buffer": self.momentum}
            self.scalars = dict(state.get("scalars") or {})
            to_meta_(self.model)
            return
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def averaged_tensors(model: nn.Module) -> List[Tensor]:
    """Parameters and floating-point buffers (BN running statistics); integer buffers such as
    num_batches_tracked are equal on every worker and are not sent."""
    return [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]


def flat_bytes(tensors: List[Tensor]) -> int:
    return sum(ledger.tensor_bytes(t) for t in tensors)


class LocalModels:
    """This process's workers' copies of one model and their optimizers, trained with local SGD:
    ``run(r)`` is one round (local steps on every local worker, then the average of ``tensors``
    of every copy: by default parameters and floating buffers). Momentum buffers stay local.
    The outer step (``outer``: True for the run's ``--outer-optimizer``, or an
    :class:`~ist_kernels.train.outer.OuterOptimizer`: DiLoCo's): the workers average their
    pseudo-gradients Δ_s = θ - θ_s (θ: the model before the round; the other averaged tensors, e.g.
    BatchNorm statistics, as values), and θ takes one outer step with the mean Δ as its gradient;
    every worker starts the next round from it (one outer state per process, the same on every rank).
    Under ``--compress bf16|int8`` the pseudo-gradient travels coded in a reduce-scatter and an
    all-gather (``Comm.average_coded_``: float32 sums in worker order, the same bits in both launch
    modes; DiLoCo's coded outer gradients) and the other tensors exactly. ``make_optimizer``: the
    workers' local optimizer (default ``ctx.make_optimizer``; DiLoCo: its AdamW). ``reset_state``:
    every optimizer's state is cleared after each average (what a fresh optimizer has, as the
    subnetwork methods' ``momentum_state=reset``: local SGD's ``momentum_state=reset``, an ablation)."""

    def __init__(self, ctx, models: Dict[int, nn.Module],
                 tensors: Callable[[nn.Module], List[Tensor]] = averaged_tensors,
                 outer: Union[bool, OuterOptimizer] = False, reset_state: bool = False,
                 make_optimizer: Optional[Callable] = None):
        self.ctx = ctx
        self.reset_state = reset_state
        self.models = models
        self.tensors = tensors
        make_optimizer = make_optimizer or ctx.make_optimizer
        self.optimizers = {s: make_optimizer(m.parameters()) for s, m in models.items()}
        self._averaged = {s: tensors(m) for s, m in models.items()}
        hp = ctx.hp
        if isinstance(outer, OuterOptimizer):
            self.outer = outer
        else:
            self.outer = OuterOptimizer.of(hp.outer_optimizer, hp.outer_lr, hp.outer_momentum) if outer else None
        self.outer_on = self.outer is not None
        self._params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in models.items()}
        # what is averaged besides the parameters (floating buffers): as values, never as Δ
        ids = {s: {id(p) for p in ps} for s, ps in self._params.items()}
        self._others = {s: [t for t in self._averaged[s] if id(t) not in ids[s]] for s in models}
        first = min(models)
        self._names = [str(i) for i in range(len(self._params[first]))]  # the outer state's names
        if self.outer_on:
            if len(self._averaged[first]) - len(self._others[first]) != len(self._params[first]):
                raise ValueError("LocalModels: the outer step needs every trainable parameter among the averaged tensors")
            self.outer.init_state_(dict(zip(self._names, self._params[first])))
        self._open: Optional[tuple] = None  # (round, phase, the model before it) between begin and end

    @property
    def model(self) -> nn.Module:
        """The first local worker's copy (after a round all copies are equal)."""
        return self.models[min(self.models)]

    def begin(self, r: int, phase: Optional[int] = None) -> List[WorkerTurn]:
        """Round r's turns: every local worker's copy and optimizer; ``phase`` tags the round's result
        (``extra["phase"]``)."""
        if self._open is not None:
            raise RuntimeError(f"LocalModels: round {self._open[0]} was begun and not ended")
        workers = sorted(self.models)
        prev = [p.detach().clone() for p in self._params[workers[0]]] if self.outer_on else []
        self._open = (r, phase, prev)
        return [WorkerTurn(s, self.models[s], self.optimizers[s]) for s in workers]

    def end(self, r: int, losses: Sequence) -> RoundResult:
        """The round's result: the local workers' summed loss, the papers' parameter-server bytes
        (each worker up- and downloads the averaged tensors) and the state each worker held. The
        average's bytes go through ``ctx.comm``."""
        if self._open is None or self._open[0] != r:
            raise RuntimeError(f"LocalModels: round {r} was not begun")
        _, phase, prev = self._open
        self._open = None
        ctx = self.ctx
        workers = sorted(self.models)
        if len(losses) != len(workers):
            raise ValueError(f"LocalModels: {len(workers)} turns in round {r}, got {len(losses)} losses")
        with ctx.clock("metrics"):
            outer = self.outer.tensors() if self.outer_on else ()
            state = {s: held_bytes(self.models[s], self.optimizers[s], outer, prev) for s in workers}
        if self.outer_on:
            ps = self._average_pseudo_gradients(r, workers, prev)
        else:
            ctx.comm.average_models_([self._averaged[s] for s in workers], round=r + 1)
            ps = sum(ctx.comm.model_ps_bytes(self._averaged[s]) for s in workers)
        if self.reset_state:
            for s in workers:
                self.optimizers[s].state.clear()
        return RoundResult(summed(losses), len(workers) * ctx.local_steps, extra=None if phase is None else
                           {"phase": phase}, ps_bytes=ps if ctx.num_workers > 1 else 0, state_bytes=state)

    @torch.no_grad()
    def _average_pseudo_gradients(self, r: int, workers: List[int], prev: List[Tensor]) -> int:
        """The outer round's average and step (see the class docstring); returns the round's
        parameter-server bytes (each worker uploads its Δ and the other tensors and downloads their
        means, Δ coded as it travels)."""
        ctx = self.ctx
        comm, codec = ctx.comm, ctx.comm.compress
        with ctx.clock("pack"):
            for s in workers:
                ps_ = self._params[s]
                torch._foreach_sub_(ps_, prev)
                torch._foreach_neg_(ps_)  # θ - θ_s, exactly
        if codec is None:
            comm.average_models_([self._params[s] + self._others[s] for s in workers], round=r + 1, compress=None)
        else:
            comm.average_coded_([self._params[s] for s in workers], codec, round=r + 1)
            if any(self._others[s] for s in workers):
                comm.average_models_([self._others[s] for s in workers], round=r + 1, compress=None)
        with ctx.clock("plan"):
            first = self._params[workers[0]]
            # prev becomes the new θ (the mean Δ in first is only read: the step writes prev and its own state)
            self.outer.step_grad_(prev, first, self._names)
            for s in workers:  # every worker starts the next round from θ
                torch._foreach_copy_(self._params[s], prev)
        if codec is None:
            return sum(comm.model_ps_bytes(self._averaged[s]) for s in workers)
        numel = sum(p.numel() for p in first)
        others = sum(t.numel() * t.element_size() for t in self._others[workers[0]])
        return 2 * (comm.coded_bytes(numel, codec) + others) * len(workers)

    def state_dict(self):
        return {"models": {s: m.state_dict() for s, m in self.models.items()},
                "optimizers": {s: o.state_dict() for s, o in self.optimizers.items()},
                "outer": self.outer.state_dict() if self.outer_on else {}}

    def load_state_dict(self, state):
        for s in self.models:
            self.models[s].load_state_dict(state["models"][s])
            self.optimizers[s].load_state_dict(state["optimizers"][s])
        if self.outer_on and state.get("outer"):
            outer = state["outer"]
            if isinstance(outer, (list, tuple)):  # an older checkpoint: the SGD momentum by position
                outer = dict(zip(self._names, outer))
            self.outer.load_state_dict(outer)
