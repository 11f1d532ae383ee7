"""The decoder every family runs: a flat list of tokens from many sequences over a paged KV cache.

Why not the transformers modules themselves: a decode step must be one CUDA graph of a few fused
kernels per layer (q/k/v and gate/up are single matrix products; rotary embedding and the KV store
are one kernel; norms fuse the residual add). transformers is used for what it is the reference of:
the config (defaults of every family) and the rotary tables (every rope type).

A layer is pre-norm (Llama): `in_norm` before attention, `mlp_norm` before the MLP, each fused with
the residual add. A family that norms differently sets the optional parts: norms of the attention's
and the MLP's outputs before they join the stream (Gemma-3, OLMo-2), no input norms (OLMo-2: attention
and MLP read the stream itself), q/k norms per head (Qwen3, Gemma-3) or over the whole projection
(OLMo-2), per-layer rotary tables (Gemma-3's local layers), attention sinks (GPT-OSS); a sparse MLP
(`moe`) or latent attention (`mla`, DeepSeek-V3) replace the dense parts.

A forward: `hidden = model.forward(ids [N], meta)`, then `model.logits(hidden[rows])`.

Split over a TP group (`split`, models/tensor_parallel.py): attention and MLP Megatron-style (row-parallel
products all-reduced), the embedding and the LM head by vocabulary rows: a lookup all-reduces every process's
rows (zeros where an id is not its own), the logits all-gather every process's slice, so every process gets
the whole logits (the padding past vocab_size trimmed) and sampling reads them as unsplit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..ops import AttnMeta
from .moe import MoE, RoutedPairs
from .weights import cat_rows


@dataclass
class Layer:
    in_norm: torch.Tensor | None         # before attention (None: attention reads the residual stream itself)
    qkv: torch.Tensor | None             # [(H + 2 KV) * D, hidden]; None with latent attention (mla)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor | None        # before the MLP (Llama's post_attention_layernorm; None: the stream itself)
    gate_up: torch.Tensor | None         # [2 * inter, hidden]; None with a sparse MLP (moe)
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None   # RMSNorm of q and k before rotation: of each head [D], or of the whole
    k_norm: torch.Tensor | None = None   # projection [H * D], [KV * D] (`qk_norm_whole`)
    qk_norm_whole: bool = False
    window: int | None = None            # sliding-window attention: a token sees the last `window` positions
    attn_out_norm: torch.Tensor | None = None    # the attention output's norm before it joins the stream
    mlp_out_norm: torch.Tensor | None = None     # the MLP output's norm before it joins the stream
    act: str = "silu"                    # the gated MLP's activation (ops.act_and_mul)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None     # this layer's cos, sin (None: the model's)
    sinks: torch.Tensor | None = None    # [H] per-head attention sink logits (GPT-OSS)
    moe: object | None = None            # a sparse MLP instead of gate_up / down (moe.MoE)
    mla: object | None = None            # latent attention instead of qkv (deepseek_v3.MLA, its model's forward)


class CausalLM:
    def __init__(self, hf_config, layers: list[Layer], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = hf_config
        self.config = c
        self.layers = layers
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.cos, self.sin = cos, sin                       # [max_pos, rotary dim // 2] float32
        self.H = c.num_attention_heads
        self.KV = getattr(c, "num_key_value_heads", None) or self.H
        self.D = getattr(c, "head_dim", None) or c.hidden_size // self.H
        self.DV = self.D
        self.scale = self.D ** -0.5
        self.embed_scale: float | None = None               # the embedding is scaled by this (Gemma: sqrt(hidden))
        self.eps = c.rms_norm_eps
        self.vocab_size = lm_head.shape[0]
        self.dtype = embed.dtype
        self.device = embed.device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []    # per layer, set by the KV cache
        # EAGLE-3 reads the residual stream entering these layers (vLLM's aux hidden states; id N: after the
        # last layer, before the final norm), written side by side into aux_buf [tokens, len(aux) * hidden]
        self.aux_layers: tuple[int, ...] = ()
        self.aux_buf: torch.Tensor | None = None
        self.tp = None                                      # the TP group when split (`split`)
        self.vocab_first: int | None = None                 # split by vocabulary: the first row embed / lm_head hold

    def split(self, shard, tp) -> None:
        """This process holds `shard` of the attention and MLP weights (models/tensor_parallel.py): its query
        and KV heads (so its KV cache holds only those), and partial sums of o_proj / down_proj, all-reduced
        over `tp` (dist.TPGroup); a sparse MLP's experts hold their share of columns and all-reduce the same way
        (the shared experts, where a family has them, split as a dense MLP and join the same all-reduce).
        The embedding and the LM head (read as their vocabulary rows) are padded to `shard.vocab_rows` rows."""
        self.H, self.KV, self.tp = shard.local_heads, shard.local_kv_heads, tp
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.tp = tp
        if shard.vocab:
            rows = shard.vocab_rows
            tied = self.lm_head is self.embed
            self.embed = _padded_rows(self.embed, rows)
            self.lm_head = self.embed if tied else _padded_rows(self.lm_head, rows)
            self.vocab_size, self.vocab_first = shard.vocab, shard.vocab_first

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per layer ((kv_heads, key dim), (kv_heads, value dim)): what one cached token holds."""
        return [((self.KV, self.D), (self.KV, self.DV)) for _ in self.layers]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_first is None:
            x = F.embedding(ids, self.embed)
        else:                                   # vocab-parallel: this process's rows, zeros for the others' ids
            local = ids - self.vocab_first
            outside = (local < 0) | (local >= self.embed.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.embed)
            x.masked_fill_(outside.unsqueeze(1), 0)
            self.tp.all_reduce(x)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)     # rounded to the dtype, as transformers does
        return x

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """ids [N] -> final hidden states [N, hidden] (after the last norm)."""
        x = self.embedding(ids)
        residual = None
        layers = self.layers
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, self.kv_caches)):
            h, residual = self._join(x, residual, layer.in_norm, layer.qkv if layer.mla is None else None)
            if i in self.aux_layers:
                self._keep_aux(i, residual)
            # o and down may join the stream themselves and hand the next linear its norm (`_row_parallel`'s join)
            mlp_in = layer.gate_up if layer.moe is None else None
            x = self._attention(layer, h, meta, k_cache, v_cache,
                                join=(residual, layer.mlp_norm, mlp_in) if layer.attn_out_norm is None else None)
            if layer.attn_out_norm is not None:
                x = ops.rms_norm(x, layer.attn_out_norm, self.eps)
            h, residual = self._join(x, residual, layer.mlp_norm, layer.moe if layer.moe is not None else mlp_in)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            x = self._mlp(layer, h, unsummed=layer.mlp_out_norm is None,
                          join=(residual, nxt.in_norm, nxt.qkv) if nxt is not None and nxt.mla is None
                          and layer.mlp_out_norm is None else None)
            if layer.mlp_out_norm is not None:
                x = ops.rms_norm(x, layer.mlp_out_norm, self.eps)
        out, residual = self._join(x, residual, self.norm)
        if len(self.layers) in self.aux_layers:
            self._keep_aux(len(self.layers), residual)
        return out

    def _join(self, x: torch.Tensor | RoutedPairs, residual: torch.Tensor | None, norm: torch.Tensor | None,
              feeds=None):
        """x joins the residual stream (the first layer's x starts it); returns (what the next block
        reads: the stream's norm, or the stream itself without one, the stream). x may be a sparse MLP's
        unsummed output (`_mlp`): its sums join the stream in the norm's kernel. `feeds`: the weight of the one
        linear that alone reads the norm (qkv, a dense MLP's gate_up); where it is FP8 at decode sizes
        (ops.fused_quant_wanted) the norm comes quantized for it (fp8_kernels.FP8Activation). Or the sparse MLP
        that reads it (moe.MoE), whose FP8 routed experts may take it quantized as well as plain (MoE.takes_quantized).
        x may have joined the stream already and be the norm (`_row_parallel`'s join: an FP8Activation with its sums
        of squares)."""
        if getattr(x, "sumsq", None) is not None:
            return x, residual
        if isinstance(x, RoutedPairs):          # the residual has the shape and dtype of the sums it takes
            quantize = norm is not None and self._fused_quant(residual, feeds) is True
            return x.add_to(residual, norm, self.eps, quantize), residual
        quantize = norm is not None and self._fused_quant(x, feeds)
        if residual is None:
            return (x if norm is None else ops.rms_norm(x, norm, self.eps, quantize=quantize)), x
        if norm is None:
            residual.add_(x)
            return residual, residual
        return ops.rms_norm(x, norm, self.eps, residual, quantize), residual     # residual += x, then its norm

    def _fused_quant(self, x: torch.Tensor, w) -> bool | str:
        """Whether the kernel reading x hands the FP8 linear w its output quantized (not split over a TP group);
        w a sparse MLP (moe.MoE): "both" where it takes its input quantized as well as plain, else False."""
        if isinstance(w, MoE):
            return "both" if w.takes_quantized(x) else False
        return self.tp is None and w is not None and ops.fused_quant_wanted(x, w)

    def _keep_aux(self, layer: int, stream: torch.Tensor) -> None:
        h = stream.shape[1]
        for j, at in enumerate(self.aux_layers):
            if at == layer:
                self.aux_buf[:stream.shape[0], j * h:(j + 1) * h].copy_(stream)

    def _mlp(self, layer: Layer, h: torch.Tensor, unsummed: bool = False, join=None) -> torch.Tensor | RoutedPairs:
        """`unsummed`: a sparse MLP may hand back its experts' outputs unsummed (moe.MoE), for `_join`; `join`: as
        `_row_parallel`'s, for down."""
        if layer.moe is not None:
            return layer.moe(h, unsummed)
        gate_up = ops.linear(h, layer.gate_up, layer.gate_up_bias)
        act = ops.act_and_mul(gate_up, layer.act, self._fused_quant(gate_up, layer.down))    # quantized for down?
        return self._row_parallel(act, layer.down, layer.down_bias, join=join)

    def _row_parallel(self, x: torch.Tensor, w, bias: torch.Tensor | None, o: bool = False, join=None):
        """x @ w^T + bias; split over a TP group, x and w hold this process's columns: the partial sums are
        all-reduced (a plain collective, captured in the CUDA graphs) before the bias joins once. `o`: the
        attention output projection, which unsplit takes `ops.linear_one_row` (a matrix-vector kernel at one row).
        `join` (residual, norm, the linear that reads the norm): where the GEMM can (FP8 at decode sizes,
        ops.add_norm_wanted) the product joins the residual stream in it and the norm comes back, for `_join` to
        pass on (one RMSNorm kernel a join fewer)."""
        if join is not None and self.tp is None and ops.add_norm_wanted(x, w, join[2]):
            return ops.linear_add_norm(x, w, bias, join[0], join[1], self.eps)
        if self.tp is None:
            return (ops.linear_one_row if o else ops.linear)(x, w, bias)
        y = ops.linear(x, w)
        self.tp.all_reduce(y)
        return y if bias is None else y + bias

    def _attention(self, layer: Layer, h, meta: AttnMeta, k_cache, v_cache, join=None) -> torch.Tensor:
        """h: the layer's input (its norm), a tensor or quantized for an FP8 qkv (`_join`'s `feeds`); `join`: as
        `_row_parallel`'s, for o."""
        H, KV, D = self.H, self.KV, self.D
        qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
        N = qkv.shape[0]
        head_norms = None
        if layer.q_norm is not None:
            if layer.qk_norm_whole:
                q, k = qkv[:, :H * D], qkv[:, H * D:(H + KV) * D]
                q.copy_(ops.rms_norm(q.contiguous(), layer.q_norm, self.eps))
                k.copy_(ops.rms_norm(k.contiguous(), layer.k_norm, self.eps))
            else:                  # Qwen3's per-head norms: in the rotary kernel
                head_norms = (layer.q_norm, layer.k_norm, self.eps)
        cos, sin = layer.rope or (self.cos, self.sin)
        ops.rope_and_store(qkv, cos, sin, meta, k_cache, v_cache, H, KV, D, head_norms)
        q = qkv[:, :H * D].view(N, H, D)
        # an FP8 o at decode sizes may take its input quantized by the attention kernel
        quantize = self._fused_quant(qkv, layer.o) and ops.attention_quant_wanted(v_cache.shape[-1])
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, layer.window, layer.sinks, quantize)
        return self._row_parallel(out if quantize else out.reshape(N, -1), layer.o, layer.o_bias, o=True, join=join)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, vocab_size]. `out` (that shape, the model's dtype; ModelRunner's buffer): where they may be
        written, returned then; a subclass may return a new tensor instead (the runner copies it into out)."""
        if self.vocab_first is None:
            return torch.matmul(hidden, self.lm_head.t(), out=out)     # F.linear's product, written into out
        # vocab-parallel: every process's slice [N, rows] gathered in rank order -> [N, vocab], padding trimmed
        local = F.linear(hidden, self.lm_head)
        N, rows = local.shape
        full = self.tp.all_gather(local).view(self.tp.world, N, rows).transpose(0, 1).reshape(N, -1)
        full = full if full.shape[1] == self.vocab_size else full[:, :self.vocab_size]
        return full.contiguous() if out is None else out.copy_(full)


def _padded_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """w with zero rows appended up to `rows` (the last vocab-parallel process's padding past vocab_size)."""
    if w.shape[0] > rows:
        raise ValueError(f"a vocabulary slice of {w.shape[0]} rows exceeds the {rows} a process holds")
    return w if w.shape[0] == rows else torch.cat([w, w.new_zeros((rows - w.shape[0], *w.shape[1:]))])


def routed_expert_bytes(model: CausalLM) -> int:
    """Bytes of the routed experts' weights `model` holds (under expert parallelism: this rank's share)."""
    return sum(layer.moe.nbytes for layer in model.layers if layer.moe is not None)


def layer_window(c, i: int) -> int | None:
    """Layer i's sliding window from `layer_types` (transformers 5 names each layer's attention), or None."""
    types = getattr(c, "layer_types", None)
    if types and types[i] == "sliding_attention" and getattr(c, "sliding_window", None):
        return int(c.sliding_window)
    return None


def attention_weights(get, p: str, path: str) -> dict:
    """The Layer fields of a layer's attention stored as q_proj, k_proj, v_proj, o_proj (with biases where
    the checkpoint has them) and optional per-head q_norm / k_norm, under prefix `p` + "self_attn."."""
    a = p + "self_attn."
    return dict(qkv=cat_rows(path, get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")),
                qkv_bias=cat_rows(path, get(a + "q_proj.bias", False), get(a + "k_proj.bias", False),
                                  get(a + "v_proj.bias", False)),
                o=get(a + "o_proj.weight"), o_bias=get(a + "o_proj.bias", False),
                q_norm=get(a + "q_norm.weight", False), k_norm=get(a + "k_norm.weight", False))


def mlp_weights(get, p: str, path: str) -> dict:
    """The Layer fields of a dense gated MLP stored as gate_proj, up_proj, down_proj under `p` + "mlp."."""
    m = p + "mlp."
    return dict(gate_up=cat_rows(path, get(m + "gate_proj.weight"), get(m + "up_proj.weight")),
                gate_up_bias=cat_rows(path, get(m + "gate_proj.bias", False), get(m + "up_proj.bias", False)),
                down=get(m + "down_proj.weight"), down_bias=get(m + "down_proj.bias", False))


def pre_norm_layer(get, i: int, path: str, window: int | None = None, moe=None, **fields) -> Layer:
    """Decoder layer i of a pre-norm (Llama-style) checkpoint: input_layernorm, attention, post_attention_layernorm
    (the norm before the MLP), and a dense gated MLP unless a sparse one (`moe`) replaces it."""
    p = f"layers.{i}."
    mlp = dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None) if moe is not None else mlp_weights(get, p, path)
    parts = {**attention_weights(get, p, path), **mlp, **fields}
    return Layer(in_norm=get(p + "input_layernorm.weight"), mlp_norm=get(p + "post_attention_layernorm.weight"),
                 window=window, moe=moe, **parts)
