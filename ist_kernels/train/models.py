"""Models the trainer can build: ``mlp`` here, every other name from ``ist_kernels.models``:
the CNNs (``preact_resnet18``, ``resnet18``, ... called with ``num_classes``, ``in_channels`` and,
when given, ``width``: the first stage's channels) on image data sets, and the language models
(``gpt_tiny``, ``gpt_small``, called with ``vocab_size``, ``context`` and, when given, ``width``
and ``depth``: the model width and the number of blocks) on token data sets (``pycode``).

``build_model(cfg, dataset)`` initialises from ``cfg.seed`` inside a forked RNG, so every rank
and the simulated run start from the same model, whatever ran before.
"""
from __future__ import annotations

import importlib
import inspect
import math
from typing import Callable, Dict

import torch
from torch import nn

from .datasets import DATASETS
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


def check_model(cfg) -> None:
    spec = DATASETS.get(cfg.dataset)
    tokens = spec is not None and spec.tokens
    lms = language_models()
    if cfg.model in MODELS:
        if tokens:
            raise ConfigError("model", f"dataset {cfg.dataset!r} is byte sequences; use a language model "
                              f"({', '.join(lms) or 'none in this build'})")
        return
    zoo = _zoo()
    if zoo is not None and cfg.model in _zoo_names(zoo):
        if cfg.model in lms:
            if not tokens:
                raise ConfigError("model", f"{cfg.model!r} is a language model; dataset {cfg.dataset!r} is not "
                                  f"token sequences (use pycode)")
            return
        if spec is not None and not spec.image:
            raise ConfigError("model", f"{cfg.model!r} is a CNN; dataset {cfg.dataset!r} is not images (use mlp)")
        return
    names = sorted(MODELS) + (_zoo_names(zoo) if zoo is not None else [])
    where = "" if zoo is not None else " (ist_kernels.models is not in this build)"
    raise ConfigError("model", f"unknown model {cfg.model!r}{where}; available: {', '.join(names)}")


def build_model(cfg, dataset) -> nn.Module:
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
