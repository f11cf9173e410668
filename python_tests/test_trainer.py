"""The thin trainer (ist-train): launch modes agree, resume is exact, bad configs are rejected
before any work, data loaders and shards are right. Tiny settings: digits, an MLP of width 16."""
import functools
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from ist_kernels.train import checkpoint, cli, datasets, methods
from ist_kernels.train.config import ConfigError, TrainConfig
from ist_kernels.train.output import read_metrics
from ist_kernels.train.runner import lr_at

from train_helpers import TINY_MLP, outputs, run as _run, untimed

TINY = TINY_MLP
run = functools.partial(_run, base=TINY)


def assert_states(a, b, exact, atol=2e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=k)


# ---------------------------------------------------------------- launch modes agree

@pytest.fixture(scope="module")
def localsgd_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("localsgd")
    sim = run(root / "sim", "--method", "localsgd", "--simulate", 2, "--rounds", 4)
    dist = run(root / "dist", "--method", "localsgd", "--workers", 2, "--rounds", 4)
    return root, sim, dist


def test_localsgd_distributed_equals_simulated(localsgd_runs):
    _, (s_sum, s_model, s_hist), (d_sum, d_model, d_hist) = localsgd_runs
    assert s_sum["mode"] == "simulated" and d_sum["mode"] == "distributed"
    # Two workers: the all_reduce computes a + b, the simulated sum b + a: the same bits.
    assert_states(s_model, d_model, exact=True)
    assert untimed(s_hist) == untimed(d_hist)
    assert [r["round"] for r in s_hist] == [0, 1, 2, 3, 4]
    assert [r.get("accuracy") is not None for r in s_hist] == [True, False, True, False, True]
    model_bytes = 4 * sum(v.numel() for v in s_model.values())
    # one flat all_reduce of the full model per round; each of the S ranks sends 2 (S - 1) / S of it
    assert all(r["bytes_sent"] == 2 * (2 * 1 * model_bytes // 2) for r in s_hist[1:])
    assert s_sum["total_bytes"] == 4 * 2 * model_bytes
    assert s_hist[-1]["train_loss"] < s_hist[1]["train_loss"]


def test_ddp_distributed_matches_simulated(tmp_path):
    s_sum, s_model, s_hist = run(tmp_path / "sim", "--method", "ddp", "--simulate", 2, "--rounds", 3)
    # with --baseline: DDP then local SGD in the same 2 processes and process group
    assert cli.main([*TINY, "--out-dir", str(tmp_path / "dist"), "--method", "ddp", "--workers", "2",
                     "--rounds", "3", "--baseline"]) == 0
    d_sum, d_model, d_hist = outputs(tmp_path / "dist" / "ddp")
    b_sum, _, _ = outputs(tmp_path / "dist" / "localsgd")
    assert b_sum["method"] == "localsgd" and b_sum["mode"] == "distributed"
    assert d_sum["total_bytes"] == 2 * b_sum["total_bytes"]  # gradients each step vs the model each round
    # DDP averages per-rank gradients; simulated, one process takes the mean over the 2x batch:
    # the same gradient up to float rounding.
    assert_states(s_model, d_model, exact=False)
    for a, b in zip(s_hist[1:], d_hist[1:]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["bytes_sent"] == b["bytes_sent"]
    grad_bytes = 4 * sum(v.numel() for v in s_model.values())
    assert s_hist[1]["bytes_sent"] == 2 * 2 * (2 * 1 * grad_bytes // 2)  # steps x workers x ring bytes
    assert s_sum["accuracy"] == pytest.approx(d_sum["accuracy"], abs=1 / 359 + 1e-9)  # one test image


def test_ddp_simulated_is_sgd_on_the_concatenated_batch(tmp_path):
    """Independent check of the simulated DDP step: plain SGD on the two workers' batches."""
    _, model, _ = run(tmp_path, "--method", "ddp", "--simulate", 2, "--rounds", 1, "--momentum", 0,
                      "--weight-decay", 0)
    cfg = TrainConfig.from_dict(dict(width=16, batch_size=8, local_steps=2, simulate=2, momentum=0.0,
                                     weight_decay=0.0)).validate()
    from ist_kernels.train.model_registry import build_model

    data = datasets.ShardedData(datasets.load_dataset(cfg), 2, 8, 0, "cpu")
    ref = build_model(cfg, data.dataset).double()
    for i in range(2):
        xs, ys = zip(*(data.batch(s, i) for s in range(2)))
        loss = torch.nn.functional.cross_entropy(ref(torch.cat(xs).double()), torch.cat(ys))
        grads = torch.autograd.grad(loss, list(ref.parameters()))
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads):
                p -= cfg.lr * g
    assert_states(model, {k: v.float() for k, v in ref.state_dict().items()}, exact=False, atol=1e-5)


def test_resnet_localsgd_distributed_equals_simulated(tmp_path):
    """A preact ResNet (BatchNorm running statistics averaged too) through both launch modes."""
    args = ["--method", "localsgd", "--model", "preact_resnet18", "--width", 4, "--rounds", 2]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2)
    assert_states(s_model, d_model, exact=True)
    assert untimed(s_hist) == untimed(d_hist)
    assert s_model["layer1.0.conv1.weight"].shape[0] == 4 and s_model["bn.num_batches_tracked"] == 4
    nbytes = 4 * sum(v.numel() for k, v in s_model.items() if v.is_floating_point())  # no int counters
    assert s_hist[1]["bytes_sent"] == 2 * (2 * 1 * nbytes // 2)


# ---------------------------------------------------------------- resume

def test_resume_equals_uninterrupted_simulated(localsgd_runs, tmp_path):
    _, (_, full_model, full_hist), _ = localsgd_runs
    out = tmp_path / "run"
    part, _, _ = run(out, "--method", "localsgd", "--simulate", 2, "--rounds", 4, "--stop-after", 2,
                     "--checkpoint-interval", 1)
    assert part["rounds"] == 2 and not part["finished"]
    assert checkpoint.latest_round(str(out / "checkpoints")) == 2
    assert sorted(os.listdir(out / "checkpoints")) == ["latest.json", "round-000002-rank-0.pt"]
    summary, model, hist = run(out, "--method", "localsgd", "--simulate", 2, "--rounds", 4, "--resume")
    assert summary["finished"]
    assert_states(full_model, model, exact=True)
    assert untimed(hist) == untimed(full_hist)


def test_resume_equals_uninterrupted_distributed(localsgd_runs, tmp_path):
    _, _, (_, full_model, full_hist) = localsgd_runs
    out = tmp_path / "run"
    run(out, "--method", "localsgd", "--workers", 2, "--rounds", 4, "--stop-after", 3)
    assert sorted(os.listdir(out / "checkpoints")) == ["latest.json", "round-000003-rank-0.pt",
                                                       "round-000003-rank-1.pt"]
    _, model, hist = run(out, "--method", "localsgd", "--workers", 2, "--rounds", 4, "--resume")
    assert_states(full_model, model, exact=True)
    assert untimed(hist) == untimed(full_hist)


def test_resume_rejects_changed_config(tmp_path, capsys):
    run(tmp_path, "--method", "localsgd", "--simulate", 2, "--rounds", 2)
    capsys.readouterr()
    for extra, option in ((["--simulate", "2", "--seed", "1"], "'seed'"), (["--simulate", "2", "--width", "8"], "'width'"),
                          (["--simulate", "3"], "'workers'"), (["--workers", "2"], "'simulate'"),
                          (["--simulate", "2", "--rounds", "1"], "'rounds'")):
        rc = cli.main([*TINY, "--out-dir", str(tmp_path), "--method", "localsgd", "--rounds", "2", "--resume", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and option in err, err
        assert "must not change on resume" in err or option in ("'workers'", "'simulate'", "'rounds'"), err


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "x.pt"
    checkpoint.atomic_torch_save({"a": 1}, str(path))

    class Boom:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        checkpoint.atomic_torch_save({"a": Boom()}, str(path))
    assert torch.load(path) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.pt"]  # the temporary file is gone


# ---------------------------------------------------------------- bad configs

BAD = [
    (["--lr", "-1"], "'lr'"),
    (["--lr", "abc"], "'lr'"),
    (["--rounds", "2.5"], "'rounds'"),
    (["--precision", "fp8"], "'precision'"),
    (["--method", "nope"], "'method'"),
    (["--dataset", "mnist"], "'dataset'"),
    (["--model", "nonexistent_net"], "'model'"),
    (["--rounds", "3", "--epochs", "1"], "'rounds'"),
    (["--workers", "0"], "'workers'"),
    (["--simulate", "2", "--workers", "3"], "'workers'"),
    (["--momentum", "1.5"], "'momentum'"),
    (["--lr-schedule", "poly"], "'lr_schedule'"),
    (["--lr-milestones", "5", "3"], "'lr_milestones'"),
    (["--device", "tpu"], "'device'"),
    (["--prune-ratio", "1"], "'prune_ratio'"),
    (["--eval-interval", "-1"], "'eval_interval'"),
    (["--dataset", "cifar10"], "'data_path'"),
    (["--option", "foo=1"], "'options.foo'"),
    (["--resume"], "'resume'"),
    (["--threads", "0"], "'threads'"),
    (["--dataset", "signal_noise", "--model", "preact_resnet18"], "'model'"),
    (["--dataset-size", "100"], "'dataset_size'"),  # digits has its own size
    (["--dataset", "synthetic_cifar10", "--dataset-size", "0"], "'dataset_size'"),
]


@pytest.mark.parametrize("args,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_config_rejected_before_work(tmp_path, capsys, args, option):
    out = tmp_path / "out"
    assert cli.main([*TINY, "--out-dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert "ist-train: error: invalid option" in err and option in err, err
    assert not out.exists()  # nothing was written


def test_bad_config_file(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("method: localsgd\nlocal_step: 3\n")
    assert cli.main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "'local_step'" in err and "did you mean 'local_steps'" in err
    f.write_text("- a list\n")
    assert cli.main(["--config", str(f)]) == 2
    assert cli.main(["--config", str(tmp_path / "missing.toml")]) == 2
    g = tmp_path / "c.json"
    g.write_text("{}")
    assert cli.main(["--config", str(g)]) == 2
    assert "'config'" in capsys.readouterr().err


def test_config_files_and_flag_precedence(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("method: ddp\nlocal-steps: 3\nlr: 0.1\nlr_milestones: [2, 4]\noptions: {}\nworkers: 2\n")
    t = tmp_path / "c.toml"
    t.write_text('method = "ddp"\nlocal_steps = 3\nlr = 0.1\nlr_milestones = [2, 4]\nworkers = 2\n')
    for f in (y, t):
        cfg = cli.build_config(["--config", str(f), "--lr", "0.2"])
        assert (cfg.method, cfg.local_steps, cfg.lr, cfg.lr_milestones, cfg.workers) == ("ddp", 3, 0.2, [2, 4], 2)
        cfg.validate()
    demo = cli.build_config(["--demo", "--quick", "--rounds", "2"])
    assert demo.method == "loft" and demo.rounds == 2 and demo.baseline and demo.prune_ratio == 0.5


def test_demo_preset_yields_to_simulate(tmp_path):
    # the preset's workers=2 is not the user's: --simulate S (flag or file) replaces it, no conflict
    cfg = cli.build_config(["--demo", "--simulate", "4"])
    assert (cfg.simulate, cfg.workers, cfg.num_workers, cfg.method) == (4, None, 4, "loft")
    cfg.validate()
    f = tmp_path / "c.yaml"
    f.write_text("simulate: 3\n")
    assert cli.build_config(["--demo", "--config", str(f)]).num_workers == 3
    assert cli.build_config(["--demo"]).workers == 2  # the preset still applies where nothing overrides it
    with pytest.raises(ConfigError, match="workers"):  # a conflict the user typed is still one
        cli.build_config(["--demo", "--simulate", "4", "--workers", "2"]).validate()


def test_method_registry_extension_point(tmp_path, monkeypatch):
    """A method registered from outside the package runs through the whole trainer."""
    from ist_kernels.train.methods.localsgd import LocalSGD

    @methods.register_method("zz_test_worker0")
    class Worker0Only(LocalSGD):
        options = {"scale": methods.Option(1.0, float, "lr scale", check=lambda v: v > 0, expected="> 0")}

        def begin_round(self, r):  # worker 0 trains, nobody communicates
            return [methods.WorkerTurn(0, self.models[0], self.optimizers[0])]

        def end_round(self, r, losses):
            return methods.RoundResult(loss_sum=losses[0], steps=self.ctx.local_steps,
                                       extra={"scale": self.ctx.options["scale"]})

    try:
        assert "zz_test_worker0" in methods.available_methods()
        assert cli.main([*TINY, "--out-dir", str(tmp_path), "--method", "zz_test_worker0", "--simulate", "2",
                         "--option", "scale=0"]) == 2
        summary, _, hist = run(tmp_path, "--method", "zz_test_worker0", "--simulate", 2, "--rounds", 2,
                               "--option", "scale=2")
        assert summary["total_bytes"] == 0 and hist[-1]["scale"] == 2.0
        monkeypatch.setattr(methods, "KNOWN_METHODS", methods.KNOWN_METHODS + ("zz_ghost",))
        with pytest.raises(ConfigError, match="'zz_ghost' is not available in this build"):
            methods.get_method("zz_ghost")
    finally:
        methods._REGISTRY.pop("zz_test_worker0", None)


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    missing = [f for f in TrainConfig.field_names() if f != "options" and "--" + f.replace("_", "-") not in out]
    assert not missing and "--option KEY=VALUE" in out


def test_python_m_entry_point():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-m", "ist_kernels.train", "--list-methods"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert {"localsgd", "ddp"} <= set(res.stdout.split())
    import tomllib

    with open("pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["ist-train"] == "ist_kernels._console:ist_train"  # then cli.run
    # a rank under torchrun leaves through exit_worker: its output flushed, its status kept
    rank_env = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    res = subprocess.run([sys.executable, "-m", "ist_kernels.train", "--list-methods"], capture_output=True,
                         text=True, env=rank_env, timeout=120)
    assert res.returncode == 0 and {"localsgd", "ddp"} <= set(res.stdout.split()), res.stderr
    res = subprocess.run([sys.executable, "-m", "ist_kernels.train", "--rounds", "0"], capture_output=True,
                         text=True, env=rank_env, timeout=120)
    assert res.returncode == 2 and "invalid option 'rounds'" in res.stderr, res.stderr


def test_outputs_plots_and_baseline_table(tmp_path, capsys):
    rc = cli.main([*TINY, "--out-dir", str(tmp_path), "--method", "ddp", "--simulate", "2", "--rounds", "2",
                   "--baseline", "--plots", "--precision", "bf16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bytes / local SGD" in out and str(tmp_path) in out
    for f in ("summary.md", "accuracy.png", "loss.png", "ddp/metrics.jsonl", "localsgd/metrics.jsonl",
              "ddp/model.pt", "localsgd/summary.json"):
        assert (tmp_path / f).is_file(), f
    ddp = read_metrics(tmp_path / "ddp" / "metrics.jsonl")
    lsgd = read_metrics(tmp_path / "localsgd" / "metrics.jsonl")
    assert all(math.isfinite(r["train_loss"]) for r in ddp[1:])
    # same budget: ddp all_reduces gradients every step, local SGD the model once per round
    assert ddp[-1]["total_bytes"] == 2 * lsgd[-1]["total_bytes"]


# ---------------------------------------------------------------- schedule

def test_lr_schedules():
    cfg = TrainConfig(lr=1.0, local_steps=2)
    assert lr_at(cfg, 10, 7, 1) == 1.0
    cfg.lr_schedule = "cosine"
    assert lr_at(cfg, 10, 0, 0) == 1.0 and lr_at(cfg, 10, 5, 0) == pytest.approx(0.5)
    cfg.lr_schedule, cfg.lr_milestones, cfg.lr_gamma = "step", [2, 4], 0.5
    assert [lr_at(cfg, 10, r, 0) for r in (0, 1, 2, 3, 4, 9)] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    cfg.lr_schedule, cfg.lr_warmup_rounds = "constant", 2
    assert [lr_at(cfg, 10, r, i) for r in (0, 1, 2) for i in (0, 1)] == [0.25, 0.5, 0.75, 1, 1, 1]


def test_epochs_become_rounds(tmp_path):
    summary, _, _ = run(tmp_path, "--method", "localsgd", "--simulate", 2, "--epochs", 0.05)
    shard = len(datasets.load_dataset(TrainConfig()).train_y) // 2  # the smaller of the two shards
    assert summary["rounds"] == math.ceil(0.05 * shard / (8 * 2))


# ---------------------------------------------------------------- data

def test_digits_shards_disjoint_and_batches_deterministic():
    ds = datasets.load_dataset(TrainConfig())
    n = len(ds.train_y)
    assert ds.train_x.shape == (n, 1, 8, 8) and len(ds.test_y) == 1797 - n == 359 and ds.num_outputs == 10
    assert ds.test_y.bincount().tolist() == [36, 36, 35, 37, 36, 36, 36, 36, 35, 36]  # stratified
    for s in (2, 3, 7):
        shards = datasets.shard_indices(n, s, seed=5)
        allidx = torch.cat(shards)
        assert len(allidx) == n and len(allidx.unique()) == n  # disjoint and covering
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        assert all(torch.equal(a, b) for a, b in zip(shards, datasets.shard_indices(n, s, seed=5)))
    assert not torch.equal(datasets.shard_indices(n, 2, 0)[0], datasets.shard_indices(n, 2, 1)[0])
    data = datasets.ShardedData(ds, 3, batch_size=64, seed=1, device="cpu")
    stream = data.streams[1]
    shard = set(data.shards[1].tolist())
    steps = [stream.indices(t) for t in range(2 * len(shard) // 64 + 2)]
    assert all(len(b) == 64 and set(b.tolist()) <= shard for b in steps)
    flat = torch.cat(steps)[: len(shard)]  # the first epoch visits every sample of the shard once
    assert sorted(flat.tolist()) == sorted(shard)
    x, y = data.batch(1, 3)
    fresh = datasets.ShardedData(ds, 3, batch_size=64, seed=1, device="cpu")
    x2, y2 = fresh.batch(1, 3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ConfigError, match="'workers'"):
        datasets.shard_indices(3, 4, 0)


def _write_cifar(folder, files, label_key, n, classes, rng):
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in files:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, classes, size=n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), label_key: labels, b"data": data}, f)
        written[name] = (data, labels)
    return written


def test_cifar_loaders(tmp_path, capsys):
    rng = np.random.default_rng(0)
    files10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    w = _write_cifar(tmp_path / "c10", files10, b"labels", 3, 10, rng)
    cfg = TrainConfig(dataset="cifar10", data_path=str(tmp_path / "c10"))
    ds = datasets.load_dataset(cfg)
    assert ds.train_x.shape == (15, 3, 32, 32) and ds.train_x.dtype == torch.uint8
    want = np.concatenate([w[f"data_batch_{i}"][0] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert np.array_equal(ds.train_x.numpy(), want)
    assert ds.test_y.tolist() == w["test_batch"][1] and ds.num_outputs == 10
    x = ds.prepare(ds.train_x[:2])
    ref = (torch.from_numpy(want[:2]).double() / 255 - torch.tensor([0.4914, 0.4822, 0.4465]).double().view(1, 3, 1, 1)) \
        / torch.tensor([0.2470, 0.2435, 0.2616]).double().view(1, 3, 1, 1)
    torch.testing.assert_close(x.double(), ref, atol=1e-5, rtol=1e-5)

    _write_cifar(tmp_path / "c100", ["train", "test"], b"fine_labels", 4, 100, rng)
    ds100 = datasets.load_dataset(TrainConfig(dataset="cifar100", data_path=str(tmp_path / "c100")))
    assert ds100.train_x.shape == (4, 3, 32, 32) and ds100.num_outputs == 100

    os.remove(tmp_path / "c10" / "data_batch_3")
    with pytest.raises(ConfigError, match="'data_path'.*data_batch_3"):
        datasets.load_dataset(cfg)
    with pytest.raises(ConfigError, match="'data_path'"):
        datasets.load_dataset(TrainConfig(dataset="cifar100", data_path=str(tmp_path / "nowhere")))

    # end to end on the tiny CIFAR-100 folder, with augmentation
    summary, _, hist = run(tmp_path / "out", "--method", "localsgd", "--simulate", 2, "--rounds", 1,
                           "--dataset", "cifar100", "--data-path", tmp_path / "c100", "--batch-size", 2)
    assert summary["rounds"] == 1 and math.isfinite(hist[-1]["train_loss"])


def test_synthetic_datasets(tmp_path):
    """Paper 002's signal + noise (classification) and paper 001's diabetes data (regression)."""
    ds = datasets.load_dataset(TrainConfig(dataset="signal_noise", seed=4))
    assert ds.train_x.shape == ds.test_x.shape == (100, 2, 400) and not ds.image
    signal = ds.train_x[:, 0]  # §5.1: x_1 = y e_1 with y = +-1, labels 0/1
    assert torch.equal(signal[:, 0], 2.0 * ds.train_y - 1) and not signal[:, 1:].any()
    assert torch.equal(ds.train_x, datasets.load_dataset(TrainConfig(dataset="signal_noise", seed=4)).train_x)
    summary, _, hist = run(tmp_path / "sn", "--method", "localsgd", "--simulate", 2, "--rounds", 2,
                           "--dataset", "signal_noise")
    assert summary["accuracy"] is not None and math.isfinite(hist[-1]["train_loss"])
    summary, _, hist = run(tmp_path / "db", "--method", "ddp", "--simulate", 2, "--rounds", 2, "--dataset", "diabetes",
                           "--lr", 0.01, "--plots")
    assert summary["accuracy"] is None and hist[-1]["test_loss"] < hist[0]["test_loss"]
    assert (tmp_path / "db" / "loss.png").is_file() and not (tmp_path / "db" / "accuracy.png").exists()


def test_synthetic_images_class_conditional_learnable_not_trivial():
    from ist_kernels.train.paper_data import synthetic_images

    C, n = 10, 3000
    x, y = synthetic_images(n, C, seed=3, stream=0)
    assert x.shape == (n, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.bincount(y, minlength=C).tolist() == [n // C] * C  # balanced, like CIFAR
    x2, y2 = synthetic_images(n, C, seed=3, stream=0)
    assert torch.equal(x, x2) and torch.equal(y, y2)  # seeded
    xt, yt = synthetic_images(n // 3, C, seed=3, stream=1)
    assert not torch.equal(xt[:10], x[:10])
    assert x.float().std() > 30 and 100 < x.float().mean() < 160  # uses the uint8 range like photos
    # the test stream shares the training stream's classes: a nearest class-mean classifier fitted
    # on the training images scores the test images far above chance, and far below 100%
    f = lambda im: torch.nn.functional.avg_pool2d(im.double(), 4).flatten(1)  # noqa: E731
    means = torch.stack([f(x[y == c]).mean(0) for c in range(C)])
    acc = float((torch.cdist(f(xt), means).argmin(1) == yt).double().mean())
    assert 0.2 < acc < 0.8, acc
    # another seed: other classes
    x3, _ = synthetic_images(100, C, seed=4)
    assert not torch.equal(x3, synthetic_images(100, C, seed=3)[0])
    with pytest.raises(ValueError, match="num_classes >= 1"):
        synthetic_images(10, 0)


@pytest.mark.parametrize("name,classes", [("synthetic_cifar10", 10), ("synthetic_cifar100", 100)])
def test_synthetic_cifar_loaders(name, classes):
    ds = datasets.load_dataset(TrainConfig(dataset=name, dataset_size=1000, seed=5))
    assert (ds.train_x.shape, ds.test_x.shape) == ((1000, 3, 32, 32), (200, 3, 32, 32))
    assert ds.train_x.dtype == torch.uint8 and ds.image and ds.num_outputs == classes
    assert set(ds.train_y.unique().tolist()) == set(range(classes))
    # normalised per batch as the CIFAR loader does: uint8 / 255, per-channel mean and std
    x = ds.prepare(ds.train_x)
    ref = (ds.train_x.double() / 255 - ds.mean.double().view(1, 3, 1, 1)) / ds.std.double().view(1, 3, 1, 1)
    torch.testing.assert_close(x.double(), ref, atol=1e-5, rtol=1e-5)
    assert x.mean((0, 2, 3)).abs().max() < 0.05 and (x.std((0, 2, 3)) - 1).abs().max() < 0.05
    # a data set, not a draw: the run's seed does not change the images
    other = datasets.load_dataset(TrainConfig(dataset=name, dataset_size=1000, seed=6))
    assert torch.equal(other.train_x, ds.train_x) and torch.equal(other.test_y, ds.test_y)
    assert datasets.DATASETS[name].augment  # crop + flip by default, as for CIFAR


def test_synthetic_cifar_trains_and_resume_keeps_its_size(tmp_path, capsys):
    args = ["--method", "localsgd", "--simulate", 2, "--rounds", 2, "--dataset", "synthetic_cifar10",
            "--dataset-size", 40]
    summary, _, hist = run(tmp_path, *args)
    assert summary["dataset"] == "synthetic_cifar10" and math.isfinite(hist[-1]["train_loss"])
    capsys.readouterr()
    rc = cli.main([*TINY, "--out-dir", str(tmp_path), *map(str, args[:-1]), "50", "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "'dataset_size'" in err and "must not change on resume" in err, err


def test_augment_is_a_crop_and_flip():
    x = torch.randn(5, 3, 8, 8)
    seed = 1234
    out = datasets._augment(x, seed)
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(5, generator=g) < 0.5
    dy = torch.randint(0, 3, (5,), generator=g)
    dx = torch.randint(0, 3, (5,), generator=g)
    xp = torch.nn.functional.pad(x, (1, 1, 1, 1))
    for i in range(5):
        ref = xp[i, :, dy[i]:dy[i] + 8, dx[i]:dx[i] + 8]
        assert torch.equal(out[i], ref.flip(2) if flip[i] else ref)


# ---------------------------------------------------------------- the demo (once LOFT is registered)

@pytest.mark.skipif("loft" not in methods.available_methods(), reason="the loft method is not in this build yet")
def test_demo_quick(tmp_path):
    assert cli.main(["--demo", "--quick", "--no-progress", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "accuracy.png").is_file()


def test_context_seeds_models_and_generators(global_rngs):
    from ist_kernels.train.runner import RunContext, World

    cfg = TrainConfig(seed=3, width=8).validate()
    ctx = RunContext(cfg, World(simulated=True), datasets.ShardedData(datasets.load_dataset(cfg), 2, 4, 3, "cpu"), 5)
    torch.manual_seed(123)
    a = ctx.build_model()
    torch.rand(7)  # whatever ran before does not change the initialisation
    b = ctx.build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    f = lambda: torch.nn.Linear(ctx.in_features, ctx.num_outputs)  # noqa: E731
    assert torch.equal(ctx.build_model(f).weight, ctx.build_model(f).weight) and ctx.in_features == 64
    assert torch.equal(torch.randperm(9, generator=ctx.generator(1, 4)), torch.randperm(9, generator=ctx.generator(1, 4)))
    assert not torch.equal(torch.rand(9, generator=ctx.generator(1, 4)), torch.rand(9, generator=ctx.generator(1, 5)))
    assert ctx.local_workers == [0, 1]


def test_single_worker_localsgd_equals_ddp(tmp_path):
    """With one worker both baselines are plain SGD on the same batches: the same bits, no bytes."""
    a_sum, a_model, a_hist = run(tmp_path / "a", "--method", "localsgd", "--workers", 1, "--rounds", 2)
    b_sum, b_model, b_hist = run(tmp_path / "b", "--method", "ddp", "--workers", 1, "--rounds", 2)
    assert a_sum["mode"] == b_sum["mode"] == "single" and a_sum["total_bytes"] == b_sum["total_bytes"] == 0
    assert_states(a_model, b_model, exact=True)
    assert untimed(a_hist) == untimed(b_hist)


def test_bytes_convention_three_workers(tmp_path):
    """S = 3 (simulated): local SGD sends 2 (S - 1) / S of the model per worker and round
    (ring all_reduce, as ist_kernels.distributed.CommStats counts); DDP that per step."""
    s, model, hist = run(tmp_path / "l", "--method", "localsgd", "--simulate", 3, "--rounds", 1)
    nbytes = 4 * sum(v.numel() for v in model.values())
    assert hist[1]["bytes_sent"] == 3 * (2 * 2 * nbytes // 3)
    s, _, hist = run(tmp_path / "d", "--method", "ddp", "--simulate", 3, "--rounds", 1)
    assert hist[1]["bytes_sent"] == 2 * 3 * (2 * 2 * nbytes // 3)
