"""The round's slice plan of a SubnetMLP in O(rows + cols) (issue 37 item 3), one command:

    python bench/bench_plan.py [--widths 1024,2048,4096,8192,16384] [--flat-max 4096] [--threads N]

prints two tables (depth 2, S = 4 balanced neuron partitions, fp32, best of ``--repeats``):

1. plan build per width: the planned gather/scatter of a round of all S subnetworks
   (``SubnetMLP._planned``: every tensor's index lists, validated, the compact buffers allocated)
   with the hidden-to-hidden weight planned as the product of its rows and columns, and the
   ``SlicePlan`` of the round (``product_plan``); against the same round's plan stated on the flat
   view, one slice per element (the form before: ``slice_plan`` flat indices + ``functional.slice_plan``
   on the flattened weight), up to ``--flat-max`` (it costs O(width^2) and GBs at 16k). The product
   plan's time per (rows + cols) should stay flat across widths; the flat one's grows with width^2.
2. per call, with the plans built beforehand: the round's gather and owner-mean write-back of all
   S subnetworks, products against the flat kernels (up to ``--flat-max``);
3. one round of tau local SGD steps of one subnetwork (as bench_subnet's round and issue 37's
   measurement): ``SubnetMLP.compact([neurons])`` (plan built, gather, tau steps, write-back)
   against the same round with its plan built once (``refresh``, tau steps, ``write_back``),
   interleaved; the target is at most 1.2x. ``compact()`` alone (plan, gather into new buffers,
   the modules) and ``refresh()`` alone (the gather into the same buffers) show the plan's share
   without the steps, which dominate the noise on a shared machine.
"""
import argparse
import time

import torch

from ist_kernels import functional as IF
from ist_kernels.nn import SubnetMLP
from ist_kernels.partition import categorical_partition, round_generator

S, DEPTH, IN, OUT = 4, 2, 256, 10


def _best(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _problem(width, device="cpu"):
    g = torch.Generator().manual_seed(0)
    model = SubnetMLP(IN, width, DEPTH, OUT, bias=True, train_output=True, generator=g).to(device)
    parts = [categorical_partition(width, S, round_generator(seed=0, round=l), balanced=True) for l in range(DEPTH)]
    neurons = [[parts[l][s] for l in range(DEPTH)] for s in range(S)]
    return model, neurons


def _flat_plan(model, neurons):
    """The round's gather/scatter plan on the flat view (one slice per element): the form before."""
    sp = model.slice_plan(neurons)
    full = dict(model.named_parameters())
    targets = [full[t.name].detach().view(-1) if model._flat(t.name) else full[t.name].detach()
               for t in sp.partitioned]
    ids = [k for _ in range(S) for k in range(len(targets))]
    indices = [t.owners[s] for s in range(S) for t in sp.partitioned]
    return IF.slice_plan(targets, ids, indices, [t.dim for t in sp.partitioned])


def plan_table(widths, flat_max, repeats):
    print(f"plan build, depth {DEPTH}, S={S} (all subnetworks), best of {repeats}")
    print(f"{'width':>6} {'rows+cols':>10} {'product plan ms':>16} {'ns/(rows+cols)':>15} {'SlicePlan ms':>13} "
          f"{'flat plan ms':>13} {'flat/product':>13}")
    for w in widths:
        model, neurons = _problem(w)
        prod_s = _best(lambda: model._planned(neurons), repeats)
        sp_s = _best(lambda: model.product_plan(neurons), repeats)
        rc = 2 * w * (DEPTH - 1)  # the hidden-to-hidden weight's rows + cols over all subnetworks
        flat = "-"
        ratio = "-"
        if w <= flat_max:
            f = _best(lambda: _flat_plan(model, neurons), max(1, repeats // 2))
            flat, ratio = f"{f * 1e3:13.1f}", f"{f / prod_s:12.0f}x"
        print(f"{w:6d} {rc:10d} {prod_s * 1e3:16.2f} {prod_s / rc * 1e9:15.0f} {sp_s * 1e3:13.2f} {flat:>13} "
              f"{ratio:>13}")


def call_table(widths, flat_max, repeats):
    """Per call, plans built beforehand: the round's gather and owner-mean write-back of all S
    subnetworks, products against the flat kernels (what a round with its plan built once pays)."""
    print(f"\nper call, plans built once: gather and write-back (mean) of all S={S} subnetworks, best of {repeats}")
    print(f"{'width':>6} {'product gather':>15} {'flat gather':>12} {'product scatter':>16} {'flat scatter':>13}")
    for w in [w for w in widths if w <= flat_max]:
        model, neurons = _problem(w)
        targets, plan, _ = model._planned(neurons)
        plan.gather(targets)
        full = dict(model.named_parameters())
        sp = model.slice_plan(neurons)
        flat_t = [full[t.name].detach().view(-1) if model._flat(t.name) else full[t.name].detach()
                  for t in sp.partitioned]
        fplan = _flat_plan(model, neurons)
        fplan.gather(flat_t)
        times = [_best(f, repeats) * 1e3 for f in (lambda: plan.gather(targets), lambda: fplan.gather(flat_t),
                                                    lambda: plan.scatter_(targets, reduce="mean"),
                                                    lambda: fplan.scatter_(flat_t, reduce="mean"))]
        print(f"{w:6d} {times[0]:15.1f} {times[1]:12.1f} {times[2]:16.1f} {times[3]:13.1f}")


def _steps(module, x, y, tau, lr=1e-3):
    params = list(module.parameters())
    for _ in range(tau):
        loss = (module(x) - y).square().sum()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)


def round_table(widths, repeats, batch, tau):
    print(f"\none round of tau={tau} local steps of one subnetwork (1/{S} of the width, depth {DEPTH}, batch {batch}, "
          f"in {IN}), interleaved, best of {repeats}")
    print(f"{'width':>6} {'plan built ms':>14} {'plan once ms':>13} {'ratio':>7} {'target':>7} {'compact() ms':>13} "
          f"{'refresh() ms':>13}")
    for w in widths:
        model, neurons = _problem(w)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)

        def built():
            with model.compact([neurons[0]]) as rnd:
                _steps(rnd.modules[0], x, y, tau)

        once = model.compact([neurons[0]])

        def reused():
            once.refresh()
            _steps(once.modules[0], x, y, tau)
            once.write_back()

        best = {built: float("inf"), reused: float("inf"), "compact": float("inf"), "refresh": float("inf")}
        built(), reused()
        alone = {"compact": lambda: model.compact([neurons[0]]), "refresh": once.refresh}
        for _ in range(repeats):
            for f in best:
                t0 = time.perf_counter()
                alone[f]() if isinstance(f, str) else f()
                best[f] = min(best[f], time.perf_counter() - t0)
        r = best[built] / best[reused]
        print(f"{w:6d} {best[built] * 1e3:14.1f} {best[reused] * 1e3:13.1f} {r:6.2f}x {'PASS' if r <= 1.2 else 'MISS':>7} "
              f"{best['compact'] * 1e3:13.2f} {best['refresh'] * 1e3:13.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--flat-max", type=int, default=4096, help="largest width the flat plan is built at")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tau", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    widths = [int(w) for w in a.widths.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    plan_table(widths, a.flat_max, a.repeats)
    call_table(widths, a.flat_max, a.repeats)
    round_table(widths, a.repeats, a.batch, a.tau)


if __name__ == "__main__":
    main()
