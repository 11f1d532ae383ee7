"""Which drafts a greedy job would accept, per request and output position — the input of
`job_sim.py --acceptance FILE` (the adaptive k's model over a real job's acceptance, on the CPU).

Under greedy decoding a draft model's proposal at output position j, given that every earlier draft of
the step was accepted, is its greedy token after the target's own prefix (prompt + output[:j]); so one
teacher-forced draft forward over prompt + output tells, for every j, whether a draft of output[j] is
accepted (`match[j]`), and a step that drafts n tokens at position p accepts the run of matches from p,
at most n — whatever k the earlier steps used. The target's outputs come from Hugging Face greedy
generation (float32, CPU: the acceptance of the H200's bf16 runs within a few per cent).

  python benchmarks/acceptance_runs.py --pair PAIR_DIR [--requests 256] [--cuts 4] [--new 128] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import cut_prompt_ids  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--cuts", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(os.path.join(a.pair, "target"), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(os.path.join(a.pair, "draft"), dtype=torch.float32).eval()
    prompts = cut_prompt_ids(a.pair, a.cuts, a.requests)
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    out = []
    t0 = time.time()
    with torch.no_grad():
        for i in range(0, len(prompts), a.batch):
            group = prompts[i:i + a.batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            gen = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=a.new,
                                  min_new_tokens=a.new, pad_token_id=pad)[:, width:]
            for p, g in zip(group, gen.tolist()):
                seq = torch.tensor([p + g])
                guess = draft(input_ids=seq).logits[0, len(p) - 1:-1].argmax(-1).tolist()
                out.append({"prompt_tokens": len(p), "match": [int(x == y) for x, y in zip(guess, g)]})
            print(f"{len(out)}/{len(prompts)} requests, {time.time() - t0:.0f} s", file=sys.stderr)
    rate = sum(sum(r["match"][1:]) for r in out) / sum(len(r["match"]) - 1 for r in out)
    with open(a.json, "w") as fh:
        json.dump({"pair": a.pair, "new": a.new, "cuts": a.cuts, "match_rate": rate, "requests": out}, fh)
    print(f"{len(out)} requests; a draft matches the target's token {rate:.3f} of the time")


if __name__ == "__main__":
    main()
