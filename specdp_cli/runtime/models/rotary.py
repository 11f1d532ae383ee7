"""Rotary tables as transformers computes them, without importing a modeling module (seconds of start-up)."""
from __future__ import annotations

import importlib

import torch


def rotary_tables(hf_config, model_type: str, arch: str, max_len: int,
                  layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary dim // 2] float32 (DeepSeek's config sets head_dim to its qk_rope_head_dim:
    only the rope part of a head rotates; a partial_rotary_factor rotates that share of each head), as
    transformers computes them: the inverse frequencies of every rope type come from transformers' own
    functions (linear, llama3, yarn…). Only the types that depend on the sequence length (dynamic, longrope)
    run the family's rotary module itself — importing a modeling module costs seconds of start-up.
    Rope parameters kept per layer type (Gemma-3, OLMo-3: {"full_attention": {...}, "sliding_attention": {...}})
    give `layer_type`'s tables (by default full_attention's)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if isinstance(rope.get("full_attention"), dict):
        layer_type = layer_type or "full_attention"
        rope = rope[layer_type]
    rope_type = rope.get("rope_type", "default")
    pos = torch.arange(max_len, dtype=torch.float32)
    if rope_type in ("dynamic", "longrope"):
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        rotary = getattr(module, arch.replace("ForCausalLM", "RotaryEmbedding"))(config=hf_config)
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos.long().view(1, -1))
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        per_type = {"layer_type": layer_type} if layer_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, **per_type)
    freqs = pos.view(-1, 1) * inv_freq.float().view(1, -1)
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()


def sliding_layer_tables(hf_config, model_type: str, arch: str, max_len: int):
    """The sliding-window layers' own cos, sin when the config keeps rope parameters per layer type (Gemma-3,
    OLMo-3), else None (every layer uses the model's tables)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if not isinstance(rope.get("sliding_attention"), dict):
        return None
    return rotary_tables(hf_config, model_type, arch, max_len, layer_type="sliding_attention")


def rope_types(config: dict) -> set[str]:
    """Every rope type a config.json names: model-wide or per layer type, and in a legacy rope_scaling."""
    rope = config.get("rope_parameters") or {}
    per_type = [r for r in (rope.get("full_attention"), rope.get("sliding_attention")) if isinstance(r, dict)]
    return {r.get("rope_type") or r.get("type") or "default"
            for r in (per_type or [rope]) + [config.get("rope_scaling") or {}]}
