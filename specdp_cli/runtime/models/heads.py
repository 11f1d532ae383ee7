"""What drafting heads share: a head reads the target's features of its tokens (EAGLE-1's, MTP's)."""
from __future__ import annotations

import torch

from .decoder import CausalLM


class TargetFeatureHead(CausalLM):
    """A head whose forward reads the features of its N tokens from `self.feats[:N]`: the target runner's
    last hidden states (after the target's final norm), which the drafter overwrites with the head's own
    output for forwards 2..k. Fixed inputs, so a CUDA graph of it replays."""
    needs_target_hidden = True          # the target runner keeps every token's last hidden state
    feats: torch.Tensor | None = None

    def attach(self, target_runner) -> None:
        """Read the features of forward 1 — the target's last hidden states — in place."""
        self.feats = target_runner.hidden

    def prepare_features(self, n: int) -> None:
        """Nothing to do: forward 1 reads the target's hidden states in place."""
