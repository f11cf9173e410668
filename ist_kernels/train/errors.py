"""The trainer's error types, in a leaf module every other trainer module imports (none of them
imports back): :class:`ConfigError` for an invalid option, :class:`RankStateError` for a rank over
its state budget. ``ist_kernels.train.config`` re-exports ConfigError."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid option: the message names it and says what was expected."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"invalid option {option!r}: {message}")


class RankStateError(RuntimeError):
    """A rank held more parameters, buffers and optimizer state than --max-rank-state-mb allows."""
