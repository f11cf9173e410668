"""A cost model of a training round: how long it takes on S workers over a link of a given
bandwidth and latency, how many bytes each rank sends, and how much state each rank holds.

Plain functions of the plans (their byte counts) and of measured compute, no process group:

- :class:`Link`: per-rank bandwidth (each direction, like a host NIC: a rank's uploads share it,
  and so do its downloads) and one-way latency; TCP/IPv4 over Ethernet delivers
  :data:`TCP_EFFICIENCY` of the line rate as payload (1448 bytes of every 1514-byte frame).
- The collectives as gloo and NCCL run them: a ring all-reduce of n bytes sends and receives
  2 (S - 1) / S n per rank in 2 (S - 1) steps (:func:`ring_all_reduce_s`); an all-to-all posts every
  send at once, so a rank takes max(sent, received) over its link plus one latency
  (:func:`all_to_all_s`). A round's communication waits for its slowest rank.
- Bytes from the plans: :func:`exchange_bytes` (the exact per-rank count of one
  ``Exchange``, from ``plan_bytes``) and, for thousands of workers where building plans is too
  costly, :func:`subnet_round_bytes` from the plan's state split (what every subnetwork holds whole
  vs what it partitions) and the owners per slice; :func:`rank_state_bytes` for memory.
- :func:`predict_round` adds compute (local steps x a measured or FLOP-derived step time: the FLOP
  model is :func:`step_flops` and, per part of the model, :func:`split_step_flops`),
  fixed per-round work (plans, packing; measured) and the communication; :func:`time_to_target`
  reads a run's curve.

Compression (the trainer's ``--compress``): :func:`exchange_bytes` counts the encoded bytes exactly
(``plan_bytes(compress=...)``, scales included, the shared tensors' two-stage average in the
all-to-all entries); :func:`subnet_round_bytes` and :func:`localsgd_round_bytes` scale by
:func:`wire_fraction` (bf16 1/2, int8 1/4; int8's fp32 scale per slice or segment is left out: under
1% for slices of 400 values or more).

The byte formulas (the ring all-reduce's 2 (S - 1) / S, the per-rank round bytes, the held state,
:func:`wire_fraction`) are :mod:`.ledger`'s, imported here under the same names.

Everything is in bytes and seconds. What the model leaves out: compute and communication never
overlap (true of the subnetwork methods and local SGD here; DDP overlaps its bucketed all-reduces
with the backward pass, so its prediction is an upper bound), and the CPU time of the network
stack itself (it competes with compute when ranks share cores).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from .exchange import plan_bytes
from .ledger import (  # noqa: F401  (the byte formulas, the ledger's, under the cost model's names)
    diloco_round_bytes,
    localsgd_round_bytes,
    rank_state_bytes,
    ring_all_reduce_bytes,
    subnet_round_bytes,
    wire_fraction,
)

#: payload / line rate of TCP over IPv4 on Ethernet at MTU 1500 with TCP timestamps: 1448 / 1514
TCP_EFFICIENCY = 1448 / 1514


@dataclass(frozen=True)
class Link:
    """Each rank's link: ``bandwidth_bps`` bit/s in each direction (None: unlimited, e.g. loopback,
    where only the measured overhead counts), ``latency_s`` one way per message, and the fraction
    of the line rate that carries payload."""
    bandwidth_bps: Optional[float] = None
    latency_s: float = 0.0
    efficiency: float = TCP_EFFICIENCY

    def __post_init__(self):
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"Link: bandwidth_bps must be > 0 or None, got {self.bandwidth_bps!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"Link: latency_s must be >= 0, got {self.latency_s!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link: efficiency must be in (0, 1], got {self.efficiency!r}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to push ``nbytes`` of payload through the link (no latency)."""
        if self.bandwidth_bps is None or nbytes <= 0:
            return 0.0
        return 8.0 * nbytes / (self.bandwidth_bps * self.efficiency)


# ---------------------------------------------------------------- collectives

def ring_all_reduce_s(nbytes: float, S: int, link: Link) -> float:
    """Reduce-scatter then all-gather around a ring: 2 (S - 1) steps of n / S each way."""
    if S < 2 or nbytes <= 0:
        return 0.0
    return link.transfer_s(ring_all_reduce_bytes(nbytes, S)) + 2 * (S - 1) * link.latency_s


def all_to_all_s(sent: float, received: float, link: Link) -> float:
    """One rank's all-to-all: every send posted at once, so its link carries ``sent`` out and
    ``received`` in concurrently."""
    if sent <= 0 and received <= 0:
        return 0.0
    return link.transfer_s(max(sent, received)) + link.latency_s


def exchange_s(per_rank: Sequence[Tuple[float, float, float]], S: int, link: Link) -> float:
    """An exchange round's communication: the slowest rank's all-to-all (sent, received) plus the
    ring all-reduce of the shared tensors (the third entry, the buffer's bytes; equal on every rank)."""
    if not per_rank:
        return 0.0
    a2a = max(all_to_all_s(s, r, link) for s, r, _ in per_rank)
    return a2a + ring_all_reduce_s(max(ar for _, _, ar in per_rank), S, link)


def comm_s(bytes_per_rank: float, link: Link, latencies: int = 0) -> float:
    """Communication time of a round whose busiest rank sends ``bytes_per_rank`` (its wire bytes:
    all-to-all payload plus the ring all-reduces' 2 (S - 1) / S) with ``latencies`` message steps
    in a row. For a symmetric round (ring all-reduce, a balanced all-to-all) a rank's link carries
    as much in as out, so its sent bytes set the time."""
    return link.transfer_s(bytes_per_rank) + latencies * link.latency_s


# ---------------------------------------------------------------- bytes from the plans

def exchange_bytes(current, next, spec, *, storage: str = "decentralized",
                   shared: str = "all_reduce", compress: Optional[str] = None) -> List[Tuple[int, int, int]]:
    """(all-to-all bytes sent, received, all-reduced buffer bytes) of every rank for one exchange
    from plan ``current`` to ``next``, counted exactly from the plans (``plan_bytes``). ``compress``
    ("bf16", "int8"): the encoded bytes; the shared tensors' compressed average runs as all-to-alls,
    so its bytes are in the first two entries and the buffer is 0."""
    return [(st.all_to_all_bytes_sent + st.average_bytes_sent,
             st.all_to_all_bytes_received + st.average_bytes_received, st.all_reduce_bytes)
            for st in plan_bytes(current, next, spec, storage=storage, shared=shared,
                                 compress=None if compress == "none" else compress)]


def resist_owners(S: int, partitioned_blocks: int, min_depth: int) -> float:
    """Owners per partitioned block in a ResIST round: each of S sub-ResNets takes
    max(min_depth, blocks / S) of the blocks, so every block goes to S * that / blocks of them."""
    if partitioned_blocks < 1:
        return 1.0
    return min(float(S), max(1.0, S * max(min_depth, partitioned_blocks / S) / partitioned_blocks))


# ---------------------------------------------------------------- time

@dataclass
class RoundCost:
    """One predicted round: ``compute`` (local steps), ``overhead`` (plans, packing, unpacking),
    ``comm`` (the link), and the bytes the busiest rank sends."""
    compute: float
    overhead: float
    comm: float
    bytes_per_rank: float

    @property
    def total(self) -> float:
        return self.compute + self.overhead + self.comm

    def as_dict(self) -> Dict[str, float]:
        return {"compute_s": self.compute, "overhead_s": self.overhead, "comm_s": self.comm,
                "round_time_s": self.total, "bytes_per_rank": self.bytes_per_rank}


def predict_round(*, steps: int, step_s: float, bytes_per_rank: float, link: Link, overhead_s: float = 0.0,
                  latencies: int = 0, comm_floor_s: float = 0.0) -> RoundCost:
    """A round of ``steps`` local steps of ``step_s`` each, then communication of ``bytes_per_rank``
    over ``link`` (never less than ``comm_floor_s``: what the same collectives measured without a
    bandwidth limit, e.g. over loopback)."""
    if steps < 0 or step_s < 0 or bytes_per_rank < 0 or overhead_s < 0:
        raise ValueError("predict_round: steps, step_s, bytes_per_rank and overhead_s must be >= 0")
    comm = max(comm_s(bytes_per_rank, link, latencies), comm_floor_s)
    return RoundCost(steps * step_s, overhead_s, comm, bytes_per_rank)


def time_to_target(round_seconds: Sequence[float], accuracies: Sequence[Optional[float]],
                   target: float) -> Optional[float]:
    """Training seconds until the first evaluated round whose accuracy reaches ``target``: the sum
    of ``round_seconds`` up to and including it (None if none does). ``accuracies[i]`` is None for
    a round without evaluation."""
    if len(round_seconds) != len(accuracies):
        raise ValueError("time_to_target: round_seconds and accuracies differ in length")
    total = 0.0
    for t, a in zip(round_seconds, accuracies):
        total += t
        if a is not None and a >= target:
            return total
    return None


def rounds_to_target(accuracies: Iterable[Optional[float]], target: float) -> Optional[int]:
    """1-based index of the first round whose accuracy reaches ``target`` (None: never)."""
    for i, a in enumerate(accuracies):
        if a is not None and a >= target:
            return i + 1
    return None


def _step_counter(model, x: torch.Tensor) -> FlopCounterMode:
    """torch's FLOP counter over one training step of ``model`` on ``x`` (forward, cross-entropy on
    zero labels, backward)."""
    with FlopCounterMode(display=False) as fc:
        out = model(x)
        y = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
        torch.nn.functional.cross_entropy(out, y).backward()
    return fc


def step_flops(model, input_shape: Sequence[int], batch: int) -> int:
    """FLOPs of one training step (forward + backward, cross-entropy on random labels) of
    ``model`` on a batch of ``batch`` inputs of ``input_shape``, counted by torch's FlopCounterMode
    (matrix products and convolutions; elementwise work is not counted). A model on the meta
    device is counted without computing anything."""
    p = next(model.parameters())
    fc = _step_counter(model, torch.randn(batch, *input_shape, device=p.device, dtype=p.dtype))
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def split_step_flops(model, input_shape: Sequence[int], batch: int, partitioned) -> Tuple[float, float]:
    """(FLOPs of a training step in the leaf modules whose weight is in ``partitioned``, a set of
    parameter names such as a plan's partitioned tensors; FLOPs of the rest): :func:`step_flops`
    counted per module, on a copy of ``model`` on the meta device (shapes only, nothing computed;
    ``model`` is left as it is)."""
    meta = copy.deepcopy(model).to("meta")
    fc = _step_counter(meta, torch.randn(batch, *input_shape, device="meta"))
    total = float(fc.get_total_flops())
    leaf = {n for n, m in meta.named_modules() if not list(m.children())}
    part = 0.0
    for key, ops in fc.get_flop_counts().items():
        name = key.split(".", 1)[1] if "." in key else ""  # "<RootClass>.<module path>"
        if name in leaf and f"{name}.weight" in partitioned:
            part += float(sum(ops.values()))
    return part, total - part


def speedup(baseline_s: Optional[float], method_s: Optional[float]) -> Optional[float]:
    """baseline / method (None when either is missing or zero)."""
    if not baseline_s or not method_s or not math.isfinite(baseline_s) or not math.isfinite(method_s):
        return None
    return baseline_s / method_s
