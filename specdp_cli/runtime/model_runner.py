"""One model (target or drafter) with its KV cache: the forwards of a step.

Two kinds of forward, both over a flat token list:
- **uniform** (`uniform(R, T)`): R rows of T tokens each — every decode forward. Its inputs live
  in persistent buffers that the caller fills on the device (`ids`, `start`, `n_real`, and the
  engine's shared block table); positions, cache slots and padding are derived from them on the
  device. On CUDA each (R, T) replays a CUDA graph captured at start-up; the key is a padded row
  count and a token count per row, never a sequence length (attention reads lengths from the
  positions and block tables). Row r's tokens sit at positions start[r] + t; tokens t >= n_real[r]
  are padding (they write to the trash block and their outputs are ignored).
- **mixed** (`mixed(batch)`): decode rows and prompt chunks together, described on the host;
  always eager (prefill steps are few).
Logits come back for every token of a uniform forward (`logits_of="all"`: the target verifies
each draft) or for each row's last real token (`"last"`: a drafter proposes one token per row).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .kv_cache import TRASH_BLOCK
from .ops import AttnMeta, mixed_tiles


def capture_sizes(max_rows: int) -> list[int]:
    """Padded row counts with a graph each: 1, 2, 4, 8, then steps of 8, 16 and 32 (vLLM-like), up to
    the first size that holds max_rows."""
    sizes, s = [], 1
    while True:
        sizes.append(s)
        if s >= max_rows:
            return sizes
        s = s * 2 if s < 8 else s + (8 if s < 32 else 16 if s < 128 else 32)


def pad_rows(n: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= n:
            return s
    return n


@dataclass
class MixedRow:
    blocks: list[int]
    start: int                 # position of tokens[0]
    tokens: list[int]          # ids (placeholders where the device fills drafts); padded tail past n_real
    n_real: int
    logits: str = "none"       # which tokens' logits come back: none | last (real token) | all (padding too)


@dataclass
class MixedBatch:
    rows: list[MixedRow] = field(default_factory=list)
    n_pad: int = 0             # total tokens, padding included (lockstep: agreed between ranks)
    fill: tuple | None = None  # (R, T, K, drafts [>=R, >=K]): rows 0..R-1 hold T tokens, tokens 1..K from drafts

    @property
    def n_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


class ModelRunner:
    def __init__(self, model, device: torch.device, block_table: torch.Tensor, block_size: int,
                 max_rows: int, t_values: list[int], logits_of: str):
        self.model = model
        self.device = device
        self.block_table = block_table            # [rows, max_blocks] int32, shared with the other runner
        self.block_size = block_size
        self.t_values = sorted(set(t_values))
        self.logits_of = logits_of
        T = max(self.t_values)
        self.ids = torch.zeros(max_rows * T, dtype=torch.long, device=device)
        self.start = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.n_real = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._t = torch.arange(T, device=device)
        self._rows = torch.arange(max_rows, device=device)
        out_rows = max_rows * (T if logits_of == "all" else 1)
        self.logits_out = torch.zeros((out_rows, model.vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    # -- uniform forwards -------------------------------------------------------------------------

    def uniform(self, R: int, T: int) -> torch.Tensor:
        """Logits of the uniform forward over the first R rows of the buffers ([R*T or R, V])."""
        g = self.graphs.get((R, T))
        if g is not None:
            g.replay()
            n = R * T if self.logits_of == "all" else R
            return self.logits_out[:n]
        return self._uniform_forward(R, T)

    def _uniform_forward(self, R: int, T: int) -> torch.Tensor:
        BS = self.block_size
        start = self.start[:R].clamp(min=0).view(R, 1)
        n_real = self.n_real[:R].view(R, 1)
        last = (n_real - 1).clamp(min=0)
        t = self._t[:T].view(1, T)
        pos = start + torch.minimum(t, last)                                   # padding repeats the last position
        bt = self.block_table[:R]
        blk = bt.gather(1, (pos // BS).clamp(max=bt.shape[1] - 1)).long()
        slots = torch.where(t < n_real, blk * BS + pos % BS, TRASH_BLOCK * BS)
        meta = AttnMeta(pos.view(-1), slots.view(-1), bt, uniform_t=T)
        hidden = self.model.forward(self.ids[:R * T], meta)
        if self.logits_of == "last":
            hidden = hidden[self._rows[:R] * T + last.view(R)]
        n = hidden.shape[0]
        self.logits_out[:n].copy_(self.model.logits(hidden))
        return self.logits_out[:n]

    def capture(self, row_sizes: list[int]) -> int:
        """Capture a CUDA graph per (padded rows, T), largest first, in one memory pool. Each key is
        run once eagerly first (kernel compilation, library workspaces). Returns the graph count."""
        pool = torch.cuda.graph_pool_handle()
        for T in self.t_values:
            for R in sorted(row_sizes, reverse=True):
                self._uniform_forward(R, T)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._uniform_forward(R, T)
                self.graphs[(R, T)] = g
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    # -- mixed forwards -------------------------------------------------------------------------------

    def mixed(self, batch: MixedBatch) -> torch.Tensor:
        """Eager forward of a mixed batch; the logits its rows ask for, in row order ([n, V])."""
        BS = self.block_size
        n = batch.n_tokens
        N = max(batch.n_pad, n, 1)
        ids = np.zeros(N, np.int64)
        pos = np.zeros(N, np.int64)
        slots = np.full(N, TRASH_BLOCK * BS, np.int64)
        nb = self.block_table.shape[1]
        bt = np.zeros((max(len(batch.rows), 1), nb), np.int32)
        keep, row_start, row_len = [], [], []
        o = 0
        for r, row in enumerate(batch.rows):
            m = len(row.tokens)
            ids[o:o + m] = row.tokens
            p = row.start + np.minimum(np.arange(m), max(row.n_real - 1, 0))
            pos[o:o + m] = p
            blocks = np.asarray(row.blocks, np.int64)
            real = p[:row.n_real]
            slots[o:o + row.n_real] = blocks[real // BS] * BS + real % BS
            bt[r, :len(row.blocks)] = row.blocks
            if row.logits == "last":
                keep.append(o + row.n_real - 1)
            elif row.logits == "all":
                keep.extend(range(o, o + m))
            row_start.append(o)
            row_len.append(m)
            o += m
        dev = self.device
        packed = torch.from_numpy(np.concatenate([ids, pos, slots, np.asarray(keep, np.int64)])).to(dev, non_blocking=True)
        ids_t, pos_t, slots_t, keep_t = torch.split(packed, [N, N, N, len(keep)])
        if batch.fill is not None:
            R, T, K, drafts = batch.fill
            if R and K:
                ids_t[:R * T].view(R, T)[:, 1:K + 1] = drafts[:R, :K]
        bt_t = torch.from_numpy(bt).to(dev, non_blocking=True)
        tiles = mixed_tiles(row_start, row_len, self.model.H // self.model.KV, dev) if dev.type == "cuda" else None
        meta = AttnMeta(pos_t, slots_t, bt_t, row_start=row_start, row_len=row_len, tiles=tiles)
        hidden = self.model.forward(ids_t, meta)
        return self.model.logits(hidden[keep_t]).float()
