"""Chosen Hugging Face baseline rows, measured with the functions of benchmarks/hf_baselines.py, one JSON
line per case — for runs that need only a few of the rows that hf_baselines.py measures (it also runs every
case; use it for the full set).

Cases: generate_bs1, assisted_k4 (assisted generation, k = 4 constant), assisted_default (its default
schedule), prompt_lookup, static:B (static batch of B).
Usage: python benchmarks/hf_rows.py PAIR_DIR [--prompts 32] [--new 128] --cases a,b,...
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_baselines as hb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--cases", default="generate_bs1,assisted_k4,static:32")
    a = ap.parse_args()
    tok, tgt, dft, prompts = hb.load_pair(a.pair, a.prompts)
    hb.run_single(tgt, tok, prompts[:2], 8)                                       # warm-up
    single = {"generate_bs1": {}, "assisted_default": dict(assistant_model=dft),
              "assisted_k4": dict(assistant_model=dft, num_assistant_tokens=4, num_assistant_tokens_schedule="constant"),
              "prompt_lookup": dict(prompt_lookup_num_tokens=4)}
    for case in a.cases.split(","):
        if case.startswith("static:"):
            bs = int(case.split(":")[1])
            _, n, t = hb.run_batched(tgt, tok, prompts, a.new, bs)
            name = f"hf_generate_bs{bs}"
        else:
            _, n, t = hb.run_single(tgt, tok, prompts, a.new, **single[case])
            name = f"hf_{case}"
        print(json.dumps({"case": name, "tok_s": n / t, "tokens": n, "s": t}), flush=True)


if __name__ == "__main__":
    main()
