"""Mixtral (MixtralForCausalLM): Llama's attention and a sparse MLP in every layer — `num_local_experts`
SiLU-gated experts (block_sparse_moe.experts.{e}.w1 / w3 / w2, or fused as transformers 5 stores them), a
softmax router (block_sparse_moe.gate) choosing `num_experts_per_tok`, weights renormalised, in float32."""
from __future__ import annotations

from .decoder import pre_norm_layer
from .llama import refuse_activation
from .moe import MoE, SoftmaxTopK, load_experts
from .registry import Family, UnsupportedModel
from .weights import expert_split


def sparse_mlp(c, get, block: str, num_experts: int, names, path: str, i: int, ep, renormalize: bool,
               float_weights: bool) -> MoE:
    """A softmax-routed sparse MLP under `block` (Mixtral, Qwen3-MoE), holding this rank's experts under
    expert parallelism (`ep`)."""
    mine = expert_split(num_experts, ep.world, ep.rank) if ep is not None else range(num_experts)
    gate_up, down = load_experts(get, block, num_experts, names, mine)
    router = get(block + "gate.weight")
    if router.shape[0] != num_experts or gate_up.shape[0] != len(mine):
        raise UnsupportedModel(f"{path}: layer {i} has {router.shape[0]} router rows for {num_experts} experts")
    return MoE(SoftmaxTopK(router, int(c.num_experts_per_tok), renormalize), gate_up, down, float_weights, mine,
               ep if ep is not None and ep.world > 1 else None)


def build_layer(c, i: int, get, path: str, ep=None):
    moe = sparse_mlp(c, get, f"layers.{i}.block_sparse_moe.", c.num_local_experts, ("w1", "w3", "w2"), path, i, ep,
                     renormalize=True, float_weights=True)
    return pre_norm_layer(get, i, path, moe=moe)


FAMILIES = [Family("MixtralForCausalLM", "mixtral", build_layer,
                   fields=("hidden_act", "head_dim", "num_local_experts", "num_experts_per_tok"),
                   experts_keys=("num_local_experts",), refuse=refuse_activation,
                   tensor_parallel=True)]
