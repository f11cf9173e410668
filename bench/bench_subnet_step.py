"""One training step (forward, backward, AdamW step) of a full transformer against an IST subnetwork
of it, on the host, where per-op overhead and not the math sets the time (issue 38 item 3).

    python bench/bench_subnet_step.py                          # gpt_small width 128 depth 2, 1 and 2 threads
    python bench/bench_subnet_step.py --threads 1 --profile    # and torch.profiler's top ops per model

The subnetwork is built as the trainer builds it from round 2 on (``Engine`` / ``ist-train
--simulate``): from a plan made after the full model got its 1/S scale hooks (so the clone copies
the hook dicts) and with the global AdamW, whose state rides in the same gather as the
parameters. Variants, to narrow a difference down:

- ``full``: the full model and its own AdamW (what a local-SGD worker steps);
- ``sub``: the subnetwork as built (``plan.build(optimizer)[0]``);
- ``sub/own``: the same with every parameter and AdamW state tensor copied into its own storage;
- ``sub/nohook``: the same with the hooks copied from the full model removed from its modules;
- ``same shape`` (``--partition ffn`` with S dividing 4): a ``GPT`` constructed at the subnetwork's
  shape (FFN of ``4 * width / S`` units) holding the subnetwork's values, with its own AdamW: what
  the subnetwork's step costs when nothing of the plan is involved.

Every model steps ``--steps`` times per repeat on one fixed batch, the models taking turns within
each repeat (so machine load hits them alike); the median over repeats of ms per step is printed,
with its ratio to ``full`` and the parameter ratio.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the tree this file is in, not an installed copy

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

from ist_kernels.models.gpt import GPT, gpt_shape, gpt_small  # noqa: E402
from ist_kernels.partition import transformer_ist_plan  # noqa: E402


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return TF.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_step(model, opt, tokens):
    opt.zero_grad(set_to_none=True)
    loss_of(model, tokens).backward()
    opt.step()


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def build(args, tokens):
    """name -> (model, optimizer)."""
    torch.manual_seed(0)
    full = gpt_small(context=args.context, width=args.width, depth=args.depth)
    glob = gpt_small(context=args.context, width=args.width, depth=args.depth)
    glob.load_state_dict(full.state_dict())
    gopt = torch.optim.AdamW(glob.parameters(), lr=1e-3)
    # round 1 as the trainer runs it: a plan, the full model's scales, some steps (AdamW state)
    transformer_ist_plan(glob, args.S, args.partition, torch.Generator().manual_seed(0)).scale_outputs()
    for _ in range(3):
        train_step(glob, gopt, tokens)
    models = {"full": (full, torch.optim.AdamW(full.parameters(), lr=1e-3))}
    train_step(*models["full"], tokens)
    # round 2's plan: made from the model with hooks, built with the global optimizer's state
    for variant in ("sub", "sub/own", "sub/nohook"):
        plan = transformer_ist_plan(glob, args.S, args.partition, torch.Generator().manual_seed(1))
        sub = plan.build(gopt)[0]
        m, opt = sub.module, sub.optimizer
        if variant == "sub/own":
            with torch.no_grad():
                for p in m.parameters():
                    p.data = p.data.clone()
                    st = opt.state[p]
                    for k, v in st.items():
                        if torch.is_tensor(v) and v.dim():
                            st[k] = v.clone()
        elif variant == "sub/nohook":
            for mod in m.modules():
                mod._forward_hooks.clear()
                mod._forward_pre_hooks.clear()
        models[variant] = (m, opt)
    if args.partition == "ffn" and 4 % args.S == 0:
        width, depth, heads = gpt_shape("gpt_small", args.width, args.depth)
        same = GPT(256, args.context, width, depth, heads, ffn_mult=4 // args.S)
        same.load_state_dict(models["sub"][0].state_dict())
        models["same shape"] = (same, torch.optim.AdamW(same.parameters(), lr=1e-3))
        train_step(*models["same shape"], tokens)
    return models


def storages(model) -> int:
    return len({p.untyped_storage().data_ptr() for p in model.parameters()})


def run(args, threads: int) -> None:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
    models = build(args, tokens)
    names = list(models)
    for name in names:  # warm up
        for _ in range(3):
            train_step(*models[name], tokens)
    times = {n: [] for n in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            model, opt = models[n]
            t = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, opt, tokens)
            times[n].append((time.perf_counter() - t) / args.steps * 1e3)
    nfull = sum(p.numel() for p in models["full"][0].parameters())
    base = statistics.median(times["full"])
    print(f"\nthreads {threads}: gpt_small width {args.width} depth {args.depth}, context {args.context}, "
          f"batch {args.batch}, IST {args.partition} S={args.S}; median of {args.repeats} x {args.steps} steps")
    print(f"{'model':12s} {'ms/step':>8s} {'min':>7s} {'x full':>7s} {'params':>8s} {'x full':>7s} "
          f"{'storages':>8s} {'hooks':>5s}")
    for n in names:
        m = models[n][0]
        np_ = sum(p.numel() for p in m.parameters())
        med = statistics.median(times[n])
        print(f"{n:12s} {med:8.2f} {min(times[n]):7.2f} {med / base:7.2f} {np_:8d} {np_ / nfull:7.2f} "
              f"{storages(m):8d} {hook_count(m):5d}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for n in names:
            model, opt = models[n]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    train_step(model, opt, tokens)
            print(f"\n{n}: torch.profiler, {args.steps} steps")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--S", type=int, default=4)
    p.add_argument("--partition", default="ffn", choices=["ffn", "heads"])
    p.add_argument("--steps", type=int, default=5, help="steps per model per repeat")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops of each model")
    args = p.parse_args(argv)
    for t in args.threads:
        run(args, t)


if __name__ == "__main__":
    main()
