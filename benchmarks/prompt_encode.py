"""A prompt's tokenization in the API server: `PromptEncoder.encode_text` (the Rust tokenizer called directly where
prompts._direct_backend allows) against the transformers tokenizer's own call, µs a prompt, for a short prompt and
a long one.

Usage: python benchmarks/prompt_encode.py [--tokenizer DIR] [--repeat N] [--json OUT.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def per_call_us(f, n: int) -> float:
    """The median of 5 rounds of n calls, µs a call."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    from specdp_cli.modeldir import load_tokenizer
    from specdp_cli.prompts import PromptEncoder

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "demo", "pair", "target"))
    ap.add_argument("--repeat", type=int, default=4000)
    ap.add_argument("--json")
    a = ap.parse_args()
    tok = load_tokenizer(a.tokenizer)
    enc = PromptEncoder(tok)
    short = "def fibonacci(n):\n    # return the n-th number\n"
    long = open(os.path.join(ROOT, "specdp_cli", "runtime", "engine.py")).read()
    rows = []
    print(f"direct path in use: {enc.backend is not None}")
    print(f"{'prompt':>8} {'tokens':>7} {'encode_text us':>15} {'tokenizer call us':>18} {'ratio':>6}")
    for name, text, n in (("short", short, a.repeat), ("long", long, max(1, a.repeat // 400))):
        assert enc.encode_text(text) == list(tok(text)["input_ids"])
        ours = per_call_us(lambda: enc.encode_text(text), n)
        call = per_call_us(lambda: list(tok(text)["input_ids"]), n)
        rows.append({"prompt": name, "chars": len(text), "tokens": len(tok(text)["input_ids"]),
                     "encode_text_us": ours, "tokenizer_call_us": call, "direct": enc.backend is not None})
        print(f"{name:>8} {rows[-1]['tokens']:>7} {ours:>15.1f} {call:>18.1f} {ours / call:>6.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"tokenizer": a.tokenizer, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
