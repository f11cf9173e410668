#!/usr/bin/env bash
# Set up (tools/setup.sh: it rebuilds the extension only when its sources, setup.py, pyproject.toml
# or torch changed since the last build, see tools/needs_build.py) and run the whole test suite.
# Without a GPU, Triton kernels run under the interpreter (TRITON_INTERPRET=1 is set by
# python_tests/conftest.py) and GPU-only tests skip.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
PY=${PYTHON:-python3}
# Two pytest workers (pytest-xdist; IST_TEST_JOBS=1: one process), a test file's tests on one of
# them (--dist loadfile: a module's fixtures are built once); the 25 slowest tests at the end.
JOBS=${IST_TEST_JOBS:-2}
XDIST=()
if [ "$JOBS" != "1" ]; then XDIST=(-n "$JOBS" --dist loadfile); fi
"$PY" -m pytest python_tests -q -ra --durations=25 "${XDIST[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "tools/test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$rc"
