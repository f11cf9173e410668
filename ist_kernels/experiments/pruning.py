"""Paper 002 §5.1, Figure 2a/2b: random pruning at initialisation, error against the pruning rate p.

    python -m ist_kernels.experiments pruning [--init-std 0.1] [--sigma-n 0.5,1] [--quick]

The network (§2.1, ReLU as in §5.1): F_j(x) = Σ_r Σ_patches σ(⟨w_{j,r} ⊙ m_{j,r}, x_patch⟩) for the
two classes j, m = 150 filters per class, each weight kept with probability 1 − p by a mask drawn
once at initialisation (``ist_kernels.prune.random_prune_``; p is the fraction removed, as §5.1
uses it), cross-entropy loss averaged over the samples, full-batch GD with lr 0.001 for 1000
iterations, initial weights N(0, σ_0²) with σ_0 = 0.1 (§5.1: "variance 0.01"). Data
(Definition 2.1, binary as in §5.1): x = [y·e_1, ξ], two patches of dimension d = 400,
ξ ~ N(0, σ_n² I), σ_n = 0.5 and 1; 100 training samples. Test error on ``--n-test`` fresh samples
(§5.1: 100; more only sharpens the estimate). Every seed draws its own data, initialisation and
masks (the same data and initialisation for every p of a seed).

Threshold (over-pruning): the smallest p above the rate with the lowest mean test error whose
mean test error exceeds that lowest one by more than ``--margin`` and by more than two standard
errors. Why it falls where it does is measured on the test set after training: the signal margin
(the part of F_y − F_other coming from the signal patch, averaged over the test samples) and the
noise spread (the standard deviation over the test samples of the part coming from the noise
patch), the two quantities of the paper's Figure 1.
``--init-std`` takes a list to compare initial scales (Condition 2.2 (6) asks for a small one).
"""
import argparse
import math
import sys
import time
from typing import Dict, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..partition.neurons import round_generator
from ..prune import random_prune_
from ..train.paper_data import signal_noise
from . import harness as C


def parser() -> argparse.ArgumentParser:
    p = C.parser("pruning", __doc__, seeds=(0, 1, 2, 3, 4), quick="d 40, 8 filters, 20 samples, 20 iterations")
    p.add_argument("--d", type=int, default=400, help="dimension of each patch (paper: 400)")
    p.add_argument("--width", type=int, default=150, help="filters per class m (paper: 150)")
    p.add_argument("--n-train", type=int, default=100, help="training samples (paper: 100)")
    p.add_argument("--n-test", type=int, default=1000, help="test samples (paper: 100)")
    p.add_argument("--sigma-n", type=C.floats, default=[0.5, 1.0], help="noise levels σ_n (paper: 0.5, 1)")
    p.add_argument("--rates", type=C.floats, default=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99],
                   help="pruning rates p, fraction of weights removed (default %(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="GD step size (paper: 0.001)")
    p.add_argument("--iters", type=int, default=1000, help="GD iterations (paper: 1000)")
    p.add_argument("--init-std", type=C.floats, default=[0.1],
                   help="std(s) σ_0 of the initial weights (paper: variance 0.01, σ_0 = 0.1)")
    p.add_argument("--margin", type=float, default=0.05,
                   help="test-error increase over the dense model that counts as over-pruning (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(d=40, width=8, n_train=20, n_test=50, iters=20, sigma_n=lambda v: v[:1],
                                      rates=[0.0, 0.5, 0.9]),
                        ("d", "width", "n_train", "n_test", "iters", "threads"))
    if any(not 0 <= r < 1 for r in args.rates) or 0.0 not in args.rates:
        p.error(f"--rates must lie in [0, 1) and include 0 (the dense model), got {args.rates}")
    args.rates = sorted(set(args.rates))
    if any(s <= 0 for s in args.sigma_n + args.init_std) or not args.lr > 0:
        p.error("--sigma-n, --init-std and --lr must be > 0")
    return args


class TwoLayerCNN(nn.Module):
    """Paper 002 §2.1: F_j(x) = Σ_r Σ_p σ(⟨w_{j,r}, x_p⟩); only the filters w train (a convolution
    with kernel = stride = d, computed as one nn.Linear over the patches)."""

    def __init__(self, d: int, width: int, num_classes: int, init_std: float, generator: torch.Generator):
        super().__init__()
        self.num_classes, self.width = num_classes, width
        self.filters = nn.Linear(d, num_classes * width, bias=False)
        with torch.no_grad():
            self.filters.weight.copy_(torch.randn(self.filters.weight.shape, generator=generator) * init_std)

    def patch_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, d] -> [N, patches, classes]: each patch's contribution to every logit."""
        z = F.relu(self.filters(x))
        return z.view(x.shape[0], x.shape[1], self.num_classes, self.width).sum(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.patch_logits(x).sum(1)


def run_cell(args, cell) -> Dict:
    """One run: cell = (init_std, sigma_n, p, seed) -> errors, the signal margin and noise spread."""
    torch.set_num_threads(args.threads)
    init_std, sigma_n, p, seed = cell
    g = round_generator(seed, 0)  # the same data and initialisation for every p of a seed
    kw = dict(signed=True, swap_patches=False, generator=g)
    x, y = signal_noise(args.n_train, args.d, sigma_n, **kw)
    x_test, y_test = signal_noise(args.n_test, args.d, sigma_n, **kw)
    model = TwoLayerCNN(args.d, args.width, 2, init_std, g)
    random_prune_(model, p, round_generator(seed, 1 + int(round(p * 1e6))))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.iters):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())
        if C.diverged_at(losses) is not None:
            return {"diverged_at": len(losses) - 1, "value": losses[-1]}
        loss.backward()
        opt.step()
    with torch.no_grad():
        train_err = (model(x).argmax(1) != y).double().mean().item()
        parts = model.patch_logits(x_test)  # [N, 2 patches (signal, noise), 2 classes]
        other = 1 - y_test
        idx = torch.arange(len(y_test))
        margin = parts[idx, :, y_test] - parts[idx, :, other]  # [N, patches]: F_y − F_other by patch
        test_err = ((parts.sum(1).argmax(1)) != y_test).double().mean().item()
    return {"diverged_at": -1, "train_error": train_err, "test_error": test_err, "train_loss": losses[-1],
            "signal_margin": margin[:, 0].mean().item(), "noise_spread": margin[:, 1].std().item()}


def threshold(args, summary, init_std, sigma_n, best):
    """Over-pruning: the smallest p above the best rate whose mean test error exceeds the best
    one's by more than ``margin`` and by more than 2 standard errors (None: no such p)."""
    low = summary[(init_std, sigma_n, best)]["test_error"]
    for p in (p for p in args.rates if p > best):
        s = summary[(init_std, sigma_n, p)]["test_error"]
        if s["mean"] is not None and low["mean"] is not None and s["mean"] > low["mean"] + args.margin \
                and C.significant(low, s):
            return p
    return None


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    cells = [(i, s, p, sd) for i in args.init_std for s in args.sigma_n for p in args.rates for sd in args.seeds]
    res = C.run_grid(run_cell, args, cells, "pruning: GD runs", args.jobs)
    divergences = [C.divergence(f"init std {c[0]:g}, σ_n={c[1]:g}, p={c[2]:g}", c[3], args.lr, r["diverged_at"],
                                r["value"]) for c, r in res.items() if r["diverged_at"] >= 0]
    keys = ("train_error", "test_error", "signal_margin", "noise_spread")
    summary = {(i, s, p): {k: C.stats(res[(i, s, p, sd)].get(k) for sd in args.seeds) for k in keys}
               for i in args.init_std for s in args.sigma_n for p in args.rates}
    best = {(i, s): min(args.rates, key=lambda p: summary[(i, s, p)]["test_error"]["mean"]
                        if summary[(i, s, p)]["test_error"]["mean"] is not None else math.inf)
            for i in args.init_std for s in args.sigma_n}
    thresholds = {(i, s): threshold(args, summary, i, s, best[(i, s)]) for i in args.init_std for s in args.sigma_n}

    lines = ["# Random pruning at initialisation (paper 002 §5.1, Figure 2a/2b)", "",
             f"d={args.d} per patch, m={args.width} filters per class, n={args.n_train} train / {args.n_test} "
             f"test, lr={args.lr}, {args.iters} GD iterations; classification error, mean ± std over seeds "
             f"{args.seeds}; p = fraction of weights removed", ""]
    for i in args.init_std:
        cols = " | ".join(f"train σ_n={s:g} | test σ_n={s:g}" for s in args.sigma_n)
        lines += [f"**initial std σ_0 = {i:g}**", "", f"| p | {cols} |", "|---|" + "---|" * (2 * len(args.sigma_n))]
        for p in args.rates:
            row = []
            for s in args.sigma_n:
                row += [C.fmt(summary[(i, s, p)]["train_error"]), C.fmt(summary[(i, s, p)]["test_error"])]
            lines.append(f"| {p:g} | " + " | ".join(row) + " |")
        lines.append("")
        for s in args.sigma_n:
            t = thresholds[(i, s)]
            lines.append(f"- σ_n={s:g}: lowest mean test error at p = {best[(i, s)]:g}; over-pruning (test error "
                         f"> that lowest + {args.margin:g}, > 2 SE) from p = " + ("none in the grid" if t is None else f"{t:g}"))
        lines += ["", f"Signal margin / noise spread on the test set (σ_0 = {i:g}; test error ≈ P(noise < "
                      "−margin): the ratio sets it)", "",
                  "| p | " + " | ".join(f"σ_n={s:g}: margin | spread | ratio" for s in args.sigma_n) + " |",
                  "|---|" + "---|" * (3 * len(args.sigma_n))]
        for p in args.rates:
            row = []
            for s in args.sigma_n:
                m, n = summary[(i, s, p)]["signal_margin"], summary[(i, s, p)]["noise_spread"]
                ratio = m["mean"] / n["mean"] if m["mean"] is not None and n["mean"] else None
                row += [C.fmt(m), C.fmt(n), "—" if ratio is None else f"{ratio:.3g}"]
            lines.append(f"| {p:g} | " + " | ".join(row) + " |")
        lines.append("")
    signal = ", ".join(f"p={p:g}: {args.width * (1 - p):.3g}" for p in args.rates)
    lines += [f"Where the threshold falls: a filter sees the signal coordinate e_1 only if its mask keeps that "
              f"entry, so m(1 − p) filters per class keep the signal ({signal}); Theorem 3.1's mild-pruning range, "
              f"kept fraction 1 − p ≥ C log d / m, ends at p = 1 − C·{math.log(args.d) / args.width:.3f} for d={args.d}, "
              f"m={args.width}. Pruning shrinks the noise spread as √(1 − p) while the margin holds until few "
              "filters keep the signal.", ""]
    lines += C.divergence_lines(divergences)

    fig, axes = C.figure(len(args.init_std) + 1, 1, size=(4.6, 3.6))
    pos = list(range(len(args.rates)))  # evenly spaced: the interesting rates crowd near 1
    for ax, i in zip(axes, args.init_std):
        for c, s in enumerate(args.sigma_n):
            for key, style in (("train_error", "--"), ("test_error", "-")):
                runs = [[res[(i, s, p, sd)].get(key) for p in args.rates] for sd in args.seeds]
                C.band(ax, pos, runs, f"{key.split('_')[0]}, σ_n={s:g}", linestyle=style, marker="o",
                       markersize=3, color=f"C{c}")
        ax.set_xticks(pos, [f"{p:g}" for p in args.rates], fontsize=7)
        ax.set_xlabel("pruning rate p (fraction removed)")
        ax.set_ylabel("classification error")
        ax.set_title(f"σ_0 = {i:g}: mean ± std, {len(args.seeds)} seeds", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    ax = axes[-1]
    for c, (i, s) in enumerate((i, s) for i in args.init_std for s in args.sigma_n):
        runs = [[(res[(i, s, p, sd)]["signal_margin"] / res[(i, s, p, sd)]["noise_spread"])
                 if res[(i, s, p, sd)]["diverged_at"] < 0 and res[(i, s, p, sd)]["noise_spread"] > 0 else None
                 for p in args.rates] for sd in args.seeds]
        C.band(ax, pos, runs, f"σ_0={i:g}, σ_n={s:g}", marker="o", markersize=3, color=f"C{c}")
    ax.set_xticks(pos, [f"{p:g}" for p in args.rates], fontsize=7)
    ax.set_xlabel("pruning rate p")
    ax.set_ylabel("signal margin / noise spread (test)")
    ax.set_title("what sets the test error", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)

    results = {"rates": args.rates, "sigma_n": args.sigma_n, "init_std": args.init_std,
               "summary": [{"init_std": i, "sigma_n": s, "p": p, **summary[(i, s, p)]} for (i, s, p) in summary],
               "threshold": [{"init_std": i, "sigma_n": s, "p": thresholds[(i, s)], "best_p": best[(i, s)]}
                             for (i, s) in thresholds],
               "runs": [{"init_std": c[0], "sigma_n": c[1], "p": c[2], "seed": c[3], **r} for c, r in res.items()],
               "divergences": divergences}
    C.write_outputs(args, "pruning", results, "\n".join(lines), fig, started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
