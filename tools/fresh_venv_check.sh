#!/usr/bin/env bash
# Install ist_kernels with no extras into a truly fresh venv (no system site-packages) and check
# that it imports, runs every op (python_tests/no_extras_worker.py) and that pip installed none of
# the trainer's or experiments' dependencies. Slow (a venv, torch, a build of _C): run by hand, not
# in CI. Usage: bash tools/fresh_venv_check.sh [venv folder, default: a temporary one]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${1:-$(mktemp -d)/venv}
"$PY" -m venv "$VENV"
V="$VENV/bin/python"
# torch pinned to its CPU build (see tools/setup.sh), the build requirements, then the package alone
"$V" -m pip install -q "${TORCH_SPEC:-torch==2.13.0+cpu}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
"$V" -m pip install -q "setuptools>=64" wheel
MAX_JOBS=${MAX_JOBS:-2} "$V" -m pip install -q --no-build-isolation -e .
installed=$("$V" -m pip list --format=freeze | cut -d= -f1 | tr 'A-Z_' 'a-z-')
echo "installed in $VENV:" $installed
for extra in matplotlib scikit-learn tqdm pyyaml numpy triton transformers; do
  if grep -qx "$extra" <<<"$installed"; then
    echo "fresh_venv_check: $extra was installed without being asked for" >&2
    exit 1
  fi
done
(cd /tmp && "$V" -c "import ist_kernels, sys; print('ist_kernels', ist_kernels.__version__, 'from', ist_kernels.__file__)")
"$V" python_tests/no_extras_worker.py
echo "fresh_venv_check: ok"
