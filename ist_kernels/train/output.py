"""What a run leaves behind: metrics.jsonl (one line per round), summary.json, the comparison table
(all of it in summary.md, a few columns on the terminal), and PNG plots of accuracy and loss against
rounds, megabytes sent and training seconds; and the lock that keeps two runs out of one output
folder."""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .checkpoint import atomic_json, is_checkpoint_file
from .config import ConfigError, under_torchrun
from .timing import TRAIN_PARTS

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
                                         "started": time.strftime("%Y-%m-%d %H:%M:%S"), "job": job_id()}).encode())
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        # the holder's record stays in the file: a restarted torchrun job recognises its folder by it
        while self._fds:
            fd = self._fds.pop()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def job_id() -> Optional[str]:
    """Under torchrun: this job, the same in every restart of its workers (the host and pid of rank
    0's elastic agent, and the rendezvous id); None otherwise."""
    if not under_torchrun():
        return None
    return f"{socket.gethostname()}:{os.getppid()}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def claimed_by(folder: str) -> Optional[str]:
    """The job (:func:`job_id`) that last held ``folder``'s lock, None when unknown."""
    try:
        with open(os.path.join(folder, LOCK_FILE)) as f:
            return json.loads(f.read() or "{}").get("job")
    except (OSError, ValueError, AttributeError):
        return None


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


def bytes_by_phase(history: Sequence[Dict[str, Any]], phases: Sequence[str], gather: int = 0) -> Dict[str, Any]:
    """``{"bytes_by_phase": {phase name: wire bytes}, "ps_bytes_by_phase": {phase name: ps bytes}}``
    from the rounds' ``phase`` tags (index into ``phases``), in phase order, with the bytes that
    assembled the full model (evaluation, the final save) as ``"gather"`` when there were any;
    ``{}`` when no round is tagged and nothing was gathered."""
    wire: Dict[int, int] = {}
    ps: Dict[int, int] = {}
    for rec in history:
        if rec.get("phase") is not None:
            wire[rec["phase"]] = wire.get(rec["phase"], 0) + rec["bytes_sent"]
            ps[rec["phase"]] = ps.get(rec["phase"], 0) + rec.get("ps_bytes", 0)
    if not wire and not gather:
        return {}
    name = lambda i: phases[i] if 0 <= i < len(phases) else f"phase {i}"  # noqa: E731
    out = {"bytes_by_phase": {name(i): wire[i] for i in sorted(wire)}}
    if wire:
        out["ps_bytes_by_phase"] = {name(i): ps[i] for i in sorted(ps)}
    if gather:
        out["bytes_by_phase"]["gather"] = gather
    return out


def time_by_phase(history: Sequence[Dict[str, Any]], phases: Sequence[str], parts: Sequence[str]) -> Dict[str, Any]:
    """``{"round_time_by_phase": {phase name: mean seconds per round}}``: a round's time is the sum of
    ``parts`` of its ``time`` (the training parts: local steps, plans, pack, collectives, unpack),
    averaged over the rounds from round 2 on (round 1 also pays for what is built once), per phase
    tag (``"all"`` for untagged rounds). ``{}`` when no round has a time."""
    sums: Dict[Any, List[float]] = {}
    for rec in history:
        t = rec.get("time")
        if not t or rec["round"] < 2:
            continue
        sums.setdefault(rec.get("phase"), []).append(sum(t.get(k, 0.0) for k in parts))
    if not sums:
        return {}
    name = lambda i: "all" if i is None else (phases[i] if 0 <= i < len(phases) else f"phase {i}")  # noqa: E731
    order = sorted(sums, key=lambda i: -1 if i is None else i)
    return {"round_time_by_phase": {name(i): sum(v) / len(v) for i, v in ((i, sums[i]) for i in order)}}


def human_count(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e6 else (f"{n / 1e3:.3g}k" if n >= 1e3 else str(int(n)))


def add_baseline_ratios(summaries: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """With a local-SGD run among ``summaries``, give every other summary ``bytes_ratio`` and
    ``ps_bytes_ratio``: its bytes per round (wire; the papers' parameter-server count) over local
    SGD's. Returns the local-SGD summary (None without one)."""
    base = next((s for s in summaries if s["method"] == "localsgd"), None) if len(summaries) > 1 else None
    if base is None:
        return None
    for s in summaries:
        if s is base:
            continue
        for key, per_round in (("bytes_ratio", "bytes_per_round"), ("ps_bytes_ratio", "ps_bytes_per_round")):
            s[key] = s[per_round] / base[per_round] if base[per_round] else None
    return base


#: the parts of ``time_by_part`` the summary table shows (``other``: what no part measured)
TABLE_PARTS = ("local", "plan", "pack", "comm", "unpack", "eval", "metrics", "checkpoint", "compile", "other")


def summary_table(summaries: Sequence[Dict[str, Any]]) -> str:
    """Markdown table: method, workers, rounds, accuracy, test loss, time, total bytes, bytes per
    round both ways (wire: what the collectives moved; ps: the papers' parameter-server count), the
    largest state a rank held, the final model's size (after pruning: of how many), the bytes of each
    phase where a run has phases, and the byte and time ratios to the local-SGD run among
    ``summaries`` when there is one."""
    base = next((s for s in summaries if s["method"] == "localsgd"), None) if len(summaries) > 1 else None
    sized = any("params" in s for s in summaries)
    phased = any(s.get("bytes_by_phase") for s in summaries)
    timed = any(s.get("time_by_part") for s in summaries)
    head = ["method", "model", "workers", "rounds", "accuracy", "test loss", "train time (s)", "bytes sent",
            "bytes / round", "ps bytes / round", "rank state"]
    head += ["model size"] * sized + ["bytes by phase"] * phased
    head += ["time by part (s)", "s / round by phase"] * timed
    if base is not None:
        head += ["bytes / local SGD", "ps bytes / local SGD", "time / local SGD"]
    rows = []
    for s in summaries:
        acc = "-" if s.get("accuracy") is None else f"{100 * s['accuracy']:.2f}%"
        loss = "-" if s.get("test_loss") is None else f"{s['test_loss']:.4f}"
        comp = s.get("compress", "none")
        row = [s["method"] + ("" if comp == "none" else f" ({comp})"), s["model"], f"{s['workers']} ({s['mode']})", str(s["rounds"]), acc, loss,
               f"{s['train_time']:.1f}", human_bytes(s["total_bytes"]), human_bytes(s["bytes_per_round"]),
               human_bytes(s["ps_bytes_per_round"]),
               f"{human_bytes(s['rank_state_bytes'])} of {human_bytes(s['full_state_bytes'])}"]
        if sized:
            size = "-" if "params" not in s else f"{human_count(s['params'])} ({human_bytes(s['param_bytes'])})"
            if s.get("params_full", s.get("params")) != s.get("params"):
                size += f", pruned from {human_count(s['params_full'])}"
            row.append(size)
        if phased:
            row.append(", ".join(f"{k} {human_bytes(v)}" for k, v in (s.get("bytes_by_phase") or {}).items()) or "-")
        if timed:
            parts = s.get("time_by_part") or {}
            row.append(", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k in TABLE_PARTS and v >= 0.005) or "-")
            row.append(", ".join(f"{k} {v:.3f}" for k, v in (s.get("round_time_by_phase") or {}).items()) or "-")
        if base is not None:
            for key in ("bytes_per_round", "ps_bytes_per_round"):
                row.append(f"{s[key] / base[key]:.3f}" if base[key] else "-")
            row.append(f"{s['train_time'] / base['train_time']:.2f}" if base["train_time"] else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _mb(n: float) -> str:
    mb = n / 1e6
    return f"{mb:.0f}" if mb >= 100 else f"{mb:.3g}"


def terminal_table(summaries: Sequence[Dict[str, Any]]) -> str:
    """The few columns a person reads on a terminal (summary.md has them all, from
    :func:`summary_table`): method, accuracy (bits per byte for language models), train time,
    seconds per round (the training parts, from round 2 on; per phase, in order, where a run has
    phases), megabytes per round and, with a local-SGD run among ``summaries``, bytes and time over
    local SGD's. A line fits 120 columns."""
    base = next((s for s in summaries if s["method"] == "localsgd"), None) if len(summaries) > 1 else None
    lm = any(s.get("bits_per_byte") is not None for s in summaries)
    head = ["method", "bits / byte" if lm else "accuracy", "train time (s)", "s / round", "MB / round"]
    if base is not None:
        head += ["bytes / local SGD", "time / local SGD"]
    rows, phases = [], []
    for s in summaries:
        comp = s.get("compress", "none")
        if lm:
            score = "-" if s.get("bits_per_byte") is None else f"{s['bits_per_byte']:.3f}"
        else:
            score = "-" if s.get("accuracy") is None else f"{100 * s['accuracy']:.2f}%"
        per_phase = s.get("round_time_by_phase") or {}
        if len(per_phase) > 1 and list(per_phase) not in phases:
            phases.append(list(per_phase))
        row = [s["method"] + ("" if comp == "none" else f" ({comp})"), score, f"{s['train_time']:.1f}",
               " / ".join(f"{v:.3f}" for v in per_phase.values()) or "-", _mb(s["bytes_per_round"])]
        if base is not None:
            row.append(f"{s['bytes_per_round'] / base['bytes_per_round']:.3f}" if base["bytes_per_round"] else "-")
            row.append(f"{s['train_time'] / base['train_time']:.2f}" if base["train_time"] else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    if phases:
        out.append("s / round by phase: " + "; ".join(" / ".join(p) for p in phases))
    return "\n".join(out)


def train_seconds(history: Sequence[Dict[str, Any]]) -> List[float]:
    """Each record's cumulative training seconds: the sum of the training parts of ``time``
    (:data:`~ist_kernels.train.timing.TRAIN_PARTS`: local steps, plans, pack, collectives, unpack;
    not evaluation, metrics or checkpoints) over the rounds up to and including it. A record without
    ``time`` (an older metrics.jsonl) counts its ``train_time`` since the previous one."""
    out, total, last_train_time = [], 0.0, 0.0
    for rec in history:
        t = rec.get("time")
        if t:
            total += sum(t.get(k, 0.0) for k in TRAIN_PARTS)
        else:
            total += max(rec.get("train_time", last_train_time) - last_train_time, 0.0)
        last_train_time = rec.get("train_time", last_train_time)
        out.append(total)
    return out


def plot_figures(runs: Dict[str, List[Dict[str, Any]]]) -> List[Tuple[str, Any]]:
    """``[(file name, matplotlib Figure)]`` (Agg): accuracy.png and loss.png, each with three panels,
    the metric against rounds, against megabytes sent (all workers) and against training seconds
    (:func:`train_seconds`). loss.png has the training loss too (dashed); for language models
    (records with ``bits_per_byte``) both losses in bits per byte. ``runs``: label -> metrics
    history; a figure whose metric no run has is left out. The caller closes the figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lm = bool(runs) and all(any(r.get("bits_per_byte") is not None for r in h) for h in runs.values())
    scale = 1 / math.log(2) if lm else 1.0  # nats per byte -> bits per byte
    figures = []
    for key, ylabel, fname in (("accuracy", "test accuracy", "accuracy.png"),
                               ("test_loss", "bits per byte" if lm else "test loss", "loss.png")):
        if not any(r.get(key) is not None for h in runs.values() for r in h):
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for label, hist in runs.items():
            seconds = dict(zip((id(r) for r in hist), train_seconds(hist)))
            xs = (lambda r: r["round"], lambda r: r["total_bytes"] / 1e6, lambda r: seconds[id(r)])
            pts = [r for r in hist if r.get(key) is not None]
            if key == "test_loss":  # also the training loss, dashed
                tr = [r for r in hist if r.get("train_loss") is not None]
                for ax, x in zip(axes, xs):
                    ax.plot([x(r) for r in tr], [scale * r["train_loss"] for r in tr], "--", alpha=0.6,
                            label=f"{label} (train)")
            for ax, x in zip(axes, xs):
                ax.plot([x(r) for r in pts], [(scale if key == "test_loss" else 1.0) * r[key] for r in pts], "o-",
                        ms=3, label=label)
        axes[0].set_xlabel("round")
        axes[1].set_xlabel("MB sent (all workers)")
        axes[2].set_xlabel("training time (s): local, plan, pack, comm, unpack")
        for ax in axes:
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if key == "test_loss":
                ax.set_yscale("log")
        fig.tight_layout()
        figures.append((fname, fig))
    return figures


def write_plots(runs: Dict[str, List[Dict[str, Any]]], out_dir: str) -> List[str]:
    """accuracy.png and loss.png (:func:`plot_figures`) in ``out_dir``. ``runs``: label -> metrics
    history. Returns the paths written."""
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for fname, fig in plot_figures(runs):
        path = os.path.join(out_dir, fname)
        try:
            fig.savefig(path, dpi=110)
        finally:
            plt.close(fig)
        paths.append(path)
    return paths


def write_comparison(cfg, summaries: List[Dict[str, Any]]) -> None:
    """The comparison of a command's runs, after they ran (the last stage of a run's way): local
    SGD's ratios into each summary.json (``bytes_ratio``, ...), summary.md (the full table), the
    terminal table (a few columns), accuracy.png / loss.png."""
    if add_baseline_ratios(summaries) is not None:
        for s in summaries:
            atomic_json(s, os.path.join(s["out_dir"], "summary.json"))
    out_dir = cfg.resolved_out_dir()
    table = summary_table(summaries)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    plots = []
    if cfg.plots:
        plots = write_plots({f"{s['method']} S={s['workers']}": read_metrics(os.path.join(s["out_dir"], "metrics.jsonl"))
                             for s in summaries}, out_dir)
    print(terminal_table(summaries))  # a few columns; summary.md has them all
    print(f"\noutputs in {os.path.abspath(out_dir)}:\n  summary.md (the full table)"
          + "".join(f", {os.path.basename(p)}" for p in plots)
          + "; per run: metrics.jsonl, summary.json, model.pt, checkpoints/")
