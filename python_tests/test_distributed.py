"""ist_kernels.distributed: the exchange over gloo equals the simulated single-process path.

Every spawned rank builds the same plans and the same "training" (seeded noise per round and
subnetwork), runs the simulated path (slice_scatter_ over subnetworks 0..S-1 with reduce="mean",
then slice_gather of the next subnetwork) and checks its own exchange result against it bit for
bit (fp32). The simulated path itself is checked against a float64 loop over owners.
One spawn per world size (2, 3, 4) runs every case; failures spawn their own small groups.
"""
import math
import os
import time
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ist_kernels  # noqa: F401
from ist_kernels.distributed import (
    CollectiveError,
    Exchange,
    average_model_,
    destroy_process_group,
    gather_bytes,
    gather_full_model,
    init_process_group,
    plan_bytes,
    ps_bytes,
)
from ist_kernels.distributed.group import all_to_all_single
from ist_kernels.partition import SlicePlan, TensorSlices, aggregate_slices_

from conftest import free_port, rank_error, spawn_ranks_until, write_rank_error

EPS = torch.finfo(torch.float32).eps


# ---------------------------------------------------------------- model specs and plans (by hand)
def mlp_spec():
    # one hidden layer of 11 neurons (paper 001): rows of fc1, columns of fc2; fc2.bias shared
    return {"fc1.weight": (11, 5), "fc1.bias": (11,), "fc2.weight": (3, 11), "fc2.bias": (3,)}


def loft_spec():
    # a stem, two partitioned blocks (conv1 by output filters with its BN, conv2 by input channels), fc
    s = {"conv0.weight": (6, 3, 3, 3)}
    for b, c in (("b1", 8), ("b2", 7)):
        s.update({f"{b}.conv1.weight": (c, 6, 3, 3), f"{b}.bn1.weight": (c,), f"{b}.bn1.bias": (c,),
                  f"{b}.bn1.running_mean": (c,), f"{b}.conv2.weight": (6, c, 3, 3)})
    s.update({"fc.weight": (5, 6), "fc.bias": (5,), "b1.bn1.num_batches_tracked": ()})
    return s


def is_counter(name):  # BN's step counter: int64, shared, kept as it is (never averaged)
    return name.endswith("num_batches_tracked")


def initial(name, shape, g):
    return torch.tensor(3) if is_counter(name) else torch.randn(shape, generator=g)


def meta_of(spec):
    return {n: torch.empty(s, device="meta", dtype=torch.int64 if is_counter(n) else torch.float32)
            for n, s in spec.items()}


RESIST_BLOCKS = 6


def resist_spec():
    s = {"conv0.weight": (4, 3, 3, 3), "bn0.weight": (4,)}
    for i in range(RESIST_BLOCKS):
        s.update({f"layer3.{i}.conv1.weight": (4, 4, 3, 3), f"layer3.{i}.bn1.weight": (4,),
                  f"layer3.{i}.bn1.num_batches_tracked": (), f"layer3.{i}.conv2.weight": (4, 4, 3, 3)})
    s.update({"fc.weight": (5, 4), "fc.bias": (5,)})
    return s


def _gen(*key):
    # a stable seed (str hashes differ between processes)
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _split(perm, S):
    return [perm[s::S].sort().values for s in range(S)]


def make_plan(kind, S, seed, rnd):
    g = _gen(kind, S, seed, rnd)
    if kind in ("mlp_categorical", "mlp_bernoulli"):
        H = mlp_spec()["fc1.weight"][0]
        if kind == "mlp_categorical":
            own = _split(torch.randperm(H, generator=g), S)
        else:  # Bernoulli(xi = 0.5) per subnetwork and neuron: overlaps and unowned neurons
            own = [(torch.rand(H, generator=g) < 0.5).nonzero().flatten() for _ in range(S)]
        t = [TensorSlices("fc1.weight", 0, tuple(own)), TensorSlices("fc1.bias", 0, tuple(own)),
             TensorSlices("fc2.weight", 1, tuple(own)), TensorSlices("fc2.bias", None)]
        return SlicePlan(S, tuple(t))
    if kind == "loft":
        t = [TensorSlices("conv0.weight", None)]
        for b, c in (("b1", 8), ("b2", 7)):
            own = tuple(_split(torch.randperm(c, generator=g), S))
            t += [TensorSlices(f"{b}.conv1.weight", 0, own), TensorSlices(f"{b}.bn1.weight", 0, own),
                  TensorSlices(f"{b}.bn1.bias", 0, own), TensorSlices(f"{b}.bn1.running_mean", 0, own),
                  TensorSlices(f"{b}.conv2.weight", 1, own)]
        t += [TensorSlices("fc.weight", None), TensorSlices("fc.bias", None),
              TensorSlices("b1.bn1.num_batches_tracked", None)]
        return SlicePlan(S, tuple(t))
    if kind == "resist":
        # blocks permuted and dealt round-robin; a subnetwork below min_depth borrows blocks (shared)
        perm = torch.randperm(RESIST_BLOCKS, generator=g).tolist()
        blocks = [set(perm[s::S]) for s in range(S)]
        for s in range(S):
            for b in perm:
                if len(blocks[s]) >= 2:
                    break
                blocks[s].add(b)
        t = [TensorSlices("conv0.weight", None), TensorSlices("bn0.weight", None)]
        empty = torch.zeros(0, dtype=torch.int64)
        for i in range(RESIST_BLOCKS):
            own = tuple(torch.arange(4) if i in blocks[s] else empty for s in range(S))
            scalar = tuple(torch.zeros(1, dtype=torch.int64) if i in blocks[s] else empty for s in range(S))
            t += [TensorSlices(f"layer3.{i}.conv1.weight", 0, own), TensorSlices(f"layer3.{i}.bn1.weight", 0, own),
                  TensorSlices(f"layer3.{i}.bn1.num_batches_tracked", 0, scalar),  # a 0-d int64 tensor
                  TensorSlices(f"layer3.{i}.conv2.weight", 0, own)]
        t += [TensorSlices("fc.weight", None), TensorSlices("fc.bias", None)]
        return SlicePlan(S, tuple(t))
    raise ValueError(kind)


SPECS = {"mlp_categorical": mlp_spec, "mlp_bernoulli": mlp_spec, "loft": loft_spec, "resist": resist_spec}


# ---------------------------------------------------------------- the simulated single-process path
def compact(full, plan, s):
    """Subnetwork s's tensors: index_select of the partitioned ones it owns, the shared ones whole."""
    out = {}
    for t in plan.tensors:
        if t.name not in full:
            continue
        if t.shared:
            out[t.name] = full[t.name].clone()
        elif t.owners[s].numel():
            v = full[t.name]
            out[t.name] = v.clone() if v.dim() == 0 else v.index_select(t.dim, t.owners[s])
    return out


def simulate(full, plan, subnets, names=None):
    """aggregate_slices_(full, every subnetwork's compact tensors in order 0..S-1): owner means,
    owners' maximum for integer counters (what SubnetworkPlan.aggregate does)."""
    new = {n: v.clone() for n, v in full.items()}
    names = set(names or full)
    targets, pos = [], {}
    for t in plan.tensors:
        if is_counter(t.name) and t.shared and t.name in names:
            new[t.name] = subnets[0][t.name].clone()  # shared counters are kept as they are
        elif t.name in names:
            pos[t.name] = len(targets)
            targets.append(new[t.name].view(1, -1) if t.shared else new[t.name].view(new[t.name].shape or (1,)))
    dims = [0] * len(targets)
    ids, updates, idx = [], [], []
    for s in range(plan.num_subnetworks):
        for t in plan.tensors:
            if t.name not in names or (is_counter(t.name) and t.shared):
                continue
            if t.shared:
                ids.append(pos[t.name])
                updates.append(subnets[s][t.name].reshape(1, -1))
                idx.append(torch.zeros(1, dtype=torch.int64))
            elif t.owners[s].numel():
                u = subnets[s][t.name]
                dims[pos[t.name]] = t.dim
                ids.append(pos[t.name])
                updates.append(u.view(u.shape or (1,)))
                idx.append(t.owners[s])
    aggregate_slices_(targets, ids, updates, idx, dims)
    return new


def reference64(full, plan, subnets):
    """Independent float64 loop: a slice owned by k >= 1 subnetworks is their mean, else unchanged."""
    out = {}
    for t in plan.tensors:
        g = full[t.name].double()
        if is_counter(t.name) and t.shared:
            out[t.name] = subnets[0][t.name].double()
            continue
        if g.dim() == 0:  # a partitioned counter: the largest of its owners' counts
            vals = [subnets[s][t.name].double() for s, o in enumerate(t.owners) if o.numel()]
            out[t.name] = max(vals) if vals else g
            continue
        if t.shared:
            out[t.name] = torch.stack([subnets[s][t.name].double() for s in range(plan.num_subnetworks)]).mean(0)
            continue
        acc, cnt = torch.zeros_like(g), torch.zeros(g.shape[t.dim], dtype=torch.float64)
        for s, o in enumerate(t.owners):
            for k, i in enumerate(o.tolist()):
                acc.select(t.dim, i).add_(subnets[s][t.name].double().select(t.dim, k))
                cnt[i] += 1
        shape = [1] * g.dim()
        shape[t.dim] = -1
        c = cnt.view(shape)
        out[t.name] = torch.where(c > 0, acc / c.clamp(min=1), g)
    return out


def train(subnet, key, scale=0.5):
    """Stand-in for local training: seeded noise, the same on every rank that replays it. Counters
    step: shared ones by 1 everywhere, a block's by 1 + s (so that owners differ)."""
    g = _gen(*key)
    s = key[3]
    return {n: (v + (1 if n in SHARED_COUNTERS else 1 + s)) if is_counter(n)
            else v + scale * torch.randn(v.shape, generator=g) for n, v in subnet.items()}


SHARED_COUNTERS = {"b1.bn1.num_batches_tracked"}


def expected_bytes(cur, nxt, spec, S, r, storage, shared):
    """Bytes rank r must send / receive through the all-to-all, from the plans by plain set algebra."""
    sent = recv = 0
    for t, tn in zip(cur.tensors, (nxt or cur).tensors):
        if is_counter(t.name) and t.shared:
            continue
        shape = spec[t.name]
        numel = 1
        for d in shape:
            numel *= d
        if t.shared:
            if shared == "exact":
                sent += (S - 1) * numel * 4
                recv += (S - 1) * numel * 4
            continue
        per_slice = numel // shape[t.dim] if shape else 1
        c = [set(o.tolist()) for o in t.owners]
        if storage == "replicated":
            sent += (S - 1) * len(c[r]) * per_slice * 4
            recv += sum(len(c[k]) for k in range(S) if k != r) * per_slice * 4
        else:
            n = [set(o.tolist()) for o in tn.owners]
            sent += sum(len(c[r] & n[q]) for q in range(S) if q != r) * per_slice * 4
            recv += sum(len(c[k] & n[r]) for k in range(S) if k != r) * per_slice * 4
    return sent, recv


def shared_bytes(plan, spec):
    total = 0
    for t in plan.shared:
        if is_counter(t.name):
            continue
        n = 1
        for d in spec[t.name]:
            n *= d
        total += 4 * n
    return total


def _assert_close_shared(got, want, S, what):
    tol = 2 * S * EPS * want.abs().max().item() + 1e-30
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: shared all_reduce mean off by {err} > {tol}"


# ---------------------------------------------------------------- one case, run on every rank
ROUNDS = 3


def run_case(kind, storage, shared, quantize, rank, S, log):
    spec = SPECS[kind]()
    g0 = _gen("init", kind, S)
    full = {n: initial(n, shape, g0) for n, shape in spec.items()}
    meta = meta_of(spec)
    plan = make_plan(kind, S, 7, 0)
    # this rank's state: decentralized -> its compact tensors; replicated -> the full model
    local = compact(full, plan, rank) if storage == "decentralized" else {n: v.clone() for n, v in full.items()}
    params = [n for n in spec if "running" not in n and not is_counter(n)]
    mom_full = {n: torch.zeros(spec[n]) for n in params}  # momentum, keyed like the parameters
    mom = {n: v for n, v in compact(mom_full, plan, rank).items() if n in params} if storage == "decentralized" \
        else {n: v.clone() for n, v in mom_full.items()}
    for rnd in range(ROUNDS):
        nxt = make_plan(kind, S, 7, rnd + 1)
        subnets = [train(compact(full, plan, s), (kind, S, rnd, s)) for s in range(S)]
        msubs = [train({n: v for n, v in compact(mom_full, plan, s).items()}, (kind, S, rnd, s, "m"), 0.1)
                 for s in range(S)]
        sim = simulate(full, plan, subnets)
        ref = reference64(full, plan, subnets)
        for n in spec:
            assert torch.allclose(sim[n].double(), ref[n], rtol=4 * EPS, atol=4 * EPS), f"simulated path {n}"
        msim = simulate(mom_full, plan, msubs, params)

        # this rank "trains": it holds its subnetwork's updated values
        mine = subnets[rank]
        if storage == "decentralized":
            local = {n: mine[n].clone() for n in local}  # shared tensors are averaged in place
            mom = {n: msubs[rank][n].clone() for n in mom}
        else:
            for state, new in ((local, mine), (mom, msubs[rank])):
                for t in plan.tensors:
                    if t.name not in state:
                        continue
                    if t.shared or state[t.name].dim() == 0:
                        if t.shared or t.owners[rank].numel():
                            state[t.name].copy_(new[t.name])
                    elif t.owners[rank].numel():
                        state[t.name].index_copy_(t.dim, t.owners[rank], new[t.name])

        if storage == "decentralized" and rnd == 1 and not quantize:
            # the aggregate before the exchange, on one rank, in one collective: owner means
            gst = []
            got = gather_full_model(local, plan, meta, dst=S - 1, reduce="mean", round=rnd, stats=gst)
            want_g = gather_bytes(plan, meta, dst=S - 1, reduce="mean")[rank]
            assert (gst[0].bytes_sent, gst[0].bytes_received) == (want_g.bytes_sent, want_g.bytes_received)
            if rank == S - 1:
                for n in spec:
                    assert torch.equal(got[n], sim[n]), f"gather(mean) {n}"
            else:
                assert got is None

        ex = Exchange(plan, nxt, meta, storage=storage, shared=shared, quantize=quantize, round=rnd)
        out = ex(local)
        st = ex.last_stats
        mout = ex(mom, names=params)

        want = compact(sim, nxt, rank) if storage == "decentralized" else sim
        mwant = {n: v for n, v in (compact(msim, nxt, rank) if storage == "decentralized" else msim).items()
                 if n in params}
        assert sorted(out) == sorted(want), (sorted(out), sorted(want))
        assert sorted(mout) == sorted(mwant)
        shared_names = {t.name for t in plan.shared}
        for got_d, want_d, what in ((out, want, "params"), (mout, mwant, "momentum")):
            for n in want_d:
                a, b = got_d[n], want_d[n]
                assert a.shape == b.shape, (what, n, a.shape, b.shape)
                if is_counter(n):
                    assert torch.equal(a, b), n
                    continue
                if quantize:
                    # |error| <= max over owners of absmax / 254 (one scale per slice), per tensor
                    src = subnets if what == "params" else msubs
                    if n in shared_names and shared == "all_reduce":
                        _assert_close_shared(a, b, S, f"{kind} {n}")
                        continue
                    amax = max(src[s][n].abs().max().item() for s in range(S) if n in src[s] and src[s][n].numel())
                    bound = amax / 127 * (0.5 + 2e-3) + 4 * EPS * b.abs().max().item()
                    err = (a - b).abs().max().item() if a.numel() else 0.0
                    assert err <= bound, f"{kind} int8 {what} round {rnd} {n}: {err} > {bound} (amax {amax})"
                    log.setdefault("qerr", []).append(err / (amax / 127))
                elif n in shared_names and shared == "all_reduce":
                    _assert_close_shared(a, b, S, f"{kind} {n}")
                else:
                    assert torch.equal(a, b), f"{kind} {storage} {what} round {rnd}: {n} differs by " \
                        f"{(a - b).abs().max().item()} on rank {rank}"

        # bytes counted from the collectives' buffers == bytes the plan implies
        es, er = expected_bytes(plan, nxt, spec, S, rank, storage, shared)
        if not quantize:
            assert (st.all_to_all_bytes_sent, st.all_to_all_bytes_received) == (es, er), (st, es, er)
        else:  # int8 codes + one fp32 scale per segment, padded to 4 bytes per peer
            assert st.all_to_all_bytes_sent <= es // 4 + 4 * (S - 1) * (1 + len(plan.tensors))
        want_ar = shared_bytes(plan, spec) if shared == "all_reduce" else 0
        assert st.all_reduce_bytes == want_ar
        assert st.collectives == (2 if shared == "all_reduce" and plan.shared else 1)
        pb = plan_bytes(plan, nxt, meta, storage=storage, shared=shared)[rank]
        assert (pb.all_reduce_bytes, pb.collectives) == (want_ar, st.collectives)
        if not quantize:
            assert (pb.all_to_all_bytes_sent, pb.all_to_all_bytes_received) == (es, er)
            assert (st.bytes_sent, st.bytes_received) == (pb.bytes_sent, pb.bytes_received)
        log.setdefault("bytes", []).append((kind, storage, shared, quantize, rnd, st.bytes_sent, es))
        if quantize and storage == "replicated":
            log.setdefault("replicas", []).append({n: v.clone() for n, v in out.items()})

        if storage == "decentralized" and not quantize and shared == "exact":
            # after the exchange every copy of a slice is equal: gather by copying from one owner
            gst = []
            got = gather_full_model(out, nxt, meta, dst=0, reduce="copy", round=rnd, stats=gst)
            # rank k > 0 sends the slices it is the lowest owner of (the shared tensors come from rank 0)
            first = {t.name: set(t.owners[rank].tolist()) - set().union(*(set(o.tolist()) for o in t.owners[:rank]))
                     for t in nxt.partitioned}
            sends = 0 if rank == 0 else sum(
                4 * len(first[t.name]) * (math.prod(spec[t.name]) // spec[t.name][t.dim] if spec[t.name] else 1)
                for t in nxt.partitioned)
            assert gst[0].bytes_sent == sends == gather_bytes(nxt, meta)[rank].bytes_sent
            if rank == 0:
                for n in spec:
                    assert torch.equal(got[n], sim[n]), f"gather(copy) {n}"

        # next round starts from the aggregate; re-sync the shared tensors to the simulated path
        # when the all_reduce made them ulp-close rather than equal
        full, mom_full, plan = sim, msim, nxt
        if storage == "decentralized":
            local = {n: (sim[n].clone() if n in shared_names else v) for n, v in out.items()}
            mom = {n: (msim[n].clone() if n in shared_names else v) for n, v in mout.items()}
        else:
            local = {n: v.clone() for n, v in sim.items()}
            mom = {n: v.clone() for n, v in msim.items()}


CASES = [
    # kind, storage, shared, quantize
    ("mlp_categorical", "decentralized", "exact", None),
    ("mlp_categorical", "replicated", "all_reduce", None),
    ("mlp_bernoulli", "replicated", "exact", None),
    ("mlp_bernoulli", "replicated", "all_reduce", "int8"),
    ("loft", "decentralized", "all_reduce", None),
    ("loft", "decentralized", "exact", None),
    ("loft", "replicated", "exact", None),
    ("loft", "decentralized", "exact", "int8"),
    ("resist", "decentralized", "exact", None),
    ("resist", "decentralized", "all_reduce", None),
    ("resist", "replicated", "exact", None),
    ("resist", "decentralized", "all_reduce", "int8"),
]


def check_all_to_all(rank, S):
    """group.all_to_all_single (gloo: point-to-point, every receive posted before any send) equals
    torch's all_to_all_single: uneven splits with zeros, this rank's own chunk, several dtypes, a
    subgroup of the ranks."""
    g = torch.Generator().manual_seed(1234)  # the same splits on every rank
    split = torch.randint(0, 5, (S, S), generator=g)
    split[0, S - 1] = 0  # rank 0 sends nothing to the last rank
    split[1, 1] = 3  # something to itself
    for dtype in (torch.float32, torch.int64, torch.uint8, torch.bool):
        inp = (torch.arange(int(split[rank].sum())) + 100 * rank).to(dtype)
        in_splits, out_splits = split[rank].tolist(), split[:, rank].tolist()
        want = torch.empty(sum(out_splits), dtype=dtype)
        if dtype != torch.bool:  # gloo's own all-to-all moves no bool
            dist.all_to_all_single(want, inp, out_splits, in_splits)
        else:
            want = torch.cat([((torch.arange(int(split[k].sum())) + 100 * k).to(dtype))
                              [int(split[k, :rank].sum()):int(split[k, :rank + 1].sum())] for k in range(S)])
        calls = []
        irecv, isend = dist.irecv, dist.isend
        dist.irecv = lambda *a, **k: calls.append("recv") or irecv(*a, **k)
        dist.isend = lambda *a, **k: calls.append("send") or isend(*a, **k)
        try:
            out = torch.full((sum(out_splits),), 7).to(dtype)
            assert all_to_all_single(out, inp, out_splits, in_splits).wait(timeout=timedelta(seconds=30))
        finally:
            dist.irecv, dist.isend = irecv, isend
        assert torch.equal(out, want), (dtype, out, want)
        assert calls == sorted(calls), calls  # every "recv" before any "send"
        assert calls.count("send") == sum(1 for q in range(S) if q != rank and in_splits[q])
    with pytest.raises(ValueError, match="splits add up to"):
        all_to_all_single(torch.empty(1), torch.empty(0), [2] + [0] * (S - 1), [0] * S)
    if S >= 3:  # a group of the ranks 1..S-1: peers are named by their global ranks
        sub = dist.new_group(list(range(1, S)))
        if rank >= 1:
            n = S - 1
            inp = torch.arange(n * 2, dtype=torch.float32) + 10 * rank
            out = torch.empty(n * 2)
            assert all_to_all_single(out, inp, [2] * n, [2] * n, group=sub).wait(timeout=timedelta(seconds=30))
            me = rank - 1
            want = torch.cat([torch.arange(2 * me, 2 * me + 2, dtype=torch.float32) + 10 * (k + 1) for k in range(n)])
            assert torch.equal(out, want)
        dist.barrier()


def check_block_coded_moments(rank, S):
    """An optimizer moment exchanged block-coded (momentum_state=int8 / int8-v4): each partitioned
    slice arrives as fake_quantize_ of its owner's values (blocks of 256 within a slice, odd sizes,
    a 4-bit code's odd count packed), the shared tensor as the exact mean, and the bytes on the wire
    are the ledger's coded count; a code beside compress, or not a BlockCode, is refused."""
    from ist_kernels.distributed import ledger
    from ist_kernels.distributed.blockwise import BlockCode, fake_quantize_

    spec = {"w1": (9, 301), "w2": (5, 9, 3), "b": (7,)}
    meta = meta_of(spec)
    plans = []
    for rnd in range(2):
        own = tuple(_split(torch.randperm(9, generator=_gen("moment", S, rnd)), S))
        plans.append(SlicePlan(S, (TensorSlices("w1", 0, own), TensorSlices("w2", 1, own), TensorSlices("b", None))))
    for bits, unsigned in ((8, False), (8, True), (4, True)):
        full = {n: torch.randn(sh, generator=_gen("m", bits, unsigned, n)) for n, sh in spec.items()}
        if unsigned:
            full = {n: v.abs() ** 2 for n, v in full.items()}
        local = compact(full, plans[0], rank)
        local["b"] = torch.full(spec["b"], float(rank + 1))
        code = BlockCode(bits, unsigned)
        ex = Exchange(plans[0], plans[1], meta)
        got = ex(local, code=code)
        for t in plans[1].partitioned:
            want = fake_quantize_(full[t.name].clone(), t.dim, bits, unsigned=unsigned).index_select(t.dim, t.owners[rank])
            assert torch.equal(got[t.name], want), (t.name, bits, unsigned)
        assert torch.equal(got["b"], torch.full(spec["b"], (S + 1) / 2)), got["b"]
        sent = 0
        for t in plans[0].partitioned:
            per = math.prod(spec[t.name]) // spec[t.name][t.dim]
            raw = plan_bytes(plans[0], plans[1], meta, names=[t.name])[rank].all_to_all_bytes_sent
            sent += ledger.state_exchange_bytes(raw, per, 4, bits)
        assert ex.last_stats.all_to_all_bytes_sent == sent, (ex.last_stats.all_to_all_bytes_sent, sent)
    ex = Exchange(plans[0], plans[1], meta, compress="int8")
    with pytest.raises(ValueError, match="cannot be combined with compress"):
        ex(compact(full, plans[0], rank), code=BlockCode(8))
    with pytest.raises(TypeError, match="must be a blockwise.BlockCode"):
        Exchange(plans[0], plans[1], meta)(compact(full, plans[0], rank), code=8)


def _worker(rank, S, store, outdir):
    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S, timeout=60)
    log = {}
    for case in CASES:
        run_case(*case, rank=rank, S=S, log=log)

    # decentralized storage refuses plans that leave a slice unowned (Bernoulli masks)
    with pytest.raises(ValueError, match="has no owner"):
        spec = {n: torch.empty(s, device="meta") for n, s in mlp_spec().items()}
        bad = make_plan("mlp_bernoulli", S, 0, 0)
        bad = SlicePlan(S, (TensorSlices("fc1.weight", 0, (torch.arange(3),) + (torch.arange(2),) * (S - 1)),)
                        + bad.tensors[1:])
        Exchange(bad, make_plan("mlp_categorical", S, 0, 1), spec)

    # pruning: a next plan may leave slices to nobody (drop_unowned); every rank gets the kept ones
    spec = loft_spec()
    meta = meta_of(spec)
    full = {n: initial(n, shape, _gen("drop", S)) for n, shape in spec.items()}
    cur = make_plan("loft", S, 7, 0)
    kept = SlicePlan(S, tuple(t if t.shared else TensorSlices(t.name, t.dim, (torch.arange(0, spec[t.name][t.dim], 2),) * S)
                              for t in cur.tensors))
    names = [t.name for t in cur.partitioned]
    with pytest.raises(ValueError, match="has no owner"):
        Exchange(cur, kept, meta)
    got = Exchange(cur, kept, meta, drop_unowned=True)({n: v for n, v in compact(full, cur, rank).items() if n in names},
                                                      names=names)
    assert sorted(got) == sorted(names)
    for t in kept.partitioned:
        assert torch.equal(got[t.name], full[t.name].index_select(t.dim, t.owners[rank])), t.name

    # the papers' parameter-server count: a worker uploads and downloads its subnetwork's floats
    for s in range(S):
        own = compact(full, cur, s)
        assert ps_bytes(cur, meta)[s] == 2 * sum(4 * v.numel() for n, v in own.items() if not is_counter(n))

    # plans are never sent, but a debugging check can compare their fingerprints in one all_gather
    meta = meta_of(loft_spec())
    Exchange(make_plan("loft", S, 7, 0), make_plan("loft", S, 7, 1), meta, verify_plans=True)
    with pytest.raises(ValueError, match="different plans"):
        Exchange(make_plan("loft", S, 7 + (rank == 0), 0), make_plan("loft", S, 7, 1), meta, verify_plans=True)

    check_all_to_all(rank, S)
    check_block_coded_moments(rank, S)

    # local SGD baseline: one flat all_reduce of the whole model
    spec = loft_spec()
    everyone = [{n: torch.randn(s, generator=_gen("lsgd", S, k, n)) for n, s in spec.items()} for k in range(S)]
    model = {n: v.clone() for n, v in everyone[rank].items()}
    st = average_model_(model, round=0)
    for n in spec:
        want = torch.stack([e[n].double() for e in everyone]).mean(0)
        assert torch.allclose(model[n].double(), want, rtol=0, atol=2 * S * EPS * want.abs().max().item())
    assert st.collectives == 1 and st.all_reduce_bytes == 4 * sum(v.numel() for v in model.values())
    torch.save(log, os.path.join(outdir, f"rank{rank}.pt"))
    destroy_process_group()


@pytest.mark.parametrize("S", [2, 3, 4])
def test_exchange_equals_simulated(S, tmp_path):
    mp.spawn(_worker, args=(S, str(tmp_path / "store"), str(tmp_path)), nprocs=S, join=True)
    logs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(S)]
    # quantised replicated exchange: every replica holds the same model
    for r in range(1, S):
        for a, b in zip(logs[0]["replicas"], logs[r]["replicas"]):
            for n in a:
                assert torch.equal(a[n], b[n]), f"int8 replicas differ at {n}"
    # and the quantisation error uses at most half a step of its scale
    assert max(max(lg["qerr"]) for lg in logs) <= 0.5 + 2e-3


# ---------------------------------------------------------------- failures: never a silent hang
def _failing_worker(rank, S, store, outdir, mode, timeout, port):
    torch.set_num_threads(1)
    if port:  # as under torchrun: the environment names the rendezvous (env://, TCP)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(S), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        init_process_group(device="cpu", timeout=timeout)
    else:
        init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S, timeout=timeout)
    kind = "loft"
    spec = {n: torch.empty(s, device="meta") for n, s in loft_spec().items()}
    full = {n: torch.randn(s, generator=_gen("f", n)) for n, s in loft_spec().items()}
    plan = make_plan(kind, S, 1, 0)
    local = compact(full, plan, rank)
    for rnd in range(3):
        nxt = make_plan(kind, S, 1, rnd + 1)
        if rank == S - 1 and rnd == 2:
            if mode == "exit":
                os._exit(0)  # dies without a word (no destroy_process_group)
            time.sleep(timeout + 4)  # stalls past the timeout
            os._exit(0)
        t0 = time.perf_counter()
        try:
            local = Exchange(plan, nxt, spec, round=rnd)(local)
        except CollectiveError as e:
            write_rank_error(outdir, rank, time.perf_counter() - t0, str(e))
            os._exit(0)
        plan = nxt
    os._exit(0)


@pytest.mark.parametrize("mode,S", [("exit", 3), ("stall", 2)])
def test_dead_or_stalled_rank_raises_within_timeout(mode, S, tmp_path):
    timeout = 5.0
    port = free_port() if mode == "stall" else 0
    spawn_ranks_until(_failing_worker, (S, str(tmp_path / "store"), str(tmp_path), mode, timeout, port), S, 90)
    for r in range(S - 1):
        took, msg = rank_error(tmp_path, r, f"rank {r} did not raise CollectiveError ({mode})")
        assert took < timeout + 5, (took, msg)
        assert "round 2" in msg and ("all_to_all_single" in msg or "all_reduce" in msg), msg


def _late_peer_worker(rank, store, outdir):
    # rank 1 enters a gloo all_to_all with nothing to move 0.3 s after rank 0: rank 0's (point to
    # point, no messages) completes at once, so it did not wait for rank 1 there
    from ist_kernels.train.comm import Comm
    from ist_kernels.train.runner import rank0_wait
    from ist_kernels.train.timing import Clock

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=30)
    comm = Comm(world_size=2, rank=rank, distributed=True, local_workers=[rank], shared="exact", clock=Clock())
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
    comm._all_to_all(torch.empty(0), torch.empty(0), [0, 0], [0, 0], "nothing to move", 0)
    (t, secs), = comm.take()["entered"]
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(everyone, torch.tensor([t, secs], dtype=torch.float64))
    if rank == 0:
        entered = torch.stack(everyone)[:, :1]  # ranks x collectives
        with open(os.path.join(outdir, "out.txt"), "w") as f:
            f.write(f"{float(entered[1, 0] - entered[0, 0])} {secs} {rank0_wait(entered, torch.tensor([secs]))}")
    destroy_process_group()


def test_a_gloo_all_to_all_with_nothing_to_move_does_not_wait_and_no_wait_is_counted(tmp_path):
    spawn_ranks_until(_late_peer_worker, (str(tmp_path / "store"), str(tmp_path)), 2, 60)
    late, secs, wait = (float(x) for x in (tmp_path / "out.txt").read_text().split())
    assert late >= 0.25 and secs < 0.2, (late, secs)
    assert wait == pytest.approx(secs)  # at most rank 0's time in it, not rank 1's 0.3 s lateness


# ---------------------------------------------------------------- one process: S = 1, bad input
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=30)
    yield
    destroy_process_group()


def test_a_backends_own_timeout_reads_timed_out_and_a_closed_connection_failed():
    # gloo's recv timeout (the process group's, as long as ours) can fire before our wait does:
    # a stalled peer still reads "timed out"; a dead one (connection closed) "failed"
    from ist_kernels.distributed.group import wait_collective

    class Work:
        def __init__(self, msg):
            self.msg = msg

        def wait(self, timeout=None):
            raise RuntimeError(self.msg)

    for msg, kind in (("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation "
                       "to complete", "timed out"),
                      ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242", "failed")):
        with pytest.raises(CollectiveError) as e:
            wait_collective(lambda: Work(msg), name="all_reduce (x)", round=3, timeout=timedelta(seconds=6))
        msg = str(e.value)
        assert msg.startswith("all_reduce (x) (round 3) on rank ") and f" {kind} (RuntimeError: " in msg, msg


def test_single_rank_is_the_identity_of_its_owner_mean(single):
    spec = loft_spec()
    full = {n: torch.randn(s) for n, s in spec.items()}
    plan, nxt = make_plan("loft", 1, 3, 0), make_plan("loft", 1, 3, 1)
    meta = {n: torch.empty(s, device="meta") for n, s in spec.items()}
    for shared in ("exact", "all_reduce"):
        ex = Exchange(plan, nxt, meta, shared=shared, round=0)
        out = ex(compact(full, plan, 0))
        for n in spec:
            assert torch.equal(out[n], full[n]), n
        assert ex.last_stats.all_to_all_bytes_sent == 0 and ex.last_stats.bytes_sent == 0


def test_bad_input_is_named(single):
    spec = mlp_spec()
    meta = {n: torch.empty(s, device="meta") for n, s in spec.items()}
    plan, nxt = make_plan("mlp_categorical", 1, 0, 0), make_plan("mlp_categorical", 1, 0, 1)
    local = compact({n: torch.randn(s) for n, s in spec.items()}, plan, 0)
    with pytest.raises(ValueError, match="storage"):
        Exchange(plan, nxt, meta, storage="central")
    with pytest.raises(ValueError, match="2 subnetworks but the group has 1"):
        Exchange(make_plan("mlp_categorical", 2, 0, 0), None, meta, storage="replicated")
    with pytest.raises(ValueError, match="needs the next plan"):
        Exchange(plan, None, meta)
    with pytest.raises(KeyError, match="spec lacks"):
        Exchange(plan, nxt, {n: v for n, v in meta.items() if n != "fc1.bias"})
    dup = SlicePlan(1, (TensorSlices("fc1.weight", 0, (torch.tensor([0, 0, 1]),)),) + plan.tensors[1:])
    with pytest.raises(ValueError, match="fc1.weight.*sorted, unique"):
        Exchange(dup, nxt, meta)
    oob = SlicePlan(1, (TensorSlices("fc1.weight", 0, (torch.arange(12),)),) + plan.tensors[1:])
    with pytest.raises(ValueError, match="fc1.weight.*in \\[0, 11\\)"):
        Exchange(oob, nxt, meta)
    ex = Exchange(plan, nxt, meta, round=4)
    with pytest.raises(ValueError, match="'fc1.weight' on rank 0 must have shape \\(11, 5\\)"):
        ex({**local, "fc1.weight": torch.zeros(10, 5)})
    with pytest.raises(KeyError, match="local lacks"):
        ex({n: v for n, v in local.items() if n != "fc2.weight"})
    with pytest.raises(KeyError, match="outside the exchanged names"):
        ex({**local, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="dtype"):
        ex({**local, "fc1.bias": local["fc1.bias"].double()})


# ---------------------------------------------------------------- NCCL: one rank on a GPU
def _nccl_worker(rank, store):
    init_process_group(init_method=f"file://{store}", rank=0, world_size=1, device="cuda", timeout=60)
    assert dist.get_backend() == "nccl"
    spec = loft_spec()
    meta = meta_of(spec)
    full = {n: initial(n, s, _gen("nccl", n)) for n, s in spec.items()}
    plan, nxt = make_plan("loft", 1, 5, 0), make_plan("loft", 1, 5, 1)
    for shared in ("exact", "all_reduce"):
        for quantize in (None, "int8"):
            local = {n: v.cuda() for n, v in compact(full, plan, 0).items()}
            out = Exchange(plan, nxt, meta, shared=shared, quantize=quantize, round=0)(local)
            for n, v in compact(full, nxt, 0).items():
                got = out[n].cpu()
                if quantize and not is_counter(n):
                    assert (got - v).abs().max() <= v.abs().max() / 127 * 0.502 + 1e-6, n
                else:
                    assert torch.equal(got, v), n
    model = {n: v.cuda() for n, v in full.items() if not is_counter(n)}
    st = average_model_(model, round=0)
    assert st.collectives == 1 and all(torch.equal(model[n].cpu(), full[n]) for n in model)
    destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_nccl_single_rank(tmp_path):
    mp.spawn(_nccl_worker, args=(str(tmp_path / "store"),), nprocs=1, join=True)
