"""The worker view: everything a method may use, and nothing else (:class:`RunContext`).

A method gets, through ``ctx``:

- who it is: ``num_workers`` (S), ``rank``, ``local_workers`` (the workers this process trains:
  ``[rank]`` distributed, ``range(S)`` simulated), ``distributed``, ``simulated``,
  ``decentralized`` (the storage), ``device``;
- its resolved options (``options``) and the run's hyper-parameters, read-only (``hp``:
  :class:`HyperParams`; ``local_steps`` and ``rounds`` directly);
- building blocks: ``build_model(factory=None)`` (seeded, identical on every rank),
  ``generator(*tags)`` (the round's generator: plans are derived, never sent),
  ``make_optimizer(params)``, ``evaluate(model)``, ``full_state_bytes(model)``;
- ``comm`` (:class:`ist_kernels.train.comm.Comm`): moves slices, averages shared tensors, gathers
  the full model, and counts the bytes and the time of all of it;
- ``clock`` (:class:`ist_kernels.train.timing.Clock`): where the round's time goes.

A method never runs local steps: its ``begin_round`` hands out :class:`WorkerTurn`s and whoever
drives the run trains them; ``train(turn, r)`` is the built-in local steps (``ist-train``'s),
timed as ``local``.

The trainer (:mod:`.runner`) builds one per process and owns everything else: data, the schedule,
evaluation, metrics, checkpoints, launching.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import ledger
from .comm import Comm
from .compiled import Compiler
from .config import DEFAULT_MOMENTUM, HyperParams, default_lr, inner_optimizer
from .datasets import ShardedData, _mix
from .errors import ConfigError
from .methods import WorkerTurn
from .model_registry import build_model, load_model_spec
from .timing import Clock

#: --precision -> the autocast dtype of the forward (fp32: no autocast)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocasts(device_type: str, dtype: torch.dtype) -> bool:
    """torch.autocast(device_type, dtype) is supported (an unsupported pair is disabled with a warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(torch.autocast(device_type, dtype=dtype)._enabled)


@dataclass
class World:
    """Where this process stands: rank among ``world_size`` processes; ``simulated``: one process
    trains all S workers. ``distributed``: torch.distributed is initialised with > 1 process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    simulated: bool = False
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def lr_at(cfg, rounds: int, r: int, i: int) -> float:
    """Learning rate of local step i of round r (0-based) of a run of ``rounds`` rounds."""
    tau = cfg.local_steps
    t, total = r * tau + i, rounds * tau
    lr = cfg.lr if cfg.lr is not None else default_lr(cfg.method, cfg.optimizer)  # (a config not validated)
    if cfg.lr_schedule == "cosine":
        lr *= 0.5 * (1.0 + math.cos(math.pi * t / total))
    elif cfg.lr_schedule == "step":
        milestones = cfg.lr_milestones or [int(0.5 * rounds), int(0.75 * rounds)]
        lr *= cfg.lr_gamma ** sum(1 for m in milestones if r >= m)
    if cfg.lr_warmup_rounds and r < cfg.lr_warmup_rounds:
        lr *= (t + 1) / (cfg.lr_warmup_rounds * tau)
    return lr


class RunContext:
    """A method's view of the run (see the module docstring); built once per process by the trainer."""

    def __init__(self, cfg, world: World, data: Optional[ShardedData], rounds: int, *,
                 model_factory: Optional[Callable[[], nn.Module]] = None,
                 evaluate: Optional[Callable[[nn.Module], Dict[str, float]]] = None):
        """``data``: the shards the built-in local steps and scores read (None when a user's loop
        brings its own batches and ``evaluate`` its scores, see :mod:`ist_kernels.train.engine`); ``model_factory``: builds the global model in place of
        the config's."""
        self._cfg = cfg
        self.hp = HyperParams(cfg)
        self.world = world
        self.data = data
        self.dataset = data.dataset if data is not None else None
        self._model_factory = model_factory
        #: --model-spec: what the partitions take where a model's structure is not found (None: find it)
        self.model_spec = load_model_spec(cfg.model_spec)
        self._user_evaluate = evaluate
        self.rounds = rounds
        self.options: Dict[str, Any] = cfg.options
        self.num_workers = cfg.num_workers
        self.local_steps = cfg.local_steps
        self.device = world.device
        sync = (lambda: torch.cuda.synchronize(world.device)) if world.device.type == "cuda" else None
        self.clock = Clock(sync)
        self.comm = Comm(world_size=cfg.num_workers, rank=world.rank, distributed=world.distributed,
                         local_workers=self.local_workers, shared=cfg.shared, clock=self.clock,
                         compress=cfg.compress)
        self._scalers: Dict[int, Any] = {}  # worker -> torch.amp.GradScaler (--precision fp16)
        #: --compile: the workers' compiled models and the run's compile counts (None: eager)
        self.compiler: Optional[Compiler] = Compiler(self.device, self.clock) if getattr(cfg, "compile", False) else None
        dtype = AUTOCAST_DTYPES.get(cfg.precision)
        if dtype is not None and not _autocasts(self.device.type, dtype):
            raise ConfigError("precision", f"torch {torch.__version__} does not autocast {cfg.precision} on "
                              f"{self.device.type}; use --precision fp32 or bf16")

    # who am I
    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def distributed(self) -> bool:
        return self.world.distributed

    @property
    def simulated(self) -> bool:
        return self.world.simulated

    @property
    def decentralized(self) -> bool:
        """--storage: a worker holds only its subnetwork (distributed runs do; simulated ones count
        bytes and state as if they did)."""
        return self._cfg.storage == "decentralized"

    @property
    def local_workers(self) -> List[int]:
        """The workers this process trains: all S when simulated, its own rank otherwise."""
        return list(range(self.num_workers)) if self.world.simulated else [self.world.rank]

    # building blocks
    @property
    def in_features(self) -> int:
        """Inputs per sample, flattened (an MLP's first layer)."""
        return math.prod(self.dataset.input_shape)

    @property
    def num_outputs(self) -> int:
        return self.dataset.num_outputs

    def build_model(self, factory: Optional[Callable[[], nn.Module]] = None) -> nn.Module:
        """A fresh global model, initialised from the run's seed (identical on every rank and launch
        mode), on the device: the configured model by default, or ``factory()`` (e.g. a SubnetMLP)."""
        if factory is None and self._model_factory is None:
            return build_model(self._cfg, self.dataset).to(self.device)
        factory = factory or self._model_factory
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._cfg.seed)
            return factory().to(self.device)

    def generator(self, *tags: int) -> torch.Generator:
        """A CPU generator seeded from (seed, *tags): every rank derives the same one, so plans are
        never sent. ``ctx.generator(PLAN, r)`` gives round r's plan without any saved state."""
        return torch.Generator().manual_seed(_mix(self._cfg.seed, *tags))

    @property
    def local_optimizer(self) -> str:
        """The workers' local optimizer: the method's own (``inner_optimizer``: diloco's AdamW) or
        ``--optimizer``."""
        return inner_optimizer(self._cfg.method) or self._cfg.optimizer

    @property
    def param_state_tensors(self) -> int:
        """How many tensors of its parameter's shape the optimizer keeps per parameter: AdamW 2 (its
        moments), SGD 1 with momentum (its buffer), else 0."""
        if self.local_optimizer == "adamw":
            return 2
        return int(self._momentum() > 0)

    def _momentum(self) -> float:
        m = self._cfg.momentum
        return DEFAULT_MOMENTUM if m is None else m  # (a config not validated)

    def full_state_bytes(self, model: nn.Module) -> int:
        """Parameters, buffers and the optimizer's state of the whole ``model`` (SGD with momentum: a
        buffer per parameter; AdamW: two moments and a 0-dim float32 step per parameter): what one
        worker training all of it holds."""
        return ledger.full_state_bytes(model, self.param_state_tensors, 4 if self.local_optimizer == "adamw" else 0)

    def make_optimizer(self, params, **hyper) -> torch.optim.Optimizer:
        """The local optimizer of ``params`` (:attr:`local_optimizer`: the method's own or --optimizer):
        torch.optim.SGD (--momentum, --nesterov, --weight-decay) or torch.optim.AdamW (--betas, --eps,
        --weight-decay); ``hyper`` overrides those (a method's own, e.g. diloco's AdamW options). The
        learning rate is set before every step (:meth:`set_lr`). On CUDA, the fused implementation
        (``fused=True``: one kernel per step for all the parameters; the same update to rounding);
        elsewhere torch's default."""
        c = self._cfg
        lr = c.lr if c.lr is not None else default_lr(c.method, c.optimizer)
        params = list(params)
        fused = {"fused": True} if fused_supported(params) else {}
        if self.local_optimizer == "adamw":
            kw = dict(lr=lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay, **fused)
            return torch.optim.AdamW(params, **{**kw, **hyper})
        kw = dict(lr=lr, momentum=self._momentum(), weight_decay=c.weight_decay, nesterov=c.nesterov, **fused)
        return torch.optim.SGD(params, **{**kw, **hyper})

    def compiled(self, turn: WorkerTurn) -> WorkerTurn:
        """``turn`` with its model compiled (--compile: :meth:`Compiler.wrap`, the worker's wrapper
        reused while its module is the same); ``turn`` itself when eager."""
        if self.compiler is None:
            return turn
        return dataclasses.replace(turn, model=self.compiler.wrap(turn.worker, turn.model))

    def lr_at(self, r: int, i: int) -> float:
        return lr_at(self._cfg, self.rounds, r, i)

    def set_lr(self, optimizer, r: int, i: int) -> float:
        lr = self.lr_at(r, i)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def autocast(self):
        """The forward's autocast region: --precision bf16 / fp16 (every op of the package autocasts,
        csrc/autocast.cpp); a no-op for fp32. Losses are computed in fp32 (:meth:`loss`)."""
        dtype = AUTOCAST_DTYPES.get(self._cfg.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def grad_scaler(self, worker: int) -> Optional["torch.amp.GradScaler"]:
        """--precision fp16: ``worker``'s gradient scaler (fp16 gradients underflow without one; on
        CUDA and on the CPU, both of which torch supports), kept across rounds so its scale carries
        over although optimizers are fresh every round, and checkpointed (:meth:`scaler_states`).
        None for fp32 / bf16."""
        if self._cfg.precision != "fp16":
            return None
        if worker not in self._scalers:
            self._scalers[worker] = torch.amp.GradScaler(self.device.type)
        return self._scalers[worker]

    def scaler_states(self) -> Dict[int, Dict[str, Any]]:
        return {w: s.state_dict() for w, s in self._scalers.items()}

    def load_scaler_states(self, states: Dict[int, Dict[str, Any]]) -> None:
        for w, state in states.items():
            scaler = self.grad_scaler(int(w))
            if scaler is not None:  # (a checkpoint's precision is checked to be the run's)
                scaler.load_state_dict(state)

    def backward_step(self, loss, optimizer, worker: int) -> None:
        """loss.backward() and optimizer.step(), through ``worker``'s gradient scaler under fp16 (a
        step whose gradients overflowed is skipped and the scale lowered, as torch.amp does)."""
        scaler = self.grad_scaler(worker)
        if scaler is None:
            loss.backward()
            optimizer.step()
            return
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    def logits(self, out) -> torch.Tensor:
        """The logits of a model's output (:func:`logits`), checked against the data's task: [B, C]
        with C >= the classes for classification, [B, T, V] with V >= the vocabulary for token data
        (ConfigError("model") otherwise: a user's model built for other data)."""
        out = logits(out)
        d = self.dataset
        if d is None:
            return out
        if d.task == "classification":
            if out.dim() != 2 or out.shape[1] < d.num_outputs:
                raise ConfigError("model", f"the model's output has shape {tuple(out.shape)}; classification of "
                                  f"{d.num_outputs} classes needs logits [batch, >= {d.num_outputs}] (a user's "
                                  f"model: e.g. --model-args num_classes={d.num_outputs})")
        elif d.task == "language_model":
            if out.dim() != 3 or out.shape[-1] < d.num_outputs:
                raise ConfigError("model", f"the model's output has shape {tuple(out.shape)}; token data of "
                                  f"vocabulary {d.num_outputs} need logits [batch, positions, >= {d.num_outputs}] "
                                  f"(a user's model: e.g. --model-args vocab_size={d.num_outputs})")
        return out

    def loss(self, out, y):
        """The loss of a model's output ``out`` (logits, or an object with ``.logits``) on targets ``y``:
        the data decide (cross-entropy on [B, C]; per position on [B, T, V] for token data, mean over
        the tokens; MSE for regression), computed in fp32."""
        out = self.logits(out)
        if self.dataset.task == "language_model":  # logits [B, T, V], targets [B, T]: mean over tokens
            if out.shape[:2] != y.shape:
                raise ConfigError("model", f"the model's logits {tuple(out.shape)} do not match the targets "
                                  f"{tuple(y.shape)} (one position per input token)")
            return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
        if self.dataset.task == "classification":
            return F.cross_entropy(out.float(), y)
        return F.mse_loss(out.float().reshape(y.shape), y)

    def batch(self, worker: int, r: int, i: int):
        """Batch of local step i of round r for ``worker`` (the same in every launch mode)."""
        return self.data.batch(worker, r * self.local_steps + i)

    def turn_batch(self, turn, r: int, i: int):
        """Batch of local step i of round r for a :class:`~ist_kernels.train.methods.WorkerTurn`: its
        worker's batch, or its ``batch_workers``' batches concatenated (simulated DDP)."""
        if len(turn.batch_workers) == 1:
            return self.batch(turn.batch_workers[0], r, i)
        batches = [self.batch(s, r, i) for s in turn.batch_workers]
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    def train(self, turn, r: int, steps: Optional[int] = None) -> torch.Tensor:
        """The built-in local steps of ``turn`` (a :class:`~ist_kernels.train.methods.WorkerTurn`)
        in round r: ``steps`` (default local_steps) steps on its batches with the learning rate
        schedule, timed as ``local``. Returns the summed loss as a float64 0-dim tensor on the
        device (no host synchronisation per step); a turn over several workers' batches (simulated
        DDP) counts each step's loss once per worker."""
        model, optimizer = turn.model, turn.optimizer
        with self.clock("local"):
            model.train()
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            for i in range(self.local_steps if steps is None else steps):
                self.set_lr(optimizer, r, i)
                x, y = self.turn_batch(turn, r, i)
                optimizer.zero_grad(set_to_none=True)
                with self.autocast():
                    out = model(x)
                loss = self.loss(out, y)
                self.backward_step(loss, optimizer, turn.worker)
                if turn.on_step is not None:
                    turn.on_step()
                total += turn.counted(loss.detach())
            if self.compiler is not None:  # what compiling took goes to ``compile``
                self.compiler.charge()
            return total

    def train_local(self, model: nn.Module, optimizer, worker: int, r: int, steps: Optional[int] = None) -> float:
        """:meth:`train` of ``worker``'s ``model`` and ``optimizer``, its summed loss as a float."""
        return float(self.train(WorkerTurn(worker, model, optimizer), r, steps))

    @property
    def scored_on(self) -> Optional[str]:
        """The split the built-in scores read: ``"holdout"`` (--holdout) or ``"test"``; None when a
        user's loop brings its own scores (or no data)."""
        if self._user_evaluate is not None or self.data is None:
            return None
        return self.data.scored_on

    @torch.no_grad()
    def bn_recalibrated(self, model: nn.Module, batches: int) -> nn.Module:
        """``model`` itself when it has no BatchNorm with running statistics, else a copy whose
        statistics are the plain average over ``batches`` training batches (``--eval-bn-batches``):
        batch k is worker k mod S's step k // S, a function of (worker, step) that draws nothing, so
        training sees the same batches."""
        def norms(net: nn.Module) -> List[nn.Module]:
            return [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

        if not norms(model):
            return model
        copy_ = copy.deepcopy(model)
        for m in norms(copy_):
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
        copy_.train()
        S = self.data.num_workers
        for k in range(batches):
            x, _ = self.data.batch(k % S, k // S)
            with self.autocast():
                copy_(x)
        return copy_

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> Dict[str, float]:
        """Scores of ``model`` on the test set (with --holdout: on the held-out part of the training
        set instead, :attr:`scored_on`; the keys stay the same): test_loss and, for classification, accuracy; for a
        language model the mean cross-entropy per token (nats), ``bits_per_byte`` (it over ln 2; for
        data whose positions are not bytes, e.g. BPE ids: ``bits_per_token``) and ``accuracy`` (of the
        next byte / token). A user's loop may bring its own scores (``evaluate``
        given to the context), or none (no data: no scores)."""
        if self._user_evaluate is not None:
            was_training = model.training
            try:
                return dict(self._user_evaluate(model))
            finally:
                model.train(was_training)
        if self.data is None:
            return {}
        if self._cfg.eval_bn_batches:
            model = self.bn_recalibrated(model, self._cfg.eval_bn_batches)
        was_training = model.training
        model.eval()
        loss_sum, correct, n = 0.0, 0, 0
        task = self.dataset.task
        for x, y in self.data.eval_batches(self._cfg.eval_batch_size):
            with self.autocast():
                out = self.logits(model(x))
            count = y.numel() if task == "language_model" else len(y)
            loss_sum += float(self.loss(out, y)) * count
            if task != "regression":
                correct += int((out.argmax(-1) == y).sum())
            n += count
        model.train(was_training)
        res = {"test_loss": loss_sum / max(n, 1)}
        if task != "regression":
            res["accuracy"] = correct / max(n, 1)
        if task == "language_model":
            res[f"bits_per_{getattr(self.dataset, 'token_unit', 'byte')}"] = res["test_loss"] / math.log(2)
        return res


def fused_supported(params) -> bool:
    """torch's fused SGD / AdamW can take ``params``: all on CUDA, floating point, torch >= 2.6
    (fused SGD came in 2.4 and AdamW's on more dtypes by 2.6; the CPU keeps the default
    implementation, so CPU results stay bit for bit)."""
    if not params or _torch_version() < (2, 6):
        return False
    tensors = [p for group in params for p in group["params"]] if isinstance(params[0], dict) else params
    return bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)


def _torch_version() -> tuple:
    try:
        return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


def logits(out) -> torch.Tensor:
    """A model's output as its logits: a tensor as it is; an object or mapping with ``logits`` (Hugging
    Face's ModelOutput); else the first element of a tuple or list (``return_dict=False``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    found = getattr(out, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ConfigError("model", f"the model returned a {type(out).__name__}; expected logits (a tensor) or an "
                      f"object with .logits")


def evaluate(ctx: RunContext, model: nn.Module) -> Dict[str, float]:
    """``ctx.evaluate(model)``."""
    return ctx.evaluate(model)
