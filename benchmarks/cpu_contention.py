"""Does work on the machine's other CPUs slow a host-bound engine on its own CPU?

A served rank shares the machine with its HTTP frontend and, in `serve_bench.py`, with the load-generating clients;
the offline engine it is compared with runs while those are idle. This runs one offline engine (`offline.py
--stdin-rounds`, codepair, 256 prompts, 32 sequences, as `serve_bench.py` runs it) pinned to one CPU, and before each
of its rounds starts N busy processes pinned to other CPUs: a Python spin loop (`spin`, as the frontend and clients'
Python keeps a core busy) or a memory-copy loop (`copy`, 64 MiB buffers: last-level cache and memory traffic). The
settings take turns, round by round, so that each one meets the machine's changing speed alike.

`--kinds frontend`: the real serving load instead, `frontend_bench.py` (an HTTP frontend, a stand-in rank offering
eagle's token rate, N load-generating processes: `--others`) on the other CPUs, started once and kept running; it is
stopped (SIGSTOP) for the idle rounds and continued for its own.

`--each-cpu`: one spinning process at a time, on each other CPU in turn (`spin@J`), against none busy: does one CPU
slow the engine's CPU more than the others (in a virtual machine, two vCPUs can be one physical core's two hardware
threads while the guest sees one thread a core)?

Usage: python benchmarks/cpu_contention.py --pair PAIR_DIR [--method none] [--cpu 3] [--others 0,5]
       [--kinds spin,copy,frontend] [--each-cpu] [--rounds 5] [--requests 256] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from serve_bench import offline_round, start_offline_rounds

BUSY = {
    "spin": "while True: pass",
    "copy": "import numpy as np\na = np.ones(1 << 23); b = np.empty_like(a)\nwhile True: np.copyto(b, a)",
}


def start_busy(kind: str, cpus: list[int]) -> list[subprocess.Popen]:
    procs = []
    for cpu in cpus:
        p = subprocess.Popen([sys.executable, "-c", BUSY[kind]], preexec_fn=lambda c=cpu: os.sched_setaffinity(0, {c}))
        procs.append(p)
    return procs


FRONTEND_PORT = 8391


def start_frontend_load(pair: str, clients: int, cpus: list[int]) -> subprocess.Popen:
    """frontend_bench.py serving without end on `cpus` (its own process group), once its load is flowing."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, os.path.join(here, "frontend_bench.py"), "--tokenizer",
                          os.path.join(pair, "tokenizer"), "--step-ms", "0.7", "--tokens-per-step", "3", "--async-steps",
                          "--client-workers", str(clients), "--requests", "10000000", "--port", str(FRONTEND_PORT)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, set(cpus)))
    for _ in range(240):
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{FRONTEND_PORT}/metrics", timeout=2).read().decode()
            if any(line.startswith("specdp:generation_tokens_total") and float(line.rsplit(" ", 1)[1]) > 0
                   for line in text.splitlines()):
                return p
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    raise SystemExit("frontend_bench.py's load did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--method", default="none")
    ap.add_argument("--cpu", type=int, default=3)
    ap.add_argument("--others", default="0,5", help="counts of busy processes, each on a CPU of its own")
    ap.add_argument("--kinds", default="spin,copy")
    ap.add_argument("--each-cpu", action="store_true", help="one spinning process, on each other CPU in turn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    free = sorted(os.sched_getaffinity(0) - {a.cpu})
    eng = start_offline_rounds(["--pair", a.pair, "--requests", str(a.requests), "--batches", "32", "--methods",
                                a.method, "--new", "128"], preexec_fn=lambda: os.sched_setaffinity(0, {a.cpu}))
    settings = [(k, n) for k in a.kinds.split(",") for n in (int(x) for x in a.others.split(",")) if n or k == "spin"]
    if a.each_cpu:
        settings = [("spin", 0)] + [("spin", f"@{c}") for c in free]
    results: dict[str, list[dict]] = {f"{k}x{n}": [] for k, n in settings}
    loads = {n: start_frontend_load(a.pair, n, free) for k, n in settings if k == "frontend"}
    try:
        for _ in range(a.rounds):
            for kind, n in settings:
                for m, load in loads.items():          # only this round's load runs
                    os.killpg(load.pid, signal.SIGCONT if (kind, n) == ("frontend", m) else signal.SIGSTOP)
                cpus = [int(n[1:])] if isinstance(n, str) else free[:n]
                busy = start_busy(kind, cpus) if kind != "frontend" else []
                try:
                    results[f"{kind}x{n}"].append(offline_round(eng))
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
    finally:
        for load in loads.values():
            os.killpg(load.pid, signal.SIGKILL)
    eng.stdin.close()
    eng.wait(60)
    base = statistics.median(r["tok_s"] for r in results["spinx0"]) if "spinx0" in results else None
    rows = []
    print(f"{'others busy':<14}{'tok/s':>10}{'ms/step':>10}{'x idle':>8}  rounds")
    for name, rs in results.items():
        tok = statistics.median(r["tok_s"] for r in rs)
        ms = statistics.median(r["ms_per_step"] for r in rs)
        rel = tok / base if base else None
        rows.append({"setting": name, "tok_s": tok, "ms_per_step": ms, "x_idle": rel, "rounds": rs})
        label = "none" if name.endswith("x0") else name.replace("x@", "@")
        print(f"{label:<14}{tok:>10.0f}{ms:>10.3f}{(rel or 0):>8.2f}  " + ", ".join(f"{r['tok_s']:.0f}" for r in rs))
    with open(a.json, "w") as fh:
        json.dump({"argv": sys.argv[1:], "cpu": a.cpu, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
