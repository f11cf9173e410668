"""Time to target (test accuracy; the language model's bits per byte) of every method on S real processes, over loopback and emulated limited links, beside a cost model's prediction, and the model extrapolated to 1,024 workers.

    python -m ist_kernels.experiments speed [--workers 2,4] [--links loopback,100mbit,1gbit] [--configs lm,cnn,mlp]

The workloads (``--configs``): ``lm``, the main one, ``gpt_tiny`` learning the bytes of the Python
standard library (``--dataset pycode``, context 128, batch 16, 40 rounds of 25 local steps, AdamW
for every method at a base lr of 1e-3, cosine after a 2-round warm-up), trained by ``localsgd``,
``ddp``, ``diloco``, ``ist-ffn`` and ``ist-heads`` (``ist`` with ``partition=ffn`` / ``heads``) and
``resist``, scored in test bits per byte (lower is better) beside the byte-frequency baselines of
pycode's test split (:func:`ist_kernels.experiments._common.pycode_baselines`: the entropy of one
byte and of a byte given the previous one); ``cnn`` and ``mlp`` on digits, scored in test accuracy.
On those every method of the trainer's registry that can train the workload (``grelu`` left
out: it trains a fixed-gate network with local SGD's communication; ``loft`` runs paper 000's
pipeline: LOFT pre-training for half the rounds, 50% filter pruning, local-SGD fine-tuning of the
pruned model) runs. Each runs the same data, seeds and rounds with S real processes (gloo over TCP; one ``python -m ist_kernels.train`` process per rank,
one torch thread each), once per link:

- ``loopback``: the processes talk over the loopback interface;
- ``100mbit``, ``1gbit``, ...: each rank runs in a network namespace of its own, joined to the
  others by a bridge, its link shaped to that rate in both directions (``ist_kernels.experiments.link``;
  needs root or CAP_NET_ADMIN, checked with a timed transfer before use; without them the line
  says why and only loopback runs, with the model's prediction for the other links).

Each method runs at its own learning rate, tuned on a validation split (never the test split): for
every (workload, method, S) a grid of ``--lr-grid`` multiples of the workload's lr (diloco: of its
inner AdamW's), each point one run of the comparison run's schedule stopped after
``--tune-rounds`` rounds, over loopback, uncompressed, on the first seed, with the trainer's
``--holdout`` (``--tune-holdout`` of the training set held out, left out of every shard, and scored
after every round in place of the test split). A point's score is its best held-out score in those
rounds (highest accuracy; language models: lowest bits per byte); the pick is the best score, ties
to the smaller lr (:func:`pick_lr`); a point that failed or whose loss went non-finite has no score;
with no score at all the workload's lr stays. A one-point grid (``--quick``) is not run: its point
is the pick. The grid, every score and the pick are in the JSON's ``tuning``; the comparison runs
(every link and compression mode) then run each method at its pick.

Each run evaluates after every round. Reported per method x workers x link: the training time (the
rounds' own wall time: local steps, plans, packing, communication; evaluation left out) until the
test metric first reaches the target (accuracy: at or above ``--target``, or ``--target-fraction``
of local SGD's final accuracy in the same workload, S and seed; bits per byte: at or below local
SGD's final plus ``--lm-margin``), the final metric, bytes per round, the measured
round time and its parts, and the cost model's prediction (``ist_kernels.distributed.cost``): the
run's own time outside its collectives (compute, plans, packing; measured) and its wait for the
slowest rank to enter them (measured) plus the model's communication: max(the collectives' own
work over loopback, the link's time for the bytes of the run's busiest link: a rank's sent or
received bytes, whichever is more, and the latencies); also the prediction made from
the loopback run alone (its whole round plus the link's time). DDP's collectives are the gradient
all-reduces its backward pass did not hide, timed by the trainer's DDP hook.

``scale``: the model alone, for S = 2 ... 1,024 at 1, 10 and 100 Gbit/s, on the papers' models
(LOFT preact_resnet18 on CIFAR-10, ResIST preact_resnet101_basic on CIFAR-100, IST on a one-hidden-
layer MLP of 4,096 units, each against local SGD of the same model): bytes per round and memory per
rank from the plans' split of the state into partitioned and shared parts, compute from the FLOPs
of a step (torch's FLOP counter, of the full model and of a subnetwork) at ``--device-tflops``,
``--scale-local-steps`` local steps of ``--scale-batch`` images, each step at least
``--step-overhead-ms``. The speed-up is per round (both methods taking as many rounds to the target;
what a subnetwork of a few units per worker does to accuracy is not modelled).
"""
import argparse
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..distributed import cost
from ..models import preact_resnet18, preact_resnet101_basic
from ..partition import loft_plan, resist_plan
from ..train.config import TrainConfig
from ..train.engine import state_split
from ..train.errors import ConfigError
from ..train.methods import METHODS
from . import _common as C, link as L

#: methods the experiment leaves out by default (see the docstring)
EXCLUDED = ("grelu",)

#: the workloads: the language model (``lm``, the main one: gpt_tiny on pycode, AdamW for every method, its
#: own list of methods, two of them IST variants), a CNN deep enough that ResIST partitions most of it (LOFT,
#: ResIST) and an MLP (IST, masked); on cnn and mlp every method that validates runs (diloco's inner AdamW at
#: its own learning rate). Keys: ``metric`` (default accuracy; ``bits_per_byte``: lower is better),
#: ``train`` (more trainer settings, each a flag and a TrainConfig field), ``methods`` (the workload's
#: methods; default: the registry's), ``variants`` (name -> (trainer method, its --option values)).
CONFIGS: Dict[str, Dict[str, Any]] = {
    # 40 rounds of 25 local steps: 1,000 AdamW steps of 16 x 128 bytes per worker, cosine after a 2-round
    # warm-up (docs/experiments.md: why, and the estimate that local SGD ends under 3.3 bits per byte)
    "lm": dict(dataset="pycode", model="gpt_tiny", width=128, depth=4, lr=1e-3, batch_size=16, local_steps=25,
               rounds=40, metric="bits_per_byte",
               train=dict(context=128, optimizer="adamw", lr_schedule="cosine", lr_warmup_rounds=2),
               methods=("localsgd", "ddp", "diloco", "ist-ffn", "ist-heads", "resist"),
               variants={"ist-ffn": ("ist", ["partition=ffn"]), "ist-heads": ("ist", ["partition=heads"])},
               options={}, flags={}),
    # scored with BatchNorm statistics re-estimated on 20 training batches (--eval-bn-batches; training
    # unchanged): the running statistics a subnetwork method's narrower models leave describe no full model
    "cnn": dict(dataset="digits", model="preact_resnet101_basic", width=16, lr=0.05, batch_size=32, local_steps=8,
                rounds=16, train=dict(eval_bn_batches=20),
                options={"resist": ["warmup_fraction=0.1"], "loft": ["pretrain_fraction=0.5"]},
                flags={"loft": ["--prune-ratio", "0.5"], "diloco": ["--lr", "0.001"]}),
    "mlp": dict(dataset="digits", model="mlp", width=8192, depth=1, lr=0.1, batch_size=64, local_steps=8, rounds=40,
                options={}, flags={"diloco": ["--lr", "0.001"]}),
}
#: --quick: every workload's rounds and local steps, and per workload what else shrinks (the lm: seconds a run)
QUICK = dict(rounds=3, local_steps=2, overrides={
    "cnn": dict(width=4), "mlp": dict(width=256),
    "lm": dict(width=64, depth=3, batch_size=4, train=dict(context=16, optimizer="adamw", lr_schedule="cosine",
                                                           lr_warmup_rounds=0, dataset_size=100_000))})
#: --lm-margin's default: the lm's target is local SGD's final bits per byte plus this
LM_MARGIN = 0.05
#: the metrics a workload can have: higher is better?
METRICS = {"accuracy": True, "bits_per_byte": False}
#: --quick runs these methods (one of each kind) unless --methods says otherwise
QUICK_METHODS = ("localsgd", "loft", "resist", "ist")
#: --compress's default: every method that compresses runs uncompressed and with these
COMPRESS = ("none", "int8", "bf16")
#: --quick runs its compressed modes (int8) for these methods only (one compressed row per link)
QUICK_COMPRESSED = ("resist",)

RUN_TIMEOUT_S = 1200  # one run's processes (bounded; a stuck run is killed and reported)
#: --run-cap-s's default: an emulated run predicted to train longer is not run (DDP over 10 Mbit/s: ~1 h)
RUN_CAP_S = 900.0

#: --lr-grid's default: multiples of the workload's learning rate tried for every (workload, method, S)
LR_GRID = (1 / 3, 1.0, 3.0, 10.0)
TUNE_HOLDOUT = 0.2  # --tune-holdout's default: the fraction of the training set the tuning runs score
#: the tuning score, by the first key the scored rounds have: (metric, higher is better)
TUNE_METRICS = (("bits_per_byte", False), ("bits_per_token", False), ("accuracy", True), ("test_loss", False))
TUNE_RULE = ("each grid point: the comparison run's schedule stopped after the tuning rounds, over loopback, "
             "uncompressed, first seed, with --holdout F (scored after every round on the held-out part of the "
             "training set, never the test split); score: the best held-out score in those rounds (highest accuracy; "
             "language models: lowest bits per byte); pick: the best score, ties to the smaller lr; a failed or "
             "non-finite run has no score; no score at all: the workload's lr; a one-point grid is not run")


def _fraction(v: str) -> float:
    """A number or a fraction a/b (argparse: --lr-grid 1/3,1,3,10)."""
    num, _, den = v.strip().partition("/")
    x = float(num) / float(den) if den else float(num)
    if not (x > 0 and x < float("inf")):
        raise ValueError(v)
    return x


lr_multipliers = C._number_list(_fraction, "number > 0 (or fraction a/b)")


def _links(s: str) -> List[str]:
    out = [v.strip().lower() for v in s.split(",") if v.strip()]
    for v in out:
        if v != "loopback":
            try:
                L.parse_rate(v)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
    if "loopback" not in out:
        out.insert(0, "loopback")  # the emulated runs' predictions start from the loopback runs
    return out


def parser() -> argparse.ArgumentParser:
    p = C.parser("speed", __doc__, seeds=(0,), quick="S=2, loopback and 100mbit, 3 rounds of 2 steps, tiny widths, "
                 f"methods {', '.join(QUICK_METHODS)}")
    p.add_argument("--configs", type=C.names, default=list(CONFIGS), help=f"workloads, of {', '.join(CONFIGS)}")
    p.add_argument("--methods", type=C.names, default=None,
                   help="methods (default: the workload's: on lm " + ", ".join(CONFIGS["lm"]["methods"]) +
                        f"; else every registered method that trains it, but {', '.join(EXCLUDED)}); a trainer "
                        "method names each of its variants (ist: ist-ffn and ist-heads on lm)")
    p.add_argument("--workers", type=C.ints, default=[2, 4], help="S, processes per run (default 2,4)")
    p.add_argument("--links", type=_links, default=["loopback", "100mbit", "1gbit"],
                   help="loopback and emulated link rates, e.g. 100mbit,1gbit (default %(default)s)")
    p.add_argument("--workers-of", action="append", default=[], metavar="WORKLOAD=S[,S...]",
                   help="S for one workload in place of --workers (repeatable), e.g. lm=4")
    p.add_argument("--links-of", action="append", default=[], metavar="WORKLOAD=LINK[,LINK...]",
                   help="links for one workload in place of --links (repeatable), e.g. lm=loopback,10mbit")
    p.add_argument("--lr-grid-of", action="append", default=[], metavar="WORKLOAD=M[,M...]",
                   help="the lr grid's multipliers for one workload in place of --lr-grid (repeatable), e.g. "
                        "cnn=1/3,1,3")
    p.add_argument("--link-seeds", type=int, default=None, metavar="N",
                   help="over an emulated link run only the first N of --seeds (default: all); loopback runs "
                        "them all")
    p.add_argument("--tune-only", action="store_true",
                   help="run the tuning (kept with --runs-dir) and print its table; no comparison runs, no outputs")
    p.add_argument("--latency", default="0", help="one-way latency added to each emulated link, e.g. 5ms (needs netem)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the workload's)")
    p.add_argument("--local-steps", type=int, default=None, help="local steps per round (default: the workload's)")
    p.add_argument("--target", type=float, default=None,
                   help="target test accuracy of the accuracy workloads (default: --target-fraction)")
    p.add_argument("--target-fraction", type=float, default=0.98,
                   help="target = this fraction of local SGD's final accuracy (same workload, S, seed)")
    p.add_argument("--lm-margin", type=float, default=LM_MARGIN,
                   help="the lm's target: local SGD's final test bits per byte (same S, seed) plus this; reached "
                        "at or below it (default %(default)s)")
    p.add_argument("--compress", type=C.names, default=None,
                   help="the trainer's --compress modes to run the subnetwork methods and local SGD with (default: "
                        f"{','.join(COMPRESS)}; --quick: none,int8, int8 for {', '.join(QUICK_COMPRESSED)} only)")
    p.add_argument("--lr-grid", type=lr_multipliers, default=None, metavar="M[,M...]",
                   help="learning rates tried per workload, method and S, as multiples of the workload's (a/b "
                        "allowed; default 1/3,1,3,10; --quick: 1, which is not run)")
    p.add_argument("--tune-rounds", type=int, default=None,
                   help="rounds of each tuning run (default: half the workload's rounds; --quick: all of them)")
    p.add_argument("--tune-holdout", type=float, default=TUNE_HOLDOUT,
                   help="fraction of the training set the tuning runs hold out and score (default %(default)s)")
    p.add_argument("--runs-dir", default=None, metavar="DIR",
                   help="keep every run (tuning and comparison) as DIR/<run>.json and reuse a stored run whose "
                        "command, S, seed and link are the same instead of running it again: an interrupted "
                        "experiment resumes, and parts run separately (a link, an S, seeds) merge into one output "
                        "when a last call names them all (default: nothing kept)")
    p.add_argument("--stored-only", action="store_true",
                   help="with --runs-dir: run nothing; the runs not kept there are listed as not run (merges "
                        "parts run separately into one output)")
    p.add_argument("--run-cap-s", type=float, default=RUN_CAP_S,
                   help="an emulated-link run the cost model predicts (from its loopback run) to train longer than "
                        "this is not run and is listed with the prediction (default %(default)s s)")
    p.add_argument("--no-scale", action="store_true", help="skip the 1,024-worker table")
    p.add_argument("--device-tflops", type=float, default=10.0,
                   help="sustained FLOP rate of a worker in the scale table, TFLOP/s (default 10: a V100, "
                        "paper 003's GPU, at ~65%% of its fp32 peak)")
    p.add_argument("--scale-local-steps", type=int, default=50, help="local steps per round in the scale table "
                   "(paper 003's default)")
    p.add_argument("--scale-batch", type=int, default=128, help="batch per worker in the scale table (paper 003)")
    p.add_argument("--step-overhead-ms", type=float, default=1.0,
                   help="fixed time of every local step in the scale table, ms (kernel launches, the optimizer; "
                        "default %(default)s): a step never takes less, however small the subnetwork")
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = parser()
    args = C.parse_args(p, argv, dict(workers=[2], links=lambda v: v[:2]), ("scale_local_steps", "scale_batch"))
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown workload {c!r}; available: {', '.join(CONFIGS)}")
    for flag, cast in (("workers_of", C.ints), ("links_of", _links), ("lr_grid_of", lr_multipliers)):
        per = {}
        for item in getattr(args, flag):
            name, _, value = item.partition("=")
            if name not in args.configs or not value:
                p.error(f"--{flag.replace('_', '-')} {item!r}: expected WORKLOAD=VALUES with WORKLOAD one of "
                        f"--configs ({', '.join(args.configs)})")
            try:
                per[name] = cast(value)
            except (argparse.ArgumentTypeError, ValueError) as e:
                p.error(f"--{flag.replace('_', '-')} {item!r}: {e}")
        setattr(args, flag, per)
    if any(s < 2 for s in args.workers + [s for v in args.workers_of.values() for s in v]):
        p.error(f"--workers and --workers-of must be >= 2, got {args.workers} {args.workers_of}")
    for name in ("rounds", "local_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr_grid is None:
        args.lr_grid = [1.0] if args.quick else list(LR_GRID)
    if args.link_seeds is not None and args.link_seeds < 1:
        p.error(f"--link-seeds must be >= 1, got {args.link_seeds}")
    if args.tune_rounds is not None and args.tune_rounds < 1:
        p.error(f"--tune-rounds must be >= 1, got {args.tune_rounds}")
    if not 0 < args.tune_holdout < 1:
        p.error(f"--tune-holdout must be in (0, 1), got {args.tune_holdout}")
    if args.target is not None and not 0 < args.target <= 1:
        p.error(f"--target must be in (0, 1], got {args.target}")
    if not 0 < args.target_fraction <= 1:
        p.error(f"--target-fraction must be in (0, 1], got {args.target_fraction}")
    if not (args.lm_margin >= 0 and math.isfinite(args.lm_margin)):
        p.error(f"--lm-margin must be a finite number >= 0, got {args.lm_margin}")
    if args.stored_only and args.runs_dir is None:
        p.error("--stored-only needs --runs-dir")
    if not args.run_cap_s > 0:
        p.error(f"--run-cap-s must be > 0, got {args.run_cap_s}")
    if not args.device_tflops > 0 or not args.step_overhead_ms >= 0:
        p.error("--device-tflops must be > 0 and --step-overhead-ms >= 0")
    try:
        args.latency_s = L.parse_time(args.latency)
    except ValueError as e:
        p.error(str(e))
    if args.compress is None:
        args.compress = ["none", "int8"] if args.quick else list(COMPRESS)
    bad = [c for c in args.compress if c not in COMPRESS]
    if bad or "none" not in args.compress:
        p.error(f"--compress: each of {', '.join(COMPRESS)}, none among them (the uncompressed runs are the "
                f"baseline), got {','.join(args.compress)}")
    if args.methods is not None:
        variants = sorted({v for w in CONFIGS.values() for v in w.get("variants", {})})
        unknown = [m for m in args.methods if m not in METHODS and m not in variants]
        if unknown:
            p.error(f"--methods: unknown {unknown}; registered: {', '.join(sorted(METHODS))}; variants: "
                    f"{', '.join(variants)}")
    return args


# ---------------------------------------------------------------- the runs

def workload(args, name: str) -> Dict[str, Any]:
    w = dict(CONFIGS[name])
    w.setdefault("metric", "accuracy")
    if args.quick:
        w.update(QUICK["overrides"].get(name, {}), rounds=QUICK["rounds"], local_steps=QUICK["local_steps"])
    if args.rounds is not None:
        w["rounds"] = args.rounds
    if args.local_steps is not None:
        w["local_steps"] = args.local_steps
    return w


def _without_lr(flags: Sequence[str]) -> List[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "--lr":
            skip = True
        else:
            out.append(f)
    return out


def trainer_method(w: Dict[str, Any], name: str) -> Tuple[str, List[str]]:
    """(the trainer's --method, its --option values) of ``name`` on workload ``w``: a variant of the
    workload's (lm's ist-ffn: ist with partition=ffn) or a trainer method itself."""
    method, options = w.get("variants", {}).get(name, (name, []))
    return method, list(options)


def _per_method(w: Dict[str, Any], key: str, name: str) -> List[str]:
    """``w[key]``'s list for the method ``name``: its own entry, else its trainer method's."""
    table = w.get(key, {})
    return list(table[name] if name in table else table.get(trainer_method(w, name)[0], []))


def higher_is_better(w: Dict[str, Any]) -> bool:
    return METRICS[w.get("metric", "accuracy")]


def base_lr(w: Dict[str, Any], method: str) -> float:
    """The workload's learning rate for ``method``: its own ``--lr`` flag (diloco's inner AdamW) or the
    workload's; the tuning grid multiplies it."""
    extra = _per_method(w, "flags", method)
    for i, f in enumerate(extra[:-1]):
        if f == "--lr":
            return float(extra[i + 1])
    return float(w["lr"])


def lr_grid(w: Dict[str, Any], method: str, multipliers: Sequence[float]) -> List[float]:
    """The learning rates tuned for ``method`` on ``w``: ``base_lr`` times each multiplier (6
    significant digits), increasing, without repeats."""
    base = base_lr(w, method)
    return sorted({float(f"{base * m:.6g}") for m in multipliers})


def method_flags(w: Dict[str, Any], method: str, compress: str, lr: Optional[float] = None) -> List[str]:
    """The trainer's flags of ``method`` on workload ``w``; ``lr``: in place of :func:`base_lr`."""
    lr = base_lr(w, method) if lr is None else lr
    tm, variant_options = trainer_method(w, method)
    flags = ["--method", tm, "--model", w["model"], "--width", str(w["width"]), "--dataset", w["dataset"],
             "--rounds", str(w["rounds"]), "--local-steps", str(w["local_steps"]), "--batch-size",
             str(w["batch_size"]), "--lr", f"{lr:.6g}", "--eval-interval", "1"]
    if "depth" in w:
        flags += ["--depth", str(w["depth"])]
    for k, v in w.get("train", {}).items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    for o in variant_options + _per_method(w, "options", method):
        flags += ["--option", o]
    flags += _without_lr(_per_method(w, "flags", method))
    if compress != "none":
        flags += ["--compress", compress]
    return flags


def trains(w: Dict[str, Any], method: str, S: int) -> Optional[str]:
    """None when ``method`` can train workload ``w`` with S workers, else why not."""
    universe = w.get("methods")
    if universe is not None and method not in universe:
        return f"not one of the workload's methods ({', '.join(universe)})"
    tm, variant_options = trainer_method(w, method)
    if tm not in METHODS:
        return f"the trainer has no method {tm!r}"
    opts = dict(o.split("=", 1) for o in variant_options + _per_method(w, "options", method))
    kw = {k: w[k] for k in ("dataset", "model", "width", "depth", "lr", "batch_size", "local_steps", "rounds") if k in w}
    try:
        TrainConfig(method=tm, workers=S, options=opts, **kw, **w.get("train", {})).validate()
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def compresses(method: str) -> bool:
    return method != "ddp"  # torch's DistributedDataParallel sends its own gradient buckets


def method_names(args, w: Dict[str, Any]) -> List[str]:
    """The methods run on workload ``w``: ``--methods`` (a trainer method stands for each of its
    variants), else the workload's list or the registry's (--quick: those whose trainer method is in
    QUICK_METHODS; else without EXCLUDED)."""
    universe = list(w["methods"]) if "methods" in w else sorted(METHODS)
    tm = {n: trainer_method(w, n)[0] for n in universe}
    if args.methods is not None:
        out = [n for n in universe if n in args.methods or tm[n] in args.methods]
        # a requested method the workload does not list: trains() says why it is skipped
        return out + [m for m in args.methods if m not in out and not any(tm[n] == m for n in out)]
    if args.quick:
        return [n for n in universe if tm[n] in QUICK_METHODS]
    return [n for n in universe if tm[n] not in EXCLUDED]


def workers_of(args, config: str) -> List[int]:
    """The S of workload ``config``: its --workers-of, else --workers."""
    return getattr(args, "workers_of", {}).get(config, args.workers)


def lr_grid_of(args, config: str) -> List[float]:
    """The lr grid's multipliers of workload ``config``: its --lr-grid-of, else --lr-grid."""
    return getattr(args, "lr_grid_of", {}).get(config, args.lr_grid)


def links_of(args, config: str) -> List[str]:
    """The links of workload ``config``: its --links-of, else --links (loopback only when links cannot
    be emulated here)."""
    links = getattr(args, "links_of", {}).get(config, args.links)
    return ["loopback"] if getattr(args, "loopback_only", False) else links


def link_order(link: str) -> Tuple[bool, float]:
    """Sort key of link names: loopback first, then the emulated links by rate."""
    return (link != "loopback", 0.0 if link == "loopback" else L.parse_rate(link))


def link_seeds(args, link: str) -> List[int]:
    """The seeds run over ``link``: every --seeds over loopback; over an emulated link the first
    --link-seeds of them (a run's arithmetic does not depend on the link: the seeds' rounds come from
    loopback, a link's runs give its round time)."""
    n = getattr(args, "link_seeds", None)
    return list(args.seeds) if link == "loopback" or n is None else list(args.seeds)[:n]


def all_links(args) -> List[str]:
    return sorted({x for c in args.configs for x in links_of(args, c)}, key=link_order)


def cells(args) -> Tuple[List[Tuple], List[str]]:
    """(config, S, link, method, compress, seed) of every run, and the skipped methods with why."""
    out, skipped = [], []
    for c in args.configs:
        w = workload(args, c)
        for m in method_names(args, w):
            why = trains(w, m, max(workers_of(args, c)))
            if why is not None:
                skipped.append(f"{m} on {c} ({w['model']}): {why}")
                continue
            for S in workers_of(args, c):
                for link in links_of(args, c):
                    for comp in args.compress:
                        tm = trainer_method(w, m)[0]
                        if comp != "none" and (not compresses(tm) or args.quick and tm not in QUICK_COMPRESSED
                                               and args.methods is None):
                            continue
                        for seed in link_seeds(args, link):
                            out.append((c, S, link, m, comp, seed))
    return out, skipped


def _base_cmd() -> List[str]:
    return [sys.executable, "-m", "ist_kernels.train", "--threads", "1", "--device", "cpu", "--no-progress",
            "--no-plots", "--overwrite"]


def _wait(procs: List[subprocess.Popen], timeout: float) -> List[int]:
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


#: what makes a stored run the same run (--runs-dir): the trainer's arguments and where it ran
STORE_VERSION = 1


def _store_key(flags: Sequence[str], S: int, seed: int, link: Optional["L.EmulatedLink"]) -> Dict[str, Any]:
    return {"version": STORE_VERSION, "flags": list(_base_cmd()[1:]) + list(flags), "workers": S, "seed": seed,
            "link": None if link is None else {"bps": link.bandwidth_bps, "latency_s": link.latency_s,
                                               "tcp": link.tcp}}


def stored(store: Optional[str], key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The run kept at ``store`` when it was made with ``key`` (else None: a missing, unreadable or
    different run is run again and overwritten)."""
    if store is None or not os.path.exists(store):
        return None
    try:
        with open(store) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if doc.get("key") != key or not isinstance(doc.get("metrics"), list) or "summary" not in doc:
        return None
    return {"summary": doc["summary"], "metrics": doc["metrics"], "stored_at": doc.get("stored_at")}


def keep(store: str, key: Dict[str, Any], run: Dict[str, Any]) -> str:
    """Write ``run`` to ``store`` atomically (a run interrupted while writing leaves no half file);
    returns the time it was stored (UTC, ISO 8601)."""
    os.makedirs(os.path.dirname(os.path.abspath(store)), exist_ok=True)
    tmp, at = store + f".tmp{os.getpid()}", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(tmp, "w") as f:
        json.dump({"key": key, "stored_at": at,
                   "host_cpus": os.cpu_count(), "summary": run["summary"], "metrics": run["metrics"]}, f,
                  separators=(",", ":"))
    os.replace(tmp, store)
    return at


class NotStored(RuntimeError):
    """--stored-only: the run is not kept in --runs-dir."""


def launch(flags: List[str], S: int, seed: int, out_dir: str, link: Optional["L.EmulatedLink"],
           store: Optional[str] = None, run_missing: bool = True) -> Dict[str, Any]:
    """One run: S ranks over loopback (the trainer's own --workers S) or inside ``link``'s namespaces
    (one process per rank, the torchrun environment set by hand). Returns its summary and metrics.
    With ``store`` (a path), a run kept there with the same command, S, seed and link is returned
    instead (``stored_at`` set), and a new run is kept there; ``run_missing`` False: a run not kept
    raises :class:`NotStored` instead of running."""
    key = _store_key(flags, S, seed, link)
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
        codes = _wait(procs, RUN_TIMEOUT_S)
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
                em = L.EmulatedLink(S, L.parse_rate(link_name), latency_s)
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


def _store(args, name: str) -> Optional[str]:
    """Where --runs-dir keeps the run called ``name`` (None without --runs-dir)."""
    return None if args.runs_dir is None else os.path.join(args.runs_dir, name + ".json")


def run_all(args, todo: List[Tuple], work: str, picks: Optional[Dict[Tuple, float]] = None
            ) -> Dict[Tuple, Dict[str, Any]]:
    """Run every (config, S, link, method, compress, seed) cell, each method at its pick
    (``picks[(config, method, S)]``; default: the workload's lr)."""
    picks = picks or {}
    done: Dict[Tuple, Dict[str, Any]] = {}

    def one(c, em):
        config, S, link_name, method, comp, seed = c
        w, name = workload(args, config), "-".join(map(str, c))
        loop = done.get((config, S, "loopback", method, comp, seed))
        if em is not None and loop is not None and "curve" in loop:
            total = sum(predict(loop, loop, cost.Link(em.bandwidth_bps, em.latency_s), S, method,
                                w["local_steps"])[1])
            if total > args.run_cap_s:
                done[c] = {"not_run": f"{method} on {config}, S={S}, {link_name}: not run, the cost model predicts "
                                     f"{total:.0f} s from its loopback run (over --run-cap-s {args.run_cap_s:g})",
                           "predicted_train_time_s": total}
                return done[c]
        lr = picks.get((config, method, S), base_lr(w, method))
        try:
            run = launch(method_flags(w, method, comp, lr), S, seed, os.path.join(work, name), em,
                         _store(args, f"{name}-lr{lr:g}"), not args.stored_only)  # lr in the name: no overwrite
        except NotStored as e:
            done[c] = {"not_run": f"{method} on {config}, S={S}, {link_name}, seed {seed}: {e}",
                       "predicted_train_time_s": None}
            return done[c]
        done[c] = {"curve": curve(run), "summary": run["summary"], "stored_at": run.get("stored_at"),
                   "tcp": None if em is None else em.tcp}  # the key's: a kept run matched it
        return done[c]

    return run_over_links(todo, lambda c: (c[2], c[1]), one, "speed", args.latency_s)


# ---------------------------------------------------------------- tuning

def tune_rounds(args, w: Dict[str, Any]) -> int:
    """Rounds of a tuning run: --tune-rounds (at most the workload's), else half the workload's
    (all of them with --quick)."""
    if args.tune_rounds is not None:
        return min(args.tune_rounds, w["rounds"])
    return w["rounds"] if args.quick else max(1, w["rounds"] // 2)


def tune_score(metrics: Sequence[Dict[str, Any]], rounds: int) -> Tuple[Optional[str], Optional[float], bool]:
    """(metric, score, higher is better) of a tuning run's metrics.jsonl rows: the best held-out score
    of rounds 1..``rounds`` in the first metric of :data:`TUNE_METRICS` they have. The score is None
    when a training loss or a score in those rounds is not finite (diverged) or nothing was scored."""
    rows = [m for m in metrics if 1 <= m.get("round", 0) <= rounds]
    scored = [m for m in rows if "test_loss" in m]
    metric, higher = next(((k, h) for k, h in TUNE_METRICS if any(k in m for m in scored)), (None, True))
    if metric is None:
        return None, None, True
    values = [m.get(metric) for m in scored]
    losses = [m.get("train_loss") for m in rows]
    if any(v is None or not math.isfinite(v) for v in values + losses):
        return metric, None, higher
    return metric, (max(values) if higher else min(values)), higher


def pick_lr(lrs: Sequence[float], scores: Sequence[Optional[float]], higher_is_better: bool = True
            ) -> Optional[float]:
    """The tuning rule: the lr of the best score (highest, or lowest with ``higher_is_better``
    False), ties to the smaller lr; points without a score (None, non-finite) never win; None when
    no point has one."""
    best = None
    for lr, sc in sorted(zip(lrs, scores), key=lambda t: t[0]):
        if sc is None or not math.isfinite(sc):
            continue
        if best is None or (sc > best[1] if higher_is_better else sc < best[1]):
            best = (lr, sc)
    return None if best is None else best[0]


def tuning_keys(todo: Sequence[Tuple]) -> List[Tuple[str, str, int]]:
    """The (config, method, S) of the comparison cells, each once."""
    return sorted({(c[0], c[3], c[1]) for c in todo})


def tune(args, todo: Sequence[Tuple], work: str) -> Tuple[Dict[str, Any], Dict[Tuple, float], List[str]]:
    """Tune the lr of every (config, method, S) of ``todo`` (see the module docstring and
    :data:`TUNE_RULE`). Returns the JSON's ``tuning`` ({config: {method: {S: entry}}}), the picks
    {(config, method, S): lr} and the errors of failed tuning runs."""
    seed = args.seeds[0]
    grids = {k: lr_grid(workload(args, k[0]), k[1], lr_grid_of(args, k[0])) for k in tuning_keys(todo)}
    cells_ = [(config, S, "loopback", method, lr, seed) for (config, method, S), g in grids.items() if len(g) > 1
              for lr in g]

    def one(c, em):
        config, S, _, method, lr, sd = c
        w = workload(args, config)
        flags = method_flags(w, method, "none", lr) + ["--stop-after", str(tune_rounds(args, w)),
                                                      "--holdout", f"{args.tune_holdout:g}"]
        name = "tune-" + "-".join(map(str, c))
        run = launch(flags, S, sd, os.path.join(work, name), em, _store(args, name), not args.stored_only)
        split = {m.get("scored_on") for m in run["metrics"] if "test_loss" in m}
        if split != {"holdout"}:
            raise RuntimeError(f"a tuning run scored {sorted(map(str, split))}, not the held-out split")
        return {"metrics": run["metrics"], "summary": run["summary"]}

    results = run_over_links(cells_, lambda c: ("loopback", c[1]), one, "speed: tuning") if cells_ else {}
    tuning: Dict[str, Any] = {}
    picks: Dict[Tuple, float] = {}
    errors: List[str] = []
    for (config, method, S), grid in grids.items():
        w = workload(args, config)
        rounds = tune_rounds(args, w)
        scores, metric, higher, errs = [], None, True, []
        for lr in grid:
            r = results.get((config, S, "loopback", method, lr, seed))
            if r is None:  # a one-point grid: not run
                scores.append(None)
                continue
            if "error" in r:
                errs.append(f"lr {lr:g}: {r['error'].splitlines()[-1] if r['error'] else ''}")
                scores.append(None)
                continue
            metric, sc, higher = tune_score(r["metrics"], rounds)
            scores.append(sc)
        pick = grid[0] if len(grid) == 1 else pick_lr(grid, scores, higher)
        fallback = pick is None
        if fallback:
            pick = base_lr(w, method)
        picks[(config, method, S)] = pick
        errors += [f"tuning {config}/{method}/S={S}: {e}" for e in errs]
        tuning.setdefault(config, {}).setdefault(method, {})[str(S)] = {
            "base_lr": base_lr(w, method), "multipliers": list(lr_grid_of(args, config)), "grid": grid,
            "scores": scores,
            "metric": metric, "higher_is_better": higher, "pick": pick, "pick_multiplier": pick / base_lr(w, method),
            "ran": len(grid) > 1, "fallback": fallback, "rounds": rounds, "holdout": args.tune_holdout,
            "seed": seed, "rule": TUNE_RULE, "errors": errs}
    return tuning, picks, errors


# ---------------------------------------------------------------- analysis

def _mean(v: Sequence[float]) -> Optional[float]:
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


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


def analyse(args, results: Dict[Tuple, Dict[str, Any]]) -> Tuple[List[Dict[str, Any]], List[str]]:
    runs, errors = [], []
    for c, r in results.items():
        if "error" in r:
            errors.append(f"{'/'.join(map(str, c))}: {r['error'].splitlines()[-1] if r['error'] else ''}")
    for c, r in sorted(results.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if "error" in r or "not_run" in r:
            continue
        config, S, link_name, method, comp, seed = c
        w = workload(args, config)
        metric, higher = w["metric"], higher_is_better(w)
        base = results.get((config, S, link_name, "localsgd", "none", seed)) or \
            results.get((config, S, "loopback", "localsgd", "none", seed))
        base_final = base["curve"][metric][-1] if base and "curve" in base and base["curve"].get(metric) else None
        target = target_of(args, w, base_final)
        cv = r["curve"]
        values = cv.get(metric) or [None] * len(cv["round_s"])
        emulated = link_name != "loopback"
        bw = L.parse_rate(link_name) if emulated else None
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
            "round_time_s": _mean(cv["round_s"]), "predicted_round_time_s": _mean(pred) if pred else None,
            "predicted_round_time_from_loopback_s": _mean(pred_loop) if pred_loop else None,
            "bytes_per_round": _mean(cv["bytes"]), "time_by_part": parts, "measured_at": r.get("stored_at"),
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


# ---------------------------------------------------------------- scale

SCALE_WORKERS = [2 ** k for k in range(1, 11)]
SCALE_GBPS = [1, 10, 100]


def _split_flops(model: torch.nn.Module, input_shape, batch: int, partitioned: set) -> Tuple[float, float]:
    """(FLOPs of a training step in modules whose weight the plan partitions, FLOPs of the rest),
    counted on a copy of the model on the meta device (shapes only, nothing computed)."""
    meta = copy.deepcopy(model).to("meta")
    x = torch.randn(batch, *input_shape, device="meta")
    with FlopCounterMode(display=False) as fc:
        out = meta(x)
        torch.nn.functional.cross_entropy(out, torch.zeros(batch, dtype=torch.long, device="meta")).backward()
    total = float(fc.get_total_flops())
    leaf = {n for n, m in meta.named_modules() if not list(m.children())}
    part = 0.0
    for key, ops in fc.get_flop_counts().items():
        name = key.split(".", 1)[1] if "." in key else ""  # "<RootClass>.<module path>"
        if name in leaf and f"{name}.weight" in partitioned:
            part += float(sum(ops.values()))
    return part, total - part


def _mlp(inputs: int, hidden: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def scale_models(args) -> List[Dict[str, Any]]:
    """The papers' models: their state split (partitioned / shared, SGD momentum included) and step
    FLOPs split alike, from a plan at small S (the split does not depend on S)."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        specs = [("loft", "preact_resnet18", "cifar10", preact_resnet18(10, 3, 64), (3, 32, 32)),
                 ("resist", "preact_resnet101_basic", "cifar100", preact_resnet101_basic(100, 3, 64), (3, 32, 32)),
                 ("ist", "mlp 784-4096-10", "mnist-shaped", _mlp(784, 4096, 10), (784,))]
        for method, name, data, model, shape in specs:
            spec = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
            pnames = [n for n, _ in model.named_parameters()]
            limit = None
            if method == "loft":
                plan = loft_plan(model, 2, torch.Generator().manual_seed(0)).slices
                limit = min(m.out_channels for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)
                            and f"{n}.weight" in {t.name for t in plan.tensors if not t.shared})
                blocks = min_depth = None
            elif method == "resist":
                rp = resist_plan(model, 2, 5, torch.Generator().manual_seed(0))
                plan, blocks, min_depth = rp.slices, len(rp.partitioned_blocks), 5
            else:
                plan, blocks, min_depth = None, None, None
                limit = 4096
            if plan is not None:
                split = state_split(plan, spec, pnames, True)
                partitioned = {t.name for t in plan.tensors if not t.shared}
            else:  # IST: every hidden unit's row of layer 0 (weight, bias) and column of layer 2 partitioned
                partitioned = {"0.weight", "0.bias", "2.weight"}
                sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
                split = {"partitioned_state_bytes": sum(2 * sizes[n] for n in partitioned),
                         "shared_state_bytes": 2 * sizes["2.bias"]}
            pf, sf = _split_flops(model, shape, args.scale_batch, partitioned)
            state = split["partitioned_state_bytes"] + split["shared_state_bytes"]
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            out.append({"method": method, "model": name, "dataset": data, "split": split, "state_bytes": state,
                        "param_bytes": params, "partitioned_flops": pf, "shared_flops": sf, "limit": limit,
                        "blocks": blocks, "min_depth": min_depth})
    return out


def scale_table(args, models: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows for every model x S x bandwidth, the method and local SGD of the same model."""
    rate = args.device_tflops * 1e12
    tau = args.scale_local_steps
    rows = []
    for m in models:
        part, shared = m["split"]["partitioned_state_bytes"], m["split"]["shared_state_bytes"]
        fixed = args.step_overhead_ms / 1e3
        full_step = fixed + (m["partitioned_flops"] + m["shared_flops"]) / rate
        # local SGD averages the parameters and buffers (not the momentum): half the param part of the state
        avg_bytes = m["state_bytes"] - m["param_bytes"]
        for S in SCALE_WORKERS:
            fits = m["limit"] is None or S <= m["limit"]
            k = cost.resist_owners(S, m["blocks"], m["min_depth"]) if m["method"] == "resist" else 1.0
            # the exchange sends weights only (momentum reset each round): the param half of the split
            sub_step = fixed + (m["shared_flops"] + m["partitioned_flops"] * k / S) / rate
            for g, comp in ((g, comp) for comp in args.compress for g in SCALE_GBPS):
                wb = cost.subnet_round_bytes(part / 2, shared / 2, S, k, compress=comp) if fits else None
                link = cost.Link(g * 1e9, 0.0)
                ls = cost.predict_round(steps=tau, step_s=full_step, link=link, latencies=2 * (S - 1),
                                        bytes_per_rank=cost.localsgd_round_bytes(avg_bytes, S, compress=comp))
                base = {"model": m["model"], "dataset": m["dataset"], "workers": S, "bandwidth_bps": g * 1e9,
                        "compress": comp}
                rows.append({**base, "method": "localsgd", "round_time_s": ls.total, "compute_s": ls.compute,
                             "bytes_per_round": ls.bytes_per_rank, "rank_state_bytes": m["state_bytes"],
                             "speedup_vs_localsgd": 1.0})
                if wb is None:
                    rows.append({**base, "method": m["method"], "round_time_s": None, "compute_s": None,
                                 "bytes_per_round": None, "rank_state_bytes": None, "speedup_vs_localsgd": None,
                                 "note": f"S > {m['limit']}: a partitioned layer has fewer units than workers"})
                    continue
                sr = cost.predict_round(steps=tau, step_s=sub_step, link=link, latencies=2 * (S - 1) + 1,
                                        bytes_per_rank=wb["wire"])
                rows.append({**base, "method": m["method"], "round_time_s": sr.total, "compute_s": sr.compute,
                             "bytes_per_round": sr.bytes_per_rank,
                             "rank_state_bytes": cost.rank_state_bytes(part, shared, S, k, optimizer_copies=0.0),
                             "owners": k, "speedup_vs_localsgd": cost.speedup(ls.total, sr.total)})
    return rows


# ---------------------------------------------------------------- outputs

def _f(v, spec=".3g", none="—"):
    return none if v is None else f"{v:{spec}}"


def _final(r: Dict[str, Any]) -> str:
    v = r.get("final_metric", r.get("final_accuracy"))
    return "—" if v is None else (f"{v:.4f}" if r.get("metric", "accuracy") == "accuracy" else f"{v:.3f} bpb")


def tuning_lines(tuning: Dict[str, Any]) -> List[str]:
    """The markdown table of the tuning: per workload, method and S, every lr with its score, and the pick."""
    if not tuning:
        return []
    out = ["## Learning rates, tuned on a held-out part of the training set", "",
           "Rule: " + TUNE_RULE + ".", "",
           "| workload | method | S | rounds | lr: held-out score | pick |", "|---|---|---|---|---|---|"]
    for config, by_method in sorted(tuning.items()):
        for method, by_s in sorted(by_method.items()):
            for S, e in sorted(by_s.items(), key=lambda kv: int(kv[0])):
                pts = ", ".join(f"{lr:.3g}: {'not run' if not e['ran'] else _f(sc, '.4g', 'failed')}"
                                for lr, sc in zip(e["grid"], e["scores"]))
                note = " (no score: the workload's lr)" if e["fallback"] else ""
                out.append(f"| {config} | {method} | {S} | {e['rounds']} | {pts} | **{e['pick']:.3g}**{note} |")
    return out + [""]


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
        mean_rounds = _mean(rounds) if loop and all(k is not None for k in rounds) else None
        for link_name in sorted({r["link"] for r in rs}, key=link_order):
            here = [r for r in rs if r["link"] == link_name]
            round_s = _mean([r["round_time_s"] for r in here])
            through = None if mean_rounds is None else _mean([t for t in (time_through(r, mean_rounds) for r in here)
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


def summary_lines(summary: Sequence[Dict[str, Any]]) -> List[str]:
    if not summary:
        return []
    out = ["## Time to target from every seed's rounds", "",
           "Rounds to target of each seed (loopback runs), and per link: the link's runs' own training seconds "
           "through the seeds' mean rounds (only when every seed reached the target; a fractional mean takes that "
           "fraction of the next round), beside the link's own runs' time to target.", "",
           "| workload | S | method | compress | link | rounds to target (seeds) | mean | s / round | time to target (s) | "
           "vs local SGD | the link's runs (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        ks = ", ".join("—" if k is None else str(k) for k in e["rounds_to_target"]) or "no loopback run"
        own = ", ".join(_f(t, ".3g", "not reached") for t in e["runs_time_to_target_s"])
        out.append(f"| {e['workload']} | {e['workers']} | {e['method']} | {e['compress']} | {e['link']} | {ks} | "
                   f"{_f(e['mean_rounds_to_target'], '.3g')} | {_f(e['round_time_s'], '.2f')} | "
                   f"{_f(e['time_to_target_s'], '.3g', 'not reached')} | {_f(e['vs_localsgd'], '.2f')} | {own} |")
    return out + [""]


def baseline_lines(baselines: Optional[Dict[str, Any]]) -> List[str]:
    if not baselines:
        return []
    return [f"Byte-frequency baselines on {baselines['dataset']}'s {baselines['split']} split "
            f"({baselines['bytes']:,} bytes, {baselines['files']} files): one byte alone (unigram entropy) "
            f"{baselines['unigram_bits']:.3f} bits, a byte given the previous one (bigram conditional entropy) "
            f"{baselines['bigram_bits']:.3f} bits.", ""]


def markdown(args, runs, scale, skipped, errors, link_note, tuning=None, baselines=None) -> str:
    L_ = ["# Time to target: measured on real processes, beside the cost model", ""]
    if link_note:
        L_ += [f"Emulated links: {link_note}", ""]
    acc_target = '%.4g' % args.target if args.target else f'{args.target_fraction:g} x local SGD final accuracy'
    L_ += ["Training time (rounds' wall time, evaluation excluded) until the test metric first reaches the target "
           f"(accuracy: at or above {acc_target}; bits per byte (bpb): at or below local SGD's final + "
           f"{args.lm_margin:g}); `vs local SGD` is time to target / local SGD's on the same link; `pred. err` is the "
           "cost model's predicted mean round time against the measured one.", ""]
    L_ += baseline_lines(baselines)
    L_ += tuning_lines(tuning or {})
    L_ += summary_lines(seed_summary(runs))
    hdr = ("| workload | S | link | method | lr | compress | time to target (s) | vs local SGD | rounds | final | "
           "MB / round | s / round | pred. s / round | pred. err | local / plan / pack / comm / unpack (s) |")
    L_ += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in sorted(runs, key=lambda r: (r["config"], r["workers"], r["bandwidth_bps"] or 0, r["method"],
                                         r["compress"], r["seed"])):
        tp = r["time_by_part"]
        L_.append(f"| {r['config']} ({r['model']}) | {r['workers']} | {r['link']} | {r['method']} | "
                  f"{_f(r.get('lr'), '.3g')} | {r['compress']} | "
                  f"{_f(r['time_to_target_s'], '.2f', 'not reached')} | {_f(r['time_vs_localsgd'], '.2f')} | "
                  f"{_f(r['rounds_to_target'], 'd')} | {_final(r)} | "
                  f"{r['bytes_per_round'] / 1e6:.3g} | {r['round_time_s']:.3f} | {_f(r['predicted_round_time_s'], '.3f')} | "
                  f"{_f(None if r['prediction_error'] is None else 100 * r['prediction_error'], '+.1f')}"
                  f"{'%' if r['prediction_error'] is not None else ''} | "
                  + " / ".join(f"{tp[p]:.2f}" for p in ("local", "plan", "pack", "comm", "unpack")) + " |")
    if skipped:
        L_ += ["", "Not run: " + "; ".join(skipped)]
    if errors:
        L_ += ["", f"**{len(errors)} run(s) failed**: " + "; ".join(errors)]
    if scale:
        L_ += ["", f"## Scale (cost model): {args.scale_local_steps} local steps of {args.scale_batch} images per "
               f"round, {args.device_tflops:g} TFLOP/s per worker plus {args.step_overhead_ms:g} ms per step, no latency", "",
               "Per round: bytes a rank sends, its state (weights, buffers, momentum), the round's time and the "
               "speed-up over local SGD of the same model (per round).", "",
               "| model | method | compress | S | Gbit/s | MB / round / rank | state / rank (MB) | s / round | speed-up |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in scale:
            if r["method"] == "localsgd" and r["bandwidth_bps"] != 1e9:
                continue
            if r["workers"] not in (2, 8, 64, 1024):
                continue
            L_.append(f"| {r['model']} | {r['method']} | {r['compress']} | {r['workers']} | {r['bandwidth_bps'] / 1e9:g} | "
                      f"{_f(None if r['bytes_per_round'] is None else r['bytes_per_round'] / 1e6, '.4g')} | "
                      f"{_f(None if r['rank_state_bytes'] is None else r['rank_state_bytes'] / 1e6, '.4g')} | "
                      f"{_f(r['round_time_s'], '.3g')} | {_f(r['speedup_vs_localsgd'], '.2f', r.get('note', '—'))} |")
        L_ += ["", "(Local SGD rows at 1 Gbit/s only, and S = 2, 8, 64, 1024; every row is in speed.json.)"]
    return "\n".join(L_)


def plot(runs, links: Sequence[str], workers: Sequence[int], baselines: Optional[Dict[str, Any]] = None):
    """One panel per S x link x metric (test accuracy of the accuracy workloads; the lm's test bits per
    byte, its byte-frequency baselines as horizontal lines) against training time."""
    metrics = [m for m in METRICS if any(r.get("metric", "accuracy") == m for r in runs)] or ["accuracy"]
    fig, axes = C.figure(cols=len(links), rows=len(workers) * len(metrics))
    seed = runs[0]["seed"] if runs else None
    for i, (S, metric) in enumerate((S, m) for S in workers for m in metrics):
        for j, link_name in enumerate(links):
            ax = axes[i * len(links) + j]
            for r in runs:
                if r["workers"] != S or r["link"] != link_name or r["seed"] != seed or \
                        r.get("metric", "accuracy") != metric:
                    continue
                xs, t = [], 0.0
                for s in r["curve"]["round_s"]:
                    t += s
                    xs.append(t)
                label = f"{r['method']}" + ("" if r["compress"] == "none" else f" {r['compress']}") + f" ({r['config']})"
                ax.plot(xs, r["curve"][metric], marker=".", label=label,
                        linestyle="-" if r["config"] in ("cnn", "lm") else "--")
            if metric == "bits_per_byte" and baselines:
                for key, name, style in (("unigram_bits", "unigram", ":"), ("bigram_bits", "bigram", "-.")):
                    ax.axhline(baselines[key], color="gray", linestyle=style, linewidth=1,
                               label=f"{name} entropy {baselines[key]:.2f}")
            C.style_axis(ax, f"S={S}, {link_name}", "training time (s)",
                         "test accuracy" if metric == "accuracy" else "test bits per byte", legend=j == 0)
    return fig


def main(argv: Sequence[str] = ()) -> int:
    args = parse(argv)
    started = time.time()
    torch.set_num_threads(1)
    reason = L.unavailable_reason()
    emulated = [x for x in all_links(args) if x != "loopback"]
    link_note = ""
    if reason and emulated:
        print(f"speed: {reason}; running loopback only (the model predicts {', '.join(emulated)})", file=sys.stderr)
        link_note = f"not run ({reason}); loopback only"
        args.links, args.loopback_only = ["loopback"], True
    elif emulated:
        link_note = (f"{', '.join(emulated)} per rank in each direction (tc tbf in network namespaces joined by a "
                     f"bridge, a {L.QUEUE_S * 1e3:g} ms queue), checked within 10% by a timed transfer before use; latency "
                     f"{args.latency_s:g} s; the ranks' TCP: the first of {', '.join(L.CONGESTION_CONTROL)} the "
                     f"kernel allows, slow start after idle {L.SLOW_START_AFTER_IDLE} (each run's tcp)")
    todo, skipped = cells(args)
    work = tempfile.mkdtemp(prefix="ist-speed-")
    try:
        tuning, picks, tune_errors = tune(args, todo, work)
        if args.tune_only:
            print("\n".join(tuning_lines(tuning)))
            for e in tune_errors:
                print(e, file=sys.stderr)
            return 1 if tune_errors else 0
        results = run_all(args, todo, work, picks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs, errors = analyse(args, results)
    errors = tune_errors + errors
    not_run = [{"cell": list(c), "why": r["not_run"], "predicted_train_time_s": r["predicted_train_time_s"]}
              for c, r in results.items() if "not_run" in r]
    skipped = skipped + [x["why"] for x in not_run]
    scale = [] if args.no_scale else scale_table(args, scale_models(args))
    baselines = C.pycode_baselines() if any(workload(args, c)["dataset"] == "pycode" for c in args.configs) else None
    fig = plot(runs, all_links(args), sorted({S for c in args.configs for S in workers_of(args, c)}), baselines)
    C.write_outputs(args, "speed", {"runs": runs, "summary": seed_summary(runs), "tuning": tuning, "scale": scale,
                                    "skipped": skipped, "not_run": not_run,
                                    "errors": errors, "workloads": {c: workload(args, c) for c in args.configs},
                                    "baselines": baselines},
                    markdown(args, runs, scale, skipped, errors, link_note, tuning, baselines), fig, started)
    return 1 if errors else 0


def _interrupted(signum, frame):  # Ctrl-C / SIGTERM: the links' own handlers remove what they made
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main(sys.argv[1:]))
