"""Where a round's time goes: a :class:`Clock` that sums wall-clock seconds into named parts.

Every row of ``metrics.jsonl`` carries the parts of its round (``time``), ``summary.json`` their
totals (``time_by_part``). The parts, each measured where the work happens:

- ``local``: the local steps (``RunContext.train_local``: forward, backward, optimizer step);
- ``plan``: the round's plans and compact state: drawing a plan, cutting or attaching the
  subnetworks, refilling the compact modules, an exchange's routing;
- ``pack`` / ``unpack``: copying slices into and out of the send / receive buffers (simulated: the
  slice gather that builds the subnetworks and the scatter that aggregates them);
- ``comm``: the collectives' own time, from issuing one to its completion (a rank that waits for a
  slower one shows the wait here);
- ``eval``: assembling and scoring the full model;
- ``metrics``: summing the round's metrics over the ranks and logging them;
- ``checkpoint``: writing a checkpoint;
- ``compile``: ``--compile``'s compiling (dynamo, AOT autograd, inductor; the backward's lazy compile
  too), taken out of the part that was open when it happened (``local``: the first local step of a
  run, and of each new subnetwork structure): once per run, not a round's cost.

``other`` (written by the trainer) is the round's wall time that no part measured.
On CUDA the clock synchronises the device at part boundaries, so a part owns its kernels' time.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, Optional

PARTS = ("local", "plan", "pack", "comm", "unpack", "eval", "metrics", "checkpoint", "compile")
#: the parts that make up a round's training time (what a method's round costs): neither the trainer's
#: bookkeeping (eval, metrics, checkpoint) nor the one-time compile
TRAIN_PARTS = ("local", "plan", "pack", "comm", "unpack")


class Clock:
    """Seconds per part since the last :meth:`take`. ``sync``: called at every boundary (e.g.
    ``torch.cuda.synchronize``) so asynchronous device work lands in the part that launched it."""

    def __init__(self, sync: Optional[Callable[[], None]] = None):
        self._sync = sync
        self._parts: Dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._open: Optional[str] = None

    @contextlib.contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        """Time the block as ``part``. Blocks do not nest: an inner block (e.g. an exchange inside
        a method's round) is charged to its own part and the outer one resumes after it."""
        if part not in self._parts:
            raise ValueError(f"Clock: unknown part {part!r}; parts are {', '.join(PARTS)}")
        outer = self._open
        if outer == part:  # re-entering the same part: already being timed
            yield
            return
        t0 = self._now()
        if outer is not None:
            self._parts[outer] += t0  # the outer part gives up [t0, t1]
        self._open = part
        try:
            yield
        finally:
            t1 = self._now()
            self._parts[part] += t1 - t0
            self._open = outer
            if outer is not None:
                self._parts[outer] -= t1

    def add(self, part: str, seconds: float) -> None:
        """Charge ``seconds`` measured elsewhere (e.g. an exchange's own timers) to ``part``; the
        open block, which also covered them, gives them up."""
        if part not in self._parts:
            raise ValueError(f"Clock: unknown part {part!r}; parts are {', '.join(PARTS)}")
        if self._open == part:  # the open block already covers them
            return
        self._parts[part] += seconds
        if self._open is not None:
            self._parts[self._open] -= seconds

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def peek(self) -> Dict[str, float]:
        return dict(self._parts)

    def take(self) -> Dict[str, float]:
        """The parts since the last take (seconds), then zero."""
        if self._open is not None:
            raise RuntimeError(f"Clock.take inside an open {self._open!r} block")
        out = dict(self._parts)
        self._parts = dict.fromkeys(PARTS, 0.0)
        return out
