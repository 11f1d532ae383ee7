"""What a rank's step message costs its sender when the reader sleeps: a serving rank sends each API server a message
every step (server/rank.py), and an API server with nothing else to do waits for it in epoll, on a CPU that has gone
idle. Waking it (the kernel's wake-up and, in a virtual machine, an inter-processor interrupt through the hypervisor)
happens inside the sender's system call, on the rank's critical path.

This process (the sender, on one CPU) does a fixed piece of Python work, as a host-bound step does, then sends a
step-sized message over a Unix socket to a reader process on another CPU, in blocks that take turns:
- `none`: no message (the work alone);
- `idle`: the reader waits in a blocking read (asleep between messages, as an idle API server is);
- `busy`: the reader polls without blocking (awake when the message comes: no wake-up).
It reports each mode's send time and the work's time (a wake-up that slowed the sender's own code afterwards would
show in the work). Run it on the machine in question: the cost depends on the kernel and the hypervisor.

Usage: python benchmarks/link_wake.py [--bytes 2048] [--blocks 200] [--per-block 10] [--work 3000] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time

MODES = ("none", "idle", "busy")


def python_work(n: int) -> int:
    """A host-bound step's kind of work: dict and list traffic in the interpreter."""
    d: dict[int, int] = {}
    s = 0
    for i in range(n):
        d[i & 255] = i
        s += d.get(i & 127, 0)
    return s


def reader(sock: socket.socket, other: socket.socket, busy, cpu: int | None) -> None:
    """Reads until the sender closes: blocking while `busy` is 0, polling without blocking while it is 1."""
    other.close()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    while True:
        if busy.value:
            try:
                data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
        else:
            data = sock.recv(1 << 16)
        if not data:
            return


def measure(a, mine: int | None, theirs: int | None) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("fork")
    busy = ctx.Value("b", 0, lock=False)
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    p = ctx.Process(target=reader, args=(b_sock, a_sock, busy, theirs), daemon=True)
    p.start()
    b_sock.close()
    if mine is not None:
        os.sched_setaffinity(0, {mine})
    msg = b"x" * a.bytes
    work: dict[str, list[int]] = {m: [] for m in MODES}
    send: dict[str, list[int]] = {m: [] for m in MODES}
    order = list(MODES)
    for blk in range(a.blocks):
        for mode in order[blk % 3:] + order[:blk % 3]:          # each mode first in turn
            busy.value = 1 if mode == "busy" else 0
            for i in range(a.per_block + 2):                    # the first two settle the reader into the mode
                t0 = time.perf_counter_ns()
                python_work(a.work)
                t1 = time.perf_counter_ns()
                if mode != "none":
                    a_sock.sendall(msg)
                t2 = time.perf_counter_ns()
                if i >= 2:
                    work[mode].append(t1 - t0)
                    send[mode].append(t2 - t1)
    a_sock.close()
    p.join(10)

    def q(xs: list[int], f: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))] / 1e3

    return {m: {"send_us_median": statistics.median(send[m]) / 1e3, "send_us_p90": q(send[m], 0.9),
                "work_us_median": statistics.median(work[m]) / 1e3, "work_us_p90": q(work[m], 0.9),
                "samples": len(work[m])} for m in MODES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=2048, help="a message's size (a step's at 32 requests: about 2 KB)")
    ap.add_argument("--blocks", type=int, default=200)
    ap.add_argument("--per-block", type=int, default=10)
    ap.add_argument("--work", type=int, default=3000, help="python_work's loop count (about 0.2 ms here)")
    ap.add_argument("--json")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    mine, theirs = (cpus[0], cpus[1]) if len(cpus) > 1 else (None, None)       # the sender's CPU, the reader's
    rows = measure(a, mine, theirs)
    print(f"{'reader':<8}{'send us (median)':>18}{'p90':>8}{'work us (median)':>18}{'p90':>8}")
    for m, r in rows.items():
        print(f"{m:<8}{r['send_us_median']:>18.2f}{r['send_us_p90']:>8.2f}{r['work_us_median']:>18.1f}"
              f"{r['work_us_p90']:>8.1f}")
    wake = rows["idle"]["send_us_median"] - rows["busy"]["send_us_median"]
    print(f"a wake-up costs the sender about {wake:.1f} us a message")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "sender_cpu": mine, "reader_cpu": theirs, "rows": rows,
                       "wake_us": wake}, fh, indent=1)


if __name__ == "__main__":
    main()
