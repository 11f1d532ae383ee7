"""The block-scaled FP8 GEMM (runtime/fp8_kernels.py) against cuBLAS's (torch's scaled_mm with 1x128 / 128x128
block scales, where this torch and GPU run it) and against bf16 F.linear, at decode and prefill row counts, on
the 8B shape's (Llama-3-8B) and the Qwen3-30B-A3B shape's dense projections. Each time is triton.testing.do_bench's
median (activation quantization included: what a layer pays; "+sum krn": split K summed by a second kernel, the
path before the tile's last program summed it); GB/s counts the weight bytes read once.
With --sweep, the GEMV's tiles (BLOCK_N x groups a step x warps / stages) at M = 1, 4, 16 and the GEMM's decode
tiles (BLOCK_N x split K) at M = 1 and 16. With --sweep-stages (alone), the decode GEMM's tiles with 3-8 pipeline
stages on cold weights (`sweep_stages`). With --sweep-rows 48,80 (alone), the 8B's projections at those row counts
(a verification step: batch x (k + 1)) over BLOCK_M x BLOCK_N x split K x warps, cold weights, against
bf16 and cuBLAS's block-scaled GEMM (`sweep_rows`).

Usage: python benchmarks/fp8_gemm.py [--rows 1,16,64,256,2048] [--sweep | --sweep-stages | --sweep-rows 48,80
       [--swap [--block-n 32,64,128]] [--shapes 8b.qkv,...]] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdp_cli.runtime import fp8_kernels as fk  # noqa: E402
from specdp_cli.runtime.models.quant import quantize_blocks  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
          "a3b.qkv": (5120, 2048), "a3b.o": (2048, 4096)}


def bench(fn, calls: int = 20) -> float:
    """ms per call: `calls` calls captured in one CUDA graph (as the engine runs them: no host launch cost),
    the graph replayed under do_bench (median)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / calls


def sum_kernel(fn) -> float:
    """bench(fn) with split K's partial sums added by a second kernel (the path before fp8_kernels.SPLITK_TICKETS)."""
    fk.SPLITK_TICKETS = False
    try:
        return bench(fn)
    finally:
        fk.SPLITK_TICKETS = True


def quantized(x, wq, ws):
    x_q, x_s = fk.quantize_activations(x)
    return fk.block_fp8_gemm(x_q, wq, ws, 128, x_scale=x_s, out_dtype=x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-stages", action="store_true",
                    help="only the decode GEMM's tiles with their pipeline depth, cold weights (sweep_stages)")
    ap.add_argument("--sweep-rows", default="",
                    help="only the GEMM's tiles at these row counts against bf16 and cuBLAS, cold weights (sweep_rows)")
    ap.add_argument("--swap", action="store_true",
                    help="with --sweep-rows: the shipped tile against tiles computing the product transposed (SWAP)")
    ap.add_argument("--ahead", action="store_true",
                    help="with --sweep-rows: the shipped tile and its neighbours with each K block's scales loaded "
                    "one block ahead (AHEAD), against the same without")
    ap.add_argument("--shapes", default="8b.qkv,8b.o,8b.gate_up,8b.down", help="with --sweep-rows: " + ",".join(SHAPES))
    ap.add_argument("--block-n", default="64", help="with --sweep-rows --swap: the transposed tiles' widths, e.g. 32,64,128")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.sweep_stages or a.sweep_rows:
        sweep = sweep_stages(dev) if a.sweep_stages else sweep_rows(dev, [int(m) for m in a.sweep_rows.split(",")],
                                                                    a.shapes.split(","), a.swap, a.ahead,
                                                                    tuple(int(b) for b in a.block_n.split(",")))
        with open(a.json, "w") as fh:
            json.dump({"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                "triton": triton.__version__, "argv": sys.argv[1:]}, "sweep": sweep}, fh, indent=1)
        return
    cublas = fk.cublas_supported(dev)
    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 30
        wq, ws = quantize_blocks(w)
        wcs = fk.cublas_weight_scale(ws)
        for M in [int(m) for m in a.rows.split(",")]:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            r = {"shape": name, "N": N, "K": K, "M": M,
                 "bf16_ms": bench(lambda: F.linear(x, w)),
                 "triton_ms": bench(lambda: quantized(x, wq, ws)),
                 "triton_sum_kernel_ms": sum_kernel(lambda: quantized(x, wq, ws)) if M <= 64 else None,
                 "fused_ms": bench(lambda: fk.block_fp8_gemm(x, wq, ws, 128)) if M <= 64 else None,
                 "w8a16_ms": bench(lambda: fk.block_fp8_gemm(x, wq, ws, 128, mode="weight_only")) if M <= 64 else None,
                 "gemv_ms": bench(lambda: fk.block_fp8_gemv(x, wq, ws, 128)) if M <= 16 else None,
                 "cublas_ms": bench(lambda: fk.cublas_block_fp8_gemm(x, wq, wcs)) if cublas and M % 8 == 0 else None}
            r["triton_GBps"] = (N * K + M * K * 2) / r["triton_ms"] / 1e6
            r["bf16_GBps"] = (2 * N * K + M * K * 2) / r["bf16_ms"] / 1e6
            rows.append(r)
            print(json.dumps(r), flush=True)
    print_table(rows)
    sweep = []
    if a.sweep:                           # the GEMV's tiles at 1, 4, 8 and 16 rows
        for name in ("8b.qkv", "8b.gate_up", "8b.down", "a3b.o"):
            N, K = SHAPES[name]
            wq, ws = quantize_blocks(torch.randn(N, K, device=dev) / 30)
            for M in (1, 4, 16):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                for bn in (8, 16, 32):
                    for groups in (1, 2, 4):
                        for warps, stages in ((4, 2), (4, 3), (8, 3)):
                            t = dict(BLOCK_N=bn, GROUPS=groups, warps=warps, stages=stages)
                            try:
                                ms = bench(lambda: fk.block_fp8_gemv(x, wq, ws, 128, tile=t))
                            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                                print(f"skip gemv {t}: {type(e).__name__}")
                                continue
                            sweep.append({"kernel": "gemv", "shape": name, "M": M, **t, "ms": ms,
                                          "GBps": N * K / ms / 1e6})
                best = min((s for s in sweep if s["shape"] == name and s["M"] == M), key=lambda s: s["ms"])
                print(f"sweep gemv {name} M={M}: best {best}", flush=True)
        for name in ("8b.o", "8b.down", "8b.qkv"):
            N, K = SHAPES[name]
            wq, ws = quantize_blocks(torch.randn(N, K, device=dev) / 30)
            for M in (1, 16):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                for bn in (16, 32, 64):
                    for split in (1, 2, 4, 8):
                        for stages in (4,):
                            t = dict(BLOCK_M=16, BLOCK_N=bn, SPLIT=split, warps=4, stages=stages, GROUP_M=1)
                            x_q, x_s = fk.quantize_activations(x)
                            try:
                                ms = bench(lambda: fk.block_fp8_gemm(x_q, wq, ws, 128, x_scale=x_s, tile=t,
                                                                     out_dtype=torch.bfloat16))
                            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                                print(f"skip {t}: {type(e).__name__}")
                                continue
                            sweep.append({"kernel": "gemm", "shape": name, "M": M, "BLOCK_N": bn, "SPLIT": split, "stages": stages,
                                          "ms": ms, "GBps": N * K / ms / 1e6})
                best = min((s for s in sweep if s["kernel"] == "gemm" and s["shape"] == name and s["M"] == M),
                           key=lambda s: s["ms"])
                print(f"sweep {name} M={M}: best {best}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "triton": triton.__version__, "cublas_block_scaled": cublas, "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows, "sweep": sweep}, fh, indent=1)


def cold_copies(N: int, K: int) -> int:
    """How many copies of an [N, K] FP8 weight make at least 160 MB (over 3x an H200's L2)."""
    return max(1, -(-(160 << 20) // (N * K)))


def cold(fn, copies: int) -> float:
    """ms per call of fn(i), i cycling over `copies` weight copies (2 x copies calls in one graph: nothing of a
    call's weight is left in L2 from the call before, as in a model's step)."""
    i = [0]

    def call():
        fn(i[0] % copies)
        i[0] += 1
    return bench(call, calls=2 * copies)


def sweep_stages(dev) -> list[dict]:
    """The decode GEMM (activations quantized before it) at 1 and 16 rows over BLOCK_N x split K x pipeline stages,
    each call reading another copy of the weight (at least 160 MB of copies, cycled: nothing is left in L2 from the
    call before, as in a model's step). A weight-streaming kernel keeps about programs x stages x tile bytes in
    flight; an FP8 tile holds half a bf16 tile's bytes, so the depth that saturates bf16 may not saturate FP8."""
    out = []
    print(f"{'shape':<12}{'M':>4}{'default us':>12}{'best us':>9}{'best GB/s':>11}  best tile")
    for name, (N, K) in SHAPES.items():
        copies = cold_copies(N, K)
        ws_ = [quantize_blocks(torch.randn(N, K, device=dev) / 30) for _ in range(copies)]
        for M in (1, 16):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            x_q, x_s = fk.quantize_activations(x)
            default = fk.tiles(M, N, K, fk._num_sms(dev))
            tried = [dict(default, label="default")]
            for bn in (32, 64, 128):
                for split in (1, 2, 4, 8):
                    for stages in (3, 4, 6, 8):
                        tried.append(dict(BLOCK_M=16, BLOCK_N=bn, SPLIT=split, warps=4, stages=stages, GROUP_M=1))
            found = []
            for t in tried:
                try:
                    ms = cold(lambda i: fk.block_fp8_gemm(x_q, ws_[i][0], ws_[i][1], 128, x_scale=x_s, tile=t,
                                                          out_dtype=torch.bfloat16), copies)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                    print(f"skip {t}: {type(e).__name__}")
                    continue
                found.append({"shape": name, "M": M, **t, "us": ms * 1e3, "GBps": N * K / ms / 1e6})
            out += found
            best = min(found, key=lambda r: r["us"])
            print(f"{name:<12}{M:>4}{found[0]['us']:>12.1f}{best['us']:>9.1f}{best['GBps']:>11.0f}  "
                  f"BLOCK_N {best['BLOCK_N']} split {best['SPLIT']} stages {best['stages']}", flush=True)
        ws_ = None
        torch.cuda.empty_cache()
    return out


def sweep_rows(dev, row_counts: list[int], shapes: list[str], swap: bool, ahead: bool = False,
               block_ns: tuple = (64,)) -> list[dict]:
    """The projections `shapes` at `row_counts` rows (activations quantized before the GEMM, as the norm kernels
    hand them over) over BLOCK_M x BLOCK_N x split K x warps, GROUP_M 8 (a column block's row blocks run side by side
    and share its weight tile in L2), each against bf16 F.linear and cuBLAS's block-scaled GEMM on cold weights.
    With `swap`: the shipped tile, then the transposed product's (SWAP: 64 or 128 weight rows a program, the rows in
    one block of BLOCK_M, split K x pipeline stages), its `fk.tiles` choice first, and the rows in blocks of 16 / 32 /
    64 side by side (GROUP_M) where they are more (session 38: slower at 80 rows); `block_ns`: the transposed tiles'
    weight rows a program (session 39: 32 / 64 / 128 on the Qwen3-30B-A3B shape's qkv and o, 8 warps at 128).
    Prints each (shape, rows)' five fastest tiles too."""
    out = []
    cublas = fk.cublas_supported(dev)
    print(f"{'shape':<12}{'M':>4}{'bf16 us':>9}{'cublas us':>10}{'default us':>11}{'best us':>9}  best tile")
    for name in shapes:
        N, K = SHAPES[name]
        copies = cold_copies(N, K)
        w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 30 for _ in range(copies)]
        w8 = [quantize_blocks(w) for w in w16]
        wcs = [fk.cublas_weight_scale(s) for _, s in w8]
        for M in row_counts:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            x_q, x_s = fk.quantize_activations(x)
            xp = torch.nn.functional.pad(x, (0, 0, 0, -M % 8))
            base = {"shape": name, "M": M,
                    "bf16_us": cold(lambda i: F.linear(x, w16[i]), copies) * 1e3,
                    "cublas_us": cold(lambda i: fk.cublas_block_fp8_gemm(xp, w8[i][0], wcs[i]), copies) * 1e3
                    if cublas else None}
            tried = [dict(fk.tiles(M, N, K, fk._num_sms(dev)), label="default")]
            if swap:
                was, fk.SWAP_TILES = fk.SWAP_TILES, "all"
                tried.append(dict(fk.tiles(M, N, K, fk._num_sms(dev)), label="swap"))
                fk.SWAP_TILES = was
                bm = max(16, triton.next_power_of_2(M))
                # (session 36's first sweep also had 128-wide blocks and 3 and 6 stages, its second W8A16 tiles with each
                # weight tile dequantized before its product: commit 5fdec1b)
                for bn in block_ns:
                    for split in (1, 2, 4, 8):
                        tried.append(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, warps=8 if bn >= 128 else 4, stages=4,
                                          GROUP_M=1, SWAP=True))
                # verification rows transposed in several row blocks of 16-64, a column block's side by side (GROUP_M:
                # one weight tile from memory, the other blocks' reads from L2), not one block padded to 128 rows
                for bm_ in (16, 32, 64):
                    if bm_ >= bm:
                        continue
                    for split in (1, 2, 4):
                        tried.append(dict(BLOCK_M=bm_, BLOCK_N=64, SPLIT=split, warps=4, stages=4,
                                          GROUP_M=triton.cdiv(M, bm_), SWAP=True, label=f"swap {bm_} x {split}"))
            if ahead:          # the shipped tile and its split neighbours, each without and with AHEAD
                d = tried[0]
                for split in sorted({d["SPLIT"], max(1, d["SPLIT"] // 2), 2 * d["SPLIT"]}):
                    for on in (False, True):
                        tried.append(dict(d, label=f"split {split}{' ahead' if on else ''}", SPLIT=split, AHEAD=on))
            for bm in () if swap or ahead else (16, 64, 128):
                if bm > max(16, triton.next_power_of_2(M)):
                    continue
                for bn in (32, 64, 128):
                    for split in (1, 2, 4, 8):
                        for warps in ((4, 8) if bm == 128 else (4,)):
                            tried.append(dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, warps=warps, stages=4, GROUP_M=8))
            found = []
            for t in tried:
                try:
                    us = cold(lambda i: fk.block_fp8_gemm(x_q, w8[i][0], w8[i][1], 128, x_scale=x_s, tile=t,
                                                          out_dtype=torch.bfloat16), copies) * 1e3
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                    print(f"skip {t}: {type(e).__name__}")
                    continue
                found.append({**base, **t, "us": us, "GBps": N * K / us / 1e3})
            out += found
            best = min(found, key=lambda r: r["us"])
            cb = f"{base['cublas_us']:.1f}" if base["cublas_us"] is not None else "-"
            print(f"{name:<12}{M:>4}{base['bf16_us']:>9.1f}{cb:>10}{found[0]['us']:>11.1f}{best['us']:>9.1f}  "
                  f"BLOCK_M {best['BLOCK_M']} BLOCK_N {best['BLOCK_N']} split {best['SPLIT']} warps {best['warps']} "
                  f"stages {best['stages']} GROUP_M {best['GROUP_M']}{' swap' if best.get('SWAP') else ''}"
                  f"{' ahead' if best.get('AHEAD') else ''}"
                  + (f"  (swap's default {found[1]['us']:.1f})" if swap and len(found) > 1 and found[1].get('label')
                     == 'swap' else "")
                  + "".join(f"  (shipped tile, ahead: {r['us']:.1f})" for r in found if ahead and r.get("AHEAD")
                            and r["SPLIT"] == found[0]["SPLIT"]), flush=True)
            for r in sorted(found, key=lambda r: r["us"])[:5]:
                print(f"  {r['us']:7.1f} us  BLOCK_N {r['BLOCK_N']} split {r['SPLIT']} warps {r['warps']}"
                      f"{' swap' if r.get('SWAP') else ''} {r.get('label', '')}", flush=True)
        w16 = w8 = wcs = None
        torch.cuda.empty_cache()
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':<12}{'M':>6}{'bf16 us':>10}{'triton us':>11}{'+sum krn':>9}{'gemv us':>9}{'fused us':>10}{'w8a16 us':>10}{'cublas us':>11}"
          f"{'triton GB/s':>13}{'bf16 GB/s':>11}")

    def us(v):
        return f"{v * 1e3:.1f}" if v is not None else "-"
    for r in rows:
        print(f"{r['shape']:<12}{r['M']:>6}{us(r['bf16_ms']):>10}{us(r['triton_ms']):>11}{us(r.get('triton_sum_kernel_ms')):>9}{us(r['gemv_ms']):>9}{us(r['fused_ms']):>10}"
              f"{us(r['w8a16_ms']):>10}{us(r['cublas_ms']):>11}{r['triton_GBps']:>13.0f}{r['bf16_GBps']:>11.0f}")


if __name__ == "__main__":
    main()
