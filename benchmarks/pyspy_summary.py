"""Where a process's Python time went, from a py-spy recording in its raw format (`py-spy record -f raw`: one
line a stack, `frame;frame;... count`, a frame `function (file:line)`).

Prints the share of the samples each function was on the stack for (inclusive) and at its top (self), over the
stacks that pass through a function whose name contains `--under` (e.g. "Engine.step (" for the engine's steps),
functions named `function (file.py)`, without their line numbers.

Usage: python benchmarks/pyspy_summary.py RAW.txt [--under "Engine.step ("] [--top 30] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter


def frame_name(frame: str) -> str:
    """`function (path/to/file.py:123)` -> `function (file.py)`."""
    name, sep, where = frame.partition(" (")
    if not sep:
        return frame
    return f"{name} ({where.rstrip(')').rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def read(path: str, under: str | None) -> tuple[Counter, Counter, int]:
    """(inclusive samples, self samples, total samples) of the stacks through `under`."""
    inclusive, own, total = Counter(), Counter(), 0
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            names = [frame_name(f) for f in stack.split(";")]
            if under is not None and not any(under in name for name in names):
                continue
            n = int(count)
            total += n
            for name in set(names):
                inclusive[name] += n
            own[names[-1]] += n
    return inclusive, own, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--under", help="only the stacks through a frame containing this")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    inclusive, own, total = read(a.raw, a.under)
    print(f"{a.raw}: {total} samples" + (f" through '{a.under}'" if a.under else ""))
    print(f"{'inclusive %':>12}{'self %':>8}  function")
    for name, n in inclusive.most_common(a.top):
        print(f"{100 * n / max(total, 1):>12.1f}{100 * own[name] / max(total, 1):>8.1f}  {name}")
    print(f"{'self %':>12}  function (the most self time)")
    for name, n in own.most_common(min(a.top, 15)):
        print(f"{100 * n / max(total, 1):>12.1f}  {name}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"raw": a.raw, "under": a.under, "samples": total,
                       "inclusive": dict(inclusive.most_common()), "self": dict(own.most_common())}, fh, indent=1)


if __name__ == "__main__":
    main()
