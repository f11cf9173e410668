"""DiLoCo (``--method diloco``) and ``--outer-optimizer nesterov``: the updates against independent
float64 references written from the math, 2 gloo ranks against --simulate (bit for bit), exact
resume, the bytes of every pseudo-gradient codec (``--compress``, once DiLoCo's ``outer_grad``) in
both byte conventions and in the cost model, and bad options named in the error."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from ist_kernels.distributed import cost
from ist_kernels.train import cli
from ist_kernels.train.config import ConfigError
from ist_kernels.train.context import RunContext, World
from ist_kernels.train.datasets import ShardedData, load_dataset
from ist_kernels.train.methods import get_method

from train_helpers import TINY_MLP, assert_equal_states, run as _run, untimed

DILOCO = [*TINY_MLP, "--method", "diloco", "--lr", "0.01"]
run = functools.partial(_run, base=DILOCO)


def _method(argv, rounds):
    """The method object of ``argv`` (simulated, in process) and its worker view."""
    cfg = cli.build_config([*argv, "--device", "cpu"]).validate()
    ctx = RunContext(cfg, World(simulated=True), ShardedData(load_dataset(cfg), cfg.num_workers, cfg.batch_size,
                                                             cfg.seed, "cpu"), rounds)
    return get_method(cfg.method)(ctx), ctx


# ---------------------------------------------------------------- DiLoCo against the math

def _mlp64(w, x):
    w1, b1, w2, b2 = w
    return torch.relu(x.flatten(1) @ w1.T + b1) @ w2.T + b2


def test_diloco_equals_a_float64_reference():
    """2 workers, 2 rounds of 3 AdamW steps each, then the outer Nesterov step on the mean
    pseudo-gradient, all in float64 from the paper's Algorithm 1 and AdamW's definition."""
    opts = dict(outer_lr=0.7, outer_momentum=0.9, weight_decay=0.1, beta1=0.9, beta2=0.99, eps=1e-6)
    argv = [*DILOCO, "--local-steps", "3", "--simulate", "2", "--rounds", "2", "--width", "8", "--lr-schedule",
            "cosine", *[a for k, v in opts.items() for a in ("--option", f"{k}={v}")]]
    m, ctx = _method(argv, 2)
    theta = [p.detach().double().clone() for p in m.model.parameters()]
    moments = {s: ([torch.zeros_like(t) for t in theta], [torch.zeros_like(t) for t in theta]) for s in (0, 1)}
    b = [torch.zeros_like(t) for t in theta]
    b1, b2, wd, eps = opts["beta1"], opts["beta2"], opts["weight_decay"], opts["eps"]
    t = 0
    for r in range(2):
        deltas = []
        for s in (0, 1):
            w = [v.clone() for v in theta]
            mom, sq = moments[s]
            for i in range(3):
                step = r * 3 + i + 1
                lr = ctx.lr_at(r, i)
                x, y = ctx.batch(s, r, i)
                wg = [v.clone().requires_grad_(True) for v in w]
                grads = torch.autograd.grad(F.cross_entropy(_mlp64(wg, x.double()), y), wg)
                for k, g in enumerate(grads):
                    mom[k] = b1 * mom[k] + (1 - b1) * g
                    sq[k] = b2 * sq[k] + (1 - b2) * g * g
                    mhat, vhat = mom[k] / (1 - b1 ** step), sq[k] / (1 - b2 ** step)
                    w[k] = w[k] * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + eps)
            deltas.append([a - c for a, c in zip(theta, w)])
        t += 1
        for k in range(len(theta)):
            g = (deltas[0][k] + deltas[1][k]) / 2
            b[k] = opts["outer_momentum"] * b[k] + g
            theta[k] = theta[k] - opts["outer_lr"] * (g + opts["outer_momentum"] * b[k])
        m.run_round(r)
    got = [p.detach().double() for p in m.model.parameters()]
    moved = max((a - c).abs().max() for a, c in zip(got, [p.double() for p in _method(argv, 2)[0].model.parameters()]))
    err = max((a - c).abs().max() for a, c in zip(got, theta))
    assert moved > 1e-2 and err < 2e-5 * moved, (err, moved)
    # the outer momentum is the reference's b
    assert max((a.double() - c).abs().max() for a, c in zip(m.momentum, b)) < 1e-4 * moved


# ---------------------------------------------------------------- both launch modes, resume, bytes

def test_diloco_distributed_equals_simulated(tmp_path):
    """int8 pseudo-gradients through the coded reduce-scatter and all-gather (fp32 goes through
    local SGD's all_reduce): the same bits and bytes in both launch modes."""
    args = ["--rounds", 2, "--compress", "int8"]
    sim = run(tmp_path / "sim", *args, "--simulate", 2)
    dist = run(tmp_path / "dist", *args, "--workers", 2)
    assert_equal_states(sim[1], dist[1])
    assert untimed(sim[2]) == untimed(dist[2])
    assert sim[0]["outer_grad"] == "int8" and dist[0]["mode"] == "distributed"


def test_diloco_resume_is_exact(tmp_path):
    args = ["--rounds", 4, "--simulate", 2, "--compress", "bf16"]
    _, full, full_hist = run(tmp_path / "full", *args)
    part, _, _ = run(tmp_path / "part", *args, "--stop-after", 2)
    assert not part["finished"]
    summary, model, hist = run(tmp_path / "part", *args, "--resume")
    assert summary["finished"]
    assert_equal_states(full, model)
    assert untimed(hist) == untimed(full_hist)


def test_diloco_bytes_per_outer_grad(tmp_path):
    """fp32: local SGD's ring all_reduce; bf16 / int8: the same at 2 / 1 bytes per element (+ one
    float32 scale per chunk sent for int8), in the wire count, the parameter-server count and the
    cost model."""
    n = 64 * 16 + 16 + 16 * 10 + 10  # the tiny MLP's parameters
    S = 2
    ls, _, _ = _run(tmp_path / "ls", "--rounds", 1, "--simulate", S, "--method", "localsgd", base=TINY_MLP)
    out = {}
    for codec, size in (("fp32", 4), ("bf16", 2), ("int8", 1)):
        out[codec] = run(tmp_path / codec, "--rounds", 1, "--simulate", S, "--compress",
                         "none" if codec == "fp32" else codec)[0]
        scales = 2 * (S - 1) * 4 * S if codec == "int8" else 0
        assert out[codec]["total_bytes"] == S * cost.diloco_round_bytes(4 * n, S, codec) + scales
        assert out[codec]["total_ps_bytes"] == S * 2 * (n * size + (4 if codec == "int8" else 0))
    assert out["fp32"]["total_bytes"] == ls["total_bytes"]
    assert out["fp32"]["total_ps_bytes"] == ls["total_ps_bytes"]
    assert cost.diloco_round_bytes(1000, 4, "bf16") == cost.localsgd_round_bytes(1000, 4) / 2
    # a worker holds θ, its model, AdamW's two moments and the outer momentum
    assert out["fp32"]["rank_state_bytes"] >= 5 * 4 * n


def test_coded_average_is_within_the_codes_error():
    from ist_kernels.train.comm import Comm
    from ist_kernels.train.timing import Clock

    g = torch.Generator().manual_seed(0)
    copies = [[torch.randn(37, generator=g), torch.randn(5, 3, generator=g)] for _ in range(3)]
    mean = [sum(c[k] for c in copies) / 3 for k in range(2)]
    for codec, tol in (("bf16", 2 ** -7), ("int8", 2 / 127)):
        cs = [[t.clone() for t in c] for c in copies]
        comm = Comm(world_size=3, rank=0, distributed=False, local_workers=[0, 1, 2], shared="all_reduce", clock=Clock())
        comm.average_coded_(cs, codec, round=0)
        for c in cs:
            for a, want in zip(c, mean):
                assert (a - want).abs().max() <= tol * 3 * max(t.abs().max() for t in want), codec
                assert not torch.equal(a, want)
        assert all(torch.equal(cs[0][k], cs[2][k]) for k in range(2))
        # 52 elements in 3 chunks of 18, 17, 17: each worker sends two chunks out, its own to two others
        assert comm.take()["sent_by_worker"][0] == (52 - 18 + 2 * 18) * (2 if codec == "bf16" else 1) + \
            (16 if codec == "int8" else 0)


# ---------------------------------------------------------------- options

@pytest.mark.parametrize("argv, option", [
    (["--method", "diloco", "--option", "outer_grad=fp16"], "options.outer_grad"),
    (["--method", "diloco", "--option", "outer_lr=0"], "options.outer_lr"),
    (["--method", "diloco", "--option", "outer_momentum=1"], "options.outer_momentum"),
    (["--method", "diloco", "--option", "beta2=1.5"], "options.beta2"),
    (["--method", "diloco", "--option", "lookahead=1"], "options.lookahead"),
    (["--method", "diloco", "--outer-optimizer", "nesterov"], "outer_optimizer"),
    (["--method", "ddp", "--outer-optimizer", "nesterov"], "outer_optimizer"),
    (["--method", "ist", "--outer-optimizer", "lamb"], "outer_optimizer"),
    (["--method", "ist", "--outer-optimizer", "nesterov", "--outer-lr", "-1"], "outer_lr"),
    (["--method", "ist", "--outer-optimizer", "nesterov", "--outer-momentum", "1"], "outer_momentum"),
])
def test_bad_options_are_named(argv, option):
    with pytest.raises(ConfigError) as e:
        cli.build_config([*TINY_MLP, *argv]).validate()
    assert e.value.option == option


def test_listed_and_in_help(capsys):
    assert cli.main(["--list-methods"]) == 0
    assert "diloco" in capsys.readouterr().out.split()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "--outer-optimizer {none,nesterov,sgd,adam}" in out and "--outer-lr" in out and "diloco" in out


# ---------------------------------------------------------------- --outer-optimizer nesterov

def test_outer_nesterov_equals_a_float64_reference():
    """ist, 2 rounds: the outer step on (previous model - aggregate) with Nesterov momentum, against
    the aggregates of plain ist rounds started from the reference's own models."""
    lr, mu = 0.5, 0.9
    base = [*TINY_MLP, "--method", "ist", "--simulate", "2", "--rounds", "2"]
    with_outer, _ = _method([*base, "--outer-optimizer", "nesterov", "--outer-lr", str(lr), "--outer-momentum",
                             str(mu)], 2)
    plain, _ = _method(base, 2)
    names = [n for n, _ in plain.net.named_parameters()]
    theta = {n: p.detach().double().clone() for n, p in plain.net.named_parameters()}
    b = {n: torch.zeros_like(t) for n, t in theta.items()}
    for r in range(2):
        with torch.no_grad():  # the plain method's round starts from the reference's model
            for n, p in plain.net.named_parameters():
                p.copy_(theta[n])
        plain.run_round(r)
        agg = {n: p.detach().double() for n, p in plain.net.named_parameters()}
        for n in names:
            g = theta[n] - agg[n]
            b[n] = mu * b[n] + g
            theta[n] = theta[n] - lr * (g + mu * b[n])
        with_outer.run_round(r)
    got = dict(with_outer.net.named_parameters())
    step = max((theta[n] - agg[n]).abs().max() for n in names)  # what the outer step changed
    err = max((got[n].double() - theta[n]).abs().max() for n in names)
    assert step > 1e-3 and err < 1e-4 * step, (err, step)


def test_outer_nesterov_distributed_decentralized_equals_simulated_and_resumes(tmp_path):
    """Decentralized storage: each slice's outer momentum moves with the slice (its bytes counted in
    both conventions, its memory in rank_state_bytes) and is in each rank's checkpoint: 2 ranks
    stopped after round 2 and resumed equal the simulated run bit for bit (--shared exact)."""
    runner = functools.partial(_run, base=TINY_MLP)
    args = ["--method", "ist", "--rounds", 3, "--shared", "exact", "--outer-optimizer", "nesterov"]
    sim = runner(tmp_path / "sim", *args, "--simulate", 2)
    part = runner(tmp_path / "dist", *args, "--workers", 2, "--stop-after", 2)
    assert not part[0]["finished"]
    dist = runner(tmp_path / "dist", *args, "--workers", 2, "--resume")
    assert dist[0]["storage"] == "decentralized" and dist[0]["finished"]
    assert_equal_states(sim[1], dist[1])
    assert untimed(sim[2]) == untimed(dist[2])
    plain = runner(tmp_path / "plain", "--method", "ist", "--rounds", 3, "--shared", "exact", "--simulate", 2)
    assert not all(torch.equal(plain[1][k], sim[1][k]) for k in plain[1])
    for key in ("total_ps_bytes", "rank_state_bytes"):
        assert sim[0][key] > plain[0][key], key
    # the momentum of a hidden neuron's row, bias and output column travels as its weights do
    assert plain[0]["total_bytes"] < sim[0]["total_bytes"] < 2 * plain[0]["total_bytes"]


def test_outer_none_is_the_default_bit_for_bit(tmp_path):
    runner = functools.partial(_run, base=TINY_MLP)
    a = runner(tmp_path / "a", "--method", "localsgd", "--rounds", 2, "--simulate", 2)
    b = runner(tmp_path / "b", "--method", "localsgd", "--rounds", 2, "--simulate", 2, "--outer-optimizer", "none")
    assert_equal_states(a[1], b[1])
    c = runner(tmp_path / "c", "--method", "localsgd", "--rounds", 2, "--simulate", 2, "--outer-optimizer", "nesterov")
    assert not all(torch.equal(a[1][k], c[1][k]) for k in a[1]) and math.isfinite(c[0]["test_loss"])
