"""Programmatic dependent launch (specdp_cli/runtime/pdl.py) on a decode step's kernel chain, in isolation.

The chain of a Llama-3-8B-shaped decoder layer at batch 1 and 16 without attention: RMSNorm (quantizing for the
FP8 linear) -> qkv -> quantization of q's columns -> o -> residual add + RMSNorm -> gate_up -> silu_and_mul -> down,
with FP8 weights (128 x 128 blocks) or bf16 ones (the bf16 rows run torch's linear, cuBLAS, and the one-row Triton
GEMV for o at batch 1, as the engine does), `--layers` layers with their own weights, captured in one CUDA graph.
Rows (VARIANTS): kernels launched plainly; with PDL, the GEMMs letting the next kernel launch at their start, after
their main loop, or launched plainly; with and without the GEMMs' weight prefetch. Median µs a replay
(fp8_gemm.py's `bench`: the graph replayed under Triton's do_bench).

Usage: python benchmarks/pdl_chain.py [--layers 32] [--batches 1,16] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fp8_gemm import bench  # noqa: E402
from specdp_cli.runtime import ops, pdl  # noqa: E402
from specdp_cli.runtime import triton_kernels as tk  # noqa: E402
from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks  # noqa: E402

H, I, QKV = 4096, 14336, 6144
# (row, PDL on, where GEMMs let the next kernel launch (pdl.GEMM_TRIGGER), weight prefetch)
VARIANTS = (("plain", False, "end", False), ("pdl, gemm plain", True, "off", False),
            ("pdl, gemm start", True, "start", False), ("pdl, gemm end", True, "end", False),
            ("pdl, gemm end+pf", True, "end", True), ("pdl, gemm start+pf", True, "start", True))


def layer_weights(fp8: bool, g):
    def w(n, k):
        full = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
        return FP8Weight(*quantize_blocks(full), 128, torch.bfloat16) if fp8 else full.bfloat16()
    return dict(qkv=w(QKV, H), o=w(H, H), gate_up=w(2 * I, H), down=w(H, I),
                norm=torch.rand(H, device="cuda", generator=g).bfloat16() + 0.5)


def chain(x, res, layers, fp8: bool):
    """The layers as the decoder runs them (models/decoder.py): norms quantized for an FP8 linear where
    ops.fused_quant_wanted says so."""
    for L in layers:
        h = tk.rms_norm(x, L["norm"], 1e-6, quantize=ops.fused_quant_wanted(x, L["qkv"]))
        q = ops.linear(h, L["qkv"])
        x = ops.linear(q[:, :H], L["o"]) if fp8 else ops.linear_one_row(q[:, :H].contiguous(), L["o"])
        h = tk.rms_norm(x, L["norm"], 1e-6, residual=res, quantize=ops.fused_quant_wanted(x, L["gate_up"]))
        gu = ops.linear(h, L["gate_up"])
        a = tk.silu_and_mul(gu, quantize=ops.fused_quant_wanted(gu[:, :I], L["down"]))
        x = ops.linear(a, L["down"])
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'weights':8} {'batch':>5} {'launch':20} {'us':>9} {'x plain':>8}")
    for fp8 in (True, False):
        layers = [layer_weights(fp8, g) for _ in range(args.layers)]
        for M in (int(b) for b in args.batches.split(",")):
            x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
            res = torch.randn(M, H, device="cuda", generator=g).bfloat16()
            plain = None
            for name, on, trigger, prefetch in VARIANTS:
                pdl.ENABLED, pdl.GEMM_TRIGGER, pdl.PREFETCH = on, trigger, prefetch
                us = bench(lambda: chain(x, res, layers, fp8), calls=1) * 1e3
                plain = plain or us
                rows.append(dict(weights="fp8" if fp8 else "bf16", batch=M, launch=name, us=us, vs_plain=plain / us))
                print(f"{rows[-1]['weights']:8} {M:>5} {name:20} {us:9.1f} {plain / us:8.3f}")
        layers = None
        torch.cuda.empty_cache()
    pdl.ENABLED, pdl.GEMM_TRIGGER, pdl.PREFETCH = True, "off", True
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, argv=sys.argv[1:])
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
