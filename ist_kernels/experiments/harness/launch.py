"""Starting runs: the cells of a grid in this process or a pool (:func:`run_grid`); one run of the
trainer on S real processes (:func:`launch`: ``python -m ist_kernels.train`` over loopback, or one
process per rank inside an emulated link's namespaces; kept in and read back from the run store);
its per-round curve (:func:`curve`); and many runs grouped by link (:func:`run_over_links`: each
emulated link made once, checked and removed after its runs)."""
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .link import EmulatedLink, parse_rate
from .store import NotStored, keep, run_key, slot, stored

# ---------------------------------------------------------------- grids in process

def _call(job):
    fn, args, cell = job
    return fn(args, cell)


def run_grid(run_cell: Callable, args, cells: Sequence, desc: str, jobs: int = 1) -> Dict:
    """{cell: run_cell(args, cell)} for every cell, with a progress bar; ``jobs`` > 1 runs the
    cells in that many processes (run_cell must then be a module-level function)."""
    from tqdm import tqdm

    results = {}
    with tqdm(total=len(cells), desc=desc, file=sys.stderr, unit="run") as bar:
        if jobs <= 1 or len(cells) <= 1:
            for c in cells:
                results[c] = run_cell(args, c)
                bar.update()
        else:
            with ProcessPoolExecutor(min(jobs, len(cells))) as pool:
                for c, r in zip(cells, pool.map(_call, [(run_cell, args, c) for c in cells])):
                    results[c] = r
                    bar.update()
    return results


# ---------------------------------------------------------------- the trainer on S processes

RUN_TIMEOUT_S = 1200  # one run's processes (bounded; a stuck run is killed and reported)


def _base_cmd() -> List[str]:
    return [sys.executable, "-m", "ist_kernels.train", "--threads", "1", "--device", "cpu", "--no-progress",
            "--no-plots", "--overwrite"]


def wait(procs: List[subprocess.Popen], timeout: float) -> List[int]:
    """The exit codes of ``procs``; when they are not all done within ``timeout`` seconds, every one still
    running is killed and TimeoutError raised."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            for q in procs:
                q.wait(timeout=30)
            raise TimeoutError(f"a run took more than {timeout:.0f} s; its processes were killed") from None
    return codes


def _port(seed: int, S: int) -> int:
    return 29400 + (os.getpid() * 7 + seed * 13 + S) % 2000


def launch(flags: List[str], S: int, seed: int, out_dir: str, link: Optional[EmulatedLink],
           store: Optional[str] = None, run_missing: bool = True) -> Dict[str, Any]:
    """One run: S ranks over loopback (the trainer's own --workers S) or inside ``link``'s namespaces
    (one process per rank, the torchrun environment set by hand). Returns its summary and metrics.
    With ``store`` (a path), a run kept there with the same command, S, seed and link is returned
    instead (``stored_at`` set), and a new run is kept there (beside, not over, a run of that name
    made with another command: :func:`~.store.slot`); ``run_missing`` False: a run not kept
    raises :class:`NotStored` instead of running."""
    key = run_key(_base_cmd()[1:] + list(flags), S, seed, link)
    store = slot(store, key)  # a run of this name made another way keeps its own file
    old = stored(store, key)
    if old is not None:
        return old
    if not run_missing:
        raise NotStored(f"not kept in {os.path.dirname(store) if store else '--runs-dir'} (--stored-only)")
    cmd = _base_cmd() + flags + ["--seed", str(seed), "--out-dir", out_dir]
    logs = [open(os.path.join(os.path.dirname(out_dir), f"{os.path.basename(out_dir)}.rank{r}.log"), "w")
            for r in range(S if link else 1)]
    try:
        if link is None:
            procs = [subprocess.Popen(cmd + ["--workers", str(S)], stdout=logs[0], stderr=subprocess.STDOUT)]
        else:
            port = _port(seed, S)
            procs = [subprocess.Popen(link.wrap(r, cmd, env=link.torchrun_env(r, S, port)), stdout=logs[r],
                                      stderr=subprocess.STDOUT) for r in range(S)]
        codes = wait(procs, RUN_TIMEOUT_S)
    finally:
        for f in logs:
            f.close()
    if any(codes):
        tail = open(logs[0].name).read()[-2000:]
        raise RuntimeError(f"run {' '.join(flags)} exited {codes}:\n{tail}")
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    run = {"summary": summary, "metrics": metrics}
    if store is not None:
        run["stored_at"] = keep(store, key, run)
    shutil.rmtree(out_dir, ignore_errors=True)  # checkpoints: megabytes a run
    return run


def curve(run: Dict[str, Any]) -> Dict[str, List]:
    """Per trained round: its training seconds, accuracy (language models: also bits per byte),
    bytes (all ranks), time parts, the busiest link's bytes and rank 0's wait for the last rank in
    its collectives (``wait``)."""
    rows = [m for m in run["metrics"] if m["round"] > 0]
    train, prev = [], 0.0
    for m in rows:
        train.append(m["train_time"] - prev)
        prev = m["train_time"]
    out = {"bits_per_byte": [m.get("bits_per_byte") for m in rows]} if any("bits_per_byte" in m for m in rows) else {}
    return {**out, "round_s": train, "accuracy": [m.get("accuracy") for m in rows],
            "bytes": [m["bytes_sent"] for m in rows], "parts": [m["time"] for m in rows],
            "busiest": [m.get("max_worker_link_bytes", m.get("max_worker_bytes_sent")) for m in rows],
            "wait": [m.get("peer_wait_s") for m in rows], "phase": [m.get("phase") for m in rows]}


def run_over_links(todo: Sequence[Tuple], link_and_workers, run_one, desc: str, latency_s: float = 0.0
                   ) -> Dict[Tuple, Dict[str, Any]]:
    """{cell: run_one(cell, link)} for every cell of ``todo``, loopback cells first, each emulated
    link (``link_and_workers(cell)`` -> (link name, S)) made once per (link, S), checked, and
    removed after its cells (on every exit path); a run that fails or times out gives
    ``{"error": ...}``."""
    from tqdm import tqdm

    results: Dict[Tuple, Dict[str, Any]] = {}
    groups: Dict[Tuple[str, int], List[Tuple]] = {}
    for c in sorted(todo, key=lambda c: (link_and_workers(c)[0] != "loopback", *map(str, c))):
        groups.setdefault(link_and_workers(c), []).append(c)
    with tqdm(total=len(todo), desc=desc, file=sys.stderr, unit="run") as bar:
        for (link_name, S), group in groups.items():
            em = None
            if link_name != "loopback":
                em = EmulatedLink(S, parse_rate(link_name), latency_s)
                em.__enter__()
            try:
                if em is not None:
                    em.check()
                for c in group:
                    try:
                        results[c] = run_one(c, em)
                    except (RuntimeError, TimeoutError) as e:
                        results[c] = {"error": str(e)[-800:]}
                    bar.update()
            finally:
                if em is not None:
                    em.__exit__(None, None, None)
    return results
