"""GReLU layers (paper 004 §4.4): gated_linear forward, forward+backward, and relu_gates, each side by
side with the torch composition it replaces and with the bare GEMM (torch.nn.functional.linear).

    python -m pytest bench/bench_grelu.py -q --benchmark-json=bench/results/grelu_raw.json
    python bench/report.py bench/results/grelu_raw.json

Baselines: "torch linear * mask" multiplies by a float mask of x's dtype kept in memory (what one
writes without 1-bit gates); "torch linear+relu+pack" computes the gates with torch ops on the device,
as python_tests/reference.py packs them (bits << j, summed per 32 features).
"""
import pytest
import torch
import torch.nn.functional as tnf

import ist_kernels.functional as F

from conftest import DEVICE, record, run

CPU_PROBLEMS = [((512, 512, 512), torch.float32), ((512, 512, 512), torch.bfloat16), ((1024, 1024, 1024), torch.float32)]
GPU_PROBLEMS = [((m, k, n), dt) for (m, k, n) in [(4096, 4096, 4096), (16384, 4096, 4096), (8192, 8192, 8192),
                                                     (65536, 1024, 1024)] for dt in (torch.bfloat16, torch.float16)]
PROBLEMS = GPU_PROBLEMS if DEVICE == "cuda" else CPU_PROBLEMS
ROUNDS = None if DEVICE == "cuda" else 10  # the CPU box is shared and noisy: more rounds, median


def _id(p):
    (m, k, n), dt = p
    return f"{m}x{k}x{n}-{str(dt).replace('torch.', '')}"


def torch_pack(on):
    """on [M, N] bool -> int32 words [M, ceil(N/32)] with torch ops (bit j of word w = feature 32w+j)."""
    M, N = on.shape
    W = (N + 31) // 32
    if N % 32:
        on = tnf.pad(on, (0, 32 * W - N))
    shifts = torch.arange(32, device=on.device, dtype=torch.int32)
    return (on.view(M, W, 32).to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def setup(problem, grad=False):
    (M, K, N), dtype = problem
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(M, K, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(N, K, device=DEVICE, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device=DEVICE, generator=g).to(dtype)
    on = torch.rand(M, N, device=DEVICE, generator=g) > 0.5
    gates = F.pack_gates(on)
    mask = on.to(dtype)
    if grad:
        for t in (x, w, b):
            t.requires_grad_()
    return x, w, b, gates, mask, torch.randn(M, N, device=DEVICE, generator=g).to(dtype)


def _label(benchmark, peaks, group, provider, problem, flops):
    (M, K, N), dtype = problem
    record(benchmark, group=f"{group} {_id(problem)}", provider=provider, flops=flops * M * N * K, dtype=dtype,
           peaks=peaks, M=M, K=K, N=N)


FWD = ["ist_kernels gated_linear", "torch linear * mask", "torch linear"]
# The two fused Triton GEMMs side by side, whatever the dispatch would pick (GPU only).
FUSED = {"ist_kernels fused TMA GEMM": True, "ist_kernels fused pointer GEMM": False}


def _fused(use_tma, fn):
    """fn with the forward forced onto one fused Triton kernel (no cuBLAS + pass)."""
    from ist_kernels.ops.grelu import _triton as tg

    def call():
        saved = tg.USE_TMA, tg.CUBLAS_EPILOGUE_MIN_K
        tg.USE_TMA, tg.CUBLAS_EPILOGUE_MIN_K = use_tma, float("inf")
        try:
            return fn()
        finally:
            tg.USE_TMA, tg.CUBLAS_EPILOGUE_MIN_K = saved
    return call


@pytest.mark.parametrize("provider", FWD + (list(FUSED) if DEVICE == "cuda" else []))
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_gated_linear_forward(benchmark, peaks, problem, provider):
    x, w, b, gates, mask, _ = setup(problem)
    fn = {
        FWD[0]: lambda: F.gated_linear(x, w, gates, b),
        FWD[1]: lambda: tnf.linear(x, w, b) * mask,
        FWD[2]: lambda: tnf.linear(x, w, b),
    }.get(provider) or _fused(FUSED[provider], lambda: F.gated_linear(x, w, gates, b))
    _label(benchmark, peaks, "gated_linear fwd", provider, problem, 2)
    with torch.no_grad():
        run(benchmark, fn, rounds=ROUNDS)


@pytest.mark.parametrize("provider", FWD)
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_gated_linear_forward_backward(benchmark, peaks, problem, provider):
    x, w, b, gates, mask, g = setup(problem, grad=True)
    fwd = {
        FWD[0]: lambda: F.gated_linear(x, w, gates, b),
        FWD[1]: lambda: tnf.linear(x, w, b) * mask,
        FWD[2]: lambda: tnf.linear(x, w, b),
    }[provider]

    def step():
        x.grad = w.grad = b.grad = None
        fwd().backward(g)

    _label(benchmark, peaks, "gated_linear fwd+bwd", provider, problem, 6)
    run(benchmark, step, rounds=ROUNDS)


GATES = ["ist_kernels relu_gates", "torch linear+relu+pack", "torch linear"]


def _torch_relu_gates(x, w, b):
    z = tnf.linear(x, w, b)
    return torch.relu(z), torch_pack(z > 0)


@pytest.mark.parametrize("provider", GATES)
@pytest.mark.parametrize("problem", PROBLEMS, ids=_id)
def test_relu_gates(benchmark, peaks, problem, provider):
    x, w, b, *_ = setup(problem)
    if provider == GATES[0]:  # the baseline computes the same gates (up to sign ties of z at 0)
        ours, theirs = F.relu_gates(x, w, b)[1], _torch_relu_gates(x, w, b)[1]
        assert (ours != theirs).float().mean().item() < 1e-3
    fn = {
        GATES[0]: lambda: F.relu_gates(x, w, b),
        GATES[1]: lambda: _torch_relu_gates(x, w, b),
        GATES[2]: lambda: tnf.linear(x, w, b),
    }[provider]
    _label(benchmark, peaks, "relu_gates", provider, problem, 2)
    with torch.no_grad():
        run(benchmark, fn, rounds=ROUNDS)
