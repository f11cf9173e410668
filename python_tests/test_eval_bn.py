"""--eval-bn-batches N: before each evaluation a copy of the full model gets BatchNorm running
statistics averaged over N training batches (precise BN). The statistics are checked against a
float64 reference computed from the batches themselves; the trained model and the training are
unchanged (the batches are a function of worker and step, nothing is drawn)."""
import pytest
import torch
from torch import nn

from ist_kernels.train import cli, datasets
from ist_kernels.train.context import RunContext, World
from ist_kernels.train.errors import ConfigError

from train_helpers import run as _run, untimed

CNN = ["--dataset", "digits", "--model", "preact_resnet18", "--width", "4", "--batch-size", "16",
       "--local-steps", "2", "--no-progress", "--no-plots", "--threads", "1", "--device", "cpu"]


def _ctx(extra=()):
    cfg = cli.build_config([*CNN, "--method", "localsgd", "--simulate", "3", *extra]).validate()
    data = datasets.ShardedData(datasets.load_dataset(cfg), 3, cfg.batch_size, cfg.seed, "cpu")
    return RunContext(cfg, World(simulated=True), data, rounds=1), data


def test_statistics_are_the_average_over_the_batches():
    ctx, data = _ctx()
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = ctx.bn_recalibrated(model, 7)
    xs = [data.batch(k % 3, k // 3)[0].flatten(1).double() for k in range(7)]
    mean = torch.stack([x.mean(0) for x in xs]).mean(0)
    var = torch.stack([x.var(0, unbiased=True) for x in xs]).mean(0)
    bn = got[1]
    assert got is not model and bn.num_batches_tracked == 7 and bn.momentum is None
    torch.testing.assert_close(bn.running_mean.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), var, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the original is untouched
    plain = nn.Sequential(nn.Linear(3, 2))
    assert ctx.bn_recalibrated(plain, 7) is plain  # nothing to re-estimate: the model itself


def test_training_is_unchanged_and_only_scores_move(tmp_path):
    args = ["--method", "loft", "--prune-ratio", "0.5", "--simulate", 2, "--rounds", 2, "--eval-interval", 1,
            "--option", "pretrain_fraction=1"]
    _, m0, h0 = _run(tmp_path / "a", *args, base=CNN)
    _, m1, h1 = _run(tmp_path / "b", *args, "--eval-bn-batches", 4, base=CNN)
    assert [r.get("train_loss") for r in h0] == [r.get("train_loss") for r in h1]
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    assert [r["test_loss"] for r in h0] != [r["test_loss"] for r in h1]
    keep = untimed(h1)
    assert all("accuracy" in r for r in keep)


def test_bad_value_names_the_option():
    with pytest.raises(ConfigError, match="eval_bn_batches"):
        cli.build_config([*CNN, "--method", "localsgd", "--eval-bn-batches", "-1"]).validate()
