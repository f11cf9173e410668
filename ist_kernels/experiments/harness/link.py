"""An emulated limited network link for real multi-process runs: one Linux network namespace per
rank, joined by a bridge, each rank's link shaped to a rate in both directions.

Topology of ``EmulatedLink(S, rate)``: namespaces ``istl-<pid>-<k>-r0 .. r<S-1>`` (one per rank)
and ``istl-<pid>-<k>-br`` holding a bridge ``br0``; rank r's interface ``r<r>`` (address
10.213.0.<r+1>/24) is one end of a veth pair whose other end ``p<r>`` is a port of the bridge. Both
ends are created inside their namespaces, so nothing appears in the caller's namespace and the
traffic stays on the addresses assigned there. A token bucket (``tc qdisc tbf``) on ``r<r>``
shapes what rank r sends and one on ``p<r>`` what it receives: like a host's NIC, a rank sending
to all its peers at once shares its rate among them. The bucket holds 1 ms of traffic (at least
32 KiB, so the rate can be reached) and its queue 50 ms: a link that idles refills its bucket and
then sends that much at the veth's own speed, far above the rate, which a real link cannot do. With
10 ms (the first choice), a step that idled 10 ms moved 1.25 MB of a 1 Gbit/s link's traffic in no
time: DistributedDataParallel's all-reduce of 2.46 MB after every step took 12 ms instead of 21 ms
(its 8 steps a round, 70 ms of 190 ms); with 1 ms it takes 21 ms, as the rate says.
The ranks' TCP (``tcp`` says what each link's ranks use): a loss-based congestion control, the first
of :data:`CONGESTION_CONTROL` the kernel lets a namespace choose (without either, what the namespace
inherited), and no slow start after idle (:data:`SLOW_START_AFTER_IDLE`). A new namespace inherits
the host's congestion control, and BBR (this machine's) overran the bucket's queue: starting from
idle it sends faster than the rate until its model of the path settles, and the queue on the
sender's own interface drops the excess. S=4 ranks over 10 Mbit/s swapping 0.6 MB with every peer
(``tools/probe_all_to_all.py --ranks 4 --rate 10mbit --mb 0.6``, 10 tries): BBR 1.75 s a swap on
average, 52,030 segments sent twice (four times the swaps' own 12,400), against 1.51 s of link
time; Reno 1.55 s, 230 sent twice. And Linux restarts a connection that idled longer than its
retransmission timeout from its initial window: each round's exchange, after the local steps,
ramps up anew on every connection. The cost model counts neither.
``latency_s`` adds a one-way delay on each end of every rank's link (so rank to rank crosses 2x;
needs the sch_netem qdisc, checked before anything is made).

:meth:`EmulatedLink.check` times a TCP transfer between two ranks and requires its payload rate
within 10% of ``rate x TCP_EFFICIENCY`` (1448 payload bytes per 1514-byte frame at MTU 1500).

Everything made is removed on every exit path: ``close()`` (idempotent) on leaving the ``with``
block, normally or by an exception, from SIGINT / SIGTERM handlers installed while a link is open
(then the signal's usual effect: KeyboardInterrupt, or exit status 128 + 15), and at interpreter
exit; a process killed by SIGKILL cannot clean up, so :func:`cleanup_stale` (run whenever a link is
made) removes the namespaces of creators that no longer exist. Making namespaces needs root or
CAP_NET_ADMIN: :func:`unavailable_reason` says in one line why not.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import Dict, List, Optional, Sequence

from ...distributed.cost import TCP_EFFICIENCY

PREFIX = "istl"
SUBNET = "10.213.0"
#: the token bucket: seconds of traffic at the rate, and its floor in bytes (see the module docstring)
BURST_S = 0.001
MIN_BURST_BYTES = 32 * 1024
#: the longest a packet may wait in the bucket's queue (tbf ``latency``): the queue's length in seconds
QUEUE_S = 0.05
#: the ranks' TCP congestion control, the first one the kernel allows (see the module docstring)
CONGESTION_CONTROL = ("cubic", "reno")
#: net.ipv4.tcp_slow_start_after_idle in the ranks' namespaces (see the module docstring)
SLOW_START_AFTER_IDLE = 0
CMD_TIMEOUT_S = 20
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_counter = 0
_open: List["EmulatedLink"] = []


def parse_rate(s: str) -> float:
    """``"100mbit"`` -> 1e8 bit/s (tc's units: kbit, mbit, gbit are powers of 1,000; a bare number is
    bit/s). Bytes-per-second spellings (``mbps``, which tc reads as megabytes) are refused."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(s).lower())
    if not m or m.group(2) not in _UNITS and m.group(2) != "":
        raise ValueError(f"--bandwidth: expected a rate like 100mbit, 1gbit or 500kbit (bit/s), got {s!r}")
    v = float(m.group(1)) * _UNITS.get(m.group(2), 1.0)
    if not v > 0:
        raise ValueError(f"--bandwidth: must be > 0, got {s!r}")
    return v


def parse_time(s) -> float:
    """``"5ms"`` -> 0.005 s; ``"100us"``, ``"0.2s"`` or a bare number of seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(s).lower())
    if not m or m.group(2) not in _TIMES and m.group(2) != "":
        raise ValueError(f"--latency: expected a time like 5ms, 100us or 0.01 (seconds), got {s!r}")
    return float(m.group(1)) * _TIMES.get(m.group(2), 1.0)


def _run(args: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {(r.stderr or r.stdout).strip()}")
    return r


def _namespaces() -> List[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> List[str]:
    """Remove the namespaces (and with them their links) of links whose creating process is gone
    (killed by SIGKILL, which cannot be trapped); returns their names."""
    removed = []
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-(?:r\d+|br|probe)", ns)
        if m and not _alive(int(m.group(1))):
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


_reason: Dict[bool, Optional[str]] = {}


def unavailable_reason(latency: bool = False) -> Optional[str]:
    """None when this process can make emulated links (namespaces, veth pairs, tbf; with
    ``latency`` also netem), else one line saying why not. Tried once per process."""
    if latency in _reason:
        return _reason[latency]
    why = None
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        why = f"the emulated link needs the {' and '.join(missing)} command(s) (iproute2), not found"
    else:
        a, b = f"{PREFIX}-{os.getpid()}-0-probe", f"{PREFIX}-{os.getpid()}-1-probe"
        try:
            r = _run(["ip", "netns", "add", a], check=False)
            if r.returncode:
                why = ("the emulated link needs root or CAP_NET_ADMIN (ip netns add: "
                       f"{(r.stderr or r.stdout).strip() or 'failed'})")
            else:
                _run(["ip", "netns", "add", b])
                _run(["ip", "link", "add", "x0", "netns", a, "type", "veth", "peer", "name", "x1", "netns", b])
                q = _run(["ip", "netns", "exec", a, "tc", "qdisc", "add", "dev", "x0", "root", "tbf", "rate",
                          "10mbit", "burst", "32kb", "latency", "50ms"], check=False)
                if q.returncode:
                    why = f"the emulated link needs the tbf qdisc (tc: {(q.stderr or q.stdout).strip()})"
                elif latency:
                    q = _run(["ip", "netns", "exec", b, "tc", "qdisc", "add", "dev", "x1", "root", "netem",
                              "delay", "1ms"], check=False)
                    if q.returncode:
                        why = "--latency needs the sch_netem qdisc, which this kernel lacks"
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            why = f"the emulated link could not be made ({e})"
        finally:
            for ns in (a, b):
                _run(["ip", "netns", "del", ns], check=False)
    _reason[latency] = why
    return why


class EmulatedLink:
    """S ranks, each in a network namespace of its own, each link shaped to ``bandwidth_bps`` in
    both directions (None: unshaped), with ``latency_s`` one-way on each end; see the module
    docstring. Use as a context manager (or call :meth:`open` and :meth:`close`)."""

    def __init__(self, ranks: int, bandwidth_bps: Optional[float], latency_s: float = 0.0,
                 queue_s: float = QUEUE_S):
        if not isinstance(ranks, int) or ranks < 2 or ranks > 250:
            raise ValueError(f"EmulatedLink: ranks must be an integer in [2, 250], got {ranks!r}")
        if bandwidth_bps is not None and not bandwidth_bps >= 1e4:
            raise ValueError(f"EmulatedLink: bandwidth_bps must be >= 10 kbit/s or None, got {bandwidth_bps!r}")
        if not latency_s >= 0:
            raise ValueError(f"EmulatedLink: latency_s must be >= 0, got {latency_s!r}")
        if not queue_s > 0:
            raise ValueError(f"EmulatedLink: queue_s must be > 0, got {queue_s!r}")
        global _counter
        _counter += 1
        self.ranks, self.bandwidth_bps, self.latency_s = ranks, bandwidth_bps, float(latency_s)
        self.queue_s = float(queue_s)
        self.prefix = f"{PREFIX}-{os.getpid()}-{_counter}"
        self._made: List[str] = []
        #: the ranks' TCP settings, read back once made: congestion_control, slow_start_after_idle
        self.tcp: Optional[Dict[str, object]] = None
        self._handlers: Dict[int, object] = {}
        self.is_open = False

    # ---- names and addresses
    def netns(self, rank: int) -> str:
        return f"{self.prefix}-r{rank}"

    @property
    def bridge_netns(self) -> str:
        return f"{self.prefix}-br"

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def ifname(self, rank: int) -> str:
        """Rank ``rank``'s interface inside its namespace (for GLOO_SOCKET_IFNAME)."""
        return f"r{rank}"

    def torchrun_env(self, rank: int, world_size: int, port: int) -> Dict[str, str]:
        """What a rank launched by hand needs of torchrun's environment (each rank its own host)."""
        return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(rank), "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": self.ifname(rank)}

    def wrap(self, rank: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> List[str]:
        """``argv`` run in rank ``rank``'s namespace, with ``env`` added to the environment."""
        return ["ip", "netns", "exec", self.netns(rank), "env",
                *[f"{k}={v}" for k, v in (env or {}).items()], *argv]

    # ---- making and removing
    def _shape(self, ns: str, dev: str) -> None:
        if self.bandwidth_bps is None and not self.latency_s:
            return
        base = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.latency_s:
            _run(base + ["root", "handle", "1:", "netem", "delay", f"{self.latency_s * 1e6:.0f}us"])
            parent = ["parent", "1:1"]
        if self.bandwidth_bps is not None:
            rate = int(self.bandwidth_bps)
            burst = max(MIN_BURST_BYTES, int(rate / 8 * BURST_S))
            _run(base + parent + ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency",
                       f"{self.queue_s * 1e3:g}ms"])

    @staticmethod
    def _set_tcp(ns: str) -> Dict[str, object]:
        """The first of CONGESTION_CONTROL the kernel allows, and SLOW_START_AFTER_IDLE, in ``ns``;
        returns what ``ns`` uses."""
        def sysctl(*args: str) -> subprocess.CompletedProcess:
            return _run(["ip", "netns", "exec", ns, "sysctl", *args], check=False)
        for cc in CONGESTION_CONTROL:
            if not sysctl("-q", "-w", f"net.ipv4.tcp_congestion_control={cc}").returncode:
                break
        sysctl("-q", "-w", f"net.ipv4.tcp_slow_start_after_idle={SLOW_START_AFTER_IDLE}")
        got = sysctl("-n", "net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle").stdout.split()
        return {"congestion_control": got[0], "slow_start_after_idle": int(got[1])}

    def open(self) -> "EmulatedLink":
        if self.is_open:
            return self
        if self.latency_s and unavailable_reason(latency=True):
            raise RuntimeError(unavailable_reason(latency=True))
        cleanup_stale()
        self.is_open = True
        _open.append(self)
        self._install_handlers()
        try:
            br = self.bridge_netns
            for ns in (br, *[self.netns(r) for r in range(self.ranks)]):
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            for r in range(self.ranks):
                ns, dev, port = self.netns(r), self.ifname(r), f"p{r}"
                _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", br])
                _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", br, "link", "set", port, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                self._shape(ns, dev)  # what rank r sends
                self._shape(br, port)  # what rank r receives
                self.tcp = self._set_tcp(ns)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every namespace this link made (their interfaces and qdiscs go with them)."""
        for ns in reversed(self._made):
            try:
                _run(["ip", "netns", "del", ns], check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._made = []
        if self in _open:
            _open.remove(self)
        self._restore_handlers()
        self.is_open = False

    def leftovers(self) -> List[str]:
        """Namespaces of this link still present (none once closed)."""
        return [ns for ns in _namespaces() if ns.startswith(self.prefix + "-")]

    def __enter__(self) -> "EmulatedLink":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- signals
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread; atexit still cleans up
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, h in self._handlers.items():
            try:
                signal.signal(sig, h)
            except (ValueError, TypeError):
                pass
        self._handlers = {}

    def _on_signal(self, signum, frame) -> None:
        previous = self._handlers.get(signum)
        self.close()
        if signum == signal.SIGINT:
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)
        sys.exit(128 + signum)

    # ---- the check
    def measure_rate(self, src: int = 0, dst: int = 1, nbytes: Optional[int] = None, port: int = 5201) -> float:
        """Payload bit/s of one TCP transfer from rank ``src`` to rank ``dst``, timed by the receiver
        from its first byte to the last (``nbytes``: default about 1.5 s of traffic at the set rate,
        2-256 MB)."""
        if not self.is_open:
            raise RuntimeError("EmulatedLink.measure_rate: the link is not open")
        if nbytes is None:
            rate = self.bandwidth_bps or 8e9
            nbytes = int(min(256e6, max(2e6, rate / 8 * 1.5)))
        recv = ("import socket,time,sys\n"
                "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                f"s.bind(('{self.addr(dst)}',{port})); s.listen(1); s.settimeout({CMD_TIMEOUT_S})\n"
                "print('ready',flush=True); c,_=s.accept(); c.settimeout(60); n=0; t0=None\n"
                "while True:\n"
                "    b=c.recv(1<<20)\n"
                "    if not b: break\n"
                "    t0=t0 or time.perf_counter(); n+=len(b)\n"
                "print(n, time.perf_counter()-t0)\n")
        send = ("import socket\n"
                f"s=socket.create_connection(('{self.addr(dst)}',{port}),timeout=20); s.settimeout(120)\n"
                f"b=bytes(1<<20); left={nbytes}\n"
                "while left>0:\n"
                "    k=min(left,len(b)); s.sendall(b[:k]); left-=k\n"
                "s.close()\n")
        rx = subprocess.Popen(self.wrap(dst, [sys.executable, "-c", recv]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        try:
            if rx.stdout.readline().strip() != "ready":
                raise RuntimeError(f"EmulatedLink.measure_rate: the receiver did not start: {rx.stderr.read()[-300:]}")
            _run(self.wrap(src, [sys.executable, "-c", send]), timeout=180)
            out, err = rx.communicate(timeout=60)
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait(timeout=10)
        try:
            n, secs = out.split()
        except ValueError:
            raise RuntimeError(f"EmulatedLink.measure_rate: no result from the receiver: {err[-300:]}") from None
        if int(n) != nbytes:
            raise RuntimeError(f"EmulatedLink.measure_rate: received {n} of {nbytes} bytes")
        return 8 * int(n) / float(secs)

    def check(self, tolerance: float = 0.10) -> float:
        """Measure rank 0 -> rank 1 and require the payload rate within ``tolerance`` of the set rate
        times TCP_EFFICIENCY; returns the measured bit/s."""
        got = self.measure_rate(0, 1)
        if self.bandwidth_bps is not None:
            want = self.bandwidth_bps * TCP_EFFICIENCY
            if abs(got - want) > tolerance * want:
                raise RuntimeError(f"EmulatedLink: a timed transfer ran at {got / 1e6:.1f} Mbit/s, not within "
                                   f"{tolerance:.0%} of the set {self.bandwidth_bps / 1e6:g} Mbit/s x "
                                   f"{TCP_EFFICIENCY:.3f} (TCP payload) = {want / 1e6:.1f} Mbit/s")
        return got


@atexit.register
def _close_all() -> None:
    for link in list(_open):
        link.close()
