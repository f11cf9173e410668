"""The method contract and the registry of the trainer's methods.

A method is one file in this package plus one line in :data:`METHODS`::

    from . import Method, Option, RoundResult, WorkerTurn, register_method

    @register_method("name")
    class Name(Method):
        options = {"xi": Option(0.5, float, "keep probability", check=lambda v: 0 < v <= 1,
                                expected="a probability in (0, 1]")}   # --option xi=0.3

        @classmethod
        def validate(cls, hp): ...            # optional; hp: the read-only hyper-parameters;
                                              #   raise ConfigError(option, why)
        def __init__(self, ctx): ...          # setup on every rank: models, optimizers
        def begin_round(self, r): ...         # plan, cut the subnetworks -> [WorkerTurn] (this process's)
        def end_round(self, r, losses): ...   # exchange, aggregation, outer step -> RoundResult
        def global_model(self): ...           # the full model; every rank calls it (may gather)
        def state_dict(self): ...             # all resume needs for this process's workers:
        def load_state_dict(self, state): ... #   models, optimizer states, plan generator states
        def evaluate(self, model): ...        # optional; default: ctx.evaluate (test loss, accuracy)
        def summary(self): ...                # optional; extra entries for summary.json

A round is split in two phases and the method never runs the local steps itself:
``begin_round(r)`` returns the workers this process trains in round r, each a :class:`WorkerTurn`
(its (sub)model and optimizer); whoever drives the run (``ist-train``'s loop, a user's loop through
:class:`ist_kernels.train.Engine`, an experiment) runs their local steps; ``end_round(r, losses)``
takes the turns' summed losses (in the turns' order) and finishes the round. No thread, no
callback: an exception raises where it happens. :meth:`Method.run_round` is the whole round with
the built-in local steps (``ctx.train``), for scripts and tests.

``ctx`` is the worker view (:class:`ist_kernels.train.context.RunContext`): S, rank, the local
workers, device, the resolved options, the read-only hyper-parameters (``ctx.hp``), a model
factory (``ctx.build_model``), the round's generator (``ctx.generator(TAG, r)``: plans are derived
on every rank, never sent), ``ctx.make_optimizer``, and ``ctx.comm``
(:class:`ist_kernels.train.comm.Comm`), which moves slices, averages shared tensors, gathers the
full model and counts the bytes and time of it all. The round engine
(:mod:`ist_kernels.train.rounds`) runs subnetwork rounds (plan -> compact state -> local steps ->
exchange) and local-SGD rounds for every launch mode and storage, in the same two phases.

The rules that keep methods independent: a method never reads the trainer's config (only
``ctx.hp`` and its options), never imports ``ist_kernels.distributed`` (only ``ctx.comm``), never
changes a counter (``ctx.comm`` counts), and never imports another method (shared pieces live in
the engine).

One class serves both launch modes. ``ctx.local_workers`` lists the workers this process trains:
``[ctx.rank]`` when distributed (one process per worker), ``range(S)`` when simulated (S workers
one after another in one process). A distributed and a simulated run of the same config must give
the same model.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch

from ...distributed.ledger import held_bytes  # noqa: F401  (what methods count held state with)
from ..errors import ConfigError

#: name -> the module of this package that registers it (one line per method)
METHODS = {
    "ddp": "ddp",
    "diloco": "diloco",
    "grelu": "grelu",
    "ist": "masked",  # masked with balanced masks
    "localsgd": "localsgd",
    "loft": "loft",
    "masked": "masked",
    "resist": "resist",
}
# The methods of the papers; one without its module is "not available" in this build.
KNOWN_METHODS = ("ist", "masked", "loft", "resist", "grelu", "localsgd", "ddp", "diloco")

_REGISTRY: Dict[str, Type["Method"]] = {}


def boolean(v) -> bool:
    """An option's true/false (also 1/0, yes/no); anything else is a ValueError."""
    if isinstance(v, bool):
        return v
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if str(v).lower() not in words:
        raise ValueError(f"not a boolean: {v!r}")
    return words[str(v).lower()]


@dataclass(frozen=True)
class Option:
    """A method-specific option (``--option NAME=VALUE`` or ``options:`` in a config file)."""

    default: Any
    type: Callable[[Any], Any]
    help: str = ""
    check: Optional[Callable[[Any], bool]] = None
    expected: str = ""  # what check wants, for the error message


@dataclass
class RoundResult:
    """What one round did on this process, summed over ``ctx.local_workers``.

    loss_sum / steps: the training loss summed over the local steps of the local workers and the
    number of those steps; bytes_sent: bytes sent outside ``ctx.comm`` (normally 0: the comm
    object counts what the round sent, in both launch modes). ps_bytes: the papers' parameter-server count of the same round
    (each worker uploads and downloads its subnetwork, :func:`ist_kernels.distributed.ps_bytes`;
    local SGD: 2 full models per worker). state_bytes: worker -> the bytes of parameters, buffers
    and optimizer state that worker held this round (:func:`held_bytes`). ``extra["phase"]`` tags
    the round with an index into ``Method.phases``. The trainer sums loss, steps and bytes over the
    ranks.
    """

    loss_sum: float
    steps: int
    bytes_sent: int = 0
    extra: Optional[Dict[str, float]] = None  # per-round scalars to log (same on every rank)
    ps_bytes: int = 0
    state_bytes: Optional[Dict[int, int]] = None


@dataclass
class WorkerTurn:
    """One worker's local steps in a round, as :meth:`Method.begin_round` hands them out:
    ``worker`` (0..S-1), ``model`` (its subnetwork, or the whole model for local-SGD methods) and
    ``optimizer`` (over ``model``'s parameters). ``batch_workers``: whose batches a step trains on,
    concatenated (default: ``(worker,)``; simulated DDP: every worker's, one synchronous step);
    ``on_step``: called after every optimizer step (DDP counts its gradient all-reduce there)."""

    worker: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch_workers: Tuple[int, ...] = ()
    on_step: Optional[Callable[[], None]] = None

    def __post_init__(self):
        if not self.batch_workers:
            self.batch_workers = (self.worker,)

    def counted(self, loss: "Loss") -> "Loss":
        """A step's loss as the round's ``train_loss`` counts it: once per worker whose batch the step
        took (simulated DDP: S times, the mean of the workers' losses once per worker)."""
        n = len(self.batch_workers)
        return loss * n if n > 1 else loss


#: a turn's summed training loss: a float or a 0-dim tensor (kept on the device: no host sync per step)
Loss = Union[float, torch.Tensor]


def summed(losses: Sequence[Loss]) -> Loss:
    """The sum of the turns' losses, as a float64 0-dim tensor where any is a tensor (no host sync)."""
    total: Loss = 0.0
    for v in losses:
        total = total + (v.detach().double() if isinstance(v, torch.Tensor) else float(v))
    return total


class Method:
    name: str = ""
    #: bytes of parameters, buffers and optimizer state of the whole model (what one local-SGD
    #: worker holds); set by the method (``ctx.full_state_bytes(model)``)
    full_state_bytes: int = 0
    #: method-specific options: name -> Option
    options: Dict[str, Option] = {}
    #: the method can train with a single worker (S = 1)
    allows_single_worker: bool = True
    #: the method applies ``--outer-optimizer`` (the round engine's outer step after aggregation)
    outer_optimizer: bool = False
    #: the local optimizer the method always uses whatever ``--optimizer`` says (diloco: "adamw"), or
    #: None: the config decides its default ``--lr`` and the summary's ``optimizer`` by it
    inner_optimizer: Optional[str] = None
    #: ``--compress`` with ``--outer-optimizer``: the method's outer step acts on a pseudo-gradient that
    #: ``--compress`` codes in both launch modes (local SGD's and DiLoCo's); False: refused (a subnetwork
    #: exchange codes weights, and the outer step would act on coded values in one launch mode and
    #: before coding in the other)
    outer_compress: bool = False
    #: ``--compress`` codes what this method sends (False: it sends something the codecs do not apply to)
    compresses: bool = True
    #: why not, for the error of ``--compress`` with it (names what to do instead)
    compress_refusal: str = ""
    #: names of the values of ``RoundResult.extra["phase"]`` (e.g. pretrain, finetune); the summary
    #: splits the bytes (both ways) by them
    phases: Tuple[str, ...] = ()

    # ---- configuration (before any work starts) ----
    @classmethod
    def resolve_options(cls, given: Mapping[str, Any]) -> Dict[str, Any]:
        """Defaults filled in, values converted, unknown names and failed checks rejected."""
        out = {}
        for key in given:
            if key not in cls.options:
                known = ", ".join(sorted(cls.options)) or "none"
                raise ConfigError(f"options.{key}", f"method {cls.name!r} has no such option (it has: {known})")
        for key, opt in cls.options.items():
            value = given.get(key, opt.default)
            if key in given:
                try:
                    value = opt.type(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"options.{key}", f"expected {opt.type.__name__}, got {value!r}") from None
                if opt.check is not None and not opt.check(value):
                    raise ConfigError(f"options.{key}", f"expected {opt.expected or 'a valid value'}, got {value!r}")
            out[key] = value
        return out

    @classmethod
    def baseline_options(cls, options: Mapping[str, Any]) -> Dict[str, Any]:
        """Options of the ``localsgd`` run that ``--baseline`` compares this method with, given
        this method's (unresolved) options: the paper's baseline. Default: dense local SGD."""
        return {}

    @classmethod
    def validate(cls, hp) -> None:
        """Method-specific checks of the run's hyper-parameters (``hp``: read-only, the options
        still as given); raise ConfigError(option, why)."""
        if not cls.allows_single_worker and hp.num_workers < 2:
            raise ConfigError("workers", f"method {cls.name!r} needs at least 2 workers, got {hp.num_workers}")
        if getattr(hp, "outer_optimizer", "none") != "none" and not cls.outer_optimizer:
            takes = ", ".join(n for n in available_methods() if _has_module(n) and get_method(n).outer_optimizer)
            raise ConfigError("outer_optimizer", f"method {cls.name!r} takes no outer optimizer (methods that do: "
                              f"{takes})")
        if getattr(hp, "compress", "none") != "none" and getattr(hp, "outer_optimizer", "none") != "none" and \
                not cls.outer_compress:
            raise ConfigError("compress", f"--compress {hp.compress} with --outer-optimizer {hp.outer_optimizer}: "
                              f"not supported together for {cls.name} (the outer step would act on coded values in "
                              "one launch mode and before coding in the other); use one of them")
        if getattr(hp, "compress", "none") != "none" and not cls.compresses:
            raise ConfigError("compress", f"--compress {hp.compress}: {cls.compress_refusal or cls.name + ' sends what the codecs do not code'}")

    # ---- training ----
    def __init__(self, ctx):
        self.ctx = ctx

    def begin_round(self, r: int) -> List[WorkerTurn]:
        """Round r's first phase: plan it and cut this process's workers' (sub)models; returns their
        turns, in the order the local steps run (``ctx.local_workers``' order)."""
        raise NotImplementedError

    def end_round(self, r: int, losses: Sequence[Loss]) -> RoundResult:
        """Round r's second phase, after every turn's local steps: exchange, aggregation, outer
        step; ``losses``: each turn's summed training loss, in the turns' order."""
        raise NotImplementedError

    def run_round(self, r: int) -> RoundResult:
        """The whole round with the built-in local steps (``ctx.train``): what ``ist-train`` does
        between the two phases."""
        turns = self.begin_round(r)
        return self.end_round(r, [self.ctx.train(turn, r) for turn in turns])

    def global_model(self):
        """The full model for evaluation and the final save; every rank calls it (it may be a
        collective: decentralized storage assembles it, and adds what that moved to
        ``ctx.comm``). Must return the model on rank 0; other ranks may return None."""
        raise NotImplementedError

    def evaluate(self, model) -> Dict[str, float]:
        """Scores of ``model`` (from global_model) on the test set, on rank 0: test_loss and, for
        classification, accuracy. Override for other scores; keep those two keys."""
        return self.ctx.evaluate(model)

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def summary(self) -> Dict[str, Any]:
        """Extra entries for the final summary (e.g. the pruned model's size); optional."""
        return {}


def register_method(name: str):
    """Class decorator: make ``name`` available to ``--method``."""

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise TypeError(f"register_method({name!r}): {cls!r} is not a Method subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} is already registered by {_REGISTRY[name].__module__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_methods():
    """Names a user can pass to --method in this build."""
    return sorted(set(_REGISTRY) | set(METHODS))


def get_method(name: str) -> Type[Method]:
    """The class registered as ``name``, importing its module (:data:`METHODS`) on first use."""
    if name not in _REGISTRY and name in METHODS:
        try:
            importlib.import_module(f"{__name__}.{METHODS[name]}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{METHODS[name]}":
                raise
    if name in _REGISTRY:
        return _REGISTRY[name]
    avail = ", ".join(sorted(set(_REGISTRY) | {n for n in METHODS if _has_module(n)}))
    if name in KNOWN_METHODS or name in METHODS:
        raise ConfigError("method", f"{name!r} is not available in this build "
                          f"(no ist_kernels/train/methods/{METHODS.get(name, name)}.py); available: {avail}")
    raise ConfigError("method", f"unknown method {name!r}; available: {avail}")


def _has_module(name: str) -> bool:
    return name in _REGISTRY or importlib.util.find_spec(f"{__name__}.{METHODS[name]}") is not None
