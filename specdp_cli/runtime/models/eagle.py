"""EAGLE drafting heads on specdp's decoder: EAGLE-1 (Li et al., 2024) and EAGLE-3 (Li et al., 2025).
Each proposes after verification (`drafters/eagle.py`).

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

Under tensor parallelism a head is replicated: every process of the TP group holds it whole and runs its
forwards over identical inputs. What it reads of the target's vocabulary-split embedding / LM head goes through
the target's own `embedding` / `logits`, so every process runs the same all-reduce / all-gather and gets whole
rows; an EAGLE-3 head's own embedding and draft-vocabulary `lm_head` stay whole.

DeepSeek-V3's multi-token-prediction layer, which drafts the same way, lives with its family
(`deepseek_v3.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...modeldir import ModelDir, aux_layer_ids, eagle_layout
from .. import ops
from ..ops import AttnMeta
from .config import head_config
from .decoder import CausalLM, Layer
from .heads import TargetFeatureHead
from .registry import UnsupportedModel
from .rotary import rotary_tables
from .weights import read_weights


def split_vocab_of(target: CausalLM) -> CausalLM | None:
    """The target when its embedding and LM head are split by vocabulary over a TP group (a head then reads them
    through the target's collectives), else None."""
    return target if target.vocab_first is not None else None


def embed_ids(head: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The embedding of `ids` a head reads: its `embed` table, or the split target's lookup (all-reduced)."""
    return F.embedding(ids, head.embed) if head.split_target is None else head.split_target.embedding(ids)


class EagleHead(TargetFeatureHead):
    def __init__(self, config, layer: Layer, fc: torch.Tensor, fc_bias: torch.Tensor | None, target: CausalLM,
                 cos: torch.Tensor, sin: torch.Tensor):
        super().__init__(config, [layer], target.embed, None, target.lm_head, cos, sin)
        self.fc, self.fc_bias = fc, fc_bias
        self.split_target = split_vocab_of(target)      # the embedding and LM head are the target's
        self.vocab_size = target.vocab_size

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        x = F.linear(torch.cat([embed_ids(self, ids), self.feats[:N]], -1), self.fc, self.fc_bias)
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = x
        a = self._attention(layer, x, meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.mlp_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return super().logits(hidden, out) if self.split_target is None else self.split_target.logits(hidden, out)


def _open_head(path: str, layout: str, dtype: torch.dtype, device: torch.device):
    """A head directory of `layout` ("eagle" / "eagle3"): its Llama config (the config class gives the
    same defaults and rope handling as a target's) and `get(name, required=True)`, which takes a weight
    out of the checkpoint in `dtype`."""
    md = ModelDir.open(path, "EAGLE head")
    w = read_weights(md.weight_files, device)
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
        mlp_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0).contiguous(),
        gate_up_bias=None, down=get(p + "mlp.down_proj.weight"), down_bias=None)


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
                 cos: torch.Tensor, sin: torch.Tensor, aux_layers: tuple[int, ...],
                 split_target: CausalLM | None = None):
        super().__init__(config, [layer], embed, norm, lm_head, cos, sin)
        self.split_target = split_target        # the target, when `embed` is its vocabulary-split table
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
        x = torch.cat([ops.rms_norm(embed_ids(self, ids), layer.in_norm, self.eps),
                       ops.rms_norm(residual, self.hidden_norm, self.eps)], -1)
        a = self._attention(layer, x, meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.mlp_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        hidden = ops.rms_norm(hidden, self.norm, self.eps)
        if self.target_ids is None:
            return torch.matmul(hidden, self.lm_head.t(), out=out)
        draft = F.linear(hidden, self.lm_head)
        out = draft.new_empty((draft.shape[0], self.vocab_size)) if out is None else out
        out.fill_(float("-inf"))
        out[:, self.target_ids] = draft               # the draft vocabulary's rows in the target's
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
                      target.vocab_size, cos.to(device), sin.to(device), aux,
                      split_vocab_of(target) if embed is None else None)
