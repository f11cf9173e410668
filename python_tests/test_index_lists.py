"""Index lists of every layout and every kind of mistake through every entry point that takes one
(issue 19, item 7): the functional API, ``torch.ops.ist_kernels``, and the internal backends --
``ist_kernels.ops.subnet._triton`` (the raw Triton launchers, under TRITON_INTERPRET=1 on CPU),
``ist_kernels.ops.subnet.triton_subnet_linear`` and ``ist_kernels.ops.subnet._aten`` (torch ops, so it
runs on CPU tensors).

Valid layouts (a stride-2 view with out-of-range junk between the entries, a column of a 2-D
tensor, a view at a storage offset, empty lists) must give the float64 reference's result; a
launcher that read an index list with unit stride gave errors of 3.4 (junk in range) or crashed
(junk out of range). Mistakes (out of range, negative, int32, 2-D, repeated) must raise the
documented type, name the argument, and leave every tensor unchanged. The fuzz driver
(tools/fuzz_triton.py) draws random cases of the same kind, each in a subprocess.
"""
import pytest
import torch

import ist_kernels.functional as F

import reference as ref
from conftest import HAS_CUDA, HAS_TRITON

ops = torch.ops.ist_kernels
TRITON_ON_CPU = HAS_TRITON and not HAS_CUDA  # the interpreter (conftest sets TRITON_INTERPRET=1)


# ------------------------------------------------------------------------------------ index lists
def strided(values, junk=2**40):
    """A stride-2 view with ``junk`` between the entries (and before and after them)."""
    buf = torch.full((2 * len(values) + 1,), junk, dtype=torch.int64)
    buf[1::2] = torch.tensor(values, dtype=torch.int64)
    return buf[1::2]


def column(values):
    """Column 1 of a [n, 3] tensor: stride 3, junk in range on either side."""
    buf = torch.zeros(len(values), 3, dtype=torch.int64)
    buf[:, 1] = torch.tensor(values, dtype=torch.int64)
    return buf[:, 1]


def offset(values):
    """A contiguous view at storage offset 5."""
    buf = torch.full((len(values) + 7,), -1, dtype=torch.int64)
    buf[5:5 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return buf[5:5 + len(values)]


def plain(values):
    return torch.tensor(values, dtype=torch.int64)


LAYOUTS = {"strided": strided, "strided-junk-in-range": lambda v: strided(v, junk=0), "column": column,
           "offset": offset, "contiguous": plain}
# (how to build the bad list from a valid one, exception type, message pattern; {name} is the argument)
MISTAKES = {
    "out-of-range": (lambda v, size: strided([*v[:-1], size]), IndexError, r"{name}\[\d+\] = \d+ is out of range"),
    "negative": (lambda v, size: plain([-1, *v[1:]]), IndexError, r"{name}\[0\] = -1 is out of range"),
    "int32": (lambda v, size: plain(v).to(torch.int32), TypeError, r"{name} must be (an )?int64"),
    "2-D": (lambda v, size: plain(v)[None], ValueError, r"{name} must be 1-D"),
    "repeated": (lambda v, size: strided([v[0], *v[:-1]]), ValueError, r"{name} must not repeat an index"),
}


# ---------------------------------------------------------------------------------- subnet_linear
def _f_subnet(x, w, b, rows, cols):
    """F.subnet_linear and its autograd: (y, grad_x, grad_weight, grad_bias) for grad_out ``g``."""
    return F.subnet_linear(x, w, b, rows, cols)


def _subnet_entries():
    """name -> (forward, backward or None); backward: (g, x, w, rows, cols, mask) -> 3 tensors."""
    entries = {"F.subnet_linear": (_f_subnet, None),
               "torch.ops": (ops.subnet_linear, ops.subnet_linear_backward)}
    from ist_kernels.ops.subnet import _aten as C
    entries["ist_kernels.ops.subnet._aten"] = (C.subnet_linear, C.subnet_linear_backward)
    if TRITON_ON_CPU:
        from ist_kernels.ops.subnet import _triton as T, triton_subnet_linear, triton_subnet_linear_backward
        entries["ist_kernels.ops.subnet._triton"] = (T.subnet_linear, T.subnet_linear_backward)
        entries["ops.subnet.triton_subnet_linear"] = (triton_subnet_linear, triton_subnet_linear_backward)
    return entries


SUBNET = _subnet_entries()
N, K = 9, 8
ROWS, COLS = [5, 1, 0, 8], [6, 2, 7]


def _subnet_problem(gen, nr, nc):
    w = torch.randn(N, K, generator=gen)
    b = torch.randn(N, generator=gen)
    x = torch.randn(3, nc, generator=gen)
    g = torch.randn(3, nr, generator=gen)
    return x, w, b, g


def _check_subnet(entry, x, w, b, g, rows, cols):
    fwd, bwd = SUBNET[entry]
    want_y = ref.subnet_linear(x, w, b, rows, cols)
    want = ref.subnet_linear_backward(g, x, w, rows, cols)
    if bwd is None:  # the functional API: gradients through autograd
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        y = fwd(xr, wr, br, rows, cols)
        y.backward(g)
        got = (xr.grad, wr.grad, br.grad)
    else:
        y = fwd(x, w, b, rows, cols)
        got = bwd(g, x, w, rows, cols, [True, True, True])
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want_y, **tol)
    for name, a, e in zip(("grad_x", "grad_weight", "grad_bias"), got, want):
        torch.testing.assert_close(a.double(), e, **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", SUBNET)
def test_subnet_index_layouts(entry, layout, gen):
    rows, cols = LAYOUTS[layout](ROWS), LAYOUTS[layout](COLS)
    x, w, b, g = _subnet_problem(gen, len(ROWS), len(COLS))
    _check_subnet(entry, x, w, b, g, rows, cols)
    # one list: the other dimension whole
    _check_subnet(entry, torch.randn(3, K, generator=gen), w, b, g, rows, None)
    _check_subnet(entry, x, w, b, torch.randn(3, N, generator=gen), None, cols)


@pytest.mark.parametrize("entry", SUBNET)
def test_subnet_empty_index_lists(entry, gen):
    for rows, cols in ((strided([]), plain(COLS)), (plain(ROWS), strided([])), (plain([]), plain([]))):
        x, w, b, g = _subnet_problem(gen, len(rows), len(cols))
        _check_subnet(entry, x, w, b, g, rows, cols)


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("which", ["rows", "cols"])
@pytest.mark.parametrize("entry", SUBNET)
def test_subnet_bad_index_lists(entry, which, mistake, gen):
    make, kind, pattern = MISTAKES[mistake]
    rows, cols = plain(ROWS), plain(COLS)
    if which == "rows":
        rows = make(ROWS, N)
    else:
        cols = make(COLS, K)
    x, w, b, g = _subnet_problem(gen, len(ROWS), len(COLS))
    fwd, bwd = SUBNET[entry]
    args = [x, w, b, rows, cols]
    before = [t.clone() for t in args]
    with pytest.raises(kind, match=pattern.format(name=which)):
        fwd(*args)
    if bwd is not None:
        with pytest.raises(kind, match=pattern.format(name=which)):
            bwd(g, x, w, rows, cols, [True, True, True])
    for t, c in zip(args, before):
        assert torch.equal(t, c)


# ------------------------------------------------------------------------- slice gather / scatter
def _sources(gen):
    return [torch.randn(6, 4, generator=gen), torch.randn(3, 7, generator=gen)]


DIMS = [0, 1]
IDS = [0, 1, 0]
LISTS = [[4, 0, 2], [6, 1], [1, 5]]


def _gather_entries():
    def into(sources, ids, indices, dims):
        n = sum(sources[s].numel() // sources[s].shape[dims[s]] * len(i) for s, i in zip(ids, indices))
        out = torch.empty(n)
        ops.slice_gather_into_(out, sources, ids, indices, dims)
        return out

    return {"F.gather_slices": lambda *a: torch.cat([s.reshape(-1) for s in F.gather_slices(*a)]),
            "torch.ops.slice_gather": ops.slice_gather, "torch.ops.slice_gather_into_": into}


def _scatter_entries():
    def owner_average(targets, ids, updates, indices, dims, reduce):  # one target only
        F.owner_average_(targets[0], updates, indices, dims[0])

    return {"F.scatter_slices_": F.scatter_slices_, "torch.ops.slice_scatter_": ops.slice_scatter_,
            "F.owner_average_": owner_average}


GATHER, SCATTER = _gather_entries(), _scatter_entries()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", GATHER)
def test_gather_index_layouts(entry, layout, gen):
    sources = _sources(gen)
    indices = [LAYOUTS[layout](v) for v in LISTS] + [strided([])]
    ids = IDS + [1]
    torch.testing.assert_close(GATHER[entry](sources, ids, indices, DIMS),
                               ref.slice_gather(sources, ids, indices, DIMS), rtol=0, atol=0)  # a copy: exact


def _scatter_problem(gen, entry, layout):
    if entry == "F.owner_average_":  # one target, several owners
        targets, ids, lists = [torch.randn(6, 4, generator=gen)], [0, 0, 0], [[4, 0, 2], [0, 5], []]
    else:
        targets, ids, lists = _sources(gen), IDS + [1], LISTS + [[]]
    indices = [LAYOUTS[layout](v) for v in lists]
    dims = [0] if entry == "F.owner_average_" else DIMS
    updates = [torch.randn(*(len(v) if d == dims[t] else n for d, n in enumerate(targets[t].shape)), generator=gen)
               for t, v in zip(ids, lists)]
    return targets, ids, updates, indices, dims


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entry", SCATTER)
def test_scatter_index_layouts(entry, layout, gen):
    targets, ids, updates, indices, dims = _scatter_problem(gen, entry, layout)
    for reduce in (("mean",) if entry == "F.owner_average_" else ("copy", "sum", "mean")):
        ts = [t.clone() for t in targets]
        want = ref.slice_scatter(ts, ids, updates, indices, dims, reduce)
        SCATTER[entry](ts, ids, updates, indices, dims, reduce)
        for a, e in zip(ts, want):
            torch.testing.assert_close(a.double(), e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize("entry", [*GATHER, *SCATTER])
def test_slices_bad_index_lists(entry, mistake, gen):
    make, kind, pattern = MISTAKES[mistake]
    if entry in GATHER:
        sources = _sources(gen)
        indices = [plain(v) for v in LISTS]
        indices[2] = make(LISTS[2], sources[0].shape[0])
        args = [sources, IDS, indices, DIMS]
        fn = GATHER[entry]
    else:
        targets, ids, updates, indices, dims = _scatter_problem(gen, entry, "contiguous")
        v = [4, 0, 2]
        indices[0] = make(v, targets[0].shape[0])
        if mistake == "2-D":
            updates[0] = updates[0][None]
        args = [targets, ids, updates, indices, dims, "mean"]
        fn = SCATTER[entry]
    name = "indices\\[2\\]" if entry in GATHER else "indices\\[0\\]"
    if mistake == "2-D":
        name = "indices(\\[[02]\\])?"
    tensors = [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    with pytest.raises(kind, match=pattern.format(name=name)):
        fn(*args)
    for t, c in zip(tensors, before):
        assert torch.equal(t, c)
