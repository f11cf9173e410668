"""Issue 27 item 4: why IST and masked need more rounds than local SGD on the MLP, factor by factor.

    python -m ist_kernels.experiments ist_ablation [--target 0.95] [--lrs 0.1,0.3,1,3] [--quick]

Every run is ``ist-train --simulate S`` (in this process, through ``ist_kernels.train.cli.main``; the
same model as a distributed run) on digits, the package's MLP, S = 2 workers, batch 64, the full
model scored every round (``--eval-interval 1``). A run's **rounds to target** is the first round
whose test accuracy is at least ``--target`` (none within ``--rounds``: not reached); its **final
accuracy** is the last round's. Each factor is a switch (``--factors``):

* ``lr``: local SGD, IST and masked (Bernoulli masks, ξ = 1/2) over the learning-rate grid ``--lrs``
  (τ = ``--local-steps``, width ``--width``, momentum 0.9): the methods at their own best rates.
* ``steps``: local SGD and IST with τ in ``--steps-grid`` at ``--base-lr``.
* ``scale``: free, from every IST/masked run: the full model is scored as paper 001 §4 does, each
  hidden output scaled by ξ = 1/S (``masked.FullModel``, keep = ξ); the experiment also scores the
  same aggregated model with keep = 1 every round (the method is unchanged: only its ``evaluate``
  is wrapped inside this process) and reports rounds to target and final accuracy both ways.
* ``repartition``: IST with ``--option repartition_every=k`` for k in ``--repartition`` (0: never,
  i.e. k = rounds, one partition for the whole run) over ``--lrs``; k = 1 is the ``lr`` factor's IST.
* ``width``: local SGD on an MLP of ``--width`` / S units (IST's subnetworks' width) over ``--lrs``:
  whether IST's cost is the narrower model or the averaging of disjoint subnetworks.
* ``momentum``: local SGD and IST with momentum 0 over ``--lrs``. IST's subnetworks change every
  round, so their optimizers (SGD momentum 0.9 by default) start afresh every round, while local
  SGD keeps each worker's momentum buffer across rounds; without momentum both start equal.

Outputs ``ist_ablation.{json,md,png}``: per setting the per-seed curves, rounds to target and final
accuracy (scaled and unscaled for IST/masked), and a sentence per factor on what it costs.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..nn.subnet import SubnetMLP
from ..train import cli
from ..train.methods import masked as M
from . import harness as C

FACTORS = ("lr", "steps", "scale", "repartition", "width", "momentum", "model")
SUBNET = "localsgd:subnetmlp"  # local SGD on IST's model (subnet_mlp below)
METHODS = ("localsgd", "ist", "masked")


def parser() -> argparse.ArgumentParser:
    p = C.parser("ist_ablation", __doc__, quick="2 settings, 3 rounds, 1 seed, width 64")
    p.add_argument("--target", type=float, default=0.95, help="test accuracy that counts as reached (default %(default)s)")
    p.add_argument("--rounds", type=int, default=40, help="rounds per run (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="S, simulated workers (default %(default)s)")
    p.add_argument("--width", type=int, default=8192, help="MLP hidden units (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per worker (default %(default)s)")
    p.add_argument("--local-steps", type=int, default=8, help="τ of the lr, repartition, width and momentum "
                   "factors (default %(default)s)")
    p.add_argument("--lrs", type=C.floats, default=[0.1, 0.3, 1.0, 3.0], help="learning-rate grid (default %(default)s)")
    p.add_argument("--base-lr", type=float, default=0.1, help="learning rate of the steps factor (default %(default)s)")
    p.add_argument("--steps-grid", type=C.ints, default=[2, 8, 32], help="local steps of the steps factor "
                   "(default %(default)s)")
    p.add_argument("--repartition", type=C.ints, default=[4, 0], help="repartition_every values k of the "
                   "repartition factor, 0: never (default %(default)s)")
    p.add_argument("--factors", type=C.names, default=list(FACTORS), help="which factors to run (default: all: "
                   + ",".join(FACTORS) + ")")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(rounds=3, width=64, lrs=[0.3], steps_grid=[2], repartition=[0],
                                      factors=["lr", "scale"], seeds=lambda v: v[:1]),
                        positive=("rounds", "workers", "width", "batch_size", "local_steps", "threads"))
    bad = [f for f in args.factors if f not in FACTORS]
    if bad:
        p.error(f"--factors: unknown {bad}; choose from {', '.join(FACTORS)}")
    if not 0 < args.target <= 1:
        p.error(f"--target must be an accuracy in (0, 1], got {args.target}")
    if args.width // args.workers < 1:
        p.error("--width must be >= --workers")
    return args


# ---------------------------------------------------------------- settings

def setting_key(method: str, lr: float, steps: int, width: int, momentum: float, k: int) -> Tuple:
    return (method, float(lr), int(steps), int(width), float(momentum), int(k))


def setting_name(key: Tuple, args) -> str:
    method, lr, steps, width, momentum, k = key
    parts = [method, f"lr={lr:g}"]
    if steps != args.local_steps:
        parts.append(f"τ={steps}")
    if width != args.width:
        parts.append(f"width={width}")
    if momentum != 0.9:
        parts.append(f"momentum={momentum:g}")
    if k != 1:
        parts.append("repartition=never" if k >= args.rounds else f"repartition every {k}")
    return " ".join(parts)


def settings(args) -> Dict[str, List[Tuple]]:
    """factor -> the setting keys it compares (a key may serve several factors; it runs once)."""
    W, tau = args.width, args.local_steps
    out: Dict[str, List[Tuple]] = {}
    f = set(args.factors)
    if "lr" in f or "scale" in f:
        out["lr"] = [setting_key(m, lr, tau, W, 0.9, 1) for m in METHODS for lr in args.lrs]
    if "steps" in f:
        out["steps"] = [setting_key(m, args.base_lr, s, W, 0.9, 1) for m in ("localsgd", "ist") for s in args.steps_grid]
    if "repartition" in f:
        ks = [1] + [k if k > 0 else args.rounds for k in args.repartition]
        out["repartition"] = [setting_key("ist", lr, tau, W, 0.9, k) for k in dict.fromkeys(ks) for lr in args.lrs]
    if "width" in f:
        out["width"] = [setting_key("localsgd", lr, tau, w, 0.9, 1) for w in (W, W // args.workers)
                        for lr in args.lrs] + [setting_key("ist", lr, tau, W, 0.9, 1) for lr in args.lrs]
    if "model" in f:
        out["model"] = [setting_key(m, lr, tau, W, 0.9, 1) for m in ("localsgd", SUBNET, "ist") for lr in args.lrs]
    if "momentum" in f:
        out["momentum"] = [setting_key(m, lr, tau, W, mom, 1) for mom in (0.9, 0.0) for m in ("localsgd", "ist")
                           for lr in args.lrs]
    return out


# ---------------------------------------------------------------- one run

@contextlib.contextmanager
def score_unscaled():
    """Inside: IST's and masked's evaluate also scores the aggregated model with keep = 1 (no 1/S
    scale of the hidden outputs) as ``accuracy_unscaled`` / ``test_loss_unscaled``; restored after."""

    had = "evaluate" in M.Masked.__dict__
    original = M.Masked.evaluate

    def evaluate(self, model):
        scores = original(self, model)
        if scores and isinstance(model, M.FullModel):
            raw = self.ctx.evaluate(M.FullModel(model.net, 1.0))
            scores = {**scores, "accuracy_unscaled": raw.get("accuracy"), "test_loss_unscaled": raw.get("test_loss")}
        return scores

    M.Masked.evaluate = evaluate
    try:
        yield
    finally:
        if had:
            M.Masked.evaluate = original
        else:
            del M.Masked.evaluate


def rounds_to_target(curve: Sequence[Optional[float]], target: float) -> Optional[int]:
    """The first round r >= 1 whose accuracy (``curve[r]``; ``curve[0]`` is the initial model's) is
    at least ``target``; None when no round reaches it (a None or NaN accuracy never does)."""
    for r, acc in enumerate(curve):
        if r >= 1 and acc is not None and math.isfinite(acc) and acc >= target:
            return r
    return None


def train_argv(args, key: Tuple, seed: int, out_dir: str) -> List[str]:
    method, lr, steps, width, momentum, k = key
    model = ["--model", "mlp", "--width", str(width)] if method != SUBNET else \
        ["--model", f"{__name__}:subnet_mlp", "--model-args", f"width={width}"]
    argv = ["--method", method.split(":")[0], "--simulate", str(args.workers), "--dataset", "digits", *model, "--batch-size", str(args.batch_size), "--local-steps", str(steps),
            "--lr", repr(lr), "--momentum", repr(momentum), "--rounds", str(args.rounds), "--eval-interval", "1",
            "--seed", str(seed), "--threads", str(args.threads), "--device", "cpu", "--out-dir", out_dir,
            "--overwrite", "--no-progress", "--no-plots"]
    if k != 1:
        argv += ["--option", f"repartition_every={k}"]
    return argv


def subnet_mlp(width: int = 8192, in_features: int = 64, classes: int = 10):
    """IST's model as one module, for local SGD (the ``model`` factor): the SubnetMLP ist and
    masked train (NTK parametrisation: weights N(0, 1), hidden outputs x 1/sqrt(width)) on
    flattened inputs, scored with keep = 1. ist-train's ``mlp`` is torch's nn.Linear layers
    (standard parametrisation): the two take different learning rates."""
    from torch import nn


    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = SubnetMLP(in_features, width, 1, classes, bias=True, train_output=True)

        def forward(self, x):
            return self.net(x.flatten(1))

    return Flat()


def run_cell(args, cell) -> Dict[str, Any]:
    """One ist-train run: its accuracy curves (scaled and, for IST/masked, unscaled), rounds to
    target, final accuracy and final test loss."""
    import io


    key, seed = cell[:-1], cell[-1]
    out_dir = tempfile.mkdtemp(prefix="ist_ablation_")
    try:
        with score_unscaled(), contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(train_argv(args, key, seed, out_dir))
        if rc != 0:
            raise RuntimeError(f"ist-train {' '.join(train_argv(args, key, seed, out_dir))} exited with {rc}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rows = [r for r in rows if "accuracy" in r]
    curve = [r.get("accuracy") for r in rows]
    loss = rows[-1].get("test_loss") if rows else None
    out = {"curve": curve, "rounds_to_target": rounds_to_target(curve, args.target),
           "final_accuracy": curve[-1] if curve else None, "final_test_loss": loss}
    if not key[0].startswith("localsgd"):
        raw = [r.get("accuracy_unscaled") for r in rows]
        out.update(curve_unscaled=raw, rounds_to_target_unscaled=rounds_to_target(raw, args.target),
                   final_accuracy_unscaled=raw[-1] if raw else None)
    return out


# ---------------------------------------------------------------- summaries

def summarize(runs: Sequence[Dict[str, Any]], rounds: int, suffix: str = "") -> Dict[str, Any]:
    """Over the seeds: rounds to target (mean, std, counting a run that never reached it as rounds
    + 1, so the mean is then a lower bound), how many reached it, and the final accuracy's stats."""
    rt = [r.get("rounds_to_target" + suffix) for r in runs]
    counted = [rounds + 1 if v is None else v for v in rt]
    return {"rounds_to_target": rt, "reached": sum(v is not None for v in rt), "runs": len(rt),
            "rounds_mean": sum(counted) / len(counted) if counted else None,
            "rounds_std": C.stats(counted)["std"] if counted else None,
            "final_accuracy": C.stats(r.get("final_accuracy" + suffix) for r in runs)}


def fmt_rounds(s: Dict[str, Any], rounds: int) -> str:
    if not s["runs"]:
        return "-"
    if s["reached"] == 0:
        return f"not in {rounds}"
    text = f"{s['rounds_mean']:.1f} ± {s['rounds_std']:.1f}"
    return text if s["reached"] == s["runs"] else f"≥ {text} ({s['runs'] - s['reached']}/{s['runs']} not in {rounds})"


def fmt_acc(s: Dict[str, Any]) -> str:
    return "-" if s["mean"] is None else f"{100 * s['mean']:.1f}% ± {100 * s['std']:.1f}"


def best(summaries: Dict[Tuple, Dict[str, Any]], keys: Sequence[Tuple]) -> Optional[Tuple]:
    """The key with the fewest rounds to target (unreached counted as rounds + 1), ties broken by
    the higher final accuracy."""
    keys = [k for k in keys if k in summaries]
    if not keys:
        return None
    return min(keys, key=lambda k: (summaries[k]["rounds_mean"], -(summaries[k]["final_accuracy"]["mean"] or 0)))


def _r(s: Dict[str, Any], rounds: int) -> str:
    return f"{s['rounds_mean']:.1f}" + ("" if s["reached"] == s["runs"] else f" (≥, {s['runs'] - s['reached']} not in {rounds})")


def findings(args, by_factor, summ, summ_raw) -> Dict[str, str]:
    """One sentence per factor, from the numbers."""
    R, W, out = args.rounds, args.width, {}

    def at(method, **kw):
        base = dict(lr=None, steps=args.local_steps, width=W, momentum=0.9, k=1, **kw)
        return [k for k in summ if k[0] == method and k[2] == base["steps"] and k[3] == base["width"]
                and k[4] == base["momentum"] and k[5] == base["k"]]

    def best_text(method, keys, label=None):
        b = best(summ, keys)
        return None if b is None else (b, f"{label or method} {_r(summ[b], R)} rounds at lr {b[1]:g}")

    if "lr" in by_factor:
        parts = [best_text(m, at(m)) for m in METHODS]
        parts = [p for p in parts if p]
        at01 = [f"{m} {_r(summ[k], R)}" for m in METHODS for k in at(m) if k[1] == args.base_lr]
        out["lr"] = ("At its best learning rate: " + "; ".join(t for _, t in parts) +
                     (f" (at lr {args.base_lr:g}: " + ", ".join(at01) + ")" if at01 else "") + ".")
        ref = summ.get(setting_key("ist", args.base_lr, args.local_steps, W, 0.9, 1))
        b = best(summ, at("ist"))
        if ref is not None and b is not None:
            out["lr"] += (f" Raising IST's lr from {args.base_lr:g} to {b[1]:g} saves "
                          f"{ref['rounds_mean'] - summ[b]['rounds_mean']:.1f} rounds.")
    if "steps" in by_factor:
        rows = []
        for s in args.steps_grid:
            a = summ.get(setting_key("localsgd", args.base_lr, s, W, 0.9, 1))
            b = summ.get(setting_key("ist", args.base_lr, s, W, 0.9, 1))
            if a and b:
                rows.append(f"τ={s}: local SGD {_r(a, R)} vs IST {_r(b, R)}")
        out["steps"] = f"At lr {args.base_lr:g}: " + "; ".join(rows) + "."
    if "scale" in args.factors and "lr" in by_factor:
        rows = []
        for m in ("ist", "masked"):
            keys = at(m)
            b = best(summ, keys)
            braw = best(summ_raw, keys)
            if b is not None and braw is not None:
                d = [summ_raw[k]["final_accuracy"]["mean"] - summ[k]["final_accuracy"]["mean"] for k in keys
                     if summ[k]["final_accuracy"]["mean"] is not None and summ_raw[k]["final_accuracy"]["mean"] is not None]
                rows.append(f"{m}: best {_r(summ[b], R)} rounds scaled (lr {b[1]:g}) vs {_r(summ_raw[braw], R)} "
                            f"unscaled (lr {braw[1]:g}); final accuracy unscaled minus scaled "
                            f"{min(d) * 100:+.1f} to {max(d) * 100:+.1f} points over the lr grid" if d else "")
        out["scale"] = ("Scoring the aggregated model without the 1/S scale (keep = 1): " + "; ".join(rows) +
                        ". The scale multiplies every hidden output by the same 1/S, so on one hidden layer it moves "
                        "the argmax only through the output bias.")
    if "repartition" in by_factor:
        ks = sorted({k[5] for k in by_factor["repartition"]})
        rows = []
        for kk in ks:
            keys = [k for k in by_factor["repartition"] if k[5] == kk]
            b = best(summ, keys)
            if b is not None:
                rows.append(f"{'never' if kk >= R else f'every {kk}'}: {_r(summ[b], R)} rounds at lr {b[1]:g}")
        out["repartition"] = "IST re-partitioning " + "; ".join(rows) + " (best lr of each)."
    if "width" in by_factor:
        wide = best_text("localsgd", [k for k in by_factor["width"] if k[0] == "localsgd" and k[3] == W],
                         f"local SGD width {W}")
        narrow = best_text("localsgd", [k for k in by_factor["width"] if k[0] == "localsgd" and k[3] != W],
                           f"local SGD width {W // args.workers}")
        ist = best_text("ist", [k for k in by_factor["width"] if k[0] == "ist"], f"IST width {W}")
        out["width"] = "; ".join(t for _, t in (wide, narrow, ist) if t) + \
            ": if the narrow local SGD is as fast as the wide one, IST's extra rounds are not the narrower model."
    if "momentum" in by_factor:
        rows = []
        for mom in (0.9, 0.0):
            for m in ("localsgd", "ist"):
                t = best_text(m, [k for k in by_factor["momentum"] if k[0] == m and k[4] == mom],
                              f"{'local SGD' if m == 'localsgd' else 'IST'} momentum {mom:g}")
                if t:
                    rows.append(t[1])
        out["momentum"] = "; ".join(rows) + (". IST restarts its optimizer every round (its subnetworks change), "
                                             "local SGD keeps its momentum buffers: the gap at momentum 0 is the "
                                             "part that is not the momentum restart.")
    if "model" in by_factor:
        rows = [best_text(m, [k for k in by_factor["model"] if k[0] == m], label)
                for m, label in (("localsgd", "local SGD on mlp"), (SUBNET, "local SGD on SubnetMLP"), ("ist", "IST"))]
        out["model"] = "; ".join(r[1] for r in rows if r) + \
            ": local SGD on IST's own model is the fair baseline for IST's learning rate."
    return out


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    by_factor = settings(args)
    keys = list(dict.fromkeys(k for ks in by_factor.values() for k in ks))
    cells = [(*k, sd) for k in keys for sd in args.seeds]
    res = C.run_grid(run_cell, args, cells, "ist_ablation: ist-train runs", args.jobs)
    runs = {k: [res[(*k, sd)] for sd in args.seeds] for k in keys}
    summ = {k: summarize(runs[k], args.rounds) for k in keys}
    summ_raw = {k: summarize(runs[k], args.rounds, "_unscaled") for k in keys if not k[0].startswith("localsgd")}
    divergences = [C.divergence(setting_name(k, args), sd, k[1], args.rounds, r["final_test_loss"])
                   for k in keys for sd, r in zip(args.seeds, runs[k])
                   if r["final_test_loss"] is None or not math.isfinite(r["final_test_loss"])]
    text = findings(args, by_factor, summ, summ_raw)

    lines = ["# IST ablation: where IST's and masked's extra rounds go (issue 27 item 4)", "",
             f"digits, MLP width {args.width}, S={args.workers} simulated workers, batch {args.batch_size}, "
             f"τ={args.local_steps} local steps unless stated, SGD momentum 0.9 unless stated, weight decay 5e-4, "
             f"{args.rounds} rounds, the full model scored every round. Rounds to target = first round with test "
             f"accuracy ≥ {100 * args.target:g}% (mean ± std over seeds; a run that never reached it counts as "
             f"{args.rounds + 1}, shown as ≥). Scaled: the full model as ist-train scores it (hidden outputs × 1/S); "
             "unscaled: the same model with keep = 1.", ""]
    titles = {"lr": "Learning rate (each method over the grid)", "steps": f"Local steps τ (lr {args.base_lr:g})",
              "repartition": "Re-partitioning every k rounds (IST)", "width": f"Width: local SGD on {args.width} vs "
              f"{args.width // args.workers} units (IST's subnetwork width)", "momentum": "Momentum 0.9 vs 0",
              "model": "Model: local SGD on ist-train's mlp (nn.Linear) vs on IST's SubnetMLP (NTK parametrisation)"}
    for factor, ks in by_factor.items():
        lines += [f"## {titles[factor]}", "", "| setting | rounds to target | final accuracy | unscaled: rounds | "
                  "unscaled: final |", "|---|---|---|---|---|"]
        for k in ks:
            raw = summ_raw.get(k)
            lines.append(f"| {setting_name(k, args)} | {fmt_rounds(summ[k], args.rounds)} | "
                         f"{fmt_acc(summ[k]['final_accuracy'])} | "
                         f"{fmt_rounds(raw, args.rounds) if raw else '-'} | "
                         f"{fmt_acc(raw['final_accuracy']) if raw else '-'} |")
        lines.append("")
    lines += ["## What each factor costs", ""] + [f"- **{f}**: {t}" for f, t in text.items()] + [""]
    lines += C.divergence_lines(divergences)

    fig, (ax0, ax1) = C.figure(2, 1, size=(10.0, 3.8))
    lr_keys = by_factor.get("lr", [])
    for m in METHODS:
        b = best(summ, [k for k in lr_keys if k[0] == m])
        if b is not None:
            C.band(ax0, list(range(len(runs[b][0]["curve"]))), [r["curve"] for r in runs[b]],
                   f"{setting_name(b, args)}")
        ks = [k for k in lr_keys if k[0] == m]
        if ks:
            ax1.plot([k[1] for k in ks], [summ[k]["rounds_mean"] for k in ks], marker="o", label=m)
    ax0.axhline(args.target, color="gray", linestyle=":", linewidth=1)
    C.style_axis(ax0, "test accuracy, each method at its best lr", "round", "accuracy", legend=True)
    ax1.set_xscale("log")
    C.style_axis(ax1, f"rounds to {100 * args.target:g}% (unreached: {args.rounds + 1})", "learning rate",
                 "rounds", legend=True)

    settings_out = []
    for k in keys:
        settings_out.append({"name": setting_name(k, args), "method": k[0], "lr": k[1], "local_steps": k[2],
                             "width": k[3], "momentum": k[4], "repartition_every": k[5],
                             "factors": [f for f, ks in by_factor.items() if k in ks],
                             "summary": summ[k], **({"summary_unscaled": summ_raw[k]} if k in summ_raw else {}),
                             "runs": [{"seed": sd, **r} for sd, r in zip(args.seeds, runs[k])]})
    results = {"target": args.target, "settings": settings_out, "findings": text, "divergences": divergences}
    C.write_outputs(args, "ist_ablation", results, "\n".join(lines), fig, started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
