"""Per-sequence KV cache: one row ("slot") per running sequence, preallocated to the model's limit.

Layout per layer: [num_slots + 1, kv_heads, max_len, head_dim]. Slot `num_slots` is the trash slot
where padding tokens write. A sequence owns one slot; its length lives with the scheduler, so a
rollback of rejected draft positions is O(1): the length goes back and stale entries past it are
masked out and later overwritten. Running sequences occupy slots 0..n-1 (the scheduler compacts
when one leaves), so attention can read `cache[:rows]` as a plain view.
"""
from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_slots: int, max_len: int, device: torch.device):
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = device
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def layer(self, idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (keys, values) of layer `idx`, allocated on first use from the shape of `like`
        ([1, kv_heads, tokens, head_dim]) so any head layout of any model family fits."""
        k = self.keys.get(idx)
        if k is None:
            shape = (self.num_slots + 1, like.shape[1], self.max_len, like.shape[3])
            k = self.keys[idx] = torch.zeros(shape, dtype=like.dtype, device=self.device)
            self.values[idx] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return k, self.values[idx]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction)."""
        if length <= 0 or src == dst:
            return
        for store in (self.keys, self.values):
            for t in store.values():
                t[dst, :, :length] = t[src, :, :length]
