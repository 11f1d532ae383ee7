"""The host's staging of a step's rows (`runtime/step_inputs.StepInputs.stage`): µs a step for --decode decode rows
(5 tokens: the last one and 4 drafts) and --chunks prompt-chunk rows (16 tokens), each sequence holding --blocks KV
blocks (a 1,500-token prompt's: 95), median of --repeats timings of --n calls. `--uncached` converts every row's
block list again each step (as before session 40); by default a sequence's int32 copy is reused while its blocks
are unchanged. CPU tensors (the staging is host work; on a GPU the two copies to the device follow).

Usage: python benchmarks/step_stage.py [--decode 32] [--chunks 8] [--blocks 96] [--n 2000] [--repeats 5]
           [--uncached] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from link_codec import per_message_us  # noqa: E402
from specdp_cli.runtime.sampling import SamplingParams  # noqa: E402
from specdp_cli.runtime.scheduler import Request, Sequence  # noqa: E402
from specdp_cli.runtime.step_inputs import RowSpec, StepInputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--uncached", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    n_rows = a.decode + a.chunks
    si = StepInputs(n_rows + 8, 16, a.blocks + 8, torch.device("cpu"))
    seqs = []
    for i in range(n_rows):
        s = Sequence(Request(f"r{i}", list(range(16 * a.blocks - 10)), SamplingParams(max_tokens=32)), 1 << 16)
        s.blocks = list(range(i * a.blocks, (i + 1) * a.blocks))
        seqs.append(s)
    rows = [RowSpec(s, s.L, [7, 1, 2, 3, 4], 5, n_drafts=4, d_tokens=(7,)) for s in seqs[:a.decode]]
    rows += [RowSpec(s, s.L - 16, list(range(16)), 16, d_tokens=tuple(range(16))) for s in seqs[a.decode:]]

    def step(_) -> None:
        if a.uncached:
            for s in seqs:
                s.block_row = None
        si.stage(rows, n_rows)

    row = {"decode": a.decode, "chunks": a.chunks, "blocks": a.blocks, "uncached": a.uncached,
           "us_per_step": per_message_us(step, None, a.n, a.repeats)}
    print(f"{'uncached' if a.uncached else 'cached'} block rows: {row['us_per_step']:.1f} µs a step "
          f"({a.decode} decode + {a.chunks} chunk rows, {a.blocks} blocks each)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(row, fh, indent=1)


if __name__ == "__main__":
    main()
