"""Synchronous data parallel SGD (torch DistributedDataParallel): the gradient of every step is
averaged over the S workers. One round is ``local_steps`` synchronous steps, so rounds and budgets
compare with the local-step methods. Simulated: one process, one model, each step on the S workers'
batches concatenated (the same gradient up to float rounding; BatchNorm statistics then cover the
S-fold batch instead of rank 0's batch)."""
from __future__ import annotations

from typing import List

from . import Method, RoundResult, WorkerTurn, held_bytes, register_method, summed


@register_method("ddp")
class DDP(Method):
    compresses = False
    compress_refusal = ("ddp averages gradients inside torch's DistributedDataParallel, which sends them "
                        "uncompressed; use --compress none")

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = ctx.build_model()
        self.net = self.model
        if ctx.distributed:
            dev = [ctx.device] if ctx.device.type == "cuda" else None
            self.net = ctx.comm.data_parallel(self.model, device_ids=dev)
        self.optimizer = ctx.make_optimizer(self.model.parameters())
        S = ctx.num_workers
        # per step: every worker all_reduces its gradients (ring wire bytes, counted by ctx.comm);
        # rank 0 sends its buffers to the S - 1 others (DDP's broadcast_buffers). The initial
        # broadcast of the model at construction is not counted (every rank builds the same model).
        self._grads = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self._buffers = (S - 1) * sum(b.numel() * b.element_size() for b in self.model.buffers())
        # parameter-server count: every step each worker uploads its gradients and downloads the model
        self._ps_per_step = 2 * self._grads if S > 1 else 0
        self.full_state_bytes = ctx.full_state_bytes(self.model)

    def begin_round(self, r: int) -> List[WorkerTurn]:
        """One turn: the (DDP-wrapped) model, each step on the local workers' batches (simulated: all
        S concatenated, one synchronous step); the all-reduces the backward pass hides are in its
        local time, every step counted (``gradient_step_done``)."""
        ctx = self.ctx
        return [WorkerTurn(ctx.local_workers[0], self.net, self.optimizer, batch_workers=tuple(ctx.local_workers),
                           on_step=ctx.comm.gradient_step_done)]

    def end_round(self, r: int, losses) -> RoundResult:
        ctx, tau = self.ctx, self.ctx.local_steps
        n = len(ctx.local_workers)
        ctx.comm.count_all_reduce(self._grads, times=tau)
        if ctx.rank == 0:
            ctx.comm.count_sent(tau * self._buffers)
        state = held_bytes(self.model, self.optimizer)
        return RoundResult(loss_sum=summed(losses), steps=n * tau, ps_bytes=n * tau * self._ps_per_step,
                           state_bytes={s: state for s in ctx.local_workers})

    def global_model(self):
        return self.model

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
