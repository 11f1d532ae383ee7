"""Mistral (MistralForCausalLM): Llama's decoder with a sliding window over every layer (`sliding_window`,
null for the later releases that dropped it)."""
from __future__ import annotations

from .decoder import pre_norm_layer
from .llama import refuse_activation
from .registry import Family


def build_layer(c, i: int, get, path: str, ep=None):
    window = getattr(c, "sliding_window", None)
    return pre_norm_layer(get, i, path, window=int(window) if window else None)


FAMILIES = [Family("MistralForCausalLM", "mistral", build_layer, fields=("hidden_act", "head_dim", "sliding_window"),
                   refuse=refuse_activation, tensor_parallel=True)]
