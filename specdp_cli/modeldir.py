"""What a local Hugging Face model directory says about itself, read without loading weights."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from functools import cached_property

from .runtime.models.naming import expert_split, layer_index  # noqa: F401 - preflight's too
from .runtime.models.quant import BlockFP8, QuantizationError, quantizable, quantization_of
from .runtime.models.registry import (UnsupportedModel, architecture_of, attention_kv_shapes,  # noqa: F401
                                      family_of)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


class ModelDirError(Exception):
    pass


@dataclass
class ModelDir:
    path: str
    config: dict

    @classmethod
    def open(cls, path: str, role: str) -> "ModelDir":
        if not path:
            raise ModelDirError(f"no {role} directory is set")
        if not os.path.isdir(path):
            raise ModelDirError(f"{role} directory not found: {path} (give a local Hugging Face model directory)")
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelDirError(f"{role} directory {path} has no config.json (is it a Hugging Face model directory?)")
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError) as e:
            raise ModelDirError(f"{role} config {cfg_path} cannot be read: {e}") from None
        if not isinstance(config, dict):
            raise ModelDirError(f"{role} config {cfg_path} is not a JSON object")
        # multimodal wrappers keep the language model's settings in text_config
        text = config.get("text_config")
        if isinstance(text, dict):
            config = {**config, **text}
        return cls(path=path, config=config)

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))

    @property
    def max_position_embeddings(self) -> int | None:
        v = self.get("max_position_embeddings") or self.get("n_positions") or self.get("max_sequence_length")
        return int(v) if v else None

    @property
    def rope_scaling(self) -> dict | None:
        """A rope-scaling setting that stretches the trained context (None for plain RoPE)."""
        for key in ("rope_scaling", "rope_parameters"):
            v = self.get(key)
            if isinstance(v, dict):
                kind = v.get("rope_type") or v.get("type")
                if kind and kind != "default":
                    return v
        return None

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model, or an architecture specdp does not run)."""
        try:
            return family_of(self.config).num_experts(self.config)
        except UnsupportedModel:
            return 0

    @property
    def quantization(self) -> BlockFP8 | None:
        """The checkpoint's block-FP8 quantization (None: unquantized, or one specdp refuses: family_of says why)."""
        try:
            return quantization_of(self.config)
        except QuantizationError:
            return None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def vocab_size(self) -> int | None:
        return self.get("vocab_size")

    @property
    def stored_dtype(self) -> str:
        """The weights' dtype: the tensors' own (safetensors headers) where known — a config may say
        otherwise (the shipped EAGLE head's says float32, its tensors are bf16) — else config.json's."""
        dtypes = {t for t, _ in self.tensor_headers.values()}
        if len(dtypes) == 1:
            found = SAFETENSORS_DTYPES.get(dtypes.pop())
            if found:
                return found
        return str(self.get("dtype") or self.get("torch_dtype") or "float32")

    @cached_property
    def tensor_headers(self) -> dict[str, tuple[str, list[int]]]:
        """name -> (dtype, shape) of every tensor in the safetensors files (their JSON headers only;
        empty for .bin checkpoints or unreadable files)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for f in self.weight_files:
            if not f.endswith(".safetensors"):
                continue
            try:
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n)) if 0 < n < (100 << 20) else {}
            except (OSError, ValueError):
                continue
            for name, info in header.items():
                if name != "__metadata__" and isinstance(info, dict):
                    out[name] = (str(info.get("dtype")), list(info.get("shape") or []))
        return out

    @property
    def num_layers(self) -> int:
        return int(self.get("num_hidden_layers") or self.get("n_layer") or 0)

    def kv_shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per layer ((kv heads, key dim), (kv heads, value dim)), from config.json by its family — what the
        loaded model's `kv_shapes()` returns, known before loading it. An EAGLE head (whose architecture
        names no family) caches like the Llama layer it is."""
        try:
            return family_of(self.config).kv_shapes(self.config)
        except UnsupportedModel:
            return attention_kv_shapes(self.config)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.kv_shapes(), DTYPE_BYTES.get(dtype, 4))

    @cached_property
    def weight_files(self) -> list[str]:
        files = sorted(glob.glob(os.path.join(self.path, "*.safetensors")))
        return files or sorted(glob.glob(os.path.join(self.path, "*.bin")))

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers the config counts (DeepSeek-V3's num_nextn_predict_layers), stored
        after the decoder layers as layers num_hidden_layers, num_hidden_layers + 1…"""
        return int(self.get("num_nextn_predict_layers") or 0)

    def loaded_share(self, mtp: bool = False, experts_held: float = 1.0, tp: int = 1) -> float:
        """The share of the weights' bytes a process loads (safetensors headers; 1.0 if unknown): the layers past
        the decoder's only the first, and only with `mtp` (method mtp's drafter); of each routed expert's
        tensors `experts_held` (expert parallelism); of each tensor a TP group of `tp` splits one process's part
        (models/tensor_parallel.py: attention — latent attention by heads —, MLP, each routed expert's columns and
        DeepSeek's shared experts' as a dense MLP's; the MTP layer as the target's). DeepSeek's `shared_experts`
        are not routed."""
        from .runtime.models.tensor_parallel import held_fraction

        split = self._tensor_parallel(tp)
        sizes = {n: (shape, _numel(shape)) for n, (_, shape) in self.tensor_headers.items()
                 if not n.endswith("_scale_inv")}
        total = sum(v for _, v in sizes.values())

        def held(name: str, shape) -> float:
            layer = layer_index(name)
            if layer is not None and layer >= self.num_layers and not (mtp and layer == self.num_layers):
                return 0.0
            share = experts_held if ".experts." in name else 1.0
            return share * held_fraction(name, shape, self.config, tp) if split else share
        return sum(v * held(n, shape) for n, (shape, v) in sizes.items()) / total if total else 1.0

    def kv_share(self, tp: int) -> float:
        """The share of the KV cache one process of a TP group of `tp` holds (its KV heads; 1.0 unsplit)."""
        from .runtime.models.tensor_parallel import shard_of

        if not self._tensor_parallel(tp):
            return 1.0
        shard = shard_of(self.config, 0, tp)
        return shard.local_kv_heads / shard.kv_heads

    def _tensor_parallel(self, tp: int) -> bool:
        """Whether a TP group of `tp` splits this model (its family splits, its shape allows)."""
        from .runtime.models.tensor_parallel import refusal

        if tp <= 1 or "intermediate_size" not in self.config:
            return False
        try:
            return family_of(self.config).tensor_parallel and refusal(self.config, tp) is None
        except UnsupportedModel:
            return False

    def _loaded_bytes(self, name: str, shape, dtype: str, fp8: bool) -> float:
        """Bytes of one tensor as loaded: in `dtype`, or with `fp8` (FP8 weights kept FP8) a quantizable weight's
        one byte an element plus a float32 scale per 128 x 128 block (models/quant.py)."""
        n = _numel(shape)
        if fp8 and len(shape) >= 2 and quantizable(name) and not (self.get("model_type") == "gpt_oss"
                                                                   and ".experts." in name):
            return n + 4 * (n // (shape[-1] * shape[-2])) * -(-shape[-2] // 128) * -(-shape[-1] // 128)
        return n * DTYPE_BYTES.get(dtype, 4)

    def weights_per_token(self, dtype: str, fp8: bool = False) -> dict | None:
        """What decoding one token reads of the decoder's weights in `dtype` (safetensors headers; None if
        unknown): `total_bytes` every decoder tensor (the MTP layers past it left out), `active_bytes` the
        same with each MoE layer's routed experts counted top_k of E and the input embedding one row (the
        whole table where the LM head is tied to it). At batch 1 a step reads `active_bytes`: the bound of
        decode speed is the device's bandwidth over it."""
        headers = self.tensor_headers
        if not headers:
            return None
        E, k = self.num_experts, int(self.get("num_experts_per_tok") or 0)
        tied = not any(n.endswith("lm_head.weight") for n in headers)
        total = active = 0.0
        for name, (_, shape) in headers.items():
            layer = layer_index(name)
            if (layer is not None and layer >= self.num_layers) or name.endswith("_scale_inv"):
                continue
            n = self._loaded_bytes(name, shape, dtype, fp8)
            total += n
            if E and ".experts." in name:
                active += n * k / E
            elif name.endswith("embed_tokens.weight") and not tied and shape:
                active += n / shape[0]
            else:
                active += n
        return {"active_bytes": int(active), "total_bytes": int(total),
                "routed": f"top {k} of {E} experts" if E else None}

    def weight_bytes(self, dtype: str, fp8: bool = False) -> int:
        """Bytes of the weights once loaded in `dtype` (files on disk, rescaled from their stored dtype; a block-FP8
        checkpoint's weights dequantized at load: its tensors' elements, scales left out, in `dtype`). With `fp8`
        (a block-FP8 checkpoint kept FP8, or `quantization: fp8` on a GPU with FP8) the quantizable weights count
        one byte an element plus their block scales."""
        if (self.quantization is not None or fp8) and self.tensor_headers:
            return int(sum(self._loaded_bytes(n, shape, dtype, fp8) for n, (_, shape) in self.tensor_headers.items()
                           if not n.endswith("_scale_inv")))
        on_disk = sum(os.path.getsize(f) for f in self.weight_files)
        stored = DTYPE_BYTES.get(self.stored_dtype, 4)
        return on_disk * DTYPE_BYTES.get(dtype, 4) // stored


def kv_bytes_per_token(shapes: list[tuple[tuple[int, int], tuple[int, int]]], dtype_bytes: int) -> int:
    """Bytes one cached token takes in a model whose layers cache keys and values of `shapes`: the one
    formula behind preflight's capacity report and the engine's KV pool."""
    return sum(kh * kd + vh * vd for (kh, kd), (vh, vd) in shapes) * dtype_bytes


def load_tokenizer(path: str):
    """The tokenizer of a local directory (no network: the path must be a directory). Loaded once
    per process and directory: preflight, reading the inputs and a rank in the CLI's own process
    share it (loading one takes seconds on slow file systems); nothing here changes a tokenizer."""
    key = os.path.realpath(path)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _load_tokenizer(path)
    return _TOKENIZERS[key]


_TOKENIZERS: dict = {}


def _load_tokenizer(path: str):
    if not os.path.isdir(path):
        raise ModelDirError(f"tokenizer directory not found: {path}")
    try:
        cls = _named_tokenizer_class(path)
        if cls is None:
            from transformers import AutoTokenizer as cls
        return cls.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure here is a property of the user's files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelDirError(f"tokenizer in {path} cannot be loaded: {first}") from None


def _named_tokenizer_class(path: str):
    """The class tokenizer_config.json names, when transformers exports it under that name (no remote
    code): what AutoTokenizer would pick, loaded without AutoTokenizer's auto-model machinery, which in
    some transformers releases (5.17) imports the generation stack — scikit-learn, pandas: 2-3 s of every
    process's start-up. None: let AutoTokenizer decide."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name.isidentifier() or config.get("auto_map"):
        return None
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):      # unknown here, or its module needs a missing package
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def has_tokenizer_files(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)


def eagle_layout(names) -> str | None:
    """Which EAGLE checkpoint layout a head's tensor names follow: "eagle" (EAGLE-1: `fc` over
    [embedding, feature], `layers.0.*` without an input norm), "eagle3" (`midlayer.*`, `d2t`), or None."""
    names = set(names)
    if "midlayer.self_attn.q_proj.weight" in names or "d2t" in names:
        return "eagle3"
    if "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names:
        return "eagle"
    return None


def aux_layer_ids(head_config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (the residual stream entering each; N = after the last
    layer): its config's `eagle_aux_hidden_state_layer_ids` (also under `eagle_config`), else vLLM's
    default (2, N // 2, N - 3)."""
    ids = head_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(head_config.get("eagle_config"), dict):
        ids = head_config["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)
    return (2, target_layers // 2, target_layers - 3)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

