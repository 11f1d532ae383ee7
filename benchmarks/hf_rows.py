"""Chosen Hugging Face baseline rows, measured with the functions of benchmarks/hf_baselines.py
(loaded from the path given, not copied), one JSON line per case — for runs that need only a few of
the rows that hf_baselines.py measures (it also runs every case; use it for the full set).

Cases: generate_bs1, assisted_k4 (assisted generation, k = 4 constant), assisted_default (its default
schedule), prompt_lookup, static:B (static batch of B).
Usage: python benchmarks/hf_rows.py HF_BASELINES_PY PAIR_DIR [--prompts 32] [--new 128] --cases a,b,...
"""
import argparse
import importlib.util
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("baselines")
    ap.add_argument("pair")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--cases", default="generate_bs1,assisted_k4,static:32")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("hf_baselines", a.baselines)
    hb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hb)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(os.path.join(a.pair, "tokenizer"))
    tgt = AutoModelForCausalLM.from_pretrained(os.path.join(a.pair, "target"), dtype=dtype).to(dev).eval()
    dft = AutoModelForCausalLM.from_pretrained(os.path.join(a.pair, "draft"), dtype=dtype).to(dev).eval()
    prompts = [json.loads(x)["prompt"] for x in open(os.path.join(a.pair, "heldout_prompts.jsonl"))][: a.prompts]
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
