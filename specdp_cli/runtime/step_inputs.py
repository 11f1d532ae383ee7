"""The rows of one step, staged in (pinned) host memory and sent to the device in one copy, plus
the block table both models read (a second copy). Everything else a step's forwards need is
derived from these on the device, so the step's device work needs no host sync until its result.

A row (`RowSpec`) is one decode row (a sequence's last token and its drafts) or one piece of a
prompt chunk; rows past the real ones, up to the padded count, are zeros (padding rows: no real
token, block table all trash).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler import Sequence

# columns: target token ids [T_MAX], drafter token ids [T_MAX], then one integer each
START, NREAL, OUT, DSTART, DNREAL, DOUT, LEN, NDRAFT, FIRST, NEXT, SRC = range(11)
N_INTS = 11


@dataclass
class RowSpec:
    seq: Sequence
    start: int                    # position of tokens[0]
    tokens: list[int]             # target token ids (decode: the last token and any host-made drafts)
    n_real: int                   # real target tokens (decode: 1 + drafts, drafts may come from the device)
    out_start: int = 0            # first token of the verification window (a prompt's last row: its last token)
    first_pos: int = 0            # position of the first token this row may produce
    n_drafts: int = 0
    d_start: int = 0              # the drafter's first forward: its tokens and their first position
    d_tokens: tuple = ()
    done: bool = False            # a row ending a prompt: it draws the sequence's next token
    next_token: int = -1          # the token after a prompt row's last one: known (>= 0), drawn this step (-2);
                                  # -1 for a decode row (an EAGLE head's inputs are the tokens shifted by one)
    src: int = -1                 # async scheduling: the row of the step still on the device whose last emitted
                                  # token (and proposals) this row takes (the host does not know them yet); -1: none.
                                  # Staged as src + 1 in SRC, so padding rows (zeros) take nothing


class StepInputs:
    def __init__(self, max_rows: int, t_max: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"
        self.t_max = t_max
        self.tids, self.dids, self.ints = 0, t_max, 2 * t_max
        cols = 2 * t_max + N_INTS
        # two host buffers, used in turn: with async scheduling a step is staged while the copy of the one
        # before it may still wait on the device's queue (the one before that has finished: the engine has
        # read its results)
        self._hosts = [torch.zeros((max_rows, cols), dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._bt_hosts = [torch.zeros((max_rows, max_blocks), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._views = [(h.numpy(), bt.numpy()) for h, bt in zip(self._hosts, self._bt_hosts)]
        self._cur = 0
        self.dev = torch.zeros((max_rows, cols), dtype=torch.long, device=device)
        self.block_table = torch.zeros((max_rows, max_blocks), dtype=torch.int32, device=device)

    @property
    def host(self) -> torch.Tensor:
        return self._hosts[self._cur]

    @property
    def bt_host(self) -> torch.Tensor:
        return self._bt_hosts[self._cur]

    def stage(self, rows: list[RowSpec], R_pad: int) -> None:
        """Fill the first R_pad rows (one numpy assignment per field, not per row, but the block table
        row by row: a step's host time matters as much as its device time) and send them to the device."""
        self._cur ^= 1
        (h, bt), o, n = self._views[self._cur], self.ints, len(rows)
        h[:R_pad] = 0
        bt[:R_pad] = 0
        if n:
            width = max(max(len(r.tokens), len(r.d_tokens)) for r in rows)
            if width > self.t_max:
                raise RuntimeError(f"internal error: a row of {width} tokens is wider than a step's rows ({self.t_max})")
            h[:n, :width] = _padded([r.tokens for r in rows], width)
            d_width = max(len(r.d_tokens) for r in rows)
            if d_width:
                h[:n, self.dids:self.dids + d_width] = _padded([r.d_tokens for r in rows], d_width)
            h[:n, o:o + N_INTS] = [(r.start, r.n_real, r.out_start, r.d_start, len(r.d_tokens),
                                    max(len(r.d_tokens) - 1, 0), r.seq.L, r.n_drafts, r.first_pos, r.next_token,
                                    r.src + 1) for r in rows]
            for i, r in enumerate(rows):            # row by row: faster than one assignment of padded lists
                if r.seq.blocks:
                    row = _block_row(r.seq)
                    bt[i, :len(row)] = row
        self.send(R_pad)

    def send(self, R_pad: int) -> None:
        """The first R_pad staged rows and their block table to the device."""
        self.dev[:R_pad].copy_(self.host[:R_pad], non_blocking=True)
        self.block_table[:R_pad].copy_(self.bt_host[:R_pad], non_blocking=True)

    @property
    def width(self) -> int:
        """Integers a staged row takes with its block table (`staged`)."""
        return self.host.shape[1] + self.bt_host.shape[1]

    def staged(self, R: int) -> torch.Tensor:
        """The first R staged rows with their block table, one int64 [R, width] host tensor (what a TP leader
        sends its followers)."""
        return torch.cat([self.host[:R], self.bt_host[:R].long()], 1)

    def stage_received(self, block: torch.Tensor, R: int) -> None:
        """Stage R rows a TP leader sent (`staged`) and send them to the device, as `stage` does."""
        self._cur ^= 1
        c = self.host.shape[1]
        self.host[:R].copy_(block[:, :c])
        self.bt_host[:R].copy_(block[:, c:])
        self.send(R)

    def col(self, c: int, R: int) -> torch.Tensor:
        return self.dev[:R, self.ints + c]

    def target_ids(self, R: int, T: int) -> torch.Tensor:
        return self.dev[:R, self.tids:self.tids + T]

    def drafter_ids(self, R: int, T: int) -> torch.Tensor:
        return self.dev[:R, self.dids:self.dids + T]


def _block_row(seq: Sequence) -> np.ndarray:
    """The sequence's blocks as int32, converted again only when they change: a list of a long prompt's ~100
    blocks takes about 2 µs to convert, and a step stages every row's (40 rows with 1,500-token prompts: 195 against
    110 µs a step, `benchmarks/step_stage.py`). The blocks list is only ever replaced or extended, so its identity
    and length tell a change; the cache holds that list, so its identity cannot pass to another while it is cached."""
    blocks, cached = seq.blocks, seq.block_row
    if cached is None or cached[0] is not blocks or cached[1] != len(blocks):
        cached = seq.block_row = (blocks, len(blocks), np.array(blocks, dtype=np.int32))
    return cached[2]


def _padded(lists, width: int) -> list[list[int]]:
    return [list(x) + [0] * (width - len(x)) if len(x) < width else x for x in lists]
