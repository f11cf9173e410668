"""The round engine in a user's own loop (ist_kernels.train.Engine, docs/library.md): the same
model, metrics and checkpoints as ist-train, in one process and under torchrun; leaving a round
early, errors in the loop, resume."""
import os
import re
import subprocess
import sys

import pytest
import torch

from ist_kernels.train import Engine

from conftest import requires_cuda
from train_helpers import assert_equal_states, outputs, run, untimed, user_loop

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SETTINGS = dict(method="ist", dataset="digits", rounds=3, local_steps=2, batch_size=8, lr=0.1, seed=3,
                width=16, threads=1, eval_interval=2, device="cpu")
CLI = ["--method", "ist", "--dataset", "digits", "--rounds", "3", "--local-steps", "2", "--batch-size", "8",
       "--lr", "0.1", "--seed", "3", "--width", "16", "--threads", "1", "--eval-interval", "2", "--no-progress",
       "--no-plots"]


def test_engine_equals_ist_train_simulated(tmp_path):
    """Same settings, same model, same metrics (bar the clocks) as ist-train --simulate 2."""
    _, want, want_hist = run(tmp_path / "cli", "--model", "mlp", "--simulate", "2", *CLI, base=[])
    summary = user_loop(Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), **SETTINGS))
    _, got, got_hist = outputs(tmp_path / "lib")
    assert_equal_states(got, want)
    assert untimed(got_hist) == untimed(want_hist)
    assert summary["bytes_per_round"] > 0 and summary["rounds"] == 3


def test_one_worker_is_one_worker(tmp_path):
    """Engine without workers (or workers=1, no torchrun) trains one worker: S = 1, as ist-train
    --workers 1 (the config's default S without torchrun is 2: a one-process engine must not plan
    two subnetworks and train one)."""
    _, want, want_hist = run(tmp_path / "cli", "--model", "mlp", "--workers", "1", *CLI, base=[])
    engine = Engine("mlp", out_dir=str(tmp_path / "lib"), **SETTINGS)
    assert engine.num_workers == 1 and engine.local_workers == [0]
    summary = user_loop(engine)
    _, got, got_hist = outputs(tmp_path / "lib")
    assert summary["workers"] == 1
    assert_equal_states(got, want)
    assert untimed(got_hist) == untimed(want_hist)


def test_engine_resume_is_exact(tmp_path):
    """stop_after=2 then resume=True: the model of an uninterrupted run, bit for bit."""
    user_loop(Engine("mlp", workers=2, out_dir=str(tmp_path / "full"), **SETTINGS))
    first = Engine("mlp", workers=2, out_dir=str(tmp_path / "cut"), stop_after=2, checkpoint_interval=1, **SETTINGS)
    assert [r.index for r in _rounds_of(first)] == [0, 1]
    again = Engine("mlp", workers=2, out_dir=str(tmp_path / "cut"), resume=True, **SETTINGS)
    done = [r.index for r in _rounds_of(again)]
    assert done == [2]
    assert_equal_states(outputs(tmp_path / "cut")[1], outputs(tmp_path / "full")[1])


def _rounds_of(engine):
    seen = []
    for rnd in engine.rounds():
        for worker in rnd:
            for x, y in worker.batches():
                worker.optimizer.zero_grad(set_to_none=True)
                worker.loss(worker.model(x), y).backward()
                worker.optimizer.step()
        seen.append(rnd)
    engine.close()
    return seen


def test_leaving_a_round_early_stops_the_engine(tmp_path):
    engine = Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), **SETTINGS)
    with pytest.raises(KeyboardInterrupt, match="the user stopped"):
        user_loop(engine, stop_at=(1, 0))
    with pytest.raises(RuntimeError, match="round 1 did not finish"):
        next(iter(engine.rounds()))
    with pytest.raises(RuntimeError, match="round 1 did not finish"):
        engine.global_model()
    assert not [t for t in __import__("threading").enumerate() if t.name.startswith("ist-engine-round")]


def test_an_error_in_the_round_reaches_the_loop(tmp_path):
    """An exception inside the engine's round (here: its byte count after the method's round) is
    raised in the user's thread, and the engine stops."""
    engine = Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), **SETTINGS)
    rounds = engine.rounds()
    rnd = next(rounds)
    it = iter(rnd)
    worker = next(it)
    def broken():
        raise ValueError("the engine's bookkeeping broke")

    engine._run.ctx.comm.take = broken  # runs on the engine's thread once the method's round returns
    with pytest.raises(ValueError, match="bookkeeping broke"):
        for worker in it:
            pass
    with pytest.raises(RuntimeError, match="a round failed"):
        next(rounds)


def test_bad_arguments():
    with pytest.raises(TypeError, match="unknown option.*no_such_option"):
        Engine("mlp", workers=2, dataset="digits", no_such_option=1)
    with pytest.raises(TypeError, match="worker count as workers="):
        Engine("mlp", simulate=2, dataset="digits")
    from ist_kernels.train.errors import ConfigError
    with pytest.raises(ConfigError, match="lr"):
        Engine("mlp", workers=2, dataset="digits", lr=-1)
    with pytest.raises(ConfigError, match="model"):
        Engine(42, workers=2, dataset="digits")


def _docs_example():
    with open(os.path.join(ROOT, "docs", "library.md")) as f:
        text = f.read()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _example_by_ist_train(tmp_path, env, launch, device):
    """model.pt of ist-train with the docs example's settings (``launch``: --workers or --simulate 2)."""
    p = subprocess.run([sys.executable, "-m", "ist_kernels.train", "--model", "example:make_model", "--method", "ist",
                        launch, "2", "--dataset", "digits", "--rounds", "3", "--local-steps", "4",
                        "--batch-size", "16", "--lr", "0.1", "--seed", "0", "--out-dir", "cli", "--no-progress",
                        "--no-plots", "--device", device], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "cli" / "ist" if (tmp_path / "cli" / "ist").exists() else tmp_path / "cli"
    return torch.load(out / "model.pt")


def test_docs_example_under_torchrun_equals_ist_train(tmp_path):
    """The first python block of docs/library.md, as written, under torchrun with 2 processes,
    gives the model ist-train gives with the same settings (2 gloo workers)."""
    (tmp_path / "example.py").write_text(_docs_example())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "MB per round" in p.stdout
    got = torch.load(tmp_path / "runs" / "library-example" / "model.pt")
    want = _example_by_ist_train(tmp_path, env, "--workers", "cpu")
    assert_equal_states(got, want)


def test_engine_with_a_callable_and_no_dataset(tmp_path):
    """A user's own model (a lambda), data and scores: the engine partitions its FFN units, counts
    the bytes, and the scores come from the user's function."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 12), torch.randint(0, 3, (64,))
    seen = []

    def score(model):
        seen.append(type(model).__name__)
        return {"accuracy": float((model(x).argmax(-1) == y).float().mean())}

    engine = Engine(lambda: torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.GELU(), torch.nn.Linear(40, 3)),
                    method="ist", workers=2, rounds=2, local_steps=3, lr=0.1, evaluate=score, eval_interval=1,
                    out_dir=str(tmp_path / "lib"), device="cpu", threads=1)
    for rnd in engine.rounds():
        for worker in rnd:
            assert worker.model[0].out_features == 20  # the worker's half of the 40 hidden units
            for i in range(3):
                worker.optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(worker.model(x[i::3]), y[i::3])
                loss.backward()
                worker.optimizer.step()
                worker.add_loss(loss)
        assert rnd.record["accuracy"] is not None and rnd.record["bytes_sent"] > 0
    full = engine.global_model()
    assert full[0].out_features == 40
    summary = engine.close()
    assert seen == ["Sequential"] * 3 and summary["rounds"] == 2 and summary["bytes_per_round"] > 0
    with pytest.raises(Exception, match="dataset"):
        Engine("mlp", workers=2)


# ---------------------------------------------------------------- failures, wherever they happen
class _Injected(Exception):
    pass


def _fail(*a, **k):
    raise _Injected("injected")


@pytest.mark.parametrize("stage", ["plan", "hand-over", "exchange", "scoring", "checkpoint"])
def test_a_failure_at_any_stage_raises_in_the_loop_at_once(tmp_path, monkeypatch, stage):
    """A failure injected into each stage of a round raises in the user's loop as that exception,
    within seconds (no thread to wait on), and the engine refuses to continue."""
    import time as _time

    from ist_kernels.train import checkpoint
    from ist_kernels.train.engine import Worker

    engine = Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), checkpoint_interval=1, **SETTINGS)
    ctx = engine._run.ctx
    if stage == "plan":
        monkeypatch.setattr(engine._run.method, "begin_round", _fail)
    elif stage == "hand-over":
        monkeypatch.setattr(Worker, "batches", _fail)
    elif stage == "exchange":
        monkeypatch.setattr(ctx.comm, "count_exchange", _fail)
    elif stage == "scoring":
        monkeypatch.setattr(engine._run.method, "evaluate", _fail)
    else:
        monkeypatch.setattr(checkpoint, "save", _fail)
    t0 = _time.perf_counter()
    with pytest.raises(_Injected):
        user_loop(engine)
    assert _time.perf_counter() - t0 < 30
    with pytest.raises(RuntimeError, match="a round failed"):
        next(iter(engine.rounds()))


def test_run_phases_are_checked(tmp_path):
    """Run.end_round needs its begin_round, with one loss per turn; a round is begun once."""
    engine = Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), **SETTINGS)
    run_ = engine._run
    run_.begin()
    with pytest.raises(RuntimeError, match="not begun"):
        run_.end_round(0, [0.0, 0.0])
    turns = run_.begin_round(0)
    assert [t.worker for t in turns] == [0, 1] and all(t.batch_workers == (t.worker,) for t in turns)
    with pytest.raises(RuntimeError, match="begun and not ended"):
        run_.begin_round(1)
    with pytest.raises(ValueError, match="2 turns"):
        run_.end_round(0, [0.0])
    rec = run_.end_round(0, [run_.ctx.train(t, 0) for t in turns])
    assert rec["round"] == 1 and rec["train_loss"] > 0


def test_engine_trains_ddp_as_ist_train_does(tmp_path):
    """ddp's turn is one synchronous model over every worker's batches (simulated): a user's loop over
    worker.batches() gives ist-train's model and metrics."""
    settings = {**SETTINGS, "method": "ddp"}
    cli_args = [a if a != "ist" else "ddp" for a in CLI]
    _, want, want_hist = run(tmp_path / "cli", "--model", "mlp", "--simulate", "2", *cli_args, base=[])
    engine = Engine("mlp", workers=2, out_dir=str(tmp_path / "lib"), **settings)
    for rnd in engine.rounds():
        workers = list(rnd)
        assert len(workers) == 1
    engine.close()
    _, got, got_hist = outputs(tmp_path / "lib")
    assert not all(torch.equal(got[k], want[k]) for k in got)  # the loop above trained nothing
    summary = user_loop(Engine("mlp", workers=2, out_dir=str(tmp_path / "lib2"), **settings))
    _, got, got_hist = outputs(tmp_path / "lib2")
    assert_equal_states(got, want)
    assert untimed(got_hist) == untimed(want_hist)
    assert summary["rounds"] == 3


@requires_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "torch.device"])
def test_docs_example_on_cuda_equals_ist_train(tmp_path, device):
    """The docs/library.md example's loop on a GPU (device "cuda", "cuda:0" or a torch.device), the
    workers simulated in one process, gives ist-train's model with the same settings."""
    import importlib.util

    (tmp_path / "example.py").write_text(_docs_example())
    spec = importlib.util.spec_from_file_location("example", tmp_path / "example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dev = torch.device("cuda") if device == "torch.device" else device
    engine = Engine(example.make_model, method="ist", workers=2, dataset="digits", rounds=3, local_steps=4,
                    batch_size=16, lr=0.1, seed=0, out_dir=str(tmp_path / "lib"), device=dev)
    for rnd in engine.rounds():
        for worker in rnd:
            assert next(worker.model.parameters()).is_cuda
            for x, y in worker.batches():
                worker.optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(worker.model(x), y)
                loss.backward()
                worker.optimizer.step()
                worker.add_loss(loss)
    engine.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert_equal_states(outputs(tmp_path / "lib")[1], _example_by_ist_train(tmp_path, env, "--simulate", "cuda"))
