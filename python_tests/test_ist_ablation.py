"""The IST ablation experiment (issue 27 item 4): its quick run writes every setting's rounds to
target and final accuracy (scaled and unscaled for IST/masked); the rounds-to-target arithmetic on
hand-made curves; IST's ``repartition_every`` option reuses round r - r % k's plan."""
import json
import math

import pytest
import torch

from ist_kernels.experiments import ist_ablation as A
from ist_kernels.experiments.__main__ import available, main
from ist_kernels.train import cli
from ist_kernels.train.config import ConfigError


def test_quick_run_writes_every_setting(tmp_path):
    assert "ist_ablation" in available()
    assert main(["ist_ablation", "--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "ist_ablation.json").read_text())
    md = (tmp_path / "ist_ablation.md").read_text()
    assert doc["experiment"] == "ist_ablation" and doc["target"] == 0.95
    assert sorted(s["method"] for s in doc["settings"]) == ["ist", "localsgd", "masked"]
    for s in doc["settings"]:
        assert len(s["runs"]) == len(doc["seeds"]) == 1
        for r in s["runs"]:
            assert len(r["curve"]) == 4  # rounds 0..3, scored every round
            assert 0 <= r["final_accuracy"] <= 1 and r["final_accuracy"] == r["curve"][-1]
            assert "rounds_to_target" in r and r["rounds_to_target"] == A.rounds_to_target(r["curve"], 0.95)
            if s["method"] == "localsgd":
                assert "curve_unscaled" not in r
            else:  # the same aggregated model scored with keep = 1
                assert len(r["curve_unscaled"]) == 4 and 0 <= r["final_accuracy_unscaled"] <= 1
                assert r["curve_unscaled"][0] is not None
        assert s["summary"]["runs"] == 1
        assert s["name"] in md
    assert "lr" in doc["findings"] and "scale" in doc["findings"]
    # the method is unchanged after the run: Masked.evaluate is the inherited one again
    from ist_kernels.train.methods import Method
    from ist_kernels.train.methods.masked import Masked
    assert Masked.evaluate is Method.evaluate


def test_rounds_to_target_on_hand_made_curves():
    rt = A.rounds_to_target
    assert rt([0.1, 0.5, 0.94, 0.95, 0.97], 0.95) == 3  # reached exactly at the target
    assert rt([0.1, 0.96, 0.90, 0.97], 0.95) == 1  # the first round that reaches it, even if it dips later
    assert rt([0.99, 0.5, 0.96], 0.95) == 2  # round 0 (the initial model) never counts
    assert rt([0.1, 0.5, 0.9], 0.95) is None
    assert rt([0.1, None, float("nan"), 0.96], 0.95) == 3  # unscored / diverged rounds do not count
    assert rt([], 0.95) is None
    runs = [{"rounds_to_target": 3, "final_accuracy": 0.96}, {"rounds_to_target": 5, "final_accuracy": 0.97},
            {"rounds_to_target": None, "final_accuracy": 0.90}]
    s = A.summarize(runs, rounds=10)
    assert s["reached"] == 2 and s["runs"] == 3 and s["rounds_to_target"] == [3, 5, None]
    assert s["rounds_mean"] == pytest.approx((3 + 5 + 11) / 3)  # unreached counts as rounds + 1
    assert s["final_accuracy"]["mean"] == pytest.approx((0.96 + 0.97 + 0.90) / 3)
    assert A.fmt_rounds(s, 10).startswith("≥ 6.3") and "1/3 not in 10" in A.fmt_rounds(s, 10)
    assert A.fmt_rounds(A.summarize(runs[:2], 10), 10) == "4.0 ± 1.4"
    assert A.fmt_rounds(A.summarize(runs[2:], 10), 10) == "not in 10"
    assert math.isclose(A.summarize(runs[:1], 10)["rounds_std"], 0.0)


def _ist_plans(rounds, *options):
    from ist_kernels.train.datasets import ShardedData, load_dataset
    from ist_kernels.train.methods import get_method
    from ist_kernels.train.runner import RunContext, World

    cfg = cli.build_config(["--dataset", "digits", "--method", "ist", "--width", "12", "--simulate", "2",
                            "--batch-size", "8", "--no-progress", "--no-plots",
                            *[a for o in options for a in ("--option", o)]]).validate()
    ctx = RunContext(cfg, World(simulated=True), ShardedData(load_dataset(cfg), 2, 8, 0, "cpu"), rounds)
    m = get_method("ist")(ctx)
    return [m.plan(r) for r in range(rounds)]


def _same(a, b):
    return all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_repartition_every_reuses_the_plan_of_the_block():
    every = _ist_plans(7)
    k3 = _ist_plans(7, "repartition_every=3")
    for r in range(7):  # round r trains round r - r % 3's partition
        assert _same(k3[r], every[r - r % 3])
    assert not _same(every[0], every[1])  # the default draws a new partition every round
    never = _ist_plans(5, "repartition_every=100")
    assert all(_same(p, every[0]) for p in never)
    with pytest.raises(ConfigError, match="repartition_every"):
        cli.build_config(["--method", "ist", "--simulate", "2", "--option", "repartition_every=0"]).validate()
