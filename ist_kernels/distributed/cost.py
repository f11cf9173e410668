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
- :func:`predict_round` adds compute (local steps x a measured or FLOP-derived step time),
  fixed per-round work (plans, packing; measured) and the communication; :func:`time_to_target`
  reads a run's curve.

Compression (the trainer's ``--compress``): :func:`exchange_bytes` counts the encoded bytes exactly
(``plan_bytes(compress=...)``, scales included, the shared tensors' two-stage average in the
all-to-all entries); :func:`subnet_round_bytes` and :func:`localsgd_round_bytes` scale by
:func:`wire_fraction` (bf16 1/2, int8 1/4; int8's fp32 scale per slice or segment is left out: under
1% for slices of 400 values or more).

Everything is in bytes and seconds. What the model leaves out: compute and communication never
overlap (true of the subnetwork methods and local SGD here; DDP overlaps its bucketed all-reduces
with the backward pass, so its prediction is an upper bound), and the CPU time of the network
stack itself (it competes with compute when ranks share cores).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from .compress import COMPRESS
from .exchange import plan_bytes
from .quantize import CODEC_BYTES

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


def wire_fraction(compress: Optional[str] = "none") -> float:
    """Bytes on the wire per fp32 byte under ``--compress`` (int8's scales left out)."""
    if compress is None:
        return 1.0
    if compress not in COMPRESS:
        raise ValueError(f"wire_fraction: compress must be one of {', '.join(COMPRESS)}, got {compress!r}")
    return {"none": 1.0, "bf16": 0.5, "int8": 0.25}[compress]


# ---------------------------------------------------------------- collectives

def ring_all_reduce_bytes(nbytes: float, S: int) -> float:
    """Bytes a rank sends (and receives) in a ring all-reduce of an ``nbytes`` buffer."""
    return 2.0 * (S - 1) / S * nbytes if S > 1 else 0.0


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


def subnet_round_bytes(partitioned: float, shared: float, S: int, owners: float = 1.0,
                       compress: Optional[str] = "none") -> Dict[str, float]:
    """Per rank, one decentralized round of subnetworks cut from a state of ``partitioned`` bytes
    (dealt among the S subnetworks, each slice to ``owners`` of them) and ``shared`` bytes (held
    whole by all): a rank holds partitioned * owners / S of the partitioned state and sends each of
    its slices to that slice's next owners except itself (owners (1 - 1/S) of them on average),
    then the shared state goes through a ring all-reduce.

    Returns ``all_to_all`` (sent = received, on average), ``all_reduce`` (the buffer) and ``wire``
    (what the rank sends). With owners = 1 (LOFT, IST: every slice has one owner) the all-to-all is
    partitioned (S - 1) / S^2; with owners k > 1 (ResIST once S x min_depth exceeds the blocks)
    it is partitioned k^2 (S - 1) / S^2: owner averaging sends every copy to every next owner.
    ``compress``: every byte times :func:`wire_fraction` (the compressed average of the shared
    state sends what the ring all-reduce sends, encoded)."""
    if S < 1 or owners < 1 or owners > S:
        raise ValueError(f"subnet_round_bytes: need 1 <= owners <= S, got S={S}, owners={owners}")
    f = wire_fraction(compress)
    a2a = partitioned * owners * owners * (S - 1) / S ** 2 * f
    return {"all_to_all": a2a, "all_reduce": float(shared) * f, "wire": a2a + ring_all_reduce_bytes(shared, S) * f}


def localsgd_round_bytes(state: float, S: int, compress: Optional[str] = "none") -> float:
    """Per rank, local SGD's round: one ring all-reduce of the whole averaged state (``compress``:
    the two-stage compressed average, the same 2 (S - 1) / S of it, encoded)."""
    return ring_all_reduce_bytes(state, S) * wire_fraction(compress)


def diloco_round_bytes(state: float, S: int, outer_grad: str = "fp32") -> float:
    """Per rank, a DiLoCo round: local SGD's bytes (one ring all-reduce of the ``state`` bytes of
    float32 parameters) times the pseudo-gradient's element size over float32's (``outer_grad``
    fp32 / bf16 / int8: 4 / 2 / 1 bytes; int8 also sends one 4-byte scale per chunk, left out)."""
    if outer_grad not in CODEC_BYTES:
        raise ValueError(f"diloco_round_bytes: outer_grad must be one of {', '.join(CODEC_BYTES)}, got {outer_grad!r}")
    return localsgd_round_bytes(state, S) * CODEC_BYTES[outer_grad] / 4


def rank_state_bytes(partitioned: float, shared: float, S: int, owners: float = 1.0,
                     optimizer_copies: float = 1.0) -> float:
    """Memory a rank holds for its subnetwork: its share of the partitioned state plus the shared
    state, times (1 + ``optimizer_copies``) for parameters that carry optimizer state (SGD with
    momentum: 1 buffer; Adam: 2); pass the parameter bytes, buffers count once."""
    return (partitioned * min(owners, S) / S + shared) * (1.0 + optimizer_copies)


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


def step_flops(model, input_shape: Sequence[int], batch: int) -> int:
    """FLOPs of one training step (forward + backward, cross-entropy on random labels) of
    ``model`` on a batch of ``batch`` inputs of ``input_shape``, counted by torch's FlopCounterMode
    (matrix products and convolutions; elementwise work is not counted). A model on the meta
    device is counted without computing anything."""
    p = next(model.parameters())
    x = torch.randn(batch, *input_shape, device=p.device, dtype=p.dtype)
    with FlopCounterMode(display=False) as fc:
        out = model(x)
        y = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
        torch.nn.functional.cross_entropy(out, y).backward()
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def speedup(baseline_s: Optional[float], method_s: Optional[float]) -> Optional[float]:
    """baseline / method (None when either is missing or zero)."""
    if not baseline_s or not method_s or not math.isfinite(baseline_s) or not math.isfinite(method_s):
        return None
    return baseline_s / method_s
