"""Per-round exchange cost: ist_kernels.distributed.Exchange vs the local-SGD full-model all_reduce.

    python bench/bench_exchange.py [--rounds 3] [--out bench/results/exchange_cpu.md]

Spawns gloo process groups on this machine (CPU): for preact_resnet18 with LOFT plans and
preact_resnet101 with ResIST plans, each rank holds its subnetwork (decentralized storage), and one
round's exchange (plans t -> t+1, both derived from the seed on every rank) is timed against
``average_model_`` of the full model (local SGD). Times are measured at S = 2 (and S = 4 for
resnet18; the CPU has few cores, so larger groups only share them); bytes per round for S = 2, 4, 8
come from ``plan_bytes`` (the same routing the exchange runs; checked equal to the counted bytes
where measured). The table sets them beside paper 003's Table 1 (ResNet101, local SGD vs ResIST)
and paper 000's Table 1 (PreResNet-18 CIFAR-100, local SGD vs LOFT, total over pretraining).

Uses ist_kernels.models and the LOFT / ResIST plans when present, else the same state-dict shapes
and plans built here.
"""
import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import ist_kernels  # noqa: E402,F401
from ist_kernels.distributed import (  # noqa: E402
    Exchange,
    average_model_,
    destroy_process_group,
    init_process_group,
    plan_bytes,
)
from ist_kernels.partition import SlicePlan, TensorSlices  # noqa: E402

GB = 1e9
NUM_CLASSES = 100  # CIFAR-100, as in both papers' tables


# ---------------------------------------------------------------- models and plans
def _bn(name, c):
    return {f"{name}.weight": (c,), f"{name}.bias": (c,), f"{name}.running_mean": (c,),
            f"{name}.running_var": (c,), f"{name}.num_batches_tracked": ()}


def preact_shapes(depth):
    """State-dict shapes of a CIFAR PreAct ResNet (3x3 stem, layer1..4, final bn, fc)."""
    bottleneck, blocks = {18: (False, [2, 2, 2, 2]), 101: (True, [3, 4, 23, 3])}[depth]
    exp = 4 if bottleneck else 1
    s = {"conv1.weight": (64, 3, 3, 3)}
    blocks_of, inp = [], 64
    for i, n in enumerate(blocks):
        planes = 64 * 2 ** i
        stage = []
        for b in range(n):
            p, stride = f"layer{i + 1}.{b}", (2 if i > 0 and b == 0 else 1)
            s.update(_bn(f"{p}.bn1", inp))
            if bottleneck:
                s[f"{p}.conv1.weight"] = (planes, inp, 1, 1)
                s.update(_bn(f"{p}.bn2", planes))
                s[f"{p}.conv2.weight"] = (planes, planes, 3, 3)
                s.update(_bn(f"{p}.bn3", planes))
                s[f"{p}.conv3.weight"] = (planes * exp, planes, 1, 1)
            else:
                s[f"{p}.conv1.weight"] = (planes, inp, 3, 3)
                s.update(_bn(f"{p}.bn2", planes))
                s[f"{p}.conv2.weight"] = (planes, planes, 3, 3)
            if stride != 1 or inp != planes * exp:
                s[f"{p}.shortcut.0.weight"] = (planes * exp, inp, 1, 1)
            stage.append(p)
            inp = planes * exp
        blocks_of.append(stage)
    s.update(_bn("bn", inp))
    s.update({"fc.weight": (NUM_CLASSES, inp), "fc.bias": (NUM_CLASSES,)})
    return s, blocks_of


def hand_loft(shapes, blocks_of, S, g):
    """LOFT (paper 000 §4): in every block but the first of a stage, conv1's output filters split
    into S disjoint random sets, with bn2's channels and conv2's input channels."""
    part = {}
    for stage in blocks_of:
        for p in stage[1:]:
            c = shapes[f"{p}.conv1.weight"][0]
            perm = torch.randperm(c, generator=g)
            own = tuple(perm[s::S].sort().values for s in range(S))
            part[f"{p}.conv1.weight"] = (0, own)
            for k in ("weight", "bias", "running_mean", "running_var"):
                part[f"{p}.bn2.{k}"] = (0, own)
            part[f"{p}.conv2.weight"] = (1, own)
    return SlicePlan(S, tuple(TensorSlices(n, *part[n]) if n in part else TensorSlices(n, None) for n in shapes))


def hand_resist(shapes, blocks_of, S, g, min_depth=5):
    """ResIST (paper 003 §2.2): the third stage's blocks but its first, permuted, dealt
    round-robin; a sub-ResNet below min_depth borrows blocks (then shared by several)."""
    blocks = blocks_of[2][1:]
    perm = torch.randperm(len(blocks), generator=g).tolist()
    mine = [set(perm[s::S]) for s in range(S)]
    for s in range(S):
        for b in perm:
            if len(mine[s]) >= min(min_depth, len(blocks)):
                break
            mine[s].add(b)
    empty = torch.zeros(0, dtype=torch.int64)
    part = {}
    for i, p in enumerate(blocks):
        for n in shapes:
            if n.startswith(p + ".") and not n.endswith("num_batches_tracked"):
                full = torch.arange(shapes[n][0])
                part[n] = (0, tuple(full if i in mine[s] else empty for s in range(S)))
    return SlicePlan(S, tuple(TensorSlices(n, *part[n]) if n in part else TensorSlices(n, None) for n in shapes))


def setup(model_name, method):
    """(spec: name -> meta tensor, plan(S, round) -> SlicePlan, source)."""
    depth = {"preact_resnet18": 18, "preact_resnet101": 101}[model_name]
    try:
        from ist_kernels import models
        from ist_kernels.partition import loft_plan, resist_plan

        model = getattr(models, model_name)(num_classes=NUM_CLASSES)
        spec = {n: torch.empty(v.shape, dtype=v.dtype, device="meta") for n, v in model.state_dict().items()}

        def plan(S, rnd):
            g = torch.Generator().manual_seed(1000 * S + rnd)
            p = loft_plan(model, S, generator=g) if method == "LOFT" else resist_plan(model, S, generator=g)
            return p.slices
        return spec, plan, "ist_kernels.models + partition"
    except (ImportError, AttributeError):
        shapes, blocks_of = preact_shapes(depth)
        spec = {n: torch.empty(s, dtype=torch.int64 if n.endswith("num_batches_tracked") else torch.float32,
                               device="meta") for n, s in shapes.items()}

        def plan(S, rnd):
            g = torch.Generator().manual_seed(1000 * S + rnd)
            return (hand_loft if method == "LOFT" else hand_resist)(shapes, blocks_of, S, g)
        return spec, plan, "hand-built shapes and plans"


# ---------------------------------------------------------------- one timed group
def _compact(full, plan, s):
    out = {}
    for t in plan.tensors:
        if t.shared:
            out[t.name] = full[t.name].clone()
        elif t.owners[s].numel():
            out[t.name] = full[t.name].index_select(t.dim, t.owners[s])
    return out


def _worker(rank, S, store, model_name, method, rounds, results):
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S, timeout=300)
    spec, plan_of, _ = setup(model_name, method)
    g = torch.Generator().manual_seed(0)
    full = {n: (torch.zeros(m.shape, dtype=m.dtype) if not m.dtype.is_floating_point
                else torch.randn(m.shape, generator=g)) for n, m in spec.items()}
    out = {}
    # fp32: shared tensors by one all_reduce; int8: every communicated tensor quantised (paper 003
    # A.5), so the shared ones go through the all-to-all too (shared="exact")
    for quantize, shared in ((None, "all_reduce"), ("int8", "exact")):
        plan = plan_of(S, 0)
        local = _compact(full, plan, rank)
        times, build, coll = [], [], []
        for rnd in range(rounds + 1):
            nxt = plan_of(S, rnd + 1)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ex = Exchange(plan, nxt, spec, quantize=quantize, shared=shared, round=rnd).prepare()
            t1 = time.perf_counter()
            local = ex(local)
            t2 = time.perf_counter()
            if rnd:  # the first round warms up
                times.append(t2 - t0)
                build.append(t1 - t0)
                coll.append(sum(ex.last_stats.collective_seconds.values()))
            st = ex.last_stats
            if quantize is None:
                want = plan_bytes(plan, nxt, spec)[rank]
                assert (st.bytes_sent, st.bytes_received) == (want.bytes_sent, want.bytes_received)
            plan = nxt
        out[quantize or "fp32"] = dict(seconds=statistics.median(times), build=statistics.median(build),
                                       collectives=statistics.median(coll), sent=st.bytes_sent,
                                       received=st.bytes_received, a2a=st.all_to_all_bytes_sent,
                                       ar=st.all_reduce_bytes, count=st.collectives)
    floats = {n: v for n, v in full.items() if v.dtype.is_floating_point}
    times = []
    for rnd in range(rounds + 1):
        torch.distributed.barrier()
        st = average_model_(floats, round=rnd)
        if rnd:
            times.append(st.seconds)
    out["local_sgd"] = dict(seconds=statistics.median(times), sent=st.bytes_sent, ar=st.all_reduce_bytes,
                            count=st.collectives)
    results[rank] = out
    destroy_process_group()


def measure(model_name, method, S, rounds):
    with tempfile.TemporaryDirectory() as d:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_worker, args=(S, os.path.join(d, "store"), model_name, method, rounds, results), nprocs=S)
        return dict(results)


# ---------------------------------------------------------------- report
PAPER_003 = {2: (0.662, 0.454), 4: (1.325, 0.720), 8: (2.649, 1.289)}  # GB per round: local SGD, ResIST
PAPER_000 = {2: (55.51, 40.03), 4: (111.03, 64.57)}  # GB over pretraining: local SGD, LOFT (PreResNet-18 C100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "exchange_cpu.md"))
    args = ap.parse_args()
    lines = [
        "# Exchange per round vs local SGD (gloo, CPU)", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{args.rounds} timed rounds after one warm-up, median; ranks use 1 thread each; load average "
        f"{os.getloadavg()[0]:.1f} when it started (times on a shared machine are indicative only).", "",
        "Bytes: per rank, counted from the buffers passed to the collectives (the all_reduce as a ring: "
        "2(S-1)/S of its buffer sent and as much received). Total = sum over ranks of bytes sent "
        "(equal to bytes received). Decentralized storage, shared tensors by one all_reduce (fp32); "
        "int8: every communicated tensor quantised, one scale per slice, the shared ones through the "
        "all-to-all as well (one collective).", ""]
    configs = [("preact_resnet18", "LOFT", (2, 4), (2, 4)), ("preact_resnet101", "ResIST", (2, 4, 8), (2,))]
    bytes_rows, time_rows = [], []
    for model_name, method, sizes, timed in configs:
        spec, plan_of, source = setup(model_name, method)
        model_bytes = sum(m.numel() * m.element_size() for m in spec.values() if m.dtype.is_floating_point)
        lines.append(f"- {model_name}: {model_bytes / 1e6:.1f} MB of floating tensors ({source})")
        for S in sizes:
            per_rank = plan_bytes(plan_of(S, 0), plan_of(S, 1), spec)
            ours = sum(p.bytes_sent for p in per_rank)
            lsgd = S * (2 * (S - 1) * model_bytes // S)
            paper = PAPER_003.get(S) if method == "ResIST" else PAPER_000.get(S)
            paper_ratio = f"{paper[1] / paper[0]:.3f}" if paper else "-"
            paper_cols = (f"{paper[0]:.3f} / {paper[1]:.3f}" if method == "ResIST" and paper else
                          (f"{paper[0]:.2f} / {paper[1]:.2f} (total)" if paper else "-"))
            bytes_rows.append(
                f"| {model_name} | {method} | {S} | {max(p.bytes_sent for p in per_rank) / GB:.4f} | "
                f"{ours / GB:.4f} | {lsgd / GB:.4f} | {ours / lsgd:.3f} | {paper_cols} | {paper_ratio} |")
        for S in timed:
            res = measure(model_name, method, S, args.rounds)
            slow = {k: max(res[r][k]["seconds"] for r in res) for k in ("fp32", "int8", "local_sgd")}
            r0 = res[0]
            time_rows.append(
                f"| {model_name} | {method} | {S} | {slow['fp32'] * 1e3:.1f} | {r0['fp32']['build'] * 1e3:.1f} | "
                f"{r0['fp32']['collectives'] * 1e3:.1f} | {slow['int8'] * 1e3:.1f} | {slow['local_sgd'] * 1e3:.1f} | "
                f"{slow['local_sgd'] / slow['fp32']:.2f}x | {r0['fp32']['sent'] / GB:.4f} | "
                f"{r0['int8']['sent'] / GB:.4f} | "
                f"{r0['local_sgd']['sent'] / GB:.4f} | {r0['fp32']['count']} |")
            print(time_rows[-1], flush=True)
    lines += ["", "## Bytes per round (from the plans; equal to the counted bytes where timed)", "",
              "| model | method | S | max per rank sent GB | total sent GB | local SGD total GB | ratio | "
              "paper local SGD / method GB | paper ratio |",
              "|---|---|---|---|---|---|---|---|---|", *bytes_rows, "",
              "Paper 003 Table 1 (ResNet101): GB per synchronisation round; paper 000 Table 1 (PreResNet-18, "
              "CIFAR-100): GB over the whole pretraining. The papers do not say how they count, so compare the "
              "ratios.", "",
              "## Time per round (slowest rank, ms)", "",
              "| model | method | S | exchange fp32 | of it: plan routing | of it: in collectives | exchange int8 | "
              "local SGD all_reduce | speedup | sent GB fp32 | sent GB int8 | sent GB local SGD | collectives |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *time_rows, ""]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
