"""specdp's attention function for Hugging Face models, over the slot KV cache.

A forward carries a flat list of N tokens ([1, N] input ids and explicit position ids), any number
of tokens per sequence: prefill chunks, verification windows and single draft tokens mix freely.
The model's linear layers see only those N tokens. Here, per layer, the new keys and values are
written into the cache at (slot, position), and the queries are gathered into a [rows, T] grid
(row = slot) to attend over `cache[:rows, :, :S]` with a mask built once per forward.

It is registered under the name "specdp" in transformers' AttentionInterface; the model runner
sets the forward's metadata with `forward_context`. Shapes (N, rows, T, S) come from small bucket
sets so a step can later be captured as a CUDA graph.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import SlotKVCache

ATTN_NAME = "specdp"


@dataclass
class AttentionMeta:
    slot: torch.Tensor        # [N] slot of each token (the trash slot for padding)
    pos: torch.Tensor         # [N] position of each token
    q_index: torch.Tensor     # [rows * T] token feeding each grid cell (any valid index for empty cells)
    out_index: torch.Tensor   # [N] grid cell of each token
    qpos: torch.Tensor        # [rows, T] position of each grid cell (0 for empty cells: finite, discarded)
    rows: int
    T: int
    S: int
    _masks: dict = field(default_factory=dict)

    def mask(self, groups: int, window: int | None) -> torch.Tensor:
        """[rows, 1, groups * T, S] bool: a cell sees cached positions <= its own (within `window`)."""
        key = (groups, window)
        m = self._masks.get(key)
        if m is None:
            kpos = torch.arange(self.S, device=self.qpos.device)
            q = self.qpos.unsqueeze(-1)
            m = kpos <= q
            if window:
                m = m & (q - kpos < window)
            m = m.unsqueeze(1).repeat(1, 1, groups, 1)
            self._masks[key] = m
        return m


_current: tuple[AttentionMeta, SlotKVCache] | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMeta, cache: SlotKVCache):
    global _current
    prev, _current = _current, (meta, cache)
    try:
        yield
    finally:
        _current = prev


def specdp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, **kwargs):
    if _current is None:
        raise RuntimeError("specdp attention called outside a specdp forward")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention softcapping / sinks are not supported by specdp yet")
    meta, cache = _current
    k_cache, v_cache = cache.layer(module.layer_idx, key)
    # query [1, H, N, d]; key, value [1, KV, N, d]
    k_cache[meta.slot, :, meta.pos] = key[0].transpose(0, 1)
    v_cache[meta.slot, :, meta.pos] = value[0].transpose(0, 1)
    H, d = query.shape[1], query.shape[3]
    kv = key.shape[1]
    G = H // kv
    B, T = meta.rows, meta.T
    # fold the G query heads that share a KV head into the query length: no KV copies for GQA
    q = query[0].transpose(0, 1)[meta.q_index]                         # [B*T, H, d]
    q = q.view(B, T, kv, G, d).permute(0, 2, 3, 1, 4).reshape(B, kv, G * T, d)
    out = F.scaled_dot_product_attention(q, k_cache[:B, :, :meta.S], v_cache[:B, :, :meta.S],
                                         attn_mask=meta.mask(G, sliding_window), scale=scaling)
    out = out.view(B, kv, G, T, d).permute(0, 3, 1, 2, 4).reshape(B * T, H, d)
    return out[meta.out_index].unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, specdp_attention)
