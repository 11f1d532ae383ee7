"""The model config the decoder reads: config.json itself when it spells out every field the decoder
reads for its family, else transformers' config class (its defaults and conversions).

Why not always transformers: under some releases (5.17) importing any config class imports the
generation stack (scikit-learn, pandas) — 2-3 s of every rank's start-up. Configs that Hugging Face
writes (`save_pretrained`) hold every field a family defines, so they take the fast path; a
hand-written config missing one, a rope type other than the default (its tables come from
transformers' functions, which want the config object) or a family not listed goes to transformers.
tests/test_hf_config.py checks that every field the decoder reads equals transformers' value.
"""
from __future__ import annotations

from types import SimpleNamespace

COMMON = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
          "hidden_act", "tie_word_embeddings", "vocab_size", "rope_parameters")
# per family, the other fields its config class defines that specdp's decoder reads (families whose classes
# rename fields through an attribute map, e.g. Qwen3-MoE's num_experts, go to transformers)
FIELDS = {
    "llama": ("head_dim",),
    "mistral": ("head_dim", "sliding_window"),
    "qwen2": ("layer_types", "sliding_window"),
    "qwen3": ("head_dim", "layer_types", "sliding_window"),
    "mixtral": ("head_dim", "num_local_experts", "num_experts_per_tok"),
}


def from_json(config: dict, model_type: str) -> SimpleNamespace | None:
    """config.json as the decoder's config, or None when transformers must build it (see above)."""
    fields = FIELDS.get(model_type)
    if fields is None or any(f not in config for f in COMMON + fields):
        return None
    rope = config["rope_parameters"]
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return None
    return SimpleNamespace(**{**config, "model_type": model_type})


def load_config(path: str, config: dict, model_type: str):
    """The decoder's config of the model directory `path` (its config.json already read into `config`)."""
    fast = from_json(config, model_type)
    if fast is not None:
        return fast
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def head_config(config: dict):
    """An EAGLE head's Llama config (its config.json may name another architecture)."""
    fast = from_json(config, "llama")
    if fast is not None:
        return fast
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
