"""The prompt sets of the benchmarks, from a pair directory's held-out prompts."""
from __future__ import annotations

import json
import os


def heldout(pair: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in open(os.path.join(pair, "heldout_prompts.jsonl"))]


def cut_prompts(pair: str, cuts: int, n: int | None = None) -> list[str]:
    """Each held-out prompt cut at `cuts` points (1/cuts .. full), so prompt lengths vary; the first n."""
    out = []
    for text in heldout(pair):
        for c in range(1, cuts + 1):
            out.append(text[: max(80, len(text) * c // cuts)])
    return out[:n] if n else out
