"""Property tests (hypothesis): every op against the independent float64 references of reference.py,
over random shapes (0 and 1 included), dtypes, memory layouts (offset, strided and transposed
views; overlapping views where the op only reads them; interleaved, non-overlapping views where
it writes them) and index lists (empty, unsorted, strided views with in-range junk between the
entries, repeated across lists where allowed), on the C++ kernels and, for the GEMM-shaped ops, on
the Triton launchers (under TRITON_INTERPRET=1 without a GPU: small shapes, fp32/fp16/fp64).

The number of examples comes from the hypothesis profile (python_tests/conftest.py: "ci", 200
per test, no deadline, failing examples printed with their reproduction blob). Tolerances are
error bounds, not fudge factors: for a sum of n terms, (n + 2) units of roundoff of the
accumulation times the sum of the terms' magnitudes, plus the output's own rounding.
"""
import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import (  # noqa: E402
    given,
    note,
    strategies as st,  # noqa: E402
)

import ist_kernels.functional as F  # noqa: E402

import reference as ref  # noqa: E402
from conftest import HAS_CUDA, HAS_TRITON  # noqa: E402

ops = torch.ops.ist_kernels

from ist_kernels.ops.subnet import _aten as gather_gemm  # noqa: E402 (the CUDA backend of subnet_linear: torch ops)

if HAS_TRITON and not HAS_CUDA:
    from ist_kernels.ops.grelu import _triton as tg
    from ist_kernels.ops.subnet import triton_subnet_linear, triton_subnet_linear_backward

    BACKENDS = ["cpp", "triton"]
else:  # on a GPU the op itself dispatches CUDA tensors to Triton (test_grelu_ops / test_subnet)
    BACKENDS = ["cpp"]

GEMM_CPU_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TRITON_DTYPES = [torch.float32, torch.float16, torch.float64]  # bf16 tl.dot is wrong in the interpreter
SLICE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
REDUCIBLE = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8]


# ---------------------------------------------------------------------------------------- inputs
def generator(data):
    """Values come from a torch generator seeded by hypothesis (the seed is part of the example)."""
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))


def values(shape, dtype, gen, special=None):
    """Random values; with ``special`` ("inf" or "huge"), floating entries are drawn from a pool
    of non-finite values (and, for "huge", the dtype's largest ones) about half the time, so that
    owners of one element often combine them."""
    if special and dtype.is_floating_point:
        x = values(shape, dtype, gen)
        big = torch.finfo(dtype).max * 0.9 if special == "huge" and dtype != torch.float64 else 1.0
        pool = torch.tensor([math.inf, -math.inf, math.nan, big, -big, 0.0, -0.0], dtype=torch.float64).to(dtype)
        pick = torch.randint(0, 2 * pool.numel(), shape, generator=gen)
        return torch.where(pick < pool.numel(), pool[pick.clamp(max=pool.numel() - 1)], x)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) + 1j * torch.randn(shape, generator=gen)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -100), min(info.max, 100) + 1, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def layout(data, x, *, allow=("contiguous", "offset", "strided", "transposed")):
    """x (contiguous) re-laid out in memory, same values: at an offset into a larger buffer, as an
    every-other-element view, or as a transposed view."""
    kind = data.draw(st.sampled_from(allow), label="layout")
    if kind == "offset":
        buf = torch.empty(x.numel() + 3, dtype=x.dtype)
        v = buf[3:].view(x.shape)
    elif kind == "strided" and x.dim() >= 1:
        v = torch.empty((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)[..., ::2]
    elif kind == "transposed" and x.dim() >= 2:
        v = torch.empty(tuple(reversed(x.shape)), dtype=x.dtype).permute(*reversed(range(x.dim())))
    else:
        return x
    v.copy_(x)
    return v


def index_list(data, gen, size, *, n=None, label="indices"):
    """n unique entries of range(size), unsorted (sometimes sorted), n drawn when None (0 allowed),
    as a contiguous tensor or a strided view with in-range junk between the entries."""
    if n is None:
        n = data.draw(st.one_of(st.just(0), st.just(size), st.integers(0, size)), label=f"len({label})")
    idx = torch.randperm(size, generator=gen)[:n]
    if data.draw(st.booleans(), label=f"{label} sorted"):
        idx = idx.sort().values
    if n and data.draw(st.booleans(), label=f"{label} strided"):
        buf = torch.randint(0, size, (2 * n + 1,), generator=gen)  # junk that a stride bug would read
        buf[1::2] = idx
        idx = buf[1::2]
        assert idx.stride(0) == 2
    return idx


def shape_of(data, rank_max=3, size_max=5, label="shape"):
    rank = data.draw(st.integers(0, rank_max), label=f"rank({label})")
    return tuple(data.draw(st.lists(st.integers(0, size_max), min_size=rank, max_size=rank), label=label))


def same_bits(a, b):
    """a and b hold the same bits (NaNs only need to be NaN at the same places)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = torch.where(nan_a, 0, a), torch.where(nan_b, 0, b)
    if a.numel() == 0:
        return True
    flat = [torch.empty(x.numel(), dtype=x.dtype).copy_(x.reshape(-1)) for x in (a, b)]  # unit stride
    return torch.equal(flat[0].view(torch.uint8), flat[1].view(torch.uint8))


def segment_numel(shape, dim, n):
    """Elements of the compact segment holding n slices of a tensor of ``shape`` along ``dim``."""
    s = list(shape)
    s[dim % len(s)] = n
    return math.prod(s)


# ------------------------------------------------------------------------------------ tolerances
def unit(dtype):
    """Unit roundoff of a floating dtype."""
    return torch.finfo(dtype).eps / 2


def acc_unit(dtype):
    """Unit roundoff of the accumulation: float64 for float64, float32 for the others."""
    return unit(torch.float64 if dtype == torch.float64 else torch.float32)


def assert_within(got, want, mag, n, dtype, what):
    """|got - want| <= (n + 2) u_acc mag + 2 u_out |want| elementwise (want, mag: float64), NaN and
    infinities where the reference has them."""
    got = got.detach().double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    finite = torch.isfinite(want)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert same[~finite].all(), f"{what}: non-finite entries differ"
    bound = (n + 2) * acc_unit(dtype) * mag + 2 * unit(dtype) * want.abs() + torch.finfo(dtype).tiny
    err = (got - want).abs()
    bad = finite & ~(err <= bound)
    assert not bad.any(), f"{what}: max error {err[bad].max().item()} > bound {bound[bad].min().item()}"


# ---------------------------------------------------------------------------------------- gates
@given(st.data())
def test_pack_gates(data):
    gen = generator(data)
    dtype = data.draw(st.sampled_from([torch.bool, torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    shape = (*shape_of(data, 2, 4, "lead"), data.draw(st.integers(0, 70), label="features"))
    special = data.draw(st.sampled_from([None, "inf"]), label="special values")  # nan and -0 are off, inf on
    mask = layout(data, values(shape, dtype, gen, special))
    before = mask.clone()
    words = ops.pack_gates(mask)
    assert torch.equal(words, ref.pack_gates(mask))
    assert torch.equal(ops.unpack_gates(words, shape[-1]), mask > 0 if dtype != torch.bool else mask)
    assert same_bits(mask, before)


@given(st.data())
def test_unpack_gates(data):
    gen = generator(data)
    features = data.draw(st.integers(0, 100), label="features")
    shape = (*shape_of(data, 2, 4, "lead"), (features + 31) // 32)
    words = layout(data, torch.randint(-2**31, 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32))
    got = ops.unpack_gates(words, features)
    assert torch.equal(got, ref.unpack_gates(words, features))
    # packing the unpacked gates clears exactly the padding bits
    assert torch.equal(ops.pack_gates(got), ref.pack_gates(ref.unpack_gates(words, features)))


# ------------------------------------------------------------------------------------ GReLU layers
def grelu_case(data, gen, backend):
    dtype = data.draw(st.sampled_from(GEMM_CPU_DTYPES if backend == "cpp" else TRITON_DTYPES), label="dtype")
    small = backend == "triton"
    lead = shape_of(data, 2 if not small else 1, 4, "lead")
    K = data.draw(st.integers(0, 40 if not small else 20), label="K")
    N = data.draw(st.integers(0, 70 if not small else 36), label="N")
    x, w = inputs_maybe_overlapping(data, gen, (*lead, K), (N, K), dtype)
    b = layout(data, values((N,), dtype, gen)) if data.draw(st.booleans(), label="bias") else None
    words = torch.randint(-2**31, 2**31, (*lead, (N + 31) // 32), generator=gen).to(torch.int32)
    return dtype, x, w, b, layout(data, words)


def inputs_maybe_overlapping(data, gen, x_shape, w_shape, dtype):
    """x and weight, re-laid out on their own, or (both only read) as views of one buffer that may
    overlap."""
    if data.draw(st.booleans(), label="x and weight share a buffer"):
        nx, nw = math.prod(x_shape), math.prod(w_shape)
        buf = values((nx + nw,), dtype, gen)
        start = data.draw(st.integers(0, nw), label="x starts at")  # x overlaps the end of weight
        return buf[start:start + nx].view(x_shape), buf[:nw].view(w_shape)
    return (layout(data, values(x_shape, dtype, gen)),
            layout(data, values(w_shape, dtype, gen), allow=("contiguous", "offset", "transposed", "strided")))


def z_and_magnitude(x, w, b):
    z = ref._linear64(x, w, b)
    mag = ref.linear_magnitude(x, w, b)
    return z, mag


@given(st.data(), st.sampled_from(BACKENDS))
def test_relu_gates(data, backend):
    gen = generator(data)
    dtype, x, w, b, _ = grelu_case(data, gen, backend)
    fn = ops.relu_gates if backend == "cpp" else tg.relu_gates
    out, gates = fn(x, w, b)
    N, K = w.shape
    z, mag = z_and_magnitude(x, w, b)
    assert out.dtype == dtype and gates.dtype == torch.int32
    assert_within(out, torch.relu(z), mag, K, dtype, "out")
    # The gates are the on/off pattern of the kernel's own output, padding bits clear ...
    assert torch.equal(gates, ref.pack_gates(out > 0))
    # ... and the reference's wherever z is further from 0 than the rounding bound.
    sure = (z.abs() > (K + 2) * acc_unit(dtype) * mag + 2 * unit(dtype) * z.abs())
    on = ref.unpack_gates(gates, N)
    assert torch.equal(on[sure], (z > 0)[sure])


@given(st.data(), st.sampled_from(BACKENDS))
def test_gated_linear(data, backend):
    gen = generator(data)
    dtype, x, w, b, gates = grelu_case(data, gen, backend)
    fwd, bwd = (ops.gated_linear, ops.gated_linear_backward) if backend == "cpp" else (tg.gated_linear,
                                                                                       tg.gated_linear_backward)
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    on = ref.unpack_gates(gates, N).double()
    y = fwd(x, w, b, gates)
    z, mag = z_and_magnitude(x, w, b)
    assert_within(y, z * on, mag * on, K, dtype, "y")
    assert (y[on == 0] == 0).all(), "an off gate must give exactly 0"
    g = layout(data, values(y.shape, dtype, gen))
    mask = data.draw(st.lists(st.booleans(), min_size=3, max_size=3), label="output_mask")
    got = bwd(g, x, w, gates, mask)
    want = ref.gated_linear_backward(g, x, w, gates)
    gm = g.double().abs() * on
    mags = (gm @ w.double().abs(), gm.reshape(M, N).T @ x.double().abs().reshape(M, K), gm.reshape(M, N).sum(0))
    for name, asked, t, r, m, n, like in zip(("grad_x", "grad_weight", "grad_bias"), mask, got, want, mags,
                                             (N, M, M), (x.shape, w.shape, (N,))):
        if not asked:
            assert t.shape == (0,), name
            continue
        assert t.shape == like and t.dtype == dtype, name
        assert_within(t, r, m, n, dtype, name)


# ---------------------------------------------------------------------------------- subnet_linear
@given(st.data(), st.sampled_from(BACKENDS + ["gather-gemm"]))
def test_subnet_linear(data, backend):
    gen = generator(data)
    small = backend != "cpp"
    dtype = data.draw(st.sampled_from({"cpp": GEMM_CPU_DTYPES,
                                       "gather-gemm": GEMM_CPU_DTYPES, "triton": TRITON_DTYPES}[backend]), label="dtype")
    N = data.draw(st.integers(0, 40 if not small else 24), label="N")
    K = data.draw(st.integers(0, 40 if not small else 24), label="K")
    rows = index_list(data, gen, N, label="rows") if data.draw(st.booleans(), label="has rows") else None
    cols = index_list(data, gen, K, label="cols") if data.draw(st.booleans(), label="has cols") else None
    Nr = N if rows is None else rows.numel()
    Kc = K if cols is None else cols.numel()
    lead = shape_of(data, 2 if not small else 1, 4, "lead")
    x, w = inputs_maybe_overlapping(data, gen, (*lead, Kc), (N, K), dtype)
    b = layout(data, values((N,), dtype, gen)) if data.draw(st.booleans(), label="bias") else None
    note(f"rows={rows} cols={cols}")
    fwd, bwd = {"cpp": (ops.subnet_linear, ops.subnet_linear_backward),
                "gather-gemm": (gather_gemm.subnet_linear, gather_gemm.subnet_linear_backward),
                "triton": (triton_subnet_linear, triton_subnet_linear_backward) if "triton" in BACKENDS else None}[backend]
    inputs = [t for t in (x, w, b, rows, cols) if t is not None]
    saved = [t.clone() for t in inputs]
    y = fwd(x, w, b, rows, cols)
    r = torch.arange(N) if rows is None else rows
    c = torch.arange(K) if cols is None else cols
    wsub = w.double().abs()[r][:, c]
    mag = ref.linear_magnitude(x, wsub, None if b is None else b[r])
    assert y.dtype == dtype
    assert_within(y, ref.subnet_linear(x, w, b, rows, cols), mag, Kc, dtype, "y")
    g = layout(data, values(y.shape, dtype, gen))
    mask = data.draw(st.lists(st.booleans(), min_size=3, max_size=3), label="output_mask")
    got = bwd(g, x, w, rows, cols, mask)
    want = ref.subnet_linear_backward(g, x, w, rows, cols)
    M = math.prod(x.shape[:-1])
    ga, xa = g.double().abs().reshape(M, Nr), x.double().abs().reshape(M, Kc)
    full_w = torch.zeros(N, K, dtype=torch.float64)
    full_w[r[:, None], c[None, :]] = ga.T @ xa
    full_b = torch.zeros(N, dtype=torch.float64)
    full_b[r] = ga.sum(0)
    mags = ((ga @ wsub).reshape(x.shape), full_w, full_b)
    for name, asked, t, rr, m, n, like in zip(("grad_x", "grad_weight", "grad_bias"), mask, got, want, mags,
                                              (Nr, M, M), (x.shape, w.shape, (N,))):
        if not asked:
            assert t.shape == (0,), name
            continue
        assert t.shape == like and t.dtype == dtype, name
        assert_within(t, rr, m, n, dtype, name)
        if name != "grad_x":  # exactly zero outside rows x cols (never uninitialised memory)
            assert (t.double()[m == 0] == 0).all(), f"{name} is not zero outside the subnetwork"
    for t, s in zip(inputs, saved):
        assert torch.equal(t, s)


# ----------------------------------------------------------------------------------------- slices
def sliced_tensors(data, gen, dtypes, *, count_max=3, label="tensors"):
    """1-3 tensors (rank 1-3, sizes 0-5) of the given dtypes, each with a dim; laid out on their
    own or as views of one shared buffer (see the callers)."""
    count = data.draw(st.integers(1, count_max), label=f"len({label})")
    shapes, dims, kinds = [], [], []
    for t in range(count):
        shape = shape_of(data, 3, 5, f"{label}[{t}].shape")
        if not shape:
            shape = (data.draw(st.integers(0, 5)),)
        shapes.append(shape)
        dims.append(data.draw(st.integers(-len(shape), len(shape) - 1), label=f"dims[{t}]"))
        kinds.append(data.draw(st.sampled_from(dtypes), label=f"{label}[{t}].dtype"))
    return shapes, dims, kinds


def segments(data, gen, shapes, dims, *, repeat_across=True, count_max=5):
    """Segment ids and index lists: each a set of unique slices of its tensor, unsorted, possibly
    empty or strided; across segments, slices repeat (several owners). Some lists are views of
    one shared buffer (read-only inputs may overlap)."""
    count = data.draw(st.integers(0, count_max), label="segments")
    ids, idx = [], []
    for j in range(count):
        t = data.draw(st.integers(0, len(shapes) - 1), label=f"ids[{j}]")
        size = shapes[t][dims[t] % len(shapes[t])]
        ids.append(t)
        idx.append(index_list(data, gen, size, label=f"indices[{j}]"))
    if count >= 2 and repeat_across and data.draw(st.booleans(), label="shared list"):
        # one list object used twice, or an overlapping window of another's memory
        j, k = data.draw(st.permutations(range(count)), label="share")[:2]
        if shapes[ids[j]][dims[ids[j]] % len(shapes[ids[j]])] == shapes[ids[k]][dims[ids[k]] % len(shapes[ids[k]])]:
            idx[k] = idx[j]
    return ids, idx


def read_only_views(data, gen, shapes, kinds, label, special=None):
    """Tensors to be read: separate (re-laid out) tensors, or, for one dtype, views of one buffer
    that may overlap each other."""
    if len(set(kinds)) == 1 and data.draw(st.booleans(), label=f"{label} share a buffer"):
        numels = [math.prod(s) for s in shapes]
        buf = values((max(numels, default=0) + sum(numels) // 2 + 1,), kinds[0], gen, special)
        out = []
        for s, n in zip(shapes, numels):
            start = data.draw(st.integers(0, buf.numel() - n), label=f"{label} offset")
            out.append(buf[start:start + n].view(s))
        return out
    return [layout(data, values(s, k, gen, special)) for s, k in zip(shapes, kinds)]


@given(st.data())
def test_slice_gather(data):
    gen = generator(data)
    mixed = data.draw(st.booleans(), label="mixed dtypes")
    dtype = data.draw(st.sampled_from(SLICE_DTYPES), label="dtype")
    shapes, dims, kinds = sliced_tensors(data, gen, SLICE_DTYPES if mixed else [dtype], label="sources")
    sources = read_only_views(data, gen, shapes, kinds, "sources")
    ids, idx = segments(data, gen, shapes, dims)
    saved = [s.clone() for s in sources]
    want = [sources[s].index_select(dims[s] % sources[s].dim(), i) for s, i in zip(ids, idx)]
    parts = F.gather_slices(sources, ids, idx, dims)
    for p, w in zip(parts, want):
        assert p.dtype == w.dtype and torch.equal(p, w)
    if len(set(kinds)) == 1:
        flat = ops.slice_gather(sources, ids, idx, dims)
        assert torch.equal(flat, ref.slice_gather(sources, ids, idx, dims))
    for s, c in zip(sources, saved):
        assert torch.equal(s, c)


@given(st.data())
def test_slice_gather_into(data):
    """The caller's buffer: a contiguous piece of a larger buffer that may also hold the (strided)
    sources elsewhere, or interleaved with them without sharing an element; or GatherBuffers."""
    gen = generator(data)
    dtype = data.draw(st.sampled_from(SLICE_DTYPES), label="dtype")
    shapes, dims, kinds = sliced_tensors(data, gen, [dtype], label="sources")
    ids, idx = segments(data, gen, shapes, dims)
    total = sum(segment_numel(shapes[s], dims[s], i.numel()) for s, i in zip(ids, idx))
    where = data.draw(st.sampled_from(["own buffer", "beside the sources", "GatherBuffers"]), label="out")
    if where == "beside the sources":
        # sources as every-other-element views of the front of one buffer, out behind them
        numels = [math.prod(s) for s in shapes]
        buf = values((2 * sum(numels) + total + 2,), dtype, gen)
        sources, at = [], 0
        for s, n in zip(shapes, numels):
            sources.append(buf[at:at + 2 * n:2].view(s) if n else buf[at:at].view(s))
            at += 2 * n
        out = buf[at + 1:at + 1 + total]
    else:
        sources = read_only_views(data, gen, shapes, kinds, "sources")
        out = values((total + 5,), dtype, gen)[5:]
    saved = [s.clone() for s in sources]
    want = ref.slice_gather(sources, ids, idx, dims)
    if where == "GatherBuffers":
        holder = F.GatherBuffers()
        for _ in range(2):  # a fresh buffer, then (results dropped) the same one reused
            parts = F.gather_slices(sources, ids, idx, dims, out=holder)
            got = torch.cat([p.reshape(-1) for p in parts]) if parts else want[:0]
            assert torch.equal(got, want)
            del parts, got
    else:
        ops.slice_gather_into_(out, sources, ids, idx, dims)
        assert torch.equal(out, want)
    for s, c in zip(sources, saved):
        assert torch.equal(s, c)


def scatter_case(data, gen, reduce):
    """Targets (separate tensors, or interleaved non-overlapping views of one buffer), segments,
    and updates (separate, or overlapping views of one buffer); with mixed dtypes sometimes."""
    dtypes = REDUCIBLE if reduce != "copy" else SLICE_DTYPES
    # non-finite entries (sum, mean) and the largest finite ones (mean: it must not overflow)
    special = data.draw(st.sampled_from([None, None, "inf"] + (["huge", "huge"] if reduce == "mean" else [])),
                        label="special values")
    mixed = data.draw(st.booleans(), label="mixed dtypes")
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    shapes, dims, kinds = sliced_tensors(data, gen, dtypes if mixed else [dtype], label="targets")
    if len(set(kinds)) == 1 and data.draw(st.booleans(), label="targets interleaved"):
        # target t is every len(shapes)-th element of one buffer, starting at t: no element shared
        T = len(shapes)
        buf = values((T * max(math.prod(s) for s in shapes) + 1,), kinds[0], gen)
        targets = [buf[t::T][:math.prod(s)].view(s) for t, s in enumerate(shapes)]
    else:
        targets = [layout(data, values(s, k, gen, special)) for s, k in zip(shapes, kinds)]
    ids, idx = segments(data, gen, shapes, dims)
    upd_shapes = []
    for t, i in zip(ids, idx):
        s = list(shapes[t])
        s[dims[t] % len(s)] = i.numel()
        upd_shapes.append(tuple(s))
    updates = read_only_views(data, gen, upd_shapes, [kinds[t] for t in ids], "updates", special) if ids else []
    if ids and data.draw(st.booleans(), label="unchanged owners"):  # every owner returns the target's values
        updates = [targets[t].index_select(dims[t] % targets[t].dim(), i).clone() for t, i in zip(ids, idx)]
    return targets, ids, updates, idx, dims


def check_scatter(targets, ids, updates, idx, dims, reduce, got):
    """got (the targets after the op) against the reference; for sum / mean within the bound of
    the owners' magnitudes (and the target's, for sum)."""
    want = ref.slice_scatter(targets, ids, updates, idx, dims, reduce)
    absolute = [u.abs() if u.dtype != torch.bool else u for u in updates]
    base = [t.abs() if reduce == "sum" else torch.zeros_like(t) for t in targets] if reduce != "copy" else targets
    mag = ref.slice_scatter(base, ids, absolute, idx, dims, "sum") if reduce != "copy" else want
    owners = [0] * len(targets)
    for t in ids:
        owners[t] += 1
    for t, (g, w, m) in enumerate(zip(got, want, mag)):
        if g.dtype.is_floating_point and reduce != "copy":
            assert_within(g, w.to(g.dtype).double() if g.dtype != torch.float64 else w, m.double(), owners[t],
                          g.dtype, f"targets[{t}]")
        else:
            assert same_bits(g, w.to(g.dtype)), f"targets[{t}]"


@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
@given(data=st.data())
def test_slice_scatter(reduce, data):
    gen = generator(data)
    targets, ids, updates, idx, dims = scatter_case(data, gen, reduce)
    before = [t.clone() for t in targets]
    saved = [u.clone() for u in updates] + [i.clone() for i in idx]
    F.scatter_slices_(targets, ids, updates, idx, dims, reduce)
    check_scatter(before, ids, updates, idx, dims, reduce, targets)
    for a, b in zip(list(updates) + list(idx), saved):
        assert same_bits(a, b)
    # Owners that all return the target's values leave it unchanged, bit for bit (mean and copy).
    if reduce != "sum":
        unchanged = [t.index_select(d % t.dim(), i).clone() for t, i, d in
                     zip([targets[t] for t in ids], idx, [dims[t] for t in ids])]
        snapshot = [t.clone() for t in targets]
        F.scatter_slices_(targets, ids, unchanged, idx, dims, reduce)
        for t, (a, b) in enumerate(zip(targets, snapshot)):
            assert same_bits(a, b), f"targets[{t}] changed although every owner returned its values"


@given(st.data())
def test_owner_average(data):
    gen = generator(data)
    dtype = data.draw(st.sampled_from(REDUCIBLE), label="dtype")
    shape = shape_of(data, 3, 5, "shape") or (data.draw(st.integers(0, 5)),)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    target = layout(data, values(shape, dtype, gen))
    owners = data.draw(st.integers(0, 4), label="owners")
    idx = [index_list(data, gen, shape[dim % len(shape)], label=f"indices[{k}]") for k in range(owners)]
    special = data.draw(st.sampled_from([None, "inf", "huge"]), label="special values")
    updates = []
    for i in idx:
        s = list(shape)
        s[dim % len(s)] = i.numel()
        updates.append(layout(data, values(tuple(s), dtype, gen, special)))
    before = target.clone()
    got = F.owner_average_(target, updates, idx, dim)
    assert got is target
    check_scatter([before], [0] * owners, updates, idx, [dim], "mean", [target])
