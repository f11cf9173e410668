"""The transformer partitions in the trainer (issue 20), end to end on pycode with a tiny gpt_tiny
(width 64: 2 heads; 4 blocks; context 16; 4 KiB of training bytes): the done-when commands with
--baseline (bits_per_byte in summary.json, bytes_ratio < 1), 2 gloo ranks (decentralized storage,
--shared exact) bit for bit equal to --simulate 2 (IST of FFN units, of heads, and of both; ResIST
stopped and resumed from per-rank checkpoints), and a simulated resume exact."""
import functools
import math

import pytest

from ist_kernels.train import cli

from train_helpers import (
    assert_equal_states,
    outputs,
    resume_equals_uninterrupted,
    resumed_distributed_equals_simulated,
    run as _run,
    untimed,
)

TINY = ["--dataset", "pycode", "--model", "gpt_tiny", "--width", "64", "--depth", "4", "--context", "16",
        "--dataset-size", "4096", "--batch-size", "4", "--local-steps", "2", "--no-progress", "--no-plots",
        "--threads", "1"]
run = functools.partial(_run, base=TINY)
PARTITIONS = {
    "ffn": ["--method", "ist"],
    "heads": ["--method", "ist", "--option", "partition=heads"],
    "resist": ["--method", "resist", "--option", "warmup_fraction=0.25"],
    "both": ["--method", "ist", "--option", "partition=both"],
}
DONE_WHEN = ("ffn", "heads", "resist")


@pytest.mark.parametrize("kind", DONE_WHEN)
def test_done_when_commands(tmp_path, kind):
    """``--simulate 2 --rounds 2 --local-steps 2 --batch-size 4 --eval-interval 0 --baseline``."""
    args = [*TINY, *PARTITIONS[kind], "--simulate", "2", "--rounds", "2", "--eval-interval", "0", "--baseline",
            "--device", "cpu", "--out-dir", str(tmp_path)]
    assert cli.main(args) == 0
    method = PARTITIONS[kind][1]
    summary, model, hist = outputs(tmp_path / method)
    base, _, _ = outputs(tmp_path / "localsgd")
    assert summary["bits_per_byte"] == pytest.approx(summary["test_loss"] / math.log(2))
    assert 0 < summary["bits_per_byte"] < 8 and base["bits_per_byte"] > 0
    assert summary["bytes_ratio"] < 1 and summary["ps_bytes_ratio"] < 1
    assert summary["rank_state_bytes"] < summary["full_state_bytes"] or kind == "resist"  # resist: warm-up
    assert [r["round"] for r in hist if "bits_per_byte" in r] == [0, 2]
    assert "tok_emb.weight" in model and "head.weight" not in model


@pytest.mark.parametrize("kind", ["ffn", "heads", "both"])
def test_ist_distributed_equals_simulated(tmp_path, kind):
    """IST of the FFN units, of the heads, and of both together: 2 gloo ranks bit for bit the
    simulated run; a rank holds its subnetwork and the shared tensors only."""
    args = [*PARTITIONS[kind], "--rounds", 3, "--shared", "exact", "--eval-interval", 3]
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2)
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    assert (d_sum["mode"], d_sum["storage"]) == ("distributed", "decentralized")
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    assert d_sum["bits_per_byte"] == s_sum["bits_per_byte"] and d_hist[-1]["test_loss"] < d_hist[0]["test_loss"]
    assert d_sum["rank_state_bytes"] < (0.75 if kind == "both" else 0.95) * d_sum["full_state_bytes"]
    assert d_sum["partition"] == kind


def test_resist_distributed_resumed_equals_simulated(tmp_path):
    """ResIST on 2 gloo ranks stopped in its ResIST phase (per-rank checkpoints: each rank's blocks)
    and resumed: bit for bit the uninterrupted simulated run."""
    args = [*PARTITIONS["resist"], "--rounds", 3, "--shared", "exact", "--eval-interval", 3]
    d_sum, d_hist = resumed_distributed_equals_simulated(run, tmp_path, *args)
    resist_rounds = [r for r in d_hist if r.get("phase") == 1]
    assert len(resist_rounds) == 2 and all(r["rank_state_bytes"] < d_sum["full_state_bytes"] for r in resist_rounds)


def test_ist_simulated_resume_is_exact(tmp_path):
    args = [*PARTITIONS["heads"], "--rounds", 3, "--simulate", 2, "--eval-interval", 1]
    resume_equals_uninterrupted(run, tmp_path, *args)
