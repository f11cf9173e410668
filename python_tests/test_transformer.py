"""The transformer pieces (issue 20): gpt_tiny / gpt_small (causality, shapes, tied embeddings), the
pycode data set (a deterministic split by path hash, disjoint, bytes and targets), the IST (FFN units,
heads) and ResIST (blocks) partitions of a transformer against an explicit float64 reference of the
sub-model, and the errors of bad options."""
import math
import os
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from ist_kernels.models import GPT, gpt_small, gpt_tiny
from ist_kernels.partition import transformer_ist_plan, transformer_resist_plan
from ist_kernels.train import cli
from ist_kernels.train.checkpoint import RESUME_MUST_MATCH, _as_compared
from ist_kernels.train.config import ConfigError
from ist_kernels.train.datasets import PYCODE_TEST_EVERY, _path_hash, byte_sequences, load_dataset, pycode_files


def small_gpt(width=64, depth=4, context=12):
    torch.manual_seed(0)
    m = GPT(vocab_size=256, context=context, width=width, depth=depth, heads=width // 32).double()
    with torch.no_grad():  # larger weights than GPT-2's init, so that every term shows in the comparisons
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


# ---------------------------------------------------------------- model

def test_shapes_sizes_and_tied_embeddings():
    m = gpt_tiny(context=16)
    x = torch.randint(0, 256, (3, 16))
    assert m(x).shape == (3, 16, 256) and m(x[:, :5]).shape == (3, 5, 256)
    assert len(m.blocks) == 4 and m.blocks[0].attn.qkv.weight.shape == (384, 128)
    s = gpt_small(context=8, width=64, depth=2)
    assert len(s.blocks) == 2 and s.tok_emb.weight.shape == (256, 64)
    # one embedding matrix: input and output (no separate head tensor in the state)
    assert not any("head" in k for k in m.state_dict())
    m = small_gpt()
    h = m.ln_f(m.blocks(m.tok_emb(x[:, :12]) + m.pos_emb(torch.arange(12))))
    torch.testing.assert_close(m(x[:, :12]), h @ m.tok_emb.weight.T)
    m(x[:, :12]).logsumexp(-1).sum().backward()
    assert m.tok_emb.weight.grad.abs().sum(1).gt(0).all()  # every row gets the output's gradient
    with pytest.raises(ValueError, match="longer than the context"):
        m(torch.zeros(1, 13, dtype=torch.long))


def test_causal():
    """The output at position t does not depend on the inputs after t."""
    m = small_gpt()
    x = torch.randint(0, 256, (2, 12))
    out = m(x)
    for t in (0, 5, 10):
        y = x.clone()
        y[:, t + 1:] = torch.randint(0, 256, y[:, t + 1:].shape)
        o = m(y)
        assert torch.equal(o[:, :t + 1], out[:, :t + 1])
        if t < 11:
            assert not torch.allclose(o[:, t + 1:], out[:, t + 1:])


# ---------------------------------------------------------------- pycode

def test_pycode_split_is_deterministic_and_disjoint():
    train, test = pycode_files()
    assert (train, test) == pycode_files()
    assert train and test and not set(train) & set(test)
    root = sysconfig.get_paths()["stdlib"]
    assert all(os.path.commonpath([root, p]) == root and "site-packages" not in p for p in train + test)
    assert all(_path_hash(os.path.relpath(p, root)) % PYCODE_TEST_EVERY == 0 for p in test)
    assert all(_path_hash(os.path.relpath(p, root)) % PYCODE_TEST_EVERY != 0 for p in train)
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15


def test_pycode_sequences_and_sizes():
    cfg = cli.build_config(["--dataset", "pycode", "--model", "gpt_tiny", "--context", "32", "--dataset-size",
                            "5000"]).validate()
    d = load_dataset(cfg)
    assert d.task == "language_model" and d.num_outputs == 256 and d.input_shape == (32,)
    assert d.train_x.shape == (156, 32) and d.train_x.dtype == torch.uint8 and d.train_y.dtype == torch.int64
    assert torch.equal(d.train_x[:, 1:].long(), d.train_y[:, :-1])  # the targets: the next byte
    assert torch.equal(d.train_x[1:, 0].long(), d.train_y[:-1, -1])
    assert int(d.train_y.min()) >= 0 and int(d.train_y.max()) <= 255 and d.test_y.numel() > 0
    assert d.prepare(d.train_x[:2]).dtype == torch.int64
    assert torch.equal(load_dataset(cfg).test_x, d.test_x)
    x, y = byte_sequences(torch.arange(10, dtype=torch.uint8), 4)
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]


# ---------------------------------------------------------------- partitions against a float64 reference

def ref_gpt(sd, tokens, blocks, head_dim=32, units=None, heads=None, scale=1.0):
    """The GPT forward written out: ``blocks`` lists (name, residual scale) in order; ``units`` /
    ``heads``: the FFN units / attention heads kept (the others zeroed), ``scale`` their outputs'
    (before the output projection)."""
    T = tokens.shape[1]
    h = sd["tok_emb.weight"][tokens] + sd["pos_emb.weight"][:T]

    def ln(x, p):
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * sd[p + ".weight"] + sd[p + ".bias"]

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for name, rs in blocks:
        x = ln(h, f"{name}.ln1")
        qkv = x @ sd[f"{name}.attn.qkv.weight"].T + sd[f"{name}.attn.qkv.bias"]
        H = qkv.shape[-1] // (3 * head_dim)
        q, k, v = (t.reshape(*t.shape[:2], H, head_dim).transpose(1, 2) for t in qkv.split(H * head_dim, -1))
        att = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~mask, float("-inf")).softmax(-1)
        y = att @ v  # B, H, T, hd
        a_scale = 1.0
        if heads is not None:
            keep = torch.zeros(H, dtype=torch.bool)
            keep[heads[name]] = True
            y = y * keep.view(1, H, 1, 1)
            a_scale = scale
        y = y.transpose(1, 2).reshape(*h.shape[:2], H * head_dim) * a_scale
        h = h + rs * (y @ sd[f"{name}.attn.proj.weight"].T + sd[f"{name}.attn.proj.bias"])
        u = F.gelu(ln(h, f"{name}.ln2") @ sd[f"{name}.mlp.fc.weight"].T + sd[f"{name}.mlp.fc.bias"])
        m_scale = 1.0
        if units is not None:
            keep = torch.zeros(u.shape[-1], dtype=torch.bool)
            keep[units[name]] = True
            u = u * keep
            m_scale = scale
        h = h + rs * (m_scale * u @ sd[f"{name}.mlp.proj.weight"].T + sd[f"{name}.mlp.proj.bias"])
    return ln(h, "ln_f") @ sd["tok_emb.weight"].T


@pytest.mark.parametrize("partition", ["ffn", "heads", "both"])
def test_ist_subnetworks_equal_the_full_model_with_the_other_units_zeroed(partition):
    S = 2
    m = small_gpt(width=128, depth=2)  # 4 heads
    x = torch.randint(0, 256, (2, 12))
    plan = transformer_ist_plan(m, S, partition, torch.Generator().manual_seed(3))
    names = [f"blocks.{i}" for i in range(2)]
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    subs = plan.build()
    for s, sub in enumerate(subs):
        units = {n: plan.units[n][s] for n in names} if partition != "heads" else None
        heads = {n: plan.heads[n][s] for n in names} if partition != "ffn" else None
        ref = ref_gpt(sd, x, [(n, 1.0) for n in names], units=units, heads=heads)
        torch.testing.assert_close(sub.module(x), ref, rtol=1e-10, atol=1e-10)
        if partition != "heads":
            assert sub.module.blocks[0].mlp.fc.weight.shape == (512 // S, 128)
            assert sub.module.blocks[0].mlp.proj.weight.shape == (128, 512 // S)
        if partition != "ffn":
            assert sub.module.blocks[1].attn.qkv.weight.shape == (3 * 64, 128)
    # the units / heads are a partition, and the full model scores each partitioned branch at 1/S:
    # the mean of the subnetworks' branches
    for n in names:
        for sets, size in ((plan.units.get(n), 512), (plan.heads.get(n), 4)):
            if sets is not None:
                assert torch.equal(torch.cat(sets).sort().values, torch.arange(size))
    plan.aggregate(subs)
    all_units = {n: torch.arange(512) for n in names} if partition != "heads" else None
    all_heads = {n: torch.arange(4) for n in names} if partition != "ffn" else None
    torch.testing.assert_close(m(x), ref_gpt(sd, x, [(n, 1.0) for n in names], units=all_units, heads=all_heads,
                                             scale=1 / S), rtol=1e-10, atol=1e-10)
    blk = m.blocks[0]
    z = torch.randn(2, 12, 128, dtype=torch.float64)
    if partition != "heads":
        torch.testing.assert_close(blk.mlp(z), sum(sub.module.blocks[0].mlp(z) for sub in subs) / S)
    if partition != "ffn":
        torch.testing.assert_close(blk.attn(z), sum(sub.module.blocks[0].attn(z) for sub in subs) / S)


def test_resist_subnetworks_skip_the_blocks_they_do_not_own():
    S, depth = 2, 5
    m = small_gpt(width=32, depth=depth)
    x = torch.randint(0, 256, (2, 12))
    plan = transformer_resist_plan(m, S, 1, torch.Generator().manual_seed(5))
    assert plan.partitioned_blocks == ["blocks.1", "blocks.2", "blocks.3"]
    assert sorted(b for bs in plan.blocks for b in bs) == plan.partitioned_blocks  # dealt once each
    assert plan.residual_scale == pytest.approx(1 / S)
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    subs = plan.build()
    for s, sub in enumerate(subs):
        order = ["blocks.0", *plan.blocks[s], f"blocks.{depth - 1}"]
        assert len(sub.module.blocks) == len(order)
        torch.testing.assert_close(sub.module(x), ref_gpt(sd, x, [(n, 1.0) for n in order]), rtol=1e-10, atol=1e-10)
    plan.aggregate(subs)
    scales = [(f"blocks.{i}", 1.0 if i in (0, depth - 1) else plan.residual_scale) for i in range(depth)]
    torch.testing.assert_close(m(x), ref_gpt(sd, x, scales), rtol=1e-10, atol=1e-10)
    shared = transformer_resist_plan(m, 3, 2, torch.Generator().manual_seed(5))  # min_depth 2 of 3: sharing
    assert all(len(b) == 2 for b in shared.blocks) and shared.residual_scale == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="at least 3 blocks"):
        transformer_resist_plan(small_gpt(width=32, depth=2), 2)


# ---------------------------------------------------------------- errors of bad options

BASE = ["--dataset", "pycode", "--model", "gpt_tiny", "--simulate", "2"]


@pytest.mark.parametrize("args, option, words", [
    (["--method", "ist", "--option", "partition=foo"], "options.partition", "ffn, heads, both"),
    (["--method", "ist", "--option", "partition=heads", "--simulate", "3"], "options.partition",
     "4 attention heads, not divisible by the 3 workers"),
    (["--method", "ist", "--option", "kappa=2"], "options.kappa", "mlp"),
    (["--method", "resist", "--depth", "2"], "depth", "depth >= 3"),
    (["--method", "resist", "--option", "min_depth=3"], "options.min_depth", "more than the 2 blocks"),
    (["--method", "ist", "--model", "mlp"], "model", "language model"),
    (["--method", "ist", "--dataset", "digits"], "model", "is a language model"),
    (["--method", "ist", "--model", "mlp", "--dataset", "digits", "--option", "partition=heads"],
     "options.partition", "needs a transformer"),
    (["--context", "0"], "context", ">= 1"),
])
def test_bad_options_name_the_option(args, option, words):
    with pytest.raises(ConfigError) as e:
        cli.build_config([*BASE, *args]).validate()
    assert e.value.option == option and words in str(e.value)


def test_list_models_and_datasets(capsys):
    assert cli.main(["--list-models"]) == 0
    models = capsys.readouterr().out.split()
    assert {"mlp", "gpt_tiny", "gpt_small", "preact_resnet18"} <= set(models)
    assert cli.main(["--list-datasets"]) == 0
    assert "pycode" in capsys.readouterr().out.split()


def test_resume_compares_depth_and_context_as_before_they_changed():
    """--depth's default became None (the model's own) and --context is new: a checkpoint of an mlp
    made before (depth 1, no context) is still resumable, a transformer's depth must match."""
    now = cli.build_config(["--model", "mlp"]).to_dict()
    old = {k: v for k, v in now.items() if k != "context"}
    old["depth"] = 1
    assert all(_as_compared(old)[k] == _as_compared(now)[k] for k in RESUME_MUST_MATCH)
    gpt = cli.build_config(["--model", "gpt_tiny", "--dataset", "pycode"]).to_dict()
    assert _as_compared({**gpt, "depth": 1})["depth"] != _as_compared(gpt)["depth"]
