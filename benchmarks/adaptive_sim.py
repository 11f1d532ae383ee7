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
import math
import os
import random
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from specdp_cli.runtime import spec_length  # noqa: E402

MODEL = spec_length          # the model under test (--spec-length: another version)
ACCEPT = (0.8, 0.7, 0.65, 0.6, 0.55, 0.5)       # per position, given the earlier drafts were accepted
ROWS = 32
REGIMES = {   # ms: decode step at k = 0 and 1, per further k; chunk steps: share, base, per prompt row, per k
    "decode steps, k = 0 a little cheaper": dict(k0=0.83, k1=0.93, per_k=0.07, share=0.6, c_base=1.2, c_row=0.1,
                                                c_k=0.05, stall_p=0.0, stall_ms=0.0),
    "k = 0 much cheaper (no drafter)": dict(k0=0.55, k1=0.85, per_k=0.06, share=0.6, c_base=1.2, c_row=0.1,
                                            c_k=0.05, stall_p=0.0, stall_ms=0.0),
    "... and 2 % of steps stall 20 ms": dict(k0=0.55, k1=0.85, per_k=0.06, share=0.6, c_base=1.2, c_row=0.1,
                                             c_k=0.05, stall_p=0.02, stall_ms=20.0),
    # every step time drifts together (host load, clocks, the other rank in lockstep): log-speed an AR(1)
    # of ~15 % spread and ~30 steps' memory
    "... and all step times drift 15 %": dict(k0=0.55, k1=0.85, per_k=0.06, share=0.6, c_base=1.2, c_row=0.1,
                                              c_k=0.05, stall_p=0.0, stall_ms=0.0, drift=0.15),
    # the 2-GPU lockstep steps of 32 rows a rank: host-bound, k costs little
    "k costs little (lockstep, 32 rows), drift": dict(k0=1.75, k1=1.85, per_k=0.03, share=0.1, c_base=2.2,
                                                     c_row=0.05, c_k=0.03, stall_p=0.0, stall_ms=0.0, drift=0.15),
    # ... and the first step of each kind runs 1.3 x (the 2-GPU lockstep traces: a graph's first replay)
    "... and first steps of a kind 1.3 x": dict(k0=1.75, k1=1.85, per_k=0.03, share=0.1, c_base=2.2, c_row=0.05,
                                               c_k=0.03, stall_p=0.0, stall_ms=0.0, drift=0.15, first=1.3),
    # ... and the batch drains over the last 20 % of the steps (24, 16, 8, 4 rows: sizes never measured
    # before, where a step costs less, the start-up timings overprice k as much as at 32 rows)
    "... and the batch drains at the end": dict(k0=1.75, k1=1.85, per_k=0.03, share=0.1, c_base=2.2, c_row=0.05,
                                              c_k=0.03, stall_p=0.0, stall_ms=0.0, drift=0.15, first=1.3,
                                              drain=0.2),
    # the 8B shape at 16 rows (device-bound): steps with prompt chunks cost 1.6-2.8 x a decode step by how
    # many prompt rows they carry, and the first tenth of the job is all heavy chunk steps (every prompt
    # arrives at once)
    "device-bound, chunk steps 10-17 ms": dict(k0=4.2, k1=5.9, per_k=0.08, share=0.35, c_base=8.0, c_row=1.1,
                                              c_k=0.05, stall_p=0.0, stall_ms=0.0, drift=0.03, heavy=0.1),
}
DRAIN_ROWS = (24, 16, 8, 4)


def load_model(path: str | None):
    """runtime/spec_length.py, or another version of it from a file (before / after a change)."""
    if not path:
        return spec_length
    import importlib.util
    spec = importlib.util.spec_from_file_location("spec_length_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def new_spec_length(model, fixed: int | None):
    """An adaptive SpecLength of `model` (k up to 6, a draft model) with start-up timings as the engine
    takes them — single forwards, pricier per k than a whole step's graph; `fixed`: force that k."""
    s = model.SpecLength(6, None, True, drafter_forward="per_draft")
    s.target_cost = {(1, 1): 0.5e-3, (1, 7): 0.55e-3, (ROWS, 1): 0.6e-3, (ROWS, 7): 0.75e-3}
    s.drafter_cost = {(1, 1): 0.1e-3, (ROWS, 1): 0.1e-3}
    s.forced = [fixed] if fixed is not None else None
    return s


def simulate(regime: dict, seed: int, steps: int, fixed: int | None) -> tuple[float, int, float]:
    """tok/s of one run, its most used k, and the model's own host time per step in microseconds (its
    calls run on every step's critical path; measured here, not part of the simulated seconds)."""
    # two streams, so every k of a seed meets the same step-time path (drift, noise, stalls, chunk steps)
    # and only the acceptance draws differ with k: version and k comparisons are paired, not seed luck
    rnd = random.Random(seed)
    env = random.Random(1_000_003 * (seed + 1))
    s = new_spec_length(MODEL, fixed)
    r = regime
    seconds = tokens = 0.0
    used: Counter = Counter()
    drift, memory = 0.0, 0.97
    seen = set()
    host = 0.0
    drain_from = steps * (1 - r.get("drain", 0.0))
    for i in range(steps):
        drift = memory * drift + env.gauss(0.0, r.get("drift", 0.0) * (1 - memory ** 2) ** 0.5)
        R = ROWS if i < drain_from else DRAIN_ROWS[min(int((i - drain_from) / (steps - drain_from) * len(DRAIN_ROWS)),
                                                       len(DRAIN_ROWS) - 1)]
        t0 = time.perf_counter()
        k = s.preferred(R, R)
        host += time.perf_counter() - t0
        used[k] += 1
        rows = []
        for _ in range(R):
            a = 0
            while a < k and rnd.random() < ACCEPT[a]:
                a += 1
            if k:
                rows.append((k, a))
            tokens += a + 1
        t0 = time.perf_counter()
        s.observe_rows(rows)
        host += time.perf_counter() - t0
        heavy = i < steps * r.get("heavy", 0.0)
        chunks = env.random() < r["share"] or heavy
        prompt_rows, noise, stall = 8 if heavy else env.randint(1, 8), env.random(), env.random()
        ms = (r["c_base"] + r["c_row"] * prompt_rows + r["c_k"] * k if chunks
              else r["k0"] if k == 0 else r["k1"] + r["per_k"] * (k - 1))
        ms *= (1 + 0.1 * (2 * noise - 1)) * math.exp(drift) * (0.6 + 0.4 * R / ROWS)   # host-bound: rows cost little
        if stall < r["stall_p"]:
            ms += r["stall_ms"]
        if (chunks, R, k) not in seen:
            seen.add((chunks, R, k))
            ms *= r.get("first", 1.0)
        seconds += ms / 1e3
        t0 = time.perf_counter()
        s.observe_step(R, k, ms / 1e3, chunks=chunks)
        host += time.perf_counter() - t0
    return tokens / seconds, used.most_common(1)[0][0], 1e6 * host / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--json")
    ap.add_argument("--spec-length", help="another version of runtime/spec_length.py to run (before/after a change)")
    a = ap.parse_args()
    global MODEL
    MODEL = load_model(a.spec_length)
    out = []
    print(f"{'regime':<40}{'adaptive':>10}{'best k':>8}{'best':>10}{'ratio':>7}{'runs mostly k<=2':>18}{'model us/step':>15}")
    for name, regime in REGIMES.items():
        runs = [simulate(regime, seed, a.steps, None) for seed in range(a.seeds)]
        adaptive = statistics.median(t for t, _, _ in runs)
        host_us = statistics.median(h for _, _, h in runs)
        fixed = {k: statistics.median(simulate(regime, seed, a.steps, k)[0] for seed in range(a.seeds))
                 for k in range(7)}
        best = max(fixed, key=fixed.get)
        low = sum(1 for _, k, _ in runs if k <= 2)
        out.append({"regime": name, **regime, "adaptive_tok_s": adaptive, "fixed_tok_s": fixed, "best_k": best,
                    "ratio": adaptive / fixed[best], "runs_mostly_k_le_2": low, "model_us_per_step": host_us, "seeds": a.seeds, "steps": a.steps})
        print(f"{name:<40}{adaptive:>10.0f}{best:>8}{fixed[best]:>10.0f}{adaptive / fixed[best]:>7.3f}"
              f"{f'{low}/{a.seeds}':>18}{host_us:>15.1f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
