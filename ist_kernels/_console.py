"""The ``ist-train`` console script (pyproject.toml: ``ist_kernels._console:ist_train``).

Not ``ist_kernels.train.cli:run`` itself: importing any module of ``ist_kernels.train`` runs that
package's check of the ``[train]`` extra first (``ist_kernels._extras``), and a console script whose
module fails to import ends in a traceback. Here the import's failure is kept, and
:func:`ist_train` checks every module of the extra (looked up, not imported: the trainer imports
most of them only when it uses them), then prints one line to stderr and exits with status 2, as
ist-train does for an invalid option; with the extra installed it is ``ist_kernels.train.cli.run``.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from ._extras import EXTRAS, MissingExtra, require

try:
    from .train.cli import run
except MissingExtra as e:
    run, _missing = None, e
else:
    _missing = None


def ist_train(argv: Optional[Sequence[str]] = None) -> None:
    """``ist-train``: :func:`ist_kernels.train.cli.run` once the ``[train]`` extra is installed;
    otherwise one line on stderr naming it, and exit status 2."""
    try:
        require("ist-train", "train", list(EXTRAS["train"]), import_them=False)
        if _missing is not None:
            raise _missing
    except MissingExtra as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    run(argv)
