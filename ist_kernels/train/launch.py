"""Launch modes.

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set): this process is one worker;
  the default process group is initialised from the environment (multi-node works the same way);
- ``--workers S`` (S > 1) otherwise: start S local processes with torch.multiprocessing (spawn),
  gloo on CPU, NCCL when there are S GPUs;
- ``--simulate S``: one process trains the S workers one after another;
- S = 1: one process, no process group.

Failures end the run with one line per process that saw them and a status (:func:`failure_status`):
2 for an invalid option found late (e.g. an unreadable data file), 1 for a checkpoint that cannot
be used, a collective whose peer died or stalled (it names the collective, round and rank), or a
worker that was killed; other exceptions are bugs and keep their traceback. With ``--workers S``
the launcher watches its workers: when one ends badly the others get a few seconds to report what
they saw, then are stopped, and the launcher names the worker that failed first.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..distributed import CollectiveError, destroy_process_group, init_process_group
from .config import TrainConfig, under_torchrun
from .runner import World, train


def resolve_device(cfg: TrainConfig, local_rank: int, processes: int) -> torch.device:
    d = cfg.device
    if d == "auto":
        use_cuda = torch.cuda.is_available() and (processes == 1 or under_torchrun()
                                                  or torch.cuda.device_count() >= processes)
        d = "cuda" if use_cuda else "cpu"
    if d == "cpu":
        return torch.device("cpu")
    if processes > 1:  # one GPU per process
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(d if ":" in d else "cuda")


def resolve_backend(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_threads(cfg: TrainConfig, processes: int) -> None:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    elif processes > 1 and not under_torchrun():  # S local processes share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // processes))


def _run_rank(cfgs: List[TrainConfig], rank: int, world_size: int, local_rank: int, init_method: Optional[str]):
    """One worker process: one process group for all the runs (the main run and its baseline)."""
    cfg = cfgs[0]
    device = resolve_device(cfg, local_rank, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _set_threads(cfg, world_size)
    # The package's process group: created once, cfg.timeout_s for every collective of
    # ist_kernels.distributed and of the trainer (a dead or stalled rank raises CollectiveError).
    if init_method is None:  # torchrun: env://
        init_process_group(resolve_backend(cfg, device), timeout=cfg.timeout_s)
    else:
        init_process_group(resolve_backend(cfg, device), timeout=cfg.timeout_s, init_method=init_method,
                           rank=rank, world_size=world_size)
    group_ok = True
    try:
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
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .output import OutputLockError
    from .runner import RankStateError

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


def _spawned(local_rank: int, cfgs: List[TrainConfig], world_size: int, init_method: str):
    try:
        _run_rank(cfgs, local_rank, world_size, local_rank, init_method)
    except Exception as e:
        status = failure_status(e)
        if status is None:
            raise  # torch.multiprocessing hands the traceback to the launcher
        report_failure(e, f"rank {local_rank}: ")
        exit_worker(status)


GRACE_S = 5.0  # seconds the other workers get to report their own error after one failed


def _spawn(cfgs: List[TrainConfig], s: int) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_spawned, args=(cfgs, s, f"tcp://127.0.0.1:{_free_port()}"), nprocs=s,
                             join=False, start_method="spawn")
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # its "terminating process ..." warnings: we say what happened
    try:
        while not ctx.join(grace_period=GRACE_S):
            pass
    except mp.ProcessExitedException as e:
        i = e.error_index
        if e.signal_name:
            raise WorkerError(f"worker process {i} (rank {i}, pid {e.error_pid}) was killed by {e.signal_name}; "
                              f"the other workers were stopped. Continue from the last checkpoint with --resume") from None
        raise WorkerError(f"worker process {i} (rank {i}) exited with status {e.exit_code}",
                          exit_code=e.exit_code if e.exit_code in (1, 2) else 1,
                          reported=e.exit_code in (1, 2)) from None
    finally:
        spawn_log.setLevel(level)


def launch(cfgs: Sequence[TrainConfig]) -> List[Optional[Dict[str, Any]]]:
    """Run the configs (validated; same launch mode) one after another in the mode they ask for;
    returns their summaries in the calling process (None on ranks > 0 under torchrun)."""
    cfgs = list(cfgs)
    cfg = cfgs[0]
    if under_torchrun():
        return _run_rank(cfgs, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         int(os.environ["LOCAL_RANK"]), None)
    if cfg.simulate or cfg.num_workers == 1:
        _set_threads(cfg, 1)
        world = World(simulated=bool(cfg.simulate), device=resolve_device(cfg, 0, 1))
        return [train(c, world) for c in cfgs]
    _spawn(cfgs, cfg.num_workers)
    out = []
    for c in cfgs:
        with open(os.path.join(c.resolved_out_dir(), "summary.json")) as f:
            out.append(json.load(f))
    return out
