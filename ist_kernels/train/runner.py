"""The training loop every method shares: data shards -> method rounds -> evaluation, metrics,
checkpoints. Methods see it through their worker view (:class:`ist_kernels.train.context.RunContext`),
and every round's time is split into parts (:mod:`ist_kernels.train.timing`): ``metrics.jsonl``
gets a ``time`` object per round, ``summary.json`` the totals (``time_by_part``) and the mean round
time of each phase (``round_time_by_phase``).
"""
from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed import ledger
from ..distributed.group import collective_timeout, wait_collective
from . import checkpoint
from .checkpoint import atomic_json, atomic_torch_save
from .config import restart_count, under_torchrun
from .context import AUTOCAST_DTYPES, RunContext, World, evaluate, lr_at  # noqa: F401  (the trainer's API)
from .datasets import ShardedData, augment_default, load_dataset
from .errors import ConfigError, RankStateError
from .methods import WorkerTurn, get_method
from .output import MetricsLog, bytes_by_phase, progress_bar, time_by_phase
from .timing import PARTS, TRAIN_PARTS


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


def _machine_id() -> int:
    """48 bits that differ between machines (Linux: the kernel's boot id; else the host name), exact
    in a float64: processes with equal ids share one monotonic clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return int(f.read().strip().replace("-", "")[:12], 16)
    except (OSError, ValueError):
        return int(hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12], 16)


def _delay_for_tests(world: World) -> None:
    """Tests of the peer-wait measurement only: with IST_TEST_DELAY_RANK=rank:seconds that rank
    sleeps that long at the start of every round, as a slower machine would."""
    spec = os.environ.get("IST_TEST_DELAY_RANK")
    if spec is not None and world.distributed:
        rank, secs = spec.split(":")
        if world.rank == int(rank):
            time.sleep(float(secs))


def rank0_wait(entered: torch.Tensor, seconds: torch.Tensor) -> float:
    """Seconds rank 0 waited for the last rank in collectives it entered with every rank:
    ``entered`` (ranks x collectives) the ranks' entry times, ``seconds`` rank 0's time in each.
    Each collective's wait is the latest entry minus rank 0's, at most rank 0's seconds in it: one
    that completed before a peer entered it (gloo's point-to-point all-to-all with nothing to
    receive from that peer) did not wait for the peer, and the ranks meet at a later one."""
    if entered.shape[1] == 0:
        return 0.0
    late = (entered.max(dim=0).values - entered[0]).clamp(min=0)
    return float(torch.minimum(late, seconds.clamp(min=0)).sum())


def _warm_up() -> None:
    """One-time set-up every run pays once per process, before its first round: torch imports its
    compiler stack on the first optimizer built (about a second on a CPU), which would otherwise
    land in whichever round builds one first."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


class Run:
    """One run of one config on this process, a round at a time: the round engine as a library.

    ``Run(cfg, world)`` sets the run up (data shards, the method, a checkpoint to resume from);
    :meth:`begin` scores round 0 (a fresh run); a round is :meth:`begin_round` (the method plans it
    and cuts this process's workers' subnetworks: their :class:`~ist_kernels.train.methods.WorkerTurn`
    s), the turns' local steps, then :meth:`end_round` (the method's exchange, aggregation and outer
    step, then the round's evaluation, metrics and checkpoint); :meth:`finish` writes the outputs
    (rank 0) and returns the summary. ``ist-train`` is ``for r in run.pending(): run.round(r)``
    between the two (:func:`train`; :meth:`round` trains the turns with the built-in local steps);
    a user's own loop (:mod:`ist_kernels.train.engine`) trains the turns itself, with its own
    scores (``scores``) in place of the data set's.

    ``data``: the sharded data the built-in local steps and scores read (default: the config's data
    set, unless ``load_data`` is False: a user's loop that brings its own batches); ``model_factory``:
    builds the global model (default: the config's model); ``scores``: ``fn(model) -> dict``
    replacing the built-in test-set scores.
    """

    def __init__(self, cfg, world: World, *, data=None, model_factory=None, scores=None, load_data: bool = True):
        t_setup = time.perf_counter()
        _warm_up()
        self.cfg, self.world = cfg, world
        method_cls = get_method(cfg.method)
        if data is None and load_data:
            dataset = load_dataset(cfg)
            data = ShardedData(dataset, cfg.num_workers, cfg.batch_size, cfg.seed, world.device, augment_default(cfg))
        self.rounds = resolve_rounds(cfg, data.shard_size if data is not None else 0)
        self.ctx = ctx = RunContext(cfg, world, data, self.rounds, model_factory=model_factory, evaluate=scores)
        self.method = method_cls(ctx)
        self.rank0 = world.rank == 0
        self.out_dir = cfg.resolved_out_dir()
        self.ckpt_dir = cfg.resolved_checkpoint_dir()
        self.start, history, self.train_time, wall0 = 0, [], 0.0, 0.0
        if cfg.resume:
            payload = checkpoint.restore(self.ckpt_dir, world.rank, world.world_size, cfg, self.method)
            self.start, history = payload["round"], payload.get("history", [])
            self.train_time, wall0 = payload["train_time"], payload["wall_time"]
            ctx.load_scaler_states(payload.get("grad_scalers", {}))
            if self.start > self.rounds:
                raise ConfigError("rounds", f"the checkpoint is at round {self.start}, past rounds={self.rounds}")
        ctx.comm.take()
        ctx.clock.take()  # set-up is not a round's
        self.setup_time = time.perf_counter() - t_setup
        self.log = MetricsLog(os.path.join(self.out_dir, "metrics.jsonl"), history) if self.rank0 else None
        self.t_start = time.perf_counter() - wall0
        self.totals = ({k: history[-1][k] for k in ("total_bytes", "total_ps_bytes", "total_gather_bytes")}
                       if history else dict(total_bytes=0, total_ps_bytes=0, total_gather_bytes=0))
        self.assembled = {}  # round -> the full model assembled for it (rank 0), reused by the final save
        self.machine_id = _machine_id() if world.distributed else 0  # read once, compared every round
        # stop_after: stop once that many rounds are done (a checkpoint is written), resume later
        self.end = self.rounds if cfg.stop_after is None else min(self.rounds, cfg.stop_after)
        self.cap = None if cfg.max_rank_state_mb is None else cfg.max_rank_state_mb * 1e6
        self.bar = None
        self.scored = {rec["round"] for rec in history if "test_loss" in rec}  # rounds whose model was scored
        self._open = None  # (round, its start, its turns) between begin_round and end_round

    @property
    def history(self):
        """metrics.jsonl's records so far (rank 0; empty elsewhere)."""
        return self.log.history if self.log is not None else []

    def pending(self) -> range:
        """The rounds this run has left: from the checkpoint's (or 0) to rounds (or stop_after)."""
        return range(self.start, self.end)

    def _sum_over_ranks(self, values, what, r):
        """The round's metrics summed over the ranks (the trainer's bookkeeping: timed as
        ``metrics``, its bytes not counted as the method's)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.world.device)
        if self.world.distributed:
            wait_collective(lambda: dist.all_reduce(t, async_op=True), name=f"all_reduce ({what})",
                            round=r + 1, timeout=collective_timeout())
        return [int(v) if i else v for i, v in enumerate(t.tolist())]

    def _wait_for_peers(self, entered, k_sum, k_squares, r) -> Optional[float]:
        """This round's seconds rank 0 waited in its collectives for the last rank to enter them:
        the sum over the collectives every rank entered (``Comm.entered``: when, and how long the
        collective took there) of the latest entry minus rank 0's, each at most rank 0's seconds in
        that collective (one that completed before a peer entered it did not wait for the peer: a
        wait is a part of ``comm``). None when not distributed, when the ranks entered different
        numbers of collectives (the sums of the counts and of their squares, the same on every rank,
        say so), or when they run on several machines (their boot ids differ), whose monotonic
        clocks do not compare. Every rank gets rank 0's."""
        world = self.world
        P = world.world_size
        if not world.distributed or P < 2 or P * k_squares != k_sum * k_sum:
            return None
        k = k_sum // P
        t = torch.zeros(P, 2 * k + 1, dtype=torch.float64, device=world.device)
        t[world.rank] = torch.tensor([*(e for e, _ in entered), *(s for _, s in entered), self.machine_id],
                                     dtype=torch.float64)
        wait_collective(lambda: dist.all_reduce(t, async_op=True), name="all_reduce (the collectives' entry times)",
                        round=r + 1, timeout=collective_timeout())
        if not bool((t[:, -1] == t[0, -1]).all()):
            return None
        return rank0_wait(t[:, :k], t[0, k:2 * k])

    def _eval_record(self, r):
        """The full model's scores after round r (rank 0); what assembling it sent is in comm."""
        with self.ctx.clock("eval"):
            model = self.method.global_model()
            if r == self.end:  # kept for the final save (only then: it may be the whole model, on rank 0)
                self.assembled[r] = model
            self.scored.add(r)
            if not self.rank0:
                return {}
            scores = self.method.evaluate(model)
            split = self.ctx.scored_on  # which split those scores read (--holdout: "holdout")
            return {**scores, "scored_on": split} if split is not None and scores else scores

    @staticmethod
    def _timed(parts: Dict[str, float], wall: float) -> Dict[str, float]:
        out = {k: round(parts[k], 6) for k in PARTS}
        out["other"] = round(wall - sum(parts.values()), 6)
        out["round"] = round(wall, 6)
        return out

    def begin(self) -> None:
        """Round 0's record (the initial model's scores) on a fresh run, and the progress bar."""
        ctx, cfg = self.ctx, self.cfg
        if self.start == 0:
            t0 = time.perf_counter()
            scores = self._eval_record(0)
            with ctx.clock("metrics"):
                (_, gathered) = self._sum_over_ranks([0.0, ctx.comm.take()["gathered"]], "the evaluation's bytes", -1)
                self.totals["total_gather_bytes"] += gathered
                rec = {"round": 0, "train_loss": None, "bytes_sent": 0, "ps_bytes": 0,
                       "gather_bytes": gathered, **self.totals, "train_time": 0.0, "wall_time": 0.0,
                       "lr": ctx.lr_at(0, 0), **scores}
            rec["time"] = self._timed(ctx.clock.take(), time.perf_counter() - t0)
            if self.rank0:
                self.log.append(rec)
        self.bar = progress_bar(self.rounds, self.start, self.rank0 and cfg.progress,
                                desc=f"{cfg.method} S={cfg.num_workers}")

    def round(self, r: int) -> Dict[str, Any]:
        """Round r with the built-in local steps: :meth:`begin_round`, ``ctx.train`` of every turn,
        :meth:`end_round`; returns the round's record."""
        turns = self.begin_round(r)
        return self.end_round(r, [self.ctx.train(turn, r) for turn in turns])

    def begin_round(self, r: int) -> List[WorkerTurn]:
        """Round r's first phase: the method plans it and cuts this process's workers' (sub)models;
        returns their turns (train each, then call :meth:`end_round`)."""
        if self._open is not None:
            raise RuntimeError(f"Run: round {self._open[0]} was begun and not ended")
        if r not in self.pending():
            raise RuntimeError(f"Run: round {r} is not pending (rounds left: {self.start}..{self.end - 1})")
        _crash_for_tests(r, self.world)
        t0 = time.perf_counter()
        _delay_for_tests(self.world)
        turns = [self.ctx.compiled(turn) for turn in self.method.begin_round(r)]  # (--compile)
        self._open = (r, t0, len(turns))
        return turns

    def end_round(self, r: int, losses: Sequence) -> Dict[str, Any]:
        """Round r's second phase, after its turns' local steps (``losses``: each turn's summed
        loss, a float or a 0-dim tensor, in the turns' order): the method's exchange, aggregation
        and outer step, then its scores (every ``eval_interval`` rounds and the last), the metrics
        summed over the ranks, a checkpoint when one is due; returns the round's record
        (metrics.jsonl's line; rank 0's carries the scores)."""
        if self._open is None or self._open[0] != r:
            raise RuntimeError(f"Run: round {r} was not begun (begin_round first)")
        _, t0, n_turns = self._open
        if len(losses) != n_turns:
            raise ValueError(f"Run.end_round: round {r} handed out {n_turns} turns, got {len(losses)} losses")
        self._open = None
        ctx, cfg, world, method, S = self.ctx, self.cfg, self.world, self.method, self.cfg.num_workers
        comm, clock = ctx.comm, ctx.clock
        res = method.end_round(r, list(losses))
        if world.device.type == "cuda":
            torch.cuda.synchronize(world.device)
        self.train_time += time.perf_counter() - t0
        done = r + 1
        taken = comm.take()
        sent = taken["sent"] + res.bytes_sent
        sent_by_worker, link_by_worker = [0] * S, [0] * S
        # what the method reported apart, shared evenly
        for s, apart in zip(ctx.local_workers, ledger.split_evenly(res.bytes_sent, len(ctx.local_workers))):
            sent_by_worker[s] = taken["sent_by_worker"][s] + apart
            link_by_worker[s] = taken["link_by_worker"][s] + apart
        scores = {}
        if (cfg.eval_interval and done % cfg.eval_interval == 0) or done == self.rounds:
            scores = self._eval_record(done)
        totals = self.totals
        with clock("metrics"):
            per_worker = [0] * S
            for s, b in (res.state_bytes or {}).items():
                per_worker[s] = b
            entered = taken["entered"]
            stats = self._sum_over_ranks([float(res.loss_sum), res.steps, sent, res.ps_bytes, comm.take()["gathered"],
                                          *per_worker, *sent_by_worker, *link_by_worker,
                                          len(entered), len(entered) ** 2], "the round's metrics", r)
            loss_sum, steps, bytes_sent, ps, gathered = stats[:5]
            per_worker, sent_by_worker, link_by_worker = stats[5:5 + S], stats[5 + S:5 + 2 * S], stats[5 + 2 * S:5 + 3 * S]
            peer_wait = self._wait_for_peers(entered, *stats[5 + 3 * S:], r)
            totals["total_bytes"] += bytes_sent
            totals["total_ps_bytes"] += ps
            totals["total_gather_bytes"] += gathered
            rec = {"round": done, "train_loss": loss_sum / max(steps, 1), "bytes_sent": bytes_sent,
                   "ps_bytes": ps, "gather_bytes": gathered, **totals, "rank_state_bytes": max(per_worker),
                   "max_worker_bytes_sent": max(sent_by_worker), "max_worker_link_bytes": max(link_by_worker),
                   "collectives": {k: round(v, 6) for k, v in taken["collectives"].items()},
                   **({} if peer_wait is None else {"peer_wait_s": round(peer_wait, 6)}),
                   "train_time": self.train_time, "lr": ctx.lr_at(r, 0), **(res.extra or {}), **scores}
        if self.cap is not None and max(per_worker) > self.cap:  # every rank sees the same sums: all stop here
            worst = max(range(S), key=lambda s: per_worker[s])
            raise RankStateError(
                f"worker {worst} held {per_worker[worst] / 1e6:.3f} MB of parameters, buffers and optimizer state "
                f"in round {done}, above --max-rank-state-mb {cfg.max_rank_state_mb:g} (the whole model's state: "
                f"{method.full_state_bytes / 1e6:.3f} MB; storage={cfg.storage}, method {cfg.method})")
        if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == self.end:
            # the checkpoint's history ends with this round, its time measured up to the checkpoint
            partial = {**rec, "time": self._timed(clock.peek(), time.perf_counter() - t0),
                       "wall_time": time.perf_counter() - self.t_start}
            with clock("checkpoint"):
                checkpoint.save(self.ckpt_dir, done, world.rank, world.world_size, {
                    "config": cfg.to_dict(), "num_workers": S, "method": method.state_dict(),
                    "rng": checkpoint.rng_state(), "grad_scalers": ctx.scaler_states(),
                    "history": self.log.history + [partial] if self.rank0 else [],
                    "train_time": self.train_time, "wall_time": time.perf_counter() - self.t_start},
                    barrier=lambda what: _barrier(world, what, done),
                    manifest={"storage": cfg.storage if S > 1 else "single",
                              "holds": "this rank's subnetwork and the shared tensors" if
                              cfg.storage == "decentralized" and world.distributed else "the whole state"})
        rec["time"] = self._timed(clock.take(), time.perf_counter() - t0)
        rec["wall_time"] = time.perf_counter() - self.t_start
        if self.rank0:
            self.log.append(rec)
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix({k: f"{rec[k]:.4g}" for k in ("train_loss", "accuracy") if rec.get(k) is not None})
        return rec

    def global_model(self):
        """The full model now (every rank calls it: it may gather; its bytes go to the next round's
        or the final record's gather count)."""
        return self.method.global_model()

    def finish(self) -> Optional[Dict[str, Any]]:
        """The run's outputs (model.pt, summary.json on rank 0); returns the summary on rank 0
        (None elsewhere). Every rank leaves together, once rank 0 has written them."""
        if self.bar is not None:
            self.bar.close()
        end, world = self.end, self.world
        model = self.assembled[end] if end in self.assembled else self.method.global_model()
        final_gather = self.ctx.comm.take()["gathered"]  # outside metrics.jsonl (a stop_after run assembles after its last round)
        final_gather = self._sum_over_ranks([0.0, final_gather], "the final save's bytes", end)[1]
        self.ctx.clock.take()
        summary = (_write_outputs(self.cfg, world, self.method, model, self.log.history, final_gather, self.rounds,
                                  self.out_dir, self.setup_time, scored=self.log.history[-1]["round"] in self.scored,
                                  scored_on=self.ctx.scored_on, compiler=self.ctx.compiler)
                   if self.rank0 else None)
        # none tears its process group down while another still works
        _barrier(world, "the run's outputs written", end)
        return summary


def train(cfg, world: World) -> Optional[Dict[str, Any]]:
    """Run one config on this process; returns the summary on rank 0 (None elsewhere)."""
    run = Run(cfg, world)
    run.begin()
    for r in run.pending():
        run.round(r)
    return run.finish()


def _write_outputs(cfg, world, method, model, hist, final_gather, rounds, out_dir, setup_time,
                   scored: bool = False, scored_on: Optional[str] = None, compiler=None) -> Dict[str, Any]:
    """summary.json and model.pt of a finished (or stopped) run, on rank 0; returns the summary.
    ``compiler``: --compile's (:class:`~ist_kernels.train.compiled.Compiler`): its counts of this
    process's compiles and recompiles go in (``compile``: whether the run compiled)."""
    S = cfg.num_workers
    final = hist[-1]
    if not scored and "test_loss" not in final:  # stopped between evaluations (stop_after): score the model now,
        final = {**final, **method.evaluate(model)}  # outside metrics.jsonl, which resume continues
    trained = hist[1:]
    summary = {
        "method": cfg.method, "model": cfg.model, "dataset": cfg.dataset, "workers": S,
        "mode": "simulated" if world.simulated else ("distributed" if world.distributed else "single"),
        "storage": cfg.storage, "shared": cfg.shared, "compress": cfg.compress,
        # the local optimizer (a method's own, e.g. diloco's AdamW, else --optimizer) and its resolved base lr
        "optimizer": method.inner_optimizer or cfg.optimizer, "lr": cfg.lr,
        "rounds": final["round"], "finished": final["round"] == rounds,
        "accuracy": final.get("accuracy"), "test_loss": final.get("test_loss"),
        # the split those scores read: "test", or "holdout" (--holdout: a part of the training set)
        "scored_on": scored_on, "holdout": getattr(cfg, "holdout", 0.0),
        **{k: final[k] for k in ("bits_per_byte", "bits_per_token") if k in final},
        "train_loss": final.get("train_loss"), "train_time": final["train_time"],
        "total_bytes": final["total_bytes"], "total_ps_bytes": final["total_ps_bytes"],
        "bytes_per_round": final["total_bytes"] / max(len(trained), 1),
        "ps_bytes_per_round": final["total_ps_bytes"] / max(len(trained), 1),
        **bytes_by_phase(hist, method.phases, gather=final["total_gather_bytes"] + final_gather),
        "rank_state_bytes": max((rec.get("rank_state_bytes", 0) for rec in trained), default=0),
        "full_state_bytes": method.full_state_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "setup_time": setup_time,
        "time_by_part": {k: sum(rec.get("time", {}).get(k, 0.0) for rec in hist) for k in (*PARTS, "other")},
        **time_by_phase(trained, method.phases, TRAIN_PARTS),
        "out_dir": out_dir, **method.summary(),
        "compile": compiler is not None,
        **({} if compiler is None else {k: v for k, v in compiler.counts().items() if k != "compile_s"}),
    }
    atomic_torch_save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(out_dir, "model.pt"))
    atomic_json(summary, os.path.join(out_dir, "summary.json"))
    return summary
