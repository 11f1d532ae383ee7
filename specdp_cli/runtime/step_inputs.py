"""The per-row integers of one step, staged in (pinned) host memory and sent to the device in one
copy, plus the block table both models read (a second copy). Everything else a step's forwards
need is derived from these on the device.

Row i is the step's i-th decode row; rows past the real ones, up to the padded count, are zeros
(padding rows: no real token, block table all trash).
"""
from __future__ import annotations

import torch

LAST, LEN, NDRAFT, DSTART, NCATCH, CATCH = 0, 1, 2, 3, 4, 5     # CATCH: two columns
DRAFTS = CATCH + 2                                              # k columns: drafts made on the host


class StepInputs:
    def __init__(self, max_rows: int, k: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        self.k = k
        cols = DRAFTS + max(k, 1)
        self.host = torch.zeros((max_rows, cols), dtype=torch.long, pin_memory=pin)
        self.dev = torch.zeros((max_rows, cols), dtype=torch.long, device=device)
        self.bt_host = torch.zeros((max_rows, max_blocks), dtype=torch.int32, pin_memory=pin)
        self.block_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)
        self._h = self.host.numpy()
        self._bt = self.bt_host.numpy()

    def stage(self, rows, drafts, R_pad: int) -> None:
        """rows: the step's decode rows (sequence, k_eff); drafts: their `Drafts` (counts, host drafts)."""
        h, bt = self._h, self._bt
        h[:R_pad] = 0
        bt[:R_pad] = 0
        for i, ((s, _), n) in enumerate(zip(rows, drafts.n)):
            L = s.L
            h[i, LAST] = s.tokens[-1]
            h[i, LEN] = L
            h[i, NDRAFT] = n
            if n:
                catch = s.tokens[s.draft_len:]
                h[i, DSTART] = s.draft_len
                h[i, NCATCH] = len(catch)
                if len(catch) <= 2:
                    h[i, CATCH:CATCH + len(catch)] = catch
            if drafts.host is not None and n:
                h[i, DRAFTS:DRAFTS + n] = drafts.host[i]
            bt[i, :len(s.blocks)] = s.blocks
        self.dev[:R_pad].copy_(self.host[:R_pad], non_blocking=True)
        self.block_table[:R_pad].copy_(self.bt_host[:R_pad], non_blocking=True)

    def col(self, c: int, R: int) -> torch.Tensor:
        return self.dev[:R, c]
