"""The rotary / norm and routed-expert Triton kernels under Triton's interpreter (TRITON_INTERPRET=1, CPU) against
the torch paths CPU runs: Qwen3's per-head q/k norms inside the rotary-and-store kernel, the routed experts with
a token's experts partly held elsewhere (expert parallelism) through both align kernels, the routing kernels
(router logits, the small align, softmax top-k fused with it), the routed sum fused with the residual add and the
next norm, RMSNorm, silu_and_mul and paged attention writing their output quantized for an FP8 linear, the one-row
output projection's matrix-vector kernel (`gemv_kernels`), a step's input copies and
logits argmax (`set_rows`, `argmax`), and paged attention with its keys split over several programs. float32 (the interpreter's
bf16 dot is not the GPU's: tests/test_gpu.py checks bf16 there). Its one interpreter process also runs the checks
other modules keep beside their tests (`CHECKS`: the feed kernels, the GEMV, EAGLE's head inputs, the FP8 GEMM)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def interpreted_checks() -> None:
    from specdp_cli.runtime import ops, triton_kernels as tk
    from specdp_cli.runtime.models.moe import MoE
    from specdp_cli.runtime.moe_kernels import routed_experts

    g = torch.Generator().manual_seed(0)
    H, KV, D, BS, NB = 4, 2, 64, 16, 12
    qkv = torch.randn(9, (H + 2 * KV) * D, generator=g)
    qw, kw = torch.randn(D, generator=g), torch.randn(D, generator=g)
    cos, sin = torch.randn(200, D // 2, generator=g), torch.randn(200, D // 2, generator=g)
    pos, slots = torch.randint(0, 200, (9,), generator=g), torch.randperm(NB * BS, generator=g)[:9]
    for norms in (None, (qw, kw, 1e-6)):
        ref, kc, vc = qkv.clone(), torch.zeros(NB, BS, KV, D), torch.zeros(NB, BS, KV, D)
        ops.rope_and_store(ref, cos, sin, ops.AttnMeta(pos, slots, None), kc, vc, H, KV, D, norms)   # torch path
        out, k2, v2 = qkv.clone(), torch.zeros_like(kc), torch.zeros_like(vc)
        tk.rope_and_store(out, cos, sin, pos, slots, k2, v2, H, KV, D, norms)
        for a, b in ((out, ref), (k2, kc), (v2, vc)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (norms is not None, (a - b).abs().max())

    hidden, inter, E, K = 64, 32, 16, 4
    gate_up, down = torch.randn(E, 2 * inter, hidden, generator=g) / 8, torch.randn(E, hidden, inter, generator=g) / 8
    moe = MoE(None, gate_up, down, True, range(E))
    for N in (5, 40):                          # 20 pairs: the small align; 160: `_align_kernel`
        x = torch.randn(N, hidden, generator=g)
        w = torch.rand(N, K, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        idx[1, 2], idx[3, 0] = -1, E + 2                      # experts held on another rank
        ref = torch.zeros_like(x)
        for t in range(N):
            for j in range(K):
                e = int(idx[t, j])
                if 0 <= e < E:
                    a = x[t] @ gate_up[e].T
                    ref[t] += w[t, j] * ((torch.nn.functional.silu(a[:inter]) * a[inter:]) @ down[e].T)
        out = routed_experts(x, w, idx, gate_up, down)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (N, (out - ref).abs().max())
        assert torch.allclose(out, moe.routed_reference(x, w, idx), rtol=1e-5, atol=1e-5), N
    fp8_expert_checks(g)
    routing_checks(g)
    one_row_checks(g)
    fused_sum_checks(g)
    fused_quant_checks(g)
    add_norm_checks(g)
    step_trim_checks(g)
    attention_checks(g)
    attention_quant_checks(g)
    print("interpreted kernels: ok")


def fp8_expert_checks(g: torch.Generator) -> None:
    """FP8 routed experts (models/quant.FP8Weight) in both kernels' modes: weight-only (the plain tile) against the
    dequantized weights, and W8A8 transposed (the tile's W8A8T: activations quantized per row and 128 columns in the
    kernels) against the dequantized weights times quantize_activations' values; an intermediate size with a partial
    last group (192) and one below a group (64), experts held elsewhere."""
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks
    from specdp_cli.runtime.moe_kernels import routed_pairs

    def quantized(a):
        q, s = fk.quantize_activations(a)
        return q.float() * s.repeat_interleave(128, 1)[:, :a.shape[1]]

    for E, H, inter, N, K in ((4, 256, 192, 3, 2), (3, 128, 64, 2, 2)):
        gate_up = FP8Weight(*quantize_blocks(torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5), 128,
                            torch.float32)
        down = FP8Weight(*quantize_blocks(torch.randn(E, H, inter, generator=g) * inter ** -0.5), 128, torch.float32)
        x = torch.randn(N, H, generator=g)
        w = torch.rand(N, K, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        idx[1, 0] = E + 1                                       # held on another rank: its row is not written
        gu, dn = gate_up.dequantize(torch.float32), down.dequantize(torch.float32)
        tile = dict(BLOCK_M=16, UP_N=64, DOWN_N=64, BLOCK_K=128, warps=4, stages=2)
        x_q = fk.FP8Activation(*fk.quantize_activations(x), torch.float32)
        # W8A8 transposed also with x quantized before (`x_q`, as the RMSNorm before the experts writes it)
        for w8a8t, quant, xq in ((False, lambda a: a, None), (True, quantized, None), (True, quantized, x_q)):
            y = routed_pairs(x, w, idx, gate_up, down, tile=dict(tile, W8A8T=w8a8t), x_q=xq)
            for p in range(N * K):
                t, e = p // K, int(idx[p // K, p % K])
                if e >= E:
                    continue
                h = quant(x[t:t + 1]) @ gu[e].T
                want = w[t, p % K] * (quant(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ dn[e].T)[0]
                assert torch.allclose(y[p], want, rtol=1e-4, atol=1e-5), (w8a8t, xq is not None, E, H, inter, p,
                                                                           (y[p] - want).abs().max())


def attention_checks(g: torch.Generator) -> None:
    """`triton_kernels.paged_attention` against the torch reference, the single pass (splits=1) and the keys split
    over 2, 3 and 5 programs a (row, KV head) with the combine kernel: rows of 133, 7 and 84 keys (BLOCK_N 64: the
    7-key row leaves every part but the first empty, the others some), GQA (4 query heads on 2 KV heads), T 1 and
    3, values narrower than keys, a sliding window (the first key rounded down to BLOCK_N), sink logits (counted
    once, in the combine). `attention_splits`' choice at a few sizes."""
    from specdp_cli.runtime import ops, triton_kernels as tk

    H, KV, D, BS = 4, 2, 64, 16
    bt = torch.zeros(3, 10, dtype=torch.int32)
    perm = torch.randperm(19, generator=g) + 1
    bt[0, :9], bt[1, :1], bt[2, :6] = perm[:9], perm[9:10], perm[10:16]
    for DV, T, window, sinks in ((64, 1, None, None), (64, 3, 20, torch.randn(H, generator=g) * 3),
                                 (32, 3, None, torch.randn(H, generator=g)), (32, 1, 40, None)):
        kc, vc = torch.randn(20, BS, KV, D, generator=g), torch.randn(20, BS, KV, DV, generator=g)
        p = (torch.tensor([130, 4, 81])[:, None] + torch.arange(T)[None]).view(-1)
        q = torch.randn(3 * T, 2 * H, D, generator=g)[:, ::2]          # strided heads
        meta = ops.AttnMeta(p, None, bt, T)
        ref = ops._attention_reference(q, kc, vc, meta, 0.1, window, sinks)
        for S in (1, 2, 3, 5):
            out = torch.full((3 * T, H, 2 * DV), float("nan"))[..., :DV]    # strided out
            tk.paged_attention(q, kc, vc, out, p, bt, T, 0.1, window, sinks, splits=S)
            assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (DV, T, window, S, (out - ref).abs().max())
    # batch 1 of an 8B model on 132 SMs: 16 parts; a short table or a window caps them; a full GPU: one pass
    assert tk.attention_splits(1, 8, 1, 32, 128, 8192, 64, 132) == 16
    assert tk.attention_splits(4, 8, 4, 32, 128, 8192, 64, 132) == 5
    assert tk.attention_splits(1, 8, 1, 32, 128, 192, 64, 132) == 3
    assert tk.attention_splits(64, 8, 1, 32, 128, 8192, 64, 132) == 1
    assert tk.attention_splits(1, 8, 1, 32, 128, 8192, 64, 0) == 1


def attention_quant_checks(g: torch.Generator) -> None:
    """Paged attention writing its output quantized for an FP8 o (`quantized`, 128-wide values: one group a head)
    gives exactly quantize_activations' fp8 values and scales of its plain output viewed [N, H * DV]: the single pass
    (the attention kernel writes them) and the keys split (the combine kernel does), T 1 and 3, a zero head (scale
    1e-12), bf16 and float32 (kernel against kernel)."""
    from specdp_cli.runtime import fp8_kernels as fk, triton_kernels as tk

    H, KV, D, DV, BS = 4, 2, 32, 128, 16
    bt = torch.tensor([[3, 1, 4, 0], [2, 5, 0, 0]], dtype=torch.int32)
    for dtype, T, S in ((torch.bfloat16, 1, 1), (torch.bfloat16, 3, 2), (torch.float32, 3, 2)):
        kc = torch.randn(6, BS, KV, D, generator=g).to(dtype)
        vc = (torch.randn(6, BS, KV, DV, generator=g) * 3).to(dtype)
        vc[..., 1, :] = 0                                   # KV head 1's values: its query heads' outputs are 0
        p = (torch.tensor([50, 20])[:, None] + torch.arange(T)[None]).view(-1)
        q = torch.randn(2 * T, H, D, generator=g).to(dtype)
        out = torch.empty(2 * T, H, DV, dtype=dtype)
        tk.paged_attention(q, kc, vc, out, p, bt, T, 0.1, None, None, splits=S)
        values, scales = fk.quantized_rows(2 * T, H * DV, q.device)
        tk.paged_attention(q, kc, vc, out[:1], p, bt, T, 0.1, None, None, splits=S, quantized=(values, scales))
        want_q, want_s = fk.quantize_activations(out.reshape(2 * T, H * DV))
        assert torch.equal(values.float(), want_q.float()) and torch.equal(scales, want_s), (dtype, T, S)
        assert (scales[:, 2:] == 1e-12).all()


def fused_quant_checks(g: torch.Generator) -> None:
    """RMSNorm (with and without the residual add) and silu_and_mul writing their output quantized for an FP8 linear
    (`quantize=True`, fp8_kernels.FP8Activation) give exactly quantize_activations' fp8 values and scales of their
    plain output, and the same residual; float32 and bf16 (kernel against kernel, so the interpreter's own float8 and
    bf16 rounding is on both sides); M 1 and 5; widths that are not a power of two (a norm block partly past the row,
    silu_and_mul's last 1024-column block partly past it). The FP8 GEMM reading it equals fp8_linear of the plain
    output, through ops.linear and an FP8Weight. RMSNorm's "both" (quantized and plain) the same numbers."""
    from specdp_cli.runtime import fp8_kernels as fk, ops, triton_kernels as tk
    from specdp_cli.runtime.models.quant import FP8Weight, quantize_blocks

    for dtype in (torch.float32, torch.bfloat16):
        for M, n in ((1, 384), (5, 256), (5, 1152)):
            x, w = torch.randn(M, n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
            x[0, :128] *= 1e-3                                  # groups of very different scales
            if M > 1:
                x[1, 128:256] = 0                               # an all-zero group (scale 1e-12)
            res = (torch.randn(M, n, generator=g) * 4).to(dtype)
            for r in (None, res):
                r_plain, r_fused = (None, None) if r is None else (r.clone(), r.clone())
                plain = tk.rms_norm(x, w, 1e-6, r_plain)
                fused = tk.rms_norm(x, w, 1e-6, r_fused, quantize=True)
                q, s = fk.quantize_activations(plain)
                assert isinstance(fused, fk.FP8Activation) and fused.dtype == dtype, type(fused)
                assert fused.q.dtype == torch.float8_e4m3fn and fused.q.shape == (M, n) and fused.scale.shape == s.shape
                assert torch.equal(fused.q.float(), q.float()) and torch.equal(fused.scale, s), (dtype, M, n, r is None)
                if r is not None:
                    assert torch.equal(r_fused, r_plain), (dtype, M, n)
                # "both" (the norm before FP8 routed experts): the plain output too, from the same residual add
                r_both = None if r is None else r.clone()
                both = tk.rms_norm(x, w, 1e-6, r_both, quantize="both")
                assert isinstance(both, fk.FP8Activation) and torch.equal(both.plain, plain), (dtype, M, n)
                assert torch.equal(both.q.float(), q.float()) and torch.equal(both.scale, s), ("both", dtype, M, n)
                if r is not None:
                    assert torch.equal(r_both, r_plain), ("both", dtype, M, n)
            gu = (torch.randn(M, 2 * n, generator=g) * 3).to(dtype)
            plain = tk.silu_and_mul(gu)
            fused = tk.silu_and_mul(gu, quantize=True)
            q, s = fk.quantize_activations(plain)
            assert isinstance(fused, fk.FP8Activation) and fused.dtype == dtype
            assert torch.equal(fused.q.float(), q.float()) and torch.equal(fused.scale, s), ("silu", dtype, M, n)
            wq, ws = quantize_blocks(torch.randn(136, n, generator=g))    # two row blocks of scales
            weight = FP8Weight(wq, ws, 128, dtype)
            want = fk.fp8_linear(plain, wq, ws, 128)
            got = ops.linear(fused, weight)
            assert got.dtype == dtype and torch.equal(got, want), ("linear", dtype, M, n)


def add_norm_checks(g: torch.Generator) -> None:
    """An FP8 GEMM joining its output to the residual stream and handing the next FP8 linear the stream's RMSNorm
    (fp8_kernels.fp8_linear_add_norm, `add_norm`), then that linear applying each row's 1 / rms (RSTD): the residual
    equals `residual + y` of the plain GEMM's output, the handed values are quantize_activations' of norm * residual,
    the squares' partial sums the residual's, and the next linear's output the plain GEMM on the dequantized
    activations scaled by 1 / rms; split K summed by the tile's last program and by torch (no ticket counters:
    graph capture), with a bias, the residual and norm weight loaded before the main loop (ADD_NORM_EARLY); float32
    (the interpreter's float8 on both sides). M 1 and 5."""
    from specdp_cli.runtime import fp8_kernels as fk
    from specdp_cli.runtime.models.quant import quantize_blocks

    K, N, N2, eps = 256, 256, 384, 1e-5
    w1q, w1s = quantize_blocks(torch.randn(N, K, generator=g) / 16)
    w2q, w2s = quantize_blocks(torch.randn(N2, N, generator=g) / 16)
    bias = torch.randn(N, generator=g)
    norm = torch.rand(N, generator=g) + 0.5
    for M in (1, 5):
        x_q, x_s = fk.quantize_activations(torch.randn(M, K, generator=g))
        residual = torch.randn(M, N, generator=g) * 3
        y = fk.block_fp8_gemm(x_q, w1q, w1s, 128, bias, x_scale=x_s, out_dtype=torch.float32)
        res = residual.clone()
        act = fk.fp8_linear_add_norm(fk.FP8Activation(x_q, x_s, torch.float32), w1q, w1s, 128, bias, res, norm, eps)
        assert torch.allclose(res, residual + y, rtol=1e-5, atol=1e-5), (M, (res - residual - y).abs().max())
        q, s = fk.quantize_activations(res * norm)
        assert torch.equal(act.q.float(), q.float()) and torch.equal(act.scale, s), M
        assert torch.allclose(act.sumsq, (res * res).view(M, -1, 128).sum(-1), rtol=1e-5), M
        rstd = torch.rsqrt((res * res).mean(1, keepdim=True) + eps)
        assert torch.allclose(act.dequantize(), (q.float() * s.repeat_interleave(128, 1)) * rstd, rtol=1e-5), M
        want = fk.block_fp8_gemm(q, w2q, w2s, 128, x_scale=s, out_dtype=torch.float32) * rstd
        got = fk.fp8_linear(act, w2q, w2s, 128)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (M, (got - want).abs().max())
        # split K: the tile's last program sums (ticket counters), or torch does (none: graph capture); the residual
        # and norm weight loaded before the main loop (EARLY): the same numbers
        tile = dict(BLOCK_M=16, BLOCK_N=128, SPLIT=2, warps=4, stages=2, GROUP_M=1, SWAP=True)
        outs = []
        for tickets, early in ((True, False), (False, False), (True, True)):
            fk.SPLITK_TICKETS = tickets
            try:
                r, qo, so = residual.clone(), *fk.quantized_rows(M, N, x_q.device)
                ss = torch.empty(M, N // 128)
                fk.block_fp8_gemm(x_q, w1q, w1s, 128, bias, x_scale=x_s, out_dtype=torch.float32,
                                  tile=dict(tile, EARLY=early), add_norm=(r, norm, qo, so, ss))
            finally:
                fk.SPLITK_TICKETS = True
            outs.append((r, qo.float(), so, ss))
        assert torch.allclose(outs[0][0], residual + y, rtol=1e-5, atol=1e-5), M
        for other in outs[1:]:
            assert torch.equal(outs[0][0], other[0]) and torch.equal(outs[0][1], other[1]), M
            assert torch.equal(outs[0][2], other[2]) and torch.allclose(outs[0][3], other[3], rtol=1e-6), M
        assert torch.equal(outs[0][3], outs[2][3]), M         # EARLY: the squares summed by the same kernel code


def step_trim_checks(g: torch.Generator) -> None:
    """ModelRunner.set_rows' one kernel (`triton_kernels.set_rows`) against its torch copies: strided sources (the
    staged step table's columns), some arguments only, a bool n_real; `argmax` against torch.argmax: ties (in one
    block, across blocks in one lane, in the last block), V not a multiple of the block, an all -inf row, 2-D,
    3-D and a strided window column."""
    from specdp_cli.runtime import triton_kernels as tk
    from specdp_cli.runtime.model_runner import ModelRunner

    R, T, table = 3, 4, torch.randint(0, 1000, (5, 20), generator=g)
    runners = []
    for kernel in (None, tk.set_rows):
        r = ModelRunner.__new__(ModelRunner)
        r.ids, r.start, r.n_real, r.out_start = (torch.full((n,), -7) for n in (5 * T, 5, 5, 5))
        r._set_rows = kernel
        runners.append(r)
    for args, kw in (((table[:R, 2:2 + T], table[:R, 12], table[:R, 13], table[:R, 14]), {}),
                     ((table[:R, 1:3],), dict(n_real=table[:R, 3] > 500)),
                     ((), dict(start=table[:R, 5] - 1, out_start=table[:R, 9])),
                     ((table[:R, 7].view(R, 1),), {})):
        for r in runners:
            r.set_rows(R, *args, **kw)
        for a, b in zip(*((r.ids, r.start, r.n_real, r.out_start) for r in runners)):
            assert torch.equal(a, b), (kw, a, b)

    V = 20000                                   # blocks of 8192: the last one partly past V
    x = torch.randn(2, 3, V, generator=g)
    x[0, 0, [5, 700, 9000]] = 9.0               # ties within a block and across blocks (the first wins)
    x[0, 1, [8192 + 3, 3]] = 9.0                # the same lane in two blocks
    x[1, 2, [V - 1, V - 2]] = 9.0               # in the last, partial block
    x[1, 0] = float("-inf")
    for t in (x, x.view(6, V), x[:, 1], x[1, 2], torch.randn(4, 1000, generator=g).round()):    # rounded: many ties
        assert torch.equal(tk.argmax(t), t.argmax(-1)), (t.shape, tk.argmax(t), t.argmax(-1))


def one_row_checks(g: torch.Generator) -> None:
    """The matrix-vector kernel `ops.linear_one_row` runs on CUDA for the attention output projection at one row,
    with the default tile it takes on Qwen3-30B-A3B's o shape [2048 x 4096] (4 rows a program, K in 1024s), over
    256 of its rows (the programs are alike: 64 of them check it as well as 512, in an eighth of the interpreter's
    time)."""
    import torch.nn.functional as F
    from specdp_cli.runtime import gemv_kernels

    tile = gemv_kernels.default_tile(1, 2048, 4096)
    assert tile == (4, 1024, 4, 3, False), tile
    x, w = torch.randn(1, 4096, generator=g), torch.randn(256, 4096, generator=g) / 64
    out = gemv_kernels.gemv(x, w, tile=tile)
    assert out.shape == (1, 256) and torch.allclose(out, F.linear(x, w), rtol=1e-5, atol=1e-5), \
        (out - F.linear(x, w)).abs().max()


def fused_sum_checks(g: torch.Generator) -> None:
    """The routed pairs' sum fused with the residual add and the next RMSNorm (`_sum_add_norm_kernel`) equals
    the sum kernel then rms_norm: top_k 8 over hidden 2048, non-powers of two, pairs held elsewhere (their rows of y
    hold garbage the sum must skip); without a norm, the residual add alone; the norm quantized for an FP8 linear
    (quantize_activations' values and scales of the plain norm). Also bf16, kernel against kernel (the interpreter
    rounds to bf16 by truncation, not as torch does)."""
    from specdp_cli.runtime import moe_kernels as mk, triton_kernels as tk

    for N, K, E, H, dtype in ((1, 8, 128, 2048, torch.float32), (3, 8, 64, 2048, torch.float32),
                              (4, 2, 8, 1000, torch.float32), (2, 3, 10, 7168, torch.float32),
                              (3, 8, 64, 2048, torch.bfloat16)):
        y = torch.randn(N * K, H, generator=g).to(dtype)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        idx[0, 1], idx[-1, 0] = -1, E + 3                     # experts held on another rank
        res, w = torch.randn(N, H, generator=g).to(dtype), torch.randn(H, generator=g).to(dtype)
        want_res = res.clone()
        want = tk.rms_norm(mk.sum_pairs(y, idx, E), w, 1e-6, want_res)
        got_res = res.clone()
        got = mk.sum_add_rms_norm(y, idx, E, got_res, w, 1e-6)
        assert torch.equal(got_res, want_res), (N, K, H, (got_res - want_res).abs().max())
        assert torch.equal(got, want), (N, K, H, (got - want).abs().max())
        got_res = res.clone()
        assert mk.sum_add_rms_norm(y, idx, E, got_res, None, 1e-6) is None
        assert torch.equal(got_res, want_res), (N, K, H)
        if H % 128 == 0:        # quantized for an FP8 linear: quantize_activations' numbers of the plain norm
            from specdp_cli.runtime import fp8_kernels as fk
            got_res = res.clone()
            fused = mk.sum_add_rms_norm(y, idx, E, got_res, w, 1e-6, quantize=True)
            q, sc = fk.quantize_activations(want)
            assert isinstance(fused, fk.FP8Activation) and fused.dtype == dtype and torch.equal(got_res, want_res)
            assert torch.equal(fused.q.float(), q.float()) and torch.equal(fused.scale, sc), ("quantized", N, H)


def check_grouping(idx: torch.Tensor, E: int, block_m: int, pairs: torch.Tensor, block_expert: torch.Tensor) -> None:
    """pairs / block_expert group the held pairs of idx [P] (outside [0, E): held elsewhere) as moe_kernels says:
    each held pair once, in a block of its expert; blocks of at most block_m pairs, padded with P; -1 past the
    used blocks, as many as the experts' counts need."""
    P = idx.numel()
    used = int((block_expert >= 0).sum())
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all(), block_expert
    held = (idx >= 0) & (idx < E)
    counts = torch.bincount(idx[held], minlength=E)
    assert used == int(((counts + block_m - 1) // block_m).sum()), (used, counts)
    slots = pairs[:used * block_m].view(used, block_m)
    assert ((slots >= 0) & (slots <= P)).all(), slots            # pair ids or the sentinel: no stale slots
    real = slots != P
    assert (idx[slots.clamp(max=P - 1)][real] == block_expert[:used, None].expand_as(slots)[real]).all()
    assert torch.equal(slots[real].sort().values, torch.arange(P)[held])      # each held pair exactly once


def routing_checks(g: torch.Generator) -> None:
    """The router's matrix-vector kernel against F.linear; the small align (random experts with repeats, some held
    elsewhere, P not a power of 2) and `_align_kernel` give valid groupings; softmax top-k fused with the align
    chooses as the torch reference does."""
    import torch.nn.functional as F
    from specdp_cli.runtime import moe_kernels as mk

    for N, E, H, kw in ((1, 128, 256, {}), (3, 24, 100, {}), (16, 128, 256, {}), (7, 30, 200, dict(block_e=4)),
                        (16, 8, 64, dict(block_e=2, block_k=32))):
        x, router = torch.randn(N, H, generator=g), torch.randn(E, H, generator=g)
        out = mk.router_logits(x, router, **kw)
        assert out.dtype == torch.float32 and torch.allclose(out, F.linear(x, router), rtol=1e-5, atol=1e-4), N
    x, router = torch.randn(5, 96, generator=g).to(torch.bfloat16), torch.randn(40, 96, generator=g)
    out = mk.router_logits(x, router, torch.float32)       # DeepSeek: bf16 activations, a float32 router
    assert out.dtype == torch.float32 and torch.allclose(out, F.linear(x.float(), router), rtol=1e-5, atol=1e-4)

    for P, E, bm in ((1, 8, 16), (37, 6, 16), (64, 128, 16), (100, 5, 16), (128, 12, 4), (128, 64, 16)):
        idx = torch.randint(-3, E + 3, (P,), generator=g)        # repeats, and experts held elsewhere
        max_blocks = mk.align_shape(P, E, bm)
        pairs = torch.full((max_blocks * bm,), -7, dtype=torch.int32)     # stale contents the kernel must not leave
        block_expert = torch.full((max_blocks,), -7, dtype=torch.int32)
        mk._align_small_kernel[(1,)](idx, pairs, block_expert, P, E, max_blocks, BLOCK_M=bm, P_BLOCK=mk._pow2(P),
                                     B_BLOCK=mk._pow2(max_blocks), PDL=False)
        check_grouping(idx, E, bm, pairs, block_expert)
        check_grouping(idx, E, bm, *mk.align(idx, E, bm))
    idx = torch.randint(-2, 12, (200,), generator=g)
    check_grouping(idx, 10, 16, *mk.align(idx, 10, 16))           # beyond SMALL_P: `_align_kernel`


# the checks of every module's interpreted kernels, in one interpreter process (its start-up is most of the time)
CHECKS = {"test_kernels_interpreted": "interpreted_checks", "test_async_scheduling": "interpreted_feed_checks",
          "test_gemv_decode": "interpreted_checks", "test_eagle": "interpreted_head_checks",
          "test_fp8": "interpreted_kernel_checks"}


class Interpreted:
    """The interpreter process running every module's `CHECKS` (one process: its start-up is most of the time),
    its output in files. It is one CPU-bound thread: `conftest.py` starts it with the session, at a lower CPU
    priority, so it runs on what the launches and servers of the modules before this one leave idle."""

    def __init__(self, niceness: int = 0):
        here = Path(__file__).parent
        code = (f"import sys, importlib; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}, "
                f"{str(here.parent / 'benchmarks')!r}]\n"
                f"for m, f in {CHECKS!r}.items(): getattr(importlib.import_module(m), f)()")
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                                     stdout=self.out, stderr=self.err, stdin=subprocess.DEVNULL,
                                     preexec_fn=(lambda: os.nice(niceness)) if niceness else None)

    def result(self, timeout: float) -> tuple[int, str, str]:
        """(returncode, stdout, stderr), at normal priority from now on where allowed; killed after `timeout`
        more seconds (subprocess.TimeoutExpired)."""
        try:
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, os.getpriority(os.PRIO_PROCESS, 0))
        except OSError:             # lowering a niceness needs privileges: it finishes at the lower priority
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.out.seek(0)
        self.err.seek(0)
        return self.proc.returncode, self.out.read(), self.err.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


AHEAD: list[Interpreted] = []       # the one conftest.py started with the session, if any


def test_kernels_under_the_triton_interpreter():
    run = AHEAD.pop() if AHEAD else Interpreted()
    code, out, err = run.result(timeout=300)
    assert code == 0 and out.count(": ok") == len(CHECKS), out + err
