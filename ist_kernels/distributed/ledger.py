"""The byte ledger: every formula that turns what a round moves or holds into bytes, once.

The collectives (:mod:`.exchange`, ``ist_kernels.train.comm``) measure what they pass to the
backend; the counts that are *formulas* (what a ring all-reduce puts on the wire, what a codec makes
of n values, the papers' parameter-server traffic, the state a worker holds, the cost model's
per-rank bytes) live here and nowhere else:

- the wire: :func:`ring_factor` (2 (S - 1) / S: the share of a buffer one rank sends, and
  receives, in a bandwidth-optimal ring all-reduce), :func:`all_reduce_wire_bytes` (its exact
  integer count, rounded down, as ``CommStats`` and ``Comm`` count), :func:`ring_all_reduce_bytes`
  (the cost model's real-valued one), :func:`two_stage_sent` (a compressed average's two
  all-to-alls), :func:`split_evenly` (a count shared by n workers, the remainder to the first);
- codecs: :data:`CODEC_BYTES` (fp32 / bf16 / int8: 4 / 2 / 1 bytes per value), :data:`SCALE_BYTES`
  (int8's fp32 scale), :func:`coded_bytes`, :func:`slice_bytes` (a slice under ``--compress``),
  :func:`coded_average_bytes` (DiLoCo's coded reduce-scatter + all-gather), :func:`wire_fraction`;
- optimizer moments (``momentum_state``, :mod:`.blockwise`): :data:`MOMENT_CODES` (what each option
  sends of a first and a second moment), :func:`moment_code`, :func:`block_coded_bytes` (a slice
  block-wise coded: ceil(n bits / 8) + 4 ceil(n / 256)), :func:`state_coded`,
  :func:`state_slice_bytes`, :func:`state_exchange_bytes` (an exchange's uncoded count, coded),
  :func:`moment_tensors_sent` (the cost model's float32 moments per parameter);
- the parameter-server convention of the papers (paper 000 Table 1, paper 003 Table 1: every worker
  uploads its subnetwork and downloads the next): :func:`subnet_bytes`, :func:`ps_bytes`,
  :func:`ps_model_bytes`;
- held state: :func:`held_bytes` (measured: distinct tensors), :func:`full_state_bytes` (one worker
  training the whole model), :func:`state_split` (shared vs partitioned, from a plan),
  :func:`rank_state_bytes` (the cost model's; ``momentum_state=local`` keeps every slice's moments);
- the cost model's per-rank round bytes: :func:`subnet_round_bytes`, :func:`localsgd_round_bytes`,
  :func:`diloco_round_bytes`, and :func:`payoff` (a subnetwork round's bytes over local SGD's).

Integer counts stay integers (floor division where a share is rounded); the cost model's are floats.
This module imports only torch: every other module of the package may import it.
"""
from __future__ import annotations

from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

Spec = Mapping[str, Union[Tensor, Tuple[Sequence[int], torch.dtype]]]

#: the values of ``--compress``
COMPRESS = ("none", "bf16", "int8")
#: wire bytes per value of each codec (DiLoCo's ``outer_grad``; ``--compress`` codes bf16 / int8)
CODEC_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
#: bytes of one int8 scale (float32)
SCALE_BYTES = 4
#: values per block of a block-wise coded optimizer moment (Dettmers et al., arXiv 2110.02861)
MOMENT_BLOCK = 256
#: optimizer state keys of second moments (non-negative: the unsigned log code); every other state
#: tensor of a parameter's shape is a first moment (AdamW's exp_avg, SGD's momentum_buffer)
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")
#: per ``momentum_state``, how a subnetwork's first / second moments travel when its slices change
#: owners: "exact" (in their dtype), bits of a block-wise code (:mod:`.blockwise`), or absent: not sent
MOMENT_CODES = {"reset": {}, "aggregate": {"first": "exact", "second": "exact"},
                "int8": {"first": 8, "second": 8}, "int8-v4": {"first": 8, "second": 4},
                "local": {}, "second": {"second": "exact"}}


# ---------------------------------------------------------------- codecs

def check(compress: Optional[str], who: str) -> Optional[str]:
    """``compress`` normalised (None for "none"); ValueError naming ``who`` and the choices."""
    if compress is None or compress == "none":
        return None
    if compress not in COMPRESS:
        raise ValueError(f"{who}: compress must be one of {', '.join(COMPRESS)}, got {compress!r}")
    return compress


def code_bytes(codec: str) -> int:
    """Bytes of one encoded value."""
    return CODEC_BYTES[codec]


def coded_bytes(numel: int, codec: str, scales: int = 1) -> int:
    """Bytes of ``numel`` values coded as ``codec`` (fp32, bf16, int8) with ``scales`` int8 scales
    (one per group of values that shares a scale; ignored by fp32 and bf16)."""
    return numel * CODEC_BYTES[codec] + (scales * SCALE_BYTES if codec == "int8" else 0)


def coded(compress: str, slice_numel: int, floating: bool = True) -> bool:
    """Whether a slice of ``slice_numel`` elements travels encoded (else exactly, in its dtype):
    floating values only, and under int8 only slices of two values or more (a code and its scale
    would take 5 bytes instead of 4)."""
    return floating and slice_numel > 0 and (compress == "bf16" or slice_numel >= 2)


def slice_bytes(compress: Optional[str], slice_numel: int, esize: int, floating: bool = True) -> int:
    """Bytes one slice of ``slice_numel`` elements (``esize`` bytes each) takes on the wire under
    ``compress`` (None: uncompressed; int8: one scale per slice)."""
    if compress is None or not coded(compress, slice_numel, floating):
        return slice_numel * esize
    return coded_bytes(slice_numel, compress)


def wire_fraction(compress: Optional[str] = "none") -> float:
    """Bytes on the wire per fp32 byte under ``--compress`` (int8's scales left out)."""
    if compress is None:
        return 1.0
    if compress not in COMPRESS:
        raise ValueError(f"wire_fraction: compress must be one of {', '.join(COMPRESS)}, got {compress!r}")
    return CODEC_BYTES["fp32" if compress == "none" else compress] / CODEC_BYTES["fp32"]


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


def tensor_bytes(t: Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- optimizer moments

def moment_code(momentum_state: str, key: str) -> Union[None, str, int]:
    """How optimizer state ``key`` (a tensor of its parameter's shape) travels under
    ``momentum_state`` (:data:`MOMENT_CODES`): None (not sent), "exact" or the bits of its block code."""
    if momentum_state not in MOMENT_CODES:
        raise ValueError(f"moment_code: momentum_state must be one of {', '.join(MOMENT_CODES)}, "
                         f"got {momentum_state!r}")
    return MOMENT_CODES[momentum_state].get("second" if key in SECOND_MOMENTS else "first")


def block_coded_bytes(numel: int, bits: int, block: int = MOMENT_BLOCK) -> int:
    """Bytes of one slice of ``numel`` values block-wise coded at ``bits`` bits: the codes packed
    (ceil(numel bits / 8)) and one float32 scale per block of ``block`` values (ceil(numel / block))."""
    if numel <= 0:
        return 0
    return -(-numel * bits // 8) + SCALE_BYTES * -(-numel // block)


def state_coded(numel: int, bits: int, esize: int, block: int = MOMENT_BLOCK) -> bool:
    """Whether a slice of ``numel`` values of ``esize`` bytes travels block-coded (else exactly):
    where its code is smaller than its values (a one-element slice stays exact)."""
    return numel > 0 and block_coded_bytes(numel, bits, block) < numel * esize


def state_slice_bytes(numel: int, esize: int, code: Union[None, str, int], block: int = MOMENT_BLOCK) -> int:
    """Bytes of one slice of a moment on the wire: ``code`` None or "exact": numel x esize; bits: its
    block code where :func:`state_coded`."""
    if code is None or code == "exact" or not state_coded(numel, code, esize, block):
        return numel * esize
    return block_coded_bytes(numel, code, block)


def state_exchange_bytes(raw: int, slice_numel: int, esize: int, code: Union[None, str, int]) -> int:
    """An exchange's ``raw`` bytes (whole slices of ``slice_numel`` values of ``esize`` bytes, as
    the uncoded count has them) with every slice coded as ``code`` codes it."""
    per = slice_numel * esize
    if per == 0:
        return 0
    return raw // per * state_slice_bytes(slice_numel, esize, code)


def moment_tensors_sent(momentum_state: str, keys: Sequence[str], esize: int = 4) -> float:
    """The cost model's moments sent per parameter, in parameter-sized tensors: each state ``key``
    that travels under ``momentum_state``, exact as 1, block-coded as its bytes per value (a full
    block's scale included) over ``esize`` (int8 of float32: (1 + 4/256) / 4)."""
    total = 0.0
    for key in keys:
        code = moment_code(momentum_state, key)
        if code is not None:
            total += 1.0 if code == "exact" else block_coded_bytes(MOMENT_BLOCK, code) / (MOMENT_BLOCK * esize)
    return total


# ---------------------------------------------------------------- the wire

def ring_factor(S: int) -> float:
    """The share of a buffer one rank sends (and receives) in a bandwidth-optimal (ring)
    all-reduce among ``S`` ranks: 2 (S - 1) / S (0 for S < 2)."""
    return 2.0 * (S - 1) / S if S > 1 else 0.0


def all_reduce_wire_bytes(nbytes: int, S: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of an ``nbytes`` buffer among ``S``
    ranks, an integer: 2 (S - 1) nbytes // S (0 for S < 2)."""
    return (2 * (S - 1) * nbytes) // S if S > 0 else 0


def ring_all_reduce_bytes(nbytes: float, S: int) -> float:
    """The cost model's :func:`all_reduce_wire_bytes`, not rounded: nbytes x :func:`ring_factor`."""
    return ring_factor(S) * nbytes if S > 1 else 0.0


def split_evenly(total: int, n: int) -> List[int]:
    """``total`` shared by ``n``: total // n each, one more to the first total % n (as
    ``torch.tensor_split`` cuts total elements into n chunks)."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def two_stage_sent(payloads: Sequence[int], rank: int) -> int:
    """Bytes ``rank`` sends (and receives) in a two-stage average of a buffer cut into
    len(payloads) chunks, chunk k of ``payloads[k]`` bytes (encoded) reduced by rank k: every other
    rank's chunk to it, then its own reduced chunk to each of the S - 1 others."""
    S = len(payloads)
    return sum(payloads) - payloads[rank] + (S - 1) * payloads[rank]


def coded_average_bytes(numel: int, S: int, rank: int, codec: str) -> int:
    """Bytes ``rank`` sends in a coded reduce-scatter + all-gather of ``numel`` values among ``S``
    ranks (``Comm.average_coded_``): the buffer cut into S near-equal chunks (:func:`split_evenly`),
    each chunk coded with one scale (int8)."""
    return two_stage_sent([coded_bytes(k, codec) for k in split_evenly(numel, S)], rank)


# ---------------------------------------------------------------- the parameter-server convention

def normalise_spec(spec: Spec) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of a spec whose values are tensors (meta ones will do) or (shape, dtype)."""
    out = {}
    for name, v in spec.items():
        if isinstance(v, Tensor):
            out[name] = (tuple(v.shape), v.dtype)
        else:
            shape, dtype = v
            out[name] = (tuple(shape), dtype)
    return out


def subnet_bytes(plan, spec: Spec, *, names: Optional[Sequence[str]] = None,
                 compress: Optional[str] = None, state_code: Union[None, str, int] = None) -> List[int]:
    """Per worker, the bytes of the floating tensors of its subnetwork under ``plan`` (a
    ``SlicePlan``): its slices of the partitioned tensors, the shared ones whole; ``names`` only
    (default: all the plan's); ``compress``: encoded as the exchange encodes them (int8: a scale per
    slice of a partitioned tensor, one per shared tensor; a one-element slice stays fp32);
    ``state_code``: the tensors are optimizer moments coded so (:func:`state_slice_bytes`; a shared
    tensor's travel exactly). Integer tensors (step counters) are not counted."""
    spec = normalise_spec(spec)
    compress = check(compress, "subnet_bytes")
    if compress is not None and state_code not in (None, "exact"):
        raise ValueError("subnet_bytes: give compress (weights) or state_code (moments), not both")

    def sized(numel: int, esize: int) -> int:
        if state_code is not None:
            return state_slice_bytes(numel, esize, state_code)
        return slice_bytes(compress, numel, esize)
    chosen = set(names if names is not None else plan.names())
    out = [0] * plan.num_subnetworks
    for t in plan.tensors:
        shape, dtype = spec[t.name]
        if t.name not in chosen or not dtype.is_floating_point:
            continue
        esize = dtype_bytes(dtype)
        for s in range(plan.num_subnetworks):
            if t.shared:  # a shared tensor's moments travel exactly (averaged in float32)
                out[s] += prod(shape) * esize if state_code is not None else sized(prod(shape), esize)
            elif getattr(t, "product", False):  # rows x cols of a 2-D tensor: one slice per element
                out[s] += sized(1, esize) * t.count(s)
            elif t.owners[s].numel():
                out[s] += (sized(prod(shape) // shape[t.dim], esize) * t.owners[s].numel()
                           if shape else sized(1, esize))
    return out


def ps_bytes(plan, spec: Spec, *, download=None, names: Optional[Sequence[str]] = None,
             compress: Optional[str] = None, state_code: Union[None, str, int] = None) -> List[int]:
    """The papers' parameter-server count of one round (paper 000 Table 1, paper 003 Table 1): per
    worker, the bytes of the floating tensors it uploads (its subnetwork under ``plan``,
    :func:`subnet_bytes`) plus those it downloads (its subnetwork under ``download``, default
    ``plan``). Local SGD moves 2 full models per worker by this count (:func:`ps_model_bytes`).
    Integer tensors (step counters) are not counted, as local SGD does not average them.
    ``state_code``: optimizer moments, coded so (:func:`subnet_bytes`)."""
    compress = check(compress, "ps_bytes")
    up = subnet_bytes(plan, spec, names=names, compress=compress, state_code=state_code)
    down = up if download is None else subnet_bytes(download, spec, names=names, compress=compress,
                                                    state_code=state_code)
    return [a + b for a, b in zip(up, down)]


def ps_model_bytes(tensors: Sequence[Tensor], compress: Optional[str] = None) -> int:
    """The parameter-server bytes of one worker that uploads and downloads ``tensors`` whole (local
    SGD's model; DDP's gradients up and parameters down), encoded as ``compress`` encodes them
    (int8: one scale per tensor)."""
    return 2 * sum(slice_bytes(compress, t.numel(), t.element_size(), t.is_floating_point()) for t in tensors)


# ---------------------------------------------------------------- held state

def held_bytes(*things) -> int:
    """Bytes of the distinct tensors in ``things``: modules (parameters and buffers), optimizers
    (their state), tensors, mappings and sequences of those. A tensor met twice (also as a
    Parameter wrapping it) counts once."""
    seen, total = set(), 0
    stack = list(things)
    while stack:
        x = stack.pop()
        if x is None:
            continue
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), x.numel(), x.dtype) if x.numel() else id(x)
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
        elif isinstance(x, torch.nn.Module):
            stack.extend(x.parameters())
            stack.extend(x.buffers())
        elif isinstance(x, torch.optim.Optimizer):
            stack.extend(v for st in x.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def full_state_bytes(model: torch.nn.Module, state_tensors_per_param: int = 0,
                     scalar_bytes_per_param: int = 0) -> int:
    """What one worker training all of ``model`` holds: its state dict (parameters and persistent
    buffers; a tied tensor once), ``state_tensors_per_param`` optimizer tensors of each trainable
    parameter's shape (SGD with momentum: 1; AdamW: 2) and ``scalar_bytes_per_param`` more bytes per
    trainable parameter (AdamW's 0-dim float32 step: 4)."""
    tensors = list({id(t): t for t in model.state_dict(keep_vars=True).values()}.values())  # tied: once
    params = [p for p in model.parameters() if p.requires_grad]
    return (sum(tensor_bytes(t) for t in tensors + params * state_tensors_per_param)
            + scalar_bytes_per_param * len(params))


def state_split(plan, spec: Spec, param_names: Sequence[str], momentum) -> Dict[str, int]:
    """The whole model's state (parameters, buffers, and ``momentum`` optimizer state tensors of its
    shape per parameter; True counts as 1; a float, e.g. :func:`moment_tensors_sent`, gives float bytes) split into what every subnetwork holds whole
    (``shared_state_bytes``) and what ``plan`` partitions (``partitioned_state_bytes``): a worker of
    S holds about shared + partitioned / S."""
    spec = normalise_spec(spec)
    params = set(param_names)
    out = {"shared_state_bytes": 0, "partitioned_state_bytes": 0}
    for t in plan.tensors:
        shape, dtype = spec[t.name]
        n = prod(shape) * dtype_bytes(dtype)
        key = "shared_state_bytes" if t.shared else "partitioned_state_bytes"
        out[key] += n * (1 + (int(momentum) if isinstance(momentum, bool) else momentum) if t.name in params else 1)
    return out


def rank_state_bytes(partitioned: float, shared: float, S: int, owners: float = 1.0,
                     optimizer_copies: float = 1.0, momentum_state: str = "aggregate") -> float:
    """Memory a rank holds for its subnetwork: its share of the partitioned state plus the shared
    state, times (1 + ``optimizer_copies``) for parameters that carry optimizer state (SGD with
    momentum: 1 buffer; Adam: 2); pass the parameter bytes, buffers count once.
    ``momentum_state="local"``: a worker keeps the moments of every slice it has trained, in the
    long run of every slice: its share of the weights plus ``optimizer_copies`` x (partitioned +
    shared) (every other option holds its subnetwork's moments only, sent coded or not)."""
    if momentum_state not in MOMENT_CODES:
        raise ValueError(f"rank_state_bytes: momentum_state must be one of {', '.join(MOMENT_CODES)}, "
                         f"got {momentum_state!r}")
    weights = partitioned * min(owners, S) / S + shared
    if momentum_state == "local":
        return weights + optimizer_copies * (partitioned + shared)
    return weights * (1.0 + optimizer_copies)


# ---------------------------------------------------------------- the cost model's round bytes

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


def payoff(split: Mapping[str, float], S: int) -> Tuple[float, float]:
    """(the partitioned fraction of the state, the bytes a round of decentralized subnetworks sends
    relative to local SGD's ring all-reduce of the whole state), from :func:`state_split`:
    :func:`subnet_round_bytes` (one owner per slice) over :func:`localsgd_round_bytes`. (0, 1) when
    there is no state or fewer than two workers."""
    part, shared = split["partitioned_state_bytes"], split["shared_state_bytes"]
    total = shared + part
    if total == 0 or S < 2:
        return 0.0, 1.0
    return part / total, subnet_round_bytes(part, shared, S)["wire"] / localsgd_round_bytes(total, S)
