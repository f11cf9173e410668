"""Subnetworks of a transformer against DiLoCo, local SGD and DDP: bits per byte against bytes sent and wall-clock.

    python -m ist_kernels.experiments transformer [--workers 2,4] [--seeds 0,1] [--links loopback,100mbit]

A small decoder-only transformer (``gpt_tiny``) learns bytes of the Python standard library's own
source (``--dataset pycode``, nothing downloaded). Every variant trains the same data, seeds, rounds
and local steps with S real processes (gloo over TCP, one ``python -m ist_kernels.train`` process per
rank, one torch thread each; with an emulated link in ``--links``, through the speed experiment's
network namespaces):

- ``ist-ffn``: each worker trains a random 1/S of every FFN's hidden units (``--method ist``);
- ``heads``: each worker trains a random 1/S of every layer's attention heads
  (``--method ist --option partition=heads``);
- ``resist-layers``: the blocks between the first and the last are dealt among the workers
  (``--method resist``);
- each of the three again with ``+nesterov``: the round's aggregate minus the previous model is the
  gradient of an outer Nesterov SGD (``--outer-optimizer nesterov``);
- ``diloco``: inner AdamW for the round's local steps, outer Nesterov SGD on the averaged
  pseudo-gradient (arXiv 2311.08105's defaults);
- ``localsgd``: the whole model on every worker, parameters averaged once a round;
- ``ddp``: synchronous data-parallel SGD, one gradient all-reduce per step.

Each run evaluates the test bits per byte after every round. The tables answer, per S and link:
which variant reaches the lowest bits per byte **at equal bytes** (the smallest total any variant
sent: each variant's best evaluation made with at most that many bytes sent), **at equal
wall-clock** (the shortest training time of any variant: rounds' own wall time, evaluation left
out), and at the end of the rounds; and what the outer optimizer adds to each subnetwork method.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..train.methods import METHODS
from . import harness as C
from .harness import link as L
from .harness.launch import launch, run_over_links

#: variant -> (method, --option values, extra flags)
VARIANTS: Dict[str, Tuple[str, List[str], List[str]]] = {
    "ist-ffn": ("ist", [], []),
    "ist-ffn+nesterov": ("ist", [], ["--outer-optimizer", "nesterov"]),
    "heads": ("ist", ["partition=heads"], []),
    "heads+nesterov": ("ist", ["partition=heads"], ["--outer-optimizer", "nesterov"]),
    "resist-layers": ("resist", [], []),
    "resist-layers+nesterov": ("resist", [], ["--outer-optimizer", "nesterov"]),
    "diloco": ("diloco", [], []),
    "localsgd": ("localsgd", [], []),
    "ddp": ("ddp", [], []),
}
#: the subnetwork variants and their outer-optimizer twins
OUTER_PAIRS = [("ist-ffn", "ist-ffn+nesterov"), ("heads", "heads+nesterov"),
               ("resist-layers", "resist-layers+nesterov")]
QUICK_VARIANTS = ("ist-ffn", "heads", "resist-layers", "diloco", "localsgd", "ddp")

#: the workload (digits of the MLP experiments do not apply: a byte-level language model)
#: (gpt_tiny: width 128 = 4 heads of 32, so heads partition at S = 2 and 4; 4 blocks, 2 of them dealt by ResIST)
WORKLOAD: Dict[str, Any] = dict(model="gpt_tiny", dataset="pycode", width=128, depth=4, context=64,
                                batch_size=8, local_steps=8, rounds=12, lr=0.1, lr_adamw=1e-3,
                                dataset_size=None)
QUICK = dict(width=64, depth=3, context=16, batch_size=4, local_steps=2, rounds=2, dataset_size=100_000)


def parser() -> argparse.ArgumentParser:
    p = C.parser("transformer", __doc__, seeds=(0, 1), quick="S=2, loopback, 2 rounds of 2 steps, a tiny model, "
                 f"variants {', '.join(QUICK_VARIANTS)}")
    p.add_argument("--variants", type=C.names, default=None,
                   help=f"variants (default: all: {', '.join(VARIANTS)})")
    p.add_argument("--workers", type=C.ints, default=[2, 4], help="S, processes per run (default 2,4)")
    p.add_argument("--links", type=C.names, default=["loopback"],
                   help="loopback and/or emulated link rates, e.g. 100mbit (default loopback; emulated links "
                        "need root or CAP_NET_ADMIN)")
    p.add_argument("--rounds", type=int, default=None, help=f"rounds per run (default {WORKLOAD['rounds']})")
    p.add_argument("--local-steps", type=int, default=None,
                   help=f"local steps per round (default {WORKLOAD['local_steps']})")
    p.add_argument("--width", type=int, default=None, help=f"model width (default {WORKLOAD['width']})")
    p.add_argument("--depth", type=int, default=None, help=f"transformer blocks (default {WORKLOAD['depth']})")
    p.add_argument("--lr", type=float, default=None,
                   help=f"SGD learning rate of every variant but DiLoCo (default {WORKLOAD['lr']})")
    p.add_argument("--lr-adamw", type=float, default=None,
                   help=f"DiLoCo's inner AdamW learning rate (default {WORKLOAD['lr_adamw']})")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(workers=[2], links=lambda v: v[:1], seeds=lambda v: v[:1]), ())
    if any(s < 2 for s in args.workers):
        p.error(f"--workers must be >= 2, got {args.workers}")
    for name in ("rounds", "local_steps", "width", "depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("lr", "lr_adamw"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    names = args.variants or list(QUICK_VARIANTS if args.quick else VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; available: {', '.join(VARIANTS)}")
    missing = sorted({VARIANTS[v][0] for v in names} - set(METHODS))
    if missing:
        p.error(f"--variants: the trainer has no method {missing}; registered: {', '.join(sorted(METHODS))}")
    args.variants = names
    for v in args.links:
        if v != "loopback":
            try:
                L.parse_rate(v)
            except ValueError as e:
                p.error(f"--links: {e}")
    return args


def workload(args) -> Dict[str, Any]:
    w = dict(WORKLOAD)
    if args.quick:
        w.update(QUICK)
    for k in ("rounds", "local_steps", "width", "depth", "lr", "lr_adamw"):
        if getattr(args, k) is not None:
            w[k] = getattr(args, k)
    return w


def flags(w: Dict[str, Any], variant: str) -> List[str]:
    """The trainer's options for one variant of workload ``w``."""
    method, options, extra = VARIANTS[variant]
    lr = w["lr_adamw"] if method == "diloco" else w["lr"]
    out = ["--method", method, "--model", w["model"], "--width", str(w["width"]), "--depth", str(w["depth"]),
           "--dataset", w["dataset"], "--context", str(w["context"]), "--rounds", str(w["rounds"]),
           "--local-steps", str(w["local_steps"]), "--batch-size", str(w["batch_size"]), "--lr", str(lr),
           "--eval-interval", "1"]
    if w.get("dataset_size"):
        out += ["--dataset-size", str(w["dataset_size"])]
    for o in options:
        out += ["--option", o]
    return out + list(extra)


def curves(run: Dict[str, Any]) -> Dict[str, List[float]]:
    """Per evaluation (round 0 = the untrained model): the round, bits per byte, bytes sent so far
    (all ranks) and training seconds so far."""
    rows = [m for m in run["metrics"] if m.get("bits_per_byte") is not None]
    return {"round": [m["round"] for m in rows], "bits_per_byte": [m["bits_per_byte"] for m in rows],
            "bytes": [m.get("total_bytes", 0) for m in rows], "time_s": [m.get("train_time", 0.0) for m in rows]}


def run_all(args, todo: List[Tuple[int, str, str, int]], work: str) -> Dict[Tuple, Dict[str, Any]]:
    """Every (S, link, variant, seed) cell (emulated links through the harness)."""
    w = workload(args)

    def one(c, em):
        run = launch(flags(w, c[2]), c[0], c[3], os.path.join(work, "-".join(map(str, c)).replace("+", "_")), em)
        return {"curves": curves(run), "summary": run["summary"]}

    return run_over_links(todo, lambda c: (c[1], c[0]), one, "transformer")


def best_within(cv: Dict[str, List[float]], key: str, budget: float) -> Optional[float]:
    """The lowest bits per byte among evaluations made with at most ``budget`` of ``key`` spent
    (round 0, the untrained model, always qualifies)."""
    vals = [b for b, x in zip(cv["bits_per_byte"], cv[key]) if x <= budget * (1 + 1e-9)]
    return min(vals) if vals else None


def analyse(args, results: Dict[Tuple, Dict[str, Any]]) -> Tuple[List[Dict], List[Dict], List[Dict], List[str]]:
    runs, errors = [], []
    for c, r in sorted(results.items()):
        S, link_name, variant, seed = c
        if "error" in r:
            errors.append(f"{variant} S={S} {link_name} seed {seed}: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        cv = r["curves"]
        method, options, extra = VARIANTS[variant]
        rounds = max(cv["round"][-1], 1)
        runs.append({"variant": variant, "method": method, "options": options,
                     "outer_optimizer": "nesterov" if "--outer-optimizer" in extra else "none",
                     "workers": S, "link": link_name, "seed": seed, "rounds": cv["round"][-1],
                     "final_bits_per_byte": cv["bits_per_byte"][-1], "initial_bits_per_byte": cv["bits_per_byte"][0],
                     "total_bytes": cv["bytes"][-1], "bytes_per_round": cv["bytes"][-1] / rounds,
                     "train_time_s": cv["time_s"][-1], "round_time_s": cv["time_s"][-1] / rounds,
                     "bytes_ratio": r["summary"].get("bytes_ratio"), "curve": cv})
    comparisons = []
    for S in args.workers:
        for link_name in args.links:
            cell = [r for r in runs if r["workers"] == S and r["link"] == link_name]
            if not cell:
                continue
            for what, key, total in (("equal bytes", "bytes", "total_bytes"), ("equal wall-clock", "time_s", "train_time_s"),
                                     ("end of the rounds", None, None)):
                by_variant: Dict[str, Any] = {}
                budget = None
                if key is not None:  # per seed, the smallest total any variant reached
                    budget = {s: min(r[total] for r in cell if r["seed"] == s) for s in {r["seed"] for r in cell}}
                for v in args.variants:
                    vals = [best_within(r["curve"], key, budget[r["seed"]]) if key else r["final_bits_per_byte"]
                            for r in cell if r["variant"] == v]
                    by_variant[v] = C.stats(vals)
                ranked = sorted((v for v in by_variant if by_variant[v]["mean"] is not None),
                                key=lambda v: by_variant[v]["mean"])
                comparisons.append({"workers": S, "link": link_name, "at": what,
                                    "budget": None if budget is None else sum(budget.values()) / len(budget),
                                    "bits_per_byte": by_variant, "best": ranked[0] if ranked else None})
    outer = []
    for S in args.workers:
        for link_name in args.links:
            for a, b in OUTER_PAIRS:
                x = [r["final_bits_per_byte"] for r in runs if r["variant"] == a and r["workers"] == S and r["link"] == link_name]
                y = [r["final_bits_per_byte"] for r in runs if r["variant"] == b and r["workers"] == S and r["link"] == link_name]
                if x and y:
                    sx, sy = C.stats(x), C.stats(y)
                    outer.append({"workers": S, "link": link_name, "variant": a, "without": sx, "with": sy,
                                  "change": sy["mean"] - sx["mean"] if sx["mean"] is not None and sy["mean"] is not None
                                  else None, "significant": C.significant(sx, sy)})
    return runs, comparisons, outer, errors


def markdown(args, w, runs, comparisons, outer, errors) -> str:
    L_ = ["# Subnetworks of a transformer against DiLoCo, local SGD and DDP", "",
          f"{w['model']} (width {w['width']}, {w['depth']} blocks), byte-level pycode, context {w['context']}; "
          f"{w['rounds']} rounds of {w['local_steps']} local steps, batch {w['batch_size']} per worker; SGD lr "
          f"{w['lr']:g} (DiLoCo: inner AdamW lr {w['lr_adamw']:g}); {len(args.seeds)} seed(s): "
          f"{', '.join(map(str, args.seeds))}. Bits per byte on the test split (lower is better), mean ± std "
          "over seeds.", ""]
    for S in args.workers:
        for link_name in args.links:
            rows = [c for c in comparisons if c["workers"] == S and c["link"] == link_name]
            if not rows:
                continue
            L_ += [f"## S = {S}, {link_name}", "",
                   "| variant | MB / round | s / round | " + " | ".join(f"bits/byte at {c['at']}" for c in rows) + " |",
                   "|---|---|---|" + "---|" * len(rows)]
            for v in args.variants:
                mine = [r for r in runs if r["variant"] == v and r["workers"] == S and r["link"] == link_name]
                if not mine:
                    continue
                mb = sum(r["bytes_per_round"] for r in mine) / len(mine) / 1e6
                sec = sum(r["round_time_s"] for r in mine) / len(mine)
                cells = []
                for c in rows:
                    s = c["bits_per_byte"][v]
                    txt = C.fmt(s, ".4f")
                    cells.append(f"**{txt}**" if c["best"] == v else txt)
                L_.append(f"| {v} | {mb:.3g} | {sec:.3g} | " + " | ".join(cells) + " |")
            L_ += [""]
            for c in rows:
                if c["budget"] is not None:
                    unit = (f"{c['budget'] / 1e6:.3g} MB sent (all ranks)" if c["at"] == "equal bytes"
                            else f"{c['budget']:.3g} s of training")
                    L_.append(f"- At {c['at']} ({unit}): lowest bits per byte **{c['best']}**.")
                else:
                    L_.append(f"- At the {c['at']}: lowest bits per byte **{c['best']}**.")
            L_ += [""]
    if outer:
        L_ += ["## What the outer optimizer adds", "",
               "Final bits per byte without and with `--outer-optimizer nesterov` (negative change: better).", "",
               "| S | link | variant | without | with | change | > 2 s.e. |", "|---|---|---|---|---|---|---|"]
        for o in outer:
            ch = "—" if o["change"] is None else f"{o['change']:+.4f}"
            L_.append(f"| {o['workers']} | {o['link']} | {o['variant']} | {C.fmt(o['without'], '.4f')} | "
                      f"{C.fmt(o['with'], '.4f')} | {ch} | {'yes' if o['significant'] else 'no'} |")
        L_ += [""]
    if errors:
        L_ += ["## Errors", ""] + [f"- {e}" for e in errors] + [""]
    return "\n".join(L_)


def plot(runs, workers: Sequence[int], links: Sequence[str]):
    panels = [(S, ln) for S in workers for ln in links]
    fig, axes = C.figure(cols=2, rows=max(len(panels), 1))
    for i, (S, link_name) in enumerate(panels):
        for j, (key, xlabel) in enumerate((("bytes", "bytes sent, all ranks"), ("time_s", "training time (s)"))):
            ax = axes[2 * i + j]
            for v in dict.fromkeys(r["variant"] for r in runs):
                mine = [r for r in runs if r["variant"] == v and r["workers"] == S and r["link"] == link_name]
                if not mine:
                    continue
                r = mine[0]  # the first seed: curves of different seeds do not share x values
                xs = [max(x, 1.0) for x in r["curve"][key]] if key == "bytes" else r["curve"][key]
                ax.plot(xs, r["curve"]["bits_per_byte"], marker=".", label=v,
                        linestyle="--" if v.endswith("+nesterov") else "-")
            if key == "bytes":
                ax.set_xscale("log")
            C.style_axis(ax, f"S={S}, {link_name}", xlabel, "test bits per byte", legend=i == j == 0)
    return fig


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    torch.set_num_threads(1)
    emulated = [x for x in args.links if x != "loopback"]
    reason = L.unavailable_reason() if emulated else None
    if reason:
        print(f"transformer: {reason}; running loopback only", file=sys.stderr)
        args.links = ["loopback"]
    todo = [(S, ln, v, seed) for S in args.workers for ln in args.links for v in args.variants for seed in args.seeds]
    work = tempfile.mkdtemp(prefix="ist-transformer-")
    try:
        results = run_all(args, todo, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = workload(args)
    runs, comparisons, outer, errors = analyse(args, results)
    C.write_outputs(args, "transformer", {"runs": runs, "comparisons": comparisons, "outer_optimizer": outer,
                                          "errors": errors, "workload": w, "variants": {
                                              v: {"method": m, "options": o, "flags": f} for v, (m, o, f) in
                                              VARIANTS.items() if v in args.variants}},
                    markdown(args, w, runs, comparisons, outer, errors), plot(runs, args.workers, args.links), started)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
