"""Training: data sets, the simulated and distributed trainers of independent subnetworks, and the
round engine for a user's own loop (:class:`Engine`, ``docs/library.md``)."""
from .library import Engine, Round, Worker

__all__ = ["Engine", "Round", "Worker"]
