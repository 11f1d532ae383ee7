"""Qwen2 (Qwen2ForCausalLM): Llama's decoder with q/k/v biases; sliding-window layers as `layer_types`
names them (use_sliding_window, max_window_layers)."""
from __future__ import annotations

from .decoder import layer_window, pre_norm_layer
from .llama import refuse_activation
from .registry import Family


def build_layer(c, i: int, get, path: str, ep=None):
    return pre_norm_layer(get, i, path, window=layer_window(c, i))


FAMILIES = [Family("Qwen2ForCausalLM", "qwen2", build_layer, fields=("hidden_act", "layer_types", "sliding_window"),
                   refuse=refuse_activation, tensor_parallel=True)]
