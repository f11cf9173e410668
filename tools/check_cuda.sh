#!/usr/bin/env bash
# Compile every csrc/**/*.cu with `nvcc -c` (toolkit-only kernels) and syntax-check the torch
# bindings in csrc/cuda/*.cpp against torch's headers. A CPU torch lacks one generated CUDA header
# (c10/cuda/impl/cuda_cmake_macros.h); an empty stand-in is enough for a syntax check.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "tools/check_cuda.sh: nvcc not found; skipping the CUDA compile check"
  exit 0
fi
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the flags torch.utils.cpp_extension adds to every nvcc call (no implicit half/bf16 conversions)
TORCH_NVCC_FLAGS="-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__"
shopt -s globstar nullglob
for f in csrc/**/*.cu; do
  echo "nvcc -c $f"
  nvcc -std=c++20 -O3 -arch=sm_90 --expt-relaxed-constexpr $TORCH_NVCC_FLAGS -Icsrc -c "$f" -o "$tmp/$(basename "$f").o"
done
TI=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))")
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CUDA_INC=$("$PY" -c "import torch.utils.cpp_extension as c; print(c.CUDA_HOME or '/usr/local/cuda')")/include
mkdir -p "$tmp/shim/c10/cuda/impl"
echo '#pragma once' > "$tmp/shim/c10/cuda/impl/cuda_cmake_macros.h"
for f in csrc/cuda/*.cpp; do
  echo "syntax check $f"
  g++ -std=c++20 -fsyntax-only -DIST_WITH_CUDA -I"$tmp/shim" -Icsrc $TI -I"$CUDA_INC" -I"$PYINC" "$f"
done
echo "tools/check_cuda.sh: CUDA sources OK"
