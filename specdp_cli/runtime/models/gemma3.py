"""Gemma-3 text (Gemma3ForCausalLM, model_type gemma3_text): a decoder with four norms per layer and
local (sliding-window) layers among global ones.

A layer: h = input_layernorm(x); x += post_attention_layernorm(attention(h)); h = pre_feedforward_layernorm(x);
x += post_feedforward_layernorm(mlp(h)) — the decoder's in_norm, attn_out_norm, mlp_norm, mlp_out_norm. Every
norm (those four, the per-head self_attn.q_norm / k_norm [head_dim] before rotation, and the final norm) is
Gemma's RMSNorm x * (1 + w) computed in float32: the weights load as 1 + w, so the decoder's RMSNorm computes
it. The MLP is GeGLU (gate_proj, up_proj, down_proj; hidden_activation gelu_pytorch_tanh). The embedding is
scaled by sqrt(hidden_size) (rounded to the model dtype, as transformers does), attention by
query_pre_attn_scalar ** -0.5, and the LM head is the embedding (tie_word_embeddings, Gemma's default) or
lm_head.weight. final_logit_softcapping, when set, squashes the logits: cap * tanh(logits / cap).

Layers: `layer_types` (transformers builds it from the older sliding_window_pattern) names each layer
"sliding_attention" (a token sees the last `sliding_window` positions, itself included) or "full_attention".
Each type has its own rotary tables: rope_parameters {"sliding_attention": {...}, "full_attention": {...}}
(transformers 5 builds them from the older rope_theta / rope_local_base_freq / rope_scaling; 10k and 1M by
default); the global ones are the model's, the local ones go to each sliding layer (`Layer.rope`).
The config always comes from transformers' Gemma3TextConfig (its conversions above).

KV per layer: num_key_value_heads x head_dim for keys and values (head_dim is explicit: 256 by default).
Refused: attention-logit softcapping (Gemma-2's), bidirectional attention, another activation, and rope types
that depend on the sequence length (dynamic, longrope).
"""
from __future__ import annotations

import torch

from .decoder import CausalLM, Layer, attention_weights, layer_window, mlp_weights
from .registry import Family, attention_kv_shapes
from .rotary import rope_types

_ROPE_TYPES = ("default", "linear", "yarn", "llama3")
_DEFAULTS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}      # Gemma3TextConfig's


def one_plus(w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm weight w (in the model dtype, as transformers holds it) as the 1 + w the decoder's
    RMSNorm multiplies by, the sum taken in float32 as Gemma3RMSNorm does."""
    return (1.0 + w.float()).to(w.dtype)


def build_layer(c, i: int, get, path: str, ep=None) -> Layer:
    p = f"layers.{i}."
    q_norm, k_norm = get(p + "self_attn.q_norm.weight"), get(p + "self_attn.k_norm.weight")
    attn = {**attention_weights(get, p, path), "q_norm": one_plus(q_norm), "k_norm": one_plus(k_norm)}
    return Layer(in_norm=one_plus(get(p + "input_layernorm.weight")),
                 attn_out_norm=one_plus(get(p + "post_attention_layernorm.weight")),
                 mlp_norm=one_plus(get(p + "pre_feedforward_layernorm.weight")),
                 mlp_out_norm=one_plus(get(p + "post_feedforward_layernorm.weight")),
                 act="gelu_tanh", window=layer_window(c, i), **attn, **mlp_weights(get, p, path))


class Gemma3LM(CausalLM):
    """The shared decoder with Gemma's scales, final norm and logit softcapping (the loader gives the sliding
    layers their own rotary tables)."""

    def __init__(self, c, layers, embed, norm, lm_head, cos, sin):
        super().__init__(c, layers, embed, one_plus(norm), lm_head, cos, sin)   # cos, sin: the global layers'
        self.scale = c.query_pre_attn_scalar ** -0.5
        self.embed_scale = c.hidden_size ** 0.5
        self.softcap = c.final_logit_softcapping

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().logits(hidden, out)
        if self.softcap is not None:       # in place (each op rounds as the out-of-place ones do)
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def kv_shapes(config: dict):
    return attention_kv_shapes({**_DEFAULTS, **config})


def refuse(config: dict) -> str | None:
    act = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        return f"hidden_activation {act!r} is not supported for Gemma-3 (gelu_pytorch_tanh only)"
    if config.get("attn_logit_softcapping") is not None:
        return "attn_logit_softcapping is not supported for Gemma-3 (specdp's attention does not cap its logits)"
    if config.get("use_bidirectional_attention"):
        return "use_bidirectional_attention is not supported: specdp runs Gemma-3 as a causal language model"
    other = sorted(rope_types(config) - set(_ROPE_TYPES))
    if other:
        return f"rope type {', '.join(other)} is not supported for Gemma-3 ({', '.join(_ROPE_TYPES)} only)"
    return None


FAMILIES = [Family("Gemma3ForCausalLM", "gemma3_text", build_layer, fields=None, kv_shapes=kv_shapes,
                   model_class=Gemma3LM, refuse=refuse)]
