"""Synchronous data parallel SGD (torch DistributedDataParallel): the gradient of every step is
averaged over the S workers. One round is ``local_steps`` synchronous steps, so rounds and budgets
compare with the local-step methods. Simulated: one process, one model, each step on the S workers'
batches concatenated (the same gradient up to float rounding; BatchNorm statistics then cover the
S-fold batch instead of rank 0's batch)."""
from __future__ import annotations

import torch

from . import Method, RoundResult, held_bytes, register_method


@register_method("ddp")
class DDP(Method):
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

    def run_round(self, r: int) -> RoundResult:
        ctx, tau = self.ctx, self.ctx.local_steps
        with ctx.clock("local"):  # the all-reduces the backward pass hid are in here; the rest is comm
            self.net.train()
            total = torch.zeros((), dtype=torch.float64, device=ctx.device)
            for i in range(tau):
                ctx.set_lr(self.optimizer, r, i)
                batches = [ctx.batch(s, r, i) for s in ctx.local_workers]
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
                self.optimizer.zero_grad(set_to_none=True)
                with ctx.autocast():
                    out = self.net(x)
                loss = ctx.loss(out, y)
                ctx.backward_step(loss, self.optimizer, worker=ctx.local_workers[0])
                ctx.comm.gradient_step_done()
                total += loss.detach() * len(batches)  # the mean of the workers' losses, once per worker
        n = len(ctx.local_workers)
        ctx.comm.count_all_reduce(self._grads, times=tau)
        if ctx.rank == 0:
            ctx.comm.count_sent(tau * self._buffers)
        state = held_bytes(self.model, self.optimizer)
        return RoundResult(loss_sum=float(total), steps=n * tau, ps_bytes=n * tau * self._ps_per_step,
                           state_bytes={s: state for s in ctx.local_workers})

    def global_model(self):
        return self.model

    def state_dict(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
