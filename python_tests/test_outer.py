"""The one outer optimizer (ist_kernels.train.outer): any torch.optim.Optimizer over the round's
pseudo-gradient, against float64 references written from the optimizers' definitions; Adam as
``--outer-optimizer adam`` on a subnetwork method, its state travelling with the slices (2 gloo
ranks, decentralized, stopped and resumed, equal the simulated run bit for bit); SGD kinds equal
torch.optim.SGD."""
import functools
import math

import pytest
import torch

from ist_kernels.train import cli
from ist_kernels.train.context import RunContext, World
from ist_kernels.train.datasets import ShardedData, load_dataset
from ist_kernels.train.methods import get_method
from ist_kernels.train.outer import ExactSGD, OuterOptimizer

from train_helpers import TINY_MLP, resumed_distributed_equals_simulated, run as _run

run = functools.partial(_run, base=TINY_MLP)


def _tensors(seed, shapes=((7, 5), (13,), (3, 1, 2))):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}


@pytest.mark.parametrize("nesterov", [True, False])
def test_exact_sgd_equals_torch_sgd(nesterov):
    """ExactSGD's values are torch.optim.SGD's (no dampening, no weight decay) to rounding, over 3 steps."""
    a = [torch.nn.Parameter(t.clone()) for t in _tensors(0).values()]
    b = [torch.nn.Parameter(t.clone()) for t in _tensors(0).values()]
    ours, theirs = ExactSGD(a, lr=0.3, momentum=0.8, nesterov=nesterov), torch.optim.SGD(b, lr=0.3, momentum=0.8,
                                                                                         nesterov=nesterov)
    for k in range(3):
        for pa, pb, g in zip(a, b, _tensors(10 + k).values()):
            pa.grad, pb.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.state[pa]["momentum_buffer"], theirs.state[pb]["momentum_buffer"])


def _adam64(theta, g, state, lr, t, b1=0.9, b2=0.999, eps=1e-8):
    m, v = state
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return theta - lr * mhat / (vhat.sqrt() + eps), (m, v)


def test_any_optimizer_class_on_the_pseudo_gradient():
    """OuterOptimizer(torch.optim.Adam): 3 outer steps of named tensors, each from the model before the
    round to a new aggregate, against Adam in float64 on g = previous - aggregate; a name met later
    starts its own state; a slice of a tensor gets the same values as the whole."""
    outer = OuterOptimizer(torch.optim.Adam, lr=0.05)
    theta = {n: t.double() for n, t in _tensors(1).items()}
    state = {n: (torch.zeros_like(t), torch.zeros_like(t)) for n, t in theta.items()}
    current = {n: t.float().clone() for n, t in theta.items()}
    for k in range(3):
        agg = {n: current[n] + 0.1 * d for n, d in _tensors(20 + k).items()}
        for n in theta:
            theta[n], state[n] = _adam64(theta[n], theta[n] - agg[n].double(), state[n], 0.05, k + 1)
        prev = {n: t.clone() for n, t in current.items()}
        outer.step_(agg, prev, list(agg))
        current = agg
        for n in theta:
            torch.testing.assert_close(current[n].double(), theta[n], rtol=1e-5, atol=1e-6)
    assert sorted(outer.param_states(list(theta), current)) == ["exp_avg", "exp_avg_sq"]
    assert outer.state_keys == ("exp_avg", "exp_avg_sq") and outer.tensors_per_param == 2


def test_of_kinds_and_bad_classes():
    assert OuterOptimizer.of("none", 0.7) is None
    sgd = OuterOptimizer.of("sgd", 0.7, 0.5)
    assert sgd.optimizer_cls is ExactSGD and sgd.kwargs == dict(lr=0.7, momentum=0.5, nesterov=False)
    assert OuterOptimizer.of("adam", 0.1).optimizer_cls is torch.optim.Adam
    with pytest.raises(ValueError, match="outer optimizer must be one of"):
        OuterOptimizer.of("lamb", 0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer class"):
        OuterOptimizer(torch.nn.Linear)
    with pytest.raises(ValueError, match="momentum"):
        ExactSGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=1.0)


def test_old_checkpoint_momentum_loads_as_momentum_buffer():
    outer = OuterOptimizer.of("nesterov", 0.7, 0.9)
    outer.init_state_({"w": torch.zeros(3)})
    kept = outer.state["w"]["momentum_buffer"]
    outer.load_state_dict({"w": torch.ones(3)})  # a checkpoint written before the outer optimizer object
    assert outer.state["w"]["momentum_buffer"] is kept and torch.equal(kept, torch.ones(3))


def _method(argv, rounds):
    cfg = cli.build_config([*TINY_MLP, *argv, "--device", "cpu"]).validate()
    ctx = RunContext(cfg, World(simulated=True), ShardedData(load_dataset(cfg), cfg.num_workers, cfg.batch_size,
                                                             cfg.seed, "cpu"), rounds)
    return get_method(cfg.method)(ctx)


def test_outer_adam_on_ist_equals_a_float64_reference():
    """ist, 2 rounds, --outer-optimizer adam: Adam from the previous model on (previous - the plain
    ist round's aggregate), the plain rounds started from the reference's own models."""
    lr = 0.01
    base = ["--method", "ist", "--simulate", "2", "--rounds", "2"]
    with_outer = _method([*base, "--outer-optimizer", "adam", "--outer-lr", str(lr)], 2)
    plain = _method(base, 2)
    names = [n for n, _ in plain.net.named_parameters()]
    theta = {n: p.detach().double().clone() for n, p in plain.net.named_parameters()}
    state = {n: (torch.zeros_like(t), torch.zeros_like(t)) for n, t in theta.items()}
    for r in range(2):
        with torch.no_grad():
            for n, p in plain.net.named_parameters():
                p.copy_(theta[n])
        plain.run_round(r)
        agg = {n: p.detach().double() for n, p in plain.net.named_parameters()}
        for n in names:
            theta[n], state[n] = _adam64(theta[n], theta[n] - agg[n], state[n], lr, r + 1)
        with_outer.run_round(r)
    got = dict(with_outer.net.named_parameters())
    step = max((theta[n] - agg[n]).abs().max() for n in names)
    err = max((got[n].double() - theta[n]).abs().max() for n in names)
    assert step > 1e-3 and err < 1e-4 * step, (err, step)


def test_outer_adam_decentralized_equals_simulated_and_resumes(tmp_path):
    """Adam's two moments travel with every partitioned slice (its step count stays with the rank):
    2 gloo ranks, stopped after round 2 and resumed, equal the simulated run bit for bit; the moments'
    bytes are in both conventions and in the state a rank holds (more than with SGD's one buffer)."""
    args = ["--method", "ist", "--rounds", 3, "--shared", "exact", "--outer-optimizer", "adam", "--outer-lr", "0.01"]
    summary, _ = resumed_distributed_equals_simulated(run, tmp_path, *args)
    sgd = run(tmp_path / "sgd", "--method", "ist", "--rounds", 3, "--shared", "exact", "--outer-optimizer",
              "nesterov", "--simulate", 2)[0]
    for key in ("total_ps_bytes", "rank_state_bytes", "total_bytes"):
        assert summary[key] > sgd[key], key
    assert math.isfinite(summary["test_loss"])


def test_localsgd_takes_every_outer_kind(tmp_path):
    finals = {}
    for kind in ("sgd", "adam"):
        s, model, _ = run(tmp_path / kind, "--method", "localsgd", "--rounds", 2, "--simulate", 2, "--outer-optimizer",
                          kind, "--outer-lr", "0.5" if kind == "sgd" else "0.01")
        assert math.isfinite(s["test_loss"])
        finals[kind] = model
    assert not all(torch.equal(finals["sgd"][k], finals["adam"][k]) for k in finals["sgd"])


def test_localsgd_outer_step_codes_its_pseudo_gradient(tmp_path):
    """--outer-optimizer with --compress on local SGD: the pseudo-gradient travels coded (DiLoCo's
    coded reduce-scatter + all-gather), the same bits on 2 gloo ranks as simulated, about a quarter
    of the fp32 bytes for int8."""
    from train_helpers import assert_equal_states, untimed

    args = ["--method", "localsgd", "--rounds", 2, "--outer-optimizer", "nesterov"]
    sim = run(tmp_path / "sim", *args, "--compress", "int8", "--simulate", 2)
    dist = run(tmp_path / "dist", *args, "--compress", "int8", "--workers", 2)
    assert_equal_states(sim[1], dist[1])
    assert untimed(sim[2]) == untimed(dist[2])
    plain = run(tmp_path / "plain", *args, "--simulate", 2)[0]
    assert 0.2 < sim[0]["total_bytes"] / plain["total_bytes"] < 0.3
    assert 0.2 < sim[0]["total_ps_bytes"] / plain["total_ps_bytes"] < 0.3
