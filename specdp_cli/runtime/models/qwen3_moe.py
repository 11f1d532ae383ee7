"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms) and, in the layers
`mlp_only_layers` and `decoder_sparse_step` leave sparse, `num_experts` SiLU-gated experts
(mlp.experts.{e}.gate_proj / up_proj / down_proj) behind a softmax router (mlp.gate); the routing
weights are renormalised when `norm_topk_prob` and cast to the activations' dtype."""
from __future__ import annotations

from .decoder import layer_window, pre_norm_layer
from .llama import refuse_activation
from .mixtral import sparse_mlp
from .registry import Family


def build_layer(c, i: int, get, path: str, ep=None):
    sparse = (i not in (getattr(c, "mlp_only_layers", None) or []) and c.num_experts > 0
              and (i + 1) % getattr(c, "decoder_sparse_step", 1) == 0)
    moe = (sparse_mlp(c, get, f"layers.{i}.mlp.", c.num_experts, ("gate_proj", "up_proj", "down_proj"), path, i, ep,
                      renormalize=bool(getattr(c, "norm_topk_prob", False)), float_weights=False) if sparse else None)
    return pre_norm_layer(get, i, path, window=layer_window(c, i), moe=moe)


# its config class renames fields through an attribute map: the config comes from transformers (fields None)
FAMILIES = [Family("Qwen3MoeForCausalLM", "qwen3_moe", build_layer, fields=None,
                   experts_keys=("num_experts", "num_local_experts"),
                   refuse=refuse_activation, tensor_parallel=True)]
