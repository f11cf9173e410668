"""The trainer's MLP methods: ist and masked (paper 001, neuron subnetworks of a SubnetMLP) and
grelu (paper 004's GReLUMLP). Each runs end to end with 2 spawned gloo workers (decentralized
storage) and simulated; the two launch modes give bit-identical models (--threads 1, --shared
exact); resume equals an uninterrupted run; a masked round equals Algorithm 1's update computed
independently; bad options are rejected."""
import functools
import math

import pytest
import torch

from ist_kernels.train import cli
from ist_kernels.train.config import ConfigError, TrainConfig
from ist_kernels.train.datasets import ShardedData, _mix, load_dataset

from train_helpers import TINY_MLP, assert_equal_states, run as _run, untimed, user_loop

TINY = [*TINY_MLP, "--shared", "exact"]  # bit for bit (the default ring all_reduce: ulps)
run = functools.partial(_run, base=TINY)


def both_modes(root, *args, base=TINY):
    sim = run(root / "sim", *args, "--simulate", 2, base=base)
    dist = run(root / "dist", *args, "--workers", 2, base=base)
    assert sim[0]["mode"] == "simulated" and dist[0]["mode"] == "distributed"
    assert_equal_states(sim[1], dist[1])
    assert untimed(sim[2]) == untimed(dist[2])
    return sim, dist


# ---------------------------------------------------------------- ist / masked

@pytest.fixture(scope="module")
def ist_runs(tmp_path_factory):
    return both_modes(tmp_path_factory.mktemp("ist"), "--method", "ist", "--rounds", 4)


def neuron_plans(method, masks, xi, rounds, S=2, width=16, depth=1, seed=0):
    """The neurons of every worker, round by round, as the trainer draws them."""
    from ist_kernels.nn.subnet import SubnetMLP
    from ist_kernels.train.methods.masked import PLAN
    from ist_kernels.train.paper001 import sample_neurons

    net = SubnetMLP(64, width, depth, 10, bias=True, train_output=True)
    return [sample_neurons(net, S, masks, xi, torch.Generator().manual_seed(_mix(seed, PLAN, r))) for r in range(rounds)]


def test_ist_distributed_equals_simulated(ist_runs):
    (summary, model, hist), _ = ist_runs
    assert [r["round"] for r in hist] == [0, 1, 2, 3, 4]
    assert hist[-1]["test_loss"] < hist[0]["test_loss"]
    # decentralized storage, balanced partition of 16 neurons into 2: a neuron whose owner changes
    # between rounds moves once, its hidden-weight row (64), bias (1) and output column (10); the
    # shared output bias (10) goes to the other rank (--shared exact); the last round only averages.
    # Parameter-server count: each worker uploads and downloads its 8 neurons and the output bias.
    plans = neuron_plans("ist", "balanced", None, 4)
    for r in range(4):
        moved = 0 if r == 3 else sum(len(set(plans[r][s][0].tolist()) & set(plans[r + 1][1 - s][0].tolist()))
                                     for s in range(2))
        assert hist[r + 1]["bytes_sent"] == 4 * (moved * (64 + 1 + 10) + 2 * 10)
        assert hist[r + 1]["ps_bytes"] == 2 * 2 * 4 * (8 * (64 + 1 + 10) + 10)
    assert summary["total_bytes"] == sum(r["bytes_sent"] for r in hist)
    assert summary["masks"] == "balanced" and summary["xi"] == 0.5


def test_ist_is_masked_with_balanced_masks(ist_runs, tmp_path):
    (_, ist_model, ist_hist), _ = ist_runs
    _, model, hist = run(tmp_path, "--method", "masked", "--option", "masks=balanced", "--rounds", 4,
                         "--simulate", 2)
    assert_equal_states(ist_model, model)
    assert untimed(hist) == untimed(ist_hist)


def _plans(method, width, S, rounds, *options):
    """The neuron plans of the first ``rounds`` rounds of ``method`` (per round: per subnetwork,
    per hidden layer, the neuron indices), as the trainer draws them."""
    from ist_kernels.train.methods import get_method
    from ist_kernels.train.runner import RunContext, World

    cfg = cli.build_config([*TINY, "--method", method, "--width", str(width), "--simulate", str(S), "--depth", "2",
                            *[a for o in options for a in ("--option", o)]]).validate()
    ctx = RunContext(cfg, World(simulated=True), ShardedData(load_dataset(cfg), S, 8, 0, "cpu"), rounds)
    m = get_method(method)(ctx)
    return [m.plan(r) for r in range(rounds)]


def test_ist_groups_are_balanced():
    """IST cuts each layer's neurons into S groups whose sizes differ by at most one (IST_Release),
    disjoint and covering: 10 neurons into 4 groups are always 3, 3, 2, 2 (in some order)."""
    for plan in _plans("ist", 10, 4, 30):
        for layer in range(2):
            groups = [plan[s][layer] for s in range(4)]
            assert sorted(len(g) for g in groups) == [2, 2, 3, 3]
            assert sorted(torch.cat(groups).tolist()) == list(range(10))


def test_masked_multinomial_and_bernoulli_never_train_an_empty_subnetwork():
    """The multinomial (categorical) and Bernoulli draws stay options of masked; a layer's draw that
    leaves a subnetwork without neurons is drawn again. At width 4, S = 3 a raw multinomial draw is
    empty for some subnetwork with probability 1 - 36/81 = 0.56, so over 40 rounds x 2 layers the
    unconditioned draws would have had empties (checked below with the raw draw)."""
    from ist_kernels.partition import categorical_partition
    from ist_kernels.train.paper001 import nonempty_probability

    assert nonempty_probability("categorical", 4, 3) == pytest.approx(36 / 81)
    assert nonempty_probability("bernoulli", 4, 3, 0.5) == pytest.approx((1 - 0.5 ** 4) ** 3)
    assert nonempty_probability("balanced", 3, 3) == 1.0 and nonempty_probability("balanced", 2, 3) == 0.0
    g = torch.Generator().manual_seed(0)
    assert any(min(len(i) for i in categorical_partition(4, 3, g)) == 0 for _ in range(80))
    sizes = set()
    for plan in _plans("masked", 4, 3, 40, "masks=categorical"):
        for layer in range(2):
            groups = [plan[s][layer] for s in range(3)]
            assert min(len(g) for g in groups) >= 1
            assert sorted(torch.cat(groups).tolist()) == list(range(4))  # still a partition
            sizes.add(tuple(sorted(len(g) for g in groups)))
    assert sizes == {(1, 1, 2)}  # the only non-empty multinomial split of 4 into 3
    for plan in _plans("masked", 4, 3, 40, "masks=bernoulli", "xi=0.5"):
        assert all(len(plan[s][layer]) >= 1 for s in range(3) for layer in range(2))


def test_sample_neurons_says_when_no_draw_can_be_nonempty():
    from ist_kernels.nn.subnet import SubnetMLP
    from ist_kernels.train.paper001 import sample_neurons

    net = SubnetMLP(3, 2, 1, 1)
    with pytest.raises(ValueError, match="cannot give each of 3 subnetworks a neuron; use width >= 3"):
        sample_neurons(net, 3, "balanced", None, torch.Generator())
    with pytest.raises(ValueError, match="and xi > 0"):
        sample_neurons(net, 2, "bernoulli", 0.0, torch.Generator())


def test_masked_bernoulli_distributed_equals_simulated(tmp_path):
    (summary, model, hist), _ = both_modes(tmp_path, "--method", "masked", "--option", "xi=0.4", "--rounds", 3)
    assert summary["masks"] == "bernoulli" and summary["xi"] == pytest.approx(0.4)
    assert all(r["bytes_sent"] > 0 for r in hist[1:])
    # decentralized storage keeps every unowned neuron with one holder (neuron mod S): a neuron moves
    # when its holders change; the count is what the Exchange's plans say
    from ist_kernels.distributed import plan_bytes
    from ist_kernels.nn.subnet import SubnetMLP

    net = SubnetMLP(64, 16, 1, 10, bias=True, train_output=True)
    plans = neuron_plans("masked", "bernoulli", 0.4, 3)
    sizes = {"hidden_weights.0": 16, "hidden_biases.0": 16, "output_weight": 16}
    store = [net.slice_plan(p).with_holders(sizes) for p in plans]
    for r, nxt in ((0, 1), (1, 2), (2, 2)):
        stats = plan_bytes(store[r], store[nxt], net.slice_spec(), shared="exact")
        assert hist[r + 1]["bytes_sent"] == sum(st.bytes_sent for st in stats)
    # every unowned neuron has exactly one holder, every owned one only its owners
    for p, st in zip(plans, store):
        owned = set(p[0][0].tolist()) | set(p[1][0].tolist())
        held = [set(o.tolist()) for o in st.tensors[0].owners]
        assert held[0] | held[1] == set(range(16))
        for n in set(range(16)) - owned:
            assert (n in held[0]) + (n in held[1]) == 1 and n in held[n % 2]
    assert hist[-1]["test_loss"] < hist[0]["test_loss"]


def test_masked_categorical_distributed_equals_simulated(tmp_path):
    both_modes(tmp_path, "--method", "masked", "--option", "masks=categorical", "--rounds", 2)


def test_masked_round_is_algorithm_1(tmp_path):
    """One round, one plain GD step (no momentum, no weight decay): every owned entry is the mean of
    its owners' updated values, an unowned one keeps its value (Algorithm 1 lines 11-13, η = N⊥/N),
    each owner's update being a gradient step of its subnetwork alone; computed here from the
    definitions in float64 (masks rebuilt from the same seed)."""
    from ist_kernels.nn.subnet import SubnetMLP
    from ist_kernels.train.methods.masked import PLAN
    from ist_kernels.train.paper001 import sample_neurons

    args = ["--dataset", "diabetes", "--model", "mlp", "--width", "6", "--batch-size", "5", "--local-steps", "1",
            "--momentum", "0", "--weight-decay", "0", "--lr", "0.1", "--seed", "3", "--no-progress", "--no-plots",
            "--threads", "1"]
    _, model, _ = run(tmp_path, "--method", "masked", "--option", "xi=0.5", "--rounds", 1, "--simulate", 3, base=args)
    cfg = TrainConfig(dataset="diabetes", seed=3, simulate=3, batch_size=5)
    data = ShardedData(load_dataset(cfg), 3, 5, 3, "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        net = SubnetMLP(10, 6, 1, 1, bias=True, train_output=True, kappa=1.0)
    plan = sample_neurons(net, 3, "bernoulli", 0.5, torch.Generator().manual_seed(_mix(3, PLAN, 0)))
    W0, b0 = net.hidden_weights[0].detach().double(), net.hidden_biases[0].detach().double()
    A0, c0 = net.output_weight.detach().double(), net.output_bias.detach().double()
    sums = [torch.zeros_like(t) for t in (W0, b0, A0, c0)]
    counts = [torch.zeros_like(t) for t in (W0, b0, A0, c0)]
    for s in range(3):
        (rows,) = plan[s]
        x, y = data.batch(s, 0)
        params = [t[rows].clone().requires_grad_() for t in (W0, b0)] + [A0[:, rows].clone().requires_grad_(),
                                                                          c0.clone().requires_grad_()]
        W, b, A, c = params
        pred = torch.relu(x.double() @ W.T + b) / math.sqrt(6) @ A.T + c
        loss = torch.nn.functional.mse_loss(pred.reshape(y.shape), y.double())
        grads = torch.autograd.grad(loss, params)
        new = [p.detach() - 0.1 * g for p, g in zip(params, grads)]
        for i, (idx, val) in enumerate(zip([rows, rows, rows, None], new)):
            if i == 2:
                sums[i][:, idx] += val
                counts[i][:, idx] += 1
            elif idx is None:
                sums[i] += val
                counts[i] += 1
            else:
                sums[i][idx] += val
                counts[i][idx] += 1
    expect = [torch.where(n > 0, s / n.clamp(min=1), t) for s, n, t in zip(sums, counts, (W0, b0, A0, c0))]
    got = [model[k].double() for k in ("net.hidden_weights.0", "net.hidden_biases.0", "net.output_weight",
                                       "net.output_bias")]
    unowned = counts[1] == 0
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
    assert torch.equal(got[1][unowned], b0[unowned].float().double())


@pytest.mark.parametrize("method", ["ist", "masked"])
def test_resume_equals_uninterrupted(method, ist_runs, tmp_path):
    if method == "ist":
        (_, full_model, full_hist), _ = ist_runs
    else:
        _, full_model, full_hist = run(tmp_path / "full", "--method", method, "--rounds", 4, "--simulate", 2)
    out = tmp_path / "run"
    part, _, _ = run(out, "--method", method, "--simulate", 2, "--rounds", 4, "--stop-after", 2)
    assert part["rounds"] == 2 and not part["finished"]
    summary, model, hist = run(out, "--method", method, "--simulate", 2, "--rounds", 4, "--resume")
    assert summary["finished"]
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_ist_resume_distributed(ist_runs, tmp_path):
    _, (_, full_model, full_hist) = ist_runs
    out = tmp_path / "run"
    run(out, "--method", "ist", "--workers", 2, "--rounds", 4, "--stop-after", 3)
    _, model, hist = run(out, "--method", "ist", "--workers", 2, "--rounds", 4, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_ist_deeper_replicated_simulated(tmp_path):
    summary, model, hist = run(tmp_path, "--method", "ist", "--depth", 2, "--rounds", 2, "--simulate", 2,
                               "--storage", "replicated")
    assert "net.hidden_weights.1" in model and summary["finished"]
    # replicated exchange: each worker sends its compact tensors once (S - 1 = 1): 8 x 64 and 8 x 8
    # hidden weights, 2 x 8 biases, 10 x 8 output columns, 10 output biases
    assert all(r["bytes_sent"] == 2 * 4 * (8 * 64 + 8 * 8 + 2 * 8 + 10 * 8 + 10) for r in hist[1:])
    # each worker held the full model, its compact copy and the copy's momentum
    full, compact = 4 * (16 * 64 + 16 * 16 + 2 * 16 + 10 * 16 + 10), 4 * (8 * 64 + 8 * 8 + 2 * 8 + 10 * 8 + 10)
    assert summary["rank_state_bytes"] == full + 2 * compact and summary["full_state_bytes"] == 2 * full


# ---------------------------------------------------------------- grelu

ACKLEY = ["--dataset", "ackley", "--model", "mlp", "--width", "16", "--depth", "2", "--batch-size", "8",
          "--local-steps", "2", "--lr", "0.01", "--no-progress", "--no-plots", "--eval-interval", "2",
          "--threads", "1"]


@pytest.mark.parametrize("subnetworks", ["false", "true"])
def test_grelu_distributed_equals_simulated(tmp_path, subnetworks):
    (summary, model, hist), _ = both_modes(tmp_path, "--method", "grelu", "--option", f"subnetworks={subnetworks}",
                                           "--rounds", 4, base=ACKLEY)
    assert hist[-1]["test_loss"] < hist[0]["test_loss"]
    assert summary["accuracy"] is None  # regression
    trained = 4 * 2 * 16 * 16  # W_1, W_2 (16 x 16, fp32)
    if subnetworks == "true":  # each rank sends its half of the rows of W_1, W_2
        assert all(r["bytes_sent"] == 2 * trained // 2 for r in hist[1:])
    else:  # ring all_reduce of W_1, W_2 only (C, Ψ, B are frozen and equal)
        assert all(r["bytes_sent"] == 2 * (2 * trained // 2) for r in hist[1:])


def test_grelu_frozen_buffers_unchanged(tmp_path):
    from ist_kernels.nn import GReLUMLP

    _, model, _ = run(tmp_path, "--method", "grelu", "--option", "subnetworks=true", "--rounds", 2, "--simulate", 2,
                      base=ACKLEY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = GReLUMLP(200, 16, 2, 1)
    for k in ("C", "psi", "B"):
        assert torch.equal(model[f"net.{k}"], getattr(ref, k)), k
    assert not torch.equal(model["net.layers.0.weight"], ref.layers[0].weight.detach())


# ---------------------------------------------------------------- data

def test_ackley_dataset_is_the_experiments_data():
    from ist_kernels.experiments import grelu as experiment
    from ist_kernels.train import paper_data as data

    assert experiment.ackley_data is data.ackley_data  # one definition
    d = load_dataset(TrainConfig(dataset="ackley", seed=0))
    assert d.task == "regression" and d.num_outputs == 1 and d.input_shape == (200,)
    assert len(d.train_y) == len(d.test_y) == 100
    torch.testing.assert_close(d.train_x.norm(dim=1), torch.ones(100))
    x, y = data.ackley_data(3, 4, torch.Generator().manual_seed(1))
    a = x.abs()
    f = torch.log(a) * (torch.cos(x) + x ** 3 * torch.sin(x)) + a.sqrt()
    expect = torch.stack([sum(x[i, 3 - j] * f[i, j] for j in range(4)) for i in range(3)]).unsqueeze(1)
    torch.testing.assert_close(y, expect)


# ---------------------------------------------------------------- bad options

BAD = [
    (["--method", "masked", "--option", "masks=gaussian"], "'options.masks'", "bernoulli, categorical or balanced"),
    (["--method", "masked", "--simulate", "8", "--width", "6", "--option", "xi=0.1"], "'options.xi'",
     "without neurons with probability 0.9"),
    (["--method", "masked", "--simulate", "8", "--width", "8", "--option", "masks=categorical"], "'width'",
     "raise the width"),
    (["--method", "masked", "--option", "xi=0"], "'options.xi'", "a probability in (0, 1]"),
    (["--method", "masked", "--option", "xi=1.5"], "'options.xi'", "a probability"),
    (["--method", "masked", "--option", "xi=half"], "'options.xi'", "expected float"),
    (["--method", "ist", "--option", "xi=0.5"], "'options.xi'", "has no such option"),
    (["--method", "ist", "--option", "bias=maybe"], "'options.bias'", "expected boolean"),
    (["--method", "ist", "--model", "preact_resnet18"], "'model'", "model mlp"),
    (["--method", "ist", "--storage", "central"], "'storage'", "decentralized, replicated"),
    (["--method", "ist", "--shared", "ring"], "'shared'", "all_reduce, exact"),
    (["--method", "ist", "--max-rank-state-mb", "0"], "'max_rank_state_mb'", "> 0"),
    (["--method", "ist", "--simulate", "3", "--width", "2"], "'width'", "width >= workers"),
    (["--method", "masked", "--option", "kappa=-1"], "'options.kappa'", "positive"),
    (["--method", "grelu", "--option", "subnetworks=sometimes"], "'options.subnetworks'", "boolean"),
    (["--method", "grelu", "--model", "resnet18"], "'model'", "GReLU"),
]


@pytest.mark.parametrize("args,option,why", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_options_rejected_before_work(tmp_path, capsys, args, option, why):
    out = tmp_path / "out"
    assert cli.main([*TINY, "--out-dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert "invalid option" in err and option in err and why in err, err
    assert not out.exists()


def test_bad_options_raise_config_error():
    with pytest.raises(ConfigError, match="options.masks"):
        TrainConfig(method="masked", options={"masks": "x"}).validate()


def _user_subnet_mlp():
    from ist_kernels.nn import SubnetMLP

    return SubnetMLP(64, 12, 1, 10, bias=True, train_output=True)


def test_masked_on_a_users_subnet_mlp_with_categorical_probabilities(tmp_path):
    """masked trains a user's SubnetMLP (MODULE:FACTORY / Engine(model=...)) with a categorical ξ
    vector (paper 001 §3); settings that cannot apply are refused by name, before any round."""
    from torch import nn

    from ist_kernels.train import Engine

    common = dict(method="masked", workers=2, rounds=2, local_steps=1, dataset="digits", batch_size=8,
                  threads=1, out_dir=str(tmp_path), plots=False)
    summary = user_loop(Engine(_user_subnet_mlp, options={"masks": "categorical", "probs": "0.75:0.25"}, **common))
    assert summary["rounds"] == 2 and summary["masks"] == "categorical" and summary["xi"] == 0.5
    assert summary["probs"] == [0.75, 0.25] and summary["train_loss"] > 0
    for options, key in [({"masks": "bernoulli", "probs": "0.5:0.5"}, "options.probs"),
                         ({"masks": "categorical", "probs": "0.2:0.3:0.5"}, "options.probs"),
                         ({"masks": "categorical", "probs": "0.7:0.7"}, "options.probs"),
                         ({"kappa": 0.5}, "options.kappa")]:
        with pytest.raises(ConfigError, match=key):
            Engine(_user_subnet_mlp, options=options, **common)
    with pytest.raises(ConfigError, match="SubnetMLP; .* built a Linear"):
        Engine(lambda: nn.Linear(64, 10), **common)
