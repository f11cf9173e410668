"""Which runs a command makes, decided once before anything is launched.

A run's way goes one direction: argv -> a config (:func:`ist_kernels.train.cli.build_config`) ->
the runs (here: the method's run and, with ``--baseline``, local SGD with the same budget; after a
torchrun restart, each continued from its checkpoint or started again; every one validated) ->
launch (:mod:`.launch`: processes) -> rounds (:class:`ist_kernels.train.runner.Run`: metrics.jsonl,
checkpoints, summary.json, model.pt) -> the comparison of the runs (:func:`.output.write_comparison`:
ratios, summary.md, the terminal table, plots).

The one decision that can only be taken after launching is a ``--workers S`` group restarted by
torch's elastic agent inside the launched processes: :func:`ist_kernels.train.launch.resume_after_restart`
takes it with :func:`resume_if_checkpointed`, as :func:`plan_runs` does for torchrun.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List

from .checkpoint import read_latest
from .config import TrainConfig, restart_count, under_torchrun
from .methods import get_method
from .output import claimed_by, job_id


def resume_if_checkpointed(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` continuing from the latest checkpoint in its folder when there is one (a restarted
    worker group), else ``cfg`` starting at round 0."""
    if cfg.resume or read_latest(cfg.resolved_checkpoint_dir()) is None:
        return cfg
    return dataclasses.replace(cfg, resume=True, overwrite=False)


def baseline_config(cfg: TrainConfig) -> TrainConfig:
    """Local SGD with the same budget: workers, rounds, local steps, batch size, schedule; run as
    the method's paper compares (``Method.baseline_options``: for loft, pre-train, prune, fine-tune).
    It holds the whole model on every worker by definition, so --max-rank-state-mb does not apply,
    and it is the papers' plain local SGD (no --outer-optimizer)."""
    out = cfg.resolved_out_dir()
    options = get_method(cfg.method).baseline_options(cfg.options)
    return dataclasses.replace(
        cfg, method="localsgd", options=options, baseline=False, outer_optimizer="none", resume=False, stop_after=None,
        max_rank_state_mb=None,
        out_dir=os.path.join(out, "localsgd"),
        checkpoint_dir=os.path.join(cfg.checkpoint_dir, "localsgd") if cfg.checkpoint_dir else None)


def run_configs(cfg: TrainConfig) -> List[TrainConfig]:
    """The method's run, and with ``--baseline`` local SGD's beside it (each in its own folder)."""
    if not cfg.baseline or cfg.method == "localsgd":
        return [cfg]
    out = cfg.resolved_out_dir()
    main = dataclasses.replace(cfg, out_dir=os.path.join(out, cfg.method),
                               checkpoint_dir=os.path.join(cfg.checkpoint_dir, cfg.method) if cfg.checkpoint_dir else None)
    return [main, baseline_config(cfg)]


def after_restart(runs: List[TrainConfig], root: str) -> List[TrainConfig]:
    """torchrun restarted the workers (rank 0 decides; :func:`ist_kernels.train.launch.resume_after_restart`
    tells the other ranks). When an earlier attempt of this job claimed the output folder, each run
    continues from its latest checkpoint, or starts again replacing that attempt's outputs; a folder
    this job never claimed is checked as on a first start (never resumed or replaced by surprise)."""
    if claimed_by(root) != job_id():
        return runs
    out = []
    for c in runs:
        c2 = resume_if_checkpointed(c)
        out.append(c2 if c2.resume else dataclasses.replace(c, overwrite=True))
    return out


def plan_runs(cfg: TrainConfig) -> List[TrainConfig]:
    """The validated runs ``cfg`` asks for (ConfigError naming the first invalid option)."""
    runs = run_configs(cfg)
    if under_torchrun() and int(os.environ["RANK"]) == 0 and restart_count() > 0:
        runs = after_restart(runs, cfg.resolved_out_dir())
    for c in runs:
        c.validate()
    return runs
