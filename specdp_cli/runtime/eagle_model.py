"""An EAGLE-1 head (Li et al., 2024) on specdp's decoder: one Llama decoder layer that predicts the
target's next hidden state.

At position j the head takes the pair (token j+1, the target's hidden state at j — after the
target's final norm): x = fc(cat(embed(token), feature)), then the decoder layer without its input
norm (causal attention over the head's own KV cache, RoPE at position j), giving the predicted
feature at j+1; logits = the target's LM head over it. Drafting feeds the predicted feature back in.
The head reuses the target's embedding and LM head (the checkpoint does not store them).

Checkpoint layout (as published with EAGLE-1): `fc.weight` [h, 2h], `fc.bias`,
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, and a Llama `config.json` for the layer's shape.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeldir import ModelDir, UnsupportedModel, eagle_layout
from . import ops
from .model import CausalLM, Layer, _read_weights, rotary_tables
from .ops import AttnMeta


class EagleHead(CausalLM):
    """Its forward reads the features of its N tokens from `self.feats[:N]` (a buffer the drafter
    fills, or the target runner's hidden states), so a CUDA graph of it has fixed inputs."""

    def __init__(self, config, layer: Layer, fc: torch.Tensor, fc_bias: torch.Tensor | None, target: CausalLM,
                 cos: torch.Tensor, sin: torch.Tensor):
        super().__init__(config, [layer], target.embed, None, target.lm_head, cos, sin)
        self.fc, self.fc_bias = fc, fc_bias
        self.feats: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        x = F.linear(torch.cat([F.embedding(ids, self.embed), self.feats[:N]], -1), self.fc, self.fc_bias)
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = x
        a = self._attention(layer, x, meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.post_norm, self.eps, residual)          # residual += a
        return residual + F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up, layer.gate_up_bias)),
                                   layer.down, layer.down_bias)


def load_eagle_head(path: str, target: CausalLM, dtype: torch.dtype, device: torch.device, max_len: int) -> EagleHead:
    md = ModelDir.open(path, "EAGLE head")
    w = _read_weights(md.weight_files, device)
    if eagle_layout(w) != "eagle":
        raise UnsupportedModel(f"{path}: not an EAGLE-1 head (expected fc.weight and layers.0.*)")
    from transformers import LlamaConfig

    # the layer is a Llama layer: its config class gives the same defaults and rope handling as a target's
    config = LlamaConfig(**{k: v for k, v in md.config.items() if k not in ("architectures", "model_type")})

    def get(name: str, required: bool = True):
        t = w.pop(name, None)
        if t is None and required:
            raise UnsupportedModel(f"{path}: weight {name} is missing")
        return None if t is None else t.to(dtype)

    p = "layers.0."
    layer = Layer(
        in_norm=None,
        qkv=torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0).contiguous(),
        qkv_bias=None, o=get(p + "self_attn.o_proj.weight"), o_bias=None,
        post_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0).contiguous(),
        gate_up_bias=None, down=get(p + "mlp.down_proj.weight"), down_bias=None, q_norm=None, k_norm=None, window=None)
    if any(k.startswith(p + "self_attn.") and k.endswith(".bias") for k in w):
        raise UnsupportedModel(f"{path}: attention biases in an EAGLE head are not supported")
    fc, fc_bias = get("fc.weight"), get("fc.bias", False)
    if fc.shape != (target.embed.shape[1], 2 * target.embed.shape[1]):
        raise UnsupportedModel(f"{path}: fc.weight is {list(fc.shape)}, the target's hidden size is "
                               f"{target.embed.shape[1]}")
    cos, sin = rotary_tables(config, "llama", "LlamaForCausalLM", max(max_len, 1))
    return EagleHead(config, layer, fc, fc_bias, target, cos.to(device), sin.to(device))
