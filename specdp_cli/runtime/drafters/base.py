"""The drafter interface: how many drafts each decode row gets, and the drafts themselves.

A step asks a drafter twice. `host_drafts` runs before the step's inputs go to the device: it
says how many tokens each row drafts (and, for a drafter that works on the host such as n-gram
lookup, which ones). `propose` runs the drafter's model forwards on the device and leaves the
drafts there for the target's verification — no host sync between them. A drafter with a model
forward also reports, through `mixed_fields`, what its first forward needs (see the engine's
step sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheduler import Sequence


@dataclass
class Drafts:
    n: list[int]                              # drafts of each decode row
    host: list[list[int]] | None = None       # the drafts, when made on the host (n-gram)
    tokens: torch.Tensor | None = None        # [R_pad, T - 1] long on the device (model drafters)
    probs: torch.Tensor | None = None         # [R_pad, T - 1, V] the distributions drawn from; None = one-hot


class Drafter:
    has_forward = False

    def host_drafts(self, rows: list[tuple[Sequence, int]], n_forwards: int) -> Drafts:
        """rows: (sequence, k_eff) of every decode row; n_forwards: the drafter forwards of this step."""
        return Drafts([0] * len(rows))

    def mixed_fields(self, rows, prefill, drafts: Drafts, n_forwards: int) -> tuple[int, int]:
        """(1 if the first drafter forward cannot be a uniform one, its token count)."""
        return 0, 0

    def propose(self, ctx, drafts: Drafts) -> None:
        """Fill drafts.tokens / drafts.probs on the device (drafters with a model forward)."""

    def on_accept(self, seq: Sequence, old_len: int, accepted: int) -> None:
        """After verification: `seq` had length old_len and `accepted` drafts were kept."""


class NoDrafter(Drafter):
    """method: none — plain decoding through the same engine."""
