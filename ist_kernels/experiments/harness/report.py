"""The experiments' outputs: ``<out>/<name>.json`` (options, environment, raw results),
``.md`` and ``.png`` (:func:`write_outputs`), the figure and its panels' style, and the
markdown tables of runs of the trainer: the tuning, the per-seed summary, the runs themselves.

The JSON holds only finite numbers: a value that diverged is ``null`` and is listed under
``"divergences"`` with what diverged, its seed, learning rate and step."""
import calendar
import json
import math
import os
import platform
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

from .analysis import BLOW_UP
from .store import STORED_AT
from .tuning import TUNE_RULE

# ---------------------------------------------------------------- outputs

JSON_DIGITS = 6  # significant digits of the floats in the JSON outputs


def jsonable(obj, digits: int = 0):
    """obj with tuples as lists, tensors/arrays as lists, non-finite floats as None; with
    ``digits`` every float rounded to that many significant digits."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return float(f"{obj:.{digits}g}") if digits else obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, digits) for v in obj]
    if hasattr(obj, "tolist"):
        return jsonable(obj.tolist(), digits)
    return obj


def write_outputs(args, name: str, results: Dict[str, Any], markdown: str, fig, started: float) -> Dict[str, str]:
    """Write ``<out>/<name>.json`` (the options, environment and raw results), ``.md`` and ``.png``;
    print the markdown and the paths. Returns {"json", "md", "png"} paths."""
    import torch

    os.makedirs(args.out, exist_ok=True)
    paths = {ext: os.path.join(args.out, f"{name}.{ext}") for ext in ("json", "md", "png")}
    wall = time.time() - started
    options = {k: v for k, v in vars(args).items() if k not in ("out",)}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    payload = {"experiment": name, "options": options, "seeds": list(args.seeds), "wall_time_s": wall,
               "environment": {"torch": torch.__version__, "python": platform.python_version(),
                               "machine": platform.machine(), "cpus": os.cpu_count(),
                               "torch_threads": torch.get_num_threads(), "load_average_1min_at_end": load},
               **results}
    with open(paths["json"], "w") as f:  # one line per top-level entry: readable diffs, small files
        doc = jsonable(payload, JSON_DIGITS)
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, allow_nan=False, separators=(',', ':'))}"
                                    for k, v in doc.items()) + "\n}\n")
    md = markdown.rstrip() + f"\n\n({len(args.seeds)} seed(s): {', '.join(map(str, args.seeds))}; " \
                             f"wall time {wall:.0f} s on {os.cpu_count()} CPUs" + \
        ("" if load is None else f", load average {load:.1f} at the end") + f"; raw results in {name}.json)\n"
    with open(paths["md"], "w") as f:
        f.write(md)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=args.dpi)
    print(md)
    print("wrote " + ", ".join(os.path.abspath(p) for p in paths.values()))
    return paths


def figure(cols: int = 1, rows: int = 1, size=(5.0, 3.6)):
    """A matplotlib Figure on the Agg canvas (no display, no global pyplot state) and its axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * cols, size[1] * rows))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, cols, k + 1) for k in range(rows * cols)]
    return fig, axes


def band(ax, x, runs: Sequence[Sequence[Optional[float]]], label: str, log: bool = False, **kw) -> None:
    """Mean over the runs (lists of equal length, None where a run diverged) with a ± std band;
    on a log axis the band's lower edge is clipped at the smallest run (it stays positive)."""
    import numpy as np

    a = np.array([[np.nan if v is None else v for v in r] for r in runs], dtype=float)
    a[~np.isfinite(a)] = np.nan
    with warnings.catch_warnings():  # a column where every run diverged is all-NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(a, 0)
        std = np.nanstd(a, 0, ddof=1) if len(runs) > 1 else np.zeros_like(mean)
        std = np.nan_to_num(std)
        lo, hi = mean - std, mean + std
        if log:
            lo = np.maximum(lo, np.nanmin(a, 0))
    line, = ax.plot(x, mean, label=label, **kw)
    if len(runs) > 1:
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.25, linewidth=0)


def style_axis(ax, title: str, xlabel: str, ylabel: str, legend: bool = False) -> None:
    """The experiments' panel style: title, axis labels, a light grid and, on one panel, a small legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=6)


def divergence_lines(records: Sequence[Dict[str, Any]]) -> List[str]:
    """The markdown of :func:`~ist_kernels.experiments.harness.analysis.divergence` records."""
    if not records:
        return ["No run diverged (every loss stayed finite and below "
                f"{BLOW_UP:g}x its initial value)."]
    out = [f"**{len(records)} run(s) diverged** (loss non-finite or above {BLOW_UP:g}x its initial value; "
           "left out of the means):", ""]
    for r in records:
        extra = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("what", "seed", "lr", "step", "value"))
        out.append(f"- {r['what']}: seed {r['seed']}, lr {r['lr']:.4g}, at step {r['step']}"
                   + (f" ({extra})" if extra else ""))
    return out


# ---------------------------------------------------------------- tables of trainer runs

def number(v: Optional[float], spec: str = ".3g", none: str = "—") -> str:
    """``v`` formatted with ``spec``; ``none`` when it is None."""
    return none if v is None else f"{v:{spec}}"


def _final(r: Dict[str, Any]) -> str:
    v = r.get("final_metric", r.get("final_accuracy"))
    return "—" if v is None else (f"{v:.4f}" if r.get("metric", "accuracy") == "accuracy" else f"{v:.3f} bpb")


def tuning_lines(tuning: Dict[str, Any]) -> List[str]:
    """The markdown table of the tuning: per workload, method and S, every lr with its score, and the pick."""
    if not tuning:
        return []
    out = ["## Learning rates, tuned on a held-out part of the training set", "",
           "Rule: " + TUNE_RULE + ".", "",
           "| workload | method | S | rounds | lr: held-out score | pick |", "|---|---|---|---|---|---|"]
    for config, by_method in sorted(tuning.items()):
        for method, by_s in sorted(by_method.items()):
            for S, e in sorted(by_s.items(), key=lambda kv: int(kv[0])):
                pts = ", ".join(f"{lr:.3g}: {'not run' if not e['ran'] else number(sc, '.4g', 'failed')}"
                                for lr, sc in zip(e["grid"], e["scores"]))
                note = " (no score: the workload's lr)" if e["fallback"] else ""
                out.append(f"| {config} | {method} | {S} | {e['rounds']} | {pts} | **{e['pick']:.3g}**{note} |")
    return out + [""]


def summary_lines(summary: Sequence[Dict[str, Any]]) -> List[str]:
    """The markdown table of :func:`~ist_kernels.experiments.harness.analysis.seed_summary`'s rows."""
    if not summary:
        return []
    out = ["## Time to target from every seed's rounds", "",
           "Rounds to target of each seed (loopback runs), and per link: the link's runs' own training seconds "
           "through the seeds' mean rounds (only when every seed reached the target; a fractional mean takes that "
           "fraction of the next round), beside the link's own runs' time to target.", "",
           "| workload | S | method | compress | link | rounds to target (seeds) | mean | s / round | time to target (s) | "
           "vs local SGD | the link's runs (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        ks = ", ".join("—" if k is None else str(k) for k in e["rounds_to_target"]) or "no loopback run"
        own = ", ".join(number(t, ".3g", "not reached") for t in e["runs_time_to_target_s"])
        out.append(f"| {e['workload']} | {e['workers']} | {e['method']} | {e['compress']} | {e['link']} | {ks} | "
                   f"{number(e['mean_rounds_to_target'], '.3g')} | {number(e['round_time_s'], '.2f')} | "
                   f"{number(e['time_to_target_s'], '.3g', 'not reached')} | {number(e['vs_localsgd'], '.2f')} | {own} |")
    return out + [""]


def baseline_lines(baselines: Optional[Dict[str, Any]]) -> List[str]:
    """A language model's byte-frequency baselines (:func:`~ist_kernels.experiments.harness.analysis.pycode_baselines`)
    in a sentence."""
    if not baselines:
        return []
    return [f"Byte-frequency baselines on {baselines['dataset']}'s {baselines['split']} split "
            f"({baselines['bytes']:,} bytes, {baselines['files']} files): one byte alone (unigram entropy) "
            f"{baselines['unigram_bits']:.3f} bits, a byte given the previous one (bigram conditional entropy) "
            f"{baselines['bigram_bits']:.3f} bits.", ""]



SESSION_GAP_H = 1.0  # kept runs measured further apart than this (hours) are of different sessions


def _measured(r: Dict[str, Any]) -> Optional[float]:
    """A run's ``measured_at`` (a kept run's UTC ISO 8601 time) in seconds since the epoch; None
    where it has none or it does not parse."""
    at = r.get("measured_at")
    try:
        return calendar.timegm(time.strptime(at, STORED_AT)) if at else None
    except (TypeError, ValueError):
        return None


def sessions_lines(runs: Sequence[Dict[str, Any]]) -> List[str]:
    """Where the runs (kept ones, ``measured_at``) were measured in more than one session (more than
    ``SESSION_GAP_H`` hours between one and the next): a sentence that says so, and which runs each
    session measured. Seconds a round of runs from different sessions carry the machine's drift
    between them (a 2-core CPU drifted 0.87x between two sessions of one day, the same final);
    rounds to target and finals do not. Nothing when every run is of one session or none is kept."""
    timed = sorted(((t, r) for r in runs if (t := _measured(r)) is not None), key=lambda x: x[0])
    if not timed:
        return []
    groups: List[List[Any]] = [[timed[0]]]
    for prev, cur in zip(timed, timed[1:]):
        if cur[0] - prev[0] > SESSION_GAP_H * 3600:
            groups.append([])
        groups[-1].append(cur)
    if len(groups) < 2:
        return []
    varies = [k for k in ("config", "workers", "link", "compress") if len({str(r.get(k)) for _, r in timed}) > 1]

    def label(r):
        where = " ".join(str(r.get(k)) for k in varies)
        return f"{r['method']}{' (' + where + ')' if where else ''}"

    def hm(t, day=True):
        return time.strftime("%Y-%m-%d %H:%M" if day else "%H:%M", time.gmtime(t))

    parts = []
    for g in groups:
        seeds: Dict[str, List[str]] = {}
        for _, r in g:
            seeds.setdefault(label(r), []).append(str(r.get("seed")))
        what = "; ".join(f"{m} {', '.join(sorted(v, key=lambda x: (len(x), x)))}" for m, v in sorted(seeds.items()))
        parts.append(f"{hm(g[0][0])}-{hm(g[-1][0], False)} UTC: {what}")
    return ["", f"The kept runs were measured in {len(groups)} sessions (more than {SESSION_GAP_H:g} h apart); seconds "
            "a round compared across sessions carry the machine's speed drift between them, rounds to target and "
            "finals do not. Method and seeds by session: " + " | ".join(parts) + "."]


def runs_lines(runs: Sequence[Dict[str, Any]]) -> List[str]:
    """The markdown table of every run (:func:`~ist_kernels.experiments.harness.analysis.analyse`'s rows),
    by workload, S, link, method, compression and seed."""
    hdr = ("| workload | S | link | method | lr | compress | time to target (s) | vs local SGD | rounds | final | "
           "MB / round | s / round | pred. s / round | pred. err | local / plan / pack / comm / unpack (s) |")
    out = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in sorted(runs, key=lambda r: (r["config"], r["workers"], r["bandwidth_bps"] or 0, r["method"],
                                         r["compress"], r["seed"])):
        tp = r["time_by_part"]
        out.append(f"| {r['config']} ({r['model']}) | {r['workers']} | {r['link']} | {r['method']} | "
                   f"{number(r.get('lr'), '.3g')} | {r['compress']} | "
                   f"{number(r['time_to_target_s'], '.2f', 'not reached')} | {number(r['time_vs_localsgd'], '.2f')} | "
                   f"{number(r['rounds_to_target'], 'd')} | {_final(r)} | "
                   f"{r['bytes_per_round'] / 1e6:.3g} | {r['round_time_s']:.3f} | "
                   f"{number(r['predicted_round_time_s'], '.3f')} | "
                   f"{number(None if r['prediction_error'] is None else 100 * r['prediction_error'], '+.1f')}"
                   f"{'%' if r['prediction_error'] is not None else ''} | "
                   + " / ".join(f"{tp[p]:.2f}" for p in ("local", "plan", "pack", "comm", "unpack")) + " |")
    return out
