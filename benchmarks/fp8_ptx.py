"""What the block-scaled FP8 GEMM (runtime/fp8_kernels._gemm_kernel) compiles to on Hopper, without a GPU: each
tile is compiled for sm_90 as the JIT would launch it (pointers, K and the row strides 16-byte aligned; split K with
tickets; activations quantized before it) and its PTX instructions are counted: the tensor-core instruction
(`wgmma` with FP8 operands, or `mma.sync` on FP8 values converted to FP16), the asynchronous copies that feed it,
shared-memory traffic. Then moe_kernels' routed-expert kernels at 16-row blocks, weight-only and W8A8 transposed.
Session 36: up to 16 rows the plain tile (BLOCK_M 16) converts the FP8 tiles to FP16 for `mma.sync`, the
transposed one (SWAP) runs FP8 `wgmma` m64n16; the weight-only expert kernels convert the FP8 weights for a bf16
`mma.sync`, the W8A8 transposed ones run FP8 `wgmma` m64n16. Each main loop's order shows where the block scales'
global loads sit: after the wait for the block's tiles, or (AHEAD) a block ahead, before it.

Usage: python benchmarks/fp8_ptx.py [--json OUT.json]   (needs triton with its NVIDIA backend, no GPU)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdp_cli.runtime import fp8_kernels as fk  # noqa: E402
from specdp_cli.runtime import moe_kernels as mk  # noqa: E402

POINTERS = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": "*fp32",
            "c_ptr": "*fp32", "y_ptr": "*bf16", "tickets_ptr": "*i32", "ss_ptr": "*fp32", "res_ptr": "*bf16",
            "nw_ptr": "*bf16", "qo_ptr": "*fp8e4nv", "so_ptr": "*fp32"}
ALIGNED = set(POINTERS) | {"N", "K", "stride_am", "stride_bn", "stride_cs", "stride_cm", "stride_ym"}
KINDS = ("wgmma.mma_async", "mma.sync", "ldmatrix", "cp.async.cg", "ld.global", "st.shared", "ld.shared", "cvt")
# (label, BLOCK_M, BLOCK_N, SWAP, GROUP_M, AHEAD[, kind]): the 8B's decode and verification tiles (fp8_kernels.tiles);
# kind "rstd": the activations an RMSNorm's input, each row scaled by its 1 / rms; "add_norm": the output joins the
# residual stream and the next linear's norm input is written (fp8_kernels.fp8_linear_add_norm, 8 warps);
# "add_norm_early": ... with the tile's residual and norm weight loaded before the main loop (ADD_NORM_EARLY)
TILES = (("16 rows, plain", 16, 64, False, 1, False), ("16 rows, swapped", 16, 64, True, 1, False),
         ("16 rows, swapped, scales a block ahead (decode default)", 16, 64, True, 1, True),
         ("16 rows, swapped, ahead, rows scaled by 1 / rms", 16, 64, True, 1, True, "rstd"),
         ("16 rows, swapped 128 wide, ahead, joins the residual", 16, 128, True, 1, True, "add_norm"),
         ("... its residual and norm weight loaded before the main loop", 16, 128, True, 1, True, "add_norm_early"),
         ("80 rows, 64-row blocks (verification default)", 64, 64, False, 2, False),
         ("80 rows, 64-row blocks, scales a block ahead", 64, 64, False, 2, True),
         ("80 rows, swapped", 128, 64, True, 1, False))
# what the main loop's order shows: where the scales' global loads sit against the wait for the block's tiles
ORDER = ("ld.global", "cp.async.wait_group", "wgmma.mma_async", "wgmma.wait_group", "mma.sync", "fma.rn", "cp.async.cg")


def compile_tile(block_m: int, block_n: int, swap: bool, group_m: int, ahead: bool = False, kind: str = "",
                 stages: int = 4):
    warps = 8 if kind.startswith("add_norm") else 4
    const = dict(B_ROWS=128, A_MODE=0, HAS_BIAS=False, SPLIT=True, TICKET=True, EVEN_K=True, BLOCK_M=block_m,
                 BLOCK_N=block_n, BLOCK_K=fk.GROUP, GROUP_M=group_m, PDL=False, PREFETCH=False, LANES=32 * warps,
                 LATE=False, SWAP=swap, AHEAD=ahead, RSTD=kind == "rstd", SS_PAD=32,
                 ADD_NORM={"add_norm": 1, "add_norm_early": 2}.get(kind, 0))
    names = fk._gemm_kernel.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in const else "fp32" if n == "eps" else "i32") for n in names}
    src = ASTSource(fn=fk._gemm_kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def compile_experts(kernel: str, w8a8t: bool, stages: int = 4, x_q: bool = False):
    """moe_kernels' routed-expert kernel ("up" or "down") on FP8 experts at 16-row blocks (a decode step's pairs),
    weight-only (32-wide gate/up blocks, as `tiles` picked before session 36) or W8A8 transposed (64-wide; gate's and
    up's rows stacked in one 128-row tile since session 37); gate/up's `x_q` (x quantized before) since session 39."""
    common = dict(BLOCK_M=16, BLOCK_K=fk.GROUP, HAS_BIAS=False, PREC="tf32", W_FP8=True, W_ROWS=128, PDL=False,
                  W8A8T=w8a8t)
    if kernel == "up":
        fn, const = mk._up_kernel, dict(common, BLOCK_N=64 if w8a8t else 32, ACT=0, X_Q=x_q)
        pointers = {"x_ptr": "*fp8e4nv" if x_q else "*bf16", "act_ptr": "*bf16", "xs_ptr": "*fp32"}
        aligned = {"stride_x", "stride_a", "H", "I"}
    else:
        fn, const = mk._down_kernel, dict(common, BLOCK_N=64, ROUND_W=True)
        pointers = {"a_ptr": "*bf16", "y_ptr": "*bf16", "rw_ptr": "*fp32"}
        aligned = {"stride_a", "stride_y", "H", "I"}
    pointers.update({"w_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "pairs_ptr": "*i32", "block_expert_ptr": "*i32",
                     "ws_ptr": "*fp32"})
    aligned |= set(pointers) | {"stride_we", "stride_wn"}
    names = fn.arg_names
    sig = {n: pointers.get(n, "constexpr" if n in const else "fp32" if n in ("alpha", "limit") else "i32")
           for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=stages))


def instructions(ptx: str) -> dict[str, int]:
    """PTX instructions (predicated ones too) by full name, those of KINDS only."""
    counts: dict[str, int] = {}
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", ptx, re.M):
        if op.startswith(KINDS):
            counts[op] = counts.get(op, 0) + 1
    return counts


def loop_order(ptx: str) -> list[str]:
    """The first inner loop's instructions of ORDER's kinds, in order, repeats counted ("ld.global x18")."""
    lines = ptx.splitlines()
    start = next((i for i, line in enumerate(lines) if "Inner Loop Header" in line), None)
    if start is None:
        return []
    seq: list[list] = []
    for line in lines[start + 1:]:
        if re.match(r"\s*\$L__BB", line):            # the next block: the loop's body ends at its back branch
            break
        kind = next((k for k in ORDER if k in line), None)
        if kind:
            if seq and seq[-1][0] == kind:
                seq[-1][1] += 1
            else:
                seq.append([kind, 1])
    return [f"{k} x{n}" for k, n in seq]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    compiled = [(label, dict(BLOCK_M=bm, BLOCK_N=bn, SWAP=swap, AHEAD=ahead, kind=(kind or [""])[0]),
                 lambda bm=bm, bn=bn, swap=swap, g=group_m, ahead=ahead, kind=(kind or [""])[0]:
                 compile_tile(bm, bn, swap, g, ahead, kind))
                for label, bm, bn, swap, group_m, ahead, *kind in TILES]
    compiled += [(f"experts' {k}, 16-row blocks, {'W8A8 transposed' if t else 'weight-only'}", {"W8A8T": t},
                  lambda k=k, t=t: compile_experts(k, t)) for k in ("up", "down") for t in (False, True)]
    compiled += [("experts' up, 16-row blocks, W8A8 transposed, x quantized before", {"W8A8T": True, "X_Q": True},
                  lambda: compile_experts("up", True, x_q=True))]
    for label, tile, build in compiled:
        ptx = build().asm["ptx"]
        counts, order = instructions(ptx), loop_order(ptx)
        rows.append({"tile": label, **tile, "instructions": counts, "loop_order": order})
        mma = ", ".join(f"{k} x{v}" for k, v in counts.items() if "mma" in k)
        print(f"{label:<48} {mma}")
        print(f"{'':<48} " + ", ".join(f"{k} x{v}" for k, v in counts.items() if "mma" not in k))
        print(f"{'':<48} main loop: " + " -> ".join(order))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
