"""Paged KV cache: fixed-size blocks drawn from one pool by every running sequence.

A sequence holds a list of block ids (its block table); position p lives in block
table[p // block_size] at offset p % block_size. The target and the drafter share the block tables
(they cache the same positions of the same sequences) and each keeps its own tensors over the same
block ids, so one pool sizes both. Block 0 is the trash block: padding tokens write there and
table entries past a sequence's end point there. Rolling back rejected drafts is free (the length
goes back; stale entries are masked out and later overwritten), and freeing a sequence is host
bookkeeping only — no tensor is touched.

Prefix caching (`cache.enable_prefix_caching`, as vLLM v1): a full block whose positions are final is
registered under a chained hash of its tokens (`block_hashes`: the hash of the block before it and its own
tokens), blocks are reference-counted, and a block no sequence holds any more keeps its contents, evictable
least-recently-freed first, until the pool needs it. A new sequence whose first full blocks' hashes are
registered takes those blocks (`BlockPool.cached_prefix`) and prefills only the rest. A block holds every
model's KV of its positions (target and drafter share the block ids): the target's is a function of the
tokens up to it, so reuse is exact. A draft model's is too, when the registering sequence's drafter had
computed it (a sequence that drafts nothing does not feed its drafter): a block is registered with that flag,
a sequence that drafts takes cached blocks only while their drafter KV is there, and a block with it replaces
one without under the same hash. An EAGLE head's last position of a block reads the token after it, so what a
sequence finds there may differ from what it would have computed: only which drafts are accepted changes.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..modeldir import kv_bytes_per_token as per_token_bytes

TRASH_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks                 # usable blocks: ids 1..num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(num_blocks, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * (num_blocks + 1)          # sequences holding each block
        self._cached: dict[bytes, int] = {}          # block hash -> the block holding those positions' KV
        self._hash_of: dict[int, bytes] = {}
        self._drafter_kv: dict[int, bool] = {}      # a registered block holds its positions' drafter KV too
        self._evictable: OrderedDict[int, None] = OrderedDict()    # cached blocks nobody holds, oldest first
        self.queries = self.hits = 0                 # prefix cache: prompt tokens looked up, tokens found

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV block pool exhausted: {n} wanted, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:                                    # evict the least recently freed cached block
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(b)]
                del self._drafter_kv[b]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """A sequence lets go of its blocks; cached ones stay cached (the tail first in line for eviction)."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cached_prefix(self, hashes: list[bytes], drafter_kv: bool = False) -> list[int]:
        """The registered blocks of the longest run of `hashes` from the first (not yet taken); with `drafter_kv`
        (the sequence drafts with a draft model) only while they hold their drafter KV too."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None or (drafter_kv and not self._drafter_kv[b]):
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        """A sequence holds cached blocks `blocks` (from `cached_prefix`)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1

    def evictable_among(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._refs[b] == 0)

    def register(self, block: int, h: bytes, drafter_kv: bool = True) -> None:
        """Block `block` holds the final KV of the positions hashed `h`, and with `drafter_kv` the drafter's too.
        The first registration of a hash stands, unless it lacks the drafter KV and this one has it; a block
        holds one hash."""
        if block in self._hash_of:
            return
        old = self._cached.get(h)
        if old is not None:
            if self._drafter_kv[old] or not drafter_kv:
                return
            del self._hash_of[old], self._drafter_kv[old]        # the old copy is an ordinary block again
            if self._refs[old] == 0:
                del self._evictable[old]
                self._free.append(old)
        self._cached[h] = block
        self._hash_of[block] = h
        self._drafter_kv[block] = drafter_kv


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
