"""`resolve(config) -> Plan`: every number and choice derived from a configuration, computed once.

The Plan is what the launcher and every rank read instead of deriving anything again: the device,
dtype and backend, dp_sync and the policy, the drafter's limit D and the no-draft window, the step k's
schedule, the layout (ranks per machine, expert parallelism) and the memory estimate (weights, KV
bytes per token, KV blocks). Resolving reads the model directories' config.json and safetensors
headers (never weights) and counts the GPUs; it raises nothing: what it cannot resolve (a missing
directory, say) it leaves at a default, and preflight reports on the Plan — with a sentence for
every problem — without ever changing it. Definitions follow DESIGN.md's contract.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .config import Config, ParallelConfig
from .methods import METHODS
from .modeldir import DTYPE_BYTES, ModelDir, ModelDirError, kv_bytes_per_token
from .runtime.spec_length import schedule

ACTIVATION_RESERVE = 1 << 30             # the estimate's guess at activations + CUDA graphs on a GPU


@dataclass(frozen=True)
class Plan:
    """Everything resolved from a configuration. Passed to the launcher and every rank (as JSON)."""
    device: str = "cpu"                      # cpu | cuda
    dtype: str = "float32"
    backend: str = "gloo"                    # gloo | nccl
    dp_sync: Optional[str] = None            # always | never
    policy: Optional[str] = None             # skip | dummy | None (method none)
    drafter_max_model_len: Optional[int] = None   # D
    no_draft_window: Optional[list[int]] = None   # [D - k + 1, M - 1], when not empty
    ranks_per_machine: int = 1                    # DP ranks on each machine
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1                 # processes (GPUs) of each DP rank
    draft_tensor_parallel_size: int = 1           # 1: the drafter replicated on each process; tp: split as the target;
                                                  # 0: no drafter model (ngram, none)
    gpus: int = 0                                 # GPUs visible on this machine when resolved (device cuda / auto)
    model_name: str = ""
    num_blocks: Optional[int] = None              # KV blocks: cache.num_blocks, the CPU default, or None (a GPU sizes it)
    expert_parallel: bool = False                 # the target's routed experts are split over the DP ranks
    async_scheduling: bool = False                # the host plans step N + 1 while the device runs step N
    speculation: Optional[dict] = None            # the step k's schedule: mode, ranges, k_values (spec_length.py)
    memory: Optional[dict] = None                 # the estimate preflight reports (see _memory)

    @property
    def lockstep(self) -> bool:
        return self.dp_sync == "always"


# -- the hooks that tests replace --------------------------------------------------------------------

def cuda_device_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fp8_capability() -> Optional[tuple[int, int]]:
    """GPU 0's compute capability (FP8 tensor cores from 8.9: Ada, Hopper); None without a GPU."""
    import torch
    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def device_memory(device: str) -> Optional[tuple[int, int]]:
    """(free, total) bytes of one device; None on CPU (there the memory estimate is all there is)."""
    if device != "cuda":
        return None
    import torch
    if not torch.cuda.is_available():
        return None     # preflight's parallel check reports the missing GPU
    free, total = torch.cuda.mem_get_info(0)
    return int(free), int(total)


# ------------------------------------------------------------------------------------------------------

def ranks_per_machine(parallel: ParallelConfig) -> int:
    """DP ranks on each machine."""
    return max(1, parallel.data_parallel_size // max(1, parallel.num_machines))


def processes_per_machine(parallel: ParallelConfig) -> int:
    """Processes on each machine: its DP ranks x tensor_parallel_size (the launcher reads it before anything
    else is resolved)."""
    return ranks_per_machine(parallel) * max(1, parallel.tensor_parallel_size)


def world_size(parallel: ParallelConfig) -> int:
    """Processes of the job: data_parallel_size x tensor_parallel_size."""
    return parallel.data_parallel_size * max(1, parallel.tensor_parallel_size)


def open_models(cfg: Config) -> tuple[ModelDir | None, ModelDir | None]:
    """The target's and the drafter's directories (None where a directory cannot be read: preflight says why)."""
    def opened(path: str | None, role: str) -> ModelDir | None:
        try:
            return ModelDir.open(path or "", role)
        except ModelDirError:
            return None
    meth = METHODS[cfg.speculative.method]
    return opened(cfg.model, "target model"), (opened(cfg.speculative.model, "drafter") if meth.loads else None)


def resolve(cfg: Config, dirs: tuple[ModelDir | None, ModelDir | None] | None = None) -> Plan:
    """The Plan of `cfg`. dirs: the (target, drafter) directories when the caller has opened them already
    (preflight, which reports why one cannot be read), else they are opened here."""
    target, drafter = dirs if dirs is not None else open_models(cfg)
    par, spec = cfg.parallel, cfg.speculative
    meth = METHODS[spec.method]
    gpus = cuda_device_count() if cfg.device in ("auto", "cuda") else 0
    device = cfg.device if cfg.device != "auto" else ("cuda" if gpus else "cpu")
    if cfg.dtype != "auto":
        dtype = cfg.dtype
    elif device == "cuda" and target is not None:
        dtype = target.stored_dtype if target.stored_dtype in ("float32", "bfloat16", "float16") else "float32"
    else:
        dtype = "float32"
    moe = bool(target and target.is_moe)
    expert_parallel = par.enable_expert_parallel and moe
    if par.dp_sync != "auto":
        dp_sync = par.dp_sync
    else:
        dp_sync = "always" if moe or expert_parallel else "never"
    D = window = policy = None
    k = spec.num_speculative_tokens
    if meth.drafts:
        limits = [cfg.max_model_len] + [v for v in (spec.max_model_len,
                                                     drafter.max_position_embeddings if drafter else None) if v]
        D = min(limits)
        if D - k + 1 <= cfg.max_model_len - 1:
            window = [D - k + 1, cfg.max_model_len - 1]
        need_dummy = par.data_parallel_size > 1 and dp_sync == "always" and meth.forward
        policy = spec.policy if spec.policy != "auto" else ("dummy" if need_dummy else "skip")
    memory = _memory(cfg, device, dtype, expert_parallel, target, drafter)
    return Plan(device=device, dtype=dtype, backend=par.backend if par.backend != "auto" else (
                    "nccl" if device == "cuda" else "gloo"),
                dp_sync=dp_sync, policy=policy, drafter_max_model_len=D, no_draft_window=window,
                ranks_per_machine=ranks_per_machine(par), data_parallel_size=par.data_parallel_size,
                tensor_parallel_size=max(1, par.tensor_parallel_size), draft_tensor_parallel_size=draft_tp(cfg),
                gpus=gpus,
                model_name=cfg.server.model_name or (target.name if target else os.path.basename(cfg.model)),
                num_blocks=memory["num_blocks"] if memory and memory["source"] != "gpu" else cfg.cache.num_blocks,
                expert_parallel=expert_parallel, speculation=speculation(cfg), memory=memory,
                async_scheduling=async_scheduling(cfg, device))


def async_scheduling(cfg: Config, device: str) -> bool:
    """`scheduler.async_scheduling`, or by default on a GPU; never with n-gram lookup (it drafts from the tokens on
    the host) or tensor parallelism (not tested yet): preflight refuses true with those."""
    on, method = cfg.scheduler.async_scheduling, cfg.speculative.method
    return ((device == "cuda" if on is None else on) and async_method(method)
            and cfg.parallel.tensor_parallel_size <= 1)


def async_method(method: str) -> bool:
    """Whether async scheduling runs with this speculative method: its next drafts need nothing from the host."""
    m = METHODS[method]
    return not m.prompt_lookup


def draft_tp(cfg: Config) -> int:
    """The drafter's TP size: `speculative.draft_tensor_parallel_size` where set (preflight checks it is 1 or
    tensor_parallel_size), else the method's own: the MTP layer split as its target, any other drafter
    replicated (1); 0 for a method without a drafter model (ngram, none)."""
    spec, tp = cfg.speculative, max(1, cfg.parallel.tensor_parallel_size)
    if not METHODS[spec.method].forward:
        return 0
    if spec.draft_tensor_parallel_size is not None:
        return spec.draft_tensor_parallel_size
    return tp if METHODS[spec.method].in_target else 1


def speculation(cfg: Config) -> dict:
    """The step k's schedule (`runtime/spec_length.schedule`): mode, ranges, k values."""
    spec = cfg.speculative
    k = spec.num_speculative_tokens if METHODS[spec.method].drafts else 0
    return schedule(k, spec.num_speculative_tokens_per_batch_size, spec.adaptive)


def _memory(cfg: Config, device: str, dtype: str, expert_parallel: bool, target: ModelDir | None,
            drafter: ModelDir | None) -> dict | None:
    """Weights, KV bytes per token and the KV cache's blocks: `cache.num_blocks`; on CPU max_num_seqs
    full-length sequences; on a GPU what gpu_memory_utilization leaves after this device's current use,
    the weights and a reserve for activations (an estimate: the engine measures activations at start and
    sizes the pool exactly). None without a readable target (or drafter, for a method that loads one)."""
    meth = METHODS[cfg.speculative.method]
    if target is None or (meth.loads and drafter is None):
        return None
    M, n, c = cfg.max_model_len, cfg.scheduler.max_num_seqs, cfg.cache
    mtp = meth.in_target
    experts = target.num_experts
    # under expert parallelism each rank holds 1/dp of the routed experts (the most any rank holds)
    experts_held = -(-experts // cfg.parallel.data_parallel_size) / experts if expert_parallel else 1.0
    fp8 = {"target": _fp8(target, cfg.quantization, device, dtype),
           "drafter": _fp8(drafter, cfg.speculative.quantization, device, dtype) if drafter else None}
    kept = {role: bool(q and q["loaded_as"] == "float8_e4m3fn") for role, q in fp8.items()}
    # under tensor parallelism a process (GPU) holds its share of the target's attention, MLP and KV heads
    tp = cfg.parallel.tensor_parallel_size
    weights = int(target.weight_bytes(dtype, kept["target"]) * target.loaded_share(mtp, experts_held, tp))
    per_token = int(target.kv_bytes_per_token(dtype) * target.kv_share(tp))
    if drafter:                      # a draft model split over the TP group holds its share, as the target
        split = draft_tp(cfg) if meth.separate_lm else 1
        share = drafter.loaded_share(tp=split) if split > 1 else 1.0
        weights += int(drafter.weight_bytes(dtype, kept["drafter"]) * share)
        per_token += int(drafter.kv_bytes_per_token(dtype) * drafter.kv_share(split))
    if mtp:                          # the MTP layer caches like one of the target's layers (split as they are)
        per_token += int(kv_bytes_per_token(target.kv_shapes()[:1], DTYPE_BYTES.get(dtype, 4)) * target.kv_share(tp))
    per_seq = -(-M // c.block_size)                         # blocks of one full-length sequence
    mem = device_memory(device)
    total = None
    if c.num_blocks:
        blocks, source = c.num_blocks, "config"
    elif mem is None:
        blocks, source = n * per_seq, "cpu"
    else:
        free, total = mem
        budget = c.gpu_memory_utilization * total - (total - free) - weights - ACTIVATION_RESERVE
        blocks, source = max(0, int(budget // max(per_token * c.block_size, 1))), "gpu"
    return {"weight_bytes": weights, "kv_bytes_per_token": per_token, "block_size": c.block_size,
            "tensor_parallel_size": max(1, cfg.parallel.tensor_parallel_size), "draft_tensor_parallel_size": draft_tp(cfg),
            "num_blocks": blocks, "source": source, "device_total": total, "sequence_blocks": per_seq,
            "weights_per_token": target.weights_per_token(dtype, kept["target"]), "quantization": fp8["target"],
            "drafter_quantization": fp8["drafter"]}


def _fp8(md: ModelDir, quantization: Optional[str], device: str, dtype: str) -> dict | None:
    """A block-FP8 model (its checkpoint's, or `quantization: fp8` at load) as preflight reports it: where the
    FP8 comes from, its block, how its weights load (`float8_e4m3fn`: kept FP8 and computed as W8A8, on a GPU
    with FP8 in bf16/fp16; else dequantized to `dtype`), the GPU's capability where it has no FP8, and the
    matrices kept in high precision."""
    from .runtime.models.quant import quantizable, unquantized_weights
    q = md.quantization
    if q is None and quantization != "fp8":
        return None
    cap = fp8_capability() if device == "cuda" else None
    kept = device == "cuda" and cap is not None and cap >= (8, 9) and dtype in ("bfloat16", "float16")
    if q is not None:
        high = unquantized_weights(md.tensor_headers)
    else:
        high = sorted({name for name, (_, shape) in md.tensor_headers.items()
                       if len(shape) >= 2 and not quantizable(name)})
    return {"method": "fp8", "source": "checkpoint" if q is not None else "on load",
            "weight_block_size": list(q.block if q is not None else (128, 128)),
            "loaded_as": "float8_e4m3fn" if kept else dtype,
            "gpu_capability": f"{cap[0]}.{cap[1]}" if cap and not kept else None,
            "high_precision": high}
