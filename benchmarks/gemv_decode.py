"""A matrix-vector Triton kernel for decode projections, y [M, N] = x [M, K] @ W [N, K]^T at M = 1..8 tokens,
against F.linear (cuBLAS).

The kernel (`gemv`, its `default_tile`) lives in specdp_cli/runtime/gemv_kernels.py, whose docstring gives its
design and where the runtime runs it (`ops.linear_one_row`: the attention output projection at one token, the
shapes this script measured faster than cuBLAS). Adding a shape or token count there needs this script's
numbers: the tile beating cuBLAS by >= 10 % (bf16, distinct weights each call so L2 does not hold them, as in a
decode step's layers) and the bf16 results within F.linear's own error of the float32 reference (printed here).

Timing: each variant is captured in a CUDA graph holding 20 calls back to back (as `benchmarks/moe_kernel.py
--routing` does), the median replay over 20 is divided by 20. The calls cycle through copies of W whose total is
at least 4x the L2 cache (--same-weights: one copy, which L2 may hold). "TB/s" is W's bytes over the time a call,
"% copy" that against the device's copy bandwidth (bytes read + written by a 1 GiB device copy).

Usage (one H200, under 90 s):
    python benchmarks/gemv_decode.py --json OUT.json [--tokens 1,2,4,8] [--shapes qwen3_qkv,llama8b_o] [--no-sweep]
    python benchmarks/gemv_decode.py --dry-run      # the shapes and tiles it would time; no GPU needed
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import triton
    from specdp_cli.runtime.gemv_kernels import _pow2, default_tile, gemv
except ImportError:     # the script needs Triton; the module stays importable for --help
    triton = None

SHAPES = {   # name: (N, K) of W in nn.Linear layout
    "qwen3_qkv": (5120, 2048), "qwen3_o": (2048, 4096), "qwen3_lm_head_16k": (16384, 2048),
    "llama8b_qkv": (6144, 4096), "llama8b_o": (4096, 4096), "llama8b_gate_up": (28672, 4096),
    "llama8b_down": (4096, 14336),
}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, DEFER); tiles whose float32 tiles pass 128 values a thread are skipped
SWEEP = [(1, 1024, 4, 2, False), (2, 512, 4, 3, False), (4, 256, 4, 3, False), (4, 512, 8, 2, False),
         (8, 256, 8, 3, False), (16, 128, 4, 2, False), (2, 256, 4, 3, True), (4, 256, 8, 2, True),
         (8, 128, 4, 4, True)]

def tile_fits(M: int, tile: tuple) -> bool:
    """The float32 product (and with DEFER the accumulator as big) within 128 values a thread."""
    bn, bk, warps, _, defer = tile
    return _pow2(M) * bn * bk * (2 if defer else 1) <= 128 * 32 * warps


def tile_name(tile: tuple) -> str:
    bn, bk, warps, stages, defer = tile
    return f"n{bn} k{bk} w{warps} s{stages}" + (" defer" if defer else "")


def per_call(call, weights: list[torch.Tensor], calls: int = 20) -> float:
    """µs per call of `calls` calls call(W) back to back in one graph, W cycling through `weights`."""
    from moe_kernel import graph_time
    return graph_time(lambda: [call(weights[i % len(weights)]) for i in range(calls)], 20) / calls


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).abs().max() / ref.abs().max()).item()


def plan(shapes: list[str], tokens: list[int], sweep: bool) -> list[tuple]:
    """(shape, M, tiles to time: the default first) for each shape and token count."""
    out = []
    for s in shapes:
        N, K = SHAPES[s]
        for M in tokens:
            d = default_tile(M, N, K)
            extra = [t for t in SWEEP if t != d and tile_fits(M, t)] if sweep else []
            out.append((s, M, [d] + extra))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--no-sweep", action="store_true", help="time the default tile only")
    ap.add_argument("--same-weights", action="store_true", help="one copy of W (L2 may hold it)")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and tiles it would time, then exit")
    ap.add_argument("--json", help="write the rows and the summary here")
    a = ap.parse_args()
    shapes, tokens = a.shapes.split(","), [int(t) for t in a.tokens.split(",")]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not all(1 <= M <= 16 for M in tokens):
        sys.exit(f"unknown shapes {bad} or tokens outside 1..16: {tokens}")
    if triton is None:
        sys.exit("gemv_decode.py needs Triton (specdp_cli/runtime/gemv_kernels.py imports it)")
    todo = plan(shapes, tokens, not a.no_sweep)
    if a.dry_run:
        for s, M, tiles in todo:
            print(f"{s:<18} N,K={SHAPES[s]}  M={M}: cuBLAS, " + "; ".join(tile_name(t) for t in tiles))
        print(f"{sum(len(t) + 1 for _, _, t in todo)} timings, "
              f"{len({(M, t) for _, M, ts in todo for t in ts})} kernel variants to compile (bf16)")
        return
    if not torch.cuda.is_available():
        sys.exit("gemv_decode.py times GPU kernels: it needs a CUDA device (try --dry-run or --help)")
    if not a.json:
        sys.exit("--json OUT is required")

    torch.backends.cuda.matmul.allow_tf32 = False          # the float32 check compares exact float32 products
    t_start = time.perf_counter()
    from offline import copy_bandwidth
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    torch.manual_seed(0)
    rows, summary, failures = [], [], []
    for s in shapes:
        N, K = SHAPES[s]
        nbytes = N * K * 2
        copies = 1 if a.same_weights else max(2, math.ceil(4 * l2 / nbytes))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
        w32 = weights[0].float()
        for s2, M, tiles in todo:
            if s2 != s:
                continue
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            x32 = x.float()
            ref = F.linear(x32, w32)
            # float32 kernel (default tile) against float32 cuBLAS; bf16 against the float32 reference, cuBLAS too
            err32 = rel_err(gemv(x32, w32), ref)
            err_cublas = rel_err(F.linear(x, weights[0]), ref)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            cublas_us = per_call(lambda w: F.linear(x, w), weights)
            rows.append({"shape": s, "N": N, "K": K, "M": M, "variant": "cublas", "tile": None, "us": cublas_us,
                         "TBps": nbytes / cublas_us / 1e6, "pct_copy": nbytes / (cublas_us * 1e-6) / bw * 100,
                         "rel_err_bf16": err_cublas})
            timed = []
            for i, t in enumerate(tiles):
                try:
                    err = rel_err(gemv(x, weights[0], tile=t), ref)
                    us = per_call(lambda w, t=t: gemv(x, w, out, t), weights)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                    print(f"{s} M={M} {tile_name(t)}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                ok = err <= max(2 * err_cublas, 1e-2) and (i > 0 or err32 <= 1e-4)
                if not ok:
                    failures.append((s, M, tile_name(t), err, err32))
                timed.append((us, t))
                rows.append({"shape": s, "N": N, "K": K, "M": M, "variant": "default" if i == 0 else "sweep",
                             "tile": list(t), "us": us, "TBps": nbytes / us / 1e6,
                             "pct_copy": nbytes / (us * 1e-6) / bw * 100, "rel_err_bf16": err,
                             "rel_err_fp32": err32 if i == 0 else None, "ok": ok})
            if not timed:
                continue
            best_us, best = min(timed, key=lambda r: r[0])
            default_us = timed[0][0] if timed[0][1] == tiles[0] else None
            summary.append({"shape": s, "M": M, "cublas_us": cublas_us, "best_us": best_us, "best_tile": list(best),
                            "default_us": default_us, "cublas_over_best": cublas_us / best_us,
                            "cublas_over_default": cublas_us / default_us if default_us else None,
                            "best_TBps": nbytes / best_us / 1e6, "cublas_TBps": nbytes / cublas_us / 1e6,
                            "rel_err_fp32": err32, "rel_err_bf16_cublas": err_cublas})
            print(json.dumps(summary[-1]), flush=True)
        del weights, w32
        torch.cuda.empty_cache()

    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "copy_TBps": bw / 1e12, "l2_bytes": l2, "same_weights": a.same_weights,
            "argv": sys.argv[1:], "seconds": time.perf_counter() - t_start}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "summary": summary, "rows": rows, "failures": failures}, fh, indent=1)
    print(f"\ncopy {bw / 1e12:.2f} TB/s (read + written); {meta['seconds']:.0f} s")
    print(f"{'shape':<18}{'M':>3}{'cuBLAS µs':>10}{'TB/s':>7}{'best µs':>9}{'TB/s':>7}  {'best tile':<24}"
          f"{'default µs':>11}{'cuBLAS/best':>12}{'cuBLAS/dflt':>12}{'fp32 err':>10}")
    for r in summary:
        d = f"{r['default_us']:.2f}" if r["default_us"] is not None else "-"
        dr = f"{r['cublas_over_default']:.2f}" if r["default_us"] is not None else "-"
        print(f"{r['shape']:<18}{r['M']:>3}{r['cublas_us']:>10.2f}{r['cublas_TBps']:>7.2f}{r['best_us']:>9.2f}"
              f"{r['best_TBps']:>7.2f}  {tile_name(tuple(r['best_tile'])):<24}{d:>11}{r['cublas_over_best']:>12.2f}"
              f"{dr:>12}{r['rel_err_fp32']:>10.1e}")
    if failures:
        print(f"MISMATCH (shape, M, tile, bf16 rel err, fp32 rel err): {failures}")
        sys.exit(1)
    print("all outputs within tolerance (bf16: max(2x cuBLAS's rel err, 1e-2) of the float32 reference; "
          "fp32 default tile: 1e-4)")


if __name__ == "__main__":
    main()
