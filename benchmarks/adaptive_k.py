"""Adaptive k against every fixed k, per batch size, in one process (the models load once).

One engine is built with `adaptive: true` and num_speculative_tokens = the largest k (so CUDA graphs
exist for every k in 0..K); a fixed-k row forces the step k through the spec-length hook (every step
prefers that k), an adaptive row lets the engine choose, its measurements reset first (start-up
timings kept) so it learns the workload from scratch like a fresh job. Each figure is the median
tok/s of --repeats runs, the rows interleaved (k = 0, 1, ..., adaptive, then again, each repeat in a rotated
order); the JSON is rewritten after every run. --replay adds a row that forces, step by step, the k the
adaptive run just before it chose: the same steps without the model. Greedy; "=k0" counts outputs equal to the k = 0 row's.

Usage (GPU: the codepair, and the 8B-shaped target with --target):
  python benchmarks/adaptive_k.py --pair PAIR_DIR [--target DIR] [--requests 256] [--new 128]
      [--batches 1,4,16,32,64] [--ks 0,1,2,3,4,5,6] [--no-adaptive] [--replay] [--repeats 3] [--dtype bfloat16] --json OUT.json
A table too long for one call (the 8B shape at batch 1: ~11 min a repeat) can be split over GPUs and calls
with --ks / --no-adaptive / --repeats; `plot_adaptive.py` pools the runs of the same row across files.
CPU smoke run: --requests 8 --new 8 --batches 1,4 --dtype float32 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from specdp_cli.config import validate  # noqa: E402
from specdp_cli.preflight import run_preflight  # noqa: E402
from specdp_cli.runtime.dist import DPGroup  # noqa: E402
from specdp_cli.runtime.engine import Engine, RankCounters  # noqa: E402
from specdp_cli.runtime.heap import freeze_startup_heap  # noqa: E402
from offline import run  # noqa: E402
from workloads import cut_prompt_ids  # noqa: E402


def build(a, k_max: int, max_seqs: int) -> Engine:
    cfg = validate({
        "model": a.target or os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
        "dtype": a.dtype, "device": "cuda" if torch.cuda.is_available() else "cpu", "max_model_len": a.max_model_len,
        "speculative": {"method": a.method, "model": os.path.join(a.pair, "draft"), "num_speculative_tokens": k_max,
                        "adaptive": True},
        "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": a.max_batched_tokens}})
    report = run_preflight(cfg)
    assert report.ok, report.errors
    dev = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    engine = Engine(cfg, report.plan, DPGroup.solo(), dev)
    freeze_startup_heap()                  # as the CLI's ranks do
    return engine


def one_run(engine: Engine, prompts, new: int, k: int | list[int] | None,
            record: list | None = None) -> tuple[list, float, RankCounters]:
    """k: a fixed step k; a list: the step k in that order (a replayed schedule); None: adaptive (its
    measurements reset first). record: a list that receives every k the rank preferred, in order."""
    sl = engine.spec_len
    sl.forced = None if k is None else list(k) if isinstance(k, list) else [k]
    sl.calls, sl._best = 0, None            # a replayed schedule starts at its first step
    if k is None:
        sl.reset_measurements()
    # an adaptive run's first two steps (and its replay's): the preference worked out during a step is the
    # k of the step after next; no measurement of the last run carries over
    engine.k_next = engine.k_pref = k if isinstance(k, int) else sl.k_max
    engine._observed = None
    engine.counters = RankCounters()
    engine.counters.spec_length = sl
    sl.used.clear()
    if sl.trace is not None:            # SPECDP_TRACE_K=1: this run's measured steps
        sl.trace.clear()
    if record is not None:
        chosen = sl.preferred

        def preferred(*args, **kwargs):
            record.append(chosen(*args, **kwargs))
            return record[-1]
        sl.preferred = preferred
    try:
        done, secs = run(engine, prompts, new)
    finally:
        sl.__dict__.pop("preferred", None)
    return [done[i].generated for i in range(len(prompts))], secs, engine.counters


def trace_summary(trace: list) -> dict:
    """A run's measured steps by kind ("k3 rows16", "... chunks"): [count, median ms], first steps left out."""
    by: dict = {}
    for k, rows, chunks, ms, level in trace:
        if level is not None:
            by.setdefault(f"k{k} rows{rows}{' chunks' if chunks else ''}", []).append(ms)
    return {key: [len(v), round(statistics.median(v), 4)] for key, v in sorted(by.items())}


def kind_name(k) -> int | str:
    return "adaptive" if k is None else k


def batch_rows(a, B: int, tok_s: dict, detail: dict) -> list[dict]:
    """One batch size's rows from the runs so far (median tok/s of each k's runs)."""
    return [{"label": a.label, "batch": B, "k": kind_name(k), "tok_s": statistics.median(runs),
             "runs": list(runs), **detail[k]} for k, runs in tok_s.items() if runs]


def write_results(a, rows, n_prompts) -> list[dict]:
    """The JSON so far (rewritten after every run: a call cut short keeps what it measured)."""
    summary = []
    for B in dict.fromkeys(r["batch"] for r in rows):
        fixed = {r["k"]: r["tok_s"] for r in rows if r["batch"] == B and isinstance(r["k"], int)}
        ad = next((r["tok_s"] for r in rows if r["batch"] == B and r["k"] == "adaptive"), None)
        if not fixed or ad is None:
            continue
        best_k = max(fixed, key=fixed.get)
        summary.append({"batch": B, "best_fixed_k": best_k, "best_fixed_tok_s": fixed[best_k], "adaptive_tok_s": ad,
                        "ratio": ad / fixed[best_k], "fixed": fixed})
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "requests": n_prompts, "new_tokens": a.new, "dtype": a.dtype,
            "repeats": a.repeats, "target": a.target or os.path.join(a.pair, "target"), "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, fh)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--method", default="draft_model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--cuts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--ks", default="0,1,2,3,4,5,6")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-adaptive", action="store_true",
                    help="fixed k rows only (a table split over GPUs or calls; plot_adaptive.py merges the runs)")
    ap.add_argument("--replay", action="store_true",
                    help="after each adaptive run, a `replay` row forcing the k it chose, step by step: the "
                         "same steps without the model's choices (adaptive vs replay: what choosing costs; "
                         "replay vs fixed k: what the chosen schedule is worth)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--label", default="codepair")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    prompts = cut_prompt_ids(a.pair, a.cuts, a.requests)
    batches = [int(b) for b in a.batches.split(",")]
    ks = [int(k) for k in a.ks.split(",")]
    engine = build(a, max(max(ks), 1), max(batches))   # a drafter with k >= 1 even for --ks 0
    rows = []
    for B in batches:
        engine.scheduler.max_num_seqs = B
        run(engine, prompts[:2], 8)                            # warm-up
        reference = None
        kinds = ks + ([] if a.no_adaptive else [None] + (["replay"] if a.replay else []))
        tok_s: dict = {k: [] for k in kinds}
        detail: dict = {}
        schedule: list[int] = []
        for rep in range(a.repeats):
            # interleaved, each repeat in a rotated order: a slow spell of the machine hits every row alike,
            # and no row always follows the same one (replay always right after its adaptive run)
            order = [k for k in kinds if k != "replay"]
            order = order[rep % len(order):] + order[:rep % len(order)]
            if a.replay:
                order.insert(order.index(None) + 1, "replay")
            for k in order:
                if k is None:
                    schedule = []
                outs, secs, c = one_run(engine, prompts, a.new, schedule if k == "replay" else k,
                                        record=schedule if k is None else None)
                tok_s[k].append(sum(len(o) for o in outs) / secs)
                if k == 0 and reference is None:
                    reference = outs
                s = c.spec
                detail[k] = {"steps": c.steps, "steps_by_k": {str(j): n for j, n in sorted(engine.spec_len.used.items())},
                             "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None,
                             "equal_k0": f"{sum(o == r for o, r in zip(outs, reference))}/{len(outs)}" if reference else None}
                if k is None:
                    detail[k]["model"] = engine.spec_len.describe(max(engine.spec_len.measured, default=(1, 0))[0])
                if engine.spec_len.trace is not None:
                    # every measured step of an adaptive run; of the others, the median step by kind (whole
                    # traces of every row kept thousands of lists alive through the later runs, and
                    # rewriting them after every run took seconds of the host the runs share)
                    detail[k]["trace_summary_ms"] = trace_summary(engine.spec_len.trace)
                    if k is None:
                        detail[k]["trace"] = list(engine.spec_len.trace)
                # rewritten after every run: a call cut by its time box keeps every finished run
                summary = write_results(a, rows + batch_rows(a, B, tok_s, detail), len(prompts))
        for row in batch_rows(a, B, tok_s, detail):
            rows.append(row)
            print(json.dumps({x: y for x, y in row.items() if x not in ("model", "trace")}), flush=True)
        summary = write_results(a, rows, len(prompts))
    head = "".join(f"{'k=' + str(k):>9}" for k in ks)
    replayed = {r["batch"]: r["tok_s"] for r in rows if r["k"] == "replay"}
    print(f"{'batch':>6}{head}{'adaptive':>10}{'best k':>7}{'ratio':>7}" + (f"{'replay':>10}" if replayed else ""))
    for s in summary:
        print(f"{s['batch']:>6}" + "".join(f"{s['fixed'][k]:>9.1f}" for k in ks)
              + f"{s['adaptive_tok_s']:>10.1f}{s['best_fixed_k']:>7}{s['ratio']:>7.3f}"
              + (f"{replayed[s['batch']]:>10.1f}" if s["batch"] in replayed else ""))


if __name__ == "__main__":
    main()
