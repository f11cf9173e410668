"""Per-call host overhead: every functional op against the torch composition it replaces, on tiny
tensors, where the time is all host (Python, dispatch, checks, allocation), not math.

    python bench/bench_overhead.py                       # CPU, and CUDA where present
    python bench/bench_overhead.py --json overhead.json  # rows {"op", "device", "ours_us", "torch_us", "ratio",
                                                         #       "timer"}

Each op runs forward, and forward + backward (``torch.autograd.grad``) where it has a gradient.
CPU: one thread, host clock, the median of ``--repeats`` runs of ``--calls`` calls each, ours and
torch's runs interleaved so both see the same machine. CUDA: host time from ``torch.profiler``
(the CPU time of a labelled range around each run of calls; the GPU work of tiny tensors is
shorter than the host's), so the number is what a step of a small model pays before the GPU
works; the profiler adds its own cost to every op it records, so ``--cuda-timer clock`` also gives
the host clock with the queue drained before each run. ``ratio`` = ours / torch: above 1, ours costs more host time per call (issue 19 item 1
asks for <= 1.3 on the CPU).

The torch compositions are what a user writes without this package: a float mask instead of
1-bit gates, index_select instead of the subnetwork GEMM and the slice ops, index_copy_ /
index_add_ loops instead of the owner-averaged scatter.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the tree this file is in, not an installed copy

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as bench/conftest.py: the kernels are defined for the CPU

import torch.nn.functional as TF  # noqa: E402

import ist_kernels.functional as F  # noqa: E402

SHIFTS = torch.arange(32, dtype=torch.int32)


# ---- the torch compositions
def torch_pack(mask):
    """bool [..., F] -> int32 [..., ceil(F/32)]: pad to whole words, shift, sum (= or)."""
    F_ = mask.shape[-1]
    padded = TF.pad(mask, (0, -F_ % 32)).view(*mask.shape[:-1], -1, 32)
    return padded.to(torch.int32).bitwise_left_shift(SHIFTS.to(mask.device)).sum(-1, dtype=torch.int32)


def torch_unpack(words, num_features):
    bits = words[..., None].bitwise_right_shift(SHIFTS.to(words.device)).bitwise_and(1)
    return bits.flatten(-2)[..., :num_features].bool()


def torch_owner_average_(target, updates, indices, dim=0):
    """The owner mean with index_add_: sum and count the owners, divide where owned."""
    acc = torch.zeros_like(target)
    count = torch.zeros(target.shape[dim], dtype=target.dtype, device=target.device)
    for u, i in zip(updates, indices):
        acc.index_add_(dim, i, u)
        count.index_add_(0, i, torch.ones_like(i, dtype=target.dtype))
    shape = [1] * target.dim()
    shape[dim] = -1
    count = count.view(shape)
    target.copy_(torch.where(count > 0, acc / count.clamp(min=1), target))
    return target


# ---- the cases: name -> (ours, torch's), each a no-argument callable on tiny tensors
def cases(device):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    def grad(*shape):
        return rnd(*shape).requires_grad_()

    M, K, N = 4, 16, 8
    x, W, b = rnd(M, K), rnd(N, K), rnd(N)
    mask = rnd(M, N) > 0
    gates = F.pack_gates(mask)
    fmask = mask.to(x.dtype)
    xg, Wg, bg = grad(M, K), grad(N, K), grad(N)
    gy = rnd(M, N)
    rows = torch.tensor([5, 1, 0, 2, 7, 3], device=device)
    cols = torch.tensor([9, 0, 4, 13, 2, 11, 6, 15, 1, 8], device=device)
    xs = rnd(M, len(cols))
    xsg = grad(M, len(cols))
    gs = rnd(M, len(rows))

    def ts_linear(x_, W_, b_):
        return TF.linear(x_, W_.index_select(0, rows).index_select(1, cols), b_.index_select(0, rows))

    # 8 tensors of a small network, each sliced along its own dim (conv filters, BN vectors, in-channels)
    srcs = [rnd(8, 4, 3, 3), rnd(8), rnd(8), rnd(6, 8, 3, 3), rnd(16, 6), rnd(16), rnd(4, 16), rnd(4)]
    dims = [0, 0, 0, 1, 0, 0, 1, 0]
    ids = list(range(len(srcs)))
    idx = [torch.randperm(s.shape[d], generator=g)[: s.shape[d] // 2].to(device) for s, d in zip(srcs, dims)]
    segs = [s.index_select(d, i) for s, d, i in zip(srcs, dims, idx)]
    sgrad = [s.clone().requires_grad_() for s in srcs]
    # scatter: 4 tensors, 2 owners each (8 segments)
    tgts = srcs[:4]
    sids = [t for t in range(4) for _ in range(2)]
    sidx = [torch.randperm(tgts[t].shape[dims[t]], generator=g)[:3].sort().values.to(device) for t in sids]
    sups = [tgts[t].index_select(dims[t], i) + 1 for t, i in zip(sids, sidx)]
    target = rnd(8, 4)
    oups = [rnd(3, 4), rnd(3, 4)]
    oidx = [torch.tensor([0, 5, 2], device=device), torch.tensor([5, 7, 1], device=device)]

    def loop(method):
        def run():
            for t, u, i in zip(sids, sups, sidx):
                getattr(tgts[t], method)(dims[t], i, u)
        return run

    def torch_scatter_mean():
        for t in range(4):
            torch_owner_average_(tgts[t], [u for s, u in zip(sids, sups) if s == t],
                                 [i for s, i in zip(sids, sidx) if s == t], dims[t])

    return {
        "pack_gates": (lambda: F.pack_gates(mask), lambda: torch_pack(mask)),
        "unpack_gates": (lambda: F.unpack_gates(gates, N), lambda: torch_unpack(gates, N)),
        "relu_gates": (lambda: F.relu_gates(x, W, b), lambda: (lambda z: (z.relu(), z > 0))(TF.linear(x, W, b))),
        "gated_linear": (lambda: F.gated_linear(x, W, gates, b), lambda: TF.linear(x, W, b) * fmask),
        "gated_linear fwd+bwd": (
            lambda: torch.autograd.grad(F.gated_linear(xg, Wg, gates, bg), (xg, Wg, bg), gy),
            lambda: torch.autograd.grad(TF.linear(xg, Wg, bg) * fmask, (xg, Wg, bg), gy)),
        "subnet_linear": (lambda: F.subnet_linear(xs, W, b, rows, cols), lambda: ts_linear(xs, W, b)),
        "subnet_linear fwd+bwd": (
            lambda: torch.autograd.grad(F.subnet_linear(xsg, Wg, bg, rows, cols), (xsg, Wg, bg), gs),
            lambda: torch.autograd.grad(ts_linear(xsg, Wg, bg), (xsg, Wg, bg), gs)),
        "gather_slices (8 tensors)": (
            lambda: F.gather_slices(srcs, ids, idx, dims),
            lambda: torch.cat([s.index_select(d, i).reshape(-1) for s, d, i in zip(srcs, dims, idx)])),
        "gather_slices fwd+bwd (8 tensors)": (
            lambda: torch.autograd.grad(F.gather_slices(sgrad, ids, idx, dims), sgrad, segs),
            lambda: torch.autograd.grad([s.index_select(d, i) for s, d, i in zip(sgrad, dims, idx)], sgrad, segs)),
        "scatter_slices_ copy (8 segments)": (
            lambda: F.scatter_slices_(tgts, sids, sups, sidx, dims[:4], "copy"), loop("index_copy_")),
        "scatter_slices_ sum (8 segments)": (
            lambda: F.scatter_slices_(tgts, sids, sups, sidx, dims[:4], "sum"), loop("index_add_")),
        "scatter_slices_ mean (8 segments)": (
            lambda: F.scatter_slices_(tgts, sids, sups, sidx, dims[:4], "mean"), torch_scatter_mean),
        "owner_average_": (lambda: F.owner_average_(target, oups, oidx, 0),
                           lambda: torch_owner_average_(target, oups, oidx, 0)),
    }


# ---- timing
def cpu_runs(fns, calls, repeats, before_run=None):
    """Median microseconds per call of each fn: ``repeats`` runs of ``calls`` calls, interleaved
    (``before_run``, untimed, before each run)."""
    for fn in fns:
        for _ in range(max(10, calls // 10)):  # warm-up (first-call caches, allocator)
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            if before_run is not None:
                before_run()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[k].append((time.perf_counter() - t0) / calls * 1e6)
    return [statistics.median(t) for t in times]


def cuda_runs(fns, calls, repeats):
    """Median host microseconds per call of each fn, from torch.profiler's CPU time of a labelled
    range around each run (the queue is drained before each run, not inside it)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for fn in fns:
        for _ in range(max(10, calls // 10)):
            fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(repeats):
            for k, fn in enumerate(fns):
                torch.cuda.synchronize()
                with record_function(f"ist_overhead_{k}_{r}"):
                    for _ in range(calls):
                        fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for e in prof.events():
        if e.name.startswith("ist_overhead_"):
            k = int(e.name.split("_")[2])
            times[k].append(e.cpu_time_total / calls)
    return [statistics.median(t) for t in times]


def cuda_clock_runs(fns, calls, repeats):
    """As cpu_runs, with the queue drained before each run and not inside it: host time while the
    GPU keeps up with tiny kernels, without the profiler's own cost on every op it records."""
    return cpu_runs(fns, calls, repeats, before_run=torch.cuda.synchronize)


def measure(device, calls, repeats, only=None, cuda_timer="profiler", on_row=None):
    """One row per op; ``on_row(rows so far)`` after each (a run stopped at a time limit keeps them)."""
    rows = []
    for op, (ours, theirs) in cases(device).items():
        if only and not any(s in op for s in only):
            continue
        run = cpu_runs if device == "cpu" else cuda_runs if cuda_timer == "profiler" else cuda_clock_runs
        ours_us, torch_us = run([ours, theirs], calls, repeats)
        rows.append({"op": op, "device": device, "ours_us": round(ours_us, 2), "torch_us": round(torch_us, 2),
                     "ratio": round(ours_us / torch_us, 3),
                     "timer": "host clock" if device == "cpu" or cuda_timer == "clock" else "torch.profiler"})
        if on_row is not None:
            on_row(rows)
    return rows


def markdown(rows, threads):
    out = [f"### Per-call host time, tiny tensors ({threads} thread{'s' if threads > 1 else ''}; "
           f"ratio = ours / torch)", "", "| op | device | ours us | torch us | ratio |", "|---|---|---:|---:|---:|"]
    out += [f"| {r['op']} | {r['device']} | {r['ours_us']:.2f} | {r['torch_us']:.2f} | {r['ratio']:.2f} |"
            for r in rows]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here (a JSON list)")
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                   help="all: the CPU, and CUDA where present (default)")
    p.add_argument("--calls", type=int, default=3000, help="calls per run (default 3000)")
    p.add_argument("--repeats", type=int, default=5, help="runs per op and provider; the median is kept (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--only", nargs="*", help="ops whose name contains one of these")
    p.add_argument("--cuda-timer", choices=["profiler", "clock"], default="profiler",
                   help="CUDA host time: torch.profiler's CPU time of the run (default; the profiler adds its "
                        "own cost to every op it records), or the host clock with the queue drained per run")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if not torch.cuda.is_available():
        if args.device == "cuda":
            p.error("--device cuda: no CUDA device")
        devices = ["cpu"]
    done = []

    def write(rows_so_far):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(done + rows_so_far, f, indent=1)
                f.write("\n")

    for d in devices:
        done += measure(d, args.calls, args.repeats, args.only, args.cuda_timer, on_row=write)
    sys.stdout.write(markdown(done, args.threads))
    return done


if __name__ == "__main__":
    main()
