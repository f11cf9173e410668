"""The emulated link (ist_kernels.experiments.harness.link): parsing, the shaped rate in both directions,
torch.distributed through it, and that nothing it made survives any way out of it."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ist_kernels.distributed.cost import TCP_EFFICIENCY
from ist_kernels.experiments.harness import link as L


def test_parse_rate_and_time():
    assert L.parse_rate("100mbit") == 1e8 and L.parse_rate("1gbit") == 1e9 and L.parse_rate("500kbit") == 5e5
    assert L.parse_rate("2.5Gbit") == 2.5e9 and L.parse_rate("64000") == 64000.0
    for bad in ("100mbps", "fast", "", "-1mbit", "0mbit", "1 mb"):
        with pytest.raises(ValueError, match="--bandwidth"):
            L.parse_rate(bad)
    assert L.parse_time("5ms") == pytest.approx(0.005) and L.parse_time("0") == 0.0
    assert L.parse_time("100us") == pytest.approx(1e-4) and L.parse_time(0.25) == 0.25
    for bad in ("5 minutes", "ms", "x"):
        with pytest.raises(ValueError, match="--latency"):
            L.parse_time(bad)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="ranks"):
        L.EmulatedLink(1, 1e8)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        L.EmulatedLink(2, 0.0)
    with pytest.raises(ValueError, match="latency_s"):
        L.EmulatedLink(2, 1e8, -1.0)
    with pytest.raises(ValueError, match="queue_s"):
        L.EmulatedLink(2, 1e8, queue_s=0.0)


def test_unavailable_reason_says_root(monkeypatch):
    """Without the right to make namespaces the reason is one line naming root / CAP_NET_ADMIN."""
    real = L._run

    def refuse(args, timeout=L.CMD_TIMEOUT_S, check=True):
        if list(args[:3]) == ["ip", "netns", "add"]:
            return subprocess.CompletedProcess(args, 1, "", "mount --make-shared /run/netns failed: Operation "
                                               "not permitted")
        return real(args, timeout, check)

    monkeypatch.setattr(L, "_run", refuse)
    monkeypatch.setattr(L, "_reason", {})
    why = L.unavailable_reason()
    assert "root or CAP_NET_ADMIN" in why and "not permitted" in why and "\n" not in why


needs_netns = pytest.mark.skipif(L.unavailable_reason() is not None, reason=str(L.unavailable_reason()))


def _leftovers(prefix):
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [n for n in names.split() if n.startswith(prefix)] + [n for n in links.split() if n.startswith(prefix)]


@needs_netns
def test_shaped_both_ways_and_nothing_left():
    with L.EmulatedLink(3, 1e8) as link:
        want = 1e8 * TCP_EFFICIENCY
        up = link.check()  # within 10% of the set rate
        assert abs(up - want) <= 0.1 * want
        # rank 2 receives from 0 and 1 at once: its download is shaped too, and the two share it
        # (each flow's rate is timed over its own span, and TCP need not share evenly: one may end
        # first and the other finish alone, so the bound is on the two transfers' wall time)
        rates, n = {}, 12_000_000
        threads = [threading.Thread(target=lambda s=s, port=port: rates.__setitem__(s, link.measure_rate(
            s, 2, nbytes=n, port=port))) for s, port in ((0, 5301), (1, 5302))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        elapsed = time.monotonic() - t0
        assert len(rates) == 2 and all(r <= 1.1 * want for r in rates.values()), rates
        assert elapsed >= 0.9 * 2 * n * 8 / want, (elapsed, rates)  # unshaped: about half of it
        # every rank's TCP: the first loss-based congestion control the kernel lets a namespace pick
        allowed = open("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read().split()
        first = next((cc for cc in L.CONGESTION_CONTROL if cc in allowed), None)
        for r in range(3):
            got = subprocess.run(["ip", "netns", "exec", link.netns(r), "sysctl", "-n", "net.ipv4.tcp_congestion_control",
                                  "net.ipv4.tcp_slow_start_after_idle"], capture_output=True, text=True).stdout.split()
            assert got == [link.tcp["congestion_control"], str(L.SLOW_START_AFTER_IDLE)], (got, link.tcp)
            assert first is None or got[0] == first, (got, first)
        # the queue: tbf's latency
        q = subprocess.run(["ip", "netns", "exec", link.netns(0), "tc", "qdisc", "show", "dev", "r0"],
                           capture_output=True, text=True).stdout
        assert f"lat {L.QUEUE_S * 1e3:g}ms" in q, q
        assert sorted(link.leftovers()) == sorted([link.bridge_netns] + [link.netns(r) for r in range(3)])
    assert _leftovers(link.prefix) == []
    with L.EmulatedLink(2, None) as free:  # unshaped: well above what shaping would allow
        assert free.measure_rate(0, 1, nbytes=20_000_000) > 3e8
    assert _leftovers(free.prefix) == []


@needs_netns
def test_removed_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        with L.EmulatedLink(2, 1e8) as link:
            assert link.leftovers()
            1 / 0
    assert _leftovers(link.prefix) == []


_HOLDER = textwrap.dedent("""
    import sys, time
    from ist_kernels.experiments.harness import link as L
    link = L.EmulatedLink(2, 1e8).open()
    print(link.prefix, flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(7)
""")


@needs_netns
@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 7), (signal.SIGTERM, 128 + signal.SIGTERM),
                                         (signal.SIGKILL, -signal.SIGKILL)])
def test_removed_when_the_holder_is_signalled(sig, status):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        prefix = p.stdout.readline().strip()
        assert prefix.startswith(L.PREFIX) and _leftovers(prefix)
        p.send_signal(sig)
        assert p.wait(timeout=60) == status
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    if sig == signal.SIGKILL:  # nothing can run in a killed process: the next link's creator sweeps
        assert _leftovers(prefix)
        assert any(n.startswith(prefix) for n in L.cleanup_stale())
    assert _leftovers(prefix) == []


_RANK = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
    dist.destroy_process_group()
""")


@needs_netns
def test_torch_distributed_runs_through_it():
    with L.EmulatedLink(2, 1e9) as link:
        port = 29000 + os.getpid() % 500
        procs = [subprocess.Popen(link.wrap(r, [sys.executable, "-c", _RANK], env=link.torchrun_env(r, 2, port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=90)[0])
            finally:
                if p.poll() is None:
                    p.kill()
        assert [p.returncode for p in procs] == [0, 0], outs
        assert all("sum 3.0" in o for o in outs), outs
        env = link.torchrun_env(1, 2, port)
        assert env["MASTER_ADDR"] == link.addr(0) and env["GLOO_SOCKET_IFNAME"] == link.ifname(1)


@needs_netns
def test_latency_without_netem_fails_before_making_anything():
    if L.unavailable_reason(latency=True) is None:
        pytest.skip("this kernel has netem: latency is applied")
    link = L.EmulatedLink(2, 1e8, 0.005)
    with pytest.raises(RuntimeError, match="netem"):
        link.open()
    assert _leftovers(link.prefix) == []
