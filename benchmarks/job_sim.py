"""The adaptive k's model over whole synthetic jobs, on the CPU in seconds: requests that differ in how
often their drafts are accepted, a fixed number of batch slots, admission as slots free, and the tail
where the batch drains — what `adaptive_sim.py` (a fixed batch of like rows) leaves out.

Each run serves --requests requests of --new tokens through --slots slots: an admitted request spends one
step in a prompt chunk (the step carries chunks) and then decodes, drafting min(k, tokens left - 1), its
drafts accepted position by position with its own probability (drawn per request: most easy, some hard).
Step times follow a regime shaped on the H200's codepair steps in 2-GPU lockstep and the 8B shape's (host-
bound: k costs little, fewer rows a little less; device-bound: k costs more), with noise and a drift. Rows:
adaptive with and without the drain choice (`rows_left` given when nothing waits), every fixed k, over the
same seeds (the requests and the step-time path are the seed's; only the acceptance draws differ with k).

  python benchmarks/job_sim.py [--seeds 16] [--requests 128] [--new 128] [--slots 32] [--spec-length FILE] [--json OUT]
  python benchmarks/job_sim.py --acceptance ACC.json [--batches 1,4,16,32,64] ...   (acceptance_runs.py's output:
      a real greedy job's acceptance, position by position; step costs shaped on the codepair's H200 traces)

(--spec-length: another version of runtime/spec_length.py; it must take `rows_left`, the drain choice's input.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from specdp_cli.runtime import spec_length  # noqa: E402
from adaptive_sim import load_model, new_spec_length  # noqa: E402

MODEL = spec_length
PAD = (1, 2, 4, 8, 16, 24, 32, 48, 64)
REGIMES = {  # ms at 32 rows: decode step at k = 0, at k = 1, per further k; what a chunk step adds; hard requests
    "lockstep-like, 1 in 5 requests hard": dict(k0=1.2, k1=1.55, per_k=0.09, chunk=0.3, rows_weight=0.4,
                                                hard=0.2, drift=0.1),
    "lockstep-like, all requests alike": dict(k0=1.2, k1=1.55, per_k=0.09, chunk=0.3, rows_weight=0.4,
                                              hard=0.0, drift=0.1),
    "device-bound, 1 in 5 requests hard": dict(k0=4.2, k1=5.9, per_k=0.15, chunk=4.0, rows_weight=0.8,
                                               hard=0.2, drift=0.03),
}


def pad(n: int) -> int:
    return next(p for p in PAD if p >= n)


# --acceptance: the codepair on one H200, shaped on session 10's adaptive traces (decode steps by batch size
# and k: 4 rows 0.5 ms at k = 1, +0.1 ms a k; 64 rows 1.1 ms, +0.19 ms a k; chunk steps 0.17-0.45 ms more)
def codepair_h200_ms(rows: int, k: int, chunks: bool) -> float:
    base, per_k = 0.45 + 0.0065 * rows, 0.09 + 0.0015 * rows
    return base + (0.05 + per_k * k if k else 0.0) + ((0.15 + 0.005 * rows) if chunks else 0.0)


MEASURED = {"codepair, one H200 (measured acceptance)": dict(ms=codepair_h200_ms, drift=0.1)}


def run(regime: dict, seed: int, a, mode, accept=None) -> float:
    """tok/s of one job; mode: a fixed k, "adaptive", or "no drain". accept: per request, whether a draft of
    each output position matches (acceptance_runs.py), instead of drawn acceptance."""
    r = regime
    people = random.Random(seed)
    n_requests = len(accept) if accept else a.requests
    alphas = ([0.0] * n_requests if accept else
              [people.uniform(0.2, 0.5) if people.random() < r["hard"] else people.uniform(0.65, 0.9)
               for _ in range(a.requests)])
    env = random.Random(1_000_003 * (seed + 1))
    luck = random.Random(seed * 7 + 3)
    s = new_spec_length(MODEL, mode if isinstance(mode, int) else None)
    queue = list(range(n_requests))
    planned = [s.k_max] * a.lag        # the preferences worked out but not yet used (the engine's lag)
    running: dict[int, dict] = {}      # request -> {"left", "drafted", "accepted", "prefill", "pos"}
    seconds = tokens = 0.0
    drift = 0.0
    while queue or running:
        admitted = 0
        while queue and len(running) < a.slots:
            running[queue.pop(0)] = {"left": a.new, "drafted": 0, "accepted": 0, "prefill": True, "pos": 1}
            admitted += 1
        R = pad(len(running))
        draining = mode == "adaptive" and not queue      # "no drain": the same model without the drain choice
        planned.append(s.preferred(len(running), R, (lambda: [(q["left"], q["drafted"], q["accepted"], True)
                                                              for q in running.values()]) if draining else None))
        k = planned.pop(0)
        verified = []
        for req, q in list(running.items()):
            if q["prefill"]:
                q["prefill"] = False
                q["left"] -= 1
                tokens += 1
            else:
                n = max(0, min(k, q["left"] - 1))
                acc = 0
                if accept:
                    match = accept[req]
                    while acc < n and q["pos"] + acc < len(match) and match[q["pos"] + acc]:
                        acc += 1
                    q["pos"] += acc + 1
                else:
                    while acc < n and luck.random() < alphas[req]:
                        acc += 1
                if n:
                    verified.append((n, acc))
                    q["drafted"] += n
                    q["accepted"] += acc
                q["left"] -= acc + 1
                tokens += acc + 1
            if q["left"] <= 0:
                del running[req]
        s.observe_rows(verified)
        drift = 0.97 * drift + env.gauss(0.0, r["drift"] * (1 - 0.97 ** 2) ** 0.5)
        if "ms" in r:
            ms = r["ms"](R, k, bool(admitted))
        else:
            ms = r["k0"] if k == 0 else r["k1"] + r["per_k"] * (k - 1)
            ms = (ms + (r["chunk"] if admitted else 0.0)) * (1 - r["rows_weight"] + r["rows_weight"] * R / 32)
        ms *= (1 + 0.1 * (2 * env.random() - 1)) * math.exp(drift)
        seconds += ms / 1e3
        s.observe_step(R, k, ms / 1e3, chunks=bool(admitted))
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--requests", type=int, help="default 128 (--acceptance: all of the file's)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--spec-length", help="another version of runtime/spec_length.py to run")
    ap.add_argument("--acceptance", help="acceptance_runs.py's JSON: a real job's acceptance, the codepair's "
                                         "H200 step costs, every batch size of --batches as the slots")
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--lag", type=int, default=2,
                    help="steps between the step whose measurements a preference has last seen and the step that "
                         "uses it, less one (the engine: 2; the engine before the choice moved into the device's "
                         "time: 1)")
    ap.add_argument("--json")
    a = ap.parse_args()
    global MODEL
    MODEL = load_model(a.spec_length)
    accept = None
    if not a.acceptance and a.requests is None:
        a.requests = 128
    cases = [(name, regime, a.slots) for name, regime in REGIMES.items()]
    if a.acceptance:
        data = json.load(open(a.acceptance))
        accept = [r["match"] for r in data["requests"]][:a.requests]
        a.new = min(a.new, data["new"])
        cases = [(f"{name}, {b} slots", regime, int(b)) for name, regime in MEASURED.items()
                 for b in a.batches.split(",")]
    out = []
    print(f"{'regime':<50}{'adaptive':>10}{'no drain':>10}{'best k':>8}{'best':>10}{'ratio':>7}{'no drain':>10}"
          + "".join(f"{'k=' + str(k):>7}" for k in range(7)))
    for name, regime, slots in cases:
        a.slots = slots
        med = {mode: statistics.median(run(regime, seed, a, mode, accept) for seed in range(a.seeds))
               for mode in ["adaptive", "no drain", *range(7)]}
        best = max(range(7), key=lambda k: med[k])
        out.append({"regime": name, **{x: v for x, v in regime.items() if x != "ms"},
                    "tok_s": {str(m): v for m, v in med.items()}, "best_k": best,
                    "ratio": med["adaptive"] / med[best], "ratio_no_drain": med["no drain"] / med[best],
                    "lag": a.lag, "seeds": a.seeds, "requests": len(accept) if accept else a.requests, "new": a.new, "slots": slots})
        print(f"{name:<50}{med['adaptive']:>10.0f}{med['no drain']:>10.0f}{best:>8}{med[best]:>10.0f}"
              f"{med['adaptive'] / med[best]:>7.3f}{med['no drain'] / med[best]:>10.3f}"
              + "".join(f"{med[k] / med[best]:>7.3f}" for k in range(7)))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
