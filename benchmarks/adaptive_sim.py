"""The adaptive k's model against synthetic step costs, on the CPU in seconds: a check of a change to
runtime/spec_length.py before it costs device time.

Each run drives one SpecLength through 250 steps of 32 rows: acceptance drawn per position, each step's
time from a cost regime (decode steps; steps with prompt chunks, whose cost grows with the prompt rows
they carry and little with k; optional stalls of a few steps' time). Rows compare adaptive with every
fixed k over the same seeds (tokens / simulated seconds, medians over --seeds). The regimes' numbers
are shaped on the H200's codepair steps (docs/benchmarks.md), not measured here.

  python benchmarks/adaptive_sim.py [--seeds 16] [--steps 250] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from specdp_cli.runtime.spec_length import SpecLength  # noqa: E402

ACCEPT = (0.8, 0.7, 0.65, 0.6, 0.55, 0.5)       # per position, given the earlier drafts were accepted
ROWS = 32
REGIMES = {   # ms: decode step at k = 0 and 1, per further k; chunk steps: share, base, per prompt row, per k
    "decode steps, k = 0 a little cheaper": dict(k0=0.83, k1=0.93, per_k=0.07, share=0.6, c_base=1.2, c_row=0.1,
                                                c_k=0.05, stall_p=0.0, stall_ms=0.0),
    "k = 0 much cheaper (no drafter)": dict(k0=0.55, k1=0.85, per_k=0.06, share=0.6, c_base=1.2, c_row=0.1,
                                            c_k=0.05, stall_p=0.0, stall_ms=0.0),
    "... and 2 % of steps stall 20 ms": dict(k0=0.55, k1=0.85, per_k=0.06, share=0.6, c_base=1.2, c_row=0.1,
                                             c_k=0.05, stall_p=0.02, stall_ms=20.0),
}


def simulate(regime: dict, seed: int, steps: int, fixed: int | None) -> tuple[float, int]:
    """tok/s of one run and its most used k."""
    rnd = random.Random(seed)
    s = SpecLength(6, None, True, drafter_forward="per_draft")
    # start-up timings as the engine takes them: single forwards, pricier per k than a whole step's graph
    s.target_cost = {(1, 1): 0.5e-3, (1, 7): 0.55e-3, (ROWS, 1): 0.6e-3, (ROWS, 7): 0.75e-3}
    s.drafter_cost = {(1, 1): 0.1e-3, (ROWS, 1): 0.1e-3}
    s.forced = [fixed] if fixed is not None else None
    r = regime
    seconds = tokens = 0.0
    used: Counter = Counter()
    for _ in range(steps):
        k = s.preferred(ROWS, ROWS)
        used[k] += 1
        rows = []
        for _ in range(ROWS):
            a = 0
            while a < k and rnd.random() < ACCEPT[a]:
                a += 1
            if k:
                rows.append((k, a))
            tokens += a + 1
        s.observe_rows(rows)
        chunks = rnd.random() < r["share"]
        ms = (r["c_base"] + r["c_row"] * rnd.randint(1, 8) + r["c_k"] * k if chunks
              else r["k0"] if k == 0 else r["k1"] + r["per_k"] * (k - 1))
        ms *= 1 + 0.1 * (2 * rnd.random() - 1)
        if rnd.random() < r["stall_p"]:
            ms += r["stall_ms"]
        seconds += ms / 1e3
        s.observe_step(ROWS, k, ms / 1e3, chunks=chunks)
    return tokens / seconds, used.most_common(1)[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = []
    print(f"{'regime':<40}{'adaptive':>10}{'best k':>8}{'best':>10}{'ratio':>7}{'runs mostly k<=2':>18}")
    for name, regime in REGIMES.items():
        runs = [simulate(regime, seed, a.steps, None) for seed in range(a.seeds)]
        adaptive = statistics.median(t for t, _ in runs)
        fixed = {k: statistics.median(simulate(regime, seed, a.steps, k)[0] for seed in range(a.seeds))
                 for k in range(7)}
        best = max(fixed, key=fixed.get)
        low = sum(1 for _, k in runs if k <= 2)
        out.append({"regime": name, **regime, "adaptive_tok_s": adaptive, "fixed_tok_s": fixed, "best_k": best,
                    "ratio": adaptive / fixed[best], "runs_mostly_k_le_2": low, "seeds": a.seeds, "steps": a.steps})
        print(f"{name:<40}{adaptive:>10.0f}{best:>8}{fixed[best]:>10.0f}{adaptive / fixed[best]:>7.3f}"
              f"{f'{low}/{a.seeds}':>18}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
