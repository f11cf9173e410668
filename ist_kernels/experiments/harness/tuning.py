"""The learning-rate tuning: per (workload, method, S) a grid of multiples of the workload's lr, each
point a run of the comparison run's schedule stopped early and scored on a held-out part of the
training set (never the test split); the pick is the best score, ties to the smaller lr
(:data:`TUNE_RULE`)."""
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .launch import launch, run_over_links
from .options import number_list
from .store import run_path
from .workload import base_lr, method_flags

#: --lr-grid's default: multiples of the workload's learning rate tried for every (workload, method, S)
LR_GRID = (1 / 3, 1.0, 3.0, 10.0)
TUNE_HOLDOUT = 0.2  # --tune-holdout's default: the fraction of the training set the tuning runs score
#: the tuning score, by the first key the scored rounds have: (metric, higher is better)
TUNE_METRICS = (("bits_per_byte", False), ("bits_per_token", False), ("accuracy", True), ("test_loss", False))
TUNE_RULE = ("each grid point: the comparison run's schedule stopped after the tuning rounds, over loopback, "
             "uncompressed, first seed, with --holdout F (scored after every round on the held-out part of the "
             "training set, never the test split); score: the best held-out score in those rounds (highest accuracy; "
             "language models: lowest bits per byte); pick: the best score, ties to the smaller lr; a failed or "
             "non-finite run has no score; no score at all: the workload's lr; a one-point grid is not run")


def fraction(v: str) -> float:
    """A number or a fraction a/b (argparse: --lr-grid 1/3,1,3,10)."""
    num, _, den = v.strip().partition("/")
    x = float(num) / float(den) if den else float(num)
    if not (x > 0 and x < float("inf")):
        raise ValueError(v)
    return x


lr_multipliers = number_list(fraction, "number > 0 (or fraction a/b)")


def lr_grid(w: Dict[str, Any], method: str, multipliers: Sequence[float]) -> List[float]:
    """The learning rates tuned for ``method`` on ``w``: ``base_lr`` times each multiplier (6
    significant digits), increasing, without repeats."""
    base = base_lr(w, method)
    return sorted({float(f"{base * m:.6g}") for m in multipliers})


def lr_grid_of(args, config: str, method: Optional[str] = None) -> List[float]:
    """The lr grid's multipliers of ``method`` on workload ``config``: its --lr-grid-of
    ``config:method``, else ``config``'s, else --lr-grid."""
    per = getattr(args, "lr_grid_of", {})
    return per.get(f"{config}:{method}", per.get(config, args.lr_grid))


def tune_rounds(args, w: Dict[str, Any]) -> int:
    """Rounds of a tuning run: --tune-rounds (at most the workload's), else half the workload's
    (all of them with --quick)."""
    if args.tune_rounds is not None:
        return min(args.tune_rounds, w["rounds"])
    return w["rounds"] if args.quick else max(1, w["rounds"] // 2)


def tune_score(metrics: Sequence[Dict[str, Any]], rounds: int) -> Tuple[Optional[str], Optional[float], bool]:
    """(metric, score, higher is better) of a tuning run's metrics.jsonl rows: the best held-out score
    of rounds 1..``rounds`` in the first metric of :data:`TUNE_METRICS` they have. The score is None
    when a training loss or a score in those rounds is not finite (diverged) or nothing was scored."""
    rows = [m for m in metrics if 1 <= m.get("round", 0) <= rounds]
    scored = [m for m in rows if "test_loss" in m]
    metric, higher = next(((k, h) for k, h in TUNE_METRICS if any(k in m for m in scored)), (None, True))
    if metric is None:
        return None, None, True
    values = [m.get(metric) for m in scored]
    losses = [m.get("train_loss") for m in rows]
    if any(v is None or not math.isfinite(v) for v in values + losses):
        return metric, None, higher
    return metric, (max(values) if higher else min(values)), higher


def pick_lr(lrs: Sequence[float], scores: Sequence[Optional[float]], higher_is_better: bool = True
            ) -> Optional[float]:
    """The tuning rule: the lr of the best score (highest, or lowest with ``higher_is_better``
    False), ties to the smaller lr; points without a score (None, non-finite) never win; None when
    no point has one."""
    best = None
    for lr, sc in sorted(zip(lrs, scores), key=lambda t: t[0]):
        if sc is None or not math.isfinite(sc):
            continue
        if best is None or (sc > best[1] if higher_is_better else sc < best[1]):
            best = (lr, sc)
    return None if best is None else best[0]


def tuning_keys(todo: Sequence[Tuple]) -> List[Tuple[str, str, int]]:
    """The (config, method, S) of the comparison cells, each once."""
    return sorted({(c[0], c[3], c[1]) for c in todo})


def tune(args, todo: Sequence[Tuple], work: str, workloads: Dict[str, Dict[str, Any]]
         ) -> Tuple[Dict[str, Any], Dict[Tuple, float], List[str]]:
    """Tune the lr of every (config, method, S) of ``todo``, the (config, S, link, method, compress, seed)
    cells of the comparison runs, ``workloads[config]`` each config's workload (the rule:
    :data:`TUNE_RULE`). ``args``: ``seeds`` (the first is tuned), ``lr_grid`` and ``lr_grid_of``
    (:func:`lr_grid_of`), ``tune_rounds``, ``quick``, ``tune_holdout``, ``runs_dir`` and ``stored_only``
    (the run store). Runs go under ``work``. Returns the JSON's ``tuning`` ({config: {method: {S:
    entry}}}), the picks {(config, method, S): lr} and the errors of failed tuning runs."""
    seed = args.seeds[0]
    grids = {k: lr_grid(workloads[k[0]], k[1], lr_grid_of(args, k[0], k[1])) for k in tuning_keys(todo)}
    cells_ = [(config, S, "loopback", method, lr, seed) for (config, method, S), g in grids.items() if len(g) > 1
              for lr in g]

    def one(c, em):
        config, S, _, method, lr, sd = c
        w = workloads[config]
        flags = method_flags(w, method, "none", lr) + ["--stop-after", str(tune_rounds(args, w)),
                                                      "--holdout", f"{args.tune_holdout:g}"]
        name = "tune-" + "-".join(map(str, c))
        run = launch(flags, S, sd, os.path.join(work, name), em, run_path(args.runs_dir, name), not args.stored_only)
        split = {m.get("scored_on") for m in run["metrics"] if "test_loss" in m}
        if split != {"holdout"}:
            raise RuntimeError(f"a tuning run scored {sorted(map(str, split))}, not the held-out split")
        return {"metrics": run["metrics"], "summary": run["summary"]}

    results = run_over_links(cells_, lambda c: ("loopback", c[1]), one, "speed: tuning") if cells_ else {}
    tuning: Dict[str, Any] = {}
    picks: Dict[Tuple, float] = {}
    errors: List[str] = []
    for (config, method, S), grid in grids.items():
        w = workloads[config]
        rounds = tune_rounds(args, w)
        scores, metric, higher, errs = [], None, True, []
        for lr in grid:
            r = results.get((config, S, "loopback", method, lr, seed))
            if r is None:  # a one-point grid: not run
                scores.append(None)
                continue
            if "error" in r:
                errs.append(f"lr {lr:g}: {r['error'].splitlines()[-1] if r['error'] else ''}")
                scores.append(None)
                continue
            metric, sc, higher = tune_score(r["metrics"], rounds)
            scores.append(sc)
        pick = grid[0] if len(grid) == 1 else pick_lr(grid, scores, higher)
        fallback = pick is None
        if fallback:
            pick = base_lr(w, method)
        picks[(config, method, S)] = pick
        errors += [f"tuning {config}/{method}/S={S}: {e}" for e in errs]
        tuning.setdefault(config, {}).setdefault(method, {})[str(S)] = {
            "base_lr": base_lr(w, method), "multipliers": list(lr_grid_of(args, config, method)), "grid": grid,
            "scores": scores,
            "metric": metric, "higher_is_better": higher, "pick": pick, "pick_multiplier": pick / base_lr(w, method),
            "ran": len(grid) > 1, "fallback": fallback, "rounds": rounds, "holdout": args.tune_holdout,
            "seed": seed, "rule": TUNE_RULE, "errors": errs}
    return tuning, picks, errors
