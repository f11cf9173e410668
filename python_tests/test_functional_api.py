"""The public API in torch's style (issue 11 item 3): ``__all__`` everywhere, ``input`` first and
``bias=None`` in the functional API, docstrings with shapes, names that do not clash with torch's,
and the deprecated aliases (they warn and still compute the same)."""
import inspect
import warnings

import pytest
import torch

import ist_kernels
import ist_kernels.functional as F
import ist_kernels.nn

import reference as ref

FUNCTIONS = ["pack_gates", "unpack_gates", "gather_slices", "scatter_slices_", "owner_average_", "relu_gates",
             "gated_linear", "subnet_linear", "slice_plan"]
SINGLE_INPUT = ["pack_gates", "unpack_gates", "owner_average_", "relu_gates", "gated_linear", "subnet_linear"]


def test_all_lists_the_public_names():
    assert sorted(F.__all__) == sorted(FUNCTIONS + ["GatherBuffers", "PlannedSlices"])
    assert sorted(ist_kernels.nn.__all__) == ["GReLUMLP", "GatedLinear", "MaskedConv2d", "MaskedLinear", "SubnetMLP"]
    assert set(ist_kernels.__all__) == {"functional", "nn", "__version__"}
    for mod in (F, ist_kernels.nn, ist_kernels):
        for name in mod.__all__:
            assert hasattr(mod, name), f"{mod.__name__}.{name}"
    assert "slice_gather" not in F.__all__ and "slice_scatter_" not in F.__all__  # deprecated


@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_and_docstring(name):
    fn = getattr(F, name)
    params = inspect.signature(fn).parameters
    first = next(iter(params))
    assert first == ("input" if name in SINGLE_INPUT else {"gather_slices": "sources", "slice_plan": "tensors"}.get(name, "targets"))
    if "bias" in params:
        assert params["bias"].default is None, name
    if "out" in params:
        assert params["out"].kind is inspect.Parameter.KEYWORD_ONLY
    doc = inspect.getdoc(fn)
    assert doc and "[" in doc and "]" in doc, f"{name}: no shapes in the docstring"


def test_names_do_not_clash_with_torch():
    for name in F.__all__:
        base = name.rstrip("_")
        for ns in (torch, torch.Tensor, torch.nn.functional):
            assert not hasattr(ns, base) and not hasattr(ns, base + "_"), f"{name} clashes with {ns.__name__}.{base}"


def _slices_case(gen):
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    idx = [torch.tensor([4, 0, 2]), torch.tensor([1, 3]), torch.tensor([5, 1])]
    return [w, b], [0, 1, 0], idx, [1, 0]


def test_slice_gather_alias_warns_and_matches(gen):
    sources, ids, idx, dims = _slices_case(gen)
    with pytest.warns(FutureWarning, match="slice_gather is deprecated.*gather_slices"):
        flat = F.slice_gather(sources, ids, idx, dims)
    want = ref.slice_gather(sources, ids, idx, dims)
    assert torch.equal(flat, want)
    segs = F.gather_slices(sources, ids, idx, dims)
    assert torch.equal(torch.cat([s.reshape(-1) for s in segs]), want)
    out = torch.empty_like(want)
    with pytest.warns(FutureWarning):
        assert F.slice_gather(sources, ids, idx, dims, out=out) is out  # old keyword still works
    assert torch.equal(out, want)
    buf = torch.zeros_like(want)  # the flat form, without the alias: gather_slices(out=)
    views = F.gather_slices(sources, ids, idx, dims, out=buf)
    assert torch.equal(buf, want) and all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                                          for v in views)
    with pytest.raises(TypeError):
        F.gather_slices(sources, ids, idx, dims, out)  # out is keyword-only


@pytest.mark.parametrize("reduce", ["copy", "sum", "mean"])
def test_slice_scatter_alias_warns_and_matches(gen, reduce):
    targets, ids, idx, dims = _slices_case(gen)
    shapes = [s.shape for s in F.gather_slices(targets, ids, idx, dims)]
    updates = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    a, b = [t.clone() for t in targets], [t.clone() for t in targets]
    F.scatter_slices_(a, ids, updates, idx, dims, reduce)
    with pytest.warns(FutureWarning, match="slice_scatter_ is deprecated.*scatter_slices_"):
        F.slice_scatter_(targets=b, target_ids=ids, updates=updates, indices=idx, dims=dims, reduce=reduce)
    want = ref.slice_scatter(targets, ids, updates, idx, dims, reduce)
    for x, y, z in zip(a, b, want):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-12)


def test_gated_linear_bias_optional_and_old_order_warns(gen):
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    b = torch.randn(7, generator=gen, dtype=torch.float64)
    gates = F.pack_gates(torch.rand(3, 7, generator=gen) > 0.5)
    torch.testing.assert_close(F.gated_linear(x, w, gates), ref.gated_linear(x, w, None, gates), rtol=1e-12, atol=1e-12)
    y = F.gated_linear(x, w, gates, b)
    torch.testing.assert_close(y, ref.gated_linear(x, w, b, gates), rtol=1e-12, atol=1e-12)
    assert torch.equal(F.gated_linear(input=x, weight=w, gates=gates, bias=b), y)
    with pytest.warns(FutureWarning, match=r"gated_linear\(input, weight, gates, bias=None\)"):
        old = F.gated_linear(x, w, b, gates)
    assert torch.equal(old, y)
    with pytest.warns(FutureWarning):
        assert torch.equal(F.gated_linear(x, w, None, gates), F.gated_linear(x, w, gates))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new order never warns
        F.gated_linear(x, w, gates, b)
        F.relu_gates(x, w)
        F.subnet_linear(x, w)
