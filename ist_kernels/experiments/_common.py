"""What the experiments share: the common options (seeds, --quick, --out, --jobs, --dpi), running
every cell of a grid with a progress bar, divergence records, mean ± std over seeds, bands in
plots, and the three outputs ``<out>/<name>.json`` (raw results), ``.md`` (tables) and ``.png``.

The JSON holds only finite numbers: a value that diverged is ``null`` and is listed under
``"divergences"`` with what diverged, its seed, learning rate and step.
"""
import argparse
import json
import math
import os
import platform
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..train.datasets import pycode_files

DEFAULT_DPI = 80
# a loss this many times its initial value (or non-finite) counts as diverged
BLOW_UP = 1e6
JSON_DIGITS = 6  # significant digits of the floats in the JSON outputs


# ---------------------------------------------------------------- options

def _number_list(cast: Callable[[str], Any], what: str) -> Callable[[str], List[Any]]:
    def parse(s: str) -> List[Any]:
        try:
            out = [cast(v) for v in s.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}s, got {s!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return out
    return parse


ints = _number_list(int, "integer")
ints.__doc__ = "A comma-separated list of integers (argparse type)."
floats = _number_list(float, "number")
floats.__doc__ = "A comma-separated list of numbers (argparse type)."


def names(s: str) -> List[str]:
    """A comma-separated list of names (argparse type)."""
    out = [v.strip() for v in s.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected at least one name")
    return out


def parser(name: str, doc: str, seeds: Sequence[int] = (0, 1, 2), quick: str = "") -> argparse.ArgumentParser:
    """The experiment's parser with the options every experiment has; ``doc`` is its module
    docstring (first line: the summary listed by ``python -m ist_kernels.experiments --help``)."""
    p = argparse.ArgumentParser(prog=f"python -m ist_kernels.experiments {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("common options")
    g.add_argument("--seeds", "--seed", dest="seeds", type=ints, default=list(seeds), metavar="S[,S...]",
                   help="seeds of the independent runs (default %(default)s); tables give mean ± std over them")
    g.add_argument("--quick", action="store_true", help="tiny run for CI, well under a minute on 2 cores" +
                   (f" ({quick})" if quick else ""))
    g.add_argument("--out", default=os.path.join("outputs", "experiments", name),
                   help=f"output folder for {name}.json, {name}.md, {name}.png (default %(default)s)")
    g.add_argument("--jobs", type=int, default=1, help="worker processes for the runs (default %(default)s)")
    g.add_argument("--dpi", type=int, default=DEFAULT_DPI, help="PNG resolution (default %(default)s)")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.dpi < 10:
        p.error(f"--dpi must be >= 10, got {args.dpi}")
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct integers >= 0, got {args.seeds}")


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str], quick: Dict[str, object],
               positive: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; with ``--quick`` set each ``quick`` option (a value, or a function of the
    parsed one) and keep the first two seeds; check the common options and that every option in
    ``positive`` is >= 1."""
    args = p.parse_args(list(argv))
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value(getattr(args, name)) if callable(value) else value)
        args.seeds = args.seeds[:2]
    check_args(p, args)
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def summary_line(doc: str) -> str:
    return doc.strip().splitlines()[0].strip()


# ---------------------------------------------------------------- running

def _call(job):
    fn, args, cell = job
    return fn(args, cell)


def run_grid(run_cell: Callable, args, cells: Sequence, desc: str, jobs: int = 1) -> Dict:
    """{cell: run_cell(args, cell)} for every cell, with a progress bar; ``jobs`` > 1 runs the
    cells in that many processes (run_cell must then be a module-level function)."""
    from tqdm import tqdm

    results = {}
    with tqdm(total=len(cells), desc=desc, file=sys.stderr, unit="run") as bar:
        if jobs <= 1 or len(cells) <= 1:
            for c in cells:
                results[c] = run_cell(args, c)
                bar.update()
        else:
            with ProcessPoolExecutor(min(jobs, len(cells))) as pool:
                for c, r in zip(cells, pool.map(_call, [(run_cell, args, c) for c in cells])):
                    results[c] = r
                    bar.update()
    return results


def diverged_at(values: Sequence[float], blow_up: float = BLOW_UP) -> Optional[int]:
    """Index of the first value that is not finite or exceeds ``blow_up`` times the first one
    (None: the run stayed finite and bounded)."""
    ref = None
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            return i
        if ref is None:
            ref = abs(v)
        elif abs(v) > blow_up * max(ref, 1e-12):
            return i
    return None


def divergence(what: str, seed: int, lr: float, step: int, value: float, **extra) -> Dict[str, Any]:
    """One divergence record (listed in the JSON and the markdown)."""
    return {"what": what, "seed": seed, "lr": lr, "step": step,
            "value": value if value is not None and math.isfinite(value) else None, **extra}


def divergence_lines(records: Sequence[Dict[str, Any]]) -> List[str]:
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


# ---------------------------------------------------------------- statistics

def stats(values: Iterable[Optional[float]]) -> Dict[str, Any]:
    """mean, sample std, min, max over the finite values; n (finite) and n_diverged."""
    vals = list(values)
    ok = [float(v) for v in vals if v is not None and math.isfinite(v)]
    n = len(ok)
    if not n:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "n_diverged": len(vals)}
    mean = sum(ok) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in ok) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(ok), "max": max(ok), "n": n, "n_diverged": len(vals) - n}


def fmt(s: Dict[str, Any], spec: str = ".3g") -> str:
    """``mean ± std`` of a :func:`stats` dict, with the diverged count when there is one."""
    if s["mean"] is None:
        return "diverged"
    out = f"{s['mean']:{spec}} ± {s['std']:{spec}}"
    return out + (f" ({s['n_diverged']} div.)" if s["n_diverged"] else "")


def moves(a: Dict[str, Any], b: Dict[str, Any], sign: int) -> Optional[bool]:
    """Whether the mean moves from ``a`` to ``b`` in direction ``sign`` (+1 up, -1 down); None if
    either diverged."""
    if a["mean"] is None or b["mean"] is None:
        return None
    return (b["mean"] - a["mean"]) * sign > 0


def significant(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """|difference of the means| above twice its standard error (Welch), a rough 95% test."""
    if a["mean"] is None or b["mean"] is None or a["n"] < 2 or b["n"] < 2:
        return False
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    return abs(b["mean"] - a["mean"]) > 2 * se


def trend(grid: Sequence[Sequence[Dict[str, Any]]], axis: int, sign: int) -> Dict[str, int]:
    """Adjacent pairs of a grid of :func:`stats` along ``axis`` (0 rows, 1 columns) whose mean moves
    in direction ``sign``; ``significant``: those of them where the move exceeds 2 standard errors;
    ``pairs``: the pairs compared (ties and diverged cells are left out)."""
    hits = sig = total = 0
    R, C = len(grid), len(grid[0]) if grid else 0
    for i in range(R):
        for j in range(C):
            i2, j2 = (i + 1, j) if axis == 0 else (i, j + 1)
            if i2 < R and j2 < C:
                m = moves(grid[i][j], grid[i2][j2], sign)
                if m is None or grid[i][j]["mean"] == grid[i2][j2]["mean"]:  # diverged, or a tie (both 0)
                    continue
                total += 1
                hits += m
                sig += m and significant(grid[i][j], grid[i2][j2])
    return {"hits": hits, "significant": sig, "pairs": total}


# ---------------------------------------------------------------- outputs

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


def byte_entropies(data: bytes) -> Dict[str, float]:
    """The byte-frequency baselines of a language model on ``data`` (bits per byte, plug-in estimates
    from its own counts): ``unigram_bits``, the entropy of one byte, -sum p(a) log2 p(a); ``bigram_bits``,
    the conditional entropy of a byte given the one before it, -sum p(a, b) log2 p(b | a) over the
    len - 1 adjacent pairs; and ``bytes``. b"abab..." gives 1 and 0 bits."""
    import torch

    if len(data) < 2:
        raise ValueError(f"byte_entropies: need at least 2 bytes, got {len(data)}")
    a = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def h(counts):  # -sum c/n log2(c/n) over the nonzero counts
        c = counts[counts > 0].double()
        p = c / c.sum()
        return float(-(p * p.log2()).sum())

    pairs = torch.bincount(a[:-1] * 256 + a[1:], minlength=256 * 256)
    # H(B | A) = H(A, B) - H(A), A over the pairs' first bytes
    bigram = h(pairs) - h(pairs.view(256, 256).sum(1))
    return {"unigram_bits": h(torch.bincount(a, minlength=256)), "bigram_bits": max(0.0, bigram),
            "bytes": len(data)}


def pycode_baselines() -> Dict[str, Any]:
    """:func:`byte_entropies` of the whole test split of ``--dataset pycode`` (every test file of the
    standard library, concatenated in the data set's order; the trainer scores its first 8 KiB)."""

    _, test = pycode_files()
    parts = []
    for path in test:
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"".join(parts)
    return {**byte_entropies(data), "dataset": "pycode", "split": "test", "files": len(test)}


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


def style_axis(ax, title: str, xlabel: str, ylabel: str, legend: bool = False) -> None:
    """The experiments' panel style: title, axis labels, a light grid and, on one panel, a small legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=6)
