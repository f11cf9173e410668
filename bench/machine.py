"""This machine's timers and measured ceilings, written once for the benchmarks (``bench/conftest.py``:
the ``peaks`` fixture, the report's fraction of peak) and ``tools/gpu_step_costs.py`` (a step's time
against its FLOPs at the card's peak)."""
import time

import torch


def median_seconds(fn, device, reps=5) -> float:
    """Median seconds of ``fn`` on ``device``: CUDA events with warm-up and an L2 flush between
    repeats on a GPU (:func:`gpu_seconds`), a host clock around a call on the CPU."""
    if torch.device(device).type == "cuda":
        return gpu_seconds(fn)[0]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gpu_seconds(fn, warmup_ms=25, rep_ms=100):
    """(median, min) seconds of ``fn`` on the GPU, timed with CUDA events by triton.testing.do_bench,
    which flushes the L2 cache before every repeat (so no input is read from a warm cache)."""
    from triton.testing import do_bench

    med, lo = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.0])
    return med / 1e3, lo / 1e3


def matmul_peak(device, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of a dense ``n`` x ``n`` x ``n`` matmul in ``dtype`` on ``device`` (its median time)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / median_seconds(lambda: a @ b, device)


def copy_peak(device, numel: int) -> float:
    """Bytes/s of a float32 copy of ``numel`` elements on ``device`` (read + write)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return 2 * numel * 4 / median_seconds(lambda: dst.copy_(src), device)
