"""Launch modes.

- under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set): this process is one worker;
  the default process group is initialised from the environment (multi-node works the same way);
- ``--workers S`` (S > 1) otherwise: start S local processes with torch.multiprocessing (spawn),
  gloo on CPU, NCCL when there are S GPUs;
- ``--simulate S``: one process trains the S workers one after another;
- S = 1: one process, no process group.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..distributed import destroy_process_group, init_process_group
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
    try:
        world = World(rank, world_size, local_rank, simulated=False, device=device)
        return [train(c, world) for c in cfgs]
    finally:
        destroy_process_group()


def _spawned(local_rank: int, cfgs: List[TrainConfig], world_size: int, init_method: str):
    _run_rank(cfgs, local_rank, world_size, local_rank, init_method)


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
    import torch.multiprocessing as mp

    s = cfg.num_workers
    mp.spawn(_spawned, args=(cfgs, s, f"tcp://127.0.0.1:{_free_port()}"), nprocs=s, join=True,
             start_method="spawn")
    out = []
    for c in cfgs:
        with open(os.path.join(c.resolved_out_dir(), "summary.json")) as f:
            out.append(json.load(f))
    return out
