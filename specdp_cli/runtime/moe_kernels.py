"""Triton kernels of the routed experts on CUDA: each expert runs once over the tokens that chose it, and only
the chosen experts' weights are read (`models/moe.py` holds the torch reference, which CPU runs and the GPU
tests compare against).

A forward's N tokens choose top_k experts each: P = N * top_k token-expert pairs (pair p is token p // top_k).
1. `_align_kernel` (one program) groups the pairs by expert into blocks of BLOCK_M: `pairs` lists, block by
   block, the pair ids of one expert (padded with P), `block_expert` each block's expert (-1 for the blocks
   past the last). Pairs whose expert this rank does not hold (expert parallelism) join no block. Up to
   SMALL_P pairs `_align_small_kernel` does it in registers instead.
2. `_up_kernel`: per (block, column block) one grouped GEMM of the block's tokens with its expert's gate and
   up rows, the activation fused (SiLU-and-mul, or GPT-OSS's clamped SwiGLU): act [P, I] by pair.
3. `_down_kernel`: act @ down^T (+ bias) times the pair's routing weight: y [P, hidden] by pair.
4. `_sum_kernel`: each token's sum over its top_k pairs (those held here). `routed_pairs` runs steps 1-3 alone: a
   decoder layer then sums them in `_sum_add_norm_kernel`, with the residual add and the next RMSNorm.
Every size is a function of N, top_k and the experts held, and every count the data decides (how many blocks
an expert fills) is read from device memory, so a CUDA graph holds all four. Every kernel here launches with
programmatic dependent launch on Hopper (pdl.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_kernels import FP8Activation, quantized_rows, store_quantized
from .triton_kernels import _add_residual, _norm_row, _normed, _pow2, norm_warps


@triton.jit
def _align_kernel(idx_ptr, pairs_ptr, block_expert_ptr, count_ptr, rank_ptr, P, E, max_blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, B_CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.begin(PDL)
    ebins = tl.arange(0, E_BLOCK)
    tl.store(count_ptr + ebins, tl.zeros([E_BLOCK], dtype=tl.int32))
    c = tl.arange(0, CHUNK)
    for p0 in range(0, max_blocks * BLOCK_M, CHUNK):                  # padding slots hold the sentinel P
        tl.store(pairs_ptr + p0 + c, tl.full([CHUNK], 0, tl.int32) + P, mask=p0 + c < max_blocks * BLOCK_M)
    tl.debug_barrier()
    # each pair's rank among its expert's pairs (the order inside an expert's blocks does not change a row's sum)
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        e = tl.load(idx_ptr + p, mask=p < P, other=-1).to(tl.int32)
        held = (p < P) & (e >= 0) & (e < E)
        r = tl.atomic_add(count_ptr + tl.where(held, e, 0), 1, mask=held)
        tl.store(rank_ptr + p, r, mask=held)
    tl.debug_barrier()
    counts = tl.load(count_ptr + ebins, mask=ebins < E, other=0)
    nblocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(nblocks, 0)
    total = tl.sum(nblocks, 0)
    tl.debug_barrier()
    tl.store(count_ptr + ebins, ends - nblocks)                       # now each expert's first block
    tl.debug_barrier()
    for p0 in range(0, P, CHUNK):
        p = p0 + c
        e = tl.load(idx_ptr + p, mask=p < P, other=-1).to(tl.int32)
        held = (p < P) & (e >= 0) & (e < E)
        first = tl.load(count_ptr + tl.where(held, e, 0), mask=held, other=0)
        r = tl.load(rank_ptr + p, mask=held, other=0)
        tl.store(pairs_ptr + first * BLOCK_M + r, p, mask=held)
    b = tl.arange(0, B_CHUNK)
    for b0 in range(0, max_blocks, B_CHUNK):
        bb = b0 + b
        expert = tl.sum(((ends[None, :] <= bb[:, None]) & (ebins[None, :] < E)).to(tl.int32), 1)
        tl.store(block_expert_ptr + bb, tl.where(bb < total, expert, -1), mask=bb < max_blocks)


# Up to SMALL_P pairs (decode and verify steps: 16 tokens of top-8) the grouping is a [P, P] comparison in one
# program's registers: no atomics, no barriers, nothing written but the used blocks and the -1 past them. Beyond,
# the matrix no longer fits in registers: `_align_kernel`.
SMALL_P = 128


@triton.jit
def _align_pairs(pid, e, held, P, max_blocks, pairs_ptr, block_expert_ptr, BLOCK_M: tl.constexpr,
                 B_BLOCK: tl.constexpr):
    """`_align_kernel`'s pairs and block_expert from a vector of pairs in registers: pid their ids (the pairs in
    any order, padded with lanes that are not held), e their held experts, held whether this rank holds them.
    Within an expert the pairs keep their id order."""
    same = (e[:, None] == e[None, :]) & held[:, None] & held[None, :]
    rank = tl.sum((same & (pid[None, :] < pid[:, None])).to(tl.int32), 1)       # pairs of i's expert before i
    count = tl.sum(same.to(tl.int32), 1)
    starts = held & (rank % BLOCK_M == 0)                                        # the pairs that open a block
    first = tl.sum(((e[None, :] < e[:, None]) & starts[None, :]).to(tl.int32), 1)   # blocks of the experts below
    pos = first * BLOCK_M + rank
    tl.store(pairs_ptr + pos, pid, mask=held)
    tl.store(block_expert_ptr + pos // BLOCK_M, e, mask=starts)
    # an expert's last pair pads the rest of its block with the sentinel P
    m = 1 + tl.arange(0, BLOCK_M)
    pad = ((pos % BLOCK_M)[:, None] + m[None, :] < BLOCK_M) & (held & (rank == count - 1))[:, None]
    tl.store(pairs_ptr + pos[:, None] + m[None, :], tl.where(pad, P, 0), mask=pad)
    b = tl.arange(0, B_BLOCK)
    total = tl.sum(starts.to(tl.int32), 0)
    tl.store(block_expert_ptr + b, tl.full([B_BLOCK], -1, tl.int32), mask=(b >= total) & (b < max_blocks))


@triton.jit
def _align_small_kernel(idx_ptr, pairs_ptr, block_expert_ptr, P, E, max_blocks, BLOCK_M: tl.constexpr,
                        P_BLOCK: tl.constexpr, B_BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    p = tl.arange(0, P_BLOCK)
    e = tl.load(idx_ptr + p, mask=p < P, other=-1).to(tl.int32)
    _align_pairs(p, e, (p < P) & (e >= 0) & (e < E), P, max_blocks, pairs_ptr, block_expert_ptr, BLOCK_M, B_BLOCK)


def _align_warps(lanes: int) -> int:
    # the [P, P] matrices take about 2 registers a cell (ptxas for sm_90): at most 32 cells a thread, no spills
    return min(16, max(4, lanes * lanes // 1024))


def align_shape(P: int, E: int, block_m: int) -> int:
    """The most blocks P pairs over E held experts fill: every block full but each expert's last."""
    return triton.cdiv(P, block_m) + min(E, P)


def align(idx: torch.Tensor, E: int, block_m: int, small: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of idx [P] (held experts; outside [0, E): held elsewhere) grouped by expert in blocks of block_m:
    (pairs [max_blocks * block_m] int32, block_expert [max_blocks] int32), as the module docstring says. `small`:
    `_align_small_kernel` (default up to SMALL_P pairs) or `_align_kernel`."""
    P = idx.numel()
    max_blocks = align_shape(P, E, block_m)
    pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=idx.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=idx.device)
    if small is None:
        small = P <= SMALL_P
    if small:
        _align_small_kernel[(1,)](idx, pairs, block_expert, P, E, max_blocks, BLOCK_M=block_m, P_BLOCK=_pow2(P),
                                  B_BLOCK=_pow2(max_blocks), num_warps=_align_warps(_pow2(P)),
                                  **pdl.options(idx.device))
    else:
        counts = torch.empty(_pow2(E), dtype=torch.int32, device=idx.device)
        ranks = torch.empty(P, dtype=torch.int32, device=idx.device)
        _align_kernel[(1,)](idx, pairs, block_expert, counts, ranks, P, E, max_blocks, BLOCK_M=block_m, CHUNK=1024,
                            E_BLOCK=_pow2(E), B_CHUNK=max(16, min(64, 8192 // _pow2(E))), num_warps=4,
                            **pdl.options(idx.device))
    return pairs, block_expert


@triton.jit
def _quantize_columns(a):
    """a [BLOCK_K, BLOCK_M] (one 128-column group of BLOCK_M activation rows, transposed) -> its FP8 values and
    each row's scale, as fp8_kernels.quantize_activations computes them."""
    af = a.to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(af), 0) / 448.0, 1e-12)
    return tl.clamp(af / s[None, :], -448.0, 448.0).to(tl.float8e4nv), s


@triton.jit
def _w8a8t_product(aq, a_s, w, s_w, acc):
    """One 128-column block of an FP8 weight's product, transposed: w [ROWS, 128] times FP8 activations aq [128,
    BLOCK_M], scaled by the weight rows' block scales s_w [ROWS] and the activation rows' scales a_s [BLOCK_M]. Hopper
    runs FP8 wgmma for this shape; weight-only, Triton converts the FP8 weights for a bf16 mma.sync
    (benchmarks/fp8_ptx.py)."""
    return acc + tl.dot(w, aq) * (s_w[:, None] * a_s[None, :])


@triton.jit
def _w8a8t_step(a, w, s_w, acc):
    """`_w8a8t_product` of the activations a [128, BLOCK_M] quantized here (W8A8, per row and 128 columns)."""
    aq, a_s = _quantize_columns(a)
    return _w8a8t_product(aq, a_s, w, s_w, acc)


@triton.jit
def _up_kernel(x_ptr, w_ptr, b_ptr, pairs_ptr, block_expert_ptr, act_ptr, ws_ptr, P, TOPK, I, H,
               stride_x, stride_we, stride_wn, stride_be, stride_a, stride_wse, stride_wsn, stride_wsk, alpha, limit,
               xs_ptr, stride_xs,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
               HAS_BIAS: tl.constexpr, PREC: tl.constexpr, W_FP8: tl.constexpr, W_ROWS: tl.constexpr,
               PDL: tl.constexpr, W8A8T: tl.constexpr, X_Q: tl.constexpr):
    pdl.begin(PDL)
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    m = tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + m)
    ok = pair < P
    tok = tl.where(ok, pair // TOPK, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    if W8A8T:
        # FP8 weights, the product transposed (`_w8a8t_step`: weight rows on the tensor cores' wide side), gate's and
        # up's BLOCK_N rows stacked in one tile [2 * BLOCK_N, BLOCK_K]: one product a K step, not two each waited for
        r = tl.arange(0, 2 * BLOCK_N)
        col = tl.program_id(1) * BLOCK_N + r % BLOCK_N
        gu = (r // BLOCK_N) * I + col                          # rows of gate_up: gate's, then up's
        gu_ok = col < I
        s_gu = ws_ptr + e64 * stride_wse + (gu // W_ROWS) * stride_wsn
        xp = x_ptr + tok[None, :] * stride_x + k[:, None]       # x [BLOCK_K, BLOCK_M]
        wp = w_ptr + e64 * stride_we + gu[:, None] * stride_wn + k[None, :]
        acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            # the block's weight scales, loaded before its tiles: their latency overlaps the wait for the tiles
            s = tl.load(s_gu + (k0 // 128) * stride_wsk, mask=gu_ok, other=0.0)
            a = tl.load(xp, mask=ok[None, :] & (k0 + k[:, None] < H), other=0.0)
            w = tl.load(wp, mask=gu_ok[:, None] & (k0 + k[None, :] < H), other=0.0)
            if X_Q:     # x quantized before (fp8_kernels.FP8Activation): its rows' scales for this group
                acc = _w8a8t_product(a, tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=ok, other=0.0), w, s, acc)
            else:
                acc = _w8a8t_step(a, w, s, acc)
            xp += BLOCK_K
            wp += BLOCK_K
        # [2 * BLOCK_N, BLOCK_M] -> gate's and up's [BLOCK_M, BLOCK_N]
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(tl.trans(acc), [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    else:
        # x [BLOCK_M, BLOCK_K], gate's and up's tiles w [BLOCK_K, BLOCK_N]; FP8 weights (W_FP8, weight-only): their
        # rows' block scales, one per 128 columns (BLOCK_K divides 128)
        sg = ws_ptr + e64 * stride_wse + (n // W_ROWS) * stride_wsn
        su = ws_ptr + e64 * stride_wse + ((I + n) // W_ROWS) * stride_wsn
        xp = x_ptr + tok[:, None] * stride_x + k[None, :]
        wg = w_ptr + e64 * stride_we + n[None, :] * stride_wn + k[:, None]               # gate's rows
        wu = wg + I * stride_wn                                                           # ... and up's
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = tl.load(xp, mask=ok[:, None] & (k0 + k[None, :] < H), other=0.0)
            g = tl.load(wg, mask=n_ok[None, :] & (k0 + k[:, None] < H), other=0.0)
            u = tl.load(wu, mask=n_ok[None, :] & (k0 + k[:, None] < H), other=0.0)
            if W_FP8:   # weight-only FP8: exact fp8 -> bf16/fp16 values, the block's scale on the partial product
                kb = k0 // 128
                acc_g += tl.dot(a, g.to(a.dtype)) * tl.load(sg + kb * stride_wsk, mask=n_ok, other=0.0)[None, :]
                acc_u += tl.dot(a, u.to(a.dtype)) * tl.load(su + kb * stride_wsk, mask=n_ok, other=0.0)[None, :]
            else:
                acc_g = tl.dot(a, g, acc_g, input_precision=PREC)
                acc_u = tl.dot(a, u, acc_u, input_precision=PREC)
            xp += BLOCK_K
            wg += BLOCK_K
            wu += BLOCK_K
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * stride_be + I + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)           # the projections round to the activations' dtype, as in torch
    u = acc_u.to(dt).to(tl.float32)
    if ACT == 0:    # SiLU(gate) * up
        y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
    else:           # GPT-OSS: (clamp(up) + 1) * gate * sigmoid(alpha * gate), gate clamped above
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_a + n[None, :], y.to(dt), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, b_ptr, rw_ptr, pairs_ptr, block_expert_ptr, y_ptr, ws_ptr, P, H, I,
                 stride_a, stride_we, stride_wn, stride_be, stride_y, stride_wse, stride_wsn, stride_wsk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PREC: tl.constexpr, ROUND_W: tl.constexpr, W_FP8: tl.constexpr, W_ROWS: tl.constexpr,
                 PDL: tl.constexpr, W8A8T: tl.constexpr):
    pdl.begin(PDL)
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    m = tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + m)
    ok = pair < P
    row = tl.where(ok, pair, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    k = tl.arange(0, BLOCK_K)
    sp = ws_ptr + e.to(tl.int64) * stride_wse + (n // W_ROWS) * stride_wsn
    if W8A8T:      # the product transposed (`_w8a8t_step`): a [BLOCK_K, BLOCK_M], w [BLOCK_N, BLOCK_K]
        a_rows, a_k, a_ok = row[None, :], k[:, None], ok[None, :]
        w_rows, w_k, w_ok = n[:, None], k[None, :], n_ok[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        a_rows, a_k, a_ok = row[:, None], k[None, :], ok[:, None]
        w_rows, w_k, w_ok = n[None, :], k[:, None], n_ok[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ap = a_ptr + a_rows * stride_a + a_k
    wp = w_ptr + e.to(tl.int64) * stride_we + w_rows * stride_wn + w_k
    for k0 in range(0, I, BLOCK_K):
        if W_FP8:          # the block's weight scales, loaded before its tiles (as _up_kernel's)
            s_w = tl.load(sp + (k0 // 128) * stride_wsk, mask=n_ok, other=0.0)
        a = tl.load(ap, mask=a_ok & (k0 + a_k < I), other=0.0)
        w = tl.load(wp, mask=w_ok & (k0 + w_k < I), other=0.0)
        if W8A8T:
            acc = _w8a8t_step(a, w, s_w, acc)
        elif W_FP8:
            acc += tl.dot(a, w.to(a.dtype)) * s_w[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PREC)
        ap += BLOCK_K
        wp += BLOCK_K
    if W8A8T:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + row, mask=ok, other=0.0).to(tl.float32)
    if ROUND_W:                  # Qwen3-MoE rounds the routing weights to the activations' dtype
        rw = rw.to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * rw[:, None]          # the expert's output (rounded) times its weight
    tl.store(y_ptr + row[:, None] * stride_y + n[None, :], y.to(dt), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _pairs_sum(y_ptr, idx_ptr, t, c, ok, TOPK, E, stride_y, K_BLOCK: tl.constexpr):
    """Token t's sum over its held pairs' rows of y at columns c, in float32."""
    # the token's top_k rows in one load (a loop of dependent loads waits on memory top_k times)
    j = tl.arange(0, K_BLOCK)
    p = t * TOPK + j
    e = tl.load(idx_ptr + p, mask=j < TOPK, other=-1)
    held = (j < TOPK) & (e >= 0) & (e < E)
    y = tl.load(y_ptr + p.to(tl.int64)[:, None] * stride_y + c[None, :], mask=held[:, None] & ok[None, :], other=0.0)
    return tl.sum(y.to(tl.float32), 0)


@triton.jit
def _sum_kernel(y_ptr, idx_ptr, out_ptr, TOPK, H, E, stride_y, stride_o, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    s = _pairs_sum(y_ptr, idx_ptr, t, c, ok, TOPK, E, stride_y, K_BLOCK)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + c, s.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_add_norm_kernel(y_ptr, idx_ptr, res_ptr, w_ptr, out_ptr, s_ptr, TOPK, H, E, stride_y, stride_r, stride_o,
                         stride_s, eps, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr,
                         QUANT: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    # `_sum_kernel` then triton_kernels' `_rms_norm_kernel` with a residual, step for step, one program a token: the
    # sum rounded to y's dtype as `_sum_kernel` stores it, the same residual add and norm (shared steps), quantized
    # for an FP8 linear as `_rms_norm_kernel` quantizes it (QUANT)
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < H
    x = _pairs_sum(y_ptr, idx_ptr, t, c, ok, TOPK, E, stride_y, K_BLOCK).to(y_ptr.dtype.element_ty)
    x = _add_residual(x, res_ptr + t.to(tl.int64) * stride_r, c, ok)
    if QUANT:
        store_quantized(_normed(x, w_ptr, res_ptr, c, ok, H, eps), out_ptr + t.to(tl.int64) * stride_o,
                        s_ptr + t.to(tl.int64) * stride_s, 0, H, BLOCK)
    elif NORM:
        _norm_row(x, w_ptr, out_ptr + t.to(tl.int64) * stride_o, c, ok, H, eps)


# Tiles by average pairs per expert. Decode sizes chosen by sweeping on an H200 (benchmarks/moe_kernel.py, the
# Qwen3-30B-A3B and DeepSeek-V3 layers at 1-256 tokens): BLOCK_M 16 with thin column blocks keeps enough programs in
# flight to stream the chosen experts' weights at 85-95 % of the copy bandwidth from 16 tokens on, and within 10 % of
# the best tile at 1 token; matrix-vector kernels (one program per pair, no grouping) lost at 1 token. Prompt chunks
# (hundreds of pairs per expert) are bound by compute: taller blocks. FP8 weights (a tile holds half a bf16 tile's
# bytes; `moe_kernel.py --fp8 --sweep`, Qwen3-30B-A3B, µs for the routed experts by 3 / 4 / 6 / 8 stages): one
# token's pairs stream best 8 deep (36.9 / 37.5 / 32.3 / 30.9), four tokens' 3 deep (67.0 / - / 76.2 / 87.4), and
# at 16 tokens 3 and 4 are equal (144.4 / 143.5 / 159.6 / 194.0).
def block_m(P: int, E: int) -> int:
    return 16 if P / max(E, 1) <= 32 else 64


def tiles(P: int, E: int, I: int, H: int, dtype: torch.dtype, fp8: bool = False) -> dict:
    per_expert = P / max(E, 1)
    if block_m(P, E) == 16:
        t = dict(BLOCK_M=16, UP_N=32 if per_expert <= 8 else 64, DOWN_N=64, BLOCK_K=128, warps=4,
                 stages=(8 if P <= 8 else 3) if fp8 else 4)
    else:
        t = dict(BLOCK_M=64, UP_N=64, DOWN_N=128, BLOCK_K=64, warps=8, stages=3)
    if dtype == torch.float32:       # a float32 tile holds twice the bytes: halve K (shared memory)
        t.update(BLOCK_K=32, stages=2)
    elif fp8 and EXPERTS_W8A8T and t["BLOCK_M"] == 16:
        # W8A8, transposed (`_w8a8t_step`): 64 weight rows a program (the tensor cores' 64-row side), whole
        # 128-column groups a K step (the activations are quantized by group)
        t.update(UP_N=64, DOWN_N=64, stages=4, W8A8T=True)
    return t


# FP8 experts of few pairs an expert (16-row blocks, bf16 / fp16 activations): W8A8 with the product transposed
# (`tiles`' W8A8T) instead of weight-only FP8, whose FP8 weights Triton converts for a bf16 mma.sync there. Session 36
# on an H200 (benchmarks/moe_kernel.py --shapes qwen3_30b_a3b --tokens 1 --fp8 --sweep): one token's 8 experts in
# 26.7 µs against 31.3 (4 stages; 27.6 with 3, 30.5 with 8); the Qwen3-30B-A3B shape (8 layers) 1.01-1.02x -> 1.05-1.06x
# bf16 at batch 1 (benchmarks/fp8.py "-noexpertsw8a8t" rows). Session 37: gate's and up's rows stacked in one tile
# (one product and one wait a K step, not two), each block's weight scales loaded before its tiles: 28.0 -> 25.3-26.7
# µs (the same command, the code before and after in one call); 32 columns a program (a 64-row tile, twice the
# programs) 28.4, the scales loaded a K block ahead 25.4 (neither kept).
EXPERTS_W8A8T = True
# The W8A8 transposed gate/up kernel reads x quantized by the RMSNorm before the experts (which writes it both ways:
# the router reads it plain) instead of quantizing each [128, BLOCK_M] tile in its K loop, once a program (a row
# reduction and a layout change in every K step). Session 39 (benchmarks/moe_kernel.py --fp8 --sweep --sweep-set
# xq, H200, Qwen3-30B-A3B, x quantized outside the graph; three calls): one token's experts 26.5 / 27.0 / 27.2 ->
# 23.7 / 26.3 / 24.3 µs, four tokens' 59.4 / 60.8 / 59.4 -> 51.2 / 52.8 / 53.0; the Qwen3-30B-A3B shape (8 layers) in
# FP8 at batch 1, 1.06-1.07x -> 1.10-1.11x bf16 (benchmarks/fp8.py's -noexpertsxq rows). Not kept: gate/up's K split
# over 2 or 4 programs a tile, the tile's last program adding the partial sums (commit a9e9d38: 26.5 -> 28.1 / 31.2 µs
# for one token; end to end 1.11x either way with x quantized before); two K blocks a step (Triton waits for each
# product before issuing the next); gate/up starting its expert's down weights on their way into L2 for the down
# kernel (commit fcb2028: 1.11x -> 1.07x end to end); 32 columns a program with x quantized before (commit a907d28:
# 24.0 / 23.2 µs at 4 / 6 stages against 23.5, end to end 1.11x against 1.10x).
EXPERTS_X_Q = True


def takes_quantized(P: int, E: int, I: int, H: int, dtype: torch.dtype) -> bool:
    """Whether `routed_pairs` on FP8 experts at P pairs over E held experts reads x quantized before (`x_q`), for
    the norm before it to write: W8A8 transposed tiles, whole 128-column groups (H a multiple of 128)."""
    return EXPERTS_X_Q and H % 128 == 0 and bool(tiles(P, E, I, H, dtype, fp8=True).get("W8A8T"))


def routed_pairs(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, act: str = "silu", alpha: float = 1.702,
                 limit: float = 7.0, round_weights: bool = False, tile: dict | None = None,
                 x_q: FP8Activation | None = None) -> torch.Tensor:
    """Each token-expert pair's weight * expert(x), y [N * top_k, hidden] by pair (pair p is token p // top_k; the
    rows of pairs held elsewhere are not written: `sum_pairs` skips them). x [N, hidden]; weights [N, top_k] float32
    (`round_weights`: rounded to x's dtype first, as Qwen3-MoE does); experts [N, top_k] indices into the held
    experts (outside [0, E'): held elsewhere, skipped); gate_up [E', 2I, hidden] (gate rows, then up rows), down
    [E', hidden, I]; optional biases [E', 2I], [E', hidden]; act "silu" (SiLU-and-mul) or "swiglu_oai" (GPT-OSS's
    clamped SwiGLU with alpha and limit). gate_up and down may be FP8 (models/quant.FP8Weight: float8 weights with
    their 128-column block scales, read as weight-only FP8: the activations stay in x's dtype; or, with the tile's
    W8A8T, W8A8: the activations quantized per row and 128 columns inside the kernels; `x_q`, x quantized before as
    an FP8Activation without sums of squares, saves the gate/up kernel that)."""
    fp8 = not isinstance(gate_up, torch.Tensor)
    if fp8:
        gu_s, gu_rows, gate_up = gate_up.scale, gate_up.rows, gate_up.weight
        d_s, d_rows, down = down.scale, down.rows, down.weight
    else:
        gu_s = d_s = x
        gu_rows = d_rows = 1
    N, H = x.shape
    K = experts.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    P = N * K
    dev = x.device
    y = torch.empty((P, H), dtype=x.dtype, device=dev)
    if N == 0:
        return y
    x = x.contiguous()
    idx = experts.contiguous().view(-1)
    rw = weights.contiguous().view(-1)
    t = tile or tiles(P, E, I, H, x.dtype, fp8)
    act_out = torch.empty((P, I), dtype=x.dtype, device=dev)
    gub = gate_up_bias if gate_up_bias is not None else gate_up
    db = down_bias if down_bias is not None else down
    gub_stride = gate_up_bias.stride(0) if gate_up_bias is not None else 0
    db_stride = down_bias.stride(0) if down_bias is not None else 0
    ACT = 0 if act == "silu" else 1
    BM = t["BLOCK_M"]
    max_blocks = align_shape(P, E, BM)
    pairs, block_expert = align(idx, E, BM)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    gss = gu_s.stride() if fp8 else (0, 0, 0)
    # W8A8 transposed: FP8 weights, whole 128-column groups a K step (the down kernel's K block is I's where I < 128)
    w8a8t = bool(t.get("W8A8T")) and fp8 and t["BLOCK_K"] == 128
    launch = pdl.expert_options(dev)
    use_q = w8a8t and x_q is not None and x_q.sumsq is None     # W8A8 transposed only: x quantized before
    xin, xs = (x_q.q, x_q.scale) if use_q else (x, act_out)
    _up_kernel[(max_blocks, triton.cdiv(I, t["UP_N"]))](
        xin, gate_up, gub, pairs, block_expert, act_out, gu_s, P, K, I, H,
        xin.stride(0), gate_up.stride(0), gate_up.stride(1), gub_stride, act_out.stride(0), *gss, float(alpha),
        float(limit), xs, xs.stride(0), BLOCK_M=BM, BLOCK_N=t["UP_N"], BLOCK_K=t["BLOCK_K"], ACT=ACT,
        HAS_BIAS=gate_up_bias is not None, PREC=prec, W_FP8=fp8, W_ROWS=gu_rows, W8A8T=w8a8t, X_Q=use_q,
        num_warps=t["warps"], num_stages=t["stages"], **launch)
    dss = d_s.stride() if fp8 else (0, 0, 0)
    _down_kernel[(max_blocks, triton.cdiv(H, t["DOWN_N"]))](
        act_out, down, db, rw, pairs, block_expert, y, d_s, P, H, I,
        act_out.stride(0), down.stride(0), down.stride(1), db_stride, y.stride(0), *dss,
        BLOCK_M=BM, BLOCK_N=t["DOWN_N"], BLOCK_K=min(t["BLOCK_K"], _pow2(I)), HAS_BIAS=down_bias is not None,
        PREC=prec, ROUND_W=round_weights, W_FP8=fp8, W_ROWS=d_rows, W8A8T=w8a8t, num_warps=t["warps"],
        num_stages=t["stages"], **launch)
    return y


def sum_pairs(y: torch.Tensor, experts: torch.Tensor, E: int) -> torch.Tensor:
    """Each token's sum over its held pairs (experts [N, top_k] in [0, E)) of `routed_pairs`' y: [N, hidden]."""
    N, K = experts.shape
    H = y.shape[1]
    out = torch.empty((N, H), dtype=y.dtype, device=y.device)
    if N:
        BLOCK = min(_pow2(H), 4096 // _pow2(K), 1024)
        _sum_kernel[(N, triton.cdiv(H, BLOCK))](y, experts.contiguous().view(-1), out, K, H, E, y.stride(0),
                                                out.stride(0), K_BLOCK=_pow2(K), BLOCK=BLOCK, num_warps=4,
                                                **pdl.options(y.device))
    return out


def sum_add_rms_norm(y: torch.Tensor, experts: torch.Tensor, E: int, residual: torch.Tensor,
                     weight: torch.Tensor | None, eps: float, quantize: bool = False):
    """`sum_pairs` joined to the residual stream in one kernel: residual [N, hidden] += each token's sum (in place),
    then the new residual's RMSNorm with `weight` (None: no norm, returns None); the numbers of `sum_pairs` then
    triton_kernels.rms_norm(sum, weight, eps, residual, quantize). `quantize` (with a weight, hidden a multiple of
    128): the norm returned quantized for an FP8 linear (fp8_kernels.FP8Activation), as rms_norm's."""
    N, K = experts.shape
    H = residual.shape[1]
    quantize = quantize and weight is not None
    if quantize:
        out, scales = quantized_rows(N, H, y.device)
    else:
        out = torch.empty((N, H), dtype=y.dtype, device=y.device) if weight is not None else None
        scales = residual
    if N:
        o = out if out is not None else residual
        _sum_add_norm_kernel[(N,)](y, experts.contiguous().view(-1), residual,
                                   weight if weight is not None else residual, o, scales, K, H, E, y.stride(0),
                                   residual.stride(0), o.stride(0), scales.stride(0), float(eps), K_BLOCK=_pow2(K),
                                   BLOCK=_pow2(H), NORM=weight is not None, QUANT=quantize, num_warps=norm_warps(H),
                                   **pdl.options(y.device))
    return FP8Activation(out, scales, residual.dtype) if quantize else out


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up, down,
                   **kw) -> torch.Tensor:
    """sum over each token's chosen experts of weight * expert(x): `routed_pairs` (its arguments), then
    `sum_pairs`."""
    return sum_pairs(routed_pairs(x, weights, experts, gate_up, down, **kw), experts, gate_up.shape[0])


# ---------------------------------------------------------------------------------------------
# routing: one program per token picks its experts and weights (a decode step's dozen tiny torch ops in one)

@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, idx_ptr, E, stride_l, TOPK: tl.constexpr, K_BLOCK: tl.constexpr,
                         E_BLOCK: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_BLOCK)
    ok = e < E
    logit = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, 0))
    prob = tl.where(ok, p / tl.sum(p, 0), -1.0)
    kk = tl.arange(0, K_BLOCK)
    wv = tl.zeros([K_BLOCK], dtype=tl.float32)
    iv = tl.zeros([K_BLOCK], dtype=tl.int32)
    for j in tl.static_range(TOPK):           # the k largest, largest first (the lowest index on a tie)
        best = tl.max(prob, 0)
        arg = tl.min(tl.where(prob == best, e, E_BLOCK), 0)
        wv = tl.where(kk == j, best, wv)
        iv = tl.where(kk == j, arg, iv)
        prob = tl.where(e == arg, -2.0, prob)
    if RENORM:
        wv = wv / tl.sum(wv, 0)
    tl.store(w_ptr + t * TOPK + kk, wv, mask=kk < TOPK)
    tl.store(idx_ptr + t * TOPK + kk, iv.to(tl.int64), mask=kk < TOPK)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits) in float32, its top k (renormalised): weights [N, k] float32, experts [N, k] int64."""
    N, E = logits.shape
    w = torch.empty((N, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((N, top_k), dtype=torch.int64, device=logits.device)
    if N:
        _softmax_topk_kernel[(N,)](logits, w, idx, E, logits.stride(0), TOPK=top_k, K_BLOCK=_pow2(top_k),
                                   E_BLOCK=_pow2(E), RENORM=renormalize, num_warps=4 if E >= 256 else 1,
                                   **pdl.options(logits.device))
    return w, idx


@triton.jit
def _grouped_sigmoid_topk_kernel(logits_ptr, bias_ptr, w_ptr, idx_ptr, stride_l, scaling,
                                 G: tl.constexpr, PG: tl.constexpr, G_BLOCK: tl.constexpr, PG_BLOCK: tl.constexpr,
                                 TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, K_BLOCK: tl.constexpr,
                                 RENORM: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_BLOCK)
    j = tl.arange(0, PG_BLOCK)
    e = g[:, None] * PG + j[None, :]                                  # [G_BLOCK, PG_BLOCK]: expert of each cell
    ok = (g[:, None] < G) & (j[None, :] < PG)
    score = tl.sigmoid(tl.load(logits_ptr + t * stride_l + e, mask=ok, other=0.0).to(tl.float32))
    choice = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    # a group's score: the sum of its two best choices
    first = tl.max(choice, 1)
    at = tl.min(tl.where(choice == first[:, None], j[None, :], PG_BLOCK), 1)
    second = tl.max(tl.where(j[None, :] == at[:, None], float("-inf"), choice), 1)
    gscore = tl.where(g < G, first + second, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(tl.where(keep, float("-inf"), gscore), 0)
        arg = tl.min(tl.where((gscore == best) & ~keep, g, G_BLOCK), 0)
        keep = keep | (g == arg)
    choice = tl.where(keep[:, None], choice, float("-inf"))
    kk = tl.arange(0, K_BLOCK)
    wv = tl.zeros([K_BLOCK], dtype=tl.float32)
    iv = tl.zeros([K_BLOCK], dtype=tl.int32)
    for i in tl.static_range(TOPK):
        best = tl.max(tl.max(choice, 1), 0)
        arg = tl.min(tl.min(tl.where(choice == best, e, G_BLOCK * PG_BLOCK), 1), 0)
        wv = tl.where(kk == i, tl.sum(tl.sum(tl.where((e == arg) & ok, score, 0.0), 1), 0), wv)
        iv = tl.where(kk == i, arg, iv)
        choice = tl.where(e == arg, float("-inf"), choice)
    if RENORM:
        wv = wv / (tl.sum(wv, 0) + 1e-20)
    tl.store(w_ptr + t * TOPK + kk, wv * scaling, mask=kk < TOPK)
    tl.store(idx_ptr + t * TOPK + kk, iv.to(tl.int64), mask=kk < TOPK)


def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, topk_group: int,
                         renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing from float32 logits [N, E] (models/deepseek_v3.SigmoidRouting, op for op): weights
    [N, k] float32, experts [N, k] int64."""
    N, E = logits.shape
    w = torch.empty((N, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((N, top_k), dtype=torch.int64, device=logits.device)
    if N:
        PG = E // groups
        _grouped_sigmoid_topk_kernel[(N,)](logits, bias, w, idx, logits.stride(0), float(scaling), G=groups, PG=PG,
                                           G_BLOCK=_pow2(groups), PG_BLOCK=_pow2(PG), TOPK_GROUP=topk_group,
                                           TOPK=top_k, K_BLOCK=_pow2(top_k), RENORM=renormalize,
                                           num_warps=4 if E >= 256 else 1, **pdl.options(logits.device))
    return w, idx


# ---------------------------------------------------------------------------------------------
# the router's logits for a few tokens. cuBLAS runs x @ router^T for a decode step as a GEMM of a few tiles that
# read the router at a fraction of the bandwidth; here one program per BLOCK_E experts reads their rows once for
# all N tokens.

# Every program also reads all N tokens' x (8 tokens of hidden 2048: 32 KB, 8 times its router row), which grows
# with N while the router does not. Measured on an H200 (benchmarks/moe_kernel.py --routing, one expert a program):
# Qwen3-30B-A3B's router 2.0 / 3.6 / 5.9 us at 1 / 8 / 16 tokens against cuBLAS's 4.9 / 5.3 / 5.0; DeepSeek-V3's
# 10.0 against 20.0 at 8 tokens, even at 16. More experts a program lost at every size.
ROUTER_MAX_TOKENS = 8


@triton.jit
def _router_kernel(x_ptr, w_ptr, out_ptr, N, E, H, stride_x, stride_w, stride_o, N_BLOCK: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.arange(0, N_BLOCK)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([N_BLOCK, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + k
        w = tl.load(w_ptr + e[:, None] * stride_w + kk[None, :], mask=(e[:, None] < E) & (kk[None, :] < H), other=0.0)
        a = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :], mask=(t[:, None] < N) & (kk[None, :] < H), other=0.0)
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    tl.store(out_ptr + t[:, None] * stride_o + e[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(t[:, None] < N) & (e[None, :] < E))


def router_logits(x: torch.Tensor, router: torch.Tensor, dtype: torch.dtype | None = None,
                  block_e: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """F.linear(x, router) for x [N, hidden] (models/moe.py takes it up to ROUTER_MAX_TOKENS tokens): float32
    products and sums, the logits [N, E] rounded to `dtype` (default x's, as F.linear returns them; DeepSeek:
    float32 from a float32 router, x read as x.float()). block_e experts per program, block_k columns per step
    (defaults by N)."""
    N, H = x.shape
    E = router.shape[0]
    assert router.stride(1) == 1, router.stride()
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((N, E), dtype=dtype or x.dtype, device=x.device)
    if N:
        nb = _pow2(N)
        be = block_e or 1
        bk = block_k or min(_pow2(H), max(64, 8192 // (nb * be)))    # the product tile: 64 floats a thread
        _router_kernel[(triton.cdiv(E, be),)](x, router, out, N, E, H, x.stride(0), router.stride(0), out.stride(0),
                                              N_BLOCK=nb, BLOCK_E=be, BLOCK_K=bk, num_warps=4,
                                              **pdl.options(x.device))
    return out
