"""A method's communication: the one object through which methods move, average and gather
tensors, and through which every byte and second of that is counted.

Methods never import ``ist_kernels.distributed`` and never touch a counter: they call
:class:`Comm`, which runs the collective (a distributed run) or counts what it would send (a
simulated run, from the plans alone, so both modes report the same numbers), and charges the
time to the round's clock (``pack``, ``comm``, ``unpack``, ``plan``; :mod:`.timing`). The trainer
reads and resets the counters once per round (:meth:`take`).

Byte conventions (those of ``ist_kernels.distributed.CommStats``): ``sent`` is what this process's
workers put on the wire: all-to-all bytes to other ranks plus the ring all-reduce's 2 (S - 1) / S
of each all-reduced buffer; ``gathered``: assembling the full model for evaluation or saving,
counted apart; the parameter-server count of the papers is a model of traffic, not traffic, and
comes from :meth:`ps_bytes`. Every formula behind these counts is :mod:`ist_kernels.distributed.ledger`'s.

Compression (``--compress bf16|int8``, :mod:`ist_kernels.distributed.compress`): what a worker
sends is encoded and its receivers decode it; the worker's own copy is replaced by the decoded
value too. Distributed, the collectives move the encoded bytes; simulated, the same encode-decode
is applied to each worker's values (:meth:`compress_contributions`, :meth:`average_models_`) in
the same order, so both give the same model bit for bit, and both count the encoded bytes (scales
included), in both conventions.

Optimizer moments coded block-wise (``momentum_state=int8|int8-v4``, :mod:`ist_kernels.distributed.
blockwise`): distributed, the Exchange sends each partitioned slice of a moment as its block code
(:class:`~ist_kernels.distributed.blockwise.BlockCode`: packed codes and a float32 scale per block)
and every copy, the sender's own too, becomes the decoded value; simulated, the same values are
coded and decoded in place before the in-process aggregation. Shared tensors' moments travel
exactly (the ring all-reduce's float32 mean). Both launch modes count the coded bytes (``state_code``
of :meth:`exchange`, :meth:`count_exchange`, :meth:`ps_bytes`: the plan's uncoded count per slice
size, each partitioned slice at its block code, :func:`~ist_kernels.distributed.ledger.
state_exchange_bytes`), which are the bytes the distributed exchange sends.
"""
from __future__ import annotations

import time
from math import prod
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..distributed import Exchange, average_model_, compress as C, gather_bytes, gather_full_model, ledger, plan_bytes
from ..distributed.blockwise import BlockCode
from ..distributed.group import all_to_all_single, collective_timeout, wait_collective
from ..distributed.ledger import all_reduce_wire_bytes  # noqa: F401  (ring all_reduce bytes, as before)
from ..distributed.quantize import decode, encode
from .timing import Clock

#: ``compress`` of :meth:`Comm.average_models_` when not given: the run's ``--compress``
_RUN = object()

class Comm:
    """Communication of one process's workers (``local_workers``) among ``world_size`` workers.

    distributed: one process per worker in a torch.distributed group; otherwise the S workers are
    simulated in this process and every method here counts what the distributed run would move.
    """

    def __init__(self, *, world_size: int, rank: int, distributed: bool, local_workers: Sequence[int],
                 shared: str, clock: Clock, compress: str = "none"):
        #: None, "bf16" or "int8": how the exchanges and averages of the rounds encode what they send
        self.compress = C.check(compress, "Comm")
        self.world_size = world_size
        self.rank = rank
        self.distributed = distributed
        self.local_workers = list(local_workers)
        self.shared = shared
        self.clock = clock
        self.sent_by_worker: Dict[int, int] = {s: 0 for s in self.local_workers}
        #: per worker, the bytes its link carried in its busier direction, summed over the
        #: collectives: max(sent, received) of each (an all-to-all of unequal slices loads a
        #: receiver's link more than its sender's; a ring all-reduce loads both alike)
        self.link_by_worker: Dict[int, int] = {s: 0 for s in self.local_workers}
        self.gathered = 0
        self._buckets: Optional[_BucketTimes] = None
        #: seconds this process waited on each named collective since the last take (a round's
        #: ``collectives`` in metrics.jsonl: where its ``comm`` time went)
        self.collectives: Dict[str, float] = {}
        #: ``(time.perf_counter(), seconds)``: when this process entered each of its collectives
        #: since the last take (DDP: each step's last gradient bucket) and how long that collective
        #: took here. Every rank enters the same
        #: ones in the same order, so comparing the ranks' lists says how long each waited for the
        #: last to arrive, at most the collective's seconds (the runner's ``peer_wait_s``).
        self.entered: List[Tuple[float, float]] = []
        #: the Exchanges of the round being exchanged, by their plans and options: the model's and
        #: each moment's exchange between the same two plans share one (its routing derived once)
        self._exchanges: Dict[tuple, Tuple[object, Exchange]] = {}
        self._exchange_round: Optional[int] = None

    @property
    def sent(self) -> int:
        """Bytes this process's workers sent since the last take."""
        return sum(self.sent_by_worker.values())

    def _sent(self, nbytes: int, workers: Optional[Sequence[int]] = None, received: Optional[int] = None) -> None:
        """Count ``nbytes`` sent (and ``received``, default as many) by each of ``workers`` (default:
        every local worker)."""
        link = max(int(nbytes), int(nbytes if received is None else received))
        for s in self.local_workers if workers is None else workers:
            self.sent_by_worker[s] += int(nbytes)
            self.link_by_worker[s] += link

    def take(self) -> Dict[str, object]:
        """The bytes counted since the last take (``sent``, ``gathered``, and ``sent_by_worker``:
        worker -> its part of ``sent``), then zero."""
        out = {"sent": self.sent, "gathered": self.gathered, "sent_by_worker": dict(self.sent_by_worker),
               "link_by_worker": dict(self.link_by_worker), "collectives": self.collectives,
               "entered": self.entered}
        self.sent_by_worker = {s: 0 for s in self.local_workers}
        self.link_by_worker = {s: 0 for s in self.local_workers}
        self.gathered = 0
        self.collectives = {}
        self.entered = []
        return out

    def _waited(self, name: str, secs: float) -> None:
        """Charge ``secs`` spent in collective ``name`` to ``comm`` and to :attr:`collectives`."""
        self.clock.add("comm", secs)
        self.collectives[name] = self.collectives.get(name, 0.0) + secs

    def _collective(self, name: str, round: int, issue) -> None:
        """Issue one collective (``issue()``, async) under the run's timeout, note when this process
        entered it (:attr:`entered`) and charge its seconds to ``comm`` as ``name``."""
        t = time.perf_counter()
        secs = wait_collective(issue, name=name, round=round + 1, timeout=collective_timeout())
        self.entered.append((t, secs))
        self._waited(name, secs)

    def _charge(self, stats, part: Optional[str] = "plan") -> None:
        """Bytes and seconds of one collective call (``CommStats``): the collectives to ``comm``, the
        buffer copies to ``pack`` / ``unpack``, the rest (routing, checks) to ``part``."""
        coll = sum(stats.collective_seconds.values())
        rest = max(0.0, stats.seconds - coll - stats.pack_seconds - stats.unpack_seconds)
        for name, secs in stats.collective_seconds.items():
            self._waited(name, secs)
        self.entered += stats.entries
        self.clock.add("pack", stats.pack_seconds)
        self.clock.add("unpack", stats.unpack_seconds)
        if part is not None:
            self.clock.add(part, rest)

    # ---- slices of subnetworks ------------------------------------------------------------------
    def exchange(self, current, next, spec, local: Mapping[str, Tensor], *, round: int,
                 names: Optional[Sequence[str]] = None, storage: str = "decentralized",
                 shared: Optional[str] = None, drop_unowned: bool = False,
                 compress: Optional[str] = None, state_code=None, second: bool = False) -> Dict[str, Tensor]:
        """Distributed: move this rank from its part of plan ``current`` to its part of ``next``
        (``ist_kernels.distributed.Exchange``; replicated storage: owner-average the full tensors in
        place). ``shared``: how shared tensors are averaged (default: the run's ``--shared``).
        ``compress``: encode what is sent (pass :attr:`compress` for the rounds' exchanges).
        ``state_code`` (bits of a block code): ``local`` is one optimizer moment (``second``: a second
        moment, the unsigned code), its partitioned slices sent block-coded and every copy decoded
        (module docstring). Returns this rank's tensors for the next round."""
        if not self.distributed:
            raise RuntimeError("Comm.exchange needs a distributed run; simulated runs aggregate in process "
                               "and count with Comm.count_exchange")
        ex = self._exchange_of(current, next, spec, storage=storage, shared=shared or self.shared, round=round,
                               drop_unowned=drop_unowned, compress=compress)
        code = None if state_code in (None, "exact") else BlockCode(state_code, unsigned=second)
        out = ex(local, names=names, code=code)
        self._sent(ex.last_stats.bytes_sent, received=ex.last_stats.bytes_received)
        self._charge(ex.last_stats)
        return out

    def _exchange_of(self, current, next, spec, *, round: int, **options) -> Exchange:
        """The round's Exchange from ``current`` to ``next`` with ``options``: built at its first
        exchange of round ``round``, reused by the others (the plans, the spec and the options the
        same objects and values); a new round drops the last one's. Without a spec (replicated
        storage: the first call's tensors are its spec) every call builds its own."""
        if spec is None:
            return Exchange(current, next, spec, round=round, **options)
        if round != self._exchange_round:
            self._exchanges, self._exchange_round = {}, round
        key = (id(current), id(next), id(spec), tuple(sorted(options.items())))
        if key not in self._exchanges:  # the entry holds the plans (in the Exchange) and the spec: their ids stay theirs
            self._exchanges[key] = (spec, Exchange(current, next, spec, round=round, **options))
        return self._exchanges[key][1]

    def _coded_state_bytes(self, current, next, spec, names, storage: str, shared: Optional[str], code):
        """Per rank, (sent, received) of an exchange of optimizer moments coded block-wise as
        ``code``: the plan's uncoded count of the tensors of each slice size, every partitioned
        slice coded (:func:`~ist_kernels.distributed.ledger.state_exchange_bytes`), the shared
        tensors exactly (their ring all-reduce in float32): what the Exchange's block code sends."""
        spec = ledger.normalise_spec(spec)
        shared = shared or self.shared
        chosen = set(names if names is not None else current.names())
        groups: Dict[tuple, List[str]] = {}
        ring = 0  # the coded bytes of the shared tensors the ring all_reduce averages
        for t in current.tensors:
            shape, dtype = spec[t.name]
            if t.name not in chosen or not dtype.is_floating_point:
                continue
            esize = ledger.dtype_bytes(dtype)
            numel = prod(shape)
            if t.shared and shared == "all_reduce":  # a shared tensor's moments: exactly
                ring += numel * esize
                continue
            # a product (rows x cols of a 2-D tensor) moves one slice per element: exactly
            slice_numel = numel if t.shared or not shape else 1 if t.product else numel // shape[t.dim]
            groups.setdefault((slice_numel, esize, "exact" if t.shared else code), []).append(t.name)
        S = current.num_subnetworks
        out = [[0, 0] for _ in range(S)]
        for (slice_numel, esize, c), group in groups.items():
            for r, st in enumerate(plan_bytes(current, next, spec, storage=storage, shared=shared, names=group)):
                out[r][0] += ledger.state_exchange_bytes(st.all_to_all_bytes_sent, slice_numel, esize, c)
                out[r][1] += ledger.state_exchange_bytes(st.all_to_all_bytes_received, slice_numel, esize, c)
        wire = ledger.all_reduce_wire_bytes(ring, S)
        return [(a + wire, b + wire) for a, b in out]

    def count_exchange(self, current, next, spec, *, names: Optional[Sequence[str]] = None,
                       storage: str = "decentralized", shared: Optional[str] = None,
                       compress: Optional[str] = None, state_code=None) -> None:
        """Simulated: count what :meth:`exchange` would send for this process's workers."""
        if self.world_size < 2:
            return
        if state_code not in (None, "exact"):
            with self.clock("metrics"):
                per = self._coded_state_bytes(current, next, spec, names, storage, shared, state_code)
                for s in self.local_workers:
                    self._sent(per[s][0], [s], received=per[s][1])
            return
        with self.clock("metrics"):
            stats = plan_bytes(current, next, spec, storage=storage, shared=shared or self.shared, names=names,
                               compress=compress)
            for s in self.local_workers:
                self._sent(stats[s].bytes_sent, [s], received=stats[s].bytes_received)

    def ps_bytes(self, plan, spec, *, names: Optional[Sequence[str]] = None, download=None,
                 compress: Optional[str] = None, state_code=None) -> int:
        """The papers' parameter-server bytes of this process's workers in a round of ``plan``
        (each uploads its subnetwork and downloads its next one, or ``download``'s part), encoded
        as ``compress`` encodes them (``state_code``: optimizer moments, coded so)."""
        with self.clock("metrics"):
            per = ledger.ps_bytes(plan, spec, names=names, download=download, compress=compress,
                                  state_code=state_code)
            return sum(per[s] for s in self.local_workers)

    def ps_bytes_of(self, plan, spec, worker: int, *, names: Optional[Sequence[str]] = None) -> int:
        """:meth:`ps_bytes` of one worker."""
        with self.clock("metrics"):
            return ledger.ps_bytes(plan, spec, names=names)[worker]

    def subnet_bytes_of(self, plan, spec, worker: int, *, names: Optional[Sequence[str]] = None) -> int:
        """The bytes of ``worker``'s subnetwork under ``plan`` (its slices of the partitioned tensors,
        the shared ones whole; floating tensors only): half of :meth:`ps_bytes_of`."""
        with self.clock("metrics"):
            return ledger.subnet_bytes(plan, spec, names=names)[worker]

    @staticmethod
    def coded_bytes(numel: int, codec: str, scales: int = 1) -> int:
        """Bytes of ``numel`` values coded as ``codec`` (fp32, bf16, int8 with ``scales`` scales): the
        ledger's :func:`~ist_kernels.distributed.ledger.coded_bytes`, for methods."""
        return ledger.coded_bytes(numel, codec, scales)

    def model_ps_bytes(self, tensors: Sequence[Tensor]) -> int:
        """The parameter-server bytes of one worker that uploads and downloads ``tensors`` (local
        SGD), encoded as the run's ``--compress`` encodes them (int8: one scale per tensor)."""
        return ledger.ps_model_bytes(tensors, self.compress)

    # ---- compression of the simulated rounds ------------------------------------------------------
    @torch.no_grad()
    def compress_contributions(self, plan, contributions: Sequence[Mapping[str, Tensor]]
                               ) -> Dict[str, Tensor]:
        """Simulated subnetwork rounds under ``--compress``: in place, every worker's tensors (plan
        name -> its compact tensor in the plan's view, workers in rank order) become what the
        compressed exchange's receivers decode: partitioned tensors slice by slice; shared ones with
        ``--shared exact`` as one slice. With the ring all_reduce (default), the shared tensors are
        left as they are and their two-stage compressed mean is returned (name -> tensor): write it
        over the aggregate's shared tensors."""
        if self.compress is None or self.world_size < 2:
            return {}
        with self.clock("pack"):
            for t in plan.tensors:
                for c in contributions:
                    x = c.get(t.name)
                    if x is None:
                        continue
                    if not t.shared:
                        C.fake_(x, t.dim, self.compress)
                    elif self.shared == "exact":
                        C.fake_(x.reshape(1, -1), 0, self.compress)
            shared = [t.name for t in plan.tensors if t.shared and t.name in contributions[0]
                      and contributions[0][t.name].is_floating_point()]
            out: Dict[str, Tensor] = {}
            if self.shared == "exact" or not shared:
                return out
            by_dtype: Dict[torch.dtype, List[str]] = {}
            for n in shared:
                by_dtype.setdefault(contributions[0][n].dtype, []).append(n)
            for names in by_dtype.values():
                sizes = [contributions[0][n].numel() for n in names]
                flats = [torch.cat([c[n].reshape(-1) for n in names]) for c in contributions]
                mean = C.two_stage_mean(flats, sizes, self.compress)
                for n, v in zip(names, mean.split(sizes)):
                    out[n] = v.view_as(contributions[0][n])
            return out

    @torch.no_grad()
    def compress_held(self, trained, stored, tensors: Mapping[str, Tensor]) -> None:
        """Simulated decentralized rounds under ``--compress``: the slices a rank stores but no
        subnetwork trained (``stored`` minus ``trained``, e.g. Bernoulli masks' unowned neurons)
        pass through the exchange encoded too; in place in the global ``tensors`` (plan view)."""
        if self.compress is None or self.world_size < 2 or stored is trained:
            return
        with self.clock("pack"):
            owned = {t.name: t for t in trained.partitioned}
            for t in stored.partitioned:
                x = tensors[t.name]
                held = torch.zeros(x.shape[t.dim], dtype=torch.bool)
                for o in t.owners:
                    held[o.cpu()] = True
                for o in owned[t.name].owners:
                    held[o.cpu()] = False
                rows = held.nonzero().flatten().to(x.device)
                if rows.numel():
                    part = x.index_select(t.dim, rows)
                    x.index_copy_(t.dim, rows, C.fake_(part, t.dim, self.compress))

    # ---- the full model ---------------------------------------------------------------------------
    def gather_full(self, local: Mapping[str, Tensor], plan, spec, *, round: int) -> Optional[Dict[str, Tensor]]:
        """Distributed, decentralized storage: the full model assembled on rank 0 (None elsewhere),
        every slice from its first owner; its bytes counted as ``gathered``."""
        stats: List = []
        full = gather_full_model(local, plan, spec, dst=0, reduce="copy", round=round, stats=stats)
        self.gathered += stats[0].bytes_sent
        return full

    def count_gather(self, plan, spec) -> None:
        """Simulated decentralized storage: count what :meth:`gather_full` would move (all ranks)."""
        if self.world_size > 1:
            with self.clock("metrics"):
                self.gathered += sum(st.bytes_sent for st in gather_bytes(plan, spec))

    # ---- whole models and scalars -----------------------------------------------------------------
    @torch.no_grad()
    def average_models_(self, copies: Sequence[Sequence[Tensor]], *, round: int, compress=_RUN) -> None:
        """Average every worker's copy of the same tensors: distributed, this rank's one copy with
        one flat all_reduce per dtype; simulated, the S local copies summed in process. Counts the
        ring all-reduce's bytes for every local worker. ``compress``: the run's ``--compress``
        (default) or another codec (None: exactly)."""
        if self.world_size == 1:
            return
        code = self.compress if compress is _RUN else compress
        if self.distributed:
            (ts,) = copies
            st = average_model_(list(ts), round=round, compress=code)
            self._sent(st.bytes_sent, received=st.bytes_received)
            self._charge(st)
            return
        if code is not None:  # the two-stage compressed average, as every rank gets it
            with self.clock("pack"):
                sizes = [t.numel() for t in copies[0]]
                mean = C.two_stage_mean([torch.cat([t.reshape(-1) for t in ts]) for ts in copies], sizes, code)
            with self.clock("unpack"):
                for ts in copies:
                    torch._foreach_copy_(list(ts), [v.view_as(t) for v, t in zip(mean.split(sizes), ts)])
            per = C.two_stage_bytes(sizes, self.world_size, code)
            for s in self.local_workers:
                self._sent(per[s], [s])
            return
        with self.clock("pack"):
            total = torch.cat([t.reshape(-1) for t in copies[0]])
            for ts in copies[1:]:
                total += torch.cat([t.reshape(-1) for t in ts])
        with self.clock("unpack"):
            total /= self.world_size
            sizes = [t.numel() for t in copies[0]]
            for ts in copies:
                torch._foreach_copy_(list(ts), [v.view_as(t) for v, t in zip(total.split(sizes), ts)])
        self._sent(all_reduce_wire_bytes(total.numel() * total.element_size(), self.world_size))

    @torch.no_grad()
    def average_coded_(self, copies: Sequence[Sequence[Tensor]], codec: str, *, round: int) -> None:
        """Average every worker's copy of the same float32 tensors, sent as ``codec`` (``bf16`` or
        ``int8``, :func:`ist_kernels.distributed.quantize.encode`) in a reduce-scatter and an
        all-gather (each one all_to_all_single): the flat buffer is cut into S chunks, every worker
        sends chunk j coded to worker j, which decodes the S of them, sums them in worker order in
        float32, divides by S, codes its mean chunk again and sends it to every worker. A rank sends
        2 (S - 1) / S of the buffer at the codec's size (a ring all-reduce's bytes) plus, for int8,
        one float32 scale per chunk it sends. Simulated, the same arithmetic in process: the two
        launch modes give the same bits for any S."""
        S = self.world_size
        if S == 1:
            return
        if codec not in ("bf16", "int8"):
            raise ValueError(f"Comm.average_coded_: codec must be bf16 or int8, got {codec!r}")
        n = sum(t.numel() for t in copies[0])
        sizes = ledger.split_evenly(n, S)  # torch.tensor_split's chunks
        if self.distributed:
            (ts,) = copies
            with self.clock("pack"):
                flat = torch.cat([t.reshape(-1).float() for t in ts])
                coded = [encode(c, codec) for c in flat.split(sizes)]
            mine = self._reduce_scatter_coded(coded, sizes, codec, round)
            with self.clock("unpack"):
                mine = encode(mine, codec)
            chunks = self._all_gather_coded(mine, sizes, codec, round)
            with self.clock("unpack"):
                flat = torch.cat(chunks)
                torch._foreach_copy_(list(ts), [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in ts]), ts)])
            self._sent(ledger.coded_average_bytes(n, S, self.rank, codec))
            return
        with self.clock("pack"):
            coded = [[encode(c, codec) for c in torch.cat([t.reshape(-1).float() for t in ts]).split(sizes)]
                     for ts in copies]
        with self.clock("unpack"):
            means = []
            for j in range(S):
                acc = decode(*coded[0][j])
                for s in range(1, S):
                    acc = acc + decode(*coded[s][j])
                means.append(decode(*encode(acc / S, codec)))
            flat = torch.cat(means)
            for ts in copies:
                torch._foreach_copy_(list(ts), [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in ts]), ts)])
        for s in self.local_workers:
            self._sent(ledger.coded_average_bytes(n, S, s, codec), [s])

    def _all_to_all(self, out: Tensor, inp: Tensor, out_splits, in_splits, what: str, round: int) -> None:
        """One all_to_all_single under the run's timeout (bf16, which gloo does not move, travels as
        the same bytes viewed as int8)."""
        k = 1
        if out.dtype == torch.bfloat16:
            out, inp, k = out.view(torch.int8), inp.view(torch.int8), 2
        self._collective(f"all_to_all_single ({what})", round,
                         lambda: all_to_all_single(out, inp, [k * n for n in out_splits], [k * n for n in in_splits]))

    def _reduce_scatter_coded(self, coded, sizes, codec: str, round: int) -> Tensor:
        """This rank's chunk of the mean: every rank's coded chunk ``rank`` decoded and summed in
        rank order, divided by S."""
        S, r = self.world_size, self.rank
        send = torch.cat([c for c, _ in coded])
        recv = torch.empty(S * sizes[r], dtype=send.dtype, device=send.device)
        self._all_to_all(recv, send, [sizes[r]] * S, sizes, "outer gradient, reduce-scatter", round)
        scales = torch.ones(S, device=send.device)
        if codec == "int8":
            self._all_to_all(scales, torch.stack([sc for _, sc in coded]), [1] * S, [1] * S,
                             "outer gradient scales", round)
        with self.clock("unpack"):
            parts = recv.split(sizes[r])
            acc = decode(parts[0], scales[0])
            for s in range(1, S):
                acc = acc + decode(parts[s], scales[s])
            return acc / S

    def _all_gather_coded(self, mine, sizes, codec: str, round: int) -> List[Tensor]:
        """Every rank's coded mean chunk, decoded, in rank order."""
        S, r = self.world_size, self.rank
        codes, scale = mine
        recv = torch.empty(sum(sizes), dtype=codes.dtype, device=codes.device)
        self._all_to_all(recv, codes.repeat(S), sizes, [sizes[r]] * S, "outer gradient, all-gather", round)
        scales = torch.ones(S, device=codes.device)
        if codec == "int8":
            self._all_to_all(scales, scale.reshape(1).repeat(S), [1] * S, [1] * S, "outer gradient scales", round)
        with self.clock("unpack"):
            return [decode(c, scales[j]) for j, c in enumerate(recv.split(sizes))]

    def all_reduce_sum_(self, tensor: Tensor, what: str, round: int, *, counted: bool = True) -> Tensor:
        """In-place SUM over the processes (a no-op simulated or with one process); a dead or
        stalled rank raises ``CollectiveError`` naming ``what`` and the round. ``counted``: its
        ring bytes are the method's traffic (not the trainer's own bookkeeping)."""
        if counted:
            self.count_all_reduce(tensor.numel() * tensor.element_size())
        if self.distributed:
            self._collective(f"all_reduce ({what})", round, lambda: dist.all_reduce(tensor, async_op=True))
        return tensor

    def count_all_reduce(self, nbytes: int, times: int = 1) -> None:
        """Count ``times`` ring all-reduces of ``nbytes`` for every local worker (e.g. DDP's gradient
        buckets, which torch's DistributedDataParallel sends itself)."""
        self._sent(times * all_reduce_wire_bytes(nbytes, self.world_size))

    # ---- torch's DistributedDataParallel ----------------------------------------------------------
    def data_parallel(self, model: nn.Module, device_ids=None) -> nn.Module:
        """``model`` in torch's DistributedDataParallel, its gradient buckets all-reduced (and
        averaged) by torch's default hook, timed: :meth:`gradient_step_done` after each step charges
        the time the step waited on them after its backward pass ended to ``comm``."""
        net = DistributedDataParallel(model, device_ids=device_ids)
        self._buckets = _BucketTimes()
        net.register_comm_hook(self._buckets, _timed_all_reduce_hook)
        return net

    def gradient_step_done(self) -> None:
        """After a DistributedDataParallel step: charge to ``comm`` (collective ``all_reduce
        (gradient buckets)``) the time from its last bucket's gradients being ready, the end of the
        backward pass, to the last all-reduce's completion: the part of the step's communication
        that the backward pass did not hide. The rest of the step stays in the open part. The times
        are the host's (``time.perf_counter``): exact for gloo, whose futures complete when the
        bytes have arrived; on CUDA an NCCL future may complete before its kernels do."""
        b = self._buckets
        if b is None or b.ready is None:
            return
        if b.done is not None:
            secs = max(0.0, b.done - b.ready)
            self._waited("all_reduce (gradient buckets)", secs)
            self.entered.append((b.ready, secs))
        b.ready = b.done = None

    def count_sent(self, nbytes: int) -> None:
        """Count bytes a collective outside this object sent (e.g. DDP's buffer broadcast), shared
        evenly by the local workers."""
        for s, part in zip(self.local_workers, ledger.split_evenly(nbytes, len(self.local_workers))):
            self._sent(part, [s])


class _BucketTimes:
    """State of :func:`_timed_all_reduce_hook`: when the current step's latest bucket became ready
    and when its latest all-reduce finished (``time.perf_counter``)."""
    process_group = None  # the default group, as DistributedDataParallel's own hook uses

    def __init__(self):
        self.ready: Optional[float] = None
        self.done: Optional[float] = None


def _timed_all_reduce_hook(state: _BucketTimes, bucket):
    """torch's default DDP hook (all-reduce the bucket, divide by the world size) with its ready and
    completion times noted in ``state``. gloo runs a process group's collectives in the order they
    were issued, so the last bucket's completion ends the step's communication."""
    state.ready = time.perf_counter()
    fut = default_hooks.allreduce_hook(state.process_group, bucket)

    def finished(f):
        state.done = time.perf_counter()
        return f.value()

    return fut.then(finished)
