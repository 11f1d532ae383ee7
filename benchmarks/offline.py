"""Offline throughput of the specdp engine on a target/draft pair: methods x batch sizes.

Runs in one process on one device (no DP), greedy, the same prompts for every row. A row's tok/s is
generated tokens / wall time of the run (model load and a warm-up excluded). "greedy equal" counts
outputs identical to the `none` method's (target-only decoding through the same engine).

Usage:
  python benchmarks/offline.py --pair PAIR_DIR [--target DIR] [--prompts 32] [--new 128]
      [--batches 1,8,32] [--methods none,ngram,draft_model] [--k 4] [--dtype bfloat16] --json OUT.json
PAIR_DIR holds target/, draft/, tokenizer/ and heldout_prompts.jsonl (the codepair layout);
--target replaces the target (e.g. the widened 8B-sized one).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdp_cli.config import validate  # noqa: E402
from specdp_cli.preflight import run_preflight  # noqa: E402
from specdp_cli.runtime.dist import DPGroup  # noqa: E402
from specdp_cli.runtime.engine import Engine  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine: Engine, prompts: list[list[int]], new: int) -> tuple[dict, float]:
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(i, p, SamplingParams(max_tokens=new), None))
    done = {}
    sync()
    t = time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.seq.req.id] = out.seq
    sync()
    return done, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", required=True)
    ap.add_argument("--target")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--methods", default="none,ngram,draft_model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--label", default="codepair")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    texts = [json.loads(line)["prompt"] for line in open(os.path.join(a.pair, "heldout_prompts.jsonl"))][: a.prompts]
    prompts = [tok(t)["input_ids"] for t in texts]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in a.batches.split(",")]
    rows, reference = [], None
    for method in a.methods.split(","):
        cfg = validate({
            "model": a.target or os.path.join(a.pair, "target"), "tokenizer": os.path.join(a.pair, "tokenizer"),
            "dtype": a.dtype, "device": device, "max_model_len": a.max_model_len,
            "speculative": {"method": method, "model": os.path.join(a.pair, "draft"), "num_speculative_tokens": a.k},
            "scheduler": {"max_num_seqs": max(batches), "max_num_batched_tokens": 16384}})
        report = run_preflight(cfg)
        assert report.ok, report.errors
        t_load = time.perf_counter()
        engine = Engine(cfg, report.plan, DPGroup.solo(), torch.device(device))
        load_s = time.perf_counter() - t_load
        for B in batches:
            engine.scheduler.num_slots = B          # the batch size: at most B sequences run at once
            run(engine, prompts[:2], 8)                              # warm-up
            engine.counters = type(engine.counters)()
            done, secs = run(engine, prompts, a.new)
            outs = [done[i].generated for i in range(len(prompts))]
            if method == "none" and reference is None:
                reference = outs
            gen = sum(len(o) for o in outs)
            s = engine.counters.spec
            row = {"label": a.label, "method": method, "batch": B, "k": a.k if method != "none" else 0,
                   "tok_s": gen / secs, "tokens": gen, "s": secs, "load_s": load_s, "steps": engine.counters.steps,
                   "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None,
                   "mean_acceptance_length": 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else None,
                   "greedy_equal_vs_none": (f"{sum(o == r for o, r in zip(outs, reference))}/{len(outs)}"
                                            if reference else None)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "prompts": len(prompts), "new_tokens": a.new, "dtype": a.dtype}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"{'method':<12}{'batch':>6}{'tok/s':>10}{'accept':>8}{'mean len':>9}{'greedy=':>9}")
    for r in rows:
        acc = f"{r['acceptance_rate']:.3f}" if r["acceptance_rate"] is not None else "-"
        ml = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
        print(f"{r['method']:<12}{r['batch']:>6}{r['tok_s']:>10.1f}{acc:>8}{ml:>9}{str(r['greedy_equal_vs_none']):>9}")


if __name__ == "__main__":
    main()
