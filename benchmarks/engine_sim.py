"""The adaptive k inside the real engine, on the CPU, with the H200's step times: what `job_sim.py` models
(admission, the drain, the model's choices) run by the engine itself — its lag between the measurements a
choice has seen and the step that uses it (one step more since session 11), the drafter's catch-up after
k = 0, drafts cut near a request's end — over the real acceptance of a greedy job (float32 here; the H200's
bf16 accepts within a few per cent of it).

The engine runs the pair for real; only the clock is simulated: each step the model observes is priced by
`job_sim.codepair_h200_ms` (rows, k, prompt chunks; no noise), the model learns from those prices, and a
row's tok/s is its tokens over the priced steps (steps the model does not observe — prompt chunks alone,
and a run's last step, whose measurements the engine would read in during the next one — priced as chunk
steps at k = 0). Rows: adaptive and every fixed k of --ks, per batch size. The CPU's forwards take ~50 ms a
step, so keep the job small (--requests 64: ~1 min a row at batch 4).

  python benchmarks/engine_sim.py --pair PAIR_DIR [--requests 64] [--new 128] [--batches 4,16] [--ks 2,3,4,5,6]
      [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import adaptive_k  # noqa: E402
from job_sim import codepair_h200_ms  # noqa: E402
from specdp_cli.runtime.model_runner import pad_rows  # noqa: E402
from workloads import cut_prompt_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--ks", default="2,3,4,5,6")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompts = cut_prompt_ids(a.pair, 4, a.requests)
    batches = [int(b) for b in a.batches.split(",")]
    ks = [int(k) for k in a.ks.split(",")]
    cfg = types.SimpleNamespace(pair=a.pair, target=None, method="draft_model", dtype="float32",
                                max_model_len=2048, max_batched_tokens=16384)
    engine = adaptive_k.build(cfg, 6, max(batches))
    model = engine.spec_len
    observe = type(model).observe_step
    clock = {"s": 0.0, "steps": 0}

    def priced(rows: int, k: int, seconds: float, chunks: bool = False) -> None:
        t = codepair_h200_ms(rows, k, chunks) / 1e3
        clock["s"] += t
        clock["steps"] += 1
        observe(model, rows, k, t, chunks)
    model.observe_step = priced
    out = []
    for B in batches:
        engine.scheduler.max_num_seqs = B
        adaptive_k.run(engine, prompts[:2], 8)           # warm-up
        rates = {}
        for k in [None, *ks]:
            clock.update(s=0.0, steps=0)
            outs, _, c = adaptive_k.one_run(engine, prompts, a.new, k)
            chunk_only = c.steps - clock["steps"]
            seconds = clock["s"] + chunk_only * codepair_h200_ms(pad_rows(B, engine.row_sizes), 0, True) / 1e3
            name = adaptive_k.kind_name(k)
            rates[name] = sum(len(o) for o in outs) / seconds
            out.append({"batch": B, "k": name, "tok_s": rates[name], "steps": c.steps,
                        "steps_by_k": {str(j): n for j, n in sorted(model.used.items())}})
            print(json.dumps(out[-1]), flush=True)
        best = max((k for k in rates if k != "adaptive"), key=rates.get)
        print(f"batch {B}: adaptive / best fixed k (k = {best}) {rates['adaptive'] / rates[best]:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"requests": a.requests, "new": a.new, "rows": out}, fh, indent=1)


if __name__ == "__main__":
    main()
