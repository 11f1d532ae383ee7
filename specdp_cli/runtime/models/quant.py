"""Quantized checkpoints: the block-scaled FP8 layout of DeepSeek-V3 / Qwen3-FP8 (Hugging Face's fine-grained FP8).

config.json's `quantization_config` says `quant_method: fp8`, `weight_block_size: [bm, bn]` (128 x 128 in the
published checkpoints) and `activation_scheme: dynamic`. Each quantized linear layer's `weight` [out, in] is
float8_e4m3fn and its `weight_scale_inv` [ceil(out / bm), ceil(in / bn)] float32 holds one scale per block:
the layer's real weight is weight * scale, block by block. Embeddings, norms, the LM head and the routers are
stored unquantized (as their own dtype says).

How specdp loads them (`FP8Load`): on a CUDA device with FP8 (compute capability >= 8.9) in bf16/fp16 the
quantized weights stay FP8 (`FP8Weight`, computed as W8A8 by `runtime/fp8_kernels.py` through `ops.linear`);
elsewhere (CPU, older GPUs, float32) each is dequantized to the compute dtype as it loads (exact: the same
numbers a dequantized copy of the checkpoint holds). `quantization: fp8` in the config quantizes a
high-precision checkpoint's quantizable weights (`quantizable`) to the same 128 x 128 block format at load
(`quantize_blocks`); where weights are not kept FP8 they are dequantized again, so a CPU run shows the effect
of the quantization. Torch-free at import: preflight reads it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_DTYPES = ("F8_E4M3",)          # safetensors' name of float8_e4m3fn
FP8_MAX = 448.0                    # float8_e4m3fn's largest finite value
ON_LOAD_BLOCK = (128, 128)         # the block `quantization: fp8` quantizes to (the published checkpoints')


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


# -- FP8 weights kept FP8 ------------------------------------------------------------------------------------

_LINEAR = re.compile(r"(self_attn\.|mlp\.|block_sparse_moe\.)(.*\.)?[a-z0-9_]*_proj(_with_mqa)?\.weight$"
                     r"|\.eh_proj\.weight$|block_sparse_moe\.experts\.\d+\.w[123]\.weight$"
                     r"|mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTED = re.compile(r"\.experts\.(\d+\.|gate_up_proj$|down_proj$)")


def quantizable(name: str) -> bool:
    """Whether `name` is a linear layer's weight that FP8 checkpoints quantize and `quantization: fp8` quantizes:
    attention projections (incl. latent attention's), dense, shared and routed experts' projections, the MTP
    layer's eh_proj. Never the embeddings, norms, LM heads or routers (mlp.gate)."""
    return bool(_LINEAR.search(name))


def routed_expert(name: str) -> bool:
    return bool(_ROUTED.search(name))


@dataclass(frozen=True)
class FP8Load:
    """How a model's weights load. keep: FP8 weights stay FP8 (a GPU with FP8 compute); else they are dequantized
    to the compute dtype. quantize: `quantization: fp8`, quantize the quantizable high-precision weights (128 x
    128 blocks). experts: routed experts stay FP8 too (their grouped kernels read FP8)."""
    keep: bool = False
    quantize: bool = False
    experts: bool = False


def fp8_compute(device, dtype) -> bool:
    """Whether FP8 weights stay FP8 on `device` in `dtype`: a CUDA device with FP8 tensor cores (compute
    capability >= 8.9: Ada, Hopper and later) computing in bf16 or fp16."""
    import torch

    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device) >= (8, 9))


def fp8_load(checkpoint: BlockFP8 | None, quantization: str | None, device, dtype, model_type: str) -> FP8Load:
    """How a model loads: its checkpoint's FP8 (or `quantization: fp8` for a high-precision one) kept FP8 where
    `fp8_compute`; routed experts FP8 too except GPT-OSS's (its own expert layout)."""
    on_load = quantization == "fp8" and checkpoint is None
    keep = (checkpoint is not None or on_load) and fp8_compute(device, dtype)
    return FP8Load(keep=keep, quantize=on_load, experts=keep and model_type != "gpt_oss")


@dataclass
class FP8Weight:
    """A linear layer's FP8 weight: `weight` [..., N, K] float8_e4m3fn and `scale` [..., ceil(N / rows),
    ceil(K / 128)] float32 (the checkpoint's weight_scale_inv: real weight = weight * scale per block); `rows` is
    128 as stored, 1 once rows were reordered at load (one scale row per weight row). `dtype`: the compute dtype.
    `cublas_scale`: the scales in the layout of cuBLAS's block-scaled GEMM (fp8_kernels), where it applies."""
    weight: torch.Tensor
    scale: torch.Tensor
    rows: int
    dtype: torch.dtype
    cublas_scale: torch.Tensor | None = None

    @property
    def shape(self):
        return self.weight.shape

    @property
    def device(self):
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.scale, (self.rows, 128), dtype or self.dtype)

    def per_row(self) -> FP8Weight:
        """The same weight with one scale row per weight row (rows 1), so that rows can be reordered or joined."""
        if self.rows == 1:
            return self
        n = self.weight.shape[-2]
        return FP8Weight(self.weight, self.scale.repeat_interleave(self.rows, -2)[..., :n, :].contiguous(), 1,
                         self.dtype)

    def take_rows(self, index: torch.Tensor) -> FP8Weight:
        w = self.per_row()
        return FP8Weight(w.weight[..., index, :].contiguous(), w.scale[..., index, :].contiguous(), 1, self.dtype)


def cat_fp8(parts: list[FP8Weight], stack: bool = False) -> FP8Weight:
    """FP8 weights joined along their rows (q, k, v -> qkv), or with `stack` along a new leading dim (experts):
    block scales kept where every part's rows fill whole blocks, else one scale row per weight row."""
    import torch

    if stack:
        return FP8Weight(torch.stack([p.weight for p in parts]).contiguous(),
                         torch.stack([p.scale for p in parts]).contiguous(), parts[0].rows, parts[0].dtype)
    rows = parts[0].rows
    if any(p.rows != rows for p in parts) or any(p.weight.shape[-2] % rows for p in parts[:-1]):
        parts, rows = [p.per_row() for p in parts], 1
    joined = FP8Weight(torch.cat([p.weight for p in parts], -2).contiguous(),
                       torch.cat([p.scale for p in parts], -2).contiguous(), rows, parts[0].dtype)
    if rows == 128 and all(p.cublas_scale is not None for p in parts):
        # the joined weight (qkv, gate_up) goes to cuBLAS's block-scaled GEMM from CUBLAS_FROM_M rows as its parts did
        # (without this scale fp8_linear ran it on the Triton GEMM's prefill tile there)
        from ..fp8_kernels import cublas_weight_scale
        joined.cublas_scale = cublas_weight_scale(joined.scale)
    return joined


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = ON_LOAD_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (float8_e4m3fn weight, float32 scales [..., ceil(N / bm), ceil(K / bn)]) as the published
    checkpoints hold them: each block's scale is its largest magnitude over FP8's largest value (computed in
    float32 on w's device)."""
    import torch

    bm, bn = block
    *lead, n, k = w.shape
    R, C = -(-n // bm), -(-k // bn)
    padded = torch.zeros((*lead, R * bm, C * bn), dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    blocks = padded.view(*lead, R, bm, C, bn)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(*lead, R * bm, C * bn)
    return q[..., :n, :k].to(torch.float8_e4m3fn).contiguous(), scale
