"""The round engine in your own training loop.

``ist-train`` runs a method's rounds with its own local steps. :class:`Engine` runs the same rounds
(the same plans, subnetworks, exchange, owner-averaging, outer step, byte and time accounting,
checkpoints and exact resume: the same :class:`ist_kernels.train.runner.Run` object ``ist-train``
uses) and hands each worker's subnetwork and optimizer to *your* loop for its local steps::

    engine = Engine(model=my_factory, method="ist", workers=2, rounds=10, local_steps=8, lr=0.1)
    for rnd in engine.rounds():          # round r: the engine plans it and cuts the subnetworks
        for worker in rnd:               # the workers this process trains, as the method asks
            model, opt = worker.model, worker.optimizer
            for x, y in my_batches(worker.index, rnd.index):    # your data, loss, schedule, logging
                opt.zero_grad(); loss = my_loss(model(x), y); loss.backward(); opt.step()
                worker.add_loss(loss)    # optional: metrics.jsonl's train_loss
        # leaving the round: exchange, owner-average, outer step, scores, metrics, checkpoint
    full = engine.global_model()         # the full model on demand (every rank calls it)
    summary = engine.close()             # model.pt, summary.json (rank 0)

Launch modes: under ``torchrun --nproc-per-node S`` each process trains one worker (its rank; the
engine creates the process group, gloo on CPUs, NCCL on GPUs, unless one exists); in one process
without torchrun it trains the S = ``workers`` workers one after another (the simulated mode, the
reference the distributed run equals).

``model``: a factory (a callable returning an ``nn.Module``; every rank calls it under the same seed,
so every rank starts from the same model) or a ``"module:factory"`` string as ``ist-train --model``
takes. ``dataset`` (optional): a data set ``ist-train`` knows (``"digits"``, ``"pycode"``, ...): then
``worker.batches()`` gives the very batches ``ist-train``'s local steps would use (with its learning
rate schedule applied to the optimizer before each), and the engine scores the full model on its
test split as ``ist-train`` does; without one, pass ``evaluate=fn(model) -> dict`` for scores (or
none). Every other keyword is an ``ist-train`` option by its config name (``lr``, ``momentum``,
``options={"partition": "heads"}``, ``storage``, ``out_dir``, ``checkpoint_interval``, ``resume``,
``seed``, ``timeout_s``, ...): ``Engine.options()`` lists them.

How it works: a method's round has two phases (:mod:`ist_kernels.train.methods`): entering a round
runs the first (``Run.begin_round``: the plan, the subnetworks and their optimizers, the workers'
turns), iterating it hands you the turns one after another, and leaving the iteration runs the second
(``Run.end_round``: exchange, aggregation, outer step, scores, metrics, checkpoint). Everything runs in
your thread, in your loop's order: no thread, no queue; an exception raises where it happens (in the
engine's phases, out of the ``for`` statement that entered or left them). The time your loop spends
with a worker is the round's ``local`` time.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from torch import nn

from ..distributed import destroy_process_group, init_process_group
from .config import TrainConfig, under_torchrun
from .datasets import ShardedData, augment_default, load_dataset, register_factory
from .errors import ConfigError
from .launch import resolve_backend, resolve_device, set_threads
from .methods import WorkerTurn
from .runner import Run, World


class Worker:
    """One worker's turn in a round: ``model`` (its subnetwork, or the whole model for local-SGD
    methods), ``optimizer`` (over ``model``'s parameters, built by the engine from the config: SGD
    with ``lr``, ``momentum``, ``weight_decay``, or AdamW with ``optimizer="adamw"``), ``index`` (the
    worker, 0..S-1), ``round`` (r). With ``compile=True``, ``model`` is the ``torch.compile``d one
    (its parameters are the module's; compiled once per structure, the time is ``compile``'s)."""

    def __init__(self, engine: "Engine", turn: WorkerTurn, r: int):
        self.model, self.optimizer, self.index, self.round = turn.model, turn.optimizer, turn.worker, r
        self._turn = turn
        self._engine = engine
        self.loss_sum: Union[float, torch.Tensor] = 0.0
        self.steps = 0

    def add_loss(self, loss: Union[float, torch.Tensor], steps: int = 1) -> None:
        """Count a local step's loss into the round's ``train_loss`` (metrics.jsonl); a tensor stays
        on its device (no host synchronisation)."""
        v = loss.detach().double() if isinstance(loss, torch.Tensor) else float(loss)
        self.loss_sum = self.loss_sum + self._turn.counted(v)  # (simulated ddp: once per worker's batch)
        self.steps += steps

    def batches(self) -> Iterator:
        """The ``local_steps`` batches ``(x, y)`` ``ist-train`` would give this worker in this round
        (needs ``dataset``); before each, the optimizer's learning rate is set from the schedule, and
        after each step the method's per-step hook runs (ddp: its gradient all-reduce's count)."""
        ctx = self._engine._run.ctx
        if ctx.data is None:
            raise RuntimeError("Worker.batches(): the engine has no dataset; pass Engine(dataset=...) or bring "
                               "your own batches")
        for i in range(ctx.local_steps):
            ctx.set_lr(self.optimizer, self.round, i)
            yield ctx.turn_batch(self._turn, self.round, i)
            if self._turn.on_step is not None:
                self._turn.on_step()

    def loss(self, out, y) -> torch.Tensor:
        """``ist-train``'s loss for the dataset's task (cross-entropy on logits, or on ``.logits``)."""
        return self._engine._run.ctx.loss(out, y)


class Round:
    """Round ``index``: iterate it for the workers this process trains (:class:`Worker`); the round
    ends (exchange, aggregation, scores, metrics, checkpoint) when the iteration does. ``record``:
    the round's metrics.jsonl record once it ended."""

    def __init__(self, engine: "Engine", r: int):
        self.engine, self.index = engine, r
        self.record: Optional[Dict[str, Any]] = None
        self._used = False

    def __iter__(self) -> Iterator[Worker]:
        if self._used:
            raise RuntimeError(f"round {self.index} was iterated already")
        self._used = True
        eng = self.engine
        run, clock = eng._run, eng._run.ctx.clock
        finished = False
        try:
            turns = run.begin_round(self.index)
            losses = []
            for turn in turns:
                worker = Worker(eng, turn, self.index)
                with clock("local"):
                    yield worker
                    if run.ctx.compiler is not None:  # (--compile) what compiling took goes to ``compile``
                        run.ctx.compiler.charge()
                losses.append(worker.loss_sum)
            self.record = run.end_round(self.index, losses)
            finished = True
        except Exception as e:  # re-raised: the engine is broken from here on
            eng._broken = e
            raise
        finally:
            if not finished and eng._broken is None:  # the loop left the round early (break, an error in it)
                eng._broken = RuntimeError(f"round {self.index} did not finish (the training loop left it); "
                                           f"the engine cannot continue: resume from its last checkpoint")


class Engine:
    """The round engine for a user's own loop (see the module docstring)."""

    def __init__(self, model: Union[Callable[[], nn.Module], str], *, method: str = "ist",
                 workers: Optional[int] = None, dataset: Optional[str] = None,
                 evaluate: Optional[Callable[[nn.Module], Dict[str, float]]] = None, **config: Any):
        if isinstance(config.get("device"), torch.device):  # a torch.device as the string the config takes
            config["device"] = str(config["device"])
        if "simulate" in config or "model" in config:
            raise TypeError("Engine: pass the model as the first argument and the worker count as workers=")
        unknown = sorted(set(config) - {f.name for f in dataclasses.fields(TrainConfig)})
        if unknown:
            raise TypeError(f"Engine: unknown option(s) {', '.join(unknown)}; see Engine.options()")
        distributed = under_torchrun()
        if distributed:
            S = int(os.environ["WORLD_SIZE"])
            if workers is not None and workers != S:
                raise ConfigError("workers", f"is {workers} but torchrun started WORLD_SIZE={S} processes")
        else:
            S = 1 if workers is None else workers
        if isinstance(model, str):
            name = model
        elif callable(model):  # built and probed by its label, as ist-train builds MODULE:FACTORY
            name = register_factory(_label(model), model)
        else:
            raise ConfigError("model", f"expected a factory (a callable returning an nn.Module) or 'module:factory', "
                              f"got {type(model).__name__}")
        cfg = TrainConfig()
        values = {"method": method, "model": name, "dataset": dataset or "none", "progress": False,
                  **config}
        if distributed:
            values["workers"] = S
        elif S > 1:
            values["simulate"] = S
        else:  # one worker (the config's default without torchrun would be 2)
            values.update(simulate=0, workers=1)
        cfg.update(values, "Engine()")
        cfg.validate(data=dataset is not None)
        self.config = cfg
        rank = int(os.environ["RANK"]) if distributed else 0
        local_rank = int(os.environ["LOCAL_RANK"]) if distributed else 0
        device = resolve_device(cfg, local_rank, S if distributed else 1)
        set_threads(cfg, S if distributed else 1)  # as ist-train (--threads fixes the float sums)
        self._own_group = False
        if distributed:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if not torch.distributed.is_initialized():
                init_process_group(resolve_backend(cfg, device), timeout=cfg.timeout_s)
                self._own_group = True
        self._world = World(rank, S if distributed else 1, local_rank, simulated=not distributed and S > 1,
                            device=device)
        data = None
        if dataset is not None:
            data = ShardedData(load_dataset(cfg), cfg.num_workers, cfg.batch_size, cfg.seed, device,
                               augment_default(cfg))
        self._broken: Optional[BaseException] = None
        self._summary: Optional[Dict[str, Any]] = None
        self._closed = False
        self._run = Run(cfg, self._world, data=data, scores=evaluate, load_data=False)
        self._begun = False

    # -- what the engine is
    @staticmethod
    def options() -> List[str]:
        """The keyword options Engine takes besides model, method, workers, dataset and evaluate."""
        return sorted(f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("model", "simulate"))

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def local_workers(self) -> List[int]:
        return self._run.ctx.local_workers

    @property
    def history(self) -> List[Dict[str, Any]]:
        """metrics.jsonl's records so far (rank 0)."""
        return self._run.history

    # -- the rounds
    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: closed")
        if self._broken is not None:
            raise RuntimeError(f"Engine: a round failed ({self._broken}); resume from the last checkpoint") \
                from self._broken

    def rounds(self) -> Iterator[Round]:
        """The rounds left (from 0, or from the checkpoint with ``resume=True``), one :class:`Round`
        each; iterate each round's workers before asking for the next round."""
        self._check()
        if not self._begun:
            try:
                self._run.begin()
            except Exception as e:
                self._broken = e
                raise
            self._begun = True
        for r in self._run.pending():
            self._check()
            rnd = Round(self, r)
            yield rnd
            if not rnd._used:
                raise RuntimeError(f"Engine: round {r} was skipped: iterate its workers (for worker in rnd)")
            self._check()

    def global_model(self) -> nn.Module:
        """The full model now (assembled from the workers' parts; every rank must call it)."""
        self._check()
        return self._run.global_model()

    def close(self) -> Optional[Dict[str, Any]]:
        """Write model.pt and summary.json (rank 0) and return the summary (None on other ranks);
        leaves the process group the engine created."""
        if self._closed:
            return self._summary
        try:
            if self._broken is None:
                if not self._begun:
                    self._run.begin()
                    self._begun = True
                self._summary = self._run.finish()
        finally:
            self._closed = True
            if self._own_group:
                destroy_process_group()
        return self._summary

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._closed = True
            if self._own_group:
                destroy_process_group()


def _label(factory: Callable) -> str:
    """``MODULE:QUALNAME`` of a factory: what summary.json and the default output folder name."""
    mod = getattr(factory, "__module__", None) or "callable"
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    return f"{mod}:{name.replace('<', '').replace('>', '')}"
