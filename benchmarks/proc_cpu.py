"""Where the CPU went while a job ran: each process's and thread's share of a window, how long its threads
waited for a CPU (the kernel's run-queue time, /proc/PID/task/TID/schedstat), and whether the container's CPU
quota throttled it (the cgroup's cpu.stat). A host-bound step that runs slower in one setting than another
with the same work is either doing more or getting less CPU: this tells the second apart.

Usage: python benchmarks/proc_cpu.py --seconds 3 [--match specdp] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def snapshot(match: str) -> dict:
    """{(pid, tid): (name, cmdline, cpu seconds, run-queue wait seconds, last CPU)} of matching processes' threads."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        cmd = " ".join((_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").split())
        if not cmd or (match and match not in cmd) or int(pid) == os.getpid():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            if stat is None:
                continue
            name = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICK           # utime + stime
            last_cpu = int(fields[36])
            sched = (_read(f"/proc/{pid}/task/{tid}/schedstat") or "").split()
            on_cpu = int(sched[0]) / 1e9 if sched else cpu
            wait = int(sched[1]) / 1e9 if len(sched) > 1 else None
            out[(int(pid), int(tid))] = (name, cmd[:90], on_cpu, wait, last_cpu)
    return out


def steal_s() -> float | None:
    """Seconds of every CPU's time the hypervisor gave to others (/proc/stat's steal), summed over CPUs."""
    line = (_read("/proc/stat") or "").split("\n", 1)[0].split()
    return int(line[8]) / TICK if len(line) > 8 and line[0] == "cpu" else None


def cgroup_stat() -> dict:
    text = _read("/sys/fs/cgroup/cpu.stat") or ""
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--match", default="", help="only processes whose command line contains this")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args()
    quota = (_read("/sys/fs/cgroup/cpu.max") or "").strip()
    g0, st0, s0, t0 = cgroup_stat(), steal_s(), snapshot(a.match), time.monotonic()
    time.sleep(a.seconds)
    g1, st1, s1, dt = cgroup_stat(), steal_s(), snapshot(a.match), time.monotonic() - t0
    steal = 100 * (st1 - st0) / dt if st0 is not None and st1 is not None else None
    rows = []
    for key, (name, cmd, cpu, wait, last_cpu) in s1.items():
        if key not in s0:
            continue
        _, _, cpu0, wait0, _ = s0[key]
        rows.append({"pid": key[0], "tid": key[1], "thread": name, "cmd": cmd, "cpu_pct": 100 * (cpu - cpu0) / dt,
                     "runqueue_wait_pct": 100 * (wait - wait0) / dt if wait is not None and wait0 is not None else None,
                     "last_cpu": last_cpu})
    rows.sort(key=lambda r: -r["cpu_pct"])
    per_process: dict[int, float] = {}
    for r in rows:
        per_process[r["pid"]] = per_process.get(r["pid"], 0.0) + r["cpu_pct"]
    cg = {k: g1[k] - g0.get(k, 0) for k in g1}
    print(f"window {dt:.2f} s; os.cpu_count {os.cpu_count()}; usable CPUs {len(os.sched_getaffinity(0))}; "
          f"cgroup cpu.max {quota or '-'}; stolen by the hypervisor {f'{steal:.1f}' if steal is not None else '-'} % of a CPU")
    if cg:
        print("cgroup cpu.stat deltas: " + ", ".join(f"{k} {v}" for k, v in cg.items()))
    print(f"{'cpu %':>7}{'wait %':>8}{'cpu#':>5}  thread / process")
    for r in rows[: a.top]:
        w = f"{r['runqueue_wait_pct']:.1f}" if r["runqueue_wait_pct"] is not None else "-"
        print(f"{r['cpu_pct']:>7.1f}{w:>8}{r['last_cpu']:>5}  {r['thread']} [{r['pid']}/{r['tid']}] {r['cmd']}")
    print("processes: " + "; ".join(f"{pid} {pct:.0f} %" for pid, pct in
                                    sorted(per_process.items(), key=lambda kv: -kv[1])[:8]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"seconds": dt, "cpu_max": quota, "steal_pct": steal, "cgroup": cg, "threads": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
