"""ist-train --precision {fp32,bf16,fp16} for every method (issue 11 item 1): the forward runs under
autocast (every op of the package autocasts), fp16 steps go through a gradient scaler whose state
is checkpointed. Short simulated runs on the CPU (bf16 and fp16 autocast are both supported there)."""
import json
import math

import pytest
import torch

from ist_kernels.train import checkpoint, cli

from train_helpers import TINY_MLP, run

CNN = ["--dataset", "digits", "--width", "4", "--batch-size", "8", "--local-steps", "2", "--no-progress",
       "--no-plots", "--threads", "1", "--eval-interval", "2"]
# every method, as small as it runs (a few seconds each)
METHODS = {
    "ist": (TINY_MLP, ["--method", "ist"]),
    "masked": (TINY_MLP, ["--method", "masked"]),
    "grelu": (TINY_MLP, ["--method", "grelu", "--width", "64"]),
    "ddp": (TINY_MLP, ["--method", "ddp"]),
    "localsgd": (TINY_MLP, ["--method", "localsgd"]),
    "diloco": (TINY_MLP, ["--method", "diloco", "--lr", "0.01"]),
    "loft": (CNN, ["--method", "loft", "--model", "preact_resnet18", "--prune-ratio", "0.5"]),
    "resist": (CNN, ["--method", "resist", "--model", "preact_resnet34", "--option", "warmup_fraction=0.25",
                     "--option", "min_depth=2"]),
}


def test_every_method_is_covered():
    from ist_kernels.train.methods import KNOWN_METHODS

    assert set(METHODS) == set(KNOWN_METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_runs_every_method(tmp_path, method):
    base, args = METHODS[method]
    summary, state, history = run(tmp_path, *args, "--simulate", "2", "--rounds", "2", "--precision", "bf16",
                                  base=base)
    with open(tmp_path / "checkpoints" / "latest.json") as f:
        assert json.load(f)["config"]["precision"] == "bf16"
    losses = [r["train_loss"] for r in history if r.get("train_loss") is not None]
    assert losses and all(math.isfinite(v) for v in losses)
    assert all(t.dtype != torch.bfloat16 for t in state.values())  # parameters stay fp32 (autocast casts)


@pytest.mark.parametrize("method", ["grelu", "masked", "ddp"])
def test_fp16_runs_with_a_grad_scaler(tmp_path, method):
    base, args = METHODS[method]
    run(tmp_path, *args, "--simulate", "2", "--rounds", "2", "--precision", "fp16", "--checkpoint-interval", "1",
        base=base)
    ckpt = next(p for p in (tmp_path / "checkpoints").iterdir() if p.suffix == ".pt")
    payload = checkpoint.read_sealed(str(ckpt))
    scalers = payload["grad_scalers"]
    assert sorted(scalers) == ([0, 1] if method != "ddp" else [0])  # one per worker this process trains
    assert all(s["scale"] > 0 for s in scalers.values())


def test_precision_autocasts_the_forward(monkeypatch):
    """The run context's autocast region and scaler follow --precision."""
    from ist_kernels.train.runner import RunContext

    for precision, dtype, scaled in (("fp32", None, False), ("bf16", torch.bfloat16, False),
                                     ("fp16", torch.float16, True)):
        cfg = cli.build_config([*TINY_MLP, "--precision", precision]).validate()
        ctx = RunContext.__new__(RunContext)
        ctx._cfg, ctx.device, ctx._scalers = cfg, torch.device("cpu"), {}
        with ctx.autocast():
            y = torch.ones(2, 3) @ torch.ones(3, 2)
        assert y.dtype == (dtype or torch.float32), precision
        assert (ctx.grad_scaler(0) is not None) == scaled, precision


def test_fp16_resume_equals_an_uninterrupted_run(tmp_path):
    """The gradient scalers' state is checkpointed: a run stopped after round 1 and resumed ends
    where the uninterrupted run does, bit for bit."""
    base, args = METHODS["grelu"]
    common = [*args, "--simulate", "2", "--precision", "fp16", "--checkpoint-interval", "1"]
    _, whole, _ = run(tmp_path / "whole", *common, "--rounds", "3", base=base)
    run(tmp_path / "split", *common, "--rounds", "1", base=base)
    _, resumed, _ = run(tmp_path / "split", *common, "--rounds", "3", "--resume", base=base)
    assert whole.keys() == resumed.keys()
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


def test_unsupported_autocast_dtype_is_a_config_error(monkeypatch, tmp_path, capsys):
    """Where torch cannot autocast the device to the precision's dtype (older torch: CPU fp16), the
    run stops with a clear error instead of silently training in fp32."""
    from ist_kernels.train import context as worker

    monkeypatch.setattr(worker, "_autocasts", lambda device_type, dtype: dtype != torch.float16)
    assert cli.main([*TINY_MLP, "--method", "ist", "--precision", "fp16", "--device", "cpu", "--simulate", "2",
                     "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'precision'" in err and "does not autocast fp16 on cpu" in err, err
