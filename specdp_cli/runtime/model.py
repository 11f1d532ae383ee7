"""specdp's own decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixture-of-experts
Mixtral and Qwen3-MoE), loaded from a local Hugging Face directory.

Why not the transformers module itself: a forward here is a flat list of tokens from many
sequences over a paged KV cache, and a decode step must be one CUDA graph of a few fused kernels
per layer (q/k/v and gate/up are single matrix products; rotary embedding and the KV store are
one kernel; norms fuse the residual add). transformers' modules are used for what they are the
reference of: the config (defaults of every family) and the rotary tables (every rope type).

A forward: `hidden = model.forward(ids [N], meta)`, then `model.logits(hidden[rows])`.
"""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeldir import FAMILIES, ModelDir, UnsupportedModel, architecture_of, expert_split
from . import ops
from .ops import AttnMeta


@dataclass
class MoE:
    """A sparse MLP: a router picks `top_k` of E experts per token (softmax over the router's logits,
    top k, renormalised when `renormalize`), each expert a SiLU-gated MLP; the output is the
    weighted sum of the chosen experts'. Mixtral keeps the routing weights in float32 (`float_weights`),
    Qwen3-MoE casts them to the activations' dtype — as transformers does for each."""
    router: torch.Tensor                 # [E, hidden]
    gate_up: torch.Tensor                # [E, 2 * inter, hidden]
    down: torch.Tensor                   # [E, hidden, inter]
    top_k: int
    renormalize: bool
    float_weights: bool
    experts: range                       # the experts held here (gate_up[j] is expert experts[j])
    ep: object | None = None             # expert parallelism: the DP group that holds the other experts

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        # every expert over every token, weighted by its routing weight (0 where not chosen): fixed
        # shapes, so a CUDA graph holds it; the experts are added in index order, as transformers does.
        # Under expert parallelism the ranks' tokens are gathered, each rank adds its experts' share, and
        # a reduce-scatter returns each rank the sum for its own tokens.
        x = h if self.ep is None else self.ep.ep_all_gather(h)
        probs = torch.softmax(F.linear(x, self.router).float(), -1)
        w, idx = torch.topk(probs, self.top_k, -1)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        if not self.float_weights:
            w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for j, e in enumerate(self.experts):
            we = (w * (idx == e)).sum(-1, keepdim=True)
            y = F.linear(ops.silu_and_mul(F.linear(x, self.gate_up[j])), self.down[j])
            out += (y * we).to(x.dtype)
        return out if self.ep is None else self.ep.ep_reduce_scatter(out)


@dataclass
class Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
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


class CausalLM:
    def __init__(self, hf_config, layers: list[Layer], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = hf_config
        self.config = c
        self.layers = layers
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.cos, self.sin = cos, sin                       # [max_pos, head_dim // 2] float32
        self.H = c.num_attention_heads
        self.KV = getattr(c, "num_key_value_heads", None) or self.H
        self.D = getattr(c, "head_dim", None) or c.hidden_size // self.H
        self.eps = c.rms_norm_eps
        self.scale = self.D ** -0.5
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
        return [((self.KV, self.D), (self.KV, self.D)) for _ in self.layers]

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
            if layer.moe is not None:
                x = layer.moe(h)
            else:
                x = F.linear(ops.silu_and_mul(F.linear(h, layer.gate_up, layer.gate_up_bias)), layer.down,
                             layer.down_bias)
        out = ops.rms_norm(x, self.norm, self.eps, residual)
        if len(self.layers) in self.aux_layers:
            self._keep_aux(len(self.layers), residual)
        return out

    def _keep_aux(self, layer: int, stream: torch.Tensor) -> None:
        h = stream.shape[1]
        for j, at in enumerate(self.aux_layers):
            if at == layer:
                self.aux_buf[:stream.shape[0], j * h:(j + 1) * h].copy_(stream)

    def _attention(self, layer: Layer, h, meta: AttnMeta, k_cache, v_cache) -> torch.Tensor:
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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


# ---------------------------------------------------------------------------------------------
# loading

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _read_weights(files: list[str], device: torch.device, experts: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, but with `experts` set only those experts' per-expert tensors."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(f, framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    m = _EXPERT.search(name) if experts is not None else None
                    if m is None or int(m.group(1)) in experts:
                        out[name] = fh.get_tensor(name)
        else:
            out.update(torch.load(f, map_location=device, weights_only=True))
    return out


def rotary_tables(hf_config, model_type: str, arch: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim // 2] float32, as transformers computes them: the inverse
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
    (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2; Qwen3-MoE: mlp.experts.{e}.gate/up/down_proj) or
    fused as transformers 5 holds them (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj)."""
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
    router = get(block + "gate.weight")
    if router.shape[0] != E or gate_up.shape[0] != len(mine):
        raise UnsupportedModel(f"{path}: layer {i} has {router.shape[0]} router rows for {E} experts")
    return MoE(router, gate_up, down, int(c.num_experts_per_tok), renormalize, float_weights, mine,
               ep if ep is not None and ep.world > 1 else None)


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_len: int, ep=None) -> CausalLM:
    """Load a supported Hugging Face causal LM directory as specdp's decoder. `ep`: the DP group over
    which a mixture-of-experts model's routed experts are split (each rank reads only its own)."""
    from transformers import AutoConfig

    md = ModelDir.open(path, "model")
    arch = architecture_of(md.config)
    model_type = FAMILIES[arch]
    c = AutoConfig.from_pretrained(path)
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{path}: hidden_act {c.hidden_act!r} is not supported (silu only)")
    experts = None
    if ep is not None:            # read only this rank's experts
        experts = set(expert_split(md.num_experts, ep.world, ep.rank))
    w = _read_weights(md.weight_files, device, experts)
    prefix = "model." if "model.embed_tokens.weight" in w else ""

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        t = w.pop(prefix + name, None)
        if t is None:
            if required:
                raise UnsupportedModel(f"{path}: weight {prefix + name} is missing")
            return None
        return t.to(dtype)

    def cat(*ts):
        if all(t is None for t in ts):
            return None
        if any(t is None for t in ts):
            raise UnsupportedModel(f"{path}: some projections of a layer have a bias and others not")
        return torch.cat(ts, 0).contiguous()

    types = getattr(c, "layer_types", None)
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        moe = _moe(c, model_type, i, p, get, path, ep)
        if types:
            window = c.sliding_window if types[i] == "sliding_attention" else None
        else:
            window = getattr(c, "sliding_window", None) if model_type == "mistral" else None
        layers.append(Layer(
            in_norm=get(p + "input_layernorm.weight"),
            qkv=cat(get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"), get(p + "self_attn.v_proj.weight")),
            qkv_bias=cat(get(p + "self_attn.q_proj.bias", False), get(p + "self_attn.k_proj.bias", False),
                         get(p + "self_attn.v_proj.bias", False)),
            o=get(p + "self_attn.o_proj.weight"), o_bias=get(p + "self_attn.o_proj.bias", False),
            post_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=None if moe else cat(get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")),
            gate_up_bias=None if moe else cat(get(p + "mlp.gate_proj.bias", False), get(p + "mlp.up_proj.bias", False)),
            down=None if moe else get(p + "mlp.down_proj.weight"),
            down_bias=None if moe else get(p + "mlp.down_proj.bias", False), moe=moe,
            q_norm=get(p + "self_attn.q_norm.weight", False), k_norm=get(p + "self_attn.k_norm.weight", False),
            window=int(window) if window else None))
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
