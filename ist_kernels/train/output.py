"""What a run leaves behind: metrics.jsonl (one line per round), summary.json, the comparison table,
and PNG plots of accuracy and loss against rounds and against bytes sent; and the lock that keeps
two runs out of one output folder."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

LOCK_FILE = ".ist-train.lock"
# what a run writes; --overwrite deletes these (and the checkpoints) and nothing else
RUN_FILES = ("metrics.jsonl", "summary.json", "model.pt")
TABLE_FILES = ("summary.md", "accuracy.png", "loss.png")


class OutputLockError(RuntimeError):
    """Another run holds the output folder."""


class OutputLock:
    """An exclusive ``fcntl.flock`` on ``<folder>/.ist-train.lock`` for each folder, held while the
    run lasts (the kernel drops it when the process dies, however it dies). The file holds the
    holder's pid and host, for the message of the run that finds the folder taken. Only one process
    of a run takes it: the launcher of ``--workers S``, rank 0 under torchrun."""

    def __init__(self, folders: Sequence[str]):
        self.folders = list(dict.fromkeys(os.path.abspath(f) for f in folders))
        self._fds: List[int] = []

    def __enter__(self) -> "OutputLock":
        try:
            for folder in self.folders:
                path = os.path.join(folder, LOCK_FILE)
                try:
                    os.makedirs(folder, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:
                    raise OutputLockError(f"cannot create the lock {path!r} of the output folder: "
                                          f"{e.strerror or e}") from None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
                    os.close(fd)
                    raise OutputLockError(
                        f"{folder!r} is in use by another ist-train run ({_describe(holder)}); wait for it "
                        f"to end or choose another --out-dir") from None
                self._fds.append(fd)
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                         "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        while self._fds:
            fd = self._fds.pop()
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "its pid is not written yet"


@contextlib.contextmanager
def claim_outputs(cfgs: Sequence[Any], root: str) -> Iterator[OutputLock]:
    """Hold the lock on the output folder ``root`` (and on each checkpoint folder outside it) while
    the runs ``cfgs`` (the main run, and its baseline) write there. A folder that holds anything but
    the lock needs --resume (continue the run) or --overwrite (the earlier run's outputs are deleted
    first); ConfigError otherwise."""
    from .config import ConfigError

    cfg = cfgs[0]
    top = os.path.abspath(root)
    outside = [c.resolved_checkpoint_dir() for c in cfgs
               if os.path.commonpath([os.path.abspath(c.resolved_checkpoint_dir()), top]) != top]
    with OutputLock([root] + outside) as lock:
        if cfg.overwrite:
            _delete_outputs(cfgs, root)
        elif not cfg.resume:
            for folder in lock.folders:
                held = sorted(set(os.listdir(folder)) - {LOCK_FILE})
                if held:
                    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
                    raise ConfigError("out_dir", f"{folder!r} is not empty (it holds {shown}); pass --resume "
                                      f"to continue the run there, --overwrite to replace it, or choose another "
                                      f"--out-dir")
        yield lock


def _delete_outputs(cfgs: Sequence[Any], root: str) -> None:
    from .checkpoint import is_checkpoint_file

    paths = [os.path.join(root, f) for f in TABLE_FILES]
    for c in cfgs:
        paths += [os.path.join(c.resolved_out_dir(), f) for f in RUN_FILES]
        d = c.resolved_checkpoint_dir()
        if os.path.isdir(d):
            paths += [os.path.join(d, f) for f in os.listdir(d) if is_checkpoint_file(f)]
    for p in paths:
        if os.path.isfile(p):
            os.unlink(p)


class MetricsLog:
    """metrics.jsonl on rank 0; on resume it is rewritten from the checkpoint's history first, so the
    file always describes exactly the rounds the model went through."""

    def __init__(self, path: str, history: Optional[List[Dict[str, Any]]] = None):
        self.path = path
        self.history = list(history or [])
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            for rec in self.history:
                f.write(json.dumps(rec) + "\n")

    def append(self, rec: Dict[str, Any]) -> None:
        self.history.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def read_metrics(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_bar(total: int, initial: int, enabled: bool, desc: str):
    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):
        # a thread lock, not tqdm's default multiprocessing one: the bar never crosses processes, and
        # the semaphore of a killed worker would be reported as leaked by the launcher
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="round", dynamic_ncols=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000.0
    return str(n)  # pragma: no cover


def summary_table(summaries: Sequence[Dict[str, Any]]) -> str:
    """Markdown table: method, workers, rounds, accuracy, test loss, time, total bytes, and the byte
    and time ratios to the local-SGD run among ``summaries`` when there is one."""
    base = next((s for s in summaries if s["method"] == "localsgd"), None) if len(summaries) > 1 else None
    head = ["method", "model", "workers", "rounds", "accuracy", "test loss", "train time (s)", "bytes sent"]
    if base is not None:
        head += ["bytes / local SGD", "time / local SGD"]
    rows = []
    for s in summaries:
        acc = "-" if s.get("accuracy") is None else f"{100 * s['accuracy']:.2f}%"
        loss = "-" if s.get("test_loss") is None else f"{s['test_loss']:.4f}"
        row = [s["method"], s["model"], f"{s['workers']} ({s['mode']})", str(s["rounds"]), acc, loss,
               f"{s['train_time']:.1f}", human_bytes(s["total_bytes"])]
        if base is not None:
            row.append(f"{s['total_bytes'] / base['total_bytes']:.3f}" if base["total_bytes"] else "-")
            row.append(f"{s['train_time'] / base['train_time']:.2f}" if base["train_time"] else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def write_plots(runs: Dict[str, List[Dict[str, Any]]], out_dir: str) -> List[str]:
    """accuracy.png and loss.png, each with two panels: against rounds and against bytes sent.
    ``runs``: label -> metrics history. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for key, ylabel, fname in (("accuracy", "test accuracy", "accuracy.png"), ("test_loss", "test loss", "loss.png")):
        if not any(r.get(key) is not None for h in runs.values() for r in h):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for label, hist in runs.items():
            pts = [r for r in hist if r.get(key) is not None]
            if key == "test_loss":  # also the training loss, dashed
                tr = [r for r in hist if r.get("train_loss") is not None]
                axes[0].plot([r["round"] for r in tr], [r["train_loss"] for r in tr], "--", alpha=0.6,
                             label=f"{label} (train)")
                axes[1].plot([r["total_bytes"] for r in tr], [r["train_loss"] for r in tr], "--", alpha=0.6,
                             label=f"{label} (train)")
            axes[0].plot([r["round"] for r in pts], [r[key] for r in pts], "o-", ms=3, label=label)
            axes[1].plot([r["total_bytes"] for r in pts], [r[key] for r in pts], "o-", ms=3, label=label)
        axes[0].set_xlabel("round")
        axes[1].set_xlabel("bytes sent (all workers)")
        for ax in axes:
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        if key == "test_loss":
            for ax in axes:
                ax.set_yscale("log")
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
