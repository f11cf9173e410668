"""Product slices (issue 37 item 3): a tensor partitioned along two dims is planned as the product of
its row and column index lists. Checked against an element-wise float64 reference written from the
math (loops over elements and owners) and, bit for bit, against the kernels' scatter of the same
segments stated on the flat view (one slice per element)."""
import pytest
import torch

import ist_kernels.functional as IF
from ist_kernels.distributed import (
    Exchange,
    destroy_process_group,
    gather_bytes,
    gather_full_model,
    init_process_group,
    plan_bytes,
)
from ist_kernels.nn import SubnetMLP
from ist_kernels.partition import SlicePlan, TensorSlices, positions

from conftest import CUDA_PARAM


def _owners(g, n, S, kind):
    """S sorted index lists into range(n): disjoint, Bernoulli (overlapping, some unowned) or empty."""
    if kind == "disjoint":
        perm = torch.randperm(n, generator=g)
        return [perm[s::S].sort().values for s in range(S)]
    if kind == "bernoulli":
        return [torch.nonzero(torch.rand(n, generator=g) < 0.6).flatten() for _ in range(S)]
    return [torch.empty(0, dtype=torch.int64) for _ in range(S)]


def _reference(target, rows, cols, updates, reduce):
    """Element by element, float64: every element's owners in segment order, then copy (the last),
    sum (target plus all) or mean (of the owners); unowned elements keep their value."""
    out = target.clone()
    n0, n1 = target.shape[:2]
    for i in range(n0):
        for k in range(n1):
            vals = [u[list(r).index(i), list(c).index(k)] for r, c, u in
                    zip([r.tolist() for r in rows], [c.tolist() for c in cols], updates) if i in r and k in c]
            if not vals:
                continue
            if reduce == "copy":
                out[i, k] = vals[-1]
            elif reduce == "sum":
                out[i, k] = target[i, k] + sum(vals)
            else:
                out[i, k] = sum(vals) / len(vals)
    return out


def _flat_scatter(target, rows, cols, updates, reduce):
    """The same write-back through the kernels, on the flat view (one slice per element)."""
    out = target.clone()
    n1 = target.shape[1]
    idx = [(r[:, None] * n1 + c[None, :]).reshape(-1) for r, c in zip(rows, cols)]
    IF.scatter_slices_([out.view(-1)], [0] * len(idx), [u.reshape(-1) for u in updates], idx, [0], reduce=reduce)
    return out


@pytest.mark.parametrize("kind", ["disjoint", "bernoulli", "empty"])
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
def test_product_plan_float64_reference(kind, reduce):
    g = torch.Generator().manual_seed(hash((kind, reduce)) % 1000)
    n0, n1, S = 7, 5, 3
    W = torch.randn(n0, n1, dtype=torch.float64, generator=g)
    rows, cols = _owners(g, n0, S, kind), _owners(g, n1, S, "bernoulli" if kind == "empty" else kind)
    plan = IF.slice_plan([W], [0] * S, list(zip(rows, cols)), [(0, 1)])
    segs = plan.gather([W])
    for r, c, seg in zip(rows, cols, segs):
        assert seg.shape == (len(r), len(c))
        want = torch.tensor([[W[i, k].item() for k in c.tolist()] for i in r.tolist()], dtype=torch.float64)
        assert torch.equal(seg, want.view(len(r), len(c)))
    updates = [torch.randn(seg.shape, dtype=torch.float64, generator=g) for seg in segs]
    got = W.clone()
    plan.scatter_([got], updates, reduce=reduce)
    torch.testing.assert_close(got, _reference(W, rows, cols, updates, reduce), rtol=1e-14, atol=1e-14)
    assert torch.equal(got, _flat_scatter(W, rows, cols, updates, reduce))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
def test_product_scatter_bit_identical_to_flat(dtype, reduce):
    """Overlapping Bernoulli owners, odd shape, every dtype the kernels reduce, and a second tensor
    sliced along one dim in the same plan: bit for bit the flat kernels' scatter."""
    g = torch.Generator().manual_seed(7)
    n0, n1, S = 13, 11, 4
    W = (torch.randn(n0, n1, generator=g) * 50).to(dtype)
    b = (torch.randn(9, generator=g) * 50).to(dtype)
    rows, cols = _owners(g, n0, S, "bernoulli"), _owners(g, n1, S, "bernoulli")
    ids, idx = [], []
    for s in range(S):
        ids += [0, 1]
        idx += [(rows[s], cols[s]), torch.arange(s, 9, 2)]
    plan = IF.slice_plan([W, b], ids, idx, [(0, 1), 0])
    segs = plan.gather([W, b])
    updates = [(torch.randn(x.shape, generator=g) * 50).to(dtype) for x in segs]
    W1, b1 = W.clone(), b.clone()
    plan.scatter_([W1, b1], updates, reduce=reduce)
    assert torch.equal(W1, _flat_scatter(W, rows, cols, updates[0::2], reduce))
    b2 = b.clone()
    IF.scatter_slices_([b2], [0] * S, updates[1::2], idx[1::2], [0], reduce=reduce)
    assert torch.equal(b1, b2)


def test_product_mean_edge_values_as_flat():
    """Owners of opposite sign near the largest float, infinities, NaN and owners all equal: the
    OwnerMean's fallbacks, bit for bit (NaN where the flat kernels give NaN)."""
    W = torch.zeros(3, 4)
    rows = [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), torch.tensor([1, 2])]
    cols = [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3]), torch.tensor([0, 3])]
    big = 3e38
    u0 = torch.tensor([[big, float("inf"), 1.0, float("nan")], [big, -big, 2.0, 5.0], [1e-45, 0.1, -0.0, 7.0]])
    u1 = torch.tensor([[-big, big, 1.0, 1.0], [big, float("-inf"), 2.0, 5.0], [-1e-45, 0.2, 0.0, 7.0]])
    u2 = torch.tensor([[big, 5.0], [0.3, 7.0]])
    plan = IF.slice_plan([W], [0, 0, 0], list(zip(rows, cols)), [(0, 1)])
    got = W.clone()
    plan.scatter_([got], [u0, u1, u2], reduce="mean")
    torch.testing.assert_close(got, _flat_scatter(W, rows, cols, [u0, u1, u2], "mean"), rtol=0, atol=0,
                               equal_nan=True)
    assert got[0, 0] == 0.0 and got[0, 1] == float("inf") and got[1, 3] == 5.0


def test_product_on_a_conv_weight_along_channels():
    """A conv's filters by (out, in) channels: dims (0, 1) of a 4-D weight, and dims (1, 0)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, 3, 3, dtype=torch.float64, generator=g)
    rows, cols = _owners(g, 6, 2, "bernoulli"), _owners(g, 5, 2, "bernoulli")
    for dims in ((0, 1), (1, 0)):
        if dims == (1, 0):  # the first list runs along dim 1 (in channels), the second along dim 0
            rows, cols = cols, rows
        plan = IF.slice_plan([w], [0, 0], list(zip(rows, cols)), [dims])
        segs = plan.gather([w])
        for r, c, seg in zip(rows, cols, segs):
            assert torch.equal(seg, w.index_select(dims[0], r).index_select(dims[1], c))
        updates = [torch.randn(s.shape, dtype=torch.float64, generator=g) for s in segs]
        got = w.clone()
        plan.scatter_([got], updates, reduce="mean")
        front = [u.movedim(dims, (0, 1)) for u in updates]
        want = w.movedim(dims, (0, 1)).clone()
        for q in range(3 * 3):  # every kernel position on its own: a 2-D reference each
            i, k = divmod(q, 3)
            want[:, :, i, k] = _reference(want[:, :, i, k], rows, cols, [u[:, :, i, k] for u in front], "mean")
        torch.testing.assert_close(got.movedim(dims, (0, 1)), want, rtol=1e-14, atol=1e-14)


def test_product_plan_bad_input():
    W = torch.zeros(4, 3)
    r, c = torch.tensor([0, 2]), torch.tensor([1])
    with pytest.raises(IndexError, match=r"indices\[0\]\[0\] holds 4, out of range for tensors\[0\] along dim 0"):
        IF.slice_plan([W], [0], [(torch.tensor([4]), c)], [(0, 1)])
    with pytest.raises(ValueError, match=r"indices\[0\]\[1\] must not repeat"):
        IF.slice_plan([W], [0], [(r, torch.tensor([1, 1]))], [(0, 1)])
    with pytest.raises(ValueError, match=r"indices\[0\] must be a pair"):
        IF.slice_plan([W], [0], [r], [(0, 1)])
    with pytest.raises(ValueError, match="names dim 0 twice"):
        IF.slice_plan([W], [0], [(r, c)], [(0, -2)])
    with pytest.raises(ValueError, match=r"indices\[0\] is a pair but tensors\[0\] is sliced along one dim"):
        IF.slice_plan([W], [0], [(r, c)], [0])
    with pytest.raises(TypeError, match=r"indices\[0\]\[1\] must be int64"):
        IF.slice_plan([W], [0], [(r, c.int())], [(0, 1)])
    plan = IF.slice_plan([W], [0], [(r, c)], [(0, 1)])
    with pytest.raises(ValueError, match=r"updates\[0\] has shape \[3, 1\] but the plan's segment 0 needs \[2, 1\]"):
        plan.scatter_([W], [torch.zeros(3, 1)])
    with pytest.raises(ValueError, match="out is not supported by a plan with product slices"):
        plan.gather([W], out=torch.empty(2))
    before = W.clone()
    with pytest.raises(ValueError, match="sources\\[0\\] is \\[4, 4\\]"):
        plan.gather([torch.zeros(4, 4)])
    assert torch.equal(W, before)


def test_slice_plan_product_kind():
    """TensorSlices products: part, flat, positions, with_holders (covered: stays the same product;
    unowned elements: holder blocks, every element held once)."""
    g = torch.Generator().manual_seed(5)
    W = torch.randn(7, 5, generator=g)
    rows, cols = _owners(g, 7, 3, "bernoulli"), _owners(g, 5, 3, "bernoulli")
    t = TensorSlices("w", 0, tuple(rows), tuple(cols), 1)
    plan = SlicePlan(3, (t,))
    flat = plan.flat({"w": (7, 5)})
    for s in range(3):
        part = plan.part({"w": W}, s)
        assert t.count(s) == len(rows[s]) * len(cols[s])
        if t.count(s):
            assert torch.equal(part["w"], W[rows[s]][:, cols[s]])
            assert torch.equal(flat.part({"w": W.view(-1)}, s)["w"], part["w"].reshape(-1))
        else:
            assert "w" not in part
    held = plan.with_holders({"w": (7, 5)})
    assert held.tensors[0].product and any(held.tensors[0].holds)  # Bernoulli owners leave elements unowned
    every = torch.cat(held.flat({"w": (7, 5)}).tensors[0].owners)
    owned = torch.cat(flat.tensors[0].owners).unique()
    assert torch.equal(every.unique(), torch.arange(35))  # every element held, each unowned one once
    assert every.numel() == torch.cat(flat.tensors[0].owners).numel() + 35 - owned.numel()
    full = TensorSlices("w", 0, (torch.tensor([0, 1]), torch.tensor([1, 2])), (torch.tensor([0, 1]),) * 2, 1)
    covered = SlicePlan(2, (full,)).with_holders({"w": (3, 2)})
    assert covered.tensors[0] is full
    pos = positions((torch.tensor([1, 3, 4]), torch.tensor([0, 2])), (torch.tensor([3, 4]), torch.tensor([2])))
    assert [p.tolist() for p in pos] == [[1, 2], [1]]
    wide = TensorSlices("w", 0, (torch.tensor([1]), torch.tensor([2])), (torch.tensor([0]), torch.tensor([0, 4])), 1)
    with pytest.raises(ValueError, match=r"'w': the cols of subnetwork 1 must be in \[0, 4\)"):
        SlicePlan(2, (wide,)).flat({"w": (7, 4)})
    with pytest.raises(ValueError, match="the product 'w' needs"):
        SlicePlan(3, (TensorSlices("w", 0, tuple(rows), tuple(cols[:2]), 1),))


@pytest.mark.parametrize("masks", ["balanced", "bernoulli"])
def test_subnet_mlp_product_round_as_flat(masks):
    """SubnetMLP (depth 3, odd width) on the product plan: the compact round's gather and owner-mean
    write-back equal the flat form's (slice_plan on the flattened weights) bit for bit."""
    g = torch.Generator().manual_seed(11)
    m = SubnetMLP(6, 9, 3, 2, bias=True, train_output=True, generator=g)
    S = 3
    if masks == "balanced":
        perms = [torch.randperm(9, generator=g) for _ in range(3)]
        neurons = [[p[s::S].sort().values for p in perms] for s in range(S)]
    else:
        neurons = [[torch.nonzero(torch.rand(9, generator=g) < 0.5).flatten() for _ in range(3)] for _ in range(S)]
    full = {n: p.detach().clone() for n, p in m.named_parameters()}
    sp = m.slice_plan(neurons)
    pp = m.product_plan(neurons)
    assert [t.product for t in pp.tensors] == [False, False, True, False, True, False, False, False]
    flat_t = [full[t.name].view(-1) if m._flat(t.name) else full[t.name] for t in sp.partitioned]
    ids = [k for _ in range(S) for k in range(len(flat_t))]
    fplan = IF.slice_plan(flat_t, ids, [t.owners[s] for s in range(S) for t in sp.partitioned],
                          [t.dim for t in sp.partitioned])
    fsegs = fplan.gather(flat_t)
    rnd = m.compact(neurons)
    got = [p for params in rnd.params for p in params if p is not None]
    shared = [k for k, t in enumerate(sp.tensors) if t.shared]
    mine = [p for s in range(S) for k, p in enumerate(rnd.params[s]) if k not in shared]
    assert all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(mine, fsegs))
    for p in got:
        p.add_(torch.randn(p.shape, generator=g))
    rnd.write_back()
    names = [t.name for t in sp.partitioned] * S
    fplan.scatter_(flat_t, [m.exchange_view(n, p) for n, p in zip(names, mine)], reduce="mean")
    now = dict(m.named_parameters())
    for t in sp.partitioned:
        assert torch.equal(now[t.name], full[t.name]), t.name


def _exchange_plans(S):
    """Two rounds' plans of a product (7 x 5; this round's rows dealt in S disjoint groups at random
    with every column, the next round's columns dealt with every row: every element one owner, and
    what moves between two ranks a product of both), a tensor sliced along one dim and a shared bias."""
    def plan(seed):
        rows, cols = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) for n in (7, 5))
        r = [rows[s::S].sort().values if seed == 1 else torch.arange(7) for s in range(S)]
        c = [cols[s::S].sort().values if seed == 2 else torch.arange(5) for s in range(S)]
        w = TensorSlices("w", 0, tuple(r), tuple(c), 1)
        v = TensorSlices("v", 0, tuple(torch.arange(s, 6, S) for s in range(S)))
        return SlicePlan(S, (w, v, TensorSlices("b", None)))
    return plan(1), plan(2)


def test_exchange_byte_counts_of_products_as_flat():
    S = 3
    cur, nxt = _exchange_plans(S)
    spec = {"w": ((7, 5), torch.float32), "v": ((6, 4), torch.float32), "b": ((2,), torch.float32)}
    flat_spec = {**spec, "w": ((35,), torch.float32)}
    shapes = {n: v[0] for n, v in spec.items()}
    for storage in ("decentralized", "replicated"):
        for compress in (None, "int8"):
            a = plan_bytes(cur, nxt, spec, storage=storage, shared="exact", compress=compress)
            b = plan_bytes(cur.flat(shapes), nxt.flat(shapes), flat_spec, storage=storage, shared="exact",
                           compress=compress)
            assert [x.bytes_sent for x in a] == [x.bytes_sent for x in b] and any(x.bytes_sent for x in a)
    assert [x.bytes_sent for x in gather_bytes(cur, spec)] == [x.bytes_sent for x in gather_bytes(cur.flat(shapes),
                                                                                                  flat_spec)]


def test_exchange_of_products_on_one_rank(tmp_path):
    """S = 1: the Exchange and gather_full_model take a product's compact rows x cols tensor and
    give back the next one, rows x cols, equal to the plan stated flat."""
    init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=30)
    try:
        g = torch.Generator().manual_seed(0)
        full = {"w": torch.randn(7, 5, generator=g), "v": torch.randn(6, 4, generator=g), "b": torch.randn(2, generator=g)}
        meta = {n: torch.empty(x.shape, device="meta") for n, x in full.items()}
        rows = (torch.tensor([0, 2, 3, 5]), torch.tensor([1, 3, 4]))
        cur = SlicePlan(1, (TensorSlices("w", 0, (torch.arange(7),), (torch.arange(5),), 1),
                            TensorSlices("v", 0, (torch.arange(6),)), TensorSlices("b", None)))
        nxt = SlicePlan(1, (TensorSlices("w", 0, (torch.arange(7),), (rows[1],), 1),
                            TensorSlices("v", 0, (rows[0],)), TensorSlices("b", None)))
        local = cur.part(full, 0)
        out = Exchange(cur, nxt, meta, shared="exact", drop_unowned=True)(local)
        assert torch.equal(out["w"], full["w"][:, rows[1]]) and torch.equal(out["v"], full["v"][rows[0]])
        assert torch.equal(out["b"], full["b"])
        got = gather_full_model(cur.part(full, 0), cur, meta)
        assert all(torch.equal(got[n], full[n]) for n in full)
        with pytest.raises(ValueError, match=r"'w' on rank 0 must have shape \(7, 5\)"):
            Exchange(cur, nxt, meta, drop_unowned=True)({**local, "w": local["w"].reshape(-1)})
    finally:
        destroy_process_group()


def test_product_gather_in_row_chunks(monkeypatch):
    """The CPU gather of a 2-D weight reads rows in chunks: chunk edges inside the rows, a chunk
    smaller than one row, and an empty column list."""
    from ist_kernels.ops.slices import product

    g = torch.Generator().manual_seed(9)
    W = torch.randn(11, 9, dtype=torch.float64, generator=g)
    rows, cols = torch.tensor([0, 2, 3, 5, 7, 8, 10]), torch.tensor([1, 4, 5, 8])
    for chunk in (1, 4, 9, 1 << 15):
        monkeypatch.setattr(product, "CHUNK", chunk)
        for c in (cols, cols[:0]):
            seg = IF.slice_plan([W], [0], [(rows, c)], [(0, 1)]).gather([W])[0]
            assert torch.equal(seg, W[rows][:, c])


def _holders_reference(rows, cols, shape, S):
    """Per holder, the sorted flat indices it keeps, element by element from the rule: every element
    (i, k) no subnetwork owns (no s with i in rows[s] and k in cols[s]) goes to (i * n1 + k) mod S."""
    n0, n1 = shape
    owned = {(i, k) for r, c in zip(rows, cols) for i in r.tolist() for k in c.tolist()}
    out = [[] for _ in range(S)]
    for i in range(n0):
        for k in range(n1):
            if (i, k) not in owned:
                out[(i * n1 + k) % S].append(i * n1 + k)
    return out


@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["disjoint", "bernoulli", "empty"])
def test_product_holders_as_blocks(S, kind):
    """with_holders keeps a product a product: each holder's blocks are exactly the unowned elements
    the element-wise rule gives it (against a reference over elements), disjoint from its own block
    and each other; the stacked compact copy reads those elements in flat_ids order; the plan stated
    flat equals the flat plan's holders; count and the ledger's count agree."""
    g = torch.Generator().manual_seed(10 * S + len(kind))
    for shape in ((7, 5), (9, 6), (1, 1), (4, 8), (0, 3)):
        rows, cols = _owners(g, shape[0], S, kind), _owners(g, shape[1], S, kind)
        plan = SlicePlan(S, (TensorSlices("w", 0, tuple(rows), tuple(cols), 1),))
        held = plan.with_holders({"w": shape})
        t = held.tensors[0]
        assert t.product
        ref = _holders_reference(rows, cols, shape, S)
        if not any(ref):
            assert t is plan.tensors[0]
            continue
        W = torch.randn(shape, generator=g, dtype=torch.float64)
        flat_held = plan.flat({"w": shape}).with_holders({"w": shape[0] * shape[1]}).tensors[0]
        for s in range(S):
            own = {i * shape[1] + k for i in rows[s].tolist() for k in cols[s].tolist()}
            got = [i * shape[1] + k for r, c in t.holds[s] for i in r.tolist() for k in c.tolist()]
            assert sorted(got) == ref[s] and len(set(got)) == len(got) and not own & set(got)
            assert t.count(s) == len(own) + len(ref[s]) == flat_held.owners[s].numel()
            assert torch.equal(held.flat({"w": shape}).tensors[0].owners[s], flat_held.owners[s])
            assert torch.equal(t.select(W, s).reshape(-1), W.reshape(-1)[t.flat_ids(s, shape[1])])
            assert t.stacked(s) == bool(ref[s])
            if t.stacked(s):  # the own block first: the trained copy is a view of the stored one
                n = len(own)
                assert torch.equal(t.select(W, s)[:n].view(len(rows[s]), len(cols[s])), W[rows[s]][:, cols[s]])
                assert held.part({"w": W}, s)["w"].dim() == 1
    with pytest.raises(ValueError, match="'w' has holder blocks"):
        SlicePlan(2, (TensorSlices("w", 0, (torch.tensor([0]),) * 2, holds=((), ())),))


def test_product_holders_plan_size_of_ist():
    """The holders of an IST round's product (S disjoint row and column groups: the off-diagonal
    blocks unowned) are at most S x S blocks per holder, their index lists O(rows + cols)."""
    g = torch.Generator().manual_seed(3)
    S, n = 4, 1001
    rows, cols = _owners(g, n, S, "disjoint"), _owners(g, n, S, "disjoint")
    t = SlicePlan(S, (TensorSlices("w", 0, tuple(rows), tuple(cols), 1),)).with_holders({"w": (n, n)}).tensors[0]
    for s in range(S):
        assert 0 < len(t.holds[s]) <= S * S
        assert sum(r.numel() + c.numel() for r, c in t.holds[s]) <= 2 * S * n
    assert sum(t.count(s) for s in range(S)) == n * n


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
def test_exchange_of_product_holders_on_one_rank(tmp_path, device):
    """S = 1, both plans with holder blocks (the rank keeps the unowned elements as blocks, its
    compact tensor 1-D in block order): the Exchange reads and writes that order (the next compact
    tensor equals the next plan's part, bit for bit; on CUDA through NCCL, twice, the second call
    with the index lists it moved to the device the first time), gather_full_model assembles the
    full tensor, and a product's holder blocks count in the plan's fingerprint."""
    from ist_kernels.distributed.exchange import plan_fingerprint

    init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                       world_size=1, timeout=30)
    try:
        g = torch.Generator().manual_seed(4)
        full = {"w": torch.randn(7, 5, generator=g), "b": torch.randn(2, generator=g)}
        meta = {n: torch.empty(x.shape, device="meta") for n, x in full.items()}

        def plan(rows, cols):
            p = SlicePlan(1, (TensorSlices("w", 0, (torch.tensor(rows),), (torch.tensor(cols),), 1),
                              TensorSlices("b", None)))
            return p.with_holders({"w": (7, 5)})
        cur, nxt = plan([0, 2, 3, 6], [1, 4]), plan([1, 2, 5], [0, 1, 3])
        assert cur.tensors[0].stacked(0) and nxt.tensors[0].stacked(0)
        local = {n: x.to(device) for n, x in cur.part(full, 0).items()}
        assert local["w"].shape == (35,)
        ex = Exchange(cur, nxt, meta, shared="exact")
        for _ in range(2):
            out = ex({n: x.clone() for n, x in local.items()})
            assert out["w"].device.type == device
            assert torch.equal(out["w"].cpu(), nxt.part(full, 0)["w"]) and torch.equal(out["b"].cpu(), full["b"])
        got = gather_full_model(local, cur, meta)
        assert all(torch.equal(got[n].cpu(), full[n]) for n in full)
        bare = SlicePlan(1, (TensorSlices("w", 0, (torch.tensor([0, 2, 3, 6]),), (torch.tensor([1, 4]),), 1),
                             TensorSlices("b", None)))
        assert plan_fingerprint(cur) != plan_fingerprint(bare)
    finally:
        destroy_process_group()


@pytest.mark.parametrize("kind", ["disjoint", "bernoulli"])
def test_plan_bytes_of_product_holders(kind):
    """plan_bytes and gather_bytes count a product with holder blocks from its blocks: rank k sends
    rank q every element k holds now and q holds next (replicated: every element k holds); the
    gather each element from its lowest holder (copy) or every holder (mean); against a reference
    over elements (4 bytes each, 2 in bf16; int8 leaves one-element slices raw), and equal to the
    plans stated flat; the other tensors' bytes are added as before."""
    S, shape = 3, (11, 9)
    g = torch.Generator().manual_seed(7)

    def plan():
        w = TensorSlices("w", 0, tuple(_owners(g, shape[0], S, kind)), tuple(_owners(g, shape[1], S, kind)), 1)
        v = TensorSlices("v", 0, tuple(_owners(g, 6, S, "disjoint")))
        return SlicePlan(S, (w, v, TensorSlices("b", None))).with_holders({"w": shape, "v": 6})
    cur, nxt = plan(), plan()
    assert any(cur.tensors[0].holds) and any(nxt.tensors[0].holds)
    spec = {"w": (shape, torch.float32), "v": ((6, 4), torch.float32), "b": ((2,), torch.float32)}
    held = [[{i * shape[1] + k for r, c in p.tensors[0].blocks(s) for i in r.tolist() for k in c.tolist()}
             for s in range(S)] for p in (cur, nxt)]
    for storage in ("decentralized", "replicated"):
        for compress, esize in ((None, 4), ("bf16", 2), ("int8", 4)):
            got = plan_bytes(cur, nxt, spec, storage=storage, names=["w"], compress=compress)
            for k in range(S):
                want = sum(len(held[0][k] & held[1][q]) if storage == "decentralized" else len(held[0][k])
                           for q in range(S) if q != k) * esize
                assert got[k].all_to_all_bytes_sent == want and got[k].collectives == 1
    for reduce in ("copy", "mean"):  # to rank 1: each element from its lowest holder, or from every holder
        got = gather_bytes(SlicePlan(S, cur.tensors[:1]), {"w": spec["w"]}, dst=1, reduce=reduce)
        for k in range(S):
            lower = set().union(*held[0][:k]) if reduce == "copy" else set()
            assert got[k].bytes_sent == (0 if k == 1 else 4 * len(held[0][k] - lower))
    shapes = {"w": shape}
    flat_spec = {**spec, "w": ((99,), torch.float32)}
    for reduce in ("copy", "mean"):
        a, b = gather_bytes(cur, spec, reduce=reduce), gather_bytes(cur.flat(shapes), flat_spec, reduce=reduce)
        assert [(x.bytes_sent, x.bytes_received, x.collectives) for x in a] == \
            [(x.bytes_sent, x.bytes_received, x.collectives) for x in b]
    a = plan_bytes(cur, nxt, spec, shared="exact", compress="int8")
    b = plan_bytes(cur.flat(shapes), nxt.flat(shapes), flat_spec, shared="exact", compress="int8")
    assert [(x.bytes_sent, x.bytes_received) for x in a] == [(x.bytes_sent, x.bytes_received) for x in b]


def _routed_plans(S, kind, seed):
    """A product w (9 x 11: rows and cols dealt by ``kind``), a tensor v sliced along dim 0 and a
    shared bias, with holder blocks where some element of w (or slice of v) has no owner."""
    g = torch.Generator().manual_seed(seed)
    rows, cols, v = _owners(g, 9, S, kind), _owners(g, 11, S, kind), _owners(g, 6, S, "disjoint")
    plan = SlicePlan(S, (TensorSlices("w", 0, tuple(rows), tuple(cols), 1), TensorSlices("v", 0, tuple(v)),
                         TensorSlices("b", None)))
    return plan


def _at_full(x, plan, name, s, shape):
    """Rank s's compact copy ``x`` of ``name`` put back at its elements of a NaN full tensor."""
    full = torch.full(shape, float("nan"), dtype=x.dtype)
    t = next(t for t in plan.tensors if t.name == name)
    ids = t.flat_ids(s, shape[1]) if t.product else t.owners[s]
    full.view(-1)[ids] = x.reshape(-1)
    return full


def _routed_worker(rank, S, store, outdir):
    """Every way through the Exchange and gather_full_model with a product routed on its blocks
    against the same plan stated flat (one slice per element, the kernels' routing): equal bit for
    bit, values and bytes."""
    from ist_kernels.distributed.blockwise import BlockCode

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S, timeout=60)
    shape = (9, 11)
    spec = {"w": (shape, torch.float32), "v": ((6, 3), torch.float32), "b": ((2,), torch.float32)}
    flat_spec = {**spec, "w": ((99,), torch.float32)}
    shapes = {n: v[0] for n, v in spec.items()}
    checked = 0
    for kind in ("disjoint", "bernoulli"):
        for storage in ("decentralized", "replicated"):
            cur, nxt = _routed_plans(S, kind, 1), _routed_plans(S, kind, 2)
            if storage == "decentralized":
                cur, nxt = cur.with_holders({"w": shape, "v": 6}), nxt.with_holders({"w": shape, "v": 6})
            fcur, fnxt = cur.flat(shapes), nxt.flat(shapes)
            g = torch.Generator().manual_seed(100 + rank)  # this rank's trained values
            mine = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
            flat_mine = {**mine, "w": mine["w"].reshape(-1)}
            if storage == "decentralized":
                local, flat_local = cur.part(mine, rank), fcur.part(flat_mine, rank)
            else:
                local, flat_local = {n: x.clone() for n, x in mine.items()}, {n: x.clone() for n, x in flat_mine.items()}
            for how in ({}, {"compress": "bf16"}, {"compress": "int8"}, {"quantize": "int8"},
                        {"code": BlockCode(8)}, {"shared": "all_reduce"}):
                init = {k: v for k, v in how.items() if k in ("compress", "shared")}
                call = {k: v for k, v in how.items() if k in ("quantize", "code")}
                init.setdefault("shared", "exact")
                a = Exchange(cur, nxt, spec, storage=storage, **init)
                b = Exchange(fcur, fnxt, flat_spec, storage=storage, **init)
                out_a = a({n: x.clone() for n, x in local.items()}, **call)
                out_b = b({n: x.clone() for n, x in flat_local.items()}, **call)
                if storage == "decentralized":
                    got = _at_full(out_a["w"], nxt, "w", rank, shape)
                    want = _at_full(out_b["w"], fnxt, "w", rank, (1, 99)).view(shape)
                    assert out_a["w"].shape == nxt.part(mine, rank)["w"].shape
                else:
                    got, want = out_a["w"], out_b["w"].view(shape)
                assert torch.equal(got.isnan(), want.isnan()), (kind, storage, how)
                assert torch.equal(got.nan_to_num(), want.nan_to_num()), (kind, storage, how)
                assert torch.equal(out_a["v"], out_b["v"]) and torch.equal(out_a["b"], out_b["b"]), (kind, storage, how)
                sa, sb = a.last_stats, b.last_stats
                assert (sa.bytes_sent, sa.bytes_received, sa.collectives) == (sb.bytes_sent, sb.bytes_received,
                                                                               sb.collectives), (kind, storage, how)
                if not call and "compress" not in how:
                    assert sa.bytes_sent == plan_bytes(cur, nxt, spec, storage=storage, shared=init["shared"])[rank].bytes_sent
                checked += 1
            if storage == "decentralized":
                for reduce in ("copy", "mean"):
                    ga = gather_full_model(local, cur, spec, dst=S - 1, reduce=reduce)
                    gb = gather_full_model(flat_local, fcur, flat_spec, dst=S - 1, reduce=reduce)
                    if rank == S - 1:
                        assert torch.equal(ga["w"], gb["w"].view(shape)) and torch.equal(ga["v"], gb["v"]), reduce
                    else:
                        assert ga is None and gb is None
                    checked += 1
    torch.save(checked, f"{outdir}/checked{rank}.pt")
    destroy_process_group()


@pytest.mark.parametrize("S", [2, 3])
def test_exchange_routes_products_on_their_blocks_as_the_flat_plan(S, tmp_path):
    """The Exchange (decentralized with holder blocks, replicated; exact and all-reduced shared
    tensors; uncompressed, bf16, int8, quantized, a moment's block code) and gather_full_model (copy,
    mean) route a product on its index lists and give, bit for bit, the values and bytes of the same
    plan stated flat, element by element (S gloo ranks, disjoint and overlapping rows and cols)."""
    import torch.multiprocessing as mp

    mp.spawn(_routed_worker, args=(S, str(tmp_path / "store"), str(tmp_path)), nprocs=S, join=True)
    assert [torch.load(tmp_path / f"checked{r}.pt") for r in range(S)] == [28] * S


def _random_blocks(g, S, per, shape):
    """Per rank, ``per`` (rows, cols) blocks of sorted random index lists (some empty; blocks of one
    rank and of different ranks may overlap)."""
    out = []
    for _ in range(S):
        mine = []
        for _ in range(per):
            r = torch.nonzero(torch.rand(shape[0], generator=g) < 0.4).flatten()
            c = torch.nonzero(torch.rand(shape[1], generator=g) < 0.4).flatten()
            mine.append((r, c))
        out.append(mine)
    return out


@pytest.mark.parametrize("S,per", [(3, 2), (4, 5), (9, 8)])  # 72 blocks: past the int64 key's 62 bits
def test_union_sizes_and_first_holders_from_blocks(S, per, monkeypatch):
    """routing.union_sizes / first_held_counts count, from the blocks, the elements ranks 0..k-1
    hold and those rank k holds first: equal to counting marked elements one by one (also with the
    row groups taken a few at a time)."""
    from ist_kernels.distributed import routing
    from ist_kernels.ops.slices import product

    g = torch.Generator().manual_seed(S * 10 + per)
    shape = (13, 17)
    blocks = _random_blocks(g, S, per, shape)
    held = [set() for _ in range(S)]
    for k in range(S):
        for r, c in blocks[k]:
            held[k] |= {(i, j) for i in r.tolist() for j in c.tolist()}
    want = [len(set().union(*held[:k])) for k in range(S + 1)]
    for chunk in (1 << 22, 20):  # 20 marks a chunk: one row group at a time
        monkeypatch.setattr(product, "UNION_CHUNK", chunk)
        monkeypatch.setattr(routing, "UNION_CHUNK", chunk)
        assert routing.union_sizes(blocks, shape, range(S + 1)) == want
        assert routing.first_held_counts(blocks, shape) == [want[k + 1] - want[k] for k in range(S)]
    assert routing.union_sizes([[] for _ in range(S)], shape, [S]) == [0]


def _elements(index):
    return [{(i, j) for i in r.tolist() for j in c.tolist()} for r, c in index]


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
@pytest.mark.parametrize("n", [2, 7, 70])  # 70 segments: past the int64 key's 62 bits
def test_union_numels_and_overlaps_against_elements(device, n, monkeypatch):
    """ops.slices.product.union_numels counts the elements of every prefix of the segments and
    overlaps says whether two segments share one: equal to sets of elements, on random segments (empty
    ones among them), on an IST partition (disjoint rows: the quick exit), on segments that share
    rows but not cols, on one shared element, on single elements with the one shared pair last, and
    with the row groups taken one at a time."""
    from ist_kernels.ops.slices import product

    g = torch.Generator().manual_seed(n)
    shape = (11, 19)

    def rand(p):
        return torch.nonzero(torch.rand(shape[0], generator=g) < p).flatten(), \
            torch.nonzero(torch.rand(shape[1], generator=g) < p).flatten()

    cases = {"random": [rand(0.3) for _ in range(n)] + [(torch.zeros(0, dtype=torch.int64), torch.arange(3))],
             "ist": [(torch.arange(shape[0])[k::n], torch.arange(shape[1])) for k in range(n)],
             "rows shared": [(torch.arange(shape[0]), torch.arange(shape[1])[k::n]) for k in range(n)]}
    one = [(torch.tensor([k]), torch.tensor([k])) for k in range(min(n, shape[0]))]  # a diagonal: no two meet
    cases["diagonal"] = one
    cases["one shared"] = one + [(torch.tensor([0, 10]), torch.tensor([18, 0]))] if n > 1 else one
    cells = torch.randperm(shape[0] * shape[1], generator=g)[:n].tolist()  # n elements, one a segment
    late = [(torch.tensor([c // shape[1]]), torch.tensor([c % shape[1]])) for c in cells]
    cases["late shared"] = late + [late[0]]  # only the last segment shares (overlaps' last batch)
    cases["elements"] = late
    for chunk in (1 << 22, 19):  # 19 marks a chunk: one row group at a time
        monkeypatch.setattr(product, "UNION_CHUNK", chunk)
        for name, index in cases.items():
            index = [(r.to(device), c.to(device)) for r, c in index]
            sets = _elements(index)
            upto = list(range(len(index) + 1))
            want = [len(set().union(*sets[:k])) for k in upto]
            assert product.union_numels(index, shape, upto) == want, name
            shared = any(sets[i] & sets[j] for j in range(len(sets)) for i in range(j))
            assert product.overlaps(index, shape) is shared, name
    assert product.union_numels([], shape, [0]) == [0]
    assert product.overlaps([], shape) is False


def _brute_pieces(contrib, need, shape):
    """Pair by pair, element by element: the rows (cols) of a that b holds, in a's order, and their
    places in each end's storage (a Part's ``store_*`` or, None, the full tensor)."""
    def place(store, i):
        return i if store is None else store.tolist().index(i)

    out = []
    for i, a in enumerate(contrib):
        for j, b in enumerate(need):
            rows = [x for x in a.rows.tolist() if x in b.rows.tolist()]
            cols = [x for x in a.cols.tolist() if x in b.cols.tolist()]
            if rows and cols:
                out.append((i, j, [place(a.store_rows, x) for x in rows], [place(a.store_cols, x) for x in cols],
                            [place(b.store_rows, x) for x in rows], [place(b.store_cols, x) for x in cols]))
    return out


@pytest.mark.parametrize("stores", ["held", "full", "mixed"])
def test_meet_pieces_against_pairwise_reference(stores):
    """routing.meet_pieces (all pairs of parts in one batch) lists the pairs that share rows and cols
    in (i, j) order, each piece's rows and cols at their places in the sender's and the receiver's
    storage, as a pair-by-pair element-wise reference does; empty parts meet nothing."""
    from ist_kernels.distributed.routing import Part, held_parts, meet_pieces, product_pieces

    g = torch.Generator().manual_seed(len(stores))
    shape = (12, 10)
    blocks = _random_blocks(g, 3, 3, shape)
    if stores == "held":
        contrib = [p for b in blocks[:2] for p in held_parts(b)]
        need = held_parts(blocks[2])
    elif stores == "full":
        contrib = [Part(r, c) for r, c in blocks[0] + blocks[1]]
        need = [Part(torch.arange(12), torch.arange(10))]
    else:  # parts lying inside bigger storage blocks (as first_held_parts gives), and full needs
        contrib = []
        for p in held_parts(blocks[0]):
            keep_r, keep_c = p.rows[::2], p.cols[1::2]
            contrib.append(Part(keep_r, keep_c, p.offset, p.store_rows, p.store_cols))
        contrib += held_parts(blocks[1])
        need = held_parts(blocks[2]) + [Part(torch.arange(12), torch.arange(10))]
    contrib.append(Part(torch.zeros(0, dtype=torch.int64), torch.arange(3)))  # empty rows: meets nothing
    got = meet_pieces(contrib, need, shape)
    want = _brute_pieces(contrib, need, shape)
    assert len(want) > 3
    assert [(i, j, s.rows.tolist(), s.cols.tolist(), r.rows.tolist(), r.cols.tolist()) for i, j, s, r in got] == want
    for i, j, s, r in got:
        a, b = contrib[i], need[j]
        assert (s.offset, s.height, s.width) == (a.offset, a.extent(0, 12), a.extent(1, 10))
        assert (r.offset, r.height, r.width) == (b.offset, b.extent(0, 12), b.extent(1, 10))
    send, recv = product_pieces(contrib, need, shape)
    assert [p.rows.tolist() for p in send] == [w[2] for w in want] and [p.cols.tolist() for p in recv] == [w[5] for w in want]
    assert meet_pieces([], need, shape) == [] and meet_pieces(contrib, [], shape) == []


def test_exchange_owner_lists_checked_naming_tensor_and_subnetwork():
    """The exchange's owner masks (routing.owner_ids, every list checked at once) refuse an owner
    list that is unsorted, repeats, leaves the dim or is not 1-D int64, naming the tensor and the
    subnetwork; a first index below the last list's last one is fine (a new list starts)."""
    spec = {"w": ((5, 3), torch.float32), "v": ((4,), torch.float32)}

    def plan(w1, v1):
        return SlicePlan(2, (TensorSlices("w", 0, (torch.tensor([3, 4]), w1)),
                             TensorSlices("v", 0, (torch.tensor([0, 3]), v1))))

    ok = plan(torch.tensor([0, 1, 2]), torch.tensor([1, 2]))
    assert plan_bytes(ok, plan(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3])), spec)[0].bytes_sent == 2 * 4
    for w1, v1, name, s in ((torch.tensor([2, 1]), torch.tensor([1]), "w", 1),
                            (torch.tensor([0, 5]), torch.tensor([1]), "w", 1),
                            (torch.tensor([0, 1, 2]), torch.tensor([1, 1]), "v", 1),
                            (torch.tensor([0, 1, 2]), torch.tensor([-1, 2]), "v", 1)):
        with pytest.raises(ValueError, match=rf"tensor '{name}': owner indices of subnetwork {s} must be sorted"):
            plan_bytes(plan(w1, v1), ok, spec)
    with pytest.raises(ValueError, match=r"tensor 'v': owner indices of subnetwork 1 must be a 1-D int64"):
        plan_bytes(plan(torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0])), ok, spec)


def test_comm_shares_one_exchange_per_round_and_plans(tmp_path, monkeypatch):
    """The trainer's Comm.exchange builds one Exchange for a round's calls between the same plans
    with the same options (the model's and each moment's exchange: the routing derived once) and
    gives the values of a fresh one; other options, another round or no spec build anew."""
    from ist_kernels.train import comm as comm_mod
    from ist_kernels.train.comm import Comm
    from ist_kernels.train.timing import Clock

    init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=30)
    try:
        built = []

        class Counted(Exchange):
            def __init__(self, *a, **k):
                built.append(k.get("round"))
                super().__init__(*a, **k)

        monkeypatch.setattr(comm_mod, "Exchange", Counted)
        g = torch.Generator().manual_seed(3)
        full = {"w": torch.randn(7, 5, generator=g), "v": torch.randn(6, 4, generator=g)}
        spec = {n: (tuple(x.shape), x.dtype) for n, x in full.items()}
        cur = SlicePlan(1, (TensorSlices("w", 0, (torch.arange(7),), (torch.arange(5),), 1),
                            TensorSlices("v", 0, (torch.arange(6),))))
        nxt = SlicePlan(1, (TensorSlices("w", 0, (torch.arange(7),), (torch.arange(5),), 1),
                            TensorSlices("v", 0, (torch.arange(6),))))  # equal, another object
        c = Comm(world_size=1, rank=0, distributed=True, local_workers=[0], shared="exact", clock=Clock())
        want = Exchange(cur, nxt, spec, shared="exact", round=1)(cur.part(full, 0))
        for _ in range(2):  # the model, then a moment keyed like it: one Exchange
            out = c.exchange(cur, nxt, spec, cur.part(full, 0), round=1)
            assert all(torch.equal(out[n], want[n]) for n in want)
        assert built == [1]
        c.exchange(cur, nxt, spec, {"v": cur.part(full, 0)["v"]}, round=1, names=["v"])  # a name set of the same Exchange
        assert built == [1]
        c.exchange(cur, nxt, spec, cur.part(full, 0), round=1, compress="bf16")  # other options
        c.exchange(cur, nxt, spec, cur.part(full, 0), round=2)  # the next round
        c.exchange(nxt, cur, spec, nxt.part(full, 0), round=2)  # other plans
        assert built == [1, 1, 2, 2]
    finally:
        destroy_process_group()


def test_integer_product_refused_by_the_byte_counts():
    """A product of an integer tensor is refused, naming it, by plan_bytes and gather_bytes (the
    exchange cannot average it element-wise as a float)."""
    plan = SlicePlan(1, (TensorSlices("c", 0, (torch.arange(3),), (torch.arange(2),), 1),))
    spec = {"c": ((3, 2), torch.int64)}
    with pytest.raises(ValueError, match=r"partitions the integer tensor 'c' as a product"):
        plan_bytes(plan, plan, spec)
    with pytest.raises(ValueError, match=r"partitions the integer tensor 'c' as a product"):
        gather_bytes(plan, spec)


@pytest.mark.parametrize("S,per", [(3, 2), (4, 4)])
def test_first_held_parts_are_each_elements_lowest_holder(S, per, monkeypatch):
    """routing.first_held_parts (gather_full_model's copy: each element from its lowest holder) gives
    rank k exactly the elements its blocks hold and no lower rank's do, each once, as parts lying in
    the block of its storage they came from; also with the row groups taken one at a time."""
    from ist_kernels.distributed import routing

    g = torch.Generator().manual_seed(S + per)
    shape = (14, 9)
    blocks = []
    for _ in range(S):  # a rank's blocks: disjoint row sets, random cols
        rows = torch.randperm(shape[0], generator=g)[:10].sort().values
        mine = []
        for r in rows.tensor_split(per):
            c = torch.nonzero(torch.rand(shape[1], generator=g) < 0.5).flatten()
            mine.append((r.sort().values, c))
        blocks.append(mine)
    held = [{(i, j) for r, c in b for i in r.tolist() for j in c.tolist()} for b in blocks]
    for chunk in (1 << 22, 9):
        monkeypatch.setattr(routing, "UNION_CHUNK", chunk)
        parts = routing.first_held_parts(blocks, shape)
        for k in range(S):
            got = [(i, j) for p in parts[k] for i in p.rows.tolist() for j in p.cols.tolist()]
            assert len(got) == len(set(got)) and set(got) == held[k] - set().union(*held[:k])
            starts = {}
            for r, c in blocks[k]:
                starts[len(starts) and sum(x.numel() * y.numel() for x, y in blocks[k][:len(starts)])] = (r, c)
            for p in parts[k]:
                r, c = starts[p.offset]
                assert torch.equal(p.store_rows, r) and torch.equal(p.store_cols, c)
                assert set(p.rows.tolist()) <= set(r.tolist()) and set(p.cols.tolist()) <= set(c.tolist())
