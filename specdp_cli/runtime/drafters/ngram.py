"""Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""
from __future__ import annotations

import numpy as np

from .base import Drafter, Drafts


def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    arr = np.asarray(tokens, dtype=np.int64)
    L = len(arr)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = arr[L - n:]
        # candidate starts i < L - n whose window equals the pattern (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class NgramDrafter(Drafter):
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def host_drafts(self, rows, n_forwards) -> Drafts:
        host = [lookup(seq.tokens, self.n_min, self.n_max, ke) if ke >= 1 else [] for seq, ke in rows]
        return Drafts([len(d) for d in host], host=host)
