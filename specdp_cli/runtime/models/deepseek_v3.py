"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention, sigmoid-routed experts with a shared
expert after the first `first_k_dense_replace` dense layers, and the multi-token-prediction (MTP) layer
its checkpoints store after the decoder (`method: mtp`'s drafter).

Latent attention caches each head's expanded key [nope | rope] and its value (keys wider than values:
simple, but more bytes per token than caching the latent); interleaved rotary pairs are de-interleaved in
the weights at load. The router (sigmoid, group-limited, with the correction bias) stays float32.

Under tensor parallelism (models/tensor_parallel.py) a process holds its share of the heads (their query, their
kv_b rows and o_proj columns: so their KV cache too), of the dense MLPs' and shared experts' columns and of each
routed expert's; the latents' projections and the router whole. The MTP layer splits as its target does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from ..ops import AttnMeta
from .decoder import CausalLM, Layer, mlp_weights
from .heads import TargetFeatureHead
from .llama import refuse_activation
from .moe import MoE, load_experts, router_logits
from .quant import FP8Load, quantization_of
from .registry import Family, UnsupportedModel
from .tensor_parallel import shard_of
from .weights import cat_rows, expert_split, rank_experts, read_weights, take_rows, weight_getter, weights_of

# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps, whatever rms_norm_eps says
MLA_NORM_EPS = 1e-6


@dataclass
class SigmoidRouting:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, op for op): sigmoid scores in float32;
    the experts are chosen by score + `bias`, only among the `topk_group` of `groups` expert groups whose
    two best scores sum highest; their weights are their scores without the bias (renormalised when
    `renormalize`), times `scaling`."""
    router: torch.Tensor                 # [E, hidden] float32
    bias: torch.Tensor                   # [E] float32 (e_score_correction_bias)
    top_k: int
    renormalize: bool
    groups: int
    topk_group: int
    scaling: float

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            from ..moe_kernels import grouped_sigmoid_topk
            return grouped_sigmoid_topk(router_logits(x, self.router, torch.float32), self.bias, self.top_k,
                                        self.groups, self.topk_group, self.renormalize, self.scaling)
        logits = F.linear(x.float(), self.router)
        scores = torch.sigmoid(logits)
        choice = scores + self.bias
        N, E = choice.shape
        per_group = E // self.groups
        group_scores = choice.view(N, self.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        in_best = torch.zeros_like(group_scores).scatter_(1, best_groups, 1)
        in_best = in_best.unsqueeze(-1).expand(N, self.groups, per_group).reshape(N, E)
        idx = torch.topk(choice.masked_fill(~in_best.bool(), float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


@dataclass
class MLA:
    """Multi-head latent attention. Each head's query is [nope | rope]: from `q` (q_proj), or with a query
    LoRA rank from `q` (q_b_proj) over the RMSNorm (`q_a_norm`) of `q_a`. `kv_a` gives the latent
    (kv_lora) and one rope key that every head shares; `kv_b` expands the latent's RMSNorm (`kv_a_norm`)
    into each head's key nope part and value. The rows that produce rope parts are de-interleaved at load
    when the model interleaves its rotary pairs (see _rope_rows_deinterleaved)."""
    q_a: torch.Tensor | None
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q: torch.Tensor                      # [H * (nope + rope), hidden or q_lora]
    kv_a: torch.Tensor                   # [kv_lora + rope, hidden]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor                   # [H * (nope + v), kv_lora]
    nope: int
    rope: int

    def __call__(self, model: CausalLM, h: torch.Tensor, meta: AttnMeta, k_cache, v_cache) -> torch.Tensor:
        """The cache holds each head's expanded key and value, so attention is plain multi-head attention
        with keys wider than values. Returns [N, H * v] before o_proj."""
        N, H = h.shape[0], model.H
        if self.q_a is None:
            q = ops.linear(h, self.q)
        else:
            q = ops.linear(ops.rms_norm(ops.linear(h, self.q_a, self.q_a_bias), self.q_a_norm, MLA_NORM_EPS), self.q)
        q = q.view(N, H, model.D)
        latent, k_rope = ops.linear(h, self.kv_a, self.kv_a_bias).split([self.kv_a.shape[0] - self.rope, self.rope], -1)
        kv = ops.linear(ops.rms_norm(latent.contiguous(), self.kv_a_norm, MLA_NORM_EPS), self.kv_b).view(N, H, -1)
        k_rope = k_rope.contiguous().view(N, 1, self.rope)
        ops.rotate(q[..., self.nope:], model.cos, model.sin, meta.positions)
        ops.rotate(k_rope, model.cos, model.sin, meta.positions)
        k = torch.cat([kv[..., :self.nope], k_rope.expand(N, H, self.rope)], -1)
        ops.store_kv(k, kv[..., self.nope:], meta, k_cache, v_cache)
        return ops.paged_attention(q, k_cache, v_cache, meta, model.scale, None).reshape(N, -1)


def _use_latent_attention(model: CausalLM, c) -> None:
    """Latent attention caches every head's expanded key [nope | rope] and its value (narrower)."""
    model.KV, model.D, model.DV = model.H, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    model.scale = _mla_scale(c)


class DeepseekV3LM(CausalLM):
    def __init__(self, hf_config, *args):
        super().__init__(hf_config, *args)
        _use_latent_attention(self, hf_config)

    def _attention(self, layer: Layer, h, meta: AttnMeta, k_cache, v_cache, join=None) -> torch.Tensor:
        return self._row_parallel(layer.mla(self, h, meta, k_cache, v_cache), layer.o, layer.o_bias, o=True,
                                  join=join)


def kv_shapes(config: dict):
    heads = int(config.get("num_attention_heads"))
    key = int(config.get("qk_nope_head_dim")) + int(config.get("qk_rope_head_dim"))
    return [((heads, key), (heads, int(config.get("v_head_dim")))) for _ in range(int(config.get("num_hidden_layers")))]


def build_layer(c, i: int, get, path: str, ep=None) -> Layer:
    """Decoder layer i (also the MTP layer, i = num_hidden_layers): latent attention, then a dense MLP or,
    from first_k_dense_replace on, sigmoid-routed experts plus the shared expert."""
    p = f"layers.{i}."
    moe = _moe(c, i, p, get, path, ep) if i >= c.first_k_dense_replace else None
    mlp = mlp_weights(get, p, path) if moe is None else dict(gate_up=None, gate_up_bias=None, down=None, down_bias=None)
    return Layer(in_norm=get(p + "input_layernorm.weight"), qkv=None, qkv_bias=None,
                 o=get(p + "self_attn.o_proj.weight"), o_bias=get(p + "self_attn.o_proj.bias", False),
                 mlp_norm=get(p + "post_attention_layernorm.weight"), **mlp, moe=moe, mla=_mla(c, p, get))


def _moe(c, i: int, p: str, get, path: str, ep) -> MoE:
    E, groups, topk_group = c.n_routed_experts, c.n_group, c.topk_group
    if E % groups or E // groups < 2 or not 0 < topk_group <= groups:
        raise UnsupportedModel(f"{path}: {E} routed experts in n_group {groups} groups (top {topk_group}): each "
                               f"group needs at least 2 experts and topk_group at most n_group")
    block = p + "mlp."
    mine = expert_split(E, ep.world, ep.rank) if ep is not None else range(E)
    gate_up, down = load_experts(get, block, E, ("gate_proj", "up_proj", "down_proj"), mine)
    router = get(block + "gate.weight", as_dtype=torch.float32)   # float32 in any dtype, as transformers keeps it
    if router.shape[0] != E or gate_up.shape[0] != len(mine):
        raise UnsupportedModel(f"{path}: layer {i} has {router.shape[0]} router rows for {E} experts")
    route = SigmoidRouting(router, get(block + "gate.e_score_correction_bias", as_dtype=torch.float32),
                           int(c.num_experts_per_tok), bool(c.norm_topk_prob), groups, topk_group,
                           float(c.routed_scaling_factor))
    shared = block + "shared_experts."
    return MoE(route, gate_up, down, True, mine, ep if ep is not None and ep.world > 1 else None,
               shared_gate_up=cat_rows(path, get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")),
               shared_down=get(shared + "down_proj.weight"))


def _mla(c, p: str, get) -> MLA:
    a = p + "self_attn."
    nope, rope, kv_lora = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    lora = c.q_lora_rank is not None
    q = get(a + ("q_b_proj.weight" if lora else "q_proj.weight"))
    H = q.shape[0] // (nope + rope)          # the heads held here (under tensor parallelism: this process's)
    kv_a, kv_a_bias = get(a + "kv_a_proj_with_mqa.weight"), get(a + "kv_a_proj_with_mqa.bias", False)
    if getattr(c, "rope_interleave", True):
        q = _rope_rows_deinterleaved(q, H, nope + rope, nope)
        kv_a = _rope_rows_deinterleaved(kv_a, 1, kv_lora + rope, kv_lora)
        kv_a_bias = None if kv_a_bias is None else _rope_rows_deinterleaved(kv_a_bias, 1, kv_lora + rope, kv_lora)
    return MLA(q_a=get(a + "q_a_proj.weight") if lora else None, q_a_bias=get(a + "q_a_proj.bias", False),
               q_a_norm=get(a + "q_a_layernorm.weight") if lora else None, q=q, kv_a=kv_a, kv_a_bias=kv_a_bias,
               kv_a_norm=get(a + "kv_a_layernorm.weight"), kv_b=get(a + "kv_b_proj.weight"), nope=nope, rope=rope)


def _rope_rows_deinterleaved(w: torch.Tensor, blocks: int, block: int, rope_start: int) -> torch.Tensor:
    """w's rows (or a bias's entries) as `blocks` blocks of `block`, each block's rope rows [rope_start:]
    reordered evens then odds. DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)…; transformers
    computes them as [x_even * cos - x_odd * sin | x_odd * cos + x_even * sin] — exactly what the
    rotate-half convention computes over [x_even | x_odd], with the same numbers in the same order."""
    rope = block - rope_start
    order = torch.cat([torch.arange(rope_start), rope_start + torch.arange(0, rope, 2),
                       rope_start + torch.arange(1, rope, 2)])
    rows = (torch.arange(blocks).view(-1, 1) * block + order).view(-1)
    return take_rows(w, rows)


def _mla_scale(c) -> float:
    """Latent attention's softmax scale: qk_head_dim^-0.5, times yarn's mscale squared when the rope
    parameters set mscale_all_dim (transformers' yarn_apply_mscale)."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale = scale * mscale * mscale
    return scale


# -- the multi-token-prediction layer (method: mtp) ------------------------------------------------

class MTPHead(TargetFeatureHead):
    """The MTP layer DeepSeek-V3 trains beside its decoder and stores in its own checkpoint as layer
    num_hidden_layers (`model.layers.{N}.*`; transformers skips it): `enorm`, `hnorm`, `eh_proj` [h, 2h]
    (no bias), a full decoder layer (latent attention, MoE with shared experts) and
    `shared_head.{norm, head}`, with `embed_tokens` there too in some checkpoints (else the target's
    embedding; no `shared_head.head`: the target's LM head). A step: x = eh_proj(cat(enorm(embed(token)),
    hnorm(feature))) (the embedding first), then the decoder layer; logits = shared_head.head(
    shared_head.norm(output)). The first step's feature is the target's last hidden state (after its final
    norm, as vLLM passes it); the next steps feed back the layer's output before `shared_head.norm`, as
    vLLM's `deepseek_mtp` does when k exceeds the layers it has. Only the first MTP layer is used
    (DeepSeek-V3 has one). Under expert parallelism its MoE holds this rank's experts and exchanges tokens
    with the other ranks like the target's."""

    def __init__(self, config, layer: Layer, enorm: torch.Tensor, hnorm: torch.Tensor, eh_proj: torch.Tensor,
                 embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, target: CausalLM):
        super().__init__(config, [layer], embed, norm, lm_head, target.cos, target.sin)
        _use_latent_attention(self, config)
        self.enorm, self.hnorm, self.eh_proj = enorm, hnorm, eh_proj

    _attention = DeepseekV3LM._attention          # latent attention, as the target's layers

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        N = ids.shape[0]
        layer, (k_cache, v_cache) = self.layers[0], self.kv_caches[0]
        residual = ops.linear(self._input(ids, self.feats[:N]), self.eh_proj)
        a = self._attention(layer, ops.rms_norm(residual, layer.in_norm, self.eps), meta, k_cache, v_cache)
        h = ops.rms_norm(a, layer.mlp_norm, self.eps, residual)          # residual += a
        return residual + self._mlp(layer, h)

    def _input(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """cat(enorm(embedding), hnorm(feature)): on CUDA one kernel where the embedding is whole and unscaled."""
        if feats.is_cuda and self.vocab_first is None and self.embed_scale is None:
            from ..triton_kernels import embed_norm_pair
            return embed_norm_pair(ids, self.embed, self.enorm, feats, self.hnorm, self.eps)
        return torch.cat([ops.rms_norm(self.embedding(ids), self.enorm, self.eps),
                          ops.rms_norm(feats, self.hnorm, self.eps)], -1)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return super().logits(ops.rms_norm(hidden, self.norm, self.eps), out)    # vocab-parallel under TP


def load_mtp_head(md, target: CausalLM, dtype: torch.dtype, device: torch.device, ep=None) -> MTPHead:
    """The first MTP layer of the target checkpoint `md` (layer num_hidden_layers of `target`'s config),
    with this rank's routed experts only under expert parallelism (`ep`, as in load_model), split over the
    target's TP group as the target is (its decoder layer; its embedding and head by vocabulary, the target's
    or its own; eh_proj and the norms whole)."""
    c, i = target.config, target.config.num_hidden_layers
    experts = rank_experts(int(c.n_routed_experts), ep)
    shard = shard_of(md.config, target.tp.rank, target.tp.world) if target.tp is not None else None
    w = read_weights(md.weight_files, device, weights_of(range(i, i + 1), experts, top_level=False), shard)
    p = f"layers.{i}."
    prefix = "model." if f"model.{p}eh_proj.weight" in w else ""
    if prefix + p + "eh_proj.weight" not in w:
        raise UnsupportedModel(f"{md.path}: no multi-token-prediction layer (weight model.{p}eh_proj.weight)")
    get = weight_getter(w, prefix, md.path, dtype, quantization_of(md.config), getattr(target, "fp8_load", FP8Load()))
    layer = build_layer(c, i, get, md.path, ep)
    h = target.embed.shape[1]
    eh_proj = get(p + "eh_proj.weight")
    if eh_proj.shape != (h, 2 * h):
        raise UnsupportedModel(f"{md.path}: {prefix}{p}eh_proj.weight is {list(eh_proj.shape)}, expected [{h}, {2 * h}]")
    embed, head = get(p + "embed_tokens.weight", False), get(p + "shared_head.head.weight", False)
    mtp = MTPHead(c, layer, get(p + "enorm.weight"), get(p + "hnorm.weight"), eh_proj,
                  target.embed if embed is None else embed, get(p + "shared_head.norm.weight"),
                  target.lm_head if head is None else head, target)
    if shard is not None:
        mtp.split(shard, target.tp)
    return mtp


# its config class converts fields (rope, defaults): the config comes from transformers (fields None)
FAMILIES = [Family("DeepseekV3ForCausalLM", "deepseek_v3", build_layer, fields=None,
                   experts_keys=("n_routed_experts",),
                   kv_shapes=kv_shapes, model_class=DeepseekV3LM, refuse=refuse_activation, load_mtp=load_mtp_head,
                   tensor_parallel=True)]
