"""A method's rounds in consecutive phases, each run by its own round engine.

LOFT pre-trains with filter-wise subnetworks and fine-tunes the pruned model with local SGD; ResIST
warms up with local SGD and then trains sub-ResNets; local SGD as LOFT's baseline pre-trains the
dense model and fine-tunes the pruned one. Each phase is a run of rounds of one round engine
(:class:`~ist_kernels.train.rounds.SubnetRounds` or :class:`~ist_kernels.train.rounds.LocalModels`);
:class:`Phases` is what they share, written once:

- which phase round r belongs to: phase i covers the ``rounds[i]`` rounds after the phases before
  it (a phase of 0 rounds is skipped; the last phase takes the rounds that are left);
- its engine, made by the phase's ``start(r)`` the first time one of its rounds begins (a
  transition such as pruning, or building the sub-ResNets' engine), timed as the round's ``plan``;
- the round's two phases: ``begin(r)`` passes the engine the phase's tag (its index, so that
  ``bytes_by_phase`` and ``round_time_by_phase`` can name it; no tag when a method has one phase)
  and, for a subnetwork engine, whether r is the phase's last round (its slices are then written
  back by round r's own plan, not sent on to the next); ``end(r, losses)`` goes to the engine that
  began round r.

Resume: a method restores its phase's engine from its checkpoint and hands it over with
:meth:`Phases.resume`, so a resumed run does not rerun the transition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from .methods import RoundResult, WorkerTurn
from .rounds import SubnetRounds


@dataclass
class Phase:
    """``rounds``: how many rounds the phase has (None: the rest of the run); ``start(r)``: the
    phase's round engine, made at its first round r."""

    rounds: Optional[int]
    start: Callable[[int], object]


class Phases:
    """Round r -> its phase and the phase's engine (see the module docstring)."""

    def __init__(self, ctx, phases: Sequence[Phase]):
        if not phases or any(p.rounds is not None and p.rounds < 0 for p in phases[:-1]):
            raise ValueError("Phases: expected one or more phases with rounds >= 0")
        self.ctx = ctx
        self.phases = list(phases)
        self.ends: List[int] = []  # the first round after each phase
        at = 0
        for i, p in enumerate(self.phases):
            at = ctx.rounds if p.rounds is None or i == len(self.phases) - 1 else min(ctx.rounds, at + p.rounds)
            self.ends.append(at)
        self.engines: List[Optional[object]] = [None] * len(self.phases)
        self._began: Optional[tuple] = None  # (round, the engine that began it)

    def index(self, r: int) -> int:
        """The phase of round r."""
        for i, end in enumerate(self.ends):
            if r < end:
                return i
        raise ValueError(f"Phases: round {r} is past the run's {self.ctx.rounds} rounds")

    def engine(self, r: int):
        """Round r's engine, made by its phase's ``start`` if it is the phase's first round here."""
        i = self.index(r)
        if self.engines[i] is None:
            with self.ctx.clock("plan"):
                self.engines[i] = self.phases[i].start(r)
        return self.engines[i]

    @property
    def current(self):
        """The engine of the latest phase started (None before the first round)."""
        return next((e for e in reversed(self.engines) if e is not None), None)

    def resume(self, r: int, engine) -> None:
        """Round r's phase runs on ``engine`` (restored from a checkpoint); earlier phases are over."""
        i = self.index(r)
        self.engines = [None] * len(self.phases)
        self.engines[i] = engine

    def begin(self, r: int) -> List[WorkerTurn]:
        eng, i = self.engine(r), self.index(r)
        tag = i if len(self.phases) > 1 else None
        if isinstance(eng, SubnetRounds):
            turns = eng.begin(r, last=r == self.ends[i] - 1, phase=tag)
        else:
            turns = eng.begin(r, phase=tag)
        self._began = (r, eng)
        return turns

    def end(self, r: int, losses: Sequence) -> RoundResult:
        if self._began is None or self._began[0] != r:
            raise RuntimeError(f"Phases: round {r} was not begun")
        eng = self._began[1]
        self._began = None
        return eng.end(r, losses)
