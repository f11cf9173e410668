"""Does ``ist_kernels._C`` need (re)building? tools/setup.sh asks before ``pip install -e .``.

A build is needed when the extension does not import, when ``ist_kernels`` is not installed in
this Python, or when what the build reads changed since the last successful build: the C++/CUDA
sources (every file under ``csrc/``), ``setup.py``, ``pyproject.toml``, the installed torch, the
Python and the environment variables setup.py reads. Their hash lies in a stamp file (``.build_stamp``
at the repository root, ignored by git) that ``--write`` records after a successful build.

    python tools/needs_build.py            # exit 0 and "up to date", or exit 3 and "rebuild: <why>"
    python tools/needs_build.py --write    # record the current inputs (after a successful build)

Any other exit status (a crash) means: rebuild, to be safe. ``--root`` / ``--stamp`` point it at
another tree or stamp (the tests do); ``--no-import-check`` skips the import and install checks.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from typing import Dict, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = ".build_stamp"
#: what the build reads besides the sources: setup.py's switches and torch's CUDA settings
BUILD_ENV = ("FORCE_CUDA", "FORCE_ONLY_CPU", "DEBUG", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST")
NEEDED = 3  # exit status: a build is needed


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")  # no import of torch: fast
    except importlib.metadata.PackageNotFoundError:
        try:
            import torch
        except ImportError:
            return "none"
        return str(torch.__version__)


def inputs(root: str = ROOT) -> Dict[str, str]:
    """What a build depends on: ``{name: digest or value}`` (files by relative path)."""
    out: Dict[str, str] = {}
    files = [os.path.join(root, "setup.py"), os.path.join(root, "pyproject.toml")]
    for folder, dirs, names in os.walk(os.path.join(root, "csrc")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(folder, n) for n in sorted(names)]
    for path in files:
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        try:
            with open(path, "rb") as f:
                out[rel] = hashlib.sha256(f.read()).hexdigest()
        except FileNotFoundError:
            out[rel] = "missing"
    out["torch"] = _torch_version()
    out["python"] = f"{sys.implementation.name} {sys.version.split()[0]} at {sys.prefix}"
    for name in BUILD_ENV:
        out["env " + name] = os.environ.get(name, "")
    return out


def read_stamp(path: str) -> Optional[Dict[str, str]]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_stamp(path: str, root: str = ROOT) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(inputs(root), f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _import_problem(root: str) -> Optional[str]:
    """Why ``ist_kernels._C`` cannot be used from this Python (None when it can): ``ist_kernels`` not
    installed as an editable install of ``root`` (what tools/setup.sh makes), or the import fails
    (not built, built for another torch)."""
    try:
        dist = importlib.metadata.distribution("ist_kernels")
    except importlib.metadata.PackageNotFoundError:
        return "ist_kernels is not installed in this Python"
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        url = {}
    here = "file://" + os.path.realpath(root)
    if not url.get("dir_info", {}).get("editable") or url.get("url", "").rstrip("/") != here:
        return f"this Python's ist_kernels is not an editable install of {root}"
    p = subprocess.run([sys.executable, "-c", "import ist_kernels._C"], cwd=root, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"the extension does not import: {last}"
    return None


def decide(root: str = ROOT, stamp: Optional[str] = None, check_import: bool = True) -> Tuple[bool, str]:
    """``(needed, why)``: whether to build, and the reason (or "up to date")."""
    stamp = stamp or os.path.join(root, STAMP)
    if check_import:
        problem = _import_problem(root)
        if problem:
            return True, problem
    recorded = read_stamp(stamp)
    if recorded is None:
        return True, f"no record of a previous build ({stamp})"
    now = inputs(root)
    changed = sorted(k for k in set(now) | set(recorded) if now.get(k) != recorded.get(k))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        return True, f"changed since the last build: {shown}"
    return False, "up to date"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=ROOT, help="the source tree (default: this repository)")
    ap.add_argument("--stamp", default=None, help=f"the stamp file (default: ROOT/{STAMP})")
    ap.add_argument("--write", action="store_true", help="record the current inputs as built")
    ap.add_argument("--no-import-check", action="store_true", help="compare the inputs only")
    a = ap.parse_args(argv)
    stamp = a.stamp or os.path.join(a.root, STAMP)
    if a.write:
        write_stamp(stamp, a.root)
        return 0
    needed, why = decide(a.root, stamp, check_import=not a.no_import_check)
    print(f"ist_kernels._C: {'rebuild: ' if needed else ''}{why}")
    return NEEDED if needed else 0


if __name__ == "__main__":
    sys.exit(main())
