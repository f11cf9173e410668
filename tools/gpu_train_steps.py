"""Local-step time of the experiments' workloads on a GPU, through the trainer itself (issue 27 item 6).

Runs ``ist-train --device cuda --simulate S`` for each (workload, method) below for a few rounds, with
no evaluation, and writes one JSON file: per run the command, each round's time by part (the
trainer's Clock synchronises the device at part boundaries, so ``local`` holds the local steps'
kernels) and the summary. The cost model takes ``local`` per round from these runs in place of
the CPU's, the link from its own terms. Every run has its own time limit; a failed run is recorded
with its error and the next one goes on.

    python tools/gpu_train_steps.py --out results.json [--device cuda] [--quick] [--budget-s 150]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: (workload, model flags) as the experiments run them: the LM (issue 27's main workload, both sizes
#: the experiment may pick) and the speed experiment's CNN at its width and at the paper's width
WORKLOADS = {
    "lm_tiny": ["--model", "gpt_tiny", "--dataset", "pycode", "--context", "128", "--batch-size", "16"],
    "lm_small": ["--model", "gpt_small", "--dataset", "pycode", "--context", "256", "--batch-size", "32"],
    "cnn": ["--model", "preact_resnet101_basic", "--width", "16", "--dataset", "digits", "--batch-size", "32"],
    "cnn_w64": ["--model", "preact_resnet101_basic", "--width", "64", "--dataset", "digits", "--batch-size", "128"],
}
METHODS = {
    "lm_tiny": ["localsgd", "ist", "ist:partition=heads", "resist", "diloco"],
    "lm_small": ["localsgd", "ist", "resist", "diloco"],
    "cnn": ["localsgd", "loft", "resist"],
    "cnn_w64": ["localsgd", "loft", "resist"],
}


def run_one(workload: str, method: str, S: int, rounds: int, local_steps: int, device: str, limit_s: float,
            tmp: str) -> dict:
    name, _, opt = method.partition(":")
    out_dir = os.path.join(tmp, f"{workload}-{name}-{opt.replace('=', '_')}-S{S}")
    cmd = [sys.executable, "-m", "ist_kernels.train", "--method", name, *WORKLOADS[workload],
           "--simulate", str(S), "--rounds", str(rounds), "--local-steps", str(local_steps),
           "--eval-interval", "0", "--device", device, "--out-dir", out_dir, "--overwrite", "--seed", "0"]
    if opt:
        cmd += ["--option", opt]
    rec = {"workload": workload, "method": method, "workers": S, "rounds": rounds, "local_steps": local_steps,
           "command": " ".join(cmd[1:])}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
        rc, err = p.returncode, p.stderr[-2000:]
    except subprocess.TimeoutExpired:
        rc, err = 124, f"stopped at its {limit_s:.0f} s limit"
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    rec["rc"] = rc
    if rc != 0:
        rec["error"] = err
        return rec
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    rec["rounds_time"] = [r.get("time") for r in rows]
    trained = [r["time"]["local"] for r in rows if (r.get("time") or {}).get("local", 0) > 0]  # not round 0's eval
    later = trained[1:] or trained  # from the second trained round on (the first compiles and builds)
    rec["local_s_per_round"] = sum(later) / len(later)  # the simulated run's S workers, one after another
    rec["local_s_per_step"] = rec["local_s_per_round"] / (local_steps * S)  # one worker's step
    rec["summary"] = {k: summary.get(k) for k in ("time_by_part", "bytes_sent", "param_count", "train_loss",
                                                  "final_loss", "rank_state_bytes") if k in summary}
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--device", default="cuda")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=20)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--budget-s", type=float, default=150.0, help="all runs together stop inside this")
    p.add_argument("--run-limit-s", type=float, default=60.0)
    args = p.parse_args(argv)
    t0, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.workloads.split(","):
            for m in METHODS[w]:
                left = args.budget_s - (time.perf_counter() - t0)
                if left < 10:
                    results.append({"workload": w, "method": m, "rc": None, "error": "the budget was spent"})
                    continue
                rec = run_one(w, m, args.workers, args.rounds, args.local_steps, args.device,
                              min(args.run_limit_s, left), tmp)
                results.append(rec)
                per = f"{rec['local_s_per_step'] * 1e3:9.2f} ms/step" if "local_s_per_step" in rec \
                    else f"failed rc={rec['rc']}: {rec.get('error', '')[-300:]}"
                print(f"{w:9s} {m:22s} S={args.workers} {per}  ({rec['wall_s']} s)", flush=True)
                with open(args.out, "w") as f:  # after every run: a stop keeps what finished
                    json.dump({"device": args.device, "results": results}, f, indent=1)
    return 0 if all(r.get("rc") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
