"""Launch modes.

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set): this process is one worker;
  the default process group is initialised from the environment (multi-node works the same way);
- ``--workers S`` (S > 1) otherwise: start S local processes through torch.distributed's elastic
  launcher (what torchrun runs: a c10d rendezvous on a port the OS assigns, held while the workers
  run, so no port race), gloo on CPU, NCCL when there are S GPUs; ``--max-restarts N`` restarts
  the workers after a failure;
- ``--simulate S``: one process trains the S workers one after another;
- S = 1: one process, no process group.

Failures end the run with one line per process that saw them and a status (:func:`failure_status`):
2 for an invalid option found late (e.g. an unreadable data file), 1 for a checkpoint that cannot
be used, a collective whose peer died or stalled (it names the collective, round and rank), or a
worker that was killed; other exceptions are bugs and keep their traceback. With ``--workers S``
the launcher (the elastic agent) watches its workers: when one ends badly the others are stopped
and the launcher names the worker that failed first.

Restarts (torchrun ``--max-restarts``, ``ist-train --workers S --max-restarts N``): a restarted
worker group continues from its latest checkpoint by itself (:func:`resume_after_restart`); with
no checkpoint yet it starts again at round 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
import traceback
import uuid
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..distributed import CollectiveError, destroy_process_group, init_process_group
from ..distributed.group import collective_timeout, wait_collective
from .checkpoint import CheckpointError, latest_round
from .config import ConfigError, TrainConfig, restart_count, under_torchrun
from .output import OutputLockError
from .runner import RankStateError, World, train
from .runs import resume_if_checkpointed


def resolve_device(cfg: TrainConfig, local_rank: int, processes: int, spawned: bool = False) -> torch.device:
    """``spawned``: a worker of ``--workers S`` (it sees torchrun's environment too)."""
    d = cfg.device
    if d == "auto":
        use_cuda = torch.cuda.is_available() and (processes == 1 or (under_torchrun() and not spawned)
                                                  or torch.cuda.device_count() >= processes)
        d = "cuda" if use_cuda else "cpu"
    if d == "cpu":
        return torch.device("cpu")
    if processes > 1:  # one GPU per process
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    # an index always: torch.cuda.set_device and the device's streams need one ("cuda" alone is the current device)
    return torch.device(d) if ":" in d else torch.device("cuda", torch.cuda.current_device())


def resolve_backend(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def set_threads(cfg: TrainConfig, processes: int, spawned: bool = False) -> None:
    """--threads, or this machine's cores shared among S local processes (spawned or --workers)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif processes > 1 and (spawned or not under_torchrun()):  # S local processes share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def resume_after_restart(cfgs: List[TrainConfig], rank: int, device: torch.device,
                         spawned: bool) -> List[TrainConfig]:
    """After an elastic restart (TORCHELASTIC_RESTART_COUNT > 0) every rank takes rank 0's decision
    (resume or start again, per run), sent with a broadcast: rank 0 decided it under the output
    folder's lock (torchrun: :func:`ist_kernels.train.cli`; ``--workers S``: here, as the launcher
    holds the lock for the whole job)."""
    n = restart_count()
    if n == 0:
        return cfgs
    if rank == 0 and spawned:
        cfgs = [resume_if_checkpointed(c) for c in cfgs]

    flags = torch.tensor([int(c.resume) for c in cfgs], dtype=torch.int64, device=device)
    wait_collective(lambda: torch.distributed.broadcast(flags, 0, async_op=True),
                    name="broadcast (resume after restart)", round=-1, timeout=collective_timeout())
    cfgs = [c if c.resume == bool(v) else dataclasses.replace(c, resume=bool(v), overwrite=False)
            for c, v in zip(cfgs, flags.tolist())]
    if rank == 0:
        where = [f"{c.method}: round {latest_round(c.resolved_checkpoint_dir())}" if c.resume else
                 f"{c.method}: round 0 (no checkpoint)" for c in cfgs]
        print(f"ist-train: restart {n}: continuing from {', '.join(where)}", file=sys.stderr, flush=True)
    return cfgs


def _run_rank(cfgs: List[TrainConfig], rank: int, world_size: int, local_rank: int, spawned: bool = False):
    """One worker process (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...): one process
    group for all the runs (the main run and its baseline)."""
    cfg = cfgs[0]
    device = resolve_device(cfg, local_rank, world_size, spawned)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    set_threads(cfg, world_size, spawned)
    # The package's process group: created once, cfg.timeout_s for every collective of
    # ist_kernels.distributed and of the trainer (a dead or stalled rank raises CollectiveError).
    init_process_group(resolve_backend(cfg, device), timeout=cfg.timeout_s)  # env://
    group_ok = True
    try:
        cfgs = resume_after_restart(cfgs, rank, device, spawned)
        world = World(rank, world_size, local_rank, simulated=False, device=device)
        return [train(c, world) for c in cfgs]
    except CollectiveError:
        group_ok = False  # unusable: an orderly destroy can block on the dead or stalled peer
        raise
    finally:
        if group_ok:
            destroy_process_group()


class WorkerError(RuntimeError):
    """A worker process of ``--workers S`` ended badly; ``exit_code`` is the status for the CLI and
    ``reported`` says whether the worker printed its own message already."""

    def __init__(self, message: str, exit_code: int = 1, reported: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.reported = reported


def failure_status(e: BaseException) -> Optional[int]:
    """The exit status a failure ends the run with: 2 for an invalid option (ConfigError), 1 (or the
    worker's own) for the failures below; None for anything else (a bug: keep the traceback)."""
    if isinstance(e, ConfigError):
        return 2
    if isinstance(e, WorkerError):
        return e.exit_code
    if isinstance(e, (CheckpointError, CollectiveError, OutputLockError, RankStateError)):
        return 1
    return None


def report_failure(e: BaseException, prefix: str = "") -> None:
    """One line on stderr (none when a worker printed its own already)."""
    if not getattr(e, "reported", False):
        print(f"ist-train: error: {prefix}{e}", file=sys.stderr, flush=True)


def exit_worker(status: int) -> None:
    """End a process that exists only to be one rank, at once: after a failed collective the gloo
    threads can still be blocked, and the interpreter's teardown then aborts (SIGABRT) instead of
    exiting with ``status``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _spawned(cfgs: List[TrainConfig]):
    """A worker of ``--workers S`` (started by the elastic agent, with torchrun's environment)."""
    rank = int(os.environ["RANK"])
    try:
        return _run_rank(cfgs, rank, int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), spawned=True)
    except Exception as e:
        status = failure_status(e)
        if status is None:  # a bug: its traceback is the report
            traceback.print_exc()
            status = 1
        else:
            report_failure(e, f"rank {rank}: ")
        if isinstance(e, CollectiveError):  # a peer's failure is the cause: let the agent see that one first
            time.sleep(PEER_GRACE_S)
        exit_worker(status)


PEER_GRACE_S = 2.0  # a worker that saw a peer fail outlives it by this much (20 monitor intervals)


_QUIET = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def _quiet_launcher():
    """Silence the elastic agent's and torch.multiprocessing's log lines (rendezvous, "Terminating
    process ...", the failed worker's traceback): the workers and :func:`_spawn` say what happened."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(_QUIET)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def children_import_cwd():
    """The working directory on the PYTHONPATH (appended) of the processes started meanwhile (restored
    after), so that a worker imports ``--model`` / ``--dataset MODULE:FACTORY`` from where the
    launcher found it (spawned workers also get the launcher's sys.path, which
    :func:`ist_kernels.train.datasets.import_factory` extends with the working directory)."""
    old = os.environ.get("PYTHONPATH")
    cwd = os.getcwd()
    if old is not None and cwd in old.split(os.pathsep):
        yield
        return
    os.environ["PYTHONPATH"] = cwd if not old else old + os.pathsep + cwd
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _spawn(cfgs: List[TrainConfig], s: int) -> List[Optional[Dict[str, Any]]]:
    """Run ``cfgs`` on S local worker processes through torch.distributed's elastic launcher (as
    ``torchrun --standalone --nproc-per-node S``); returns rank 0's summaries."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = cfgs[0]
    join_s = max(1, math.ceil(cfg.timeout_s))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=s, run_id=f"ist-train-{uuid.uuid4()}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # a store on a port the OS assigns, held by this process
        rdzv_configs={"join_timeout": join_s}, rdzv_timeout=join_s, max_restarts=cfg.max_restarts,
        monitor_interval=0.1, start_method="spawn")
    try:
        with _quiet_launcher(), children_import_cwd():
            results = elastic_launch(config, _spawned)(cfgs)
    except ChildFailedError as e:
        killed = sorted(r for r, f in e.failures.items() if f.exitcode < 0)  # the cause, when one was killed
        rank, failure = (killed[0], e.failures[killed[0]]) if killed else e.get_first_failure()
        restarts = f" (after {cfg.max_restarts} restart{'s' * (cfg.max_restarts > 1)})" if cfg.max_restarts else ""
        if failure.exitcode < 0:
            raise WorkerError(f"worker process {rank} (rank {rank}, pid {failure.pid}) was killed by "
                              f"{failure.signal_name()}{restarts}; the other workers were stopped. Continue from "
                              f"the last checkpoint with --resume") from None
        raise WorkerError(f"worker process {rank} (rank {rank}) exited with status {failure.exitcode}{restarts}",
                          exit_code=failure.exitcode if failure.exitcode in (1, 2) else 1,
                          reported=failure.exitcode in (1, 2)) from None
    return results[0]


def launch(cfgs: Sequence[TrainConfig]) -> List[Optional[Dict[str, Any]]]:
    """Run the configs (validated; same launch mode) one after another in the mode they ask for;
    returns their summaries in the calling process (None on ranks > 0 under torchrun)."""
    cfgs = list(cfgs)
    cfg = cfgs[0]
    if under_torchrun():
        return _run_rank(cfgs, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    if cfg.simulate or cfg.num_workers == 1:
        set_threads(cfg, 1)
        world = World(simulated=bool(cfg.simulate), device=resolve_device(cfg, 0, 1))
        return [train(c, world) for c in cfgs]
    return _spawn(cfgs, cfg.num_workers)
