"""Paper 000 Figures 1 and 4: filter distance of the pruned-filter sets over rounds, LOFT vs dense.

    python -m ist_kernels.experiments loft [--datasets digits,synthetic_cifar10] [--data-path CIFAR_DIR]

For every data set and seed, two pre-trainings start from the same initial model, the same S
shards and the same batches (the trainer's ``--simulate S`` path): LOFT (every round a fresh
filter partition, §4 Algorithm 1; no pruning inside the run) and dense local SGD (every worker
trains the whole model, then the models are averaged). After every ``--snapshot-every`` rounds the
L2 norms of the filters of every prunable conv (the filter conv of each partitioned block, the
layers LOFT prunes, §6) are recorded. The filter distance (§3.1, ``ist_kernels.metrics``) compares
the top-l lists of two rankings, l = the filters that pruning at ``--prune-ratio`` keeps: it is 0 when
the same filters survive pruning in the same order.

Reported, per layer, mean ± std over seeds:
- Figure 1: pairwise distances between the snapshots of one run (heatmaps of the first seed);
- Figure 4: distance from every snapshot to the run's final one, and the round from which it
  stays below a tenth of the chance level (the ranking has settled: does LOFT settle early, and
  faster than dense pre-training?);
- LOFT vs dense: distance between the two runs' snapshots at the same round (do they pick the
  same ticket?), against the chance level (the mean distance between two independent random
  rankings of that many filters) and the test accuracy of both.

Data sets: ``digits`` (8x8, saturates near 98-99%) and ``synthetic_cifar10`` (CIFAR-shaped,
harder; ``--dataset-size`` training images); with ``--data-path`` (a CIFAR-10 python-pickle
folder) ``synthetic_cifar10`` is replaced by the real ``cifar10``.
"""
import argparse
import sys
import time
from typing import Dict, Sequence

import torch

from ..metrics import filter_distance
from ..prune import filters_to_keep
from ..train.config import TrainConfig
from ..train.datasets import DATASETS, ShardedData, augment_default, load_dataset
from ..train.methods import get_method
from ..train.runner import RunContext, World, evaluate
from . import harness as C


def parser() -> argparse.ArgumentParser:
    p = C.parser("loft", __doc__, quick="width 4, 3 rounds of 2 steps, 600 synthetic images, 2 seeds")
    p.add_argument("--datasets", type=C.names, default=["digits", "synthetic_cifar10"],
                   help="data sets from the trainer's registry (default digits,synthetic_cifar10)")
    p.add_argument("--data-path", default=None,
                   help="CIFAR-10 python-pickle folder: run cifar10 in place of synthetic_cifar10")
    p.add_argument("--dataset-size", type=int, default=5000,
                   help="training images of generated data sets (default %(default)s)")
    p.add_argument("--model", default="preact_resnet18", help="CNN (default %(default)s)")
    p.add_argument("--width", type=int, default=16, help="first-stage channels (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="S, subnetworks / local-SGD workers (default 2)")
    p.add_argument("--rounds", type=int, default=30, help="pre-training rounds (default %(default)s)")
    p.add_argument("--local-steps", type=int, default=8, help="local SGD steps per round (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per worker (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.05, help="base learning rate, cosine schedule (default %(default)s)")
    p.add_argument("--prune-ratio", type=float, default=0.5,
                   help="fraction of filters pruning removes; the distance compares the kept lists (default 0.5)")
    p.add_argument("--snapshot-every", type=int, default=1, help="rounds between filter snapshots (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(width=4, rounds=3, local_steps=2, dataset_size=600, batch_size=16),
                        ("dataset_size", "width", "workers", "rounds", "local_steps", "batch_size",
                         "snapshot_every", "threads"))
    if not 0 <= args.prune_ratio < 1 or not args.lr > 0:
        p.error("--prune-ratio must be in [0, 1) and --lr > 0")
    if args.data_path:
        args.datasets = ["cifar10" if d == "synthetic_cifar10" else d for d in args.datasets]
    return args


def config(args, dataset: str, method: str, seed: int):
    """The trainer config of one pre-training run (validated: unknown data sets or models fail here)."""
    values = dict(method=method, model=args.model, width=args.width, dataset=dataset, data_path=args.data_path,
                  simulate=args.workers, rounds=args.rounds, local_steps=args.local_steps,
                  batch_size=args.batch_size, lr=args.lr, lr_schedule="cosine", seed=seed, device="cpu",
                  threads=args.threads, prune_ratio=args.prune_ratio, progress=False, plots=False,
                  options={"pretrain_fraction": 1.0} if method == "loft" else {})
    spec = DATASETS.get(dataset)
    if spec is not None and getattr(spec, "sized", False):  # generated data sets take a size
        values["dataset_size"] = args.dataset_size
    return TrainConfig.from_dict(values, "the loft experiment").validate()


def filter_norms(model, layers: Sequence[str]) -> Dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: state[k + ".weight"].detach().flatten(1).double().norm(dim=1).cpu() for k in layers}


def pretrain(args, cfg, dataset) -> Dict:
    """One pre-training run: filter-norm snapshots of the prunable convs after rounds 0, e, 2e, ...
    and the last, the test accuracy before and after training, or where it diverged."""
    torch.set_num_threads(args.threads)
    data = ShardedData(dataset, cfg.num_workers, cfg.batch_size, cfg.seed, "cpu", augment_default(cfg))
    ctx = RunContext(cfg, World(simulated=True), data, cfg.rounds)
    method = get_method(cfg.method)(ctx)
    layers = sorted(filters_to_keep(method.global_model(), args.prune_ratio))
    rounds, norms, accuracy, losses = [0], [filter_norms(method.global_model(), layers)], [], []
    accuracy.append(evaluate(ctx, method.global_model())["accuracy"])
    for r in range(cfg.rounds):
        res = method.run_round(r)
        losses.append(res.loss_sum / max(res.steps, 1))
        if C.diverged_at(losses) is not None:
            return {"layers": layers, "diverged_at": r + 1, "value": losses[-1]}
        if (r + 1) % args.snapshot_every == 0 or r + 1 == cfg.rounds:
            rounds.append(r + 1)
            norms.append(filter_norms(method.global_model(), layers))
    accuracy.append(evaluate(ctx, method.global_model())["accuracy"])
    return {"layers": layers, "diverged_at": -1, "rounds": rounds, "norms": norms, "accuracy": accuracy,
            "train_loss": losses}


def chance_distance(num_filters: int, keep: float, samples: int = 2000) -> float:
    """Mean filter distance between two independent uniformly random rankings (fixed generator)."""
    g = torch.Generator().manual_seed(0)
    return sum(filter_distance(torch.rand(num_filters, generator=g, dtype=torch.float64),
                               torch.rand(num_filters, generator=g, dtype=torch.float64), keep)
               for _ in range(samples)) / samples


SETTLED = 0.1  # a ranking has settled once its distance to the final one stays below this x chance


def settle(curve: Sequence[float], rounds: Sequence[int], level: float):
    """The first round from which the distance to the final ranking stays <= ``level``."""
    for i in range(len(curve)):
        if all(v <= level for v in curve[i:]):
            return rounds[i]
    return rounds[-1]


def run_cell(args, cell) -> Dict:
    """(data set, seed) -> both pre-trainings and their filter distances."""
    dataset_name, seed = cell
    cfgs = {m: config(args, dataset_name, m, seed) for m in ("loft", "localsgd")}
    dataset = load_dataset(cfgs["loft"])
    runs = {m: pretrain(args, cfg, dataset) for m, cfg in cfgs.items()}
    keep = 1.0 - args.prune_ratio
    out = {"runs": {m: {k: v for k, v in r.items() if k != "norms"} for m, r in runs.items()}}
    if any(r["diverged_at"] >= 0 for r in runs.values()):
        return out
    layers, T = runs["loft"]["layers"], len(runs["loft"]["rounds"])

    def dist(a, b, k):
        return filter_distance(a[k], b[k], keep)

    for m, r in runs.items():
        n = r["norms"]
        out[m] = {"pairwise": {k: [[dist(n[i], n[j], k) for j in range(T)] for i in range(T)] for k in layers},
                  "to_final": {k: [dist(n[i], n[-1], k) for i in range(T)] for k in layers}}
    out["loft_vs_dense"] = {k: [dist(runs["loft"]["norms"][i], runs["localsgd"]["norms"][i], k) for i in range(T)]
                            for k in layers}
    out["filters"] = {k: len(runs["loft"]["norms"][0][k]) for k in layers}
    return out


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    for d in args.datasets:  # fail before any work on a bad data set / model name
        config(args, d, "loft", args.seeds[0])
    cells = [(d, s) for d in args.datasets for s in args.seeds]
    res = C.run_grid(run_cell, args, cells, "loft: LOFT + local SGD pre-training", args.jobs)
    divergences = [C.divergence(f"{m} on {c[0]}", c[1], args.lr, r["diverged_at"], r.get("value"))
                   for c, out in res.items() for m, r in out["runs"].items() if r["diverged_at"] >= 0]
    keep = 1.0 - args.prune_ratio
    lines = ["# Filter distance of the pruned-filter sets, LOFT vs dense pre-training (paper 000 Figures 1, 4)", "",
             f"{args.model} width {args.width}, S={args.workers}, {args.rounds} rounds of {args.local_steps} local "
             f"steps, batch {args.batch_size}, lr {args.lr} (cosine); distances compare the kept top "
             f"{keep:g} of each prunable conv's filters (§3.1, not normalised); mean ± std over seeds", ""]
    summary, figs = {}, []
    for d in args.datasets:
        ok = [res[(d, s)] for s in args.seeds if "loft_vs_dense" in res[(d, s)]]
        if not ok:
            lines += [f"**{d}**: every seed diverged", ""]
            continue
        layers = list(ok[0]["loft_vs_dense"])
        rounds = ok[0]["runs"]["loft"]["rounds"]
        chance = {k: chance_distance(ok[0]["filters"][k], keep) for k in layers}
        acc = {m: C.stats(o["runs"][m]["accuracy"][-1] for o in ok) for m in ("loft", "localsgd")}
        s = {"rounds": rounds, "chance": chance, "accuracy": acc, "layers": {}}
        lines += [f"**{d}** (final test accuracy: LOFT {C.fmt(acc['loft'], '.4f')}, local SGD "
                  f"{C.fmt(acc['localsgd'], '.4f')})", "",
                  "| layer (filters) | chance | LOFT vs dense, round 0 → mid → last | LOFT: to final, round 0 → mid "
                  "| dense: to final, round 0 → mid | LOFT settles (round) | dense settles (round) |",
                  "|---|---:|---|---|---|---:|---:|"]
        mid = len(rounds) // 2
        for k in layers:
            vs = [C.stats(o["loft_vs_dense"][k][i] for o in ok) for i in range(len(rounds))]
            tf = {m: [C.stats(o[m]["to_final"][k][i] for o in ok) for i in range(len(rounds))]
                  for m in ("loft", "localsgd")}

            st = {m: C.stats(settle(o[m]["to_final"][k], rounds, SETTLED * chance[k]) for o in ok) for m in tf}
            s["layers"][k] = {"loft_vs_dense": vs, "to_final": tf, "settles": st}
            lines.append(f"| {k} ({ok[0]['filters'][k]}) | {chance[k]:.3g} | {C.fmt(vs[0])} → {C.fmt(vs[mid])} → "
                         f"{C.fmt(vs[-1])} | {C.fmt(tf['loft'][0])} → {C.fmt(tf['loft'][mid])} | "
                         f"{C.fmt(tf['localsgd'][0])} → {C.fmt(tf['localsgd'][mid])} | {C.fmt(st['loft'])} | "
                         f"{C.fmt(st['localsgd'])} |")
        lines.append("")
        summary[d] = s
        figs.append((d, ok, layers, rounds, chance))
    lines += C.divergence_lines(divergences)

    ncols = max((len(f[2]) for f in figs), default=1)
    fig, axes = C.figure(ncols, 3 * max(1, len(figs)), size=(2.6, 2.4))
    for row, (d, ok, layers, rounds, chance) in enumerate(figs):
        for j, k in enumerate(layers):
            for r, m in enumerate(("loft", "localsgd")):  # Figure 1: pairwise, first seed; dark = close
                ax = axes[(3 * row + r) * ncols + j]
                im = ax.imshow(ok[0][m]["pairwise"][k], cmap="Blues_r", origin="upper",
                               extent=(rounds[0], rounds[-1], rounds[-1], rounds[0]))
                ax.set_title(f"{d} {'LOFT' if m == 'loft' else 'dense'}\n{k}", fontsize=6)
                ax.tick_params(labelsize=5)
                fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=5)
            ax = axes[(3 * row + 2) * ncols + j]  # Figure 4 + LOFT vs dense, bands over seeds
            C.band(ax, rounds, [o["loft"]["to_final"][k] for o in ok], "LOFT → its final", color="C0")
            C.band(ax, rounds, [o["localsgd"]["to_final"][k] for o in ok], "dense → its final", color="C1")
            C.band(ax, rounds, [o["loft_vs_dense"][k] for o in ok], "LOFT vs dense", color="C2")
            ax.axhline(chance[k], color="k", linestyle=":", linewidth=1, label="chance")
            ax.set_xlabel("round", fontsize=6)
            ax.set_ylabel("filter distance", fontsize=6)
            ax.tick_params(labelsize=5)
            ax.set_title(f"{d} {k}", fontsize=6)
            if j == 0:
                ax.legend(fontsize=5)
    for ax in axes[3 * len(figs) * ncols:]:
        ax.set_visible(False)

    # the pairwise matrices (Figure 1) of each data set's first seed only: the plotted ones
    first = {d: min(s for dd, s in res if dd == d) for d in args.datasets}
    cells = [{"dataset": c[0], "seed": c[1], **{k: v for k, v in out.items() if k not in ("loft", "localsgd")},
              **{m: {"to_final": out[m]["to_final"], **({"pairwise": out[m]["pairwise"]} if c[1] == first[c[0]] else {})}
                 for m in ("loft", "localsgd") if m in out}} for c, out in res.items()]
    results = {"datasets": args.datasets, "keep": keep, "summary": summary, "divergences": divergences,
               "cells": cells}
    C.write_outputs(args, "loft", results, "\n".join(lines), fig, started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
