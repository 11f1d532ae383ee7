"""OLMo-2 (Olmo2ForCausalLM): a post-norm decoder. Its layers have no input norms: attention and the MLP read
the residual stream itself, and each output is normed before it joins the stream:

    x = x + post_attention_layernorm(attention(x))
    x = x + post_feedforward_layernorm(mlp(x))

Config (transformers' Olmo2Config; Hugging Face-written config.json files take the fast path): hidden_size,
num_attention_heads, num_key_value_heads (grouped-query attention), head_dim = hidden_size / heads (the config
has no head_dim field), rms_norm_eps, hidden_act (silu only), rope_parameters (rope_theta; every rope type comes
from transformers' functions, as Llama's), attention_bias, tie_word_embeddings (false in the releases).

Weights under model.layers.{i}:
- self_attn.{q,k,v,o}_proj.weight (and .bias with attention_bias): q/k/v load as one [(H + 2 KV) * D, hidden];
- self_attn.q_norm.weight [H * D], self_attn.k_norm.weight [KV * D]: RMSNorms over the WHOLE projected q and k
  (not per head) before rotation (decoder.Layer's `qk_norm_whole`);
- post_attention_layernorm.weight, post_feedforward_layernorm.weight: the norms of the attention's and the MLP's
  outputs (`attn_out_norm`, `mlp_out_norm`); `in_norm` and `mlp_norm` are None;
- mlp.{gate,up,down}_proj.weight: a SiLU-gated MLP (gate and up load as one [2 * inter, hidden]).
Olmo2RMSNorm multiplies by the weight before casting back to the dtype (Llama's norm, ops.rms_norm, after): the
same in float32. KV cache: grouped-query attention, num_key_value_heads x head_dim per layer (the default).

OLMo-3 (Olmo3ForCausalLM, transformers' Olmo3Config) is OLMo-2 with sliding-window layers: `layer_types` names
each layer "sliding_attention" (a token sees the last `sliding_window` positions) or "full_attention" (by default
every fourth), and each type has its own rope parameters, {"sliding_attention": {...}, "full_attention": {...}}
(transformers builds them from the older rope_theta / rope_scaling, the scaling going to the full layers only):
the full layers' tables are the model's, the sliding layers' go to each sliding layer (`Layer.rope`). Its config
always comes from transformers (those conversions). Refused for OLMo-3: rope types that depend on the sequence
length (dynamic, longrope: transformers recomputes their tables per forward).
"""
from __future__ import annotations

from .decoder import Layer, attention_weights, layer_window, mlp_weights
from .llama import refuse_activation
from .registry import Family
from .rotary import rope_types


def build_layer(c, i: int, get, path: str, ep=None, window: int | None = None) -> Layer:
    p = f"layers.{i}."
    return Layer(in_norm=None, mlp_norm=None, qk_norm_whole=True, window=window,
                 attn_out_norm=get(p + "post_attention_layernorm.weight"),
                 mlp_out_norm=get(p + "post_feedforward_layernorm.weight"),
                 **attention_weights(get, p, path), **mlp_weights(get, p, path))


def build_olmo3_layer(c, i: int, get, path: str, ep=None) -> Layer:
    return build_layer(c, i, get, path, ep, window=layer_window(c, i))


def refuse_olmo3(config: dict) -> str | None:
    per_length = sorted(rope_types(config) & {"dynamic", "longrope"})
    if per_length:
        return f"rope type {per_length[0]!r} is not supported for OLMo-3 (its tables change with the sequence length)"
    return refuse_activation(config)


FAMILIES = [Family("Olmo2ForCausalLM", "olmo2", build_layer, fields=("hidden_act",), refuse=refuse_activation),
            Family("Olmo3ForCausalLM", "olmo3", build_olmo3_layer, fields=None, refuse=refuse_olmo3)]
