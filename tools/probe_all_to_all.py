"""How long S ranks take to swap equal messages over an emulated link, several ways (needs root).

    python tools/probe_all_to_all.py [--ranks 2] [--rate 100mbit] [--mb 0.6,1.2] [--tries 30]
        [--pause 0.05] [--queue-ms 50] [--cc bbr|reno] [--slow-start-after-idle 0|1]
        [--only gloo,recvfirst,allreduce,sendfirst,pairwise,acked,concurrent] [--show-qdisc]

Each rank runs in its own network namespace (``ist_kernels.experiments.harness.link.EmulatedLink``, removed
on every exit path) and times, ``--tries`` times each after a barrier and ``--pause`` seconds idle:
``dist.all_to_all_single`` (gloo's: ``gloo``), ``ist_kernels.distributed.group.all_to_all_single``
(``recvfirst``: every receive posted before any send), a ring ``all_reduce`` that sends the same
bytes per rank, isend-then-irecv pairs (``sendfirst``), the sends in S - 1 pairwise steps
(``pairwise``; ``acked``: each step waits for the peer's note that it arrived) and every receive
then every send at once by hand (``concurrent``). Rank 0 prints the mean, median, 90th percentile
and maximum in ms beside the link's time for the bytes, and the TCP retransmission counters of all
ranks' namespaces over the tries; ``--show-qdisc`` prints each shaper's sent and dropped packets.

What it showed (2 ranks, 100 Mbit/s, 1.2 MB each way, 30 tries): gloo's all-to-all and
isend-then-irecv 91-95 ms median but 182 ms at the 90th percentile (the two directions one after
the other); receives first 92 ms median, 117 ms at the 90th percentile; all_reduce 92 / 97 ms.
And (4 ranks, 10 Mbit/s, 0.6 MB to each peer, ``--pause 1``): under BBR 1.75 s a swap against
1.51 s of link time, 52,030 segments resent, all dropped by the sender's own shaper; under Reno
1.55 s, 230 resent (docs/experiments.md, "The emulated link").
"""
import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--mb", default="0.6,1.2", help="MB each rank sends each peer (comma-separated)")
    p.add_argument("--tries", type=int, default=30)
    p.add_argument("--pause", type=float, default=0.05, help="idle seconds before each timed collective")
    p.add_argument("--only", default="", help="comma-separated subset of: gloo,recvfirst,allreduce,sendfirst,pairwise,acked,concurrent")
    p.add_argument("--slow-start-after-idle", type=int, choices=(0, 1), default=None,
                   help="set net.ipv4.tcp_slow_start_after_idle in every rank's namespace (default: the link's)")
    p.add_argument("--queue-ms", type=float, default=50.0, help="the emulated link's queue (tbf latency)")
    p.add_argument("--show-qdisc", action="store_true", help="print every shaper's counters at the end")
    p.add_argument("--cc", default="", help="set net.ipv4.tcp_congestion_control in every rank's namespace (default: the link's own, "
                        "ist_kernels.experiments.harness.link.CONGESTION_CONTROL)")
    p.add_argument("--port", type=int, default=29611)
    return p.parse_args()


def tcp_counters() -> dict:
    """This namespace's TCP retransmission counters (/proc/net/snmp and /proc/net/netstat)."""
    want = {"Tcp": ("RetransSegs",), "TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPFastRetrans")}
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            sect, names = head.split(":")[0], head.split()[1:]
            for k, v in zip(names, vals.split()[1:]):
                if k in want.get(sect, ()):
                    out[k] = int(v)
    return out


def launch(args) -> int:
    from ist_kernels.experiments.harness import link as L

    reason = L.unavailable_reason()
    if reason:
        print(f"probe_all_to_all: {reason}", file=sys.stderr)
        return 2
    with L.EmulatedLink(args.ranks, L.parse_rate(args.rate), 0.0, queue_s=args.queue_ms / 1e3) as em:
        em.check()
        print(f"{args.ranks} ranks over {args.rate}, a {args.queue_ms:g} ms queue, TCP congestion control "
              f"{args.cc or em.tcp['congestion_control']}, slow start after idle "
              f"{em.tcp['slow_start_after_idle'] if args.slow_start_after_idle is None else args.slow_start_after_idle}",
              flush=True)
        procs = [subprocess.Popen(em.wrap(r, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                                          env=em.torchrun_env(r, args.ranks, args.port)))
                 for r in range(args.ranks)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=600))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(-9)
        if args.show_qdisc:  # what each shaper sent and dropped
            for ns in [em.bridge_netns] + [em.netns(r) for r in range(args.ranks)]:
                print(ns, subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show"],
                                         capture_output=True, text=True).stdout, flush=True)
    return max(abs(c) for c in codes)


def rank_main(args) -> int:
    from ist_kernels.distributed.group import all_to_all_single
    from ist_kernels.experiments.harness import link as L

    torch.set_num_threads(1)
    if args.slow_start_after_idle is not None:  # this process's namespace only
        with open("/proc/sys/net/ipv4/tcp_slow_start_after_idle", "w") as f:
            f.write(str(args.slow_start_after_idle))
    if args.cc:
        with open("/proc/sys/net/ipv4/tcp_congestion_control", "w") as f:
            f.write(args.cc)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    r, S = dist.get_rank(), dist.get_world_size()
    bps = L.parse_rate(args.rate)
    only = set(args.only.split(",")) if args.only else {"gloo", "recvfirst", "allreduce", "sendfirst", "pairwise", "acked", "concurrent"}

    def timeit(name, fn, expect_s):
        ts = []
        before = tcp_counters()
        for _ in range(args.tries):
            dist.barrier()
            time.sleep(args.pause)
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        after = tcp_counters()
        lost = [None] * S
        dist.all_gather_object(lost, {k: after[k] - before[k] for k in after})
        ts.sort()
        if r == 0:
            tot = {k: sum(d[k] for d in lost) for k in lost[0]}
            print(f"{name:44s} mean {sum(ts) / len(ts) * 1e3:7.1f}  median {ts[len(ts) // 2] * 1e3:7.1f}  p90 {ts[int(len(ts) * 0.9)] * 1e3:7.1f}  "
                  f"max {ts[-1] * 1e3:7.1f} ms  (link time {expect_s * 1e3:.1f} ms)  all ranks over "
                  f"{args.tries} tries: " + ", ".join(f"{k} {v}" for k, v in tot.items()), flush=True)

    for mb in (float(x) for x in args.mb.split(",")):
        n = int(mb * 1e6 / 4)
        x, y = torch.randn(n * S), torch.empty(n * S)
        wire = (S - 1) * n * 4 * 8 / bps
        if "gloo" in only:
            timeit(f"gloo all_to_all_single, {mb:g} MB per peer", lambda: dist.all_to_all_single(y, x), wire)
        if "recvfirst" in only:
            timeit(f"group.all_to_all_single, {mb:g} MB per peer",
                   lambda: all_to_all_single(y, x, [n] * S, [n] * S).wait(timeout=timedelta(seconds=60)), wire)
        z = torch.randn(int(mb * 1e6 * S / (2 * (S - 1)) / 4))  # a ring all_reduce sends 2(S-1)/S of it
        if "allreduce" in only:
            timeit(f"all_reduce sending {mb:g} MB per rank", lambda: dist.all_reduce(z), wire)

        def send_first():
            reqs = []
            for q in range(S):
                if q != r:
                    reqs += [dist.isend(x[q * n:(q + 1) * n], q), dist.irecv(y[q * n:(q + 1) * n], q)]
            for q in reqs:
                q.wait()
        def pairwise():
            recvs = {q: dist.irecv(y[q * n:(q + 1) * n], q) for q in range(S) if q != r}
            for k in range(1, S):
                send = dist.isend(x[(r + k) % S * n:((r + k) % S + 1) * n], (r + k) % S)
                recvs[(r - k) % S].wait()
                send.wait()
        ack_out, ack_in = torch.zeros(1), torch.zeros(1)

        def acked():
            recvs = {q: dist.irecv(y[q * n:(q + 1) * n], q) for q in range(S) if q != r}
            for k in range(1, S):
                dst, src = (r + k) % S, (r - k) % S
                ack = dist.irecv(ack_in, dst, tag=1)
                send = dist.isend(x[dst * n:(dst + 1) * n], dst)
                recvs[src].wait()
                a = dist.isend(ack_out, src, tag=1)  # "your step-k message has arrived"
                send.wait()
                ack.wait()
                a.wait()
        def concurrent():  # every receive posted, then every send at once
            reqs = [dist.irecv(y[q * n:(q + 1) * n], q) for q in range(S) if q != r]
            reqs += [dist.isend(x[q * n:(q + 1) * n], q) for q in range(S) if q != r]
            for q in reqs:
                q.wait()
        if "concurrent" in only:
            timeit(f"receives first, sends at once, {mb:g} MB per peer", concurrent, wire)
        if "acked" in only:
            timeit(f"pairwise steps, acked, {mb:g} MB per peer", acked, wire)
        if "pairwise" in only:
            timeit(f"pairwise steps, {mb:g} MB per peer", pairwise, wire)
        if "sendfirst" in only:
            timeit(f"isend then irecv, {mb:g} MB per peer", send_first, wire)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    a = parse()
    sys.exit(rank_main(a) if os.environ.get("RANK") is not None else launch(a))
