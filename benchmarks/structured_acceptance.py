"""Structured output with speculation: draft acceptance and speed with and without a grammar, on the shipped demo
pair (draft_model, k 4), in one process. The drafter knows no grammar: where its drafts break the grammar they are
rejected at that position (the grammar's mask gives them probability 0), so acceptance falls with a grammar that
forces text the drafter would not write; the output still equals plain decoding under the same grammar.

Usage: python benchmarks/structured_acceptance.py [--device cpu] [--prompts 16] [--max-tokens 64] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offline  # noqa: E402

from specdp_cli.request_params import check_sampling  # noqa: E402

PAIR = os.path.join(ROOT, "demo", "pair")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "args": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 4},
                                           "returns": {"enum": ["None", "int", "str", "bool"]}},
          "required": ["name", "args", "returns"], "additionalProperties": False}
CASES = {
    "none": {},
    "json_schema": {"structured_outputs": {"json": SCHEMA}},
    "regex": {"structured_outputs": {"regex": r"def [a-z_]{1,20}\(([a-z_]{1,10}(, [a-z_]{1,10}){0,3})?\):\n    "
                                              r"(return|raise|if|for) [a-z_. ()]{1,40}"}},
    "choice": {"structured_outputs": {"choice": ["return None", "return self", "raise ValueError", "pass"]}},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    engine = offline.engine_from({"model": os.path.join(PAIR, "target"), "max_model_len": 512, "device": a.device,
                                  "dtype": "float32" if a.device == "cpu" else "bfloat16",
                                  "speculative": {"method": "draft_model", "model": os.path.join(PAIR, "draft"),
                                                  "num_speculative_tokens": 4},
                                  "scheduler": {"max_num_seqs": a.prompts}})
    lines = [json.loads(x)["prompt"] for x in open(os.path.join(ROOT, "demo", "prompts.jsonl"))]
    prompts = [engine.output.tokenizer.encode(lines[i % len(lines)]) for i in range(a.prompts)]
    rows = []
    for name, extra in CASES.items():
        fields = check_sampling(extra, {})
        for spec in (True, False):
            done, s = offline.run(engine, prompts, a.max_tokens, {**fields, "speculative": spec})
            seqs = list(done.values())
            drafted = sum(q.stats.num_draft_tokens for q in seqs)
            accepted = sum(q.stats.num_accepted_tokens for q in seqs)
            tokens = sum(len(q.generated) for q in seqs)
            rows.append({"grammar": name, "speculative": spec, "tokens": tokens, "seconds": s,
                         "tok_per_s": tokens / s, "draft_tokens": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else None,
                         "accepted_per_step": accepted / max(1, sum(q.stats.num_drafts for q in seqs)),
                         "outputs": {q.req.id: q.generated for q in seqs}})
    base = {r["grammar"]: r for r in rows if not r["speculative"]}
    print(f"{'grammar':<12} {'acceptance':>10} {'acc/step':>9} {'tok/s spec':>11} {'tok/s plain':>12} {'speed-up':>9} "
          f"{'same tokens':>12}")
    for r in rows:
        if not r["speculative"]:
            continue
        b = base[r["grammar"]]
        same = r["outputs"] == b["outputs"]
        r["same_as_plain"] = same
        print(f"{r['grammar']:<12} {r['acceptance'] or 0:>10.1%} {r['accepted_per_step']:>9.2f} {r['tok_per_s']:>11.1f} "
              f"{b['tok_per_s']:>12.1f} {r['tok_per_s'] / b['tok_per_s']:>8.2f}x {str(same):>12}")
    for r in rows:
        r.pop("outputs")
    with open(a.json, "w") as fh:
        json.dump({"device": a.device, "prompts": a.prompts, "max_tokens": a.max_tokens, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
