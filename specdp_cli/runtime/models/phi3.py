"""Phi-3 (Phi3ForCausalLM: Phi-3/3.5-mini and -medium, Phi-4, Phi-4-mini): Llama's pre-norm decoder with its
projections stored fused. Under model.layers.{i}:
- input_layernorm, post_attention_layernorm: Llama RMSNorms (before attention, before the MLP);
- self_attn.qkv_proj [(H + 2 KV) * D, hidden]: q, k, v rows stacked in that order — already the decoder's
  qkv layout, loaded as it is — and self_attn.o_proj;
- mlp.gate_up_proj [2 * intermediate, hidden]: gate rows then up rows (transformers' Phi3MLP chunks them in
  that order), the decoder's gate_up layout, loaded as it is; mlp.down_proj; a SiLU-gated MLP.
No biases (transformers' Phi-3 has none and ignores any a checkpoint holds; so does specdp).
Rotary embedding over the leading `partial_rotary_factor` share of each head (Phi-4-mini: 0.75; the rest
passes through), default or longrope tables (rotary.py; longrope's short or long factors are chosen once
for the whole table, by whether max_model_len exceeds original_max_position_embeddings, where transformers
chooses by the length a forward reaches). `sliding_window`, when set, applies to every layer: position p is
visible from q when q - p < sliding_window (transformers' sliding_window_overlay). Dropouts are training only.
KV per layer: num_key_value_heads x head_dim (hidden_size / num_attention_heads) for keys and values.
"""
from __future__ import annotations

from .decoder import Layer
from .llama import refuse_activation
from .registry import Family, UnsupportedModel

ROPE_TYPES = ("default", "longrope", "su", "yarn")      # Phi3Config renames "su" and "yarn" to longrope


def refuse(config: dict) -> str | None:
    why = refuse_activation(config)
    if why:
        return why
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in ROPE_TYPES:
        return f"Phi-3 rope type {kind!r} is not supported (default and longrope only, as transformers' Phi3Config)"
    return None


def build_layer(c, i: int, get, path: str, ep=None) -> Layer:
    p = f"layers.{i}."
    H = c.num_attention_heads
    KV = getattr(c, "num_key_value_heads", None) or H
    D = getattr(c, "head_dim", None) or c.hidden_size // H
    qkv = get(p + "self_attn.qkv_proj.weight")
    if qkv.shape[0] != (H + 2 * KV) * D:
        raise UnsupportedModel(f"{path}: layer {i}'s qkv_proj has {qkv.shape[0]} rows, not (heads + 2 kv heads) "
                               f"x head_dim = {(H + 2 * KV) * D}")
    window = getattr(c, "sliding_window", None)
    return Layer(in_norm=get(p + "input_layernorm.weight"),
                 qkv=qkv, qkv_bias=None, o=get(p + "self_attn.o_proj.weight"), o_bias=None,
                 mlp_norm=get(p + "post_attention_layernorm.weight"),
                 gate_up=get(p + "mlp.gate_up_proj.weight"), gate_up_bias=None,
                 down=get(p + "mlp.down_proj.weight"), down_bias=None,
                 window=int(window) if window else None)


FAMILIES = [Family("Phi3ForCausalLM", "phi3", build_layer, fields=("hidden_act", "sliding_window"), refuse=refuse)]
