"""Paper 003 Table 4: ResIST's 3.58-3.81x over local SGD, predicted by the cost model from FLOPs and bytes.

    python -m ist_kernels.experiments paper003 [--efficiency 0.65] [--local-steps 50,25] [--baseline reduce_broadcast]

No training: the per-round time of local SGD and of ResIST on paper 003's setting (§5, Table 4:
preact ResNet-101 of basic blocks [3, 4, 23, 3] at width 64 on 32x32 CIFAR-10, batch 128 per worker,
4 and 8 V100s, ℓ local iterations per round, 160 epochs) from ``ist_kernels.distributed.cost``:

- compute: ℓ steps of the FLOPs of a training step (torch's FLOP counter on the meta device: the full
  model for local SGD, the deepest sub-ResNet of a ``resist_plan`` for ResIST, whose round waits for
  it) at ``--peak-tflops`` x ``--efficiency``, each step at least ``--step-overhead-ms``;
- communication over each link of :data:`LINKS` (alpha-beta, :class:`cost.Link`): local SGD averages
  the parameters and buffers as the paper does (``--baseline``, §2.5: the third section's blocks by
  a reduce then a broadcast, the rest by all-reduce), ResIST sends every partitioned block to its
  next owners (an all-to-all, Figure 3) and all-reduces the shared state.

Both methods run the same epochs with the same ℓ and batch, so they take the same number of rounds
and the speed-up is the ratio of their round times. Beside it the table gives the speed-up with each
term switched off (ResIST as deep as local SGD; ResIST sending what local SGD sends; local SGD
averaging by ring all-reduce; an infinitely fast link), the link bandwidth at which the model would
give the paper's speed-up, and Table 4's own times against the model's (what the model leaves
unexplained, per round). Writes paper003.json, .md and .png into ``--out``.
"""
import argparse
import functools
import math
import sys
import time
import warnings
from typing import Any, Dict, Optional, Sequence

import torch

from ..distributed import cost
from ..models import preact_resnet101_basic
from ..partition import resist_plan
from . import harness as C

# ---------------------------------------------------------------- the paper's setting (003_*.txt lines)

#: Table 4 (lines 227-237): total training seconds, (local SGD, ResIST) per S and dataset
TABLE4 = {4: {"C10": (5486.0, 1532.0), "C100": (5528.0, 1545.0)},
          8: {"C10": (10072.0, 2671.0), "C100": (10058.0, 2639.0)}}
#: Table 4's printed speed-ups
PAPER_SPEEDUP = {4: {"C10": 3.60, "C100": 3.58}, 8: {"C10": 3.77, "C100": 3.81}}
BATCH = 128          # per worker (line 175)
EPOCHS = 160         # with four or eight machines (line 175)
TRAIN_IMAGES = 50_000  # CIFAR-10/100 training set
INPUT = (3, 32, 32)
CLASSES = 10
WIDTH = 64
MIN_DEPTH = 5        # partitioned blocks per sub-ResNet at least (line 114)
#: ℓ per S: 50 is the paper's default (line 116); at 8 workers ℓ was reduced (line 201), by how much the
#: paper does not say: 25 is our assumption (it barely moves the prediction: the rounds are compute-bound)
LOCAL_STEPS = {4: 50, 8: 25}
V100_FP32_TFLOPS = 15.7  # NVIDIA V100 SXM2 datasheet, fp32 peak
EFFICIENCY = 0.65        # of that peak on the convolutions (10.2 TFLOP/s, speed.py's --device-tflops 10)
STEP_OVERHEAD_MS = 1.0   # per local step at least (speed.py's --step-overhead-ms)
#: the instances (line 173): p3.8xlarge (4 V100) for four workers, p3.16xlarge (8 V100) for eight
INSTANCE = {4: "p3.8xlarge", 8: "p3.16xlarge"}
#: AWS's published network performance of those instances, bit/s
INSTANCE_NETWORK_BPS = {"p3.8xlarge": 10e9, "p3.16xlarge": 25e9}


def links(S: int) -> Dict[str, cost.Link]:
    """The links the prediction is made for: ``nvlink`` (every worker a GPU of one instance, line 173;
    NCCL over NVLink 2.0, assumed 100 GB/s per rank and direction, 10 µs), ``network`` (one worker per
    instance over its published network rate, TCP, 50 µs one way: an assumption, the paper states no
    latency), ``100mbit`` (the emulated link of our own measurement, results/speed.md)."""
    return {"nvlink": cost.Link(100e9 * 8, 10e-6, efficiency=1.0),
            "network": cost.Link(INSTANCE_NETWORK_BPS[INSTANCE.get(S, "p3.16xlarge")], 50e-6),
            "100mbit": cost.Link(100e6, 50e-6)}


BASELINES = ("reduce_broadcast", "ring", "star")


# ---------------------------------------------------------------- the model's counts

def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return preact_resnet101_basic(CLASSES, INPUT[0], WIDTH)


@functools.lru_cache(maxsize=8)
def model_counts(S: int, min_depth: int = MIN_DEPTH, batch: int = BATCH, seed: int = 0) -> Dict[str, Any]:
    """FLOPs of a training step (batch ``batch``) and bytes (fp32 parameters and buffers) of the
    preact ResNet-101 and of the sub-ResNets of one ``resist_plan`` of it for ``S`` workers:
    ``full_flops``, ``partitioned_flops`` / ``shared_flops`` (``cost.split_step_flops``: the
    convolutions of the blocks ResIST deals out vs the rest), ``sub_flops`` (each sub-ResNet,
    counted on its own module), ``sub_blocks`` (its partitioned blocks), ``blocks`` (P),
    ``owners`` (mean sub-ResNets per partitioned block), ``state_bytes`` (what local SGD
    averages), ``partitioned_bytes``, ``shared_bytes``, ``third_section_bytes`` (the partitioned
    blocks: what the paper's local SGD reduces and broadcasts), ``param_count``."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _meta_model()
        plan = resist_plan(model, S, min_depth, torch.Generator().manual_seed(seed))
        partitioned = {t.name for t in plan.slices.tensors if not t.shared}
        pf, sf = cost.split_step_flops(model, INPUT, batch, partitioned)
        subs = plan.build()
        sub_flops = [float(cost.step_flops(s.module, INPUT, batch)) for s in subs]
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    part_bytes = float(sum(v for n, v in sizes.items() if n in partitioned))
    state = float(sum(sizes.values()))
    P = len(plan.partitioned_blocks)
    return {"S": S, "full_flops": pf + sf, "partitioned_flops": pf, "shared_flops": sf, "sub_flops": sub_flops,
            "sub_blocks": [len(b) for b in plan.blocks], "blocks": P,
            "owners": sum(len(b) for b in plan.blocks) / P, "state_bytes": state,
            "partitioned_bytes": part_bytes, "shared_bytes": state - part_bytes, "third_section_bytes": part_bytes,
            "param_count": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------- round times

def localsgd_comm_s(m: Dict[str, Any], S: int, link: cost.Link, baseline: str) -> float:
    """Local SGD's averaging of the whole state: ``ring`` (one ring all-reduce), ``reduce_broadcast``
    (the paper's, §2.5 line 102: the third section's blocks reduced to one rank then broadcast from
    it, pipelined as NCCL runs both, so each rank's link carries those bytes once per collective, 2x
    per round: Table 1's "2x the model per machine"; the other sections ring all-reduced) or
    ``star`` (the same reduce and broadcast through one rank's link, unpipelined, as a parameter
    server: that link carries the third section S - 1 times each way)."""
    if baseline == "ring":
        return cost.ring_all_reduce_s(m["state_bytes"], S, link)
    n3, rest = m["third_section_bytes"], m["state_bytes"] - m["third_section_bytes"]
    if baseline == "reduce_broadcast":
        rb = 2 * link.transfer_s(n3) + 2 * (S - 1) * link.latency_s
    elif baseline == "star":
        rb = 2 * link.transfer_s((S - 1) * n3) + 2 * link.latency_s
    else:
        raise ValueError(f"localsgd_comm_s: baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    return rb + cost.ring_all_reduce_s(rest, S, link) if S > 1 else 0.0


def resist_comm_s(m: Dict[str, Any], S: int, link: cost.Link) -> float:
    """ResIST's exchange (§2.5, Figure 3): every partitioned block to its next owners (an all-to-all,
    ``cost.subnet_round_bytes`` with the plan's owners per block) and a ring all-reduce of the shared
    state."""
    b = cost.subnet_round_bytes(m["partitioned_bytes"], m["shared_bytes"], S, m["owners"])
    return cost.all_to_all_s(b["all_to_all"], b["all_to_all"], link) + cost.ring_all_reduce_s(b["all_reduce"], S, link)


def rounds(S: int, local_steps: int) -> float:
    """Rounds of ``local_steps`` steps in 160 epochs of CIFAR split over S workers at batch 128."""
    return EPOCHS * TRAIN_IMAGES / (BATCH * S * local_steps)


def predict(m: Dict[str, Any], S: int, local_steps: int, link: cost.Link, *, rate: float,
            overhead_s: float = STEP_OVERHEAD_MS / 1e3, baseline: str = "reduce_broadcast",
            off: Sequence[str] = ()) -> Dict[str, Any]:
    """Round times of local SGD and ResIST and the speed-up, with the terms in ``off`` switched off:
    ``depth`` (ResIST computes the full model's FLOPs), ``bytes`` (ResIST's communication takes
    local SGD's time), ``averaging`` (local SGD averages by ring all-reduce), ``link`` (an
    infinitely fast link: no communication time)."""
    bad = set(off) - {"depth", "bytes", "averaging", "link"}
    if bad:
        raise ValueError(f"predict: unknown terms {sorted(bad)}")
    link = cost.Link(None) if "link" in off else link
    base = "ring" if "averaging" in off else baseline
    full_step = overhead_s + m["full_flops"] / rate
    sub_step = full_step if "depth" in off else overhead_s + max(m["sub_flops"]) / rate
    ls = cost.RoundCost(local_steps * full_step, 0.0, localsgd_comm_s(m, S, link, base), 0.0)
    rs_comm = ls.comm if "bytes" in off else resist_comm_s(m, S, link)
    rs = cost.RoundCost(local_steps * sub_step, 0.0, rs_comm, 0.0)
    return {"localsgd": {"compute_s": ls.compute, "comm_s": ls.comm, "round_s": ls.total},
            "resist": {"compute_s": rs.compute, "comm_s": rs.comm, "round_s": rs.total},
            "speedup": cost.speedup(ls.total, rs.total)}


def implied_bandwidth(m, S, local_steps, target, *, rate, overhead_s, baseline, latency_s=50e-6
                      ) -> Optional[float]:
    """The link bandwidth (bit/s, TCP) at which the model's speed-up equals ``target``; None when no
    bandwidth gives it (the speed-up runs from the compute ratio on a fast link to the
    communication ratio on a slow one)."""
    def f(bps):
        return predict(m, S, local_steps, cost.Link(bps, latency_s), rate=rate, overhead_s=overhead_s,
                       baseline=baseline)["speedup"] - target
    lo, hi = 1e3, 1e13
    if f(lo) * f(hi) > 0:
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if f(lo) * f(mid) <= 0:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


TERMS = (("depth", "no depth: ResIST as deep as local SGD"), ("bytes", "no bytes: ResIST sends local SGD's"),
         ("averaging", "no averaging: ring baseline"), ("link", "no link: infinitely fast"))


def table4_prediction(workers: Sequence[int] = (4, 8), local_steps: Optional[Dict[int, int]] = None, *,
                      efficiency: float = EFFICIENCY, peak_tflops: float = V100_FP32_TFLOPS,
                      step_overhead_ms: float = STEP_OVERHEAD_MS, baseline: str = "reduce_broadcast",
                      min_depth: int = MIN_DEPTH) -> Dict[str, Any]:
    """The prediction for every S in ``workers`` and every link of :func:`links`: round times, the
    speed-up with all terms and with each term of :data:`TERMS` off (and all of them: 1.0), the
    bandwidth that gives the paper's mean speed-up under each baseline, and Table 4's times beside
    the model's totals (``residual_per_round_s``: Table 4's time less the model's compute, per
    round: what the model would have to put into communication)."""
    if not 0 < efficiency <= 1 or peak_tflops <= 0 or step_overhead_ms < 0:
        raise ValueError("table4_prediction: need 0 < efficiency <= 1, peak_tflops > 0, step_overhead_ms >= 0")
    if baseline not in BASELINES:
        raise ValueError(f"table4_prediction: baseline must be one of {', '.join(BASELINES)}, got {baseline!r}")
    local_steps = dict(LOCAL_STEPS if local_steps is None else local_steps)
    rate = peak_tflops * 1e12 * efficiency
    oh = step_overhead_ms / 1e3
    rows = []
    for S in workers:
        if S < 2:
            raise ValueError(f"table4_prediction: S must be >= 2, got {S}")
        ell = local_steps.get(S, LOCAL_STEPS.get(S, 50))
        m = model_counts(S, min_depth)
        paper = PAPER_SPEEDUP.get(S)
        target = sum(paper.values()) / len(paper) if paper else None
        row = {"workers": S, "local_steps": ell, "rounds": rounds(S, ell), "instance": INSTANCE.get(S),
               "paper_speedup": paper, "sub_blocks": max(m["sub_blocks"]), "blocks": m["blocks"],
               "owners": m["owners"], "flops_ratio": max(m["sub_flops"]) / m["full_flops"],
               "bytes": {"localsgd_state": m["state_bytes"], "partitioned": m["partitioned_bytes"],
                         "shared": m["shared_bytes"]},
               "links": {}}
        for name, link in links(S).items():
            kw = dict(rate=rate, overhead_s=oh, baseline=baseline)
            cell = predict(m, S, ell, link, **kw)
            cell["bandwidth_bps"] = link.bandwidth_bps
            cell["without"] = {t: predict(m, S, ell, link, off=(t,), **kw)["speedup"] for t, _ in TERMS}
            cell["without"]["all"] = predict(m, S, ell, link, off=[t for t, _ in TERMS], **kw)["speedup"]
            cell["star_speedup"] = predict(m, S, ell, link, rate=rate, overhead_s=oh, baseline="star")["speedup"]
            row["links"][name] = cell
        row["implied_bandwidth_bps"] = {b: (implied_bandwidth(m, S, ell, target, rate=rate, overhead_s=oh, baseline=b)
                                            if target else None) for b in BASELINES}
        comp_ls = row["rounds"] * row["links"]["nvlink"]["localsgd"]["compute_s"]
        comp_rs = row["rounds"] * row["links"]["nvlink"]["resist"]["compute_s"]
        row["table4"] = {d: {"localsgd_s": t[0], "resist_s": t[1], "model_compute_localsgd_s": comp_ls,
                             "model_compute_resist_s": comp_rs,
                             "residual_per_round_localsgd_s": (t[0] - comp_ls) / row["rounds"],
                             "residual_per_round_resist_s": (t[1] - comp_rs) / row["rounds"]}
                         for d, t in TABLE4.get(S, {}).items()}
        rows.append(row)
    return {"setting": {"model": f"preact_resnet101_basic (width {WIDTH}, {CLASSES} classes, input {list(INPUT)})",
                        "batch": BATCH, "epochs": EPOCHS, "train_images": TRAIN_IMAGES, "min_depth": min_depth,
                        "peak_tflops": peak_tflops, "efficiency": efficiency, "rate_flops": rate,
                        "step_overhead_ms": step_overhead_ms, "baseline": baseline,
                        "local_steps": {str(S): local_steps.get(S, LOCAL_STEPS.get(S, 50)) for S in workers},
                        "param_count": model_counts(workers[0], min_depth)["param_count"]},
            "rows": rows}


# ---------------------------------------------------------------- outputs

def _x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _bw(v: Optional[float]) -> str:
    if v is None:
        return "none"
    return f"{v / 1e9:.3g} Gbit/s" if v >= 1e9 else f"{v / 1e6:.3g} Mbit/s"


def markdown(pred: Dict[str, Any]) -> str:
    s = pred["setting"]
    out = [f"Cost model on paper 003's setting: {s['model']}, {s['param_count'] / 1e6:.1f}M parameters, batch "
           f"{s['batch']}, V100 at {s['efficiency']:.0%} of {s['peak_tflops']:g} TFLOP/s fp32 "
           f"({s['rate_flops'] / 1e12:.1f} TFLOP/s), {s['step_overhead_ms']:g} ms per step at least, "
           f"baseline averaging `{s['baseline']}`.", "",
           "| S | ℓ | link | local SGD round (compute + comm) | ResIST round (compute + comm) | speed-up | "
           + " | ".join(label for _, label in TERMS) + " | all off | star baseline | paper |",
           "|---" * (10 + len(TERMS)) + "|"]
    for r in pred["rows"]:
        paper = "-".join(f"{v:.2f}" for v in sorted(r["paper_speedup"].values())) + "x" if r["paper_speedup"] else "—"
        for name, c in r["links"].items():
            ls, rs = c["localsgd"], c["resist"]
            out.append(f"| {r['workers']} | {r['local_steps']} | {name} ({_bw(c['bandwidth_bps'])}) | "
                       f"{ls['round_s']:.2f} s ({ls['compute_s']:.2f} + {ls['comm_s']:.3f}) | "
                       f"{rs['round_s']:.2f} s ({rs['compute_s']:.2f} + {rs['comm_s']:.3f}) | **{_x(c['speedup'])}** | "
                       + " | ".join(_x(c["without"][t]) for t, _ in TERMS)
                       + f" | {_x(c['without']['all'])} | {_x(c['star_speedup'])} | {paper} |")
    out += ["", "| S | sub-ResNet blocks (of 33) | its FLOPs / full | owners per block | bandwidth giving the paper's "
            "speed-up: reduce_broadcast / ring / star | Table 4 local SGD: time, model's compute, rest per round | "
            "Table 4 ResIST: time, model's compute, rest per round |", "|---|---|---|---|---|---|---|"]
    for r in pred["rows"]:
        ib = r["implied_bandwidth_bps"]
        t4 = r["table4"].get("C10") or {}
        shared = 33 - r["blocks"]
        t4ls = (f"{t4['localsgd_s']:.0f} s, {t4['model_compute_localsgd_s']:.0f} s, "
                f"{t4['residual_per_round_localsgd_s']:.2f} s" if t4 else "—")
        t4rs = (f"{t4['resist_s']:.0f} s, {t4['model_compute_resist_s']:.0f} s, "
                f"{t4['residual_per_round_resist_s']:.2f} s" if t4 else "—")
        out.append(f"| {r['workers']} | {shared} + {r['sub_blocks']} | {r['flops_ratio']:.3f} | {r['owners']:.2f} | "
                   f"{' / '.join(_bw(ib[b]) for b in BASELINES)} | {t4ls} | {t4rs} |")
    out += ["", "Table 4 times are CIFAR-10's (160 epochs); the rounds are 160 x 50,000 / (128 S ℓ). "
            "\"none\": no bandwidth gives the paper's speed-up under that baseline (it lies beyond both the "
            "compute ratio and the communication ratio)."]
    return "\n".join(out)


def plot(pred: Dict[str, Any]):
    fig, axes = C.figure(len(pred["rows"]), 1)
    for ax, r in zip(axes, pred["rows"]):
        names = list(r["links"])
        labels = ["all terms"] + [f"no {t}" for t, _ in TERMS] + ["star"]
        for i, name in enumerate(names):
            c = r["links"][name]
            vals = [c["speedup"]] + [c["without"][t] for t, _ in TERMS] + [c["star_speedup"]]
            xs = [j + (i - 1) * 0.27 for j in range(len(vals))]
            ax.bar(xs, [v or 0 for v in vals], width=0.27, label=name)
        for v in (r["paper_speedup"] or {}).values():
            ax.axhline(v, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, fontsize=7)
        C.style_axis(ax, f"S={r['workers']}, ℓ={r['local_steps']} (dashed: paper)", "", "speed-up over local SGD",
                     legend=True)
    return fig


def parser() -> argparse.ArgumentParser:
    p = C.parser("paper003", __doc__, seeds=(0,), quick="the same prediction: it takes seconds")
    p.add_argument("--workers", type=C.ints, default=[4, 8], help="S (default 4,8: Table 4's)")
    p.add_argument("--local-steps", type=C.ints, default=None,
                   help="ℓ per S, one per --workers entry (default 50 at S=4, the paper's; 25 at S=8, assumed)")
    p.add_argument("--efficiency", type=float, default=EFFICIENCY,
                   help="fraction of the V100's fp32 peak a step's convolutions run at (default %(default)s)")
    p.add_argument("--peak-tflops", type=float, default=V100_FP32_TFLOPS,
                   help="fp32 peak, TFLOP/s (default %(default)s)")
    p.add_argument("--step-overhead-ms", type=float, default=STEP_OVERHEAD_MS,
                   help="each local step takes at least this, ms (default %(default)s)")
    p.add_argument("--baseline", choices=BASELINES, default="reduce_broadcast",
                   help="how local SGD averages (default %(default)s: the paper's, §2.5)")
    return p


def main(argv: Sequence[str] = ()) -> int:
    p = parser()
    args = p.parse_args(list(argv))
    C.check_args(p, args)
    if args.local_steps is not None and len(args.local_steps) != len(args.workers):
        p.error("--local-steps needs one value per --workers entry")
    if any(S < 2 for S in args.workers):
        p.error("--workers must be >= 2")
    if not 0 < args.efficiency <= 1:
        p.error(f"--efficiency must be in (0, 1], got {args.efficiency}")
    started = time.time()
    ell = dict(zip(args.workers, args.local_steps)) if args.local_steps else None
    pred = table4_prediction(args.workers, ell, efficiency=args.efficiency, peak_tflops=args.peak_tflops,
                             step_overhead_ms=args.step_overhead_ms, baseline=args.baseline)
    C.write_outputs(args, "paper003", {**pred, "divergences": []}, markdown(pred), plot(pred), started)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
