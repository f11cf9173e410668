"""ist-train with the user's own model and data: --model MODULE:FACTORY / file.py:FACTORY with
--model-args, --dataset MODULE:FACTORY, --dataset tokens, --dataset imagefolder (the PIL reader
here; torchvision's where it imports). Factories live in small modules each test writes."""
import functools
import os
import pickle
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

from ist_kernels.train import cli, datasets, model_registry as models
from ist_kernels.train.config import ConfigError, HyperParams, TrainConfig, parse_kv
from ist_kernels.train.context import logits

from train_helpers import assert_equal_states, run as _run

BASE = ["--batch-size", "8", "--local-steps", "2", "--no-progress", "--no-plots", "--eval-interval", "1",
        "--threads", "1", "--rounds", "2"]
run = functools.partial(_run, base=BASE)

FACTORIES = """
import torch
from torch import nn
import torch.utils.data as tud


class Blobs(tud.Dataset):
    classes = ["a", "b", "c"]

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 5, generator=g) + self.y[:, None].float()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def blobs(n=120):
    return Blobs(n, 0), Blobs(40, 1)


def net(hidden=8, classes=3):
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def digits_net(num_classes=10):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, num_classes))


def reads_values(hidden=8):  # cannot run on the meta device
    m = net(hidden)
    assert float(m[0].weight.detach().abs().sum()) > 0
    return m


def raises(**kw):
    raise RuntimeError("factory exploded")


def not_a_module():
    return {"weights": 1}


def wrong_data():
    return [1, 2, 3]


def one_dataset():
    return Blobs(10, 0)


class Out:
    def __init__(self, logits):
        self.logits = logits


class HFLike(nn.Module):  # returns an object with .logits, as Hugging Face models do
    def __init__(self):
        super().__init__()
        self.inner = net()

    def forward(self, x):
        return Out(self.inner(x))


def hf_like():
    return HFLike()
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh module of FACTORIES (a unique name: sys.modules caches modules) in tmp_path, the
    working directory; returns its name."""
    name = f"user_factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------- options

def test_kv_options_parse_and_coerce():
    assert parse_kv("model_args", "a=1,b=2.5,c=true,d=x, e=False") == dict(a=1, b=2.5, c=True, d="x", e=False)
    cfg = cli.build_config(["--model", "m:f", "--model-args", "a=1,b=x", "--model-args", "c=0.5",
                            "--dataset-args", "dtype=uint8"])
    assert cfg.model_args == dict(a=1, b="x", c=0.5) and cfg.dataset_args == dict(dtype="uint8")
    assert TrainConfig.from_dict({"model_args": {"n": 3}}).model_args == {"n": 3}
    for bad in ("a", "=1", "1a=2"):
        with pytest.raises(ConfigError, match="'model_args'"):
            parse_kv("model_args", bad)
    c = TrainConfig(model="pkg.mod:make_net", dataset="path/to/data.py:load", workers=2)
    assert c.resolved_out_dir() == os.path.join("runs", "localsgd-make_net-load-S2")


BAD = [
    (["--model", "nosuchmodule_xyz:fn"], "'model'", "cannot import module 'nosuchmodule_xyz'"),
    (["--model", "{m}:missing"], "'model'", "has no attribute 'missing'"),
    (["--model", "{m}:raises", "--model-args", "a=1"], "'model'", "raises(a=1) raised RuntimeError: factory exploded"),
    (["--model", "{m}:not_a_module"], "'model'", "not a torch.nn.Module"),
    (["--model", "{m}"], "'model'", "unknown model"),
    (["--model", "nowhere/net.py:fn"], "'model'", "is not a file"),
    (["--dataset", "{m}:wrong_data"], "'dataset'", "must return (train, test)"),
    (["--dataset", "{m}:one_dataset"], "'dataset'", "must return (train, test)"),
    (["--dataset", "{m}:raises"], "'dataset'", "factory exploded"),
    (["--dataset", "nosuchmodule_xyz:load"], "'dataset'", "cannot import"),
    (["--dataset", "tokens", "--model", "gpt_tiny"], "'data_path'", "needs --data-path"),
    (["--dataset", "imagefolder"], "'data_path'", "needs --data-path"),
    (["--model-args", "width=3"], "'model_args'", "applies to --model MODULE:FACTORY"),
    (["--dataset-args", "x=1"], "'dataset_args.x'", "takes no dataset_args"),
]


@pytest.mark.parametrize("args,option,text", BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_user_model_or_data_rejected_before_work(user_module, tmp_path, capsys, args, option, text):
    out = tmp_path / "out"
    args = [a.replace("{m}", user_module) for a in args]
    assert cli.main([*BASE, "--out-dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert f"ist-train: error: invalid option {option}" in err and text in err, err
    assert not out.exists()  # nothing was written


def test_imagefolder_without_torchvision_says_so(tmp_path, capsys):
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision imports here")
    except Exception:
        pass
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    out = tmp_path / "out"
    assert cli.main([*BASE, "--out-dir", str(out), "--dataset", "imagefolder", "--data-path",
                     str(tmp_path / "imgs")]) == 2
    err = capsys.readouterr().err
    assert "invalid option 'dataset'" in err and "torchvision cannot be imported" in err and "backend=pil" in err
    assert not out.exists()


# ---------------------------------------------------------------- models

def test_probe_model_meta_cpu_fallback_and_cache(user_module):
    cfg = TrainConfig(model=f"{user_module}:net", model_args={"hidden": 6})
    m = models.probe_model(cfg)
    assert m[0].weight.is_meta and m[0].weight.shape == (6, 5)
    assert models.probe_model(HyperParams(cfg)) is m  # cached; a method's validate passes its HyperParams
    cpu = models.probe_model(TrainConfig(model=f"{user_module}:reads_values"))
    assert cpu[0].weight.device.type == "cpu"
    assert models.is_external_model(cfg.model) and not models.is_external_model("mlp")
    with pytest.raises(ValueError):
        models.probe_model(TrainConfig(model="mlp"))


def test_user_model_seeded_like_every_model(user_module, tmp_path):
    cfg = TrainConfig(model=f"{user_module}:digits_net", seed=3)
    a = models.build_model(cfg, None)
    torch.manual_seed(123)  # whatever ran before
    b = models.build_model(cfg, None)
    assert_equal_states(a.state_dict(), b.state_dict())
    c = models.build_model(TrainConfig(model=f"{user_module}:digits_net", seed=4), None)
    assert not torch.equal(a[1].weight, c[1].weight)
    # a file path works too, with the same result
    path = os.path.join(str(tmp_path), f"{user_module}.py")
    d = models.build_model(TrainConfig(model=f"{path}:digits_net", seed=3), None)
    assert_equal_states(a.state_dict(), d.state_dict())


def test_logits_of_outputs():
    t = torch.randn(2, 3)
    assert logits(t) is t and logits((t, 1)) is t and logits({"logits": t}) is t
    assert logits(type("O", (), {"logits": t})()) is t
    with pytest.raises(ConfigError, match="'model'"):
        logits("nope")


def test_user_model_and_data_distributed_equals_simulated(user_module, tmp_path):
    """The factories are imported by the spawned workers from the working directory; every rank
    builds the same model and reads the same shards, so the runs agree bit for bit."""
    args = ["--model", f"{user_module}:net", "--model-args", "hidden=12", "--dataset", f"{user_module}:blobs",
            "--dataset-args", "n=96", "--method", "localsgd"]
    s_sum, s_model, s_hist = run(tmp_path / "sim", *args, "--simulate", 2)
    d_sum, d_model, d_hist = run(tmp_path / "dist", *args, "--workers", 2)
    assert d_sum["mode"] == "distributed"
    assert_equal_states(s_model, d_model)
    assert [r.get("accuracy") for r in s_hist] == [r.get("accuracy") for r in d_hist]
    assert s_model["0.weight"].shape == (12, 5)


def test_user_model_on_builtin_data_and_logits_objects(user_module, tmp_path):
    _, model, hist = run(tmp_path / "a", "--model", f"{user_module}:digits_net", "--dataset", "digits",
                         "--simulate", 2)
    assert hist[-1]["accuracy"] > 0.2 and "1.weight" in model
    _, _, hist = run(tmp_path / "b", "--model", f"{user_module}:hf_like", "--dataset", f"{user_module}:blobs",
                     "--simulate", 2)
    assert hist[-1]["accuracy"] is not None


def test_user_model_too_few_outputs(user_module, tmp_path, capsys):
    assert cli.main([*BASE, "--out-dir", str(tmp_path / "o"), "--model", f"{user_module}:digits_net",
                     "--model-args", "num_classes=5", "--simulate", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "invalid option 'model'" in err and "num_classes=10" in err


# ---------------------------------------------------------------- torch Datasets

def test_dataset_from_torch_infers_the_task():
    import torch.utils.data as tud
    from PIL import Image

    x = torch.randint(0, 50, (30, 8))
    lm = datasets.dataset_from_torch("lm", tud.TensorDataset(x[:, :-1], x[:, 1:]),
                                     tud.TensorDataset(x[:4, :-1], x[:4, 1:]))
    assert lm.task == "language_model" and lm.num_outputs == int(x.max()) + 1 and lm.token_unit == "token"
    assert lm.prepare(lm.train_x[:2]).dtype == torch.long
    f64 = functools.partial(torch.randn, dtype=torch.float64)
    reg = datasets.dataset_from_torch("r", tud.TensorDataset(f64(10, 3), torch.randn(10, 2)),
                                      tud.TensorDataset(f64(4, 3), torch.randn(4, 2)))
    assert reg.task == "regression" and reg.num_outputs == 2
    assert reg.train_x.dtype == reg.test_x.dtype == torch.float32
    imgs = [(Image.fromarray(np.full((6, 7, 3), i, np.uint8)), i % 2) for i in range(6)]
    im = datasets.dataset_from_torch("img", imgs, imgs[:2])
    assert im.task == "classification" and im.image and im.train_x.shape == (6, 3, 6, 7)
    assert im.train_x.dtype == torch.uint8 and im.num_outputs == 2
    with pytest.raises(ConfigError, match="'dataset'.*same shapes"):
        datasets.dataset_from_torch("bad", [(torch.zeros(3), 0), (torch.zeros(4), 1)], [(torch.zeros(3), 0)])
    with pytest.raises(ConfigError, match="'dataset'.*pairs"):
        datasets.dataset_from_torch("bad", [torch.zeros(3)], [torch.zeros(3)])


def test_user_data_shards_are_disjoint_and_deterministic(user_module):
    cfg = TrainConfig(dataset=f"{user_module}:blobs", dataset_args={"n": 50})
    ds = datasets.load_dataset(cfg)
    assert datasets.load_dataset(cfg) is ds  # validation's load is reused
    assert (ds.task, ds.num_outputs, ds.input_shape, len(ds.train_y)) == ("classification", 3, (5,), 50)
    assert models.model_task(cfg) == "classification"
    data = datasets.ShardedData(ds, 3, 4, 0, "cpu")
    allidx = torch.cat(data.shards).sort().values
    assert torch.equal(allidx, torch.arange(50))
    again = datasets.ShardedData(ds, 3, 4, 0, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(data.shards, again.shards))


# ---------------------------------------------------------------- tokens

def test_tokens_file_split_meta_and_checks(tmp_path):
    ids = (np.arange(1000) * 7 % 300).astype(np.uint16)
    f = tmp_path / "train.bin"
    ids.tofile(f)
    cfg = TrainConfig(dataset="tokens", data_path=str(f), context=16, model="gpt_tiny")
    cfg.validate()
    ds = datasets.load_dataset(cfg)
    # the last tenth (100 ids) is the test split; sequences of 16 ids, targets shifted by one
    assert ds.task == "language_model" and ds.num_outputs == 300 and ds.token_unit == "token"
    assert ds.train_x.shape == ((900 - 1) // 16, 16) and ds.test_x.shape == ((100 - 1) // 16, 16)
    assert torch.equal(ds.train_x[0].long(), torch.from_numpy(ids[:16].astype(np.int64)))
    assert torch.equal(ds.train_y[0], torch.from_numpy(ids[1:17].astype(np.int64)))
    assert torch.equal(ds.test_x[0].long(), torch.from_numpy(ids[900:916].astype(np.int64)))
    capped = datasets.load_dataset(TrainConfig(dataset="tokens", data_path=str(f), context=16, dataset_size=170))
    assert capped.train_x.shape[0] == (170 - 1) // 16
    # nanoGPT's layout: a folder with train.bin, val.bin and meta.pkl (vocab_size)
    ids[:100].tofile(tmp_path / "val.bin")
    with open(tmp_path / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 320, "itos": {0: "a"}, "stoi": {"a": 0}}, fh)
    ds2 = datasets.load_dataset(TrainConfig(dataset="tokens", data_path=str(tmp_path), context=16))
    assert ds2.num_outputs == 320 and ds2.train_x.shape[0] == (1000 - 1) // 16
    bad = [
        (dict(dataset_args={"dtype": "int7"}), "'dataset_args.dtype'"),
        (dict(dataset_args={"vocab_size": 100}), "'dataset_args.vocab_size'"),
        (dict(dataset_args={"test_fraction": 1.5}), "'dataset_args.test_fraction'"),
        (dict(dataset_args={"image_size": 3}), "'dataset_args.image_size'"),
        (dict(data_path=str(tmp_path / "none.bin")), "'data_path'"),
    ]
    for kw, option in bad:
        c = TrainConfig(**{**dict(dataset="tokens", data_path=str(f), context=16), **kw})
        with pytest.raises(ConfigError, match=option):
            datasets.load_dataset(c)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="'dataset_args.dtype'.*dtype=uint8"):
        TrainConfig(dataset="tokens", data_path=str(odd), model="gpt_tiny").validate()
    with pytest.raises(ConfigError, match="'model'"):  # the mlp takes no token data
        TrainConfig(dataset="tokens", data_path=str(f)).validate()


def test_tokens_uint8_runs_a_language_model(tmp_path):
    f = tmp_path / "bytes.txt"
    f.write_bytes(open(datasets.__file__, "rb").read()[:6000])
    _, _, hist = run(tmp_path / "o", "--dataset", "tokens", "--data-path", f, "--dataset-args", "dtype=uint8",
                     "--model", "gpt_tiny", "--width", "32", "--depth", "1", "--context", "16", "--simulate", 2)
    assert hist[-1]["bits_per_byte"] < 8.5 and "bits_per_token" not in hist[-1]


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformers") is None, reason="needs transformers")
def test_hugging_face_model_on_tokens(tmp_path, monkeypatch):
    (tmp_path / "hf_tiny.py").write_text(textwrap.dedent("""
        def gpt2(vocab_size=256, n_positions=16):
            from transformers import GPT2Config, GPT2LMHeadModel
            return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=16,
                                              n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    """))
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "t.bin"
    (np.arange(3000) * 5 % 97).astype(np.uint16).tofile(f)
    _, model, hist = run(tmp_path / "o", "--model", f"{tmp_path / 'hf_tiny.py'}:gpt2", "--model-args",
                         "vocab_size=97", "--dataset", "tokens", "--data-path", f, "--context", "16", "--simulate", 2)
    assert hist[-1]["bits_per_token"] < hist[0]["bits_per_token"]
    assert any(k.endswith("wte.weight") for k in model)


# ---------------------------------------------------------------- imagefolder

def _write_images(root, classes, per_class, size=(6, 5), sizes=None):
    from PIL import Image

    for c, name in enumerate(classes):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = sizes[i % len(sizes)] if sizes else size
            a = np.full((h, w, 3), 40 * c + i, np.uint8)
            Image.fromarray(a).save(d / f"img{i}.png")
        (d / "notes.txt").write_text("not an image")


def test_imagefolder_pil_reader(tmp_path):
    root = tmp_path / "data"
    _write_images(root / "train", ["cat", "dog", "eel"], 4)
    _write_images(root / "val", ["dog"], 4)  # val/ stands for test/; a class may be missing
    cfg = TrainConfig(dataset="imagefolder", data_path=str(root), dataset_args={"backend": "pil"})
    cfg.validate()
    ds = datasets.load_dataset(cfg)
    assert (ds.task, ds.num_outputs, ds.image, ds.input_shape) == ("classification", 3, True, (3, 5, 6))
    assert ds.train_x.dtype == torch.uint8 and len(ds.train_y) == 12 and len(ds.test_y) == 4
    assert ds.test_y.tolist() == [1, 1, 1, 1]  # labels by the training classes' names
    assert int(ds.train_x[ds.train_y == 1][0, 0, 0, 0]) == 40  # dog's first image
    assert ds.mean.shape == (3,) and not datasets.augment_default(cfg)
    # one folder of classes: a tenth (by path hash) is the test split; sizes differ -> image_size
    flat = tmp_path / "flat"
    _write_images(flat, ["a", "b"], 15, sizes=[(6, 5), (4, 4)])
    c2 = TrainConfig(dataset="imagefolder", data_path=str(flat), dataset_args={"backend": "pil"})
    with pytest.raises(ConfigError, match="'dataset_args.image_size'"):
        datasets.load_dataset(c2)
    c3 = TrainConfig(dataset="imagefolder", data_path=str(flat), dataset_args={"backend": "pil", "image_size": 8})
    ds3 = datasets.load_dataset(c3)
    assert ds3.input_shape == (3, 8, 8) and len(ds3.train_y) + len(ds3.test_y) == 30 and len(ds3.test_y) > 0
    assert datasets.load_dataset(c3) is ds3
    with pytest.raises(ConfigError, match="'dataset_args.backend'"):
        TrainConfig(dataset="imagefolder", data_path=str(flat), dataset_args={"backend": "cv2"}).validate()


def test_imagefolder_through_torchvision_api(tmp_path, monkeypatch):
    """The torchvision path, against a stand-in of torchvision.datasets.ImageFolder where the real
    one cannot be imported (the listing is the PIL reader's: the same rules)."""
    try:
        import torchvision  # noqa: F401
        real = True
    except Exception:
        real = False
    if not real:
        pkg = tmp_path / "fake" / "torchvision"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "datasets.py").write_text(textwrap.dedent("""
            from ist_kernels.train.datasets import _pil_samples

            class ImageFolder:
                def __init__(self, root):
                    self.classes, self.samples = _pil_samples(root)
        """))
        monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    root = tmp_path / "data"
    _write_images(root / "train", ["x", "y"], 3)
    _write_images(root / "test", ["y"], 2)
    try:
        ds = datasets.load_dataset(TrainConfig(dataset="imagefolder", data_path=str(root)))
    finally:
        if not real:
            for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
                del sys.modules[k]
    assert ds.num_outputs == 2 and ds.test_y.tolist() == [1, 1] and len(ds.train_y) == 6


def test_imagefolder_trains_a_cnn(tmp_path):
    root = tmp_path / "data"
    _write_images(root / "train", ["a", "b"], 8, size=(8, 8))
    _write_images(root / "test", ["a", "b"], 2, size=(8, 8))
    _, _, hist = run(tmp_path / "o", "--dataset", "imagefolder", "--data-path", root, "--dataset-args", "backend=pil",
                     "--model", "preact_resnet18", "--width", "4", "--simulate", 2, "--augment")
    assert hist[-1]["accuracy"] is not None
