"""The nn modules as torch.nn modules (issue 11 item 2): construction on ``meta`` then ``to_empty`` +
``reset_parameters``, a repr that never reads data, device/dtype factory kwargs, the state dict
through ``torch.save`` / ``torch.load(weights_only=True)``, ``torch.compile(fullgraph=True)``, DDP
and FSDP2 ``fully_shard`` on gloo (2 spawned ranks, with timeouts)."""
import inspect
import io
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import ist_kernels.functional as F
from ist_kernels.nn import GatedLinear, GReLUMLP, MaskedConv2d, MaskedLinear, SubnetMLP

from conftest import DEVICES

NAMES = ["GatedLinear", "GReLUMLP", "SubnetMLP", "MaskedLinear", "MaskedConv2d"]
P = 0.5  # pruning rate of the masked layers


def build(name, seed, device=None, dtype=None):
    """Module ``name`` (tiny shapes), initialised from ``seed`` alone: modules with a ``generator``
    take one; MaskedLinear/MaskedConv2d take the mask seed (their weights come from the global RNG,
    which the caller seeds)."""
    kw = {"device": device, "dtype": dtype}
    gen = torch.Generator().manual_seed(seed)
    if name == "GatedLinear":
        return GatedLinear(6, 37, **kw)
    if name == "GReLUMLP":
        return GReLUMLP(5, 33, 2, 3, bias=True, generator=gen, **kw)
    if name == "SubnetMLP":
        return SubnetMLP(5, 33, 2, 3, bias=True, train_output=True, kappa=0.7, generator=gen, **kw)
    if name == "MaskedLinear":
        return MaskedLinear(7, 5, p=P, seed=seed, **kw)
    if name == "MaskedConv2d":
        return MaskedConv2d(3, 4, (3, 2), padding=1, p=P, seed=seed, **kw)
    raise KeyError(name)


def reset(module, seed):
    """``reset_parameters`` as :func:`build` initialises: from a generator of ``seed`` where the
    module takes one, else from the global RNG seeded with ``seed``."""
    if "generator" in inspect.signature(module.reset_parameters).parameters:
        module.reset_parameters(torch.Generator().manual_seed(seed))
    else:
        torch.manual_seed(seed)
        module.reset_parameters()


def make(name, seed, **kw):
    torch.manual_seed(seed)  # the global RNG: GatedLinear's and the masked layers' weights
    return build(name, seed, **kw)


def inputs(name, seed, batch=4, dtype=torch.float32):
    """Positional forward arguments of ``name`` (fresh random ones from ``seed``)."""
    g = torch.Generator().manual_seed(seed + 1000)
    if name == "GatedLinear":
        return (torch.randn(batch, 6, generator=g, dtype=dtype), F.pack_gates(torch.rand(batch, 37, generator=g) > 0.5))
    if name == "MaskedConv2d":
        return (torch.randn(batch, 3, 5, 4, generator=g, dtype=dtype),)
    if name == "SubnetMLP":
        neurons = [torch.randperm(33, generator=g)[:20].sort().values for _ in range(2)]
        return (torch.randn(batch, 5, generator=g, dtype=dtype), neurons)
    return (torch.randn(batch, {"GReLUMLP": 5, "MaskedLinear": 7}[name], generator=g, dtype=dtype),)


def state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def garbage_(module):
    """What ``to_empty`` may leave: NaN floats, bool bytes that are neither 0 nor 1."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t.dtype == torch.bool:
                t.view(torch.uint8).fill_(7)
            elif t.is_floating_point():
                t.fill_(float("nan"))


# ------------------------------------------------------------------ meta -> to_empty -> reset
@pytest.mark.parametrize("name", NAMES)
def test_meta_to_empty_reset_parameters_gives_the_directly_built_module(name):
    seed = int.from_bytes(os.urandom(3), "little")
    meta = build(name, seed, device="meta")
    assert all(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))
    text = repr(meta)  # never reads data (MaskedLinear.sparsity used to call .item() here)
    assert type(meta).__name__ in text
    meta.to_empty(device="cpu")
    garbage_(meta)
    reset(meta, seed)
    direct = make(name, seed)
    got, want = state(meta), state(direct)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].device.type == "cpu", k
        if got[k].is_floating_point():
            assert torch.isfinite(got[k]).all(), k
        assert torch.equal(got[k], want[k]), k
    args = inputs(name, seed)
    assert torch.equal(meta(*args), direct(*args))


@pytest.mark.parametrize("cls", [MaskedLinear, MaskedConv2d])
def test_masked_reset_redraws_the_same_mask_at_the_keep_rate(cls):
    p = 0.3
    shape_args = (200, 100) if cls is MaskedLinear else (20, 40, 5)
    seed = int.from_bytes(os.urandom(3), "little")
    layer = cls(*shape_args, p=p, seed=seed, device="meta")
    layer.to_empty(device="cpu")
    garbage_(layer)
    layer.reset_parameters()
    mask = layer.mask
    assert set(mask.view(torch.uint8).unique().tolist()) <= {0, 1}  # a real bool mask
    assert abs(mask.float().mean().item() - (1 - p)) < 0.02  # 20000 entries: std 0.0032
    assert (layer.weight[~mask] == 0).all() and torch.isfinite(layer.weight).all()
    assert abs(layer.sparsity - p) < 0.02
    layer.reset_parameters()
    assert torch.equal(layer.mask, mask)  # redrawn from the stored seed
    assert layer.mask_seed == seed and f"mask_seed={seed}" in repr(layer)


def test_masked_built_from_a_generator_records_its_seed():
    g = torch.Generator().manual_seed(4)
    a, b = MaskedLinear(30, 20, p=0.5, generator=g), MaskedLinear(30, 20, p=0.5, generator=g)
    assert isinstance(a.mask_seed, int) and a.mask_seed != b.mask_seed  # one seed per layer
    assert not torch.equal(a.mask, b.mask)
    built = a.mask.clone()
    a.reset_parameters()
    assert torch.equal(a.mask, built)
    again = MaskedLinear(30, 20, p=0.5, generator=torch.Generator().manual_seed(4))
    assert again.mask_seed == a.mask_seed and torch.equal(again.mask, built)
    twin = MaskedLinear(30, 20, p=0.5, seed=a.mask_seed)
    assert torch.equal(twin.mask, built)
    assert MaskedLinear(3, 3, p=0.0).mask_seed is None and MaskedLinear(3, 3, p=0.0).mask.all()
    with pytest.raises(ValueError, match="seed or generator"):
        MaskedLinear(3, 3, p=0.5, seed=1, generator=g)
    with pytest.raises(ValueError, match="p"):
        MaskedConv2d(3, 3, 1, p=-0.1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", DEVICES)
def test_factory_kwargs(name, device):
    """Parameters and buffers are made on the device and dtype asked for (drawn there: a CUDA
    generator draws a CUDA module; a CPU one gives the CPU model's values)."""
    m = make(name, 3, device=device, dtype=torch.float64)
    tensors = list(m.parameters()) + list(m.buffers())
    assert all(t.device.type == torch.device(device).type for t in tensors)
    assert all(t.dtype in (torch.float64, torch.bool) for t in tensors)
    assert any(t.dtype == torch.float64 for t in tensors)
    if name in ("GReLUMLP", "SubnetMLP"):
        cpu = make(name, 3, dtype=torch.float64)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(m.state_dict().values(), cpu.state_dict().values()))
        if device != "cpu":  # a generator on the module's device draws in place
            m.reset_parameters(torch.Generator(device).manual_seed(3))
            assert all(torch.isfinite(p).all() for p in m.parameters())


def test_subnet_mlp_constructor_order():
    m = SubnetMLP(4, 8, 3, 2)
    assert (m.in_features, m.width, m.depth, m.out_features) == (4, 8, 3, 2)
    assert len(m.hidden_weights) == 3 and m.output_weight.shape == (2, 8)
    k = SubnetMLP(4, 8, depth=3, out_features=2)
    assert (k.depth, k.out_features) == (3, 2)
    assert list(inspect.signature(SubnetMLP).parameters)[:4] == list(inspect.signature(GReLUMLP).parameters)[:4]
    with pytest.raises(TypeError, match=r"SubnetMLP\(in_features, width, depth, out_features\)"):
        SubnetMLP(10, 4000, 1)  # the old (in, width, out) call
    assert "depth=3, out_features=2" in repr(m)


# ------------------------------------------------------------------ state dict
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_weights_only(name, tmp_path):
    src, dst = make(name, 11), make(name, 12)
    if name == "GReLUMLP":
        src.cache_gates(torch.randn(9, 5))  # derived data: not saved
    path = tmp_path / "sd.pt"
    torch.save(src.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in loaded.values())
    dst.load_state_dict(loaded)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    args = inputs(name, 1)
    assert torch.equal(dst(*args), src(*args))
    buf = io.BytesIO()
    torch.save(dst.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True).keys() == src.state_dict().keys()


# ------------------------------------------------------------------ torch.compile
class _All(nn.Module):
    """Every module in one graph: one compilation for all five."""

    def __init__(self, seed):
        super().__init__()
        self.mods = nn.ModuleDict({n: make(n, seed) for n in NAMES})

    def forward(self, args):
        return [self.mods[n](*args[n]) for n in NAMES]


@pytest.mark.slow
def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = _All(5)
    args = {n: inputs(n, 5) for n in NAMES}
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    got = compiled(args)
    sum(y.square().sum() for y in got).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = model(args)
    sum(y.square().sum() for y in want).backward()
    for n, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------ DDP and FSDP2 on gloo
WORLD = 2


def _reference_grads(name, seed):
    """Gradients of the mean loss over both ranks' batches, on one process."""
    m = make(name, seed)
    for r in range(WORLD):
        out = m(*inputs(name, 100 + r))
        (out.square().sum() / WORLD).backward()
    return {k: p.grad for k, p in m.named_parameters()}, state(m)


def _check(got, want, what):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{what} {k}: {m}")


def _worker(rank, store, outdir):
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    report = os.path.join(outdir, f"rank{rank}.txt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (WORLD,))
        except ImportError as e:  # pragma: no cover (torch < 2.6)
            fully_shard, mesh = None, repr(e)
        lines = []
        for name in NAMES:
            want_grads, want_state = _reference_grads(name, 7)
            # DDP: rank 1 starts from other weights and masks; DDP broadcasts rank 0's.
            m = make(name, 7 if rank == 0 else 8)
            ddp = DDP(m)
            ddp(*inputs(name, 100 + rank)).square().sum().backward()
            _check(state(m), want_state, f"DDP {name} state")
            _check({k: p.grad for k, p in m.named_parameters()}, want_grads, f"DDP {name} grad")
            lines.append(f"ddp {name} ok")
            if fully_shard is None:
                lines.append(f"fsdp {name} skip {mesh}")
                continue
            # FSDP2: built on meta, sharded, materialised on the CPU, reset from the seed.
            with torch.device("meta"):
                m = build(name, 7)
            fully_shard(m, mesh=mesh)
            m.to_empty(device="cpu")
            reset(m, 7)
            m(*inputs(name, 100 + rank)).square().sum().backward()
            got_state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state(m).items()}
            _check(got_state, want_state, f"FSDP2 {name} state")
            got = {k: p.grad.full_tensor() for k, p in m.named_parameters()}  # averaged over ranks
            _check(got, want_grads, f"FSDP2 {name} grad")
            lines.append(f"fsdp {name} ok")
        dist.destroy_process_group()
        with open(report, "w") as f:
            f.write("\n".join(lines))
    except BaseException:  # noqa: BLE001 (reported to the test)
        with open(report, "w") as f:
            f.write("ERROR\n" + traceback.format_exc())
        os._exit(1)


@pytest.mark.slow
def test_ddp_and_fsdp2_on_gloo(tmp_path):
    ctx = mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 240
    for p in ctx.processes:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    reports = {}
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.txt"
        reports[r] = path.read_text() if path.exists() else "no report"
    assert not hung, f"ranks {hung} did not finish within 240 s: {reports}"
    for r, text in reports.items():
        assert not text.startswith("ERROR") and text != "no report", f"rank {r}:\n{text}"
        for name in NAMES:
            assert f"ddp {name} ok" in text and f"fsdp {name} ok" in text, f"rank {r}:\n{text}"
