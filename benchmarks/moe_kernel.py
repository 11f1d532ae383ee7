"""One MoE layer's routed experts on one GPU: specdp's Triton kernels (`runtime/moe_kernels.py`, default tiles
and, with --sweep, other tiles and matrix-vector kernels) against PyTorch's grouped GEMM (`torch._grouped_mm`: pairs sorted by expert, a grouped
GEMM for gate/up, SiLU-and-mul, a grouped GEMM for down, the weighted sum) and the previous engine's path
(every expert over every token), at several token counts. Each variant is captured in a CUDA graph and
replayed (what a decode step does), timed with CUDA events; "GB/s" is the bytes of the experts the tokens chose
(each read once) over the time, and "% copy" that against the device's measured copy bandwidth.

Usage: python benchmarks/moe_kernel.py [--shapes qwen3_30b_a3b,deepseek_v3] [--tokens 1,16,64,256] [--sweep]
           [--sweep-set all|xq] [--dtype bfloat16] [--fp8] --json OUT.json
(--fp8: the experts in FP8, read weight-only by the Triton kernels, with deeper-pipelined tiles under --sweep; bytes
and GB/s count FP8 bytes)
(prompt chunks: --tokens 2048,8192)

--routing times only a layer's routing for few tokens, old (cuBLAS router logits, the top-k kernel, `_align_kernel`)
against new (`router_logits`' matrix-vector kernel up to ROUTER_MAX_TOKENS, the top-k kernel (DeepSeek: its grouped
top-k), the small align), and each kernel alone, with router variants; each graph holds 20 calls back to back (as
a decode step's layers run), the time is per call:
    python benchmarks/moe_kernel.py --routing --shapes qwen3_30b_a3b,deepseek_v3 --tokens 1,2,4,8,16 --json OUT.json
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
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offline  # noqa: E402
from moe_expert_count import all_experts  # noqa: E402
from specdp_cli.runtime.models.moe import MoE, router_logits as pick_router  # noqa: E402
from specdp_cli.runtime import moe_kernels as mk  # noqa: E402
from specdp_cli.runtime.moe_kernels import routed_experts, softmax_topk, tiles  # noqa: E402
from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks  # noqa: E402
from specdp_cli.runtime.fp8_kernels import FP8Activation, quantize_activations  # noqa: E402

SHAPES = {   # experts, top_k, hidden, expert width
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "deepseek_v3": (256, 8, 7168, 2048),
    "mixtral_8x7b": (8, 2, 4096, 14336),
}
SWEEP = [dict(BLOCK_M=bm, UP_N=un, DOWN_N=dn, BLOCK_K=bk, warps=w, stages=s)
         for bm, un, dn, bk, w, s in [(16, 32, 32, 128, 4, 4), (16, 64, 64, 128, 4, 4), (16, 32, 64, 128, 4, 4),
                                      (16, 32, 64, 256, 4, 3), (32, 64, 64, 64, 4, 4), (64, 64, 128, 64, 8, 3),
                                      (128, 128, 128, 64, 8, 3)]]
# FP8 experts (--fp8; weight-only, BLOCK_K dividing 128): an FP8 tile holds half a bf16 tile's bytes, so deeper
# pipelines and more programs are tried for the bytes in flight that stream the experts
SWEEP_FP8 = [dict(BLOCK_M=16, UP_N=un, DOWN_N=dn, BLOCK_K=128, warps=4, stages=s)
             for un, dn, s in [(32, 64, 3), (32, 64, 6), (32, 64, 8), (16, 32, 4), (16, 32, 6), (16, 64, 6),
                               (64, 64, 6), (32, 32, 6)]]
# ... and W8A8 with the product transposed (moe_kernels' W8A8T: the activations quantized in the kernels, FP8 wgmma
# on Hopper; session 36; since session 37 gate's and up's UP_N rows stacked in one tile: 128 or 64 weight rows a
# program), 3-6 stages (session 37 also loaded the block scales a K block ahead: no faster, commit history)
SWEEP_FP8 += [dict(BLOCK_M=16, UP_N=un, DOWN_N=dn, BLOCK_K=128, warps=4, stages=s, W8A8T=True)
              for un, dn, s in [(64, 64, 4), (64, 64, 3), (64, 64, 6), (32, 64, 4), (32, 64, 3), (32, 64, 6)]]
# session 39 (`--sweep-set xq`): the W8A8 transposed tile with x quantized before (X_Q: no quantization in gate/up's K
# loop; here quantized outside the timed graph, as the RMSNorm before the experts writes it in the engine), 3-6
# stages. Session 39 also split gate/up's K over 2 or 4 programs a tile (SPLIT_K; not kept: commit a9e9d38) and had
# gate/up prefetch its expert's down weights into L2 (PREFETCH_DOWN; not kept: commit fcb2028)
SWEEP_XQ = [dict(BLOCK_M=16, UP_N=64, DOWN_N=64, BLOCK_K=128, warps=4, stages=s, W8A8T=True, **kw)
            for s, kw in [(4, {}), (4, dict(X_Q=True)), (3, dict(X_Q=True)), (6, dict(X_Q=True))]]
# matrix-vector kernels (one program per pair for gate/up, one per token summing its experts' down projections;
# no grouping): the alternative for few pairs that the engine does not use (it lost to the grouped kernels)
GEMV = [dict(UP_N=un, DOWN_N=dn, BLOCK_K=bk, warps=w)
        for un, dn, bk, w in [(16, 16, 256, 4), (8, 8, 256, 4), (32, 32, 128, 4), (16, 16, 512, 8), (4, 8, 512, 4)]]


@triton.jit
def _gemv_up_kernel(x_ptr, w_ptr, idx_ptr, act_ptr, TOPK, I, H, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(idx_ptr + p).to(tl.int64)
    t = p // TOPK
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    wg = w_ptr + e * 2 * I * H + n[:, None] * H + k[None, :]
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = tl.load(x_ptr + t * H + k0 + k).to(tl.float32)
        acc_g += tl.sum(tl.load(wg).to(tl.float32) * a[None, :], 1)
        acc_u += tl.sum(tl.load(wg + I * H).to(tl.float32) * a[None, :], 1)
        wg += BLOCK_K
    tl.store(act_ptr + p * I + n, (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(act_ptr.dtype.element_ty))


@triton.jit
def _gemv_down_kernel(a_ptr, w_ptr, rw_ptr, idx_ptr, out_ptr, TOPK, H, I, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, TOPK):
        p = t * TOPK + j
        wp = w_ptr + tl.load(idx_ptr + p).to(tl.int64) * H * I + n[:, None] * I + k[None, :]
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            acc += tl.sum(tl.load(wp).to(tl.float32) * tl.load(a_ptr + p * I + k0 + k).to(tl.float32)[None, :], 1)
            wp += BLOCK_K
        y += acc * tl.load(rw_ptr + p)
    tl.store(out_ptr + t * H + n, y.to(out_ptr.dtype.element_ty))


def gemv_path(x, w, idx, gate_up, down, t):
    """The matrix-vector alternative (sizes divisible by the blocks, as the shapes here are)."""
    N, K = idx.shape
    I, H = down.shape[2], x.shape[1]
    act = torch.empty((N * K, I), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    _gemv_up_kernel[(N * K, I // t["UP_N"])](x, gate_up, idx, act, K, I, H, BLOCK_N=t["UP_N"], BLOCK_K=t["BLOCK_K"],
                                             num_warps=t["warps"])
    _gemv_down_kernel[(N, H // t["DOWN_N"])](act, down, w, idx, out, K, H, I, BLOCK_N=t["DOWN_N"],
                                             BLOCK_K=min(t["BLOCK_K"], I), num_warps=t["warps"])
    return out


def grouped_mm_path(x, w, idx, gate_up, down):
    """PyTorch's grouped GEMM over the pairs sorted by expert."""
    N, K = idx.shape
    E = gate_up.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // K
    h = torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def graph_time(fn, reps: int = 50) -> float:
    """Median µs of one replay of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def graph_time_per_call(fn, calls: int = 20, reps: int = 30) -> float:
    """Median µs per call of `calls` calls of fn captured back to back in one CUDA graph."""
    return graph_time(lambda: [fn() for _ in range(calls)], reps) / calls


def routing_rows(shapes: list[str], tokens: list[int], dtype: torch.dtype) -> list[dict]:
    """Old routing vs new, and each kernel alone, per shape and token count (see the module docstring)."""
    rows = []
    torch.manual_seed(0)
    for shape in shapes:
        E, K, H, _ = SHAPES[shape]
        sigmoid = shape.startswith("deepseek")
        router = torch.randn(E, H, device="cuda", dtype=torch.float32 if sigmoid else dtype) * H ** -0.5
        bias = torch.randn(E, device="cuda") * 0.1
        for N in tokens:
            x = torch.randn(N, H, device="cuda", dtype=dtype)
            P = N * K
            bm = mk.block_m(P, E)
            out_dt = torch.float32 if sigmoid else None

            def old_logits():
                return F.linear(x.float(), router) if sigmoid else F.linear(x, router)

            def topk(logits):
                if sigmoid:
                    return mk.grouped_sigmoid_topk(logits, bias, K, 8, 4, True, 2.5)
                return softmax_topk(logits, K, True)

            logits = old_logits()
            idx = topk(logits)[1].view(-1)
            new_logits = mk.router_logits(x, router, out_dt)
            err = (new_logits.float() - logits.float()).abs().max().item()
            same = (new_logits == logits).float().mean().item()
            variants = {
                "old: F.linear + top-k + _align_kernel": lambda: mk.align(topk(old_logits())[1].view(-1), E, bm,
                                                                           small=False),
                "new: router_logits + top-k + small align":
                    lambda: mk.align(topk(pick_router(x, router, out_dt))[1].view(-1), E, bm),
                "router F.linear": old_logits,
                "router_logits (default)": lambda: mk.router_logits(x, router, out_dt),
                "top-k kernel": lambda: topk(logits),
                "_align_kernel": lambda: mk.align(idx, E, bm, small=False),
                "small align": lambda: mk.align(idx, E, bm, small=True),
            }
            for be, bk in ((1, None), (4, None), (1, 256)):
                variants[f"router_logits block_e={be} block_k={bk}"] = (
                    lambda be=be, bk=bk: mk.router_logits(x, router, out_dt, block_e=be, block_k=bk))
            for name, fn in variants.items():
                row = {"shape": shape, "tokens": N, "variant": name, "us": graph_time_per_call(fn),
                       "logits_max_abs_diff": err, "logits_equal_frac": same}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def write_json(a, rows: list[dict], **meta) -> None:
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "dtype": a.dtype, **meta, "argv": sys.argv[1:]}
    with open(a.json, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3_30b_a3b,deepseek_v3")
    ap.add_argument("--tokens", default="1,16,64,256")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-set", default="all", choices=["all", "xq"],
                    help="with --sweep --fp8: all tiles, or only session 39's x-quantized-before tiles")
    ap.add_argument("--fp8", action="store_true", help="the experts in FP8 (128 x 128 blocks, read weight-only by "
                    "the Triton kernels; the other paths read them dequantized)")
    ap.add_argument("--all-experts-max-e", type=int, default=128, help="time the old path up to this many experts")
    ap.add_argument("--routing", action="store_true", help="time the routing kernels only, old against new")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.routing:
        rows = routing_rows(a.shapes.split(","), [int(t) for t in a.tokens.split(",")], dtype)
        write_json(a, rows)
        print(f"{'shape':<15}{'tokens':>7} {'variant':<60}{'µs':>8}  logits vs F.linear: equal, max diff")
        for r in rows:
            print(f"{r['shape']:<15}{r['tokens']:>7} {r['variant'][:60]:<60}{r['us']:>8.2f}  "
                  f"{r['logits_equal_frac']:.4f} {r['logits_max_abs_diff']:.1e}")
        return
    bw = offline.copy_bandwidth()
    rows = []
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        E, K, H, I = SHAPES[shape]
        gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=dtype) * H ** -0.5
        down = torch.randn(E, H, I, device="cuda", dtype=dtype) * I ** -0.5
        expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
        if a.fp8:       # the Triton kernels read FP8Weight; the reference and the other paths its dequantized values
            gu8, d8 = (FP8Weight(*quantize_blocks(t.float()), 128, dtype) for t in (gate_up, down))
            gate_up, down = gu8.dequantize(dtype), d8.dequantize(dtype)
            expert_bytes //= 2
        for N in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(N, H, device="cuda", dtype=dtype)
            idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(N)])
            w = torch.softmax(torch.randn(N, K, device="cuda"), -1)
            used = int(torch.unique(idx).numel())
            read = used * expert_bytes
            ref = grouped_mm_path(x, w, idx, gate_up, down).float()
            sweep = (SWEEP_XQ if a.sweep_set == "xq" else SWEEP_FP8) if a.fp8 else SWEEP
            variants = [("triton", None)] + ([(f"triton {t}", t) for t in sweep] if a.sweep else [])
            x_q = FP8Activation(*quantize_activations(x), dtype) if a.fp8 else None
            variants += [(f"gemv {t}", ("gemv", t)) for t in GEMV] if a.sweep and N * K <= 128 and not a.fp8 else []
            variants += [("grouped_mm", "gmm"), ("routing (softmax top-k)", "route")]
            if E <= a.all_experts_max_e and N <= 64:
                variants.append(("all experts (before)", "all"))
            for name, t in variants:
                if t == "gmm":
                    fn = lambda: grouped_mm_path(x, w, idx, gate_up, down)      # noqa: E731
                elif isinstance(t, tuple):
                    fn = lambda t=t: gemv_path(x, w.contiguous(), idx.contiguous(), gate_up, down, t[1])  # noqa: E731
                elif t == "route":     # the router's GEMV and the routing kernel, for scale
                    router = torch.randn(E, H, device="cuda", dtype=dtype)
                    fn = lambda: softmax_topk(F.linear(x, router), K, True)[0]   # noqa: E731
                elif t == "all":
                    old = MoE(None, gate_up, down, True, range(E))
                    fn = lambda: all_experts(old, x, w, idx)     # noqa: E731
                elif a.fp8:
                    fn = lambda t=t: routed_experts(    # noqa: E731
                        x, w, idx, gu8, d8, tile=t, x_q=x_q if t is not None and t.get("X_Q") else None)
                else:
                    fn = lambda t=t: routed_experts(x, w, idx, gate_up, down, tile=t)  # noqa: E731
                try:
                    err = ((fn().float() - ref).abs().max() / ref.abs().max()).item() if t != "route" else 0.0
                    us = graph_time(fn)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit shared memory
                    print(f"{shape} N={N} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {"shape": shape, "tokens": N, "variant": name, "tile": t if isinstance(t, (dict, tuple)) else
                       (tiles(N * K, E, I, H, dtype, a.fp8) if t is None else None), "us": us, "experts_used": used,
                       "bytes": read, "GBps": read / us / 1e3, "pct_copy": read / (us * 1e-6) / bw * 100,
                       "rel_err_vs_grouped_mm": err}
                rows.append(row)
                print(json.dumps(row), flush=True)

    write_json(a, rows, copy_bandwidth_Bps=bw)
    print(f"{'shape':<15}{'tokens':>7} {'variant':<60}{'µs':>9}{'GB/s':>8}{'% copy':>8}{'err':>9}")
    for r in rows:
        print(f"{r['shape']:<15}{r['tokens']:>7} {r['variant'][:60]:<60}{r['us']:>9.1f}{r['GBps']:>8.0f}"
              f"{r['pct_copy']:>8.1f}{r['rel_err_vs_grouped_mm']:>9.1e}")
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
