"""Paper 002 §5.1 at small scale: a two-layer CNN pruned at initialisation at rate p (fraction of
weights removed, mask fixed through training), trained by full-batch gradient descent on the
synthetic signal + noise data (Definition 2.1, binary as in §5.1: x = [y·e_1, ξ], two patches of
dimension d = 400, ξ ~ N(0, σ_n² I)); training and test error against the pruning rate.

The network (§2.1, ReLU as in §5.1): F_j(x) = Σ_r Σ_patches σ(⟨w_{j,r} ⊙ m_{j,r}, x_patch⟩) for the
two classes j, m = 150 filters per class, cross-entropy loss, lr 0.001, 1000 iterations, 100
training samples. Initial weights N(0, σ_0²) with σ_0 = 0.01: §5.1 says variance 0.01 (σ_0 = 0.1),
but with σ_0 = 0.1 the random projection of a test point's noise patch onto the initial filters
(σ_0 √d σ_n ≈ 1 per filter) dominates the logits and even the dense model is near chance (test
error 0.42 at σ_n = 0.5 in our runs); the small σ_0 of Condition 2.2 (6) gives the regime §5.1
describes. Filters applied to each patch are a convolution with kernel =
stride = d, computed as one nn.Linear over the patches and pruned by ist_kernels.prune.random_prune_.

    python -m ist_kernels.experiments pruning [--quick] [--out DIR]

Writes DIR/pruning.png and DIR/pruning.md and prints the table.
"""
import argparse
import os
import sys
import time
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._common import run_grid

Cell = Tuple[float, float, int]  # (sigma_n, p, run)


def _floats(s: str) -> List[float]:
    return [float(v) for v in s.split(",") if v]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ist_kernels.experiments pruning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=400, help="dimension of each patch (paper: 400)")
    p.add_argument("--width", type=int, default=150, help="filters per class m (paper: 150)")
    p.add_argument("--n-train", type=int, default=100, help="training samples (paper: 100)")
    p.add_argument("--n-test", type=int, default=1000,
                   help="test samples (paper: 100; more only sharpens the estimate)")
    p.add_argument("--sigma-n", type=_floats, default=[0.5, 1.0], help="noise levels σ_n (paper: 0.5, 1)")
    p.add_argument("--rates", type=_floats, default=[0.0, 0.3, 0.5, 0.7, 0.9, 0.97, 0.99, 0.995],
                   help="pruning rates p (fraction of weights removed)")
    p.add_argument("--runs", type=int, default=3, help="independent runs per point (paper: 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="GD step size (paper: 0.001)")
    p.add_argument("--iters", type=int, default=1000, help="GD iterations (paper: 1000)")
    p.add_argument("--init-std", type=float, default=0.01,
                   help="std σ_0 of the initial weights (paper: 'variance 0.01'; see the module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--out", default=os.path.join("outputs", "experiments", "pruning"))
    p.add_argument("--quick", action="store_true", help="tiny run for tests")
    args = p.parse_args(list(argv))
    if args.quick:
        args.d, args.width, args.n_train, args.n_test, args.iters = 40, 8, 20, 50, 20
        args.sigma_n, args.rates, args.runs, args.jobs = [0.5], [0.0, 0.5], 1, 1
    return args


class TwoLayerCNN(nn.Module):
    """Paper 002 §2.1: F_j(x) = Σ_r Σ_p σ(⟨w_{j,r}, x_p⟩); only the filters w train."""

    def __init__(self, d: int, width: int, num_classes: int, init_std: float, generator: torch.Generator):
        super().__init__()
        self.num_classes, self.width = num_classes, width
        self.filters = nn.Linear(d, num_classes * width, bias=False)
        with torch.no_grad():
            self.filters.weight.copy_(torch.randn(self.filters.weight.shape, generator=generator) * init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [N, patches, d] -> logits [N, K]
        z = F.relu(self.filters(x))  # the same filters on every patch: a convolution, stride d
        return z.view(x.shape[0], x.shape[1], self.num_classes, self.width).sum((1, 3))


def run_cell(args: argparse.Namespace, cell: Cell) -> Tuple[float, float]:
    """(training error, test error) of one run: fresh data, initialisation and mask."""
    from ..prune import random_prune_
    from ..partition.neurons import round_generator
    from ..train.data import signal_noise

    torch.set_num_threads(1)
    sigma_n, p, run = cell
    g = round_generator(args.seed, run)  # the same data and initialisation for every p of a run
    kw = dict(signed=True, swap_patches=False, generator=g)
    x, y = signal_noise(args.n_train, args.d, sigma_n, **kw)
    x_test, y_test = signal_noise(args.n_test, args.d, sigma_n, **kw)
    model = TwoLayerCNN(args.d, args.width, 2, args.init_std, g)
    random_prune_(model, p, round_generator(args.seed + 1, run * 1000 + int(p * 1000)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(args.iters):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        train_err = (model(x).argmax(1) != y).double().mean().item()
        test_err = (model(x_test).argmax(1) != y_test).double().mean().item()
    return train_err, test_err


def _stats(values: List[float]) -> Tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), (t.std().item() if len(values) > 1 else 0.0)


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    cells = [(s, p, r) for s in args.sigma_n for p in args.rates for r in range(args.runs)]
    t0 = time.time()
    res = run_grid(run_cell, args, cells, "pruning", args.jobs)
    elapsed = time.time() - t0

    summary = {}  # (sigma_n, p) -> ((train mean, std), (test mean, std))
    for s in args.sigma_n:
        for p in args.rates:
            runs = [res[(s, p, r)] for r in range(args.runs)]
            summary[(s, p)] = (_stats([a for a, _ in runs]), _stats([b for _, b in runs]))
    cols = " | ".join(f"train σ_n={s:g} | test σ_n={s:g}" for s in args.sigma_n)
    lines = [f"**Random pruning at initialisation (paper 002 §5.1): classification error, mean ± std over "
             f"{args.runs} runs** (d={args.d} per patch, m={args.width} filters per class, n={args.n_train} "
             f"train / {args.n_test} test, lr={args.lr}, {args.iters} GD iterations, init std {args.init_std})",
             "", f"| pruning rate p | {cols} |", "|---|" + "---|" * (2 * len(args.sigma_n))]
    for p in args.rates:
        row = []
        for s in args.sigma_n:
            (tr, trs), (te, tes) = summary[(s, p)]
            row += [f"{tr:.3f} ± {trs:.3f}", f"{te:.3f} ± {tes:.3f}"]
        lines.append(f"| {p:g} | " + " | ".join(row) + " |")
    best = {s: min(args.rates, key=lambda p: summary[(s, p)][1][0]) for s in args.sigma_n}
    lines += ["", "Lowest test error at p = " + ", ".join(f"{best[s]:g} (σ_n={s:g})" for s in args.sigma_n),
              f"({len(cells)} runs in {elapsed:.0f} s)"]
    report = "\n".join(lines)
    with open(os.path.join(args.out, "pruning.md"), "w") as f:
        f.write(report + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    pos = list(range(len(args.rates)))  # evenly spaced: the interesting rates crowd near 1
    for c, s in enumerate(args.sigma_n):
        for k, (label, style) in enumerate([("train", "--"), ("test", "-")]):
            mean = [summary[(s, p)][k][0] for p in args.rates]
            std = [summary[(s, p)][k][1] for p in args.rates]
            ax.errorbar(pos, mean, yerr=std, linestyle=style, marker="o", capsize=3, color=f"C{c}",
                        label=f"{label}, σ_n={s:g}")
    ax.set_xticks(pos, [f"{p:g}" for p in args.rates])
    ax.set_xlabel("pruning rate p (fraction of weights removed)")
    ax.set_ylabel("classification error")
    ax.set_title("Random pruning at initialisation (paper 002 §5.1)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "pruning.png"), dpi=120)
    plt.close(fig)
    print(report)
    print(f"wrote {os.path.join(args.out, 'pruning.png')} and pruning.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
