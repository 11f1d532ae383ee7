"""Paged KV cache: fixed-size blocks drawn from one pool by every running sequence.

A sequence holds a list of block ids (its block table); position p lives in block
table[p // block_size] at offset p % block_size. The target and the drafter share the block tables
(they cache the same positions of the same sequences) and each keeps its own tensors over the same
block ids, so one pool sizes both. Block 0 is the trash block: padding tokens write there and
table entries past a sequence's end point there. Rolling back rejected drafts is free (the length
goes back; stale entries are masked out and later overwritten), and freeing a sequence is host
bookkeeping only — no tensor is touched.
"""
from __future__ import annotations

import torch

from ..modeldir import kv_bytes_per_token as per_token_bytes

TRASH_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks                 # usable blocks: ids 1..num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV block pool exhausted: {n} wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def kv_bytes_per_token(model) -> int:
    """Bytes one cached token takes in every layer of the loaded `model` (keys and values), by the
    formula preflight uses too (modeldir.kv_bytes_per_token)."""
    return per_token_bytes(model.kv_shapes(), torch.empty(0, dtype=model.dtype).element_size())


def allocate_kv(model, num_blocks: int, block_size: int) -> None:
    """Give `model` its per-layer caches [num_blocks + 1, block_size, heads, dim] (block 0 = trash)."""
    model.kv_caches = [
        (torch.zeros((num_blocks + 1, block_size, kh, kd), dtype=model.dtype, device=model.device),
         torch.zeros((num_blocks + 1, block_size, vh, vd), dtype=model.dtype, device=model.device))
        for (kh, kd), (vh, vd) in model.kv_shapes()]
