"""A GPU rank's intra-op threads: the offline engine with OMP_NUM_THREADS at each of --threads, side by side.
A count may repeat (`--threads 1,1,1`): identical engines, how far apart two processes of the same work run.

One offline engine (`offline.py --stdin-rounds`, codepair, 256 prompts, 32 sequences, as `serve_bench.py` runs it)
per thread count, all on the one GPU at once (each with its share of its memory), taking turns round by round so that
each meets the machine's changing speed alike. `--cpu N` confines every engine to CPU N (as `serve_bench.py
--rank-cpu` confines the rank and its offline twin); without it they run where the scheduler puts them.

Usage: python benchmarks/rank_threads.py --pair PAIR_DIR [--method none] [--threads 4,1] [--cpu N] [--rounds 7]
       --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from serve_bench import offline_round, start_offline_rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--method", default="none")
    ap.add_argument("--threads", default="4,1")
    ap.add_argument("--cpu", type=int)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    counts = [int(t) for t in a.threads.split(",")]      # a count may repeat: identical engines, side by side
    engines = []
    for i, t in enumerate(counts):
        args = ["--pair", a.pair, "--requests", str(a.requests), "--batches", "32", "--methods", a.method, "--new",
                "128", "--gpu-memory-utilization", f"{0.8 * (i + 1) / len(counts):.3f}"]
        pin = (lambda: os.sched_setaffinity(0, {a.cpu})) if a.cpu is not None else None
        engines.append(start_offline_rounds(args, env=dict(os.environ, OMP_NUM_THREADS=str(t)), preexec_fn=pin))
    rounds: list[list[dict]] = [[] for _ in counts]
    for _ in range(a.rounds):
        for i, p in enumerate(engines):
            rounds[i].append(offline_round(p))
    for p in engines:
        p.stdin.close()
        p.wait(60)
    # each round's tok/s over the first engine's round just before it (the pairs met the same machine)
    rows = []
    print(f"{a.method}, {'CPU ' + str(a.cpu) if a.cpu is not None else 'unpinned'}")
    print(f"{'engine':>7}{'threads':>8}{'tok/s':>10}{'ms/step':>9}{'x first (pairs)':>16}  rounds")
    for i, t in enumerate(counts):
        rs = rounds[i]
        tok = statistics.median(r["tok_s"] for r in rs)
        pairs = statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(rs, rounds[0]))
        rows.append({"engine": i, "threads": t, "tok_s": tok,
                     "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
                     "pair_ratio_median": pairs, "rounds": rs})
        print(f"{i:>7}{t:>8}{tok:>10.0f}{rows[-1]['ms_per_step']:>9.3f}{pairs:>16.2f}  "
              + ", ".join(f"{r['tok_s']:.0f}" for r in rs))
    with open(a.json, "w") as fh:
        json.dump({"argv": sys.argv[1:], "method": a.method, "cpu": a.cpu, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
