"""The optional dependencies (pyproject.toml's extras) of ``ist_kernels.train`` and
``ist_kernels.experiments``: one clear line, naming the extra to install, when one is missing.

The kernel library needs torch alone. ``import ist_kernels.train`` without numpy raises
:class:`MissingExtra` (an ImportError) saying ``ist_kernels.train needs numpy: pip install
'ist_kernels[train]'`` before anything else of the trainer is imported; ``ist_kernels.experiments``
likewise. The ``ist-train`` console script enters through ``ist_kernels._console``, which says the
same in one line and exits 2. This module imports nothing of ist_kernels, so the packages it guards
can import it first.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Dict, Sequence

#: pyproject.toml's extras: {extra: {module it provides: the distribution pip installs}}
EXTRAS: Dict[str, Dict[str, str]] = {
    "train": {"numpy": "numpy", "sklearn": "scikit-learn", "tqdm": "tqdm", "yaml": "pyyaml",
              "matplotlib": "matplotlib"},
    "experiments": {"numpy": "numpy", "sklearn": "scikit-learn", "tqdm": "tqdm", "matplotlib": "matplotlib"},
}


class MissingExtra(ImportError):
    """A module of an extra is not installed; the message is one line saying what to install."""


def _installed(module: str, import_it: bool) -> bool:
    """Whether ``module`` is installed (imported, or only looked up). A module that is there but
    fails to import for another reason (a broken install) raises that error, not this one's."""
    try:
        if import_it:
            importlib.import_module(module)
            return True
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as e:
        if e.name is not None and e.name != module:
            raise
        return False


def require(package: str, extra: str, modules: Sequence[str], import_them: bool = True) -> None:
    """Raise :class:`MissingExtra` naming the distributions of ``modules`` (modules of ``extra``)
    that are not installed. ``import_them``: import them (for what ``package`` imports anyway),
    else only look them up (no import cost). The error's ``name`` is ``package``: the import that
    failed (so ``python -m package`` reports it in one line too)."""
    missing = [EXTRAS[extra][m] for m in modules if not _installed(m, import_them)]
    if missing:
        raise MissingExtra(f"{package} needs {', '.join(missing)}: pip install 'ist_kernels[{extra}]'",
                           name=package)
