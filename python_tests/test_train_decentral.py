"""Decentralized storage in the trainer (issue 9): gloo runs with 2-4 ranks where a rank holds only
its subnetwork, against --simulate (to a few ulps with the default ring all_reduce, bit for bit with
--shared exact), resume from per-rank checkpoints, depth-3 ist, the per-rank state cap, and a killed
rank ending the others with a clear message."""
import functools
import json
import os
import re
import time

import pytest
import torch

from ist_kernels.train import checkpoint, cli

from conftest import free_port, rank_error, spawn_ranks_until, write_rank_error
from train_helpers import assert_equal_states, run as _run, untimed

BASE = ["--dataset", "digits", "--batch-size", "8", "--local-steps", "2", "--no-progress", "--no-plots",
        "--threads", "1", "--eval-interval", "1"]
run = functools.partial(_run, base=BASE)
LOFT = ["--method", "loft", "--model", "preact_resnet18", "--width", "4", "--prune-ratio", "0.5"]
IST = ["--method", "ist", "--model", "mlp", "--width", "16"]


def test_default_mode_equals_simulated_to_a_few_ulps(tmp_path):
    """One LOFT round on 3 ranks: every filter comes back from its single owner bit for bit; the
    shared tensors are the ring all_reduce's mean: the two means of the S workers' values x_s differ by
    at most what two summation orders can, 2 ((S - 1) eps sum_s |x_s| / S + eps |mean|) elementwise
    (the workers' values, not the mean, set the rounding: they may cancel)."""
    S = 3
    args = [*LOFT, "--rounds", 1, "--option", "pretrain_fraction=1"]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", S)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", S)
    assert (d_sum["mode"], d_sum["storage"], d_sum["shared"]) == ("distributed", "decentralized", "all_reduce")
    # the workers' values before the average: the same round in process, through the split-phase API
    from ist_kernels.train.context import RunContext, World
    from ist_kernels.train.datasets import ShardedData, load_dataset
    from ist_kernels.train.methods import get_method

    cfg = cli.build_config([*BASE, *map(str, args), "--simulate", str(S), "--device", "cpu"]).validate()
    ctx = RunContext(cfg, World(simulated=True), ShardedData(load_dataset(cfg), S, cfg.batch_size, cfg.seed, "cpu"),
                     cfg.rounds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        method = get_method("loft")(ctx)
        turns = method.begin_round(0)
        for t in turns:
            ctx.train(t, 0)
        contributions = [{k: v.detach().clone() for k, v in t.model.state_dict().items()} for t in turns]
    finally:
        torch.set_num_threads(threads)
    partitioned = {t.name for t in method.rounds.plan(0).partitioned}
    differ = 0
    for k, a in s_model.items():
        b = d_model[k]
        if k in partitioned or not a.is_floating_point():
            assert torch.equal(a, b), k
        else:
            eps = torch.finfo(a.dtype).eps
            magnitude = sum(c[k].abs() for c in contributions)
            bound = 2 * ((S - 1) * eps * magnitude / S + eps * a.abs()) + torch.finfo(a.dtype).tiny
            assert ((a - b).abs() <= bound).all(), (k, (a - b).abs().max(), ((a - b).abs() / bound).max())
            differ += not torch.equal(a, b)
    assert differ > 0  # the ring's summation order does show (otherwise this test proves nothing)
    # bytes, state and the round's counts are the same numbers in both modes
    for key in ("bytes_sent", "ps_bytes", "gather_bytes", "rank_state_bytes"):
        assert s_hist[1][key] == d_hist[1][key], key


def test_exact_mode_depth3_ist_bit_for_bit_on_three_ranks(tmp_path):
    """Distributed ist of any depth: hidden-to-hidden weights partitioned by rows and columns."""
    args = [*IST, "--depth", 3, "--rounds", 3, "--shared", "exact"]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 3)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 3)
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    assert d_model["net.hidden_weights.2"].shape == (16, 16) and d_sum["finished"]
    assert d_hist[-1]["test_loss"] < d_hist[0]["test_loss"]
    assert d_sum["rank_state_bytes"] < d_sum["full_state_bytes"]
    # the ranks hold the model once: a hidden-to-hidden entry (i, j) belongs to the subnetwork that
    # has both neurons; the entries between two subnetworks' neurons (trained by none this round)
    # are kept, untrained, by one holder each
    from ist_kernels.nn.subnet import SubnetMLP
    from ist_kernels.train.datasets import _mix
    from ist_kernels.train.methods.masked import PLAN
    from ist_kernels.train.paper001 import sample_neurons

    net = SubnetMLP(64, 16, 3, 10, bias=True, train_output=True)
    neurons = sample_neurons(net, 3, "balanced", None, torch.Generator().manual_seed(_mix(0, PLAN, 1)))
    trained = net.slice_plan(neurons)
    store = trained.with_holders({t.name: net.slice_spec()[t.name][0][t.dim] for t in trained.partitioned})
    for t, u in zip(trained.partitioned, store.partitioned):
        held = torch.cat(list(u.owners))
        assert torch.equal(held.sort().values, torch.arange(net.slice_spec()[t.name][0][t.dim])), t.name
        for s in range(3):
            assert set(t.owners[s].tolist()) <= set(u.owners[s].tolist())
    w1 = store.tensors[[x.name for x in store.tensors].index("hidden_weights.1")]
    rows, cols = neurons[0][1], neurons[0][0]
    assert set((rows[:, None] * 16 + cols[None, :]).flatten().tolist()) <= set(w1.owners[0].tolist())


def test_replicated_storage_stays_for_testing(tmp_path):
    """--storage replicated: every rank holds the whole model (and says so), bit for bit the same run."""
    args = [*IST, "--depth", 2, "--rounds", 2, "--shared", "exact", "--storage", "replicated"]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2)
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    assert d_sum["storage"] == "replicated" and d_sum["rank_state_bytes"] > d_sum["full_state_bytes"] / 2
    assert all(r["gather_bytes"] == 0 for r in d_hist)  # rank 0 holds the model: nothing to assemble


@pytest.fixture(scope="module")
def loft_dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("loft") / "full"
    return out, run(out, *LOFT, "--rounds", 4, "--workers", 2)


def test_checkpoints_hold_each_ranks_part(loft_dist):
    out, (summary, model, hist) = loft_dist
    folder = out / "checkpoints"
    with open(folder / "latest.json") as f:
        manifest = json.load(f)
    assert manifest["storage"] == "decentralized" and manifest["round"] == 4
    assert manifest["files"] == ["round-000004-rank-0.pt", "round-000004-rank-1.pt"]
    assert sorted(p.name for p in folder.glob("*.pt")) == manifest["files"]


@pytest.mark.parametrize("stop", [1, 3])  # in the pre-training phase; after pruning
def test_resume_from_per_rank_checkpoints_is_exact(loft_dist, tmp_path, stop):
    _, (_, full_model, full_hist) = loft_dist
    out = tmp_path / "run"
    part, _, _ = run(out, *LOFT, "--rounds", 4, "--workers", 2, "--stop-after", stop)
    assert part["rounds"] == stop and not part["finished"]
    if stop == 1:  # each rank's file holds its own filters only (half of every partitioned conv)
        ranks = [checkpoint.read_sealed(str(out / "checkpoints" / f"round-000001-rank-{k}.pt")) for k in (0, 1)]
        parts = [r["method"]["pretrain"]["part"] for r in ranks]
        name = "layer4.1.conv1.weight"
        assert parts[0][name].shape[0] + parts[1][name].shape[0] == full_model[name].shape[0] * 2 == 32
    summary, model, hist = run(out, *LOFT, "--rounds", 4, "--workers", 2, "--resume")
    assert summary["finished"]
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)


def test_rank_state_of_a_loft_run_on_four_ranks_under_the_cap(tmp_path):
    """LOFT S=4: a rank holds the shared state and a quarter of the partitioned state (+ rounding of
    the filter split), measured, under a cap below the whole model's state."""
    args = [*LOFT, "--rounds", 2, "--option", "pretrain_fraction=1", "--workers", 4]
    summary, _, _ = run(tmp_path / "probe", *args, "--eval-interval", 0)
    shared, partitioned = summary["shared_state_bytes"], summary["partitioned_state_bytes"]
    assert shared + partitioned == summary["full_state_bytes"]
    assert summary["rank_state_bytes"] <= 1.1 * (shared + partitioned / 4)
    cap = (summary["rank_state_bytes"] + summary["full_state_bytes"]) / 2e6  # MB, between the two
    capped, _, _ = run(tmp_path / "capped", *args, "--max-rank-state-mb", cap, "--eval-interval", 0)
    assert capped["finished"] and capped["full_state_bytes"] > cap * 1e6


def test_cap_below_a_subnetwork_fails_the_run(tmp_path, capsys):
    args = [*BASE, *LOFT, "--rounds", 2, "--simulate", 4, "--out-dir", str(tmp_path)]
    assert cli.main([*map(str, args), "--max-rank-state-mb", "0.01"]) == 1
    err = capsys.readouterr().err
    assert "above --max-rank-state-mb 0.01" in err and "in round 1" in err and "worker" in err


# ---------------------------------------------------------------- a rank dies mid-run
def _dying_rank(rank, S, args, port, outdir):
    """One trainer rank; rank S - 1 exits without a word when round 2 starts."""
    from ist_kernels.train.launch import _run_rank
    from ist_kernels.train.methods.masked import Masked

    if rank == S - 1:
        original = Masked.begin_round

        def begin_round(self, r):
            if r == 1:
                os._exit(0)
            return original(self, r)

        Masked.begin_round = begin_round
    # this process is one rank, as torchrun starts it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(S), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    cfg = cli.build_config(args)
    cfg.validate()
    t0 = time.perf_counter()
    try:
        _run_rank([cfg], rank, S, rank)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        write_rank_error(outdir, rank, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    os._exit(0)


def test_killed_rank_ends_the_others_with_a_clear_message(tmp_path):
    S, timeout = 3, 20
    args = [*BASE, *IST, "--rounds", 4, "--workers", S, "--timeout-s", timeout, "--out-dir", str(tmp_path / "run")]
    args = list(map(str, args))
    spawn_ranks_until(_dying_rank, (S, args, free_port(), str(tmp_path)), S, 120)
    for r in range(S - 1):
        took, msg = rank_error(tmp_path, r, f"rank {r} did not stop with an error")
        assert msg.startswith("CollectiveError:") and "(round 2)" in msg and f"rank {r} of {S}" in msg, msg
        assert "a peer died" in msg
        assert float(re.search(r"after ([0-9.]+) s", msg).group(1)) <= timeout  # the collective's own wait
        assert took < 60 + timeout, took
