"""Atomic checkpoints.

Each process writes ``round-RRRRRR-rank-K.pt`` (temporary file + ``os.replace``) holding the round,
its method state (models, optimizer states, plan generators of the workers it runs), the RNG states
and, on rank 0, the metrics history. When every rank has written, rank 0 points ``latest.json`` at
the round (again temporary file + ``os.replace``), then each rank removes its older files. A crash
at any moment leaves ``latest.json`` naming a complete set of files. The folder must be visible to
every rank (a shared filesystem across nodes).

Files are read back with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain
Python values only (the RNG states too), so a crafted file cannot run code on ``--resume``. A rank
file is sealed: it holds the serialised payload as bytes with their SHA-256, because torch's zip
format does not check the tensor bytes (most flipped bytes would load silently as other weights).
Any file that cannot be used (empty, truncated, corrupt, not written by this trainer, the wrong
round or rank) raises :class:`CheckpointError` naming it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import tempfile
import warnings
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from ..distributed import CollectiveError
from .errors import ConfigError
from .model_registry import language_models

LATEST = "latest.json"
_FILE = re.compile(r"^round-(\d+)-rank-(\d+)\.pt$")
_TMP = re.compile(r"^\.tmp-.*-(round-\d+-rank-(\d+)\.pt|latest\.json)$")  # left by a crash mid-write


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: the message names the file and what is wrong with it."""


# Options that must not change between a checkpoint and its resumption.
RESUME_MUST_MATCH = ("method", "model", "width", "depth", "dataset", "data_path", "seed", "batch_size",
                     "local_steps", "options", "precision", "augment", "dataset_size", "context", "storage",
                     "shared", "outer_optimizer", "outer_lr", "outer_momentum", "compress", "optimizer",
                     "model_args", "dataset_args", "model_spec", "holdout")
#: options added after checkpoints were first written: a checkpoint without them had their defaults
_ADDED_DEFAULTS = {"outer_optimizer": "none", "outer_lr": 0.7, "outer_momentum": 0.9, "compress": "none",
                   "optimizer": "sgd", "model_args": {}, "dataset_args": {}, "model_spec": None,
                   "holdout": 0.0}


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


SEAL = "ist-train checkpoint, sha256-sealed, v1"


def seal(payload: Dict[str, Any]) -> Dict[str, Any]:
    """What a rank file holds: ``payload`` serialised, as bytes, with their SHA-256."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    raw = buf.getvalue()
    return {"format": SEAL, "sha256": hashlib.sha256(raw).hexdigest(),
            "payload": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}


def read_sealed(path: str) -> Any:
    """The payload of a file :func:`seal` wrote, checked against its SHA-256 and read with
    ``weights_only=True``; CheckpointError naming ``path`` otherwise."""
    sealed = _torch_load(path, path)
    if not (isinstance(sealed, dict) and sealed.get("format") == SEAL and isinstance(sealed.get("sha256"), str)
            and isinstance(sealed.get("payload"), torch.Tensor) and sealed["payload"].dtype == torch.uint8):
        raise CheckpointError(f"{path!r} is not a checkpoint written by this version of ist-train "
                              f"(no {SEAL!r} envelope)")
    raw = sealed["payload"].numpy().tobytes()
    if hashlib.sha256(raw).hexdigest() != sealed["sha256"]:
        raise CheckpointError(f"{path!r} is corrupt: its contents do not match the SHA-256 recorded when it "
                              f"was written")
    return _torch_load(io.BytesIO(raw), path)


def _torch_load(f, path: str) -> Any:
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing a file
            warnings.simplefilter("ignore")
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path!r} cannot be read as a checkpoint: {_load_failure(e)}") from None


def is_checkpoint_file(name: str) -> bool:
    """A file name this module writes (rank files, latest.json, temporary files of a crash)."""
    return name == LATEST or bool(_FILE.match(name) or _TMP.match(name))


def rank_file(folder: str, round_: int, rank: int) -> str:
    return os.path.join(folder, f"round-{round_:06d}-rank-{rank}.pt")


# ---------------------------------------------------------------- RNG states as tensors and plain values

def rng_state() -> Dict[str, Any]:
    """torch, numpy, Python ``random`` (and CUDA, when initialised) generator states, as tensors and
    plain values that ``torch.load(weights_only=True)`` reads back; :func:`set_rng_state` restores
    them bit for bit."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    s = {"torch": torch.get_rng_state(),
         "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
         "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                    "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: Dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    n = s["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = s["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---------------------------------------------------------------- writing

def save(folder: str, round_: int, rank: int, world_size: int, payload: Dict[str, Any],
         barrier: Optional[Callable[[str], None]] = None, manifest: Optional[Dict[str, Any]] = None) -> None:
    """Write this rank's file for ``round_``; all ranks call it. ``barrier(what)`` syncs them (a
    collective that names ``what`` when a peer fails). latest.json, the manifest, names the round,
    every rank's file and ``manifest``'s entries (e.g. the storage: under decentralized storage each
    file holds only its rank's part of the model)."""
    atomic_torch_save(seal(dict(payload, round=round_, rank=rank, world_size=world_size)),
                      rank_file(folder, round_, rank))
    if barrier:
        barrier(f"checkpoint round {round_}: every rank's file written")
    if rank == 0:
        atomic_json({"round": round_, "world_size": world_size, "num_workers": payload["num_workers"],
                     "files": [os.path.basename(rank_file(folder, round_, k)) for k in range(world_size)],
                     **(manifest or {}), "config": payload["config"]}, os.path.join(folder, LATEST))
    if barrier:
        barrier(f"checkpoint round {round_}: {LATEST} updated")
    for name in os.listdir(folder):  # latest.json no longer names them
        m, t = _FILE.match(name), _TMP.match(name)
        if (m and int(m.group(2)) == rank and int(m.group(1)) != round_) or \
                (t and (int(t.group(2)) == rank if t.group(2) else rank == 0)):
            os.unlink(os.path.join(folder, name))


# ---------------------------------------------------------------- reading

def _brief(e: BaseException) -> str:
    """The exception in one line (torch's messages run over many)."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 160 and ". " in first:
        first = first[:first.index(". ")]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _load_failure(e: BaseException) -> str:
    """Why torch.load(weights_only=True) could not read a file, in one line."""
    text = str(e).strip()
    if isinstance(e, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        detail = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation",
                                                             "Please file an issue"))]
        return ("the safe loader (weights_only) refused to unpickle it (" + (detail[0] if detail else "unsupported")
                + "): it is corrupt, or holds more than tensors and plain values")
    return f"it is truncated or corrupt ({_brief(e)})"


def read_latest(folder: str) -> Optional[Dict[str, Any]]:
    """``latest.json`` of ``folder`` (None when there is none); CheckpointError naming the file when
    it cannot be read or is not what :func:`save` writes."""
    path = os.path.join(folder, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read {path!r}: {_brief(e)}") from e
    if not raw:
        raise CheckpointError(f"{path!r} is empty (0 bytes); it should name the latest complete checkpoint")
    try:
        latest = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path!r} is not valid JSON ({_brief(e)}); the file is corrupt") from e
    expect = {"round": int, "world_size": int, "num_workers": int, "config": dict}
    bad = [k for k, tp in expect.items() if not isinstance(latest, dict) or not isinstance(latest.get(k), tp)
           or isinstance(latest.get(k), bool)]
    if bad or latest["round"] < 1 or latest["world_size"] < 1 or latest["num_workers"] < 1:
        raise CheckpointError(f"{path!r} is not a checkpoint index written by ist-train: expected an object with "
                              f"round, world_size, num_workers >= 1 and config, got {str(latest)[:120]}")
    return latest


def latest_round(folder: str) -> Optional[int]:
    latest = read_latest(folder)
    return None if latest is None else latest["round"]


def _as_compared(config: Dict[str, Any]) -> Dict[str, Any]:
    """A config as resume compares it: ``depth`` None (the model's default) is 1 for every model but
    a language model (the mlp's default; a ResNet ignores it), and a checkpoint from before
    ``context`` existed (when ``depth`` defaulted to 1) has the default context, 128."""
    out = {"context": 128, **config}
    if out.get("model") not in language_models():
        out["depth"] = out.get("depth") or 1
    return out


def check_resumable(folder: str, cfg, world_size: Optional[int] = None) -> int:
    """Raise ConfigError unless ``folder`` holds a checkpoint this config can resume (CheckpointError
    when latest.json is unusable); returns its round. Reads only latest.json, so the CLI checks it
    before any work starts."""
    latest = read_latest(folder)
    if latest is None:
        raise ConfigError("resume", f"no checkpoint in {folder!r}")
    saved, now = _as_compared(latest["config"]), _as_compared(cfg.to_dict())
    for key in RESUME_MUST_MATCH:
        if saved.get(key, _ADDED_DEFAULTS.get(key)) != now.get(key):
            raise ConfigError(key, f"is {now.get(key)!r} but the checkpoint in {folder!r} was made with "
                              f"{saved.get(key)!r}; it must not change on resume")
    if latest["num_workers"] != cfg.num_workers:
        raise ConfigError("workers", f"the checkpoint in {folder!r} has {latest['num_workers']} workers, "
                          f"this run {cfg.num_workers}")
    if bool(saved.get("simulate")) != bool(now.get("simulate")):
        raise ConfigError("simulate", f"the checkpoint in {folder!r} was made "
                          f"{'simulated' if saved.get('simulate') else 'with one process per worker'}; resume it the same way")
    if cfg.rounds is not None and latest["round"] > cfg.rounds:
        raise ConfigError("rounds", f"is {cfg.rounds} but the checkpoint in {folder!r} is at round {latest['round']}")
    if world_size is not None and latest["world_size"] != world_size:
        raise ConfigError("resume", f"the checkpoint in {folder!r} was written by {latest['world_size']} "
                          f"process(es), this run has {world_size}")
    return latest["round"]


# what save() puts in every rank file besides the caller's payload, and their types
_PAYLOAD = {"round": int, "rank": int, "world_size": int, "method": dict, "rng": dict, "history": list,
            "train_time": float, "wall_time": float}


def load(folder: str, rank: int, world_size: int, cfg) -> Dict[str, Any]:
    """This rank's file of the round latest.json names, read with ``weights_only=True`` and checked
    to be that round's file of this rank; CheckpointError naming the file otherwise."""
    round_ = check_resumable(folder, cfg, world_size)
    path = rank_file(folder, round_, rank)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path!r} is missing ({os.path.join(folder, LATEST)!r} names round {round_})")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path!r} is empty (0 bytes); the checkpoint is damaged")
    payload = read_sealed(path)
    bad = [k for k, tp in _PAYLOAD.items() if not isinstance(payload, dict) or
           not isinstance(payload.get(k), tp) or isinstance(payload.get(k), bool)]
    if bad:
        raise CheckpointError(f"{path!r} is not a checkpoint written by ist-train (missing or wrong: "
                              f"{', '.join(bad)})")
    if (payload["round"], payload["rank"], payload["world_size"]) != (round_, rank, world_size):
        raise CheckpointError(f"{path!r} holds round {payload['round']} of rank {payload['rank']} of "
                              f"{payload['world_size']}, expected round {round_} of rank {rank} of {world_size}")
    payload["path"] = path
    return payload


def restore(folder: str, rank: int, world_size: int, cfg, method) -> Dict[str, Any]:
    """Load this rank's checkpoint (:func:`load`) into ``method`` and the RNGs; returns the payload
    (round, history, train_time, wall_time). A file whose contents do not fit the method raises
    CheckpointError naming it."""
    payload = load(folder, rank, world_size, cfg)
    try:
        method.load_state_dict(payload["method"])
        set_rng_state(payload["rng"])
    except Exception as e:
        if isinstance(e, CollectiveError):
            raise
        raise CheckpointError(f"{payload['path']!r} does not fit this run ({cfg.method}): {_brief(e)}") from e
    return payload
