"""ist-train: the command line (also ``python -m ist_kernels.train``).

Options come from, in increasing precedence: the defaults, the ``--demo`` preset, a ``--config``
file (YAML or TOML), and flags. Everything is validated before any work starts; an invalid option
exits with status 2 and a message naming it.

One run at a time per output folder: the run locks it (``.ist-train.lock``; a second run stops at
once, naming the first one's pid and host), and a folder that holds an earlier run needs
``--resume`` (continue it) or ``--overwrite`` (replace it). A checkpoint that cannot be used, a
peer that dies or stalls, or a killed worker ends the run with one line naming the file, the
collective or the worker, and status 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .config import (
    CHOICES,
    GROUPS,
    ConfigError,
    TrainConfig,
    demo_preset,
    load_config_file,
    under_torchrun,
)
from .datasets import available_datasets
from .launch import exit_worker, failure_status, launch, report_failure
from .methods import available_methods
from .model_registry import available_models
from .output import claim_outputs, write_comparison
from .runs import plan_runs


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple, dict)):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def _dynamic_choices() -> Dict[str, Sequence[str]]:
    """Names known only at run time (registries); --help lists them too."""
    return {"method": available_methods(), "dataset": available_datasets()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ist-train", description=__doc__.split("\n\n")[0],
        epilog="launch: torchrun --nproc-per-node=S [--max-restarts N] -m ist_kernels.train ... | "
               "ist-train --workers S [--max-restarts N] ... (starts S local processes through torch's elastic "
               "launcher) | ist-train --simulate S ... (one process). Precedence: defaults < --demo < --config < "
               "flags.")
    p.add_argument("--config", help="YAML (.yaml/.yml) or TOML (.toml) file of options")
    p.add_argument("--list-methods", action="store_true", help="print the available methods and exit")
    p.add_argument("--list-datasets", action="store_true", help="print the available datasets and exit")
    p.add_argument("--list-models", action="store_true", help="print the available models and exit")
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    choices = {**CHOICES, **_dynamic_choices()}
    for title, names in GROUPS.items():
        g = p.add_argument_group(title)
        for name in names:
            f = fields[name]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            _add_option(g, f, hints[name], default, choices.get(name))
    return p


def _add_option(g, f: dataclasses.Field, tp, default, choices: Optional[Sequence[str]]) -> None:
    """One TrainConfig field as a flag. Flags default to SUPPRESS (only what was given overrides the
    lower layers); the help shows the field's default and its choices (validated by TrainConfig)."""
    flag = "--" + f.name.replace("_", "-")
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if typing.get_origin(tp) is typing.Union else tp
    help_ = f.metadata.get("help", "")
    if "default" not in help_:  # some say what None means themselves
        help_ += f" (default: {_show(default)})"
    help_ = help_.replace("%", "%%")  # argparse formats help with %
    if f.name == "options":
        g.add_argument("--option", dest="options", action="append", metavar="KEY=VALUE", help=help_,
                       default=argparse.SUPPRESS)
    elif typing.get_origin(base) in (dict, Dict):  # model_args, dataset_args: K=V[,K=V...], repeatable
        g.add_argument(flag, dest=f.name, action="append", metavar="K=V[,K=V...]", help=help_,
                       default=argparse.SUPPRESS)
    elif base is bool:
        g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_,
                       default=argparse.SUPPRESS)
    elif typing.get_origin(base) in (list, List):
        g.add_argument(flag, dest=f.name, nargs="+", type=str, help=help_, default=argparse.SUPPRESS)
    else:
        metavar = "{" + ",".join(choices) + "}" if choices else f.name.upper() if f.name != "simulate" else "S"
        g.add_argument(flag, dest=f.name, type=str, help=help_, default=argparse.SUPPRESS, metavar=metavar)


def _parse_options(items: Sequence[str]) -> Dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("options", f"expected KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def build_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """The config the command line describes (not yet validated)."""
    ns = vars(_parser().parse_args(argv))
    flags = {k: v for k, v in ns.items() if k not in ("config", "list_methods", "list_datasets", "list_models")}
    if "options" in flags:
        flags["options"] = _parse_options(flags["options"])
    cfg = TrainConfig()
    demo = flags.get("demo", False)
    if ns.get("config"):
        file_values = load_config_file(ns["config"])
        demo = flags.get("demo", file_values.get("demo", False))
    if demo:
        preset = demo_preset(quick=flags.get("quick", False))
        # the preset yields to what the user gave: --simulate S replaces the preset's worker count
        # (both set S, and a preset value the user never typed must not conflict with theirs)
        given = set(flags) | ({str(k).replace("-", "_") for k in file_values} if ns.get("config") else set())
        if "simulate" in given:
            preset.pop("workers")
        cfg.update(preset, "the --demo preset")
    if ns.get("config"):
        cfg.update(file_values, ns["config"])
    cfg.update(flags, "flags")
    return cfg


def _validate_and_run(argv) -> Tuple[TrainConfig, Optional[List[Dict[str, Any]]]]:
    """argv -> the config -> the validated runs (:func:`.runs.plan_runs`) -> launch under the output
    folder's lock -> the comparison of the runs (:func:`.output.write_comparison`); returns the
    config and the summaries (None on a rank > 0 under torchrun)."""
    cfg = build_config(argv)
    runs = plan_runs(cfg)
    # the launcher (rank 0 under torchrun) holds the lock; the other ranks only write their
    # checkpoint files, and never get past rank 0's first collective when rank 0 stops
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        launch(runs)
        return cfg, None
    with claim_outputs(runs, cfg.resolved_out_dir()):
        summaries = launch(runs)
        write_comparison(cfg, summaries)
    return cfg, summaries


def main(argv: Optional[Sequence[str]] = None) -> int:
    ns = vars(_parser().parse_args(argv))
    for flag, names in (("list_methods", available_methods), ("list_datasets", available_datasets),
                        ("list_models", available_models)):
        if ns[flag]:
            print("\n".join(names()))
            return 0

    try:
        cfg, summaries = _validate_and_run(argv)
    except Exception as e:
        status = failure_status(e)
        if status is None:  # a bug: keep the traceback
            raise
        if under_torchrun():  # this process is one rank: it ends here
            report_failure(e, f"rank {os.environ['RANK']}: ")
            exit_worker(status)
        report_failure(e)
        return status
    if summaries is not None and cfg.stop_after is not None and not all(s["finished"] for s in summaries):
        print(f"stopped after round {summaries[0]['rounds']}; continue with --resume")
    return 0


def run(argv: Optional[Sequence[str]] = None) -> None:
    """The entry point of ``ist-train`` and ``python -m ist_kernels.train``: :func:`main`, then exit.

    A process that exists only to be one rank (under torchrun) ends with :func:`exit_worker` once
    :func:`main` returns: by then it has left its last collective, passed the final barrier and
    destroyed its process group, and nothing of c10d / gloo (worker threads, pending work holding
    tensors, the store client) is left for the interpreter's finalization to tear down, where a
    destructor that still finds a joinable thread or needs the GIL ends the process with SIGABRT
    ("terminate called without an active exception") after a finished run."""
    status = main(argv)
    if under_torchrun():
        exit_worker(status)
    sys.exit(status)


if __name__ == "__main__":  # pragma: no cover
    run()
