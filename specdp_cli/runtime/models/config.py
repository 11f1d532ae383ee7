"""The model config the decoder reads: config.json itself when it spells out every field the decoder
reads for its family, else transformers' config class (its defaults and conversions).

Why not always transformers: under some releases (5.17) importing any config class imports the
generation stack (scikit-learn, pandas) — 2-3 s of every rank's start-up. Configs that Hugging Face
writes (`save_pretrained`) hold every field a family defines, so they take the fast path; a
hand-written config missing one, a rope type other than the default (its tables come from
transformers' functions, which want the config object) or a family whose fields are None goes to
transformers. tests/test_hf_config.py checks that every field the decoder reads equals transformers' value.
"""
from __future__ import annotations

from types import SimpleNamespace

from .registry import COMMON_FIELDS, Family


def from_json(config: dict, family: Family) -> SimpleNamespace | None:
    """config.json as the decoder's config, or None when transformers must build it (see above)."""
    if family.fields is None or any(f not in config for f in COMMON_FIELDS + family.fields):
        return None
    rope = config["rope_parameters"]
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return None
    return SimpleNamespace(**{**config, "model_type": family.model_type})


def load_config(path: str, config: dict, family: Family):
    """The decoder's config of the model directory `path` (its config.json already read into `config`)."""
    fast = from_json(config, family)
    if fast is not None:
        return fast
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def head_config(config: dict):
    """An EAGLE head's Llama config (its config.json may name another architecture)."""
    from .registry import families

    fast = from_json(config, families()["LlamaForCausalLM"])
    if fast is not None:
        return fast
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
