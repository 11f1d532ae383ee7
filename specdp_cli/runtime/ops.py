"""The few operations a decoder layer needs beyond matrix products, over the paged KV cache.

Each has a plain-torch version (what CPU runs, written to round where Hugging Face's modules round,
so float32 outputs match transformers') and, on CUDA, a Triton kernel (`triton_kernels.py`) that
the GPU tests compare with it. `AttnMeta` describes one forward's token layout to attention.

Token layout of a forward: R rows of T tokens (row r owns tokens [r*T, (r+1)*T)); a row is a run
of one sequence's tokens at rising positions. Attention needs nothing but tensors, so a forward
can be captured in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    positions: torch.Tensor          # [N] long: position of each token in its sequence
    slot_mapping: torch.Tensor       # [N] long: flat cache slot each token's k, v go to (block * BS + offset)
    block_table: torch.Tensor        # [R, max_blocks] int32: row r's blocks (0, the trash block, past its end)
    T: int = 1                       # tokens per row (N = R * T)


def _triton():
    from . import triton_kernels
    return triton_kernels


def linear(x, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ bias): F.linear for a tensor; for an FP8 weight (models/quant.FP8Weight, kept FP8 only on CUDA
    devices with FP8) the W8A8 block-scaled GEMM of `fp8_kernels.py` (elsewhere: its dequantized copy). x may be
    the output of `rms_norm` / `silu_and_mul` / `act_and_mul` already quantized for w (fp8_kernels.FP8Activation,
    asked for where `fused_quant_wanted(.., w)`): the GEMM reads it as it is."""
    if not isinstance(x, torch.Tensor):                  # an FP8Activation (CUDA only)
        if isinstance(w, torch.Tensor):
            return F.linear(x.dequantize(), w, bias)
        from .fp8_kernels import fp8_linear
        return fp8_linear(x, w.weight, w.scale, w.rows, bias, w.cublas_scale)
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if x.is_cuda:
        from .fp8_kernels import fp8_linear
        return fp8_linear(x, w.weight, w.scale, w.rows, bias, w.cublas_scale)
    return F.linear(x, w.dequantize(x.dtype), bias)


def add_norm_wanted(x, w, next_w) -> bool:
    """Whether `linear_add_norm(x, w, ...)` may stand for linear(x, w) joining the residual stream and the stream's
    RMSNorm for the FP8 linear next_w (fp8_kernels.add_norm_wanted: x already quantized at decode sizes, on CUDA)."""
    if isinstance(x, torch.Tensor) or w is None or isinstance(w, torch.Tensor):
        return False
    from . import fp8_kernels
    return fp8_kernels.add_norm_wanted(x, w, next_w)


def linear_add_norm(x, w, bias: torch.Tensor | None, residual: torch.Tensor, norm: torch.Tensor, eps: float):
    """residual += linear(x, w, bias) (in place) and the stream's rms_norm(residual, norm, eps) for the next FP8
    linear, in the GEMM (where `add_norm_wanted`): fp8_kernels.fp8_linear_add_norm."""
    from .fp8_kernels import fp8_linear_add_norm
    return fp8_linear_add_norm(x, w.weight, w.scale, w.rows, bias, residual, norm, eps)


def fused_quant_wanted(x: torch.Tensor, w) -> bool:
    """Whether the norm / activation kernel reading x may hand `linear(.., w)` its output quantized (`quantize=True`
    of rms_norm, silu_and_mul, act_and_mul): w an FP8 weight kept FP8, x on CUDA at decode sizes
    (fp8_kernels.fused_quant_wanted). Never on CPU, where FP8 weights are dequantized at load."""
    if not x.is_cuda or w is None or isinstance(w, torch.Tensor):
        return False
    from . import fp8_kernels
    return fp8_kernels.fused_quant_wanted(x, w)


def attention_quant_wanted(dv: int) -> bool:
    """Whether paged attention with DV-wide values writes its output quantized (`paged_attention`'s `quantize`) for
    an FP8 o that `fused_quant_wanted` already takes quantized: one 128-column group a head
    (fp8_kernels.FUSE_ATTENTION_QUANT)."""
    from . import fp8_kernels
    return dv == fp8_kernels.GROUP and fp8_kernels.FUSE_ATTENTION_QUANT


def linear_one_row(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` for the attention output projection (o): one row by a plain bf16/fp16 weight (not FP8, not
    float32) of at most gemv_kernels.ONE_ROW_MAX_WEIGHT elements, no bias, on CUDA runs `gemv_kernels.gemv`;
    anything else `linear`. Decided by shapes and dtypes alone, so a CUDA graph captured at one row replays it."""
    # H200, one token: o [2048 x 4096] 8.7 vs cuBLAS 9.6 µs, [4096 x 4096] 12.0 vs 13.5 (cuBLAS adds a split-K reduce)
    if (isinstance(x, torch.Tensor) and x.is_cuda and x.shape[0] == 1 and bias is None and isinstance(w, torch.Tensor)
            and w.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype and w.stride(-1) == 1):
        from . import gemv_kernels
        if w.numel() <= gemv_kernels.ONE_ROW_MAX_WEIGHT:
            return gemv_kernels.gemv(x, w)
    return linear(x, w, bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (int64; ties: the smallest index) of x [..., V], a float dtype; on CUDA one Triton
    program a row (torch's reduction runs one row of a vocabulary in a single block: 5.6 µs on an H200 for 16k
    bf16 logits). NaN is not treated as torch treats it (the largest)."""
    if x.is_cuda:
        return _triton().argmax(x)
    return x.argmax(-1)


# ---------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool | str = False) -> torch.Tensor:
    """weight * x / rms(x), as transformers' Llama RMSNorm rounds it. With `residual`, first
    residual += x (in place, the layer's residual stream) and normalise that. `quantize` (only where
    `fused_quant_wanted(x, w)` for the FP8 linear w that alone reads the result): on CUDA the result comes quantized
    for it (fp8_kernels.FP8Activation, the numbers `linear` would make of the plain result); "both" (where
    moe.MoE.takes_quantized): that FP8Activation with the plain result as its `plain`; ignored on CPU."""
    if x.is_cuda:
        return _triton().rms_norm(x, weight, eps, residual, quantize)
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def head_rms_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, H: int, KV: int, D: int,
                   eps: float) -> None:
    """RMSNorm of each query head (q_weight [D]) and each key head (k_weight) of qkv [N, (H + 2 KV) * D], in
    place (Qwen3's per-head q/k norms)."""
    if qkv.is_cuda:
        _triton().head_rms_norm_(qkv, q_weight, k_weight, H, KV, D, eps)
        return
    N = qkv.shape[0]
    heads = qkv.view(N, H + 2 * KV, D)
    heads[:, :H] = rms_norm(heads[:, :H].reshape(N * H, D), q_weight, eps).view(N, H, D)
    heads[:, H:H + KV] = rms_norm(heads[:, H:H + KV].reshape(N * KV, D), k_weight, eps).view(N, KV, D)


def silu_and_mul(x: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """silu(gate) * up over x = [gate | up]. `quantize`: as rms_norm's (the result quantized for an FP8 linear on
    CUDA, where `fused_quant_wanted(x, w)`; ignored on CPU)."""
    if x.is_cuda:
        return _triton().silu_and_mul(x, quantize)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_and_mul(x: torch.Tensor, act: str, quantize: bool = False) -> torch.Tensor:
    """act(gate) * up over x = [gate | up]: "silu" (Llama's SwiGLU) or "gelu_tanh" (Gemma's GeGLU,
    transformers' gelu_pytorch_tanh). `quantize`: silu_and_mul's (gelu_tanh ignores it: a plain tensor)."""
    if act == "silu":
        return silu_and_mul(x, quantize)
    gate, up = x.chunk(2, dim=-1)
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown activation {act!r}")


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMeta,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, H: int, KV: int, D: int,
                   head_norms: tuple | None = None) -> None:
    """Rotate q and k of qkv [N, (H + 2 KV) * D] in place (rotate-half convention); store k and v
    into the caches [blocks, BS, KV, D] at meta.slot_mapping. cos, sin: [max_pos, rot // 2] float32, where
    rot = D, or with a partial rotary factor the leading rot dims of each head (the rest pass through).
    `head_norms` (q_weight, k_weight, eps): `head_rms_norm_` first (on CUDA in the same kernel)."""
    rot = 2 * cos.shape[-1]
    if qkv.is_cuda and rot == D:
        _triton().rope_and_store(qkv, cos, sin, meta.positions, meta.slot_mapping, k_cache, v_cache, H, KV, D,
                                 head_norms)
        return
    if head_norms is not None:
        q_weight, k_weight, eps = head_norms
        head_rms_norm_(qkv, q_weight, k_weight, H, KV, D, eps)
    x = qkv.view(qkv.shape[0], H + 2 * KV, D)
    rotate(x[:, :H + KV, :rot], cos, sin, meta.positions)
    store_kv(x[:, H:H + KV], x[:, H + KV:], meta, k_cache, v_cache)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate x [N, heads, D] in place by each token's position (rotate-half convention: dims i and
    i + D/2 form a pair). cos, sin: [max_pos, D // 2] float32. On CUDA one Triton kernel (x's last stride 1)."""
    if x.is_cuda and x.stride(-1) == 1:
        _triton().rotate_(x, cos, sin, positions)
        return
    half = x.shape[-1] // 2
    c = cos[positions].to(x.dtype).unsqueeze(1)
    s = sin[positions].to(x.dtype).unsqueeze(1)
    x1, x2 = x[..., :half].clone(), x[..., half:].clone()
    x[..., :half] = x1 * c - x2 * s
    x[..., half:] = x2 * c + x1 * s


def store_kv(k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Store k [N, KV, D] and v [N, KV, DV] into the caches [blocks, BS, KV, D(V)] at meta.slot_mapping.
    Plain torch on every device: no host sync, so a CUDA graph holds it."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    scale: float, window: int | None, sinks: torch.Tensor | None = None,
                    quantize: bool = False) -> torch.Tensor:
    """Causal attention of q [N, H, D] over the cache; returns [N, H, DV]. A token sees its own
    row's keys at positions <= its own (and within `window` when set). `sinks` [H]: a logit per head
    that joins each softmax's denominator and adds no value (GPT-OSS). `quantize` (DV 128, only where
    `fused_quant_wanted` for the FP8 o that alone reads it): on CUDA the result viewed [N, H * DV] comes quantized
    for o (fp8_kernels.FP8Activation); ignored on CPU."""
    N, H, D = q.shape
    DV = v_cache.shape[-1]
    if q.is_cuda:
        if quantize:
            from .fp8_kernels import FP8Activation, quantized_rows
            values, scales = quantized_rows(N, H * DV, q.device)
            _triton().paged_attention(q, k_cache, v_cache, q.new_empty((1, 1, DV)), meta.positions,
                                      meta.block_table, meta.T, scale, window, sinks, quantized=(values, scales))
            return FP8Activation(values, scales, q.dtype)
        out = torch.empty((N, H, DV), dtype=q.dtype, device=q.device)
        _triton().paged_attention(q, k_cache, v_cache, out, meta.positions, meta.block_table, meta.T, scale, window,
                                  sinks)
        return out
    return _attention_reference(q, k_cache, v_cache, meta, scale, window, sinks)


def _attention_reference(q, k_cache, v_cache, meta: AttnMeta, scale, window, sinks=None) -> torch.Tensor:
    N, H, D = q.shape
    _, BS, KV, DV = v_cache.shape
    G = H // KV
    R, T = meta.block_table.shape[0], meta.T
    if R == 0 or N == 0:
        return torch.zeros((N, H, DV), dtype=q.dtype, device=q.device)
    qpos = meta.positions.view(R, T)
    S = int(qpos.max()) + 1
    kpos = torch.arange(S, device=q.device)
    bt = meta.block_table.long()
    col = (kpos // BS).clamp(max=bt.shape[1] - 1)
    slots = bt[:, col] * BS + kpos % BS                              # [R, S]
    keys = k_cache.view(-1, KV, D)[slots].permute(0, 2, 1, 3)        # [R, KV, S, D]
    vals = v_cache.view(-1, KV, DV)[slots].permute(0, 2, 1, 3)
    # the G query heads sharing a KV head fold into the query length: no KV copies for GQA
    qg = q.reshape(R, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(R, KV, G * T, D)
    visible = kpos.view(1, 1, S) <= qpos.unsqueeze(-1)               # [R, T, S]
    if window:
        visible = visible & (qpos.unsqueeze(-1) - kpos.view(1, 1, S) < window)
    mask = visible.unsqueeze(1).expand(R, G, T, S).reshape(R, 1, G * T, S)
    if sinks is not None:
        o = _attention_with_sinks(qg, keys, vals, mask, scale, sinks.view(KV, G, 1).expand(KV, G, T).reshape(KV, G * T))
        return o.view(R, KV, G, T, DV).permute(0, 3, 1, 2, 4).reshape(N, H, DV)
    o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)
    return o.view(R, KV, G, T, DV).permute(0, 3, 1, 2, 4).reshape(N, H, DV)


def _attention_with_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax over each query's keys also holds a sink logit (`sinks` [KV, G * T], one per
    query row), which takes probability and gives nothing back, as GPT-OSS trains it (transformers' eager
    attention: the max subtracted over keys and sink together)."""
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    w = w.masked_fill(~mask, float("-inf"))
    both = torch.cat([w, sinks.to(w.dtype).unsqueeze(0).unsqueeze(-1).expand(w.shape[0], -1, -1, 1)], -1)
    both = both - both.max(dim=-1, keepdim=True).values
    probs = torch.softmax(both, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
