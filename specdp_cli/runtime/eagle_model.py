"""Drafting heads on specdp's decoder: EAGLE-1 (Li et al., 2024), EAGLE-3 (Li et al., 2025) and
DeepSeek-V3's multi-token-prediction (MTP) layer. Each proposes after verification (`drafters/eagle.py`).

EAGLE-1: one Llama decoder layer that predicts the target's next hidden state.

At position j the head takes the pair (token j+1, the target's hidden state at j — after the
target's final norm): x = fc(cat(embed(token), feature)), then the decoder layer without its input
norm (causal attention over the head's own KV cache, RoPE at position j), giving the predicted
feature at j+1; logits = the target's LM head over it. Drafting feeds the predicted feature back in.
The head reuses the target's embedding and LM head (the checkpoint does not store them).

Checkpoint layout (as published with EAGLE-1): `fc.weight` [h, 2h], `fc.bias`,
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`layers.0.post_attention_layernorm.weight`, and a Llama `config.json` for the layer's shape.

EAGLE-3 (the layout vLLM's `llama_eagle3` reads): the feature is `fc` (no bias) over three of the
target's hidden states side by side — the residual stream entering layers
`eagle_aux_hidden_state_layer_ids` (config.json), by default (2, N // 2, N - 3) of the target's N layers,
as vLLM takes them. The `midlayer` attends over [input_layernorm(embedding), hidden_norm(feature)]
(q/k/v take 2h inputs) with the feature as its residual stream; `norm` then `lm_head` over a draft
vocabulary give logits, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]). The
next draft step feeds the stream before `norm` back in. The head's own `embed_tokens` is used when the
checkpoint has one, else the target's.

MTP (`method: mtp`): the layer DeepSeek-V3 trains beside its decoder and stores in the target's own
checkpoint as layer num_hidden_layers (`model.layers.{N}.*`; transformers skips it): `enorm`, `hnorm`,
`eh_proj` [h, 2h] (no bias), a full decoder layer (latent attention, MoE with shared experts) and
`shared_head.{norm, head}`, with `embed_tokens` there too in some checkpoints (else the target's embedding;
no `shared_head.head`: the target's LM head). A step: x = eh_proj(cat(enorm(embed(token)), hnorm(feature)))
(the embedding first), then the decoder layer; logits = shared_head.head(shared_head.norm(output)). The
first step's feature is the target's last hidden state (after its final norm, as vLLM passes it); the next
steps feed back the layer's output before `shared_head.norm`, as vLLM's `deepseek_mtp` does when k exceeds
the layers it has. Only the first MTP layer is used (DeepSeek-V3 has one). Under expert parallelism its
MoE holds this rank's experts and exchanges tokens with the other ranks like the target's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeldir import FAMILIES, ModelDir, UnsupportedModel, architecture_of, aux_layer_ids, eagle_layout
from . import ops
from .model import (CausalLM, Layer, _read_weights, _weights_of, decoder_layer, rank_experts, rotary_tables,
                    weight_getter)
from .hf_config import head_config
from .ops import AttnMeta


class TargetFeatureHead(CausalLM):
    """A head whose forward reads the features of its N tokens from `self.feats[:N]`: the target runner's
    last hidden states (after the target's final norm), which the drafter overwrites with the head's own
    output for forwards 2..k. Fixed inputs, so a CUDA graph of it replays."""
    needs_target_hidden = True          # the target runner keeps every token's last hidden state
    feats: torch.Tensor | None = None

    def attach(self, target_runner) -> None:
        """Read the features of forward 1 — the target's last hidden states — in place."""
        self.feats = target_runner.hidden

    def prepare_features(self, n: int) -> None:
        """Nothing to do: forward 1 reads the target's hidden states in place."""


class EagleHead(TargetFeatureHead):
    def __init__(self, config, layer: Layer, fc: torch.Tensor, fc_bias: torch.Tensor | None, target: CausalLM,
                 cos: torch.Tensor, sin: torch.Tensor):
        super().__init__(config, [layer], target.embed, None, target.lm_head, cos, sin)
        self.fc, self.fc_bias = fc, fc_bias

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        x = F.linear(torch.cat([F.embedding(ids, self.embed), self.feats[:N]], -1), self.fc, self.fc_bias)
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = x
        a = self._attention(layer, x, meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.post_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)


def _open_head(path: str, layout: str, dtype: torch.dtype, device: torch.device):
    """A head directory of `layout` ("eagle" / "eagle3"): its Llama config (the config class gives the
    same defaults and rope handling as a target's) and `get(name, required=True)`, which takes a weight
    out of the checkpoint in `dtype`."""
    md = ModelDir.open(path, "EAGLE head")
    w = _read_weights(md.weight_files, device)
    if eagle_layout(w) != layout:
        want = "fc.weight and layers.0.*" if layout == "eagle" else "midlayer.* and fc.weight"
        raise UnsupportedModel(f"{path}: not an {'EAGLE-1' if layout == 'eagle' else 'EAGLE-3'} head "
                               f"(expected {want})")
    config = head_config(md.config)

    def get(name: str, required: bool = True):
        t = w.pop(name, None)
        if t is None and required:
            raise UnsupportedModel(f"{path}: weight {name} is missing")
        return None if t is None else t.to(dtype)

    return md, config, get, w


def _head_layer(path: str, get, w: dict, p: str, in_norm: torch.Tensor | None) -> Layer:
    """The head's decoder layer under prefix `p` (no biases, no q/k norms, full attention)."""
    if any(k.startswith(p + "self_attn.") and k.endswith(".bias") for k in w):
        raise UnsupportedModel(f"{path}: attention biases in an EAGLE head are not supported")
    return Layer(
        in_norm=in_norm,
        qkv=torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"], 0).contiguous(),
        qkv_bias=None, o=get(p + "self_attn.o_proj.weight"), o_bias=None,
        post_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0).contiguous(),
        gate_up_bias=None, down=get(p + "mlp.down_proj.weight"), down_bias=None, q_norm=None, k_norm=None, window=None)


def load_eagle_head(path: str, target: CausalLM, dtype: torch.dtype, device: torch.device, max_len: int) -> EagleHead:
    _, config, get, w = _open_head(path, "eagle", dtype, device)
    layer = _head_layer(path, get, w, "layers.0.", None)          # EAGLE-1's layer has no input norm
    fc, fc_bias = get("fc.weight"), get("fc.bias", False)
    if fc.shape != (target.embed.shape[1], 2 * target.embed.shape[1]):
        raise UnsupportedModel(f"{path}: fc.weight is {list(fc.shape)}, the target's hidden size is "
                               f"{target.embed.shape[1]}")
    cos, sin = rotary_tables(config, "llama", "LlamaForCausalLM", max(max_len, 1))
    return EagleHead(config, layer, fc, fc_bias, target, cos.to(device), sin.to(device))


class Eagle3Head(CausalLM):
    """forward returns the residual stream before the final norm (the feature the next draft step
    takes); `logits` applies the norm, the draft LM head and the d2t map. Its features come from
    `self.feats[:N]`, which `prepare_features` fills from the target's aux hidden states."""

    def __init__(self, config, layer: Layer, hidden_norm: torch.Tensor, fc: torch.Tensor, embed: torch.Tensor,
                 norm: torch.Tensor, lm_head: torch.Tensor, draft_to_target: torch.Tensor | None, target_vocab: int,
                 cos: torch.Tensor, sin: torch.Tensor, aux_layers: tuple[int, ...]):
        super().__init__(config, [layer], embed, norm, lm_head, cos, sin)
        self.hidden_norm, self.fc = hidden_norm, fc
        self.aux_layers_of_target = aux_layers
        self.vocab_size = target_vocab
        # target id of each draft id (None: the draft vocabulary is the target's)
        self.target_ids = (None if draft_to_target is None else
                           torch.arange(lm_head.shape[0], device=lm_head.device) + draft_to_target)
        self.feats: torch.Tensor | None = None
        self.aux_in: torch.Tensor | None = None      # the target's aux_buf

    needs_target_hidden = False

    def attach(self, target_runner) -> None:
        """Have the target keep its aux hidden states for the head's `fc`."""
        target, n = target_runner.model, target_runner.ids.shape[0]
        target.aux_layers = self.aux_layers_of_target
        target.aux_buf = torch.zeros((n, len(self.aux_layers_of_target) * target.embed.shape[1]),
                                     dtype=target.dtype, device=target.device)
        self.aux_in = target.aux_buf
        self.feats = torch.zeros((n, self.embed.shape[1]), dtype=self.dtype, device=self.device)

    def prepare_features(self, n: int) -> None:
        self.feats[:n].copy_(F.linear(self.aux_in[:n], self.fc))

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = self.feats[:N]      # the stream grows in place: feats is refilled before every forward
        x = torch.cat([ops.rms_norm(F.embedding(ids, self.embed), layer.in_norm, self.eps),
                       ops.rms_norm(residual, self.hidden_norm, self.eps)], -1)
        a = self._attention(layer, x, meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.post_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = F.linear(ops.rms_norm(hidden, self.norm, self.eps), self.lm_head)
        if self.target_ids is None:
            return draft
        out = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        out[:, self.target_ids] = draft
        return out


def load_eagle3_head(path: str, target: CausalLM, dtype: torch.dtype, device: torch.device,
                     max_len: int) -> Eagle3Head:
    md, config, get, w = _open_head(path, "eagle3", dtype, device)
    p = "midlayer."
    layer = _head_layer(path, get, w, p, get(p + "input_layernorm.weight"))
    if config.__dict__.get("norm_before_residual"):
        raise UnsupportedModel(f"{path}: norm_before_residual heads are not supported")
    aux = aux_layer_ids(md.config, target.num_layers)
    h = target.embed.shape[1]
    fc = get("fc.weight")
    if fc.shape != (h, len(aux) * h):
        raise UnsupportedModel(f"{path}: fc.weight is {list(fc.shape)}; with the target's hidden size {h} and "
                               f"{len(aux)} aux layers it must be [{h}, {len(aux) * h}]")
    if any(not 0 <= i <= target.num_layers for i in aux):
        raise UnsupportedModel(f"{path}: aux layers {list(aux)} outside the target's 0..{target.num_layers}")
    d2t = w.pop("d2t", None)
    lm_head = get("lm_head.weight")
    if d2t is not None:
        ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t.long()
        if d2t.shape[0] != lm_head.shape[0] or int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
            raise UnsupportedModel(f"{path}: d2t maps {d2t.shape[0]} draft ids outside the target's "
                                   f"0..{target.vocab_size - 1} (or does not match lm_head's {lm_head.shape[0]} rows)")
    embed = get("embed_tokens.weight", False)
    cos, sin = rotary_tables(config, "llama", "LlamaForCausalLM", max(max_len, 1))
    return Eagle3Head(config, layer, get(p + "hidden_norm.weight"), fc, target.embed if embed is None else embed,
                      get("norm.weight"), lm_head, None if d2t is None else d2t.to(device).long(),
                      target.vocab_size, cos.to(device), sin.to(device), aux)


class MTPHead(TargetFeatureHead):
    """DeepSeek-V3's MTP layer (see the module docstring). forward returns the layer's output stream (the
    feature of the next draft step); `logits` applies shared_head.norm and shared_head.head."""

    def __init__(self, config, layer: Layer, enorm: torch.Tensor, hnorm: torch.Tensor, eh_proj: torch.Tensor,
                 embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, target: CausalLM):
        super().__init__(config, [layer], embed, norm, lm_head, target.cos, target.sin)
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = F.linear(torch.cat([ops.rms_norm(F.embedding(ids, self.embed), self.enorm, self.eps),
                                       ops.rms_norm(self.feats[:N], self.hnorm, self.eps)], -1), self.eh_proj)
        a = self._attention(layer, ops.rms_norm(residual, layer.in_norm, self.eps), meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.post_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(ops.rms_norm(hidden, self.norm, self.eps), self.lm_head)


def load_mtp_head(path: str, target: CausalLM, dtype: torch.dtype, device: torch.device, ep=None) -> MTPHead:
    """The first MTP layer of the target checkpoint at `path` (layer num_hidden_layers of `target`'s config),
    with this rank's routed experts only under expert parallelism (`ep`, as in load_model)."""
    md = ModelDir.open(path, "model")
    c, i = target.config, target.config.num_hidden_layers
    w = _read_weights(md.weight_files, device, _weights_of(range(i, i + 1), rank_experts(md, ep), top_level=False))
    p = f"layers.{i}."
    prefix = "model." if f"model.{p}eh_proj.weight" in w else ""
    if prefix + p + "eh_proj.weight" not in w:
        raise UnsupportedModel(f"{path}: no multi-token-prediction layer (weight model.{p}eh_proj.weight)")
    get = weight_getter(w, prefix, path, dtype)
    layer = decoder_layer(c, FAMILIES[architecture_of(md.config)], i, get, path, ep)
    h = target.embed.shape[1]
    eh_proj = get(p + "eh_proj.weight")
    if eh_proj.shape != (h, 2 * h):
        raise UnsupportedModel(f"{path}: {prefix}{p}eh_proj.weight is {list(eh_proj.shape)}, expected [{h}, {2 * h}]")
    embed, head = get(p + "embed_tokens.weight", False), get(p + "shared_head.head.weight", False)
    return MTPHead(c, layer, get(p + "enorm.weight"), get(p + "hnorm.weight"), eh_proj,
                   target.embed if embed is None else embed, get(p + "shared_head.norm.weight"),
                   target.lm_head if head is None else head, target)


def load_head(method: str, path: str, target: CausalLM, dtype: torch.dtype, device: torch.device, max_len: int,
              ep=None):
    """The drafting head of `method`: an EAGLE head from its directory ("eagle", "eagle3"), or the MTP layer
    of the target's checkpoint ("mtp"; `ep` splits its experts as the target's)."""
    loaders = {"eagle": lambda: load_eagle_head(path, target, dtype, device, max_len),
               "eagle3": lambda: load_eagle3_head(path, target, dtype, device, max_len),
               "mtp": lambda: load_mtp_head(path, target, dtype, device, ep)}
    return loaders[method]()
