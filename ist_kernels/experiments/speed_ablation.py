"""Issue 27: what costs the subnetwork methods their time to target in speed, factor by factor.

    python -m ist_kernels.experiments speed_ablation --workload lm|cnn [--workers S] [--factors ...]
                                                     [--runs-dir DIR]

One of ``speed``'s workloads, S real processes over loopback, every method at the learning rate
``speed``'s tuning picked (read from ``--speed-json``; the workload's lr where it has none). The
**baselines** are ``speed``'s own comparison runs (the same command line: with ``--runs-dir`` the
kept runs are read, not run again). Each factor (``--factors``) changes one thing of one method and
keeps the rest.

``lm`` (gpt_tiny on pycode, AdamW for every method, 40 rounds of 25 local steps; S = 4): why the
subnetwork methods end above local SGD. Baselines: local SGD, ResIST, IST of FFN units and of heads.

* ``state``: the subnetwork methods start every round's AdamW afresh (the trainer's default
  ``momentum_state=reset``, as paper 000's Algorithm 1 and the ResIST code, which aggregate only the
  weights), while local SGD's workers keep theirs. ResIST and both IST variants with
  ``momentum_state=aggregate`` (the two moments sliced with the weights and owner-averaged), and
  local SGD with ``momentum_state=reset`` (its AdamW cleared after every average): what the reset
  costs each, from both sides.
* ``lr``: both IST variants at a third of their pick, which was the tuning grid's lowest point.
* ``depth``: the model ResIST deals. ResIST shares a transformer's first and last blocks and deals the
  rest, each subnetwork at least one (paper 003 §2.2), so at gpt_tiny's 4 blocks and S = 4 a
  subnetwork keeps 3 of the 4 (its compute and bytes little under the full model's). Local SGD,
  ResIST and ResIST with its moments aggregated on a model of width 64 and 12 blocks (``DEEP``: about
  gpt_tiny's compute a step, three times its depth; a subnetwork keeps 4-5 of the 12), compared with
  local SGD on that model (its own target, ``REFERENCE``), at the lr each method picked on gpt_tiny.
* ``depth-lr``: that lr was tuned on gpt_tiny, not on the deeper model. Local SGD and ResIST with its
  moments on the deep model at three times and a third of it (local SGD also at twice it, the lr of
  ``depth-state``'s ResIST at twice); every deep variant is then measured
  against the deep local SGD with the best final on its seed (``reference_of``: the strongest baseline
  of the sweep, picked on the test split as every variant is scored).
* ``depth-state``: the optimizer state at a few bytes (issue 39) on the deep model: ResIST with its
  moments kept where they are (``momentum_state=local``: no bytes; at lr 3e-3 and twice it) and sent
  block-wise 8-bit / 4-bit (``int8-v4``), and IST of FFN units with theirs kept, each against the
  strongest deep local SGD of its seed (IST of heads cannot run there: width 64 has 2 heads, S = 4).

``cnn`` (preact ResNet-101 of width 16 on digits, 16 rounds of 8 local steps; S = 2): why LOFT takes
more rounds than local SGD. LOFT runs paper 000's pipeline: LOFT pre-training for
``pretrain_fraction`` of the rounds, 50% of the filters pruned, local SGD fine-tuning the pruned model.
Baselines: local SGD, LOFT, ResIST.

* ``pipeline``: local SGD through the same pipeline (paper 000's own baseline, ``localsgd
  --option pretrain_fraction=0.5 --prune-ratio 0.5``): what pruning and fine-tuning cost a dense
  pre-training, apart from LOFT's subnetworks.
* ``pretrain``: LOFT with ``pretrain_fraction`` 0.25, 0.75 and 1 (no pruning: LOFT throughout).
* ``state``: LOFT with ``momentum_state=aggregate`` (SGD momentum travels with the filters).
* ``bn``: how the model is scored. ``speed``'s CNN scores the full model with its BatchNorm
  statistics re-estimated on 20 training batches (``--eval-bn-batches 20``; training unchanged); the
  ``-stale`` variants of local SGD, LOFT and LOFT pre-training throughout score it with the running
  statistics training left (``--eval-bn-batches 0``, the trainer's default): whether a pre-trained
  model scores low because of its weights (the method) or because of running statistics gathered by
  the narrower subnetworks (the evaluation).

A run's **rounds to target** is the first round at or past the target: accuracy, ``--target-fraction``
(0.98) of local SGD's final (same seed); bits per byte, at or below local SGD's final plus
``--lm-margin`` (as in ``speed``); its **final** is the last round's. Outputs
``speed_ablation_<workload>_S<S>.{json,md,png}``: per variant its curve, final, rounds to target (and to
3.0 / 2.9 bits per byte on the lm), seconds per round, and a sentence per comparison on what it moves.
"""
import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tqdm import tqdm

from ..distributed import cost
from ..train.methods import available_methods, get_method
from . import harness as C
from .harness import link as L
from .harness.analysis import mean, predict, rounds_to_target, time_through, time_to_target
from .harness.launch import curve, launch, run_over_links
from .harness.store import NotStored
from .harness.workload import base_lr, higher_is_better, method_flags
from .speed import LM_MARGIN, workload

STALE = ("--eval-bn-batches", "0")  # the bn factor's flags: the running statistics as training left them
#: the depth factor's model (after the workload's --width / --depth; the last value is the one taken): about
#: gpt_tiny's compute a step (192 vs 196 ms, one thread, batch 16 x 128), three times its depth
DEEP = ("--width", "64", "--depth", "12")
#: per workload: (factor, variant name, the workload's method, --option values in place of or beside the
#: workload's, more trainer flags, lr multiplier of the pick); factor "baseline": speed's own run
Variant = Tuple[str, str, str, Tuple[str, ...], Tuple[str, ...], float]
VARIANTS: Dict[str, Tuple[Variant, ...]] = {
    "lm": (
        ("baseline", "localsgd", "localsgd", (), (), 1.0),
        ("baseline", "resist", "resist", (), (), 1.0),
        ("baseline", "ist-ffn", "ist-ffn", (), (), 1.0),
        ("baseline", "ist-heads", "ist-heads", (), (), 1.0),
        ("state", "localsgd-reset", "localsgd", ("momentum_state=reset",), (), 1.0),
        ("state", "resist-aggregate", "resist", ("momentum_state=aggregate",), (), 1.0),
        ("state", "ist-ffn-aggregate", "ist-ffn", ("momentum_state=aggregate",), (), 1.0),
        ("state", "ist-heads-aggregate", "ist-heads", ("momentum_state=aggregate",), (), 1.0),
        ("lr", "ist-ffn-lr/3", "ist-ffn", (), (), 1 / 3),
        ("lr", "ist-heads-lr/3", "ist-heads", (), (), 1 / 3),
        ("depth", "localsgd-deep", "localsgd", (), DEEP, 1.0),
        ("depth", "resist-deep", "resist", (), DEEP, 1.0),
        ("depth", "resist-deep-aggregate", "resist", ("momentum_state=aggregate",), DEEP, 1.0),
        ("depth-lr", "localsgd-deep-lrx3", "localsgd", (), DEEP, 3.0),
        ("depth-lr", "resist-deep-aggregate-lrx3", "resist", ("momentum_state=aggregate",), DEEP, 3.0),
        ("depth-lr", "localsgd-deep-lr/3", "localsgd", (), DEEP, 1 / 3),
        ("depth-lr", "resist-deep-aggregate-lr/3", "resist", ("momentum_state=aggregate",), DEEP, 1 / 3),
        ("depth-lr", "localsgd-deep-lrx2", "localsgd", (), DEEP, 2.0),
        ("depth-state", "resist-deep-local", "resist", ("momentum_state=local",), DEEP, 1.0),
        ("depth-state", "resist-deep-int8", "resist", ("momentum_state=int8-v4",), DEEP, 1.0),
        ("depth-state", "resist-deep-local-lrx2", "resist", ("momentum_state=local",), DEEP, 2.0),
        ("depth-state", "ist-ffn-deep-local", "ist-ffn", ("momentum_state=local",), DEEP, 1.0),
    ),
    "cnn": (
        ("baseline", "localsgd", "localsgd", (), (), 1.0),
        ("baseline", "loft", "loft", (), (), 1.0),
        ("baseline", "resist", "resist", (), (), 1.0),
        ("pipeline", "localsgd-pipeline", "localsgd", ("pretrain_fraction=0.5",), ("--prune-ratio", "0.5"), 1.0),
        ("pretrain", "loft-pretrain0.25", "loft", ("pretrain_fraction=0.25",), (), 1.0),
        ("pretrain", "loft-pretrain0.75", "loft", ("pretrain_fraction=0.75",), (), 1.0),
        ("pretrain", "loft-pretrain1", "loft", ("pretrain_fraction=1",), (), 1.0),
        ("state", "loft-aggregate", "loft", ("momentum_state=aggregate",), (), 1.0),
        ("bn", "localsgd-stale", "localsgd", (), STALE, 1.0),
        ("bn", "loft-stale", "loft", (), STALE, 1.0),
        ("bn", "loft-pretrain1-stale", "loft", ("pretrain_fraction=1",), STALE, 1.0),
    ),
}
#: what each variant is compared with (its baseline)
BASE_OF = {"localsgd-reset": "localsgd", "resist-aggregate": "resist", "ist-ffn-aggregate": "ist-ffn",
           "ist-heads-aggregate": "ist-heads", "ist-ffn-lr/3": "ist-ffn", "ist-heads-lr/3": "ist-heads",
           "localsgd-pipeline": "localsgd", "loft-pretrain0.25": "loft", "loft-pretrain0.75": "loft",
           "loft-pretrain1": "loft", "loft-aggregate": "loft", "localsgd-stale": "localsgd", "loft-stale": "loft",
           "loft-pretrain1-stale": "loft-pretrain1", "localsgd-deep": "localsgd", "resist-deep": "localsgd-deep",
           "resist-deep-aggregate": "resist-deep", "localsgd-deep-lrx3": "localsgd-deep",
           "localsgd-deep-lr/3": "localsgd-deep", "localsgd-deep-lrx2": "localsgd-deep", "resist-deep-aggregate-lrx3": "resist-deep-aggregate",
           "resist-deep-aggregate-lr/3": "resist-deep-aggregate", "resist-deep-local": "resist-deep-aggregate",
           "resist-deep-int8": "resist-deep-aggregate", "resist-deep-local-lrx2": "resist-deep-local",
           "ist-ffn-deep-local": "localsgd-deep"}
#: the depth factor's local SGD runs: gpt_tiny's pick and the depth-lr factor's three times, a third and twice it
DEEP_LOCAL = ("localsgd-deep", "localsgd-deep-lrx3", "localsgd-deep-lr/3", "localsgd-deep-lrx2")
#: the local SGD run whose final sets a variant's target (same seed) and whose time it is compared with: a
#: variant on another model than the workload's has its own (default: the baseline ``localsgd``); of several
#: candidates, the one with the best final on that seed among those that ran (``reference_of``)
REFERENCE: Dict[str, Tuple[str, ...]] = {
    v: DEEP_LOCAL for v in (*DEEP_LOCAL, "resist-deep", "resist-deep-aggregate", "resist-deep-aggregate-lrx3",
                            "resist-deep-aggregate-lr/3", "resist-deep-local", "resist-deep-int8",
                            "resist-deep-local-lrx2", "ist-ffn-deep-local")}
#: factors that change the model: their variants' compute is their own in the cost model's prediction
MODEL_FACTORS = ("depth", "depth-lr", "depth-state")
WORKERS = {"lm": 4, "cnn": 2}
LINK = {"lm": "10mbit", "cnn": "100mbit"}  # --link's default per workload (speed's slowest link for it)
#: factors whose variants train exactly as their method's speed run (they change only what is scored)
EVAL_ONLY = ("baseline", "bn")  # --workers' default per workload (the S where a bar was missed)
QUICK_METHODS = {"lm": ("localsgd", "ist-ffn"), "cnn": ("localsgd", "loft")}  # --quick: these methods' variants
LEVELS = {"lm": (3.3, 3.2, 3.0, 2.9)}  # bits per byte: rounds (and predicted time) to each, beside the target's


def factors(workload: str) -> List[str]:
    return list(dict.fromkeys(v[0] for v in VARIANTS[workload] if v[0] != "baseline"))


def parser() -> argparse.ArgumentParser:
    p = C.parser("speed_ablation", __doc__, seeds=(0,), quick="speed's --quick workload: 3 rounds, S=2, two "
                                                              "methods' variants")
    p.add_argument("--workload", choices=sorted(VARIANTS), default="lm", help="speed's workload (default %(default)s)")
    p.add_argument("--workers", type=int, default=None,
                   help="S, the worker processes (default: lm 4, cnn 2; --quick: 2)")
    p.add_argument("--factors", type=C.names, default=None,
                   help="factors to run beside the baselines (default: all of the workload's: "
                        + "; ".join(f"{w}: {','.join(factors(w))}" for w in sorted(VARIANTS)) + ")")
    p.add_argument("--variants", type=C.names, default=None,
                   help="run only these variants of the factors (the others are read where kept, else not run; "
                        "default: every variant of the factors)")
    p.add_argument("--speed-json", default=os.path.join("results", "speed.json"),
                   help="speed's output whose tuning gives each method's lr (default %(default)s; missing: the "
                        "workload's lr)")
    p.add_argument("--runs-dir", default=None, metavar="DIR",
                   help="keep every run here and reuse a kept run with the same command, S and seed (speed's "
                        "--runs-dir: its kept comparison runs are the baselines)")
    p.add_argument("--stored-only", action="store_true", help="run nothing: read the kept runs (missing: not_run)")
    p.add_argument("--link", default=None,
                   help="the link whose kept runs (in --runs-dir) time the baselines and the variants that change "
                        "only the evaluation (default: lm 10mbit, cnn 100mbit)")
    p.add_argument("--emulate", type=C.names, default=[], metavar="LINK[,LINK]",
                   help="emulated links (e.g. 10mbit,100mbit; needs root: network namespaces) over which the variants "
                        "of the model factors among --factors and the local SGD runs they are measured against run "
                        "again, seeds --emulate-seeds: their measured time to target beside the cost model's "
                        "prediction from the loopback run, and its error (default: none)")
    p.add_argument("--emulate-seeds", type=C.ints, default=[0], help="the seeds of --emulate (default 0)")
    p.add_argument("--emulate-variants", type=C.names, default=None,
                   help="--emulate only these variants and their reference local SGD runs (default: every variant "
                        "of the model factors that ran)")
    p.add_argument("--lm-margin", type=float, default=LM_MARGIN,
                   help="lm: target = local SGD's final bits per byte plus this (default %(default)s)")
    p.add_argument("--target-fraction", type=float, default=0.98,
                   help="accuracy: target = this fraction of local SGD's final accuracy (default %(default)s)")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    C.check_args(p, args)
    known = factors(args.workload)
    args.factors = known if args.factors is None else args.factors
    bad = [f for f in args.factors if f not in known]
    if bad:
        p.error(f"--factors: unknown {', '.join(bad)} for --workload {args.workload}; expected some of "
                f"{', '.join(known)}")
    if args.workers is None:
        args.workers = 2 if args.quick else WORKERS[args.workload]
    for link in args.emulate:
        try:
            L.parse_rate(link)
        except ValueError as e:
            p.error(f"--emulate: {e}")
    known_variants = {v[1] for v in VARIANTS[args.workload]}
    for opt in ("variants", "emulate_variants"):
        bad = [v for v in getattr(args, opt) or () if v not in known_variants]
        if bad:
            p.error(f"--{opt.replace('_', '-')}: unknown {', '.join(bad)} for --workload {args.workload}")
    if args.link is None:
        args.link = LINK[args.workload]
    if args.workers < 2:
        p.error(f"--workers: expected at least 2 (subnetworks need 2 or more workers), got {args.workers}")
    if args.stored_only and args.runs_dir is None:
        p.error("--stored-only needs --runs-dir")
    return args


def picks(path: str, workload: str, S: int) -> Dict[str, float]:
    """Each method's picked lr on ``workload`` at S from ``speed.json``'s tuning (empty when missing)."""
    try:
        with open(path) as f:
            tuning = json.load(f).get("tuning", {}).get(workload, {})
    except (OSError, ValueError):
        return {}
    return {m: t[str(S)]["pick"] for m, t in tuning.items() if str(S) in t and t[str(S)].get("pick") is not None}


def with_options(flags: Sequence[str], options: Sequence[str]) -> List[str]:
    """``flags`` with ``--option KEY=VALUE`` for each of ``options``, in place of a value the flags give KEY."""
    keys = {o.split("=", 1)[0] for o in options}
    out: List[str] = []
    it = iter(flags)
    for f in it:
        if f == "--option":
            o = next(it)
            if o.split("=", 1)[0] not in keys:
                out += [f, o]
        else:
            out.append(f)
    for o in options:
        out += ["--option", o]
    return out


def variant_flags(w: Dict[str, Any], method: str, options: Sequence[str], extra: Sequence[str],
                  lr: float) -> List[str]:
    """speed's comparison-run flags of ``method`` at ``lr`` (so a baseline is speed's own run), with ``options``
    and the ``extra`` flags."""
    return with_options(method_flags(w, method, "none", lr), options) + list(extra)


def store_name(workload: str, S: int, seed: int, name: str, method: str, lr: float, baseline: bool,
               link: str = "loopback") -> str:
    """A baseline's kept name is speed's comparison run's over ``link``; a variant's its own."""
    if baseline:
        return f"{workload}-{S}-{link}-{method}-none-{seed}-lr{lr:g}"
    return f"ablate-{workload}-{S}-{link}-{name.replace('/', 'div')}-{seed}-lr{lr:g}"


def _workload(args) -> Dict[str, Any]:
    return workload(argparse.Namespace(quick=args.quick, rounds=None, local_steps=None), args.workload)


def row_of(run: Dict[str, Any], metric: str) -> Dict[str, Any]:
    c = curve(run)
    values = c[metric]
    return {"values": values, "round_s": c["round_s"], "final": values[-1] if values else None, "curve": c,
            "mean_round_s": mean(c["round_s"]), "mb_per_round": mean([b / 1e6 for b in c["bytes"]]),
            "phase": c["phase"]}


def run_variants(args) -> Tuple[List[Dict[str, Any]], Dict[str, float]]:
    w = _workload(args)
    S, metric = args.workers, w["metric"]
    lrs = {} if args.quick else picks(args.speed_json, args.workload, S)
    todo = [v for v in VARIANTS[args.workload] if (v[0] == "baseline" or v[0] in args.factors)
            and (not args.quick or v[2] in QUICK_METHODS[args.workload])]
    rows: List[Dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="ist-speed-ablation-")
    try:
        bar = tqdm(total=len(todo) * len(args.seeds), desc="speed_ablation", unit="run", file=sys.stderr)
        for seed in args.seeds:
            for factor, name, method, options, extra, mult in todo:
                lr = float(f"{lrs.get(method, base_lr(w, method)) * mult:.6g}")
                flags = variant_flags(w, method, options, extra, lr)
                store = None if args.runs_dir is None else os.path.join(
                    args.runs_dir, store_name(args.workload, S, seed, name, method, lr, factor == "baseline") + ".json")
                row = {"workload": args.workload, "factor": factor, "variant": name, "method": method,
                       "options": list(options), "flags": list(extra), "lr": lr, "seed": seed, "workers": S,
                       "metric": metric, "trainer_flags": flags}
                chosen = factor == "baseline" or args.variants is None or name in args.variants
                try:
                    run = launch(flags, S, seed, os.path.join(work, f"{name.replace('/', 'div')}-{seed}"), None,
                                 store, chosen and not args.stored_only)
                    row.update(row_of(run, metric), measured_at=run.get("stored_at"))
                except NotStored as e:
                    row["not_run"] = str(e) if chosen else "not among --variants, and not kept"
                except RuntimeError as e:  # a run that failed or timed out: the rest still run
                    row["not_run"] = f"failed: {str(e)[-500:]}"
                rows.append(row)
                bar.update(1)
        bar.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows, lrs


def target(args, w: Dict[str, Any], local_final: float) -> float:
    """speed's target from local SGD's final (same seed), with this experiment's margin and fraction."""
    return args.target_fraction * local_final if higher_is_better(w) else local_final + args.lm_margin


def candidates(variant: str) -> Tuple[str, ...]:
    """The local SGD runs that may be ``variant``'s reference (``REFERENCE``; default the baseline)."""
    return REFERENCE.get(variant, ("localsgd",))


def reference_of(rows: List[Dict[str, Any]], variant: str, seed: int, higher: bool) -> str:
    """The local SGD run ``variant`` is measured against on ``seed``: of its ``candidates`` that ran on that
    seed, the one with the best final (the strongest baseline: an lr sweep's pick, scored on the test split
    as every variant is); none ran: the first."""
    cands = candidates(variant)
    ran = [r for r in rows if r["variant"] in cands and r["seed"] == seed and r.get("final") is not None]
    if not ran:
        return cands[0]
    return (max if higher else min)(ran, key=lambda r: r["final"])["variant"]


def analyse(args, rows: List[Dict[str, Any]]) -> Tuple[Dict[int, float], List[str]]:
    """Adds each row's target (and the ``reference`` run that sets it), rounds to it (and to the workload's
    LEVELS); returns the targets per seed and the findings."""
    w = _workload(args)
    higher = higher_is_better(w)
    refs = {c for v in [r["variant"] for r in rows] + ["localsgd"] for c in candidates(v)}
    of = {(r["variant"], r["seed"]): target(args, w, r["final"]) for r in rows
          if r["variant"] in refs and r.get("final") is not None}
    targets = {seed: t for (v, seed), t in of.items() if v == "localsgd"}
    for r in rows:
        if "values" not in r:
            continue
        r["reference"] = reference_of(rows, r["variant"], r["seed"], higher)
        r["target"] = of.get((r["reference"], r["seed"]))
        r["rounds_to_target"] = rounds_to_target(r["values"], r["target"], higher)
        r["rounds_to"] = {f"{lv:g}": rounds_to_target(r["values"], lv, higher) for lv in LEVELS.get(args.workload, ())}
    return targets, findings(rows)


def link_times(args, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per variant of an EVAL_ONLY factor whose every seed reached the target: its time to target over
    ``--link``, the training seconds of its method's kept run over that link (any seed; their mean)
    through the variant's mean rounds (``harness.analysis.time_through``); ``vs_localsgd``: against local SGD's of
    the same factor (the same evaluation)."""
    if args.runs_dir is None:
        return []
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows if r["factor"] in EVAL_ONLY and not r["options"]):
        rs = [r for r in rows if r["variant"] == variant]
        k, reached, ran = _mean_of(rows, variant, "rounds_to_target")
        r0 = rs[0]
        pattern = os.path.join(args.runs_dir, f"{args.workload}-{r0['workers']}-{args.link}-{r0['method']}-none-*-"
                                              f"lr{r0['lr']:g}.json")
        times = []
        for path in sorted(glob.glob(pattern)):
            with open(path) as f:
                kept = json.load(f)
            t = time_through({"curve": curve(kept)}, k) if k is not None and reached == ran else None
            if t is not None:
                times.append(t)
        out.append({"variant": variant, "factor": r0["factor"], "method": r0["method"], "link": args.link,
                    "mean_rounds_to_target": k if reached == ran else None, "link_runs": len(times),
                    "time_to_target_s": sum(times) / len(times) if times else None})
    for e in out:
        base = next((b for b in out if b["method"] == "localsgd" and b["factor"] == e["factor"]), None)
        e["vs_localsgd"] = (e["time_to_target_s"] / base["time_to_target_s"]
                            if base and e["time_to_target_s"] and base["time_to_target_s"] else None)
    return out


def compute_scale(r: Dict[str, Any], rows: List[Dict[str, Any]]) -> float:
    """How much slower ``r``'s machine ran than its reference local SGD run's (1: the same, or no way to
    tell): a run with warm-up rounds (ResIST's first rounds: local SGD on the full model, the reference's
    compute and bytes) against its reference of the same seed, the reference's mean round over the run's
    mean warm-up round. Multiplying the run's measured seconds by it puts both on the reference's machine
    (runs kept on another day, or beside other work, carry another machine speed)."""
    ref = next((x for x in rows if x["variant"] == r.get("reference") and x["seed"] == r["seed"] and "curve" in x),
               None)
    if ref is None or ref["variant"] == r["variant"]:
        return 1.0
    phases = get_method(r["method"]).phases if r["method"] in available_methods() else ()
    if "warmup" not in phases:
        return 1.0
    c = r["curve"]  # a round's phase: the index of its method's phase
    warm = [t for t, ph in zip(c["round_s"], c.get("phase") or ()) if ph == phases.index("warmup")]
    return mean(ref["curve"]["round_s"]) / mean(warm) if warm and ref["curve"]["round_s"] else 1.0


def _scaled(c: Dict[str, List], k: float) -> Dict[str, List]:
    """A curve's seconds (rounds, their parts, the waits) times ``k``."""
    if k == 1.0:
        return c
    return {**c, "round_s": [t * k for t in c["round_s"]],
            "parts": [{n: v * k for n, v in p.items()} for p in c["parts"]],
            "wait": [None if t is None else t * k for t in c.get("wait") or [None] * len(c["round_s"])]}


def predicted_times(args, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per variant whose every seed reached the target: the cost model's time to target over ``--link``
    (``harness.analysis.predict``: the compute, waits and loopback collectives of its method's baseline run of the
    same seed, so the variants' runs, made on a machine busy with other work, do not carry their own
    slower compute; a variant of a ``MODEL_FACTORS`` factor, on another model, its own), the link's time
    for the variant's own busiest link's bytes; within 15% of every emulated run so far), summed over
    that seed's rounds to target and averaged over the seeds; ``vs_localsgd``: against its ``reference``
    local SGD's (``REFERENCE``; default the baseline) the same way. ``predicted_time_to`` and
    ``vs_localsgd_to``: the same through the rounds to each of the workload's ``LEVELS``;
    ``predicted_round_s``: the mean predicted round; ``per_seed``: each seed's round, times and ratios
    (against its reference's same seed)."""
    w = _workload(args)
    link = cost.Link(L.parse_rate(args.link), 0.0)
    levels = [f"{lv:g}" for lv in LEVELS.get(args.workload, ())]

    def mean_through(rs, per_round, rounds_of):
        """The seeds' mean of each one's predicted seconds through its rounds (None: a seed not there)."""
        ks = [rounds_of(r) for r in rs]
        return None if any(k is None for k in ks) else sum(sum(p[:k]) for p, k in zip(per_round, ks)) / len(ks)

    def ratio(a, b):
        return a / b if a and b else None

    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant and "curve" in r]
        if not rs:
            continue
        per_round, scales = [], []
        for r in rs:
            b = r if r["factor"] in MODEL_FACTORS else next(
                (x for x in rows if x["factor"] == "baseline" and x["method"] == r["method"]
                 and x["seed"] == r["seed"] and "curve" in x), r)
            scales.append(compute_scale(b, rows) if b is r else 1.0)
            bc = _scaled(b["curve"], scales[-1])
            own = {"curve": {**bc, "busiest": r["curve"]["busiest"], "bytes": r["curve"]["bytes"]}}
            per_round.append(predict(own, {"curve": bc}, link, r["workers"], r["method"], w["local_steps"])[0])
        mb = [b / 1e6 for r in rs for b in r["curve"]["busiest"] if b is not None]
        out.append({"variant": variant, "factor": rs[0]["factor"], "link": args.link,
                    "predicted_time_to_target_s": mean_through(rs, per_round, lambda r: r.get("rounds_to_target")),
                    "predicted_time_to": {lv: mean_through(rs, per_round, lambda r: r.get("rounds_to", {}).get(lv))
                                          for lv in levels},
                    "predicted_round_s": sum(sum(p) for p in per_round) / sum(len(p) for p in per_round),
                    "per_seed": {r["seed"]: {"reference": r["reference"], "round_s": sum(p) / len(p) if p else None,
                                             "compute_scale": k,
                                             "time_to_target_s": mean_through([r], [p], lambda x: x.get("rounds_to_target")),
                                             "time_to": {lv: mean_through([r], [p], lambda x: x.get("rounds_to", {}).get(lv))
                                                         for lv in levels}}
                                 for r, p, k in zip(rs, per_round, scales)},
                    "busiest_link_mb_per_round": sum(mb) / len(mb) if mb else None})
    def mean_of(xs):
        return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)

    by = {e["variant"]: e for e in out}
    for e in out:
        refs = {}
        for seed, mine in e["per_seed"].items():  # the ratios seed by seed, against that seed's reference
            refs[seed] = by[mine["reference"]]["per_seed"].get(seed) if mine["reference"] in by else None
            ref = refs[seed]
            mine["vs_localsgd"] = ratio(mine["time_to_target_s"], ref and ref["time_to_target_s"])
            mine["round_vs_localsgd"] = ratio(mine["round_s"], ref and ref["round_s"])
            mine["vs_localsgd_to"] = {lv: ratio(mine["time_to"][lv], ref and ref["time_to"][lv]) for lv in levels}
        names = list(dict.fromkeys(m["reference"] for m in e["per_seed"].values()))
        e["reference"] = names[0] if len(names) == 1 else "/".join(names)
        # the means: the variant's over its seeds against its references' over the same seeds
        e["vs_localsgd"] = ratio(e["predicted_time_to_target_s"],
                                 mean_of([r and r["time_to_target_s"] for r in refs.values()]))
        e["vs_localsgd_to"] = {lv: ratio(e["predicted_time_to"][lv], mean_of([r and r["time_to"][lv] for r in refs.values()]))
                               for lv in levels}
    return out


def emulated_rows(args, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The loopback rows ``--emulate`` runs again: on ``--emulate-seeds``, the variants of the model factors
    among ``--factors`` that ran (only ``--emulate-variants`` when given) and the local SGD run each is measured
    against on its seed (its ``reference``)."""
    chosen = [r for r in rows if r["factor"] in MODEL_FACTORS and r["factor"] in args.factors and "curve" in r
              and r["seed"] in args.emulate_seeds
              and (args.emulate_variants is None or r["variant"] in args.emulate_variants)]
    want = {(r["variant"], r["seed"]) for r in chosen} | {(r["reference"], r["seed"]) for r in chosen}
    return [r for r in rows if (r["variant"], r["seed"]) in want and "curve" in r]


def run_emulated(args, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each of :func:`emulated_rows` over each ``--emulate`` link (S processes in network namespaces, the link
    shaped per rank: ``harness.link``), kept in ``--runs-dir`` like the loopback runs. Per run: its measured
    mean round and the cost model's (``harness.analysis.predict`` with the emulated run's own compute, and
    from the loopback run alone) with their errors, its rounds and training seconds to its loopback row's
    target, and those against its reference local SGD's over the same link and seed (``vs_localsgd``)."""
    if not args.emulate:
        return []
    reason = L.unavailable_reason()
    if reason:
        print(f"speed_ablation: --emulate: {reason}; no emulated runs", file=sys.stderr)
        return []
    w = _workload(args)
    higher = higher_is_better(w)
    todo = [(link, r["variant"], r["seed"]) for link in args.emulate for r in emulated_rows(args, rows)]
    by = {(r["variant"], r["seed"]): r for r in rows}
    work = tempfile.mkdtemp(prefix="ist-speed-ablation-emulated-")

    def one(c, em):
        link, variant, seed = c
        r = by[(variant, seed)]
        store = None if args.runs_dir is None else os.path.join(
            args.runs_dir, store_name(args.workload, r["workers"], seed, variant, r["method"], r["lr"], False, link)
            + ".json")
        run = launch(r["trainer_flags"], r["workers"], seed, os.path.join(work, f"{link}-{variant.replace('/', 'div')}-{seed}"),
                     em, store, not args.stored_only)
        return {"curve": curve(run), "stored_at": run.get("stored_at")}

    try:  # a run that fails, times out or (--stored-only) is not kept: its {"error": ...}
        done = run_over_links(todo, lambda c: (c[0], args.workers), one, "speed_ablation emulated")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = []
    for (link, variant, seed), res in done.items():
        r = by[(variant, seed)]
        e = {"link": link, "variant": variant, "factor": r["factor"], "seed": seed, "reference": r["reference"]}
        if "curve" not in res:
            out.append({**e, "error": res.get("error", "not run")})
            continue
        cv = res["curve"]
        with_compute, from_loop = predict(res, r, cost.Link(L.parse_rate(link), 0.0), r["workers"], r["method"],
                                          w["local_steps"])
        measured = sum(cv["round_s"]) / len(cv["round_s"])
        t, k = time_to_target(cv["round_s"], cv[w["metric"]], r["target"], higher)
        e.update(round_s=measured, predicted_round_s=sum(with_compute) / len(with_compute),
                 predicted_round_from_loopback_s=sum(from_loop) / len(from_loop),
                 final=cv[w["metric"]][-1], rounds_to_target=k, time_to_target_s=t, target=r["target"],
                 busiest_link_mb_per_round=mean([b / 1e6 for b in cv["busiest"] if b is not None]))
        e["prediction_error"] = e["predicted_round_s"] / measured - 1.0
        e["prediction_error_from_loopback"] = e["predicted_round_from_loopback_s"] / measured - 1.0
        out.append(e)
    got = {(e["link"], e["variant"], e["seed"]): e for e in out}
    for e in out:
        ref = got.get((e["link"], e["reference"], e["seed"]))
        mine, theirs = e.get("time_to_target_s"), ref and ref.get("time_to_target_s")
        e["vs_localsgd"] = mine / theirs if mine and theirs else None
        e["round_vs_localsgd"] = (e["round_s"] / ref["round_s"] if ref and ref.get("round_s") and e.get("round_s")
                                  else None)
    return sorted(out, key=lambda e: (L.parse_rate(e["link"]), e["seed"], e["variant"]))


def _mean_of(rows, variant, key) -> Tuple[Optional[float], int, int]:
    """(mean of ``key`` over the variant's seeds that have it, how many have it, how many ran)."""
    ran = [r for r in rows if r["variant"] == variant and "values" in r]
    v = [r[key] for r in ran if r.get(key) is not None]
    return (sum(v) / len(v) if v else None), len(v), len(ran)


def findings(rows: List[Dict[str, Any]]) -> List[str]:
    """One sentence per variant: its mean final and rounds to target against its baseline's and its reference
    local SGD's (each row's ``reference``, seed by seed: ``analyse``)."""
    out = []
    for variant, base in BASE_OF.items():
        a, _, na = _mean_of(rows, variant, "final")
        b, _, nb = _mean_of(rows, base, "final")
        if a is None or b is None:
            continue
        mine = [r for r in rows if r["variant"] == variant and "values" in r]
        ref = "/".join(dict.fromkeys(r["reference"] for r in mine))
        finals = [next((x["final"] for x in rows if x["variant"] == r["reference"] and x["seed"] == r["seed"]
                        and x.get("final") is not None), None) for r in mine]
        local = None if not finals or None in finals else sum(finals) / len(finals)
        ka, ra, _ = _mean_of(rows, variant, "rounds_to_target")
        kb, rb, _ = _mean_of(rows, base, "rounds_to_target")

        def reach(k, n_reached, n):
            return f"{n_reached}/{n} seeds reach the target" + (f" in {k:.1f} rounds (mean)" if k is not None else "")
        gap = "" if local is None or base == "localsgd" or base in candidates(variant) else \
            f"; gap to {ref}'s {local:.4g}: {b - local:+.3g} -> {a - local:+.3g}"
        out.append(f"{variant}: final {a:.4g} against {base}'s {b:.4g} ({a - b:+.3g}){gap}; "
                   f"{reach(ka, ra, na)} ({base}: {reach(kb, rb, nb)}).")
    return out


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec)


def markdown(args, rows, targets, lines, lrs, times=(), predicted=(), emulated=()) -> str:
    w = _workload(args)
    levels = LEVELS.get(args.workload, ())
    metric = "bits per byte" if w["metric"] == "bits_per_byte" else "accuracy"
    ran = {r["variant"] for r in rows if "values" in r}
    rule = (f"local SGD's final + {args.lm_margin:g} bits per byte" if not higher_is_better(w) else
            f"{args.target_fraction:g} x local SGD's final accuracy")
    md = [f"# What costs the subnetwork methods their time to target (`speed_ablation`, {args.workload})", "",
          f"{w['model']} on {w['dataset']}, S = {args.workers} processes over loopback, {w['rounds']} rounds of "
          f"{w['local_steps']} local steps (speed's {args.workload} workload); each method at speed's tuned lr"
          + ("" if lrs else " (none found: the workload's lr)") + f". Target: {rule} ("
          + ", ".join(f"seed {s}: {_fmt(t, '.4g')}" for s, t in sorted(targets.items())) + ")"
          + "".join(f"; {', '.join(sorted(k for k, x in REFERENCE.items() if x == cands and k in ran))}: "
                    + (f"{shown[0]}'s final" if len(shown) == 1 else
                       f"the best final of {', '.join(shown)} (the seed's)") + " plus the same, its own seed"
                    for cands in dict.fromkeys(REFERENCE.values())
                    for shown in [[c for c in cands if c in ran]] if shown) + ".", "",
          f"| factor | variant | lr | options and flags | seed | final {metric} | rounds to target | "
          + "".join(f"to {lv:g} | " for lv in levels) + "s / round | MB / round |",
          "|---|---|---|---|---|---|---|" + "---|" * len(levels) + "---|---|"]
    for r in rows:
        what = " ".join(r["options"] + r["flags"]) or "—"
        if "not_run" in r:
            md.append(f"| {r['factor']} | {r['variant']} | {r['lr']:g} | {what} | {r['seed']} | not run | |"
                      + " |" * len(levels) + " | |")
            continue
        md.append(f"| {r['factor']} | {r['variant']} | {r['lr']:g} | {what} | {r['seed']} | {_fmt(r['final'], '.4g')} | "
                  f"{_fmt(r['rounds_to_target'], 'd')} | "
                  + "".join(f"{_fmt(r['rounds_to'][f'{lv:g}'], 'd')} | " for lv in levels)
                  + f"{_fmt(r['mean_round_s'], '.2f')} | {_fmt(r['mb_per_round'], '.1f')} |")
    if times:
        md += ["", f"## Time to target over {args.link}", "",
               f"The variants that train as their method's `speed` run (baselines; the factors that change only "
               f"the evaluation): the training seconds of that method's kept run over {args.link} through the "
               f"seeds' mean rounds, against local SGD's under the same evaluation.", "",
               "| variant | mean rounds to target | time to target (s) | vs local SGD |", "|---|---|---|---|"]
        md += [f"| {e['variant']} | {_fmt(e['mean_rounds_to_target'], '.3g')} | "
               + ("not reached | " if e["mean_rounds_to_target"] is None else
                  f"{_fmt(e['time_to_target_s'], '.3g')} | " if e["link_runs"] else "no kept run | ")
               + f"{_fmt(e['vs_localsgd'], '.2f')} |" for e in times]
    if predicted:
        md += ["", f"## Predicted time to target over {args.link}", "",
               f"The cost model over {args.link}: the compute, waits and loopback collectives of the method's "
               "baseline run (same seed; a variant on another model: its own), the link's time for the variant's "
               "own busiest link's bytes, through the variant's rounds to target (or to each level) of that seed; mean over the "
               "seeds; against its reference local SGD's the same way. A run with warm-up rounds (ResIST: local "
               "SGD on the full model) has its seconds rescaled to its reference's machine (`compute scale`: the "
               "reference's mean round over the run's mean warm-up round; runs kept on another day or beside other "
               "work ran at another speed); other runs carry their own. "
               "A prediction from loopback runs carries their compute as measured (runs made beside other work "
               "are slower) and misses what the emulated link adds to a round's compute: where the table above "
               "has a measured time, it is the one to read.",
               "",
               "| variant | busiest link MB / round | s / round | predicted time to target (s) | vs local SGD | "
               + "".join(f"to {lv:g} (s, vs local SGD) | " for lv in levels) + "local SGD run | compute scale (seeds) |",
               "|---|---|---|---|---|" + "---|" * len(levels) + "---|---|"]

        def to(e, lv):
            t = e["predicted_time_to"].get(f"{lv:g}")
            return "—" if t is None else f"{t:.3g} ({_fmt(e['vs_localsgd_to'][f'{lv:g}'], '.2f')})"
        md += [f"| {e['variant']} | {_fmt(e['busiest_link_mb_per_round'], '.2f')} | {_fmt(e['predicted_round_s'], '.2f')} | "
               f"{_fmt(e['predicted_time_to_target_s'], '.3g')} | {_fmt(e['vs_localsgd'], '.2f')} | "
               + "".join(f"{to(e, lv)} | " for lv in levels) + f"{e['reference']} | "
               + " / ".join(f"{m.get('compute_scale', 1.0):.2f}" for m in e["per_seed"].values()) + " |"
               for e in predicted]
    if emulated:
        md += ["", "## Over emulated links", "",
               "The model factors' variants and their reference local SGD runs again with each rank's link shaped "
               "(`--emulate`): the measured mean round against the cost model's (with the run's own compute, and "
               "from the loopback run alone; error = predicted / measured - 1), and the measured training seconds "
               "to the loopback row's target against the reference's over the same link and seed.", "",
               "| link | variant | seed | s / round | predicted (error) | from loopback (error) | busiest link MB / round "
               "| final | rounds to target | time to target (s) | vs local SGD | round vs local SGD |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in emulated:
            if "error" in e:
                md.append(f"| {e['link']} | {e['variant']} | {e['seed']} | failed: {e['error'].splitlines()[-1][:120] if e['error'] else ''} "
                          "| | | | | | | | |")
                continue
            md.append(f"| {e['link']} | {e['variant']} | {e['seed']} | {e['round_s']:.2f} | "
                      f"{e['predicted_round_s']:.2f} ({e['prediction_error']:+.1%}) | "
                      f"{e['predicted_round_from_loopback_s']:.2f} ({e['prediction_error_from_loopback']:+.1%}) | "
                      f"{_fmt(e['busiest_link_mb_per_round'], '.2f')} | {_fmt(e['final'], '.4g')} | "
                      f"{_fmt(e['rounds_to_target'], 'd')} | {_fmt(e['time_to_target_s'], '.4g')} | "
                      f"{_fmt(e['vs_localsgd'], '.2f')} | {_fmt(e['round_vs_localsgd'], '.2f')} |")
    md += ["", "## Findings (means over the seeds)", ""] + [f"- {s}" for s in lines]
    return "\n".join(md)


def plot(args, rows, targets):
    w = _workload(args)
    facs = factors(args.workload)
    fig, axes = C.figure(len(facs), 1, size=(5.5, 3.8))
    for ax, factor in zip(axes, facs):
        shown = ((factor,) if factor in MODEL_FACTORS else ("baseline", factor))  # baselines: another model
        for r in rows:
            if r["factor"] not in shown or "values" not in r or r["seed"] != rows[0]["seed"]:
                continue
            ax.plot(range(1, len(r["values"]) + 1), r["values"], "-" if r["factor"] == "baseline" else "--",
                    label=r["variant"])
        t = next((r.get("target") for r in rows if r["factor"] == factor and r["seed"] == rows[0]["seed"]
                  and r.get("target") is not None), None) if factor in MODEL_FACTORS else targets.get(rows[0]["seed"])
        if t is not None:
            ax.axhline(t, color="grey", lw=0.8, ls=":")
        if w["metric"] == "bits_per_byte":
            ax.set_ylim(top=4.0)
        C.style_axis(ax, f"{args.workload}, factor: {factor} (seed {rows[0]['seed']})", "round",
                     "test " + w["metric"].replace("_", " "), legend=True)
    return fig


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    started = time.time()
    rows, lrs = run_variants(args)
    targets, lines = analyse(args, rows)
    times, predicted = link_times(args, rows), predicted_times(args, rows)
    emulated = run_emulated(args, rows)
    C.write_outputs(args, f"speed_ablation_{args.workload}_S{args.workers}",
                    {"workload": args.workload, "rows": rows, "targets": targets, "picks": lrs, "findings": lines,
                     "link_times": times, "predicted": predicted, "emulated": emulated},
                    markdown(args, rows, targets, lines, lrs, times, predicted, emulated), plot(args, rows, targets),
                    started)
    return 0
