"""Do ranks on one host slow each other down? One engine per GPU, each in its own process (as the
ranks of `dp_sync: never` are), running the same share of the 256 x 128 workload alone and at the
same time as the others, interleaved, so machine drift hits both alike.

Each process loads its engine once (no NCCL, no launcher), then waits for commands. A scenario names
the processes that run (`0`, `1`, `01`); each runs its half of the cut prompts (process i takes
prompts i, i + P, ...) and reports wall ms per step, the part of it spent waiting for the step's
device-to-host copy (the device's share as the host sees it) and the rest (host work), plus two host
probes run just before: a pure-Python loop (CPU speed) and small pwrite()s (system-call cost).

Usage: python benchmarks/concurrency_probe.py --pair PAIR_DIR [--gpus 0,1] [--scenarios 0,1,01,0,1,01]
           [--method none] [--threads 1] [--pin] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def cpu_probe_ms(n: int = 300_000) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i & 7
    return (time.perf_counter() - t) * 1e3


def pwrite_probe_us(n: int = 2000) -> float:
    fd, path = tempfile.mkstemp()
    rec = b"x" * 191 + b"\n"
    t = time.perf_counter()
    for _ in range(n):
        os.pwrite(fd, rec, 0)
    dt = time.perf_counter() - t
    os.close(fd)
    os.remove(path)
    return dt / n * 1e6


def child(a) -> None:
    import torch
    from transformers import AutoTokenizer

    from offline import build, run
    from workloads import cut_prompts

    torch.set_num_threads(a.threads)
    me, P = a.child, len(a.gpus.split(","))
    if a.pin:
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // P
        os.sched_setaffinity(0, cpus[me * share:(me + 1) * share])
    a.target, a.dtype, a.max_model_len, a.max_batched_tokens = None, "bfloat16", 2048, 16384
    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    prompts = [tok(t)["input_ids"] for t in cut_prompts(a.pair, 4, a.requests)][me::P]
    engine = build(a, a.method, False, a.max_num_seqs)
    run(engine, prompts[:a.max_num_seqs], 16)                    # warm-up
    waited = [0.0]
    to_host = engine._read

    def timed_to_host(*args):
        t = time.perf_counter()
        try:
            return to_host(*args)
        finally:
            waited[0] += time.perf_counter() - t
    engine._read = timed_to_host
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        cpu_ms, pw_us = cpu_probe_ms(), pwrite_probe_us()
        waited[0] = 0.0
        s0 = engine.counters.steps
        _, wall = run(engine, prompts, a.new)
        steps = engine.counters.steps - s0
        print("RESULT " + json.dumps({"proc": me, "steps": steps, "wall_s": wall, "ms_per_step": wall / steps * 1e3,
                                      "wait_ms_per_step": waited[0] / steps * 1e3,
                                      "host_ms_per_step": (wall - waited[0]) / steps * 1e3,
                                      "cpu_probe_ms": cpu_ms, "pwrite_us": pw_us}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--scenarios", default="0,1,01,0,1,01,01,0,1")
    ap.add_argument("--method", default="none")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", action="store_true", help="each process on its own share of the CPUs")
    ap.add_argument("--child", type=int, default=-1)
    ap.add_argument("--json")
    a = ap.parse_args()
    a.pair = os.path.abspath(a.pair)
    if a.child >= 0:
        return child(a)
    gpus = a.gpus.split(",")
    procs = []
    for i, g in enumerate(gpus):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(i)] + sys.argv[1:]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES=g), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1))

    def read_tagged(p, tag):
        for line in p.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"a probe process ended early (exit {p.wait()})")

    for p in procs:
        read_tagged(p, "READY")
    rows = []
    for sc in a.scenarios.split(","):
        ids = [int(c) for c in sc]
        for i in ids:                        # started within microseconds of each other
            procs[i].stdin.write("run\n")
        for i in ids:
            r = json.loads(read_tagged(procs[i], "RESULT "))
            r["scenario"] = "alone" if len(ids) == 1 else "together"
            r["ran"] = sc
            rows.append(r)
            print(json.dumps(r), flush=True)
    for p in procs:
        p.stdin.close()
        p.wait()
    print(f"{'proc':>4} {'scenario':>9} {'runs':>5} {'ms/step':>8} {'host ms':>8} {'wait ms':>8} {'cpu probe ms':>13} "
          f"{'pwrite us':>10}")
    summary = []
    for i in range(len(procs)):
        for sc in ("alone", "together"):
            rs = [r for r in rows if r["proc"] == i and r["scenario"] == sc]
            if not rs:
                continue
            m = {k: statistics.median(r[k] for r in rs) for k in
                 ("ms_per_step", "host_ms_per_step", "wait_ms_per_step", "cpu_probe_ms", "pwrite_us")}
            summary.append({"proc": i, "scenario": sc, "runs": len(rs), **m})
            print(f"{i:>4} {sc:>9} {len(rs):>5} {m['ms_per_step']:>8.3f} {m['host_ms_per_step']:>8.3f} "
                  f"{m['wait_ms_per_step']:>8.3f} {m['cpu_probe_ms']:>13.2f} {m['pwrite_us']:>10.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": vars(a), "rows": rows, "medians": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
