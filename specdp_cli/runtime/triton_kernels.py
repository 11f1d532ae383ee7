"""Triton kernels of the CUDA execution path (imported only on CUDA; `ops.py` holds the torch
reference of each, which CPU runs and the GPU tests compare against).

- `paged_attention`: causal attention of R rows of T query tokens over a paged KV cache, one
  program per (row, KV head): the row's T queries and the G query heads sharing the KV head form
  one [BLOCK_M, D] block, so GQA costs no KV copies. Keys are read through the row's block table
  up to the row's last query position, with an online softmax (flash attention). Nothing but the
  tensors it reads decides its work, so a CUDA graph can hold it. Where R * KV programs leave the GPU
  mostly idle (small batch), each row's keys are split over S programs (`attention_splits`, chosen by
  shapes alone) writing float32 partial sums, and a second kernel combines them (flash-decoding).
- `rope_and_store`: rotary embedding of q and k (in place, HF's rotate-half convention) and the
  store of k and v into their cache slots, one program per token; `rotate_`: the rotation alone, of any
  strided [tokens, heads, rot] view (latent attention's rope parts, a partial rotary factor).
- `head_rms_norm_`: Qwen3's per-head q and k RMSNorms, in place, one program per (token, head).
- `add_rms_norm` / `rms_norm` and `silu_and_mul`: the fused elementwise steps of a decoder layer,
  rounding where Hugging Face's modules round so bf16 results stay close to theirs; with `quantize` their output
  goes to an FP8 linear quantized (fp8_kernels.FP8Activation, `fused_quant_wanted`), one kernel fewer.
- `forward_layout`: a forward's token positions, cache slots and logits rows from its per-row inputs,
  in one kernel (at batch 1 a decoder layer is a handful of kernels of ~3 µs each, and the dozen tiny
  torch ops this replaces cost as much as two layers); `set_rows`: the copies of a forward's inputs into
  the runner's buffers, one launch instead of one per input.
- `argmax`: the argmax of logits rows, one program a row (torch's reduce takes 5.6 µs for one bf16 row
  of 16k on an H200: a single block of 512 threads).
The attention, rotary, norm and activation kernels launch with programmatic dependent launch on Hopper (pdl.py:
each lets the next launch at its top, then waits for the one before).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .fp8_kernels import FP8Activation, quantize_groups, quantized_rows, store_quantized


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---------------------------------------------------------------------------------------------
# attention

@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache, v_cache, out_ptr, pos_ptr, bt_ptr, sinks_ptr, part_acc, part_ml, oq_ptr, os_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_oq, stride_os,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        qn, scale, window, NT, H,
        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        BS: tl.constexpr, PREC: tl.constexpr, HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
        PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    q0 = row * qn
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    m = tl.arange(0, BLOCK_M)
    tq = m // G_PAD
    g = m % G_PAD
    m_ok = (tq < qn) & (g < G)
    tok = q0 + tq
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & (d[None, :] < D), other=0.0)
    qpos = tl.load(pos_ptr + tok, mask=m_ok, other=0)
    last = tl.load(pos_ptr + q0 + qn - 1)            # positions rise within a row: the last is its max
    first = tl.load(pos_ptr + q0)
    lo = first * 0                                    # the type of `first` (int64) in both branches
    if window > 0:
        lo = tl.maximum(first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = last + 1
    if SPLIT:           # part s of S: [lo + s * chunk, lo + (s + 1) * chunk) ∩ [lo, hi), chunk a multiple of BLOCK_N
        parts = tl.num_programs(2)
        part = tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(hi - lo, parts), BLOCK_N) * BLOCK_N
        lo = lo + part * chunk
        hi = tl.minimum(lo + chunk, hi)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS and not SPLIT:     # a head's sink logit starts its softmax: it takes probability and adds no value
        m_i = tl.load(sinks_ptr + head, mask=m_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634            # exp2 instead of exp
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi
        blk = tl.load(bt_ptr + row * stride_bt + kpos // BS, mask=k_ok, other=0).to(tl.int64)
        off = kpos % BS
        k = tl.load(k_cache + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=k_ok[:, None] & (d[None, :] < D), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        visible = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (qpos[:, None] - kpos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    if SPLIT:           # the part's unnormalised sum and its softmax state (float32), for `_attention_combine_kernel`
        i = (tl.program_id(2) * NT + tok) * H + head
        tl.store(part_acc + i[:, None] * DV + dv[None, :], acc, mask=m_ok[:, None] & (dv[None, :] < DV))
        tl.store(part_ml + i, m_i, mask=m_ok)
        tl.store(part_ml + tl.num_programs(2) * NT * H + i, l_i, mask=m_ok)
    else:
        acc = acc / tl.maximum(l_i, 1e-30)[:, None]
        if QUANT:       # DV = 128: a (token, head)'s output is one 128-column group of o's input, quantized for it
            q8, s8 = quantize_groups(acc.to(out_ptr.dtype.element_ty).to(tl.float32))
            tl.store(oq_ptr + tok[:, None] * stride_oq + head[:, None] * DV + dv[None, :],
                     q8.to(oq_ptr.dtype.element_ty), mask=m_ok[:, None])
            tl.store(os_ptr + tok * stride_os + head, s8, mask=m_ok)
        else:
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _attention_combine_kernel(part_acc, part_ml, sinks_ptr, out_ptr, oq_ptr, os_ptr, stride_ot, stride_oh,
                              stride_oq, stride_os, NT, H, S, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                              S_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    """out[tok, head] from the S parts of its keys: each part's sum rescaled to the common max (exp2 domain),
    summed, divided by the summed denominators (with the head's sink, if any, counted here once). QUANT (DV = 128):
    written quantized for an FP8 o instead, one 128-column group a (token, head)."""
    pdl.begin(PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < S
    dv = tl.arange(0, BLOCK_DV)
    i = (s * NT + tok) * H + head
    m = tl.load(part_ml + i, mask=s_ok, other=-1.0e30)
    l = tl.load(part_ml + S * NT * H + i, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.exp2(m - m_max)                            # an empty part: m = -1e30, l = 0, acc = 0
    l_sum = tl.sum(l * w, 0)
    if HAS_SINKS:
        l_sum += tl.exp2(sink - m_max)
    acc = tl.load(part_acc + i[:, None] * DV + dv[None, :], mask=s_ok[:, None] & (dv[None, :] < DV), other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.maximum(l_sum, 1e-30)
    if QUANT:
        store_quantized(o.to(out_ptr.dtype.element_ty), oq_ptr + tok * stride_oq, os_ptr + tok * stride_os,
                        head * DV, H * DV, BLOCK_DV)
    else:
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dv < DV)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """The device's SM count (cached per device index); 0 off CUDA (the interpreter: no split unless asked)."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


MAX_SPLITS = 16
SPLIT_SCRATCH = 1 << 24         # at most this many float32 elements of partial sums (64 MiB)


def attention_splits(R: int, KV: int, T: int, H: int, DV: int, max_keys: int, block_n: int, sms: int) -> int:
    """How many parts S `paged_attention` cuts each row's keys into (grid (R, KV, S), then a combine kernel).

    One program per (row, KV head) leaves most of the GPU idle at small batch (batch 1 of an 8B model: 8 programs
    on 132 SMs, each walking the whole context), so below one program per SM the keys are split for R * KV * S
    around 1-2x the SM count. Capped by the BLOCK_N chunks a row can hold (`max_keys`: the block table's width in
    keys, or less with a sliding window), by MAX_SPLITS and by the float32 scratch of the partial sums. Shapes and
    Python ints only, never tensor values: a CUDA graph captured at (R, T) replays the same split. S = 1 (the single
    pass, no scratch, no combine) once R * KV fills the GPU."""
    progs = R * KV
    if progs == 0 or progs >= sms:
        return 1
    S = min(-(-sms // progs), MAX_SPLITS, max(max_keys // block_n, 1))
    S = min(S, max(SPLIT_SCRATCH // max(R * T * H * DV, 1), 1))
    return max(S, 1)


def paged_attention(q, k_cache, v_cache, out, positions, block_table, T: int, scale: float, window: int,
                    sinks=None, splits: int | None = None, quantized: tuple | None = None) -> None:
    """q [N, H, D] (any token/head strides, unit last stride), caches [blocks, BS, KV, D(V)],
    out [N, H, DV]; row r (of block_table's rows) owns tokens [r*T, (r+1)*T); sinks [H] or None.
    `splits`: parts each row's keys are cut into (None: `attention_splits`' choice; 1: the single pass).
    `quantized` (DV = 128): (values [N, H * DV] float8, scales [N, H] float32) written instead of out, the numbers
    fp8_kernels.quantize_activations makes of out viewed [N, H * DV] (out only gives the dtype then)."""
    H, D = q.shape[1], q.shape[2]
    BS, KV, DV = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    G = H // KV
    G_PAD = _pow2(G)
    R = block_table.shape[0]
    if R == 0:
        return
    BLOCK_N = 64 if _pow2(D) <= 128 else 32
    if splits is None:
        max_keys = block_table.shape[1] * BS
        if window:                      # lo is rounded down to BLOCK_N: at most window + T - 1 + BLOCK_N - 1 keys
            max_keys = min(max_keys, window + T + BLOCK_N)
        splits = attention_splits(R, KV, T, H, DV, max_keys, BLOCK_N, _sm_count(q.device))
    NT = R * T
    if splits > 1:
        part_acc = torch.empty((splits, NT, H, DV), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((2, splits, NT, H), dtype=torch.float32, device=q.device)     # max m, sum l
    else:
        part_acc = part_ml = out        # unused
    has_sinks = sinks is not None
    if quantized is not None:
        assert DV == 128, DV            # one 128-column group a head
    oq, os_ = quantized if quantized is not None else (out, out)
    launch = pdl.options(q.device)
    _paged_attention_kernel[(R, KV, splits)](
        q, k_cache, v_cache, out, positions, block_table, sinks if has_sinks else positions, part_acc, part_ml,
        oq, os_, q.stride(0), q.stride(1), out.stride(0), out.stride(1), oq.stride(0), os_.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        T, scale, window or 0, NT, H,
        G=G, G_PAD=G_PAD, D=D, DV=DV, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
        BLOCK_Q=max(_pow2(T), 16 // min(G_PAD, 16)), BLOCK_N=BLOCK_N, BS=BS,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", HAS_SINKS=has_sinks, SPLIT=splits > 1,
        QUANT=quantized is not None, num_warps=4, **launch)
    if splits > 1:
        _attention_combine_kernel[(NT, H)](
            part_acc, part_ml, sinks if has_sinks else part_ml, out, oq, os_, out.stride(0), out.stride(1),
            oq.stride(0), os_.stride(0), NT, H, splits, DV=DV, BLOCK_DV=_pow2(DV), S_PAD=_pow2(splits),
            HAS_SINKS=has_sinks, QUANT=quantized is not None, num_warps=2, **launch)


# ---------------------------------------------------------------------------------------------
# a forward's token layout

@triton.jit
def _forward_layout_kernel(start_ptr, n_real_ptr, out_start_ptr, bt_ptr, pos_ptr, slot_ptr, rows_ptr,
                           stride_bt, max_blocks, T, W, trash_slot,
                           BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    start = tl.maximum(tl.load(start_ptr + r), 0)
    n = tl.load(n_real_ptr + r)
    t = tl.arange(0, BLOCK_T)
    ok = t < T
    pos = start + tl.minimum(t, tl.maximum(n - 1, 0))             # padding repeats the last position
    col = tl.minimum(pos // BS, max_blocks - 1)
    blk = tl.load(bt_ptr + r * stride_bt + col, mask=ok, other=0).to(tl.int64)
    slot = tl.where(t < n, blk * BS + pos % BS, trash_slot)
    tl.store(pos_ptr + r * T + t, pos, mask=ok)
    tl.store(slot_ptr + r * T + t, slot, mask=ok)
    w = tl.arange(0, BLOCK_W)
    cols = tl.minimum(tl.load(out_start_ptr + r) + w, T - 1)
    tl.store(rows_ptr + r * W + w, r * T + cols, mask=w < W)


def forward_layout(start, n_real, out_start, block_table, T: int, W: int, block_size: int, trash_block: int,
                   positions, slots, out_rows) -> None:
    """For R rows (start, n_real, out_start [R] long; block_table [R, max_blocks] int32): positions and
    slots [R * T] and the logits window's token rows out_rows [R * W], as ModelRunner's torch reference."""
    R = start.shape[0]
    if R:
        _forward_layout_kernel[(R,)](start, n_real, out_start, block_table, positions, slots, out_rows,
                                     block_table.stride(0), block_table.shape[1], T, W, trash_block * block_size,
                                     BS=block_size, BLOCK_T=_pow2(T), BLOCK_W=_pow2(W), num_warps=1)


@triton.jit
def _set_rows_kernel(ids_src, start_src, n_real_src, out_start_src, ids_dst, start_dst, n_real_dst, out_start_dst,
                     T, stride_ir, stride_it, stride_s, stride_n, stride_o, IDS: tl.constexpr, START: tl.constexpr,
                     NREAL: tl.constexpr, OUT: tl.constexpr, BLOCK_T: tl.constexpr):
    r, c = tl.program_id(0), tl.program_id(1)
    if IDS:
        t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        v = tl.load(ids_src + r * stride_ir + t * stride_it, mask=t < T, other=0)
        tl.store(ids_dst + r * T + t, v.to(tl.int64), mask=t < T)
    if c == 0:
        if START:
            tl.store(start_dst + r, tl.load(start_src + r * stride_s).to(tl.int64))
        if NREAL:
            tl.store(n_real_dst + r, tl.load(n_real_src + r * stride_n).to(tl.int64))
        if OUT:
            tl.store(out_start_dst + r, tl.load(out_start_src + r * stride_o).to(tl.int64))


def set_rows(R: int, ids_dst, start_dst, n_real_dst, out_start_dst, ids=None, start=None, n_real=None,
             out_start=None) -> None:
    """ModelRunner.set_rows' copies in one launch: ids [R, T] (any strides, integer) into ids_dst[:R * T] row by
    row, and each of start / n_real / out_start given ([R], any stride, integer or bool) into its buffer's first R
    (int64) entries. Shapes alone decide the launch, so a CUDA graph holds it."""
    if R == 0 or (ids is None and start is None and n_real is None and out_start is None):
        return
    T = ids.shape[1] if ids is not None else 1
    BLOCK_T = min(_pow2(T), 1024)
    cols = [(x, x.stride(0) if x is not None else 0) for x in (start, n_real, out_start)]
    _set_rows_kernel[(R, triton.cdiv(T, BLOCK_T) if ids is not None else 1)](
        ids if ids is not None else ids_dst, *(x if x is not None else ids_dst for x, _ in cols),
        ids_dst, start_dst, n_real_dst, out_start_dst, T,
        ids.stride(0) if ids is not None else 0, ids.stride(1) if ids is not None else 0, *(st for _, st in cols),
        IDS=ids is not None, START=start is not None, NREAL=n_real is not None, OUT=out_start is not None,
        BLOCK_T=BLOCK_T, num_warps=1)


# ---------------------------------------------------------------------------------------------
# the argmax of logits rows

@triton.jit
def _argmax_kernel(x_ptr, out_ptr, stride_x, V, ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), ACC)
    at = lane                                     # each lane's first index at its maximum (lanes see rising indices)
    for v0 in range(0, V, BLOCK):
        i = v0 + lane
        x = tl.load(x_ptr + row * stride_x + i, mask=i < V, other=float("-inf")).to(ACC)
        better = x > best                          # strict: a tie keeps the earlier index
        best = tl.where(better, x, best)
        at = tl.where(better, i, at)
    m = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == m, at, V), 0).to(tl.int64))   # ties: the smallest index


def argmax(x) -> torch.Tensor:
    """torch.argmax(x, -1) of x [..., V] (last stride 1, a float dtype): one program per row, V in blocks."""
    V = x.shape[-1]
    out = torch.empty(x.shape[:-1], dtype=torch.long, device=x.device)
    rows = (x if x.stride(-1) == 1 else x.contiguous()).reshape(-1, V)                        # a view for the runners' logits ([R, W, V] or a window column)
    if rows.shape[0]:
        # H200: 16 warps of 8192 lanes keep 16 KB of bf16 in flight a step (a 16k row: 2 steps)
        BLOCK = min(_pow2(V), 8192)
        _argmax_kernel[(rows.shape[0],)](rows, out, rows.stride(0), V,
                                         ACC=tl.float64 if x.dtype == torch.float64 else tl.float32, BLOCK=BLOCK,
                                         num_warps=max(1, min(16, BLOCK // 512)))
    return out


# ---------------------------------------------------------------------------------------------
# async scheduling: tokens the host has not read yet go from one step's rows to the next step's on the device

@triton.jit
def _feed_rows_kernel(inp_ptr, last_ptr, short_ptr, drafts_ptr, cf_ptr, cn_ptr, ct_ptr, R, stride_row, stride_d,
                      c_ids, c_dids, c_start, c_first, c_ndraft, c_src, c_dstart, c_dnreal, c_dout, c_len,
                      KMAX: tl.constexpr, CATCH: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    row = inp_ptr + r * stride_row
    src = tl.load(row + c_src, mask=r < R, other=0) - 1
    fed = (r < R) & (src >= 0)
    s = tl.where(fed, src, 0)
    tl.store(row + c_ids, tl.load(last_ptr + s, mask=fed, other=0), mask=fed)
    d = tl.load(short_ptr + s, mask=fed, other=0)
    tl.store(row + c_start, tl.load(row + c_start, mask=fed, other=0) + d, mask=fed)
    tl.store(row + c_first, tl.load(row + c_first, mask=fed, other=0) + d, mask=fed)
    tl.store(row + c_len, tl.load(row + c_len, mask=fed, other=0) + d, mask=fed)
    if KMAX > 0:
        n = tl.load(row + c_ndraft, mask=fed, other=0)
        for j in tl.static_range(KMAX):
            use = fed & (j < n)
            tl.store(row + c_ids + 1 + j, tl.load(drafts_ptr + s * stride_d + j, mask=use, other=0), mask=use)
    if CATCH:
        catch = fed & (tl.load(row + c_dnreal, mask=fed, other=0) > 0)
        cnt = tl.load(cn_ptr + s, mask=catch, other=1)
        tl.store(row + c_dstart, tl.load(cf_ptr + s, mask=catch, other=0), mask=catch)
        tl.store(row + c_dnreal, cnt, mask=catch)
        tl.store(row + c_dout, cnt - 1, mask=catch)
        tl.store(row + c_dids, tl.load(ct_ptr + s * 2, mask=catch, other=0), mask=catch)
        tl.store(row + c_dids + 1, tl.load(ct_ptr + s * 2 + 1, mask=catch, other=0), mask=catch)


def feed_rows(inp, R: int, cols: tuple, c) -> None:
    """`async_rows.feed` in one kernel: the rows of inp [>= R, width] (the staged step) whose SRC column names a
    row of the step before (1 + its index) take what `record_rows` kept of it (c: async_rows.Carry)."""
    kmax = c.drafts.shape[1] if c.drafts is not None else 0
    catch = c.catch_first is not None
    _feed_rows_kernel[(1,)](inp, c.last, c.short, c.drafts if kmax else c.last, c.catch_first if catch else c.last,
                            c.catch_count if catch else c.last, c.catch_tokens if catch else c.last, R,
                            inp.stride(0), c.drafts.stride(0) if kmax else 0, *cols, KMAX=kmax, CATCH=catch,
                            BLOCK=_pow2(R), num_warps=4)


@triton.jit
def _record_rows_kernel(table_ptr, ndraft_ptr, first_ptr, last_ptr, short_ptr, drafts_ptr, cf_ptr, cn_ptr, ct_ptr,
                        R, W, K, stride_t, stride_n, stride_d, KMAX: tl.constexpr, CATCH: tl.constexpr,
                        BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    m = r < R
    row = table_ptr + r * stride_t
    n = tl.load(row + W, mask=m, other=1)
    a = tl.maximum(n - 1, 0)
    nd = tl.load(ndraft_ptr + r * stride_n, mask=m, other=0)
    tl.store(last_ptr + r, tl.load(row + a, mask=m, other=0), mask=m)
    tl.store(short_ptr + r, n - 1 - nd, mask=m)
    for j in tl.static_range(KMAX):
        use = m & (tl.zeros_like(r) + j < K)
        tl.store(drafts_ptr + r * stride_d + j, tl.load(row + W + 1 + j, mask=use, other=0), mask=use)
    if CATCH:
        j0 = tl.minimum(a, tl.maximum(nd - 1, 0))
        tl.store(cf_ptr + r, tl.load(first_ptr + r * stride_n, mask=m, other=0) + j0, mask=m)
        tl.store(cn_ptr + r, a - j0 + 1, mask=m)
        tl.store(ct_ptr + r * 2, tl.load(row + j0, mask=m, other=0), mask=m)
        tl.store(ct_ptr + r * 2 + 1, tl.load(row + tl.minimum(j0 + 1, a), mask=m, other=0), mask=m)


def record_rows(table, W: int, K: int, ndraft, first, c) -> None:
    """`async_rows.record` in one kernel (table [R, W + 1 + K]; ndraft, first [R]: columns of the staged step, the
    same stride; c: async_rows.Carry)."""
    R = table.shape[0]
    kmax = c.drafts.shape[1] if c.drafts is not None else 0
    catch = c.catch_first is not None
    _record_rows_kernel[(1,)](table, ndraft, first, c.last, c.short, c.drafts if kmax else c.last,
                              c.catch_first if catch else c.last, c.catch_count if catch else c.last,
                              c.catch_tokens if catch else c.last, R, W, K, table.stride(0), ndraft.stride(0),
                              c.drafts.stride(0) if kmax else 0, KMAX=kmax, CATCH=catch, BLOCK=_pow2(R),
                              num_warps=4)


# ---------------------------------------------------------------------------------------------
# an EAGLE head's / MTP layer's first forward: its inputs from the target's rows and what verification emitted

@triton.jit
def _head_inputs_kernel(ids_ptr, tok_ptr, nout_ptr, start_ptr, nreal_ptr, next_ptr, out_ids_ptr, out_start_ptr,
                        out_nreal_ptr, out_col_ptr, next_start_ptr, drafting_ptr, T, stride_ids, stride_tok,
                        stride_in, BLOCK_T: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK_T)
    m = c < T
    shifted = tl.load(ids_ptr + r * stride_ids + tl.where(c < T - 1, c + 1, 0), mask=m, other=0)
    n_out = tl.load(nout_ptr + r)
    n_real = tl.load(nreal_ptr + r * stride_in)
    nxt = tl.load(next_ptr + r * stride_in)
    start = tl.load(start_ptr + r * stride_in)
    col = tl.maximum(tl.where(nxt != -1, n_real - 1, n_out - 1), 0)
    drawn = tl.load(tok_ptr + r * stride_tok + tl.maximum(n_out - 1, 0))
    follow = tl.where(nxt >= 0, nxt, drawn)
    tl.store(out_ids_ptr + r * T + c, tl.where(c == col, follow, shifted), mask=m)
    tl.store(out_start_ptr + r, start)
    tl.store(out_nreal_ptr + r, n_real)
    tl.store(out_col_ptr + r, col)
    tl.store(next_start_ptr + r, start + col)
    tl.store(drafting_ptr + r, ((nxt < 0) & (n_real > 0)).to(tl.int64))


def head_inputs(ids, tokens, n_out, start, n_real, nxt, out_ids, out_start, out_n_real, out_col, next_start,
                drafting) -> None:
    """`drafters.eagle.head_inputs` in one kernel (R rows: ids [R, T] the target's, tokens [R, W] and n_out [R]
    what verification emitted, start / n_real / nxt [R] staged columns; out_ids [R * T] and the other outputs [R]
    long)."""
    R, T = ids.shape
    if R:
        _head_inputs_kernel[(R,)](ids, tokens, n_out, start, n_real, nxt, out_ids, out_start, out_n_real, out_col,
                                  next_start, drafting, T, ids.stride(0), tokens.stride(0), start.stride(0),
                                  BLOCK_T=_pow2(T), num_warps=1)


@triton.jit
def _next_draft_kernel(d_ptr, drafts_ptr, start_ptr, ids_ptr, feats_ptr, hidden_ptr, j, H, stride_dr, stride_f,
                       stride_h, BLOCK_H: tl.constexpr):
    r = tl.program_id(0)
    d = tl.load(d_ptr + r)
    tl.store(drafts_ptr + r * stride_dr + j, d)
    tl.store(ids_ptr + r, d)
    tl.store(start_ptr + r, tl.load(start_ptr + r) + 1)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        tl.store(feats_ptr + r * stride_f + h, tl.load(hidden_ptr + r * stride_h + h, mask=h < H), mask=h < H)


def next_draft(d, drafts, j: int, start, ids, feats, hidden, R: int) -> None:
    """For R rows: drafts[:, j] = d, ids[:R] = d (a T = 1 forward's tokens), start[:R] += 1, feats[:R] = hidden[:R]."""
    H = feats.shape[1]
    if R:
        _next_draft_kernel[(R,)](d, drafts, start, ids, feats, hidden, j, H, drafts.stride(0), feats.stride(0),
                                 hidden.stride(0), BLOCK_H=min(_pow2(H), 1024), num_warps=4)


# ---------------------------------------------------------------------------------------------
# rotary embedding + KV store

@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache, v_cache, qw_ptr, kw_ptr, eps,
                       stride_t, stride_ct, stride_kslot, stride_kh, stride_vslot, stride_vh,
                       H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + pos * stride_ct + i, mask=i_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_ct + i, mask=i_ok, other=0.0)
    h = tl.arange(0, BLOCK_H)
    base = qkv_ptr + t * stride_t
    # q heads then k heads: rotate in place; k heads also go to the cache
    hq_ok = h < H + KV
    ok = hq_ok[:, None] & i_ok[None, :]
    p1 = base + h[:, None] * D + i[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    if NORM:        # Qwen3's per-head q/k RMSNorm first, rounded as `_head_rms_norm_kernel` rounds it
        dt = qkv_ptr.dtype.element_ty
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        is_q = (h < H)[:, None]
        w1 = tl.where(is_q, tl.load(qw_ptr + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + i, mask=i_ok, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :])
        x1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(qkv_ptr.dtype.element_ty)
    tl.store(p1, y1, mask=ok)
    tl.store(p1 + HALF, y2, mask=ok)
    kh = h - H
    is_k = (h >= H) & hq_ok
    kok = is_k[:, None] & i_ok[None, :]
    kp = k_cache + slot * stride_kslot + kh[:, None] * stride_kh + i[None, :]
    tl.store(kp, y1.to(k_cache.dtype.element_ty), mask=kok)
    tl.store(kp + HALF, y2.to(k_cache.dtype.element_ty), mask=kok)
    # v heads: a plain copy into the cache
    dd = tl.arange(0, BLOCK_D)
    vh = tl.arange(0, BLOCK_H)
    vok = (vh[:, None] < KV) & (dd[None, :] < D)
    v = tl.load(base + (H + KV) * D + vh[:, None] * D + dd[None, :], mask=vok, other=0.0)
    tl.store(v_cache + slot * stride_vslot + vh[:, None] * stride_vh + dd[None, :],
             v.to(v_cache.dtype.element_ty), mask=vok)


def rope_and_store(qkv, cos, sin, positions, slot_mapping, k_cache, v_cache, H: int, KV: int, D: int,
                   head_norms: tuple | None = None) -> None:
    """qkv [N, (H + 2 KV) * D] contiguous rows: rotate q and k in place, store k, v at `slot_mapping`
    (flat slots of caches [blocks, BS, KV, D]). cos, sin [max_pos, D // 2] float32. `head_norms` (q_weight,
    k_weight, eps): each q and k head's RMSNorm first (`head_rms_norm_`'s numbers, one kernel fewer)."""
    N = qkv.shape[0]
    if N == 0:
        return
    kf = k_cache.view(-1, KV, D)
    vf = v_cache.view(-1, KV, D)
    qw, kw, eps = head_norms or (qkv, qkv, 0.0)
    _rope_store_kernel[(N,)](qkv, cos, sin, positions, slot_mapping, kf, vf, qw, kw, float(eps),
                             qkv.stride(0), cos.stride(0), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
                             H=H, KV=KV, D=D, HALF=D // 2, BLOCK_H=_pow2(H + KV), BLOCK_HALF=_pow2(D // 2),
                             BLOCK_D=_pow2(D), NORM=head_norms is not None, num_warps=4, **pdl.options(qkv.device))


@triton.jit
def _rotate_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_h, stride_ct, HEADS, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    ok = (h[:, None] < HEADS) & (i[None, :] < HALF)
    dt = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_ct + i, mask=i < HALF, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_ct + i, mask=i < HALF, other=0.0).to(dt).to(tl.float32)[None, :]
    p1 = x_ptr + t.to(tl.int64) * stride_t + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(dt), mask=ok)
    tl.store(p1 + HALF, (x2 * c + x1 * s).to(dt), mask=ok)


def rotate_(x, cos, sin, positions) -> None:
    """x [N, heads, rot] (any token and head strides, unit last stride), rotated in place by each token's
    position (rotate-half pairs); cos, sin [max_pos, rot // 2] float32, rounded to x's dtype as `ops.rotate`."""
    N, heads, rot = x.shape
    if N:
        _rotate_kernel[(N,)](x, cos, sin, positions, x.stride(0), x.stride(1), cos.stride(0), heads, rot // 2,
                             BLOCK_H=_pow2(heads), BLOCK_HALF=_pow2(rot // 2), num_warps=4 if heads > 16 else 1,
                             **pdl.options(x.device))


# ---------------------------------------------------------------------------------------------
# norms and the MLP activation

@triton.jit
def _add_residual(x, res_ptr, c, ok):
    """residual += x at columns c of one row (res_ptr: the row's start), stored rounded as HF rounds the stream;
    returns the new residual."""
    x = (x.to(tl.float32) + tl.load(res_ptr + c, mask=ok, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + c, x, mask=ok)
    return x


@triton.jit
def _normed(x, w_ptr, dt_ptr, c, ok, n, eps):
    """weight * (x / rms(x)) of one row x [BLOCK] of n columns, rounded to dt_ptr's element type as HF rounds it."""
    dt = dt_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    y = (xf * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    return (w.to(tl.float32) * y.to(tl.float32)).to(dt)


@triton.jit
def _norm_row(x, w_ptr, out_ptr, c, ok, n, eps):
    """out = weight * (x / rms(x)) of one row x [BLOCK] of n columns (out_ptr: the row's start)."""
    tl.store(out_ptr + c, _normed(x, w_ptr, out_ptr, c, ok, n, eps), mask=ok)


# `moe_kernels._sum_add_norm_kernel` shares these two steps (and `norm_warps`): its norms round as these do
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, s_ptr, q_ptr, stride_x, stride_r, stride_o, stride_s, stride_q,
                     n, eps, HAS_RES: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    if HAS_RES:
        x = _add_residual(x, res_ptr + row * stride_r, c, ok)
    if QUANT == 1:  # the output as x's dtype rounds it, stored quantized for an FP8 linear (fp8_kernels.FP8Activation)
        store_quantized(_normed(x, w_ptr, x_ptr, c, ok, n, eps), out_ptr + row * stride_o, s_ptr + row * stride_s, 0,
                        n, BLOCK)
    elif QUANT == 2:    # both: the output, and quantized at q_ptr / s_ptr
        y = _normed(x, w_ptr, out_ptr, c, ok, n, eps)
        tl.store(out_ptr + row * stride_o + c, y, mask=ok)
        store_quantized(y, q_ptr + row * stride_q, s_ptr + row * stride_s, 0, n, BLOCK)
    else:
        _norm_row(x, w_ptr, out_ptr + row * stride_o, c, ok, n, eps)


@triton.jit
def _embed_norm_pair_kernel(ids_ptr, embed_ptr, ew_ptr, f_ptr, fw_ptr, out_ptr, stride_e, stride_f, stride_o, n, eps,
                            BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < n
    tok = tl.load(ids_ptr + t).to(tl.int64)
    _norm_row(tl.load(embed_ptr + tok * stride_e + c, mask=ok, other=0.0), ew_ptr, out_ptr + t * stride_o, c, ok, n,
              eps)
    _norm_row(tl.load(f_ptr + t * stride_f + c, mask=ok, other=0.0), fw_ptr, out_ptr + t * stride_o + n, c, ok, n,
              eps)


def embed_norm_pair(ids, embed, embed_weight, feats, feats_weight, eps: float):
    """[rms_norm(embed[ids]) | rms_norm(feats)] ([N, 2 h]; an MTP layer's input before eh_proj) in one kernel, the
    numbers of rms_norm(F.embedding(ids, embed), ...) and rms_norm(feats, ...) side by side."""
    N, n = feats.shape
    out = torch.empty((N, 2 * n), dtype=feats.dtype, device=feats.device)
    if N:
        _embed_norm_pair_kernel[(N,)](ids, embed, embed_weight, feats, feats_weight, out, embed.stride(0),
                                      feats.stride(0), out.stride(0), n, eps, BLOCK=_pow2(n), num_warps=norm_warps(n))
    return out


def norm_warps(n: int) -> int:
    return 4 if n <= 4096 else 8


def rms_norm(x, weight, eps: float, residual=None, quantize: bool | str = False):
    """y = weight * (x / rms(x)); with `residual`: residual += x first (in place) and x = residual. `quantize` (x's
    columns a multiple of 128): y as x's dtype rounds it, returned quantized for an FP8 linear instead
    (fp8_kernels.FP8Activation: quantize_activations(y)'s numbers); "both": that FP8Activation with y itself as its
    `plain` (a sparse MLP's router reads y, its FP8 experts the quantized copy)."""
    N, n = x.shape
    mode = 2 if quantize == "both" else 1 if quantize else 0
    if mode:
        q, scales = quantized_rows(N, n, x.device)
        out = q if mode == 1 else torch.empty_like(x)
    else:
        out = q = scales = torch.empty_like(x)
    if N:
        res = residual if residual is not None else x
        _rms_norm_kernel[(N,)](x, res, weight, out, scales, q, x.stride(0), res.stride(0), out.stride(0),
                               scales.stride(0), q.stride(0), n, eps, HAS_RES=residual is not None, QUANT=mode,
                               BLOCK=_pow2(n), num_warps=norm_warps(n), **pdl.options(x.device))
    if mode == 2:
        return FP8Activation(q, scales, x.dtype, plain=out)
    return FP8Activation(out, scales, x.dtype) if mode else out


@triton.jit
def _head_rms_norm_kernel(x_ptr, qw_ptr, kw_ptr, stride_t, eps, H, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    ptr = x_ptr + t * stride_t + h * D + d
    x = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    y = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)).to(x_ptr.dtype.element_ty)
    is_q = (d * 0 + h) < H                                                # a query head's weight or a key's
    w = (tl.load(qw_ptr + d, mask=ok & is_q, other=0.0).to(tl.float32)
         + tl.load(kw_ptr + d, mask=ok & ~is_q, other=0.0).to(tl.float32))
    tl.store(ptr, (w * y.to(tl.float32)).to(x_ptr.dtype.element_ty), mask=ok)


def head_rms_norm_(qkv, q_weight, k_weight, H: int, KV: int, D: int, eps: float) -> None:
    """In place over qkv [N, (H + 2 KV) * D] (unit last stride): each of the H query heads' RMSNorm with q_weight
    [D], each of the KV key heads' with k_weight (Qwen3's per-head q/k norms), rounded as `rms_norm` rounds."""
    N = qkv.shape[0]
    if N:
        _head_rms_norm_kernel[(N, H + KV)](qkv, q_weight, k_weight, qkv.stride(0), eps, H, D=D, BLOCK_D=_pow2(D),
                                           num_warps=1 if D <= 256 else 4, **pdl.options(qkv.device))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_ptr, stride_x, stride_o, stride_s, n, QUANT: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK
    c = c0 + tl.arange(0, BLOCK)
    ok = c < n
    dt = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + c, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    if QUANT:       # whole 128-column groups in each program (BLOCK and n multiples of 128)
        store_quantized((act * up).to(dt), out_ptr + row * stride_o, s_ptr + row * stride_s, c0, n, BLOCK)
    else:
        tl.store(out_ptr + row * stride_o + c, (act * up).to(dt), mask=ok)


def silu_and_mul(x, quantize: bool = False):
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I]; `quantize` (I a multiple of 128): returned quantized for
    an FP8 linear (fp8_kernels.FP8Activation: quantize_activations' numbers of that output in x's dtype)."""
    N, two = x.shape
    n = two // 2
    if quantize:
        out, scales = quantized_rows(N, n, x.device)
    else:
        out = scales = torch.empty((N, n), dtype=x.dtype, device=x.device)
    if N:
        BLOCK = min(_pow2(n), 1024)
        _silu_mul_kernel[(N, triton.cdiv(n, BLOCK))](x, out, scales, x.stride(0), out.stride(0), scales.stride(0), n,
                                                      QUANT=quantize, BLOCK=BLOCK, num_warps=4,
                                                      **pdl.options(x.device))
    return FP8Activation(out, scales, x.dtype) if quantize else out
