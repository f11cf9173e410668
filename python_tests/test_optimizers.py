"""--optimizer sgd|adamw for every method (issue 27 item 1): the default learning rate follows the
optimizer (and diloco's inner AdamW), every method lowers the loss with AdamW at its default
learning rate, a subnetwork's AdamW moments travel with its slice (momentum_state=aggregate) and
are counted in both byte conventions and the state bytes, decentralized storage equals the
simulated run and resume is exact; bad combinations stop before any work.

Small runs on a shared 2-core machine: gpt_tiny of width 32, 2 blocks (3 for resist), context 32,
20000 training bytes of pycode, batch 8, 4 local steps, one thread per process."""
import functools

import pytest
import torch

from ist_kernels.train import cli
from ist_kernels.train.config import TrainConfig
from ist_kernels.train.errors import ConfigError

from train_helpers import (
    resume_equals_uninterrupted,
    resumed_distributed_equals_simulated,
    run as _run,
    untimed,
)

GPT = ["--dataset", "pycode", "--model", "gpt_tiny", "--width", "32", "--depth", "2", "--context", "32",
       "--dataset-size", "20000", "--batch-size", "8", "--local-steps", "4", "--no-progress", "--no-plots",
       "--threads", "1"]
MLP = ["--dataset", "digits", "--model", "mlp", "--width", "32", "--batch-size", "16", "--local-steps", "4",
       "--no-progress", "--no-plots", "--threads", "1"]
CNN = ["--dataset", "digits", "--model", "preact_resnet18", "--width", "4", "--batch-size", "16",
       "--local-steps", "4", "--no-progress", "--no-plots", "--threads", "1"]
run = functools.partial(_run, base=GPT)

# every method (and the subnetwork methods with their state aggregated), on gpt_tiny where it takes it
ADAMW_RUNS = {
    "localsgd": (GPT, ["--method", "localsgd"]),
    "ddp": (GPT, ["--method", "ddp"]),
    "ist": (GPT, ["--method", "ist"]),
    "ist-aggregate": (GPT, ["--method", "ist", "--option", "momentum_state=aggregate"]),
    "ist-heads": (GPT, ["--method", "ist", "--option", "partition=heads", "--width", "64"]),
    "resist-aggregate": (GPT, ["--method", "resist", "--depth", "3", "--option", "momentum_state=aggregate"]),
    "ist-mlp": (MLP, ["--method", "ist"]),
    "masked": (MLP, ["--method", "masked"]),
    "grelu": (MLP, ["--method", "grelu"]),
    "grelu-subnetworks": (MLP, ["--method", "grelu", "--option", "subnetworks=true"]),
    "loft": (CNN, ["--method", "loft", "--prune-ratio", "0.5", "--option", "momentum_state=aggregate"]),
}


def _lowers(tmp_path, base, args):
    summary, _, hist = _run(tmp_path, *args, "--simulate", 2, "--rounds", 5, "--eval-interval", 5, base=base)
    assert [r["round"] for r in hist if "test_loss" in r] == [0, 5]
    assert hist[-1]["test_loss"] < hist[0]["test_loss"], (hist[0]["test_loss"], hist[-1]["test_loss"])
    assert hist[-1]["train_loss"] < hist[1]["train_loss"] or hist[-1]["test_loss"] < 0.9 * hist[0]["test_loss"]
    return summary


@pytest.mark.parametrize("name", list(ADAMW_RUNS))
def test_adamw_at_its_default_lr_lowers_the_loss(tmp_path, name):
    base, args = ADAMW_RUNS[name]
    summary = _lowers(tmp_path, base, [*args, "--optimizer", "adamw"])
    assert (summary["optimizer"], summary["lr"]) == ("adamw", 1e-3)


def test_diloco_at_its_default_lr_lowers_the_loss(tmp_path):
    """diloco's inner AdamW took SGD's 0.05 as its default learning rate and ended worse than the
    untrained model; its default is AdamW's 1e-3."""
    summary = _lowers(tmp_path, GPT, ["--method", "diloco"])
    assert (summary["optimizer"], summary["lr"]) == ("adamw", 1e-3)
    assert summary["bits_per_byte"] < 8


def test_defaults_follow_the_optimizer():
    cfg = TrainConfig().validate()
    assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.nesterov) == ("sgd", 0.05, 0.9, False)
    cfg = cli.build_config(["--optimizer", "adamw", "--betas", "0.9,0.95", "--eps", "1e-6"]).validate()
    assert (cfg.lr, cfg.momentum, cfg.betas, cfg.eps) == (1e-3, None, [0.9, 0.95], 1e-6)
    assert cfg.validate().lr == 1e-3  # idempotent
    assert cli.build_config(["--method", "diloco"]).validate().lr == 1e-3
    assert cli.build_config(["--optimizer", "adamw", "--lr", "0.01"]).validate().lr == 0.01
    assert cli.build_config(["--lr-milestones", "2", "4"]).validate().lr_milestones == [2, 4]


@pytest.mark.parametrize("argv, option", [
    (["--optimizer", "adamw", "--momentum", "0.9"], "'momentum'"),
    (["--optimizer", "adamw", "--momentum", "0"], "'momentum'"),
    (["--optimizer", "adamw", "--nesterov"], "'nesterov'"),
    (["--optimizer", "adam"], "'optimizer'"),
    (["--optimizer", "adamw", "--betas", "0.9"], "'betas'"),
    (["--optimizer", "adamw", "--betas", "0.9,1.0"], "'betas'"),
    (["--optimizer", "adamw", "--eps", "0"], "'eps'"),
    (["--method", "diloco", "--betas", "0.9,0.95"], "'betas'"),
    (["--method", "ist", "--option", "momentum_state=aggregate"], "'options.momentum_state'"),  # the mlp
])
def test_bad_combinations_stop_before_any_work(tmp_path, capsys, argv, option):
    with pytest.raises(ConfigError, match=option):
        cli.build_config(argv).validate()
    assert cli.main([*argv, "--out-dir", str(tmp_path / "out"), "--no-progress"]) != 0
    assert option.strip("'") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_adamw_moments_travel_and_are_counted(tmp_path):
    """momentum_state=aggregate sends AdamW's two moments with every slice: twice SGD momentum's
    bytes in both conventions; the state a worker holds counts the two moments and the step."""
    got = {}
    for opt in ("sgd", "adamw"):
        for state in ("reset", "aggregate"):
            summary, _, hist = run(tmp_path / f"{opt}-{state}", "--method", "ist", "--optimizer", opt,
                                   "--option", f"momentum_state={state}", "--simulate", 2, "--rounds", 2,
                                   "--eval-interval", 0)
            got[opt, state] = summary, hist
    for key in ("bytes_sent", "ps_bytes"):
        for r in (1, 2):
            sgd = got["sgd", "aggregate"][1][r][key] - got["sgd", "reset"][1][r][key]
            adamw = got["adamw", "aggregate"][1][r][key] - got["adamw", "reset"][1][r][key]
            assert sgd > 0 and adamw == 2 * sgd, (key, r, sgd, adamw)
    assert got["sgd", "reset"][1][1]["bytes_sent"] == got["adamw", "reset"][1][1]["bytes_sent"]
    sgd, adamw = got["sgd", "reset"][0], got["adamw", "reset"][0]
    n_params = sum(1 for _ in _gpt_parameters())
    assert adamw["full_state_bytes"] - sgd["full_state_bytes"] == adamw["param_bytes"] + 4 * n_params
    held = adamw["rank_state_bytes"] - sgd["rank_state_bytes"]  # a subnetwork's second moment and steps
    assert 0 < held < adamw["param_bytes"] + 4 * n_params


def _gpt_parameters():
    from ist_kernels.train import datasets
    from ist_kernels.train.model_registry import build_model

    cfg = cli.build_config(GPT).validate()
    return build_model(cfg, datasets.load_dataset(cfg)).parameters()


def test_decentralized_adamw_state_equals_simulated_and_resumes_exactly(tmp_path):
    """ist on gpt_tiny, momentum_state=aggregate, AdamW: 2 gloo ranks (decentralized storage: a
    rank holds its slices' moments, which go to their next owners) stopped after round 2 and
    resumed from per-rank checkpoints equal the uninterrupted simulated run bit for bit (--shared
    exact; the default all_reduce equals it to a few ulps)."""
    args = ["--method", "ist", "--optimizer", "adamw", "--option", "momentum_state=aggregate", "--rounds", 3,
            "--shared", "exact", "--eval-interval", 3]
    d_sum, d_hist = resumed_distributed_equals_simulated(run, tmp_path, *args)
    assert d_hist[-1]["test_loss"] < d_hist[0]["test_loss"]
    assert d_sum["rank_state_bytes"] < d_sum["full_state_bytes"]


def test_decentralized_resist_adamw_state_equals_simulated(tmp_path):
    """resist, momentum_state=aggregate, AdamW on 2 gloo ranks: ResIST's subnetworks hold different
    layers, so the ranks' moments name different tensors; the exchange still runs one schedule on
    every rank (it hung in the first subnetwork round before) and equals the simulated run, resumed."""
    args = ["--method", "resist", "--depth", "4", "--optimizer", "adamw", "--option", "momentum_state=aggregate",
            "--option", "warmup_fraction=0.2", "--rounds", 6, "--shared", "exact", "--eval-interval", 6]
    d_sum, d_hist = resumed_distributed_equals_simulated(run, tmp_path, *args)
    assert d_hist[-1]["test_loss"] < d_hist[0]["test_loss"]
    assert [r.get("phase") for r in d_hist[1:]] == [0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("args", [
    ["--method", "ist", "--option", "momentum_state=aggregate"],  # the global AdamW state (simulated)
    ["--method", "localsgd"],  # every worker's AdamW state, kept across rounds
    ["--method", "localsgd", "--option", "momentum_state=reset"],  # cleared after every average
], ids=["ist-aggregate", "localsgd", "localsgd-reset"])
def test_simulated_adamw_resume_is_exact(tmp_path, args):
    args = [*args, "--optimizer", "adamw", "--rounds", 3, "--simulate", 2, "--eval-interval", 1]
    resume_equals_uninterrupted(run, tmp_path, *args)


@pytest.mark.parametrize("state", ["local", "reset"])
def test_localsgd_keeps_each_workers_adamw_state_across_rounds(tmp_path, state):
    """Whole-model methods keep their optimizers: after 2 rounds of 4 steps AdamW's step is 8;
    ``momentum_state=reset`` (the ablation of the subnetwork methods' reset) clears every worker's
    state after each average, so the first round is the same as without and the second is not."""
    from ist_kernels.train.methods import get_method

    cfg = cli.build_config([*GPT, "--method", "localsgd", "--optimizer", "adamw", "--simulate", "2",
                            "--rounds", "2", "--option", f"momentum_state={state}"]).validate()
    from ist_kernels.train import datasets
    from ist_kernels.train.context import RunContext, World

    data = datasets.ShardedData(datasets.load_dataset(cfg), 2, cfg.batch_size, cfg.seed, "cpu")
    ctx = RunContext(cfg, World(simulated=True), data, rounds=2)
    method = get_method("localsgd")(ctx)
    for r in range(2):
        method.run_round(r)
    for opt in method.optimizers.values():
        assert isinstance(opt, torch.optim.AdamW)
        steps = {float(st["step"]) for st in opt.state.values()}
        assert steps == ({8.0} if state == "local" else set())


def test_localsgd_reset_changes_only_rounds_after_the_first(tmp_path):
    args = ["--method", "localsgd", "--optimizer", "adamw", "--simulate", 2, "--eval-interval", 1]
    _, _, one_kept = run(tmp_path / "k1", *args, "--rounds", 1)
    _, _, one_reset = run(tmp_path / "r1", *args, "--rounds", 1, "--option", "momentum_state=reset")
    assert untimed(one_kept) == untimed(one_reset)
    _, kept, _ = run(tmp_path / "k2", *args, "--rounds", 2)
    _, reset, _ = run(tmp_path / "r2", *args, "--rounds", 2, "--option", "momentum_state=reset")
    assert any(not torch.equal(kept[k], reset[k]) for k in kept if kept[k].is_floating_point())
