"""Loading a model directory as specdp's decoder, and a drafter's head, through the family registry."""
from __future__ import annotations

import torch

from ...modeldir import ModelDir
from .config import load_config
from .decoder import CausalLM
from .quant import fp8_load, quantization_of
from .registry import UnsupportedModel, family_of
from .rotary import rotary_tables, sliding_layer_tables
from .tensor_parallel import fp8_refusal, shard_of
from .weights import rank_experts, read_weights, weight_getter, weights_of


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_len: int, ep=None,
               quantization: str | None = None, tp=None) -> CausalLM:
    """Load a supported Hugging Face causal LM directory as specdp's decoder. `ep`: the DP group over
    which a mixture-of-experts model's routed experts are split (each rank reads only its own).
    `quantization` "fp8": quantize a high-precision checkpoint's linear layers at load (models/quant.py).
    `tp`: the TP group (dist.TPGroup) over which attention and MLP are split (models/tensor_parallel.py): a target,
    or a draft model split as a target (speculative.draft_tensor_parallel_size)."""
    md = ModelDir.open(path, "model")
    fam = family_of(md.config)
    c = load_config(path, md.config, fam)
    experts = rank_experts(fam.num_experts(md.config), ep)
    shard = None
    if tp is not None and tp.world > 1:
        if not fam.tensor_parallel:
            raise UnsupportedModel(f"{path}: {fam.architecture} cannot be split over a TP group yet")
        shard = shard_of(md.config, tp.rank, tp.world)
        why = fp8_refusal(md.tensor_headers, md.config, tp.world)
        if why:
            raise UnsupportedModel(f"{path}: {why}")
    w = read_weights(md.weight_files, device, weights_of(range(c.num_hidden_layers), experts), shard)
    quant = quantization_of(md.config)
    fp8 = fp8_load(quant, quantization, device, dtype, fam.model_type)
    get = weight_getter(w, "model." if "model.embed_tokens.weight" in w else "", path, dtype, quant, fp8)
    layers = [fam.build_layer(c, i, get, path, ep) for i in range(c.num_hidden_layers)]
    embed = get("embed_tokens.weight")
    norm = get("norm.weight")
    head = w.pop("lm_head.weight", None)
    if getattr(c, "tie_word_embeddings", False):
        lm_head = embed
    elif head is None:
        raise UnsupportedModel(f"{path}: weight lm_head.weight is missing (and the embeddings are not tied)")
    else:
        lm_head = head.to(dtype)
    cos, sin = rotary_tables(c, fam.model_type, fam.architecture, max(max_len, 1))
    local = sliding_layer_tables(c, fam.model_type, fam.architecture, max(max_len, 1))
    if local is not None:                    # rope kept per layer type: the sliding layers take their own tables
        local = (local[0].to(device), local[1].to(device))
        for layer, kind in zip(layers, c.layer_types):
            if kind == "sliding_attention":
                layer.rope = local
    model = (fam.model_class or CausalLM)(c, layers, embed, norm, lm_head, cos.to(device), sin.to(device))
    model.fp8_load = fp8                     # the MTP layer in the same checkpoint loads the same way
    if shard is not None:
        model.split(shard, tp)
    return model


def load_head(method: str, path: str, target: CausalLM, dtype: torch.dtype, device: torch.device, max_len: int,
              ep=None):
    """The drafting head of `method`: an EAGLE head from its directory ("eagle", "eagle3"), or the MTP layer
    of the target's checkpoint ("mtp": its family's; `ep` splits its experts as the target's)."""
    from .eagle import load_eagle3_head, load_eagle_head

    if method == "eagle":
        return load_eagle_head(path, target, dtype, device, max_len)
    if method == "eagle3":
        return load_eagle3_head(path, target, dtype, device, max_len)
    md = ModelDir.open(path, "model")
    fam = family_of(md.config)
    if fam.load_mtp is None:
        raise UnsupportedModel(f"{path}: {fam.architecture} has no multi-token-prediction layer specdp reads")
    return fam.load_mtp(md, target, dtype, device, ep)
