"""The drafter interface: how many drafts each decode row gets, and the drafts themselves.

A step asks a drafter twice. `host_drafts` runs before the step's inputs go to the device: it
says how many tokens each row drafts (and, for a drafter that works on the host such as n-gram
lookup, which ones). `propose` runs the drafter's model forwards on the device and leaves the
drafts there for the target's verification — no host sync between them. A drafter with a model
forward also keeps its own KV cache up to date: `catch_up` names the tokens its first forward
feeds for a decode row, `prefills` whether it prefills a sequence's prompt beside the target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..scheduler import Sequence


@dataclass
class Drafts:
    n: list[int]                              # drafts of each decode row
    host: list[list[int]] | None = None       # the drafts, when made on the host (n-gram)


class Drafter:
    has_forward = False
    after_verify = False      # proposes the next step's drafts after verification (`propose_after`)
    catches_up = False        # a first forward feeds the tokens its own cache has not seen (`catch_up`)

    def host_drafts(self, rows: list[tuple[Sequence, int]], n_forwards: int) -> Drafts:
        """rows: (sequence, k_eff) of every decode row; n_forwards: the drafter forwards of this step."""
        return Drafts([0] * len(rows))

    def catch_up(self, seq: Sequence, n: int, width: int) -> tuple[int, list[int], int]:
        """For a decode row that would draft n >= 1 tokens: (first position, tokens) the first drafter
        forward feeds it (at most `width`), and the drafts it makes this step (0 while it catches up)."""
        return 0, [], n

    def prefills(self, seq: Sequence) -> bool:
        """Whether the drafter's cache takes this sequence's prompt chunks beside the target's."""
        return False

    def kv_upto(self, seq: Sequence) -> float:
        """The positions below which the drafter's own KV of `seq` is computed (prefix caching registers blocks
        with it): all of them for a drafter without a cache of its own, or one that learns every verified
        position (an EAGLE head, an MTP layer)."""
        return math.inf

    def propose(self, ctx) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """On the device: (drafts [R_pad, T_dec - 1], the distributions drawn from or None)."""
        return None, None

    def propose_after(self, ctx, tokens: torch.Tensor, n_out: torch.Tensor) -> torch.Tensor:
        """On the device, after verification (tokens [R_pad, W] and n_out [R_pad] emitted): the next
        step's drafts [R_pad, K] of every row."""
        raise NotImplementedError

    def after_step(self, ctx) -> None:
        """Host bookkeeping once the step's forwards are issued."""

    def on_accept(self, seq: Sequence, old_len: int, accepted: int, n_drafts: int) -> None:
        """After verification: `seq` had length old_len and `accepted` of its n_drafts drafts were kept."""

    def feeds_on_device(self, seq: Sequence) -> bool:
        """Async scheduling: whether the next row of `seq`, whose last step is still on the device, can take its
        drafter inputs there (the host does not know that step's tokens yet)."""
        return True


class NoDrafter(Drafter):
    """method: none — plain decoding through the same engine."""
