"""Datasets for the trainer (nothing downloads) and the per-worker shards and batches.

- ``digits``: sklearn's bundled 8x8 digits (1797 images, 10 classes), a fixed stratified 80/20 split.
- ``cifar10`` / ``cifar100``: the standard python-pickle folder at ``data_path``
  (``data_batch_1..5`` + ``test_batch``; ``train`` + ``test`` for CIFAR-100), kept as uint8 and
  normalised per batch. The pickles are read by a restricted unpickler that builds only what the
  format holds (dicts, lists, strings, numbers, numpy arrays) and refuses anything else, so a
  crafted file cannot run code; a file with the size of the standard archive's must also have its
  published md5 (other sizes, e.g. subsets, are not checked).
- ``synthetic_cifar10`` / ``synthetic_cifar100``: CIFAR-shaped stand-ins generated in memory
  (``ist_kernels.train.paper_data.synthetic_images``: class-conditional, learnable but not trivial), the
  same images for every run (``dataset_size`` training images, default CIFAR's 50000, and a fifth as
  many test images), kept as uint8 and normalised per batch as CIFAR is: the papers' tables on the
  papers' shapes, offline.
- ``signal_noise``: paper 002's synthetic signal + noise classification (§5.1 settings);
  ``diabetes``: paper 001's regression data; ``ackley``: paper 004 §6.1's synthetic regression
  (all from ``ist_kernels.train.paper_data``).
- ``pycode``: byte-level language modelling (256 classes per position) on the Python standard
  library's own source files (``sysconfig.get_paths()["stdlib"]``, present wherever Python is;
  ``site-packages`` left out). A file is in the test split when the SHA-256 of its path (relative,
  ``/``-separated) is 0 mod 10, so the split is the same on every machine with that Python; the
  files are read in the order of that hash (a spread over the whole library) up to
  ``dataset_size`` training bytes (default 1 MiB) and a fixed :data:`PYCODE_TEST_BYTES` test
  bytes, and cut into sequences of ``context`` bytes (the targets: the same bytes shifted by one).
- ``tokens``: a flat file of token ids at ``data_path`` (nanoGPT's ``.bin``: ``--dataset-args
  dtype=uint16``, the default, or ``uint8`` / ``uint32``), language modelling. The file's last
  ``test_fraction`` (default 0.1) of ids is the test split (nanoGPT's 90/10); a folder with
  ``train.bin`` and ``val.bin`` (or ``test.bin``) gives both splits. ``vocab_size``: from
  ``--dataset-args vocab_size=N``, else a ``meta.pkl`` beside the file (nanoGPT's; read without
  loading any global), else 256 for uint8, else the largest id + 1. ``dataset_size`` caps the training
  ids, ``test_tokens`` the test ids. Cut into sequences of ``context`` ids as pycode is; the test
  metric is ``bits_per_byte`` for uint8 ids of vocabulary 256, else ``bits_per_token``.
- ``imagefolder``: the ``data_path`` folder as torchvision's ``ImageFolder`` reads it
  (``DIR/train/<class>/*`` and ``DIR/test/<class>/*`` or ``DIR/val/<class>/*``; or ``DIR/<class>/*``,
  whose images go to the test split when the SHA-256 of their relative path is 0 mod 10). torchvision
  is imported only for this (a ConfigError says so where it cannot be); ``--dataset-args backend=pil``
  lists the same files without torchvision. Images are read with PIL as RGB (ImageFolder's loader),
  resized to ``image_size`` x ``image_size`` when that is given (else they must share one size),
  kept as uint8 and normalised per batch with the training set's per-channel mean and std. Not
  augmented by default (``--augment`` turns the crop + flip on).
- ``MODULE:FACTORY`` / ``path/to/file.py:FACTORY``: a user's factory, called with ``dataset_args``
  as keyword arguments under ``torch.manual_seed(seed)``, returning ``(train, test)``
  ``torch.utils.data.Dataset``s of (input, target) items. They are *materialised* (every item read
  once into one tensor per split: :func:`dataset_from_torch` says how the task is inferred), so
  shards, batches and resumption work as for every other data set; this is meant for data that fits
  in memory. Every process calls the factory itself: it must return the same data every time.

``--holdout F`` (0 < F < 1) carves a validation split out of the training set
(:func:`hold_out`): round(F x n) of its n samples (at least one), a seeded random subset for
classification and regression data (seed: the run's ``seed``), the last ones for a language model
(contiguous text, so no held-out sequence sits between two trained ones); the shards are cut from
the rest, and every evaluation scores the held-out samples instead of the test split
(``scored_on``: ``"holdout"``; the test split is not read). Settings tuned on it never see the test
split.

Each worker s of S sees its own shard: a seed-determined permutation of the training set cut into S
disjoint near-equal parts. Batches are a pure function of (seed, worker, step): the worker's stream
is its shard reshuffled every epoch, cut into full batches. So the simulated and the distributed
runs see the same batches, and resuming needs no data-loader state.
"""
from __future__ import annotations

import codecs
import hashlib
import importlib
import importlib.util
import math
import os
import pickle
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .errors import ConfigError
from .paper_data import ackley_data, diabetes_regression, signal_noise, synthetic_images


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
    # language models: what one position is, for the test metric ``bits_per_<token_unit>`` (pycode
    # and raw-byte token files: "byte"; BPE ids and the like: "token")
    token_unit: str = "byte"
    # --holdout: the validation split carved from the training set (:func:`hold_out`), scored in place
    # of the test split; ``train_index`` / ``holdout_index``: where the training and held-out samples
    # were in the training set as loaded (None: no holdout)
    holdout_x: Optional[Tensor] = None
    holdout_y: Optional[Tensor] = None
    train_index: Optional[Tensor] = None
    holdout_index: Optional[Tensor] = None

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def scored_on(self) -> str:
        """The split evaluations score: ``"holdout"`` (--holdout) or ``"test"``."""
        return "test" if self.holdout_y is None else "holdout"

    def eval_split(self) -> Tuple[Tensor, Tensor]:
        """(inputs, targets) of the split evaluations score (:attr:`scored_on`)."""
        return (self.test_x, self.test_y) if self.holdout_y is None else (self.holdout_x, self.holdout_y)

    def to(self, device) -> "Dataset":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Dataset(self.name, self.task, move(self.train_x), move(self.train_y), move(self.test_x),
                       move(self.test_y), self.num_outputs, move(self.mean), move(self.std), self.image,
                       self.token_unit, move(self.holdout_x), move(self.holdout_y), self.train_index,
                       self.holdout_index)

    def prepare(self, x: Tensor) -> Tensor:
        """A batch for the model: uint8 images scaled and normalised to floats, token ids (uint8,
        int32 for wider ids) as int64."""
        if self.task == "language_model" and x.dtype != torch.long and not x.is_floating_point():
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
    test samples drawn from cfg.seed (``ist_kernels.train.paper_data.ackley_data``); the test loss is the MSE."""
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


# ---------------------------------------------------------------- factories the user brings

def is_external(name) -> bool:
    """``MODULE:FACTORY`` or ``path/to/file.py:FACTORY`` (a user's model or data set factory), not a
    registered name."""
    return isinstance(name, str) and ":" in name


def ensure_cwd_importable() -> None:
    """The working directory on sys.path (as ``python -m`` puts it; the ``ist-train`` script does
    not), appended so that it never shadows an installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _file_module(path: str, option: str):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ConfigError(option, f"{path!r} is not a file (expected path/to/file.py:FACTORY)")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
    name = f"_ist_user_{stem}_{hashlib.sha256(path.encode()).hexdigest()[:10]}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(option, f"cannot import {path!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (classes defined there pickle by this name)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ConfigError(option, f"importing {path!r} failed: {type(e).__name__}: {e}") from e
    return module


#: factories handed over as Python objects (``ist_kernels.train.Engine(model=callable)``), by the
#: ``MODULE:QUALNAME`` label they run under: a lambda or a closure cannot be imported by name
_FACTORIES: Dict[str, Callable] = {}


def register_factory(label: str, fn: Callable) -> str:
    """Make ``fn`` what ``label`` (``MODULE:FACTORY``) names in this process; returns the label."""
    if not is_external(label):
        raise ValueError(f"register_factory: expected a MODULE:FACTORY label, got {label!r}")
    _FACTORIES[label] = fn
    return label


def import_factory(spec: str, option: str) -> Callable:
    """The callable ``spec`` names: one registered under that label (:func:`register_factory`), or
    ``MODULE:FACTORY`` (MODULE importable from the working directory or PYTHONPATH; FACTORY may be
    dotted, e.g. ``Class.create``) or ``path/to/file.py:FACTORY``. ConfigError naming ``option``
    when it cannot be imported or found."""
    if spec in _FACTORIES:
        return _FACTORIES[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(option, f"expected MODULE:FACTORY or path/to/file.py:FACTORY, got {spec!r}")
    ensure_cwd_importable()
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _file_module(target, option)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                raise ConfigError(option, f"cannot import module {target!r}: no module {e.name!r} in the working "
                                  f"directory ({os.getcwd()}), PYTHONPATH or the installed packages") from None
            raise ConfigError(option, f"importing module {target!r} failed: {e}") from e
        except Exception as e:  # the user's module raised while importing
            raise ConfigError(option, f"importing module {target!r} failed: {type(e).__name__}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(option, f"{target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(option, f"{spec!r} is a {type(obj).__name__}, not a callable factory")
    return obj


def describe_call(spec: str, kwargs) -> str:
    return f"{spec}({', '.join(f'{k}={v!r}' for k, v in dict(kwargs).items())})"


def _as_tensor(v, what: str) -> Tensor:
    if isinstance(v, Tensor):
        return v.detach().cpu()
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, (bool, int, float, np.generic)):
        return torch.tensor(v.item() if isinstance(v, np.generic) else v)
    if type(v).__module__.startswith("PIL."):  # a PIL image: uint8 [C, H, W], as torchvision's pil_to_tensor
        a = np.array(v)  # a writable copy
        return torch.from_numpy(a[:, :, None] if a.ndim == 2 else a).permute(2, 0, 1).contiguous()
    raise ConfigError("dataset", f"{what} is a {type(v).__name__}; expected a tensor, numpy array, number or PIL image")


def _materialise(ds, split: str) -> Tuple[Tensor, Tensor]:
    items = iter(ds) if isinstance(ds, torch.utils.data.IterableDataset) else (ds[i] for i in range(len(ds)))
    xs, ys = [], []
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError("dataset", f"item {i} of the {split} set is a {type(item).__name__}"
                              f"{f' of length {len(item)}' if isinstance(item, (tuple, list)) else ''}; expected "
                              f"(input, target) pairs")
        x, y = (_as_tensor(v, f"{'input' if j == 0 else 'target'} of item {i} of the {split} set")
                for j, v in enumerate(item))
        if xs and (x.shape != xs[0].shape or x.dtype != xs[0].dtype or y.shape != ys[0].shape):
            raise ConfigError("dataset", f"item {i} of the {split} set has input {tuple(x.shape)} {x.dtype} and "
                              f"target {tuple(y.shape)}, item 0 {tuple(xs[0].shape)} {xs[0].dtype} and "
                              f"{tuple(ys[0].shape)}: every item must have the same shapes (resize in the factory)")
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ConfigError("dataset", f"the {split} set is empty")
    return torch.stack(xs), torch.stack(ys)


def dataset_from_torch(name: str, train, test) -> Dataset:
    """A user's (train, test) ``torch.utils.data.Dataset`` pair as a :class:`Dataset`, materialised:
    every item read once into one tensor per split (so shards and batches work as for the built-in
    data sets; meant for data sets that fit in memory). Items are (input, target) pairs of tensors,
    numpy arrays, numbers or PIL images (uint8 [C, H, W]; uint8 inputs are scaled to 0..1 per batch).
    The task follows the targets: integer scalars are classification (classes: ``len(train.classes)``
    when the data set has ``classes``, else the largest label + 1); integer sequences as long as
    integer inputs are language modelling (next-token targets; vocabulary: ``train.vocab_size`` when
    set, else the largest id + 1); floating-point targets are regression. Inputs of shape [C, H, W]
    count as images (--augment applies)."""
    xtr, ytr = _materialise(train, "train")
    xte, yte = _materialise(test, "test")
    if xtr.shape[1:] != xte.shape[1:] or ytr.shape[1:] != yte.shape[1:]:
        raise ConfigError("dataset", f"train items have input {tuple(xtr.shape[1:])} and target "
                          f"{tuple(ytr.shape[1:])}, test items {tuple(xte.shape[1:])} and {tuple(yte.shape[1:])}: "
                          f"they must agree")
    if xtr.is_floating_point():  # float64 (numpy's default) inputs meet float32 weights
        xtr, xte = xtr.float(), xte.float()
    integer = lambda t: not t.is_floating_point() and not t.is_complex()  # noqa: E731
    if ytr.is_floating_point():
        return Dataset(name, "regression", xtr, ytr.float(), xte, yte.float(), max(1, math.prod(ytr.shape[1:])),
                       image=False)
    if not integer(ytr):
        raise ConfigError("dataset", f"targets of dtype {ytr.dtype}: expected integer labels, token ids or floats")
    ytr, yte = ytr.long(), yte.long()
    if ytr.dim() == 1:
        classes = getattr(train, "classes", None)
        n = len(classes) if classes is not None else int(max(ytr.max(), yte.max())) + 1
        low = int(min(ytr.min(), yte.min()))
        high = int(max(ytr.max(), yte.max()))
        if low < 0 or high >= n:
            raise ConfigError("dataset", f"labels span {low}..{high}, outside 0..{n - 1} (the data set's classes)")
        image = xtr.dim() == 4
        return Dataset(name, "classification", xtr, ytr, xte, yte, n, image=image)
    if ytr.dim() == 2 and xtr.shape == ytr.shape and integer(xtr):
        top = int(max(xtr.max(), ytr.max(), xte.max(), yte.max()))
        vocab = getattr(train, "vocab_size", None) or top + 1
        if int(min(xtr.min(), ytr.min(), xte.min(), yte.min())) < 0 or top >= vocab:
            raise ConfigError("dataset", f"token ids outside 0..{vocab - 1} (the data set's vocab_size)")
        wide = torch.int32 if vocab < 2 ** 31 else torch.long
        narrow = lambda t: t if t.dtype == torch.uint8 else t.to(wide)  # noqa: E731
        return Dataset(name, "language_model", narrow(xtr), ytr, narrow(xte), yte, int(vocab), image=False,
                       token_unit=getattr(train, "token_unit", "token"))
    raise ConfigError("dataset", f"targets of shape {tuple(ytr.shape[1:])} per item with inputs of shape "
                      f"{tuple(xtr.shape[1:])}: expected a class label (scalar), next-token ids (the input's "
                      f"shape, for integer token inputs) or float regression targets")


def _load_external(cfg) -> Dataset:
    fn = import_factory(cfg.dataset, "dataset")
    kwargs = dict(cfg.dataset_args or {})
    call = describe_call(cfg.dataset, kwargs)
    try:
        with torch.random.fork_rng(devices=[]):  # a factory that draws, draws the same on every rank
            torch.manual_seed(cfg.seed)
            out = fn(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("dataset", f"{call} raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(d, torch.utils.data.Dataset) for d in out)):
        got = (f"a {type(out).__name__} of {', '.join(type(d).__name__ for d in out)}"
               if isinstance(out, (tuple, list)) else f"a {type(out).__name__}")
        raise ConfigError("dataset", f"{call} must return (train, test): two torch.utils.data.Dataset, got {got}")
    return dataset_from_torch(cfg.dataset, out[0], out[1])


def _check_args(cfg, allowed: Tuple[str, ...]) -> None:
    for key in dict(getattr(cfg, "dataset_args", None) or {}):
        if key not in allowed:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no dataset_args"
            raise ConfigError(f"dataset_args.{key}", f"unknown for dataset {cfg.dataset!r} ({takes})")


# ---------------------------------------------------------------- tokens: a flat file of token ids

TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
TOKENS_ARGS = ("dtype", "vocab_size", "test_fraction", "test_tokens")


class _MetaUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl holds dicts, strings and numbers only: no global is ever loaded."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused the global {module}.{name} (meta.pkl holds dicts, strings, numbers)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused a persistent id")


def _token_paths(cfg) -> Tuple[str, Optional[str], str]:
    """(train file, test file or None (split the train file), folder of meta.pkl)."""
    path = cfg.data_path
    if not path:
        raise ConfigError("data_path", "dataset 'tokens' needs --data-path: a flat file of token ids (nanoGPT's "
                          ".bin) or a folder with train.bin and val.bin (or test.bin)")
    if os.path.isdir(path):
        train = os.path.join(path, "train.bin")
        test = next((os.path.join(path, f) for f in ("test.bin", "val.bin") if os.path.isfile(os.path.join(path, f))),
                    None)
        if not os.path.isfile(train) or test is None:
            raise ConfigError("data_path", f"folder {path!r} lacks train.bin and val.bin (or test.bin); give those, "
                              f"or the path of one token file (its last test_fraction is the test split)")
        return train, test, path
    if not os.path.isfile(path):
        raise ConfigError("data_path", f"{path!r} does not exist (a flat file of token ids expected)")
    return path, None, os.path.dirname(os.path.abspath(path))


def _token_settings(cfg):
    """(numpy dtype, vocab_size or None, test_fraction, test_tokens or None, paths), checked."""
    _check_args(cfg, TOKENS_ARGS)
    args = dict(getattr(cfg, "dataset_args", None) or {})
    train, test, folder = _token_paths(cfg)
    meta = {}
    meta_path = os.path.join(folder, "meta.pkl")
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, "rb") as f:
                meta = _MetaUnpickler(f).load()
        except Exception as e:
            raise ConfigError("data_path", f"cannot read {meta_path!r} (nanoGPT's meta.pkl: a dict with "
                              f"vocab_size): {e}") from None
        if not isinstance(meta, dict):
            raise ConfigError("data_path", f"{meta_path!r} holds a {type(meta).__name__}, not a dict")
    name = args.get("dtype", meta.get("dtype", "uint16"))
    if name not in TOKEN_DTYPES:
        raise ConfigError("dataset_args.dtype", f"must be one of {', '.join(TOKEN_DTYPES)}, got {name!r}")
    dtype = np.dtype(TOKEN_DTYPES[name])
    vocab = args.get("vocab_size", meta.get("vocab_size"))
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
        raise ConfigError("dataset_args.vocab_size", f"must be an integer >= 2, got {vocab!r}")
    if vocab is not None and vocab > np.iinfo(dtype).max + 1:
        raise ConfigError("dataset_args.vocab_size", f"{vocab} ids do not fit {name}")
    frac = args.get("test_fraction", 0.1)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac < 1:
        raise ConfigError("dataset_args.test_fraction", f"must be a number in (0, 1), got {frac!r}")
    if test is not None and "test_fraction" in args:
        raise ConfigError("dataset_args.test_fraction", f"{cfg.data_path!r} has its own test file {test!r}")
    cap = args.get("test_tokens")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError("dataset_args.test_tokens", f"must be an integer >= 1, got {cap!r}")
    for p in (train, test):
        if p is not None and os.path.getsize(p) % dtype.itemsize:
            raise ConfigError("dataset_args.dtype", f"{p!r} has {os.path.getsize(p)} bytes, not a whole number of "
                              f"{name} ids (nanoGPT's .bin is uint16, the default; raw bytes: dtype=uint8)")
    return dtype, vocab, float(frac), cap, train, test


def _check_tokens(cfg) -> None:
    _token_settings(cfg)


def _load_tokens(cfg) -> Dataset:
    """``--dataset tokens``: see the module docstring."""
    dtype, vocab, frac, cap, train_path, test_path = _token_settings(cfg)
    data = np.memmap(train_path, dtype=dtype, mode="r") if os.path.getsize(train_path) else np.zeros(0, dtype)
    if test_path is None:
        cut = int(len(data) * (1 - frac))
        train, test = data[:cut], data[cut:]
    else:
        train = data
        test = np.memmap(test_path, dtype=dtype, mode="r") if os.path.getsize(test_path) else np.zeros(0, dtype)
    if cfg.dataset_size is not None:
        train = train[:cfg.dataset_size]
    if cap is not None:
        test = test[:cap]
    wide = np.uint8 if dtype == np.uint8 else np.int32 if dtype == np.uint16 else np.int64
    as_t = lambda a: torch.from_numpy(np.array(a, dtype=wide))  # noqa: E731  (a copy: the file is closed after)
    ttr, tte = as_t(train), as_t(test)
    c = cfg.context
    for what, t in (("training", ttr), ("test", tte)):
        if t.numel() < c + 1:
            raise ConfigError("dataset_size" if what == "training" and cfg.dataset_size else "data_path",
                              f"tokens: the {what} split has {t.numel()} ids, too few for one sequence of context "
                              f"{c} (need {c + 1})")
    top = int(max(ttr.max(), tte.max()))
    if vocab is None:
        vocab = 256 if dtype == np.uint8 else top + 1
    elif top >= vocab:
        raise ConfigError("dataset_args.vocab_size", f"the file holds id {top}, outside 0..{vocab - 1}")
    xtr, ytr = byte_sequences(ttr, c)
    xte, yte = byte_sequences(tte, c)
    unit = "byte" if dtype == np.uint8 and vocab == 256 else "token"
    return Dataset("tokens", "language_model", xtr, ytr, xte, yte, int(vocab), image=False, token_unit=unit)


# ---------------------------------------------------------------- imagefolder

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
IMAGEFOLDER_ARGS = ("image_size", "backend")
IMAGEFOLDER_TEST_EVERY = 10  # no train/test folders: an image is a test image when its path's hash is 0 mod this


def _imagefolder_layout(cfg):
    """(backend, image_size or None, train folder, test folder or None (hash split))."""
    _check_args(cfg, IMAGEFOLDER_ARGS)
    args = dict(getattr(cfg, "dataset_args", None) or {})
    backend = args.get("backend", "torchvision")
    if backend not in ("torchvision", "pil"):
        raise ConfigError("dataset_args.backend", f"must be torchvision or pil, got {backend!r}")
    size = args.get("image_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError("dataset_args.image_size", f"must be an integer >= 1 (pixels of a side), got {size!r}")
    path = cfg.data_path
    if not path:
        raise ConfigError("data_path", "dataset 'imagefolder' needs --data-path: a folder DIR/train/<class>/*, "
                          "DIR/test/<class>/* (or DIR/val), or DIR/<class>/* (split by a hash of the path)")
    if not os.path.isdir(path):
        raise ConfigError("data_path", f"{path!r} is not a folder (imagefolder: DIR/train/<class>/* ... expected)")
    if backend == "torchvision":
        try:
            import torchvision.datasets  # noqa: F401
        except Exception as e:
            raise ConfigError("dataset", f"imagefolder reads through torchvision's ImageFolder, and torchvision cannot "
                              f"be imported here ({type(e).__name__}: {e}); install the torchvision built for torch "
                              f"{torch.__version__}, or pass --dataset-args backend=pil (a PIL-only reader of the "
                              f"same layout)") from None
    train = os.path.join(path, "train")
    test = next((os.path.join(path, d) for d in ("test", "val") if os.path.isdir(os.path.join(path, d))), None)
    if os.path.isdir(train) and test is not None:
        return backend, size, train, test
    return backend, size, path, None


def _pil_samples(root: str, option: str = "data_path") -> Tuple[List[str], List[Tuple[str, int]]]:
    """torchvision's ImageFolder listing, without torchvision: sorted class folders, their images
    (by extension, case-insensitive, walking sub-folders, following links) in sorted order."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for i, c in enumerate(classes):
        for folder, _, files in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            samples += [(os.path.join(folder, f), i) for f in sorted(files) if f.lower().endswith(IMG_EXTENSIONS)]
    if not samples:
        raise ConfigError(option, f"found no images ({', '.join(IMG_EXTENSIONS)}) in class folders of {root!r}")
    return classes, samples


def _tv_samples(root: str) -> Tuple[List[str], List[Tuple[str, int]]]:
    from torchvision.datasets import ImageFolder

    try:
        ds = ImageFolder(root)
    except (FileNotFoundError, RuntimeError) as e:
        raise ConfigError("data_path", f"torchvision's ImageFolder({root!r}): {e}") from None
    return list(ds.classes), [(p, int(c)) for p, c in ds.samples]


def _read_image(path: str, size: Optional[int]) -> Tensor:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")  # as ImageFolder's default loader
            if size is not None and im.size != (size, size):
                im = im.resize((size, size), Image.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
    except Exception as e:
        raise ConfigError("data_path", f"cannot read image {path!r}: {e}") from None
    return torch.from_numpy(a.copy()).permute(2, 0, 1).contiguous()


def _stack_images(samples, size, split) -> Tuple[Tensor, Tensor]:
    imgs = [_read_image(p, size) for p, _ in samples]
    shapes = sorted({tuple(t.shape[1:]) for t in imgs})
    if len(shapes) > 1:
        raise ConfigError("dataset_args.image_size", f"the {split} images have {len(shapes)} sizes ({shapes[0]}, "
                          f"{shapes[-1]}, ...): pass --dataset-args image_size=N to resize them to N x N")
    return torch.stack(imgs), torch.tensor([c for _, c in samples], dtype=torch.long)


def _check_imagefolder(cfg) -> None:
    _imagefolder_layout(cfg)


def _load_imagefolder(cfg) -> Dataset:
    """``--dataset imagefolder``: see the module docstring."""
    backend, size, train_root, test_root = _imagefolder_layout(cfg)
    listing = _tv_samples if backend == "torchvision" else _pil_samples
    classes, train = listing(train_root)
    if test_root is None:
        rel = lambda p: os.path.relpath(p, train_root)  # noqa: E731
        test = [s for s in train if _path_hash(rel(s[0])) % IMAGEFOLDER_TEST_EVERY == 0]
        train = [s for s in train if _path_hash(rel(s[0])) % IMAGEFOLDER_TEST_EVERY != 0]
        if not train or not test:
            raise ConfigError("data_path", f"{train_root!r}: {len(train) + len(test)} images make no train/test split "
                              f"(a tenth, by path hash, is the test split); add images or give train/ and test/")
    else:
        test_classes, test = listing(test_root)
        index = {c: i for i, c in enumerate(classes)}
        unknown = [c for c in test_classes if c not in index]
        if unknown:
            raise ConfigError("data_path", f"{test_root!r} has classes {', '.join(unknown[:5])} that "
                              f"{train_root!r} lacks")
        test = [(p, index[test_classes[c]]) for p, c in test]
    xtr, ytr = _stack_images(train, size, "train")
    xte, yte = _stack_images(test, size, "test")
    if xtr.shape[1:] != xte.shape[1:]:
        raise ConfigError("dataset_args.image_size", f"train images are {tuple(xtr.shape[2:])}, test images "
                          f"{tuple(xte.shape[2:])}: pass --dataset-args image_size=N")
    f = xtr.double().div_(255.0)
    mean, std = f.mean(dim=(0, 2, 3)), f.std(dim=(0, 2, 3)).clamp_min(1e-6)
    return Dataset("imagefolder", "classification", xtr, ytr, xte, yte, len(classes), mean.float(), std.float(),
                   image=True)


@dataclass(frozen=True)
class DatasetSpec:
    loader: Callable  # cfg -> Dataset
    check: Optional[Callable] = None  # cfg -> None, raising ConfigError before any work starts
    augment: bool = False  # random crop + flip by default
    image: bool = True  # inputs are (C, H, W) images (CNN models need that)
    sized: bool = False  # cfg.dataset_size picks the number of training samples (pycode: bytes)
    tokens: bool = False  # inputs are token sequences (language models need that)
    args: Tuple[str, ...] = ()  # the dataset_args it takes (an external factory: any)
    task: str = "classification"  # Dataset.task of what it loads
    cache: bool = False  # keep what it loaded for the next load of the same settings in this process


DATASETS: Dict[str, DatasetSpec] = {
    "digits": DatasetSpec(_load_digits),
    "cifar10": DatasetSpec(_load_cifar("cifar10"), _check_cifar("cifar10"), augment=True),
    "cifar100": DatasetSpec(_load_cifar("cifar100"), _check_cifar("cifar100"), augment=True),
    "synthetic_cifar10": DatasetSpec(_load_synthetic("synthetic_cifar10", 10), augment=True, sized=True),
    "synthetic_cifar100": DatasetSpec(_load_synthetic("synthetic_cifar100", 100), augment=True, sized=True),
    "signal_noise": DatasetSpec(_load_signal_noise, image=False),
    "diabetes": DatasetSpec(_load_diabetes, image=False, task="regression"),
    "ackley": DatasetSpec(_load_ackley, image=False, task="regression"),
    "pycode": DatasetSpec(_load_pycode, image=False, sized=True, tokens=True, task="language_model"),
    "tokens": DatasetSpec(_load_tokens, _check_tokens, image=False, sized=True, tokens=True, args=TOKENS_ARGS,
                          task="language_model", cache=True),
    "imagefolder": DatasetSpec(_load_imagefolder, _check_imagefolder, args=IMAGEFOLDER_ARGS, cache=True),
}

#: what ``--dataset MODULE:FACTORY`` gets (task and image are known once it is loaded: :func:`dataset_kind`)
EXTERNAL = DatasetSpec(_load_external, image=False, task="", cache=True)


def register_dataset(name: str, spec: DatasetSpec) -> None:
    DATASETS[name] = spec


def available_datasets() -> List[str]:
    return sorted(DATASETS)


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of a registered name, :data:`EXTERNAL` for ``MODULE:FACTORY``; ConfigError otherwise."""
    if is_external(name):
        return EXTERNAL
    if name not in DATASETS:
        raise ConfigError("dataset", f"unknown dataset {name!r}; available: {', '.join(available_datasets())}, "
                          f"or MODULE:FACTORY / path/to/file.py:FACTORY returning (train, test) torch Datasets")
    return DATASETS[name]


def check_dataset(cfg) -> None:
    """Everything about the data that can be checked before any work starts. A ``MODULE:FACTORY``
    data set is loaded here (once per process: :func:`load_dataset` reuses it) so that a factory
    that fails or returns the wrong type stops the run before any process starts."""
    spec = dataset_spec(cfg.dataset)
    if cfg.dataset_size is not None and not spec.sized:
        sized = ", ".join(n for n, d in sorted(DATASETS.items()) if d.sized)
        raise ConfigError("dataset_size", f"dataset {cfg.dataset!r} has a fixed size; only {sized} "
                          f"take dataset_size")
    if spec is not EXTERNAL:
        _check_args(cfg, spec.args)
    if spec.check is not None:
        spec.check(cfg)
    if spec is EXTERNAL:
        load_dataset(cfg)


_LOADED: Dict[tuple, Dataset] = {}  # the last loads of cached specs (at most 2)


def _load_key(cfg) -> tuple:
    args = tuple(sorted((str(k), repr(v)) for k, v in dict(getattr(cfg, "dataset_args", None) or {}).items()))
    return (cfg.dataset, args, cfg.data_path, cfg.dataset_size, cfg.context, cfg.seed, os.getcwd())


def load_dataset(cfg) -> Dataset:
    """The data set ``cfg`` names (``cfg`` may be a TrainConfig or HyperParams), its ``holdout``
    fraction of the training set held out (:func:`hold_out`) when that is > 0."""
    spec = dataset_spec(cfg.dataset)
    if not spec.cache:
        check_dataset(cfg)
        ds = spec.loader(cfg)
    else:
        key = _load_key(cfg)
        if key not in _LOADED:
            if spec is not EXTERNAL:
                check_dataset(cfg)
            ds = spec.loader(cfg)
            while len(_LOADED) >= 2:
                _LOADED.pop(next(iter(_LOADED)))
            _LOADED[key] = ds
        ds = _LOADED[key]
    fraction = getattr(cfg, "holdout", 0) or 0
    return hold_out(ds, fraction, cfg.seed) if fraction else ds


def holdout_indices(n: int, fraction: float, seed: int, task: str) -> Tuple[Tensor, Tensor]:
    """(kept, held out): indices into a training set of ``n`` samples, each sorted; round(fraction x n)
    held out (at least 1, at most n - 1). Classification and regression: a random subset drawn from
    ``seed`` (its own stream, apart from the shards'); a language model: the last ones (its
    sequences are consecutive text)."""
    if not (0 < fraction < 1):
        raise ConfigError("holdout", f"must be in (0, 1) (a fraction of the training set; 0: off), got {fraction!r}")
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise ConfigError("holdout", f"{fraction:g} of {n} training samples leaves none to train on")
    if task == "language_model":
        return torch.arange(n - k), torch.arange(n - k, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, 0x4A1D)))
    return perm[k:].sort().values, perm[:k].sort().values


def hold_out(ds: Dataset, fraction: float, seed: int) -> Dataset:
    """``ds`` with ``fraction`` of its training set moved to a validation split (``holdout_x``,
    ``holdout_y``; :func:`holdout_indices` says which), scored in place of the test split; the
    training set (and so every shard) is the rest."""
    if ds.holdout_y is not None:
        raise ConfigError("holdout", "the data set already has a held-out split")
    keep, held = holdout_indices(len(ds.train_y), fraction, seed, ds.task)
    return Dataset(ds.name, ds.task, ds.train_x[keep], ds.train_y[keep], ds.test_x, ds.test_y, ds.num_outputs,
                   ds.mean, ds.std, ds.image, ds.token_unit, ds.train_x[held], ds.train_y[held], keep, held)


def dataset_kind(cfg) -> Tuple[str, bool]:
    """(task, image) of the data ``cfg`` names: "classification", "regression" or "language_model",
    and whether the inputs are [C, H, W] images. Read from the registry for the built-in names; a
    ``MODULE:FACTORY`` data set is loaded (cached) to find out."""
    spec = dataset_spec(cfg.dataset)
    if spec is EXTERNAL:
        ds = load_dataset(cfg)
        return ds.task, ds.image
    return spec.task, spec.image


def augment_default(cfg) -> bool:
    return dataset_spec(cfg.dataset).augment if cfg.augment is None else cfg.augment


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
    """The batch stream of one worker: its shard, reshuffled each epoch, cut into full batches. An
    epoch's order is drawn on the CPU and moved to ``device`` once (on CUDA a host-to-device copy
    waits for the GPU: once an epoch, not once a step)."""

    shard: Tensor
    batch_size: int
    seed: int
    worker: int
    _cache: Dict[int, Tensor] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")

    def _epoch(self, e: int) -> Tensor:
        if e not in self._cache:
            if len(self._cache) > 4:
                self._cache.clear()
            g = torch.Generator().manual_seed(_mix(self.seed, self.worker, e, 0xB47C))
            self._cache[e] = self.shard[torch.randperm(len(self.shard), generator=g)].to(self.device)
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
        self.streams = [WorkerBatches(s, batch_size, seed, w, device=self.device) for w, s in enumerate(self.shards)]

    @property
    def shard_size(self) -> int:
        return min(len(s) for s in self.shards)

    def batch(self, worker: int, step: int) -> Tuple[Tensor, Tensor]:
        idx = self.streams[worker].indices(step)  # on the device already
        x = self.dataset.prepare(self.dataset.train_x[idx])
        if self.augment:
            x = _augment(x, _mix(self.seed, worker, step, 0xA06))
        return x, self.dataset.train_y[idx]

    @property
    def scored_on(self) -> str:
        """The split :meth:`eval_batches` reads: ``"holdout"`` (--holdout) or ``"test"``."""
        return self.dataset.scored_on

    def test_batches(self, batch_size: int):
        d = self.dataset
        for i in range(0, len(d.test_y), batch_size):
            yield d.prepare(d.test_x[i:i + batch_size]), d.test_y[i:i + batch_size]

    def eval_batches(self, batch_size: int):
        """Batches of the split evaluations score: the held-out one with --holdout, else the test split."""
        d = self.dataset
        x, y = d.eval_split()
        for i in range(0, len(y), batch_size):
            yield d.prepare(x[i:i + batch_size]), y[i:i + batch_size]


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
