"""--compile (torch.compile of the workers' models), fused optimizers on CUDA, and no host
synchronisation in the local steps.

--compile gives the eager model within fp32 rounding after one local step and the same training
after several rounds (final loss within 1%); a run compiles once: a subnetwork of the same
structure (simulated storage builds a new module object every round) reuses the compiled code, so
summary.json's ``compiles`` is one per distinct structure and ``recompiles`` is zero; the compile's
seconds are ``time_by_part["compile"]``. Each test starts from an empty dynamo cache
(``torch._dynamo.reset()``), so the counts are the run's own; inductor's on-disk cache keeps
later compiles short."""
import functools

import pytest
import torch

from ist_kernels.train import Engine
from ist_kernels.train.compiled import Compiler, check_compile
from ist_kernels.train.config import TrainConfig
from ist_kernels.train.context import RunContext, World, fused_supported
from ist_kernels.train.errors import ConfigError

from conftest import requires_cuda
from train_helpers import TINY_MLP, run as _run

run = functools.partial(_run, base=TINY_MLP)
CNN = ["--dataset", "digits", "--width", "4", "--batch-size", "8", "--local-steps", "2", "--no-progress",
       "--no-plots", "--threads", "1", "--eval-interval", "2"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def both(root, *args, base=TINY_MLP):
    """(eager outputs, --compile outputs) of the same run."""
    return (_run(root / "eager", *args, base=base), _run(root / "compiled", *args, "--compile", base=base))


def test_compile_one_local_step_equals_eager_within_rounding(tmp_path):
    (e_sum, e_model, _), (c_sum, c_model, _) = both(tmp_path, "--method", "ist", "--simulate", 2, "--rounds", 1,
                                                   "--local-steps", 1)
    assert e_sum["compile"] is False and "compiles" not in e_sum
    assert c_sum["compile"] is True and c_sum["compiles"] == 1 and c_sum["recompiles"] == 0
    assert e_model.keys() == c_model.keys()
    for k in e_model:
        torch.testing.assert_close(c_model[k], e_model[k], rtol=1e-5, atol=1e-6, msg=k)


def test_compile_five_rounds_compile_once_and_train_the_same(tmp_path):
    """ist, simulated: a new compact module per worker and round, every one of the same structure
    (16 neurons in 2 balanced halves): one compile for the whole run, no recompile."""
    (e_sum, _, e_hist), (c_sum, _, c_hist) = both(tmp_path, "--method", "ist", "--simulate", 2, "--rounds", 5)
    assert (c_sum["compiles"], c_sum["recompiles"]) == (1, 0)
    tp = c_sum["time_by_part"]
    assert tp["compile"] > 0 and e_sum["time_by_part"]["compile"] == 0
    # the first round compiled, the others only wrapped their new modules: most of the run's compile
    # seconds are the first round's (no absolute threshold: inductor's on-disk cache, warmed by an
    # earlier test or run, makes a compile of this model take well under 0.1 s)
    later = [r["time"]["compile"] for r in c_hist[2:]]
    assert c_hist[1]["time"]["compile"] > sum(later), (c_hist[1]["time"]["compile"], later)
    assert c_sum["train_loss"] == pytest.approx(e_sum["train_loss"], rel=0.01)
    assert c_sum["test_loss"] == pytest.approx(e_sum["test_loss"], rel=0.01)
    assert len(c_hist) == len(e_hist) == 6


@pytest.mark.parametrize("extra", [("--method", "localsgd", "--optimizer", "adamw"),
                                   ("--method", "ist", "--storage", "replicated")],
                         ids=["localsgd-adamw", "ist-replicated"])
def test_compile_trains_like_eager(tmp_path, extra):
    (e_sum, _, _), (c_sum, _, _) = both(tmp_path, *extra, "--simulate", 2, "--rounds", 3)
    assert (c_sum["compiles"], c_sum["recompiles"]) == (1, 0)
    assert c_sum["train_loss"] == pytest.approx(e_sum["train_loss"], rel=0.01)
    assert c_sum["test_loss"] == pytest.approx(e_sum["test_loss"], rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("extra, structures", [
    (("--method", "resist", "--model", "preact_resnet34", "--rounds", 3, "--option", "warmup_fraction=0.34",
      "--option", "min_depth=2"), 3),
    (("--method", "loft", "--model", "preact_resnet18", "--prune-ratio", "0.5", "--rounds", 3), 1),
], ids=["resist", "loft"])
def test_compile_trains_cnn_methods_like_eager(tmp_path, extra, structures, monkeypatch):
    """The CNN methods: one compile per distinct subnetwork structure (resist: the warm-up's full
    model, then the two depths the workers train; loft: one, its pre-training's subnetworks at
    S=2 and the model pruned by half having the same shapes: the fine-tune round reuses them), a
    recompile of the same forward for each after the first. Through dynamo and AOT autograd without
    inductor's code generation (``backend="aot_eager"``): inductor takes minutes per ResNet
    structure on a small CPU (resist here: 380 s, 3 compiles); its numerics are checked on the MLP
    above."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="aot_eager", **kw))
    (e_sum, _, _), (c_sum, _, _) = both(tmp_path, *extra, "--simulate", 2, base=CNN)
    assert (c_sum["compiles"], c_sum["recompiles"]) == (structures, structures - 1)
    assert c_sum["train_loss"] == pytest.approx(e_sum["train_loss"], rel=0.01)
    assert c_sum["test_loss"] == pytest.approx(e_sum["test_loss"], rel=0.01)


def test_engine_compile_hands_out_the_compiled_model(tmp_path):
    eng = Engine("mlp", method="localsgd", workers=2, dataset="digits", rounds=2, local_steps=2, width=16,
                 batch_size=8, threads=1, device="cpu", compile=True, out_dir=str(tmp_path))
    models = []
    for rnd in eng.rounds():
        for worker in rnd:
            assert isinstance(worker.model, torch._dynamo.eval_frame.OptimizedModule)
            models.append(worker.model)
            for x, y in worker.batches():
                worker.optimizer.zero_grad()
                loss = worker.loss(worker.model(x), y)
                loss.backward()
                worker.optimizer.step()
                worker.add_loss(loss)
    summary = eng.close()
    assert models[0] is models[2] and models[1] is models[3]  # a worker's wrapper is kept across rounds
    assert (summary["compiles"], summary["recompiles"]) == (1, 0)
    assert summary["time_by_part"]["compile"] > 0


def test_compile_unavailable_names_the_option(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "no-such-c++-compiler")
    with pytest.raises(ConfigError) as e:
        check_compile(torch.device("cpu"))
    assert e.value.option == "compile" and "C++ compiler" in str(e.value)
    with pytest.raises(ConfigError):
        Compiler(torch.device("cpu"))


# ---------------------------------------------------------------- fused optimizers

def _context(device, *args):
    cfg = TrainConfig.from_dict({"dataset": "none", "model": "mlp", "device": device, **dict(args)})
    return RunContext(cfg, World(device=torch.device(device)), None, 1)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizers_are_not_fused_on_the_cpu(optimizer):
    ctx = _context("cpu", ("optimizer", optimizer))
    params = [torch.nn.Parameter(torch.randn(3))]
    assert not fused_supported(params)
    assert not ctx.make_optimizer(params).defaults.get("fused")


@requires_cuda
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizers_are_fused_on_cuda(optimizer):
    ctx = _context("cuda", ("optimizer", optimizer))
    net = torch.nn.Linear(4, 3).cuda()
    opt = ctx.make_optimizer(net.parameters())
    assert opt.defaults.get("fused") is True
    net(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.step()  # (fused kernels take the run's options: momentum, nesterov, weight decay, betas)


# ---------------------------------------------------------------- no host synchronisation

def test_local_steps_do_not_synchronise_with_the_host(tmp_path, monkeypatch):
    """Reading a tensor's value on the host (.item(), float(), int(), bool(), .tolist()) waits for
    the device: none happens inside the built-in local steps (the round's loss stays a device
    tensor, read once in Run.end_round) nor in Engine's Worker.add_loss."""
    calls = []

    def forbidden(name):
        def read(self, *a, **k):
            raise AssertionError(f"host synchronisation in the local steps: Tensor.{name}")
        return read

    def patched(fn):
        def wrapper(*args, **kwargs):
            with monkeypatch.context() as m:
                for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
                    m.setattr(torch.Tensor, name, forbidden(name))
                out = fn(*args, **kwargs)
            calls.append(out)
            return out
        return wrapper

    monkeypatch.setattr(RunContext, "train", patched(RunContext.train))
    summary, _, hist = run(tmp_path, "--method", "ist", "--simulate", 2, "--rounds", 2)
    assert len(calls) == 4 and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in calls)
    assert summary["rounds"] == 2 and all(r["train_loss"] > 0 for r in hist[1:])
    with pytest.raises(AssertionError, match="Tensor.item"):
        patched(lambda: torch.ones(()).item())()

    from ist_kernels.train.engine import Worker
    from ist_kernels.train.methods import WorkerTurn

    worker = Worker(None, WorkerTurn(0, torch.nn.Linear(1, 1), None), 0)
    patched(worker.add_loss)(torch.tensor(0.5))
    patched(worker.add_loss)(torch.tensor(0.25))
    assert isinstance(worker.loss_sum, torch.Tensor) and float(worker.loss_sum) == 0.75
