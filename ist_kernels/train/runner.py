"""The training loop every method shares: data shards -> method rounds -> evaluation, metrics,
checkpoints. Methods see it through :class:`RunContext`.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .config import restart_count, under_torchrun
from .datasets import ShardedData, _mix, augment_default, load_dataset
from .methods import get_method
from .models import build_model

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
    lr = cfg.lr
    if cfg.lr_schedule == "cosine":
        lr *= 0.5 * (1.0 + math.cos(math.pi * t / total))
    elif cfg.lr_schedule == "step":
        milestones = cfg.lr_milestones or [int(0.5 * rounds), int(0.75 * rounds)]
        lr *= cfg.lr_gamma ** sum(1 for m in milestones if r >= m)
    if cfg.lr_warmup_rounds and r < cfg.lr_warmup_rounds:
        lr *= (t + 1) / (cfg.lr_warmup_rounds * tau)
    return lr


class RunContext:
    """Everything a method needs; built once per process by :func:`train`."""

    def __init__(self, cfg, world: World, data: ShardedData, rounds: int):
        self.cfg = cfg
        self.world = world
        self.data = data
        self.dataset = data.dataset
        self.rounds = rounds
        self.options: Dict[str, Any] = cfg.options
        self.num_workers = cfg.num_workers
        self.device = world.device
        #: bytes this process sent assembling the full model (evaluation, the final save); methods add
        #: to it in global_model(), the trainer reads it, counted apart from the training bytes
        self.gather_bytes = 0
        self._scalers: Dict[int, Any] = {}  # worker -> torch.amp.GradScaler (--precision fp16)
        dtype = AUTOCAST_DTYPES.get(cfg.precision)
        if dtype is not None and not _autocasts(self.device.type, dtype):
            from .config import ConfigError

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
        """cfg.storage: a worker holds only its subnetwork (distributed runs do; simulated ones count
        bytes and state as if they did)."""
        return self.cfg.storage == "decentralized"

    @property
    def local_workers(self) -> List[int]:
        """The workers this process trains: all S when simulated, its own rank otherwise."""
        return list(range(self.num_workers)) if self.world.simulated else [self.world.rank]

    def all_reduce_(self, tensor, what: str, r: int):
        """In-place SUM over the processes (no-op simulated or with one process). A dead or stalled
        rank raises ist_kernels.distributed.CollectiveError naming ``what`` and the round, within
        cfg.timeout_s."""
        if self.distributed:
            from ..distributed.group import collective_timeout, wait_collective

            wait_collective(lambda: dist.all_reduce(tensor, async_op=True), name=f"all_reduce ({what})",
                            round=r + 1, timeout=collective_timeout())
        return tensor

    # building blocks
    @property
    def in_features(self) -> int:
        """Inputs per sample, flattened (an MLP's first layer)."""
        return math.prod(self.dataset.input_shape)

    @property
    def num_outputs(self) -> int:
        return self.dataset.num_outputs

    def build_model(self, factory: Optional[Callable[[], nn.Module]] = None) -> nn.Module:
        """A fresh global model, initialised from cfg.seed (identical on every rank and launch
        mode), on the device: cfg.model by default, or ``factory()`` (e.g. a SubnetMLP)."""
        if factory is None:
            return build_model(self.cfg, self.dataset).to(self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return factory().to(self.device)

    def generator(self, *tags: int) -> torch.Generator:
        """A CPU generator seeded from (cfg.seed, *tags): every rank derives the same one, so plans
        are never sent. ``ctx.generator(PLAN, r)`` gives round r's plan without any saved state."""
        return torch.Generator().manual_seed(_mix(self.cfg.seed, *tags))

    def full_state_bytes(self, model: nn.Module) -> int:
        """Parameters, buffers and (with momentum) one SGD momentum buffer per parameter of the whole
        ``model``: what one worker training all of it holds."""
        tensors = list(model.state_dict().values())
        mom = [p for p in model.parameters() if p.requires_grad] if self.cfg.momentum > 0 else []
        return sum(t.numel() * t.element_size() for t in tensors + mom)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        c = self.cfg
        return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                               nesterov=c.nesterov)

    def lr_at(self, r: int, i: int) -> float:
        return lr_at(self.cfg, self.rounds, r, i)

    def set_lr(self, optimizer, r: int, i: int) -> float:
        lr = self.lr_at(r, i)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def autocast(self):
        """The forward's autocast region: --precision bf16 / fp16 (every op of the package autocasts,
        csrc/autocast.cpp); a no-op for fp32. Losses are computed in fp32 (:meth:`loss`)."""
        dtype = AUTOCAST_DTYPES.get(self.cfg.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def grad_scaler(self, worker: int) -> Optional["torch.amp.GradScaler"]:
        """--precision fp16: ``worker``'s gradient scaler (fp16 gradients underflow without one; on
        CUDA and on the CPU, both of which torch supports), kept across rounds so its scale carries
        over although optimizers are fresh every round, and checkpointed (:meth:`scaler_states`).
        None for fp32 / bf16."""
        if self.cfg.precision != "fp16":
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

    def loss(self, out, y):
        if self.dataset.task == "classification":
            return F.cross_entropy(out.float(), y)
        return F.mse_loss(out.float().reshape(y.shape), y)

    def batch(self, worker: int, r: int, i: int):
        """Batch of local step i of round r for ``worker`` (the same in every launch mode)."""
        return self.data.batch(worker, r * self.cfg.local_steps + i)

    def train_local(self, model: nn.Module, optimizer, worker: int, r: int, steps: Optional[int] = None) -> float:
        """``steps`` (default local_steps) SGD steps of ``worker`` in round r; returns the summed loss."""
        model.train()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for i in range(self.cfg.local_steps if steps is None else steps):
            self.set_lr(optimizer, r, i)
            x, y = self.batch(worker, r, i)
            optimizer.zero_grad(set_to_none=True)
            with self.autocast():
                out = model(x)
            loss = self.loss(out, y)
            self.backward_step(loss, optimizer, worker)
            total += loss.detach()
        return float(total)


@torch.no_grad()
def evaluate(ctx: RunContext, model: nn.Module) -> Dict[str, float]:
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    for x, y in ctx.data.test_batches(ctx.cfg.eval_batch_size):
        with ctx.autocast():
            out = model(x)
        loss_sum += float(ctx.loss(out, y)) * len(y)
        if ctx.dataset.task == "classification":
            correct += int((out.argmax(1) == y).sum())
        n += len(y)
    model.train(was_training)
    res = {"test_loss": loss_sum / max(n, 1)}
    if ctx.dataset.task == "classification":
        res["accuracy"] = correct / max(n, 1)
    return res


def resolve_rounds(cfg, shard_size: int) -> int:
    if cfg.rounds is not None:
        rounds = cfg.rounds
    elif cfg.epochs is not None:
        rounds = max(1, math.ceil(cfg.epochs * shard_size / (cfg.batch_size * cfg.local_steps)))
    else:
        rounds = 20
    return min(rounds, 3) if cfg.quick and not cfg.demo else rounds


def _barrier(world: World, what: str, r: int):
    """A barrier that, like every collective of the trainer, names itself and the round when a peer
    dies or stalls (CollectiveError within cfg.timeout_s)."""
    if world.distributed:
        from ..distributed.group import collective_timeout, wait_collective

        wait_collective(lambda: dist.barrier(async_op=True), name=f"barrier ({what})", round=r,
                        timeout=collective_timeout())


def _crash_for_tests(r: int, world: World) -> None:
    """Tests of elastic restarts only: with IST_TEST_FAIL_AT_ROUND=k0,k1,... the last rank of
    attempt n (TORCHELASTIC_RESTART_COUNT n) dies before round k_n + 1, as a crashed machine would."""
    at = os.environ.get("IST_TEST_FAIL_AT_ROUND")
    if at is None or not under_torchrun() or world.rank != world.world_size - 1:
        return
    rounds = [int(k) for k in at.split(",")]
    n = restart_count()
    if n < len(rounds) and r == rounds[n]:
        os._exit(3)


class RankStateError(RuntimeError):
    """A rank held more parameters, buffers and optimizer state than --max-rank-state-mb allows."""


def train(cfg, world: World) -> Optional[Dict[str, Any]]:
    """Run one config on this process; returns the summary on rank 0 (None elsewhere)."""
    from .output import MetricsLog, progress_bar

    method_cls = get_method(cfg.method)
    dataset = load_dataset(cfg)
    data = ShardedData(dataset, cfg.num_workers, cfg.batch_size, cfg.seed, world.device, augment_default(cfg))
    rounds = resolve_rounds(cfg, data.shard_size)
    ctx = RunContext(cfg, world, data, rounds)
    method = method_cls(ctx)
    rank0 = world.rank == 0
    out_dir = cfg.resolved_out_dir()
    ckpt_dir = cfg.resolved_checkpoint_dir()
    S = cfg.num_workers

    start, history, train_time, wall0 = 0, [], 0.0, 0.0
    if cfg.resume:
        payload = checkpoint.restore(ckpt_dir, world.rank, world.world_size, cfg, method)
        start, history = payload["round"], payload.get("history", [])
        train_time, wall0 = payload["train_time"], payload["wall_time"]
        ctx.load_scaler_states(payload.get("grad_scalers", {}))
        if start > rounds:
            from .config import ConfigError

            raise ConfigError("rounds", f"the checkpoint is at round {start}, past rounds={rounds}")
    log = MetricsLog(os.path.join(out_dir, "metrics.jsonl"), history) if rank0 else None
    t_start = time.perf_counter() - wall0
    totals = ({k: history[-1][k] for k in ("total_bytes", "total_ps_bytes", "total_gather_bytes")}
              if history else dict(total_bytes=0, total_ps_bytes=0, total_gather_bytes=0))
    assembled = {}  # round -> the full model assembled for it (rank 0), reused by the final save

    def sum_over_ranks(values, what, r):
        t = torch.tensor(values, dtype=torch.float64, device=world.device)
        return [int(v) if i else v for i, v in enumerate(ctx.all_reduce_(t, what, r).tolist())]

    def eval_record(r):
        """The full model's scores after round r (rank 0) and what assembling it sent (all ranks)."""
        ctx.gather_bytes = 0
        model = method.global_model()
        if r == end:  # kept for the final save (only then: it may be the whole model, on rank 0)
            assembled[r] = model
        return method.evaluate(model) if rank0 else {}

    # stop_after: stop once that many rounds are done (a checkpoint is written), resume later
    end = rounds if cfg.stop_after is None else min(rounds, cfg.stop_after)
    if start == 0:
        scores = eval_record(0)
        (_, gathered) = sum_over_ranks([0.0, ctx.gather_bytes], "the evaluation's bytes", -1)
        totals["total_gather_bytes"] += gathered
        rec = {"round": 0, "train_loss": None, "bytes_sent": 0, "ps_bytes": 0,
               "gather_bytes": gathered, **totals, "train_time": 0.0, "wall_time": 0.0, "lr": ctx.lr_at(0, 0),
               **scores}
        if rank0:
            log.append(rec)

    bar = progress_bar(rounds, start, rank0 and cfg.progress, desc=f"{cfg.method} S={S}")
    cap = None if cfg.max_rank_state_mb is None else cfg.max_rank_state_mb * 1e6
    for r in range(start, end):
        _crash_for_tests(r, world)
        t0 = time.perf_counter()
        res = method.run_round(r)
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        train_time += time.perf_counter() - t0
        done = r + 1
        scores = {}
        ctx.gather_bytes = 0
        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == rounds:
            scores = eval_record(done)
        per_worker = [0] * S
        for s, b in (res.state_bytes or {}).items():
            per_worker[s] = b
        stats = sum_over_ranks([res.loss_sum, res.steps, res.bytes_sent, res.ps_bytes, ctx.gather_bytes, *per_worker],
                               "the round's metrics", r)
        loss_sum, steps, bytes_sent, ps, gathered, per_worker = stats[0], stats[1], stats[2], stats[3], stats[4], stats[5:]
        totals["total_bytes"] += bytes_sent
        totals["total_ps_bytes"] += ps
        totals["total_gather_bytes"] += gathered
        rec = {"round": done, "train_loss": loss_sum / max(steps, 1), "bytes_sent": bytes_sent,
               "ps_bytes": ps, "gather_bytes": gathered, **totals, "rank_state_bytes": max(per_worker),
               "train_time": train_time, "lr": ctx.lr_at(r, 0), **(res.extra or {}), **scores}
        rec["wall_time"] = time.perf_counter() - t_start
        if rank0:
            log.append(rec)
            bar.update(1)
            bar.set_postfix({k: f"{rec[k]:.4g}" for k in ("train_loss", "accuracy") if rec.get(k) is not None})
        if cap is not None and max(per_worker) > cap:  # every rank sees the same sums: all stop here
            worst = max(range(S), key=lambda s: per_worker[s])
            raise RankStateError(
                f"worker {worst} held {per_worker[worst] / 1e6:.3f} MB of parameters, buffers and optimizer state "
                f"in round {done}, above --max-rank-state-mb {cfg.max_rank_state_mb:g} (the whole model's state: "
                f"{method.full_state_bytes / 1e6:.3f} MB; storage={cfg.storage}, method {cfg.method})")
        if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == end:
            checkpoint.save(ckpt_dir, done, world.rank, world.world_size, {
                "config": cfg.to_dict(), "num_workers": S, "method": method.state_dict(),
                "rng": checkpoint.rng_state(), "grad_scalers": ctx.scaler_states(),
                "history": log.history if rank0 else [],
                "train_time": train_time, "wall_time": rec["wall_time"]},
                barrier=lambda what: _barrier(world, what, done),
                manifest={"storage": cfg.storage if S > 1 else "single",
                          "holds": "this rank's subnetwork and the shared tensors" if
                          cfg.storage == "decentralized" and world.distributed else "the whole state"})
    bar.close()

    ctx.gather_bytes = 0
    model = assembled[end] if end in assembled else method.global_model()
    final_gather = ctx.gather_bytes  # outside metrics.jsonl (a stop_after run assembles after its last round)
    final_gather = sum_over_ranks([0.0, final_gather], "the final save's bytes", end)[1]
    summary = _write_outputs(cfg, world, method, model, log.history, final_gather, rounds, out_dir) if rank0 else None
    # every rank leaves together, once rank 0 has written the outputs (none tears its process group
    # down while another still works)
    _barrier(world, "the run's outputs written", end)
    return summary


def _write_outputs(cfg, world, method, model, hist, final_gather, rounds, out_dir) -> Dict[str, Any]:
    """summary.json and model.pt of a finished (or stopped) run, on rank 0; returns the summary."""
    from .output import bytes_by_phase

    S = cfg.num_workers
    final = hist[-1]
    if "test_loss" not in final:  # stopped between evaluations (stop_after): score the model now,
        final = {**final, **method.evaluate(model)}  # outside metrics.jsonl, which resume continues
    trained = hist[1:]
    summary = {
        "method": cfg.method, "model": cfg.model, "dataset": cfg.dataset, "workers": S,
        "mode": "simulated" if world.simulated else ("distributed" if world.distributed else "single"),
        "storage": cfg.storage, "shared": cfg.shared,
        "rounds": final["round"], "finished": final["round"] == rounds,
        "accuracy": final.get("accuracy"), "test_loss": final.get("test_loss"),
        "train_loss": final.get("train_loss"), "train_time": final["train_time"],
        "total_bytes": final["total_bytes"], "total_ps_bytes": final["total_ps_bytes"],
        "bytes_per_round": final["total_bytes"] / max(len(trained), 1),
        "ps_bytes_per_round": final["total_ps_bytes"] / max(len(trained), 1),
        **bytes_by_phase(hist, method.phases, gather=final["total_gather_bytes"] + final_gather),
        "rank_state_bytes": max((rec.get("rank_state_bytes", 0) for rec in trained), default=0),
        "full_state_bytes": method.full_state_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "out_dir": out_dir, **method.summary(),
    }
    from .checkpoint import atomic_json, atomic_torch_save

    atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(out_dir, "model.pt"))
    atomic_json(summary, os.path.join(out_dir, "summary.json"))
    return summary
