"""Where each process's time went, from py-spy's collapsed stacks (`py-spy record --subprocesses --format raw`):
per process (the innermost "process PID:CMD" frame of a stack), its samples and the functions with the most samples
inclusive (the function anywhere on the stack) and exclusive (the function on top), line numbers dropped. Written
for benchmarks/run_h200.sh s30serve (served rank against offline engine, issue 33), small enough to come back
from the device where the raw file does not.

`--within FUNC` keeps only the stacks with FUNC on them (e.g. "Engine.step": where a rank's steps go, start-up left
out), each process's shares then of those samples. RAW may be gzipped.

Usage: python benchmarks/pyspy_steps.py RAW.txt[.gz] [--top 60] [--min-samples 500] [--within FUNC] --json OUT.json
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os

def frame_name(frame: str) -> str:
    """"step (specdp_cli/runtime/engine.py:412)" -> "step (engine.py)"."""
    name, _, where = frame.partition(" (")
    return f"{name} ({os.path.basename(where.rstrip(')').rsplit(':', 1)[0])})" if where else name


def summarize(path: str, top: int, min_samples: int, within: str | None = None) -> dict:
    procs: dict[str, dict] = {}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            last_proc = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
            proc = frames[last_proc] if last_proc >= 0 else "?"
            funcs = [frame_name(f) for f in frames[last_proc + 1:] if not f.startswith("thread ")]
            if within is not None and not any(f.split(" (")[0] == within for f in funcs):
                continue
            p = procs.setdefault(proc, {"samples": 0, "inclusive": collections.Counter(),
                                        "exclusive": collections.Counter()})
            p["samples"] += n
            for f in set(funcs):
                p["inclusive"][f] += n
            if funcs:
                p["exclusive"][funcs[-1]] += n
    out = {}
    for proc, p in sorted(procs.items(), key=lambda kv: -kv[1]["samples"]):
        if p["samples"] < min_samples:
            continue
        out[proc[:200]] = {"samples": p["samples"], "inclusive": p["inclusive"].most_common(top),
                           "exclusive": p["exclusive"].most_common(top)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--min-samples", type=int, default=500)
    ap.add_argument("--within", help="only the stacks with this function on them (its name as py-spy gives it)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    out = summarize(a.raw, a.top, a.min_samples, a.within)
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)
    for proc, p in out.items():
        print(f"== {proc[:150]}: {p['samples']} samples")
        for f, n in p["inclusive"][:25]:
            print(f"  {100 * n / p['samples']:5.1f} %  {f}")
        print("  on top:")
        for f, n in p["exclusive"][:12]:
            print(f"  {100 * n / p['samples']:5.1f} %  {f}")


if __name__ == "__main__":
    main()
