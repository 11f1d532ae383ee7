"""GPT-OSS (GptOssForCausalLM): a pre-norm decoder whose every layer is a sparse MLP, and whose attention
has biases, attention sinks and alternating sliding-window / full layers.

Config (transformers' GptOssConfig, always built by transformers: its default rope is yarn): hidden_size,
num_attention_heads, num_key_value_heads, head_dim, `layer_types` ("sliding_attention" layers see the last
`sliding_window` positions), rope_parameters (yarn, factor 32, in the published checkpoints; every rope type
comes from transformers' functions), num_local_experts, num_experts_per_tok, swiglu_alpha, swiglu_limit.

Weights under model.layers.{i}:
- input_layernorm, post_attention_layernorm: RMSNorm (GPT-OSS multiplies the weight before casting back,
  Llama after; the same in float32);
- self_attn.{q,k,v,o}_proj.weight and .bias; self_attn.sinks [H]: a logit per head that joins each softmax's
  denominator and adds no value (ops.paged_attention's `sinks`); rotary embedding rotate-half, as ops.rotate;
- mlp.router.weight [E, hidden], mlp.router.bias [E]: the top k of the router's logits, then a softmax over those
  k (`TopKSoftmax`);
- mlp.experts.gate_up_proj [E, hidden, 2I] with gate and up interleaved (gate = [..., ::2], up = [..., 1::2]),
  gate_up_proj_bias [E, 2I], down_proj [E, I, hidden], down_proj_bias [E, hidden]: loaded as this rank's experts
  (expert parallelism) in F.linear's layout, gate and up stacked ([E', 2I, hidden], [E', hidden, I]);
  each expert is the clamped SwiGLU (`GptOssMoE.expert`).
KV cache: grouped-query attention, num_key_value_heads x head_dim per layer (the default).

MXFP4 checkpoints (the published gpt-oss-20b / 120b: quantization_config quant_method "mxfp4") are refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decoder import layer_window, pre_norm_layer
from .moe import MoE
from .naming import expert_split
from .registry import Family, UnsupportedModel


@dataclass
class TopKSoftmax:
    """GPT-OSS's router: the top k of the logits (with the router's bias), a softmax over those k values in the
    activations' dtype; the weights come back in float32 (exactly: the MoE casts them back)."""
    router: torch.Tensor                 # [E, hidden]
    bias: torch.Tensor                   # [E]
    top_k: int

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = torch.topk(F.linear(x, self.router, self.bias), self.top_k, -1)
        return torch.softmax(top, -1).float(), idx


@dataclass
class GptOssMoE(MoE):
    """The sparse MLP with GPT-OSS's experts: biased projections and the clamped SwiGLU
    (up + 1) * gate * sigmoid(alpha * gate), gate clamped above and up both sides at `limit`."""
    gate_up_bias: torch.Tensor | None = None     # [E', 2I]: gate | up
    down_bias: torch.Tensor | None = None        # [E', hidden]
    alpha: float = 1.702
    limit: float = 7.0

    def expert(self, x: torch.Tensor, j: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[j], self.gate_up_bias[j]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return F.linear((up + 1) * glu, self.down[j], self.down_bias[j])

    def kernel_args(self) -> dict:
        return dict(super().kernel_args(), gate_up_bias=self.gate_up_bias, down_bias=self.down_bias,
                    act="swiglu_oai", alpha=self.alpha, limit=self.limit)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes + self.gate_up_bias.nbytes + self.down_bias.nbytes


def sparse_mlp(c, get, i: int, path: str, ep) -> GptOssMoE:
    """Layer i's router and this rank's experts (all of them without expert parallelism)."""
    E = int(c.num_local_experts)
    mine = expert_split(E, ep.world, ep.rank) if ep is not None else range(E)
    m = f"layers.{i}.mlp."
    router, router_bias = get(m + "router.weight"), get(m + "router.bias")
    gate_up = get(m + "experts.gate_up_proj")[mine.start:mine.stop]            # [E', hidden, 2I], interleaved
    gate_up_bias = get(m + "experts.gate_up_proj_bias")[mine.start:mine.stop]  # [E', 2I]
    down = get(m + "experts.down_proj")[mine.start:mine.stop]                  # [E', I, hidden]
    down_bias = get(m + "experts.down_proj_bias")[mine.start:mine.stop]
    if router.shape[0] != E or gate_up.shape[0] != len(mine):
        raise UnsupportedModel(f"{path}: layer {i} has {router.shape[0]} router rows and "
                               f"{gate_up.shape[0] + mine.start} experts for {E} experts")
    gate_up = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1).transpose(1, 2).contiguous()
    gate_up_bias = torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]], -1).contiguous()
    return GptOssMoE(TopKSoftmax(router, router_bias, int(c.num_experts_per_tok)), gate_up,
                     down.transpose(1, 2).contiguous(), False, mine, ep if ep is not None and ep.world > 1 else None,
                     gate_up_bias=gate_up_bias, down_bias=down_bias.contiguous(),
                     alpha=float(getattr(c, "swiglu_alpha", 1.702)), limit=float(getattr(c, "swiglu_limit", 7.0)))


def build_layer(c, i: int, get, path: str, ep=None):
    moe = sparse_mlp(c, get, i, path, ep)
    return pre_norm_layer(get, i, path, window=layer_window(c, i), moe=moe, sinks=get(f"layers.{i}.self_attn.sinks"))


def refuse(config: dict) -> str | None:
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "mxfp4":
        return ("GPT-OSS checkpoints with MXFP4 weights (quantization_config quant_method 'mxfp4', as "
                "openai/gpt-oss-20b and gpt-oss-120b ship) are not supported yet; give bfloat16 or float32 weights "
                "(e.g. a dequantized checkpoint)")
    types = set(config.get("layer_types") or []) - {"sliding_attention", "full_attention"}
    if types:
        return f"GPT-OSS layer_types {sorted(types)} are not supported (sliding_attention and full_attention only)"
    return None


# its config class fills in layer_types, head_dim and a yarn rope: the config comes from transformers (fields None)
FAMILIES = [Family("GptOssForCausalLM", "gpt_oss", build_layer, fields=None,
                   experts_keys=("num_local_experts",),
                   refuse=refuse)]
