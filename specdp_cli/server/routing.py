"""Which rank a request goes to: the least loaded one (outstanding prompt + max_tokens), or — prefix caching on —
the rank that already holds the longest prefix of its prompt when its load is within one such request of the least
loaded. The frontend's picture of each rank's prefix cache is what it sent there (`PrefixIndex`): the block hashes
of those prompts, the least recently sent dropped past the rank's cache size, the same chained hashes the ranks
register (`runtime/block_hash.py`)."""
from __future__ import annotations

from collections import OrderedDict

from ..runtime.block_hash import block_hashes


def prompt_hashes(prompt: list[int], block_size: int) -> list[bytes]:
    """The prompt's full blocks a rank could find cached (the last token is always computed): what the frontend
    works out once for a request, for its routing and for the rank, which then need not hash the prompt itself."""
    return block_hashes(prompt, block_size, [], (len(prompt) - 1) // block_size)


class PrefixIndex:
    def __init__(self, world: int, capacity: int = 1 << 16):
        self.capacity = capacity
        self.ranks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(world)]

    def matched(self, rank: int, hashes: list[bytes]) -> int:
        held, n = self.ranks[rank], 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def sent(self, rank: int, hashes: list[bytes]) -> None:
        held = self.ranks[rank]
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)


def pick_rank(load: list[int], cost: int, index: PrefixIndex | None, hashes: list[bytes]) -> int:
    """The rank for a request of `cost` (prompt + max_tokens) given each rank's outstanding `load`; `hashes`: its
    prompt's (`prompt_hashes`)."""
    least = min(range(len(load)), key=lambda r: (load[r], r))
    if index is None:
        return least
    rank = least
    if hashes:
        best = max(range(len(load)), key=lambda r: (index.matched(r, hashes), -load[r], -r))
        if index.matched(best, hashes) and load[best] <= load[least] + cost:
            rank = best
    index.sent(rank, hashes)
    return rank
