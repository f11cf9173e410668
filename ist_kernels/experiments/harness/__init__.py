"""The experiments' harness: what the experiments share, apart from what each of them runs.

Modules, by concern:

- :mod:`.options`: the options every experiment has (seeds, ``--quick``, ``--out``, ``--jobs``,
  ``--dpi``) and argparse types for lists;
- :mod:`.launch`: running a grid of cells in this process or a pool, and one run of the trainer on S
  real processes (loopback, or an emulated link's namespaces), its per-round curve, runs grouped by link;
- :mod:`.store`: the run store (``--runs-dir``): a run kept as a JSON file under the key it was made
  with (the trainer's arguments, S, seed, link) and read back in place of running it again;
- :mod:`.workload`: a workload (a dict of trainer settings) and its methods' trainer command lines;
- :mod:`.tuning`: learning-rate grids scored on a held-out split, and the pick;
- :mod:`.analysis`: mean ± std over seeds, divergence records, byte-frequency baselines, targets,
  time to target, the cost model's prediction of a run, the per-seed summary;
- :mod:`.report`: the outputs ``<out>/<name>.json``, ``.md``, ``.png``, figures, markdown tables;
- :mod:`.link`: the emulated limited link (network namespaces joined by a bridge, shaped by ``tc``).

The names below are what every experiment uses (``from . import harness as C``); the rest are in their
modules. Nothing here imports an experiment."""
from .analysis import (
    BLOW_UP,
    byte_entropies,
    diverged_at,
    divergence,
    fmt,
    moves,
    pycode_baselines,
    significant,
    stats,
    trend,
)
from .launch import run_grid
from .options import DEFAULT_DPI, check_args, floats, ints, names, number_list, parse_args, parser, summary_line
from .report import JSON_DIGITS, band, divergence_lines, figure, jsonable, style_axis, write_outputs

__all__ = ["BLOW_UP", "DEFAULT_DPI", "JSON_DIGITS", "band", "byte_entropies", "check_args", "diverged_at",
           "divergence", "divergence_lines", "figure", "floats", "fmt", "ints", "jsonable", "moves", "names",
           "number_list", "parse_args", "parser", "pycode_baselines", "run_grid", "significant", "stats",
           "style_axis", "summary_line", "trend", "write_outputs"]
