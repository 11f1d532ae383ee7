"""W8A8 block-scaled FP8 linear layers on CUDA (compute capability >= 8.9; tuned on Hopper).

A weight W [N, K] is float8_e4m3fn with one float32 scale per block of `rows` x 128 (`rows` 128 as the
checkpoints store it, 1 once rows were reordered at load): W's real value is W_q * scale, block by block.
Activations are quantized dynamically, per token and 128-column group: x ~ x_q * x_scale, x_scale =
amax(group) / 448. Then y = sum over the K groups g of (x_q[:, g] @ W_q[:, g]^T) * x_scale[:, g] * w_scale[n, g]
(+ bias), accumulated in float32, written in the activations' dtype.

- `quantize_activations`: the per-token, per-group quantization (one kernel; the scales may be written
  column-major, the layout cuBLAS's block-scaled GEMM wants).
- `_gemm_kernel`: the block-scaled GEMM over float8 activations and their scales (A_MODE 0); A_MODE 1 reads
  bf16/fp16 activations and quantizes each [BLOCK_M, 128] tile itself (the same numbers as
  `quantize_activations`), A_MODE 2 uses them as they are (weight-only W8A16). Decode tiles are
  thin in N and split K over several programs when there are too few column blocks to fill the device;
  the partial sums go to a float32 workspace that the tile's last program to finish adds up in split order (a
  ticket counter per tile; `SPLITK_TICKETS`), or `_splitk_sum_kernel` (deterministic either way).
- `_gemv_kernel`: a few rows in one kernel without tensor cores, each program quantizing its row's activations
  itself (DECODE_MODE "gemv", measured, not the default).
- `fp8_linear(x, w, bias)`: decode sizes (M <= 64, and verification rows up to VERIFY_MAX_M) quantize the
  activations with `quantize_activations` (or take them quantized by the norm / activation kernel before,
  `FP8Activation`, `fused_quant_wanted`) and run the Triton GEMM (verification rows through a wide weight:
  cuBLAS's, `verify_on_cublas`); from `CUBLAS_FROM_M` rows cuBLAS's block-scaled GEMM through torch's scaled_mm
  (M padded to a multiple of 8), where this torch and GPU have it. benchmarks/fp8_gemm.py measures all of them
  (H200, CUDA graphs: the Triton GEMM 1.4-1.65x bf16 at M = 1 on the 8B's large projections, cuBLAS's fastest at
  2048 rows; quantizing inside the GEMM was slowest: a row reduction and a layout change in every K step).
Every size is fixed by the shapes and nothing reads device memory on the host: a CUDA graph holds them. The
quantization and split-K sum kernels launch with programmatic dependent launch on Hopper (pdl.py); the GEMM plainly
unless pdl.GEMM_TRIGGER says otherwise.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl

GROUP = 128                     # activation group and weight block width along K
# in the kernels: 448 is float8_e4m3fn's largest finite value; an all-zero group gets scale 1e-12 (its values
# quantize to 0 either way)


@triton.jit
def quantize_groups(x):
    """x [groups, 128] float32 -> (values [groups, 128] float32 within +-448, to be cast to float8_e4m3fn; scales
    [groups]): the numbers of every activation quantization here (`_quant_kernel`, the norm and activation
    kernels' quantized outputs in triton_kernels.py)."""
    s = tl.maximum(tl.max(tl.abs(x), 1) / 448.0, 1e-12)
    return tl.clamp(x / s[:, None], -448.0, 448.0), s


@triton.jit
def store_quantized(y, q_ptr, s_ptr, c0, K, BLOCK: tl.constexpr):
    """One row's activations y [BLOCK] (columns c0 .. c0 + BLOCK of K, c0 and BLOCK multiples of 128, as rounded to
    the activation dtype) stored quantized as `quantize_activations` stores them: float8 values at q_ptr + column,
    float32 scales at s_ptr + group (q_ptr, s_ptr: the row's starts; scales contiguous along the row)."""
    G: tl.constexpr = BLOCK // 128
    q, s = quantize_groups(tl.reshape(y.to(tl.float32), [G, 128]))
    g = c0 // 128 + tl.arange(0, G)
    col = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + col, q.to(q_ptr.dtype.element_ty), mask=col < K)
    tl.store(s_ptr + g, s, mask=g * 128 < K)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_sm, stride_sg,
                  GROUP_SIZE: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP_SIZE)
    col = g[:, None] * GROUP_SIZE + c[None, :]
    ok = col < K
    x = tl.load(x_ptr + m * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    q, s = quantize_groups(x)
    tl.store(q_ptr + m * stride_q + col, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, s, mask=g * GROUP_SIZE < K)


def quantize_activations(x: torch.Tensor, column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K / 128)] float32), x ~ x_q * scale per group.
    `column_major_scales`: the scales' memory is [groups, M] (stride (1, M)), as torch's scaled_mm wants."""
    M, K = x.shape
    G = triton.cdiv(K, GROUP)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = (torch.empty((G, M), dtype=torch.float32, device=x.device).t() if column_major_scales
         else activation_scales(M, K, x.device))
    if M:
        per = min(8, triton.next_power_of_2(G))
        _quant_kernel[(M, triton.cdiv(G, per))](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                                GROUP_SIZE=GROUP, GROUPS=per, num_warps=4,
                                                **pdl.options(x.device))
    return q, s


def activation_scales(M: int, K: int, device) -> torch.Tensor:
    """An empty [M, ceil(K / 128)] float32 scale table, row-major (quantize_activations' and the fused kernels')."""
    return torch.empty((M, triton.cdiv(K, GROUP)), dtype=torch.float32, device=device)


def quantized_rows(M: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty float8 values [M, K] and their scale table, for a kernel that writes its output quantized for an FP8
    linear (K a multiple of 128: whole groups)."""
    assert K % GROUP == 0, K
    return torch.empty((M, K), dtype=torch.float8_e4m3fn, device=device), activation_scales(M, K, device)


class FP8Activation(NamedTuple):
    """Activations already quantized for an FP8 linear (`quantize_activations`' numbers, written by the kernel that
    produced them: RMSNorm, silu_and_mul): q [M, K] float8_e4m3fn, scale [M, ceil(K / 128)] float32 (row-major),
    dtype: the activations' dtype, which the linear's output takes. With `sumsq` (an RMSNorm's input, written by the
    GEMM before it: `fp8_linear_add_norm`): q * scale is the norm's weight times the residual stream, sumsq [M, T]
    the partial sums of the stream's squares (T column blocks), and each row's 1 / rms, rsqrt(sum / K + eps), still
    to be applied: the GEMM reading it does that to its output rows. With `plain` (an RMSNorm's output written both
    ways, triton_kernels.rms_norm's "both"): the values unquantized, for a sparse MLP whose router reads them and
    whose FP8 routed experts read q."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    sumsq: torch.Tensor | None = None
    eps: float = 0.0
    plain: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """q * scale per group in `dtype` (a fallback for a consumer that is not an FP8 linear)."""
        M, K = self.q.shape
        x = self.q.float() * self.scale.repeat_interleave(GROUP, 1)[:, :K]
        if self.sumsq is not None:
            x = x * torch.rsqrt(self.sumsq.sum(1, keepdim=True) / K + self.eps)
        return x.to(self.dtype)


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, y_ptr, tickets_ptr, M, N, K, k_blocks_per_split,
                 n_splits, stride_am, stride_asm, stride_asg, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm,
                 stride_ym, prefetch_bytes, ss_ptr, stride_ss, ss_count, eps, res_ptr, stride_res, nw_ptr, qo_ptr,
                 stride_qo, so_ptr, stride_so,
                 B_ROWS: tl.constexpr, A_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, TICKET: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr, LANES: tl.constexpr, LATE: tl.constexpr, SWAP: tl.constexpr,
                 AHEAD: tl.constexpr, RSTD: tl.constexpr, SS_PAD: tl.constexpr, ADD_NORM: tl.constexpr):
    # program -> (row block, column block), grouped so that GROUP_M row blocks share the weights in L2.
    # SWAP: the product is computed transposed, weight tile [BLOCK_N, BLOCK_K] times activations [BLOCK_K, BLOCK_M],
    # so that the weight's columns fill the tensor cores' 64-row side and few activation rows their narrow side
    # (Hopper's wgmma wants 64 rows a warp group; without the swap a few rows pad a 16- or 64-row block).
    # AHEAD: each K block's scales are loaded one block ahead. Loaded in their own block they are plain global loads
    # that Triton issues after the block's tiles have arrived and the product waits on them (benchmarks/fp8_ptx.py).
    # RSTD: the activations are an RMSNorm's weight times its input (FP8Activation's sumsq): each output row is
    # multiplied by the row's 1 / rms from the ss_count partial sums of squares at ss_ptr (loaded before the main
    # loop, used after it). ADD_NORM (BLOCK_N 128, not SWAP-only): the output joins the residual stream at res_ptr
    # (in place, rounded as `residual + y` in its dtype) and is not stored; the stream's norm weight times it goes to
    # qo_ptr / so_ptr quantized (one 128-column group a column block) and its squares' sum to ss_ptr column pid_n:
    # the next FP8 linear's RSTD input (`fp8_linear_add_norm`). ADD_NORM 2: the tile's residual and norm weight are
    # loaded before the main loop (ADD_NORM_EARLY), not in the last step.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < N
    kb0 = split * k_blocks_per_split
    # each tile's rows, columns (K) and valid rows in its orientation
    if SWAP:             # a [BLOCK_K, BLOCK_M], b [BLOCK_N, BLOCK_K]
        a_rows, a_k, a_ok = m.to(tl.int64)[None, :], k[:, None], m_ok[None, :]
        b_rows, b_k, b_ok = n.to(tl.int64)[:, None], k[None, :], n_ok[:, None]
    else:                # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N]
        a_rows, a_k, a_ok = m.to(tl.int64)[:, None], k[None, :], m_ok[:, None]
        b_rows, b_k, b_ok = n.to(tl.int64)[None, :], k[:, None], n_ok[None, :]
    a_ptrs = a_ptr + a_rows * stride_am + kb0 * BLOCK_K + a_k
    b_ptrs = b_ptr + b_rows * stride_bn + kb0 * BLOCK_K + b_k
    bs_ptrs = bs_ptr + (n // B_ROWS) * stride_bsn
    if not LATE:
        pdl.launch_next(PDL)
    if PREFETCH:        # this program's first weight bytes on their way to L2 while the kernel before still runs
        pdl.prefetch_rows(b_ptr, pid_n * BLOCK_N, N, stride_bn, kb0 * BLOCK_K,
                          tl.minimum(prefetch_bytes, K - kb0 * BLOCK_K), BLOCK_N, LANES)
    pdl.wait_previous(PDL)
    if RSTD:            # issued now, waited for after the main loop
        t = tl.arange(0, SS_PAD)
        ss = tl.load(ss_ptr + m[:, None] * stride_ss + t[None, :], mask=m_ok[:, None] & (t[None, :] < ss_count),
                     other=0.0)
    if ADD_NORM == 2:   # likewise (every program: which one finishes the tile is known only at the end)
        res_early = tl.load(res_ptr + m.to(tl.int64)[:, None] * stride_res + n[None, :],
                            mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        nw_early = tl.load(nw_ptr + n, mask=n_ok, other=0.0)
    else:
        res_early = 0.0
        nw_early = 0.0
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kb_end = tl.minimum(kb0 + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    if AHEAD:
        b_s_next = tl.load(bs_ptrs + kb0 * stride_bsk, mask=n_ok, other=0.0)
        if A_MODE == 0:
            a_s_next = tl.load(as_ptr + m * stride_asm + kb0 * stride_asg, mask=m_ok, other=0.0)
    for kb in range(kb0, kb_end):
        if AHEAD:           # this block's scales, loaded in the block before; the next block's on their way (the
            kb_next = tl.minimum(kb + 1, kb_end - 1)        # last block loads its own again: no load past the end)
            b_s = b_s_next
            b_s_next = tl.load(bs_ptrs + kb_next * stride_bsk, mask=n_ok, other=0.0)
            if A_MODE == 0:
                a_s_ahead = a_s_next
                a_s_next = tl.load(as_ptr + m * stride_asm + kb_next * stride_asg, mask=m_ok, other=0.0)
        else:
            b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_ok, other=0.0)
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_ok, other=0.0)
            b = tl.load(b_ptrs, mask=b_ok, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_ok & (kb * BLOCK_K + a_k < K), other=0.0)
            b = tl.load(b_ptrs, mask=b_ok & (kb * BLOCK_K + b_k < K), other=0.0)
        if A_MODE == 2:    # weight-only: bf16/fp16 activations, the weights' exact fp8 values in that dtype
            if SWAP:
                acc += tl.dot(b.to(a.dtype), a) * b_s[:, None]
            else:
                acc += tl.dot(a, b.to(a.dtype)) * b_s[None, :]
        else:
            if A_MODE == 1:    # this tile's per-row group scales and fp8 values, as _quant_kernel computes them
                af = a.to(tl.float32)
                if SWAP:
                    a_s = tl.maximum(tl.max(tl.abs(af), 0) / 448.0, 1e-12)
                    a = tl.clamp(af / a_s[None, :], -448.0, 448.0).to(b_ptr.dtype.element_ty)
                else:
                    a_s = tl.maximum(tl.max(tl.abs(af), 1) / 448.0, 1e-12)
                    a = tl.clamp(af / a_s[:, None], -448.0, 448.0).to(b_ptr.dtype.element_ty)
            elif AHEAD:
                a_s = a_s_ahead
            else:
                a_s = tl.load(as_ptr + m * stride_asm + kb * stride_asg, mask=m_ok, other=0.0)
            if SWAP:
                acc += tl.dot(b, a) * (b_s[:, None] * a_s[None, :])
            else:
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if LATE:
        pdl.launch_next(PDL)
    if SWAP:
        acc = tl.trans(acc)
    if RSTD:            # the norm's 1 / rms of each row (its partial sums in a fixed order: deterministic)
        acc = acc * tl.rsqrt(tl.sum(ss, 1) / K + eps)[:, None]
    ok = m_ok[:, None] & n_ok[None, :]
    out = c_ptr + split * stride_cs + m.to(tl.int64)[:, None] * stride_cm + n[None, :]
    if SPLIT:            # float32 partial sums; _splitk_sum_kernel adds the bias and casts, or (TICKET) the tile's last
        tl.store(out, acc, mask=ok)
        if TICKET:       # program to finish does: one launch less a GEMM
            tl.debug_barrier()          # every thread's partial sums are stored before the ticket is taken
            ticket = tl.atomic_add(tickets_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                ws = c_ptr + m.to(tl.int64)[:, None] * stride_cm + n[None, :]
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, n_splits):         # in split order: the sum kernel's numbers
                    total += tl.load(ws + s * stride_cs, mask=ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                if ADD_NORM:
                    _add_norm_out(total.to(y_ptr.dtype.element_ty), m, n, m_ok, n_ok, pid_n, res_ptr, stride_res,
                                  nw_ptr, qo_ptr, stride_qo, so_ptr, stride_so, ss_ptr, stride_ss, res_early,
                                  nw_early, ADD_NORM == 2)
                else:
                    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :],
                             total.to(y_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(tickets_ptr + pid, 0)     # ready for the next launch (a graph's next replay)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ADD_NORM:
            _add_norm_out(acc.to(c_ptr.dtype.element_ty), m, n, m_ok, n_ok, pid_n, res_ptr, stride_res, nw_ptr,
                          qo_ptr, stride_qo, so_ptr, stride_so, ss_ptr, stride_ss, res_early, nw_early, ADD_NORM == 2)
        else:
            tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_norm_out(y, m, n, m_ok, n_ok, pid_n, res_ptr, stride_res, nw_ptr, qo_ptr, stride_qo, so_ptr, stride_so,
                  ss_ptr, stride_ss, res_early, nw_early, EARLY: tl.constexpr):
    """A GEMM tile's output y [BLOCK_M, 128] (in the activations' dtype) joins the residual stream (in place, the
    numbers of `residual + y`); the stream's squares summed over the tile's columns go to ss_ptr [row, pid_n], and the
    norm weight's product with it, quantized (one 128-column group), to qo_ptr / so_ptr [row, pid_n]: an RMSNorm's
    output but for each row's 1 / rms, which the GEMM reading it applies (RSTD). EARLY: the tile's residual and the
    norm weight were loaded already (res_early, nw_early)."""
    rows = m.to(tl.int64)[:, None]
    ok = m_ok[:, None] & n_ok[None, :]
    res = res_ptr + rows * stride_res + n[None, :]
    if EARLY:
        r_old = res_early
        w = nw_early.to(tl.float32)
    else:
        r_old = tl.load(res, mask=ok, other=0.0)
        w = tl.load(nw_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    r = (r_old.to(tl.float32) + y.to(tl.float32)).to(y.dtype)
    tl.store(res, r, mask=ok)
    rf = r.to(tl.float32)
    tl.store(ss_ptr + m * stride_ss + pid_n, tl.sum(rf * rf, 1), mask=m_ok)
    q, s = quantize_groups((rf * w[None, :]).to(y.dtype).to(tl.float32))
    tl.store(qo_ptr + rows * stride_qo + n[None, :], q.to(qo_ptr.dtype.element_ty), mask=ok)
    tl.store(so_ptr + m * stride_so + pid_n, s, mask=m_ok)


@triton.jit
def _splitk_sum_kernel(ws_ptr, bias_ptr, c_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_wsk,
                 stride_ym, W_ROWS: tl.constexpr, QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    # one program: output row m, BLOCK_N columns, over all of K, GROUPS 128-column groups a step. The row's
    # activations are quantized per group here (the same numbers as _quant_kernel) and dequantized at once, the
    # weights dequantized by their block scale, and the products summed elementwise; one reduction at the end.
    pid = tl.program_id(0)
    m = (pid % M).to(tl.int64)            # consecutive programs: the same weight columns, other rows (L2 reuse)
    n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    g = tl.arange(0, GROUPS)
    c = tl.arange(0, GROUP_SIZE)
    col = g[:, None] * GROUP_SIZE + c[None, :]                                  # [GROUPS, GROUP]
    w_ptrs = w_ptr + n.to(tl.int64)[:, None, None] * stride_wn + col[None, :, :]
    s_ptrs = ws_ptr + (n // W_ROWS).to(tl.int64)[:, None] * stride_wsn + g[None, :] * stride_wsk
    acc = tl.zeros([BLOCK_N, GROUPS, GROUP_SIZE], dtype=tl.float32)
    for k0 in range(0, K, GROUPS * GROUP_SIZE):
        k_ok = k0 + col < K
        x = tl.load(x_ptr + m * stride_xm + k0 + col, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT_X:
            sx = tl.maximum(tl.max(tl.abs(x), 1) / 448.0, 1e-12)
            x = tl.clamp(x / sx[:, None], -448.0, 448.0).to(w_ptr.dtype.element_ty).to(tl.float32) * sx[:, None]
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
        sw = tl.load(s_ptrs + (k0 // GROUP_SIZE) * stride_wsk, mask=n_ok[:, None] & (k0 + g * GROUP_SIZE < K)[None, :],
                     other=0.0)
        acc += w * sw[:, :, None] * x[None, :, :]
    y = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_tile(N: int, sms: int) -> dict:
    """8- or 16-column blocks, four 128-column groups a step (the sweep's best at one row on an H200)."""
    return dict(BLOCK_N=16 if triton.cdiv(N, 16) >= 2 * sms else 8, GROUPS=4, warps=4, stages=2)


def block_fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rows: int,
                   bias: torch.Tensor | None = None, tile: dict | None = None, quantize_x: bool = True) -> torch.Tensor:
    """The block-scaled FP8 product for a few rows in one kernel, without tensor cores (DECODE_MODE "gemv"):
    y [M, N] = dequant(quant(x)) @ dequant(weight)^T (+ bias), x [M, K] bf16/fp16/fp32 quantized per token and
    128 columns inside (W8A8, as `fp8_linear`'s other paths), or used as it is with quantize_x=False (W8A16)."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    t = tile or gemv_tile(N, _num_sms(x.device))
    grid = (M * triton.cdiv(N, t["BLOCK_N"]),)
    _gemv_kernel[grid](x, weight, scale, bias if bias is not None else scale, out, M, N, K, x.stride(0),
                       weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0), W_ROWS=rows,
                       QUANT_X=quantize_x, HAS_BIAS=bias is not None, BLOCK_N=t["BLOCK_N"], GROUPS=t["GROUPS"],
                       GROUP_SIZE=GROUP, num_warps=t["warps"], num_stages=t["stages"])
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


_SMS: dict = {}


# Split-K's partial sums are added up by the last program of each tile to finish (a ticket counter per tile, in
# split order: the same numbers as _splitk_sum_kernel) instead of a second kernel: at batch 1 an 8B-shaped model
# ran 96 split sums a step (1.4 µs each and a gap on an H100). The counters are zero between launches (the last
# program resets its tile's); they are allocated outside graph capture (else the sum kernel is used).
SPLITK_TICKETS = True
_TICKETS: dict = {}


def _tickets(device: torch.device, tiles: int) -> torch.Tensor | None:
    buf = _TICKETS.get(device.index)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _TICKETS[device.index] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return buf


def _add_norm_torch(y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, q: torch.Tensor,
                    scales: torch.Tensor, sumsq: torch.Tensor) -> None:
    """`_add_norm_out`'s numbers for a whole output y [M, N] (block_fp8_gemm's `add_norm` without ticket counters)."""
    residual.copy_((residual.float() + y.float()).to(residual.dtype))
    r = residual.float()
    sumsq.copy_((r * r).view(r.shape[0], -1, GROUP).sum(-1))
    q_, s_ = quantize_activations((r * weight.float()).to(residual.dtype))
    q.copy_(q_)
    scales.copy_(s_)


def tiles(M: int, N: int, K: int, sms: int, add_norm: bool = False) -> dict:
    """Tiles by the number of rows M. Decode (M <= 64, and verification rows up to VERIFY_MAX_M where N is not
    wide): BLOCK_M 16 (the smallest tensor-core tile) to 64, thin column blocks, and K split until there are about
    1.5 programs an SM to stream the weights
    (benchmarks/fp8_gemm.py --sweep on an H200: 64 x split 4 was the fastest or within 2 % of it for the 8B's
    projections at 1 and 16 rows, 10-20 % faster than 32-wide blocks); prefill: 64 x 128 tiles. `add_norm`
    (block_fp8_gemm's, up to 16 rows): 128 columns a program."""
    k_blocks = triton.cdiv(K, GROUP)
    if add_norm:        # one 128-column group a program (`_add_norm_out`), the product transposed, up to 16 rows
        return _swap_tile(M, N, k_blocks, sms, GROUP, 8)
    if M <= VERIFY_MAX_M and (SWAP_TILES == "all" or (SWAP_TILES == "decode" and M <= 16)
                              or (SWAP_TILES == "verify" and M > 16)):
        return _swap_tile(M, N, k_blocks, sms, 64, 4)
    if M <= 64 or (M <= VERIFY_MAX_M and triton.cdiv(N, 64) < 2 * sms):
        # 64 wide (before DECODE_TILES_29, decode rows ran 32 wide where 64 made two programs an SM: the 8B's
        # gate_up; verification rows never meet such a weight here, it goes to cuBLAS or the prefill tile)
        narrow = not DECODE_TILES_29 and triton.cdiv(N, 64) >= 2 * sms
        bn = 16 if N < 512 else 32 if narrow else 64
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        programs = triton.cdiv(M, 16 if M <= 64 else 64) * triton.cdiv(N, bn)
        split = _k_split(programs, k_blocks, M, sms, DECODE_TILES_29)
        # verification rows (65 .. VERIFY_MAX_M): 64-row blocks, a column block's side by side to share its weight
        # tile in L2 (benchmarks/fp8_gemm.py --sweep-rows: at 80 rows 64 x 64 tiles were the best or within 3 % of
        # it on the 8B's qkv, o and down, 1.2-1.9x faster than the prefill tile)
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, warps=4, stages=4, GROUP_M=triton.cdiv(M, 64))
    return dict(BLOCK_M=64 if M <= 128 else 128, BLOCK_N=128, SPLIT=1, warps=8 if M > 128 else 4, stages=3,
                GROUP_M=8)


def _swap_tile(M: int, N: int, k_blocks: int, sms: int, block_n: int, warps: int) -> dict:
    """The product transposed (_gemm_kernel's SWAP): block_n weight rows a program, every activation row in one
    block."""
    return dict(BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n,
                SPLIT=_k_split(triton.cdiv(N, block_n), k_blocks, M, sms, True), warps=warps, stages=4, GROUP_M=1,
                SWAP=True)


def _k_split(programs: int, k_blocks: int, M: int, sms: int, deep: bool) -> int:
    """K split for a decode tile of `programs` programs: doubled until there are about 1.5 programs an SM while each
    split keeps 8 K blocks; with `deep`, up to 16 rows (one row block) a long K split further while each split keeps
    more than 16 K blocks and the programs stay within 4 an SM (DECODE_TILES_29: the 8B's down, 112 K blocks over 64
    programs, split 8, was 4)."""
    split = 1
    while 2 * programs * split < 3 * sms and k_blocks >= 8 * split:
        split *= 2
    while deep and M <= 16 and k_blocks > 16 * split and 2 * programs * split <= 4 * sms:
        split *= 2
    return split


# Where the GEMMs take part in PDL (pdl.GEMM_TRIGGER not "off"; not the default, measured slower) each program
# prefetches the first bytes of its weight rows into L2 before it waits for the kernel before it (pdl.PREFETCH): at
# most PREFETCH_BUDGET bytes over the whole grid (H200's L2 holds 50 MB; the kernel before a projection runs a few
# microseconds, in which the device reads ~10-20 MB).
PREFETCH_BUDGET = 24 << 20


def prefetch_bytes(programs: int, block_n: int, row_bytes: int) -> int:
    """Bytes of each weight row (of a program's K range, `row_bytes`) to prefetch: whole 128-byte lines, the
    grid's total within PREFETCH_BUDGET; 0: none."""
    per_row = PREFETCH_BUDGET // max(programs * block_n, 1) // 128 * 128
    return min(row_bytes, per_row)


def block_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rows: int,
                   bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, tile: dict | None = None, mode: str = "fused",
                   rstd: tuple | None = None, add_norm: tuple | None = None) -> torch.Tensor:
    """y [M, N] = dequant(x) @ dequant(weight)^T (+ bias). x [M, K]: with `x_scale` [M, ceil(K / 128)] already
    float8; else bf16/fp16/fp32 activations, `mode` "fused": quantized per token and 128-group inside the kernel,
    "weight_only": kept as they are (W8A16). weight [N, K] float8_e4m3fn with `scale` [ceil(N / rows), ceil(K / 128)]
    float32. `rstd` (sumsq [M, T], eps): x is an RMSNorm's weight times its input, each output row is multiplied by
    rsqrt(sumsq.sum(1) / K + eps) (FP8Activation.sumsq). `add_norm` (residual [M, N], norm weight [N], q [M, N]
    float8, scales [M, N / 128], sumsq [M, N / 128]; N a multiple of 128): y joins the residual in place and is not
    returned (the tile 128 columns wide); q, scales and sumsq are written for the next linear's RSTD
    (`fp8_linear_add_norm`)."""
    M, K = x.shape
    N = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    t = tile or tiles(M, N, K, _num_sms(x.device), add_norm is not None)
    if add_norm is not None:
        assert t["BLOCK_N"] == GROUP and N % GROUP == 0, (t, N)
    k_blocks = triton.cdiv(K, GROUP)
    split = max(1, min(t["SPLIT"], k_blocks))
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)
    c = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    a_mode = 0 if x_scale is not None else 2 if mode == "weight_only" else 1
    a_s = x_scale if x_scale is not None else scale          # unused unless pre-quantized
    grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]), split)
    tickets = _tickets(x.device, grid[0]) if split > 1 and SPLITK_TICKETS else None
    launch = pdl.gemm_options(x.device)
    aligned = K % GROUP == 0 and weight.stride(0) % 16 == 0 and weight.data_ptr() % 16 == 0
    prefetch = prefetch_bytes(grid[0] * grid[1], t["BLOCK_N"], per_split * GROUP * weight.element_size()) \
        if launch["PDL"] and pdl.PREFETCH and M <= 64 and aligned else 0
    assert rstd is None or add_norm is None, "one of rstd and add_norm: they share the sums' arguments"
    if rstd is not None:
        ss, eps = rstd
    elif add_norm is not None:
        ss, eps = add_norm[4], 0.0
    else:
        ss, eps = scale, 0.0
    res, nw, qo, so = add_norm[:4] if add_norm is not None else (scale, scale, scale, scale)
    add_norm_mode = 0 if add_norm is None else 2 if t.get("EARLY", ADD_NORM_EARLY) else 1
    _gemm_kernel[grid](x, a_s, weight, scale, bias if bias is not None else scale, c, out,
                       tickets if tickets is not None else scale, M, N, K, per_split, split,
                       x.stride(0), a_s.stride(0), a_s.stride(1), weight.stride(0), scale.stride(0), scale.stride(1),
                       c.stride(0) if split > 1 else 0, c.stride(-2), out.stride(0), prefetch,
                       ss, ss.stride(0), ss.shape[1], float(eps), res, res.stride(0), nw, qo, qo.stride(0), so,
                       so.stride(0), RSTD=rstd is not None, SS_PAD=triton.next_power_of_2(ss.shape[1]),
                       ADD_NORM=add_norm_mode, B_ROWS=rows, A_MODE=a_mode, HAS_BIAS=bias is not None,
                       SPLIT=split > 1,
                       TICKET=tickets is not None, EVEN_K=K % GROUP == 0, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                       BLOCK_K=GROUP, GROUP_M=t["GROUP_M"], PREFETCH=prefetch > 0, LANES=32 * t["warps"],
                       SWAP=t.get("SWAP", False), AHEAD=t.get("AHEAD", SCALES_AHEAD and t.get("SWAP", False)),
                       num_warps=t["warps"], num_stages=t["stages"], **launch)
    if split > 1 and tickets is None:
        if add_norm is not None:        # graph capture without ticket counters: the tickets' numbers in torch
            y = c[0].clone()
            for s in range(1, split):
                y += c[s]
            if bias is not None:
                y += bias.float()
            _add_norm_torch(y.to(out_dtype), *add_norm)
            return out
        BLOCK = 1024
        _splitk_sum_kernel[(triton.cdiv(M * N, BLOCK),)](c, bias if bias is not None else c, out, M * N, N,
                                                         SPLITS=split, HAS_BIAS=bias is not None, BLOCK=BLOCK,
                                                         num_warps=4, **pdl.options(x.device))
    return out


# -- cuBLAS's block-scaled GEMM (torch's scaled_mm, Hopper, CUDA >= 12.9) ---------------------------------

def cublas_weight_scale(scale: torch.Tensor) -> torch.Tensor:
    """The weight's [ceil(N / 128), ceil(K / 128)] scales in the layout cuBLAS reads for 128 x 128 blocks:
    the K-block count padded to a multiple of 4, stored K-major ([L4, N / 128] seen transposed)."""
    R, L = scale.shape
    L4 = -(-L // 4) * 4
    padded = torch.zeros((R, L4), dtype=torch.float32, device=scale.device)
    padded[:, :L] = scale
    return padded.t()


def cublas_block_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, cublas_scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product through torch.nn.functional.scaled_mm (BlockWise1x128 activations, BlockWise128x128
    weights); K a multiple of 128, 128-row weight blocks, M a multiple of 8 (cuBLAS refuses M = 1, 7, 33 on an
    H200 with torch 2.11: CUBLAS_STATUS_NOT_SUPPORTED)."""
    from torch.nn.functional import ScalingType, scaled_mm

    x_q, x_s = quantize_activations(x, column_major_scales=True)
    y = scaled_mm(x_q, weight.t(), x_s, ScalingType.BlockWise1x128, cublas_scale, ScalingType.BlockWise128x128,
                  output_dtype=x.dtype)
    return y if bias is None else y + bias


def cublas_supported(device: torch.device) -> bool:
    """Whether this torch and device run scaled_mm with block scales (tried once on a small product)."""
    key = device.index
    if key not in _CUBLAS:
        try:
            w = torch.randn(256, 256, device=device).to(torch.float8_e4m3fn)
            s = cublas_weight_scale(torch.ones(2, 2, device=device))
            cublas_block_fp8_gemm(torch.randn(16, 256, device=device, dtype=torch.bfloat16), w, s)
            torch.cuda.synchronize(device)
            _CUBLAS[key] = True
        except Exception:  # noqa: BLE001 - any failure means: not on this build/device
            _CUBLAS[key] = False
    return _CUBLAS[key]


_CUBLAS: dict = {}

# Rows from which cuBLAS's block-scaled GEMM is used instead of the Triton kernel (None: never), and how the
# Triton kernels treat decode activations (M <= 64: "quantize" first with quantize_activations, "fused" in the
# kernel, "weight_only", or "gemv": one row through a weight of at most GEMV_MAX_WEIGHT elements in
# block_fp8_gemv, else as "quantize"). Set from benchmarks/fp8_gemm.py's and benchmarks/fp8.py's measurements on
# an H200 (benchmarks/results/). The GEMV beats the GEMM at one row on the smaller projections (8B's qkv 9.4
# against 11.0 µs) and loses on the large ones (gate_up 41.9 against 34.4); the 8B shape end to end is the same
# either way (285 against 284 tok/s), so it is not the default.
#
# In "quantize" the activations of the decoder layer's FP8 linears come quantized from the kernel before them where
# `fused_quant_wanted` says so (FUSE_DECODE_QUANT): the RMSNorm before qkv and gate_up (the residual-add variant
# too) and silu_and_mul before down write fp8 values and scales (FP8Activation) instead of their bf16 output, the
# same numbers quantize_activations makes of that output, so `_quant_kernel` is skipped: an 8B-shaped model at
# batch 1 ran 128 of them a step (1.1 µs each and a 0.4 µs gap on an H100, of a 3.9 ms step). The attention's
# output before o can come quantized too where its heads are 128 wide (FUSE_ATTENTION_QUANT; the decode attention or
# its combine kernel writes one group a head: session 22's trace had o's quantization at 1.2 µs and a 0.4 µs gap a
# layer; on the H200 the 8B shape's FP8 step went from 2.88 to 2.86 ms at batch 1 and 3.37 to 3.36 at batch 16,
# session 29, benchmarks/fp8.py's "-attnquant" rows). Its decode mode "quantize-unfused" is "quantize" without either.
CUBLAS_FROM_M: int | None = 128
# Verification rows (a batch of 16 verifying 4 drafts is 80), 65 .. VERIFY_MAX_M (64: none): cuBLAS's block-scaled
# GEMM where its 128-wide column tiles alone fill the device (`verify_on_cublas`: the 8B's gate_up, 39.8 µs at 80
# rows against 60.0 for the best Triton tile), else the Triton GEMM on decode-style tiles of 64-row blocks with K
# split (`tiles`: the 8B's o 14.7 µs, down 36.5, against cuBLAS's 16.8 and 44.6, whose 32 column tiles leave most of
# the SMs idle). Before, these rows ran on the prefill tile (o 21.2, down 68.1). benchmarks/fp8_gemm.py --sweep-rows.
VERIFY_MAX_M = 127
# Decode tiles (M <= 64) as session 29's sweep (benchmarks/fp8_gemm.py --sweep-rows 1,16, cold weights, H200) found
# them: 64-wide column blocks for a weight as wide as the 8B's gate_up too (0.5-0.8 µs faster a call than 32-wide at
# 1 and 16 rows; applied up to 64), and up to 16 rows a long K split further (the 8B's down: split 8, 0.4-1.3 µs
# faster than split 4). The 8B shape end to end: 1.44 -> 1.48x bf16 at batch 1, 1.39 -> 1.42x at batch 16. False:
# session 28's tiles (benchmarks/fp8.py's "-s28tiles" rows).
DECODE_TILES_29 = True
# Which rows' GEMMs run transposed (_gemm_kernel's SWAP; `tiles`): "off", "decode" (1 .. 16 rows), "verify" (17 ..
# VERIFY_MAX_M rows) or "all" (1 .. VERIFY_MAX_M). Up to 16 rows Triton runs the plain tile's FP8 values through FP16
# mma.sync, the transposed one through Hopper's FP8 wgmma (benchmarks/fp8_ptx.py). "decode" (session 36,
# benchmarks/fp8_gemm.py --sweep-rows 1,16,80 --swap, cold weights, H200): 0-6 % faster on the 8B's projections at 1
# and 16 rows (o 9.5 -> 9.1 µs, gate_up 33.9 -> 32.9 at one row), 5-42 % slower at 80 (qkv 18.8 -> 26.7); the 8B
# shape end to end 2.79 -> 2.73 ms a step at batch 1, 3.32 -> 3.24 at 16 (benchmarks/fp8.py "-noswap" rows).
# VERIFY_CUBLAS False: verification rows never go to cuBLAS (`verify_on_cublas`).
SWAP_TILES = "decode"
VERIFY_CUBLAS = True
# Each K block's scales loaded one block ahead (_gemm_kernel's AHEAD) in the transposed decode tiles (SWAP) where a
# tile does not say. Session 37 on an H200 (benchmarks/fp8_gemm.py --sweep-rows 1,16 --ahead, cold weights): 0.4-1.0
# µs faster on the 8B's qkv, o and down (qkv 11.5 -> 11.0 µs, o 9.3 -> 8.8, down 21.4 -> 20.8 at one row), gate_up
# the same; the 8B shape end to end 2.75 -> 2.69 ms a step at batch 1 (benchmarks/fp8.py "-noahead" rows). At 80
# rows (the plain 64-row tiles) no faster: qkv 18.8 -> 19.2 µs, o, gate_up and down the same.
SCALES_AHEAD = True
DECODE_MODE = "quantize"
GEMV_MAX_WEIGHT = 32 << 20
FUSE_DECODE_QUANT = True
FUSE_ATTENTION_QUANT = True


def fused_quant_wanted(x: torch.Tensor, w) -> bool:
    """Whether the kernel reading x [M, ...] (an RMSNorm over K columns, or silu_and_mul's [gate | up] of 2K) may
    hand the FP8 linear `w` (models/quant.FP8Weight, K = its columns) its output already quantized (FP8Activation):
    x on CUDA, w kept FP8, M rows that fp8_linear runs on the Triton GEMM as "quantize" (M <= 64 or verification
    rows, DECODE_MODE "quantize", not cuBLAS's rows), K a multiple of 128 (whole groups in every program of those
    kernels: the RMSNorm holds its row in one block of next_power_of_2(K) columns, silu_and_mul blocks of min(that,
    1024); the decode attention one group a head). Shapes, dtypes and these settings alone decide it, so a CUDA graph
    captures the same path it replays."""
    return x.dim() == 2 and _reads_quantized(x.shape[0], x.dtype, x.device, x.is_cuda, w)


def _reads_quantized(M: int, dtype: torch.dtype, device: torch.device, is_cuda: bool, w) -> bool:
    """`fused_quant_wanted` for M rows of `dtype` on `device`."""
    if not (FUSE_DECODE_QUANT and DECODE_MODE == "quantize" and is_cuda) or isinstance(w, torch.Tensor):
        return False
    weight = getattr(w, "weight", None)
    K = w.shape[-1]
    return (weight is not None and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and 0 < M <= max(64, VERIFY_MAX_M) and (CUBLAS_FROM_M is None or M < CUBLAS_FROM_M)
            and not verify_on_cublas(M, weight.shape[0], getattr(w, "cublas_scale", None), device) and K % GROUP == 0
            and dtype in (torch.bfloat16, torch.float16, torch.float32))


# The residual add and the RMSNorm between two FP8 linears at decode sizes (o -> the MLP's norm -> gate_up, down ->
# the next layer's norm -> qkv) done by the GEMMs themselves, not by a norm kernel (`fp8_linear_add_norm`).
FUSE_ADD_NORM = True
# ... with the tile's residual and norm weight loaded before the GEMM's main loop, not in its last step (the loads'
# latency off the tile's tail; ADD_NORM 2). Session 38 on an H200, the 8B shape in FP8 at batch 1: 2.57-2.59 ->
# 2.55-2.56 ms a step in three calls (benchmarks/fp8.py's "-noaddnormearly" rows), at batch 16 3.17 either way.
ADD_NORM_EARLY = True


def add_norm_wanted(x, w, next_w) -> bool:
    """Whether `fp8_linear_add_norm(x, w, ...)` may stand for `linear(x, w)` + the RMSNorm that joins it to the
    residual stream for the FP8 linear next_w: x quantized already (FP8Activation without sumsq: the attention's or
    silu_and_mul's output) of at most 16 rows, w's output columns a multiple of 128, next_w reading its input
    quantized (`fused_quant_wanted`), a 16-bit stream. Shapes and settings alone decide it (CUDA graphs)."""
    if not (FUSE_ADD_NORM and isinstance(x, FP8Activation) and x.sumsq is None and x.dtype in (torch.bfloat16,
                                                                                            torch.float16)):
        return False
    M = x.q.shape[0]
    weight = getattr(w, "weight", None)
    return (0 < M <= 16 and weight is not None and weight.dtype == torch.float8_e4m3fn and weight.dim() == 2
            and weight.shape[0] % GROUP == 0 and next_w is not None and next_w.shape[-1] == weight.shape[0]
            and _reads_quantized(M, x.dtype, x.q.device, x.q.is_cuda, next_w))


def fp8_linear_add_norm(x: FP8Activation, weight: torch.Tensor, scale: torch.Tensor, rows: int,
                        bias: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> FP8Activation:
    """residual += x @ W^T (+ bias), in place, and the stream's RMSNorm with norm_weight handed to the next FP8
    linear: an FP8Activation whose q * scale is norm_weight * residual and whose `sumsq` carries each row's squares
    in blocks of 128 columns, so that the next GEMM applies 1 / rms (`add_norm_wanted` says where). Numbers: the
    residual as `residual + y`; the norm as rms_norm's but for the rounding of x / rms to the dtype before the
    weight's product (the GEMM scales its output rows instead)."""
    M, N = x.q.shape[0], weight.shape[0]
    q, scales = quantized_rows(M, N, x.q.device)
    sumsq = torch.empty((M, N // GROUP), dtype=torch.float32, device=x.q.device)
    block_fp8_gemm(x.q, weight, scale, rows, bias, x_scale=x.scale, out_dtype=x.dtype,
                   add_norm=(residual, norm_weight, q, scales, sumsq))
    return FP8Activation(q, scales, x.dtype, sumsq, float(eps))


def verify_on_cublas(M: int, N: int, cublas_scale: torch.Tensor | None, device: torch.device) -> bool:
    """Whether M verification rows (65 .. VERIFY_MAX_M) through an N-row weight run on cuBLAS's block-scaled GEMM:
    where it has the weight's scales (set at load only where cublas_supported) and cdiv(N, 128) column tiles fill
    every SM."""
    return (cublas_scale is not None and CUBLAS_FROM_M is not None and VERIFY_CUBLAS and 64 < M <= VERIFY_MAX_M
            and triton.cdiv(N, 128) >= _num_sms(device))


def fp8_linear(x: torch.Tensor | FP8Activation, weight: torch.Tensor, scale: torch.Tensor, rows: int,
               bias: torch.Tensor | None = None, cublas_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through the FP8 weight: [..., N] in x's dtype. x may come quantized (FP8Activation [M, K], where
    `fused_quant_wanted` said so): the GEMM reads it as it is."""
    if isinstance(x, FP8Activation):
        return block_fp8_gemm(x.q, weight, scale, rows, bias, x_scale=x.scale, out_dtype=x.dtype,
                              rstd=(x.sumsq, x.eps) if x.sumsq is not None else None)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    # cublas_scale is set at load only where cublas_supported (models/weights.py)
    if cublas_scale is not None and x2.shape[1] % GROUP == 0 and (
            (CUBLAS_FROM_M is not None and M >= CUBLAS_FROM_M)
            or verify_on_cublas(M, weight.shape[0], cublas_scale, x2.device)):
        pad = -M % 8                      # cuBLAS's block-scaled GEMM wants M a multiple of 8
        xp = torch.nn.functional.pad(x2, (0, 0, 0, pad)) if pad else x2
        y = cublas_block_fp8_gemm(xp, weight, cublas_scale, bias)[:M]
    elif DECODE_MODE == "gemv" and M == 1 and weight.numel() <= GEMV_MAX_WEIGHT:
        y = block_fp8_gemv(x2, weight, scale, rows, bias)
    elif M <= 64 and DECODE_MODE in ("fused", "weight_only"):
        y = block_fp8_gemm(x2, weight, scale, rows, bias, mode=DECODE_MODE)
    else:
        x_q, x_s = quantize_activations(x2)
        y = block_fp8_gemm(x_q, weight, scale, rows, bias, x_scale=x_s, out_dtype=x2.dtype)
    return y.reshape(*lead, weight.shape[0])
