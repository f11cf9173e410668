"""Structures found from a module's data flow (issue 38 item 5), in models this package does not
define: an nn.Sequential MLP with a norm and dropout between its projections (the norm's vectors go
with the units; a subnetwork normalizes over its own units), a hand-written decoder layer whose
q/k/v/o and FFN projections and norms are its direct children (read by torch.fx), the same layer
with control flow fx cannot trace (read from one meta forward), torch's nn.TransformerEncoder and
nn.MultiheadAttention (heads of its own in-projection; a subnetwork's module holds its heads only)
and HF OPT (fc1/fc2 beside the attention). Every subnetwork is compared in float64 with a reference
written from the math (or the full model with the other units / heads removed); errors say what was
looked for, what was found and why the rest was not taken; the trainer runs them end to end."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ist_kernels.partition import dataflow, find_structure, input_scale, transformer_ist_plan, transformer_resist_plan
from ist_kernels.partition.mha import HeadsMultiheadAttention

from plan_helpers import TOL, aggregation_round_trip, noisy as _noisy, zero_except as _zero_except


def _cols(heads, hd):
    return (heads.view(-1, 1) * hd + torch.arange(hd)).flatten()


def _unhooked(model):
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        mod._forward_pre_hooks.clear()
        mod._forward_hooks.clear()
        mod._forward_hooks_with_kwargs.clear()
        mod._forward_pre_hooks_with_kwargs.clear()
    return ref


# ---------------------------------------------------------------- an MLP with a norm between its projections

def norm_mlp(norm="layer"):
    torch.manual_seed(0)
    n = nn.LayerNorm(32) if norm == "layer" else nn.BatchNorm1d(32)
    return _noisy(nn.Sequential(nn.Flatten(), nn.Linear(12, 32), n, nn.GELU(), nn.Dropout(0.25), nn.Linear(32, 3)))


def test_a_layernorm_between_the_projections_goes_with_the_units():
    """Linear -> LayerNorm -> GELU -> Dropout -> Linear: the norm's weight and bias are partitioned
    with the units and a subnetwork normalizes over its own units (the reference: that math)."""
    model = norm_mlp()
    st = find_structure(model)
    assert [(f.in_projs, f.out_proj, f.norms, f.hidden) for f in st.ffns] == [(("1",), "5", ("2",), 32)]
    assert "normalized over a subnetwork's units by 2" in st.describe()
    x = torch.randn(7, 3, 4, dtype=torch.float64)
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, "ffn", torch.Generator().manual_seed(1))
    assert {t.name for t in plan.partitioned} == {"1.weight", "1.bias", "2.weight", "2.bias", "5.weight"}
    subs = plan.build()
    for s, sub in enumerate(subs):
        u = plan.units["5"][s]
        assert sub.module[2].normalized_shape == (16,) and sub.module[2].weight.shape == (16,)
        z = x.flatten(1) @ model[1].weight[u].T + model[1].bias[u]
        z = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + model[2].eps)
        z = F.gelu(z * model[2].weight[u] + model[2].bias[u])
        torch.testing.assert_close(sub.module(x), z @ model[5].weight[:, u].T + model[5].bias, **TOL)
    # the full model: its own norm over all 32 units, the branch scaled by 1/S
    plan.scale_outputs()
    z = F.gelu(model[2](model[1](x.flatten(1))))
    torch.testing.assert_close(model(x), z @ model[5].weight.T / 2 + model[5].bias, **TOL)
    torch.testing.assert_close(_unhooked(model)(x), clean(x), rtol=0, atol=0)  # nothing in the state
    aggregation_round_trip(model, transformer_ist_plan(model, 2, "ffn", torch.Generator().manual_seed(2)), x)


def test_a_batchnorm_between_the_projections_is_exact():
    """BatchNorm1d normalizes each unit over the batch: a subnetwork is the full model with the other
    units removed (training mode too), its running statistics go back to their units."""
    model = norm_mlp("batch")
    assert find_structure(model).ffns[0].norms == ("2",)
    x = torch.randn(9, 12, dtype=torch.float64)
    plan = transformer_ist_plan(model, 2, "ffn", torch.Generator().manual_seed(0))
    assert {"2.running_mean", "2.running_var"} <= {t.name for t in plan.partitioned}
    subs = plan.build()
    model.train()
    ref = _unhooked(model)
    ref[4].p = 0.0
    outs = []
    for s, sub in enumerate(subs):
        sub.module.train()
        sub.module[4].p = 0.0
        u = plan.units["5"][s]
        assert sub.module[2].num_features == 16
        r = copy.deepcopy(ref)
        with torch.no_grad():
            _zero_except(r[5].weight, 1, u)
        outs.append(sub.module(x))
        torch.testing.assert_close(outs[-1], r(x), **TOL)
    plan.aggregate(subs)  # the running statistics each subnetwork updated, back in their units
    stats = torch.zeros(32, dtype=torch.float64)
    ref(x)
    for s, sub in enumerate(subs):
        stats[plan.units["5"][s]] = sub.module[2].running_mean
    torch.testing.assert_close(model[2].running_mean, stats, **TOL)
    torch.testing.assert_close(model[2].running_mean, ref[2].running_mean, **TOL)
    model[4].p = 0.0
    torch.testing.assert_close(model(x), sum(o for o in outs) / 2, **TOL)  # the mean of the subnetworks


# ---------------------------------------------------------------- a decoder layer written by hand

class Decoder(nn.Module):
    """A decoder layer as several HF layers are written: projections and norms are its direct
    children, no MLP or attention submodule, the forward by hand."""

    def __init__(self, d=16, heads=4, h=40, gated=True, kv_heads=None):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.num_key_value_heads = kv_heads or heads
        kv = self.num_key_value_heads * self.head_dim
        self.input_layernorm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, kv), nn.Linear(d, kv)
        self.o_proj = nn.Linear(d, d)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.gated = gated
        if gated:
            self.gate_proj, self.up_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
            self.down_proj = nn.Linear(h, d, bias=False)
        else:
            self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def attention(self, y):
        B, T, _ = y.shape
        q = self.q_proj(y).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (p(y).view(B, T, self.num_key_value_heads, self.head_dim).transpose(1, 2)
                for p in (self.k_proj, self.v_proj))
        g = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        s = s.masked_fill(self.causal(s), float("-inf"))
        return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))

    def causal(self, s):
        return torch.ones_like(s, dtype=torch.bool).triu(1)

    def forward(self, hidden_states, attention_mask=None):
        x = hidden_states + self.attention(self.input_layernorm(hidden_states))
        y = self.post_attention_layernorm(x)
        if self.gated:
            return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return x + self.fc2(F.dropout(F.gelu(self.fc1(y)), 0.0, self.training))


class ShapeCheckingDecoder(Decoder):
    """The same layer, its forward branching on its input's shape and its mask made on the default
    device: torch.fx cannot trace it, so its flow is read from one forward of a meta sample."""

    def causal(self, s):
        return torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1)

    def forward(self, hidden_states, attention_mask=None):
        if hidden_states.dim() == 2:
            hidden_states = hidden_states.unsqueeze(0)
        return super().forward(hidden_states, attention_mask)


def decoders(cls=Decoder, n=3, **kw):
    torch.manual_seed(0)
    return _noisy(nn.Sequential(*[cls(**kw) for _ in range(n)]))


def _decoder_reference(model, units=None, heads=None, scale=1.0):
    """``model`` (a Sequential of Decoders) with only ``units[i]`` FFN units and ``heads[i]`` query
    heads of layer i (the others' output-projection columns zeroed), those weights times ``scale``."""
    ref = _unhooked(model)
    with torch.no_grad():
        for i, layer in enumerate(ref):
            out = layer.down_proj if layer.gated else layer.fc2
            if units is not None:
                _zero_except(out.weight, 1, units[i])
                out.weight.mul_(scale)
            if heads is not None:
                _zero_except(layer.o_proj.weight, 1, _cols(heads[i], layer.head_dim))
                layer.o_proj.weight.mul_(scale)
    return ref


@pytest.mark.parametrize("cls, kw", [(Decoder, {}), (Decoder, dict(gated=False)), (Decoder, dict(kv_heads=2)),
                                     (ShapeCheckingDecoder, {})])
@pytest.mark.parametrize("partition", ["ffn", "heads", "both"])
def test_a_decoder_layer_with_direct_child_projections(cls, kw, partition):
    model = decoders(cls, **kw)
    st = find_structure(model)
    ffn = ("gate_proj", "up_proj") if kw.get("gated", True) else ("fc1",)
    out = "down_proj" if kw.get("gated", True) else "fc2"
    assert [(f.in_projs, f.out_proj, f.name) for f in st.ffns] == \
        [(tuple(f"{i}.{p}" for p in ffn), f"{i}.{out}", f"{i}") for i in range(3)]
    a = st.attentions[1]
    assert (a.q, a.k, a.v, a.o, a.name) == ("1.q_proj", "1.k_proj", "1.v_proj", "1.o_proj", "1")
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (4, kw.get("kv_heads", 4), 4)
    assert st.layers == "" and st.num_layers == 3 and not st.notes
    if cls is ShapeCheckingDecoder:
        with pytest.raises(dataflow.NoFlow, match="torch.fx could not trace"):
            dataflow.fx_flow(model[0], lambda m: True)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, partition, torch.Generator().manual_seed(3))
    subs = plan.build()
    for s, sub in enumerate(subs):
        units = [plan.units[str(i)][s] for i in range(3)] if partition != "heads" else None
        heads = [plan.heads[str(i)][s] for i in range(3)] if partition != "ffn" else None
        if heads is not None:
            assert sub.module[0].num_heads == 2 and sub.module[0].q_proj.out_features == 8
        torch.testing.assert_close(sub.module(x), _decoder_reference(model, units, heads)(x), **TOL)
    plan.scale_outputs()
    every = [torch.arange(40)] * 3 if partition != "heads" else None
    all_heads = [torch.arange(4)] * 3 if partition != "ffn" else None
    torch.testing.assert_close(model(x), _decoder_reference(clean, every, all_heads, 0.5)(x), **TOL)
    if partition != "heads":  # each FFN branch of the full model is the mean of the subnetworks'
        for i in range(3):
            y = torch.randn(2, 6, 16, dtype=torch.float64)
            branch = (lambda m: m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))) if kw.get("gated", True) \
                else (lambda m: m.fc2(F.gelu(m.fc1(y))))
            torch.testing.assert_close(branch(model[i]), sum(branch(sub.module[i]) for sub in subs) / 2, **TOL)
    if partition == "both" and cls is Decoder and not kw:
        aggregation_round_trip(model, transformer_ist_plan(model, 2, "both", torch.Generator().manual_seed(4)), x)
        rp = transformer_resist_plan(model, 2, 1, torch.Generator().manual_seed(0))  # ResIST of the same layers
        assert rp.partitioned_blocks == ["1"]


# ---------------------------------------------------------------- nn.MultiheadAttention

class Attn(nn.Module):
    def __init__(self, E=16, H=4, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, H, **kw)

    def forward(self, x, kv=None, **kw):
        kv = x if kv is None else kv
        return self.attn(x, kv, kv, **kw)[0]


def mha_reference(m, q_in, kv_in, heads, attn_mask=None, key_padding_mask=None, batch_first=True):
    """The float64 output of ``m`` (an nn.MultiheadAttention) with only the heads ``heads``, and their
    attention weights [N, len(heads), L, S], from the math: per head softmax(q k^T / sqrt(hd) + mask) v,
    through its columns of out_proj. ``attn_mask``: an additive [L, S] or [N * H, L, S] mask;
    ``key_padding_mask``: bool [N, S] (True: not attended)."""
    if not batch_first:
        q_in, kv_in = q_in.transpose(0, 1), kv_in.transpose(0, 1)
    E, H, hd = m.embed_dim, m.num_heads, m.head_dim
    if m.in_proj_weight is not None:
        Wq, Wk, Wv = m.in_proj_weight[:E], m.in_proj_weight[E:2 * E], m.in_proj_weight[2 * E:]
    else:
        Wq, Wk, Wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    b = m.in_proj_bias
    N, L, S = q_in.shape[0], q_in.shape[1], kv_in.shape[1]
    out = torch.zeros(N, L, E, dtype=torch.float64)
    weights = []
    for h in heads.tolist():
        r = slice(h * hd, (h + 1) * hd)
        q = q_in @ Wq[r].T + b[r]
        k = kv_in @ Wk[r].T + b[E:][r]
        v = kv_in @ Wv[r].T + b[2 * E:][r]
        extra = 0
        if m.bias_k is not None:
            k = torch.cat([k, m.bias_k[0, 0, r].expand(N, 1, hd)], 1)
            v = torch.cat([v, m.bias_v[0, 0, r].expand(N, 1, hd)], 1)
            extra += 1
        if m.add_zero_attn:
            k = torch.cat([k, torch.zeros(N, 1, hd, dtype=k.dtype)], 1)
            v = torch.cat([v, torch.zeros(N, 1, hd, dtype=v.dtype)], 1)
            extra += 1
        s = q @ k.transpose(1, 2) / math.sqrt(hd)
        if attn_mask is not None:
            am = attn_mask if attn_mask.dim() == 2 else attn_mask.view(N, H, L, S)[:, h]
            s = s + F.pad(am, (0, extra))
        if key_padding_mask is not None:
            s = s.masked_fill(F.pad(key_padding_mask, (0, extra)).view(N, 1, S + extra), float("-inf"))
        p = s.softmax(-1)
        weights.append(p)
        out = out + (p @ v) @ m.out_proj.weight[:, r].T
    out = out + m.out_proj.bias
    return (out if batch_first else out.transpose(0, 1)), torch.stack(weights, 1)


MHA_CASES = {
    "batch_first": dict(kw=dict(batch_first=True), fwd=dict(need_weights=False)),
    "masks": dict(kw=dict(batch_first=True), fwd=dict(need_weights=True, average_attn_weights=False), masks=True),
    "sequence_first_bias_kv_zero_attn": dict(kw=dict(add_bias_kv=True, add_zero_attn=True),
                                             fwd=dict(need_weights=True), masks=True),
    "kdim_per_head_mask": dict(kw=dict(batch_first=True, kdim=12, vdim=12), fwd=dict(need_weights=False),
                               head_mask=True),
}


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_heads(case):
    c = MHA_CASES[case]
    torch.manual_seed(0)
    model = _noisy(Attn(**c["kw"]))
    bf = model.attn.batch_first
    st = find_structure(model)
    a = st.attentions[0]
    assert (a.q, a.k, a.v, a.o, a.num_heads, a.num_kv_heads, a.head_dim, a.name) == \
        ("attn", "attn", "attn", "attn.out_proj", 4, 4, 4, "attn")
    N, L, S = 3, 5, 6 if "kdim" in c["kw"] else 5
    x = torch.randn(N, L, 16, dtype=torch.float64)
    kv = torch.randn(N, S, 12, dtype=torch.float64) if "kdim" in c["kw"] else x
    fwd, ref_kw = dict(c["fwd"]), {}
    if c.get("masks"):
        causal = torch.ones(L, S, dtype=torch.bool).triu(1)
        pad = torch.zeros(N, S, dtype=torch.bool)
        pad[0, -2:] = True
        fwd.update(attn_mask=causal, key_padding_mask=pad)
        ref_kw = dict(attn_mask=torch.zeros(L, S, dtype=torch.float64).masked_fill(causal, float("-inf")),
                      key_padding_mask=pad)
    if c.get("head_mask"):
        m3 = torch.randn(N * 4, L, S, dtype=torch.float64)
        fwd.update(attn_mask=m3)
        ref_kw = dict(attn_mask=m3)
    xin, kvin = (x, kv) if bf else (x.transpose(0, 1), kv.transpose(0, 1))
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, "heads", torch.Generator().manual_seed(1))
    subs = plan.build()
    outs = []
    for s, sub in enumerate(subs):
        m = sub.module.attn
        heads = plan.heads["attn.out_proj"][s]
        assert type(m) is HeadsMultiheadAttention and m.num_heads == 2 and m.out_proj.in_features == 8
        assert m.embed_dim == 16 and m.head_dim == 4 and torch.equal(m.heads, heads)
        y, w = m(xin, kvin, kvin, **fwd)
        want, want_w = mha_reference(clean.attn, xin, kvin, heads, batch_first=bf, **ref_kw)
        torch.testing.assert_close(y, want, **TOL)
        if fwd.get("need_weights"):
            want_w = want_w if fwd.get("average_attn_weights", True) is False else want_w.mean(1)
            torch.testing.assert_close(w, want_w, **TOL)
        outs.append(y)
    # the full module: its heads' sum scaled by 1/S (a forward hook: its forward reads out_proj itself)
    plan.scale_outputs()
    assert input_scale(model.attn) == 0.5 and plan.output_projections() == ["attn"]
    y = model.attn(xin, kvin, kvin, **fwd)[0]
    want, _ = mha_reference(clean.attn, xin, kvin, torch.arange(4), batch_first=bf, **ref_kw)
    b = clean.attn.out_proj.bias
    torch.testing.assert_close(y, b + (want - b) / 2, **TOL)
    torch.testing.assert_close(y, sum(outs) / 2, **TOL)
    with torch.no_grad():  # eval without grad: torch's fast path where it applies, the hook still scales
        torch.testing.assert_close(model.attn(xin, kvin, kvin, **fwd)[0], y, **TOL)
    aggregation_round_trip(model, transformer_ist_plan(model, 2, "heads", torch.Generator().manual_seed(2)), x,
                lambda m, x: m(xin, kvin))


def encoder(depth=3):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 48, dropout=0.0, batch_first=True)
    return _noisy(nn.TransformerEncoder(layer, depth, enable_nested_tensor=False))


@pytest.mark.parametrize("partition", ["ffn", "both"])
def test_torch_transformer_encoder(partition):
    """nn.TransformerEncoderLayer: linear1/linear2 beside its nn.MultiheadAttention and norms (its
    forward branches on shapes: read from one meta forward); its fast path never bypasses the scales."""
    model = encoder()
    st = find_structure(model)
    assert [(f.in_projs, f.out_proj) for f in st.ffns] == [((f"layers.{i}.linear1",), f"layers.{i}.linear2")
                                                           for i in range(3)]
    assert [a.q for a in st.attentions] == [f"layers.{i}.self_attn" for i in range(3)]
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, partition, torch.Generator().manual_seed(0))
    subs = plan.build()

    def reference(units, heads, scale=1.0):
        ref = _unhooked(clean).train()  # torch's own layers, no fast path
        with torch.no_grad():
            for i, layer in enumerate(ref.layers):
                _zero_except(layer.linear2.weight, 1, units[i])
                layer.linear2.weight.mul_(scale)
                if heads is not None:
                    _zero_except(layer.self_attn.out_proj.weight, 1, _cols(heads[i], 4))
                    layer.self_attn.out_proj.weight.mul_(scale)
        return ref

    for s, sub in enumerate(subs):
        units = [plan.units[f"layers.{i}"][s] for i in range(3)]
        heads = [plan.heads[f"layers.{i}"][s] for i in range(3)] if partition == "both" else None
        with torch.no_grad():
            torch.testing.assert_close(sub.module(x), reference(units, heads)(x), **TOL)
    plan.scale_outputs()
    ref = reference([torch.arange(48)] * 3, [torch.arange(4)] * 3 if partition == "both" else None, 0.5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), **TOL)


@pytest.mark.parametrize("partition", ["ffn", "both"])
def test_hf_opt(partition):
    """HF OPT's decoder layer holds fc1 / fc2 beside its attention and norms (no MLP module)."""
    tr = pytest.importorskip("transformers")
    cfg = tr.OPTConfig(vocab_size=256, hidden_size=32, ffn_dim=80, num_hidden_layers=3, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = _noisy(tr.OPTForCausalLM(cfg))
    st = find_structure(model)
    key = "model.decoder.layers.{}"
    assert [(f.in_projs, f.out_proj) for f in st.ffns] == [((key.format(i) + ".fc1",), key.format(i) + ".fc2")
                                                           for i in range(3)]
    assert len(st.attentions) == 3 and st.layers == "model.decoder.layers"
    x = torch.randint(0, 256, (2, 9))
    clean = copy.deepcopy(model)
    plan = transformer_ist_plan(model, 2, partition, torch.Generator().manual_seed(0))

    def reference(s, scale=1.0):
        ref = _unhooked(clean)
        with torch.no_grad():
            for i, layer in enumerate(ref.model.decoder.layers):
                _zero_except(layer.fc2.weight, 1, plan.units[key.format(i)][s] if s is not None else torch.arange(80))
                layer.fc2.weight.mul_(scale)
                if partition == "both":
                    heads = plan.heads[key.format(i)][s] if s is not None else torch.arange(4)
                    _zero_except(layer.self_attn.out_proj.weight, 1, _cols(heads, 8))
                    layer.self_attn.out_proj.weight.mul_(scale)
        return ref

    for s, sub in enumerate(plan.build()):
        assert sub.module.model.decoder.layers[0].fc1.out_features == 40
        torch.testing.assert_close(sub.module(input_ids=x).logits, reference(s)(input_ids=x).logits, **TOL)
    plan.scale_outputs()
    torch.testing.assert_close(model(input_ids=x).logits, reference(None, 0.5)(input_ids=x).logits, **TOL)


# ---------------------------------------------------------------- a structure-only (meta) model

@pytest.mark.parametrize("build", [lambda: decoders(ShapeCheckingDecoder), encoder,
                                   lambda: _noisy(Attn(batch_first=True))])
def test_a_meta_model_partitions_like_the_real_one(build):
    real = build()
    meta = copy.deepcopy(real).to("meta")
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    partition = "both" if find_structure(real).ffns else "heads"
    rp, mp = transformer_ist_plan(real, 2, partition, g()), transformer_ist_plan(meta, 2, partition, g())
    assert [(t.name, t.dim) for t in rp.tensors] == [(t.name, t.dim) for t in mp.tensors]
    for a, b in zip(rp.tensors, mp.tensors):
        assert all(torch.equal(u, v) for u, v in zip(a.owners, b.owners))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for s, sub in enumerate(rp.build()):
        attached = mp.attach(s, rp.part(s)).module.eval()
        torch.testing.assert_close(attached(x), sub.module(x), rtol=0, atol=0)


# ---------------------------------------------------------------- what is still refused, and why

# (a norm beside the projections: a module holding only two projections is taken whole, unread)
class SoftmaxBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.softmax(self.a(self.norm(x)), -1))


class Leaky(nn.Module):  # the hidden values also leave the module
    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.a(self.norm(x)))
        return self.b(h) + h.mean(-1, keepdim=True)


class Opaque(nn.Module):  # two required inputs and control flow on values: neither traced nor run
    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, y):
        if bool(y.sum() > 0):
            x = -x
        return self.b(torch.relu(self.a(self.norm(x))))


@pytest.mark.parametrize("cls, why", [
    (SoftmaxBetween, r"not taken: <root>: a -> b: softmax\(\) is not elementwise per hidden unit nor a norm "
                     r"of the 16 units"),
    (Leaky, r"not taken: <root>: a -> b: the hidden values are also read by mean\(\)"),
    (Opaque, r"not taken: <root>: projections a, b seen, their data flow not read: torch.fx could not trace "
             r"Opaque.forward \(TraceError.*Opaque.forward takes 2 required arguments"),
])
def test_what_is_refused_says_what_was_found_and_why(cls, why):
    with pytest.raises(ValueError, match=r"found no FFN in " + cls.__name__ + r" \(partition=ffn\): looked for an "
                       r"FFN.*data flow.*; found: residual layers: none; " + why):
        transformer_ist_plan(cls(), 2)
    # a spec still partitions it
    plan = transformer_ist_plan(cls(), 2, spec={"ffns": [("a", "b")]})
    assert plan.units["b"][0].numel() == 8


def test_a_spec_names_the_norms_and_a_multihead_attention():
    model = norm_mlp()
    st = find_structure(model, {"ffns": [(("1",), "5", ("2",))], "attentions": []})
    assert st.ffns[0].norms == ("2",)
    with pytest.raises(ValueError, match="spec: FFN norm '3' is not a LayerNorm"):
        find_structure(model, {"ffns": [(("1",), "5", ("3",))]})
    attn = Attn()
    assert find_structure(attn, {"attentions": [{"q": "attn", "k": "attn", "v": "attn", "o": "attn.out_proj"}]}) \
        .attentions == find_structure(attn).attentions


# ---------------------------------------------------------------- the trainer, end to end

class Classifier(nn.Module):
    """Two hand-written decoder layers over 4 positions of 12 features, mean-pooled to 3 classes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Decoder(d=12, heads=4, h=24) for _ in range(2)])
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = x.view(x.shape[0], 4, 12)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def norm_classifier():
    return nn.Sequential(nn.Linear(48, 40), nn.LayerNorm(40), nn.GELU(), nn.Dropout(0.1), nn.Linear(40, 3))


@pytest.mark.parametrize("factory, partition, check", [
    (norm_classifier, "ffn", lambda m: m[0].out_features == 20 and m[1].normalized_shape == (20,)),
    (Classifier, "both", lambda m: m.layers[0].down_proj.in_features == 12 and m.layers[1].num_heads == 2),
])
def test_the_engine_trains_them(tmp_path, factory, partition, check):
    from ist_kernels.train import Engine
    torch.manual_seed(0)
    x, y = torch.randn(64, 48), torch.randint(0, 3, (64,))

    def score(model):
        with torch.no_grad():
            return {"accuracy": float((model(x).argmax(-1) == y).float().mean())}

    engine = Engine(factory, method="ist", workers=2, rounds=2, local_steps=3, lr=0.1, evaluate=score,
                    eval_interval=1, options={"partition": partition}, out_dir=str(tmp_path / "run"), device="cpu",
                    threads=1)
    for rnd in engine.rounds():
        for worker in rnd:
            assert check(worker.model)
            for i in range(3):
                worker.optimizer.zero_grad()
                loss = F.cross_entropy(worker.model(x[i::3]), y[i::3])
                loss.backward()
                worker.optimizer.step()
                worker.add_loss(loss)
        assert rnd.record["accuracy"] is not None and rnd.record["bytes_sent"] > 0
    full = engine.global_model()
    assert not check(full)
    summary = engine.close()
    assert summary["rounds"] == 2 and summary["bytes_per_round"] > 0
