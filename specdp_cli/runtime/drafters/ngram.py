"""Prompt-lookup drafting: find the most recent earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""
from __future__ import annotations

from array import array

from .base import Drafter, Drafts


def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the last n tokens (n from n_max down).
    The search is bytes.rfind over the ids packed as 4-byte integers (C speed: a step looks up
    every row on the host, so a Python or numpy scan per row would cost more than the forward)."""
    L = len(tokens)
    buf = array("i", tokens).tobytes()
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = buf[4 * (L - n):]
        # the latest match lying wholly inside tokens[:L - 1] (so not the suffix itself), starting
        # on a token boundary (a hit between boundaries is a coincidence of bytes: look earlier)
        end = 4 * (L - 1)
        pos = buf.rfind(pattern, 0, end)
        while pos > 0 and pos % 4:
            pos = buf.rfind(pattern, 0, pos + 4 * n - 1)
        if pos >= 0 and pos % 4 == 0:
            start = pos // 4 + n
            return tokens[start:start + k]
    return []


class NgramDrafter(Drafter):
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def host_drafts(self, rows, n_forwards) -> Drafts:
        host = [lookup(seq.tokens, self.n_min, self.n_max, ke) if ke >= 1 else [] for seq, ke in rows]
        return Drafts([len(d) for d in host], host=host)
