"""Process groups, created once, and collectives that fail loudly instead of hanging.

``init_process_group`` picks NCCL for CUDA tensors and gloo for CPU tensors, reads torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or takes an explicit
``init_method`` (``file://`` for tests spawned with torch.multiprocessing, ``tcp://host:port``) and
keeps one timeout that every collective of this package waits at most.

Every collective here is issued with ``async_op=True`` and waited with that timeout; a peer that
died (gloo: connection closed) or stalls (no matching collective within the timeout) makes
:func:`wait_collective` raise :class:`CollectiveError` naming the collective, the round, this rank
and the group size. The process group is unusable afterwards (as torch.distributed states for any
failed collective): the caller should tear down and exit.
"""
import os
import time
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)
_timeout: timedelta = DEFAULT_TIMEOUT


class CollectiveError(RuntimeError):
    """A collective failed or did not complete within the timeout (a peer died or stalls)."""


def _as_timedelta(timeout: Union[None, float, timedelta]) -> Optional[timedelta]:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    return timedelta(seconds=float(timeout))


def default_backend(device: Union[str, torch.device, None] = None) -> str:
    """'nccl' for CUDA tensors, 'gloo' for CPU tensors (device None: CUDA when available)."""
    if device is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(
    backend: Optional[str] = None,
    *,
    device: Union[str, torch.device, None] = None,
    timeout: Union[None, float, timedelta] = None,
    init_method: Optional[str] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> dist.ProcessGroup:
    """Create the default process group once and return it; later calls return the same group.

    backend: 'nccl' or 'gloo'; None picks from ``device`` (see :func:`default_backend`).
    timeout: seconds or timedelta every collective of this package waits at most (default 10 min).
    init_method / rank / world_size: as torch.distributed.init_process_group; when all are None the
    torchrun environment (``env://``) is used.
    """
    global _timeout
    timeout = _as_timedelta(timeout)
    if dist.is_initialized():
        if backend is not None and dist.get_backend() != backend:
            raise RuntimeError(
                f"init_process_group: the default group already exists with backend "
                f"{dist.get_backend()!r}, asked for {backend!r} (process groups are created once)")
        if timeout is not None:
            _timeout = timeout
        return dist.group.WORLD
    backend = backend or default_backend(device)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_process_group: backend must be 'nccl' or 'gloo', got {backend!r}")
    if init_method is None and (rank is None or world_size is None):
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_process_group: no init_method given and the torchrun environment lacks {missing}; "
                f"run under torchrun or pass init_method='file://...' (or 'tcp://host:port'), rank and world_size")
        init_method = "env://"
    if backend == "nccl":
        # A blocking wait makes Work.wait() honour the timeout and raise on the host instead of
        # leaving the watchdog to abort the process.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
    _timeout = timeout or DEFAULT_TIMEOUT
    kwargs = dict(backend=backend, init_method=init_method, timeout=_timeout)
    if rank is not None:
        kwargs.update(rank=rank, world_size=world_size)
    elif init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs = dict(backend=backend, store=_attempt_store(_timeout), rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]), timeout=_timeout)
    dist.init_process_group(**kwargs)
    return dist.group.WORLD


def _attempt_store(timeout: timedelta) -> dist.Store:
    """The elastic agent's store (torchrun, ``ist-train --workers``), under a prefix of its own per
    restart. The agent keeps one store across restarts of the workers, and env:// would read the
    addresses the previous attempt's ranks published there: a rank that arrives first then dials a
    dead peer (gloo: "Connection refused") instead of waiting for the restarted one."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/ist_kernels/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_timeout(timeout: Union[None, float, timedelta] = None) -> timedelta:
    """The timeout a collective waits: the argument, else the one given to init_process_group."""
    return _as_timedelta(timeout) or _timeout


def wait_collective(issue, *, name: str, round: Optional[int], timeout: timedelta, group=None):
    """Issue ``issue()`` (a collective started with async_op=True) and wait at most ``timeout``.

    Raises CollectiveError naming the collective and the round when it fails or times out.
    Returns the seconds the collective took.
    """
    t0 = time.perf_counter()

    def fail(reason, cause=None):
        rank = dist.get_rank(group) if dist.is_initialized() else -1
        size = dist.get_world_size(group) if dist.is_initialized() else -1
        where = f"round {round}" if round is not None else "no round"
        raise CollectiveError(
            f"{name} ({where}) on rank {rank} of {size} {reason} after {time.perf_counter() - t0:.1f} s "
            f"(timeout {timeout.total_seconds():g} s): a peer died, stalled or issued a different "
            f"collective; the process group is unusable now") from cause

    try:
        work = issue()
        done = work.wait(timeout=timeout)
    except CollectiveError:
        raise
    except Exception as e:  # gloo: connection closed / timed out; nccl: blocking-wait timeout
        first = str(e).splitlines()[0] if str(e) else ""
        # the backend's own timeout (the process group's, the same as ours) may fire first: a stall
        # reads "timed out" either way; a closed connection (a dead peer) "failed"
        fail(f"{'timed out' if 'timed out' in first.lower() else 'failed'} ({type(e).__name__}: {first})", e)
    if done is False:
        fail("timed out")
    return time.perf_counter() - t0


class _Requests:
    """Several point-to-point requests waited as one (``wait(timeout)``: False once the time is up)."""

    def __init__(self, requests):
        self.requests = requests

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for req in self.requests:
            if deadline is None:
                done = req.wait()
            else:
                done = req.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            if done is False:
                return False
        return True


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group=None):
    """``dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)``
    (flat 1-D tensors; splits in elements), but on gloo as point-to-point messages with every receive
    posted before any send.

    Why: gloo's TCP transport sends a message only once the peer has said it posted the receive,
    and that note travels on the same socket as the data. gloo's all-to-all posts its sends first,
    so when a peer's note comes early, this rank's own note queues behind the whole message it is
    already sending, and the peer starts sending only after that message has arrived: the two
    directions run one after the other. Over a 100 Mbit/s link, 1.2 MB each way took 91 ms in the
    median but 182 ms at the 90th percentile (``dist.all_to_all_single`` at S=2, 30 tries); with
    the receives posted first, the 90th percentile was 117 ms. Returns an object with
    ``wait(timeout)``, as a collective's work does (for :func:`wait_collective`)."""
    if dist.get_backend(group) != "gloo":
        return dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group, async_op=True)
    S, r = dist.get_world_size(group), dist.get_rank(group)
    if len(out_splits) != S or len(in_splits) != S:
        raise ValueError(f"all_to_all_single: need {S} splits on each side, got {len(out_splits)} and {len(in_splits)}")
    peer = (lambda q: q) if group is None else (lambda q: dist.get_global_rank(group, q))
    recv_at, send_at = [0], [0]
    for n in out_splits:
        recv_at.append(recv_at[-1] + int(n))
    for n in in_splits:
        send_at.append(send_at[-1] + int(n))
    if recv_at[-1] != out.numel() or send_at[-1] != inp.numel():
        raise ValueError(f"all_to_all_single: the splits add up to {recv_at[-1]} and {send_at[-1]} elements, "
                         f"but out has {out.numel()} and inp {inp.numel()}")
    reqs = [dist.irecv(out[recv_at[q]:recv_at[q + 1]], peer(q), group=group)
            for q in range(S) if q != r and out_splits[q]]
    reqs += [dist.isend(inp[send_at[q]:send_at[q + 1]], peer(q), group=group)
             for q in range(S) if q != r and in_splits[q]]
    if out_splits[r]:
        out[recv_at[r]:recv_at[r + 1]].copy_(inp[send_at[r]:send_at[r + 1]])
    return _Requests(reqs)
