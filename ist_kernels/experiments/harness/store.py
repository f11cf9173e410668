"""The run store (``--runs-dir``): each run kept as one JSON file (the key it was made with, when it
was stored, the host's CPUs, the trainer's summary and per-round metrics) and read back in place of
running it again when the key is the same: the trainer's arguments, S, the seed and the link. Runs of
one name with different keys (e.g. tuning runs of another ``--tune-rounds``) keep a file each: the
first ``<name>.json``, the others ``<name>-<key hash>.json`` (:func:`slot`)."""
import hashlib
import json
import os
import time
from typing import Any, Dict, Optional, Sequence

STORED_AT = "%Y-%m-%dT%H:%M:%SZ"  # a kept run's ``stored_at``: UTC, ISO 8601

#: what makes a stored run the same run (--runs-dir): the trainer's arguments and where it ran
STORE_VERSION = 1


def run_key(command: Sequence[str], S: int, seed: int, link) -> Dict[str, Any]:
    """The key of a run: the trainer's arguments (``command``: all of them, the launcher's own first), S,
    the seed and the link (an ``EmulatedLink``, None over loopback: its rate, latency and TCP)."""
    return {"version": STORE_VERSION, "flags": list(command), "workers": S, "seed": seed,
            "link": None if link is None else {"bps": link.bandwidth_bps, "latency_s": link.latency_s,
                                               "tcp": link.tcp}}


def _read(store: Optional[str]) -> Optional[Dict[str, Any]]:
    """The JSON object kept at ``store`` (None: no store, no file, unreadable, not an object)."""
    if store is None or not os.path.exists(store):
        return None
    try:
        with open(store) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def stored(store: Optional[str], key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The run kept at ``store`` when it was made with ``key`` (else None: a missing, unreadable or
    different run is run again and overwritten)."""
    doc = _read(store)
    if doc is None or doc.get("key") != key or not isinstance(doc.get("metrics"), list) or "summary" not in doc:
        return None
    return {"summary": doc["summary"], "metrics": doc["metrics"], "stored_at": doc.get("stored_at")}


def key_hash(key: Dict[str, Any]) -> str:
    """Ten hex digits of the key's SHA-1 (its JSON, keys sorted)."""
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]


def slot(store: Optional[str], key: Dict[str, Any]) -> Optional[str]:
    """The file that keeps (or will keep) the run of ``key`` named by ``store``: ``store`` itself when
    it is free, unreadable or holds that key; else ``<store without .json>-<key hash>.json``, so that a
    run of the same name made another way never overwrites it."""
    doc = _read(store)
    if doc is None or "key" not in doc or stored(store, key) is not None:
        return store
    root = store[:-len(".json")] if store.endswith(".json") else store
    return f"{root}-{key_hash(key)}.json"


def keep(store: str, key: Dict[str, Any], run: Dict[str, Any]) -> str:
    """Write ``run`` to ``store`` atomically (a run interrupted while writing leaves no half file);
    returns the time it was stored (UTC, ISO 8601)."""
    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    tmp, at = store + f".tmp{os.getpid()}", time.strftime(STORED_AT, time.gmtime())
    with open(tmp, "w") as f:
        json.dump({"key": key, "stored_at": at,
                   "host_cpus": os.cpu_count(), "summary": run["summary"], "metrics": run["metrics"]}, f,
                  separators=(",", ":"))
    os.replace(tmp, store)
    return at


class NotStored(RuntimeError):
    """--stored-only: the run is not kept in --runs-dir."""


def run_path(runs_dir: Optional[str], name: str) -> Optional[str]:
    """Where ``runs_dir`` (--runs-dir) keeps the run called ``name`` (None without one)."""
    return None if runs_dir is None else os.path.join(runs_dir, name + ".json")
