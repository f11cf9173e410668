"""Time to target (test accuracy; the language model's bits per byte) of every method on S real processes, over loopback and emulated limited links, beside a cost model's prediction, and the model extrapolated to 1,024 workers.

    python -m ist_kernels.experiments speed [--workers 2,4] [--links loopback,100mbit,1gbit] [--configs lm12,cnn,mlp]

The workloads (``--configs``): ``lm``, ``gpt_tiny`` learning the bytes of the Python
standard library (``--dataset pycode``, context 128, batch 16, 40 rounds of 25 local steps, AdamW
for every method at a base lr of 1e-3, cosine after a 2-round warm-up), trained by ``localsgd``,
``ddp``, ``diloco``, ``ist-ffn`` and ``ist-heads`` (``ist`` with ``partition=ffn`` / ``heads``) and
``resist``, scored in test bits per byte (lower is better) beside the byte-frequency baselines of
pycode's test split (:func:`ist_kernels.experiments.harness.analysis.pycode_baselines`: the entropy of one
byte and of a byte given the previous one; named, not in the default ``--configs``); ``lm12``, the main
language model, the same data, rounds and schedule on ``gpt_tiny`` at width 64 and 12 blocks (0.62M parameters), where
depth lets a ResIST subnetwork skip most blocks, its methods those of ``lm`` but ``ist-heads`` (2 heads
cannot be split over 4 workers), ResIST and IST keeping their AdamW moments where they are
(``momentum_state=local``); ``cnn`` and ``mlp`` on digits, scored in test accuracy.
On those every method of the trainer's registry that can train the workload (``grelu`` left
out: it trains a fixed-gate network with local SGD's communication; ``loft`` runs paper 000's
pipeline: LOFT pre-training for half the rounds, 50% filter pruning, local-SGD fine-tuning of the
pruned model) runs. Each runs the same data, seeds and rounds with S real processes (gloo over TCP; one ``python -m ist_kernels.train`` process per rank,
one torch thread each), once per link:

- ``loopback``: the processes talk over the loopback interface;
- ``100mbit``, ``1gbit``, ...: each rank runs in a network namespace of its own, joined to the
  others by a bridge, its link shaped to that rate in both directions (``ist_kernels.experiments.harness.link``;
  needs root or CAP_NET_ADMIN, checked with a timed transfer before use; without them the line
  says why and only loopback runs, with the model's prediction for the other links).

Each method runs at its own learning rate, tuned on a validation split (never the test split): for
every (workload, method, S) a grid of ``--lr-grid`` multiples of the workload's lr (diloco: of its
inner AdamW's), each point one run of the comparison run's schedule stopped after
``--tune-rounds`` rounds, over loopback, uncompressed, on the first seed, with the trainer's
``--holdout`` (``--tune-holdout`` of the training set held out, left out of every shard, and scored
after every round in place of the test split). A point's score is its best held-out score in those
rounds (highest accuracy; language models: lowest bits per byte); the pick is the best score, ties
to the smaller lr (:func:`~ist_kernels.experiments.harness.tuning.pick_lr`); a point that failed or whose loss went non-finite has no score;
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
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..distributed import cost
from ..distributed.ledger import state_split
from ..models import preact_resnet18, preact_resnet101_basic
from ..partition import loft_plan, resist_plan
from ..train.methods import METHODS
from . import harness as C
from .harness import link as L
from .harness.analysis import analyse, link_order, predict, seed_summary
from .harness.launch import curve, launch, run_over_links
from .harness.report import baseline_lines, number, runs_lines, sessions_lines, summary_lines, tuning_lines
from .harness.store import NotStored, run_path
from .harness.tuning import LR_GRID, TUNE_HOLDOUT, lr_multipliers, tune
from .harness.workload import METRICS, base_lr, compresses, method_flags, trainer_method, trains

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
    # the 12-block LM (issue 39): gpt_tiny at width 64 and 12 blocks (0.62M parameters), lm's data, rounds
    # and schedule, so that depth pays (a ResIST subnetwork trains a third to a half of the blocks); ResIST
    # and IST keep their AdamW moments where they are (momentum_state=local: nothing sent, the state of a
    # slice that comes back reused); IST of heads cannot split width 64's 2 heads over S = 4 (left out)
    "lm12": dict(dataset="pycode", model="gpt_tiny", width=64, depth=12, lr=1e-3, batch_size=16, local_steps=25,
                 rounds=40, metric="bits_per_byte",
                 train=dict(context=128, optimizer="adamw", lr_schedule="cosine", lr_warmup_rounds=2),
                 methods=("localsgd", "ddp", "diloco", "ist-ffn", "resist"),
                 variants={"ist-ffn": ("ist", ["partition=ffn"])},
                 options={"ist": ["momentum_state=local"], "resist": ["momentum_state=local"]}, flags={}),
    # scored with BatchNorm statistics re-estimated on 20 training batches (--eval-bn-batches; training
    # unchanged): the running statistics a subnetwork method's narrower models leave describe no full model
    "cnn": dict(dataset="digits", model="preact_resnet101_basic", width=16, lr=0.05, batch_size=32, local_steps=8,
                rounds=16, train=dict(eval_bn_batches=20),
                options={"resist": ["warmup_fraction=0.1"], "loft": ["pretrain_fraction=0.5"]},
                flags={"loft": ["--prune-ratio", "0.5"], "diloco": ["--lr", "0.001"]}),
    "mlp": dict(dataset="digits", model="mlp", width=8192, depth=1, lr=0.1, batch_size=64, local_steps=8, rounds=40,
                options={}, flags={"diloco": ["--lr", "0.001"]}),
}
#: --configs' default: lm12 is the main language model (issue 39: every method tuned on the held-out split at
#: 20 rounds, 3 seeds of the bar's methods, the cost model checked over an emulated link); lm (gpt_tiny's 4
#: blocks) is named, its results kept in results/speed.*
DEFAULT_CONFIGS = ("lm12", "cnn", "mlp")
#: --quick: every workload's rounds and local steps, and per workload what else shrinks (the lm: seconds a run)
QUICK = dict(rounds=3, local_steps=2, overrides={
    "cnn": dict(width=4), "mlp": dict(width=256),
    "lm": dict(width=64, depth=3, batch_size=4, train=dict(context=16, optimizer="adamw", lr_schedule="cosine",
                                                           lr_warmup_rounds=0, dataset_size=100_000)),
    "lm12": dict(width=64, depth=6, batch_size=4, train=dict(context=16, optimizer="adamw", lr_schedule="cosine",
                                                             lr_warmup_rounds=0, dataset_size=100_000))})
#: --lm-margin's default: the lm's target is local SGD's final bits per byte plus this
LM_MARGIN = 0.05
#: --quick runs these methods (one of each kind) unless --methods says otherwise
QUICK_METHODS = ("localsgd", "loft", "resist", "ist")
#: --compress's default: every method that compresses runs uncompressed and with these
COMPRESS = ("none", "int8", "bf16")
#: --quick runs its compressed modes (int8) for these methods only (one compressed row per link)
QUICK_COMPRESSED = ("resist",)

#: --run-cap-s's default: an emulated run predicted to train longer is not run (DDP over 10 Mbit/s: ~1 h)
RUN_CAP_S = 900.0


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
    p.add_argument("--configs", type=C.names, default=list(DEFAULT_CONFIGS),
                   help=f"workloads, of {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})")
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
    p.add_argument("--lr-grid-of", action="append", default=[], metavar="WORKLOAD[:METHOD]=M[,M...]",
                   help="the lr grid's multipliers for one workload (or one method of it) in place of --lr-grid "
                        "(repeatable), e.g. cnn=1/3,1,3 or lm12:diloco=1,3")
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
            workload = name.split(":")[0] if flag == "lr_grid_of" else name  # lr: WORKLOAD or WORKLOAD:METHOD
            if workload not in args.configs or not value:
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


def workloads(args) -> Dict[str, Dict[str, Any]]:
    """{config: its workload} of every --configs."""
    return {c: workload(args, c) for c in args.configs}


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


def links_of(args, config: str) -> List[str]:
    """The links of workload ``config``: its --links-of, else --links (loopback only when links cannot
    be emulated here)."""
    links = getattr(args, "links_of", {}).get(config, args.links)
    return ["loopback"] if getattr(args, "loopback_only", False) else links


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
                         run_path(args.runs_dir, f"{name}-lr{lr:g}"), not args.stored_only)  # lr in the name: no overwrite
        except NotStored as e:
            done[c] = {"not_run": f"{method} on {config}, S={S}, {link_name}, seed {seed}: {e}",
                       "predicted_train_time_s": None}
            return done[c]
        done[c] = {"curve": curve(run), "summary": run["summary"], "stored_at": run.get("stored_at"),
                   "tcp": None if em is None else em.tcp}  # the key's: a kept run matched it
        return done[c]

    return run_over_links(todo, lambda c: (c[2], c[1]), one, "speed", args.latency_s)


# ---------------------------------------------------------------- scale

SCALE_WORKERS = [2 ** k for k in range(1, 11)]
SCALE_GBPS = [1, 10, 100]


def _mlp(inputs: int, hidden: int, classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


#: scale_models' rows by --scale-batch, kept for the process: counting every S's subnetworks (ResIST's
#: plan at S = 1024 clones 1024 sub-ResNets) takes ~30 s on a 2-core CPU, and they depend on nothing else
_SCALE_MODELS: Dict[int, List[Dict[str, Any]]] = {}


def scale_models(args) -> List[Dict[str, Any]]:
    """:func:`count_scale_models` of ``--scale-batch``, counted once per process (a deep copy each call)."""
    if args.scale_batch not in _SCALE_MODELS:
        _SCALE_MODELS[args.scale_batch] = count_scale_models(args)
    return copy.deepcopy(_SCALE_MODELS[args.scale_batch])


def count_scale_models(args) -> List[Dict[str, Any]]:
    """The papers' models: their state split (partitioned / shared, SGD momentum included), from a
    plan at small S (the split does not depend on S), and the FLOPs of a step of ``--scale-batch``:
    the full model's (``cost.model_step_flops``) and, per S, a worker's subnetwork's
    (``cost.subnetwork_step_flops``: the method's plan at that S, its compact subnetworks counted; the
    mean over the S workers, as the table's bytes and owners are: a ResIST round at S = 4 deals 6, 6,
    5 and 5 of the 22 blocks, 5.5 on average)."""
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
            else:  # IST: every hidden unit's row of layer 0 (weight, bias) and column of layer 2 partitioned
                partitioned = {"0.weight", "0.bias", "2.weight"}
                sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
                split = {"partitioned_state_bytes": sum(2 * sizes[n] for n in partitioned),
                         "shared_state_bytes": 2 * sizes["2.bias"]}
            x = torch.randn(args.scale_batch, *shape, device="meta")
            options = {"min_depth": min_depth} if method == "resist" else None
            sub_flops = {S: sum(cost.subnetwork_step_flops(model, method, S, options, x)) / S
                         for S in SCALE_WORKERS if limit is None or S <= limit}
            state = split["partitioned_state_bytes"] + split["shared_state_bytes"]
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            out.append({"method": method, "model": name, "dataset": data, "split": split, "state_bytes": state,
                        "param_bytes": params, "full_flops": cost.model_step_flops(model, x), "sub_flops": sub_flops,
                        "limit": limit, "blocks": blocks, "min_depth": min_depth})
    return out


def scale_table(args, models: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Rows for every model x S x bandwidth, the method and local SGD of the same model."""
    rate = args.device_tflops * 1e12
    tau = args.scale_local_steps
    rows = []
    for m in models:
        part, shared = m["split"]["partitioned_state_bytes"], m["split"]["shared_state_bytes"]
        fixed = args.step_overhead_ms / 1e3
        full_step = fixed + m["full_flops"] / rate
        # local SGD averages the parameters and buffers (not the momentum): half the param part of the state
        avg_bytes = m["state_bytes"] - m["param_bytes"]
        for S in SCALE_WORKERS:
            fits = m["limit"] is None or S <= m["limit"]
            k = cost.resist_owners(S, m["blocks"], m["min_depth"]) if m["method"] == "resist" else 1.0
            # the exchange sends weights only (momentum reset each round): the param half of the split
            sub_step = fixed + m["sub_flops"][S] / rate if fits else None
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
    L_ += runs_lines(runs)
    L_ += sessions_lines(runs)
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
                      f"{number(None if r['bytes_per_round'] is None else r['bytes_per_round'] / 1e6, '.4g')} | "
                      f"{number(None if r['rank_state_bytes'] is None else r['rank_state_bytes'] / 1e6, '.4g')} | "
                      f"{number(r['round_time_s'], '.3g')} | {number(r['speedup_vs_localsgd'], '.2f', r.get('note', '—'))} |")
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
                        linestyle="-" if r["config"] in ("cnn", "lm", "lm12") else "--")
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
        tuning, picks, tune_errors = tune(args, todo, work, workloads(args))
        if args.tune_only:
            print("\n".join(tuning_lines(tuning)))
            for e in tune_errors:
                print(e, file=sys.stderr)
            return 1 if tune_errors else 0
        results = run_all(args, todo, work, picks)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runs, errors = analyse(args, results, workloads(args))
    errors = tune_errors + errors
    not_run = [{"cell": list(c), "why": r["not_run"], "predicted_train_time_s": r["predicted_train_time_s"]}
              for c, r in results.items() if "not_run" in r]
    skipped = skipped + [x["why"] for x in not_run]
    scale = [] if args.no_scale else scale_table(args, scale_models(args))
    baselines = C.pycode_baselines() if any(workload(args, c)["dataset"] == "pycode" for c in args.configs) else None
    fig = plot(runs, all_links(args), sorted({S for c in args.configs for S in workers_of(args, c)}), baselines)
    C.write_outputs(args, "speed", {"runs": runs, "summary": seed_summary(runs), "tuning": tuning, "scale": scale,
                                    "skipped": skipped, "not_run": not_run,
                                    "errors": errors, "workloads": workloads(args),
                                    "baselines": baselines},
                    markdown(args, runs, scale, skipped, errors, link_note, tuning, baselines), fig, started)
    return 1 if errors else 0


def _interrupted(signum, frame):  # Ctrl-C / SIGTERM: the links' own handlers remove what they made
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(main(sys.argv[1:]))
