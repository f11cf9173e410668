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
  model is :func:`step_flops` and, per part of the model, :func:`split_step_flops`; for any model
  and input :func:`model_step_flops`, and per worker of a method :func:`subnetwork_step_flops`),
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
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.utils.flop_counter as _flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ..partition import is_transformer, loft_plan, resist_plan, transformer_ist_plan, transformer_resist_plan
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


# ---------------------------------------------------------------- FLOPs

def _sdpa_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _flop_counter.sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    # the gradients of the two products (of Q, K from the scores; of the scores, V from the values):
    # twice the forward's, as for any matrix product (flash kernels' recomputed scores not counted)
    return 2 * _flop_counter.sdpa_flop_count(query, key, value)


def _attention_mapping() -> Dict[Any, Any]:
    """Every fused attention kernel (CPU flash, CUDA flash / memory-efficient / cuDNN), forward and
    backward, counted alike: 2 (QK^T, PV) x 2 B H T_q T_k d forward over the full score matrix,
    twice that backward; the math path (meta device, masks the kernels do not take) runs bmm's that
    count the same. torch's own formulas leave the CPU kernel out and count a flash backward's
    recomputed scores."""
    out = {}
    for name, fn in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward),
                     ("_scaled_dot_product_flash_attention", _sdpa_forward),
                     ("_scaled_dot_product_efficient_attention", _sdpa_forward),
                     ("_scaled_dot_product_cudnn_attention", _sdpa_forward),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward),
                     ("_scaled_dot_product_flash_attention_backward", _sdpa_backward),
                     ("_scaled_dot_product_efficient_attention_backward", _sdpa_backward),
                     ("_scaled_dot_product_cudnn_attention_backward", _sdpa_backward)):
        op = getattr(torch.ops.aten, name, None)  # None: a torch without that kernel
        if op is not None:
            out[op] = fn
    return out


def flop_counter() -> FlopCounterMode:
    """torch's FlopCounterMode (no display) with the attention kernels counted as
    :func:`model_step_flops` states."""
    return FlopCounterMode(display=False, custom_mapping=_attention_mapping())


def _step_counter(model, x: torch.Tensor) -> FlopCounterMode:
    """torch's FLOP counter over one training step of ``model`` on ``x`` (forward, cross-entropy on
    zero labels, backward)."""
    with flop_counter() as fc:
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


#: the methods :func:`subnetwork_step_flops` counts: a subnetwork per worker, or the whole model on every worker
SUBNETWORK_METHODS = ("ist", "resist", "loft")
WHOLE_MODEL_METHODS = ("localsgd", "ddp", "diloco")


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deepcopy of ``model`` whose parameters and buffers are on the meta device (shapes, dtypes,
    ``requires_grad`` and ties kept; no tensor data copied)."""
    memo: Dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        m = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
    return copy.deepcopy(model, memo)


def _call_args(sample_input, device: Optional[str]) -> Tuple[tuple, dict]:
    """``sample_input`` as (args, kwargs): a tensor (one argument), a tuple or list (the positional
    arguments) or a mapping (keyword arguments); tensors moved to ``device`` (None: left)."""
    def move(v):
        return v.to(device) if device is not None and isinstance(v, torch.Tensor) else v
    if isinstance(sample_input, Mapping):
        return (), {k: move(v) for k, v in sample_input.items()}
    if isinstance(sample_input, (tuple, list)):
        return tuple(move(v) for v in sample_input), {}
    return (move(sample_input),), {}


def _first_tensor(out) -> torch.Tensor:
    """The tensor a step's loss is taken from: ``out`` itself, its ``logits`` (a Hugging Face
    ModelOutput), or the first tensor of a tuple, list or mapping."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = out.values() if isinstance(out, Mapping) or hasattr(out, "keys") else out
    if isinstance(items, Iterable):
        for v in items:
            if isinstance(v, torch.Tensor):
                return v
    raise TypeError(f"model_step_flops: the model returned {type(out).__name__}, with no tensor to take a loss from")


def _count_step(module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The FLOPs :func:`flop_counter` counts over ``module``'s forward on (args, kwargs) and the
    backward of the sum of its output (any loss: the loss itself has no matrix product)."""
    with flop_counter() as fc:
        loss = _first_tensor(module(*args, **kwargs)).sum()
        if loss.requires_grad:
            loss.backward()
    return int(fc.get_total_flops())


def model_step_flops(model: torch.nn.Module, sample_input, *, meta: bool = True) -> int:
    """FLOPs of one training step (forward and backward) of ANY ``model`` on ``sample_input`` (a
    tensor, a tuple of positional arguments or a mapping of keyword arguments: the batch of a step,
    e.g. tokens ``[B, T]``), counted by torch's FlopCounterMode from the operators that run.

    Convention: a multiply-add is 2 FLOPs; counted are the matrix products and convolutions (Linear,
    HF Conv1D, Conv1d/2d/3d, ``F.linear`` on a tied output embedding: the LM head counts like any
    Linear, bmm/matmul) and attention's score and value products (2 x 2 B H T_q T_k d forward over the
    whole T_q x T_k score matrix, a causal mask not halving it; the same on every device and kernel,
    see :func:`flop_counter`). Not counted: embedding lookups (0), bias adds, norms, activations,
    softmax, the loss, the optimizer's elementwise update. The backward is autograd's: every
    product's weight gradient (its forward's FLOPs) and input gradient (the same) where autograd
    needs it: a layer reading the data itself (an MLP's or CNN's first layer) computes no input
    gradient, a frozen parameter no weight gradient. So a language model (embeddings first) counts
    exactly 3x its forward; ``Sequential(Linear(I, H), act, Linear(H, O))`` on a batch of B counts
    4 B I H + 6 B H O.

    ``meta`` (default): counted on a copy on the meta device (nothing computed, no tensor data
    copied, ``model`` untouched); ``meta=False``: on a deepcopy where ``model`` is, computing (for a
    model whose forward reads tensor values, which the meta device cannot)."""
    if meta:
        net = _meta_copy(model)
        args, kwargs = _call_args(sample_input, "meta")
    else:
        net = copy.deepcopy(model)
        args, kwargs = _call_args(sample_input, None)
    return _count_step(net, args, kwargs)


def _resnet_min_depth(model: torch.nn.Module, S: int) -> int:
    """ResIST's default ``min_depth`` on a ResNet (the trainer's ``resist``, ``min_depth=-1``):
    min(5, max(P / S rounded up, P // 2, 1)) of the P partitioned blocks."""
    P = len(resist_plan(model, 1, 0, torch.Generator().manual_seed(0)).partitioned_blocks)
    return min(5, max(-(-P // S), P // 2, 1))


def _method_plan(model: torch.nn.Module, method: str, S: int, options: Mapping[str, Any],
                 generator: torch.Generator):
    """The plan ``method`` makes of ``model`` for a round (the trainer's choice of partition)."""
    spec = options.get("spec")
    if method == "ist":
        return transformer_ist_plan(model, S, options.get("partition", "ffn"), generator, spec=spec)
    if method == "resist":
        min_depth = int(options.get("min_depth", -1))
        if spec is not None or is_transformer(model):
            return transformer_resist_plan(model, S, 1 if min_depth == -1 else min_depth, generator, spec=spec)
        return resist_plan(model, S, _resnet_min_depth(model, S) if min_depth == -1 else min_depth, generator)
    return loft_plan(model, S, generator)


def subnetwork_step_flops(model: torch.nn.Module, method: str, S: int, options: Optional[Mapping[str, Any]] = None,
                          sample_input=None, *, seed: int = 0, meta: bool = True) -> List[int]:
    """FLOPs of one training step of each of the ``S`` workers of ``method`` on ``model`` (each
    worker's batch ``sample_input``), counted as :func:`model_step_flops` counts them: ``ist``,
    ``resist`` and ``loft`` (its pre-training phase) build the round's plan on the model (a
    generator seeded with ``seed``; the plan functions of :mod:`ist_kernels.partition`, chosen as
    the trainer chooses them) and count the compact subnetworks ``plan.build()`` makes, which run
    what a worker runs; ``localsgd``, ``ddp`` and ``diloco`` train the whole model on every worker.

    ``options`` (the trainer's ``--option`` values; others do not change a step's FLOPs and are not
    read): ``ist``: ``partition`` (``ffn``, default; ``heads``; ``both``), ``spec``; ``resist``:
    ``min_depth`` (-1, default: the trainer's default, 1 on a transformer), ``spec``. A round waits
    for its slowest worker: ``max(...)`` / :func:`model_step_flops` is the subnetwork's share of a
    local step's compute. Subnetworks whose parameters have the same names and shapes are counted
    once."""
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"subnetwork_step_flops: S must be an int >= 1, got {S!r}")
    if method not in SUBNETWORK_METHODS + WHOLE_MODEL_METHODS:
        raise ValueError(f"subnetwork_step_flops: unknown method {method!r}; counted: "
                         f"{', '.join(SUBNETWORK_METHODS + WHOLE_MODEL_METHODS)}")
    if sample_input is None:
        raise ValueError("subnetwork_step_flops: sample_input (a worker's batch) is required")
    if method in WHOLE_MODEL_METHODS:
        return [model_step_flops(model, sample_input, meta=meta)] * S
    net = _meta_copy(model) if meta else copy.deepcopy(model)
    plan = _method_plan(net, method, S, options or {}, torch.Generator().manual_seed(seed))
    args, kwargs = _call_args(sample_input, "meta" if meta else None)
    counted: Dict[Tuple, int] = {}
    out = []
    for sub in plan.build():
        key = (type(sub.module), tuple((n, tuple(p.shape), p.requires_grad) for n, p in sub.module.named_parameters()))
        if key not in counted:
            counted[key] = _count_step(sub.module, args, kwargs)
        out.append(counted[key])
    return out


def speedup(baseline_s: Optional[float], method_s: Optional[float]) -> Optional[float]:
    """baseline / method (None when either is missing or zero)."""
    if not baseline_s or not method_s or not math.isfinite(baseline_s) or not math.isfinite(method_s):
        return None
    return baseline_s / method_s
