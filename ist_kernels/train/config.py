"""The trainer's configuration: one dataclass, loaded from a YAML/TOML file and/or flags.

Every option has a default; ``TrainConfig.validate()`` checks everything that can be checked
without loading data, and raises :class:`ConfigError` naming the option, before any work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from . import methods
from .checkpoint import check_resumable
from .datasets import check_dataset, is_external
from .errors import ConfigError
from .model_registry import check_model, load_model_spec
from .outer import OUTER_OPTIMIZERS

PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine", "step")
BACKENDS = ("auto", "gloo", "nccl")
STORAGES = ("decentralized", "replicated")
SHARED = ("all_reduce", "exact")
OPTIMIZERS = ("sgd", "adamw")
#: the default --lr: by the local optimizer (a method's ``inner_optimizer`` where it has one, else --optimizer)
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
DEFAULT_MOMENTUM = 0.9  # SGD's
DEFAULT_BETAS = (0.9, 0.999)
COMPRESS = ("none", "bf16", "int8")  # ist_kernels.distributed.compress.COMPRESS (checked by a test)
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # larger values overflow the backends' millisecond timeouts
# the values an option takes, where they are a fixed list (--help shows them)
CHOICES = {"precision": PRECISIONS, "lr_schedule": LR_SCHEDULES, "backend": BACKENDS, "storage": STORAGES,
           "shared": SHARED, "outer_optimizer": OUTER_OPTIMIZERS, "compress": COMPRESS, "optimizer": OPTIMIZERS}
# --help's sections: every option of TrainConfig in exactly one
GROUPS = {
    "data": ("dataset", "data_path", "dataset_args", "augment", "dataset_size", "context", "holdout"),
    "model": ("model", "model_args", "model_spec", "width", "depth"),
    "method": ("method", "prune_ratio", "options", "storage", "shared", "compress", "outer_optimizer",
               "outer_lr", "outer_momentum", "baseline"),
    "training": ("local_steps", "rounds", "epochs", "batch_size", "eval_batch_size", "optimizer", "lr",
                 "lr_schedule", "lr_warmup_rounds", "lr_milestones", "lr_gamma", "momentum", "nesterov",
                 "weight_decay", "betas", "eps", "seed",
                 "precision", "compile", "eval_interval", "eval_bn_batches"),
    "distributed": ("workers", "simulate", "device", "backend", "timeout_s", "max_restarts", "max_rank_state_mb",
                    "threads"),
    "output": ("out_dir", "checkpoint_dir", "checkpoint_interval", "resume", "overwrite", "stop_after", "progress",
               "plots"),
    "presets": ("demo", "quick"),
}




def _opt(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    # what to train
    method: str = _opt("localsgd", "training method (see --list-methods)")
    model: str = _opt("mlp", "model: mlp, a name from ist_kernels.models (e.g. preact_resnet18; see --list-models), "
                      "or your own: MODULE:FACTORY (importable from the working directory or PYTHONPATH, e.g. "
                      "torchvision.models:resnet18) or path/to/file.py:FACTORY, returning an nn.Module whose output "
                      "is logits or has .logits")
    model_args: Dict[str, Any] = _opt({}, "--model MODULE:FACTORY: keyword arguments of the factory, "
                                      "K=V[,K=V...] (values read as int, float, true/false, else string; "
                                      "repeatable), e.g. num_classes=10")
    model_spec: Optional[str] = _opt(None, "what ist / resist partition in a model whose structure is not found: "
                                     "JSON (inline or a .json file) or MODULE:OBJECT giving a dict with keys "
                                     "ffns=[[[in_proj, ...], out_proj]], attentions=[{q, k, v, o, num_heads}], "
                                     "layers='<container>' (module paths)")
    width: Optional[int] = _opt(None, "mlp: hidden width (default 128); ResNets: first-stage channels (default 64); "
                                "gpt_tiny / gpt_small: model width (default 128 / 256; heads of 32)")
    depth: Optional[int] = _opt(None, "mlp: hidden layers (default 1); gpt_tiny / gpt_small: transformer blocks "
                                "(default 4 / 6)")
    dataset: str = _opt("digits", "dataset (see --list-datasets), or your own: MODULE:FACTORY or "
                        "path/to/file.py:FACTORY returning (train, test) torch.utils.data.Datasets of "
                        "(input, target) items (read into memory)")
    data_path: Optional[str] = _opt(None, "the dataset's files: the CIFAR python-pickle folder; imagefolder: "
                                    "DIR with train/<class>/* and test/<class>/* (or val/), or <class>/* (a tenth "
                                    "by path hash is the test split); tokens: a flat file of token ids (its last "
                                    "tenth is the test split) or a folder with train.bin and val.bin")
    dataset_args: Dict[str, Any] = _opt({}, "K=V[,K=V...] (repeatable): --dataset MODULE:FACTORY: keyword "
                                        "arguments of the factory; tokens: dtype (uint16, the default as in "
                                        "nanoGPT's .bin; uint8; uint32), vocab_size (default: meta.pkl's, else 256 "
                                        "for uint8, else the largest id + 1), test_fraction (0.1), test_tokens; "
                                        "imagefolder: image_size (resize to N x N), backend (torchvision, the "
                                        "default, or pil: the same layout read without torchvision)")
    augment: Optional[bool] = _opt(None, "random crop + flip for image batches (default: on for CIFAR)")
    dataset_size: Optional[int] = _opt(None, "pycode: training bytes (default 1048576); tokens: training ids "
                                       "(default: the whole split); "
                                       "generated data sets (synthetic_cifar10/100): training samples "
                                       "(default 50000, CIFAR's; the test set has a fifth as many)")
    context: int = _opt(128, "pycode, tokens: ids per sequence (the language model's context)")
    holdout: float = _opt(0.0, "hold out this fraction of the training set (0 < F < 1; 0: off) and score every "
                          "evaluation on it instead of the test split (a validation split for tuning): a seeded "
                          "random subset (language models: the last sequences), left out of every shard")
    # workers
    workers: Optional[int] = _opt(None, "number of workers S (processes); default: WORLD_SIZE under torchrun, else 2")
    simulate: int = _opt(0, "train S workers/subnetworks one after another in one process (0: off)")
    backend: str = _opt("auto", "torch.distributed backend: auto (nccl on CUDA, gloo on CPU), gloo, nccl")
    timeout_s: float = _opt(600.0, "collective timeout in seconds, at most 604800 (7 days)")
    max_restarts: int = _opt(0, "--workers S: restart the workers this many times after a failure; a restarted "
                             "run continues from its latest checkpoint (under torchrun: torchrun's --max-restarts)")
    storage: str = _opt("decentralized", "subnetwork methods: decentralized (a rank holds only its subnetwork and "
                        "the shared tensors; the full model is assembled only to evaluate or save) or replicated "
                        "(every rank holds the full model; for testing)")
    shared: str = _opt("all_reduce", "how the shared tensors are averaged between rounds: all_reduce (ring; "
                       "equals --simulate to a few ulps) or exact (through the all-to-all; bit for bit, more bytes)")
    outer_optimizer: str = _opt("none", "the methods that take one (ist, masked, loft, resist, localsgd): an outer "
                                "optimizer step after each round's aggregation, on the pseudo-gradient (the previous "
                                "model - the aggregate): nesterov (SGD with Nesterov momentum, DiLoCo's), sgd (heavy-"
                                "ball momentum), adam (torch.optim.Adam at --outer-lr) or none; decentralized storage: "
                                "a slice's outer state travels with it to its next owner")
    outer_lr: float = _opt(0.7, "--outer-optimizer: outer learning rate (DiLoCo's 0.7)")
    outer_momentum: float = _opt(0.9, "--outer-optimizer nesterov / sgd: outer momentum (DiLoCo's 0.9)")
    compress: str = _opt("none", "encode what the rounds send: none, bf16 (2 bytes a value) or int8 (1 byte a "
                         "value and a fp32 scale per slice / segment); the exchanges of the subnetwork methods "
                         "and the averages of local SGD (not ddp's gradients); simulated and distributed runs "
                         "give the same model")
    max_rank_state_mb: Optional[float] = _opt(None, "fail the run when a rank holds more than this many MB "
                                              "(10^6 bytes) of parameters, buffers and optimizer state")
    threads: Optional[int] = _opt(None, "CPU threads per process (default: torch's; spawned workers share the cores)")
    # schedule
    local_steps: int = _opt(4, "local SGD steps per round (tau / l)")
    rounds: Optional[int] = _opt(None, "communication rounds (default 20; exclusive with epochs)")
    epochs: Optional[float] = _opt(None, "passes over each worker's shard, converted to rounds")
    batch_size: int = _opt(32, "batch size per worker")
    eval_batch_size: int = _opt(512, "batch size for evaluation")
    optimizer: str = _opt("sgd", "the local optimizer of every method: sgd (--momentum, --nesterov, --weight-decay) "
                          "or adamw (--betas, --eps, --weight-decay: torch.optim.AdamW); diloco's inner optimizer "
                          "is AdamW with its own --option beta1/beta2/eps/weight_decay")
    lr: Optional[float] = _opt(None, "base learning rate (default: 0.05 for sgd, 0.001 for adamw and for diloco)")
    lr_schedule: str = _opt("constant", "constant, cosine (over all steps) or step (x lr_gamma at lr_milestones)")
    lr_warmup_rounds: int = _opt(0, "linear learning-rate warm-up over this many rounds")
    lr_milestones: List[int] = _opt([], "rounds at which the step schedule multiplies lr by lr_gamma (default: 50%, 75%)")
    lr_gamma: float = _opt(0.1, "factor of the step schedule")
    momentum: Optional[float] = _opt(None, "SGD momentum (default 0.9; sgd only)")
    nesterov: bool = _opt(False, "Nesterov momentum (sgd only)")
    weight_decay: float = _opt(5e-4, "weight decay (sgd: L2 in the gradient; adamw: decoupled)")
    betas: List[float] = _opt(list(DEFAULT_BETAS), "adamw: B1,B2, the moments' decay rates")
    eps: float = _opt(1e-8, "adamw: epsilon")
    prune_ratio: float = _opt(0.0, "fraction of filters/weights pruned by methods that prune (loft, masked)")
    options: Dict[str, Any] = _opt({}, "method-specific options, KEY=VALUE (see the method's docs)")
    # run
    seed: int = _opt(0, "seed of the model initialisation, data shards and plans")
    device: str = _opt("auto", "auto, cpu, cuda or cuda:N")
    precision: str = _opt("fp32", "fp32, or bf16 / fp16 (autocast of the forward; fp16 with a gradient scaler)")
    compile: bool = _opt(False, "torch.compile the workers' models for their local steps: compiled once per run "
                         "(a subnetwork of the same structure reuses the compiled code every round; summary.json "
                         "counts compiles and recompiles, time_by_part its compile time)")
    eval_interval: int = _opt(1, "evaluate every this many rounds (0: only before the first and after the last)")
    eval_bn_batches: int = _opt(0, "before each evaluation, re-estimate the BatchNorm running statistics of a copy "
                                "of the full model on this many training batches (precise BN: the trained model "
                                "and the training batches are unchanged); 0: score the statistics the method "
                                "left")
    out_dir: Optional[str] = _opt(None, "output folder (default runs/<method>-<model>-<dataset>-S<S>)")
    checkpoint_dir: Optional[str] = _opt(None, "checkpoint folder (default <out_dir>/checkpoints)")
    checkpoint_interval: int = _opt(0, "checkpoint every this many rounds (0: only at the end)")
    resume: bool = _opt(False, "resume from the latest checkpoint in checkpoint_dir")
    overwrite: bool = _opt(False, "start afresh in a non-empty out_dir: delete the earlier run's outputs "
                           "(metrics, summaries, model, plots, checkpoints) first; other files stay")
    stop_after: Optional[int] = _opt(None, "stop (after a checkpoint) once this many rounds are done")
    baseline: bool = _opt(False, "also run local SGD with the same budget and compare")
    progress: bool = _opt(True, "progress bar on rank 0")
    plots: bool = _opt(True, "write PNG plots")
    demo: bool = _opt(False, "the demo: LOFT on digits with 2 workers vs local SGD (README)")
    quick: bool = _opt(False, "smoke tests and CI: at most 3 rounds (with --demo: the demo's small size)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        cfg = cls()
        cfg.update(values, source)
        return cfg

    def update(self, values: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        names = self.field_names()
        hints = typing.get_type_hints(type(self))
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(name, f"unknown option (from {source}){hint}")
            setattr(self, name, _coerce(name, hints[name], value))
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ derived values
    @property
    def under_torchrun(self) -> bool:
        return under_torchrun()

    @property
    def num_workers(self) -> int:
        """S: the number of workers (subnetworks), real or simulated."""
        if self.simulate:
            return self.simulate
        if self.workers is not None:
            return self.workers
        if under_torchrun():
            return int(os.environ["WORLD_SIZE"])
        return 2

    def resolved_out_dir(self) -> str:
        if self.out_dir:
            return self.out_dir
        return os.path.join("runs", f"{self.method}-{_short(self.model)}-{_short(self.dataset)}-S{self.num_workers}")

    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint_dir or os.path.join(self.resolved_out_dir(), "checkpoints")

    # ------------------------------------------------------------------ validation
    def validate(self, data: bool = True) -> "TrainConfig":
        """Raise ConfigError naming the first invalid option; checks method/dataset/model names too."""
        if self.width is not None:
            _positive_int(self, "width")
        if self.depth is not None:
            _positive_int(self, "depth")
        _positive_int(self, "context")
        _positive_int(self, "local_steps")
        _positive_int(self, "batch_size")
        _positive_int(self, "eval_batch_size")
        if self.threads is not None:
            _positive_int(self, "threads")
        if self.dataset_size is not None:
            _positive_int(self, "dataset_size")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not (
                self.holdout == 0 or 0 < self.holdout < 1):  # also rejects nan
            raise ConfigError("holdout", f"must be a fraction in (0, 1) of the training set, or 0 (off), "
                              f"got {self.holdout!r}")
        if self.simulate < 0:
            raise ConfigError("simulate", f"must be >= 0 (0: off), got {self.simulate}")
        if self.workers is not None and self.workers < 1:
            raise ConfigError("workers", f"must be >= 1, got {self.workers}")
        if self.simulate and self.workers is not None and self.workers not in (1, self.simulate):
            raise ConfigError("workers", f"--simulate {self.simulate} runs in one process; "
                              f"--workers {self.workers} conflicts with it")
        if self.simulate and under_torchrun():
            raise ConfigError("simulate", "runs in one process; do not launch it with torchrun")
        if under_torchrun() and self.workers is not None and self.workers != int(os.environ["WORLD_SIZE"]):
            raise ConfigError("workers", f"is {self.workers} but torchrun started WORLD_SIZE="
                              f"{os.environ['WORLD_SIZE']} processes")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.max_restarts and (under_torchrun() or self.simulate or self.num_workers == 1):
            raise ConfigError("max_restarts", "restarts the workers of --workers S (S > 1); under torchrun pass "
                              "torchrun's own --max-restarts" if under_torchrun() else
                              "restarts the workers of --workers S (S > 1); this run has no worker processes")
        if self.rounds is not None and self.epochs is not None:
            raise ConfigError("rounds", "give rounds or epochs, not both")
        if self.rounds is not None and self.rounds < 1:
            raise ConfigError("rounds", f"must be >= 1, got {self.rounds}")
        if self.epochs is not None and not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise ConfigError("epochs", f"must be a finite number > 0, got {self.epochs}")
        _resolve_optimizer(self)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"must be a finite number > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError("lr_schedule", f"must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.lr_warmup_rounds < 0:
            raise ConfigError("lr_warmup_rounds", f"must be >= 0, got {self.lr_warmup_rounds}")
        if any(m < 0 for m in self.lr_milestones) or list(self.lr_milestones) != sorted(self.lr_milestones):
            raise ConfigError("lr_milestones", f"must be increasing round numbers >= 0, got {self.lr_milestones}")
        if not (0 < self.lr_gamma <= 1):
            raise ConfigError("lr_gamma", f"must be in (0, 1], got {self.lr_gamma}")
        if self.momentum is not None and not (0 <= self.momentum < 1):
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum}")
        if self.nesterov and not self.momentum:
            raise ConfigError("nesterov", "needs momentum > 0")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ConfigError("weight_decay", f"must be a finite number >= 0, got {self.weight_decay}")
        if not (0 <= self.prune_ratio < 1):
            raise ConfigError("prune_ratio", f"must be in [0, 1), got {self.prune_ratio}")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.storage not in STORAGES:
            raise ConfigError("storage", f"must be one of {', '.join(STORAGES)}, got {self.storage!r}")
        if self.shared not in SHARED:
            raise ConfigError("shared", f"must be one of {', '.join(SHARED)}, got {self.shared!r}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError("outer_optimizer", f"must be one of {', '.join(OUTER_OPTIMIZERS)}, "
                              f"got {self.outer_optimizer!r}")
        if not (self.outer_lr > 0 and math.isfinite(self.outer_lr)):
            raise ConfigError("outer_lr", f"must be a finite number > 0, got {self.outer_lr}")
        if not (0 <= self.outer_momentum < 1):
            raise ConfigError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if self.compress not in COMPRESS:
            raise ConfigError("compress", f"--compress must be one of {', '.join(COMPRESS)}, got {self.compress!r}")
        if self.max_rank_state_mb is not None and not (self.max_rank_state_mb > 0 and
                                                       math.isfinite(self.max_rank_state_mb)):
            raise ConfigError("max_rank_state_mb", f"must be a finite number > 0, got {self.max_rank_state_mb}")
        if not (0 < self.timeout_s <= MAX_TIMEOUT_S):  # also rejects nan and inf
            raise ConfigError("timeout_s", f"must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                              f"got {self.timeout_s}")
        if self.eval_bn_batches < 0:
            raise ConfigError("eval_bn_batches", f"must be >= 0 (0: no re-estimate), got {self.eval_bn_batches}")
        if self.eval_interval < 0:
            raise ConfigError("eval_interval", f"must be >= 0 (0: only at the end), got {self.eval_interval}")
        if self.checkpoint_interval < 0:
            raise ConfigError("checkpoint_interval", f"must be >= 0 (0: only at the end), got {self.checkpoint_interval}")
        if self.resume and self.overwrite:
            raise ConfigError("overwrite", "conflicts with --resume (overwrite starts afresh, resume continues)")
        if self.stop_after is not None and self.stop_after < 1:
            raise ConfigError("stop_after", f"must be >= 1, got {self.stop_after}")
        _validate_device(self)
        # names: datasets, models and methods know their own lists
        if data:
            check_dataset(self)
            check_model(self)
        elif is_external(self.model):  # a user's loop with its own data (ist_kernels.train.Engine)
            check_model(self)
        else:
            raise ConfigError("dataset", f"the built-in model {self.model!r} is shaped by its data set: give one, "
                              f"or a model factory")
        if self.model_spec is not None:
            if not is_external(self.model):
                raise ConfigError("model_spec", f"applies to --model MODULE:FACTORY, not to the built-in {self.model!r}")
            load_model_spec(self.model_spec)
        method = methods.get_method(self.method)
        self.options = method.resolve_options(self.options)
        method.validate(HyperParams(self))
        if self.resume:
            check_resumable(self.resolved_checkpoint_dir(), self)
        return self


def _short(name: str) -> str:
    """A name for a folder: MODULE:FACTORY and path/to/file.py:FACTORY give FACTORY."""
    name = name.rpartition(":")[2] if ":" in name else name
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "model"


KV_OPTIONS = ("model_args", "dataset_args")  # K=V[,K=V...] strings from flags


def parse_value(text: str):
    """A K=V value: int, float, true/false (any case), else the string itself."""
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for tp in (int, float):
        try:
            return tp(t)
        except ValueError:
            pass
    return t


def parse_kv(name: str, items) -> Dict[str, Any]:
    """``"k=v,k2=v2"`` (or a list of such strings) as a dict, values through :func:`parse_value`."""
    out: Dict[str, Any] = {}
    for item in [items] if isinstance(items, str) else items:
        if not isinstance(item, str):
            raise ConfigError(name, f"expected K=V[,K=V...], got {item!r}")
        for part in filter(None, (p.strip() for p in item.split(","))):
            key, eq, value = part.partition("=")
            if not eq or not key.strip() or not key.strip().isidentifier():
                raise ConfigError(name, f"expected K=V with K a keyword name, got {part!r}")
            out[key.strip()] = parse_value(value)
    return out


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def restart_count() -> int:
    """How many times torch's elastic agent (torchrun, or ``--workers S``) restarted this worker group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if under_torchrun() else 0


def inner_optimizer(method: str) -> Optional[str]:
    """The local optimizer ``method`` always uses whatever --optimizer says (its class's
    ``inner_optimizer``, e.g. diloco's AdamW), or None; None too for a name no method has."""
    try:
        return methods.get_method(method).inner_optimizer
    except ConfigError:
        return None


def default_lr(method: str, optimizer: str) -> float:
    """The --lr a run of ``method`` with ``optimizer`` gets when none is given: 0.05 for SGD, 1e-3
    for AdamW, by the method's own local optimizer where it has one (AdamW's step is about lr per
    coordinate whatever the gradient's scale, so SGD's 0.05 throws a transformer's weights, of std
    0.02, far away in one step)."""
    return DEFAULT_LR[inner_optimizer(method) or optimizer]


def _resolve_optimizer(cfg) -> None:
    """Check --optimizer and its options; fill in the learning rate and momentum defaults (the
    resolved values are the config's: the checkpoint and summary.json store them). Idempotent."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    inner = inner_optimizer(cfg.method)
    if inner is not None and (tuple(cfg.betas) != DEFAULT_BETAS or cfg.eps != 1e-8):
        raise ConfigError("betas" if tuple(cfg.betas) != DEFAULT_BETAS else "eps",
                          f"{cfg.method}'s inner {inner} takes its own options (--option NAME=VALUE), "
                          "not --betas / --eps")
    if cfg.optimizer == "adamw" and inner is None:
        if cfg.momentum is not None:
            raise ConfigError("momentum", f"--momentum {cfg.momentum} is SGD's; --optimizer adamw takes --betas B1,B2 "
                              "(the first is its momentum)")
        if cfg.nesterov:
            raise ConfigError("nesterov", "Nesterov momentum is SGD's; --optimizer adamw has none")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ConfigError("betas", f"expected two numbers in [0, 1) (B1,B2), got {list(cfg.betas)}")
    if not (cfg.eps > 0 and math.isfinite(cfg.eps)):
        raise ConfigError("eps", f"must be a finite number > 0, got {cfg.eps}")
    if cfg.lr is None:
        cfg.lr = default_lr(cfg.method, cfg.optimizer)
    if cfg.momentum is None and cfg.optimizer == "sgd":
        cfg.momentum = DEFAULT_MOMENTUM


def _positive_int(cfg, name):
    v = getattr(cfg, name)
    if v < 1:
        raise ConfigError(name, f"must be >= 1, got {v}")


def _validate_device(cfg):
    import torch

    d = cfg.device
    if d in ("auto", "cpu"):
        pass
    elif d == "cuda" or d.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{d!r} asked for but CUDA is not available")
        if d.startswith("cuda:"):
            try:
                idx = int(d.split(":", 1)[1])
            except ValueError:
                raise ConfigError("device", f"expected cuda:N, got {d!r}") from None
            if not 0 <= idx < torch.cuda.device_count():
                raise ConfigError("device", f"{d!r}: only {torch.cuda.device_count()} CUDA devices")
        n = cfg.num_workers
        if not cfg.simulate and not under_torchrun() and n > torch.cuda.device_count():
            raise ConfigError("device", f"{n} local workers on CUDA need {n} GPUs, "
                              f"found {torch.cuda.device_count()} (use --device cpu or --simulate)")
    else:
        raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {d!r}")
    if cfg.backend == "nccl" and (d == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("backend", "nccl needs CUDA devices")


def _coerce(name: str, tp, value):
    """Check/convert a value from a file or a flag to the option's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(name, f"expected true or false, got {value!r}")
    if tp in (int, float):
        # bools are ints to Python, not numbers to a user; an int option takes 3.0 but not 3.5
        if not isinstance(value, bool):
            if isinstance(value, int) or (isinstance(value, float) and (tp is float or value.is_integer())):
                return tp(value)
            if isinstance(value, str):
                try:
                    return tp(value)
                except ValueError:
                    pass
        raise ConfigError(name, f"expected {'an integer' if tp is int else 'a number'}, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, f"expected a string, got {value!r}")
    if origin in (list, List):
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, f"expected a list, got {value!r}")
        # "--betas 0.9,0.95" arrives as one string of the list
        value = [p for v in value for p in (v.replace(",", " ").split() if isinstance(v, str) else [v])]
        return [_coerce(name, args[0], v) for v in value]
    if origin in (dict, Dict):
        if name in KV_OPTIONS and isinstance(value, (str, list, tuple)):
            return parse_kv(name, value)
        if not isinstance(value, Mapping):
            raise ConfigError(name, f"expected a table/mapping, got {value!r}")
        return {str(k): v for k, v in value.items()}
    return value  # pragma: no cover


def load_config_file(path: str) -> Dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a dict of options."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"file {path!r} not found")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                data = yaml.safe_load(f) or {}
        else:
            raise ConfigError("config", f"{path!r}: expected a .yaml, .yml or .toml file")
    except ConfigError:
        raise
    except Exception as e:  # parse errors: say which file
        raise ConfigError("config", f"cannot parse {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path!r} must hold a mapping of option: value")
    return data


def demo_preset(quick: bool) -> Dict[str, Any]:
    """The README's main-job command: LOFT on digits with 2 workers and a preact ResNet-34 (pre-train,
    prune 50%, fine-tune), against local SGD with the same budget."""
    # preact_resnet34 (LOFT partitions 12 of its 16 blocks: a subnetwork has 0.61x the FLOPs, where
    # preact_resnet18 partitions 4 of 8 and keeps 0.73x), width 32 (first-stage channels): the local
    # steps' arithmetic, not the per-op overhead, then sets a round's time on a CPU. ~40 s for both
    # runs on 2 CPU cores, ~98-99% test accuracy
    return dict(method="loft", model="preact_resnet34", dataset="digits", workers=2, prune_ratio=0.5,
                width=4 if quick else 32, local_steps=4 if quick else 8, rounds=4 if quick else 20, batch_size=32,
                lr=0.05, lr_schedule="cosine", eval_interval=1 if quick else 5, baseline=True,
                out_dir=os.path.join("runs", "demo"))


class HyperParams:
    """The run's hyper-parameters, read-only: every option of the config by its name (lists as
    tuples, ``options`` as a read-only mapping) and ``num_workers``. What a method and its
    ``validate`` read instead of the config itself."""

    __slots__ = ("_values",)

    def __init__(self, cfg):
        values = {}
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if isinstance(v, list):
                v = tuple(v)
            elif isinstance(v, dict):
                v = types.MappingProxyType(dict(v))
            values[f.name] = v
        values["num_workers"] = cfg.num_workers
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"no hyper-parameter {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"hyper-parameters are read-only (tried to set {name!r})")

    def __repr__(self) -> str:
        return f"HyperParams({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"
