"""Quantized checkpoints: the block-scaled FP8 layout of DeepSeek-V3 / Qwen3-FP8 (Hugging Face's fine-grained FP8).

config.json's `quantization_config` says `quant_method: fp8`, `weight_block_size: [bm, bn]` (128 x 128 in the
published checkpoints) and `activation_scheme: dynamic`. Each quantized linear layer's `weight` [out, in] is
float8_e4m3fn and its `weight_scale_inv` [ceil(out / bm), ceil(in / bn)] float32 holds one scale per block:
the layer's real weight is weight * scale, block by block. Embeddings, norms, the LM head and the routers are
stored unquantized (as their own dtype says). specdp reads such checkpoints by dequantizing each FP8 weight to the
compute dtype as it loads it (exact: the same numbers a dequantized copy of the checkpoint holds). Torch-free at
import: preflight reads it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_DTYPES = ("F8_E4M3",)          # safetensors' name of float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]         # rows x columns of a weight that one scale covers

    def describe(self) -> str:
        return f"FP8 (float8_e4m3fn weights, one scale per {self.block[0]}x{self.block[1]} block, dynamic activations)"


class QuantizationError(ValueError):
    """A quantization_config specdp does not read (the message says which and what to give instead)."""


def quantization_of(config: dict) -> BlockFP8 | None:
    """The checkpoint's quantization (None: unquantized), or QuantizationError saying why it is refused."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "unknown method")).lower()
    if method != "fp8":
        raise QuantizationError(f"quantized checkpoints ({method}) are not supported; give block-scaled FP8 "
                                f"(quant_method fp8 with weight_block_size), bfloat16, float16 or float32 weights")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"FP8 checkpoints without weight_block_size (per-tensor or per-channel scales: "
                                f"{block!r}) are not supported; give the block-scaled layout (e.g. [128, 128])")
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise QuantizationError(f"FP8 checkpoints with activation_scheme {scheme!r} are not supported (dynamic only)")
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise QuantizationError(f"FP8 checkpoints in format {fmt!r} are not supported (e4m3 only)")
    return BlockFP8((int(block[0]), int(block[1])))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """weight [..., out, in] (float8) times its block scales [..., ceil(out / bm), ceil(in / bn)], in float32, then
    `dtype`."""
    bm, bn = block
    out, inp = weight.shape[-2:]
    if scale_inv.shape[-2:] != (-(-out // bm), -(-inp // bn)):
        raise ValueError(f"scales {list(scale_inv.shape)} do not match weight {list(weight.shape)} in {bm}x{bn} blocks")
    s = scale_inv.float().repeat_interleave(bm, -2)[..., :out, :].repeat_interleave(bn, -1)[..., :inp]
    return (weight.float() * s).to(dtype)


_NUMBERED = re.compile(r"\.\d+\.")


def unquantized_weights(headers: dict[str, tuple[str, list[int]]]) -> list[str]:
    """The matrices a block-FP8 checkpoint keeps in high precision, layer and expert numbers folded into '*'
    (e.g. model.embed_tokens.weight, lm_head.weight, model.layers.*.mlp.gate.weight)."""
    names = {_NUMBERED.sub(".*.", n) for n, (dt, shape) in headers.items()
             if len(shape) >= 2 and dt not in FP8_DTYPES and not n.endswith("_scale_inv")}
    return sorted(names)
