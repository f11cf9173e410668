#!/usr/bin/env bash
# Set up a fresh machine: torch (the local CPU wheel here; keep an installed CUDA torch as it is),
# the runtime and test dependencies, and an editable build of ist_kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q "setuptools>=64" wheel  # build requirements: the build runs without isolation
"$PY" -m pip install -q -r requirements.txt
if ! "$PY" -c "import ist_kernels._C" 2>/dev/null || [ "${IST_REBUILD:-1}" = "1" ]; then
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
