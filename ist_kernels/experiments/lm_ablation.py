"""Issue 27: why the subnetwork methods end above local SGD on the language model, factor by factor.

    python -m ist_kernels.experiments lm_ablation [--workers 4] [--factors state,lr] [--runs-dir DIR]

``speed``'s ``lm`` workload (gpt_tiny on pycode, AdamW for every method, 40 rounds of 25 local steps,
cosine after a 2-round warm-up), S real processes over loopback, every method at the learning rate
``speed``'s tuning picked (read from ``--speed-json``; the workload's lr where it has none). The
**baselines** are ``speed``'s own comparison runs (the same command line: with ``--runs-dir`` the
kept runs are read, not run again): local SGD, ResIST, IST of FFN units and of heads. Each factor
(``--factors``) changes one thing of one method and keeps the rest:

* ``state``: the subnetwork methods start every round's AdamW afresh (the trainer's default
  ``momentum_state=reset``, as paper 000's Algorithm 1 and the ResIST code, which aggregate only the
  weights), while local SGD's workers keep theirs. ResIST and both IST variants with
  ``momentum_state=aggregate`` (the two moments sliced with the weights and owner-averaged), and
  local SGD with ``momentum_state=reset`` (its AdamW cleared after every average): what the reset
  costs each, from both sides.
* ``lr``: both IST variants at a third of their pick, which was the tuning grid's lowest point.

A run's **rounds to target** is the first round whose test bits per byte are at or below the target,
local SGD's final plus ``--lm-margin`` (as in ``speed``); its **final** is the last round's. Outputs
``lm_ablation.{json,md,png}``: per variant its curve, final, rounds to target and to 3.0 / 2.9 bits,
seconds per round, and a sentence per factor on what it moves.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from . import _common as C, speed as SP

#: (factor, variant name, the workload's method, its extra --option values, lr multiplier of the pick)
VARIANTS: Tuple[Tuple[str, str, str, Tuple[str, ...], float], ...] = (
    ("baseline", "localsgd", "localsgd", (), 1.0),
    ("baseline", "resist", "resist", (), 1.0),
    ("baseline", "ist-ffn", "ist-ffn", (), 1.0),
    ("baseline", "ist-heads", "ist-heads", (), 1.0),
    ("state", "localsgd-reset", "localsgd", ("momentum_state=reset",), 1.0),
    ("state", "resist-aggregate", "resist", ("momentum_state=aggregate",), 1.0),
    ("state", "ist-ffn-aggregate", "ist-ffn", ("momentum_state=aggregate",), 1.0),
    ("state", "ist-heads-aggregate", "ist-heads", ("momentum_state=aggregate",), 1.0),
    ("lr", "ist-ffn-lr/3", "ist-ffn", (), 1 / 3),
    ("lr", "ist-heads-lr/3", "ist-heads", (), 1 / 3),
)
FACTORS = ("state", "lr")
QUICK_METHODS = ("localsgd", "ist-ffn")  # --quick runs only these methods' variants
LEVELS = (3.0, 2.9)  # bits per byte: rounds to each, beside the target's


def parser() -> argparse.ArgumentParser:
    p = C.parser("lm_ablation", __doc__, seeds=(0,), quick="speed's --quick lm: a tiny transformer, 3 rounds, S=2, local SGD's and "
                                                                   "IST-of-FFN's variants")
    p.add_argument("--workers", type=int, default=None, help="S, the worker processes (default 4; --quick: 2)")
    p.add_argument("--factors", type=C.names, default=list(FACTORS),
                   help=f"factors to run beside the baselines (default {','.join(FACTORS)})")
    p.add_argument("--speed-json", default=os.path.join("bench", "results", "experiments", "speed.json"),
                   help="speed's output whose tuning gives each method's lr (default %(default)s; missing: the "
                        "workload's lr)")
    p.add_argument("--runs-dir", default=None, metavar="DIR",
                   help="keep every run here and reuse a kept run with the same command, S and seed (speed's "
                        "--runs-dir: its kept comparison runs are the baselines)")
    p.add_argument("--stored-only", action="store_true", help="run nothing: read the kept runs (missing: not_run)")
    p.add_argument("--lm-margin", type=float, default=SP.LM_MARGIN,
                   help="target = local SGD's final bits per byte plus this (default %(default)s)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    C.check_args(p, args)
    bad = [f for f in args.factors if f not in FACTORS]
    if bad:
        p.error(f"--factors: unknown {', '.join(bad)}; expected some of {', '.join(FACTORS)}")
    if args.workers is None:
        args.workers = 2 if args.quick else 4
    if args.workers < 2:
        p.error(f"--workers: expected at least 2 (subnetworks need 2 or more workers), got {args.workers}")
    if args.stored_only and args.runs_dir is None:
        p.error("--stored-only needs --runs-dir")
    return args


def picks(path: str, S: int) -> Dict[str, float]:
    """Each lm method's picked lr at S from ``speed.json``'s tuning (empty when it is missing)."""
    try:
        with open(path) as f:
            tuning = json.load(f).get("tuning", {}).get("lm", {})
    except (OSError, ValueError):
        return {}
    return {m: t[str(S)]["pick"] for m, t in tuning.items() if str(S) in t and t[str(S)].get("pick") is not None}


def variant_flags(w: Dict[str, Any], method: str, options: Sequence[str], lr: float) -> List[str]:
    """speed's comparison-run flags of ``method`` at ``lr`` (so a baseline is speed's own run) plus ``options``."""
    flags = SP.method_flags(w, method, "none", lr)
    for o in options:
        flags += ["--option", o]
    return flags


def store_name(S: int, seed: int, name: str, method: str, lr: float, baseline: bool) -> str:
    """A baseline's kept name is speed's loopback comparison run's; a variant's its own."""
    if baseline:
        return f"lm-{S}-loopback-{method}-none-{seed}-lr{lr:g}"
    return f"ablate-lm-{S}-loopback-{name.replace('/', 'div')}-{seed}-lr{lr:g}"


def row_of(run: Dict[str, Any]) -> Dict[str, Any]:
    c = SP.curve(run)
    bpb = c["bits_per_byte"]
    return {"bits_per_byte": bpb, "round_s": c["round_s"], "final": bpb[-1] if bpb else None,
            "mean_round_s": SP._mean(c["round_s"]), "mb_per_round": SP._mean([b / 1e6 for b in c["bytes"]]),
            "bits_per_byte_round0": next((m.get("bits_per_byte") for m in run["metrics"] if m["round"] == 0), None)}


def rounds_to(values: Sequence[Optional[float]], level: Optional[float]) -> Optional[int]:
    return None if level is None else SP.time_to_target([0.0] * len(values), values, level, False)[1]


def run_variants(args) -> Tuple[List[Dict[str, Any]], Dict[str, float]]:
    w = SP.workload(argparse.Namespace(quick=args.quick, rounds=None, local_steps=None), "lm")
    S = args.workers
    lrs = {} if args.quick else picks(args.speed_json, S)
    todo = [v for v in VARIANTS if (v[0] == "baseline" or v[0] in args.factors)
            and (not args.quick or v[2] in QUICK_METHODS)]
    rows: List[Dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="ist-lm-ablation-")
    try:
        bar = tqdm(total=len(todo) * len(args.seeds), desc="lm_ablation", unit="run", file=sys.stderr)
        for seed in args.seeds:
            for factor, name, method, options, mult in todo:
                lr = float(f"{lrs.get(method, SP.base_lr(w, method)) * mult:.6g}")
                flags = variant_flags(w, method, options, lr)
                store = None if args.runs_dir is None else os.path.join(
                    args.runs_dir, store_name(S, seed, name, method, lr, factor == "baseline") + ".json")
                row = {"factor": factor, "variant": name, "method": method, "options": list(options), "lr": lr,
                       "seed": seed, "workers": S}
                try:
                    run = SP.launch(flags, S, seed, os.path.join(work, f"{name.replace('/', 'div')}-{seed}"), None,
                                    store, not args.stored_only)
                    row.update(row_of(run), measured_at=run.get("stored_at"))
                except SP.NotStored as e:
                    row["not_run"] = str(e)
                rows.append(row)
                bar.update(1)
        bar.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows, lrs


def analyse(args, rows: List[Dict[str, Any]]) -> Tuple[Dict[int, Optional[float]], List[str]]:
    """Adds each row's target, rounds to it and to LEVELS; returns the targets per seed and the findings."""
    targets = {}
    for r in rows:
        if r["variant"] == "localsgd" and r.get("final") is not None:
            targets[r["seed"]] = r["final"] + args.lm_margin
    for r in rows:
        if "bits_per_byte" not in r:
            continue
        r["target"] = targets.get(r["seed"])
        r["rounds_to_target"] = rounds_to(r["bits_per_byte"], r["target"])
        r["rounds_to"] = {f"{lv:g}": rounds_to(r["bits_per_byte"], lv) for lv in LEVELS}
    return targets, findings(rows)


def _final(rows, variant) -> Optional[float]:
    v = [r["final"] for r in rows if r["variant"] == variant and r.get("final") is not None]
    return sum(v) / len(v) if v else None


def findings(rows: List[Dict[str, Any]]) -> List[str]:
    """One sentence per comparison: the variant's mean final bits per byte against its baseline's."""
    out = []
    base_of = {"localsgd-reset": "localsgd", "resist-aggregate": "resist", "ist-ffn-aggregate": "ist-ffn",
               "ist-heads-aggregate": "ist-heads", "ist-ffn-lr/3": "ist-ffn", "ist-heads-lr/3": "ist-heads"}
    local = _final(rows, "localsgd")
    for variant, base in base_of.items():
        a, b = _final(rows, variant), _final(rows, base)
        if a is None or b is None:
            continue
        gap = "" if local is None or base == "localsgd" else \
            f"; its gap to local SGD ({local:.3f}) goes from {b - local:+.3f} to {a - local:+.3f}"
        out.append(f"{variant}: final {a:.3f} bits per byte against {base}'s {b:.3f} ({a - b:+.3f}){gap}.")
    return out


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec)


def markdown(args, rows, targets, lines, lrs) -> str:
    w = SP.workload(argparse.Namespace(quick=args.quick, rounds=None, local_steps=None), "lm")
    md = ["# Why the subnetwork methods end above local SGD on the language model (`lm_ablation`)", "",
          f"{w['model']} on {w['dataset']}, AdamW, S = {args.workers} processes over loopback, {w['rounds']} rounds "
          f"of {w['local_steps']} local steps "
          "(speed's lm workload); each method at speed's tuned lr"
          + ("" if lrs else " (none found: the workload's lr)") + ". Target: local SGD's final + "
          f"{args.lm_margin:g} bits per byte (" + ", ".join(f"seed {s}: {_fmt(t)}" for s, t in sorted(targets.items()))
          + ").", "",
          "| factor | variant | lr | options | seed | final bpb | rounds to target | to 3.0 / 2.9 | s / round | "
          "MB / round |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "not_run" in r:
            md.append(f"| {r['factor']} | {r['variant']} | {r['lr']:g} | {' '.join(r['options']) or '—'} | "
                      f"{r['seed']} | not run | | | | |")
            continue
        rt = r["rounds_to"]
        md.append(f"| {r['factor']} | {r['variant']} | {r['lr']:g} | {' '.join(r['options']) or '—'} | {r['seed']} | "
                  f"{_fmt(r['final'])} | {_fmt(r['rounds_to_target'], 'd')} | "
                  f"{_fmt(rt['3'], 'd')} / {_fmt(rt['2.9'], 'd')} | {_fmt(r['mean_round_s'], '.2f')} | "
                  f"{_fmt(r['mb_per_round'], '.1f')} |")
    md += ["", "## Findings", ""] + [f"- {s}" for s in lines]
    return "\n".join(md)


def plot(rows, targets):
    fig, axes = C.figure(2, 1, size=(5.5, 3.8))
    for ax, factor in zip(axes, FACTORS):
        for r in rows:
            if r["factor"] not in ("baseline", factor) or "bits_per_byte" not in r:
                continue
            ls = "-" if r["factor"] == "baseline" else "--"
            ax.plot(range(1, len(r["bits_per_byte"]) + 1), r["bits_per_byte"], ls,
                    label=f"{r['variant']} (seed {r['seed']})")
        for t in sorted(set(v for v in targets.values() if v is not None)):
            ax.axhline(t, color="grey", lw=0.8, ls=":")
        ax.set_ylim(top=4.0)
        C.style_axis(ax, f"factor: {factor}", "round", "test bits per byte", legend=True)
    return fig


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    started = time.time()
    rows, lrs = run_variants(args)
    targets, lines = analyse(args, rows)
    C.write_outputs(args, "lm_ablation", {"rows": rows, "targets": targets, "picks": lrs, "findings": lines},
                    markdown(args, rows, targets, lines, lrs), plot(rows, targets), started)
    return 0
