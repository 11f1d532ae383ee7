"""The model families specdp runs, keyed by the architecture a config.json names.

A family (`Family`, defined in its own file) says everything specdp needs to know about it: the
config.json fields its decoder reads, how each decoder layer's weights load (`build_layer`), what one
cached token holds per layer (`kv_shapes`, read by preflight before any weight is loaded and by the
KV cache after), how many routed experts a layer has, its forward (`model_class`), its multi-token-
prediction layer where it has one, and which checkpoints it refuses by name. Adding a family is its
file and one line in `_FAMILY_MODULES`.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


class UnsupportedModel(ValueError):
    pass


# config.json fields every family's decoder reads (see config.py's fast path)
COMMON_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                 "tie_word_embeddings", "vocab_size", "rope_parameters")

KVShapes = list[tuple[tuple[int, int], tuple[int, int]]]


def attention_kv_shapes(config: dict) -> KVShapes:
    """Per layer ((kv heads, key dim), (kv heads, value dim)) of multi-head / grouped-query attention."""
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
    return [((kv, dim), (kv, dim)) for _ in range(int(config.get("num_hidden_layers") or 0))]


@dataclass(frozen=True)
class Family:
    architecture: str                      # the config.json `architectures` entry, e.g. "LlamaForCausalLM"
    model_type: str                        # transformers' model_type and module name, e.g. "llama"
    build_layer: Callable                  # (config, i, get, path, ep) -> decoder layer i (decoder.Layer)
    fields: tuple[str, ...] | None = ()    # config.json fields read beyond COMMON_FIELDS; None: always transformers'
    experts_keys: tuple[str, ...] = ()     # config keys of routed experts per MoE layer, the first found counts (dense: none)
    kv_shapes: Callable[[dict], KVShapes] = attention_kv_shapes
    model_class: type | None = None        # its forward (None: decoder.CausalLM, a pre-norm decoder)
    refuse: Callable[[dict], str | None] | None = None     # why a config cannot run (None: it can)
    load_mtp: Callable | None = None       # (path, target, dtype, device, ep) -> its MTP layer as a drafter
    tensor_parallel: bool = False          # loads split over a TP group (models/tensor_parallel.py's split)

    def num_experts(self, config: dict) -> int:
        n = next((config[k] for k in self.experts_keys if k in config), 0)
        return int(n) if isinstance(n, int) and n > 1 else 0


# family modules, each defining FAMILIES (one Family per architecture it covers)
_FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
                   "gemma3", "phi3", "olmo2", "gpt_oss")

_registry: dict[str, Family] | None = None


def families() -> dict[str, Family]:
    """Every supported architecture's family (the family modules load on first use)."""
    global _registry
    if _registry is None:
        _registry = {}
        for name in _FAMILY_MODULES:
            for fam in importlib.import_module(f"{__package__}.{name}").FAMILIES:
                _registry[fam.architecture] = fam
    return _registry


def family_of(config: dict) -> Family:
    """The family a config.json names (by `architectures`, else `model_type`), or UnsupportedModel saying
    what is supported or why this checkpoint is refused."""
    known = families()
    archs = config.get("architectures") or []
    fam = next((known[a] for a in archs if a in known), None)
    if fam is None and not archs:
        fam = next((f for f in known.values() if f.model_type == config.get("model_type")), None)
    if fam is None:
        named = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
        raise UnsupportedModel(f"{named} is not supported; specdp runs {', '.join(sorted(known))}")
    why = fam.refuse(config) if fam.refuse else None
    if why is None:
        from .quant import QuantizationError, quantization_of
        try:
            quantization_of(config)          # block-scaled FP8 is read; any other quantization is refused
        except QuantizationError as e:
            why = str(e)
    if why:
        raise UnsupportedModel(why)
    return fam


def architecture_of(config: dict) -> str:
    return family_of(config).architecture
