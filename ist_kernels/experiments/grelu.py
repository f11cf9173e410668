"""Paper 004 §6.1: GReLU vs ReLU on the Ackley regression, training loss over seeds and time per iteration.

    python -m ist_kernels.experiments grelu [--width 512] [--steps 500] [--lr ...] [--seeds 0,1,2]

Both networks have the same width and depth and the same initial C, W_1..W_L, B (§2.1) and are
trained by full-batch gradient descent with the same constant learning rate on the loss of eq. (2),
ℓ = ½ Σ_i ‖ŷ_i − y_i‖² (§6 calls this sum "MSE"). As in §2.1 only W_1..W_L train, in both networks;
the GReLU network reads its gates from a cache made once (§4.4). Every seed draws its own data and
initialisation. A run whose loss becomes non-finite or grows past 1e6 times its initial value is
reported as diverged, with its learning rate (it is left out of the means).

Default learning rate: 0.25·d/(L·m²). At the §2.1 initialisation each sample's tangent kernel
K(x_i, x_i) is about L·m²/d, so this is a constant step both networks take stably on seeds 0-9 at
the default size (0.5·d/(L·m²) sent ReLU to NaN on seed 2); the theory's η = d/(n⁴L³d_y) is far
smaller, §6 uses larger practical values. ``--lr`` takes a list to compare several.

Timing is a benchmark: the three variants (GReLU with cached gates, GReLU recomputing its gates
every step, ReLU) are timed in interleaved repeats (a fresh random order each repeat, after a
warm-up), each repeat ``--timing-iters`` iterations of forward + backward + update; the table gives
the median and the minimum over the repeats, with the median's ratio to ReLU.
"""
import argparse
import copy
import random
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..nn import GReLUMLP
from ..train.paper_data import ackley_data  # noqa: F401  (§6.1 data: defined once, in train/paper_data.py)
from . import harness as C


def parser() -> argparse.ArgumentParser:
    p = C.parser("grelu", __doc__, quick="n 20, d 32, width 64, 40 steps, 2 seeds")
    p.add_argument("--n", type=int, default=100, help="training examples (§6.1: 100)")
    p.add_argument("--d", type=int, default=200, help="input dimension (§6.1: 200)")
    p.add_argument("--depth", type=int, default=4, help="hidden layers L (§6.1: 4)")
    p.add_argument("--width", type=int, default=512, help="width m (Theorem 1 asks n²L = 40000; laptop scale here)")
    p.add_argument("--steps", type=int, default=500, help="gradient-descent steps")
    p.add_argument("--lr", type=C.floats, default=None, metavar="LR[,LR...]",
                   help="learning rate(s) (default 0.25·d/(L·m²), see above)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run and for timing (default 1)")
    p.add_argument("--timing-repeats", type=int, default=15, help="interleaved timing repeats (default 15)")
    p.add_argument("--timing-iters", type=int, default=10, help="iterations per timing repeat (default 10)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(n=20, d=32, width=64, steps=40, timing_repeats=5, timing_iters=3),
                        ("n", "d", "depth", "width", "steps", "threads", "timing_repeats", "timing_iters"))
    if args.lr is None:
        args.lr = [default_lr(args)]
    if any(not lr > 0 for lr in args.lr):
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def default_lr(args) -> float:
    return 0.25 * args.d / (args.depth * args.width ** 2)


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


def train(step_fn, params, lr: float, steps: int) -> Tuple[List[float], int, Optional[float]]:
    """Full-batch gradient descent with a constant learning rate. Returns the loss at steps
    0..steps (NaN from the step it diverged at), that step (-1: it did not) and the loss there."""
    opt = torch.optim.SGD(params, lr=lr)
    losses: List[float] = []
    for t in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = step_fn()
        losses.append(loss.item())
        if C.diverged_at(losses) is not None:
            return losses[:t] + [float("nan")] * (steps + 1 - t), t, losses[t]
        if t == steps:
            break
        loss.backward()
        opt.step()
    return losses, -1, None


def build(args, seed: int):
    """(data, GReLU net with cached gates, its ReLU twin) of one seed."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(seed)
    x, y = ackley_data(args.n, args.d, gen)
    x, y = x.to(dtype), y.to(dtype)
    grelu = GReLUMLP(args.d, args.width, args.depth, 1, dtype=dtype, generator=gen)
    relu = relu_twin(grelu)
    grelu.cache_gates(x)  # §4.4: the gates are computed once and read from the 1-bit table
    return x, y, grelu, relu


def variants(x, y, grelu, relu) -> Dict[str, Tuple]:
    """name -> (step function returning the loss, trained parameters)."""
    index = torch.arange(x.shape[0])
    g_params = list(grelu.layers.parameters())
    return {
        "grelu_cached": (lambda: loss_fn(grelu(x, index), y), g_params),
        "grelu_recomputed": (lambda: loss_fn(grelu(x), y), g_params),
        "relu": (lambda: loss_fn(relu(x), y), [q for q in relu.parameters() if q.requires_grad]),
    }


def run_cell(args, cell) -> Dict:
    """Train GReLU and ReLU from the same initialisation: (seed, lr) -> losses and divergences."""
    seed, lr = cell
    torch.set_num_threads(args.threads)
    x, y, grelu, relu = build(args, seed)
    v = variants(x, y, grelu, relu)
    out = {}
    for name, key in (("GReLU", "grelu_cached"), ("ReLU", "relu")):
        losses, at, value = train(*v[key], lr, args.steps)
        out[name] = {"losses": losses, "diverged_at": at, "value": value}
    return out


def time_per_iteration(args) -> Dict[str, List[float]]:
    """Seconds per iteration of each variant, one entry per interleaved repeat (models of the
    first seed; a warm-up repeat first; a fresh random order each repeat)."""
    torch.set_num_threads(args.threads)
    x, y, grelu, relu = build(args, args.seeds[0])
    grelu, relu = copy.deepcopy(grelu), copy.deepcopy(relu)
    v = variants(x, y, grelu, relu)
    lr = min(args.lr)
    opts = {name: torch.optim.SGD(params, lr=lr) for name, (_, params) in v.items()}
    times: Dict[str, List[float]] = {name: [] for name in v}
    order = list(v)
    rng = random.Random(0)
    for r in range(args.timing_repeats + 1):  # repeat 0 is the warm-up
        rng.shuffle(order)
        for name in order:
            step_fn, _ = v[name]
            t0 = time.perf_counter()
            for _ in range(args.timing_iters):
                opts[name].zero_grad(set_to_none=True)
                step_fn().backward()
                opts[name].step()
            if r > 0:
                times[name].append((time.perf_counter() - t0) / args.timing_iters)
    return times


TARGET = 1e-6  # steps_to: the loss this fraction of the initial one (far above float32 round-off)


def steps_to(losses: Sequence[float], fraction: float) -> Optional[int]:
    """The first step whose loss is at most ``fraction`` of the initial loss (None: never)."""
    for t, v in enumerate(losses):
        if v == v and v <= fraction * losses[0]:
            return t
    return None


def table_steps(steps: int) -> List[int]:
    """0, 10, 20, 50, 100, 200, 500, ... and the last step."""
    pts, k = {0, steps}, 10
    while k < steps:
        pts.update(s for s in (k, 2 * k, 5 * k) if s < steps)
        k *= 10
    return sorted(pts)


LABELS = {"grelu_cached": "GReLU, cached 1-bit gates (§4.4)",
          "grelu_recomputed": "GReLU, gates recomputed by the frozen network every step", "relu": "ReLU"}


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    cells = [(s, lr) for lr in args.lr for s in args.seeds]
    res = C.run_grid(run_cell, args, cells, "grelu: GReLU + ReLU gradient descent", args.jobs)
    print("timing ...", file=sys.stderr)
    times = time_per_iteration(args)

    divergences, runs, finals = [], {}, {}
    for (seed, lr), r in res.items():
        for net in ("GReLU", "ReLU"):
            at = r[net]["diverged_at"]
            if at >= 0:
                divergences.append(C.divergence(net, seed, lr, at, r[net]["value"]))
            runs.setdefault((net, lr), []).append(r[net]["losses"])
    steps = table_steps(args.steps)
    lines = ["# GReLU vs ReLU, synthetic Ackley regression (paper 004 §6.1)", "",
             f"n={args.n}, d={args.d}, depth L={args.depth}, width m={args.width}, out=1, {args.dtype}, "
             f"full-batch GD for {args.steps} steps, torch threads={args.threads}; training loss ½Σ‖ŷ−y‖² "
             f"(eq. 2), mean ± std over seeds {args.seeds}", ""]
    claim = []
    for lr in args.lr:
        lines += [f"**lr = {lr:.4g}**", "", "| step | GReLU loss | ReLU loss |", "|---:|---:|---:|"]
        for t in steps:
            g = C.stats(run[t] for run in runs[("GReLU", lr)])
            r = C.stats(run[t] for run in runs[("ReLU", lr)])
            lines.append(f"| {t} | {C.fmt(g)} | {C.fmt(r)} |")
        both = [(res[(s, lr)]["GReLU"]["losses"][-1], res[(s, lr)]["ReLU"]["losses"][-1]) for s in args.seeds]
        finite = [(g, r) for g, r in both if g == g and r == r]
        lower = sum(g < r for g, r in finite)
        reach = {net: C.stats(steps_to(res[(s, lr)][net]["losses"], TARGET) for s in args.seeds)
                 for net in ("GReLU", "ReLU")}
        claim.append({"lr": lr, "grelu_lower": lower, "both_finite": len(finite), "seeds": len(both),
                      "steps_to_target": reach, "target": TARGET})
        finals[str(lr)] = {"GReLU": C.stats(g for g, _ in both), "ReLU": C.stats(r for _, r in both)}
        lines += ["", f"GReLU ends lower than ReLU on {lower}/{len(finite)} seeds where both stayed finite "
                      f"({len(both) - len(finite)} seed(s) with a diverged run). Steps to a loss of {TARGET:g} x "
                      f"the initial one: GReLU {C.fmt(reach['GReLU'])}, ReLU {C.fmt(reach['ReLU'])} "
                      "(a run that never gets there is counted under div.).", ""]
    lines += C.divergence_lines(divergences)
    tstats = {name: {"median_s": statistics.median(t), "min_s": min(t), "repeats": t} for name, t in times.items()}
    relu_med = tstats["relu"]["median_s"]
    lines += ["", f"**Time per iteration** (forward + backward + update; {args.timing_repeats} interleaved "
                  f"repeats of {args.timing_iters} iterations in random order after a warm-up; seed "
                  f"{args.seeds[0]}'s models)", "",
              "| variant | median ms | min ms | median ÷ ReLU median |", "|---|---:|---:|---:|"]
    for name, s in tstats.items():
        lines.append(f"| {LABELS[name]} | {1e3 * s['median_s']:.3f} | {1e3 * s['min_s']:.3f} | "
                     f"{s['median_s'] / relu_med:.2f} |")

    fig, (ax, axt) = C.figure(2, 1, size=(5.2, 3.8))
    for k, lr in enumerate(args.lr):
        for net, style in (("GReLU", "-"), ("ReLU", "--")):
            C.band(ax, range(args.steps + 1), runs[(net, lr)], f"{net}, lr {lr:.3g}", log=True,
                   linestyle=style, color=f"C{2 * k + (net == 'ReLU')}")
    ax.set_yscale("log")
    ax.set_xlabel("gradient-descent step")
    ax.set_ylabel("training loss ½Σ‖ŷ−y‖² (eq. 2)")
    ax.set_title(f"Ackley n={args.n}, d={args.d}, L={args.depth}, m={args.width}: mean ± std, "
                 f"{len(args.seeds)} seeds", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    names = list(tstats)
    for i, name in enumerate(names):
        t = [1e3 * v for v in tstats[name]["repeats"]]
        axt.plot([i] * len(t), t, "o", alpha=0.4, color=f"C{i}")
        axt.plot([i - 0.25, i + 0.25], [1e3 * tstats[name]["median_s"]] * 2, "k-")
    axt.set_xticks(range(len(names)), ["GReLU cached", "GReLU recomp.", "ReLU"], fontsize=8)
    axt.set_ylabel("ms per iteration (each repeat; bar: median)")
    axt.set_title("interleaved timing repeats", fontsize=8)
    axt.grid(True, alpha=0.3)
    results = {"lrs": args.lr, "default_lr": default_lr(args), "steps": list(range(args.steps + 1)),
               "runs": [{"seed": s, "lr": lr, **res[(s, lr)]} for (s, lr) in cells],
               "final": finals, "claim": claim, "timing": tstats, "divergences": divergences}
    C.write_outputs(args, "grelu", results, "\n".join(lines), fig, started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
