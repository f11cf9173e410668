"""--holdout F: a validation split carved from the training set, disjoint from every worker's shard,
scored in place of the test split (issue 27: tuned settings are chosen on it, never on the test split)."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from ist_kernels.train import cli, datasets
from ist_kernels.train.config import ConfigError, TrainConfig
from ist_kernels.train.model_registry import build_model

from train_helpers import TINY_MLP, run as _run


def run(out, *args):
    return _run(out, *args, base=TINY_MLP)


def _check_split(cfg, workers=3):
    """The held-out samples are the loaded training set's at ``holdout_index``, in no worker's shard
    (nor in any batch), and training + held out = the whole training set."""
    full = datasets.load_dataset(TrainConfig(**{**cfg, "holdout": 0.0}))
    ds = datasets.load_dataset(TrainConfig(**cfg))
    n = len(full.train_y)
    keep, held = ds.train_index, ds.holdout_index
    assert ds.scored_on == "holdout" and full.scored_on == "test"
    assert len(held) == max(1, round(cfg["holdout"] * n)) and len(keep) + len(held) == n
    assert sorted(torch.cat([keep, held]).tolist()) == list(range(n))
    assert torch.equal(ds.holdout_x, full.train_x[held]) and torch.equal(ds.holdout_y, full.train_y[held])
    assert torch.equal(ds.train_x, full.train_x[keep]) and torch.equal(ds.test_y, full.test_y)
    data = datasets.ShardedData(ds, workers, batch_size=8, seed=cfg.get("seed", 0), device="cpu")
    held_set = set(held.tolist())
    for w, shard in enumerate(data.shards):
        assert not set(keep[shard].tolist()) & held_set  # no held-out sample in any shard
        for step in range(3):
            assert not set(keep[data.streams[w].indices(step)].tolist()) & held_set
    assert sum(len(s) for s in data.shards) == len(keep)
    x, y = next(data.eval_batches(10 ** 6))  # evaluations read the held-out split, not the test split
    assert torch.equal(y, ds.holdout_y) and torch.equal(x, ds.prepare(ds.holdout_x))
    return ds, full


def test_classification_holdout_is_a_seeded_subset_left_out_of_every_shard():
    ds, full = _check_split(dict(dataset="digits", holdout=0.2, seed=3))
    again = datasets.load_dataset(TrainConfig(dataset="digits", holdout=0.2, seed=3))
    other = datasets.load_dataset(TrainConfig(dataset="digits", holdout=0.2, seed=4))
    assert torch.equal(ds.holdout_index, again.holdout_index)  # deterministic
    assert not torch.equal(ds.holdout_index, other.holdout_index)  # by the seed
    assert ds.holdout_y.bincount(minlength=10).min() > 10  # a random subset, not one class's block
    _check_split(dict(dataset="diabetes", holdout=0.25))  # regression


def test_language_model_holdout_is_the_last_sequences():
    ds, full = _check_split(dict(dataset="pycode", dataset_size=20000, context=32, holdout=0.1))
    n = len(full.train_y)
    assert ds.holdout_index.tolist() == list(range(n - len(ds.holdout_index), n))


def test_factory_dataset_holdout(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text(
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "def make(n=60):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.randn(n, 5, generator=g)\n"
        "    y = (x[:, 0] > 0).long()\n"
        "    return TensorDataset(x, y), TensorDataset(x[:10], y[:10])\n")
    monkeypatch.chdir(tmp_path)
    _check_split(dict(dataset="mydata.py:make", holdout=0.3), workers=2)


def _direct_scores(summary, out, cfg):
    """The saved model evaluated by hand on the held-out samples: (accuracy, mean cross-entropy)."""
    ds = datasets.load_dataset(cfg)
    model = build_model(cfg, ds)
    model.load_state_dict(torch.load(os.path.join(out, "model.pt")))
    model.eval()
    with torch.no_grad():
        logits = model(ds.prepare(ds.holdout_x)).float()
    return (int((logits.argmax(-1) == ds.holdout_y).sum()) / len(ds.holdout_y),
            float(F.cross_entropy(logits, ds.holdout_y)))


def test_run_scores_the_holdout_split(tmp_path):
    args = ("--method", "localsgd", "--simulate", 2, "--rounds", 2, "--seed", 1)
    test_summary, _, test_hist = run(tmp_path / "test", *args)
    summary, _, hist = run(tmp_path / "held", *args, "--holdout", 0.25)
    assert test_summary["scored_on"] == "test" and summary["scored_on"] == "holdout"
    assert summary["holdout"] == 0.25 and test_summary["holdout"] == 0.0
    scored = [r for r in hist if "test_loss" in r]
    assert [r["round"] for r in scored] == [0, 2] and all(r["scored_on"] == "holdout" for r in scored)
    assert all(r["scored_on"] == "test" for r in test_hist if "test_loss" in r)
    # another split (and a model trained on fewer samples): other scores
    assert summary["test_loss"] != test_summary["test_loss"]
    # the scores are the saved model's on the held-out samples
    cfg = TrainConfig(dataset="digits", model="mlp", width=16, seed=1, holdout=0.25)
    acc, loss = _direct_scores(summary, tmp_path / "held", cfg)
    assert summary["accuracy"] == pytest.approx(acc, abs=1e-12)
    assert summary["test_loss"] == pytest.approx(loss, rel=1e-5)
    # the scores are not the test split's
    ds = datasets.load_dataset(cfg)
    model = build_model(cfg, ds)
    model.load_state_dict(torch.load(tmp_path / "held" / "model.pt"))
    with torch.no_grad():
        test_loss = float(F.cross_entropy(model.eval()(ds.prepare(ds.test_x)), ds.test_y))
    assert not math.isclose(test_loss, summary["test_loss"], rel_tol=1e-6)


def test_distributed_run_scores_the_same_holdout(tmp_path):
    args = ("--method", "localsgd", "--rounds", 2, "--seed", 2, "--holdout", 0.2)
    sim, _, sim_hist = run(tmp_path / "sim", "--simulate", 2, *args)
    dist, _, dist_hist = run(tmp_path / "dist", "--workers", 2, *args)
    assert dist["scored_on"] == "holdout"
    assert dist["accuracy"] == sim["accuracy"]
    assert dist["test_loss"] == pytest.approx(sim["test_loss"], rel=1e-5)


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan", "inf"])
def test_bad_holdout_rejected(tmp_path, capsys, value):
    out = tmp_path / "out"
    assert cli.main([*TINY_MLP, "--out-dir", str(out), "--holdout", value]) == 2
    err = capsys.readouterr().err
    assert "'holdout'" in err, err
    assert not out.exists()


def test_bad_holdout_values_in_code():
    for bad in (True, "0.2", 1.0, -1e-9):
        with pytest.raises(ConfigError, match="'holdout'"):
            TrainConfig(holdout=bad).validate()
    TrainConfig(holdout=0).validate()
    TrainConfig(holdout=0.5).validate()
    ds = datasets.load_dataset(TrainConfig(dataset="signal_noise"))
    with pytest.raises(ConfigError, match="'holdout'.*none to train on"):
        datasets.hold_out(ds, 0.999, 0)
    with pytest.raises(ConfigError, match="'holdout'"):
        datasets.hold_out(datasets.hold_out(ds, 0.5, 0), 0.5, 0)


def test_resume_must_keep_the_holdout(tmp_path, capsys):
    out = tmp_path / "run"
    run(out, "--method", "localsgd", "--simulate", 2, "--rounds", 2, "--stop-after", 1, "--holdout", 0.2)
    capsys.readouterr()
    rc = cli.main([*TINY_MLP, "--device", "cpu", "--out-dir", str(out), "--method", "localsgd", "--simulate", "2",
                   "--rounds", "2", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "'holdout'" in err and "must not change on resume" in err, err
    summary, _, hist = run(out, "--method", "localsgd", "--simulate", 2, "--rounds", 2, "--resume", "--holdout", 0.2)
    assert summary["finished"] and summary["scored_on"] == "holdout"
    assert all(r["scored_on"] == "holdout" for r in hist if "test_loss" in r)
