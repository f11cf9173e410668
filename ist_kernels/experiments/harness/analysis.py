"""What the experiments compute from their runs: mean ± std over seeds and whether two means differ
(:func:`stats`, :func:`significant`, :func:`trend`), divergence records, the byte-frequency
baselines of a language model, and for runs of the trainer the time to a target (:func:`time_to_target`,
:func:`target_of`), the cost model's prediction of a run over a link (:func:`predict`), the
per-seed summary (:func:`seed_summary`) and the rows of every run (:func:`analyse`)."""
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ...distributed import cost
from ...train.datasets import pycode_files
from .link import parse_rate
from .workload import higher_is_better, trainer_method

# ---------------------------------------------------------------- statistics over seeds

def stats(values: Iterable[Optional[float]]) -> Dict[str, Any]:
    """mean, sample std, min, max over the finite values; n (finite) and n_diverged."""
    vals = list(values)
    ok = [float(v) for v in vals if v is not None and math.isfinite(v)]
    n = len(ok)
    if not n:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0, "n_diverged": len(vals)}
    mean = sum(ok) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in ok) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(ok), "max": max(ok), "n": n, "n_diverged": len(vals) - n}


def fmt(s: Dict[str, Any], spec: str = ".3g") -> str:
    """``mean ± std`` of a :func:`stats` dict, with the diverged count when there is one."""
    if s["mean"] is None:
        return "diverged"
    out = f"{s['mean']:{spec}} ± {s['std']:{spec}}"
    return out + (f" ({s['n_diverged']} div.)" if s["n_diverged"] else "")


def moves(a: Dict[str, Any], b: Dict[str, Any], sign: int) -> Optional[bool]:
    """Whether the mean moves from ``a`` to ``b`` in direction ``sign`` (+1 up, -1 down); None if
    either diverged."""
    if a["mean"] is None or b["mean"] is None:
        return None
    return (b["mean"] - a["mean"]) * sign > 0


def significant(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """|difference of the means| above twice its standard error (Welch), a rough 95% test."""
    if a["mean"] is None or b["mean"] is None or a["n"] < 2 or b["n"] < 2:
        return False
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    return abs(b["mean"] - a["mean"]) > 2 * se


def trend(grid: Sequence[Sequence[Dict[str, Any]]], axis: int, sign: int) -> Dict[str, int]:
    """Adjacent pairs of a grid of :func:`stats` along ``axis`` (0 rows, 1 columns) whose mean moves
    in direction ``sign``; ``significant``: those of them where the move exceeds 2 standard errors;
    ``pairs``: the pairs compared (ties and diverged cells are left out)."""
    hits = sig = total = 0
    R, C = len(grid), len(grid[0]) if grid else 0
    for i in range(R):
        for j in range(C):
            i2, j2 = (i + 1, j) if axis == 0 else (i, j + 1)
            if i2 < R and j2 < C:
                m = moves(grid[i][j], grid[i2][j2], sign)
                if m is None or grid[i][j]["mean"] == grid[i2][j2]["mean"]:  # diverged, or a tie (both 0)
                    continue
                total += 1
                hits += m
                sig += m and significant(grid[i][j], grid[i2][j2])
    return {"hits": hits, "significant": sig, "pairs": total}


# ---------------------------------------------------------------- divergence

# a loss this many times its initial value (or non-finite) counts as diverged
BLOW_UP = 1e6


def diverged_at(values: Sequence[float], blow_up: float = BLOW_UP) -> Optional[int]:
    """Index of the first value that is not finite or exceeds ``blow_up`` times the first one
    (None: the run stayed finite and bounded)."""
    ref = None
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            return i
        if ref is None:
            ref = abs(v)
        elif abs(v) > blow_up * max(ref, 1e-12):
            return i
    return None


def divergence(what: str, seed: int, lr: float, step: int, value: float, **extra) -> Dict[str, Any]:
    """One divergence record (listed in the JSON and the markdown)."""
    return {"what": what, "seed": seed, "lr": lr, "step": step,
            "value": value if value is not None and math.isfinite(value) else None, **extra}


# ---------------------------------------------------------------- language-model baselines

def byte_entropies(data: bytes) -> Dict[str, float]:
    """The byte-frequency baselines of a language model on ``data`` (bits per byte, plug-in estimates
    from its own counts): ``unigram_bits``, the entropy of one byte, -sum p(a) log2 p(a); ``bigram_bits``,
    the conditional entropy of a byte given the one before it, -sum p(a, b) log2 p(b | a) over the
    len - 1 adjacent pairs; and ``bytes``. b"abab..." gives 1 and 0 bits."""
    import torch

    if len(data) < 2:
        raise ValueError(f"byte_entropies: need at least 2 bytes, got {len(data)}")
    a = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def h(counts):  # -sum c/n log2(c/n) over the nonzero counts
        c = counts[counts > 0].double()
        p = c / c.sum()
        return float(-(p * p.log2()).sum())

    pairs = torch.bincount(a[:-1] * 256 + a[1:], minlength=256 * 256)
    # H(B | A) = H(A, B) - H(A), A over the pairs' first bytes
    bigram = h(pairs) - h(pairs.view(256, 256).sum(1))
    return {"unigram_bits": h(torch.bincount(a, minlength=256)), "bigram_bits": max(0.0, bigram),
            "bytes": len(data)}


def pycode_baselines() -> Dict[str, Any]:
    """:func:`byte_entropies` of the whole test split of ``--dataset pycode`` (every test file of the
    standard library, concatenated in the data set's order; the trainer scores its first 8 KiB)."""

    _, test = pycode_files()
    parts = []
    for path in test:
        with open(path, "rb") as f:
            parts.append(f.read())
    data = b"".join(parts)
    return {**byte_entropies(data), "dataset": "pycode", "split": "test", "files": len(test)}


# ---------------------------------------------------------------- time to target

def mean(v: Sequence[Optional[float]]) -> Optional[float]:
    """The mean of the values that are not None (None when there is none)."""
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def link_order(link: str) -> Tuple[bool, float]:
    """Sort key of link names: loopback first, then the emulated links by rate."""
    return (link != "loopback", 0.0 if link == "loopback" else parse_rate(link))


def predict(run: Dict[str, Any], loop: Dict[str, Any], link: cost.Link, S: int, method: str, steps: int
            ) -> Tuple[List[float], List[float]]:
    """The cost model's per-round times of ``run`` over ``link``, two ways (lists of seconds):

    * ``with measured compute``: the run's own time outside its collectives (local steps, plans,
      packing, unpacking: what the link does not change, measured in that run), plus the run's
      wait for its slowest rank to enter the collectives (``peer_wait_s``: the ranks' compute
      differs, and no byte moves before the last arrives; measured in that run too), plus the
      model's communication: max(the collectives' own work over loopback, in the loopback run
      ``loop`` of the same cell, its comm less its own wait; the link's time for the bytes of the
      round's busiest link, ``max_worker_link_bytes`` (a worker's sent or received bytes,
      whichever is more, summed over the collectives) and the latencies). The two overlap: gloo
      reduces and copies one piece while the next is on the wire. Runs from before the wait was
      measured add the loopback collectives whole to the link's time (an upper bound).
    * ``from loopback``: ``loop``'s whole round in place of the run's own non-communication time,
      the link's time added to it: a prediction made before the run, which also carries the
      machine's drift in compute speed between the two runs.

    DDP's collectives are the gradient all-reduces its backward pass did not hide (``comm``: from
    a step's last gradient bucket being ready to its all-reduce's end, ``Comm.gradient_step_done``);
    its latencies are one ring's per local step."""
    with_compute, from_loop = [], []
    lc, rc = loop["curve"], run["curve"]
    for i, per_round in enumerate(lc["round_s"]):
        per_rank = rc["busiest"][i] if rc["busiest"][i] is not None else rc["bytes"][i] / S
        latencies = 2 * (S - 1) * (steps if method == "ddp" else 1)
        wire = cost.comm_s(per_rank, link, latencies)
        from_loop.append(per_round + wire)
        loop_comm = lc["parts"][i].get("comm", 0.0)
        outside = max(0.0, rc["round_s"][i] - rc["parts"][i].get("comm", 0.0))
        run_wait, loop_wait = (c.get("wait", [None] * (i + 1))[i] for c in (rc, lc))
        if run_wait is None or loop_wait is None:
            with_compute.append(outside + loop_comm + wire)
        else:
            with_compute.append(outside + run_wait + max(loop_comm - loop_wait, wire))
    return with_compute, from_loop


def _signed(values: Sequence[Optional[float]], target: float, higher_is_better: bool
            ) -> Tuple[List[Optional[float]], float]:
    """``values`` and ``target`` as "higher is better" (negated when lower is), for the cost model's
    reached-at-or-above helpers."""
    sign = 1.0 if higher_is_better else -1.0
    return [None if x is None else sign * x for x in values], sign * target


def time_to_target(round_s: Sequence[float], values: Sequence[Optional[float]], target: Optional[float],
                   higher_is_better: bool = True) -> Tuple[Optional[float], Optional[int]]:
    """(training seconds, rounds) until the first evaluated round whose value reaches ``target``: at
    or above it (accuracy), or at or below it with ``higher_is_better`` False (bits per byte); (None,
    None) when none does or there is no target."""
    if target is None:
        return None, None
    v, t = _signed(values, target, higher_is_better)
    return cost.time_to_target(round_s, v, t), cost.rounds_to_target(v, t)


def rounds_to_target(values: Sequence[Optional[float]], target: Optional[float],
                     higher_is_better: bool = True) -> Optional[int]:
    """The rounds of :func:`time_to_target` alone (no round times needed)."""
    return None if target is None else cost.rounds_to_target(*_signed(values, target, higher_is_better))


def target_of(args, w: Dict[str, Any], base_final: Optional[float]) -> Optional[float]:
    """The target of workload ``w`` from local SGD's final value (same workload, S, seed): accuracy:
    ``--target``, else ``--target-fraction`` x it; bits per byte: it + ``--lm-margin``."""
    if higher_is_better(w):
        if args.target is not None:
            return args.target
        return None if base_final is None else args.target_fraction * base_final
    return None if base_final is None else base_final + args.lm_margin


def time_through(run: Dict[str, Any], rounds: float) -> Optional[float]:
    """The training seconds of ``run``'s first ``rounds`` rounds (a fractional round: that fraction of
    the next one's), from its measured per-round times; None past its last round."""
    round_s = (run.get("curve") or {}).get("round_s")
    if not round_s:
        return None if run.get("round_time_s") is None else rounds * run["round_time_s"]
    whole = int(math.floor(rounds))
    if whole > len(round_s) or (whole == len(round_s) and rounds > whole):
        return None
    return sum(round_s[:whole]) + (rounds - whole) * (round_s[whole] if whole < len(round_s) else 0.0)


def seed_summary(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workload, S, method, compress) and link: the rounds to target of every seed, from the
    loopback runs (a run's arithmetic does not depend on the link, so the seeds run where it is cheap),
    their mean (None unless every seed reached the target), the link's measured mean round time (its
    runs' mean over seeds) and the time to target over the link from the seeds' rounds: the link's runs'
    own training seconds through that many rounds (:func:`time_through`, so a method whose rounds cost
    differently by phase, LOFT's pre-training and fine-tuning or ResIST's warm-up, is charged the rounds
    it takes), beside the link's own runs' time to target; ``vs_localsgd``: that time over local SGD's
    (uncompressed, same workload, S and link)."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["workers"], r["method"], r["compress"]), []).append(r)
    out = []
    for (config, S, method, comp), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        loop = sorted((r for r in rs if r["link"] == "loopback"), key=lambda r: r["seed"])
        rounds = [r["rounds_to_target"] for r in loop]
        mean_rounds = mean(rounds) if loop and all(k is not None for k in rounds) else None
        for link_name in sorted({r["link"] for r in rs}, key=link_order):
            here = [r for r in rs if r["link"] == link_name]
            round_s = mean([r["round_time_s"] for r in here])
            through = None if mean_rounds is None else mean([t for t in (time_through(r, mean_rounds) for r in here)
                                                              if t is not None])
            out.append({"workload": config, "workers": S, "method": method, "compress": comp, "link": link_name,
                        "seeds": [r["seed"] for r in loop], "rounds_to_target": rounds,
                        "reached": sum(k is not None for k in rounds), "mean_rounds_to_target": mean_rounds,
                        "round_time_s": round_s,
                        "time_to_target_s": through,
                        "runs_time_to_target_s": [r["time_to_target_s"] for r in here]})
    for e in out:
        base = next((b for b in out if b["method"] == "localsgd" and b["compress"] == "none" and
                     all(b[k] == e[k] for k in ("workload", "workers", "link"))), None)
        e["vs_localsgd"] = (e["time_to_target_s"] / base["time_to_target_s"]
                            if base and e["time_to_target_s"] and base["time_to_target_s"] else None)
    return out


def analyse(args, results: Dict[Tuple, Dict[str, Any]], workloads: Dict[str, Dict[str, Any]]
            ) -> Tuple[List[Dict[str, Any]], List[str]]:
    """The rows of every run of ``results`` ({(config, S, link, method, compress, seed): a run's
    ``curve``, ``summary``, ``stored_at`` and ``tcp``, or its ``error`` or ``not_run``}), ``workloads[config]``
    each config's workload: its target (:func:`target_of`, from local SGD's run of the same cell), time
    and rounds to it, final metric, mean round time and parts, bytes, and the cost model's prediction
    (:func:`predict`, from the cell's loopback run); time to target against local SGD's and the
    prediction's error. Also the failed runs, one line each. ``args``: ``target``, ``target_fraction``,
    ``lm_margin`` and ``latency_s`` (the emulated links' latency)."""
    runs, errors = [], []
    for c, r in results.items():
        if "error" in r:
            errors.append(f"{'/'.join(map(str, c))}: {r['error'].splitlines()[-1] if r['error'] else ''}")
    for c, r in sorted(results.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if "error" in r or "not_run" in r:
            continue
        config, S, link_name, method, comp, seed = c
        w = workloads[config]
        metric, higher = w["metric"], higher_is_better(w)
        base = results.get((config, S, link_name, "localsgd", "none", seed)) or \
            results.get((config, S, "loopback", "localsgd", "none", seed))
        base_final = base["curve"][metric][-1] if base and "curve" in base and base["curve"].get(metric) else None
        target = target_of(args, w, base_final)
        cv = r["curve"]
        values = cv.get(metric) or [None] * len(cv["round_s"])
        emulated = link_name != "loopback"
        bw = parse_rate(link_name) if emulated else None
        lk = cost.Link(bw, args.latency_s if emulated else 0.0)
        loop = results.get((config, S, "loopback", method, comp, seed))
        pred, pred_loop = predict(r, loop, lk, S, method, w["local_steps"]) if loop and "curve" in loop \
            else (None, None)
        ttt, k = time_to_target(cv["round_s"], values, target, higher)
        parts = {p: sum(x.get(p, 0.0) for x in cv["parts"]) for p in ("local", "plan", "pack", "comm", "unpack")}
        tm, options = trainer_method(w, method)
        runs.append({
            "workload": config, "config": config, "model": w["model"], "dataset": w["dataset"], "method": method,
            "trainer_method": tm, "options": options, "compress": comp,
            "lr": r["summary"].get("lr"), "seed": seed, "workers": S, "link": link_name, "bandwidth_bps": bw,
            "latency_s": args.latency_s if emulated else 0.0, "emulated": emulated,
            "tcp": r.get("tcp"), "metric": metric, "higher_is_better": higher, "final_metric": values[-1] if values else None,
            "target": target, "target_accuracy": target if metric == "accuracy" else None,
            "time_to_target_s": ttt, "rounds_to_target": k,
            "predicted_time_to_target_s": sum(pred[:k]) if pred and k else None,
            "final_accuracy": cv["accuracy"][-1], "rounds": len(cv["round_s"]),
            "round_time_s": mean(cv["round_s"]), "predicted_round_time_s": mean(pred) if pred else None,
            "predicted_round_time_from_loopback_s": mean(pred_loop) if pred_loop else None,
            "bytes_per_round": mean(cv["bytes"]), "time_by_part": parts, "measured_at": r.get("stored_at"),
            "train_time_s": sum(cv["round_s"]), "curve": {"round_s": cv["round_s"], "accuracy": cv["accuracy"],
                                                    **({metric: values} if metric != "accuracy" else {}),
                                                    "parts": cv["parts"], "busiest": cv["busiest"],
                                                    "wait": cv["wait"]},
        })
    for r in runs:
        base = next((b for b in runs if b["method"] == "localsgd" and b["compress"] == "none" and
                     all(b[k] == r[k] for k in ("config", "workers", "link", "seed"))), None)
        r["time_vs_localsgd"] = (r["time_to_target_s"] / base["time_to_target_s"]
                                 if base and r["time_to_target_s"] and base["time_to_target_s"] else None)
        m = r["round_time_s"]
        for key, err in (("predicted_round_time_s", "prediction_error"),
                         ("predicted_round_time_from_loopback_s", "prediction_error_from_loopback")):
            r[err] = (r[key] - m) / m if r[key] is not None and m else None
    return runs, errors
