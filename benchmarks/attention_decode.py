"""Paged attention at decode sizes (runtime/triton_kernels.paged_attention): the keys of each row split over
several programs and combined (flash-decoding, `attention_splits`' automatic choice) against the single pass
(splits=1), on the 8B shape (Llama-3-8B: 32 query heads, 8 KV heads, head dim 128), bf16, the engine's cache block
size (16). R rows of T query tokens (T > 1: a speculative step verifying drafts), each row's context of `ctx` keys
(its last query at position ctx - 1) through a block table as wide as the engine's (--max-len keys: the split's cap
comes from the table's width, not the context). Each time is µs per call: ~20 calls captured in one CUDA graph (as
the engine runs them), the graph replayed under triton.testing.do_bench (median).

Usage: python benchmarks/attention_decode.py [--rows 1,4,16,64] [--ctx 128,512,2048] [--t 1,4] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_gemm import bench  # noqa: E402  (calls in one CUDA graph, replayed under do_bench)
from specdp_cli.runtime import triton_kernels as tk  # noqa: E402

H, KV, D, BS = 32, 8, 128, 16


def case(R: int, ctx: int, T: int, max_len: int, dev) -> dict:
    width = -(-max_len // BS)
    used = -(-ctx // BS)
    kc = torch.randn(R * used + 1, BS, KV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.zeros(R, width, dtype=torch.int32, device=dev)          # block 0: the trash block past a row's end
    bt[:, :used] = (torch.randperm(R * used, device=dev) + 1).view(R, used).to(torch.int32)
    pos = (torch.arange(T, device=dev) + ctx - T).clamp(min=0).repeat(R)
    q = torch.randn(R * T, H, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def run(splits):
        return lambda: tk.paged_attention(q, kc, vc, out, pos, bt, T, D ** -0.5, 0, None, splits=splits)
    S = tk.attention_splits(R, KV, T, H, D, width * BS, 64, tk._sm_count(dev))
    auto_ms = bench(run(None))
    single_ms = bench(run(1))
    kv_bytes = R * ctx * KV * D * 2 * 2
    return {"R": R, "ctx": ctx, "T": T, "splits": S, "auto_us": auto_ms * 1e3, "single_us": single_ms * 1e3,
            "speedup": single_ms / auto_ms, "auto_GBps": kv_bytes / auto_ms / 1e6}


def print_table(rows: list[dict]) -> None:
    print(f"{'R':>4}{'ctx':>6}{'T':>3}{'S':>4}{'auto us':>10}{'S=1 us':>10}{'speedup':>9}{'auto GB/s':>11}")
    for r in rows:
        print(f"{r['R']:>4}{r['ctx']:>6}{r['T']:>3}{r['splits']:>4}{r['auto_us']:>10.1f}{r['single_us']:>10.1f}"
              f"{r['speedup']:>9.2f}{r['auto_GBps']:>11.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64", help="rows R (comma-separated)")
    ap.add_argument("--ctx", default="128,512,2048", help="keys per row (comma-separated)")
    ap.add_argument("--t", default="1,4", help="query tokens per row T (comma-separated)")
    ap.add_argument("--max-len", type=int, default=8192, help="keys a row's block table can hold (the engine's width)")
    ap.add_argument("--json", help="write the rows and the run's metadata here")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for T in [int(t) for t in a.t.split(",")]:
        for R in [int(r) for r in a.rows.split(",")]:
            for ctx in [int(c) for c in a.ctx.split(",")]:
                r = case(R, ctx, T, max(a.max_len, ctx), dev)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print_table(rows)
    if a.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
                "sms": tk._sm_count(dev), "torch": torch.__version__, "triton": triton.__version__,
                "shape": {"H": H, "KV": KV, "D": D, "BS": BS}, "argv": sys.argv[1:]}
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
