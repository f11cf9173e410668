#!/usr/bin/env bash
# Set up a fresh machine (what CI runs from a clean clone): torch (the CPU wheel where none is
# installed; an installed CUDA torch is kept as it is, and pip never replaces it: every later step
# runs with --no-build-isolation / --no-deps or installs packages that do not depend on torch),
# the extras the tests, the demo and CI need (requirements.txt: [train], [experiments], [triton],
# [hf], [test], ruff), and an editable build of ist_kernels against that torch (skipped when the last
# build is up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # The CPU build, pinned by its local version (+cpu): PyPI's Linux torch is a CUDA build, so a bare
  # `torch` could pull one. Here the wheel lies in the local mirror; elsewhere set
  # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0+cpu}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install -q "setuptools>=64" wheel  # build requirements: the build runs without isolation
"$PY" -m pip install -q -r requirements.txt
# Build only when needed (tools/needs_build.py: the extension does not import, or csrc/, setup.py,
# pyproject.toml, torch or the Python changed since the last successful build, recorded in
# .build_stamp); IST_REBUILD=1 forces a build.
if [ "${IST_REBUILD:-0}" = "1" ] || ! "$PY" tools/needs_build.py; then
  rm -f .build_stamp
  # --no-deps: the dependencies are in place (torch above, the extras from requirements.txt)
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  "$PY" tools/needs_build.py --write
fi
