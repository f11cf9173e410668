"""What the trainer tests share: running ist-train in-process and reading back what a run wrote."""
import json
import os

import torch

from ist_kernels.train import cli
from ist_kernels.train.output import read_metrics

TIME_KEYS = ("train_time", "wall_time", "time", "collectives", "peer_wait_s")
# One thread per process: the spawned workers and the simulated run then compute bit-identical steps
# on any machine (and small runs do not fight over a shared box's cores). Digits, an MLP of width 16.
TINY_MLP = ["--dataset", "digits", "--model", "mlp", "--width", "16", "--batch-size", "8", "--local-steps", "2",
            "--no-progress", "--no-plots", "--eval-interval", "2", "--threads", "1"]


def outputs(out):
    """(summary.json, model.pt state, metrics.jsonl rows) of the run in ``out``."""
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f), torch.load(os.path.join(out, "model.pt")), read_metrics(os.path.join(out, "metrics.jsonl"))


def run(out, *args, base):
    """ist-train ``base + --out-dir out + args``; asserts success and returns :func:`outputs`.
    Runs on the CPU unless ``--device`` is given: with ``--device auto`` on a one-GPU machine a
    simulated run would take the GPU and a 2-process run the CPU, and the tests compare the two."""
    argv = [*base, "--out-dir", str(out), *map(str, args)]
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    assert cli.main(argv) == 0
    return outputs(out)


def untimed(history):
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in history]


def assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k].double() - b[k].double()).abs().max())


def resume_equals_uninterrupted(run, tmp_path, *args, stop_after=1):
    """``args`` run uninterrupted, and stopped after round ``stop_after`` then resumed: the same
    model bit for bit and the same metrics (bar the clocks). ``run(out, *args)``: a test file's
    runner. Returns (summary, metrics) of the resumed run."""
    _, full_model, full_hist = run(tmp_path / "full", *args)
    run(tmp_path / "part", *args, "--stop-after", stop_after)
    summary, model, hist = run(tmp_path / "part", *args, "--resume")
    assert summary["finished"]
    assert_equal_states(full_model, model)
    assert untimed(hist) == untimed(full_hist)
    return summary, hist


def resumed_distributed_equals_simulated(run, tmp_path, *args):
    """``args`` with ``--simulate 2``, then on 2 gloo ranks stopped after round 2 and resumed from
    the per-rank checkpoints: the same model and metrics (bar the clocks), the distributed run
    decentralized and finished. ``run(out, *args)``: a test file's runner. Returns (summary,
    metrics) of the distributed run."""
    _, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    part, _, _ = run(tmp_path / "dist", *args, "--workers", 2, "--stop-after", 2)
    assert part["rounds"] == 2 and not part["finished"]
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2, "--resume")
    assert d_sum["finished"] and (d_sum["mode"], d_sum["storage"]) == ("distributed", "decentralized")
    assert_equal_states(s_model, d_model)
    assert untimed(s_hist) == untimed(d_hist)
    return d_sum, d_hist


def user_loop(engine, stop_at=None):
    """A loop as a user writes it: the engine's batches, its loss by hand."""
    for rnd in engine.rounds():
        for worker in rnd:
            model, opt = worker.model, worker.optimizer
            for x, y in worker.batches():
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                loss.backward()
                opt.step()
                worker.add_loss(loss)
            if stop_at is not None and (rnd.index, worker.index) == stop_at:
                raise KeyboardInterrupt("the user stopped")
    return engine.close()
