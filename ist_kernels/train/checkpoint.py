"""Atomic checkpoints.

Each process writes ``round-RRRRRR-rank-K.pt`` (temporary file + ``os.replace``) holding the round,
its method state (models, optimizer states, plan generators of the workers it runs), the RNG states
and, on rank 0, the metrics history. When every rank has written, rank 0 points ``latest.json`` at
the round (again temporary file + ``os.replace``), then each rank removes its older files. A crash
at any moment leaves ``latest.json`` naming a complete set of files. The folder must be visible to
every rank (a shared filesystem across nodes).
"""
from __future__ import annotations

import json
import os
import random
import re
import tempfile
from typing import Any, Dict, Optional

import numpy as np
import torch

from .config import ConfigError

LATEST = "latest.json"
_FILE = re.compile(r"^round-(\d+)-rank-(\d+)\.pt$")

# Options that must not change between a checkpoint and its resumption.
RESUME_MUST_MATCH = ("method", "model", "width", "depth", "dataset", "data_path", "seed", "batch_size",
                     "local_steps", "options", "precision", "augment", "dataset_size")


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: str) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json(obj: Any, path: str) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


def rank_file(folder: str, round_: int, rank: int) -> str:
    return os.path.join(folder, f"round-{round_:06d}-rank-{rank}.pt")


def latest_round(folder: str) -> Optional[int]:
    try:
        with open(os.path.join(folder, LATEST)) as f:
            return int(json.load(f)["round"])
    except FileNotFoundError:
        return None


def rng_state() -> Dict[str, Any]:
    s = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: Dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(folder: str, round_: int, rank: int, world_size: int, payload: Dict[str, Any], barrier=None) -> None:
    """Write this rank's file for ``round_``; all ranks call it (``barrier`` syncs them)."""
    atomic_torch_save(dict(payload, round=round_, rank=rank, world_size=world_size),
                      rank_file(folder, round_, rank))
    if barrier:
        barrier()
    if rank == 0:
        atomic_json({"round": round_, "world_size": world_size, "num_workers": payload["num_workers"],
                     "config": payload["config"]}, os.path.join(folder, LATEST))
    if barrier:
        barrier()
    for name in os.listdir(folder):  # older rounds of this rank: latest.json no longer names them
        m = _FILE.match(name)
        if m and int(m.group(2)) == rank and int(m.group(1)) != round_:
            os.unlink(os.path.join(folder, name))


def check_resumable(folder: str, cfg, world_size: Optional[int] = None) -> int:
    """Raise ConfigError unless ``folder`` holds a checkpoint this config can resume; returns its
    round. Reads only latest.json, so the CLI checks it before any work starts."""
    try:
        with open(os.path.join(folder, LATEST)) as f:
            latest = json.load(f)
    except FileNotFoundError:
        raise ConfigError("resume", f"no checkpoint in {folder!r}") from None
    saved, now = latest["config"], cfg.to_dict()
    for key in RESUME_MUST_MATCH:
        if saved.get(key) != now.get(key):
            raise ConfigError(key, f"is {now.get(key)!r} but the checkpoint in {folder!r} was made with "
                              f"{saved.get(key)!r}; it must not change on resume")
    if latest["num_workers"] != cfg.num_workers:
        raise ConfigError("workers", f"the checkpoint in {folder!r} has {latest['num_workers']} workers, "
                          f"this run {cfg.num_workers}")
    if bool(saved.get("simulate")) != bool(now.get("simulate")):
        raise ConfigError("simulate", f"the checkpoint in {folder!r} was made "
                          f"{'simulated' if saved.get('simulate') else 'with one process per worker'}; resume it the same way")
    if cfg.rounds is not None and int(latest["round"]) > cfg.rounds:
        raise ConfigError("rounds", f"is {cfg.rounds} but the checkpoint in {folder!r} is at round {latest['round']}")
    if world_size is not None and latest["world_size"] != world_size:
        raise ConfigError("resume", f"the checkpoint in {folder!r} was written by {latest['world_size']} "
                          f"process(es), this run has {world_size}")
    return int(latest["round"])


def load(folder: str, rank: int, world_size: int, cfg) -> Dict[str, Any]:
    round_ = check_resumable(folder, cfg, world_size)
    path = rank_file(folder, round_, rank)
    if not os.path.isfile(path):
        raise ConfigError("resume", f"{path!r} is missing (latest.json names round {round_})")
    return torch.load(path, map_location="cpu", weights_only=False)
