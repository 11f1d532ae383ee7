"""Qwen3 (Qwen3ForCausalLM): Llama's decoder with an RMSNorm over each head's q and k before rotation
(self_attn.q_norm / k_norm, [head_dim]) and an explicit head_dim; sliding windows as `layer_types` names them."""
from __future__ import annotations

from .decoder import layer_window, pre_norm_layer
from .llama import refuse_activation
from .registry import Family


def build_layer(c, i: int, get, path: str, ep=None):
    return pre_norm_layer(get, i, path, window=layer_window(c, i))


FAMILIES = [Family("Qwen3ForCausalLM", "qwen3", build_layer,
                   fields=("hidden_act", "head_dim", "layer_types", "sliding_window"), refuse=refuse_activation,
                   tensor_parallel=True)]
