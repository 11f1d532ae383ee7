"""Where a step's device time goes, from a Chrome trace of torch.profiler (benchmarks/offline.py `profile(trace=)`,
moe_shapes.py --profile B --trace PATH): the kernels of each CUDA-graph replay grouped by the launch that issued
them, their median durations and the idle gaps between them, and the host time between replays.

    python benchmarks/kernel_timeline.py TRACE.json [--steps 20] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics


def load(path: str) -> tuple[list[dict], list[dict]]:
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launches = sorted((e for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")),
                      key=lambda e: e["ts"])
    return kernels, launches


def replays(kernels: list[dict], launches: list[dict]) -> list[list[dict]]:
    """The kernels of each graph launch, in launch order (matched on the runtime's correlation id)."""
    by_corr = collections.defaultdict(list)
    for k in kernels:
        by_corr[k.get("args", {}).get("correlation")].append(k)
    return [by_corr[l["args"]["correlation"]] for l in launches if by_corr.get(l["args"].get("correlation"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=20, help="the last N replays are summarised")
    ap.add_argument("--order", type=int, default=40, help="kernels of one replay listed in order")
    ap.add_argument("--json")
    a = ap.parse_args()
    kernels, launches = load(a.trace)
    groups = [g for g in replays(kernels, launches) if len(g) > 5][-a.steps:]
    if not groups:
        raise SystemExit("no graph replays with kernels in the trace")
    n = statistics.mode(len(g) for g in groups)
    groups = [g for g in groups if len(g) == n]
    span = [g[-1]["ts"] + g[-1]["dur"] - g[0]["ts"] for g in groups]
    busy = [sum(k["dur"] for k in g) for g in groups]
    between = [b[0]["ts"] - (a_[-1]["ts"] + a_[-1]["dur"]) for a_, b in zip(groups, groups[1:])]
    print(f"{len(groups)} replays of {n} kernels: span {statistics.median(span):.1f} us, kernels busy "
          f"{statistics.median(busy):.1f} us, gaps inside {statistics.median(span) - statistics.median(busy):.1f} us, "
          f"device idle between replays {statistics.median(between) if between else float('nan'):.1f} us (medians)")
    rows = []
    for i in range(n):
        durs = [g[i]["dur"] for g in groups]
        gaps = [g[i]["ts"] - (g[i - 1]["ts"] + g[i - 1]["dur"]) if i else 0.0 for g in groups]
        rows.append({"i": i, "name": groups[0][i]["name"], "dur_us": statistics.median(durs),
                     "gap_before_us": statistics.median(gaps)})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"kernels_per_replay": n, "span_us": span, "busy_us": busy, "between_us": between,
                       "rows": rows}, fh, indent=1)
    by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        short = r["name"][:70]
        by_name[short][0] += 1
        by_name[short][1] += r["dur_us"]
        by_name[short][2] += r["gap_before_us"]
    print(f"{'kernel':<72}{'count':>6}{'us':>9}{'gaps us':>9}")
    for name, (c, d, g) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<72}{c:>6}{d:>9.1f}{g:>9.1f}")
    print("\none replay in order (median us):")
    for r in rows[:a.order]:
        print(f"{r['i']:>4} {r['dur_us']:>7.1f} gap {r['gap_before_us']:>5.1f}  {r['name'][:90]}")


if __name__ == "__main__":
    main()
