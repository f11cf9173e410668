"""The host path of gather_slices(out=...) (bench_slices "into a reused buffer": 4.6x slower than the
allocating call on an H200, 2026-11-27, host-bound).

Two causes, each guarded here by counting calls (no timing):
- a one-dtype call ran the whole Python check_gather before the C++ op checked the same again;
- the Python checks formatted every message (f-strings) before testing its condition: about four
  strings per segment and per tensor on every call.
"""
import pytest
import torch

import ist_kernels.functional as F
import ist_kernels.ops.slices as S


def problem(segments_per_tensor=2, tensors=8):
    g = torch.Generator().manual_seed(0)
    xs, dims = [], []
    for t in range(tensors):
        if t % 2:
            xs.append(torch.randn(6, 5, 3, generator=g))
            dims.append(1)
        else:
            xs.append(torch.randn(7, generator=g))  # 1-D segments (BN vectors)
            dims.append(0)
    ids, indices = [], []
    for _ in range(segments_per_tensor):
        for t, (x, d) in enumerate(zip(xs, dims)):
            ids.append(t)
            indices.append(torch.randperm(x.shape[d], generator=g)[: x.shape[d] // 2 + 1].sort().values)
    return xs, ids, indices, dims


@pytest.fixture
def counted(monkeypatch):
    """Counts of the message-taking checks (check / check_type / check_index) the slice checks call."""
    calls = {"n": 0}

    def wrap(fn):
        def counting(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return counting

    for name in ("check", "check_type", "check_index"):
        monkeypatch.setattr(S, name, wrap(getattr(S, name)))
    return calls


def test_slice_checks_build_no_message_on_good_input(counted):
    """Good input: no check with a pre-built message per tensor or per segment (a failed check
    builds its message in ``fail``)."""
    xs, ids, indices, dims = problem(segments_per_tensor=4)
    S.check_gather(xs, ids, indices, dims)
    updates = F.gather_slices(xs, ids, indices, dims)
    S.check_scatter(xs, ids, updates, indices, dims, "mean")
    S.wrap_dims("op", xs, dims, "sources")
    assert counted["n"] == 0


def test_slice_checks_still_name_the_argument():
    xs, ids, indices, dims = problem()
    with pytest.raises(IndexError, match=r"slice_gather: source_ids\[1\] = 99 is out of range"):
        S.check_gather(xs, [ids[0], 99] + ids[2:], indices, dims)
    with pytest.raises(TypeError, match=r"slice_gather: indices\[2\] must be int64"):
        S.check_gather(xs, ids, indices[:2] + [indices[2].int()] + indices[3:], dims)
    with pytest.raises(IndexError, match=r"dims\[1\] = 3 is out of range for sources\[1\] with 3 dimensions"):
        S.check_gather(xs, ids, indices, [0, 3] + dims[2:])
    with pytest.raises(ValueError, match=r"sources\[1\] is 0-d"):
        S.check_gather([xs[0], torch.tensor(1.0)] + xs[2:], ids, indices, dims)
    updates = F.gather_slices(xs, ids, indices, dims)
    bad = list(updates)
    bad[3] = bad[3][:1]
    with pytest.raises(ValueError, match=r"slice_scatter_: updates\[3\] has shape"):
        S.check_scatter(xs, ids, bad, indices, dims, "mean")
    with pytest.raises(TypeError, match='reduce="mean" needs a floating or integer dtype'):
        S.check_scatter([x.bool() for x in xs], ids, [u.bool() for u in updates], indices, dims, "mean")


@pytest.mark.parametrize("kind", ["buffers", "tensor"])
def test_one_dtype_out_call_checks_in_cpp_only(monkeypatch, kind):
    """One dtype: gather_slices(out=...) leaves every check to the one C++ launch (no Python
    check_gather first), and returns the allocating call's values as views of the buffer."""
    xs, ids, indices, dims = problem(segments_per_tensor=3)
    want = F.gather_slices(xs, ids, indices, dims)
    calls = []
    real = S.check_gather
    monkeypatch.setattr(S, "check_gather", lambda *a, **k: calls.append(1) or real(*a, **k))
    holder = F.GatherBuffers()
    flat = torch.empty(sum(w.numel() for w in want))
    for _ in range(3):
        got = F.gather_slices(xs, ids, indices, dims, out=holder if kind == "buffers" else flat)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)
            assert g.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
        del got, g, w  # nothing views the buffer any more: the next call reuses it
    assert calls == []
    if kind == "buffers":
        assert holder.reused == 2


def test_one_dtype_out_call_errors_name_the_caller(monkeypatch):
    """Without the Python pre-check, bad arguments still raise the checks' errors."""
    xs, ids, indices, dims = problem()
    holder = F.GatherBuffers()
    with pytest.raises(IndexError, match=r"source_ids\[1\] = 99"):
        F.gather_slices(xs, [ids[0], 99] + ids[2:], indices, dims, out=holder)
    with pytest.raises(IndexError, match=r"dims\[1\] = 3 is out of range"):
        F.gather_slices(xs, ids, indices, [0, 3] + dims[2:], out=holder)
    with pytest.raises(ValueError, match=r"dims must have one entry per sources"):
        F.gather_slices(xs, ids, indices, dims[:-1], out=holder)
    with pytest.raises(ValueError, match=r"0-d"):
        F.gather_slices([xs[0], torch.tensor(1.0)] + xs[2:], ids, indices, dims, out=holder)
    bad = [i.clone() for i in indices]
    bad[2][0] = 1000
    with pytest.raises(IndexError, match=r"indices\[2\]\[0\] = 1000 is out of range"):
        F.gather_slices(xs, ids, bad, dims, out=holder)
    with pytest.raises(ValueError, match="sources is empty"):
        F.gather_slices([], [], [], [], out=holder)
