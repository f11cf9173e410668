"""GReLU vs ReLU on the synthetic Ackley regression of paper 004 §6.1, at laptop scale.

    python -m ist_kernels.experiments grelu [--width 512] [--steps 500] [--lr ...] [--out DIR]

Both networks have the same width and depth, the same initial C, W_1..W_L, B (§2.1), and are
trained by full-batch gradient descent with the same constant learning rate on the loss of eq. (2),
ℓ = ½ Σ_i ‖ŷ_i − y_i‖² (§6 calls this sum "MSE"). As in §2.1 only W_1..W_L train, in both networks.
The GReLU network reads its gates from a cache made once (§4.4). The script prints ℓ at several
step counts and the time per iteration of both, and writes ``grelu_vs_relu.png`` and
``results.md`` into ``--out``.
"""
import argparse
import copy
import os
import time

import torch
from torch import nn

from ..train.data import ackley_data  # noqa: F401  (§6.1 data: defined once, in train/data.py)


def relu_twin(grelu) -> nn.Sequential:
    """The ReLU MLP with the GReLU network's C, W_1..W_L, B (same initialisation); C and B frozen."""
    m, d, L, dy = grelu.width, grelu.in_features, grelu.depth, grelu.out_features
    mods = [nn.Linear(d, m, bias=False), nn.ReLU()]
    for _ in range(L):
        mods += [nn.Linear(m, m, bias=False), nn.ReLU()]
    mods.append(nn.Linear(m, dy, bias=False))
    net = nn.Sequential(*mods).to(grelu.C.dtype)
    with torch.no_grad():
        net[0].weight.copy_(grelu.C)
        for k, layer in enumerate(grelu.layers):
            net[2 + 2 * k].weight.copy_(layer.weight)
        net[-1].weight.copy_(grelu.B)
    net[0].weight.requires_grad_(False)
    net[-1].weight.requires_grad_(False)
    return net


def loss_fn(pred, y):
    return 0.5 * (pred - y).pow(2).sum()  # eq. (2)


def train(step_fn, params, lr, steps, bar=None):
    """Full-batch gradient descent with a constant learning rate; returns the loss at steps 0..steps."""
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for t in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = step_fn()
        losses.append(loss.item())
        if t == steps:
            break
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)
    return losses


def time_per_iteration(variants, lr, iters, rounds):
    """Seconds per gradient-descent iteration (forward + backward + update) of each variant
    {name: (step_fn, params)}. The variants are timed in turn, round after round, and each keeps its
    fastest round: on a shared machine that is the least disturbed measurement."""
    opts = {name: torch.optim.SGD(params, lr=lr) for name, (_, params) in variants.items()}
    best = {name: float("inf") for name in variants}
    for r in range(rounds + 1):  # round 0 is a warm-up
        for name, (step_fn, _) in variants.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                opts[name].zero_grad(set_to_none=True)
                step_fn().backward()
                opts[name].step()
            if r > 0:
                best[name] = min(best[name], (time.perf_counter() - t0) / iters)
    return best


def table_steps(steps: int):
    """0, 10, 20, 50, 100, 200, 500, ... and the last step."""
    pts, k = {0, steps}, 10
    while k < steps:
        pts.update(s for s in (k, 2 * k, 5 * k) if s < steps)
        k *= 10
    return sorted(pts)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ist_kernels.experiments grelu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100, help="training examples (§6.1: 100)")
    p.add_argument("--d", type=int, default=200, help="input dimension (§6.1: 200)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers L (§6.1: 4)")
    p.add_argument("--width", type=int, default=512, help="width m (Theorem 1: n²L = 40000; laptop scale here)")
    p.add_argument("--steps", type=int, default=500, help="gradient-descent steps")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.5·d/(L·m²), see below)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=os.path.join("outputs", "grelu"), help="output directory")
    p.add_argument("--quick", action="store_true", help="tiny run for tests (width 64, 40 steps, n 20, d 32)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.d, args.width, args.steps = 20, 32, 64, 40

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tqdm import tqdm

    from ist_kernels.nn import GReLUMLP

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = ackley_data(args.n, args.d, gen)
    x, y = x.to(dtype), y.to(dtype)
    grelu = GReLUMLP(args.d, args.width, args.depth, 1, dtype=dtype, generator=gen)
    relu = relu_twin(grelu)
    # Default learning rate: at the §2.1 initialisation each sample's tangent kernel K(x_i, x_i) is
    # about L·m²/d_x, so 0.5·d_x/(L·m²) is a constant step that both networks take stably here (the
    # theory's η = d_x/(n⁴L³d_y) is far smaller; §6 uses larger practical values).
    lr = args.lr if args.lr is not None else 0.5 * args.d / (args.depth * args.width**2)
    grelu.cache_gates(x)  # §4.4: the gates are computed once and read from the 1-bit table
    index = torch.arange(args.n)

    grelu_params = list(grelu.layers.parameters())
    relu_params = [q for q in relu.parameters() if q.requires_grad]
    grelu_step = lambda: loss_fn(grelu(x, index), y)  # noqa: E731
    relu_step = lambda: loss_fn(relu(x), y)  # noqa: E731

    t_start = time.perf_counter()
    # Copies for timing, made before training (training leaves the timed models' cost unchanged).
    g_probe, r_probe = copy.deepcopy(grelu), copy.deepcopy(relu)
    with tqdm(total=2 * args.steps, desc="GReLU + ReLU gradient descent", unit="step") as bar:
        bar.set_postfix_str("GReLU")
        g_loss = train(grelu_step, grelu_params, lr, args.steps, bar)
        bar.set_postfix_str("ReLU")
        r_loss = train(relu_step, relu_params, lr, args.steps, bar)
    # Time per iteration, including §4.4's point: the same GReLU iteration with its gates recomputed
    # by the frozen network every step.
    times = time_per_iteration({
        "grelu_cached": (lambda: loss_fn(g_probe(x, index), y), list(g_probe.layers.parameters())),
        "grelu_recomputed": (lambda: loss_fn(g_probe(x), y), list(g_probe.layers.parameters())),
        "relu": (lambda: loss_fn(r_probe(x), y), [q for q in r_probe.parameters() if q.requires_grad]),
    }, lr, iters=max(2, min(20, args.steps // 20)), rounds=5)
    g_time, t_uncached, r_time = times["grelu_cached"], times["grelu_recomputed"], times["relu"]
    elapsed = time.perf_counter() - t_start

    os.makedirs(args.out, exist_ok=True)
    lines = [
        "# GReLU vs ReLU, synthetic Ackley regression (paper 004 §6.1)",
        "",
        f"n={args.n}, d={args.d}, depth L={args.depth}, width m={args.width}, out=1, {args.dtype}, "
        f"full-batch GD, lr={lr:.3g}, seed={args.seed}, torch threads={torch.get_num_threads()}",
        "",
        "| step | GReLU loss (eq. 2) | ReLU loss (eq. 2) |",
        "|---:|---:|---:|",
    ]
    for t in table_steps(args.steps):
        lines.append(f"| {t} | {g_loss[t]:.4e} | {r_loss[t]:.4e} |")
    lines += [
        "",
        "| time per iteration (forward + backward + update; fastest of 5 rounds) | ms |",
        "|---|---:|",
        f"| GReLU, cached 1-bit gates (§4.4) | {1e3 * g_time:.2f} |",
        f"| GReLU, gates recomputed by the frozen network every step | {1e3 * t_uncached:.2f} |",
        f"| ReLU | {1e3 * r_time:.2f} |",
        "",
        f"total wall time {elapsed:.1f} s",
    ]
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(g_loss, "-", label=f"GReLU ({1e3 * g_time:.1f} ms/iter)")
    ax.plot(r_loss, "--", label=f"ReLU ({1e3 * r_time:.1f} ms/iter)")
    ax.set_yscale("log")
    ax.set_xlabel("gradient-descent step")
    ax.set_ylabel("training loss ½Σ‖ŷ−y‖² (eq. 2)")
    ax.set_title(f"Ackley regression n={args.n}, d={args.d}, L={args.depth}, m={args.width}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = os.path.join(args.out, "grelu_vs_relu.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"\noutputs: {os.path.abspath(png)}\n         {os.path.abspath(os.path.join(args.out, 'results.md'))}")
    return 0
