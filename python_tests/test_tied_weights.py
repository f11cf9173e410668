"""Tied weights (one tensor held by several modules: HF GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``, a user's LM whose output layer is its embedding): a partition plan holds
such a tensor once (its first name in module order, as ``named_parameters()``), every subnetwork's
clone stays tied (its optimizer sees one parameter), aggregation writes it once and the model stays
tied; the round engine's helpers (unique names, a tied meta structure, the tied assembled model) and
the trainer's ``ist`` rounds on GPT-2 in one process and on two gloo ranks (decentralized storage,
bit for bit with the simulated run, resumed from per-rank checkpoints)."""
import copy
import os

import pytest
import torch
from torch import nn

from ist_kernels.partition import transformer_ist_plan, transformer_resist_plan
from ist_kernels.partition.subnetworks import SubnetworkPlan
from ist_kernels.train.rounds import assign_tensors_, model_tensors, tied_names, to_meta_

from conftest import free_port, spawn_ranks_until
from train_helpers import assert_equal_states, outputs

TOL = dict(rtol=1e-12, atol=1e-12)
TR = pytest.importorskip("transformers")


def gpt2_model():
    """GPT-2 tied by default (``tie_word_embeddings=True``); no dropout, so that runs compare exactly."""
    torch.manual_seed(0)
    cfg = TR.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return TR.GPT2LMHeadModel(cfg)


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class TiedLM(nn.Module):
    """A user's language model whose output layer is its embedding."""

    def __init__(self, vocab=32, width=16, hidden=64, depth=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width, hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.emb(x))))


def tied_lm():
    torch.manual_seed(0)
    return TiedLM().double()


# (model, its tied places (first, other), a forward on tokens)
MODELS = {
    "gpt2": (lambda: gpt2_model().double(), ("transformer.wte", "lm_head"),
             lambda m, x: m(input_ids=x, use_cache=False).logits),
    "user": (tied_lm, ("emb", "head"), lambda m, x: m(x)),
}


def _tied(module, places):
    a, b = (module.get_submodule(p).weight for p in places)
    return a is b


# ------------------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("name, partition", [("gpt2", "both"), ("user", "ffn")])
def test_ist_plan_holds_a_tied_tensor_once_and_aggregation_keeps_the_model_tied(name, partition):
    build, places, fwd = MODELS[name]
    S = 2
    model = build()
    first, other = (f"{p}.weight" for p in places)
    plan = transformer_ist_plan(model, S, partition, torch.Generator().manual_seed(1))
    assert plan.aliases == {other: first}
    names = [t.name for t in plan.tensors]
    assert len(names) == len(set(names)) and other not in names and other not in plan.local_names
    assert names == list(model_tensors(model)) and set(names) >= {n for n, _ in model.named_parameters()}
    assert first in {t.name for t in plan.shared}
    subs = plan.build()
    for s, sub in enumerate(subs):
        assert _tied(sub.module, places)  # the clone stays tied: one parameter
        assert plan.local_names[first][s] == first
        assert len(list(sub.module.parameters())) == len(list(sub.module.named_parameters(remove_duplicate=False))) - 1
        assert list(plan.tensors_of(sub)) == [n for n in names if plan.local_names[n][s] is not None]
        with torch.no_grad():
            for p in sub.module.parameters():  # the tied tensor once
                p.add_(s + 1.0)
    params = {n for n, _ in model.named_parameters()}
    now = {k: v.clone() for k, v in plan.model_tensors().items()}
    expected = {}
    for t in plan.partitioned:  # every slice from its single owner
        g = now[t.name]
        for s in range(S):
            g.index_copy_(t.dim, t.owners[s], g.index_select(t.dim, t.owners[s]) + s + 1.0)
        expected[t.name] = g
    for t in plan.shared:  # the mean of +1 and +2 (buffers untouched)
        expected[t.name] = now[t.name] + 1.5 if t.name in params else now[t.name]
    before = model.get_submodule(places[0]).weight
    plan.aggregate(subs)
    assert _tied(model, places) and model.get_submodule(places[0]).weight is before
    got = plan.model_tensors()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, **TOL)
    x = torch.randint(0, 32, (2, 10))
    fwd(model, x)
    for sub in plan.build():  # the next round's clones are tied too
        assert _tied(sub.module, places)
        fwd(sub.module, x)


@pytest.mark.parametrize("name", ["gpt2", "user"])
def test_clone_optimizers_see_one_parameter_and_its_state_is_aggregated_once(name):
    build, places, fwd = MODELS[name]
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = transformer_ist_plan(model, 2, "ffn", torch.Generator().manual_seed(2))
    subs = plan.build(opt)
    x = torch.randint(0, 32, (2, 10))
    for sub in subs:
        ps = sub.optimizer.param_groups[0]["params"]
        assert len(ps) == len({id(p) for p in ps}) == len(list(sub.module.parameters()))
        sub.optimizer.zero_grad()
        fwd(sub.module, x).square().mean().backward()
        sub.optimizer.step()
    tied = [sub.module.get_submodule(places[0]).weight for sub in subs]
    want_w = torch.stack([t.detach() for t in tied]).mean(0)
    want_m = torch.stack([sub.optimizer.state[t]["momentum_buffer"] for sub, t in zip(subs, tied)]).mean(0)
    plan.aggregate(subs, opt)
    w = model.get_submodule(places[0]).weight
    assert _tied(model, places)
    torch.testing.assert_close(w.detach(), want_w, **TOL)
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], want_m, **TOL)
    assert len(opt.state) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["gpt2", "user"])
def test_resist_plan_keeps_the_ties(name):
    build, places, fwd = MODELS[name]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = transformer_resist_plan(model, 2, 1, torch.Generator().manual_seed(5))
    assert list(plan.aliases.values()) == [f"{places[0]}.weight"]
    subs = plan.build()
    assert all(_tied(sub.module, places) for sub in subs)
    plan.aggregate(subs)
    after = model.state_dict()
    assert _tied(model, places) and list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


class RowPlan(SubnetworkPlan):
    """The user model's embedding rows (vocabulary) dealt out: the tied output layer goes with them."""

    who = "row_plan"

    def __init__(self, model, partitioned):
        self.rows = {n: owned for n, (_, owned) in partitioned.items()}
        super().__init__(model, 2, partitioned)

    def _edit(self, s, glob, root):
        n = self.rows["emb.weight"][s].numel()
        glob["emb"].num_embeddings = glob["head"].out_features = n


def test_a_tied_tensor_is_partitioned_by_its_first_name_only():
    model = tied_lm()
    halves = [torch.arange(0, 16), torch.arange(16, 32)]
    plan = RowPlan(model, {"emb.weight": (0, halves)})
    assert [t.name for t in plan.partitioned] == ["emb.weight"]
    subs = plan.build()
    for s, sub in enumerate(subs):
        assert _tied(sub.module, ("emb", "head")) and sub.module.head.weight.shape == (16, 16)
        with torch.no_grad():
            sub.module.head.weight.add_(s + 1.0)
    want = model.emb.weight.detach().clone()
    want[:16] += 1
    want[16:] += 2
    plan.aggregate(subs)
    assert _tied(model, ("emb", "head"))
    torch.testing.assert_close(model.emb.weight.detach(), want, **TOL)
    with pytest.raises(ValueError, match="head.weight is tied to emb.weight"):
        RowPlan(tied_lm(), {"head.weight": (0, halves)})
    # a clone whose tie was broken is refused before anything is written
    subs = plan.build()
    subs[1].module.head.weight = nn.Parameter(subs[1].module.head.weight.detach().clone())
    snapshot = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match="no longer"):
        plan.aggregate(subs)
    assert torch.equal(model.emb.weight.detach(), snapshot)


# ------------------------------------------------------------------- the round engine's helpers

def test_engine_names_a_tied_tensor_once_and_keeps_ties_on_meta_and_when_assembled():
    model = gpt2_model()
    places = ("transformer.wte", "lm_head")
    tensors = model_tensors(model)
    assert "lm_head.weight" not in tensors and "lm_head.weight" in model.state_dict()
    assert tied_names(model) == {"lm_head.weight": "transformer.wte.weight"}
    assert list(tensors) == [t.name for t in transformer_ist_plan(model, 2, "both").tensors]
    plan = transformer_ist_plan(model, 2, "both", torch.Generator().manual_seed(4))
    parts = [plan.part(s) for s in range(2)]
    full = {k: v.clone() for k, v in tensors.items()}
    meta = to_meta_(copy.deepcopy(model))  # decentralized storage's structure (Module.to would untie it)
    assert _tied(meta, places) and meta.lm_head.weight.is_meta
    assert all(not t.is_meta for t in model.state_dict().values())
    meta_plan = transformer_ist_plan(meta, 2, "both", torch.Generator().manual_seed(4))
    assert [t.name for t in meta_plan.tensors] == list(tensors)
    for s in range(2):
        sub = meta_plan.attach(s, parts[s])  # a rank's subnetwork around its compact tensors
        assert _tied(sub.module, places) and sub.module.lm_head.weight.data_ptr() == parts[s][
            "transformer.wte.weight"].data_ptr()
        assert list(meta_plan.tensors_of(sub)) == list(parts[s])
    assembled = assign_tensors_(copy.deepcopy(meta), full)  # the engine's _assemble
    assert _tied(assembled, places) and not assembled.lm_head.weight.is_meta
    assert_equal_states(assembled.state_dict(), model.state_dict())
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(assembled(input_ids=x).logits, model(input_ids=x).logits, rtol=0, atol=0)


# ---------------------------------------------------------------- the trainer's rounds on GPT-2

KW = dict(method="ist", workers=2, dataset="pycode", rounds=2, local_steps=2, batch_size=4, context=32,
          dataset_size=20000, lr=0.01, options={"partition": "both"}, shared="exact", threads=1, device="cpu")


def _engine(**kw):
    from ist_kernels.train import Engine

    return Engine(gpt2_model, **{**KW, **kw})


def _loop(engine):
    for rnd in engine.rounds():
        for w in rnd:
            assert _tied(w.model, ("transformer.wte", "lm_head"))
            assert len(w.optimizer.param_groups[0]["params"]) == len(list(w.model.parameters()))
            for x, y in w.batches():
                w.optimizer.zero_grad(set_to_none=True)
                loss = w.loss(w.model(x), y)
                loss.backward()
                w.optimizer.step()
                w.add_loss(loss)
    model = engine.global_model()
    if model is not None:
        assert _tied(model, ("transformer.wte", "lm_head"))
    return engine.close()


def _rank(rank, S, port, out):
    """One rank of the gloo run, as torchrun starts it: a full run, then one cut after round 1 and
    resumed."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(S), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        _loop(_engine(out_dir=os.path.join(out, "dist")))
        _loop(_engine(out_dir=os.path.join(out, "cut"), stop_after=1, checkpoint_interval=1))
        _loop(_engine(out_dir=os.path.join(out, "cut"), resume=True))
    except BaseException as e:  # noqa: B902 - read back by the test
        with open(os.path.join(out, f"err{rank}.txt"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        raise


def test_ist_rounds_on_gpt2_simulated_and_on_two_ranks(tmp_path):
    """Simulated: the model and every subnetwork stay tied through the rounds; two gloo ranks
    (decentralized storage: the global model is a tied meta structure, the full model assembled
    tied) give the simulated model bit for bit, also when resumed from per-rank checkpoints."""
    summary = _loop(_engine(out_dir=str(tmp_path / "sim")))
    assert summary["finished"] and summary["mode"] == "simulated"
    _, sim, _ = outputs(tmp_path / "sim")
    assert torch.equal(sim["lm_head.weight"], sim["transformer.wte.weight"])
    spawn_ranks_until(_rank, (2, free_port(), str(tmp_path)), 2, 300)
    for r in range(2):
        assert not os.path.exists(tmp_path / f"err{r}.txt"), (tmp_path / f"err{r}.txt").read_text()
    d_sum, dist, _ = outputs(tmp_path / "dist")
    assert (d_sum["mode"], d_sum["storage"]) == ("distributed", "decentralized")
    assert_equal_states(dist, sim)
    assert_equal_states(outputs(tmp_path / "cut")[1], sim)
