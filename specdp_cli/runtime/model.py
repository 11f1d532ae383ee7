"""specdp's own decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts
Mixtral and Qwen3-MoE) and DeepSeek-V3 (latent attention, sigmoid-routed experts with shared experts),
loaded from a local Hugging Face directory.

Why not the transformers module itself: a forward here is a flat list of tokens from many
sequences over a paged KV cache, and a decode step must be one CUDA graph of a few fused kernels
per layer (q/k/v and gate/up are single matrix products; rotary embedding and the KV store are
one kernel; norms fuse the residual add). transformers' modules are used for what they are the
reference of: the config (defaults of every family) and the rotary tables (every rope type).

A forward: `hidden = model.forward(ids [N], meta)`, then `model.logits(hidden[rows])`.
"""
from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeldir import FAMILIES, ModelDir, UnsupportedModel, architecture_of, expert_split, layer_index
from . import ops
from .hf_config import load_config
from .ops import AttnMeta


def _gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(ops.silu_and_mul(F.linear(x, gate_up)), down)


@dataclass
class SigmoidRouting:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, op for op): sigmoid scores in float32;
    the experts are chosen by score + `bias`, only among the `topk_group` of `groups` expert groups whose
    two best scores sum highest; their weights are their scores without the bias (renormalised when the
    MoE says so), times `scaling`."""
    bias: torch.Tensor                   # [E] float32 (e_score_correction_bias)
    groups: int
    topk_group: int
    scaling: float

    def __call__(self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool):
        scores = torch.sigmoid(F.linear(x.float(), router))
        choice = scores + self.bias
        N, E = choice.shape
        per_group = E // self.groups
        group_scores = choice.view(N, self.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        in_best = torch.zeros_like(group_scores).scatter_(1, best_groups, 1)
        in_best = in_best.unsqueeze(-1).expand(N, self.groups, per_group).reshape(N, E)
        idx = torch.topk(choice.masked_fill(~in_best.bool(), float("-inf")), k=top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


@dataclass
class MoE:
    """A sparse MLP: a router picks `top_k` of E experts per token (softmax over the router's logits,
    top k, renormalised when `renormalize`; or `sigmoid` routing), each expert a SiLU-gated MLP; the
    output is the weighted sum of the chosen experts', plus the shared experts' output where the model
    has them (DeepSeek). Mixtral and DeepSeek keep the routing weights in float32 (`float_weights`),
    Qwen3-MoE casts them to the activations' dtype — as transformers does for each."""
    router: torch.Tensor                 # [E, hidden] (float32 with sigmoid routing)
    gate_up: torch.Tensor                # [E, 2 * inter, hidden]
    down: torch.Tensor                   # [E, hidden, inter]
    top_k: int
    renormalize: bool
    float_weights: bool
    experts: range                       # the experts held here (gate_up[j] is expert experts[j])
    ep: object | None = None             # expert parallelism: the DP group that holds the other experts
    sigmoid: SigmoidRouting | None = None        # DeepSeek's routing instead of softmax over the logits
    shared_gate_up: torch.Tensor | None = None   # the shared experts (one gated MLP), on every rank whole
    shared_down: torch.Tensor | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # every expert over every token, weighted by its routing weight (0 where not chosen): fixed
        # shapes, so a CUDA graph holds it; the experts are added in index order, as transformers does.
        # Under expert parallelism the ranks' tokens are gathered, each rank adds its experts' share, and
        # a reduce-scatter returns each rank the sum for its own tokens; the shared experts then run on
        # the rank's own tokens only, so they are added once.
        x = h if self.ep is None else self.ep.ep_all_gather(h)
        w, idx = self._route(x)
        if not self.float_weights:
            w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for j, e in enumerate(self.experts):
            we = (w * (idx == e)).sum(-1, keepdim=True)
            out += (_gated_mlp(x, self.gate_up[j], self.down[j]) * we).to(x.dtype)
        if self.ep is not None:
            out = self.ep.ep_reduce_scatter(out)
        if self.shared_gate_up is not None:
            out = out + _gated_mlp(h, self.shared_gate_up, self.shared_down)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [N, top_k] (float32) and the experts they go to."""
        if self.sigmoid is not None:
            return self.sigmoid(x, self.router, self.top_k, self.renormalize)
        probs = torch.softmax(F.linear(x, self.router).float(), -1)
        w, idx = torch.topk(probs, self.top_k, -1)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, idx


# DeepSeek's q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps, whatever rms_norm_eps says
MLA_NORM_EPS = 1e-6


@dataclass
class MLA:
    """DeepSeek's multi-head latent attention. Each head's query is [nope | rope]: from `q` (q_proj), or
    with a query LoRA rank from `q` (q_b_proj) over the RMSNorm (`q_a_norm`) of `q_a`. `kv_a` gives the
    latent (kv_lora) and one rope key that every head shares; `kv_b` expands the latent's RMSNorm
    (`kv_a_norm`) into each head's key nope part and value. The rows that produce rope parts are
    de-interleaved at load when the model interleaves its rotary pairs (see _rope_rows_deinterleaved)."""
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


@dataclass
class Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor | None             # None with latent attention (mla)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None          # Qwen3: RMSNorm of each head's q and k before rotation
    k_norm: torch.Tensor | None
    window: int | None
    moe: MoE | None = None               # a sparse MLP instead of gate_up / down
    mla: MLA | None = None               # DeepSeek's latent attention instead of qkv


class CausalLM:
    def __init__(self, hf_config, layers: list[Layer], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = hf_config
        self.config = c
        self.layers = layers
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.cos, self.sin = cos, sin                       # [max_pos, rotary dim // 2] float32
        self.H = c.num_attention_heads
        if getattr(c, "kv_lora_rank", None):
            # latent attention caches every head's expanded key [nope | rope] and its value (narrower)
            self.KV, self.D, self.DV = self.H, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
            self.scale = _mla_scale(c)
        else:
            self.KV = getattr(c, "num_key_value_heads", None) or self.H
            self.D = getattr(c, "head_dim", None) or c.hidden_size // self.H
            self.DV = self.D
            self.scale = self.D ** -0.5
        self.eps = c.rms_norm_eps
        self.vocab_size = lm_head.shape[0]
        self.dtype = embed.dtype
        self.device = embed.device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []    # per layer, set by the KV cache
        # EAGLE-3 reads the residual stream entering these layers (vLLM's aux hidden states; id N: after the
        # last layer, before the final norm), written side by side into aux_buf [tokens, len(aux) * hidden]
        self.aux_layers: tuple[int, ...] = ()
        self.aux_buf: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per layer ((kv_heads, key dim), (kv_heads, value dim)): what one cached token holds."""
        return [((self.KV, self.D), (self.KV, self.DV)) for _ in self.layers]

    def forward(self, ids: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        """ids [N] -> final hidden states [N, hidden] (after the last norm)."""
        x = F.embedding(ids, self.embed)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, self.kv_caches)):
            if residual is None:
                residual = x
                h = ops.rms_norm(x, layer.in_norm, self.eps)
            else:
                h = ops.rms_norm(x, layer.in_norm, self.eps, residual)     # residual += x
            if i in self.aux_layers:
                self._keep_aux(i, residual)
            x = self._attention(layer, h, meta, k_cache, v_cache)
            h = ops.rms_norm(x, layer.post_norm, self.eps, residual)
            x = self._mlp(layer, h)
        out = ops.rms_norm(x, self.norm, self.eps, residual)
        if len(self.layers) in self.aux_layers:
            self._keep_aux(len(self.layers), residual)
        return out

    def _keep_aux(self, layer: int, stream: torch.Tensor) -> None:
        h = stream.shape[1]
        for j, at in enumerate(self.aux_layers):
            if at == layer:
                self.aux_buf[:stream.shape[0], j * h:(j + 1) * h].copy_(stream)

    @staticmethod
    def _mlp(layer: Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.moe is not None:
            return layer.moe(h)
        return F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)

    def _attention(self, layer: Layer, h, meta: AttnMeta, k_cache, v_cache) -> torch.Tensor:
        if layer.mla is not None:
            return self._latent_attention(layer, h, meta, k_cache, v_cache)
        N = h.shape[0]
        H, KV, D = self.H, self.KV, self.D
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        if layer.q_norm is not None:
            heads = qkv.view(N, H + 2 * KV, D)
            heads[:, :H] = ops.rms_norm(heads[:, :H].reshape(N * H, D), layer.q_norm, self.eps).view(N, H, D)
            heads[:, H:H + KV] = ops.rms_norm(heads[:, H:H + KV].reshape(N * KV, D), layer.k_norm, self.eps).view(N, KV, D)
        ops.rope_and_store(qkv, self.cos, self.sin, meta, k_cache, v_cache, H, KV, D)
        q = qkv[:, :H * D].view(N, H, D)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, layer.window)
        return F.linear(out.reshape(N, -1), layer.o, layer.o_bias)

    def _latent_attention(self, layer: Layer, h, meta: AttnMeta, k_cache, v_cache) -> torch.Tensor:
        """DeepSeek's MLA (see MLA). The cache holds each head's expanded key and value, so attention
        is plain multi-head attention with keys wider than values."""
        a, N, H = layer.mla, h.shape[0], self.H
        if a.q_a is None:
            q = F.linear(h, a.q)
        else:
            q = F.linear(ops.rms_norm(F.linear(h, a.q_a, a.q_a_bias), a.q_a_norm, MLA_NORM_EPS), a.q)
        q = q.view(N, H, self.D)
        latent, k_rope = F.linear(h, a.kv_a, a.kv_a_bias).split([a.kv_a.shape[0] - a.rope, a.rope], -1)
        kv = F.linear(ops.rms_norm(latent.contiguous(), a.kv_a_norm, MLA_NORM_EPS), a.kv_b).view(N, H, -1)
        k_rope = k_rope.contiguous().view(N, 1, a.rope)
        ops.rotate(q[..., a.nope:], self.cos, self.sin, meta.positions)
        ops.rotate(k_rope, self.cos, self.sin, meta.positions)
        k = torch.cat([kv[..., :a.nope], k_rope.expand(N, H, a.rope)], -1)
        ops.store_kv(k, kv[..., a.nope:], meta, k_cache, v_cache)
        out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, None)
        return F.linear(out.reshape(N, -1), layer.o, layer.o_bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


def routed_expert_bytes(model: CausalLM) -> int:
    """Bytes of the routed experts' weights `model` holds (under expert parallelism: this rank's share)."""
    return sum(layer.moe.gate_up.nbytes + layer.moe.down.nbytes for layer in model.layers if layer.moe is not None)


# ---------------------------------------------------------------------------------------------
# loading

_EXPERT = re.compile(r"\.experts\.(\d+)\.")      # routed experts only: ".shared_experts." does not match


def _read_weights(files: list[str], device: torch.device,
                  wanted: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names are `wanted` (the others are never read from a safetensors file)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(f, framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    if wanted(name):
                        out[name] = fh.get_tensor(name)
        else:
            out.update((k, v) for k, v in torch.load(f, map_location=device, weights_only=True).items() if wanted(k))
    return out


def _weights_of(layers: range, experts: set[int] | None, top_level: bool = True) -> Callable[[str], bool]:
    """Which tensors a model reads: those of the decoder layers in `layers` and, with `top_level`, those of
    no layer (embedding, final norm, LM head); with `experts` set (expert parallelism) only those routed
    experts' per-expert tensors. A target reads layers 0..num_hidden_layers - 1: DeepSeek-V3 stores its
    multi-token-prediction layer as layer num_hidden_layers, a drafter's weights (`method: mtp`)."""
    def wanted(name: str) -> bool:
        layer = layer_index(name)
        if layer is None:
            return top_level
        if layer not in layers:
            return False
        expert = _EXPERT.search(name) if experts is not None else None
        return expert is None or int(expert.group(1)) in experts
    return wanted


def rotary_tables(hf_config, model_type: str, arch: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim // 2] float32 (DeepSeek's config sets head_dim to its qk_rope_head_dim:
    only the rope part of a head rotates), as transformers computes them: the inverse
    frequencies of every rope type come from transformers' own functions (linear, llama3, yarn…).
    Only the types that depend on the sequence length (dynamic, longrope) run the family's rotary
    module itself — importing a modeling module costs seconds of start-up."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    pos = torch.arange(max_len, dtype=torch.float32)
    if rope_type in ("dynamic", "longrope"):
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        rotary = getattr(module, arch.replace("ForCausalLM", "RotaryEmbedding"))(config=hf_config)
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos.long().view(1, -1))
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    freqs = pos.view(-1, 1) * inv_freq.float().view(1, -1)
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()


def _moe(c, model_type: str, i: int, p: str, get, path: str, ep=None) -> MoE | None:
    """Layer i's sparse MLP, or None for a dense one. Experts are read as stored per expert
    (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2; Qwen3-MoE, DeepSeek: mlp.experts.{e}.gate/up/down_proj) or
    fused as transformers 5 holds them (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj)."""
    deepseek = model_type == "deepseek_v3"
    if model_type == "mixtral":
        E, block, names = c.num_local_experts, p + "block_sparse_moe.", ("w1", "w3", "w2")
        renormalize, float_weights = True, True
    elif model_type == "qwen3_moe":
        sparse = (i not in (getattr(c, "mlp_only_layers", None) or []) and c.num_experts > 0
                  and (i + 1) % getattr(c, "decoder_sparse_step", 1) == 0)
        if not sparse:
            return None
        E, block, names = c.num_experts, p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        renormalize, float_weights = bool(getattr(c, "norm_topk_prob", False)), False
    elif deepseek:
        if i < c.first_k_dense_replace:
            return None
        E, block, names = c.n_routed_experts, p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        renormalize, float_weights = bool(c.norm_topk_prob), True
    else:
        return None
    mine = expert_split(E, ep.world, ep.rank) if ep is not None else range(E)
    fused = get(block + "experts.gate_up_proj", False)
    if fused is not None:
        gate_up = fused[mine.start:mine.stop].contiguous()
        down = get(block + "experts.down_proj")[mine.start:mine.stop].contiguous()
    else:
        g, u, d = names
        gate_up = torch.stack([torch.cat([get(f"{block}experts.{e}.{g}.weight"), get(f"{block}experts.{e}.{u}.weight")])
                               for e in mine]).contiguous()
        down = torch.stack([get(f"{block}experts.{e}.{d}.weight") for e in mine]).contiguous()
    # DeepSeek's router stays float32 in any dtype (transformers' _keep_in_fp32_modules_strict)
    router = get(block + "gate.weight", as_dtype=torch.float32 if deepseek else None)
    if router.shape[0] != E or gate_up.shape[0] != len(mine):
        raise UnsupportedModel(f"{path}: layer {i} has {router.shape[0]} router rows for {E} experts")
    moe = MoE(router, gate_up, down, int(c.num_experts_per_tok), renormalize, float_weights, mine,
              ep if ep is not None and ep.world > 1 else None)
    if deepseek:
        moe.sigmoid = _sigmoid_routing(c, block, get, path)
        shared = block + "shared_experts."
        moe.shared_gate_up = torch.cat([get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")]).contiguous()
        moe.shared_down = get(shared + "down_proj.weight")
    return moe


def _sigmoid_routing(c, block: str, get, path: str) -> SigmoidRouting:
    E, groups, topk_group = c.n_routed_experts, c.n_group, c.topk_group
    if E % groups or E // groups < 2 or not 0 < topk_group <= groups:
        raise UnsupportedModel(f"{path}: {E} routed experts in n_group {groups} groups (top {topk_group}): each "
                               f"group needs at least 2 experts and topk_group at most n_group")
    return SigmoidRouting(get(block + "gate.e_score_correction_bias", as_dtype=torch.float32), groups, topk_group,
                          float(c.routed_scaling_factor))


def _mla(c, p: str, get) -> MLA | None:
    """The latent attention of the layer under prefix p, or None for a model without it."""
    if not getattr(c, "kv_lora_rank", None):
        return None
    a = p + "self_attn."
    H, nope, rope, kv_lora = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    lora = c.q_lora_rank is not None
    q = get(a + ("q_b_proj.weight" if lora else "q_proj.weight"))
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
    return w[rows.to(w.device)].contiguous()


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


def weight_getter(w: dict[str, torch.Tensor], prefix: str, path: str, dtype: torch.dtype):
    """`get(name, required=True, as_dtype=None)`: takes weight `prefix + name` out of `w`, in `dtype`."""
    def get(name: str, required: bool = True, as_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        t = w.pop(prefix + name, None)
        if t is None:
            if required:
                raise UnsupportedModel(f"{path}: weight {prefix + name} is missing")
            return None
        return t.to(as_dtype or dtype)
    return get


def _cat(path: str, *ts: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise UnsupportedModel(f"{path}: some projections of a layer have a bias and others not")
    return torch.cat(ts, 0).contiguous()


def decoder_layer(c, model_type: str, i: int, get, path: str, ep=None) -> Layer:
    """Decoder layer i (weights `layers.{i}.*` through `get`); `ep` as in load_model."""
    p = f"layers.{i}."
    moe = _moe(c, model_type, i, p, get, path, ep)
    mla = _mla(c, p, get)
    types = getattr(c, "layer_types", None)
    if types:
        window = c.sliding_window if types[i] == "sliding_attention" else None
    else:
        window = getattr(c, "sliding_window", None) if model_type == "mistral" else None
    return Layer(
        in_norm=get(p + "input_layernorm.weight"),
        qkv=None if mla else _cat(path, get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                                  get(p + "self_attn.v_proj.weight")),
        qkv_bias=None if mla else _cat(path, get(p + "self_attn.q_proj.bias", False),
                                       get(p + "self_attn.k_proj.bias", False),
                                       get(p + "self_attn.v_proj.bias", False)),
        o=get(p + "self_attn.o_proj.weight"), o_bias=get(p + "self_attn.o_proj.bias", False),
        post_norm=get(p + "post_attention_layernorm.weight"),
        gate_up=None if moe else _cat(path, get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")),
        gate_up_bias=None if moe else _cat(path, get(p + "mlp.gate_proj.bias", False),
                                           get(p + "mlp.up_proj.bias", False)),
        down=None if moe else get(p + "mlp.down_proj.weight"),
        down_bias=None if moe else get(p + "mlp.down_proj.bias", False), moe=moe,
        q_norm=get(p + "self_attn.q_norm.weight", False), k_norm=get(p + "self_attn.k_norm.weight", False),
        window=int(window) if window else None, mla=mla)


def rank_experts(md: ModelDir, ep) -> set[int] | None:
    """The routed experts this rank reads under expert parallelism (None: all of them)."""
    return None if ep is None else set(expert_split(md.num_experts, ep.world, ep.rank))


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_len: int, ep=None) -> CausalLM:
    """Load a supported Hugging Face causal LM directory as specdp's decoder. `ep`: the DP group over
    which a mixture-of-experts model's routed experts are split (each rank reads only its own)."""
    md = ModelDir.open(path, "model")
    arch = architecture_of(md.config)
    model_type = FAMILIES[arch]
    c = load_config(path, md.config, model_type)
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{path}: hidden_act {c.hidden_act!r} is not supported (silu only)")
    w = _read_weights(md.weight_files, device, _weights_of(range(c.num_hidden_layers), rank_experts(md, ep)))
    get = weight_getter(w, "model." if "model.embed_tokens.weight" in w else "", path, dtype)
    layers = [decoder_layer(c, model_type, i, get, path, ep) for i in range(c.num_hidden_layers)]
    embed = get("embed_tokens.weight")
    norm = get("norm.weight")
    head = w.pop("lm_head.weight", None)
    if getattr(c, "tie_word_embeddings", False):
        lm_head = embed
    elif head is None:
        raise UnsupportedModel(f"{path}: weight lm_head.weight is missing (and the embeddings are not tied)")
    else:
        lm_head = head.to(dtype)
    cos, sin = rotary_tables(c, model_type, arch, max(max_len, 1))
    return CausalLM(c, layers, embed, norm, lm_head, cos.to(device), sin.to(device))
