"""Benchmark harness shared by every bench/bench_*.py file.

Each benchmark runs one provider (our op, or a torch baseline imported from
python_tests/reference.py or written as the torch composition it replaces) for one problem, and
records in ``benchmark.extra_info`` what ``bench/report.py`` needs to put providers side by side:
the problem (``group``), the provider, the FLOPs and the bytes the problem needs. The report
divides by the machine's measured peaks (``peaks`` fixture: a large matmul and a large copy).
"""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python_tests"))  # reference.py

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from machine import copy_peak, gpu_seconds, matmul_peak  # noqa: E402  (bench/machine.py)

import ist_kernels  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


@pytest.fixture(scope="session")
def peaks():
    """Measured ceilings of this machine: dense matmul FLOP/s per dtype and copy bytes/s."""
    n = 8192 if DEVICE == "cuda" else 1024
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if DEVICE == "cpu" and dtype == torch.float16:
            continue
        out[f"matmul_{dtype}".replace("torch.", "")] = matmul_peak(DEVICE, n, dtype)
    out["copy_bytes"] = copy_peak(DEVICE, (512 if DEVICE == "cuda" else 32) * 2**20)
    return out


def record(benchmark, *, group, provider, flops=0, bytes=0, dtype=None, peaks=None, **extra):
    """Label one benchmark run for bench/report.py."""
    benchmark.group = group
    benchmark.extra_info.update(
        provider=provider, flops=flops, bytes=bytes, device=device_name(),
        dtype=str(dtype).replace("torch.", "") if dtype is not None else None, **extra)
    if peaks is not None:
        benchmark.extra_info["peaks"] = peaks


def run(benchmark, fn, rounds=None):
    """Time ``fn``. On a GPU: CUDA events, warm-up and an L2 flush per repeat (``gpu_seconds``); the
    median and min land in ``extra_info`` (``median_s``, ``min_s``), which bench/report.py prefers over
    pytest-benchmark's host-clock stats (pytest-benchmark then runs ``fn`` once, to keep its JSON).
    On the CPU: pytest-benchmark's host clock, a few rounds."""
    if DEVICE == "cuda":
        med, lo = gpu_seconds(fn)
        benchmark.extra_info.update(median_s=med, min_s=lo, timer="cuda events (triton do_bench, L2 flushed)")

        def call():
            fn()
            sync()

        return benchmark.pedantic(call, rounds=1, iterations=1, warmup_rounds=0)

    if rounds is None:
        rounds = 3
    return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
