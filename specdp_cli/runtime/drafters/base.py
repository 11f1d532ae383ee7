"""The drafter interface: propose draft tokens for the rows that draft this step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler import Sequence


@dataclass
class Drafts:
    tokens: list[list[int]]              # per drafting row, up to its k_eff tokens
    probs: torch.Tensor | None = None    # [rows, K, V] the distributions drawn from; None = one-hot


class Drafter:
    """`propose(rows, prefill, n_forwards, step)`.

    rows: (sequence, k_eff >= 1) pairs that draft this step; prefill: the prompt chunks the target
    prefills this step, which a drafter with a KV cache prefills alongside; n_forwards: how many
    model forwards the drafter phase runs (the engine decides: lockstep needs exactly k, also over
    a padding batch). Drafters without a model forward ignore it.
    """
    has_forward = False

    def propose(self, rows: list[tuple[Sequence, int]], prefill: list[tuple[Sequence, int, int]],
                n_forwards: int, step: int) -> Drafts:
        raise NotImplementedError

    def on_accept(self, seq: Sequence, old_len: int, accepted: int) -> None:
        """After verification: `seq` had length old_len and `accepted` drafts were kept."""

    def on_move(self, seq: Sequence, from_slot: int) -> None:
        """`seq` moved from `from_slot` to `seq.slot` (slot compaction)."""


class NoDrafter(Drafter):
    """method: none — plain decoding through the same engine."""

    def propose(self, rows, prefill, n_forwards, step) -> Drafts:
        return Drafts([[] for _ in rows])
