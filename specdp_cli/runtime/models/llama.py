"""Llama (LlamaForCausalLM): the pre-norm decoder every other family varies — RMSNorm, grouped-query
attention with rotary embeddings (every rope type), a SiLU-gated MLP; q_proj/k_proj/v_proj/o_proj and
gate_proj/up_proj/down_proj under model.layers.{i}, biases where the checkpoint has them."""
from __future__ import annotations

from .decoder import pre_norm_layer
from .registry import Family


def refuse_activation(config: dict) -> str | None:
    act = config.get("hidden_act", "silu")
    return None if act == "silu" else f"hidden_act {act!r} is not supported for this family (silu only)"


def build_layer(c, i: int, get, path: str, ep=None):
    return pre_norm_layer(get, i, path)


FAMILIES = [Family("LlamaForCausalLM", "llama", build_layer, fields=("hidden_act", "head_dim"),
                   refuse=refuse_activation, tensor_parallel=True)]
