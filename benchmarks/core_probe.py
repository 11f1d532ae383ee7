"""Whether this machine's CPUs run Python alike: the topology (each CPU's core, its SMT siblings, its NUMA node,
the GPUs' local CPUs) and a fixed pure-Python loop pinned to each CPU in turn (alone, then with a busy loop on
its SMT sibling when it has one), repeated. A host-bound engine step (a small model, sub-millisecond steps) runs
at its CPU's Python speed: two processes of the same job ran up to 2x apart on one H200 machine
(benchmarks/results/2026-12-02-h200-s23-*). This tells a slow CPU, a busy sibling and a noisy machine apart.

--pairs V1,V2 measures each victim CPU with a busy loop on every other CPU in turn (alone and beside, back to back):
a virtual machine's CPUs may share physical cores (or host threads) that its topology does not show. --parallel
1,2,4,8,16 runs N pinned loops at once: whether the machine gives N busy CPUs N CPUs' worth of Python.

Usage: python benchmarks/core_probe.py [--rounds 3] [--loop 300000] [--pairs 0,7] [--parallel 1,2,4,8,16]
           [--json OUT.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import statistics
import time


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def topology() -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    out = {}
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}"
        node = [os.path.basename(p)[4:] for p in glob.glob(f"{base}/node*")]
        out[c] = {"core": _read(f"{base}/topology/core_id"), "package": _read(f"{base}/topology/physical_package_id"),
                  "siblings": _read(f"{base}/topology/thread_siblings_list"), "node": node[0] if node else "",
                  "mhz": _read(f"{base}/cpufreq/scaling_cur_freq")}
    gpus = {}
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        if _read(f"{dev}/vendor") == "0x10de" and _read(f"{dev}/class").startswith("0x0302"):
            gpus[os.path.basename(dev)] = {"local_cpus": _read(f"{dev}/local_cpulist"),
                                           "numa_node": _read(f"{dev}/numa_node")}
    return {"cpus": out, "gpus": gpus}


def _loop(n: int) -> float:
    t = time.perf_counter()
    d = dict.fromkeys(range(1024), 0)
    s = 0
    for i in range(n):                   # dict and int work, as the engine's Python does
        d[i & 1023] = i
        s += d[(i * 7) & 1023]
    return time.perf_counter() - t


def _pinned(cpu: int, n: int, q) -> None:
    os.sched_setaffinity(0, {cpu})
    _loop(n // 10)
    q.put(_loop(n))


def _busy(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        _loop(10000)


def probe(cpu: int, n: int, sibling: int | None) -> float:
    ctx = mp.get_context("fork")
    q, stop = ctx.Queue(), ctx.Event()
    busy = None
    if sibling is not None:
        busy = ctx.Process(target=_busy, args=(sibling, stop))
        busy.start()
    p = ctx.Process(target=_pinned, args=(cpu, n, q))
    p.start()
    ms = 1e3 * q.get()
    p.join()
    if busy is not None:
        stop.set()
        busy.join()
    return ms


def _pinned_at(cpu: int, n: int, q, ready, go) -> None:
    os.sched_setaffinity(0, {cpu})
    _loop(n // 10)
    ready.put(cpu)
    go.wait()
    q.put(_loop(n))


def parallel(cpus: list[int], n: int) -> list[float]:
    """ms of the loop on each of `cpus`, all started together."""
    ctx = mp.get_context("fork")
    q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_pinned_at, args=(c, n, q, ready, go)) for c in cpus]
    for p in ps:
        p.start()
    for _ in ps:
        ready.get()                      # each has pinned itself and warmed up
    go.set()
    out = [1e3 * q.get() for _ in ps]
    for p in ps:
        p.join()
    return out


def pairs(victim: int, cpus: list[int], n: int, rounds: int) -> dict[int, float]:
    """For each other CPU: the victim's loop beside a busy loop there over the victim's loop alone measured right
    before (the median ratio of `rounds`)."""
    out = {}
    for j in cpus:
        if j == victim:
            continue
        ratios = []
        for _ in range(rounds):
            alone = probe(victim, n, None)
            ratios.append(probe(victim, n, j) / alone)
        out[j] = statistics.median(ratios)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loop", type=int, default=300000)
    ap.add_argument("--pairs", default="", help="victim CPUs: each measured beside a busy loop on every other CPU")
    ap.add_argument("--parallel", default="", help="counts of loops run at once on CPUs 0..N-1, e.g. 1,2,4,8,16")
    ap.add_argument("--json")
    a = ap.parse_args()
    topo = topology()
    extra = {}
    cpus_all = sorted(topo["cpus"])
    if a.parallel:
        extra["parallel"] = []
        for _ in range(a.rounds):
            for N in [int(x) for x in a.parallel.split(",")]:
                ms = parallel(cpus_all[:N], a.loop)
                extra["parallel"].append({"n": N, "ms": ms})
                print(f"parallel {N:>3}: median {statistics.median(ms):6.1f} ms, max {max(ms):6.1f}", flush=True)
    if a.pairs:
        extra["pairs"] = {}
        for v in [int(x) for x in a.pairs.split(",")]:
            r = pairs(v, cpus_all, a.loop, a.rounds)
            extra["pairs"][v] = r
            print(f"victim {v}: beside / alone by busy CPU: " + " ".join(f"{j}:{x:.2f}" for j, x in r.items()), flush=True)
    cpus = sorted(topo["cpus"])
    print("GPUs:", json.dumps(topo["gpus"]))
    alone = {c: [] for c in cpus}
    shared = {c: [] for c in cpus}
    for _ in range(a.rounds):
        for c in cpus:
            alone[c].append(probe(c, a.loop, None))
            sib = [int(s) for s in topo["cpus"][c]["siblings"].replace("-", ",").split(",") if s and int(s) != c]
            sib = [s for s in sib if s in topo["cpus"]]
            if sib:
                shared[c].append(probe(c, a.loop, sib[0]))
    print(f"{'cpu':>4} {'core':>5} {'node':>5} {'siblings':>10} {'MHz':>8} {'alone ms (rounds)':>30} {'sibling busy ms':>22}")
    rows = []
    for c in cpus:
        t = topo["cpus"][c]
        row = {"cpu": c, **t, "alone_ms": alone[c], "sibling_busy_ms": shared[c]}
        rows.append(row)
        print(f"{c:>4} {t['core']:>5} {t['node']:>5} {t['siblings']:>10} {t['mhz']:>8} "
              f"{' '.join(f'{x:6.1f}' for x in alone[c]):>30} {' '.join(f'{x:6.1f}' for x in shared[c]):>22}")
    med = [statistics.median(alone[c]) for c in cpus]
    print(f"alone: median of CPUs {statistics.median(med):.1f} ms, fastest {min(med):.1f}, slowest {max(med):.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"gpus": topo["gpus"], "rows": rows, **extra}, fh, indent=1)


if __name__ == "__main__":
    main()
