"""Reading a checkpoint's tensors: which ones a model reads, and taking them out by name in a dtype."""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

from .naming import expert_split, layer_index
from .quant import BlockFP8, FP8Load, FP8Weight, cat_fp8, dequantize, quantizable, quantize_blocks, routed_expert
from .registry import UnsupportedModel

_EXPERT = re.compile(r"\.experts\.(\d+)\.")      # routed experts only: ".shared_experts." does not match


def read_weights(files: list[str], device: torch.device,
                 wanted: Callable[[str], bool] = lambda name: True, shard=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose names are `wanted` (the others are never read from a safetensors file).
    `shard` (tensor parallelism: models/tensor_parallel.Shard): of a split tensor only this process's slice is
    read."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(f, framework="pt", device=str(device)) as fh:
                for name in fh.keys():
                    if wanted(name):
                        cut = shard.cut(name) if shard is not None else None
                        if cut is None:
                            out[name] = fh.get_tensor(name)
                        else:
                            part = fh.get_slice(name)
                            _check_rows(shard, name, part.get_shape()[0], f)
                            out[name] = _joined([part[(slice(None),) * cut[0] + (sl,)] for sl in cut[1]],
                                                cut[0]).to(device).contiguous()
        else:
            for k, v in torch.load(f, map_location=device, weights_only=True).items():
                if wanted(k):
                    cut = shard.cut(k) if shard is not None else None
                    if cut is not None:
                        _check_rows(shard, k, v.shape[0], f)
                    out[k] = v if cut is None else _joined([v.narrow(cut[0], sl.start, sl.stop - sl.start)
                                                            for sl in cut[1]], cut[0]).contiguous()
    return out


def _check_rows(shard, name: str, rows: int, file: str) -> None:
    why = shard.vocab_mismatch(name, rows)
    if why:
        raise UnsupportedModel(f"{file}: {why}")


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def weights_of(layers: range, experts: set[int] | None, top_level: bool = True) -> Callable[[str], bool]:
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


def rank_experts(num_experts: int, ep) -> set[int] | None:
    """The routed experts this rank reads under expert parallelism (None: all of them)."""
    return None if ep is None else set(expert_split(num_experts, ep.world, ep.rank))


def weight_getter(w: dict[str, torch.Tensor], prefix: str, path: str, dtype: torch.dtype,
                  quant: BlockFP8 | None = None, fp8: FP8Load = FP8Load()):
    """`get(name, required=True, as_dtype=None)`: takes weight `prefix + name` out of `w`, in `dtype`. A float8
    weight of a block-FP8 checkpoint (`quant`) comes with its `weight_scale_inv`; with `fp8.quantize` the
    quantizable high-precision weights are quantized to 128 x 128 blocks first. Either stays FP8 (an FP8Weight)
    where `fp8.keep` says so (routed experts only with `fp8.experts`), else is dequantized to `dtype`."""
    def fp8_weight(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   as_dtype: torch.dtype | None):
        keep = (fp8.keep and as_dtype is None and block[1] == 128 and quantizable(name)
                and (fp8.experts or not routed_expert(name)))
        try:
            if not keep:
                return dequantize(q, scale, block, as_dtype or dtype)
        except ValueError as e:
            raise UnsupportedModel(f"{path}: {prefix + name}: {e}") from None
        scale = scale.float().contiguous()
        cublas = None
        if block[0] == 128 and q.dim() == 2 and q.is_cuda:
            from ..fp8_kernels import cublas_supported, cublas_weight_scale
            # tried here, at load: the trial synchronizes, which a CUDA graph's capture must not
            cublas = cublas_weight_scale(scale) if cublas_supported(q.device) else None
        return FP8Weight(q.contiguous(), scale, block[0], dtype, cublas)

    def get(name: str, required: bool = True, as_dtype: torch.dtype | None = None):
        t = w.pop(prefix + name, None)
        if t is None:
            if required:
                raise UnsupportedModel(f"{path}: weight {prefix + name} is missing")
            return None
        if t.dtype == torch.float8_e4m3fn:
            scale = w.pop(prefix + name + "_scale_inv", None)
            if quant is None or scale is None:
                raise UnsupportedModel(f"{path}: weight {prefix + name} is float8 but "
                                       + ("config.json has no quantization_config" if quant is None
                                          else f"{prefix + name}_scale_inv is missing"))
            return fp8_weight(name, t, scale, quant.block, as_dtype)
        if fp8.quantize and as_dtype is None and t.dim() >= 2 and quantizable(name) and (
                fp8.experts or not routed_expert(name) or not fp8.keep):
            q, scale = quantize_blocks(t)
            return fp8_weight(name, q, scale, (128, 128), None)
        return t.to(as_dtype or dtype)
    return get


def take_rows(w, rows: torch.Tensor):
    """w's rows (a tensor's first dim, an FP8 weight's rows with their scales) in the order `rows`."""
    if isinstance(w, FP8Weight):
        return w.take_rows(rows.to(w.device))
    return w[rows.to(w.device)].contiguous()


def cat_rows(path: str, *ts: torch.Tensor | None) -> torch.Tensor | None:
    """Projections stacked into one matrix (q, k, v -> qkv; gate, up -> gate_up), or their biases."""
    if all(t is None for t in ts):
        return None
    if any(t is None for t in ts):
        raise UnsupportedModel(f"{path}: some projections of a layer have a bias and others not")
    if all(isinstance(t, FP8Weight) for t in ts):
        return cat_fp8(list(ts))
    ts = [t.dequantize() if isinstance(t, FP8Weight) else t for t in ts]
    return torch.cat(ts, 0).contiguous()
