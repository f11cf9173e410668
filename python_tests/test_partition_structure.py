"""IST and ResIST partitions found in any model's structure (issue 26 item 1): a user's Sequential
MLP, HF Llama (gated FFN, grouped-query attention), HF GPT-2 (Conv1D, fused c_attn) and our GPT.
Every subnetwork's forward is compared in float64 with the full model where the other units / heads
are zeroed (or the other layers replaced by the identity), written out here from the math; the full
model's hooks make each branch the mean of the subnetworks' branches and leave no trace in the
state dict; a model with nothing found gets an error naming what was looked for; a spec bypasses
discovery; a structure-only (meta) model partitions like the real one."""
import copy

import pytest
import torch
from torch import nn

from ist_kernels.models import gpt_tiny
from ist_kernels.partition import (
    Structure,
    check_ist,
    check_resist,
    find_structure,
    is_transformer,
    transformer_ist_plan,
    transformer_resist_plan,
)

from plan_helpers import TOL, aggregation_round_trip, noisy as _noisy, zero_except as _zero_except


def mlp():
    torch.manual_seed(0)
    return _noisy(nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)))


def llama():
    tr = pytest.importorskip("transformers")
    cfg = tr.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return _noisy(tr.LlamaForCausalLM(cfg))


def gpt2(tie=True):
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return _noisy(tr.GPT2LMHeadModel(cfg))


def ours():
    torch.manual_seed(0)
    return _noisy(gpt_tiny(context=16, width=64, depth=4))  # 2 heads of 32, FFN 256


# How each model is written (the reference's knowledge, not discovery's): per layer i, the FFN's
# (input projections, output projection) and the attention's (output projection, head_dim), as
# (module, weight dim of the hidden units / heads) pairs; layer container; a forward returning logits.
def _lin(m, dim_out):  # nn.Linear: outputs are rows (dim 0); Conv1D: columns (dim 1)
    return m, dim_out


ARCH = {
    "mlp": dict(ffn=lambda m, i: ([(m[1], 0)], (m[3], 1)), attn=None, layers=None,
                fwd=lambda m, x: m(x), x=lambda: torch.randn(3, 4, 4, 4, dtype=torch.float64), n=1),
    "llama": dict(ffn=lambda m, i: ([(m.model.layers[i].mlp.gate_proj, 0), (m.model.layers[i].mlp.up_proj, 0)],
                                    (m.model.layers[i].mlp.down_proj, 1)),
                  attn=lambda m, i: ((m.model.layers[i].self_attn.o_proj, 1), 16),
                  layers=lambda m: m.model.layers, key="model.layers.{}",
                  fwd=lambda m, x: m(input_ids=x, use_cache=False).logits, x=lambda: torch.randint(0, 256, (2, 10)), n=4),
    "gpt2": dict(ffn=lambda m, i: ([(m.transformer.h[i].mlp.c_fc, 1)], (m.transformer.h[i].mlp.c_proj, 0)),
                 attn=lambda m, i: ((m.transformer.h[i].attn.c_proj, 0), 16),
                 layers=lambda m: m.transformer.h, key="transformer.h.{}",
                 fwd=lambda m, x: m(input_ids=x, use_cache=False).logits, x=lambda: torch.randint(0, 256, (2, 10)), n=4),
    "ours": dict(ffn=lambda m, i: ([(m.blocks[i].mlp.fc, 0)], (m.blocks[i].mlp.proj, 1)),
                 attn=lambda m, i: ((m.blocks[i].attn.proj, 1), 32),
                 layers=lambda m: m.blocks, key="blocks.{}",
                 fwd=lambda m, x: m(x), x=lambda: torch.randint(0, 256, (2, 12)), n=4),
}
BUILD = {"mlp": mlp, "llama": llama, "gpt2": gpt2, "ours": ours, "gpt2_untied": lambda: gpt2(False)}
ARCH["gpt2_untied"] = ARCH["gpt2"]


def reference(model, name, units=None, heads=None, scale=1.0, depth_scale=None, skip=()):
    """A float64 copy of ``model`` with only ``units[i]`` FFN units / ``heads[i]`` query heads of
    layer i (the others' output-projection columns and input rows zeroed), the partitioned output
    projections' weights times ``scale``; layers in ``skip`` replaced by the identity, and layer i
    of ``depth_scale`` computing x + p (layer(x) - x)."""
    a = ARCH[name]
    ref = copy.deepcopy(model)
    for mod in ref.modules():  # no hooks of the partition in the reference
        mod._forward_pre_hooks.clear()
        mod._forward_hooks.clear()
        mod._forward_hooks_with_kwargs.clear()
        mod._forward_pre_hooks_with_kwargs.clear()
    with torch.no_grad():
        for i, keep in (units or {}).items():
            ins, (out, odim) = a["ffn"](ref, i)
            for m, d in ins:
                _zero_except(m.weight, d, keep)
                if m.bias is not None:
                    _zero_except(m.bias, 0, keep)
            _zero_except(out.weight, odim, keep)
            out.weight.mul_(scale)
        for i, keep in (heads or {}).items():
            (o, odim), hd = a["attn"](ref, i)
            cols = (keep.view(-1, 1) * hd + torch.arange(hd)).flatten()
            _zero_except(o.weight, odim, cols)
            o.weight.mul_(scale)
    if skip or depth_scale:
        layers = a["layers"](ref)

        class Identity(nn.Module):
            def forward(self, x, *args, **kwargs):
                return x

        class Scaled(nn.Module):
            def __init__(self, inner, p):
                super().__init__()
                self.inner, self.p = inner, p

            def forward(self, x, *args, **kwargs):
                return x + self.p * (self.inner(x, *args, **kwargs) - x)

        for i in skip:
            layers[i] = Identity()
        for i, p in (depth_scale or {}).items():
            layers[i] = Scaled(layers[i], p)
    return ref


def _layer_key(name, i):
    return ARCH[name]["key"].format(i) if "key" in ARCH[name] else "3"


# ---------------------------------------------------------------- discovery

def test_found_structure():
    st = find_structure(mlp())
    assert [(f.in_projs, f.out_proj, f.hidden) for f in st.ffns] == [(("1",), "3", 512)]
    assert not st.attentions and st.layers is None
    st = find_structure(llama())
    assert len(st.ffns) == 4 and st.ffns[0].in_projs == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert st.ffns[0].hidden == 172
    a = st.attentions[2]
    assert (a.q, a.k, a.v, a.o) == tuple(f"model.layers.2.self_attn.{p}_proj" for p in "qkvo")
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 2, 16)
    assert (st.layers, st.num_layers) == ("model.layers", 4)
    st = find_structure(gpt2())
    assert st.ffns[1].in_projs == ("transformer.h.1.mlp.c_fc",) and st.ffns[1].hidden == 256
    a = st.attentions[0]
    assert a.fused and a.q == "transformer.h.0.attn.c_attn" and (a.num_heads, a.num_kv_heads, a.head_dim) == (4, 4, 16)
    assert (st.layers, st.num_layers) == ("transformer.h", 4)
    st = find_structure(ours())
    assert [f.out_proj for f in st.ffns] == [f"blocks.{i}.mlp.proj" for i in range(4)]
    assert st.attentions[3].fused and st.attentions[3].num_heads == 2 and st.layers == "blocks"
    assert is_transformer(ours()) and is_transformer(llama()) and not is_transformer(mlp())


# ---------------------------------------------------------------- IST

CASES = [("mlp", "ffn"), ("ours", "ffn"), ("ours", "heads"), ("ours", "both"), ("llama", "ffn"),
         ("llama", "heads"), ("llama", "both"), ("gpt2", "ffn"), ("gpt2", "heads"), ("gpt2", "both")]


@pytest.mark.parametrize("name, partition", CASES)
def test_ist_subnetworks_equal_the_full_model_with_the_others_removed(name, partition):
    S = 2
    a = ARCH[name]
    model = BUILD[name]()
    x = a["x"]()
    clean = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = transformer_ist_plan(model, S, partition, torch.Generator().manual_seed(3))
    layers = range(a["n"])
    subs = plan.build()
    for s, sub in enumerate(subs):
        units = {i: plan.units[_layer_key(name, i)][s] for i in layers} if partition != "heads" else None
        heads = {i: plan.heads[_layer_key(name, i)][s] for i in layers} if partition != "ffn" else None
        if heads and name == "llama":  # grouped-query: the kv heads of a subnetwork's query heads
            assert torch.equal(plan.kv_heads[_layer_key(name, 0)][s], heads[0][::2] // 2)
        torch.testing.assert_close(a["fwd"](sub.module, x), a["fwd"](reference(model, name, units, heads), x), **TOL)
    for key, sets in plan.units.items():  # a partition
        assert torch.equal(torch.cat(sets).sort().values, torch.arange(plan.ffns[key].hidden))
    for key, sets in plan.heads.items():
        assert torch.equal(torch.cat(sets).sort().values, torch.arange(plan.attentions[key].num_heads))
    if partition != "heads":  # narrowed shapes
        ins, (out, odim) = a["ffn"](subs[0].module, 0)
        assert out.weight.shape[odim] == plan.units[_layer_key(name, 0)][0].numel()
    # the full model scored as the mean of the subnetworks: 1/S on the partitioned output projections
    plan.scale_outputs()
    all_units = {i: torch.arange(plan.ffns[_layer_key(name, i)].hidden) for i in layers} if partition != "heads" else None
    all_heads = {i: torch.arange(plan.attentions[_layer_key(name, i)].num_heads) for i in layers} \
        if partition != "ffn" else None
    torch.testing.assert_close(a["fwd"](model, x), a["fwd"](reference(clean, name, all_units, all_heads, 1 / S), x), **TOL)
    if name == "mlp":  # the whole model is the branch
        torch.testing.assert_close(model(x), sum(sub.module(x) for sub in subs) / S, **TOL)
    for key, f in plan.ffns.items():  # each FFN branch is the mean of the subnetworks' branches (exact)
        z = torch.randn(2, 5, model.get_submodule(f.in_projs[0]).weight.shape[1 if name != "gpt2" else 0],
                        dtype=torch.float64)
        if name != "mlp":
            torch.testing.assert_close(model.get_submodule(f.name)(z),
                                       sum(sub.module.get_submodule(f.name)(z) for sub in subs) / S, **TOL)
    for key, att in plan.attentions.items():
        if name == "ours":
            z = torch.randn(2, 5, 64, dtype=torch.float64)
            torch.testing.assert_close(model.get_submodule(att.name)(z),
                                       sum(sub.module.get_submodule(att.name)(z) for sub in subs) / S, **TOL)
    # no trace in the state dict: the same keys and values as the unhooked model
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    fresh = copy.deepcopy(clean)
    fresh.load_state_dict(after)  # strict
    torch.testing.assert_close(a["fwd"](fresh, x), a["fwd"](clean, x), rtol=0, atol=0)
    # a deepcopy of the full model keeps its scales; subnetworks built later are not scaled
    torch.testing.assert_close(a["fwd"](copy.deepcopy(model), x), a["fwd"](model, x), rtol=0, atol=0)
    subs2 = transformer_ist_plan(model, S, partition, torch.Generator().manual_seed(3)).build()
    for sub, sub2 in zip(subs, subs2):
        torch.testing.assert_close(a["fwd"](sub2.module, x), a["fwd"](sub.module, x), rtol=0, atol=0)


@pytest.mark.parametrize("name, partition", [("mlp", "ffn"), ("llama", "both"), ("gpt2_untied", "both"),
                                             ("gpt2", "both")])
def test_ist_aggregation_round_trip(name, partition):
    model = BUILD[name]()
    plan = transformer_ist_plan(model, 2, partition, torch.Generator().manual_seed(1))
    aggregation_round_trip(model, plan, ARCH[name]["x"](), ARCH[name]["fwd"])  # the mean of +1 and +2; still runs


# ---------------------------------------------------------------- ResIST

@pytest.mark.parametrize("name", ["llama", "gpt2_untied"])
def test_resist_subnetworks_skip_the_layers_they_do_not_own(name):
    S = 2
    a = ARCH[name]
    model = BUILD[name]()
    x = a["x"]()
    clean = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = transformer_resist_plan(model, S, 1, torch.Generator().manual_seed(5))
    key = a["key"]
    assert plan.partitioned_blocks == [key.format(1), key.format(2)]
    assert sorted(b for bs in plan.blocks for b in bs) == plan.partitioned_blocks
    subs = plan.build()
    for s, sub in enumerate(subs):
        skip = [i for i in (1, 2) if key.format(i) not in plan.blocks[s]]
        assert len(a["layers"](sub.module)) == 4 - len(skip)
        torch.testing.assert_close(a["fwd"](sub.module, x), a["fwd"](reference(model, name, skip=skip), x), **TOL)
    plan.aggregate(subs)
    p = plan.residual_scale
    assert p == pytest.approx(1 / S)
    torch.testing.assert_close(a["fwd"](model, x), a["fwd"](reference(clean, name, depth_scale={1: p, 2: p}), x), **TOL)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    for s, sub in enumerate(plan.build()):  # subnetworks after aggregation are not scaled
        skip = [i for i in (1, 2) if key.format(i) not in plan.blocks[s]]
        torch.testing.assert_close(a["fwd"](sub.module, x), a["fwd"](reference(clean, name, skip=skip), x), **TOL)
    shared = transformer_resist_plan(model, 2, 2, torch.Generator().manual_seed(5))  # min_depth 2: both layers
    assert shared.residual_scale == 1.0


class Residual(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


def test_resist_and_ist_on_a_users_sequential_of_residual_layers():
    torch.manual_seed(0)
    model = _noisy(nn.Sequential(*[Residual(8) for _ in range(5)]))
    st = find_structure(model)
    assert st.layers == "" and st.num_layers == 5 and len(st.ffns) == 5 and is_transformer(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    plan = transformer_resist_plan(model, 3, 1, torch.Generator().manual_seed(0))
    assert plan.partitioned_blocks == ["1", "2", "3"]
    for s, sub in enumerate(plan.build()):
        h = x
        for i in [0, *[int(b) for b in plan.blocks[s]], 4]:
            h = model[i](h)
        torch.testing.assert_close(sub.module(x), h, **TOL)
    plan.scale_residuals()
    h = x
    for i in range(5):
        h = h + (plan.residual_scale if i in (1, 2, 3) else 1.0) * model[i].ff(model[i].norm(h))
    torch.testing.assert_close(model(x), h, **TOL)
    ist = transformer_ist_plan(model, 2, "ffn", torch.Generator().manual_seed(0))
    assert sorted(ist.units) == ["0", "1", "2", "3", "4"]


# ---------------------------------------------------------------- errors, spec, meta

def test_nothing_found_names_what_was_looked_for():
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    with pytest.raises(ValueError, match=r"found no FFN in Sequential.*looked for.*Linear.*spec="):
        transformer_ist_plan(cnn, 2)
    with pytest.raises(ValueError, match=r"found no attention in Sequential.*looked for.*num_heads.*spec="):
        transformer_ist_plan(mlp(), 2, "heads")
    with pytest.raises(ValueError, match=r"found no residual layers in Sequential.*looked for.*ModuleList"):
        transformer_resist_plan(mlp(), 2)
    with pytest.raises(ValueError, match="has 2 key/value heads \\(4 query heads\\), not divisible by S=4"):
        check_ist(llama(), 4, "heads")
    with pytest.raises(ValueError, match="only 512 hidden units"):
        check_ist(mlp(), 513)
    assert check_resist(llama(), 2, 2).num_layers == 4
    with pytest.raises(ValueError, match="min_depth=3 is larger than the 2"):
        check_resist(llama(), 2, 3)
    with pytest.raises(ValueError, match="spec: FFN input projection 'nope'"):
        find_structure(mlp(), {"ffns": [("nope", "3")]})
    with pytest.raises(ValueError, match="unknown keys"):
        find_structure(mlp(), {"ffn": []})


class OddFFN(nn.Module):  # a parameter read between the projections: discovery does not take it as an FFN
    def __init__(self):
        super().__init__()
        self.w_in = nn.Linear(16, 24)
        self.w_out = nn.Linear(24, 16)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.w_out(torch.tanh(self.w_in(x)) * self.gain)


class OddAttention(nn.Module):  # no readable head count: four heads of 4 from the view below
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, 4).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        y = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = OddAttention()
        self.ffn = OddFFN()

    def forward(self, x):
        x = x + self.att(x)
        return x + self.ffn(x)


def test_a_spec_bypasses_discovery():
    torch.manual_seed(0)
    model = _noisy(OddModel())
    st = find_structure(model)
    assert not st.ffns and not st.attentions
    assert st.notes == ["att: wk, wq, wv -> wo: reshape() is not elementwise per hidden unit nor a norm of the 16 units",
                        "ffn: w_in -> w_out: a parameter or buffer is read between them"]
    spec = {"ffns": [(("ffn.w_in",), "ffn.w_out")],
            "attentions": [{"q": "att.wq", "k": "att.wk", "v": "att.wv", "o": "att.wo", "num_heads": 4}]}
    st = find_structure(model, spec)
    assert st.ffns[0].hidden == 24 and st.attentions[0].head_dim == 4 and st.attentions[0].num_kv_heads == 4
    assert find_structure(model, Structure(st.ffns, st.attentions)).ffns == st.ffns
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, "both", torch.Generator().manual_seed(0), spec=spec)
    subs = plan.build()
    for s, sub in enumerate(subs):
        ref = copy.deepcopy(clean)
        with torch.no_grad():
            _zero_except(ref.ffn.w_out.weight, 1, plan.units["ffn.w_out"][s])
            cols = (plan.heads["att.wo"][s].view(-1, 1) * 4 + torch.arange(4)).flatten()
            _zero_except(ref.att.wo.weight, 1, cols)
        torch.testing.assert_close(sub.module(x), ref(x), **TOL)
    plan.scale_outputs()
    ref = copy.deepcopy(clean)
    with torch.no_grad():
        ref.ffn.w_out.weight.mul_(0.5)
        ref.att.wo.weight.mul_(0.5)
    torch.testing.assert_close(model(x), ref(x), **TOL)
    torch.testing.assert_close(model.ffn(x), sum(sub.module.ffn(x) for sub in subs) / 2, **TOL)
    torch.testing.assert_close(model.att(x), sum(sub.module.att(x) for sub in subs) / 2, **TOL)
    # layers by spec: the container discovery would not pick
    deep = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Residual(4) for _ in range(3)]),
                         nn.ModuleList([Residual(4) for _ in range(4)]))
    assert find_structure(deep).layers == "2"
    assert transformer_resist_plan(deep, 1, spec={"layers": "1"}).partitioned_blocks == ["1.1"]


@pytest.mark.parametrize("name, method", [("mlp", "ffn"), ("llama", "both"), ("gpt2", "heads"), ("ours", "both"),
                                          ("llama", "resist")])
def test_a_meta_model_partitions_like_the_real_one(name, method):
    real = BUILD[name]()
    with torch.device("meta"):
        meta = BUILD[name]()
    assert all(p.is_meta for p in meta.parameters())
    # non-persistent buffers (Llama's rotary inv_freq) are constants of the structure that clones share
    # by reference: a structure-only model keeps them real (as the engine's to_meta_ does)
    real_mods = dict(real.named_modules())
    for name_, m in meta.named_modules():
        for b in m._non_persistent_buffers_set:
            m._buffers[b] = real_mods[name_]._buffers[b]

    def make(m):
        g = torch.Generator().manual_seed(7)
        return transformer_resist_plan(m, 2, 1, g) if method == "resist" else transformer_ist_plan(m, 2, method, g)
    rp, mp = make(real), make(meta)
    assert [(t.name, t.dim) for t in rp.tensors] == [(t.name, t.dim) for t in mp.tensors]
    for a, b in zip(rp.tensors, mp.tensors):
        assert len(a.owners) == len(b.owners) and all(torch.equal(u, v) for u, v in zip(a.owners, b.owners))
    x = ARCH[name]["x"]()
    for s, sub in enumerate(rp.build()):
        sub_meta = mp.attach(s, rp.part(s))
        sub_meta.module.eval()
        torch.testing.assert_close(ARCH[name]["fwd"](sub_meta.module, x), ARCH[name]["fwd"](sub.module, x), rtol=0, atol=0)


def test_the_trainer_validates_a_built_model():
    from ist_kernels.train.errors import ConfigError
    from ist_kernels.train.methods.ist_transformer import TransformerIST
    assert len(TransformerIST.validate_model(mlp(), 2, "ffn").ffns) == 1
    with pytest.raises(ConfigError, match=r"'options.partition'.*found no attention in Sequential"):
        TransformerIST.validate_model(mlp(), 2, "heads")
    with pytest.raises(ConfigError, match=r"'workers'.*only 512 hidden units"):
        TransformerIST.validate_model(mlp(), 600, "ffn")
    with pytest.raises(ConfigError, match=r"'options.partition'.*2 heads, not divisible by S=4"):
        TransformerIST.validate_model(ours(), 4, "both")
