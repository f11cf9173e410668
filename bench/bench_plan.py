"""The round's slice plan of a SubnetMLP in O(rows + cols) (issue 37 item 3), one command:

    python bench/bench_plan.py [--widths 1024,2048,4096,8192,16384] [--flat-max 4096] [--route-max 4096]
                               [--threads N] [--only plan,call,round,ist,exchange,overlap] [--exchange-max 8192]

prints six tables (depth 2, S = 4 balanced neuron partitions, fp32, best of ``--repeats``):

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
4. the ``ist`` method's plan of one round on the mlp (what ``Masked.round_plan`` builds: the trained
   plan and the stored one with every unowned element given a holder, ``with_holders``), as products
   with holder blocks against the flat form (``slice_plan`` + ``with_holders`` element by element,
   the form before, up to ``--flat-max``); the routing setup of the decentralized Exchange
   between two rounds' stored plans (both plans' owner masks and rank 0's routing,
   ``Exchange._prepare`` + ``_layout``): a product routed on its blocks at every width, the plan
   stated flat (element by element) up to ``--route-max``; and ``plan_bytes`` between the two
   rounds (what a simulated round counts), a product's from its blocks.
5. the distributed round's exchange between those two rounds (S gloo ranks on this machine, up to
   ``--exchange-max``): the Exchange built and its routing set up (``Exchange(...).prepare()``)
   against its call (the all-to-all of every rank's compact tensors and the owner means), alone and
   in the round: tau local steps of each rank's subnetwork then the exchange, built in the round or
   built before; the round with its routing built costs at most 1.2x the one that reuses it (target).
6. ``overlaps`` (whether two segments of a product target share an element: the owner mean's slow
   path, asked by the SubnetMLP plan and the Exchange for every target block) on a width x width
   target: a x a pieces that tile it (rows and cols each split a ways at random: what a round's
   write-back of a freshly drawn partition brings, every pair meeting in rows or cols but no element
   shared) and a x a random segments that do share elements; against the pair-by-pair check
   ``overlaps`` made before (one ``bincount`` per dim and pair, stopping at the first shared pair).
"""
import argparse
import time

import torch

from ist_kernels import functional as IF
from ist_kernels.distributed import plan_bytes
from ist_kernels.nn import SubnetMLP
from ist_kernels.ops.slices.product import overlaps
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


def _next_neurons(width):
    """The next round's partition: drawn anew, as the ist method draws every round's (each block
    of this round meets every block of the next)."""
    parts = [categorical_partition(width, S, round_generator(seed=0, round=DEPTH + l), balanced=True)
             for l in range(DEPTH)]
    return [[parts[l][s] for l in range(DEPTH)] for s in range(S)]


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


def _stored_plans(model, neurons, products):
    """A round's trained and stored plans as ``Masked.round_plan`` builds them."""
    trained = model.product_plan(neurons) if products else model.slice_plan(neurons)
    spec = model.product_spec() if products else model.slice_spec()
    sizes = {t.name: spec[t.name][0] if t.product else spec[t.name][0][t.dim] for t in trained.partitioned}
    return trained, trained.with_holders(sizes), spec


def _routing_setup(cur, nxt, spec):
    """The decentralized Exchange's setup on rank 0 (no process group): both plans' owner masks of
    the tensors sliced along one dim, rank 0's routing of them, and its products' pieces (what
    ``Exchange._layout`` builds; a plan stated flat has no products)."""
    from ist_kernels.distributed.exchange import _plan_masks, _product_entries, route_products
    from ist_kernels.distributed.routing import route

    entries, cm = _plan_masks(cur, spec, S, False, "current")
    nm = _plan_masks(nxt, spec, S, False, "next")[1]
    routing = route(entries, 0, cm, nm, source_held=cm[0], target_held=nm[0])
    nxt_of = {e.name: t for e, t in _product_entries(nxt, spec, "next")}
    route_products(routing, entries, [(e, t, nxt_of[e.name]) for e, t in _product_entries(cur, spec, "current")],
                   0, S, True, False)
    return routing


def ist_table(widths, flat_max, route_max, repeats):
    print(f"\nist on the mlp: one round's plan (Masked.round_plan: trained + stored with holders) and the "
          f"Exchange's routing setup, depth {DEPTH}, S={S}, best of {repeats}")
    print(f"{'width':>6} {'product plan ms':>16} {'flat plan ms':>13} {'flat/product':>13} {'holder blocks':>14} "
          f"{'routing (product) ms':>21} {'routing (flat) ms':>18} {'plan_bytes (product) ms':>24} "
          f"{'plan_bytes (flat) ms':>21}")
    for w in widths:
        model, neurons = _problem(w)
        nxt_neurons = _next_neurons(w)
        p = _best(lambda: _stored_plans(model, neurons, True), repeats)
        held = _stored_plans(model, neurons, True)[1]
        blocks = max(len(b) for t in held.tensors if t.holds for b in t.holds)
        flat = ratio = r_prod = r_flat = b_flat = "-"
        cur, nxt = _stored_plans(model, neurons, True)[1:], _stored_plans(model, nxt_neurons, True)[1]
        b_prod = f"{_best(lambda: plan_bytes(cur[0], nxt, cur[1]), repeats) * 1e3:.1f}"
        if w <= flat_max:
            f = _best(lambda: _stored_plans(model, neurons, False), max(1, repeats // 2))
            flat, ratio = f"{f * 1e3:.1f}", f"{f / p:.0f}x"
            fcur, fnxt = _stored_plans(model, neurons, False)[1:], _stored_plans(model, nxt_neurons, False)[1]
            b_flat = f"{_best(lambda: plan_bytes(fcur[0], fnxt, fcur[1]), max(1, repeats // 2)) * 1e3:.1f}"
        for products in (True, False) if w <= route_max else (True,):
            cur, nxt = _stored_plans(model, neurons, products)[1:], _stored_plans(model, nxt_neurons, products)[1]
            t = _best(lambda: _routing_setup(cur[0], nxt, cur[1]), max(1, repeats // 2))
            if products:
                r_prod = f"{t * 1e3:.1f}"
            else:
                r_flat = f"{t * 1e3:.0f}"
        print(f"{w:6d} {p * 1e3:16.2f} {flat:>13} {ratio:>13} {blocks:14d} {r_prod:>21} {r_flat:>18} {b_prod:>24} "
              f"{b_flat:>21}")


def _exchange_worker(rank, widths, repeats, batch, tau, store, out):
    import torch.distributed as dist

    from ist_kernels.distributed import Exchange, destroy_process_group, init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S, timeout=600)
    rows = []
    for w in widths:
        model, neurons = _problem(w)
        (cur, spec), nxt = _stored_plans(model, neurons, True)[1:], _stored_plans(
            model, _next_neurons(w), True)[1]
        local = cur.part({n: p.detach() for n, p in model.named_parameters()}, rank)
        mine = model.compact([neurons[rank]]).modules[0]  # this rank's subnetwork, for its local steps
        g = torch.Generator().manual_seed(1 + rank)
        x, y = torch.randn(batch, IN, generator=g), torch.randn(batch, OUT, generator=g)
        once = Exchange(cur, nxt, spec).prepare()
        best = dict.fromkeys(("build", "call", "round built", "round once"), float("inf"))
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            ex = Exchange(cur, nxt, spec).prepare()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            ex(local)
            t3 = time.perf_counter()
            dist.barrier()  # the round: tau local steps, then the exchange built or the one built before
            t4 = time.perf_counter()
            _steps(mine, x, y, tau)
            Exchange(cur, nxt, spec).prepare()(local)
            t5 = time.perf_counter()
            dist.barrier()
            t6 = time.perf_counter()
            _steps(mine, x, y, tau)
            once(local)
            t7 = time.perf_counter()
            if i:  # the first repeat warms the buffers
                for k, v in (("build", t1 - t0), ("call", t3 - t2), ("round built", t5 - t4), ("round once", t7 - t6)):
                    best[k] = min(best[k], v)
        rows.append((w, best, ex.last_stats.bytes_sent))
    if rank == 0:
        torch.save(rows, out)
    destroy_process_group()


def exchange_table(widths, repeats, batch, tau):
    """The distributed round's exchange of the ist method's stored plans (products with holder
    blocks), S gloo ranks on this machine: the Exchange built (routing set up) against called, alone
    and in a round of tau local steps (each rank its subnetwork's)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_exchange_worker, args=(widths, repeats, batch, tau, f"{d}/store", f"{d}/rows.pt"), nprocs=S,
                 join=True)
        rows = torch.load(f"{d}/rows.pt")
    print(f"\nthe decentralized Exchange between two ist rounds on the mlp (stored plans with holder blocks), "
          f"S={S} gloo ranks, depth {DEPTH}, rank 0, best of {repeats}; the round: tau={tau} local steps "
          f"(batch {batch}) and the exchange, built or built before")
    print(f"{'width':>6} {'build + prepare ms':>19} {'exchange call ms':>17} {'built / once':>13} "
          f"{'round built ms':>15} {'round once ms':>14} {'round ratio':>12} {'target':>7} {'MB sent':>8}")
    for w, b, sent in rows:
        r = (b["build"] + b["call"]) / b["call"]
        rr = b["round built"] / b["round once"]
        print(f"{w:6d} {b['build'] * 1e3:19.1f} {b['call'] * 1e3:17.1f} {r:12.2f}x {b['round built'] * 1e3:15.1f} "
              f"{b['round once'] * 1e3:14.1f} {rr:11.2f}x {'PASS' if rr <= 1.2 else 'MISS':>7} {sent / 1e6:8.1f}")


def _pairwise_overlaps(index, sizes):
    """The check ``overlaps`` made before (the baseline): the quick disjoint exit, then pair by pair,
    one ``bincount`` per dim, stopping at the first pair that shares rows and cols."""
    def meet(lists, n):
        return int(torch.bincount(torch.cat(lists), minlength=n).max()) > 1

    if len(index) < 2 or not meet([p[0] for p in index], sizes[0]) or not meet([p[1] for p in index], sizes[1]):
        return False
    return any(meet([index[j][0], index[i][0]], sizes[0]) and meet([index[j][1], index[i][1]], sizes[1])
               for j in range(len(index)) for i in range(j))


def overlap_table(widths, repeats):
    print("\n6. overlaps on a width x width target: a x a pieces tiling it (no element shared) and a x a random "
          "segments (sharing), ms")
    print(f"{'width':>6} {'a':>3} {'tiled: pairwise':>16} {'now':>8} {'ratio':>7} {'random: pairwise':>17} {'now':>8} "
          f"{'ratio':>7}")
    g = torch.Generator().manual_seed(0)
    for w in widths:
        for a in (S, 2 * S):
            rp, cp = torch.randperm(w, generator=g), torch.randperm(w, generator=g)
            tiled = [(rp[i::a].sort().values, cp[j::a].sort().values) for i in range(a) for j in range(a)]
            rand = [(torch.nonzero(torch.rand(w, generator=g) < 0.5).flatten(),
                     torch.nonzero(torch.rand(w, generator=g) < 0.5).flatten()) for _ in range(a * a)]
            row = []
            for ix, want in ((tiled, False), (rand, True)):
                assert overlaps(ix, (w, w)) is want and _pairwise_overlaps(ix, (w, w)) is want
                old = _best(lambda: _pairwise_overlaps(ix, (w, w)), repeats)
                new = _best(lambda: overlaps(ix, (w, w)), repeats)
                row += [old * 1e3, new * 1e3, old / new]
            print(f"{w:6d} {a:3d} {row[0]:16.3f} {row[1]:8.3f} {row[2]:6.2f}x {row[3]:17.3f} {row[4]:8.3f} {row[5]:6.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--widths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--flat-max", type=int, default=4096, help="largest width the flat plan is built at")
    ap.add_argument("--route-max", type=int, default=4096, help="largest width the Exchange's routing of the flat plan is set up at")
    ap.add_argument("--exchange-max", type=int, default=8192, help="largest width the distributed exchange runs at")
    ap.add_argument("--only", default="plan,call,round,ist,exchange,overlap", help="the tables to print")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tau", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    widths = [int(w) for w in a.widths.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    only = set(a.only.split(","))
    if "plan" in only:
        plan_table(widths, a.flat_max, a.repeats)
    if "call" in only:
        call_table(widths, a.flat_max, a.repeats)
    if "round" in only:
        round_table(widths, a.repeats, a.batch, a.tau)
    if "ist" in only:
        ist_table(widths, a.flat_max, a.route_max, a.repeats)
    if "exchange" in only:
        exchange_table([w for w in widths if w <= a.exchange_max], max(1, a.repeats // 2), a.batch, a.tau)
    if "overlap" in only:
        overlap_table(widths, a.repeats)


if __name__ == "__main__":
    main()
