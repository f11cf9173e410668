"""Training: data sets, the simulated and distributed trainers of independent subnetworks, and the
round engine for a user's own loop (:class:`Engine`, ``docs/library.md``). Needs the ``[train]``
extra: without numpy the import fails with one line saying so (``ist_kernels._extras``)."""
from .._extras import require

require(__name__, "train", ["numpy"])  # imported by the modules below; the rest of [train] when used

from .engine import Engine, Round, Worker  # noqa: E402

__all__ = ["Engine", "Round", "Worker"]
