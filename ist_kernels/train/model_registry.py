"""Models the trainer can build: ``mlp`` here, every other name from ``ist_kernels.models``:
the CNNs (``preact_resnet18``, ``resnet18``, ... called with ``num_classes``, ``in_channels`` and,
when given, ``width``: the first stage's channels) on image data sets, and the language models
(``gpt_tiny``, ``gpt_small``, called with ``vocab_size``, ``context`` and, when given, ``width``
and ``depth``: the model width and the number of blocks) on token data sets (``pycode``).

A user's model: ``--model MODULE:FACTORY`` (MODULE importable from the working directory or
PYTHONPATH, e.g. ``torchvision.models:resnet18``) or ``--model path/to/file.py:FACTORY``, called
with ``--model-args`` as keyword arguments (nothing else is passed: give ``num_classes`` /
``vocab_size`` yourself), must return an ``nn.Module``. Its output may be a logits tensor or an
object with ``.logits`` (Hugging Face), and the loss follows the data (cross-entropy on [B, C] for
classification, per position on [B, T, V] for token data, MSE for regression). Method validators
inspect its structure through :func:`probe_model`.

``build_model(cfg, dataset)`` initialises from ``cfg.seed`` inside a forked RNG, so every rank
and the simulated run start from the same model, whatever ran before (factories included).
"""
from __future__ import annotations

import importlib
import inspect
import json
import math
import os
from typing import Callable, Dict

import torch
from torch import nn

from .datasets import dataset_kind, describe_call, import_factory, is_external
from .errors import ConfigError

MODELS: Dict[str, Callable] = {}


def register_model(name: str):
    """Decorator: ``fn(cfg, input_shape, num_outputs) -> nn.Module`` becomes ``--model name``."""

    def deco(fn):
        MODELS[name] = fn
        return fn

    return deco


@register_model("mlp")
def mlp(cfg, input_shape, num_outputs) -> nn.Module:
    """Flatten, ``depth`` hidden ReLU layers of ``width`` neurons, a linear output layer."""
    layers = [nn.Flatten()]
    fan_in, width = math.prod(input_shape), cfg.width or 128
    for _ in range(cfg.depth or 1):
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    layers.append(nn.Linear(fan_in, num_outputs))
    return nn.Sequential(*layers)


def _zoo():
    try:
        return importlib.import_module("ist_kernels.models")
    except ModuleNotFoundError as e:
        if e.name != "ist_kernels.models":
            raise
        return None


def _zoo_names(zoo):
    return sorted(n for n, f in vars(zoo).items() if n.islower() and not n.startswith("_") and inspect.isfunction(f))


def available_models() -> list:
    """Names a user can pass to --model in this build."""
    zoo = _zoo()
    return sorted(MODELS) + (_zoo_names(zoo) if zoo is not None else [])


def language_models() -> tuple:
    """Names of the language models of ``ist_kernels.models`` (token inputs, logits per position)."""
    zoo = _zoo()
    return tuple(getattr(zoo, "LANGUAGE_MODELS", ())) if zoo is not None else ()


def is_external_model(name) -> bool:
    """``--model MODULE:FACTORY`` or ``path/to/file.py:FACTORY``: a user's model, not a name of this package."""
    return is_external(name)


def model_task(hp) -> str:
    """What the model of ``hp`` (a TrainConfig or HyperParams) is trained for, which the data decide:
    "classification" (logits [B, C]), "language_model" (logits [B, T, V] for token ids [B, T]) or
    "regression". A ``MODULE:FACTORY`` data set is loaded (cached) to find out."""
    return dataset_kind(hp)[0]


def _model_args(cfg) -> dict:
    return dict(getattr(cfg, "model_args", None) or {})


def _call_factory(cfg, meta: bool) -> nn.Module:
    """The user's model: ``FACTORY(**model_args)`` on the meta device (``meta``), else on the CPU
    seeded from cfg.seed in a forked RNG. ConfigError("model") for a factory that cannot be
    imported, raises, or returns something other than an nn.Module."""
    fn = import_factory(cfg.model, "model")
    kwargs = _model_args(cfg)
    call = describe_call(cfg.model, kwargs)
    try:
        if meta:
            with torch.device("meta"):
                model = fn(**kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                model = fn(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        err = ConfigError("model", f"{call} raised {type(e).__name__}: {e}")
        err.factory_raised = True
        raise err from e
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"{call} returned a {type(model).__module__}.{type(model).__qualname__}, not a "
                          f"torch.nn.Module")
    return model


_PROBED: Dict[tuple, nn.Module] = {}


def probe_model(cfg) -> nn.Module:
    """The user's model (``--model MODULE:FACTORY``) of ``cfg`` (a TrainConfig or the HyperParams a
    method's ``validate`` gets), built once per process and cached by (model, model_args, working
    directory): on the meta device where the factory allows it (no memory, no initialisation),
    else on the CPU. For inspecting structure before launch (``named_modules()``, shapes): the
    module is shared between callers, so do not modify it or run it (its tensors may be on "meta").
    ConfigError("model") when the factory cannot be imported, raises, or returns no nn.Module;
    ValueError for a built-in model name (they are known by name)."""
    if not is_external_model(cfg.model):
        raise ValueError(f"probe_model: {cfg.model!r} is a built-in model, not MODULE:FACTORY")
    key = (cfg.model, tuple(sorted((str(k), repr(v)) for k, v in _model_args(cfg).items())), os.getcwd())
    if key not in _PROBED:
        try:
            model = _call_factory(cfg, meta=True)
        except ConfigError as e:
            if not getattr(e, "factory_raised", False):
                raise  # not importable, or not a module: the CPU would not change that
            model = _call_factory(cfg, meta=False)  # a factory that cannot run on "meta" (e.g. reads values)
        _PROBED[key] = model
    return _PROBED[key]


def check_model(cfg) -> None:
    if is_external_model(cfg.model):
        probe_model(cfg)
        return
    if _model_args(cfg):
        raise ConfigError("model_args", f"applies to --model MODULE:FACTORY, not to the built-in {cfg.model!r} "
                          f"(use --width / --depth)")
    task, image = dataset_kind(cfg)
    tokens = task == "language_model"
    lms = language_models()
    if cfg.model in MODELS:
        if tokens:
            raise ConfigError("model", f"dataset {cfg.dataset!r} is token sequences; use a language model "
                              f"({', '.join(lms) or 'none in this build'}) or MODULE:FACTORY")
        return
    zoo = _zoo()
    if zoo is not None and cfg.model in _zoo_names(zoo):
        if cfg.model in lms:
            if not tokens:
                raise ConfigError("model", f"{cfg.model!r} is a language model; dataset {cfg.dataset!r} is not "
                                  f"token sequences (use pycode or tokens)")
            return
        if not image:
            raise ConfigError("model", f"{cfg.model!r} is a CNN; dataset {cfg.dataset!r} is not images (use mlp)")
        return
    names = sorted(MODELS) + (_zoo_names(zoo) if zoo is not None else [])
    where = "" if zoo is not None else " (ist_kernels.models is not in this build)"
    raise ConfigError("model", f"unknown model {cfg.model!r}{where}; available: {', '.join(names)}, or "
                      f"MODULE:FACTORY / path/to/file.py:FACTORY returning an nn.Module")


def build_model(cfg, dataset) -> nn.Module:
    if is_external_model(cfg.model):
        return _call_factory(cfg, meta=False)
    check_model(cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model in MODELS:
            return MODELS[cfg.model](cfg, dataset.input_shape, dataset.num_outputs)
        fn = getattr(_zoo(), cfg.model)
        if cfg.model in language_models():
            return fn(vocab_size=dataset.num_outputs, context=dataset.input_shape[0], width=cfg.width,
                      depth=cfg.depth)
        if not dataset.image or len(dataset.input_shape) != 3:
            raise ConfigError("model", f"{cfg.model!r} is a CNN; dataset {dataset.name!r} has inputs of shape "
                              f"{dataset.input_shape}, not images")
        kw = dict(num_classes=dataset.num_outputs, in_channels=dataset.input_shape[0])
        if cfg.width is not None and "width" in inspect.signature(fn).parameters:
            kw["width"] = cfg.width
        return fn(**kw)


def load_model_spec(value):
    """``--model-spec``: None, or the spec dict (:func:`ist_kernels.partition.find_structure`'s
    ``spec``) it gives: JSON text, a ``.json`` file, or ``MODULE:OBJECT`` (a dict, a Structure, or a
    callable returning one). ConfigError("model_spec") when it cannot be read."""
    if value is None or isinstance(value, dict):
        return value
    text = str(value).strip()
    try:
        if text.startswith("{"):
            spec = json.loads(text)
        elif text.endswith(".json"):
            with open(text) as f:
                spec = json.load(f)
        elif is_external_model(text):
            obj = import_factory(text, "model_spec")
            spec = obj() if callable(obj) and not isinstance(obj, type) else obj
        else:
            raise ValueError("expected JSON, a .json file or MODULE:OBJECT")
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError("model_spec", f"cannot read {text[:80]!r}: {e}") from None
    if not isinstance(spec, dict) and type(spec).__name__ != "Structure":
        raise ConfigError("model_spec", f"expected a dict (ffns, attentions, layers), got {type(spec).__name__}")
    return spec
