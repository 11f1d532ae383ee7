"""A matrix-vector Triton kernel for decode projections, y [M, N] = x [M, K] @ W [N, K]^T at a few tokens (imported
only on CUDA; `ops.linear_one_row` runs it, benchmarks/gemv_decode.py times it against cuBLAS).

Design (the MoE router's `_router_kernel` in moe_kernels.py, grown to whole projections): no tensor cores and no
split-K. Each program owns BLOCK_N rows of W and loops over all of K in BLOCK_K chunks: it loads the
[BLOCK_N, BLOCK_K] tile of W once (16-byte vector loads along K), the [M_BLOCK, BLOCK_K] tile of x (tiny, from
L2), and adds the float32 products [M_BLOCK, BLOCK_N, BLOCK_K], summed along K every step, or (DEFER) kept per
lane and summed once after the loop. Rows past N and tokens past M read the last row / token (always in bounds)
and are not stored, so the loads carry no masks unless K is not a multiple of BLOCK_K. One kernel a call: N = 2048
at BLOCK_N = 4 is 512 programs (about four an SM on an H200), so a K split (an fp32 buffer to zero, atomics, a
cast: two more kernels a call, what cuBLAS's split-K reduce costs) is left out.

Where it runs (H200, bf16, CUDA graphs, benchmarks/gemv_decode.py): at one token it beats cuBLAS on attention
output projections (Qwen3-30B-A3B o [2048 x 4096]: 8.65 vs 9.64 µs; Llama-8B o [4096 x 4096]: 11.97 vs 13.48 µs),
ties on qkv and loses on gate_up, down and the LM head; from two tokens on it loses almost everywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_kernels import prefetch_bytes
from .triton_kernels import _pow2

# the largest weight (elements) measured faster than cuBLAS at one token: Llama-8B's o [4096 x 4096]; larger
# projections (Llama-8B's down, 4096 x 14336) reach cuBLAS's full bandwidth and lose
ONE_ROW_MAX_WEIGHT = 4096 * 4096


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, prefetch_bytes, M_BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DEFER: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, LANES: tl.constexpr, ELEMENT: tl.constexpr,
                 LATE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_BLOCK)
    k = tl.arange(0, BLOCK_K)
    # rows past N / tokens past M read the last one (in bounds) and are not stored: no masks on the loads
    rows = tl.minimum(n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + k[None, :]
    if not LATE:
        pdl.launch_next(PDL)
    if PREFETCH:        # the first bytes of this program's rows on their way to L2 while the kernel before runs
        pdl.prefetch_rows(w_ptr, tl.program_id(0) * BLOCK_N, N, stride_wn * ELEMENT, 0, prefetch_bytes, BLOCK_N, LANES)
    pdl.wait_previous(PDL)
    x_ptrs = x_ptr + tl.minimum(m, M - 1)[:, None] * stride_xm + k[None, :]
    if DEFER:
        acc = tl.zeros([M_BLOCK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([M_BLOCK, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            a = tl.load(x_ptrs + k0)
        else:
            in_k = (k0 + k)[None, :] < K
            w = tl.load(w_ptrs + k0, mask=in_k, other=0.0)
            a = tl.load(x_ptrs + k0, mask=in_k, other=0.0)
        p = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        if DEFER:
            acc += p
        else:
            acc += tl.sum(p, 2)
    if LATE:
        pdl.launch_next(PDL)
    if DEFER:
        y = tl.sum(acc, 2)
    else:
        y = acc
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def default_tile(M: int, N: int, K: int) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, DEFER): 4 rows a program (>= 512 programs from N = 2048 on), K
    chunks keeping the [M, 4, BLOCK_K] float32 product at 64 values a thread (4 warps), between 128 and 1024
    columns; summed every step, 3 stages."""
    bn = 4 if N >= 2048 else 1
    bk = min(max(8192 // (_pow2(M) * bn), 128), 1024, max(_pow2(K), 16))
    return (bn, bk, 4, 3, False)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, tile: tuple | None = None) -> torch.Tensor:
    """F.linear(x, w) for x [M, K] (M small), w [N, K] row-major, both bf16/fp16/fp32: float32 sums, y in x's
    dtype. tile = (BLOCK_N, BLOCK_K, num_warps, num_stages, DEFER), default `default_tile`."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.stride(1) == 1 and x.dtype == w.dtype, (x.shape, w.shape, w.stride(), x.dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    bn, bk, warps, stages, defer = tile or default_tile(M, N, K)
    launch = pdl.gemm_options(x.device)
    row_bytes = K * w.element_size()
    aligned = row_bytes % 16 == 0 and w.stride(0) * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0
    prefetch = prefetch_bytes(triton.cdiv(N, bn), bn, row_bytes) if launch["PDL"] and pdl.PREFETCH and aligned else 0
    _gemv_kernel[(triton.cdiv(N, bn),)](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), prefetch,
                                        M_BLOCK=_pow2(M), BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0,
                                        DEFER=defer, PREFETCH=prefetch > 0, LANES=32 * warps, ELEMENT=w.element_size(),
                                        num_warps=warps, num_stages=stages, **launch)
    return out
