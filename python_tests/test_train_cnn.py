"""The CNN methods of the trainer: loft (pre-train with LOFT, prune, fine-tune) and resist (local-SGD
warm-up, then ResIST rounds), end to end on 8x8 digits with tiny ResNets (width 4), with 2 spawned
gloo workers (decentralized storage) and --simulate 2. With --threads 1 and --shared exact the two
launch modes give bit-identical models (the default ring all_reduce: see test_train_decentral.py)."""
import functools
import os

import pytest
import torch

from ist_kernels.partition import loft_plan, resist_plan
from ist_kernels.train import cli

from train_helpers import assert_equal_states, outputs, run as _run, untimed

TINY = ["--dataset", "digits", "--width", "4", "--batch-size", "8", "--local-steps", "2", "--no-progress",
        "--no-plots", "--threads", "1", "--eval-interval", "2"]
run = functools.partial(_run, base=TINY)
LOFT = ["--method", "loft", "--model", "preact_resnet18", "--prune-ratio", "0.5", "--rounds", "4", "--shared", "exact"]
RESIST = ["--method", "resist", "--model", "preact_resnet34", "--rounds", "4", "--shared", "exact",
          "--option", "warmup_fraction=0.25", "--option", "min_depth=2"]


def floats_bytes(state, names=None):
    return sum(4 * v.numel() for k, v in state.items() if v.is_floating_point() and (names is None or k in names))


# ---------------------------------------------------------------- loft

@pytest.fixture(scope="module")
def loft_and_baseline_runs(tmp_path_factory):
    """LOFT and its paper baseline (--baseline), simulated and with 2 gloo workers:
    {mode: (loft outputs, localsgd outputs)}."""
    root = tmp_path_factory.mktemp("loft")
    out = {}
    for mode, launch in (("sim", "--simulate"), ("dist", "--workers")):
        assert cli.main([*TINY, *LOFT, launch, "2", "--baseline", "--device", "cpu", "--out-dir", str(root / mode)]) == 0
        out[mode] = (outputs(root / mode / "loft"), outputs(root / mode / "localsgd"))
    out["table"] = (root / "sim" / "summary.md").read_text()
    return out


@pytest.fixture(scope="module")
def loft_runs(loft_and_baseline_runs):
    return loft_and_baseline_runs["sim"][0], loft_and_baseline_runs["dist"][0]


def test_loft_distributed_equals_simulated(loft_runs):
    (s_sum, s_model, s_hist), (d_sum, d_model, d_hist) = loft_runs
    assert (s_sum["mode"], d_sum["mode"]) == ("simulated", "distributed")
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)  # losses, accuracies and bytes, round by round


def test_loft_workflow_pretrain_prune_finetune(loft_runs):
    (summary, model, hist), _ = loft_runs
    # 4 rounds, pretrain_fraction 0.5: 2 LOFT rounds, then the pruned model is fine-tuned
    assert [r.get("phase") for r in hist[1:]] == [0, 0, 1, 1]  # Loft.phases: pretrain, finetune
    assert summary["pretrain_rounds"] == 2 and summary["finished"]
    # the saved model is the pruned one: partitioned convs lost half their filters (width 4 -> 32 in
    # layer4), the first block of each stage and strided blocks are untouched
    assert model["layer4.1.conv1.weight"].shape == (16, 32, 3, 3)
    assert model["layer4.1.conv2.weight"].shape == (32, 16, 3, 3)
    assert model["layer4.0.conv1.weight"].shape == (32, 16, 3, 3)
    assert model["layer1.1.conv1.weight"].shape == (2, 4, 3, 3)
    assert summary["params_pruned"] == sum(v.numel() for k, v in model.items() if "running" not in k
                                           and "num_batches" not in k)
    assert summary["params_pruned"] < summary["params_full"]
    # fine-tune rounds: one ring all_reduce of the pruned model per round, 2 ranks x (2 (S-1)/S) x bytes;
    # the first one also moved the kept filters to the other rank (and the filter norms)
    assert hist[4]["bytes_sent"] == 2 * floats_bytes(model) < hist[3]["bytes_sent"]
    assert hist[3]["ps_bytes"] == hist[4]["ps_bytes"] == 2 * 2 * floats_bytes(model)  # up + down, 2 workers
    by_phase, ps_by_phase = summary["bytes_by_phase"], summary["ps_bytes_by_phase"]
    assert by_phase["finetune"] == hist[3]["bytes_sent"] + hist[4]["bytes_sent"]
    assert ps_by_phase["pretrain"] == hist[1]["ps_bytes"] + hist[2]["ps_bytes"]
    assert by_phase["gather"] == sum(r["gather_bytes"] for r in hist) > 0  # evaluations of the full model
    assert hist[-1]["accuracy"] is not None and summary["accuracy"] == hist[-1]["accuracy"]


def test_loft_pretrain_bytes_are_the_plans(loft_runs, tmp_path):
    """Pre-train bytes, independently from the plans: with decentralized storage and --shared exact
    a rank sends each of its filters (with its BN channels and next-conv input channels) to the rank
    that owns it in the next round's plan, and every shared float tensor to the other rank; the last
    pre-train round only averages (the filters stay with their owners). Parameter-server count:
    each worker uploads and downloads its subnetwork."""
    (summary, _, hist), _ = loft_runs
    from ist_kernels.models import preact_resnet18
    from ist_kernels.train.datasets import _mix
    from ist_kernels.train.methods.loft import PLAN

    full = preact_resnet18(num_classes=10, in_channels=1, width=4)
    state = full.state_dict()
    plans = [loft_plan(full, 2, torch.Generator().manual_seed(_mix(0, PLAN, r))) for r in range(2)]
    shared = floats_bytes(state, {t.name for t in plans[0].shared})

    def moved(cur, nxt):  # bytes of the slices whose owner changes
        total = 0
        for t, u in zip(cur.partitioned, nxt.partitioned):
            per_slice = 4 * state[t.name].numel() // state[t.name].shape[t.dim]
            for s in range(2):
                total += per_slice * len(set(t.owners[s].tolist()) & set(u.owners[1 - s].tolist()))
        return total

    assert hist[1]["bytes_sent"] == moved(plans[0], plans[1]) + 2 * shared
    assert hist[2]["bytes_sent"] == 2 * shared
    part = floats_bytes(state, {t.name for t in plans[0].partitioned})
    assert hist[1]["ps_bytes"] == hist[2]["ps_bytes"] == 2 * (2 * shared + part)
    # what a worker held: its half of the partitioned state and the shared state (weights, BN
    # statistics, momentum of the weights; integer BN counters)
    assert summary["rank_state_bytes"] <= summary["shared_state_bytes"] + summary["partitioned_state_bytes"] // 2 + 256
    assert summary["rank_state_bytes"] < summary["full_state_bytes"]


def test_loft_resume_equals_uninterrupted(loft_runs, tmp_path):
    (_, full_model, full_hist), _ = loft_runs
    out = tmp_path / "run"
    # stop in the pre-train phase (the prune happens after resuming) ...
    part, _, _ = run(out, *LOFT, "--simulate", 2, "--stop-after", 1)
    assert part["rounds"] == 1 and not part["finished"]
    _, model, hist = run(out, *LOFT, "--simulate", 2, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)
    # ... and in the fine-tune phase (the pruned structure is rebuilt from the checkpoint)
    out2 = tmp_path / "run2"
    run(out2, *LOFT, "--simulate", 2, "--stop-after", 3)
    _, model, hist = run(out2, *LOFT, "--simulate", 2, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_loft_baseline_is_local_sgd_pretrain_prune_finetune(loft_and_baseline_runs, tmp_path):
    """Paper 000's baseline: local SGD pre-trains the dense model for the same rounds, the same L2
    filter pruning, local-SGD fine-tuning; summary.md shows the pruned sizes and bytes by phase."""
    (loft, loft_model, loft_hist), (base, model, hist) = loft_and_baseline_runs["sim"]
    _, (d_base, d_model, d_hist) = loft_and_baseline_runs["dist"]
    assert_equal_states(model, d_model)
    assert untimed(hist) == untimed(d_hist)
    assert base["method"] == "localsgd" and [r.get("phase") for r in hist[1:]] == [0, 0, 1, 1]
    assert base["pretrain_rounds"] == loft["pretrain_rounds"] == 2
    # pruned like LOFT's model: half the filters of every partitioned conv, the same parameter count
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in loft_model.items()}
    assert base["params_pruned"] == loft["params_pruned"] == base["params"] < base["params_full"]
    # pre-training is dense local SGD: the same rounds as a run that never prunes
    _, _, dense_hist = run(tmp_path / "dense", *LOFT, "--method", "localsgd", "--simulate", 2)
    strip = lambda rows: [{k: v for k, v in r.items() if k != "phase"} for r in untimed(rows)]  # noqa: E731
    assert strip(hist[:3]) == strip(dense_hist[:3])
    # bytes: the dense model's ring all_reduce while pre-training, the pruned one's while fine-tuning
    # (the same as LOFT's fine-tuning); split by phase in summary.json and summary.md
    dense_bytes = dense_hist[1]["bytes_sent"]
    assert hist[1]["bytes_sent"] == hist[2]["bytes_sent"] == dense_bytes
    assert hist[3]["bytes_sent"] == hist[4]["bytes_sent"] == loft_hist[4]["bytes_sent"] == 2 * floats_bytes(model)
    assert base["bytes_by_phase"] == {"pretrain": 2 * dense_bytes, "finetune": 4 * floats_bytes(model)}
    # LOFT's fine-tuning also moved the kept filters from their owners (decentralized storage)
    prune = loft_hist[3]["bytes_sent"] - loft_hist[4]["bytes_sent"]
    assert prune > 0 and loft["bytes_by_phase"]["finetune"] - prune == base["bytes_by_phase"]["finetune"]
    assert loft["bytes_by_phase"]["pretrain"] < base["bytes_by_phase"]["pretrain"]
    table = loft_and_baseline_runs["table"]
    assert "model size" in table and "bytes by phase" in table
    from ist_kernels.train.output import human_bytes, human_count

    for s in (loft, base):
        assert f"pruned from {human_count(s['params_full'])}" in table
        assert f"finetune {human_bytes(s['bytes_by_phase']['finetune'])}" in table


def test_localsgd_pruning_resume_equals_uninterrupted(loft_and_baseline_runs, tmp_path):
    _, (_, full_model, full_hist) = loft_and_baseline_runs["sim"]
    args = [*LOFT, "--method", "localsgd", "--option", "pretrain_fraction=0.5", "--simulate", 2]
    run(tmp_path, *args, "--stop-after", 3)  # in the fine-tune phase: rebuilt from the dense model
    _, model, hist = run(tmp_path, *args, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_loft_momentum_aggregate_distributed_equals_simulated(tmp_path):
    args = [*LOFT, "--rounds", "2", "--option", "momentum_state=aggregate", "--option", "pretrain_fraction=1"]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2)
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    assert "params_pruned" not in s_sum  # pre-trained only
    # the momentum (one buffer per parameter) travels with the weights: more bytes than weights alone
    _, _, w_hist = run(tmp_path / "w", *LOFT, "--rounds", "2", "--option", "pretrain_fraction=1", "--simulate", 2)
    assert s_hist[1]["bytes_sent"] > w_hist[1]["bytes_sent"]


# ---------------------------------------------------------------- resist

@pytest.fixture(scope="module")
def resist_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resist")
    return run(root / "sim", *RESIST, "--simulate", 2), run(root / "dist", *RESIST, "--workers", 2)


def test_resist_distributed_equals_simulated(resist_runs):
    (s_sum, s_model, s_hist), (d_sum, d_model, d_hist) = resist_runs
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    assert [r.get("phase") for r in s_hist[1:]] == [0, 1, 1, 1]  # ResIST.phases: warmup, resist
    assert s_sum["warmup_rounds"] == 1 and s_sum["min_depth"] == 2


def test_resist_bytes_and_full_model_scaling(resist_runs):
    (_, model, hist), _ = resist_runs
    # warm-up: the local-SGD ring all_reduce of the whole model
    assert hist[1]["bytes_sent"] == 2 * floats_bytes(model)
    # ResIST rounds move less: each partitioned block goes only from its owners
    assert 0 < hist[2]["bytes_sent"] < hist[1]["bytes_sent"]
    # the evaluated full model scales the partitioned blocks' residuals: layer3 of preact_resnet34 has
    # 5 partitioned blocks, 2 sub-ResNets of min_depth 2 own 2 + 3 = 5 of 10 slots -> scale 1/2
    from ist_kernels.models import preact_resnet34

    net = preact_resnet34(num_classes=10, in_channels=1, width=4)
    plan = resist_plan(net, 2, 2, torch.Generator().manual_seed(0))
    assert plan.residual_scale == pytest.approx(0.5)


def test_resist_resume_equals_uninterrupted(resist_runs, tmp_path):
    (_, full_model, full_hist), _ = resist_runs
    out = tmp_path / "run"
    run(out, *RESIST, "--simulate", 2, "--stop-after", 2)  # in the ResIST phase (residual scales saved)
    _, model, hist = run(out, *RESIST, "--simulate", 2, "--resume")
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_resist_on_paper_003s_resnet101_and_synthetic_cifar100(tmp_path):
    """The papers' model and shapes offline: preact_resnet101_basic (width 4 here) on 3x32x32
    synthetic CIFAR-100 images, a warm-up round and a ResIST round."""
    summary, model, hist = run(
        tmp_path, "--method", "resist", "--model", "preact_resnet101_basic", "--dataset", "synthetic_cifar100",
        "--dataset-size", 64, "--batch-size", 4, "--local-steps", 1, "--rounds", 2, "--simulate", 2,
        "--option", "warmup_fraction=0.5")
    assert summary["finished"] and summary["min_depth"] == 5 and summary["dataset"] == "synthetic_cifar100"
    assert model["fc.weight"].shape == (100, 32) and model["conv1.weight"].shape == (4, 3, 3, 3)
    assert sum(1 for k in model if k.startswith("layer3.") and k.endswith(".conv1.weight")) == 23
    assert hist[1]["bytes_sent"] == 2 * floats_bytes(model)  # warm-up: local SGD's ring all_reduce
    assert 0 < hist[2]["bytes_sent"] < hist[1]["bytes_sent"]  # ResIST: 22 of 23 layer3 blocks dealt out


def _resist_context(*args):
    from ist_kernels.train import datasets
    from ist_kernels.train.runner import RunContext, World

    cfg = cli.build_config([*TINY, *RESIST, "--simulate", "2", *args]).validate()
    data = datasets.ShardedData(datasets.load_dataset(cfg), 2, cfg.batch_size, cfg.seed, "cpu")
    return RunContext(cfg, World(simulated=True), data, cfg.rounds)


def test_resist_warmup_trains_with_the_residual_scale():
    """Paper 003 §2.6, footnote 2: the local-SGD warm-up already scales the blocks ResIST partitions,
    so the full model never changes form when the ResIST rounds start."""
    from ist_kernels.train.methods import get_method
    from ist_kernels.train.rounds import averaged_tensors

    ctx = _resist_context("--option", "warmup_fraction=0.5")  # rounds 0, 1 warm-up; 2, 3 ResIST
    method = get_method("resist")(ctx)
    partitioned = [f"layer3.{j}" for j in range(1, 6)]  # preact_resnet34: layer3 has 6 blocks
    scale = 0.5  # S = 2, min_depth 2: the 5 blocks are dealt 3 + 2, every one owned once: 1/S

    def scales(model):
        return {n: m.residual_scale for n, m in model.named_modules() if hasattr(m, "residual_scale")}

    for m in method.warmup.models.values():
        got = scales(m)
        assert all(got[n] == scale for n in partitioned)
        assert all(v == 1.0 for n, v in got.items() if n not in partitioned)
    # the warm-up round is local SGD on models scaled so (set here by hand), bit for bit ...
    refs = {s: ctx.build_model() for s in (0, 1)}
    for m in refs.values():
        for n in partitioned:
            m.get_submodule(n).residual_scale = scale
    unscaled = {s: ctx.build_model() for s in (0, 1)}
    for models in (refs, unscaled):
        for s, m in models.items():
            ctx.train_local(m, ctx.make_optimizer(m.parameters()), s, 0)
        ctx.comm.average_models_([averaged_tensors(m) for m in models.values()], round=1)
    method.run_round(0)
    assert_equal_states(method.warmup.models[0].state_dict(), refs[0].state_dict())
    # ... and not at scale 1
    assert not torch.equal(method.warmup.models[0].layer3[1].conv1.weight, unscaled[0].layer3[1].conv1.weight)
    # the full model keeps the scale through the switch to ResIST rounds
    evaluated = []
    for r in range(1, 4):
        method.run_round(r)
        evaluated.append([scales(method.global_model())[n] for n in partitioned])
    assert evaluated == [[scale] * 5] * 3


def test_cnn_methods_reject_bad_configs(capsys):
    assert cli.main([*TINY, "--method", "loft", "--model", "mlp", "--simulate", "2"]) == 2
    assert "loft partitions the filters of a ResNet" in capsys.readouterr().err
    assert cli.main([*TINY, "--method", "loft", "--model", "preact_resnet18", "--simulate", "2",
                     "--option", "pretrain_fraction=0"]) == 2
    assert "pretrain_fraction" in capsys.readouterr().err
    assert cli.main([*TINY, "--method", "resist", "--model", "preact_resnet18", "--simulate", "2",
                     "--option", "momentum_state=keep"]) == 2
    assert "reset or aggregate" in capsys.readouterr().err
    assert cli.main([*TINY, "--method", "localsgd", "--model", "mlp", "--simulate", "2",
                     "--option", "pretrain_fraction=0.5"]) == 2
    assert "'options.pretrain_fraction'" in capsys.readouterr().err


# ---------------------------------------------------------------- the demo

def test_demo_quick_compares_loft_with_local_sgd(tmp_path, capsys):
    assert cli.main(["--demo", "--quick", "--no-progress", "--threads", "1", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| loft " in printed and "| localsgd " in printed and str(tmp_path) in printed
    loft, model, _ = outputs(tmp_path / "loft")
    base, _, _ = outputs(tmp_path / "localsgd")
    assert (loft["workers"], base["workers"]) == (2, 2) and loft["rounds"] == base["rounds"] == 4
    assert loft["total_bytes"] < base["total_bytes"]  # LOFT sends less than local SGD
    assert model["layer4.1.conv1.weight"].shape[0] == 16  # pruned 50% (width 4: 32 filters)
    for f in ("summary.md", "accuracy.png", "loss.png"):
        assert os.path.isfile(tmp_path / f), f
