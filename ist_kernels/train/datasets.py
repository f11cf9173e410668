"""Datasets for the trainer (nothing downloads) and the per-worker shards and batches.

- ``digits``: sklearn's bundled 8x8 digits (1797 images, 10 classes), a fixed stratified 80/20 split.
- ``cifar10`` / ``cifar100``: the standard python-pickle folder at ``data_path``
  (``data_batch_1..5`` + ``test_batch``; ``train`` + ``test`` for CIFAR-100), kept as uint8 and
  normalised per batch. The pickles are read by a restricted unpickler that builds only what the
  format holds (dicts, lists, strings, numbers, numpy arrays) and refuses anything else, so a
  crafted file cannot run code; a file with the size of the standard archive's must also have its
  published md5 (other sizes, e.g. subsets, are not checked).
- ``synthetic_cifar10`` / ``synthetic_cifar100``: CIFAR-shaped stand-ins generated in memory
  (``ist_kernels.train.data.synthetic_images``: class-conditional, learnable but not trivial), the
  same images for every run (``dataset_size`` training images, default CIFAR's 50000, and a fifth as
  many test images), kept as uint8 and normalised per batch as CIFAR is: the papers' tables on the
  papers' shapes, offline.
- ``signal_noise``: paper 002's synthetic signal + noise classification (§5.1 settings);
  ``diabetes``: paper 001's regression data; ``ackley``: paper 004 §6.1's synthetic regression
  (all from ``ist_kernels.train.data``).
- ``pycode``: byte-level language modelling (256 classes per position) on the Python standard
  library's own source files (``sysconfig.get_paths()["stdlib"]``, present wherever Python is;
  ``site-packages`` left out). A file is in the test split when the SHA-256 of its path (relative,
  ``/``-separated) is 0 mod 10, so the split is the same on every machine with that Python; the
  files are read in the order of that hash (a spread over the whole library) up to
  ``dataset_size`` training bytes (default 1 MiB) and a fixed :data:`PYCODE_TEST_BYTES` test
  bytes, and cut into sequences of ``context`` bytes (the targets: the same bytes shifted by one).

Each worker s of S sees its own shard: a seed-determined permutation of the training set cut into S
disjoint near-equal parts. Batches are a pure function of (seed, worker, step): the worker's stream
is its shard reshuffled every epoch, cut into full batches. So the simulated and the distributed
runs see the same batches, and resuming needs no data-loader state.
"""
from __future__ import annotations

import codecs
import hashlib
import os
import pickle
import sysconfig
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .data import ackley_data, diabetes_regression, signal_noise, synthetic_images
from .errors import ConfigError


@dataclass
class Dataset:
    name: str
    task: str  # "classification", "regression" or "language_model" (tokens in, a class per position)
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_outputs: int  # classes, or regression targets
    mean: Optional[Tensor] = None  # per-channel normalisation of uint8 images (0..1 scale)
    std: Optional[Tensor] = None
    image: bool = False

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def to(self, device) -> "Dataset":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Dataset(self.name, self.task, move(self.train_x), move(self.train_y), move(self.test_x),
                       move(self.test_y), self.num_outputs, move(self.mean), move(self.std), self.image)

    def prepare(self, x: Tensor) -> Tensor:
        """A batch for the model: uint8 images scaled and normalised to floats, uint8 tokens as int64."""
        if x.dtype == torch.uint8 and self.task == "language_model":
            return x.long()
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
            if self.mean is not None:
                x = (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        return x


# ---------------------------------------------------------------- loaders

def _digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """sklearn's bundled digits (1797 x 8 x 8 in 0..16, labels), read from the file sklearn ships
    without importing sklearn.datasets (a second of start-up in every spawned worker)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") if spec else ""
    if os.path.isfile(path):
        raw = np.loadtxt(path, delimiter=",", dtype=np.float64)
        return raw[:, :-1].reshape(-1, 8, 8), raw[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # pragma: no cover

    d = load_digits()  # pragma: no cover
    return d.images, d.target.astype(np.int64)  # pragma: no cover


def _load_digits(cfg) -> Dataset:
    images, y = _digits_arrays()
    x = images.astype(np.float32) / 16.0
    # A fixed stratified 80/20 split (not cfg.seed): every run is scored on the same test set.
    rng = np.random.RandomState(0)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: int(round(0.2 * len(idx)))]] = True
    xtr, xte, ytr, yte = x[~test], x[test], y[~test], y[test]
    mean, std = xtr.mean(), xtr.std()
    norm = lambda a: torch.from_numpy((a - mean) / std).unsqueeze(1).contiguous()  # noqa: E731
    return Dataset("digits", "classification", norm(xtr), torch.from_numpy(ytr), norm(xte),
                   torch.from_numpy(yte), 10, image=True)


_CIFAR = {
    "cifar10": dict(train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"], label=b"labels",
                    classes=10, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616)),
    "cifar100": dict(train=["train"], test=["test"], label=b"fine_labels", classes=100,
                     mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762)),
}


def _cifar_files(name: str, path: Optional[str]) -> Tuple[List[str], List[str]]:
    spec = _CIFAR[name]
    if not path:
        raise ConfigError("data_path", f"{name} needs data_path: the python-pickle folder "
                          f"(with {', '.join(spec['train'] + spec['test'])}); nothing is downloaded")
    if not os.path.isdir(path):
        raise ConfigError("data_path", f"{path!r} is not a folder ({name} python-pickle folder expected)")
    missing = [f for f in spec["train"] + spec["test"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ConfigError("data_path", f"{path!r} lacks {name} file(s) {', '.join(missing)} "
                          f"(expected the python-pickle folder, e.g. cifar-10-batches-py)")
    j = lambda fs: [os.path.join(path, f) for f in fs]  # noqa: E731
    return j(spec["train"]), j(spec["test"])


# (size in bytes, md5) of the files of the standard archives (cifar-10-python.tar.gz,
# cifar-100-python.tar.gz), as published with them
_CIFAR_STANDARD = {
    "data_batch_1": (31035704, "c99cafc152244af753f735de768cd75f"),
    "data_batch_2": (31035320, "d4bba439e000b95fd0a9bffe97cbabec"),
    "data_batch_3": (31035999, "54ebc095f3ab1f0389bbae665268c751"),
    "data_batch_4": (31035696, "634d18415352ddfa80567beed471001a"),
    "data_batch_5": (31035623, "482c414d41f54cd18b22e5b47cb7c3cb"),
    "test_batch": (31035526, "40351d587109b95175f43aff81a1287e"),
    "train": (155249918, "16019d7e3df5f24257cddd939b257f8d"),
    "test": (31049707, "f0ef6b0ae62326f3e7ffdfab6717acfc"),
}


def _check_standard_md5(path: str) -> None:
    """A file the size of the standard archive's must be that file: its md5 is compared. Other
    sizes (subsets, re-pickled copies) are not checked."""
    size, md5 = _CIFAR_STANDARD.get(os.path.basename(path), (None, None))
    if size is None or os.path.getsize(path) != size:
        return
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != md5:
        raise ConfigError("data_path", f"{path!r} has the size of the standard CIFAR file but md5 {h.hexdigest()}, "
                          f"not the published {md5}: the file is corrupt or was modified")


def _np_global(module: str, name: str):
    core = getattr(np, "_core", None) or np.core  # numpy >= 2 pickles name numpy._core, older numpy.core
    return getattr(getattr(core, module), name)


def _plain_dtype(*args):
    dt = np.dtype(*args)
    if dt.hasobject:
        raise pickle.UnpicklingError("an object array (CIFAR arrays hold numbers)")
    return dt


def _latin1(text, encoding="latin1"):  # how Python 3 pickles bytes with protocols 0-2
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError("_codecs.encode other than of a string to latin-1")
    return codecs.encode(text, encoding)


# the only globals a CIFAR batch refers to: numpy's array reconstruction (numpy 1 and 2 names,
# pickle protocols 2-5) and latin-1 bytes
_CIFAR_GLOBALS = {
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: _plain_dtype,
    ("numpy.core.multiarray", "_reconstruct"): lambda: _np_global("multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): lambda: _np_global("multiarray", "_reconstruct"),
    ("numpy.core.numeric", "_frombuffer"): lambda: _np_global("numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"): lambda: _np_global("numeric", "_frombuffer"),
    ("_codecs", "encode"): lambda: _latin1,
}


class _CifarUnpickler(pickle.Unpickler):
    """Builds dicts, lists, strings, numbers and numpy arrays of numbers; nothing else."""

    def find_class(self, module, name):
        make = _CIFAR_GLOBALS.get((module, name))
        if make is None:
            raise pickle.UnpicklingError(f"refused the global {module}.{name} (a CIFAR batch holds only "
                                         f"dicts, lists, strings, numbers and numpy arrays)")
        return make()

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id (not part of the CIFAR format)")


def read_cifar_pickle(path: str) -> Dict[bytes, object]:
    """One CIFAR python-pickle file as a dict with bytes keys, through the restricted unpickler
    (and the md5 check of a standard-size file); ConfigError naming the file otherwise."""
    _check_standard_md5(path)
    with open(path, "rb") as fh:
        try:
            d = _CifarUnpickler(fh, encoding="bytes").load()
        except Exception as e:
            raise ConfigError("data_path", f"cannot read {path!r} as a CIFAR pickle: "
                              f"{type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError("data_path", f"{path!r} holds a {type(d).__name__}, not the CIFAR dict")
    return {(k.encode() if isinstance(k, str) else k): v for k, v in d.items()}


def _read_cifar(files: List[str], label_key: bytes, num_classes: int) -> Tuple[Tensor, Tensor]:
    xs, ys = [], []
    for f in files:
        d = read_cifar_pickle(f)
        if b"data" not in d or label_key not in d:
            raise ConfigError("data_path", f"{f!r} lacks the keys 'data' and {label_key.decode()!r}")
        data, labels = d[b"data"], d[label_key]
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8) or not (
                isinstance(labels, (list, np.ndarray)) and all(isinstance(v, (int, np.integer)) for v in labels)):
            raise ConfigError("data_path", f"{f!r}: expected 'data' a uint8 numpy array and "
                              f"{label_key.decode()!r} a list of integers")
        labels = np.asarray(labels, dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
            raise ConfigError("data_path", f"{f!r}: expected data of shape (N, 3072) and N labels, "
                              f"got {data.shape} and {len(labels)}")
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise ConfigError("data_path", f"{f!r}: labels outside 0..{num_classes - 1}")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(labels)
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def _load_cifar(name):
    def load(cfg) -> Dataset:
        spec = _CIFAR[name]
        train_files, test_files = _cifar_files(name, cfg.data_path)
        xtr, ytr = _read_cifar(train_files, spec["label"], spec["classes"])
        xte, yte = _read_cifar(test_files, spec["label"], spec["classes"])
        return Dataset(name, "classification", xtr, ytr, xte, yte, spec["classes"],
                       torch.tensor(spec["mean"]), torch.tensor(spec["std"]), image=True)

    return load


def _check_cifar(name):
    return lambda cfg: _cifar_files(name, cfg.data_path)


SYNTHETIC_TRAIN_SIZE = 50000  # CIFAR's; the test set has a fifth as many, as CIFAR's 10000


def _load_synthetic(name: str, classes: int):
    def load(cfg) -> Dataset:
        """The same images for every run (seed 0, like a data set on disk): cfg.seed draws the
        model, the shards and the plans, not the data."""
        n = cfg.dataset_size or SYNTHETIC_TRAIN_SIZE
        xtr, ytr = synthetic_images(n, classes, seed=0, stream=0)
        xte, yte = synthetic_images(max(1, n // 5), classes, seed=0, stream=1)
        probe = xtr[:5000].double().div_(255.0)  # per-channel statistics, as CIFAR's constants are
        mean, std = probe.mean((0, 2, 3)), probe.std((0, 2, 3))
        return Dataset(name, "classification", xtr, ytr, xte, yte, classes, mean.float(), std.float(), image=True)

    return load


def _load_signal_noise(cfg) -> Dataset:
    """Paper 002 §5.1: x = [y e_1, xi] in R^{2 x 400}, y = +-1 (labels 0/1 here), xi ~ N(0, 0.5^2 I),
    100 training and 100 test samples, drawn from cfg.seed (the paper repeats runs over seeds)."""
    g = torch.Generator().manual_seed(_mix(cfg.seed, 0x5167))
    x, y = signal_noise(200, 400, 0.5, signed=True, swap_patches=False, generator=g)
    return Dataset("signal_noise", "classification", x[:100], y[:100], x[100:], y[100:], 2, image=False)


def _load_diabetes(cfg) -> Dataset:
    """sklearn's bundled diabetes regression (442 x 10) as paper 001 prepares it (each input scaled
    to norm 1, targets standardised), a fixed 80/20 split; the test loss is the MSE."""
    x, y = diabetes_regression(442, generator=torch.Generator().manual_seed(0))
    return Dataset("diabetes", "regression", x[:354], y[:354], x[354:], y[354:], 1, image=False)


def _load_ackley(cfg) -> Dataset:
    """Paper 004 §6.1's Ackley regression: x in R^200 with ‖x‖ = 1, scalar y; 100 training and 100
    test samples drawn from cfg.seed (``ist_kernels.train.data.ackley_data``); the test loss is the MSE."""
    x, y = ackley_data(200, 200, torch.Generator().manual_seed(_mix(cfg.seed, 0xAC1E)))
    x, y = x.float(), y.float()
    return Dataset("ackley", "regression", x[:100], y[:100], x[100:], y[100:], 1, image=False)


PYCODE_TRAIN_BYTES = 1 << 20  # pycode's default dataset_size
PYCODE_TEST_BYTES = 1 << 13  # the fixed test subset: 8 KiB of the test files
PYCODE_TEST_EVERY = 10  # a file is in the test split when its path's hash is 0 mod this


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.replace(os.sep, "/").encode()).digest()[:8], "big")


def pycode_files(root: Optional[str] = None) -> Tuple[List[str], List[str]]:
    """(train, test) paths of the standard library's ``.py`` files under ``root`` (default
    ``sysconfig.get_paths()["stdlib"]``), each list in the order of the hash of the relative path;
    a file is a test file when that hash is 0 mod :data:`PYCODE_TEST_EVERY`."""
    root = root or sysconfig.get_paths()["stdlib"]
    rels = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        rels += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    rels.sort(key=lambda r: (_path_hash(r), r))
    test = [r for r in rels if _path_hash(r) % PYCODE_TEST_EVERY == 0]
    train = [r for r in rels if _path_hash(r) % PYCODE_TEST_EVERY != 0]
    return [os.path.join(root, r) for r in train], [os.path.join(root, r) for r in test]


def read_bytes(paths: List[str], limit: int) -> Tensor:
    """The files' bytes, concatenated in order, up to ``limit`` bytes (uint8)."""
    parts, n = [], 0
    for path in paths:
        if n >= limit:
            break
        with open(path, "rb") as f:
            data = f.read(limit - n)
        parts.append(data)
        n += len(data)
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def byte_sequences(data: Tensor, context: int) -> Tuple[Tensor, Tensor]:
    """Non-overlapping sequences of ``context`` bytes (uint8 ``[n, context]``) and their targets,
    the next byte at every position (int64)."""
    n = max(0, (data.numel() - 1) // context)
    return data[:n * context].view(n, context).clone(), data[1:n * context + 1].view(n, context).long()


def _load_pycode(cfg) -> Dataset:
    train_files, test_files = pycode_files()
    if not train_files or not test_files:
        raise ConfigError("dataset", f"pycode: found no Python sources in {sysconfig.get_paths()['stdlib']!r}")
    size = cfg.dataset_size or PYCODE_TRAIN_BYTES
    xtr, ytr = byte_sequences(read_bytes(train_files, size), cfg.context)
    xte, yte = byte_sequences(read_bytes(test_files, max(PYCODE_TEST_BYTES, cfg.context + 1)), cfg.context)
    if len(xtr) == 0:
        raise ConfigError("dataset_size", f"pycode: {size} bytes make no sequence of context {cfg.context} "
                          f"(need at least {cfg.context + 1})")
    return Dataset("pycode", "language_model", xtr, ytr, xte, yte, 256, image=False)


@dataclass(frozen=True)
class DatasetSpec:
    loader: Callable  # cfg -> Dataset
    check: Optional[Callable] = None  # cfg -> None, raising ConfigError before any work starts
    augment: bool = False  # random crop + flip by default
    image: bool = True  # inputs are (C, H, W) images (CNN models need that)
    sized: bool = False  # cfg.dataset_size picks the number of training samples (pycode: bytes)
    tokens: bool = False  # inputs are token sequences (language models need that)


DATASETS: Dict[str, DatasetSpec] = {
    "digits": DatasetSpec(_load_digits),
    "cifar10": DatasetSpec(_load_cifar("cifar10"), _check_cifar("cifar10"), augment=True),
    "cifar100": DatasetSpec(_load_cifar("cifar100"), _check_cifar("cifar100"), augment=True),
    "synthetic_cifar10": DatasetSpec(_load_synthetic("synthetic_cifar10", 10), augment=True, sized=True),
    "synthetic_cifar100": DatasetSpec(_load_synthetic("synthetic_cifar100", 100), augment=True, sized=True),
    "signal_noise": DatasetSpec(_load_signal_noise, image=False),
    "diabetes": DatasetSpec(_load_diabetes, image=False),
    "ackley": DatasetSpec(_load_ackley, image=False),
    "pycode": DatasetSpec(_load_pycode, image=False, sized=True, tokens=True),
}


def register_dataset(name: str, spec: DatasetSpec) -> None:
    DATASETS[name] = spec


def available_datasets() -> List[str]:
    return sorted(DATASETS)


def check_dataset(cfg) -> None:
    if cfg.dataset not in DATASETS:
        raise ConfigError("dataset", f"unknown dataset {cfg.dataset!r}; available: {', '.join(available_datasets())}")
    spec = DATASETS[cfg.dataset]
    if cfg.dataset_size is not None and not spec.sized:
        sized = ", ".join(n for n, d in sorted(DATASETS.items()) if d.sized)
        raise ConfigError("dataset_size", f"dataset {cfg.dataset!r} has a fixed size; only {sized} "
                          f"take dataset_size")
    if spec.check is not None:
        spec.check(cfg)


def load_dataset(cfg) -> Dataset:
    check_dataset(cfg)
    return DATASETS[cfg.dataset].loader(cfg)


def augment_default(cfg) -> bool:
    return DATASETS[cfg.dataset].augment if cfg.augment is None else cfg.augment


# ---------------------------------------------------------------- shards and batches

def _mix(*xs: int) -> int:
    """A 63-bit seed from integers (splitmix64-style), identical on every rank and platform."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def shard_indices(n: int, num_workers: int, seed: int) -> List[Tensor]:
    """S disjoint shards covering range(n): a seeded permutation cut into near-equal parts."""
    if num_workers > n:
        raise ConfigError("workers", f"{num_workers} workers but only {n} training samples")
    g = torch.Generator().manual_seed(_mix(seed, 0x5A4D))
    perm = torch.randperm(n, generator=g)
    return [c.clone() for c in torch.tensor_split(perm, num_workers)]


@dataclass
class WorkerBatches:
    """The batch stream of one worker: its shard, reshuffled each epoch, cut into full batches."""

    shard: Tensor
    batch_size: int
    seed: int
    worker: int
    _cache: Dict[int, Tensor] = field(default_factory=dict)

    def _epoch(self, e: int) -> Tensor:
        if e not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            g = torch.Generator().manual_seed(_mix(self.seed, self.worker, e, 0xB47C))
            self._cache[e] = self.shard[torch.randperm(len(self.shard), generator=g)]
        return self._cache[e]

    def indices(self, step: int) -> Tensor:
        """Sample indices of global step ``step`` (0-based) of this worker."""
        n = len(self.shard)
        start = step * self.batch_size
        parts, need = [], self.batch_size
        while need:
            e, off = divmod(start, n)
            take = min(need, n - off)
            parts.append(self._epoch(e)[off:off + take])
            start += take
            need -= take
        return torch.cat(parts)


class ShardedData:
    """The dataset on the run's device, the S shards, and batches as a function of (worker, step)."""

    def __init__(self, dataset: Dataset, num_workers: int, batch_size: int, seed: int, device,
                 augment: bool = False):
        self.dataset = dataset.to(device)
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.seed = seed
        self.augment = augment and dataset.image
        self.shards = shard_indices(len(dataset.train_y), num_workers, seed)
        self.streams = [WorkerBatches(s, batch_size, seed, w) for w, s in enumerate(self.shards)]

    @property
    def shard_size(self) -> int:
        return min(len(s) for s in self.shards)

    def batch(self, worker: int, step: int) -> Tuple[Tensor, Tensor]:
        idx = self.streams[worker].indices(step).to(self.device)
        x = self.dataset.prepare(self.dataset.train_x[idx])
        if self.augment:
            x = _augment(x, _mix(self.seed, worker, step, 0xA06))
        return x, self.dataset.train_y[idx]

    def test_batches(self, batch_size: int):
        d = self.dataset
        for i in range(0, len(d.test_y), batch_size):
            yield d.prepare(d.test_x[i:i + batch_size]), d.test_y[i:i + batch_size]


def _augment(x: Tensor, seed: int) -> Tensor:
    """Random crop (zero padding H/8) and horizontal flip, drawn on the CPU from ``seed``."""
    n, _, h, w = x.shape
    pad = max(1, h // 8)
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(n, generator=g) < 0.5
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    xp = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    rows = (dy.view(n, 1) + torch.arange(h)).to(x.device)  # n x h
    cols = (dx.view(n, 1) + torch.arange(w)).to(x.device)  # n x w
    out = xp[torch.arange(n, device=x.device).view(n, 1, 1, 1), torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1),
             rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]
    return torch.where(flip.to(x.device).view(n, 1, 1, 1), out.flip(3), out)
