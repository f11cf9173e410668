#!/usr/bin/env bash
# One command on a GPU machine (finishes inside ~9 minutes, never hangs: every step has a limit):
# build for sm_90, the GPU-only tests (-m gpu), the benchmarks with bench/report.py and a pass/miss
# line per performance goal (bench/goals.py), the per-call host overhead (bench/bench_overhead.py),
# then the rest of the suite on CUDA. Results go to the folder $OUT names (default gpu_results/), at
# most 8 files:
#   suite.log (environment, build, step times, the overhead rows), tests_gpu.log, bench_raw.json,
#   bench_more.json, report.md (with the overhead table), goals.md, tests_all.log, hopper.md
#   (tools/hopper_report.py when it runs there).
# Usage: OUT=somewhere bash tools/gpu_suite.sh   (on the device tool: bash tools/gpu_suite.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/suite.log"
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-560}
status=0

step() {  # step NAME LIMIT_S CMD...: run with a time limit, log rc and seconds
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$((BUDGET_S - (start - T0) - 10))  # the whole suite stays inside BUDGET_S
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: skipped, the ${BUDGET_S}s budget is spent" | tee -a "$LOG"; status=1; return 124; fi
  echo "== $name (limit ${limit}s, at +$((start - T0))s)" >&2
  timeout -k 15 "$limit" "$@"
  rc=$?
  echo "== $name: rc=$rc in $(($(date +%s) - start))s" | tee -a "$LOG" >&2
  [ "$rc" -ne 0 ] && status=1
  return "$rc"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv || true
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); p = torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs', getattr(p, 'L2_cache_size', 0) >> 20, 'MB L2')"
  nvcc --version | tail -1
} >>"$LOG" 2>&1

# 1. build for sm_90 in place (no pip: the image's torch stays as it is). The GPU image's default
# compiler (CXX=/opt/gcc/bin/g++, a wrapper) linked libstdc++ into _C statically, and that copy's
# ostream crashed formatting any TORCH_CHECK message with an integer (seen on an H100, 2026-11-22):
# build with the distribution's g++ (13, as torch 2.11 was) where it is there, and check the result.
for v in 13 ""; do
  if [ -x "/usr/bin/g++${v:+-$v}" ] && [ -x "/usr/bin/gcc${v:+-$v}" ]; then
    export CC="/usr/bin/gcc${v:+-$v}" CXX="/usr/bin/g++${v:+-$v}"
    break
  fi
done
echo "compiler: CC=${CC:-default} CXX=${CXX:-default}" >>"$LOG"
step build 240 env TORCH_CUDA_ARCH_LIST="9.0" MAX_JOBS="$(nproc)" "$PY" setup.py build_ext --inplace >>"$LOG" 2>&1 \
  || { echo "build failed: see $LOG" | tee -a "$LOG"; tail -40 "$LOG"; exit 1; }
if nm -C --defined-only ist_kernels/_C*.so 2>/dev/null | grep -q " [TW] std::basic_ostream"; then
  echo "build check: _C carries its own libstdc++ (static); its C++ errors would crash. Set CXX to a g++ that links it dynamically." | tee -a "$LOG"
  exit 1
fi
"$PY" -c "import torch, ist_kernels; print('ist_kernels from', ist_kernels.__file__); x = torch.randn(8, 4, device='cuda'); print('cuda slice_gather ok', torch.ops.ist_kernels.slice_gather([x], [0], [torch.tensor([1, 3], device='cuda')], [0])[0].shape)" >>"$LOG" 2>&1

# 2. GPU-only tests (one pinned tile config per kernel: IST_KERNELS_AUTOTUNE=0 from the conftest);
# in xdist workers where pytest-xdist is there, so that a crash fails one test, not the run
if "$PY" -c "import xdist" 2>/dev/null; then par4=(-n 4); par8=(-n 8); else par4=(); par8=(); fi
step tests_gpu ${IST_TESTS_GPU_LIMIT:-150} "$PY" -m pytest python_tests -m gpu -q -ra -p no:cacheprovider --timeout=120 "${par4[@]}" \
  >"$OUT/tests_gpu.log" 2>&1
tail -5 "$OUT/tests_gpu.log" | tee -a "$LOG"

# 3a. per-call host overhead on tiny tensors (bench/bench_overhead.py; CUDA host time from torch.profiler),
# first because it is quick: its table is appended to report.md below and its JSON rows to suite.log
# (the folder holds at most 8 files)
OVERHEAD_JSON="${TMPDIR:-/tmp}/ist_overhead_$$.json" OVERHEAD_MD="${TMPDIR:-/tmp}/ist_overhead_$$.md"
# CUDA only (CI measures the CPU), host clock with the queue drained per run: with torch.profiler
# (--cuda-timer profiler) the CPU and CUDA passes did not finish in 120 s on an H200 (2026-11-27)
step bench_overhead 90 "$PY" bench/bench_overhead.py --device cuda --cuda-timer clock --calls 500 \
  --json "$OVERHEAD_JSON" >"$OVERHEAD_MD" 2>>"$LOG"
[ -s "$OVERHEAD_JSON" ] && { echo "bench_overhead.json (the rows that finished):"; cat "$OVERHEAD_JSON"; } >>"$LOG"
rm -f "$OVERHEAD_JSON"

# 3b. benchmarks (autotuned configs, CUDA-event timing with L2 flush), report, goals
# (two runs, each with its own JSON, so that a step stopped at its limit costs only its own numbers)
step bench_kernels 300 "$PY" -m pytest bench/bench_grelu.py bench/bench_subnet.py bench/bench_slices.py -q \
  -p no:cacheprovider --benchmark-json="$OUT/bench_raw.json" ${IST_BENCH_FILTER:+-k "$IST_BENCH_FILTER"} >>"$LOG" 2>&1
step bench_partition 90 "$PY" -m pytest bench/bench_partition.py -q -p no:cacheprovider \
  --benchmark-json="$OUT/bench_more.json" >>"$LOG" 2>&1
jsons=()
for j in "$OUT/bench_raw.json" "$OUT/bench_more.json"; do [ -s "$j" ] && jsons+=("$j"); done
if [ "${#jsons[@]}" -gt 0 ]; then
  (cd bench && "$PY" report.py "${jsons[@]}" --out "$OUT/report.md" >/dev/null && \
    "$PY" goals.py "${jsons[@]}" --out "$OUT/goals.md") | tee -a "$LOG"
fi
[ -s "$OVERHEAD_MD" ] && cat "$OVERHEAD_MD" >>"$OUT/report.md"
rm -f "$OVERHEAD_MD"

# 4. the rest of the suite with CUDA present (CPU and Triton-on-CUDA paths), in parallel workers;
# skipped with IST_GPU_SUITE_QUICK=1 (CI runs those tests on every change; a lease is short)
[ "${IST_GPU_SUITE_QUICK:-0}" = "1" ] || step tests_all 170 "$PY" -m pytest python_tests -m "not gpu" -q -ra -p no:cacheprovider --timeout=120 "${par8[@]}" \
  >"$OUT/tests_all.log" 2>&1
tail -5 "$OUT/tests_all.log" | tee -a "$LOG"

# 5. the offline Hopper report (also in CI), where present
if [ -f tools/hopper_report.py ] && [ "${IST_GPU_SUITE_QUICK:-0}" != "1" ]; then
  step hopper 60 "$PY" tools/hopper_report.py --out "$OUT/hopper.md" >>"$LOG" 2>&1
fi
echo "gpu_suite: status=$status in $(($(date +%s) - T0))s; results in $OUT" | tee -a "$LOG"
[ -f "$OUT/goals.md" ] && cat "$OUT/goals.md"
exit "$status"
