"""Does a subnetwork's step cost its FLOPs? One command for a lent GPU (issue 38 items 3-4).

For each model (the package's ``gpt_small --width 1024 --depth 8`` and a Hugging Face
``LlamaForCausalLM`` from ``tools/hf_models.py``, both about 100M parameters), each batch (16 and
64 sequences of 512 tokens), each mode (eager, ``--compile``) and each method (local SGD, IST of
FFN units, IST of heads, ResIST), it trains ``--simulate 4`` rounds through the trainer itself
(``Run.begin_round`` / ``RunContext.train`` / ``Run.end_round``: bf16 autocast, AdamW, fused on
CUDA) in this process and takes the ``local`` time of rounds 2..R (compiling is charged to its own
part) per worker step. Beside it:

- the FLOPs of a step (``ist_kernels.distributed.cost.model_step_flops``) and of each method's
  largest subnetwork (``subnetwork_step_flops``: the structure the partitions find);
- the card's measured peak (a bf16 ``matmul`` of 8192^3, CUDA events; fp32 on a CPU);
- the checks: local SGD's step within 1.5x of its FLOPs at the measured peak; each subnetwork
  method's step at most 1.15x of (its FLOPs / local SGD's FLOPs) x local SGD's step (the same
  model, batch and mode), PASS / MISS.

It writes ``--out`` (markdown: the table and the checks) and the same as JSON beside it, rewritten
after every run (a stop keeps what finished), and with ``--profile`` a per-operator profile
(``torch.profiler``) of one local step of each method on the Llama, eager, at the first batch.
Every run has a time limit inside one overall budget (a run past the budget is listed as not
reached):

    python tools/gpu_step_costs.py --out bench/results/h200_train_steps.md --profile   # ~8 min on an H200
    python tools/gpu_step_costs.py --quick --device cpu --out /tmp/steps.md            # the same, tiny, on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.join(ROOT, "bench"))

from machine import matmul_peak  # noqa: E402  (bench/machine.py: the benchmarks' ceilings)

from ist_kernels.distributed.cost import model_step_flops, subnetwork_step_flops  # noqa: E402
from ist_kernels.train.config import TrainConfig  # noqa: E402
from ist_kernels.train.datasets import load_dataset  # noqa: E402
from ist_kernels.train.launch import set_threads  # noqa: E402
from ist_kernels.train.model_registry import build_model  # noqa: E402
from ist_kernels.train.runner import Run, World  # noqa: E402

HF = os.path.join(ROOT, "tools", "hf_models.py")
#: name -> (trainer values of the model, at full size, at --quick size)
MODELS = {
    "gpt1024": ({"model": "gpt_small", "width": 1024, "depth": 8},
                {"model": "gpt_small", "width": 128, "depth": 6}),
    "llama1024": ({"model": f"{HF}:llama", "model_args": {"context": 512}},
                  {"model": f"{HF}:llama", "model_args": {"hidden": 64, "layers": 6, "heads": 8, "kv": 4,
                                                          "ffn": 160, "context": 32}}),
}
#: label -> (method, options)
METHODS = {"localsgd": ("localsgd", {}), "ist-ffn": ("ist", {"partition": "ffn"}),
           "ist-heads": ("ist", {"partition": "heads"}), "resist": ("resist", {"warmup_fraction": 0.0})}  # every timed round trains sub-ResNets
#: the checks' bounds (issue 38 item 3)
LOCAL_SGD_BOUND = 1.5
SUBNET_BOUND = 1.15


def measure_peak(device: torch.device, quick: bool) -> Dict[str, float]:
    """The card's matmul rate (FLOP/s, ``bench/machine.py``'s median): bf16 8192^3 on CUDA, fp32
    1024^3 on a CPU (256^3 with ``quick``)."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda and not quick else (1024 if not quick else 256, torch.float32)
    return {"flops_per_s": matmul_peak(device, n, dtype), "n": n, "dtype": str(dtype).replace("torch.", "")}


def config(model: str, method: str, batch: int, compile_: bool, args, out_dir: str) -> TrainConfig:
    """The trainer's config of one run: ``args.rounds`` timed rounds and one for the operator count
    leave the run one round short of its end (no final checkpoint, no final evaluation)."""
    values = {**MODELS[model][1 if args.quick else 0], "method": METHODS[method][0],
              "options": dict(METHODS[method][1]), "dataset": "pycode", "context": args.context,
              "batch_size": batch, "simulate": args.workers, "rounds": args.rounds + 2, "local_steps": args.local_steps,
              "eval_interval": 0, "device": args.device, "precision": args.precision, "optimizer": "adamw",
              "compile": compile_, "seed": 0, "out_dir": out_dir, "overwrite": True, "progress": False,
              "plots": False, **({"threads": 1} if torch.device(args.device).type == "cpu" else {})}
    return TrainConfig.from_dict(values, "gpu_step_costs").validate()


def step_flops(cfg: TrainConfig, model: str, method: str, batch: int, cache: Dict) -> Dict[str, float]:
    """FLOPs of one worker step: the whole model, and the method's largest subnetwork."""
    key = (model, method, batch)
    if key not in cache:
        net = build_model(cfg, load_dataset(cfg))
        tokens = torch.zeros(batch, cfg.context, dtype=torch.long)
        full = model_step_flops(net, tokens)
        name, options = METHODS[method]
        sub = max(subnetwork_step_flops(net, name, cfg.num_workers, options, tokens)) if name != "localsgd" else full
        cache[key] = {"full": float(full), "step": float(sub)}
    return cache[key]


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched (on CUDA each is about one kernel launch)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def time_run(cfg: TrainConfig, rounds: int, deadline: float) -> Dict[str, float]:
    """ms per worker step of ``local`` over rounds 2..R (R = ``rounds``), through the trainer's own
    round phases; the compile part and the compile counts."""
    device = torch.device(cfg.device)
    set_threads(cfg, 1)  # as ist-train: --threads (the CPU runs) fixes torch's thread count
    run = Run(cfg, World(simulated=True, device=device))
    run.begin()
    per_round, compile_s = [], 0.0
    for r in range(rounds):
        turns = run.begin_round(r)
        losses = [run.ctx.train(turn, r) for turn in turns]
        rec = run.end_round(r, losses)
        compile_s += rec["time"].get("compile", 0.0)
        per_round.append((rec["time"]["local"], len(turns)))
        if time.perf_counter() > deadline and r >= 1:
            break
    later = per_round[1:] or per_round
    steps = sum(n for _, n in later) * cfg.local_steps
    out = {"ms_per_step": 1e3 * sum(t for t, _ in later) / steps, "rounds_timed": len(later),
           "compile_s": compile_s, "train_loss": float(rec["train_loss"])}
    if not cfg.compile:  # the operators of a later step of the first worker (forward, backward, AdamW)
        r = len(per_round)
        turns = run.begin_round(r)
        first = run.ctx.train(turns[0], r, steps=1)  # a fresh optimizer's first step also makes its state
        with OpCount() as c:
            first = first + run.ctx.train(turns[0], r, steps=1)
        run.end_round(r, [first] + [torch.zeros((), dtype=torch.float64, device=device)] * (len(turns) - 1))
        out["ops_per_step"] = c.n
    if run.ctx.compiler is not None:
        out.update(run.ctx.compiler.counts())
    return out


def checks(rows: List[Dict], peak: float) -> None:
    """Fills each row's ``flop_ratio``, ``measured_ratio``, ``bound`` and ``check`` (PASS / MISS)."""
    base = {(r["model"], r["batch"], r["mode"]): r for r in rows if r["method"] == "localsgd" and "ms_per_step" in r}
    for r in rows:
        if "ms_per_step" not in r:
            r["check"] = "not reached"
            continue
        if r["method"] == "localsgd":
            r["flop_ms"] = 1e3 * r["flops"]["step"] / peak
            r["measured_ratio"] = r["ms_per_step"] / r["flop_ms"]
            r["bound"] = LOCAL_SGD_BOUND
        else:
            b = base.get((r["model"], r["batch"], r["mode"]))
            r["flop_ratio"] = r["flops"]["step"] / r["flops"]["full"]
            if b is None:
                r["check"] = "no local SGD run"
                continue
            r["measured_ratio"] = r["ms_per_step"] / b["ms_per_step"]
            r["bound"] = SUBNET_BOUND * r["flop_ratio"]
        r["check"] = "PASS" if r["measured_ratio"] <= r["bound"] else "MISS"


def render(doc: Dict) -> str:
    peak = doc["peak"]
    lines = [f"# A subnetwork's step against its FLOPs: {doc['device']}", "",
             f"`{doc['command']}` ({doc['wall_s']:.0f} s). torch {doc['torch']}; S = {doc['workers']} simulated "
             f"workers, {doc['local_steps']} local steps a round, rounds 2..{doc['rounds']} timed (`local`; "
             f"compiling is its own part), {doc['precision']} autocast, AdamW, context {doc['context']}. Measured "
             f"peak: {peak['flops_per_s'] / 1e12:.1f} TFLOP/s ({peak['dtype']} matmul {peak['n']}^3).", "",
             "Checks: local SGD's step at most 1.5x its FLOPs at the measured peak; a subnetwork method's step "
             "at most 1.15x (its FLOPs / local SGD's) x local SGD's step, same model, batch and mode.", "",
             "| model | batch | mode | method | ms / step | GFLOP / step | FLOP ratio | measured | bound | check "
             "| aten ops / step |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in doc["rows"]:
        ms = f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else "-"
        fr = "1 (FLOP time {:.2f} ms)".format(r["flop_ms"]) if "flop_ms" in r else \
            (f"{r['flop_ratio']:.3f}" if "flop_ratio" in r else "-")
        meas = f"{r['measured_ratio']:.3f}" if "measured_ratio" in r else "-"
        bound = f"{r['bound']:.3f}" if "bound" in r else "-"
        gf = f"{r['flops']['step'] / 1e9:.1f}" if "flops" in r else "-"
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['method']} | {ms} | {gf} | {fr} | {meas} | "
                     f"{bound} | {r['check']}{' (' + r['error'] + ')' if r.get('error') else ''} | "
                     f"{r.get('ops_per_step', '-')} |")
    n = sum(r["check"] == "PASS" for r in doc["rows"])
    lines += ["", f"{n} of {len(doc['rows'])} rows PASS. Compile counts per compiled run are in the JSON beside "
                  "this file. aten ops / step: the operators one eager step of a worker dispatches (forward, "
                  "backward, optimizer; on CUDA about one kernel launch each): a subnetwork that launches as many "
                  "kernels as the full model cannot step faster where launches, not FLOPs, set the time."]
    return "\n".join(lines) + "\n"


def profile(cfg: TrainConfig, steps: int = 1) -> str:
    """A per-operator table of one local step (after two warm rounds' worth of steps) of the first
    worker: ``torch.profiler``, sorted by device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile as prof

    device = torch.device(cfg.device)
    run = Run(cfg, World(simulated=True, device=device))
    run.begin()
    turn = run.begin_round(0)[0]
    run.ctx.train(turn, 0, steps=3)  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with prof(activities=acts) as p:
        run.ctx.train(turn, 0, steps=steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return p.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the markdown file to write (and the same name .json)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny models, 2 rounds, batches 2 and 4, context 32")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--modes", default="eager,compile")
    p.add_argument("--batches", default=None, help="default 16,64 (--quick: 2,4)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="rounds per run; rounds 2.. are timed")
    p.add_argument("--local-steps", type=int, default=None, help="default 10 (--quick: 2)")
    p.add_argument("--context", type=int, default=None, help="default 512 (--quick: 32)")
    p.add_argument("--precision", default=None, help="default bf16 on CUDA, fp32 on a CPU")
    p.add_argument("--budget-s", type=float, default=480.0, help="all runs together stop inside this")
    p.add_argument("--run-limit-s", type=float, default=45.0, help="a run stops timing after this (>= 2 rounds)")
    p.add_argument("--profile", action="store_true", help="also a per-operator profile of one step on the Llama")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    args.local_steps = args.local_steps or (2 if args.quick else 10)
    args.context = args.context or (32 if args.quick else 512)
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.quick:
        args.rounds = min(args.rounds, 2)
    batches = [int(b) for b in (args.batches or ("2,4" if args.quick else "16,64")).split(",")]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else 0)
    peak = measure_peak(device, args.quick)
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
           "command": "python tools/gpu_step_costs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__, "workers": args.workers, "local_steps": args.local_steps,
           "rounds": args.rounds, "precision": args.precision, "context": args.context, "peak": peak, "rows": []}
    flops: Dict = {}
    order = [(mode, b, m, meth) for mode in args.modes.split(",") for b in batches
             for m in args.models.split(",") for meth in args.methods.split(",")]
    json_out = os.path.splitext(args.out)[0] + ".json"
    with tempfile.TemporaryDirectory() as tmp:
        for mode, b, m, meth in order:
            row = {"model": m, "batch": b, "mode": mode, "method": meth}
            doc["rows"].append(row)
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < 15:
                row["error"] = "the budget was spent"
                continue
            try:
                cfg = config(m, meth, b, mode == "compile", args, os.path.join(tmp, f"{m}-{meth}-{b}-{mode}"))
                row["flops"] = step_flops(cfg, m, meth, b, flops)
                t0 = time.perf_counter()
                row.update(time_run(cfg, args.rounds, t0 + min(args.run_limit_s, left)))
                row["wall_s"] = round(time.perf_counter() - t0, 1)
            except Exception as e:  # recorded; the next run goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{mode:7s} B={b:<3d} {m:10s} {meth:10s} "
                  f"{row.get('ms_per_step', float('nan')):9.3f} ms/step {row.get('error', '')}", flush=True)
            doc["wall_s"] = time.perf_counter() - t_start
            checks(doc["rows"], peak["flops_per_s"])
            with open(json_out, "w") as f:
                json.dump(doc, f, indent=1)
            with open(args.out, "w") as f:
                f.write(render(doc))
        if args.profile:
            parts = [f"# One local step of the Llama, per operator: {doc['device']}", "",
                     f"`{doc['command']}`: batch {batches[0]}, eager, the first worker's turn, after 3 warm steps.", ""]
            for meth in args.methods.split(","):
                if args.budget_s + 90 - (time.perf_counter() - t_start) < 10:
                    parts += [f"## {meth}", "", "not reached (budget)", ""]
                    continue
                try:
                    cfg = config("llama1024", meth, batches[0], False, args, os.path.join(tmp, f"profile-{meth}"))
                    parts += [f"## {meth}", "", "```", profile(cfg), "```", ""]
                except Exception as e:
                    parts += [f"## {meth}", "", f"failed: {type(e).__name__}: {str(e)[:300]}", ""]
            with open(os.path.splitext(args.out)[0] + "_profile.md", "w") as f:
                f.write("\n".join(parts))
    return 0 if all("ms_per_step" in r for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
