"""subnet_linear (IST, paper 001 §3.1) against the torch compositions it replaces.

A subnetwork keeps a fraction of a layer's output neurons (rows) and of its input neurons (cols):
the same fraction of both here, as for a hidden layer between two partitioned layers. Providers,
for the forward and for forward + backward (gradients of x, W and b):

- ist_kernels.subnet_linear: gathers W[rows][:, cols] tile by tile, gradients full-size.
- index_select+matmul: materialise W[rows][:, cols] and b[rows], then F.linear (autograd scatters
  the gradients back to full size through index_select's backward).
- masked full-width: the full layer with the masks multiplied in, y = (x ⊙ m_in) Wᵀ + b, ⊙ m_out;
  what a subnetwork costs without subnet ops (x is full-width here).
- pre-gathered matmul: F.linear on compact weights gathered beforehand (not timed) and compact
  gradients: the floor for a subnetwork GEMM.

FLOPs are the subnetwork's (2·M·len(rows)·len(cols) forward, 3x that with the backward) for every
provider, so TFLOP/s compare useful work. Targets (GPU): >= 1.3x index_select+matmul,
>= 0.8·S x the masked full-width matmul (S = 1/keep), >= 0.9x the pre-gathered matmul.
"""
import pytest
import torch
import torch.nn.functional as TF

import ist_kernels.functional as F

from conftest import DEVICE, record, run

KEEP = [2, 4, 8]  # keep 1/2, 1/4, 1/8 of the rows and of the cols
PROVIDERS = ["ist_kernels.subnet_linear", "index_select+matmul", "masked full-width", "pre-gathered matmul"]


def problem(M, N, K, keep, dtype, requires_grad):
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(N, generator=g)[: N // keep].sort().values.to(DEVICE)
    cols = torch.randperm(K, generator=g)[: K // keep].sort().values.to(DEVICE)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype).requires_grad_(requires_grad)
    b = torch.randn(N, generator=g).to(DEVICE, dtype).requires_grad_(requires_grad)
    x = torch.randn(M, len(cols), generator=g).to(DEVICE, dtype).requires_grad_(requires_grad)
    return x, w, b, rows, cols


def provider_fn(provider, x, w, b, rows, cols, backward):
    """A closure running one provider's forward (and backward when asked)."""
    M, N, K = x.shape[0], w.shape[0], w.shape[1]
    g = torch.randn(M, len(rows), device=DEVICE, dtype=x.dtype)
    if provider == "ist_kernels.subnet_linear":
        inputs = (x, w, b)

        def fwd():
            return F.subnet_linear(x, w, b, rows, cols)
    elif provider == "index_select+matmul":
        inputs = (x, w, b)

        def fwd():
            return TF.linear(x, w.index_select(0, rows).index_select(1, cols), b.index_select(0, rows))
    elif provider == "masked full-width":
        m_out = torch.zeros(N, device=DEVICE, dtype=x.dtype).index_fill_(0, rows, 1)
        m_in = torch.zeros(K, device=DEVICE, dtype=x.dtype).index_fill_(0, cols, 1)
        x_full = torch.zeros(M, K, device=DEVICE, dtype=x.dtype).index_copy_(1, cols, x.detach())
        x_full.requires_grad_(x.requires_grad)
        g = torch.zeros(M, N, device=DEVICE, dtype=x.dtype).index_copy_(1, rows, g)
        inputs = (x_full, w, b)

        def fwd():
            return TF.linear(x_full * m_in, w, b) * m_out
    else:  # pre-gathered matmul
        wc = w.detach()[rows][:, cols].clone().requires_grad_(w.requires_grad)
        bc = b.detach()[rows].clone().requires_grad_(b.requires_grad)
        inputs = (x, wc, bc)

        def fwd():
            return TF.linear(x, wc, bc)

    if not backward:
        return lambda: fwd()
    return lambda: torch.autograd.grad(fwd(), inputs, g)


def bench_one(benchmark, peaks, M, N, K, keep, dtype, provider, backward):
    x, w, b, rows, cols = problem(M, N, K, keep, dtype, requires_grad=backward)
    flops = 2 * M * len(rows) * len(cols) * (3 if backward else 1)
    mode = "fwd+bwd" if backward else "fwd"
    record(benchmark, group=f"subnet_linear {mode} {str(dtype)[6:]} M={M} N={N} K={K} keep=1/{keep} rows+cols",
           provider=provider, flops=flops, dtype=dtype, peaks=peaks, keep=1 / keep)
    fn = provider_fn(provider, x, w, b, rows, cols, backward)
    with torch.no_grad() if not backward else torch.enable_grad():
        run(benchmark, fn, rounds=15 if DEVICE == "cpu" else None)  # more rounds: CPU times are noisy


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_subnet_linear_cpu(benchmark, peaks, keep, provider, backward):
    if DEVICE != "cpu":
        pytest.skip("CPU sizes")
    bench_one(benchmark, peaks, 256, 1024, 1024, keep, torch.float32, provider, backward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_subnet_linear_cuda(benchmark, peaks, keep, provider, backward):
    bench_one(benchmark, peaks, 8192, 8192, 8192, keep, torch.bfloat16, provider, backward)


# ---- One round of tau local steps of one subnetwork (issue 19 item 3): the round as IST trains it
# (SubnetMLP.compact: one planned gather, tau dense steps on compact tensors, one planned scatter)
# against a hand-compacted dense MLP of the same shapes (tau steps, no gather, no scatter: the
# floor) and against the per-call path (tau steps of model(x, neurons) through subnet_linear, whose
# gradients are full-size). SGD, ReLU hidden layers, biases, a trained output layer.
ROUND = dict(cpu=dict(batch=256, in_features=256, width=2048, depth=2, out=10, S=4, tau=8),
             cuda=dict(batch=4096, in_features=1024, width=16384, depth=2, out=10, S=4, tau=8))
ROUND_PROVIDERS = ["ist_kernels SubnetMLP.compact (gather, tau steps, scatter)", "hand-compacted dense MLP (tau steps)",
                   "per call subnet_linear (model(x, neurons))",
                   "SubnetMLP.compact, plan built once (refresh, tau steps, write_back)"]
# The last provider times the same round without building its slice plan (the round's plan is
# built once, outside the timing): the difference to the first is the plan's build and first
# upload. A hidden-to-hidden weight is planned on its flat view (width^2 slices), so the plan's
# inverse maps are O(width^2) per subnetwork on the host (csrc/slices_plan.h build_slice_plan; H200
# 2026-11-27: ~2.9 s of the 3.0 s round at width 16384).


def round_problem():
    from ist_kernels.nn import SubnetMLP
    from ist_kernels.partition import categorical_partition, round_generator

    c = ROUND[DEVICE]
    g = torch.Generator().manual_seed(0)
    model = SubnetMLP(c["in_features"], c["width"], c["depth"], c["out"], bias=True, train_output=True,
                      generator=g).to(DEVICE)
    neurons = [categorical_partition(c["width"], c["S"], round_generator(seed=0, round=l), balanced=True)[0]
               for l in range(c["depth"])]
    x = torch.randn(c["batch"], c["in_features"], generator=g).to(DEVICE)
    y = torch.randn(c["batch"], c["out"], generator=g).to(DEVICE)
    return model, neurons, x, y, c


def sgd_steps(module_or_fn, params, x, y, tau, lr=1e-3):
    for _ in range(tau):
        loss = (module_or_fn(x) - y).square().sum()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)


@pytest.mark.parametrize("provider", ROUND_PROVIDERS)
def test_round_of_local_steps(benchmark, peaks, provider):
    model, neurons, x, y, c = round_problem()
    n = [len(i) for i in neurons]
    fan = [c["in_features"]] + n[:-1]
    # FLOPs of the subnetwork's tau steps (forward + backward of every layer: 6 * batch * in * out)
    flops = c["tau"] * 6 * c["batch"] * (sum(a * b for a, b in zip(fan, n)) + n[-1] * c["out"])
    if provider == ROUND_PROVIDERS[0]:
        def fn():
            with model.compact([neurons]) as rnd:
                mod = rnd.modules[0]
                sgd_steps(mod, list(mod.parameters()), x, y, c["tau"])
    elif provider == ROUND_PROVIDERS[1]:
        layers = []
        for a, b in zip(fan, n):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        dense = torch.nn.Sequential(*layers, torch.nn.Linear(n[-1], c["out"])).to(DEVICE)
        params = list(dense.parameters())

        def fn():
            sgd_steps(dense, params, x, y, c["tau"])
    elif provider == ROUND_PROVIDERS[2]:
        params = model.subnet_parameters()

        def fn():
            sgd_steps(lambda inp: model(inp, neurons), params, x, y, c["tau"])
    else:
        rnd = model.compact([neurons])
        mod = rnd.modules[0]
        params = list(mod.parameters())

        def fn():
            rnd.refresh()
            sgd_steps(mod, params, x, y, c["tau"])
            rnd.write_back()
    record(benchmark, group=f"one round of tau={c['tau']} local steps of one subnetwork (1/{c['S']} of "
           f"width {c['width']}, depth {c['depth']}, batch {c['batch']})", provider=provider, flops=flops,
           dtype=torch.float32, peaks=peaks)
    run(benchmark, fn, rounds=5 if DEVICE == "cpu" else None)


def compare_round(repeats: int = 4) -> dict:
    """The round providers interleaved, best of ``repeats`` each (steadier than separate runs on a
    shared machine): provider -> (seconds, ratio to the hand-compacted dense MLP)."""
    import time

    model, neurons, x, y, c = round_problem()
    n = [len(i) for i in neurons]
    layers = []
    for a, b in zip([c["in_features"]] + n[:-1], n):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    dense = torch.nn.Sequential(*layers, torch.nn.Linear(n[-1], c["out"])).to(DEVICE)

    def compact():
        with model.compact([neurons]) as rnd:
            sgd_steps(rnd.modules[0], list(rnd.modules[0].parameters()), x, y, c["tau"])

    fns = {ROUND_PROVIDERS[0]: compact,
           ROUND_PROVIDERS[1]: lambda: sgd_steps(dense, list(dense.parameters()), x, y, c["tau"]),
           ROUND_PROVIDERS[2]: lambda: sgd_steps(lambda i: model(i, neurons), model.subnet_parameters(), x, y,
                                                 c["tau"])}
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: (v, v / best[ROUND_PROVIDERS[1]]) for k, v in best.items()}


if __name__ == "__main__":  # python3 bench/bench_subnet.py [threads]: the round comparison alone
    import sys

    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    for name, (sec, ratio) in compare_round().items():
        print(f"{name:60s} {sec * 1e3:9.1f} ms  {ratio:5.2f}x the dense MLP")
