"""One model (target or drafter) with its KV cache: loading, and a forward over token segments.

`ModelRunner.forward` is the only place a model runs. It first calls the DP group's token-count
sync (a no-op unless ranks step in lockstep), pads to the agreed size, and runs the model over a
flat token list. Called with no segments it runs a padding batch, which is exactly how an idle
rank takes part in a lockstep step: the same code over a placeholder token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import ATTN_NAME, AttentionMeta, forward_context, register
from .kv_cache import SlotKVCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Segment:
    slot: int
    start: int          # position of tokens[0] in its sequence
    tokens: list[int]
    keep: int = 0       # logits are returned for the last `keep` tokens


def load_causal_lm(path: str, dtype: str, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()      # no per-shard loading bars in a CLI's output
    register()
    if device.type == "cuda":
        # cuDNN attention builds a graph per new shape, costing ~0.6 ms of CPU per call with our
        # changing shapes (measured on an H200); the memory-efficient kernel has no such cost
        torch.backends.cuda.enable_cudnn_sdp(False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=ATTN_NAME)
    model.to(device).eval()
    model.requires_grad_(False)
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "attention", "attn")) and hasattr(module, "q_proj") \
                and not isinstance(getattr(module, "layer_idx", None), int):
            raise RuntimeError(f"{path}: attention module {name} has no layer_idx; this model family is not supported")
    return model


def bucket(n: int, exact_up_to: int = 0, step_after: int = 0) -> int:
    """Round up to a small set of sizes: exact up to `exact_up_to`, then powers of two
    (or multiples of `step_after` once past it)."""
    if n <= exact_up_to:
        return max(n, 1)
    if step_after and n > step_after:
        return -(-n // step_after) * step_after
    p = 1
    while p < n:
        p *= 2
    return p


class ModelRunner:
    def __init__(self, model, cache: SlotKVCache, device: torch.device, dp, role: str):
        self.model = model
        self.cache = cache
        self.device = device
        self.dp = dp
        self.role = role
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.padding_forwards = 0

    def forward(self, segments: list[Segment], step: int, what: str) -> torch.Tensor:
        """Run the model over `segments`; return float32 logits [sum(keep), vocab] in segment order.
        Every rank in lockstep first agrees on the token count and pads to it."""
        n_local = sum(len(s.tokens) for s in segments)
        n = self.dp.sync_tokens(n_local, step, what)
        if n_local == 0:
            self.padding_forwards += 1
        return self._run(segments, n)

    def warmup(self) -> None:
        """One padding forward outside any step: allocates every layer's KV cache up front, so a
        lack of memory shows at start-up rather than in the middle of a job."""
        self._run([], 1)

    @torch.inference_mode()
    def _run(self, segments: list[Segment], n: int) -> torch.Tensor:
        N = bucket(max(n, 1), exact_up_to=0, step_after=512)
        rows = min(bucket(max((s.slot for s in segments), default=0) + 1), self.cache.num_slots)
        T = bucket(max((len(s.tokens) for s in segments), default=1), exact_up_to=8)
        S = min(bucket(max((s.start + len(s.tokens) for s in segments), default=1), step_after=128),
                self.cache.max_len)
        S = max(S, min(128, self.cache.max_len))

        ids, pos, slot, out_index = [], [], [], []
        q_index = [0] * (rows * T)
        qpos = [0] * (rows * T)
        keep = []
        for s in segments:
            base, m = len(ids), len(s.tokens)
            ids.extend(s.tokens)
            pos.extend(range(s.start, s.start + m))
            slot.extend([s.slot] * m)
            cell = s.slot * T
            out_index.extend(range(cell, cell + m))
            q_index[cell:cell + m] = range(base, base + m)
            qpos[cell:cell + m] = range(s.start, s.start + m)
            keep.extend(range(base + m - s.keep, base + m))
        pad = N - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        slot += [self.cache.trash_slot] * pad
        out_index += [0] * pad
        packed = torch.tensor(ids + pos + slot + out_index + q_index + qpos + keep, dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        parts = torch.split(packed, [N, N, N, N, rows * T, rows * T, len(keep)])
        meta = AttentionMeta(slot=parts[2], pos=parts[1], out_index=parts[3], q_index=parts[4],
                             qpos=parts[5].view(rows, T), rows=rows, T=T, S=S)
        logits_to_keep = parts[6] if keep else 1
        with forward_context(meta, self.cache):
            out = self.model(input_ids=parts[0].unsqueeze(0), position_ids=parts[1].unsqueeze(0),
                             use_cache=False, logits_to_keep=logits_to_keep)
        logits = out.logits[0]
        if not keep:
            return logits[:0].float()
        return logits.float()
